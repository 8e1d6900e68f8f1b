"""The MoE combine (unpermute) and its backward, fused: Triton on GPU/NPU, torch elsewhere.

Shapes (T tokens, K experts per token, H hidden, n <= T*K kept assignments):
    y_rows [n, H] expert outputs in sorted order (unweighted, hidden's dtype);
    weights [T, K] routing weights (any float dtype); order [T*K] int64, the sort: sorted
    row i is assignment order[i] = t * K + k (rows i >= n, or where the optional ``kept`` mask
    is False, were dropped by a capacity).

Forward:  out[t] = sum_k w[t, k] * y_rows[slot[t * K + k]]  (slot: the inverse permutation,
          -1 for a dropped assignment), accumulated in promote(hidden, weights) dtype
          (the Triton kernels, which take no float64 hidden: in float32 whatever the
          weights' dtype, below the float32-or-narrower output's rounding) and stored in
          hidden's dtype.
Backward: for sorted row i with assignment j = order[i], token t = j // K:
          grad_y[i] = w[j] * grad_out[t]  (hidden's dtype),
          grad_w[j] = grad_out[t] . y_rows[i]  (0 for a dropped assignment).

The torch path (index_add over the sorted rows) materializes the weighted rows in the
accumulation dtype and scatter-adds them with atomics; the Triton kernels gather instead
(each program owns one output row: deterministic, no atomics) and fuse the weighting, the
dtype casts and the reduction into one pass over the rows (Megatron-Core's fused
``moe_unpermute`` does the same on CUDA; written here from the equations above).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from graphopt.kernels.lightning.triton_kernels import (
    INTERPRETED,
    cdiv,
    next_power_of_2,
    triton_available,
)

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _combine(Y, W, SLOT, OUT, H, K: tl.constexpr, BLOCK: tl.constexpr):
        """out[t, block] = sum_k w[t, k] y[slot[t, k], block] (fp32), one program per
        (token, H block)."""
        t, ih = tl.program_id(0), tl.program_id(1)
        cols = ih * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(0, K):
            j = t.to(tl.int64) * K + k
            slot = tl.load(SLOT + j)
            # a dropped assignment reads nothing and adds exactly 0, whatever its weight
            # (an inf / NaN weight times a masked 0 would be NaN)
            w = tl.where(slot >= 0, tl.load(W + j).to(tl.float32), 0.0)
            keep = mask & ((cols * 0 + slot) >= 0)
            y = tl.load(Y + tl.maximum(slot, 0).to(tl.int64) * H + cols, mask=keep,
                        other=0.0).to(tl.float32)
            acc += w * y
        tl.store(OUT + t.to(tl.int64) * H + cols, acc.to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _combine_backward(GO, Y, W, ORDER, GY, GW, H, K: tl.constexpr, BLOCK: tl.constexpr):
        """Sorted row i: grad_y[i] = w[j] grad_out[j // K], grad_w[j] = grad_out[j // K] .
        y[i] with j = order[i]; one program per kept row, looping over H."""
        i = tl.program_id(0).to(tl.int64)
        j = tl.load(ORDER + i)
        t = j // K
        w = tl.load(W + j).to(tl.float32)
        dot = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, H, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < H
            go = tl.load(GO + t * H + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(Y + i * H + cols, mask=mask, other=0.0).to(tl.float32)
            dot += go * y
            tl.store(GY + i * H + cols, (go * w).to(GY.dtype.element_ty), mask=mask)
        tl.store(GW + j, tl.sum(dot, axis=0).to(GW.dtype.element_ty))


def use_triton(x: Tensor) -> bool:
    """The Triton kernels run for GPU/NPU tensors when triton is installed, and on CPU under
    Triton's interpreter (TRITON_INTERPRET=1 when triton was imported, for tests); float64
    stays on torch."""
    if not triton_available() or x.dtype == torch.float64:
        return False
    return x.device.type in ("cuda", "npu", "xpu") or (x.device.type == "cpu" and INTERPRETED)


def _block(h: int) -> int:
    return min(1024, next_power_of_2(max(h, 16)))


def combine(y_rows: Tensor, weights: Tensor, order: Tensor, out_dtype: torch.dtype,
            acc: torch.dtype, fused: bool | None = None, kept: Tensor | None = None) -> Tensor:
    """out [T, H] in ``out_dtype`` = the routing-weighted sum of each token's expert rows
    (module doc), accumulated in ``acc``. Dropped assignments (rows beyond y_rows, or rows
    where ``kept`` [n] bool is False, whatever they hold: NaN included) add exactly 0.
    ``fused``: the Triton kernel (True), torch's index_add (False), None: :func:`use_triton`."""
    t, k = weights.shape
    n, h = y_rows.shape
    token = order[:n] // k
    if not (use_triton(y_rows) if fused is None else fused):
        w = weights.reshape(-1)[order[:n]].to(acc)
        rows = y_rows.to(acc) * w.unsqueeze(-1)
        if kept is not None:
            rows = torch.where(kept.unsqueeze(-1), rows, 0)
        out = torch.zeros(t, h, dtype=acc, device=y_rows.device).index_add(0, token, rows)
        return out.to(out_dtype)
    slot = torch.full((t * k,), -1, dtype=torch.int32, device=y_rows.device)
    position = torch.arange(n, dtype=torch.int32, device=y_rows.device)
    slot[order[:n]] = position if kept is None else torch.where(kept, position, -1)
    out = torch.empty(t, h, dtype=out_dtype, device=y_rows.device)
    block = _block(h)
    if t:
        _combine[(t, cdiv(h, block))](y_rows.contiguous(), weights.contiguous(), slot,
                                             out, h, K=k, BLOCK=block)
    return out


def combine_backward(grad_out: Tensor, y_rows: Tensor, weights: Tensor, order: Tensor,
                     acc: torch.dtype, fused: bool | None = None, kept: Tensor | None = None
                     ) -> tuple[Tensor, Tensor]:
    """(grad_y [n, H] in y_rows' dtype, grad_weights [T, K] in ``acc``) of :func:`combine`
    for grad_out [T, H]; ``fused`` and ``kept`` as in :func:`combine` (a dropped row's
    weight gradient is exactly 0; its grad_y row is unspecified)."""
    t, k = weights.shape
    n, h = y_rows.shape
    if not (use_triton(y_rows) if fused is None else fused):
        token = order[:n] // k
        grad_rows = grad_out.index_select(0, token).to(acc)
        w = weights.reshape(-1)[order[:n]].to(acc)
        grad_w = torch.zeros(t * k, dtype=acc, device=y_rows.device)
        dot = (grad_rows * y_rows.to(acc)).sum(-1)
        grad_w[order[:n]] = dot if kept is None else torch.where(kept, dot, 0)
        return (grad_rows * w.unsqueeze(-1)).to(y_rows.dtype), grad_w.view(t, k)
    grad_y = torch.empty_like(y_rows)
    grad_w = torch.zeros(t * k, dtype=acc, device=y_rows.device)
    if n:
        _combine_backward[(n,)](grad_out.contiguous(), y_rows.contiguous(),
                                weights.contiguous(), order.contiguous(), grad_y, grad_w, h,
                                K=k, BLOCK=min(_block(h), 512))
    if kept is not None:  # the kernel ran on every row: zero the dropped ones' dots
        dropped = torch.ones(t * k, dtype=torch.bool, device=y_rows.device)
        dropped[order[:n]] = ~kept
        grad_w = grad_w.masked_fill(dropped, 0)
    return grad_y, grad_w.view(t, k)


def launch_specs() -> list[tuple[Any, dict[str, str], dict[str, Any]]]:
    """(kernel, argument types, constexprs) of the combine and its backward as launched for
    bf16 rows, fp32 weights and K = 2 (for graphopt.kernels.resources' ahead-of-time
    compilation: H is a runtime int, not a pointer)."""
    from graphopt.kernels.resources import argument_types

    return [(_combine, argument_types(_combine, {"W": "*fp32", "SLOT": "*i32", "H": "i32"},
                                      "*bf16"), {"K": 2, "BLOCK": 1024}),
            (_combine_backward, argument_types(
                _combine_backward, {"W": "*fp32", "ORDER": "*i64", "GW": "*fp32", "H": "i32"},
                "*bf16"), {"K": 2, "BLOCK": 512})]
