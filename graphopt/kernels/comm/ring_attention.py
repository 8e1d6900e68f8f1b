"""Causal ring attention with load balancing: softmax attention over a sequence split across
the P ranks of a CP group, keys and values passed around the ring.

Layout ("zigzag", as Megatron-LM's context parallelism and Llama 3's CP balance causal
work): the sequence is cut into 2P chunks; rank r holds chunks r and 2P-1-r, concatenated
([B, H, 2c, D], c = S / 2P), so every rank does the same amount of causal work.

Forward (Liu et al. 2023, Ring Attention; online softmax as in FlashAttention-2): P steps;
at step s rank r holds the keys/values of rank (r - s) mod P, attends its two query chunks
to those two key chunks by their global chunk order (an earlier chunk fully, the same chunk
causally, a later one not at all), merges the partial results with a running row maximum
and sum, and passes the keys/values to rank r + 1 (isend/irecv) while it computes.
Backward: with the saved log-sum-exp L_i, P_ij = exp(s_ij - L_i), D_i = rowsum(dO_i O_i)
(O as returned, in q's dtype, as FlashAttention-2's backward reads it):
dS = P (dO V^T - D), dQ += dS K scale, dK += dS^T Q scale, dV += P^T dO; keys/values make
the same trip and their gradients travel with them, arriving home after P steps.

Exact (the same sums in another order); float64 tests compare with SDPA on the whole
sequence. Memory per step: [2c, 2c] scores per head (plain matmuls, no fused kernel: the
CPU has no SDPA variant returning the log-sum-exp that torch exposes for this).

Errors: ValueError for a local length that is not even (two chunks), heads of q and k/v
that differ (expand GQA heads first).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from graphopt.kernels import acc_dtype


def zigzag_chunks(rank: int, size: int) -> tuple[int, int]:
    """The two global chunk indices (of 2 x size) rank ``rank`` holds."""
    return rank, 2 * size - 1 - rank


def _pass(tensors: list[Tensor], pg: dist.ProcessGroup) -> list[Tensor]:
    """Send ``tensors`` to the next rank of the ring and receive the previous rank's."""
    size, rank = dist.get_world_size(pg), dist.get_rank(pg)
    nxt = dist.get_global_rank(pg, (rank + 1) % size)
    prv = dist.get_global_rank(pg, (rank - 1) % size)
    # contiguous receive buffers: gloo (and NCCL) reject strided ones, and K/V arrive as
    # transformers' transpose views when there is no GQA repeat to copy them
    out = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, pg) for t in tensors] + \
        [dist.P2POp(dist.irecv, o, prv, pg) for o in out]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out


def _pairs(rank: int, src: int, size: int, c: int) -> list[tuple[slice, slice, bool]]:
    """(query rows, key rows, causal) of the local [2c] blocks that attend to each other."""
    out = []
    for qi, qc in enumerate(zigzag_chunks(rank, size)):
        for ki, kc in enumerate(zigzag_chunks(src, size)):
            if kc <= qc:
                out.append((slice(qi * c, (qi + 1) * c), slice(ki * c, (ki + 1) * c), kc == qc))
    return out


def _scores(q: Tensor, k: Tensor, scale: float, causal: bool) -> Tensor:
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        mask = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


@torch.library.custom_op("graphopt::ring_attention_fwd", mutates_args=())
def ring_attention_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, group: str,
                       size: int) -> tuple[Tensor, Tensor]:
    """The forward (module docstring) over the ``size`` ranks of ``group`` (its name, ""
    the world): (out [B, H, 2c, Dv] in q's dtype, lse [B, H, 2c] in the accumulation
    dtype, float32 or float64). A ``torch.library`` op with :func:`ring_attention_bwd`
    registered as its autograd, so Dynamo keeps a layer with ring attention in one graph
    (the exchange is opaque) and AOTAutograd sees one forward and one backward op."""
    from graphopt.distributed import group_by_name

    pg = group_by_name(group, size, "ring attention")
    rank = dist.get_rank(pg)
    c = q.shape[2] // 2
    acc = acc_dtype(q.dtype)
    qa = q.to(acc)
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=acc, device=q.device)
    row_max = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    row_sum = torch.zeros(q.shape[:3], dtype=acc, device=q.device)
    kv = [k, v]
    for step in range(size):
        src = (rank - step) % size
        nxt = _pass(kv, pg) if step < size - 1 else None
        ka, va = kv[0].to(acc), kv[1].to(acc)
        for rows, cols, causal in _pairs(rank, src, size, c):
            s = _scores(qa[:, :, rows], ka[:, :, cols], scale, causal)
            new_max = torch.maximum(row_max[:, :, rows], s.amax(-1))
            keep = torch.exp(row_max[:, :, rows] - new_max)
            p = torch.exp(s - new_max.unsqueeze(-1))
            row_sum[:, :, rows] = row_sum[:, :, rows] * keep + p.sum(-1)
            out[:, :, rows] = out[:, :, rows] * keep.unsqueeze(-1) + p @ va[:, :, cols]
            row_max[:, :, rows] = new_max
        if nxt is not None:
            kv = nxt
    out = out / row_sum.unsqueeze(-1)
    return out.to(q.dtype), row_max + torch.log(row_sum)


@ring_attention_fwd.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, scale: float, group: str,
      size: int) -> tuple[Tensor, Tensor]:
    return (q.new_empty(*q.shape[:3], v.shape[-1]),
            q.new_empty(q.shape[:3], dtype=acc_dtype(q.dtype)))


@torch.library.custom_op("graphopt::ring_attention_bwd", mutates_args=())
def ring_attention_bwd(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                       lse: Tensor, scale: float, group: str, size: int
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in q's, k's and v's dtypes (module docstring): keys/values make the
    forward's trip again with their gradients, which arrive home after ``size`` moves."""
    from graphopt.distributed import group_by_name

    pg = group_by_name(group, size, "ring attention")
    rank = dist.get_rank(pg)
    c = q.shape[2] // 2
    acc = lse.dtype
    qa, do = q.to(acc), grad_out.to(acc)
    delta = (do * out.to(acc)).sum(-1)
    dq = torch.zeros_like(qa)
    kv = [k, v]
    dkv = [torch.zeros(k.shape, dtype=acc, device=k.device),
           torch.zeros(v.shape, dtype=acc, device=v.device)]
    for step in range(size):
        src = (rank - step) % size
        ka, va = kv[0].to(acc), kv[1].to(acc)
        for rows, cols, causal in _pairs(rank, src, size, c):
            s = _scores(qa[:, :, rows], ka[:, :, cols], scale, causal)
            p = torch.exp(s - lse[:, :, rows].unsqueeze(-1))
            dp = do[:, :, rows] @ va[:, :, cols].transpose(-1, -2)
            ds = p * (dp - delta[:, :, rows].unsqueeze(-1))
            dq[:, :, rows] += ds @ ka[:, :, cols] * scale
            dkv[0][:, :, cols] += ds.transpose(-1, -2) @ qa[:, :, rows] * scale
            dkv[1][:, :, cols] += p.transpose(-1, -2) @ do[:, :, rows]
        # keys/values and their gradients move on together; after P moves they are home
        # (a ring of one rank: home already; gloo refuses a send to itself)
        if size > 1:
            moved = _pass(kv + dkv, pg)
            kv, dkv = moved[:2], moved[2:]
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


@ring_attention_bwd.register_fake
def _(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
      scale: float, group: str, size: int) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, scale, group, size = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.scale, ctx.group, ctx.size = scale, group, size
    # lse is the backward's state: its gradient is not computed, so it must not claim one
    # (a loss through it would get a silently wrong gradient), nor get a zero-filled one
    ctx.mark_non_differentiable(output[1])


def _backward(ctx: Any, grad_out: Tensor, _grad_lse: Tensor | None) -> tuple:
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = ring_attention_bwd(grad_out.contiguous(), q, k, v, out, lse, ctx.scale,
                                    ctx.group, ctx.size)
    return dq, dk, dv, None, None, None


ring_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup,
                   scale: float | None = None) -> Tensor:
    """Causal softmax attention of this rank's zigzag chunks (module docstring).

    Args:
        q, k, v: [B, H, 2c, D] (k, v with q's heads: expand GQA first), this rank's chunks r
            and 2P-1-r concatenated; any float dtype (float32 accumulation, float64 kept).
        group: the CP process group (ranks in ring order).
        scale: multiplies q . k; default 1/sqrt(D).
    Returns:
        [B, H, 2c, D] in q's dtype.
    Raises:
        ValueError: an odd local length or differing head counts.
    """
    if q.shape[2] % 2:
        raise ValueError(f"ring attention holds two chunks per rank: the local length "
                         f"({q.shape[2]}) must be even (pad the sequence to a multiple of "
                         "2 x cp)")
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise ValueError(f"q has {q.shape[1]} heads, k/v {k.shape[1]}/{v.shape[1]}: expand "
                         "the key/value heads first")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return ring_attention_fwd(q, k, v, float(scale), group.group_name,
                              dist.get_world_size(group))[0]
