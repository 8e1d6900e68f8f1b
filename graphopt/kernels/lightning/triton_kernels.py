"""Chunk-parallel Triton forward/backward of Lightning Attention (GPU via triton, Ascend NPU via
triton-ascend; CPU tests via ``TRITON_INTERPRET=1``).

Same math as chunked.py (equations (2)-(3) and their gradients), organised as
flash-linear-attention's chunk kernels (``chunk_simple_gla``: per-chunk states, a scan over
chunks, then an output pass parallel over chunks), written from the equations:

    forward   kv[c]     = (K_c * b)^T V_c                     grid (chunks, B*H, D/Bk x Dv/Bv)
              S[c]      = lambda^L S[c-1] + kv[c-1]  (scan)   grid (B*H, D/Bk x Dv/Bv)
              O_c       = ((Q_c K_c^T) * M) V_c + (Q_c * a) S[c]          grid (chunks, B*H, Dv/Bv)
    backward  S[c] again from the initial state (the op's checkpoint 0), and
              g[c]      = (Q_c * a)^T dO_c                   grid (2 chunks, B*H, D/Bk x Dv/Bv)
              E[c-1]    = lambda^L_c E[c] + g[c]  (reverse scan; E[N-1] = dS_T; E[c] is the
                          gradient of the state after chunk c; what is left: dS_0)
                          the forward scan and this one share a launch: grid (2 B*H, tiles);
                          so do the kv[c] and g[c] passes (_chunk_outer_pair, _scan_pair)
              dK (+ dslope parts), per K/V head summing its GQA group
                                                            grid (chunks, B*Hk, D/Bk)
              dQ (+ dslope parts)                           grid (chunks, B*H, D/Bk)
              dV (the output kernel, transposed scores), per K/V head
                                                            grid (chunks, B*Hk, Dv/Bv)

Per chunk c of length L (L = C except the tail) and in-chunk positions i, j:
M_ij = lambda^(i-j) (i >= j), a_i = lambda^(i+1), b_j = lambda^(L-1-j), lambda = exp(-slope).
A chunk is computed as R tiles of at most MAX_TILE = 64 rows: the [C, C] products above are
done tile by tile (a query tile with the key tiles up to its own, a key tile with the query
tiles from its own), so the O, dQ/dK and dV grids run over chunks x R tiles, the kv[c] and
g[c] programs loop over their chunk's tiles, and a program holds [64, 64] fp32 tiles
whatever C; states exist once per chunk.
Only the scans are sequential (N = S / C steps of one [Bk, Bv] tile each); every other launch
is parallel over tiles x heads x batch. Head dims up to 256: tiles of Bk x Bv <= 64 x 64 with
loops over the other tiles, so shared memory per program stays bounded. fp32 accumulation for
any input dtype; the state buffer is written in place by the scan (kv[c] is read before
S[c] overwrites it), so the forward keeps one transient [B*H, N, D, Dv] fp32 buffer and saves
only the initial state for the backward.
Portable Triton only (tl.dot, tl.exp, masks, program ids), as triton-ascend needs.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

Tensor = torch.Tensor


_TRITON_FOUND = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """Whether triton is installed (looked up once, at import: a module search is ~1 us of
    host time per call, and resolve_impl asks on every call). A module constant, not
    ``functools.cache``: Dynamo traces resolve_impl inside compiled graphs and warned of
    "silent incorrectness" at every lru_cache-wrapped call it met (a review)."""
    return _TRITON_FOUND


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids on the host. Not ``triton.cdiv``: Triton 3.x makes it a
    ConstexprFunction whose call unwraps every argument (~2 us each; 25 calls per Lightning
    forward+backward, measured by benchmarks/lightning_host.py)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n = 0, as triton.next_power_of_2), on the host
    (see :func:`cdiv`)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _chunk_of(CU, CHUNKS, p, seq, n_per, CS: tl.constexpr, VARLEN: tl.constexpr):
        """Chunk slot ``p`` (chunks of CS rows): (its batch index: 0 for packed sequences;
        its first position along the sequence dim [S] or [T]; the chunk length L, 0 for an
        unused slot). Where a head's rows are is :func:`_at`'s business."""
        if VARLEN:
            n = tl.load(CHUNKS + 2 * p)
            c = tl.load(CHUNKS + 2 * p + 1)
            bos = tl.load(CU + n)
            seqlen = tl.load(CU + n + 1) - bos
            i = 0
        else:
            i = p // n_per
            c = p % n_per
            bos = 0
            seqlen = seq
        length = tl.maximum(tl.minimum(CS, seqlen - c * CS), 0)
        return i, bos + c * CS, length

    @triton.jit
    def _chunk_table(CU, TABLE, OFFS, CU32, OK, n_seqs, slots, total, C: tl.constexpr,
                     BP: tl.constexpr, BN: tl.constexpr):
        """The packed sequences' chunk slots in one launch (program per BP slots): OFFS[i] =
        first slot of sequence i (exclusive prefix sum of its ceil(L_i / C) chunks, N + 1
        entries) and TABLE[p] = (sequence, chunk within it); slots past the last chunk belong
        to the last sequence, beyond its length (idle). Each program walks the N sequences in
        blocks of BN with a running prefix sum: the sequence j with OFFS[j] <= p < OFFS[j + 1]
        owns slot p. Program 0 also writes OFFS, CU32 (cu_seqlens, any int dtype, as int32)
        and OK[0] = 1 if cu_seqlens increases strictly from 0 to ``total``, else 0 (for the
        caller's asynchronous assert). Owner and chunk are clamped valid whatever cu_seqlens
        holds. Work: every program walks all N sequences, O(P N) in all (a review): for
        T = 64k tokens in chunks of 64 and N = 1,000 sequences that is 32 programs of 16
        [64, 64] steps; at N = 16k and T = 1M, 512 programs of 250 steps, an estimate of
        ~0.1 ms on an H200 (not measured), where a prefix-sum launch plus a binary search
        per slot (two launches) would be O(P log N + N)."""
        pid = tl.program_id(0)
        p = pid * BP + tl.arange(0, BP)
        owner = tl.zeros([BP], dtype=tl.int32)
        first = tl.zeros([BP], dtype=tl.int32)
        carry = tl.sum(tl.zeros([BN], dtype=tl.int32), axis=0)
        bad = carry
        for j0 in range(0, n_seqs, BN):
            j = j0 + tl.arange(0, BN)
            mj = j < n_seqs
            a_raw = tl.load(CU + j, mask=mj, other=0)
            b_raw = tl.load(CU + j + 1, mask=mj, other=0)
            bad += tl.sum(tl.where(mj & (b_raw <= a_raw), 1, 0), axis=0)
            # int32 (the caller refuses T >= 2^31); values up to T: checked with OK below
            a, b = a_raw.to(tl.int32), b_raw.to(tl.int32)
            count = tl.where(mj, (b - a + (C - 1)) // C, 0)
            end = tl.cumsum(count, axis=0) + carry
            tl.store(OFFS + j + 1, end, mask=mj & (j * 0 + pid == 0))
            tl.store(CU32 + j + 1, b, mask=mj & (j * 0 + pid == 0))
            start = end - count
            last = j == n_seqs - 1
            own = mj[None, :] & (start[None, :] <= p[:, None]) & \
                ((p[:, None] < end[None, :]) | last[None, :])
            owner += tl.sum(tl.where(own, j[None, :], 0), axis=1)
            first += tl.sum(tl.where(own, start[None, :], 0), axis=1)
            carry += tl.sum(count, axis=0)
        zero = tl.arange(0, 1)
        ok = (bad == 0) & (tl.load(CU + zero) == 0) & (tl.load(CU + zero + n_seqs) == total)
        tl.store(OK + zero, ok.to(tl.int32), mask=zero + pid == 0)
        tl.store(OFFS + zero, zero, mask=zero + pid == 0)
        tl.store(CU32 + zero, tl.load(CU + zero).to(tl.int32), mask=zero + pid == 0)
        mp = p < slots
        owner = tl.minimum(tl.maximum(owner, 0), n_seqs - 1)
        tl.store(TABLE + 2 * p, owner, mask=mp)
        tl.store(TABLE + 2 * p + 1, tl.maximum(p - first, 0), mask=mp)

    @triton.jit
    def _at(i, h, pos, sb, sh, ss):
        """Element offset (int64) of row ``pos`` of head ``h`` of batch ``i`` in a [B, H, S, X]
        tensor of strides (sb, sh, ss, 1): any layout whose last dim is contiguous ("bhsd",
        "bshd", the views a fused QKV projection splits into) is read in place."""
        return i.to(tl.int64) * sb + h.to(tl.int64) * sh + pos.to(tl.int64) * ss

    @triton.jit
    def _decays(SLOPE, h, length, off, C: tl.constexpr):
        """Head ``h``'s slope and, for the tile of C rows at offset ``off`` of a chunk of
        ``length`` rows: positions in the chunk (int and float), row mask and the decays
        a = lambda^(f+1), b = lambda^(L-1-f) (0 on masked rows)."""
        s = tl.load(SLOPE + h).to(tl.float32)
        oi = off + tl.arange(0, C)
        mrow = oi < length
        fi = oi.to(tl.float32)
        a = tl.where(mrow, tl.exp(-s * (fi + 1.0)), 0.0)
        kpos = tl.maximum(length - 1 - fi, 0.0)
        b = tl.where(mrow, tl.exp(-s * kpos), 0.0)
        return s, oi, mrow, fi, a, kpos, b

    @triton.jit
    def _decay_mask(s, gap):
        """lambda^gap where gap = (query position - key position) >= 0, else 0."""
        return tl.where(gap >= 0, tl.exp(-s * tl.maximum(gap, 0.0)), 0.0)

    @triton.jit
    def _outer_tile(X, Y, SLOPE, OUT, CU, CHUNKS, p, h, t, seq, heads, group, n_per, x_scale,
                    sxb, sxh, syb, syh,
                    D: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, R: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, QUERY: tl.constexpr,
                    LOWP: tl.constexpr, VARLEN: tl.constexpr, DOT: tl.constexpr,
                    SXS: tl.constexpr, SYS: tl.constexpr):
        """One [BK, BV] tile ``t`` of chunk slot ``p``, head ``h``: see :func:`_chunk_outer`."""
        out, ok, ov = _outer_value(X, Y, SLOPE, CU, CHUNKS, p, h, t, seq, group, n_per,
                                   x_scale, sxb, sxh, syb, syh, D, DV, C, R, BK, BV, QUERY,
                                   LOWP, VARLEN, DOT, SXS, SYS)
        base = OUT + (p.to(tl.int64) * heads + h) * D * DV
        tl.store(base + ok[:, None] * DV + ov[None, :], out.to(OUT.dtype.element_ty),
                 mask=(ok < D)[:, None] & (ov < DV)[None, :])

    @triton.jit
    def _outer_value(X, Y, SLOPE, CU, CHUNKS, p, h, t, seq, group, n_per, x_scale,
                     sxb, sxh, syb, syh,
                     D: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, R: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, QUERY: tl.constexpr,
                     LOWP: tl.constexpr, VARLEN: tl.constexpr, DOT: tl.constexpr,
                     SXS: tl.constexpr, SYS: tl.constexpr):
        """(the fp32 [BK, BV] tile ``t`` of chunk slot ``p``'s outer-product sum for head
        ``h`` (:func:`_chunk_outer`), its row and column indices)."""
        ct = X.dtype.element_ty if LOWP else tl.float32
        nv = tl.cdiv(DV, BV)
        ik, iv = t // nv, t % nv
        i, pos, length = _chunk_of(CU, CHUNKS, p, seq, n_per, C * R, VARLEN)
        hx = h if QUERY else h // group
        xb = X + _at(i, hx, pos, sxb, sxh, SXS)
        yb = Y + _at(i, hx, pos, syb, syh, SYS)
        ok = ik * BK + tl.arange(0, BK)
        ov = iv * BV + tl.arange(0, BV)
        out = tl.zeros([BK, BV], dtype=tl.float32)
        for r in range(0, (length + C - 1) // C):
            s, oi, mrow, fi, a, kpos, b = _decays(SLOPE, h, length, r * C, C)
            x = tl.load(xb + oi[:, None] * SXS + ok[None, :],
                        mask=mrow[:, None] & (ok < D)[None, :], other=0.0).to(ct)
            y = tl.load(yb + oi[:, None] * SYS + ov[None, :],
                        mask=mrow[:, None] & (ov < DV)[None, :], other=0.0).to(ct)
            w = a if QUERY else b
            out += tl.dot(tl.trans((x * (w * x_scale)[:, None]).to(ct)), y,
                          input_precision=DOT)
        return out, ok, ov

    @triton.jit
    def _chunk_outer(X, Y, SLOPE, OUT, CU, CHUNKS, seq, heads, group, n_per, x_scale,
                     sxb, sxh, syb, syh,
                     D: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, R: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, QUERY: tl.constexpr,
                     LOWP: tl.constexpr, VARLEN: tl.constexpr, DOT: tl.constexpr,
                     SXS: tl.constexpr, SYS: tl.constexpr):
        """OUT[p, h] tile = sum over the chunk's R tiles of (x_scale X_t * w)^T Y_t with
        w = a (QUERY: X, Y = Q, dO of query head h) or b (X, Y = K, V of K/V head
        h // group: GQA without expanding K and V); X, Y of strides (sxb, sxh, SXS, 1),
        (syb, syh, SYS, 1) (row strides constexpr: see _strides). Products take the
        inputs' dtype (bf16/fp16 tensor cores), fp32 accumulation."""
        p, h, t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        _outer_tile(X, Y, SLOPE, OUT, CU, CHUNKS, p, h, t, seq, heads, group, n_per, x_scale,
                    sxb, sxh, syb, syh, D, DV, C, R, BK, BV, QUERY, LOWP, VARLEN, DOT, SXS, SYS)

    @triton.jit
    def _chunk_outer_pair(K, V, Q, GO, SLOPE, STATES, DSEND, CU, CHUNKS, seq, heads, group,
                          n_per, slots, scale, skb, skh, svb, svh, sqb, sqh, sdb, sdh,
                          D: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
                          R: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          LOWP: tl.constexpr, VARLEN: tl.constexpr, DOT: tl.constexpr,
                          SKS: tl.constexpr, SVS: tl.constexpr, SQS: tl.constexpr,
                          SDS: tl.constexpr):
        """The backward's two chunk passes in one launch (one launch less on the host):
        programs p < slots write STATES[p] = sum (K_t * b)^T V_t (as _chunk_outer with
        QUERY=False), programs slots + p write DSEND[p] = sum (scale Q_t * a)^T dO_t
        (QUERY=True). Strides as _chunk_outer's, for K, V, Q and dO."""
        p, h, t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        if p < slots:
            _outer_tile(K, V, SLOPE, STATES, CU, CHUNKS, p, h, t, seq, heads, group, n_per,
                        1.0, skb, skh, svb, svh, D, DV, C, R, BK, BV, False, LOWP, VARLEN, DOT,
                        SKS, SVS)
        else:
            _outer_tile(Q, GO, SLOPE, DSEND, CU, CHUNKS, p - slots, h, t, seq, heads, group,
                        n_per, scale, sqb, sqh, sdb, sdh, D, DV, C, R, BK, BV, True, LOWP,
                        VARLEN, DOT, SQS, SDS)

    @triton.jit
    def _walk(SLOPE, CU, OFFS, INIT, ih, t, seq, heads, n_per, has_init, D: tl.constexpr,
              DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, VARLEN: tl.constexpr):
        """What a scan over (sequence, head) ``ih``'s chunks needs, for state tile ``t``:
        (sequence, head, slope, first chunk slot, chunks, sequence length, the tile's
        offsets and mask in a [D, Dv] state, the initial state tile (0 without
        ``has_init``))."""
        i, h = ih // heads, ih % heads
        nv = tl.cdiv(DV, BV)
        ik, iv = t // nv, t % nv
        s = tl.load(SLOPE + h).to(tl.float32)
        if VARLEN:
            p0 = tl.load(OFFS + i)
            count = tl.load(OFFS + i + 1) - p0
            seqlen = tl.load(CU + i + 1) - tl.load(CU + i)
        else:
            p0 = i * n_per
            count = n_per
            seqlen = seq
        ok = ik * BK + tl.arange(0, BK)
        ov = iv * BV + tl.arange(0, BV)
        tile = ok[:, None] * DV + ov[None, :]
        mask = (ok < D)[:, None] & (ov < DV)[None, :]
        state = tl.load(INIT + ih.to(tl.int64) * D * DV + tile, mask=mask & has_init,
                        other=0.0).to(tl.float32)
        return i, h, s, p0, count, seqlen, tile, mask, state

    @triton.jit
    def _scan_tile(BUF, SLOPE, INIT, FINAL, CU, OFFS, ih, t, seq, heads, n_per,
                   D: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, has_init, reverse, VARLEN: tl.constexpr):
        """Tile ``t`` of (sequence, head) ``ih``: see :func:`_scan`. ``has_init`` and
        ``reverse`` may be constexprs or runtime flags (:func:`_scan_pair`: one loop body
        for both scans, so the pair needs no more registers than one scan)."""
        i, h, s, p0, count, seqlen, tile, mask, state = _walk(
            SLOPE, CU, OFFS, INIT, ih, t, seq, heads, n_per, has_init, D, DV, BK, BV, VARLEN)
        for step in range(0, count):
            c = tl.where(reverse, count - 1 - step, step)
            length = tl.minimum(C, seqlen - c * C)
            ptr = BUF + ((p0 + c).to(tl.int64) * heads + h) * D * DV + tile
            local = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
            tl.store(ptr, state.to(BUF.dtype.element_ty), mask=mask)
            state = tl.exp(-s * length) * state + local
        tl.store(FINAL + ih.to(tl.int64) * D * DV + tile, state, mask=mask)

    @triton.jit
    def _scan(BUF, SLOPE, INIT, FINAL, CU, OFFS, seq, heads, n_per,
              D: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, HAS_INIT: tl.constexpr, REVERSE: tl.constexpr,
              VARLEN: tl.constexpr):
        """In place over BUF [P, H, D, Dv] for sequence i, head h: forward, BUF[c] <- state
        before chunk c and state <- lambda^L_c state + BUF[c]; REVERSE walks the chunks from
        the last (dS_end scan). FINAL [N, H, D, Dv] gets the last state (final state /
        gradient of the initial state); INIT [N, H, D, Dv] is the first."""
        _scan_tile(BUF, SLOPE, INIT, FINAL, CU, OFFS, tl.program_id(0), tl.program_id(1), seq,
                   heads, n_per, D, DV, C, BK, BV, HAS_INIT, REVERSE, VARLEN)

    @triton.jit
    def _scan_pair(STATES, INIT, FINAL, DSEND, DHT, DH0, SLOPE, CU, OFFS, seq, heads, n_per,
                   rows, D: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, HAS_INIT: tl.constexpr,
                   HAS_DHT: tl.constexpr, VARLEN: tl.constexpr):
        """The backward's two scans in one launch: programs ih < rows (= sequences x heads)
        run the forward scan of STATES from INIT (into FINAL), programs rows + ih the reverse
        scan of DSEND from DHT into DH0 (as two _scan launches)."""
        ih, t = tl.program_id(0), tl.program_id(1)
        rev = ih >= rows
        _scan_tile(tl.where(rev, DSEND, STATES), SLOPE, tl.where(rev, DHT, INIT),
                   tl.where(rev, DH0, FINAL), CU, OFFS, tl.where(rev, ih - rows, ih), t, seq,
                   heads, n_per, D, DV, C, BK, BV, tl.where(rev, HAS_DHT, HAS_INIT), rev,
                   VARLEN)

    @triton.jit
    def _seq_states_tile(X, Y, SLOPE, BUF, INIT, FINAL, CU, CHUNKS, OFFS, ih, t, seq, heads,
                         group, n_per, n_seqs, slots, x_scale, sxb, sxh, syb, syh,
                         D: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, R: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr, QUERY: tl.constexpr,
                         LOWP: tl.constexpr, VARLEN: tl.constexpr, DOT: tl.constexpr,
                         SXS: tl.constexpr, SYS: tl.constexpr, HAS_INIT: tl.constexpr,
                         REVERSE: tl.constexpr):
        """The state pass and its scan in one program per (sequence, head) ``ih`` and tile
        ``t``, walking the chunks in order (REVERSE: from the last): BUF[c] <- the running
        state, then state <- lambda^L_c state + kv[c] with kv[c] the chunk's outer-product
        sum (:func:`_outer_value`) rounded to BUF's dtype, as :func:`_scan` reads it from the
        parallel pass: with the same tiles both give the same numbers (flash-linear-attention's
        ``chunk_fwd_kernel_h`` runs its state pass this way). Packed sequences: the last
        sequence's programs also zero the spare slots after the used ones (the parallel
        pass writes zeros there; the dQ / dK kernels read them times 0)."""
        i, h, s, p0, count, seqlen, tile, mask, state = _walk(
            SLOPE, CU, OFFS, INIT, ih, t, seq, heads, n_per, HAS_INIT, D, DV, BK, BV, VARLEN)
        for step in range(0, count):
            c = count - 1 - step if REVERSE else step
            length = tl.minimum(C * R, seqlen - c * (C * R))
            kv, _, _ = _outer_value(X, Y, SLOPE, CU, CHUNKS, p0 + c, h, t, seq, group, n_per,
                                    x_scale, sxb, sxh, syb, syh, D, DV, C, R, BK, BV, QUERY,
                                    LOWP, VARLEN, DOT, SXS, SYS)
            ptr = BUF + ((p0 + c).to(tl.int64) * heads + h) * D * DV + tile
            tl.store(ptr, state.to(BUF.dtype.element_ty), mask=mask)
            state = tl.exp(-s * length) * state + \
                kv.to(BUF.dtype.element_ty).to(tl.float32)
        tl.store(FINAL + ih.to(tl.int64) * D * DV + tile, state, mask=mask)
        if VARLEN:
            if i == n_seqs - 1:
                for p in range(p0 + count, slots):
                    tl.store(BUF + ((p0 * 0 + p).to(tl.int64) * heads + h) * D * DV + tile,
                             tl.zeros([BK, BV], dtype=BUF.dtype.element_ty), mask=mask)

    @triton.jit
    def _chunk_states(K, V, SLOPE, BUF, INIT, FINAL, CU, CHUNKS, OFFS, seq, heads, group,
                      n_per, n_seqs, slots, skb, skh, svb, svh,
                      D: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, R: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, LOWP: tl.constexpr,
                      VARLEN: tl.constexpr, DOT: tl.constexpr, SKS: tl.constexpr,
                      SVS: tl.constexpr, HAS_INIT: tl.constexpr):
        """The forward's chunk states S[c] (before chunk c) and final state in one launch:
        :func:`_seq_states_tile` over K, V (the sequential alternative to _chunk_outer +
        _scan; grid (sequences x heads, tiles))."""
        _seq_states_tile(K, V, SLOPE, BUF, INIT, FINAL, CU, CHUNKS, OFFS, tl.program_id(0),
                         tl.program_id(1), seq, heads, group, n_per, n_seqs, slots, 1.0, skb,
                         skh, svb, svh,
                         D, DV, C, R, BK, BV, False, LOWP, VARLEN, DOT, SKS, SVS, HAS_INIT,
                         False)

    @triton.jit
    def _chunk_states_pair(K, V, Q, GO, SLOPE, STATES, INIT, FINAL, DSEND, DHT, DH0, CU,
                           CHUNKS, OFFS, seq, heads, group, n_per, n_seqs, slots, rows, scale,
                           skb, skh, svb,
                           svh, sqb, sqh, sdb, sdh,
                           D: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
                           R: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                           LOWP: tl.constexpr, VARLEN: tl.constexpr, DOT: tl.constexpr,
                           SKS: tl.constexpr, SVS: tl.constexpr, SQS: tl.constexpr,
                           SDS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_DHT: tl.constexpr):
        """The backward's two state passes, each with its scan, in one launch (the
        sequential alternative to _chunk_outer_pair + _scan_pair): programs ih < rows the
        chunk states from K, V (as _chunk_states), the others dS_end from Q, dO walking the
        chunks from the last, from DHT into DH0."""
        ih, t = tl.program_id(0), tl.program_id(1)
        if ih < rows:
            _seq_states_tile(K, V, SLOPE, STATES, INIT, FINAL, CU, CHUNKS, OFFS, ih, t, seq,
                             heads, group, n_per, n_seqs, slots, 1.0, skb, skh, svb, svh, D,
                             DV, C, R, BK, BV, False, LOWP, VARLEN, DOT, SKS, SVS, HAS_INIT,
                             False)
        else:
            _seq_states_tile(Q, GO, SLOPE, DSEND, DHT, DH0, CU, CHUNKS, OFFS, ih - rows, t,
                             seq, heads, group, n_per, n_seqs, slots, scale, sqb, sqh, sdb,
                             sdh, D, DV, C, R, BK, BV, True, LOWP, VARLEN, DOT, SQS, SDS,
                             HAS_DHT, True)

    @triton.jit
    def _chunk_out(Q, K, Z, SLOPE, BUF, OUT, CU, CHUNKS, seq, heads, group, n_per, scale,
                   sqb, sqh, skb, skh, szb, szh, sob, soh, D: tl.constexpr, DV: tl.constexpr,
                   C: tl.constexpr, R: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, GRAD_V: tl.constexpr,
                   LOWP: tl.constexpr, VARLEN: tl.constexpr, DOT: tl.constexpr,
                   SQS: tl.constexpr, SKS: tl.constexpr, SZS: tl.constexpr,
                   SOS: tl.constexpr):
        """Per tile r of chunk p (program r + R * p) and Dv tile, with M the masked decay
        and t over the chunk's tiles:
        forward (Z = V, BUF = S):        O_r  = sum_{t <= r} ((Q_r K_t^T) * M) V_t
                                                + (Q_r * a) S[p];
        GRAD_V (Z = dO, BUF = dS_end):   dV_r = sum_{t >= r} ((Q_t K_r^T) * M)^T dO_t
                                                + (K_r * b) dS_end[p]
        (q scaled), dV summed over the GQA group's query heads. The tile's own rows are
        query rows (forward) or key rows (GRAD_V), as are the output rows. Strides
        (s?b, s?h, S?S) of Q, K, Z and OUT (last dims contiguous; row strides constexpr).
        Products take the inputs' dtype (the state and the masked scores are rounded to it,
        as flash-linear-attention does), fp32 accumulation."""
        pr, hh, iv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        ct = Q.dtype.element_ty if LOWP else tl.float32
        p, r = pr // R, pr % R
        # GRAD_V: program per K/V head hh, summing its GQA group's query heads in the loop
        # (dV in K/V's heads and dtype: no fp32 per-query-head buffer); forward: hh = h.
        n_heads = group if GRAD_V else 1
        h0 = hh * n_heads
        hk = h0 // group
        i, pos, length = _chunk_of(CU, CHUNKS, p, seq, n_per, C * R, VARLEN)
        s, oi, mrow, fi, a, kpos, b = _decays(SLOPE, h0, length, r * C, C)
        ov = iv * BV + tl.arange(0, BV)
        mv = ov < DV
        oc = tl.arange(0, C)
        # scalar row bases (int64) + int32 in-tile offsets: no per-element 64-bit row indices
        # kept live across the loops (they spilled registers on sm_90)
        own = pos + r * C
        if GRAD_V:
            xb = K + _at(i, hk, own, skb, skh, SKS)
            sxs = SKS
        else:
            xb = Q + _at(i, h0, own, sqb, sqh, SQS)
            sxs = SQS
        dest = OUT + _at(i, hh, own, sob, soh, SOS)  # output rows: K/V's or Q's
        x_scale = 1.0 if GRAD_V else scale
        tiles = (length + C - 1) // C
        live = (r < tiles).to(tl.int32)
        lo = r if GRAD_V else 0
        hi = tiles if GRAD_V else (r + 1) * live
        out = tl.zeros([C, BV], dtype=tl.float32)
        for j in range(0, n_heads):
            h = h0 + j
            s, oi, mrow, fi, a, kpos, b = _decays(SLOPE, h, length, r * C, C)
            w = b if GRAD_V else a
            base = BUF + (p.to(tl.int64) * heads + h) * D * DV
            for ik in range(0, tl.cdiv(D, BK)):  # state term (X_r * w) BUF[p]
                ok = ik * BK + tl.arange(0, BK)
                mk = ok < D
                x = tl.load(xb + oc[:, None] * sxs + ok[None, :],
                            mask=mrow[:, None] & mk[None, :], other=0.0).to(ct)
                tile = tl.load(base + ok[:, None] * DV + ov[None, :],
                               mask=mk[:, None] & mv[None, :], other=0.0)
                out += tl.dot((x * (w * x_scale)[:, None]).to(ct), tile.to(ct),
                              input_precision=DOT)
            for t in range(lo, hi):  # the chunk's other tiles: keys up to r / queries from r
                ti = t * C + tl.arange(0, C)
                mt = ti < length
                # rows of Y = Q, Z = dO of query head h (GRAD_V), or Y = K, Z = V of K/V
                # head hk
                if GRAD_V:
                    yb = Q + _at(i, h, pos + t * C, sqb, sqh, SQS)
                    sy_s = SQS
                else:
                    yb = K + _at(i, hk, pos + t * C, skb, skh, SKS)
                    sy_s = SKS
                zb = Z + _at(i, h if GRAD_V else hk, pos + t * C, szb, szh, SZS)
                sc = tl.zeros([C, C], dtype=tl.float32)  # X_r Y_t^T
                for ik in range(0, tl.cdiv(D, BK)):
                    ok = ik * BK + tl.arange(0, BK)
                    mk = ok < D
                    x = tl.load(xb + oc[:, None] * sxs + ok[None, :],
                                mask=mrow[:, None] & mk[None, :], other=0.0).to(ct)
                    y = tl.load(yb + oc[:, None] * sy_s + ok[None, :],
                                mask=mt[:, None] & mk[None, :], other=0.0).to(ct)
                    sc += tl.dot(x, tl.trans(y), input_precision=DOT)
                ft = ti.to(tl.float32)
                # rows: own tile, columns: tile t; the query is the later position
                gap = ft[None, :] - fi[:, None] if GRAD_V else fi[:, None] - ft[None, :]
                m = _decay_mask(s, gap)
                z = tl.load(zb + oc[:, None] * SZS + ov[None, :],
                            mask=mt[:, None] & mv[None, :], other=0.0).to(ct)
                out += tl.dot((sc * m * scale).to(ct), z, input_precision=DOT)
        tl.store(dest + oc[:, None] * SOS + ov[None, :], out.to(OUT.dtype.element_ty),
                 mask=mrow[:, None] & mv[None, :])

    @triton.jit
    def _do_vt(DOB, mdo, SDS: tl.constexpr, VB, mv_rows, SVS: tl.constexpr, DV: tl.constexpr,
               C: tl.constexpr, BV: tl.constexpr, LOWP: tl.constexpr, DOT: tl.constexpr):
        """dO V^T [C, C] (fp32) over the Dv tiles: C rows of dO from DOB (row mask mdo, row
        stride SDS) and of V from VB (row mask mv_rows, row stride SVS), products in the
        input dtype under LOWP."""
        ct = DOB.dtype.element_ty if LOWP else tl.float32
        oc = tl.arange(0, C)
        acc = tl.zeros([C, C], dtype=tl.float32)
        for iv in range(0, tl.cdiv(DV, BV)):
            ov = iv * BV + tl.arange(0, BV)
            mv = ov < DV
            g = tl.load(DOB + oc[:, None] * SDS + ov[None, :], mask=mdo[:, None] & mv[None, :],
                        other=0.0).to(ct)
            v = tl.load(VB + oc[:, None] * SVS + ov[None, :],
                        mask=mv_rows[:, None] & mv[None, :], other=0.0).to(ct)
            acc += tl.dot(g, tl.trans(v), input_precision=DOT)
        return acc

    @triton.jit
    def _chunk_dqdk(Q, K, V, DO, SLOPE, STATES, DSEND, DQ, DK, DSLOPE, CU, CHUNKS, seq, heads,
                    group, n_per, parts, scale, sqb, sqh, skb, skh, svb, svh, sdb, sdh, sob,
                    soh, D: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
                    R: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GRAD_K: tl.constexpr,
                    SLOPE_GRAD: tl.constexpr, LOWP: tl.constexpr, VARLEN: tl.constexpr,
                    DOT: tl.constexpr, SQS: tl.constexpr, SKS: tl.constexpr,
                    SVS: tl.constexpr, SDS: tl.constexpr, SOS: tl.constexpr):
        """GRAD_K: dK of tile r of chunk p (program r + R * p) on one D tile, summed over the
        GQA group's query heads (one program per K/V head), else its dQ;
        and this program's part of dslope (linear in the D tiles: every term is a sum over
        D; each (query, key) pair of the chunk counted once, by the query's tile in the dQ
        launch; the chunk's state-decay term <dS_end[c], S[c]> by tile 0 in the dQ launch,
        which reads S[c] anyway, so dK never reads the chunk states). An unused slot or
        tile adds 0. Products take the inputs' dtype, fp32 accumulation. dQ and dK are two
        launches: one kernel computing both kept ~2x the live tiles and spilled registers
        on sm_90 in every tile config (graphopt.kernels.resources). Without SLOPE_GRAD
        (the slope is not trained: MiniMax's and Lightning's fixed ALiBi-style slopes) the
        dslope terms are skipped: dQ's extra Q_r K_t^T product per key tile and its reads of
        dS_end. dK takes any placeholder for STATES: the backward frees the states before dK
        and dV are allocated. Strides
        (s?b, s?h, S?S) of Q, K, V, dO and of the output (DQ or DK), last dims contiguous
        (row strides constexpr)."""
        pr, hh, ik = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        ct = Q.dtype.element_ty if LOWP else tl.float32
        p, r = pr // R, pr % R
        # GRAD_K: program per K/V head hh, summing its GQA group's query heads (dK in K's
        # heads and dtype); dQ: hh is the query head.
        h0 = hh * group if GRAD_K else hh
        hk = h0 // group
        i, pos, length = _chunk_of(CU, CHUNKS, p, seq, n_per, C * R, VARLEN)
        s, oi, mrow, fi, a, kpos, b = _decays(SLOPE, h0, length, r * C, C)
        ok = ik * BK + tl.arange(0, BK)
        mk = ok < D
        oc = tl.arange(0, C)
        # scalar row bases (int64) + int32 in-tile offsets (see _chunk_out)
        own = pos + r * C
        k_own = K + _at(i, hk, own, skb, skh, SKS)
        v_own = V + _at(i, hk, own, svb, svh, SVS)
        tile_mask = mrow[:, None] & mk[None, :]
        tiles = (length + C - 1) // C
        first = (r == 0).to(tl.float32)  # the chunk's state-decay term: tile 0's
        if GRAD_K:
            dk = tl.zeros([C, BK], dtype=tl.float32)
            for j in range(0, group):
                h = h0 + j
                s, oi, mrow, fi, a, kpos, b = _decays(SLOPE, h, length, r * C, C)
                slot = (p.to(tl.int64) * heads + h) * D * DV
                vds = tl.zeros([C, BK], dtype=tl.float32)  # V_r dS^T
                for iv in range(0, tl.cdiv(DV, BV)):
                    ov = iv * BV + tl.arange(0, BV)
                    mv = ov < DV
                    v = tl.load(v_own + oc[:, None] * SVS + ov[None, :],
                                mask=mrow[:, None] & mv[None, :], other=0.0).to(ct)
                    ds = tl.load(DSEND + slot + ok[:, None] * DV + ov[None, :],
                                 mask=mk[:, None] & mv[None, :], other=0.0)
                    vds += tl.dot(v, tl.trans(ds.to(ct)), input_precision=DOT)
                acc = tl.zeros([C], dtype=tl.float32)
                if SLOPE_GRAD:  # before the tile loop: vds is not kept live through it
                    k = tl.load(k_own + oc[:, None] * SKS + ok[None, :], mask=tile_mask,
                                other=0.0).to(tl.float32)
                    acc = -tl.sum(vds * k, axis=1) * kpos * b
                dk += vds * b[:, None]
                for t in range(r, tiles):  # queries of tile t >= r
                    q_t = Q + _at(i, h, pos + t * C, sqb, sqh, SQS)
                    do_t = DO + _at(i, h, pos + t * C, sdb, sdh, SDS)
                    mt = t * C + oc < length
                    dov = _do_vt(do_t, mt, SDS, v_own, mrow, SVS, DV, C, BV, LOWP,
                                 DOT)  # dO_t V_r^T
                    m = _decay_mask(s, (t * C + oc).to(tl.float32)[:, None] - fi[None, :])
                    qt = tl.load(q_t + oc[:, None] * SQS + ok[None, :],
                                 mask=mt[:, None] & mk[None, :], other=0.0).to(ct)
                    dk += tl.dot(tl.trans((dov * m * scale).to(ct)), qt, input_precision=DOT)
                if SLOPE_GRAD:
                    tl.store(DSLOPE + (pr.to(tl.int64) * heads + h) * parts + ik,
                             tl.sum(acc, axis=0))
            tl.store(DK + _at(i, hh, own, sob, soh, SOS) + oc[:, None] * SOS + ok[None, :],
                     dk.to(DK.dtype.element_ty), mask=tile_mask)
        else:
            q_own = Q + _at(i, h0, own, sqb, sqh, SQS)
            do_own = DO + _at(i, h0, own, sdb, sdh, SDS)
            slot = (p.to(tl.int64) * heads + h0) * D * DV
            dq = tl.zeros([C, BK], dtype=tl.float32)  # dO_r S^T, then dQ_r
            ssum = tl.zeros([BK], dtype=tl.float32)  # <dS_end, S> of the chunk (tile 0)
            for iv in range(0, tl.cdiv(DV, BV)):
                ov = iv * BV + tl.arange(0, BV)
                mv = ov < DV
                do = tl.load(do_own + oc[:, None] * SDS + ov[None, :],
                             mask=mrow[:, None] & mv[None, :], other=0.0).to(ct)
                st = tl.load(STATES + slot + ok[:, None] * DV + ov[None, :],
                             mask=mk[:, None] & mv[None, :], other=0.0)
                dq += tl.dot(do, tl.trans(st.to(ct)), input_precision=DOT)
                if SLOPE_GRAD:  # read by tile 0 only (masked elsewhere)
                    tile0 = mk & ((r + tl.zeros([BK], dtype=tl.int32)) == 0)
                    ds = tl.load(DSEND + slot + ok[:, None] * DV + ov[None, :],
                                 mask=tile0[:, None] & mv[None, :], other=0.0)
                    ssum += tl.sum(ds.to(tl.float32) * st.to(tl.float32), axis=1)
            q = tl.load(q_own + oc[:, None] * SQS + ok[None, :], mask=tile_mask,
                        other=0.0).to(ct)
            acc = tl.zeros([C], dtype=tl.float32)
            if SLOPE_GRAD:
                acc = -tl.sum(dq * q.to(tl.float32), axis=1) * scale * (fi + 1.0) * a
            dq = dq * a[:, None]
            live = (r < tiles).to(tl.int32)
            for t in range(0, (r + 1) * live):  # keys of tile t <= r, and the pairs' dslope
                k_t = K + _at(i, hk, pos + t * C, skb, skh, SKS)
                v_t = V + _at(i, hk, pos + t * C, svb, svh, SVS)
                mt = t * C + oc < length
                dov = _do_vt(do_own, mrow, SDS, v_t, mt, SVS, DV, C, BV, LOWP,
                             DOT)  # dO_r V_t^T
                gap = fi[:, None] - (t * C + oc).to(tl.float32)[None, :]
                m = _decay_mask(s, gap)
                dovm = dov * m  # 0 where the key is after the query, so gap needs no clamp
                kt = tl.load(k_t + oc[:, None] * SKS + ok[None, :],
                             mask=mt[:, None] & mk[None, :], other=0.0).to(ct)
                dq += tl.dot(dovm.to(ct), kt, input_precision=DOT)
                if SLOPE_GRAD:
                    acc -= tl.sum(dovm * tl.dot(q, tl.trans(kt), input_precision=DOT) * gap,
                                  axis=1) * scale
            tl.store(DQ + _at(i, h0, own, sob, soh, SOS) + oc[:, None] * SOS + ok[None, :],
                     (dq * scale).to(DQ.dtype.element_ty), mask=tile_mask)
            if SLOPE_GRAD:
                part = tl.sum(acc, axis=0) \
                    - first * length * tl.exp(-s * length) * tl.sum(ssum, axis=0)
                tl.store(DSLOPE + (pr.to(tl.int64) * heads + h0) * parts + ik, part)


MAX_TILE = 64
"""Rows per program (the tile C). A chunk of block_size rows (rounded up to a power of two
>= 16) is computed as R = block_size / C tiles of C rows: a program holds [C, C] and
[C, 64] fp32 tiles whatever the chunk (C = 256 would need 256 KB for the score tile alone),
while states are stored once per chunk (R times fewer state bytes than chunks of C)."""


def _tiles(d: int, dv: int, block_size: int) -> dict[str, int]:
    """Tile rows C and tiles per chunk R (chunk length C * R: a power of two >= 16), D / Dv
    tiles of at most 64 (>= 16, tl.dot's minimum), within shared memory at D = 256."""
    chunk = max(16, next_power_of_2(block_size))
    c = min(chunk, MAX_TILE)
    return dict(C=c, R=chunk // c,
                BK=min(64, max(16, next_power_of_2(d))),
                BV=min(64, max(16, next_power_of_2(dv))))


SCAN_OPTIONS = {"num_warps": 4, "num_stages": 1}
"""The scans' launch options (one [Bk, Bv] state tile per program; not tuned: in place)."""


def chunk_rows(d: int, dv: int, block_size: int) -> int:
    """Rows per chunk slot of the Triton kernels at head dims (d, dv) and ``block_size``
    (a power of two >= 16; the tiles of :func:`_tiles`)."""
    t = _tiles(d, dv, block_size)
    return t["C"] * t["R"]


def _options(c: int) -> dict[str, int]:
    return {"num_warps": 4 if c <= 64 else 8, "num_stages": 1}


UNTUNED_TILE = 32
"""D / Dv tile of a tuned launch run without autotuning on a GPU/NPU (``TUNE = False``, e.g.
``lightning_gpu.py --no-tune``), with UNTUNED_WARPS warps: the one config of the candidates
that compiles without register spills on sm_90 for every launch at head dims 64 and 128,
fixed or trained slope (``tests/test_kernel_resources.py``). The interpreter's tiles (64
wide, 4 warps) spilled there in the output, dQ, dK and dV launches, up to 1,064 stack bytes
per thread (dK with dslope at D = 128), which is what a ``--no-tune`` H200 run got."""

UNTUNED_WARPS = 8


def untuned(t: dict[str, int], tuned: tuple[str, ...]) -> tuple[dict[str, int],
                                                                dict[str, int]]:
    """(tiles, launch options) of a launch that is not autotuned: ``t`` and _options under
    the interpreter (or for launches with nothing tuned), else the ``tuned`` tiles capped at
    UNTUNED_TILE with UNTUNED_WARPS warps."""
    if INTERPRETED or not tuned:
        return dict(t), _options(t["C"])
    return ({**t, **{n: min(t[n], UNTUNED_TILE) for n in tuned}},
            {"num_warps": UNTUNED_WARPS, "num_stages": 1})


def dot_precision() -> str:
    """The ``DOT`` constexpr, tl.dot's ``input_precision`` for fp32 products (fp32 and fp16
    inputs, fp32 states): "ieee", or "tf32" when torch's ``set_float32_matmul_precision``
    is "high"/"medium", as torch's own fp32 matmuls. Triton's default on NVIDIA is TF32
    (10-bit mantissa: ~4e-4 relative error in outputs and gradients where the chunked path
    has ~2e-7), and its ``default_dot_input_precision`` compile option is not applied by
    triton 3.9, hence the explicit argument. bf16 products (LOWP) ignore it."""
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def _out_dtype(x: Tensor) -> torch.dtype:
    """Outputs and q/k/v gradients are stored in the inputs' dtype (fp32 accumulation inside
    the kernels, one rounding at the store: no fp32 copy and cast pass); float64 inputs get
    fp32 (the kernels compute in fp32)."""
    return x.dtype if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else \
        torch.float32


def _lowp(dtype: torch.dtype) -> bool:
    """Whether the products (tl.dot) take the input dtype: see LOWP_DTYPES."""
    return dtype in LOWP_DTYPES


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    """Storage of the per-chunk state buffers (S[c] before each chunk, and the backward's
    dS_end[c]) for inputs of ``dtype``: the input dtype where the products take it (LOWP:
    every reader rounds the state to it before its tl.dot anyway, so storing it rounded
    halves the buffers' bytes and their traffic without changing those products), else
    float32. The scans accumulate in float32 registers (each chunk's own outer-product sum
    is rounded once when stored, not the running state), and the final state and the
    initial state's gradient are float32 buffers of their own. flash-linear-attention
    stores its forward states in the input dtype too (float32 in its backward: twice these
    bytes; measured in docs/benchmarks.md, "Lightning memory on the CPU")."""
    return dtype if _lowp(dtype) else torch.float32


def _ntiles(d: int, dv: int, meta: dict[str, Any]) -> int:
    """[BK, BV] tiles of a [D, Dv] state."""
    return cdiv(d, meta["BK"]) * cdiv(dv, meta["BV"])


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's CPU interpreter (read at import, as triton.jit does)."""

TUNE = not INTERPRETED
"""Autotune the launches (GPU/NPU); the interpreter takes fixed tiles. Tests set it to run the
tuned launch path under the interpreter (with a host timer, BENCHMARKER)."""

LOWP_DTYPES: tuple[torch.dtype, ...] = () if INTERPRETED else (torch.bfloat16,)
"""Input dtypes whose products take the input dtype (tensor cores at their full rate, half the
operand registers; fp32 accumulation; chunk states and masked scores rounded to it, as
flash-linear-attention does): bf16, which has fp32's range. fp16 inputs take fp32 products:
rounding a state to fp16 overflows past 65504 where the output itself fits (a long sequence
with little decay, a large carried-in state). None under the interpreter, whose tl.dot
misreads bf16 operands (triton 3.9); tests set (torch.float16,) there to run the
low-precision path with values inside fp16's range."""


def _configs(tuned: tuple[str, ...]) -> list[Any]:
    """Tiles in ``tuned`` over {32, 64} x num_warps {4, 8} x num_stages {1, 2}."""
    out = []
    for tiles in itertools.product((32, 64), repeat=len(tuned)):
        for warps, stages in itertools.product((4, 8), (1, 2)):
            out.append(triton.Config(dict(zip(tuned, tiles)), num_warps=warps,
                                     num_stages=stages))
    return out


def _prune(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
    """Drop tiles wider than the padded head dim (they would only add masked work)."""
    args = {**named_args, **kwargs}
    limit = {"BK": max(16, next_power_of_2(args["D"])),
             "BV": max(16, next_power_of_2(args["DV"]))}
    kept = [c for c in configs if all(v <= limit.get(n, v) for n, v in c.kwargs.items())]
    return kept or configs[:1]


_AUTOTUNED: dict[tuple[int, tuple[str, ...], tuple[str, ...]], Any] = {}
_KERNEL_INFO: dict[int, tuple[bool, tuple[int, ...]]] = {}
_CHOSEN: dict[tuple[Any, ...], dict[str, Any]] = {}

BENCHMARKER: Callable[..., list[float]] | None = None
"""The autotuner's timer (triton.autotune's ``do_bench``); None: the device driver's. Tests
set a host timer to run the tuned launch path under the interpreter."""


def _launch(kernel: Any, grid: Callable[[dict[str, Any]], tuple[int, ...]], args: tuple,
            t: dict[str, int], tuned: tuple[str, ...], reset: tuple[str, ...] = (),
            **consts: Any) -> None:
    """Run ``kernel`` with the tiles ``t``. On a GPU/NPU the tiles named in ``tuned`` and the
    warps/stages are autotuned (triton.autotune, keyed on head dims, chunk and mode; configs
    that do not fit shared memory are skipped by the autotuner); under the interpreter they
    are ``t``'s. Tuned kernels write every element of their outputs each run, except the
    outputs named in ``reset``, which a tile writes in part (dK/dQ's dslope parts: one per D
    tile) and which the autotuner zeroes before each benchmarked config and before the
    chosen one runs (without it, the parts a 32-wide tile wrote while it was benchmarked
    were summed into a 64-wide winner's dslope: 4.8 relative off on the tuning call, a
    review). The scans update in place and keep ``t``."""
    info = _KERNEL_INFO.get(id(kernel))
    if info is None:  # per kernel: whether it takes DOT, where its tensor arguments are
        info = _KERNEL_INFO[id(kernel)] = ("DOT" in kernel.arg_names, _tensor_positions(args))
    if info[0]:
        consts["DOT"] = dot_precision()
    if not TUNE or not tuned:
        tiles, options = untuned(t, tuned)
        meta = {**tiles, **consts}
        kernel[grid(meta)](*args, **meta, **options)
        return
    key = (id(kernel), tuned, reset)
    fixed = {n: v for n, v in t.items() if n not in tuned}
    # The winner for these constexprs and argument dtypes (a superset of the autotuner's
    # key), launched without the autotuner's per-call bookkeeping (~10 us a launch on the
    # host, measured by benchmarks/lightning_host.py); what it runs is what the autotuner
    # runs on a cached key: the chosen config's kwargs, no reset (that follows tuning only).
    # (items in call-site order: one launch site always passes them in one order; a
    # kernel's tensor arguments are at fixed positions: its pointer parameters)
    chosen_key = (key, *fixed.items(), *consts.items(), *[args[i].dtype for i in info[1]])
    chosen = _CHOSEN.get(chosen_key)  # every constexpr and launch option, merged once
    if chosen is not None:
        kernel[grid(chosen)](*args, **chosen)
        return
    positions = _tensor_positions(args)
    if positions != info[1]:  # checked once per new key: the hot path relies on it
        raise RuntimeError(f"{getattr(kernel, '__name__', kernel)}: tensor arguments at "
                           f"{positions}, first launched with them at {info[1]}; every call "
                           "site must pass tensors for the kernel's pointer parameters")
    if key not in _AUTOTUNED:
        _AUTOTUNED[key] = triton.autotune(
            _configs(tuned), key=["D", "DV", "C", "R", *sorted(consts)],
            prune_configs_by={"early_config_prune": _prune}, do_bench=BENCHMARKER,
            reset_to_zero=list(reset) or None,
            # the winner per key on disk (triton's cache dir): the ~16 candidates x 6 tuned
            # launches of one (head dims, chunk, dtype) are compiled and timed once per
            # machine, not in every process (an H200 took minutes on a first call)
            cache_results=BENCHMARKER is None)(kernel)
    if not INTERPRETED:
        precompile(kernel, args, tuned, {**fixed, **consts})
    tuner = _AUTOTUNED[key]
    tuner[lambda meta: grid({**fixed, **consts, **meta})](*args, **fixed, **consts)
    _CHOSEN[chosen_key] = {**fixed, **consts, **tuner.best_config.all_kwargs()}


def _tensor_positions(args: tuple) -> tuple[int, ...]:
    """Where a launch's tensor arguments (its pointer parameters) are in ``args``."""
    return tuple(i for i, a in enumerate(args) if isinstance(a, Tensor))


_threads = os.environ.get("GRAPHOPT_TRITON_COMPILE_THREADS", "").strip()
COMPILE_THREADS = int(_threads) if _threads.isdigit() else min(16, os.cpu_count() or 1)
"""Threads that compile a tuned launch's candidate configs at once, before the autotuner
times them (``GRAPHOPT_TRITON_COMPILE_THREADS``; 0 or 1: the autotuner compiles them one by
one on first use)."""

_PRECOMPILED: set[tuple[Any, ...]] = set()


def precompile(kernel: Any, args: tuple, tuned: tuple[str, ...], meta: dict[str, Any]) -> int:
    """Compile every candidate config of a tuned launch (the autotuner's, after its pruning)
    for these arguments in ``COMPILE_THREADS`` threads, once per launch, argument dtypes and
    constexprs; returns the number of configs submitted (0 when already done or disabled).

    The autotuner compiles its candidates one at a time when it first times them: on an H200
    (2026-12-04) one (head dims, chunk, dtype) key's ~16 configs x 6 launches took minutes,
    and a D=128 fp32 correctness case did not finish in 300 s; one compile is 0.3-15 s on
    this 2-core CPU (ptxas is slow on register-heavy configs). Triton's compile releases the
    GIL for most of its time (16 configs of dK for sm_90: 9.4 s one by one, 5.2 s on 2
    threads). Uses Triton's ``AsyncCompileMode`` (``triton.runtime._async_compile``, what
    Inductor's parallel compile drives): ``kernel.warmup`` with each config's options puts
    the compiled kernel into the JIT cache the autotuner reads, with the specialization of
    these arguments. Configs that fail to compile are left to the autotuner (which skips
    them), as is everything when Triton lacks the API.

    Args:
        kernel: the ``triton.jit`` function (not its autotuner).
        args: the launch's positional arguments (tensors of any dtype, ints, floats), as
            the autotuner will receive them.
        tuned: the constexpr tile names the autotuner varies (``("BK", "BV")``).
        meta: every other constexpr (``D``, ``DV``, ``C``, ``R``, flags) with its value.

    Returns:
        configs submitted (0: already done for this key, threads <= 1, or no API).
    Raises nothing: compile errors stay for the autotuner to meet."""
    if COMPILE_THREADS <= 1:
        return 0
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # an older Triton: the autotuner compiles as it goes
        return 0
    dtypes = tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor))
    done = (id(kernel), tuned, dtypes, tuple(sorted(meta.items())))
    if done in _PRECOMPILED:
        return 0
    _PRECOMPILED.add(done)
    configs = _prune(_configs(tuned), {}, **meta)
    with ThreadPoolExecutor(COMPILE_THREADS) as pool, \
            AsyncCompileMode(pool, ignore_errors=True):
        for cfg in configs:
            try:
                kernel.warmup(*args, grid=(1,), **meta, **cfg.all_kwargs())
            except Exception:  # noqa: BLE001  (left to the autotuner, which reports it)
                continue
    return len(configs)


class _Chunks(NamedTuple):
    """Where the chunk slots are: dense batches (B sequences of S, slot p = i * N_per + c) or
    packed sequences (slot p -> (sequence, chunk) from the CHUNKS table, built on the device
    from cu_seqlens: no host synchronization, one launch per kernel for every sequence)."""

    n_seqs: int
    n_per: int  # chunks per sequence (dense only)
    slots: int  # P: chunk slots (an upper bound for packed sequences; spare slots idle)
    cu: Tensor  # [N + 1] int32 (packed) or a placeholder
    table: Tensor  # [P, 2] int32 (sequence, chunk) (packed) or a placeholder
    offsets: Tensor  # [N + 1] int32 first slot of each sequence (packed) or a placeholder
    varlen: bool
    packed: Tensor  # int32 [2 P + 2 (N + 1) + 1]: table, offsets, cu, check; or a placeholder


def packed_chunk_size(seq: int, n_seqs: int, c: int) -> int:
    """Elements of :func:`_chunks`' one int32 buffer for ``n_seqs`` packed sequences of ``seq``
    tokens in all, chunks of ``c`` rows: the table [P, 2] with P = floor(T / C) + N slots,
    the first-slot offsets [N + 1], cu_seqlens as int32 [N + 1] and cu_seqlens' check [1]."""
    return 2 * (seq // c + n_seqs) + 2 * (n_seqs + 1) + 1


def _chunks(batch: int, seq: int, c: int, cu_seqlens: Tensor | None, placeholder: Tensor,
            packed: Tensor | None = None) -> _Chunks:
    """The chunk slots; for packed sequences the forward builds them (one launch) and the
    backward takes the forward's ``packed`` buffer (:attr:`_Chunks.packed`) back."""
    if cu_seqlens is None:
        n = cdiv(seq, c)
        return _Chunks(batch, n, batch * n, placeholder, placeholder, placeholder, False,
                       placeholder)
    n_seqs = cu_seqlens.shape[0] - 1
    # sum_i ceil(L_i / C) <= floor(T / C) + N: a static bound, so no count leaves the device.
    slots = seq // c + n_seqs
    size = packed_chunk_size(seq, n_seqs, c)
    build = packed is None
    if packed is None:
        packed = torch.empty(size, dtype=torch.int32, device=placeholder.device)
    elif packed.numel() != size or packed.dtype != torch.int32:
        raise ValueError(f"the forward's chunk buffer has {packed.numel()} {packed.dtype} "
                         f"elements, {size} int32 expected for {n_seqs} sequences of {seq} "
                         f"tokens in chunks of {c}: pass the forward's own")
    table = packed[:2 * slots].view(slots, 2)
    offsets, cu = packed[2 * slots:-1].view(2, n_seqs + 1).unbind(0)
    if build:
        ok = packed[-1:]
        _chunk_table[(cdiv(slots, TABLE_BLOCK),)](
            cu_seqlens.contiguous(), table, offsets, cu, ok, n_seqs, slots, seq, C=c,
            BP=TABLE_BLOCK, BN=TABLE_BLOCK)
        # asynchronous on a GPU (no host synchronization); the caller skips its own check
        torch._assert_async(ok, f"cu_seqlens must increase strictly from 0 to S = {seq}")
    return _Chunks(n_seqs, 0, slots, cu, table, offsets, True, packed)


TABLE_BLOCK = 64
"""Slots per program, and sequences per step of its walk, of :func:`_chunk_table`."""


def chunk_table_reference(cu_seqlens: Tensor, seq: int, c: int) -> tuple[Tensor, Tensor]:
    """What :func:`_chunk_table` computes, in torch ops (the tests' reference): (table
    [floor(T / C) + N, 2] int32 of (sequence, chunk), offsets [N + 1] int32)."""
    cu = cu_seqlens.to(torch.int32)
    n_seqs = cu.shape[0] - 1
    counts = (cu[1:] - cu[:-1] + (c - 1)) // c
    offsets = torch.cat([cu.new_zeros(1), torch.cumsum(counts, 0, dtype=torch.int32)])
    p = torch.arange(seq // c + n_seqs, dtype=torch.int32, device=cu.device)
    owner = torch.searchsorted(offsets[1:], p, right=True).clamp_(max=n_seqs - 1)
    return torch.stack([owner.to(torch.int32), p - offsets[owner]], dim=1), offsets


def _states(k: Tensor, v: Tensor, slope: Tensor, initial: Tensor | None, t: dict[str, int],
            g: _Chunks, seq: int, group: int) -> tuple[Tensor, Tensor]:
    """(S[c] for every chunk slot [P, H, D, Dv] in _state_dtype, final states
    [N, H, D, Dv] fp32);
    k, v: [B, Hk, S | T, D | Dv] (H = Hk * group query heads; any strides with the last dim
    contiguous, see :func:`_kernel_input`), initial: [N, H, D, Dv] or None."""
    heads = slope.shape[0]
    d, dv = k.shape[-1], v.shape[-1]
    buf = torch.empty(g.slots, heads, d, dv, dtype=_state_dtype(k.dtype), device=k.device)
    final = torch.empty(g.n_seqs, heads, d, dv, dtype=torch.float32, device=k.device)
    init = initial.float().contiguous() if initial is not None else final

    def parallel() -> None:
        _launch(_chunk_outer, lambda m: (g.slots, heads, _ntiles(d, dv, m)),
                (k, v, slope, buf, g.cu, g.table, seq, heads, group, g.n_per, 1.0,
                 *_strides(k), *_strides(v)), t, ("BK", "BV"),
                D=d, DV=dv, QUERY=False, LOWP=_lowp(k.dtype), VARLEN=g.varlen,
                SXS=k.stride(2), SYS=v.stride(2))
        _run_scan(buf, slope, init, final, g, seq, d, dv, t, initial is not None, False)

    def sequential() -> None:
        _launch(_chunk_states, lambda m: (g.n_seqs * heads, _ntiles(d, dv, m)),
                (k, v, slope, buf, init, final, g.cu, g.table, g.offsets, seq, heads, group,
                 g.n_per, g.n_seqs, g.slots, *_strides(k), *_strides(v)), t, ("BK", "BV"),
                D=d, DV=dv, LOWP=_lowp(k.dtype), VARLEN=g.varlen, SKS=k.stride(2),
                SVS=v.stride(2), HAS_INIT=initial is not None)

    _state_pass(("forward", g, heads, d, dv, t, k.dtype), parallel, sequential)
    return buf, final


STATE_PASS = "auto"
"""How the chunk states (and, in the backward, dS_end) are computed: "parallel" (one
launch parallel over chunks for the per-chunk outer products, then a scan: 2 launches,
parallel over chunks x heads x tiles), "sequential" (one launch walking each sequence's
chunks in order, per (sequence, head, tile): 1 launch, parallel over heads x tiles only;
flash-linear-attention's ``chunk_fwd_kernel_h`` way) or "auto": on a GPU/NPU the faster of
the two, timed once per (pass, head dims, chunk, dtype, power-of-two buckets of sequences x
heads and of chunks per sequence), "parallel" for packed sequences and under the
interpreter. With the same tiles both give the same numbers bit for bit (the chunk sums are
rounded to the state dtype either way); autotuned, each pass has its own tiles, and the
results differ by rounding as any two tile choices do."""

_STATE_PASS_CHOICE: dict[tuple[Any, ...], str] = {}


def _state_pass(key: tuple[Any, ...], parallel: Callable[[], None],
                sequential: Callable[[], None]) -> None:
    """Run the state pass :data:`STATE_PASS` picks (``key``: (pass, _Chunks, heads, d, dv,
    tiles, dtype), bucketed here)."""
    mode = STATE_PASS
    if mode == "auto":
        if INTERPRETED or key[1].varlen:
            # packed sequences: the sequential pass takes as long as the longest sequence,
            # which is not known on the host (a choice timed on even lengths would be reused
            # for one long sequence and many short ones)
            mode = "parallel"
        else:
            which, g, heads, d, dv, t, dtype = key
            bucket = (which, d, dv, t["C"], t["R"], dtype, g.varlen,
                      next_power_of_2(g.n_seqs * heads),
                      next_power_of_2(max(1, g.slots // max(1, g.n_seqs))))
            mode = _STATE_PASS_CHOICE.get(bucket, "")
            if not mode:
                mode = _STATE_PASS_CHOICE[bucket] = _faster(parallel, sequential)
    elif mode not in ("parallel", "sequential"):
        raise ValueError(f"STATE_PASS must be 'auto', 'parallel' or 'sequential', got {mode!r}")
    (parallel if mode == "parallel" else sequential)()


def _faster(parallel: Callable[[], None], sequential: Callable[[], None]) -> str:
    """"parallel" or "sequential", whichever is faster by the autotuner's timer (each run
    once first: compiles and tunes its launches). Both only write their outputs (the scan
    rewrites what the outer-product launch wrote), so running them twice is harmless. A
    timer that fails (a backend without Triton's benchmarking) leaves "parallel"."""
    bench = BENCHMARKER or triton.testing.do_bench
    times = []
    for fn in (parallel, sequential):
        fn()
        try:
            ms = bench(fn)
        except Exception:  # noqa: BLE001  (timing is an optimization, never an error)
            return "parallel"
        times.append(ms[0] if isinstance(ms, (list, tuple)) else float(ms))
    return "parallel" if times[0] <= times[1] else "sequential"


def _run_scan(buf: Tensor, slope: Tensor, init: Tensor, final: Tensor, g: _Chunks, seq: int,
              d: int, dv: int, t: dict[str, int], has_init: bool, reverse: bool) -> None:
    """The sequential scan over each sequence's chunks (of C * R rows), in place on buf."""
    _scan[(g.n_seqs * slope.shape[0], _ntiles(d, dv, t))](
        buf, slope, init, final, g.cu, g.offsets, seq, slope.shape[0], g.n_per, D=d, DV=dv,
        C=t["C"] * t["R"], BK=t["BK"], BV=t["BV"], HAS_INIT=has_init, REVERSE=reverse,
        VARLEN=g.varlen, **SCAN_OPTIONS)


INT32_MAX = 2**31 - 1


def _kernel_input(x: Tensor, chunk: int) -> Tensor:
    """[B, H, S, X] as the kernels read it: in place when its last dim is contiguous (every
    other stride is an argument: "bhsd", "bshd" through the public API's transpose, the
    q / k / v views of a fused QKV projection; no copy), else a contiguous copy; float64
    becomes float32 (the kernels' products take the input dtype: fp32 / bf16 / fp16).
    Also copied: a row stride so large that an offset inside one chunk of ``chunk`` rows
    (row * stride + column, computed in int32 in the kernels; only the chunk's start is
    int64) would pass 2^31 - 1 (found by a review: a sequence-first fused projection with
    B * 3 * H * D > 2^31 / 1023 elements per row at block_size 1024 read out of bounds)."""
    if x.dtype == torch.float64:
        x = x.float()  # keeps a dense tensor's strides: checked below as any other
    rows = min(chunk, x.shape[2])
    in_place = (x.stride(-1) == 1 or x.shape[-1] == 1) and \
        max(rows - 1, 0) * x.stride(2) + x.shape[-1] <= INT32_MAX
    return x if in_place else x.contiguous()


def _strides(x: Tensor) -> tuple[int, int]:
    """(batch, head) strides of a [B, H, S, X] kernel input or output (elements), runtime
    arguments. Its row stride ``x.stride(2)`` is passed as a constexpr (``S?S``), so every
    in-tile offset ``row * stride`` folds into the address arithmetic as it did with the
    fixed [B * H * S, X] row layout: runtime row strides made the dK kernel at D = 256 with a
    trained slope spill registers on sm_90 (255 registers + 8 stack bytes in its best
    config; 218 and none before strides; graphopt.kernels.resources). A new layout (bhsd,
    bshd, a fused QKV split) compiles and tunes its own kernels once."""
    sb, sh = x.stride()[:2]  # one call (host time: ~24 calls a step)
    return sb, sh


def _forward(q: Tensor, k: Tensor, v: Tensor, slope: Tensor, scale: float,
             initial: Tensor | None, block_size: int, cu_seqlens: Tensor | None
             ) -> tuple[Tensor, Tensor, Tensor, _Chunks]:
    """(o [B, H, S, Dv] in q's dtype (fp32 for fp64), states [P, H, D, Dv] (_state_dtype), final
    [N, H, D, Dv] fp32, chunk slots)."""
    b, h, seq, d = q.shape
    dv = v.shape[-1]
    t = _tiles(d, dv, block_size)
    slope_f = slope.float().contiguous()
    g = _chunks(b, seq, t["C"] * t["R"], cu_seqlens, slope_f)
    q_, k_, v_ = (_kernel_input(x, t["C"] * t["R"]) for x in (q, k, v))
    group = h // k.shape[1]
    states, final = _states(k_, v_, slope_f, initial, t, g, seq, group)
    o = torch.empty(b, h, seq, dv, dtype=_out_dtype(q), device=q.device)
    _launch(_chunk_out, lambda m: (g.slots * t["R"], h, cdiv(dv, m["BV"])),
            (q_, k_, v_, slope_f, states, o, g.cu, g.table, seq, h, group, g.n_per,
             float(scale), *_strides(q_), *_strides(k_), *_strides(v_), *_strides(o)), t,
            ("BK", "BV"), D=d, DV=dv, GRAD_V=False, LOWP=_lowp(q.dtype), VARLEN=g.varlen,
            SQS=q_.stride(2), SKS=k_.stride(2), SZS=v_.stride(2), SOS=o.stride(2))
    return o, states, final, g


def _backward(grad_o: Tensor, grad_state: Tensor | None, q: Tensor, k: Tensor, v: Tensor,
              slope: Tensor, scale: float, initial: Tensor | None, block_size: int,
              cu_seqlens: Tensor | None, need_slope_grad: bool, need_q: bool = True,
              need_kv: bool = True, chunks: Tensor | None = None
              ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor]:
    """Gradients from the initial states [N, H, D, Dv] (the chunk states are recomputed by
    the forward's two parallel passes: selective rematerialization). ``need_q`` /
    ``need_kv`` False: the dQ, resp. dK and dV, launches are skipped (zeros returned)
    unless ``need_slope_grad`` (its parts come from the dQ and dK launches). ``chunks``:
    packed sequences' chunk buffer from the forward (None: built again)."""
    b, h, seq, d = q.shape
    dv = v.shape[-1]
    t = _tiles(d, dv, block_size)
    slope_f = slope.float().contiguous()
    g = _chunks(b, seq, t["C"] * t["R"], cu_seqlens, slope_f, chunks)
    q_, k_, v_, go = (_kernel_input(x, t["C"] * t["R"]) for x in (q, k, v, grad_o))
    group = h // k.shape[1]
    # Two passes, each one launch for both of its parts (_chunk_outer_pair, _scan_pair):
    # the chunk states S[c] recomputed from the initial state as the forward does, and
    # g[c] = (Q_c * a)^T dO_c with, in place, the reverse scan dS_end[c] = E[c] where
    # E[last] = dS_T and E[c-1] = lambda^L_c E[c] + g[c]; what is left is dS of the initial
    # state.
    states = torch.empty(g.slots, h, d, dv, dtype=_state_dtype(k.dtype), device=q.device)
    dsend = torch.empty(g.slots, h, d, dv, dtype=_state_dtype(q.dtype), device=q.device)
    final = torch.empty(g.n_seqs, h, d, dv, dtype=torch.float32, device=q.device)
    dh0 = torch.empty(g.n_seqs, h, d, dv, dtype=torch.float32, device=q.device)
    init = initial.float().contiguous() if initial is not None else final
    dht = grad_state.float().contiguous() if grad_state is not None else dh0
    rows = g.n_seqs * h
    strides = (*_strides(k_), *_strides(v_), *_strides(q_), *_strides(go))
    row_strides: dict[str, Any] = dict(SKS=k_.stride(2), SVS=v_.stride(2), SQS=q_.stride(2),
                                       SDS=go.stride(2))
    flags: dict[str, Any] = dict(HAS_INIT=initial is not None, HAS_DHT=grad_state is not None)
    # the buffers travel in these argument tuples, cleared after the pass (the states are
    # freed before dK and dV below)
    args: dict[str, tuple[Any, ...]] = {}
    args["outer"] = (k_, v_, q_, go, slope_f, states, dsend, g.cu, g.table, seq, h, group,
                  g.n_per, g.slots, float(scale), *strides)
    args["scan"] = (states, init, final, dsend, dht, dh0, slope_f, g.cu, g.offsets, seq, h,
                 g.n_per, rows)
    args["seq"] = (k_, v_, q_, go, slope_f, states, init, final, dsend, dht, dh0, g.cu, g.table,
                g.offsets, seq, h, group, g.n_per, g.n_seqs, g.slots, rows, float(scale),
                *strides)

    def parallel() -> None:
        _launch(_chunk_outer_pair, lambda m: (2 * g.slots, h, _ntiles(d, dv, m)),
                args["outer"], t, ("BK", "BV"), D=d, DV=dv, LOWP=_lowp(q.dtype),
                VARLEN=g.varlen, **row_strides)
        _scan_pair[(2 * rows, _ntiles(d, dv, t))](
            *args["scan"], D=d, DV=dv, C=t["C"] * t["R"], BK=t["BK"], BV=t["BV"],
            VARLEN=g.varlen, **flags, **SCAN_OPTIONS)

    def sequential() -> None:
        _launch(_chunk_states_pair, lambda m: (2 * rows, _ntiles(d, dv, m)), args["seq"], t,
                ("BK", "BV"), D=d, DV=dv, LOWP=_lowp(q.dtype), VARLEN=g.varlen, **flags,
                **row_strides)

    _state_pass(("backward", g, h, d, dv, t, q.dtype), parallel, sequential)
    args.clear()
    del final, init
    want_q, want_kv = need_q or need_slope_grad, need_kv or need_slope_grad
    # dslope parts per (program, D tile): room for the narrowest D tile (16), zeros where a
    # wider tuned tile leaves slots unused (zeroed again by the autotuner), so BK is tuned
    # too. Without a slope gradient the kernels skip those terms (one placeholder, not
    # zero-filled: a fill is a kernel launch on a GPU).
    nk = cdiv(d, 16)
    parts = (torch.zeros(2, g.slots * t["R"], h, nk, dtype=torch.float32, device=q.device)
             if need_slope_grad else slope_f.new_empty(2, 1, h, nk))  # never read: no fill

    def dqdk(grad_k: bool, states: Tensor, out: Tensor, part: Tensor) -> None:
        """dK (per K/V head) or dQ into ``out`` (the kernel's DQ and DK: one is written)."""
        heads = h // group if grad_k else h
        _launch(_chunk_dqdk, lambda m: (g.slots * t["R"], heads, cdiv(d, m["BK"])),
                (q_, k_, v_, go, slope_f, states, dsend, out, out, part, g.cu, g.table, seq,
                 h, group, g.n_per, nk, float(scale), *_strides(q_), *_strides(k_),
                 *_strides(v_), *_strides(go), *_strides(out)), t, ("BK", "BV"),
                ("DSLOPE",), D=d, DV=dv, GRAD_K=grad_k, SLOPE_GRAD=need_slope_grad,
                LOWP=_lowp(q.dtype), VARLEN=g.varlen, SQS=q_.stride(2), SKS=k_.stride(2),
                SVS=v_.stride(2), SDS=go.stride(2), SOS=out.stride(2))

    # dQ first: nothing after it reads the chunk states (dK takes dS_end in their place),
    # so they are freed before dK and dV are allocated (peak: the states, dS_end and dQ, or
    # dS_end and the three gradients; not all five).
    dq = (torch.empty if want_q else torch.zeros)(b, h, seq, d, dtype=_out_dtype(q),
                                                   device=q.device)
    if want_q:
        dqdk(False, states, dq, parts[1])
    del states
    # dK, dV in K/V's heads: each program sums its GQA group's query heads.
    new = torch.empty if want_kv else torch.zeros
    dk = new(b, h // group, seq, d, dtype=_out_dtype(q), device=q.device)
    dvv = new(b, h // group, seq, dv, dtype=_out_dtype(q), device=q.device)
    if want_kv:
        dqdk(True, dsend, dk, parts[0])
        _launch(_chunk_out, lambda m: (g.slots * t["R"], h // group,
                                       cdiv(dv, m["BV"])),
                (q_, k_, go, slope_f, dsend, dvv, g.cu, g.table, seq, h, group, g.n_per,
                 float(scale), *_strides(q_), *_strides(k_), *_strides(go), *_strides(dvv)),
                t, ("BK", "BV"), D=d, DV=dv, GRAD_V=True,
                LOWP=_lowp(q.dtype), VARLEN=g.varlen, SQS=q_.stride(2), SKS=k_.stride(2),
                SZS=go.stride(2), SOS=dvv.stride(2))
    dslope = parts.sum(dim=(0, 1, 3)) if need_slope_grad else None
    return dq, dk, dvv, dslope, dh0


def triton_forward(q: Tensor, k: Tensor, v: Tensor, slope: Tensor, scale: float,
                  initial_state: Tensor | None, block_size: int
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """Same contract as ``chunked.chunked_forward``, except that k and v keep their Hk heads
    (GQA: query head h reads K/V head h // (H / Hk), nothing expanded) and that the only
    checkpoint is the initial state (the backward recomputes every chunk's state from it in
    two parallel passes): (o [B, H, S, Dv] in q's dtype (fp32 for fp64), final state
    [B, H, D, Dv] fp32, checkpoints [B, H, 1, D, Dv] fp32, or [B, H, 0, D, Dv] without an
    initial state). The block length is rounded up to a power of two >= 16."""
    b, h, _, d = q.shape
    dv = v.shape[-1]
    o, _, final, _ = _forward(q, k, v, slope, scale, initial_state, block_size, None)
    if initial_state is None:  # no checkpoint: the backward starts from zero (HAS_INIT off),
        first = final.new_empty(b, h, 0, d, dv)  # no zero-filled state (a fill kernel)
    else:
        first = initial_state.to(torch.float32, copy=True).reshape(b, h, 1, d, dv)
    return o, final, first


def triton_backward(grad_o: Tensor, grad_state: Tensor | None, q: Tensor, k: Tensor,
                   v: Tensor, slope: Tensor, scale: float, checkpoints: Tensor,
                   block_size: int, need_slope_grad: bool, need_q: bool = True,
                   need_kv: bool = True
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor]:
    """Same contract as ``chunked.chunked_backward`` with k, v of Hk heads (dk, dv are
    [B, Hk, S, D | Dv] in q's dtype, each GQA group summed in the kernels) and checkpoints
    [B, H, 1, D, Dv], the initial state, or [B, H, 0, D, Dv] for none (a zero initial
    state, not materialized): the chunk states are recomputed from it by the
    forward's two parallel passes, so the forward saves q, k, v, slope and one state only
    (selective rematerialization)."""
    initial = checkpoints[:, :, 0] if checkpoints.shape[2] else None
    return _backward(grad_o, grad_state, q, k, v, slope, scale, initial, block_size, None,
                     need_slope_grad, need_q, need_kv)


def triton_varlen_forward(q: Tensor, k: Tensor, v: Tensor, slope: Tensor, scale: float,
                          initial_state: Tensor | None, block_size: int, cu_seqlens: Tensor
                          ) -> tuple[Tensor, Tensor, Tensor]:
    """Packed sequences in one launch per kernel. q: [1, H, T, D], k, v: [1, Hk, T, D | Dv]
    (GQA not expanded), cu_seqlens [N + 1] int on q's device (validated by the caller),
    initial_state [N, H, D, Dv] or None. Returns (o [1, H, T, Dv] in q's dtype, final
    states [N, H, D, Dv] fp32, the chunk slots for the backward: int32
    [:func:`packed_chunk_size`])."""
    o, _, final, g = _forward(q, k, v, slope, scale, initial_state, block_size, cu_seqlens)
    return o, final, g.packed


def triton_varlen_backward(grad_o: Tensor, grad_state: Tensor | None, q: Tensor, k: Tensor,
                           v: Tensor, slope: Tensor, scale: float,
                           initial_state: Tensor | None, block_size: int,
                           cu_seqlens: Tensor, need_slope_grad: bool,
                           chunks: Tensor | None = None
                           ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor]:
    """Gradients of :func:`triton_varlen_forward` (dq [1, H, T, D] in q's dtype; dk, dv
    [1, Hk, T, D | Dv] in q's dtype, each GQA group summed in the kernels; dslope [H] or
    None; d initial_state [N, H, D, Dv]). ``chunks``: the forward's chunk slots (None:
    built again, one launch)."""
    return _backward(grad_o, grad_state, q, k, v, slope, scale, initial_state, block_size,
                     cu_seqlens, need_slope_grad, chunks=chunks)


class LaunchSpec(NamedTuple):
    """One kernel launch of a forward + backward, for ahead-of-time compilation
    (graphopt.kernels.resources): its argument types, the constexprs it is launched with,
    which of them the GPU autotunes, and the fixed launch options of an untuned one."""

    name: str
    kernel: Any
    types: dict[str, str]
    constexprs: dict[str, Any]
    tuned: tuple[str, ...]


def launch_specs(d: int, dv: int, block_size: int, dtype: str = "bf16",
                 varlen: bool = False, slope_grad: bool = True) -> list[LaunchSpec]:
    """The launches of one forward + backward at head dims (d, dv), chunk ``block_size`` and
    input dtype ("bf16", "fp16", "fp32"): state pass, scan, output, the backward's state and
    g passes (one launch), its scan and reverse scan (one launch), dQ, dK, dV
    (``slope_grad``: with the dslope terms, the kernels' larger variant), then the
    sequential state passes that :data:`STATE_PASS` may take instead (forward; backward)."""
    from graphopt.kernels.resources import argument_types

    lowp = dtype == "bf16"  # as LOWP_DTYPES on a GPU
    stored = "*bf16" if lowp else "*fp32"  # _state_dtype
    state = {n: "*fp32" for n in ("SLOPE", "INIT", "FINAL", "DSLOPE")}
    state.update({n: "*fp32" for n in ("DHT", "DH0")})
    state.update({n: stored for n in ("BUF", "STATES", "DSEND")})
    index = {n: "*i32" for n in ("CU", "CHUNKS", "OFFS")}
    t = _tiles(d, dv, block_size)

    def spec(name: str, kernel: Any, tuned: tuple[str, ...], out: str | None = None,
             **consts: Any) -> LaunchSpec:
        explicit = {**state, **index, **({"OUT": out} if out else {})}
        types = argument_types(kernel, explicit, f"*{dtype}", floats=("scale", "x_scale"))
        params = {p.name for p in kernel.params if p.is_constexpr}
        rows = dict(SXS=d, SYS=dv, SQS=d, SKS=d, SVS=dv, SZS=dv, SDS=dv)  # "bhsd" inputs
        fixed = {k: v for k, v in {**t, **rows, **consts, "D": d, "DV": dv, "VARLEN": varlen,
                                   "DOT": dot_precision(),
                                   "LOWP": lowp}.items() if k in params}
        return LaunchSpec(name, kernel, types, fixed, tuned)

    scan: dict[str, Any] = {"C": t["C"] * t["R"], "HAS_INIT": True}
    return [spec("kv states", _chunk_outer, ("BK", "BV"), out=stored, QUERY=False),
            spec("scan", _scan, (), REVERSE=False, **scan),
            spec("output", _chunk_out, ("BK", "BV"), GRAD_V=False, SOS=dv),
            spec("kv + g states", _chunk_outer_pair, ("BK", "BV")),
            spec("scan + reverse scan", _scan_pair, (), C=scan["C"], HAS_INIT=True,
                 HAS_DHT=True),
            spec("dQ", _chunk_dqdk, ("BK", "BV"), GRAD_K=False, SLOPE_GRAD=slope_grad,
                 SOS=d),
            spec("dK", _chunk_dqdk, ("BK", "BV"), GRAD_K=True, SLOPE_GRAD=slope_grad, SOS=d),
            spec("dV", _chunk_out, ("BK", "BV"), GRAD_V=True, SOS=dv),
            # the sequential state passes (STATE_PASS), in place of the pairs above
            spec("states (sequential)", _chunk_states, ("BK", "BV"), HAS_INIT=True),
            spec("states + dS (sequential)", _chunk_states_pair, ("BK", "BV"), HAS_INIT=True,
                 HAS_DHT=True)]


def launch_configs(spec: LaunchSpec) -> list[tuple[dict[str, Any], int, int]]:
    """(constexprs, num_warps, num_stages) a launch may take on a GPU: the autotuner's
    candidates after pruning for a tuned kernel, the scans' fixed tiles and options."""
    if not spec.tuned:
        return [(spec.constexprs, SCAN_OPTIONS["num_warps"], SCAN_OPTIONS["num_stages"])]
    out = []
    for cfg in _prune(_configs(spec.tuned), {}, **spec.constexprs):
        out.append(({**spec.constexprs, **cfg.kwargs}, cfg.num_warps, cfg.num_stages))
    return out
