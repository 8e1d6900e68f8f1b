"""Triton forward/backward of Lightning Attention (GPU via triton, Ascend NPU via
triton-ascend; CPU tests via ``TRITON_INTERPRET=1``).

Same math as chunked.py (equations (2)-(3) and their gradients). One program per (batch,
head) walks the blocks of its sequence, keeping the [D, Dv] state in registers: forward in
order; backward first recomputes the state before every block from the saved initial state
(kernel ``_states``), then walks the blocks in reverse carrying dS. Only portable Triton is
used (tl.dot, tl.exp, masks, program ids): no CUDA-specific intrinsics, inline PTX, TMA or
warp-specialization, so the same source is what triton-ascend compiles for NPU cores.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

Tensor = torch.Tensor


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _block_setup(SLOPE, pid, heads, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr,
                     BDV: tl.constexpr, C: tl.constexpr):
        """Per (batch, head) program: the slope, index ranges and masks of a D x Dv state,
        and a block's masked decay matrix m[i, j] = exp(-s (i - j)) (i >= j) and query
        decays a[i] = exp(-s (i + 1)); shared by the forward and backward kernels."""
        s = tl.load(SLOPE + pid % heads).to(tl.float32)
        oc = tl.arange(0, C)
        od = tl.arange(0, BD)
        ov = tl.arange(0, BDV)
        md, mv = od < D, ov < DV
        state_ptr = od[:, None] * DV + ov[None, :]
        smask = md[:, None] & mv[None, :]
        fi = oc.to(tl.float32)
        gap = fi[:, None] - fi[None, :]
        m = tl.where(gap >= 0, tl.exp(-s * tl.maximum(gap, 0.0)), 0.0)
        a = tl.exp(-s * (fi + 1.0))
        return s, oc, od, ov, md, mv, state_ptr, smask, fi, gap, m, a

    @triton.jit
    def _fwd(Q, K, V, SLOPE, H0, OUT, HT, CKPT, seq, heads, n_full, n_ckpt, scale,
             D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
             C: tl.constexpr, R: tl.constexpr, HAS_H0: tl.constexpr):
        pid = tl.program_id(0)
        s, oc, od, ov, md, mv, state_ptr, smask, fi, gap, m, a = _block_setup(
            SLOPE, pid, heads, D, DV, BD, BDV, C)
        if HAS_H0:
            state = tl.load(H0 + pid * D * DV + state_ptr, mask=smask, other=0.0).to(tl.float32)
        else:
            state = tl.zeros([BD, BDV], dtype=tl.float32)
        for n in range(0, tl.cdiv(seq, C)):
            start = n * C
            length = tl.minimum(C, seq - start)
            if n < n_full:
                if n % R == 0:
                    tl.store(CKPT + (pid * n_ckpt + n // R) * D * DV + state_ptr, state,
                             mask=smask)
            else:
                tl.store(CKPT + (pid * n_ckpt + n_ckpt - 1) * D * DV + state_ptr, state,
                         mask=smask)
            mrow = oc < length
            rows = pid * seq + start + oc
            q = tl.load(Q + rows[:, None] * D + od[None, :], mask=mrow[:, None] & md[None, :],
                        other=0.0).to(tl.float32) * scale
            k = tl.load(K + rows[:, None] * D + od[None, :], mask=mrow[:, None] & md[None, :],
                        other=0.0).to(tl.float32)
            v = tl.load(V + rows[:, None] * DV + ov[None, :], mask=mrow[:, None] & mv[None, :],
                        other=0.0).to(tl.float32)
            qk = tl.dot(q, tl.trans(k)) * m
            o = tl.dot(qk, v) + tl.dot(q * a[:, None], state)
            tl.store(OUT + rows[:, None] * DV + ov[None, :], o.to(OUT.dtype.element_ty),
                     mask=mrow[:, None] & mv[None, :])
            b = tl.where(mrow, tl.exp(-s * tl.maximum(length - 1 - fi, 0.0)), 0.0)
            state = tl.exp(-s * length) * state + tl.dot(tl.trans(k * b[:, None]), v)
        if seq % C == 0:
            tl.store(CKPT + (pid * n_ckpt + n_ckpt - 1) * D * DV + state_ptr, state, mask=smask)
        tl.store(HT + pid * D * DV + state_ptr, state, mask=smask)

    @triton.jit
    def _states(K, V, SLOPE, CKPT, SPREV, seq, heads, n_ckpt,
                D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                C: tl.constexpr):
        pid = tl.program_id(0)
        s = tl.load(SLOPE + pid % heads).to(tl.float32)
        oc = tl.arange(0, C)
        od = tl.arange(0, BD)
        ov = tl.arange(0, BDV)
        md, mv = od < D, ov < DV
        state_ptr = od[:, None] * DV + ov[None, :]
        smask = md[:, None] & mv[None, :]
        state = tl.load(CKPT + pid * n_ckpt * D * DV + state_ptr, mask=smask, other=0.0)
        fi = oc.to(tl.float32)
        nblocks = tl.cdiv(seq, C)
        for n in range(0, nblocks):
            tl.store(SPREV + (pid * nblocks + n) * D * DV + state_ptr, state, mask=smask)
            start = n * C
            length = tl.minimum(C, seq - start)
            mrow = oc < length
            rows = pid * seq + start + oc
            k = tl.load(K + rows[:, None] * D + od[None, :], mask=mrow[:, None] & md[None, :],
                        other=0.0).to(tl.float32)
            v = tl.load(V + rows[:, None] * DV + ov[None, :], mask=mrow[:, None] & mv[None, :],
                        other=0.0).to(tl.float32)
            b = tl.where(mrow, tl.exp(-s * tl.maximum(length - 1 - fi, 0.0)), 0.0)
            state = tl.exp(-s * length) * state + tl.dot(tl.trans(k * b[:, None]), v)

    @triton.jit
    def _bwd(Q, K, V, SLOPE, DO, DHT, SPREV, DQ, DK, DV_, DH0, DSLOPE, seq, heads, scale,
             D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
             C: tl.constexpr, HAS_DHT: tl.constexpr):
        pid = tl.program_id(0)
        s, oc, od, ov, md, mv, state_ptr, smask, fi, gap, m, a = _block_setup(
            SLOPE, pid, heads, D, DV, BD, BDV, C)
        if HAS_DHT:
            ds = tl.load(DHT + pid * D * DV + state_ptr, mask=smask, other=0.0).to(tl.float32)
        else:
            ds = tl.zeros([BD, BDV], dtype=tl.float32)
        gapm = tl.maximum(gap, 0.0)
        acc = tl.zeros([C], dtype=tl.float32)
        nblocks = tl.cdiv(seq, C)
        for back in range(0, nblocks):
            n = nblocks - 1 - back
            start = n * C
            length = tl.minimum(C, seq - start)
            mrow = oc < length
            rows = pid * seq + start + oc
            mq = mrow[:, None] & md[None, :]
            mo = mrow[:, None] & mv[None, :]
            q = tl.load(Q + rows[:, None] * D + od[None, :], mask=mq, other=0.0).to(
                tl.float32) * scale
            k = tl.load(K + rows[:, None] * D + od[None, :], mask=mq, other=0.0).to(tl.float32)
            v = tl.load(V + rows[:, None] * DV + ov[None, :], mask=mo, other=0.0).to(tl.float32)
            do = tl.load(DO + rows[:, None] * DV + ov[None, :], mask=mo, other=0.0).to(
                tl.float32)
            sprev = tl.load(SPREV + (pid * nblocks + n) * D * DV + state_ptr, mask=smask,
                            other=0.0)
            kpos = tl.maximum(length - 1 - fi, 0.0)
            b = tl.where(mrow, tl.exp(-s * kpos), 0.0)
            lam = tl.exp(-s * length)
            dovm = tl.dot(do, tl.trans(v)) * m
            qk = tl.dot(q, tl.trans(k))
            qkm = qk * m
            dsp = tl.dot(do, tl.trans(sprev))
            vds = tl.dot(v, tl.trans(ds))
            dq = tl.dot(dovm, k) + dsp * a[:, None]
            dk = tl.dot(tl.trans(dovm), q) + vds * b[:, None]
            dv = tl.dot(tl.trans(qkm), do) + tl.dot(k * b[:, None], ds)
            tl.store(DQ + rows[:, None] * D + od[None, :], dq * scale, mask=mq)
            tl.store(DK + rows[:, None] * D + od[None, :], dk, mask=mq)
            tl.store(DV_ + rows[:, None] * DV + ov[None, :], dv, mask=mo)
            acc -= tl.sum(dovm * qk * gapm, axis=1)
            acc -= tl.sum(dsp * q, axis=1) * (fi + 1.0) * a
            acc -= tl.sum(vds * k, axis=1) * kpos * b
            acc -= tl.where(oc == 0, length * lam * tl.sum(tl.sum(ds * sprev, axis=1), axis=0),
                            0.0)
            ds = lam * ds + tl.dot(tl.trans(q * a[:, None]), do)
        tl.store(DH0 + pid * D * DV + state_ptr, ds, mask=smask)
        tl.store(DSLOPE + pid, tl.sum(acc, axis=0))


def _launch_shapes(q: Tensor, v: Tensor, block_size: int) -> dict[str, Any]:
    d, dv = q.shape[-1], v.shape[-1]
    return dict(D=d, DV=dv, BD=max(16, triton.next_power_of_2(d)),
                BDV=max(16, triton.next_power_of_2(dv)), C=max(16, triton.next_power_of_2(
                    block_size)))


def triton_forward(q: Tensor, k: Tensor, v: Tensor, slope: Tensor, scale: float,
                   initial_state: Tensor | None, block_size: int, checkpoint_every: int
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """Same contract as ``chunked.chunked_forward`` (heads already expanded for GQA).

    The block length is rounded up to a power of two >= 16 (Triton tile shapes).
    """
    from graphopt.kernels.lightning.chunked import num_checkpoints

    b, h, seq, d = q.shape
    dv = v.shape[-1]
    shapes = _launch_shapes(q, v, block_size)
    c = shapes["C"]
    n_full = seq // c
    n_ckpt = num_checkpoints(seq, c, checkpoint_every)
    q_, k_, v_ = (x.contiguous() for x in (q, k, v))
    o = torch.empty(b, h, seq, dv, dtype=torch.float32, device=q.device)
    ht = torch.empty(b, h, d, dv, dtype=torch.float32, device=q.device)
    ckpt = torch.zeros(b, h, n_ckpt, d, dv, dtype=torch.float32, device=q.device)
    h0 = initial_state.float().contiguous() if initial_state is not None else ht
    _fwd[(b * h,)](q_, k_, v_, slope.float().contiguous(), h0, o, ht, ckpt, seq, h, n_full,
                   n_ckpt, float(scale), R=checkpoint_every,
                   HAS_H0=initial_state is not None, **shapes, **_launch_options(d, dv))
    return o, ht, ckpt


def _launch_options(d: int, dv: int) -> dict[str, int]:
    """One pipeline stage: each program keeps its [D, Dv] float32 state and block tiles in
    shared memory; Triton's default multi-stage pipelining of the tile loads needed 320 KB
    for D = Dv = 128 on an H200 (limit 227 KB). More warps for the larger tiles."""
    return {"num_stages": 1, "num_warps": 8 if d * dv >= 128 * 128 else 4}


def triton_backward(grad_o: Tensor, grad_state: Tensor | None, q: Tensor, k: Tensor,
                    v: Tensor, slope: Tensor, scale: float, checkpoints: Tensor,
                    block_size: int, checkpoint_every: int, need_slope_grad: bool
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor]:
    """Same contract as ``chunked.chunked_backward``. States are recomputed from the saved
    initial state (checkpoint 0) into a transient [B, H, N, D, Dv] buffer."""
    b, h, seq, d = q.shape
    dv = v.shape[-1]
    shapes = _launch_shapes(q, v, block_size)
    nblocks = triton.cdiv(seq, shapes["C"])
    q_, k_, v_, go = (x.contiguous() for x in (q, k, v, grad_o))
    slope_f = slope.float().contiguous()
    sprev = torch.empty(b, h, max(nblocks, 1), d, dv, dtype=torch.float32, device=q.device)
    _states[(b * h,)](k_, v_, slope_f, checkpoints.contiguous(), sprev, seq, h,
                      checkpoints.shape[2], **shapes, **_launch_options(d, dv))
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.empty(k.shape, dtype=torch.float32, device=q.device)
    dvv = torch.empty(v.shape, dtype=torch.float32, device=q.device)
    dh0 = torch.empty(b, h, d, dv, dtype=torch.float32, device=q.device)
    dslope = torch.empty(b * h, dtype=torch.float32, device=q.device)
    dht = grad_state.float().contiguous() if grad_state is not None else dh0
    _bwd[(b * h,)](q_, k_, v_, slope_f, go, dht, sprev, dq, dk, dvv, dh0, dslope, seq, h,
                   float(scale), HAS_DHT=grad_state is not None, **shapes,
                   **_launch_options(d, dv))
    ds = dslope.view(b, h).sum(0) if need_slope_grad else None
    return dq, dk, dvv, ds, dh0
