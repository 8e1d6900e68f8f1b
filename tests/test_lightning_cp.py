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


def _worker(rank, world, seq):
    from graphopt.kernels.lightning.cp import lightning_attention_cp

    q, k, v, slope, grad = _inputs(seq)
    rows = slice(rank * seq // world, (rank + 1) * seq // world)
    mine = [x[:, :, rows].clone().requires_grad_() for x in (q, k, v)]
    slope = slope.clone().requires_grad_()
    out = lightning_attention_cp(*mine, slope, "", scale=0.5, block_size=4)
    grads = torch.autograd.grad(out, [*mine, slope], grad[:, :, rows])
    return out.detach(), grads


@pytest.mark.parametrize("world, seq", [(2, 22), (4, 36)])
def test_state_passing_equals_the_whole_sequence(world, seq):
    from graphopt.kernels.lightning import lightning_attention

    q, k, v, slope, grad = _inputs(seq)
    inputs = [x.clone().requires_grad_() for x in (q, k, v, slope)]
    want = lightning_attention(*inputs, scale=0.5, block_size=4)
    want_grads = torch.autograd.grad(want, inputs, grad)
    results = run_distributed(_worker, world, seq)
    slope_grad = sum(r[1][3] for r in results)
    for rank, (out, grads) in enumerate(results):
        rows = slice(rank * seq // world, (rank + 1) * seq // world)
        torch.testing.assert_close(out, want[:, :, rows].detach(), rtol=1e-10, atol=1e-10)
        for got, full in zip(grads[:3], want_grads[:3]):
            torch.testing.assert_close(got, full[:, :, rows], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(slope_grad, want_grads[3], rtol=1e-10, atol=1e-10)


def _uneven_worker(rank, world):
    from graphopt.kernels.lightning.cp import lightning_attention_cp

    x = torch.zeros(1, 2, 5 + rank, 4, dtype=torch.float64)
    try:
        lightning_attention_cp(x, x, x, torch.zeros(2, dtype=torch.float64))
    except ValueError as exc:
        return str(exc)
    return "ran"


def test_unequal_chunks_are_a_clear_error():
    for message in run_distributed(_uneven_worker, 2):
        assert "needs equal chunks; the ranks hold [5, 6] positions" in message
