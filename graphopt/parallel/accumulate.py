"""Gradient accumulation at pp = 1, with the data-parallel reductions the planner prices.

    for mb in graphopt.parallel.microbatches(model, local):   # plan.microbatch sequences each
        (model(input_ids=mb, labels=mb).loss * len(mb) / len(local)).backward()
    opt.step(); opt.zero_grad()

A plain loop over ``local.split(plan.microbatch)`` is correct too, but every backward then
reduces the gradients over the data-parallel ranks: m all-reduces per step for replicas
where one suffices. :func:`microbatches` switches each engine's reduction per microbatch as
:func:`graphopt.planner.perf.evaluate` prices it (``perf._dp_sync``), the way Megatron-LM and
torchtitan accumulate:

- replicas (dp without dp_shard FSDP: DDP for ZeRO-0/1, FSDP2 ``replicate`` with TP): one
  all-reduce per step, in the last microbatch's backward (DDP ``no_sync`` semantics through
  ``set_requires_gradient_sync``); replicas hold full gradients anyway, so accumulating them
  locally costs no memory.
- FSDP (ZeRO-2/3): a reduce-scatter in every microbatch's backward, so gradients stay sharded
  as the plan's memory prediction assumes (FSDP2 without gradient sync would hold the
  unsharded gradients, and under ZeRO-3 the gathered parameters, until the last microbatch:
  torch's FSDP2 docs; torchtitan makes the same choice). HSDP all-reduces the accumulated
  shards across dp_replicate once, in the last microbatch (``set_requires_all_reduce``).
- experts whose gradients graphopt.parallel.expert reduces by a hook (no FSDP over the
  experts): every microbatch (the hook reduces each backward's gradient, which stays exact
  for any gradient already accumulated).

Pipeline parallelism (pp > 1) does this itself: ``PipelinedModel.step`` takes the whole
local batch.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn

from graphopt.errors import ConfigError


def _dp_engines(model: nn.Module) -> tuple[list[Any], list[Any]]:
    """(modules whose whole reduction can wait for the last microbatch: composable DDP and
    FSDP2 replicate; FSDP2 fully_shard modules, whose all-reduce across replicas can)."""
    from torch.distributed._composable.replicate import DDP
    from torch.distributed._composable.replicate_with_fsdp import ReplicateModule
    from torch.distributed.fsdp import FSDPModule

    replicas, sharded = [], []
    for module in model.modules():
        if isinstance(module, (DDP, ReplicateModule)):
            replicas.append(module)
        elif isinstance(module, FSDPModule):
            sharded.append(module)
    return replicas, sharded


def _set_sync(replicas: list[Any], sharded: list[Any], sync: bool) -> None:
    from torch.distributed._composable.replicate import DDP

    for module in replicas:
        if isinstance(module, DDP):
            module.set_requires_gradient_sync(sync)
        else:
            module.set_requires_gradient_sync(sync, recurse=False)
    for module in sharded:
        module.set_requires_all_reduce(sync, recurse=False)


def _discard_pending(replicas: list[Any], sharded: list[Any]) -> None:
    """After a loop left early: drop what FSDP2 holds for the reduction that did not run
    (HSDP's partial all-reduce output, FSDP2 replicate's unsharded gradients), which
    ``zero_grad`` does not reach (a review: the next step's gradients were 1.8-2.8% off).
    FSDP2's own recovery (``reset_iter_state`` on each root) plus the unsharded gradients it
    leaves."""
    from torch.distributed.fsdp import FSDPModule

    fsdp = [m for m in replicas + sharded if isinstance(m, FSDPModule)]
    inner = {id(sub) for m in fsdp for sub in cast(nn.Module, m).modules() if sub is not m}
    for module in fsdp:
        if id(module) not in inner:  # a root
            module.reset_iter_state()
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for param in group.fsdp_params:
                param.unsharded_accumulated_grad = None
                unsharded = getattr(param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None


_OPEN: dict[int, Any] = {}
"""id(model) -> weak reference to the microbatches() generator last started on it: a
generator held in a variable and left with break keeps its sync setting until it closes,
which the next microbatches() on the model does."""


def microbatches(model: nn.Module, *tensors: torch.Tensor,
                 size: int | None = None) -> Iterator[Any]:
    """Split this data-parallel rank's batch into microbatches and set, before each one's
    forward, whether its backward reduces gradients over the data-parallel ranks (module
    docstring): every reduction a replica needs runs in the last microbatch's backward,
    FSDP's reduce-scatters in each.

    A loop left early (``break``, an exception) is a step whose reductions did not all run:
    when the generator closes (at once for ``for mb in microbatches(...)``; a generator held
    in a variable closes when ``.close()`` is called, when it is garbage-collected, or when
    the next ``microbatches`` on this model starts) every engine reduces again, FSDP2's
    pending reduction state is discarded (``reset_iter_state``), and a warning says to zero
    the gradients and run the step again (as after torch's ``no_sync``: the gradients of
    the microbatches that ran are this rank's own).

    Args:
        model: the result of :func:`graphopt.parallelize` (pp = 1), or any module (then
            nothing is switched, the batch is only split).
        tensors: [B, ...] tensors of any dtype (int64 input_ids, labels, float
            embeddings, ...), split together along dim 0 into views; CP's chunks from
            :func:`graphopt.parallel.context.shard_sequence` stay marked as such.
        size: sequences per microbatch; default the plan's ``microbatch``.
    Yields:
        the microbatches in order: one tensor [size, ...] (the last may be smaller, as
        ``torch.split``), or a tuple when several tensors were given.
    Raises:
        ConfigError: no tensor, tensors of different batch sizes, size < 1 (or no size and
            no plan), a PipelinedModel (its ``step`` microbatches itself), or, with FSDP or
            expert parallelism, ranks that would run different numbers of microbatches
            (raised on every rank: their per-microbatch collectives would wait forever).
    Warns:
        when this rank's batch is smaller than the plan's microbatch, when a loop is left
        early, and when a loop that recorded autograd ends with no backward through the
        last microbatch's outputs (that backward runs the replicas' reduction; the next
        ``microbatches`` on the model then discards FSDP2's pending reduction).
    Source: Megatron-LM's ``forward_backward_no_pipelining`` (every microbatch but the last
    under the DDP's ``no_sync``), torchtitan's FSDP accumulation (reduce-scatter every
    microbatch), torch's FSDP2 ``set_requires_gradient_sync`` / ``set_requires_all_reduce``
    and ``reset_iter_state`` (early exit).
    """
    from graphopt.parallel.context import SHARDED

    report = getattr(model, "graphopt_parallel", None)
    plan = getattr(report, "parallel_plan", None)
    if getattr(model, "parts", None) is not None:
        raise ConfigError("microbatches() is for pp = 1: a PipelinedModel splits the batch "
                          "itself; call model.step(input_ids) with the whole local batch")
    from_plan = size is None
    if size is None:
        if plan is None:
            raise ConfigError("microbatches() needs size= for a model graphopt.parallelize "
                              "did not shard (it reads the plan's microbatch otherwise)")
        size = plan.microbatch
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigError(f"microbatch size must be an int >= 1, got {size!r}")
    if not tensors or any(not isinstance(t, torch.Tensor) or t.dim() == 0 for t in tensors):
        raise ConfigError("microbatches() takes one or more [B, ...] tensors to split "
                          "along dim 0")
    batch = tensors[0].shape[0]
    if any(t.shape[0] != batch for t in tensors):
        raise ConfigError("microbatches(): the tensors' batch sizes differ: "
                          f"{[t.shape[0] for t in tensors]}")
    if from_plan and 0 < batch < size:
        warnings.warn(f"graphopt.parallel.microbatches: this rank's batch has {batch} "
                      f"sequences, fewer than the plan's microbatch of {size}: it runs as one "
                      "microbatch of those (the plan's prediction assumed full microbatches)",
                      stacklevel=2)
    return _run(model, tensors, size, SHARDED)


def _run(model: nn.Module, tensors: tuple[torch.Tensor, ...], size: int,
         sharded_tag: str) -> Iterator[Any]:
    previous = _OPEN.pop(id(model), None)
    if previous is not None and previous() is not None:
        previous().close()
    unsynced = _LAST_BACKWARD.pop(id(model), None)
    splits = [t.split(size) for t in tensors]
    for t, parts in zip(tensors, splits):
        if getattr(t, sharded_tag, False):  # CP's chunk: its same-tokens check is skipped
            for part in parts:  # (the tag names the layout it was cut for)
                setattr(part, sharded_tag, getattr(t, sharded_tag))
    replicas, sharded = _dp_engines(model)
    if unsynced is not None and not unsynced.ran:  # the last step's sync backward never
        _discard_pending(replicas, sharded)  # ran: FSDP2 still holds its partial reduction
    report = getattr(model, "graphopt_parallel", None)
    from graphopt.parallel.batch_norm import synced_batch_norms

    # (a review: DDP with BatchNorm's whole-batch statistics, 3 and 5 rows in microbatches
    # of 2: gloo aborted on mismatched all-reduces)
    if sharded or getattr(report, "experts", None) or (
            model.training and synced_batch_norms(model)):
        _same_count_everywhere(len(splits[0]), len(tensors[0]), size)
    generator = _generate(model, list(zip(*splits)), len(tensors), replicas, sharded)
    if replicas or sharded:
        _OPEN[id(model)] = weakref.ref(generator)
    return generator


def _same_count_everywhere(count: int, batch: int, size: int) -> None:
    """Raise ConfigError on every rank unless every rank runs ``count`` microbatches: FSDP's
    gathers and reduce-scatters and expert parallelism's all-to-alls run per microbatch, so
    a rank with fewer left the others waiting forever (a review: 7 sequences over 4 FSDP
    ranks, microbatch 1). One all-reduce; the pipeline's step checks the same."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    from graphopt.distributed import all_reduce_host

    counts = all_reduce_host(torch.tensor([count, -count], dtype=torch.int64),
                             dist.ReduceOp.MAX)
    most, fewest = int(counts[0]), -int(counts[1])
    if most != fewest:
        raise ConfigError(
            f"graphopt.parallel.microbatches: the ranks would run {fewest} to {most} "
            f"microbatches (this rank: {batch} sequences in microbatches of {size}); FSDP's, "
            "expert parallelism's and whole-batch BatchNorm's collectives run per "
            "microbatch, so the ranks would "
            "wait for each other forever: give every data-parallel rank the same number of "
            "sequences (drop_last=True, or pad the last batch)")


class _BackwardSeen:
    """A forward hook on the model for one loop: whether any forward recorded autograd
    (``trained``; a loop of ``torch.no_grad()`` evaluations needs no backward) and whether
    a backward reached an output of a forward of the last microbatch (``ran``; a tensor
    hook on each output that requires grad). Every forward of the last microbatch is
    watched: a ``torch.no_grad()`` forward of it first (reference log-probabilities) has
    no such output (watching only the first forward warned there, a re-review)."""

    def __init__(self, model: nn.Module) -> None:
        self.ran = self.trained = self.last = False
        self.handle = model.register_forward_hook(self._watch)

    def _watch(self, module: nn.Module, args: Any, output: Any) -> None:
        for leaf in torch.utils._pytree.tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                self.trained = True
                if self.last:
                    leaf.register_hook(self._seen)

    def _seen(self, grad: torch.Tensor) -> None:
        self.ran = True


_LAST_BACKWARD: dict[int, _BackwardSeen] = {}


def _generate(model: nn.Module, parts: list[tuple[torch.Tensor, ...]], count: int,
              replicas: list[Any], sharded: list[Any]) -> Iterator[Any]:
    done = 0
    seen = _BackwardSeen(model) if replicas or sharded else None
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            _set_sync(replicas, sharded, last)
            if seen is not None:
                seen.last = last
            yield part[0] if count == 1 else part
            done = i + 1
    finally:
        _set_sync(replicas, sharded, True)
        if seen is not None:
            seen.handle.remove()
        if done == len(parts) and seen is not None and seen.trained and not seen.ran:
            # (a review: skipping the last microbatch's backward, replicas' parameters
            # differed by 0.02 after the step; under HSDP the next step's norm was 2.3x)
            _LAST_BACKWARD[id(model)] = seen
            warnings.warn(
                "graphopt.parallel.microbatches: no backward has reached the last "
                "microbatch's outputs by the end of the loop, and that backward runs this "
                "step's data-parallel reductions: without it the gradients are this rank's "
                "own and the replicas diverge at the optimizer step. Run every "
                "microbatch's backward inside the loop (to skip a microbatch's loss, "
                "backward it times zero: loss.nan_to_num() * 0)", stacklevel=2)
        if done < len(parts) and (replicas or sharded):
            _discard_pending(replicas, sharded)
            warnings.warn(
                f"graphopt.parallel.microbatches: the loop ended after {done} of "
                f"{len(parts)} microbatches, so the data-parallel reductions of this step "
                "may not all have run (the gradients of the microbatches that ran unsynced "
                "are this rank's own; FSDP's pending reductions were discarded): zero the "
                "gradients (optimizer.zero_grad()) and run the step again",
                stacklevel=2)
