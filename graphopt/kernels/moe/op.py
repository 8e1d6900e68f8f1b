"""``graphopt::moe_experts``: the MoE expert computation as one custom op (fake impl and
autograd), on one device or expert-parallel over a process group.

Inputs (T tokens, K experts per token, E experts, H hidden, F expert intermediate):
    hidden [T, H]; top_k_index [T, K] int64 in [0, E); top_k_weights [T, K] (any float
    dtype, e.g. float32 from a float32 router next to bf16 experts); gate_up [El, 2F, H] and
    down [El, H, F] in hidden's dtype (transformers' layout): this rank's El = E / ep local
    experts, experts r*El .. (r+1)*El - 1 on EP rank r (El = E with ep = 1). Output [T, H],
    hidden's dtype;
    the weighted sum over the K experts is accumulated in promote(hidden, weights) dtype, as
    transformers' grouped_mm experts do (float32 in the Triton combine, which never takes
    float64 hidden: see graphopt.kernels.moe.combine).

Algorithm (Megablocks sec. 5; Megatron-Core's alltoall token dispatcher):
    1. stable sort of the T*K assignments by expert; counts by a device histogram;
    2. capacity (optional): C = ceil(cf * T * K / E) assignments per expert are kept, chosen
       by ``drop_policy`` ("position": the first in (token, k) order, Switch's first-come
       rule; "probs": the largest routing weights, Megatron-Core's default; see
       dispatch.capacity_keep_mask and docs/moe.md), moved ahead
       of the dropped ones by a stable partition (cumsums, no second sort). On one device
       the number kept never leaves it: all T*K rows keep their static size and the grouped
       GEMMs stop at the last kept row;
    3. EP = 1: SwiGLU experts on the sorted rows (graphopt.kernels.moe.experts).
       EP = P > 1: expert e lives on EP rank e // (E / P); the per-rank counts [P, E] are
       all-gathered, then a :class:`~graphopt.kernels.comm.RoundTrip` (schedule flat,
       chunked, hierarchical or peer) sends each row to its expert's rank, runs the local
       experts there and returns the rows;
    4. combine: out[t] = sum_k w[t, k] * y[t, k] (graphopt.kernels.moe.combine: a fused
       Triton gather on GPU/NPU, index_add in sorted order elsewhere).
The backward runs the same round trip with the gradient rows (owner ranks compute the
expert backward and the weight gradients of their experts). With EP each rank passes only
its local experts and gets only their gradients: expert weights are sharded for real
(graphopt.parallel.expert stores each rank's share; the moe pass, when it runs EP on a model
whose modules hold every expert, slices the local ones out in the graph).

Outputs beyond ``out`` carry what the backward needs: the expert output rows (sorted,
unweighted), the gate/up activations, with EP the rows this rank received as an expert
owner (their number R is data-dependent: the fake impl gives it an unbacked size), the
received rows per round-trip piece, the counts and the sort. Everything the backward needs
is an output saved by autograd (AOTAutograd when compiled), so its lifetime is the autograd
graph's: a forward without backward, a checkpoint recomputation, ``retain_graph`` and
saved-tensor hooks (``save_on_cpu``) all work as for any op. (Megatron-Core's dispatcher
keeps this state on the dispatcher object between forward and backward; an earlier
version here kept it in a per-process stash, which leaked when a forward's backward never
ran.)

Errors (this op; :func:`graphopt.kernels.moe.moe_experts`, the public one-device wrapper,
validates shapes, indices and capacity_factor; this op takes a float, where <= 0 stands
for the public API's None, dropless): with EP,
ValueError on every rank when any rank's top_k_index leaves [0, E), and for chunks or
ranks_per_node < 1 or an unknown schedule; RuntimeError when the EP group is not
initialized.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from graphopt.kernels import refuse_double_backward, transformable
from graphopt.kernels.comm import RoundTrip, round_trip_keys
from graphopt.kernels.moe.combine import combine, combine_backward
from graphopt.kernels.moe.dispatch import (
    capacity_partition,
    expert_capacity,
    priority_order,
    sorted_counts,
)
from graphopt.kernels.moe.experts import swiglu_experts_backward, swiglu_experts_forward


def resolve_group(name: str, ep: int) -> dist.ProcessGroup | None:
    """The EP process group named ``name`` ("" with ep == 1: none).

    Raises:
        RuntimeError: torch.distributed is not initialized, or the group's size is not ep.
    """
    if ep == 1:
        return None
    from graphopt.distributed import group_by_name

    return group_by_name(name, ep, f"moe ep={ep}")


def _sort(top_k_index: Tensor, top_k_weights: Tensor, num_experts: int,
          capacity_factor: float, drop_policy: str) -> tuple[Tensor, Tensor, Tensor]:
    """(order [T*K], token [T*K], counts [E]): the assignments sorted by expert, with a
    capacity the kept ones (``drop_policy``) first and the dropped ones after them (counts:
    kept per expert). The counts and the number kept stay on the device (no host
    synchronization)."""
    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    if capacity_factor > 0:
        order, counts = priority_order(flat, top_k_weights, num_experts, drop_policy)
        capacity = expert_capacity(capacity_factor, flat.numel(), num_experts)
        order, counts, _ = capacity_partition(flat, order, counts, capacity)
    else:  # dropless: the order within an expert changes nothing
        order, counts = sorted_counts(flat, num_experts)
    return order, order // k, counts


def _rows(counts: Tensor, n: int, capacity_factor: float, pg: dist.ProcessGroup | None
          ) -> tuple[int, Tensor | None]:
    """(rows computed, kept [rows] bool or None) for this rank's kept ``counts`` [E] of n
    sorted assignments. Dropless: all n. With a capacity on one device: still all n, static,
    the first counts.sum() kept (a device mask; the grouped GEMMs stop at the last offset and
    the rows after it are never computed, as torchtitan's padded grouped_mm rows). Expert
    parallel: the kept count, read on the host (the all-to-all needs its split sizes there
    anyway)."""
    if capacity_factor <= 0:
        return n, None
    if pg is None:
        return n, torch.arange(n, device=counts.device) < counts.sum()
    return int(counts.sum()), None


_CHECKED_EXPERT_COUNTS: set[tuple[int, int]] = set()


def _check_expert_count(counts: Tensor, group: dist.ProcessGroup, ep: int) -> None:
    """Every EP rank of ``group`` must pass the same number of local experts (E / ep):
    checked once per (group, E) with one all-reduce, and every rank raises the same
    ValueError. Ranks with different counts reached the counts' all_gather with different
    sizes, and gloo aborted the process ("Received data size doesn't match", a review)."""
    key = (id(group), counts.numel())
    if key in _CHECKED_EXPERT_COUNTS:
        return
    local = counts.numel() // ep
    bounds = counts.new_tensor([local, -local])
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
    most, fewest = int(bounds[0]), -int(bounds[1])
    if most != fewest:
        raise ValueError(f"graphopt moe: EP ranks pass between {fewest} and {most} local "
                         f"experts (this rank {local}); every rank of the EP group must pass "
                         f"E / ep experts (gate_up [E / ep, 2F, H], down [E / ep, H, F])")
    _CHECKED_EXPERT_COUNTS.add(key)


def _gather_counts(counts: Tensor, group: dist.ProcessGroup | None, ep: int,
                   bad: Tensor | None = None) -> Tensor:
    """counts [E] of every EP rank -> [ep, E]. ``bad``: this rank's top_k_index had values
    outside [0, E); it travels with the counts (no extra collective) and every rank raises
    the same ValueError (one rank raising alone left the others waiting in this gather)."""
    if group is None:
        return counts.view(1, -1)
    _check_expert_count(counts, group, ep)
    flag = (bad if bad is not None else torch.zeros((), dtype=torch.bool)).to(counts)
    mine = torch.cat([counts, flag.view(1)]).contiguous()
    parts = [torch.empty_like(mine) for _ in range(ep)]
    dist.all_gather(parts, mine, group=group)
    gathered = torch.stack(parts)
    wrong = gathered[:, -1].nonzero().flatten().tolist()
    if wrong:
        raise ValueError(f"graphopt moe: top_k_index has values outside [0, {counts.numel()}) "
                         f"on EP rank(s) {wrong} (the router's indices must name one of the "
                         f"{counts.numel()} experts)")
    return gathered[:, :-1].contiguous()  # as the fake impl declares (Inductor checks)


def _pad_rows(x: Tensor, n: int) -> Tensor:
    """x [valid, W] -> [n, W] with zero rows after it (no copy when dropless)."""
    if x.shape[0] == n:
        return x
    out = x.new_zeros(n, x.shape[1])
    out[:x.shape[0]] = x
    return out


def _check_index_dtype(top_k_index: Tensor) -> None:
    """ValueError unless ``top_k_index`` is int64 (the op's contract; a direct call with
    int32 indices failed inside the sort with scatter's dtype error, a review)."""
    if top_k_index.dtype != torch.int64:
        raise ValueError(f"graphopt moe: top_k_index must be int64, got {top_k_index.dtype}: "
                         "call graphopt.kernels.moe.moe_experts (it casts) or pass "
                         "top_k_index.long()")


@torch.library.custom_op("graphopt::moe_experts", mutates_args=())
def moe_experts_op(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: Tensor,
                   down: Tensor, capacity_factor: float, ep: int, group: str, schedule: str,
                   chunks: int, ranks_per_node: int, drop_policy: str = "position"
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out [T, H], y_rows [T*K, H], gu [T*K, 2F] (ep = 1) or [R, 2F], owned [0, H] (ep = 1)
    or [R, H] (the R rows this rank's experts computed, in round-trip piece order),
    piece_rows [0] (ep = 1) or [pieces] int64 (rows of each piece in ``owned``), counts
    [ep, E], order [T*K] (the sort, reused by the backward)). With a capacity, y_rows and gu
    rows past the kept count are unspecified (on one device) or zero (expert parallel).
    Only ``out`` is differentiable: the other outputs are the backward's state (marked
    non-differentiable, so they are constants to autograd, as the integer ones are)."""
    _check_index_dtype(top_k_index)
    num_experts = gate_up.shape[0] * ep
    pg = resolve_group(group, ep)
    bad = None
    if pg is not None:  # sorted safely; every rank raises in _gather_counts
        bad = ((top_k_index < 0) | (top_k_index >= num_experts)).any()
        top_k_index = top_k_index.clamp(0, num_experts - 1)
    order, token, counts = _sort(top_k_index, top_k_weights, num_experts, capacity_factor,
                                 drop_policy)
    counts_all = _gather_counts(counts, pg, ep, bad)
    valid, kept = _rows(counts, order.numel(), capacity_factor, pg)
    rows = hidden.index_select(0, token[:valid])
    w1, w2 = gate_up, down
    saved: dict[Any, tuple[Tensor, Tensor]] = {}

    def forward(key: Any, x: Tensor, per_expert: Tensor) -> Tensor:
        gu, y = swiglu_experts_forward(x, per_expert, w1, w2)
        saved[key] = (x, gu)
        return y

    trip = RoundTrip(counts_all, pg, schedule, chunks, ranks_per_node)
    y_valid = trip(rows, forward, tag=0)
    y_rows = _pad_rows(y_valid, top_k_index.numel())
    if pg is None:
        gu_out = _pad_rows(saved[0][1], top_k_index.numel())
        owned = hidden.new_empty(0, hidden.shape[1])
        piece_rows = top_k_index.new_empty(0, dtype=torch.int64)
    else:
        keys = round_trip_keys(schedule, chunks, ep)
        assert sorted(saved) == keys, (sorted(saved), keys)
        owned, gu_out = (torch.cat([saved[k][i] for k in keys]) if len(keys) > 1
                         else saved[keys[0]][i] for i in (0, 1))  # fresh tensors: no copy
        piece_rows = torch.tensor([saved[k][0].shape[0] for k in keys], dtype=torch.int64,
                                  device=top_k_index.device)
    acc = torch.promote_types(hidden.dtype, top_k_weights.dtype)
    out = combine(y_valid, top_k_weights, order, hidden.dtype, acc, kept=kept)
    return out, y_rows, gu_out, owned, piece_rows, counts_all.to(torch.int64), order


def _received_rows() -> Any:
    """A new unbacked size for the rows this rank's experts receive (fake impl only).

    Dynamo's shape environment refuses data-dependent output sizes unless the user set
    ``torch._dynamo.config.capture_dynamic_output_shape_ops`` (a choice about user code such
    as ``nonzero``: graph break or not); the EP op inserted by graphopt (moe pass,
    ``graphopt.parallelize``'s experts) would then break the graph at every MoE layer. The
    setting is lifted for this one size only, and restored."""
    ctx = torch.library.get_ctx()
    env = getattr(ctx, "_shape_env", None)
    if env is None or env.allow_dynamic_output_shape_ops:
        return ctx.new_dynamic_size()
    settings = env.settings  # frozen; part of FakeTensor's dispatch cache key
    env.settings = dataclasses.replace(settings, allow_dynamic_output_shape_ops=True)
    try:
        return ctx.new_dynamic_size()
    finally:
        env.settings = settings


@moe_experts_op.register_fake
def _(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: Tensor,
      down: Tensor, capacity_factor: float, ep: int, group: str, schedule: str, chunks: int,
      ranks_per_node: int, drop_policy: str = "position"
      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    _check_index_dtype(top_k_index)
    # the EP layout's sizes are constants: specialized (a guard) where Dynamo traced them as
    # symbols (FSDP2-wrapped experts under dynamic=True: "chunks must be an int >= 1, got
    # s5", a review)
    ep, chunks = int(ep), int(chunks)
    n = top_k_index.numel()
    owned: Any = 0  # ep = 1: the backward gathers its rows from hidden again
    gu_rows: Any = n
    pieces = 0
    if ep > 1:  # the rows other ranks send here: data-dependent (an unbacked size)
        owned = gu_rows = _received_rows()
        pieces = len(round_trip_keys(schedule, chunks, ep))
    return (hidden.new_empty(hidden.shape), hidden.new_empty(n, hidden.shape[1]),
            hidden.new_empty(gu_rows, gate_up.shape[1]), hidden.new_empty(owned, hidden.shape[1]),
            top_k_index.new_empty(pieces, dtype=torch.int64),
            top_k_index.new_empty(ep, gate_up.shape[0] * ep, dtype=torch.int64),
            top_k_index.new_empty(n, dtype=torch.int64))


@torch.library.custom_op("graphopt::moe_experts_backward", mutates_args=())
def moe_experts_backward(grad_out: Tensor, hidden: Tensor, top_k_index: Tensor,
                         top_k_weights: Tensor, gate_up: Tensor, down: Tensor, y_rows: Tensor,
                         gu: Tensor, owned: Tensor, piece_rows: Tensor, counts_all: Tensor,
                         order: Tensor, capacity_factor: float, ep: int, group: str,
                         schedule: str, chunks: int, ranks_per_node: int,
                         weight_grads: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(grad hidden, grad top_k_weights, grad gate_up, grad down) of moe_experts' ``out``;
    ``order`` is the forward's sort (not sorted again). ``weight_grads=False`` (the experts
    are frozen: fine-tuning everything else) skips the two weight-gradient grouped GEMMs of
    every expert and returns empty [0] tensors for them."""
    pg = resolve_group(group, ep)
    token = order // top_k_index.shape[1]
    valid, kept = _rows(counts_all[dist.get_rank(pg) if pg is not None else 0], order.numel(),
                        capacity_factor, pg)
    acc = torch.promote_types(hidden.dtype, top_k_weights.dtype)
    grad_y, grad_weights = combine_backward(grad_out, y_rows[:valid], top_k_weights, order, acc,
                                            kept=kept)
    w1, w2 = gate_up, down
    local: dict[str, Tensor] = {}  # this rank's experts' weight gradients, accumulated
    if pg is None:
        saved = {0: (hidden.index_select(0, token[:valid]), gu[:valid])}
    else:
        keys = round_trip_keys(schedule, chunks, ep)
        sizes = piece_rows.tolist()
        saved = dict(zip(keys, zip(owned.split(sizes), gu.split(sizes))))

    def backward(key: Any, gy: Tensor, per_expert: Tensor) -> Tensor:
        x, gu_rows = saved[key]
        gx, up, dn = swiglu_experts_backward(x, gu_rows, per_expert, w1, w2, gy,
                                             local.get("up"), local.get("down"), weight_grads)
        if up is not None and dn is not None:
            local["up"], local["down"] = up, dn
        return gx

    trip = RoundTrip(counts_all, pg, schedule, chunks, ranks_per_node)
    grad_x = trip(grad_y, backward, tag=2)
    if not weight_grads:
        grad_gate_up, grad_down = gate_up.new_empty(0), down.new_empty(0)
    else:
        grad_gate_up = local["up"] if "up" in local else torch.zeros_like(gate_up)
        grad_down = local["down"] if "down" in local else torch.zeros_like(down)
    # grad_hidden[t] = sum_k grad_x[slot(t, k)]: the combine with unit weights (a gather per
    # token, fp32 accumulation, deterministic on the GPU; was index_add: bf16 atomics).
    # Rows past the last grouped-GEMM offset (never computed) are dropped rows: they add 0.
    ones = torch.ones(top_k_weights.shape, dtype=torch.float32, device=hidden.device)
    grad_hidden = combine(grad_x, ones, order, hidden.dtype,
                          torch.promote_types(hidden.dtype, torch.float32), kept=kept)
    # contiguous, as the fake implementation says (it said the inputs' strides: with a
    # transposed input Inductor read the gradients with the wrong strides, 1.3 off without
    # its size asserts, a review)
    return (grad_hidden.contiguous(),
            grad_weights.reshape(top_k_weights.shape).to(top_k_weights.dtype).contiguous(),
            grad_gate_up.contiguous(), grad_down.contiguous())


@moe_experts_backward.register_fake
def _(grad_out: Tensor, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
      gate_up: Tensor, down: Tensor, y_rows: Tensor, gu: Tensor, owned: Tensor,
      piece_rows: Tensor, counts_all: Tensor, order: Tensor, capacity_factor: float, ep: int,
      group: str, schedule: str, chunks: int, ranks_per_node: int, weight_grads: bool = True
      ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # contiguous whatever the inputs' strides, as the implementation returns them
    grads = (hidden.new_empty(hidden.shape), top_k_weights.new_empty(top_k_weights.shape))
    if not weight_grads:
        return (*grads, gate_up.new_empty(0), down.new_empty(0))
    return (*grads, gate_up.new_empty(gate_up.shape), down.new_empty(down.shape))


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    hidden, index, weights, gate_up, down = inputs[:5]
    ctx.options = inputs[5:11]
    ctx.save_for_backward(hidden, index, weights, gate_up, down, *output[1:])
    # Outputs 1..6 are what the backward needs, not results: no gradient flows into them
    # (requires_grad False, so using one in a loss cannot give a silently wrong gradient),
    # and autograd does not materialize zero gradients for them (it filled y_rows
    # [T*K, H] and gu [T*K, 2F] with zeros in every backward).
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, grad_out: Tensor, *unused: Any) -> tuple[Any, ...]:
    hidden, index, weights, gate_up, down, *saved = ctx.saved_tensors
    need = ctx.needs_input_grad
    experts = bool(need[3] or need[4])  # frozen experts: no weight-gradient GEMMs
    if grad_out is None:  # out did not reach the loss (set_materialize_grads(False))
        grad_out = torch.zeros_like(hidden)
    grads = moe_experts_backward(grad_out.contiguous(), hidden, index, weights, gate_up, down,
                                 *saved, *ctx.options, experts)
    return (grads[0], None, grads[1], grads[2] if need[3] else None,
            grads[3] if need[4] else None) + (None,) * 7


moe_experts_op.register_autograd(_backward, setup_context=_setup_context)
refuse_double_backward(moe_experts_backward, "graphopt::moe_experts",
                       "keep transformers' experts for that term (options without 'moe')")
MOE_FUNCTORCH = transformable("graphopt::moe_experts", moe_experts_op, _setup_context,
                              _backward)
"""The op under torch.func transforms (graphopt.kernels.transformable)."""
