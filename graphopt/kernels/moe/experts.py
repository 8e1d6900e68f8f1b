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
import torch.nn.functional as F
from torch import Tensor


def _segments(counts: Tensor) -> list[tuple[int, int, int]]:
    """(expert, start, end) of every non-empty segment."""
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            out.append((e, start, start + n))
        start += n
    return out


def swiglu_experts_forward(rows: Tensor, counts: Tensor, gate_up: Tensor,
                           down: Tensor) -> tuple[Tensor, Tensor]:
    """(gu [n, 2F], y [n, H]); experts with no rows cost nothing."""
    n = rows.shape[0]
    gu = rows.new_empty(n, gate_up.shape[1])
    y = rows.new_empty(n, down.shape[1])
    for e, s, t in _segments(counts):
        torch.mm(rows[s:t], gate_up[e].t(), out=gu[s:t])
    g, u = gu.chunk(2, dim=-1)
    a = F.silu(g) * u
    for e, s, t in _segments(counts):
        torch.mm(a[s:t], down[e].t(), out=y[s:t])
    return gu, y


def swiglu_experts_backward(rows: Tensor, gu: Tensor, counts: Tensor, gate_up: Tensor,
                            down: Tensor, grad_y: Tensor, grad_gate_up: Tensor,
                            grad_down: Tensor) -> Tensor:
    """grad_rows [n, H]; adds the weight gradients into grad_gate_up [El, 2F, H] and
    grad_down [El, H, F] (in place)."""
    g, u = gu.chunk(2, dim=-1)
    silu = F.silu(g)
    a = silu * u
    grad_a = torch.empty_like(a)
    segments = _segments(counts)
    for e, s, t in segments:
        torch.mm(grad_y[s:t], down[e], out=grad_a[s:t])
        grad_down[e].addmm_(grad_y[s:t].t(), a[s:t])
    f = g.shape[1]
    grad_gu = torch.empty_like(gu)
    grad_gu[:, :f] = torch.ops.aten.silu_backward(grad_a * u, g)  # grad * silu'(g), fused
    torch.mul(grad_a, silu, out=grad_gu[:, f:])
    grad_rows = torch.empty_like(rows)
    for e, s, t in segments:
        grad_gate_up[e].addmm_(grad_gu[s:t].t(), rows[s:t])
        torch.mm(grad_gu[s:t], gate_up[e], out=grad_rows[s:t])
    return grad_rows
