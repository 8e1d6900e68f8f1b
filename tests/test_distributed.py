"""graphopt.distributed: the spawned gloo groups the multi-rank tests and benchmarks use."""

import socket

import pytest
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


def _ddp_worker(rank, world, name, options):
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    import graphopt
    from graphopt.models import build_model

    torch._dynamo.reset()
    graphopt.clear_reports()
    model = build_model(name, dtype=torch.float64).train()
    ref_model = copy.deepcopy(model)
    ref_model.set_experts_implementation("eager")  # (grouped_mm has no float64 kernel)
    model.set_experts_implementation("grouped_mm")  # one graph per layer for the moe pass
    ref = DDP(ref_model)
    compiled = torch.compile(DDP(model), backend="graphopt", options=options)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
    compiled(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    ref(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    err = max(float((p.grad - r.grad).abs().max())
              for p, r in zip(model.parameters(), ref.module.parameters()))
    sites = [(p.name, s.action) for r in graphopt.reports() for p in r.passes
             for s in p.sites if p.name == "moe"]
    notes = [n for r in graphopt.reports() for n in r.notes]
    return err, sites, notes


@pytest.mark.parametrize("name,options", [
    ("mixtral", {"lowering": "eager", "moe": {}}),
    ("minimax", {"lowering": "eager", "attention": "exact", "moe": {}})])
def test_ddp_split_graphs_with_fake_inputs_compile_and_stay_exact(name, options):
    """Dynamo's DDPOptimizer compiles every split graph after the first with fake example
    inputs; the moe and attention passes evaluated them for real and crashed ("Please
    convert all Tensors to FakeTensors first", a review). They now treat those values as
    unknown (moe probes with drawn weights), the report says why, and the gradients equal
    DDP without compile."""
    for err, sites, notes in gd.run_distributed(_ddp_worker, 2, name, options):
        assert err < 1e-12
        assert ("moe", "rewritten") in sites, sites
        assert any("example inputs are fake tensors" in n for n in notes)
