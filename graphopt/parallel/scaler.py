"""Loss scaling (fp16 mixed precision) for parallelized models.

Contract: :class:`GradScaler` is ``torch.amp.GradScaler`` for a model returned by
:func:`graphopt.parallelize`: every rank skips the same steps and keeps the same scale,
those of one process training on the global batch. torch's scaler checks only this rank's
gradients for inf/NaN, which under graphopt's plans are part of the model's: a pipeline
stage's layers, an EP rank's experts, a TP or FSDP shard. An overflow on one rank then
skips the step there only and the scales drift apart (a review, one rank's inf injected:
pp=2 stages 1.4e-2 and 4.4e-3 off one process, their scales 1024 and 4096 after the step;
dp_shard=2 x tp=2 without SP 5.5e-3 between the TP ranks, as DTensor's own inf check
reduces over the first gradient's mesh only). A mix of DTensor and plain gradients (EP
experts outside FSDP, TP without SP) also failed in torch's foreach check ("got mixed
torch.Tensor and DTensor"), with torch's ``ShardedGradScaler`` too.

Here the check runs on each gradient's local tensor (a DTensor's shard or partial sum:
an inf in any part makes the whole tensor's inf) and the flag is summed over the process
group (the world by default: every rank of the model's mesh, PP stages included), once per
``unscale_`` (or per ``step`` of an optimizer that unscales itself, ``fused=True``), so
every rank calls ``unscale_`` (or ``step``) for each of its optimizers in the same order,
as for any collective. Under PP, pass the scaler to
``PipelinedModel.step(..., scaler=scaler)``, which scales each microbatch's loss inside
the schedule (``scaler.scale(loss).backward()`` has no loss to scale there).

Source: ``torch.amp.GradScaler`` (Micikevicius et al., "Mixed Precision Training", ICLR
2018: dynamic loss scaling) and the world-wide inf reduction of torch's
``ShardedGradScaler`` (FSDP), Megatron-LM's ``DynamicGradScaler`` (found_inf all-reduced
over the model-parallel group).

Pseudo-code::

    unscale_(optimizer):
        for grad in optimizer's gradients: local = grad.to_local() if DTensor else grad
        _amp_foreach_non_finite_check_and_unscale_(locals per device and dtype, flag, 1/scale)
        flag = all_reduce_sum(sum of this rank's per-device flags, group)
        every per-device flag (or one on the scale's device, for a rank without gradients)
            = min(flag, 1)
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist


def _local(grad: torch.Tensor) -> torch.Tensor:
    """A DTensor gradient's local tensor (its storage: in-place writes reach the DTensor),
    else the gradient."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if to_local is not None else grad


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose inf/NaN check covers the whole parallelized model
    (see the module docstring): the same arguments, and ``process_group`` (default: the
    world) over which the found-inf flag is summed.

    Shapes/dtypes: as torch's; gradients may be DTensors and plain tensors in one optimizer.
    Raises: as torch's (``ValueError`` for float16 gradients in ``unscale_``; call order
    errors as ``RuntimeError``).
    """

    def __init__(self, device: str = "cuda", *args: Any,
                 process_group: dist.ProcessGroup | None = None, **kwargs: Any) -> None:
        super().__init__(device, *args, **kwargs)
        self.process_group = process_group

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                        found_inf: torch.Tensor, allow_fp16: bool
                        ) -> dict[torch.device, torch.Tensor]:
        """torch's check and unscale, on each gradient's local tensor (sparse gradients:
        their coalesced values, as torch)."""
        flags: dict[torch.device, torch.Tensor] = {}
        inv: dict[torch.device, torch.Tensor] = {}
        grouped: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    if not allow_fp16 and param.grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    grad = param.grad
                    if grad.is_sparse:
                        if grad.dtype is torch.float16:
                            param.grad = grad = grad.coalesce()
                        grad = grad._values()
                    grad = _local(grad)
                    grouped[(grad.device, grad.dtype)].append(grad)
            for (device, _), grads in grouped.items():
                if device not in flags:
                    flags[device] = found_inf.to(device)
                    inv[device] = inv_scale.to(device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, flags[device],
                                                                 inv[device])
        return flags

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """torch's ``unscale_``, then the found-inf flag summed over ``process_group``."""
        if not self._enabled:
            return
        super().unscale_(optimizer)
        self._reduce_found_inf(optimizer)

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The check ``step`` runs instead of ``unscale_`` for an optimizer that unscales
        itself (``fused=True`` Adam/AdamW/SGD: a re-review found each rank deciding from
        its own gradients there, 1.7e-2 off one process), reduced the same way."""
        super()._check_inf_per_device(optimizer)
        self._reduce_found_inf(optimizer)
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    def _reduce_found_inf(self, optimizer: torch.optim.Optimizer) -> None:
        """Sum this rank's found-inf flags for ``optimizer`` over ``process_group`` (a
        collective: every rank calls it once per optimizer step) and write the result,
        clamped to 1, into each of them (into a new one on the scale's device where this
        rank has no gradient)."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        state = self._per_optimizer_states[id(optimizer)]
        flags: dict[torch.device, torch.Tensor] = state["found_inf_per_device"]
        assert self._scale is not None  # (set by scale(); the callers checked it)
        total = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        for flag in flags.values():
            total += flag.to(total.device)
        dist.all_reduce(total, group=self.process_group)
        total.clamp_(max=1.0)
        if not flags:  # no gradient on this rank: the others' flag still decides
            flags[total.device] = total
        for flag in flags.values():
            flag.copy_(total)
