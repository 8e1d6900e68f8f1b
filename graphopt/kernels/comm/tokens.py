"""Split replicated token rows over a group and gather them back, with the gradients of
Megatron-LM's "scatter to / gather from the model-parallel region" (Shoeybi et al. 2019,
``mappings.py``): used where a layer's input is replicated over a group (TP without
sequence parallelism) but its work should not be (expert parallelism folded over TP ranks:
each token is dispatched once, by one rank of the group).

Vocabulary: ``x`` [T, ...] is identical on the ``size`` ranks of ``group``; rank r's *share*
is rows ``share_bounds(T, size)[r]`` (contiguous; the first T % size ranks get one more).

    scatter_rows(x)   forward: this rank's share;  backward: all-gather of the shares'
                      gradients (the replicated input's gradient is the whole one, on every
                      rank, as TP expects of a replicated activation).
    gather_rows(y)    forward: all-gather of the shares -> [T, ...];  backward: this rank's
                      share of the (replicated) output gradient.

For tensor-parallel experts (each rank of the group holds a slice of every expert's FFN
dim and computes a partial output for the same tokens)::

    copy_to_group(x)      forward: x;  backward: all-reduce (sum) of the partial gradients
    reduce_from_group(y)  forward: all-reduce (sum) of the partial outputs;  backward: the
                          replicated gradient itself

All are ``torch.library`` custom ops (opaque to Dynamo, autograd registered), so graphs
that contain them compile. Errors: RuntimeError when the group is not initialized or its
size is not ``size``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def share_bounds(rows: int, size: int) -> list[tuple[int, int]]:
    """[(start, end)] of each rank's contiguous share of ``rows`` rows. ``rows`` may be a
    SymInt (a dynamic token count under torch.compile: the fake kernels call this), so no
    ``divmod`` (SymInt has none) and no branch on it: rank r starts at
    r * (rows // size) + min(r, rows % size)."""
    base, extra = rows // size, rows % size
    return [(r * base + torch.sym_min(r, extra), (r + 1) * base + torch.sym_min(r + 1, extra))
            for r in range(size)]


def _group(name: str, size: int) -> dist.ProcessGroup:
    from graphopt.distributed import group_by_name

    return group_by_name(name, size, "graphopt's token ops (scatter_rows, gather_rows, "
                         "copy_to_group, reduce_from_group)")


@torch.library.custom_op("graphopt::scatter_rows", mutates_args=())
def scatter_rows(x: Tensor, group: str, size: int) -> Tensor:
    """This rank's share of ``x`` [T, ...] (module docstring)."""
    start, end = share_bounds(x.shape[0], size)[dist.get_rank(_group(group, size))]
    return x[start:end].clone()


@scatter_rows.register_fake
def _(x: Tensor, group: str, size: int) -> Tensor:
    start, end = share_bounds(x.shape[0], size)[dist.get_rank(_group(group, size))]
    return x.new_empty(end - start, *x.shape[1:])


@torch.library.custom_op("graphopt::gather_rows", mutates_args=())
def gather_rows(share: Tensor, group: str, size: int, rows: int) -> Tensor:
    """The ``rows`` rows whose shares the ranks hold, on every rank (module docstring)."""
    pg = _group(group, size)
    bounds = share_bounds(rows, size)
    width = bounds[0][1] - bounds[0][0]  # the largest share: pad to it (gloo needs equal sizes)
    padded = share.new_zeros(width, *share.shape[1:])
    padded[:share.shape[0]] = share
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded.contiguous(), group=pg)
    return torch.cat([p[:end - start] for p, (start, end) in zip(parts, bounds)])


@gather_rows.register_fake
def _(share: Tensor, group: str, size: int, rows: int) -> Tensor:
    return share.new_empty(rows, *share.shape[1:])


def _scatter_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.group, ctx.size, ctx.rows = inputs[1], inputs[2], inputs[0].shape[0]


def _scatter_backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
    return gather_rows(grad.contiguous(), ctx.group, ctx.size, ctx.rows), None, None


def _gather_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.group, ctx.size = inputs[1], inputs[2]


def _gather_backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
    return scatter_rows(grad.contiguous(), ctx.group, ctx.size), None, None, None


scatter_rows.register_autograd(_scatter_backward, setup_context=_scatter_setup)
gather_rows.register_autograd(_gather_backward, setup_context=_gather_setup)


# Tensor-parallel experts (graphopt.parallel.expert with expert_tp = tp): the experts' input
# is replicated over the TP group and each rank computes a partial output from its slice of
# the FFN dim; Megatron-LM's "copy to" / "reduce from the model-parallel region" mappings.


@torch.library.custom_op("graphopt::copy_to_group", mutates_args=())
def copy_to_group(x: Tensor, group: str, size: int) -> Tensor:
    """``x`` (replicated over ``group``) itself; backward: the sum over the group of the
    ranks' partial gradients."""
    _group(group, size)
    return x.clone()


@copy_to_group.register_fake
def _(x: Tensor, group: str, size: int) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("graphopt::reduce_from_group", mutates_args=())
def reduce_from_group(x: Tensor, group: str, size: int) -> Tensor:
    """The sum over ``group`` of the ranks' partial ``x``; backward: the (replicated)
    gradient itself."""
    out = x.contiguous().clone()
    dist.all_reduce(out, group=_group(group, size))
    return out


@reduce_from_group.register_fake
def _(x: Tensor, group: str, size: int) -> Tensor:
    return torch.empty_like(x)


def _group_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.group, ctx.size = inputs[1], inputs[2]


def _copy_backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
    return reduce_from_group(grad, ctx.group, ctx.size), None, None


def _reduce_backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
    return copy_to_group(grad, ctx.group, ctx.size), None, None


copy_to_group.register_autograd(_copy_backward, setup_context=_group_setup)
reduce_from_group.register_autograd(_reduce_backward, setup_context=_group_setup)
