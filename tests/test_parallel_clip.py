"""Gradient clipping of parallelized models (graphopt.parallel.clip_grad_norm_) on real gloo
process groups, float64: every rank's returned norm (2 and inf) equals the single-process
norm of the same global batch, and the clipped gradients equal torch.nn.utils.clip_grad_norm_
on one process. Before this function, torch's own clipping on these models gave per-rank
norms (PP: 0.87 and 0.92 for a norm of 1.27; EP: 1.3381 vs 1.3376, so DP replicas scaled
their dense gradients differently) or raised (mixed DTensor and plain gradients)."""

from __future__ import annotations

import pytest
import torch

from graphopt.distributed import run_distributed
from graphopt.errors import ConfigError
from graphopt.planner.plan import ParallelPlan
from tests.helpers import BATCH, config_errors, held_grads, lm_loss, plan_backward

TIED = dict(tie_word_embeddings=True)
RUNS = {
    2: [("mixtral", {}, dict(dp_shard=2, ep=2, zero_stage=0)),  # plain experts, DDP
        ("llama", TIED, dict(pp=2)),  # stages; the tied embedding on both ends
        ("llama", {}, dict(tp=2, sp=False))],  # DTensor and plain gradients mixed
    4: [("mixtral", {}, dict(dp_shard=4, ep=2, zero_stage=3)),  # FSDP'd experts over edp
        ("mixtral", {}, dict(pp=2, tp=2, ep=2)),  # PP x TP+SP, EP over tp
        # tensor-parallel experts: FFN slices over tp, EP over dp_shard
        ("mixtral", {}, dict(dp_shard=2, tp=2, ep=2, expert_tp=2, zero_stage=3)),
        ("llama", TIED, dict(pp=2, dp_shard=2, zero_stage=3)),
        # the router [2, H] over dp_shard 4: ranks 2 and 3 hold empty shards, whose inf-norm
        # raised there while ranks 0 and 1 waited in the all-reduce (a review)
        ("mixtral", dict(num_local_experts=2), dict(dp_shard=4, ep=2, zero_stage=3)),
        # FSDP2 x TP with dp_shard inside tp: DTensor's own norm raised a KeyError there
        ("llama", {}, dict(dp_shard=2, tp=2, zero_stage=3,
                           mesh_order=("dp_shard", "tp", "cp", "dp_replicate", "pp")))],
}


def _worker(rank, world, runs):
    import graphopt
    from graphopt.models import build_model
    from graphopt.parallel import build_mesh, clip_grad_norm_, grad_norm

    out = []
    for i, (name, overrides, kw) in enumerate(runs):
        plan = ParallelPlan(**kw)
        mesh = build_mesh(plan)
        ref = build_model(name, torch.float64, **overrides)
        model = graphopt.parallelize(build_model(name, torch.float64, **overrides), plan, mesh)
        plan_backward(model, plan, mesh)
        lm_loss(ref, BATCH).backward()
        inf = grad_norm(model, float("inf"))
        want_inf = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()],
                                                 float("inf"))
        # torch's foreach argument, both ways (a review: it was a TypeError)
        two = clip_grad_norm_(model, max_norm=0.5, foreach=i % 2 == 0)
        want_two = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.5)
        grad_err = max(float((got - want).abs().max()) for _, got, want in held_grads(model, ref))
        out.append((name, kw, float(two), float(want_two), float(inf), float(want_inf),
                    grad_err))
    return out


@pytest.mark.parametrize("world", sorted(RUNS))
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_clipping_uses_the_whole_model_s_norm(world):
    for results in run_distributed(_worker, world, RUNS[world]):
        for name, plan, two, want_two, inf, want_inf, grad_err in results:
            assert want_two > 0.5  # the clipping scales
            assert abs(two - want_two) < 1e-9 * want_two, (name, plan, two, want_two)
            assert abs(inf - want_inf) < 1e-9 * want_inf, (name, plan, inf, want_inf)
            assert grad_err < 1e-10, (name, plan, grad_err)


def test_clipping_needs_a_parallelized_model():
    from graphopt.models import build_model
    from graphopt.parallel import clip_grad_norm_

    with pytest.raises(ConfigError, match="torch.nn.utils.clip_grad_norm_"):
        clip_grad_norm_(build_model("llama"), 1.0)


def _zero_norm_worker(rank, world):
    import graphopt
    from graphopt.models import build_model
    from graphopt.parallel import grad_norm

    model = graphopt.parallelize(build_model("llama"), ParallelPlan(dp_shard=2, zero_stage=3))
    return config_errors(lambda: grad_norm(model, 0))[0]


def test_a_norm_of_order_zero_is_a_clear_error():
    """grad_norm(model, 0) was a ZeroDivisionError (a review)."""
    for message in run_distributed(_zero_norm_worker, 2):
        assert "norm_type must be > 0" in message


def _nan_worker(rank, world):
    """A NaN in rank 1's gradient only (pp=2 stage, a ZeRO-3 shard, or a ZeRO-2 shard after
    an evaluation forward with gradients enabled, which leaves FSDP2's gathered copies in
    the module): (inf-norm, 2-norm, error_if_nonfinite's message or "ran") on this rank."""
    import math

    import graphopt
    from graphopt.models import build_model
    from graphopt.parallel import build_mesh, clip_grad_norm_, grad_norm
    from graphopt.parallel.apply import master_parameters

    out = []
    for kw in (dict(pp=2), dict(dp_shard=2, zero_stage=3), dict(dp_shard=2, zero_stage=2)):
        plan = ParallelPlan(**kw)
        mesh = build_mesh(plan)
        model = graphopt.parallelize(build_model("llama", torch.float64), plan, mesh)
        plan_backward(model, plan, mesh)
        if plan.zero_stage == 2:
            model(input_ids=BATCH[:1], use_cache=False)  # a validation loss, no backward
        if rank == 1:
            masters = master_parameters(model)
            g = next(q.grad for q in (masters.get(id(p), p) for p in model.parameters())
                     if q.grad is not None)
            (g.to_local() if hasattr(g, "to_local") else g).view(-1)[0] = math.nan
        norms = [float(grad_norm(model, float("inf"))), float(grad_norm(model))]
        try:
            clip_grad_norm_(model, 1.0, float("inf"), error_if_nonfinite=True)
            out.append((norms, "ran"))
        except RuntimeError as exc:
            out.append((norms, str(exc)))
    return out


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_nan_on_any_rank_makes_every_rank_s_norm_nan():
    """gloo's max all-reduce dropped a NaN held by rank 1: the inf-norm was finite on both
    ranks and error_if_nonfinite did not raise (a review)."""
    import math

    for results in run_distributed(_nan_worker, 2):
        for norms, message in results:
            assert all(math.isnan(n) for n in norms), norms
            assert "non-finite" in message, message
