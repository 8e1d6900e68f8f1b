"""SwiGLU experts on rows grouped by expert, forward and explicit backward.

Shapes (n rows, El experts here, H hidden, F expert intermediate): rows [n, H] grouped by
expert with ``counts`` [El] rows each (sum = n); gate_up [El, 2F, H] and down [El, H, F]
(transformers' layout: per-expert ``F.linear`` weights, gate rows first). Dtypes follow the
rows; weights must have the rows' dtype.

Forward (Mixtral/Qwen3-MoE/DeepSeek-V3 experts, Shazeer 2020 "GLU variants"):
    gu = rows @ gate_up[e]^T = [g | u];  a = silu(g) * u;  y = a @ down[e]^T
Backward, with s = sigmoid(g) and silu'(g) = s * (1 + g * (1 - s)):
    grad_a = grad_y @ down[e];                d down[e]    += grad_y^T a
    grad_g = grad_a * u * silu'(g);  grad_u = grad_a * silu(g)
    grad_gu = [grad_g | grad_u];              d gate_up[e] += grad_gu^T rows
    grad_rows = grad_gu @ gate_up[e]
Writing the backward out (instead of autograd through ``gate_up[e]``) accumulates the weight
gradients into one [El, ...] buffer: autograd's select backward would materialize a zero
tensor of the whole weight per expert.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphopt.kernels.moe.swiglu import swiglu, swiglu_backward


def _segments(counts: Tensor) -> list[tuple[int, int, int]]:
    """(expert, start, end) of every non-empty segment."""
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            out.append((e, start, start + n))
        start += n
    return out


GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def use_grouped_mm(x: Tensor, *others: Tensor) -> bool:
    """torch's grouped GEMM (``torch._grouped_mm``: one call for all experts) runs for these
    operands: float32/bf16/fp16 on CPU, bf16 on CUDA sm80+ (no float64 kernel anywhere) with
    16-byte aligned strides and data (its kernels' requirement); else one mm per expert."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in GROUPED_DTYPES or x.dim() != 2:
        return False
    if x.is_cuda and (x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)
                      < (8, 0)):
        return False  # CUDA kernels: bf16 on sm80+
    for t in (x, *others):
        size = t.element_size()
        # one unit stride (the contiguous dim), every other stride 16-byte aligned, size-1
        # dims included: torch._grouped_mm checks them all
        strides = sorted(t.stride())
        if t.data_ptr() % 16 or strides[0] != 1 or any(st * size % 16 for st in strides[1:]):
            return False
    return True


def grouped_mm(x: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
    """Rows of segment e times ``weight[e]``: x [n, K] (segments of ``counts`` rows),
    weight [El, K, N] -> [n, N]; one grouped GEMM where torch has one, else a loop."""
    if use_grouped_mm(x, weight) and weight.shape[2] * x.element_size() % 16 == 0:
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return torch._grouped_mm(x, weight, offs=offs)
    out = x.new_empty(x.shape[0], weight.shape[2])
    for e, s, t in _segments(counts):
        torch.mm(x[s:t], weight[e], out=out[s:t])
    return out


def empty_groups_unreliable(device: torch.device) -> bool:
    """Whether torch._grouped_mm's weight-gradient form (2d x 2d, offsets on K) may leave the
    blocks of empty groups (experts with no rows) non-zero: reported for Blackwell (sm100+:
    pytorch/pytorch#172439, non-zero gradients for zero-size groups; Hopper was correct
    there) and ROCm (pytorch/pytorch#174314, an uninitialized output)."""
    if device.type != "cuda":
        return False
    return bool(torch.version.hip) or torch.cuda.get_device_capability(device)[0] >= 10


def zero_empty_experts(out: Tensor, counts: Tensor) -> Tensor:
    """out [El, M, N] with the blocks of experts whose ``counts`` [El] is 0 set to 0 (a
    where, not a multiply: garbage may be NaN); no host synchronization."""
    return torch.where((counts == 0).view(-1, 1, 1), out.new_zeros(()), out)


def _weight_grad(grad: Tensor | None, a: Tensor, b: Tensor, counts: Tensor,
                 shape: tuple[int, ...]) -> Tensor:
    """grad[e] (+)= a_seg^T b_seg per segment: a [n, M], b [n, N] -> [El, M, N] (``shape``).
    ``grad`` None: a new tensor (on CUDA the grouped GEMM's own output, no zero fill). Grouped
    on CUDA; on CPU the per-expert addmm_ accumulates in place and measured faster."""
    if a.is_cuda and a.shape[0] and use_grouped_mm(a, b):
        offs = torch.cumsum(counts, 0).to(torch.int32)
        out = torch._grouped_mm(a.t(), b, offs=offs)
        if empty_groups_unreliable(out.device):
            out = zero_empty_experts(out, counts)
        return out if grad is None else grad.add_(out)
    if grad is None:
        grad = a.new_zeros(shape)
    for e, s, t in _segments(counts):
        grad[e].addmm_(a[s:t].t(), b[s:t])
    return grad


def swiglu_experts_forward(rows: Tensor, counts: Tensor, gate_up: Tensor,
                           down: Tensor) -> tuple[Tensor, Tensor]:
    """(gu [n, 2F], y [n, H]); experts with no rows cost nothing. The activation is
    graphopt.kernels.moe.swiglu's (one fused kernel on GPU/NPU)."""
    gu = grouped_mm(rows, gate_up.transpose(-2, -1), counts)
    y = grouped_mm(swiglu(gu), down.transpose(-2, -1), counts)
    return gu, y


def swiglu_experts_backward(rows: Tensor, gu: Tensor, counts: Tensor, gate_up: Tensor,
                            down: Tensor, grad_y: Tensor, grad_gate_up: Tensor | None = None,
                            grad_down: Tensor | None = None, weights: bool = True
                            ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(grad_rows [n, H], grad_gate_up [El, 2F, H], grad_down [El, H, F]): the weight
    gradients are added into the given buffers (in place) or returned as new tensors;
    ``weights=False`` (frozen experts) skips their two grouped GEMMs and returns the buffers
    as given. The activation's backward (and a, recomputed for the down weight gradient) is
    one graphopt.kernels.moe.swiglu pass."""
    grad_a = grouped_mm(grad_y, down, counts)
    grad_gu, a = swiglu_backward(gu, grad_a)
    if weights:
        grad_down = _weight_grad(grad_down, grad_y, a, counts, tuple(down.shape))
        grad_gate_up = _weight_grad(grad_gate_up, grad_gu, rows, counts,
                                    tuple(gate_up.shape))
    return grouped_mm(grad_gu, gate_up, counts), grad_gate_up, grad_down
