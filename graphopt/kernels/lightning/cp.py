"""Exact context parallelism for Lightning Attention: the recurrent KV state is passed
between ranks instead of the keys and values.

Rank r of a CP group of P ranks holds the r-th contiguous chunk of the sequence (length
L_r; chunks may differ in length) of q, k, v [B, H, L_r, D]. With lambda_h = exp(-slope_h):

    S_r    = sum_{t < L_r} lambda^(L_r - 1 - t) k_t^T v_t      (chunk r's own state, [D, Dv])
    S_in_r = sum_{j < r} lambda^(L_{j+1} + ... + L_{r-1}) S_j  (the state entering chunk r)
    o_r    = LightningAttention(q_r, k_r, v_r, initial_state=S_in_r)

which is the single-device recurrence S_{t+1} = lambda S_t + k_t^T v_t cut at chunk
boundaries (Lightning Attention-2's inter-block term, arXiv:2401.04658 eq. (3), with a
chunk per rank instead of a block per loop step; the prefix over ranks is the associative
scan of (lambda^L, S) pairs). Communication: one all-gather of the P local states
(B*H*D*Dv elements each, independent of L) and one of the P lengths forward, the states'
reduce-scatter backward; no host synchronization; the
backward is autograd's through the all-gather (``all_gather_single_autograd``: the
reduce-scatter sums every later rank's dS_in into dS_j, the reverse scan), the prefix
combine and the op's own gradient for ``initial_state``. Causal, so no load balancing is
needed: every rank does the same work.

Errors: the op's own shape errors; RuntimeError without torch.distributed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from graphopt.kernels.lightning.chunked import acc_dtype
from graphopt.kernels.lightning.op import lightning_attention
from graphopt.kernels.lightning.reference import expand_kv


def _group(name: str) -> dist.ProcessGroup:
    from graphopt.distributed import group_by_name

    return group_by_name(name, None, "context-parallel lightning attention")


def chunk_state(k: Tensor, v: Tensor, slope: Tensor) -> Tensor:
    """S = sum_t lambda^(L-1-t) k_t^T v_t of one chunk: k [B, H, L, D], v [B, H, L, Dv]
    (heads already expanded to slope's), slope [H] -> [B, H, D, Dv] in the accumulation
    dtype (float32, float64 for float64)."""
    acc = acc_dtype(k.dtype)
    length = k.shape[2]
    # in acc, also under autocast (mixed_precision="bf16" runs the forward in a bf16 region,
    # where the einsum ran in bf16: a review measured 2.7x the error of one process)
    with torch.autocast(k.device.type, enabled=False):
        steps = torch.arange(length - 1, -1, -1, device=k.device, dtype=acc)
        weight = torch.exp(-slope.to(acc)[:, None] * steps)  # [H, L], exponents <= 0
        return torch.einsum("bhld,bhle->bhde", k.to(acc) * weight[None, :, :, None],
                            v.to(acc))


def lightning_attention_cp(q: Tensor, k: Tensor, v: Tensor, slope: Tensor,
                           group: str | dist.ProcessGroup = "",
                           *, scale: float | None = None, block_size: int | None = None,
                           checkpoint_every: int | None = None, impl: str = "auto") -> Tensor:
    """Causal Lightning Attention of this rank's sequence chunk, exact under CP (module
    docstring).

    Args:
        q: [B, Hq, L, D] (layout "bhsd"), this rank's chunk; k [B, Hk, L, D], v [B, Hk, L,
            Dv]; slope [Hq]; as :func:`graphopt.kernels.lightning.lightning_attention`.
        group: the CP process group, or its name ("" = the world), ranks in sequence
            order. Under torch.compile pass the group: Dynamo cannot trace resolving a
            name (a graph break).
    Returns:
        o [B, Hq, L, Dv] in q's dtype: rows of the whole sequence's output for this chunk
        (the ranks' chunk lengths may differ).
    """
    import torch.distributed._functional_collectives as funcol

    pg = _group(group) if isinstance(group, str) else group
    size, rank = dist.get_world_size(pg), dist.get_rank(pg)
    hq = q.shape[1]
    local = chunk_state(expand_kv(k, hq), expand_kv(v, hq), slope)
    states = funcol.all_gather_single_autograd(local.contiguous(), gather_dim=0, group=pg)
    states = states.view(size, *local.shape)
    # the chunks' lengths, on q's device (NCCL groups take no CPU tensors) and without a
    # host synchronization (a graph break under torch.compile, as the equality check that
    # this replaces was: a review)
    lengths = funcol.all_gather_single(torch.full((1,), q.shape[2], device=q.device,
                                                  dtype=torch.int64), 0, pg)
    # rank 0 too (an empty sum: zeros), so every rank's backward runs the all-gather's
    # reduce-scatter (a collective: skipping it on one rank would hang the others)
    acc = local.dtype
    with torch.autocast(q.device.type, enabled=False):
        ends = torch.cumsum(lengths.to(acc), 0)  # ends[j]: positions in chunks 0..j
        hops = (ends[rank - 1] - ends[:rank]) if rank else ends[:0]  # chunks j+1..r-1
        decay = torch.exp(-slope.to(acc)[None, :] * hops[:, None])  # [r, H]
        initial = (states[:rank] * decay[:, None, :, None, None]).sum(0)
    out = lightning_attention(q, k, v, slope, scale=scale, initial_state=initial,
                              block_size=block_size, checkpoint_every=checkpoint_every,
                              impl=impl)
    assert isinstance(out, torch.Tensor)  # output_final_state=False: the output alone
    return out
