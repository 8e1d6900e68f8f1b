"""The SwiGLU activation of the MoE experts and its backward, fused: Triton on GPU/NPU, torch
elsewhere.

Shapes (n rows, F expert intermediate): gu [n, 2F] = [g | u] (the gate_up grouped GEMM's
output, gate columns first: transformers' layout); grad_a [n, F]; dtypes follow gu
(bf16/fp16/fp32), computed in float32.

Forward (Shazeer 2020, "GLU variants improve transformer", SwiGLU):
    a = silu(g) * u,  silu(g) = g * sigmoid(g)
Backward, with s = sigmoid(g) and silu'(g) = s * (1 + g * (1 - s)):
    grad_g = grad_a * u * silu'(g);  grad_u = grad_a * silu(g)
and, in the same pass, a again: the down projection's weight gradient needs it
(d down[e] += grad_y^T a) and the forward does not keep it (gu is what is saved).

Why fused: torch runs the forward as two kernels (silu, then the product: 5 [n, F]-sized
reads and writes) and the backward as five (silu recomputed, silu * u, grad_a * u,
silu_backward, grad_a * silu: 14); the kernels here read g, u (and grad_a) once and write
a (and grad_g, grad_u, a) once: 3 and 6. At Mixtral size (8192 rows, F 14336, bf16) that is
2.35 GB less memory traffic per forward+backward, ~0.6 ms on an H200 (docs/benchmarks.md,
"MoE vs transformers' grouped_mm: what is left to win"), and one rounding to the output
dtype instead of one per torch kernel.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from graphopt.kernels.lightning.triton_kernels import cdiv, next_power_of_2, triton_available
from graphopt.kernels.moe.combine import use_triton

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _swiglu(GU, A, f, BLOCK: tl.constexpr):
        """Row r, columns [c * BLOCK, (c + 1) * BLOCK) of a = silu(g) * u."""
        r, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
        cols = c * BLOCK + tl.arange(0, BLOCK)
        m = cols < f
        g = tl.load(GU + r * 2 * f + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(GU + r * 2 * f + f + cols, mask=m, other=0.0).to(tl.float32)
        a = g * tl.sigmoid(g) * u
        tl.store(A + r * f + cols, a.to(A.dtype.element_ty), mask=m)

    @triton.jit
    def _swiglu_backward(GU, GA, DGU, A, f, BLOCK: tl.constexpr):
        """Row r, columns [c * BLOCK, (c + 1) * BLOCK) of grad_g, grad_u (into DGU = [grad_g |
        grad_u]) and a (module docstring)."""
        r, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
        cols = c * BLOCK + tl.arange(0, BLOCK)
        m = cols < f
        g = tl.load(GU + r * 2 * f + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(GU + r * 2 * f + f + cols, mask=m, other=0.0).to(tl.float32)
        ga = tl.load(GA + r * f + cols, mask=m, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        silu = g * s
        tl.store(DGU + r * 2 * f + cols, (ga * u * s * (1.0 + g * (1.0 - s))).to(
            DGU.dtype.element_ty), mask=m)
        tl.store(DGU + r * 2 * f + f + cols, (ga * silu).to(DGU.dtype.element_ty), mask=m)
        tl.store(A + r * f + cols, (silu * u).to(A.dtype.element_ty), mask=m)


def _block(f: int) -> int:
    return min(1024, next_power_of_2(max(f, 16)))


def swiglu(gu: Tensor, fused: bool | None = None) -> Tensor:
    """a [n, F] = silu(g) * u for gu [n, 2F] = [g | u] (bf16/fp16/fp32; float64 on the torch
    path), in gu's dtype, computed in float32 by the kernel (Shazeer 2020, SwiGLU; module
    docstring). ``fused``: the Triton kernel (True), torch (False), None:
    graphopt.kernels.moe.combine.use_triton (GPU/NPU with triton, or the interpreter).
    Raises nothing of its own (an odd column count is the caller's: experts.py checks
    gate_up's rows are even)."""
    n, f2 = gu.shape
    f = f2 // 2
    if not (use_triton(gu) if fused is None else fused):
        g, u = gu.chunk(2, dim=-1)
        return F.silu(g) * u
    gu = gu.contiguous()
    a = gu.new_empty(n, f)
    if n and f:
        block = _block(f)
        _swiglu[(n, cdiv(f, block))](gu, a, f, BLOCK=block)
    return a


def swiglu_backward(gu: Tensor, grad_a: Tensor, fused: bool | None = None
                    ) -> tuple[Tensor, Tensor]:
    """(grad_gu [n, 2F] = [grad_g | grad_u], a [n, F]) for gu [n, 2F] and grad_a [n, F]
    (module docstring: grad_g = grad_a * u * silu'(g), grad_u = grad_a * silu(g), a =
    silu(g) * u), in gu's dtype (grad_a is cast to it), computed in float32 by the kernel;
    ``fused`` as in :func:`swiglu`. Raises nothing of its own."""
    n, f2 = gu.shape
    f = f2 // 2
    if not (use_triton(gu) if fused is None else fused):
        g, u = gu.chunk(2, dim=-1)
        silu = F.silu(g)
        grad_gu = torch.empty_like(gu)
        grad_gu[:, :f] = torch.ops.aten.silu_backward(grad_a * u, g)  # grad * silu'(g)
        torch.mul(grad_a, silu, out=grad_gu[:, f:])
        return grad_gu, silu * u
    gu, grad_a = gu.contiguous(), grad_a.to(gu.dtype).contiguous()
    grad_gu, a = torch.empty_like(gu), gu.new_empty(n, f)
    if n and f:
        block = _block(f)
        _swiglu_backward[(n, cdiv(f, block))](gu, grad_a, grad_gu, a, f, BLOCK=block)
    return grad_gu, a


def launch_specs() -> list[tuple[Any, dict[str, str], dict[str, Any]]]:
    """(kernel, argument types, constexprs) of the two kernels as launched for bf16 rows and
    F = 14336 (Mixtral), for graphopt.kernels.resources' ahead-of-time compilation."""
    from graphopt.kernels.resources import argument_types

    return [(kernel, argument_types(kernel, {"f": "i32"}, "*bf16"), {"BLOCK": 1024})
            for kernel in (_swiglu, _swiglu_backward)]
