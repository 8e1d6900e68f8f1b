"""Gradient clipping by the global norm for parallelized models.

Contract: :func:`clip_grad_norm_` is ``torch.nn.utils.clip_grad_norm_`` for a model returned
by :func:`graphopt.parallelize`: every rank gets the norm of the whole model's gradient (the
single-process norm of the same global batch) and scales its own gradients by the same
``max_norm / (norm + 1e-6)`` (clamped to 1), as torch does. torch's own function on such a
model sees only this rank's tensors: under PP each stage's norm (0.87 and 0.92 for a Llama
whose norm is 1.27), under EP each rank's experts (1.3381 vs 1.3376 on two DP replicas, so
their dense parameters were scaled differently and the replicas drifted apart), and a mix of
DTensor and plain gradients (TP without SP, EP with FSDP) raised.

Each gradient counts once:
- DTensor gradients (TP, FSDP2/HSDP, FSDP'd experts): the norm of the whole tensor over its
  mesh, from the local shards (``torch.nn.utils.get_total_norm`` of them, summed over the
  mesh dims that shard them: DTensor's own reduction raised a KeyError on FSDP2 x TP meshes
  with dp_shard inside tp; Partial gradients still go through DTensor).
- EP experts (``graphopt.parallel.expert``): each EP rank holds other experts, so their
  part is summed over the EP group, and with tensor-parallel experts over the etp (TP)
  group, whose ranks hold other FFN slices (replicas over edp hold equal gradients and are
  not summed).
- Plain gradients (DDP/replicate, replicated modules): equal on the ranks that hold them.
- PP: each stage's part is summed over the pipeline group; a tied embedding held by the
  first and the last stage counts once (the first stage's).

Source: the norm and clip coefficient of ``torch.nn.utils.clip_grad_norm_``; the per-axis
reductions follow torchtitan's ``clip_grad_norm_`` (non-DTensor EP and PP parts all-reduced)
and Megatron-LM's ``get_grad_norm_fp32`` (model-parallel all-reduce of the squared norm).

Pseudo-code::

    parts = [norm(DTensor grads of mesh m).full_tensor() for each mesh m]
            + [norm(plain dense grads)] ; experts = norm(plain expert grads)
    p-norm: s = sum(part^p) + all_reduce_sum(experts^p, ep); s = all_reduce_sum(s, pp)
    inf:    s = max(...), all-reduced with MAX
    total = s^(1/p); inf-norm: nan / inf if any rank's gradients hold one (a sum of flags:
    gloo's max reduction can drop a NaN)
    grads *= min(1, max_norm / (total + 1e-6))
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from graphopt.errors import ConfigError
from graphopt.parallel.apply import master_parameters


def _norm(grads: list[torch.Tensor], p: float) -> torch.Tensor:
    """The ``p``-norm of ``grads`` as a plain float64 scalar (0 for none)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    if not hasattr(grads[0], "device_mesh"):
        grads = [g for g in grads if g.numel()]  # (the inf-norm of an empty tensor raises)
        if not grads:
            return torch.zeros((), dtype=torch.float64)
    if hasattr(grads[0], "device_mesh") and not any(
            pl.is_partial() for g in grads for pl in g.placements):  # type: ignore[attr-defined]
        return _sharded_norm(grads, p)
    total = torch.nn.utils.get_total_norm(grads, norm_type=p)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    return total.detach().to(torch.float64).cpu()


def _sharded_norm(grads: list[Any], p: float) -> torch.Tensor:
    """The ``p``-norm of DTensor ``grads`` (one mesh, no Partial placement) from their
    local shards: per placement, the local norm (to the p) summed (inf: the max) over the
    mesh dims that shard it; Replicate dims hold copies and are not summed. DTensor's own
    reduction (torch.nn.utils.get_total_norm, then full_tensor) raised a KeyError ("Invalid
    mesh_dim_names ('dp_shard_cp', 'tp') ... ascending order") on FSDP2 x TP meshes whose
    dp_shard is inside tp in mesh_order (a review)."""
    mesh = grads[0].device_mesh
    groups: dict[tuple[Any, ...], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(tuple(g.placements), []).append(g.to_local())
    inf = p == float("inf")
    parts = []
    for placements, locals_ in groups.items():
        # a rank's empty shards (FSDP2 splits dim 0 unevenly: a [4, H] router over 3 ranks
        # is 2/2/0) hold nothing; the inf-norm of an empty tensor raised on that rank while
        # the others waited in the all-reduce (a review)
        locals_ = [t for t in locals_ if t.numel()]
        local = torch.nn.utils.get_total_norm(locals_, norm_type=p).detach() if locals_ \
            else torch.zeros((), dtype=torch.float64)
        value = local.to(torch.float64).cpu()  # (_all_reduce moves it where the group needs)
        value = value if inf else value.pow(p)
        for dim, placement in enumerate(placements):
            if not placement.is_replicate():  # Shard, _StridedShard (not a Shard in torch
                # 2.13: FSDP2's dim-0 split after TP's; summed, or the norm came out 1/sqrt(2))
                value = _all_reduce(value, mesh.get_group(dim), p)
        parts.append(value if inf else value.pow(1.0 / p))  # a norm, as _combine takes
    total = _combine(parts, p)
    return total if inf else total.pow(1.0 / p)


def _combine(parts: list[torch.Tensor], p: float) -> torch.Tensor:
    stacked = torch.stack(parts) if parts else torch.zeros(1, dtype=torch.float64)
    return stacked.max() if p == float("inf") else stacked.pow(p).sum()


def _all_reduce(value: torch.Tensor, group: Any, p: float) -> torch.Tensor:
    """``value`` (a host scalar) summed (inf: max) over ``group``, back on the host."""
    from graphopt.distributed import all_reduce_host

    return all_reduce_host(value, dist.ReduceOp.MAX if p == float("inf") else None, group)


def grad_norm(model: nn.Module, norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type``-norm of the whole model's gradient (module docstring), a float64
    scalar equal on every rank. Parameters without a gradient count as zero. Collective: every
    rank of the model's mesh calls it.

    Raises:
        ConfigError: ``model`` was not parallelized by graphopt; ``norm_type`` is not > 0.
    """
    report = getattr(model, "graphopt_parallel", None)
    if report is None or report.parallel_plan is None:
        raise ConfigError("graphopt.parallel.clip_grad_norm_ needs a model returned by "
                          "graphopt.parallelize or graphopt.compile(options={'parallel': ...}); "
                          "use torch.nn.utils.clip_grad_norm_ for a plain model")
    plan, mesh, p = report.parallel_plan, report.mesh, float(norm_type)
    if not p > 0:  # (0 was a ZeroDivisionError: a review)
        raise ConfigError(f"norm_type must be > 0 (float('inf') for the max norm), got "
                          f"{norm_type!r}")
    # ZeRO-2 after a forward without backward: the sharded parameters hold the gradients,
    # the gathered copies FSDP2 left in the module hold none (a review)
    masters = master_parameters(model)
    skip = _tied_copy(model)
    meshes: dict[tuple[Any, bool], list[torch.Tensor]] = {}
    plain: dict[bool, list[torch.Tensor]] = {False: [], True: []}
    names = getattr(model, "original_names", {})
    for name, param in model.named_parameters():
        if param is skip:
            continue
        param = masters.get(id(param), param)
        if param.grad is None:
            continue
        name = names.get(name, name).replace("_orig_mod.", "")
        expert = any(name.startswith(path + ".") for path in report.experts)  # FSDP2 made
        # new Parameter objects: the experts are known by name
        if hasattr(param.grad, "device_mesh"):
            meshes.setdefault((param.grad.device_mesh, expert), []).append(param.grad)
        else:
            plain[expert].append(param.grad)
    dense, experts = ([_norm(g, p) for (_, e), g in meshes.items() if e == expert]
                      + [_norm(plain[expert], p)] for expert in (False, True))
    local, mine = _combine(dense, p), _combine(experts, p)
    if plan.ep > 1:  # other EP ranks hold other experts
        from graphopt.parallel.mesh import expert_mesh

        emesh = expert_mesh(mesh, plan)
        mine = _all_reduce(mine, emesh["ep"].get_group(), p)
        if plan.expert_tp > 1:  # and other FFN slices of them
            mine = _all_reduce(mine, emesh["etp"].get_group(), p)
    local = torch.maximum(local, mine) if p == float("inf") else local + mine
    if plan.pp > 1:
        local = _all_reduce(local, mesh["pp"].get_group(), p)
    if p != float("inf"):  # sums carry a NaN or inf from any rank
        return local.pow(1.0 / p)
    # A max all-reduce over gloo dropped a NaN held by a rank other than rank 0 (a review:
    # the inf-norm came out finite on every rank and rank 1 stepped NaN into its weights),
    # so every rank's non-finite gradients are counted once more, with a sum over all ranks
    # (ZeRO-2's sharded parameters hold them: after an evaluation forward with gradients
    # enabled the module's gathered copies hold none, and a NaN went uncounted, a review;
    # summed on the device the group's backend takes, as the norms are)
    flags = torch.zeros(2, dtype=torch.float64)
    for param in model.parameters():
        param = masters.get(id(param), param)
        if param.grad is not None:
            g = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
            flags[0] += bool(torch.isnan(g).any())
            flags[1] += bool(torch.isinf(g).any())
    flags = _all_reduce(flags, None, 1.0)
    if flags[0]:
        return torch.full((), float("nan"), dtype=torch.float64)
    if flags[1]:
        return torch.full((), float("inf"), dtype=torch.float64)
    return local


def _tied_copy(model: nn.Module) -> Any:
    """Under PP, the last stage's copy of a tied embedding (the first stage counts it)."""
    tied = getattr(model, "tied", None)
    if tied is None or getattr(model, "is_first", True):
        return None
    return dict(model.named_parameters())[tied[0]]


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """Scale this rank's gradients of a parallelized ``model`` in place so that the whole
    model's gradient norm is at most ``max_norm`` (``torch.nn.utils.clip_grad_norm_``'s
    coefficient ``min(1, max_norm / (norm + 1e-6))``, the same on every rank). Collective.

    Args:
        model: a model returned by :func:`graphopt.parallelize` (a PipelinedModel too).
        max_norm: the largest allowed norm (same units as the gradients).
        norm_type: p of the p-norm; ``float("inf")`` for the max norm.
        error_if_nonfinite: raise if the norm is nan or inf (as torch's).
        foreach: as torch's (None: its default): scale the gradients with the foreach
            kernels (``torch._foreach_mul_``) or one by one; the result is the same.
    Returns:
        The norm before clipping (float64 scalar, equal on every rank).
    Raises:
        ConfigError: ``model`` was not parallelized by graphopt.
        RuntimeError: ``error_if_nonfinite`` and the norm is not finite.
    """
    total = grad_norm(model, norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                           f"{float(total)}: non-finite, so they cannot be clipped")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    masters = master_parameters(model)  # ZeRO-2: the sharded parameters hold the gradients
    for param in (masters.get(id(p), p) for p in model.parameters()):
        if param.grad is not None:
            g = param.grad
            local = g.to_local() if hasattr(g, "to_local") else g
            groups.setdefault((local.device, local.dtype), []).append(local)
    with torch.no_grad():
        for (device, dtype), grads in groups.items():
            scale = coef.to(device, dtype)
            if foreach or (foreach is None and device.type != "cpu"):
                torch._foreach_mul_(grads, scale)
            else:
                for local in grads:
                    local.mul_(scale)
    return total
