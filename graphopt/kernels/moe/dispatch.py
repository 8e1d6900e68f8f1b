"""Sorted dispatch + grouped expert GEMMs + combine, exact with respect to the per-expert loop
that transformers' eager MoE blocks run (``MixtralExperts.forward``).

Shapes (T tokens, K experts per token, E experts, H hidden, F expert intermediate):
    hidden [T, H]; top_k_index [T, K] (int64, values in [0, E)); top_k_weights [T, K];
    gate_up [E, 2F, H] and down [E, H, F] (per-expert ``F.linear`` weights, transformers'
    layout). Output [T, H] in hidden's dtype.

Algorithm (Megablocks, Gale et al. 2023, sec. 5; Megatron-Core's "alltoall" dispatcher):
    1. flatten the T*K (token, expert) assignments and sort them by expert with a stable
       sort, so copies of tokens bound for one expert are contiguous and keep token order;
       counts[e] = number of assignments to e (:func:`sort_by_expert`);
    2. gather the token rows in that order (one index_select);
    3. every expert's SwiGLU MLP on its segment (:mod:`graphopt.kernels.moe.experts`: one
       grouped GEMM per projection, or one matmul per non-empty segment; experts with zero
       tokens cost nothing);
    4. scale each row by its routing weight and scatter-add it back to its token
       (index_add: the combine).

Capacity (optional, ``capacity_factor``): expert e keeps at most
C = ceil(capacity_factor * T * K / E) assignments; dropped assignments contribute nothing, so a
token whose every assignment is dropped gets a zero output (the residual carries it). Which
ones are kept is the drop policy (Megatron-Core's ``moe_token_drop_policy``, same names):
    "position": the first C in (token, k) order (Switch Transformer's first-come rule: tokens
        earlier in the batch win; with K > 1 it differs from GShard's top-2 gating, which
        fills every first choice before any second one);
    "probs": the C with the largest routing weights (ties: the earlier (token, k) wins).
:func:`capacity_keep_mask` gives exactly which assignments are kept.
"""

from __future__ import annotations

import math
import numbers
from fractions import Fraction
from typing import Any

import torch
from torch import Tensor

from graphopt.kernels import refuse_forward_ad

DROP_POLICIES = ("position", "probs")


def expert_ids(top_k_index: Tensor, num_experts: int) -> Tensor:
    """``top_k_index`` flattened to int64 [T*K] after checking it on the host: an integer
    tensor (int64, int32, int16, uint8: routers differ) with values in [0, num_experts).

    Raises:
        ValueError: a floating or bool tensor, or an index outside [0, num_experts) (a
            gather would read another expert's rows, or fail without naming the cause).
    """
    if top_k_index.dtype.is_floating_point or top_k_index.dtype.is_complex or \
            top_k_index.dtype == torch.bool:
        raise ValueError(f"top_k_index must be an integer tensor, got {top_k_index.dtype}")
    flat = top_k_index.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise ValueError(f"top_k_index has values outside [0, {num_experts}): min "
                         f"{int(flat.min())}, max {int(flat.max())}")
    return flat.to(torch.int64)


def capacity_factor_value(capacity_factor: Any) -> float | None:
    """A capacity factor as the Python float the op and the ONNX export compute C from, or
    None (dropless).

    Takes a Python number, a NumPy scalar or a one-element tensor without gradient. A factor
    held in a narrower float (float32, float16, bfloat16) stands for the shortest decimal
    that rounds to it in that dtype (``np.float32(1.1)`` is 1.1, not 1.100000023841858, so
    C = 11 at T K / E = 10 as docs/moe.md says: a review got 12).

    Raises:
        ValueError: a bool, a non-number, a tensor with gradient or several elements, or a
            value that is not a finite number > 0.
    """
    if capacity_factor is None:
        return None
    value, dtype = capacity_factor, None
    if not isinstance(value, (bool, int, float)) and hasattr(value, "dtype"):
        try:  # a NumPy scalar or a tensor
            tensor = torch.as_tensor(value)
        except (TypeError, RuntimeError, ValueError):
            tensor = None
        if tensor is not None and tensor.requires_grad:
            raise ValueError(f"capacity_factor is a tensor that requires grad "
                             f"({capacity_factor!r}); pass a number or a detached tensor (the "
                             "capacity is not differentiable)")
        if tensor is not None and tensor.numel() == 1 and not tensor.dtype.is_complex and \
                tensor.dtype != torch.bool:
            try:  # a meta tensor has no value; float8 has no CPU comparison
                value, dtype = float(tensor.double().item()), tensor.dtype
            except (RuntimeError, NotImplementedError) as exc:
                raise ValueError(f"capacity_factor {capacity_factor!r} has no value to read "
                                 f"({type(exc).__name__}); pass a number") from None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
            not 0 < float(value) < math.inf:
        raise ValueError(f"capacity_factor must be a finite number > 0, or None (dropless), "
                         f"got {capacity_factor!r}")
    value = float(value)
    if dtype is not None and dtype.is_floating_point and dtype != torch.float64:
        for digits in range(1, 18):  # the shortest decimal the narrow dtype rounds to value
            decimal = float(f"{value:.{digits}g}")
            if torch.tensor(decimal, dtype=dtype).item() == value:
                return decimal
    return value


def sort_by_expert(top_k_index: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """(order [T*K], token [T*K], counts [E]): ``order`` sorts the flattened assignments by
    expert (stable: token order within an expert), ``token`` is the token row of each sorted
    assignment, ``counts`` the assignments per expert.

    Raises:
        ValueError: not an integer tensor, or an index outside [0, num_experts)
            (:func:`expert_ids`).
    """
    flat = expert_ids(top_k_index, num_experts)
    order, counts = sorted_counts(flat, num_experts)
    k = top_k_index.shape[-1] if top_k_index.dim() > 1 else 1
    return order, order // k, counts


def sorted_counts(flat: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """(order [n], counts [E] int64) of flat [n] expert indices already known to lie in
    [0, E): a stable sort and a histogram, both on the device. The histogram is a scatter_add:
    torch.bincount reads the maximum on the host (a CUDA synchronization)."""
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    return order, counts


def priority_order(flat: Tensor, weights: Tensor, num_experts: int, drop_policy: str
                   ) -> tuple[Tensor, Tensor]:
    """(order [n], counts [E]) like :func:`sorted_counts`, with each expert's assignments in
    the drop policy's priority (module docstring): "position" keeps (token, k) order;
    "probs" puts the largest routing weights ``weights`` [n] first (Megatron-Core's "probs"
    policy), ties in (token, k) order: a stable sort by weight, descending, then a stable
    sort by expert. Both stay on the device.

    Raises:
        ValueError: an unknown drop policy.
    """
    if drop_policy == "position":
        return sorted_counts(flat, num_experts)
    if drop_policy != "probs":
        raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")
    by_weight = torch.argsort(weights.reshape(-1), descending=True, stable=True)
    order, counts = sorted_counts(flat[by_weight], num_experts)
    return by_weight[order], counts


def capacity_partition(flat: Tensor, order: Tensor, counts: Tensor, capacity: int
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """(order' [n], kept [E], keep [n] bool in ``order``'s positions) for an expert capacity
    C: the first C sorted assignments of each expert are kept (``order`` sorts each expert's
    assignments by the drop policy's priority, :func:`priority_order`).
    ``order'`` is a stable partition of ``order``: the kept assignments first (still grouped
    by expert), the dropped ones after them, so rows past ``kept.sum()`` are the dropped ones.
    O(n) with cumsums and one scatter, no second sort and nothing read on the host: the
    number kept stays a device tensor."""
    n = order.numel()
    position = torch.arange(n, device=order.device)
    starts = torch.cumsum(counts, 0) - counts
    keep = position - starts[flat[order]] < capacity
    kept = counts.clamp(max=capacity)
    kept_before = torch.cumsum(keep, 0) - keep.long()  # exclusive
    target = torch.where(keep, kept_before, kept.sum() + position - kept_before)
    return torch.empty_like(order).scatter_(0, target, order), kept, keep


def capacity_fraction(capacity_factor: float) -> Fraction:
    """The capacity factor as the rational number it stands for: its shortest decimal (repr)
    as a fraction (1.1 -> 11/10, 0.5000001 -> 5000001/10**7, 1e-7 -> 1/10**7), or the
    simplest fraction with a denominator <= 10**6 whose float is the factor (0.3333333333333333
    -> 1/3), so C is computed exactly for the factor as written and the same way everywhere
    (the op, the ONNX export) instead of from a float product (1.1 * 50 / 5 =
    11.000000000000002 would keep a 12th assignment)."""
    value = capacity_factor_value(capacity_factor)  # np.float32(1.1) stands for 1.1
    exact = Fraction(repr(value))
    near = exact.limit_denominator(10**6)
    # only a fraction the float stands for: 0.5000001 is not 1/2 (a review found C = 5
    # where ceil(0.5000001 * 10) = 6)
    return near if near and float(near) == value else exact


def expert_capacity(capacity_factor: float, assignments: int, num_experts: int) -> int:
    """C = ceil(capacity_factor * T * K / E) in exact arithmetic (:func:`capacity_fraction`),
    at most T * K (a factor >= E keeps everything; no overflow for a huge one)."""
    factor = capacity_factor_value(capacity_factor)
    if factor is None or factor >= num_experts:  # (None: dropless)
        return assignments
    return min(math.ceil(capacity_fraction(factor) * assignments / num_experts), assignments)


def capacity_keep_mask(top_k_index: Tensor, num_experts: int, capacity_factor: float,
                       top_k_weights: Tensor | None = None, drop_policy: str = "position"
                       ) -> Tensor:
    """[T, K] bool: which assignments an expert capacity of
    C = ceil(capacity_factor * T * K / E) keeps under ``drop_policy`` (module docstring;
    "probs" needs ``top_k_weights`` [T, K]). The same validation as :func:`moe_experts`.

    Raises:
        ValueError: top_k_index not an integer [T, K] tensor or out of [0, num_experts), a
            capacity factor that is not a finite number > 0 (:func:`capacity_factor_value`),
            an unknown drop policy, or "probs" without weights of top_k_index's shape.
    """
    if top_k_index.dim() != 2:
        raise ValueError(f"top_k_index must be [T, K], got shape {tuple(top_k_index.shape)}")
    t, k = top_k_index.shape
    flat = expert_ids(top_k_index, num_experts)
    factor = capacity_factor_value(capacity_factor)
    if factor is None:
        raise ValueError("capacity_keep_mask needs a capacity_factor (None is dropless: "
                         "every assignment is kept)")
    if drop_policy == "probs" and (top_k_weights is None or
                                   top_k_weights.shape != top_k_index.shape):
        raise ValueError(f"drop_policy 'probs' ranks assignments by top_k_weights: pass them "
                         f"shaped as top_k_index {tuple(top_k_index.shape)}, got "
                         f"{None if top_k_weights is None else tuple(top_k_weights.shape)}")
    capacity = expert_capacity(factor, t * k, num_experts)
    weights = top_k_weights if top_k_weights is not None else flat
    order, counts = priority_order(flat, weights, num_experts, drop_policy)
    keep_sorted = capacity_partition(flat, order, counts, capacity)[2]
    keep = torch.zeros(t * k, dtype=torch.bool, device=top_k_index.device)
    keep[order] = keep_sorted
    return keep.view(t, k)


def moe_experts(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: Tensor,
                down: Tensor, capacity_factor: float | None = None,
                drop_policy: str = "position") -> Tensor:
    """SwiGLU experts with sorted dispatch on one device (the module docstring gives shapes
    and rules): ``graphopt::moe_experts`` with ep=1, differentiable.

    Raises:
        ValueError: shape mismatches (named), indices out of range, capacity_factor <= 0,
            an unknown drop_policy.
        NotImplementedError: forward-mode AD tangents on the inputs.
    """
    refuse_forward_ad("graphopt's moe_experts", hidden, top_k_weights, gate_up, down)
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H], got shape {tuple(hidden.shape)}")
    t, h = hidden.shape
    e = gate_up.shape[0]
    if top_k_index.shape != top_k_weights.shape or top_k_index.shape[0] != t:
        raise ValueError(f"top_k_index {tuple(top_k_index.shape)} and top_k_weights "
                         f"{tuple(top_k_weights.shape)} must both be [T={t}, K]")
    if gate_up.dim() != 3 or gate_up.shape[2] != h or gate_up.shape[1] % 2 or \
            down.shape != (e, h, gate_up.shape[1] // 2):
        raise ValueError(f"gate_up must be [E, 2F, H={h}] (gate and up rows stacked: an even "
                         f"row count) and down [E, H, F]; got {tuple(gate_up.shape)} and "
                         f"{tuple(down.shape)}")
    if top_k_index.dim() != 2 or top_k_index.dtype.is_floating_point or \
            top_k_index.dtype == torch.bool:
        raise ValueError(f"top_k_index must be an integer [T, K] tensor, got "
                         f"{top_k_index.dtype} of shape {tuple(top_k_index.shape)}")
    if not top_k_weights.dtype.is_floating_point:
        raise ValueError(f"top_k_weights must be floating point, got {top_k_weights.dtype}")
    if not hidden.dtype.is_floating_point:  # failed inside silu (a review)
        raise ValueError(f"hidden must be floating point, got {hidden.dtype}")
    if gate_up.dtype != hidden.dtype or down.dtype != hidden.dtype:
        raise ValueError(f"gate_up ({gate_up.dtype}) and down ({down.dtype}) must have "
                         f"hidden's dtype ({hidden.dtype})")
    capacity_factor = capacity_factor_value(capacity_factor)
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")
    from graphopt.kernels import functorch_active, functorch_unwrapped

    # under vmap (batched routing) every batch entry's indices at once: a batched tensor
    # has no .item() and _assert_async no batching rule
    flat = functorch_unwrapped(top_k_index).reshape(-1)
    if flat.is_cuda or torch.compiler.is_compiling():
        # checked on the device (no host synchronization on the hot path) or, in a graph
        # torch.compile traces, by an assert in the graph (no data-dependent guard)
        torch._assert_async(((flat >= 0) & (flat < e)).all(),
                            f"graphopt moe_experts: top_k_index has values outside [0, {e})")
    elif flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= e):
        raise ValueError(f"top_k_index has values outside [0, {e}): min {int(flat.min())}, "
                         f"max {int(flat.max())}")
    from graphopt.kernels.moe.op import MOE_FUNCTORCH, moe_experts_op

    # torch.func.grad / vjp / jacrev / vmap take an autograd.Function (pytorch#168393)
    op = MOE_FUNCTORCH.apply if functorch_active() else moe_experts_op
    # int64 indices for the op (int32 / int16 / uint8 routers work too)
    return op(hidden, top_k_index.to(torch.int64), top_k_weights, gate_up, down,
              float(capacity_factor or -1.0), 1, "", "flat", 1, 1, drop_policy)[0]
