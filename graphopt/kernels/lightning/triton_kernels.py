"""Chunk-parallel Triton forward/backward of Lightning Attention (GPU via triton, Ascend NPU via
triton-ascend; CPU tests via ``TRITON_INTERPRET=1``).

Same math as chunked.py (equations (2)-(3) and their gradients), organised as
flash-linear-attention's chunk kernels (``chunk_simple_gla``: per-chunk states, a scan over
chunks, then an output pass parallel over chunks), written from the equations:

    forward   kv[c]     = (K_c * b)^T V_c                     grid (chunks, B*H, D/Bk x Dv/Bv)
              S[c]      = lambda^L S[c-1] + kv[c-1]  (scan)   grid (B*H, D/Bk x Dv/Bv)
              O_c       = ((Q_c K_c^T) * M) V_c + (Q_c * a) S[c]          grid (chunks, B*H, Dv/Bv)
    backward  S[c] again from the initial state (the op's checkpoint 0): two launches
              g[c]      = (Q_c * a)^T dO_c                   grid (chunks, B*H, D/Bk x Dv/Bv)
              E[c-1]    = lambda^L_c E[c] + g[c]  (reverse scan; E[N-1] = dS_T; E[c] is the
                          gradient of the state after chunk c; what is left: dS_0)
              dQ, dK, dslope parts                          grid (chunks, B*H, D/Bk)
              dV (the output kernel, transposed scores)     grid (chunks, B*H, Dv/Bv)

Per chunk c of length L (L = C except the tail) and in-chunk positions i, j:
M_ij = lambda^(i-j) (i >= j), a_i = lambda^(i+1), b_j = lambda^(L-1-j), lambda = exp(-slope).
Only the scans are sequential (N = S / C steps of one [Bk, Bv] tile each); every other launch
is parallel over chunks x heads x batch. Head dims up to 256: tiles of Bk x Bv <= 64 x 64 with
loops over the other tiles, so shared memory per program stays bounded. fp32 accumulation for
any input dtype; the state buffer is written in place by the scan (kv[c] is read before
S[c] overwrites it), so the forward keeps one [B*H, N, D, Dv] fp32 buffer.
Portable Triton only (tl.dot, tl.exp, masks, program ids), as triton-ascend needs.
"""

from __future__ import annotations

import importlib.util

import torch

Tensor = torch.Tensor


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _decays(SLOPE, bh, heads, seq, c, C: tl.constexpr):
        """Chunk ``c``'s slope, length, row mask, positions and decays a, b (masked)."""
        s = tl.load(SLOPE + bh % heads).to(tl.float32)
        oc = tl.arange(0, C)
        length = tl.minimum(C, seq - c * C)
        mrow = oc < length
        fi = oc.to(tl.float32)
        a = tl.where(mrow, tl.exp(-s * (fi + 1.0)), 0.0)
        kpos = tl.maximum(length - 1 - fi, 0.0)
        b = tl.where(mrow, tl.exp(-s * kpos), 0.0)
        return s, oc, length, mrow, fi, a, kpos, b

    @triton.jit
    def _chunk_outer(X, Y, SLOPE, OUT, seq, heads, n_chunks, x_scale,
                     DX: tl.constexpr, DY: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                     BV: tl.constexpr, QUERY: tl.constexpr):
        """OUT[bh, c] tile = (x_scale * X_c * w)^T Y_c with w = a (QUERY) or b (keys)."""
        c, bh, t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        nv = tl.cdiv(DY, BV)
        ik, iv = t // nv, t % nv
        s, oc, length, mrow, fi, a, kpos, b = _decays(SLOPE, bh, heads, seq, c, C)
        ok = ik * BK + tl.arange(0, BK)
        ov = iv * BV + tl.arange(0, BV)
        rows = bh * seq + c * C + oc
        x = tl.load(X + rows[:, None] * DX + ok[None, :], mask=mrow[:, None] & (ok < DX)[None, :],
                    other=0.0).to(tl.float32) * x_scale
        y = tl.load(Y + rows[:, None] * DY + ov[None, :], mask=mrow[:, None] & (ov < DY)[None, :],
                    other=0.0).to(tl.float32)
        w = a if QUERY else b
        out = tl.dot(tl.trans(x * w[:, None]), y)
        base = OUT + (bh * n_chunks + c) * DX * DY
        tl.store(base + ok[:, None] * DY + ov[None, :], out,
                 mask=(ok < DX)[:, None] & (ov < DY)[None, :])

    @triton.jit
    def _scan(BUF, SLOPE, INIT, FINAL, seq, heads, n_chunks,
              D: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, HAS_INIT: tl.constexpr, REVERSE: tl.constexpr):
        """In place over BUF [B*H, N, D, Dv]: forward, BUF[c] <- state before chunk c and
        state <- lambda^L_c state + BUF[c]; REVERSE walks c = N-1..0 (dS_end scan). FINAL gets
        the last state (final state / gradient of the initial state)."""
        bh, t = tl.program_id(0), tl.program_id(1)
        nv = tl.cdiv(DV, BV)
        ik, iv = t // nv, t % nv
        s = tl.load(SLOPE + bh % heads).to(tl.float32)
        ok = ik * BK + tl.arange(0, BK)
        ov = iv * BV + tl.arange(0, BV)
        tile = ok[:, None] * DV + ov[None, :]
        mask = (ok < D)[:, None] & (ov < DV)[None, :]
        if HAS_INIT:
            state = tl.load(INIT + bh * D * DV + tile, mask=mask, other=0.0).to(tl.float32)
        else:
            state = tl.zeros([BK, BV], dtype=tl.float32)
        for step in range(0, n_chunks):
            c = n_chunks - 1 - step if REVERSE else step
            length = tl.minimum(C, seq - c * C)
            ptr = BUF + (bh * n_chunks + c) * D * DV + tile
            local = tl.load(ptr, mask=mask, other=0.0)
            tl.store(ptr, state, mask=mask)
            state = tl.exp(-s * length) * state + local
        tl.store(FINAL + bh * D * DV + tile, state, mask=mask)

    @triton.jit
    def _scores_and_state_term(Q, K, rows, mrow, w, ov, mv, base, scale,
                               D: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
                               BK: tl.constexpr, BV: tl.constexpr, FROM_Q: tl.constexpr):
        """Over the D tiles of chunk rows ``rows``: (Q K^T [C, C], (X * w) B [C, Bv]) with X = Q
        (FROM_Q) or K and B the chunk's [D, Dv] buffer at ``base`` (a state or its gradient)."""
        qk = tl.zeros([C, C], dtype=tl.float32)
        acc = tl.zeros([C, BV], dtype=tl.float32)
        for ik in range(0, tl.cdiv(D, BK)):
            ok = ik * BK + tl.arange(0, BK)
            mk = ok < D
            q = tl.load(Q + rows[:, None] * D + ok[None, :], mask=mrow[:, None] & mk[None, :],
                        other=0.0).to(tl.float32) * scale
            k = tl.load(K + rows[:, None] * D + ok[None, :], mask=mrow[:, None] & mk[None, :],
                        other=0.0).to(tl.float32)
            tile = tl.load(base + ok[:, None] * DV + ov[None, :],
                           mask=mk[:, None] & mv[None, :], other=0.0)
            qk += tl.dot(q, tl.trans(k))
            x = q if FROM_Q else k
            acc += tl.dot(x * w[:, None], tile)
        return qk, acc

    @triton.jit
    def _chunk_out(Q, K, X, SLOPE, BUF, OUT, seq, heads, n_chunks, scale,
                   D: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, GRAD_V: tl.constexpr):
        """Per chunk c and Dv tile, with M the masked decay:
        forward (X = V, BUF = S):        O_c  = ((Q_c K_c^T) * M) V_c + (Q_c * a) S[c];
        GRAD_V (X = dO, BUF = dS_end):   dV_c = ((Q_c K_c^T) * M)^T dO_c + (K_c * b) dS_end[c]
        (q scaled)."""
        c, bh, iv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        s, oc, length, mrow, fi, a, kpos, b = _decays(SLOPE, bh, heads, seq, c, C)
        ov = iv * BV + tl.arange(0, BV)
        mv = ov < DV
        rows = bh * seq + c * C + oc
        qk, term = _scores_and_state_term(Q, K, rows, mrow, b if GRAD_V else a, ov, mv,
                                          BUF + (bh * n_chunks + c) * D * DV, scale,
                                          D, DV, C, BK, BV, not GRAD_V)
        gap = fi[:, None] - fi[None, :]
        m = tl.where(gap >= 0, tl.exp(-s * tl.maximum(gap, 0.0)), 0.0)
        x = tl.load(X + rows[:, None] * DV + ov[None, :], mask=mrow[:, None] & mv[None, :],
                    other=0.0).to(tl.float32)
        scores = tl.trans(qk * m) if GRAD_V else qk * m
        out = tl.dot(scores, x) + term
        tl.store(OUT + rows[:, None] * DV + ov[None, :], out.to(OUT.dtype.element_ty),
                 mask=mrow[:, None] & mv[None, :])

    @triton.jit
    def _chunk_dqdk(Q, K, V, DO, SLOPE, STATES, DSEND, DQ, DK, DSLOPE, seq, heads, n_chunks,
                    scale, D: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                    BV: tl.constexpr):
        """dQ, dK of chunk c on one D tile, and this tile's part of dslope (linear in the D
        tiles: every term is a sum over D)."""
        c, bh, ik = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        nk = tl.cdiv(D, BK)
        s, oc, length, mrow, fi, a, kpos, b = _decays(SLOPE, bh, heads, seq, c, C)
        ok = ik * BK + tl.arange(0, BK)
        mk = ok < D
        rows = bh * seq + c * C + oc
        q = tl.load(Q + rows[:, None] * D + ok[None, :], mask=mrow[:, None] & mk[None, :],
                    other=0.0).to(tl.float32) * scale
        k = tl.load(K + rows[:, None] * D + ok[None, :], mask=mrow[:, None] & mk[None, :],
                    other=0.0).to(tl.float32)
        dov = tl.zeros([C, C], dtype=tl.float32)
        dsp = tl.zeros([C, BK], dtype=tl.float32)
        vds = tl.zeros([C, BK], dtype=tl.float32)
        ssum = tl.zeros([BK], dtype=tl.float32)
        sbase = STATES + (bh * n_chunks + c) * D * DV
        dbase = DSEND + (bh * n_chunks + c) * D * DV
        for iv in range(0, tl.cdiv(DV, BV)):
            ov = iv * BV + tl.arange(0, BV)
            mv = ov < DV
            do = tl.load(DO + rows[:, None] * DV + ov[None, :], mask=mrow[:, None] & mv[None, :],
                         other=0.0).to(tl.float32)
            v = tl.load(V + rows[:, None] * DV + ov[None, :], mask=mrow[:, None] & mv[None, :],
                        other=0.0).to(tl.float32)
            st = tl.load(sbase + ok[:, None] * DV + ov[None, :], mask=mk[:, None] & mv[None, :],
                         other=0.0)
            ds = tl.load(dbase + ok[:, None] * DV + ov[None, :], mask=mk[:, None] & mv[None, :],
                         other=0.0)
            dov += tl.dot(do, tl.trans(v))
            dsp += tl.dot(do, tl.trans(st))
            vds += tl.dot(v, tl.trans(ds))
            ssum += tl.sum(ds * st, axis=1)
        gap = fi[:, None] - fi[None, :]
        gapm = tl.maximum(gap, 0.0)
        m = tl.where(gap >= 0, tl.exp(-s * gapm), 0.0)
        dovm = dov * m
        qk = tl.dot(q, tl.trans(k))
        dq = tl.dot(dovm, k) + dsp * a[:, None]
        dk = tl.dot(tl.trans(dovm), q) + vds * b[:, None]
        tl.store(DQ + rows[:, None] * D + ok[None, :], dq * scale,
                 mask=mrow[:, None] & mk[None, :])
        tl.store(DK + rows[:, None] * D + ok[None, :], dk, mask=mrow[:, None] & mk[None, :])
        acc = -tl.sum(dovm * qk * gapm, axis=1)
        acc -= tl.sum(dsp * q, axis=1) * (fi + 1.0) * a
        acc -= tl.sum(vds * k, axis=1) * kpos * b
        lam = tl.exp(-s * length)
        part = tl.sum(acc, axis=0) - length * lam * tl.sum(ssum, axis=0)
        tl.store(DSLOPE + (bh * n_chunks + c) * nk + ik, part)


def _tiles(d: int, dv: int, block_size: int) -> dict[str, int]:
    """Chunk length C (a power of two >= 16) and D / Dv tiles of at most 64 (>= 16, tl.dot's
    minimum): a program holds [C, C] and [C, 64] fp32 tiles, within shared memory at D = 256."""
    return dict(C=max(16, triton.next_power_of_2(block_size)),
                BK=min(64, max(16, triton.next_power_of_2(d))),
                BV=min(64, max(16, triton.next_power_of_2(dv))))


def _options(c: int) -> dict[str, int]:
    return {"num_warps": 4 if c <= 64 else 8, "num_stages": 1}


def _states(k: Tensor, v: Tensor, slope: Tensor, initial: Tensor | None, t: dict[str, int]
            ) -> tuple[Tensor, Tensor]:
    """(S[c] for every chunk [B*H, N, D, Dv] fp32, final state [B*H, D, Dv] fp32)."""
    bh, seq, d = k.shape
    dv = v.shape[-1]
    n = triton.cdiv(seq, t["C"])
    heads = slope.shape[0]
    buf = torch.empty(bh, n, d, dv, dtype=torch.float32, device=k.device)
    tiles = triton.cdiv(d, t["BK"]) * triton.cdiv(dv, t["BV"])
    _chunk_outer[(n, bh, tiles)](k, v, slope, buf, seq, heads, n, 1.0, DX=d, DY=dv,
                                 QUERY=False, **t, **_options(t["C"]))
    final = torch.empty(bh, d, dv, dtype=torch.float32, device=k.device)
    init = initial.reshape(bh, d, dv).float().contiguous() if initial is not None else final
    _scan[(bh, tiles)](buf, slope, init, final, seq, heads, n, D=d, DV=dv,
                       HAS_INIT=initial is not None, REVERSE=False, **t, **_options(t["C"]))
    return buf, final


def triton_forward(q: Tensor, k: Tensor, v: Tensor, slope: Tensor, scale: float,
                  initial_state: Tensor | None, block_size: int, checkpoint_every: int
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """Same contract as ``chunked.chunked_forward`` (heads expanded for GQA): (o [B, H, S, Dv]
    fp32, final state [B, H, D, Dv] fp32, checkpoints [B, H, n, D, Dv] fp32). The block
    length is rounded up to a power of two >= 16."""
    from graphopt.kernels.lightning.chunked import num_checkpoints

    b, h, seq, d = q.shape
    dv = v.shape[-1]
    t = _tiles(d, dv, block_size)
    c = t["C"]
    n = triton.cdiv(seq, c)
    q_, k_, v_ = (x.reshape(b * h, seq, x.shape[-1]).contiguous() for x in (q, k, v))
    slope_f = slope.float().contiguous()
    states, final = _states(k_, v_, slope_f, initial_state, t)
    o = torch.empty(b * h, seq, dv, dtype=torch.float32, device=q.device)
    _chunk_out[(n, b * h, triton.cdiv(dv, t["BV"]))](
        q_, k_, v_, slope_f, states, o, seq, h, n, float(scale), D=d, DV=dv, GRAD_V=False,
        **t, **_options(c))
    n_full = seq // c
    picks = [states[:, i] for i in range(0, n_full, checkpoint_every)]
    picks.append(states[:, n_full] if seq % c else final)  # where the tail starts
    checkpoints = torch.stack(picks, dim=1)
    assert checkpoints.shape[1] == num_checkpoints(seq, c, checkpoint_every)
    return (o.view(b, h, seq, dv), final.view(b, h, d, dv),
            checkpoints.view(b, h, -1, d, dv))


def triton_backward(grad_o: Tensor, grad_state: Tensor | None, q: Tensor, k: Tensor,
                   v: Tensor, slope: Tensor, scale: float, checkpoints: Tensor,
                   block_size: int, checkpoint_every: int, need_slope_grad: bool
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor]:
    """Same contract as ``chunked.chunked_backward``. The chunk states are recomputed from
    the initial state (checkpoint 0) by the forward's two parallel launches: the forward
    saves q, k, v, slope and the checkpoints only (selective rematerialization)."""
    b, h, seq, d = q.shape
    dv = v.shape[-1]
    t = _tiles(d, dv, block_size)
    c = t["C"]
    n = triton.cdiv(seq, c)
    bh = b * h
    q_, k_, v_, go = (x.reshape(bh, seq, x.shape[-1]).contiguous()
                      for x in (q, k, v, grad_o))
    slope_f = slope.float().contiguous()
    states, _ = _states(k_, v_, slope_f, checkpoints[:, :, 0], t)
    tiles = triton.cdiv(d, t["BK"]) * triton.cdiv(dv, t["BV"])
    # g[c] = (Q_c * a)^T dO_c, then in place the reverse scan: dS_end[c] = E[c] with
    # E[N-1] = dS_T and E[c-1] = lambda^L_c E[c] + g[c]; what is left is dS of the initial state.
    dsend = torch.empty(bh, n, d, dv, dtype=torch.float32, device=q.device)
    _chunk_outer[(n, bh, tiles)](q_, go, slope_f, dsend, seq, h, n, float(scale), DX=d,
                                 DY=dv, QUERY=True, **t, **_options(c))
    dh0 = torch.empty(bh, d, dv, dtype=torch.float32, device=q.device)
    dht = grad_state.reshape(bh, d, dv).float().contiguous() if grad_state is not None \
        else dh0
    _scan[(bh, tiles)](dsend, slope_f, dht, dh0, seq, h, n, D=d, DV=dv,
                       HAS_INIT=grad_state is not None, REVERSE=True, **t, **_options(c))
    dq = torch.empty(bh, seq, d, dtype=torch.float32, device=q.device)
    dk = torch.empty_like(dq)
    dvv = torch.empty(bh, seq, dv, dtype=torch.float32, device=q.device)
    nk = triton.cdiv(d, t["BK"])
    parts = torch.empty(bh, n, nk, dtype=torch.float32, device=q.device)
    _chunk_dqdk[(n, bh, nk)](q_, k_, v_, go, slope_f, states, dsend, dq, dk, parts, seq, h,
                             n, float(scale), D=d, DV=dv, **t, **_options(c))
    _chunk_out[(n, bh, triton.cdiv(dv, t["BV"]))](q_, k_, go, slope_f, dsend, dvv, seq, h,
                                                  n, float(scale), D=d, DV=dv, GRAD_V=True,
                                                  **t, **_options(c))
    dslope = parts.sum(dim=(1, 2)).view(b, h).sum(0) if need_slope_grad else None
    return (dq.view(b, h, seq, d), dk.view(b, h, seq, d), dvv.view(b, h, seq, dv), dslope,
            dh0.view(b, h, d, dv))
