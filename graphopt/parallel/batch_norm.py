"""BatchNorm under data parallelism: statistics of the whole data-parallel batch.

A ``BatchNorm1d/2d/3d`` in training normalizes by its input's batch statistics. Under DP (and
CP, which splits the sequence a BatchNorm over [N, C, L] also reduces over) each rank sees a
slice of the batch, so plain replicas normalize by their slice's statistics, update their
running statistics from it and drift apart (a review: gradients 1e-2 off one process, running
statistics 0.11 apart between the ranks, eval logits 0.04 apart; nothing said so).
:func:`sync_batch_norms` makes each such module compute the statistics of the whole DP x CP
batch, as ``torch.nn.SyncBatchNorm`` does (which runs on CUDA/XPU/HPU only): per channel,
the sum and the count are all-reduced (mean), then the sum of squared deviations from that
mean (biased variance, used to normalize; the running variance takes the unbiased one,
n / (n - 1)), each through the functional collective ``all_reduce``
(``torch.distributed._functional_collectives``: traceable by Dynamo), whose backward
all-reduces the gradient: every rank's loss reaches every rank's activations through the
statistics, as in one process. With DP's gradient averaging the step then equals one process
over the whole batch (float64: ~1e-15). An InstanceNorm normalizes each instance by its own
statistics (exact per rank); one with running statistics gets the whole batch's mean of its
instances' statistics (:class:`_GlobalInstanceStats`).

Source: Ioffe & Szegedy 2015 (batch normalization); torch.nn.SyncBatchNorm
(``torch/nn/modules/_functions.py``) for the distributed statistics and their backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def sync_batch_norms(model: nn.Module, group: Any) -> list[str]:
    """Make every BatchNorm of ``model`` (not SyncBatchNorm: it syncs itself) normalize by the
    statistics of the whole batch over ``group`` in training, and every InstanceNorm with
    running statistics update them from the whole batch. Eval mode with running
    statistics is unchanged (each rank holds the same running statistics).

    Args:
        model: the model (modules changed in place: an instance ``forward``).
        group: the process group the batch is split over (DP x CP).
    Returns:
        The module paths changed.
    """
    changed = []
    for path, module in model.named_modules():
        if "forward" in module.__dict__:
            continue
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and \
                not isinstance(module, nn.SyncBatchNorm):
            module.forward = _GlobalBatchNorm(module, group)  # type: ignore[method-assign,assignment]
            changed.append(path)
        elif isinstance(module, nn.modules.instancenorm._InstanceNorm) and \
                module.track_running_stats:
            module.forward = _GlobalInstanceStats(module, group)  # type: ignore[method-assign,assignment]
            changed.append(path)
    return changed


def synced_batch_norms(model: nn.Module) -> list[str]:
    """The module paths :func:`sync_batch_norms` changed in ``model``: each all-reduces in
    its training forward (and backward), so every rank must run as many of them."""
    return [path for path, m in model.named_modules()
            if isinstance(m.__dict__.get("forward"), (_GlobalBatchNorm, _GlobalInstanceStats))]


class _GlobalInstanceStats:
    """The instance ``forward`` of an InstanceNorm with running statistics: each instance
    is normalized by its own statistics (exact on every rank), and the running statistics
    take the mean over every rank's instances, as one process over the whole batch does
    (a review: left per rank, replicas 0.23 apart and eval outputs 1e-2 apart). torch's
    ``instance_norm`` updates them with the batch mean of the instances' means and
    unbiased variances (``momentum=None`` there: no update)."""

    def __init__(self, module: nn.modules.instancenorm._InstanceNorm, group: Any) -> None:
        self.module, self.group = module, group.group_name

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, C, *] or [C, *] of any float dtype -> the normalized x (same shape)."""
        from torch.distributed._functional_collectives import all_reduce

        m = self.module
        if not (m.training and m.running_mean is not None and m.running_var is not None):
            return type(m).forward(m, x)
        m._check_input_dim(x)
        if x.dim() == m._get_no_batch_dim():
            return self(x.unsqueeze(0)).squeeze(0)
        y = nn.functional.instance_norm(x, None, None, m.weight, m.bias, True, 0.0, m.eps)
        with torch.no_grad():
            values = x.detach().to(torch.promote_types(x.dtype, torch.float32))
            dims = list(range(2, x.dim()))
            means, variances = values.mean(dims), values.var(dims, correction=1)
            count = torch.full((1,), means.shape[0], dtype=values.dtype, device=x.device)
            total = all_reduce(torch.cat([means.sum(0), variances.sum(0), count]), "sum",
                               self.group)
            channels = means.shape[1]
            factor = 0.0 if m.momentum is None else m.momentum
            n = total[-1]
            m.running_mean.mul_(1 - factor).add_(
                (total[:channels] / n).to(m.running_mean.dtype) * factor)
            m.running_var.mul_(1 - factor).add_(
                (total[channels:2 * channels] / n).to(m.running_var.dtype) * factor)
        return y


class _GlobalBatchNorm:
    """The instance ``forward`` of a BatchNorm: whole-batch statistics over ``group``."""

    def __init__(self, module: nn.modules.batchnorm._BatchNorm, group: Any) -> None:
        # the group's name, not the object: a copy or pickle of the module (an EMA copy of
        # a sub-network, a review) cannot hold a ProcessGroup; the functional collective
        # resolves the name
        self.module, self.group = module, group.group_name

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, C, *] of any float dtype -> the normalized x (same shape and dtype;
        statistics and the normalization computed in float32 at least)."""
        from torch.distributed._functional_collectives import all_reduce

        m = self.module
        if not (m.training or m.running_mean is None):  # running statistics: per rank alike
            return type(m).forward(m, x)
        m._check_input_dim(x)
        factor: float | torch.Tensor = 0.0 if m.momentum is None else m.momentum
        if m.training and m.track_running_stats and m.num_batches_tracked is not None:
            m.num_batches_tracked.add_(1)
            if m.momentum is None:  # cumulative moving average (a tensor: no host read)
                factor = 1.0 / m.num_batches_tracked.to(torch.float64)
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        out_dtype = x.dtype
        # statistics in float32 at least (bf16 sums and counts round: torch's kernels
        # accumulate in float32 too)
        x = x.to(torch.promote_types(x.dtype, torch.float32))
        count = torch.full((1,), x.numel() // max(x.shape[1], 1), dtype=x.dtype,
                           device=x.device)
        total = all_reduce(torch.cat([x.sum(dims), count]), "sum", self.group)
        n = total[-1]
        mean = total[:-1] / n
        centered = x - mean.reshape(shape)
        var = all_reduce((centered * centered).sum(dims), "sum", self.group) / n
        y = centered * torch.rsqrt(var + m.eps).reshape(shape)
        if m.weight is not None:
            y = y * m.weight.reshape(shape)
        if m.bias is not None:
            y = y + m.bias.reshape(shape)
        if m.training and m.running_mean is not None and m.running_var is not None:
            with torch.no_grad():
                unbiased = var * (n / (n - 1).clamp_min(1))  # (no host read of n)
                m.running_mean.mul_(1 - factor).add_(mean.to(m.running_mean.dtype) * factor)
                m.running_var.mul_(1 - factor).add_(unbiased.to(m.running_var.dtype) * factor)
        return y.to(out_dtype)
