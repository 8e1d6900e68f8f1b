"""Context-parallel Lightning Attention (state passing between ranks) on real gloo process
groups, float64: every rank's output rows and the gradients of q, k, v (rows of its chunk)
and of slope (summed over ranks) equal the single-process op on the whole sequence."""

from __future__ import annotations

import pytest
import torch

from graphopt.distributed import run_distributed

B, HQ, HK, D, DV = 2, 4, 2, 8, 6


def _inputs(seq):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, HQ, seq, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, HK, seq, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, HK, seq, DV, generator=gen, dtype=torch.float64)
    slope = torch.tensor([0.0, 0.05, 0.3, 1.5], dtype=torch.float64)  # 0: no decay
    grad = torch.randn(B, HQ, seq, DV, generator=gen, dtype=torch.float64)
    return q, k, v, slope, grad


def _rows(rank, world, seq, cuts=None):
    bounds = cuts or [i * seq // world for i in range(world + 1)]
    return slice(bounds[rank], bounds[rank + 1])


def _worker(rank, world, seq, cuts=None):
    from graphopt.kernels.lightning.cp import lightning_attention_cp

    q, k, v, slope, grad = _inputs(seq)
    rows = _rows(rank, world, seq, cuts)
    mine = [x[:, :, rows].clone().requires_grad_() for x in (q, k, v)]
    slope = slope.clone().requires_grad_()
    out = lightning_attention_cp(*mine, slope, "", scale=0.5, block_size=4)
    grads = torch.autograd.grad(out, [*mine, slope], grad[:, :, rows])
    return out.detach(), grads


@pytest.mark.parametrize("world, seq, cuts", [(2, 22, None), (4, 36, None),
                                              (3, 17, [0, 5, 14, 17])])
def test_state_passing_equals_the_whole_sequence(world, seq, cuts):
    """Equal chunks, and chunks of different lengths (5, 9, 3): the decay between chunks
    follows the all-gathered lengths (it was an error, whose check synchronized with the
    host and broke torch.compile's graph: a review)."""
    from graphopt.kernels.lightning import lightning_attention

    q, k, v, slope, grad = _inputs(seq)
    inputs = [x.clone().requires_grad_() for x in (q, k, v, slope)]
    want = lightning_attention(*inputs, scale=0.5, block_size=4)
    want_grads = torch.autograd.grad(want, inputs, grad)
    results = run_distributed(_worker, world, seq, cuts)
    slope_grad = sum(r[1][3] for r in results)
    for rank, (out, grads) in enumerate(results):
        rows = _rows(rank, world, seq, cuts)
        torch.testing.assert_close(out, want[:, :, rows].detach(), rtol=1e-10, atol=1e-10)
        for got, full in zip(grads[:3], want_grads[:3]):
            torch.testing.assert_close(got, full[:, :, rows], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(slope_grad, want_grads[3], rtol=1e-10, atol=1e-10)


def test_the_chunk_state_accumulates_in_float32_under_bf16_autocast():
    """mixed_precision="bf16" runs the forward under bf16 autocast, where the chunk state's
    einsum ran in bf16 (a review: 2.7x the error of one process at cp=4)."""
    from graphopt.kernels.lightning.cp import chunk_state

    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, 2, 64, 16, generator=gen) for _ in range(2))
    slope = torch.tensor([0.01, 0.1])
    want = chunk_state(k.double(), v.double(), slope.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = chunk_state(k, v, slope)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
