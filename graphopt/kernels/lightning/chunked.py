"""Chunked Lightning Attention in PyTorch: forward and an explicit backward (CPU, fallback).

Notation for one block of length L (L = C for full blocks, the remainder for the tail), per
head with lambda = exp(-slope) and in-block positions i (query) and j (key):

    M_ij = lambda^(i - j) if i >= j else 0        (intra-block masked decay)
    a_i  = lambda^(i + 1)                          (query decay: reach of the previous state)
    b_j  = lambda^(L - 1 - j)                      (key decay: reach into the next state)
    O      = ((Q K^T) * M) V + (Q * a) S_prev                                        (2)
    S_next = lambda^L S_prev + (K * b)^T V                                            (3)

(Lightning Attention-2, arXiv:2401.04658, Algorithm 1; the same decomposition as MiniMax's
``MiniMaxLightningAttention`` block loop.) Gradients, for dO and dS_next = dL/dS_next:

    dQ = ((dO V^T) * M) K + (dO S_prev^T) * a
    dK = ((dO V^T) * M)^T Q + (V dS_next^T) * b
    dV = ((Q K^T) * M)^T dO + (K * b) dS_next
    dS_prev = lambda^L dS_next + (Q * a)^T dO
    dslope = -sum((dO V^T) * (Q K^T) * M * (i - j)) - sum((dO S_prev^T) * Q * (i + 1) a)
             - sum((V dS_next^T) * K * (L - 1 - j) b) - L lambda^L sum(dS_next * S_prev)

Selective rematerialization (EPLoN's idea for NPUs, applied here): the forward saves only the
state at the start of every r-th block (``checkpoint_every``); the backward walks segments
of r blocks from the end, recomputes their states from the checkpoint, and computes that
segment's gradients batched. Saved-for-backward bytes: q, k, v, slope plus
ceil(N / r) states of [D, Dv] per head, instead of N states (or autograd's O(N C^2) of a
Python block loop).

All math runs in float32 (float64 for float64 inputs); decays are built as exp of
non-positive exponents after masking (slope >= 0), so strong decay underflows to 0, never
overflows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from graphopt.kernels import acc_dtype

Tensor = torch.Tensor


@dataclass
class Decays:
    """Decay factors of a block of length L for heads with slopes s ([H], accumulation dtype).

    m: [H, L, L] masked intra decay; a: [H, L, 1]; b: [H, L, 1]; block: [H, 1, 1] = lambda^L;
    gap: [L, L] (i - j, masked to 0 above the diagonal); qpos: [L, 1] = i + 1;
    kpos: [L, 1] = L - 1 - j.
    """

    m: Tensor
    a: Tensor
    b: Tensor
    block: Tensor
    gap: Tensor
    qpos: Tensor
    kpos: Tensor

    @staticmethod
    def make(slope: Tensor, length: int) -> Decays:
        s = slope.view(-1, 1, 1)
        idx = torch.arange(length, device=slope.device, dtype=slope.dtype)
        gap = idx.view(-1, 1) - idx.view(1, -1)
        causal = gap >= 0
        gap = gap.clamp(min=0)
        m = torch.exp(-s * gap) * causal
        qpos = (idx + 1).view(-1, 1)
        kpos = (length - 1 - idx).view(-1, 1)
        return Decays(m=m, a=torch.exp(-s * qpos), b=torch.exp(-s * kpos),
                      block=torch.exp(-s * length), gap=gap * causal, qpos=qpos, kpos=kpos)


def _blocks(x: Tensor, start: int, n: int, c: int) -> Tensor:
    """[B, H, S, X] -> [B, H, n, c, X] view of positions start .. start + n*c."""
    b, h, _, d = x.shape
    # Contiguous: matmul folds leading dims into one bmm batch only for mergeable strides;
    # a strided segment view would be copied inside every matmul that reads it.
    return x[:, :, start:start + n * c].reshape(b, h, n, c, d).contiguous()


def _scan_states(kv: Tensor, lam: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """States before each block and after the last: S_prev[n] (eq. 3 unrolled).

    kv: [B, H, n, D, Dv] per-block contributions (K * b)^T V; lam: [H, 1, 1] = lambda^L.
    Returns (S_prev [B, H, n, D, Dv], S_after [B, H, D, Dv]).
    """
    prev = []
    for i in range(kv.shape[2]):
        prev.append(state)
        state = lam * state + kv[:, :, i]
    return torch.stack(prev, dim=2), state


def _segments(n_full: int, tail: int, c: int, every: int) -> list[tuple[int, int, int]]:
    """(start position, number of blocks, block length) per segment, in sequence order.

    Full blocks are grouped r at a time; the tail (S mod C positions) is always a segment of
    its own (possibly empty), so there are ceil(n_full / r) + 1 checkpoints for every S.
    """
    segs = [(first * c, min(every, n_full - first), c) for first in range(0, n_full, every)]
    segs.append((n_full * c, 1 if tail else 0, tail))
    return segs


def num_checkpoints(seq: int, block_size: int, checkpoint_every: int) -> int:
    """ceil(floor(S / C) / r) + 1 (pure integer arithmetic, so it works on SymInts)."""
    return (seq // block_size + checkpoint_every - 1) // checkpoint_every + 1


@dataclass
class _Setup:
    """What forward and backward both start from: inputs in the accumulation dtype (q
    already scaled), the carried state (a copy: never an alias of an input), the segments,
    and the decays per block length (cached)."""

    qf: Tensor
    kf: Tensor
    vf: Tensor
    slope: Tensor
    state: Tensor
    segments: list[tuple[int, int, int]]
    _decays: dict[int, Decays]

    def decays(self, length: int) -> Decays:
        if length not in self._decays:
            self._decays[length] = Decays.make(self.slope, length)
        return self._decays[length]


def _setup(q: Tensor, k: Tensor, v: Tensor, slope: Tensor, scale: float,
           carried: Tensor | None, block_size: int, checkpoint_every: int) -> _Setup:
    acc = acc_dtype(q.dtype)
    bsz, heads, seq, d = q.shape
    state = (carried.to(acc, copy=True) if carried is not None
             else q.new_zeros(bsz, heads, d, v.shape[-1], dtype=acc))
    n_full, tail = divmod(seq, block_size)
    return _Setup(q.to(acc) * scale, k.to(acc), v.to(acc), slope.to(acc), state,
                  _segments(n_full, tail, block_size, checkpoint_every), {})


def _without_autocast(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` (its first argument a tensor) with autocast off on that tensor's device:
    the math is promised in the accumulation dtype, and a caller's bf16 autocast region
    (graphopt.parallel's mixed precision) made eager calls round every matmul to bf16 (a
    review: outputs and states 6.0e-3 / 3.5e-3 off instead of 2e-7, and the backward,
    outside autocast, no longer the forward's gradient), while compiled calls were exact."""
    @functools.wraps(fn)
    def run(first: Tensor, *args: Any, **kwargs: Any) -> Any:
        device = first.device.type
        if device in ("cpu", "cuda", "xpu", "npu", "mps") and \
                torch.is_autocast_enabled(device):
            with torch.autocast(device, enabled=False):
                return fn(first, *args, **kwargs)
        return fn(first, *args, **kwargs)
    return run


@_without_autocast
def chunked_forward(q: Tensor, k: Tensor, v: Tensor, slope: Tensor, scale: float,
                    initial_state: Tensor | None, block_size: int,
                    checkpoint_every: int) -> tuple[Tensor, Tensor, Tensor]:
    """Equation (2)-(3) over all blocks. q/k/v [B, H, S, D|Dv] with equal H (GQA expanded
    by the caller), any dtype; returns (o [B, H, S, Dv] accumulation dtype, final state
    [B, H, D, Dv], checkpoints [B, H, ceil(N / r), D, Dv]: states at segment starts). Runs
    with autocast off (:func:`_without_autocast`)."""
    bsz, heads, seq, _ = q.shape
    dv = v.shape[-1]
    setup = _setup(q, k, v, slope, scale, initial_state, block_size, checkpoint_every)
    state = setup.state
    out = q.new_empty(bsz, heads, seq, dv, dtype=state.dtype)
    checkpoints = []
    for start, n, length in setup.segments:
        checkpoints.append(state)
        if n == 0:
            continue
        dec = setup.decays(length)
        qb, kb, vb = (_blocks(x, start, n, length) for x in (setup.qf, setup.kf, setup.vf))
        kv = (kb * dec.b.unsqueeze(1)).transpose(-1, -2) @ vb
        prev, state = _scan_states(kv, dec.block, state)
        o = ((qb @ kb.transpose(-1, -2)).mul_(dec.m.unsqueeze(1))) @ vb
        o.add_((qb * dec.a.unsqueeze(1)) @ prev)
        out[:, :, start:start + n * length] = o.reshape(bsz, heads, n * length, dv)
    return out, state, torch.stack(checkpoints, dim=2)


@_without_autocast
def chunked_backward(grad_o: Tensor, grad_state: Tensor | None, q: Tensor, k: Tensor,
                     v: Tensor, slope: Tensor, scale: float, checkpoints: Tensor,
                     block_size: int, checkpoint_every: int, need_slope_grad: bool,
                     need_q: bool = True, need_kv: bool = True
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor]:
    """Gradients (dq, dk, dv, dslope or None, d initial_state) of (2)-(3), see module doc.

    Shapes as in :func:`chunked_forward`; results in the accumulation dtype. ``need_q`` /
    ``need_kv`` False: dq, resp. dk, dv and d initial_state are zeros, not computed (no
    reverse state scan, no dK/dV products; without dq, no recomputed forward states),
    unless ``need_slope_grad``, which reads both. FLOPs: :func:`graphopt.cost.lightning_flops`
    with the same ``need_q`` / ``need_kv`` (equal to the matmul FLOPs counted here).
    """
    bsz, heads, seq, d = q.shape
    dv_dim = v.shape[-1]
    setup = _setup(q, k, v, slope, scale, grad_state, block_size, checkpoint_every)
    qf, kf, vf, d_state = setup.qf, setup.kf, setup.vf, setup.state
    acc = d_state.dtype
    go = grad_o.to(acc)
    want_q, want_kv = need_q or need_slope_grad, need_kv or need_slope_grad
    dq = torch.empty_like(qf) if want_q else torch.zeros_like(qf)
    dk, dv = (torch.empty_like(kf), torch.empty_like(vf)) if want_kv else \
        (torch.zeros_like(kf), torch.zeros_like(vf))
    if not want_kv:
        d_state = torch.zeros_like(d_state)
    dslope = torch.zeros(heads, dtype=acc, device=q.device) if need_slope_grad else None
    segments = setup.segments
    for seg_index in range(len(segments) - 1, -1, -1):
        start, n, length = segments[seg_index]
        if n == 0:
            continue
        dec = setup.decays(length)
        sl = slice(start, start + n * length)
        qb, kb, vb, gob = (_blocks(x, start, n, length) for x in (qf, kf, vf, go))
        m, a, b = dec.m.unsqueeze(1), dec.a.unsqueeze(1), dec.b.unsqueeze(1)
        lam = dec.block  # [H, 1, 1]: broadcasts against states [B, H, D, Dv]
        kbb = kb * b
        if want_q:  # the forward's states again, from the checkpoint (dQ and dslope)
            kv = kbb.transpose(-1, -2) @ vb
            prev, _ = _scan_states(kv, lam, checkpoints[:, :, seg_index])
        dov_m = (gob @ vb.transpose(-1, -2)).mul_(m)  # (dO V^T) * M [B, H, n, L, L]
        if want_q:
            dsp = gob @ prev.transpose(-1, -2)  # dO S_prev^T [B, H, n, L, D]
            dq[:, :, sl] = (dov_m @ kb).add_(dsp * a).reshape(bsz, heads, -1, d)
        if not want_kv:
            continue
        qa = qb * a
        qdo = qa.transpose(-1, -2) @ gob  # [B, H, n, D, Dv]
        nexts = []
        for i in range(n - 1, -1, -1):  # dS_next per block, walking backwards
            nexts.append(d_state)
            d_state = lam * d_state + qdo[:, :, i]
        d_next = torch.stack(nexts[::-1], dim=2)
        qk = qb @ kb.transpose(-1, -2)
        vds = vb @ d_next.transpose(-1, -2)  # V dS_next^T [B, H, n, L, D]
        dk[:, :, sl] = (dov_m.transpose(-1, -2) @ qb).add_(vds * b).reshape(bsz, heads, -1, d)
        qkm = qk * m if dslope is not None else qk.mul_(m)
        dv[:, :, sl] = (qkm.transpose(-1, -2) @ gob).add_(kbb @ d_next).reshape(
            bsz, heads, -1, dv_dim)
        if dslope is not None:
            gap, qpos, kpos = dec.gap, dec.qpos, dec.kpos
            dslope -= (dov_m * qk * gap).sum(dim=(0, 2, 3, 4))
            dslope -= (dsp * qb * (qpos * a)).sum(dim=(0, 2, 3, 4))
            dslope -= (vds * kb * (kpos * b)).sum(dim=(0, 2, 3, 4))
            dslope -= length * lam.view(-1) * (d_next * prev).sum(dim=(0, 2, 3, 4))
    return dq * scale, dk, dv, dslope, d_state


DEFAULT_BLOCK_SIZE = 64
"""Block length C: balances the O(S C D) intra-block work against the per-block scan steps
on CPUs (benchmarks/lightning_attention.py). Fixed (not a function of S) so that a symbolic
sequence length never needs a guard."""

DEFAULT_CHECKPOINT_EVERY = 8
"""Save one state per 8 blocks (512 positions at C = 64): measured fastest of 2/4/8/16/64
at S = 4k and 16k (shorter segments keep the backward's transient tensors in cache)."""
