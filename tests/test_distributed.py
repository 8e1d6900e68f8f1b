"""graphopt.distributed: the spawned gloo groups the multi-rank tests and benchmarks use."""

import socket

import torch

import graphopt.distributed as gd


def _threads_and_sum(rank, world):
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return torch.get_num_threads(), float(t)


def test_a_taken_rendezvous_port_starts_the_group_again_on_a_free_one(monkeypatch):
    """Concurrent test workers may take the free port between its choice and rank 0's bind:
    the group starts again on a new port. Each rank runs one intra-op thread, as torchrun's
    ranks do."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1]]
        choose = gd.free_port
        monkeypatch.setattr(gd, "free_port", lambda: ports.pop() if ports else choose())
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        results = gd.run_distributed(_threads_and_sum, 2)
    assert not ports  # the taken port was tried first
    assert results == [(1, 3.0), (1, 3.0)]
