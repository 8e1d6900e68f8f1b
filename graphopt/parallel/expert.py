"""Expert parallelism for a plan: each rank stores, computes and updates only its experts.

Contract: :func:`apply_ep` finds the model's routed-experts modules (transformers'
``*Experts``: parameters ``gate_up_proj`` [E, 2F, H] and ``down_proj`` [E, H, F], SwiGLU,
called as ``experts(hidden [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``),
replaces both parameters by this rank's ``E / ep`` experts (plain ``nn.Parameter``s, the
slice ``[r * E/ep, (r+1) * E/ep)`` for EP rank r) and the module's forward by
``graphopt::moe_experts`` over the plan's EP group (:func:`graphopt.parallel.mesh.
expert_mesh`): sorted dispatch, all-to-all to the experts' owners, grouped expert GEMMs,
all-to-all back, weighted combine (one of the four schedules of
:mod:`graphopt.kernels.comm.all_to_all`). Router, shared experts and everything else stay
as they are, so routing numerics are the model's own.

Tokens and gradients (every token is dispatched exactly once in the world):
- EP folds over dp_shard x cp x tp (Megatron-Core's MoE parallel folding). Ranks of one TP
  group hold the same tokens when the MoE block's input is replicated over TP (TP without
  SP, and with SP too: the replicated MoE block all-gathers its input), so with tp > 1 each
  TP rank dispatches its share of the rows (``graphopt::scatter_rows``) and the outputs are
  all-gathered back (``graphopt::gather_rows``; Megatron's scatter/gather region mappings).
- Tensor-parallel experts (``expert_tp`` = tp > 1; Megatron-Core's expert tensor
  parallelism with the ETP group = the TP group): EP folds over dp_shard x cp, and each TP
  rank keeps slice t of every local expert's FFN dim (gate and up rows
  ``[t*F/tp, (t+1)*F/tp)`` of ``gate_up_proj``'s two halves, the same columns of
  ``down_proj``). SwiGLU is elementwise over F, so each rank's experts give a partial
  output for all of the TP group's (identical) tokens: the input and routing weights enter
  through ``graphopt::copy_to_group`` (backward: the partial gradients summed over TP) and
  the combined output leaves through ``graphopt::reduce_from_group`` (forward: the sum
  over TP). No token is split over TP then; each is computed once per FFN slice.
- An expert's gradient on its owner is the sum over the tokens every DP rank routed to it;
  ranks holding the same experts (the ``edp`` group: dp_replicate x edp_shard) sum their
  gradients and divide by dp x cp, the dense parameters' average (CP ranks' losses carry
  a factor cp, see graphopt.parallel.context.cp_loss):
  with ZeRO-2/3 and edp_shard > 1 by FSDP2 (``fully_shard`` over edp_shard, HSDP with
  dp_replicate; ``set_gradient_divide_factor(dp)``; dim 0 when the local experts divide
  into the shards, else dim 1 as torchtitan does), otherwise by a gradient hook
  (all-reduce over edp, then / dp). Dense data parallelism ignores the expert parameters.

Refused by :func:`graphopt.parallelize` with ConfigError before anything changes: no
experts module, E not divisible by ep, F not divisible by expert_tp, expert_tp other than
1 or tp, expert layouts other than transformers' concatenated, untransposed, bias-free SwiGLU,
ZeRO-1 with ep > 1 (ZeroRedundancyOptimizer would broadcast one rank's experts over ranks
that hold others: use ZeRO-2/3 or 0).

Pseudo-code::

    emesh = expert_mesh(mesh, plan); r = emesh["ep"].local_rank
    for experts in model: keep rows r*E/ep .. (r+1)*E/ep of gate_up_proj, down_proj
        forward = gather_rows(moe_experts(scatter_rows(x, idx, w), local experts, ep group))
    with expert_tp = tp: also keep FFN slice t (TP rank) of each local expert, and
        forward = reduce_from_group(moe_experts(copy_to_group(x), idx,
                                                copy_to_group(w), local slices, ep group))
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from graphopt.distributed import all_reduce_host
from graphopt.errors import ConfigError
from graphopt.planner.plan import ParallelPlan


@dataclass
class EPState:
    """What an expert-parallel experts module's forward needs (set by :func:`apply_ep`)."""

    ep: int
    group: str
    ranks_per_node: int
    schedule: str
    chunks: int
    split_group: str
    split: int
    """TP degree whose ranks share the same tokens and split them (1: none)."""
    etp_group: str = ""
    etp: int = 1
    """Tensor-parallel experts: the TP group over which each expert's FFN dim is split."""


def find_experts(model: nn.Module) -> dict[str, nn.Module]:
    """Modules holding routed experts as 3-D ``gate_up_proj`` / ``down_proj`` parameters."""
    found = {}
    for path, module in model.named_modules():
        up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if isinstance(up, nn.Parameter) and isinstance(down, nn.Parameter) and \
                up.dim() == down.dim() == 3 and up.shape[0] == down.shape[0]:
            found[path] = module
    return found


def experts_fsdp_degree(plan: ParallelPlan) -> int:
    """The ranks FSDP shards the experts over: ``plan.edp_shard`` where ZeRO-2/3 shards the
    dense parameters (zero_stage >= 2 and dp_shard x cp > 1), else 1."""
    return plan.edp_shard if plan.zero_stage >= 2 and plan.dp_shard * plan.cp > 1 else 1


def check_expert_split(path: str, experts: int, ffn: int, hidden: int, ep: int,
                       expert_tp: int = 1, edp_shard: int = 1) -> None:
    """Raise ConfigError unless ``experts`` SwiGLU experts of FFN dim ``ffn`` and hidden
    size ``hidden`` split as the plan asks: E divisible by ep, F by expert_tp, and (with
    ``edp_shard`` > 1) a rank's [E/ep, 2F/expert_tp, H] and [E/ep, H, F/expert_tp] by
    :func:`fsdp_dim`. From a module (:func:`check_experts`) or a config (the planner's
    ``not_executable``)."""
    if experts % ep:
        raise ConfigError(f"{path}: {experts} experts are not divisible by ep={ep}: choose "
                          f"an ep that divides {experts}")
    if ffn % expert_tp:
        raise ConfigError(f"{path}: the experts' FFN dim ({ffn}) is not divisible by "
                          f"expert_tp={expert_tp}: use expert_tp=1, or a tp (= expert_tp) "
                          f"that divides {ffn}")
    if edp_shard > 1:
        local = experts // ep
        fsdp_dim({"gate_up_proj": (local, 2 * ffn // expert_tp, hidden),
                  "down_proj": (local, hidden, ffn // expert_tp)}, edp_shard)


def check_experts(path: str, module: Any, ep: int, expert_tp: int = 1,
                  edp_shard: int = 1) -> None:
    """Raise ConfigError unless ``module`` is SwiGLU experts in transformers' layout with
    E divisible by ep, the FFN dim F divisible by expert_tp, and (``edp_shard`` > 1: FSDP
    over the experts' data-parallel ranks) a rank's part splittable by :func:`fsdp_dim`."""
    check_expert_split(path, module.gate_up_proj.shape[0], module.down_proj.shape[-1],
                       module.down_proj.shape[1], ep, expert_tp, edp_shard)
    layout = {"has_gate": True, "is_concatenated": True, "is_transposed": False,
              "has_bias": False, "has_post_expert_norm": False}
    odd = {k: getattr(module, k) for k, v in layout.items() if getattr(module, k, v) != v}
    act = type(getattr(module, "act_fn", None)).__name__
    if odd or act not in ("SiLU", "SiLUActivation"):
        raise ConfigError(f"{path}: expert parallelism runs transformers' concatenated SwiGLU "
                          f"experts; this module has {odd or ''} activation {act}: use ep=1")


def group_ranks_per_node(ranks: list[int], local_world: int | None = None) -> int:
    """Ranks of one EP group (global ranks, in group order) that share a node, the inner
    level of the hierarchical and peer schedules: nodes hold $LOCAL_WORLD_SIZE consecutive
    global ranks (torchrun's placement); without it, one node. Groups whose ranks do not
    come in equal blocks per node count as 1 (every exchange priced as inter-node).
    A docs review: a plan's EP group was priced as one node whatever torchrun said.

    Args:
        ranks: the group's global ranks, in group order (``get_process_group_ranks``).
        local_world: ranks per node; None: $LOCAL_WORLD_SIZE, else ``len(ranks)``.
    Returns:
        ranks per node, a divisor of ``len(ranks)`` (the ``ranks_per_node`` of
        :class:`graphopt.passes.moe_options.MoEOptions`).
    Raises:
        ConfigError: $LOCAL_WORLD_SIZE is set to something other than an int >= 1.
    """
    import math

    from graphopt.passes.moe import local_world_size

    if local_world is None:
        local_world = local_world_size() or len(ranks)
    nodes = [r // local_world for r in ranks]
    block = next((i for i, n in enumerate(nodes) if n != nodes[0]), len(nodes))
    if len(nodes) % block or any(n != nodes[i - i % block] for i, n in enumerate(nodes)) \
            or len(set(nodes)) != len(nodes) // block:
        return 1
    return math.gcd(block, len(nodes))


def apply_ep(model: nn.Module, plan: ParallelPlan, mesh: Any, all_to_all: str = "flat",
             chunks: int = 1, ranks_per_node: int | None = None
             ) -> dict[str, tuple[int, int, int]]:
    """Shard the experts of ``model`` over the plan's EP groups (module docstring).

    Returns:
        {experts module path: (first expert, end, E)} held by this rank.
    Raises:
        ConfigError: see the module docstring.
    """
    import graphopt.kernels.comm.tokens  # noqa: F401  (registers the ops the forward calls)
    import graphopt.kernels.moe.op  # noqa: F401
    from graphopt.parallel.mesh import expert_mesh

    experts: dict[str, Any] = find_experts(model)  # parallelize checked them already
    emesh = expert_mesh(mesh, plan)
    rank = emesh["ep"].get_local_rank()
    rpn = ranks_per_node or group_ranks_per_node(
        dist.get_process_group_ranks(emesh["ep"].get_group()))
    if plan.ep % rpn:
        raise ConfigError(f"ranks_per_node ({rpn}) must divide ep ({plan.ep})")
    etp = plan.expert_tp
    tp_group = str(mesh["tp"].get_group().group_name) if plan.tp > 1 else ""
    split = plan.tp if etp == 1 else 1  # ETP: every TP rank computes all of its tokens
    state = EPState(plan.ep, str(emesh["ep"].get_group().group_name), rpn, all_to_all, chunks,
                    tp_group if split > 1 else "", split, tp_group if etp > 1 else "", etp)
    part = (mesh["tp"].get_local_rank(), etp)
    held = {}
    for path, module in experts.items():
        e = module.gate_up_proj.shape[0]
        per = e // plan.ep
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(module, name)
            local = nn.Parameter(
                held_part(name, full.detach(), (rank * per, (rank + 1) * per), part).clone(),
                requires_grad=full.requires_grad)
            setattr(module, name, local)
        module.graphopt_ep_held = {n: tuple(getattr(module, n).shape)  # type: ignore[assignment]
                                   for n in ("gate_up_proj", "down_proj")}
        module.graphopt_ep = state  # type: ignore[assignment]
        module.forward = types.MethodType(_ep_forward, module)  # type: ignore[method-assign]
        held[path] = (rank * per, (rank + 1) * per, e)
    return held


def held_part(name: str, full: torch.Tensor, experts: tuple[int, int],
              ffn: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """The part of an experts parameter ``full`` (``gate_up_proj`` [E, 2F, H] or
    ``down_proj`` [E, H, F]) a rank holds: experts ``experts`` = (start, end) on dim 0,
    and with ``ffn`` = (t, expert_tp) slice t of the FFN dim (``gate_up_proj``: rows
    [t*F/etp, (t+1)*F/etp) of its gate half and of its up half, concatenated as
    transformers concatenates them; ``down_proj``: those columns). A view where it can be."""
    out = full[experts[0]:experts[1]]
    t, etp = ffn
    if etp == 1:
        return out
    if name == "down_proj":
        f = out.shape[2] // etp
        return out[:, :, t * f:(t + 1) * f]
    gate, up = out.chunk(2, dim=1)
    f = gate.shape[1] // etp
    return torch.cat([gate[:, t * f:(t + 1) * f], up[:, t * f:(t + 1) * f]], dim=1)


def _ep_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts of this rank, expert-parallel (module docstring); shapes as the module's
    own forward: [T, H], [T, K], [T, K] -> [T, H]."""
    st: EPState = self.graphopt_ep  # type: ignore[assignment]
    ops = torch.ops.graphopt
    rows = hidden_states.shape[0]
    x, idx, w = hidden_states, top_k_index, top_k_weights
    up: torch.Tensor = self.gate_up_proj  # type: ignore[assignment]
    down: torch.Tensor = self.down_proj  # type: ignore[assignment]
    held: dict[str, tuple[int, ...]] = self.graphopt_ep_held  # type: ignore[assignment]
    if (tuple(up.shape), tuple(down.shape)) != (held["gate_up_proj"], held["down_proj"]):
        raise ConfigError(
            f"this rank's experts parameters have shapes {list(up.shape)} (gate_up_proj) and "
            f"{list(down.shape)} (down_proj) where graphopt.parallelize left this rank's "
            f"share, {list(held['gate_up_proj'])} and {list(held['down_proj'])}: they were "
            "set after parallelize (e.g. experts.gate_up_proj = nn.Parameter(all "
            "experts)). Load a one-process state dict before parallelize, or resume "
            "with dcp.load({'model': graphopt.parallel.ModelState(model)}, ...), which loads "
            "each rank's share (docs/parallel.md, Checkpoints)")
    dtype = torch.get_autocast_dtype(x.device.type) \
        if torch.is_autocast_enabled(x.device.type) else x.dtype
    if up.dtype != dtype:  # mixed precision: float32 master weights, bf16 compute (the
        # custom op is not autocast-aware; casts are differentiable, gradients float32)
        x, w, up, down = x.to(dtype), w.to(dtype), up.to(dtype), down.to(dtype)
    if st.split > 1:
        x, idx, w = (ops.scatter_rows(t, st.split_group, st.split) for t in (x, idx, w))
    if st.etp > 1:  # partial outputs from this rank's FFN slice (module docstring). The
        # routing weights' gradient is a sum of TP partials: taken in the wider of their
        # dtype and the tokens' (Mixtral's float32 weights in a float64 model: each partial
        # rounded to float32, the router's gradient was 1e-10 off, 6e-8 after 3 steps)
        w = w.to(torch.promote_types(w.dtype, x.dtype))
        x, w = (ops.copy_to_group(t, st.etp_group, st.etp) for t in (x, w))
    out = ops.moe_experts(x, idx, w, up, down, -1.0, st.ep, st.group,
                          st.schedule, st.chunks, st.ranks_per_node)[0]
    if st.split > 1:
        out = ops.gather_rows(out, st.split_group, st.split, rows)
    if st.etp > 1:
        out = ops.reduce_from_group(out, st.etp_group, st.etp)
    return out


def _shard_on(dim: int) -> Any:
    """FSDP2's ``shard_placement_fn``: every parameter sharded on ``dim``."""
    from torch.distributed.tensor import Shard

    return lambda _: Shard(dim)


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of the experts modules :func:`apply_ep` sharded (each rank's own
    experts), looked up on the modules each time: a parameter replaced later
    (``load_state_dict(assign=True)``) is found as well (a review: marked on the tensor,
    a replaced one lost the mark and was never reduced, 2.3e-3 off one process)."""
    return [getattr(m, n) for m in model.modules() if hasattr(m, "graphopt_ep")
            for n in ("gate_up_proj", "down_proj")]


def fsdp_dim(shapes: dict[str, tuple[int, ...]], edp_shard: int) -> int:
    """The dim FSDP2 splits this rank's experts tensors (``shapes``: gate_up_proj
    [E/ep, 2F/expert_tp, H], down_proj [E/ep, H, F/expert_tp]) on over ``edp_shard`` ranks:
    0 (the local experts) when edp_shard divides their count, else 1 (inside each expert).

    Raises:
        ConfigError: edp_shard divides neither (FSDP2 splits only dim 0 unevenly: torch
            raised NotImplementedError from inside parallelize, found by a review).
    """
    if shapes["gate_up_proj"][0] % edp_shard == 0:
        return 0
    uneven = [f"{n} {list(s)}" for n, s in shapes.items() if s[1] % edp_shard]
    if uneven:
        raise ConfigError(
            f"FSDP of the experts over edp_shard={edp_shard} (dp_shard*cp*tp / "
            f"(ep*expert_tp)) splits this rank's {shapes['gate_up_proj'][0]} expert(s) "
            f"inside, on dim 1, which {edp_shard} does not divide ({', '.join(uneven)}): use "
            "a plan whose edp_shard divides the local experts (E/ep) or those dims (a "
            "larger ep, or expert_tp = tp), or zero_stage=0")
    return 1


def reduce_expert_grads(model: nn.Module, plan: ParallelPlan, mesh: Any, fsdp: bool,
                        dtype: torch.dtype | None = None) -> str:
    """Make expert gradients the average over dp of the per-DP-rank gradients (module
    docstring): FSDP2 over edp_shard when ``fsdp`` (ZeRO-2/3) and edp_shard > 1, else a
    gradient hook. ``dtype``: mixed precision's compute dtype (FSDP2's param_dtype, with
    float32 reduction). Returns a note for the report."""
    from torch.distributed.fsdp import fully_shard

    from graphopt.parallel.apply import _mp_policy
    from graphopt.parallel.mesh import expert_mesh

    emesh = expert_mesh(mesh, plan)
    edp_shard = emesh["edp_shard"].size()
    dp = plan.dp * plan.cp  # the dense parameters' average runs over dp x cp (CP ranks'
    # losses carry a factor cp: graphopt.parallel.context.cp_loss)
    if fsdp and edp_shard > 1:
        fs_mesh = emesh["dp_replicate", "edp_shard"] if plan.dp_replicate > 1 \
            else emesh["edp_shard"]
        for module in find_experts(model).values():
            dim = fsdp_dim({n: tuple(getattr(module, n).shape)
                            for n in ("gate_up_proj", "down_proj")}, edp_shard)
            fully_shard(module, mesh=fs_mesh, reshard_after_forward=plan.zero_stage == 3,
                        shard_placement_fn=_shard_on(dim),
                        **_mp_policy(dtype))
            module.set_gradient_divide_factor(float(dp))  # type: ignore[operator]
            if dist.get_backend(fs_mesh.get_group(0)) == "gloo":  # no PREMUL_SUM in gloo:
                module.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
        return (f"experts: FSDP (ZeRO-{plan.zero_stage}) over edp_shard={edp_shard}"
                + (f" x dp_replicate={plan.dp_replicate}" if plan.dp_replicate > 1 else "")
                + f", gradients summed and divided by dp x cp={dp}")
    group = emesh["edp"].get_group() if emesh["edp"].size() > 1 else None
    if group is None and dp == 1:
        return "experts: no data-parallel copy (each EP rank's experts are unique)"

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        if group is not None:
            dist.all_reduce(grad, group=group)
        return grad.div_(dp) if dp > 1 else grad

    @torch.compiler.disable
    def register() -> None:
        """The hook on every expert parameter that requires grad now: frozen ones take none
        (torch refuses it), so experts unfrozen after parallelize get theirs before the
        next forward (a review: gradual unfreezing left them unreduced, 2x one process)."""
        for p in expert_params(model):
            if p.requires_grad and not getattr(p, "_graphopt_ep_hooked", False):
                p.register_hook(hook)
                p._graphopt_ep_hooked = True  # type: ignore[attr-defined]  # (on the
                # tensor: a set of ids could meet a new parameter at a freed one's id)

    from graphopt.parallel.apply import _before_each_forward

    register()
    _before_each_forward(model, register)
    return ("experts: gradients " + (f"summed over edp ({emesh['edp'].size()} ranks), "
                                      if group is not None else "")
            + f"divided by dp x cp={dp} (gradient hook)")


def choose_schedule_at_first_step(model: nn.Module, plan: ParallelPlan, opts: Any,
                                  notes: list[str]) -> None:
    """Resolve ``all_to_all``/``chunks`` "auto" with the cost model
    (:func:`graphopt.passes.moe.ep_schedule`) for the token count of the first forward:
    a forward pre-hook on ``model`` reads the tokens of ``input_ids``/``inputs_embeds`` (or
    the first tensor argument), takes the largest over the ranks (one all-reduce, so every
    rank picks the same schedule), sets every experts module's schedule, appends the
    choice to ``notes`` and removes itself. Until then (or if the first forward is traced
    by torch.compile) the schedule is "flat"."""
    from graphopt.passes.moe import ep_schedule

    experts: dict[str, Any] = find_experts(model)
    first = next(iter(experts.values()))
    state: EPState = first.graphopt_ep  # type: ignore[assignment]
    top_k = int(getattr(getattr(model, "config", None), "num_experts_per_tok", 0) or 0)
    if not top_k:
        notes.append("EP schedule: flat (the model's config has no num_experts_per_tok)")
        return

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling():
            return
        handle.remove()
        x = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if x is None:
            x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if x is None:
            return
        tokens = x.numel() if not x.is_floating_point() else x.shape[:-1].numel()
        count = all_reduce_host(torch.tensor([-(-tokens // state.split)], dtype=torch.int64),
                                dist.ReduceOp.MAX)
        hidden, ffn = int(first.down_proj.shape[1]), int(first.down_proj.shape[2])
        schedule, chunks, note = ep_schedule(int(count), top_k, hidden, ffn,
                                             first.down_proj.dtype, opts, state.ranks_per_node)
        for m in experts.values():
            m.graphopt_ep.schedule, m.graphopt_ep.chunks = schedule, chunks
        notes.append(f"{note} (at the first step: {int(count)} tokens per rank)")

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
