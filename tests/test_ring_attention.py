"""Causal ring attention (zigzag load balancing) on real gloo process groups, float64: every
rank's output rows and the gradients of its q, k, v rows equal SDPA on the whole
sequence."""

from __future__ import annotations

import pytest
import torch

from graphopt.distributed import run_distributed


def _inputs(seq):
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, 3, seq, 8, generator=gen, dtype=torch.float64)
                     for _ in range(4))
    return q, k, v, grad


def _rows(rank, world, seq):
    c = seq // (2 * world)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * world - 1 - rank) * c, (2 * world - rank) * c)])


def _worker(rank, world, seq):
    import torch.distributed as dist

    from graphopt.kernels.comm.ring_attention import ring_attention

    q, k, v, grad = _inputs(seq)
    rows = _rows(rank, world, seq)
    mine = [x[:, :, rows].clone().requires_grad_() for x in (q, k, v)]
    out = ring_attention(*mine, dist.group.WORLD, scale=0.3)
    grads = torch.autograd.grad(out, mine, grad[:, :, rows])
    # the op's log-sum-exp output is backward state: no gradient claimed for it
    lse = torch.ops.graphopt.ring_attention_fwd(*mine, 0.3, dist.group.WORLD.group_name,
                                                world)[1]
    assert not lse.requires_grad
    return out.detach(), grads


@pytest.mark.parametrize("world, seq", [(2, 24), (4, 32)])
def test_ring_attention_equals_sdpa_on_the_whole_sequence(world, seq):
    q, k, v, grad = _inputs(seq)
    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*inputs, is_causal=True, scale=0.3)
    want_grads = torch.autograd.grad(want, inputs, grad)
    for rank, (out, grads) in enumerate(run_distributed(_worker, world, seq)):
        rows = _rows(rank, world, seq)
        torch.testing.assert_close(out, want[:, :, rows].detach(), rtol=1e-10, atol=1e-10)
        for got, full in zip(grads, want_grads):
            torch.testing.assert_close(got, full[:, :, rows], rtol=1e-10, atol=1e-10)
