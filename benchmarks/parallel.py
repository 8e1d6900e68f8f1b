"""Executed parallel plans on 4 gloo ranks (CPU), side by side with the planner's prediction.

    python benchmarks/parallel.py [--model llama|mixtral] [--layers 4] [--hidden 256]
                                  [--seq 256] [--batch 8] [--reps 5]

A Llama, or a Mixtral with 8 experts (top-2; transformers' grouped_mm experts when the
experts are not expert-parallel), transformers classes, fp32, random weights, is sharded by
graphopt.parallelize for each plan; a step is forward + backward + AdamW on this rank's
share of the global batch (eager modules; compile time would dominate at this size).
Reported per plan: median step time of the slowest rank, the planner's predicted step time
for the same model and plan on the cost model's profile (``local`` when `graphopt calibrate`
ran, else h100-sxm, named in the output), their ratio, and the measured per-rank bytes of
parameters + gradients + optimizer states next to the plan's memory model. 4 ranks share
this machine's cores (1 thread each), and gloo's collectives are CPU copies on those same
cores: communication here is not overlapped the way NCCL on GPUs overlaps it, so the ratio
mostly measures that.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from common import add_size_args

from graphopt.distributed import run_distributed
from graphopt.planner.plan import ParallelPlan

PLANS = {
    "llama": [dict(dp_replicate=4), dict(dp_shard=4, zero_stage=1),
              dict(dp_shard=4, zero_stage=3), dict(tp=4, sp=True),
              dict(dp_shard=2, tp=2, zero_stage=3), dict(dp_replicate=2, dp_shard=2, zero_stage=3)],
    "mixtral": [dict(dp_shard=4, zero_stage=3), dict(dp_shard=4, ep=4, zero_stage=3),
                dict(dp_shard=4, ep=2, zero_stage=3), dict(dp_shard=2, tp=2, ep=4, zero_stage=3),
                dict(dp_replicate=2, dp_shard=2, ep=2, zero_stage=3)],
}


def _sizes(args: argparse.Namespace) -> dict:
    sizes = dict(num_hidden_layers=args.layers, hidden_size=args.hidden,
                 intermediate_size=4 * args.hidden, num_attention_heads=8, num_key_value_heads=4)
    if args.model == "mixtral":
        sizes.update(num_local_experts=8, num_experts_per_tok=2,
                     intermediate_size=2 * args.hidden)
    return sizes


def _state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    def size(t: torch.Tensor) -> int:
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.numel() * local.element_size()

    states = opt.optim.state if hasattr(opt, "optim") else opt.state
    return (sum(size(p) for p in model.parameters())
            + sum(size(p.grad) for p in model.parameters() if p.grad is not None)
            + sum(size(v) for s in states.values() for v in s.values()
                  if isinstance(v, torch.Tensor) and v.dim()))


def _worker(rank: int, world: int, args: argparse.Namespace, plan_kwargs: dict) -> dict:
    import torch.distributed as dist

    from graphopt.models import build_model
    from graphopt.parallel import build_mesh, build_optimizer, parallelize

    torch.set_num_threads(1)
    plan = ParallelPlan(**plan_kwargs)
    torch.manual_seed(0)
    model = build_model(args.model, **_sizes(args))
    if args.model == "mixtral" and plan.ep == 1:
        model.set_experts_implementation("grouped_mm")  # not the per-expert Python loop
    mesh = build_mesh(plan)
    model = parallelize(copy.deepcopy(model), plan, mesh)
    opt = build_optimizer(model, plan, mesh, torch.optim.AdamW, lr=1e-4)
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    local = ids.chunk(plan.dp)[mesh["dp"].get_local_rank()]
    times = []
    for _ in range(args.reps + 1):  # the first step builds optimizer states: not timed
        dist.barrier()
        start = time.perf_counter()
        model(input_ids=local, labels=local, use_cache=False).loss.backward()
        opt.step()
        state = _state_bytes(model, opt)
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return {"times": times[1:], "state_bytes": state}


def _predict(args: argparse.Namespace, plan: ParallelPlan) -> tuple[str, float, float]:
    """(profile name, predicted step seconds, predicted params+grads+optimizer bytes)."""
    from graphopt.cost.profiles import default_profile_name, load_profile
    from graphopt.planner.model import plan_model
    from graphopt.planner.perf import evaluate

    name = default_profile_name()
    cluster = load_profile(name)
    dtype = torch.float32
    if args.model == "mixtral":
        # MoE models are traced with grouped_mm experts, whose meta kernel takes bf16 only;
        # the steps run in fp32, so the bf16 trace is costed at the profile's fp32 rate
        # (this CPU's bf16 GEMM is 200x slower than fp32: calibrated 0.7 GFLOP/s)
        cluster = cluster.with_rate_of("bfloat16", "float32")
        dtype = torch.bfloat16
    model = plan_model(args.model, args.seq, cluster, dtype=dtype, overrides=_sizes(args))
    pred = evaluate(plan, model, cluster, args.batch, dp_overlap=False)
    return name, pred.step_s, pred.memory_parts["params+grads+optimizer"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(PLANS), default="llama")
    add_size_args(parser)
    args = parser.parse_args()
    print(f"{args.model} {args.layers} layers, hidden {args.hidden}, seq {args.seq}, global batch "
          f"{args.batch}, fp32, 4 gloo ranks x 1 thread; medians of {args.reps} steps")
    print(f"{'plan':50s} {'step ms':>8s} {'pred ms':>8s} {'ratio':>6s} {'state MB':>9s} "
          f"{'pred MB':>8s}")
    for kwargs in PLANS[args.model]:
        plan = ParallelPlan(**kwargs)
        ranks = run_distributed(_worker, 4, args, kwargs)
        step = statistics.median(max(r["times"][i] for r in ranks)
                                 for i in range(args.reps))
        state = max(r["state_bytes"] for r in ranks)
        profile, pred_s, pred_state = _predict(args, plan)
        print(f"{plan.describe():50s} {step * 1e3:8.1f} {pred_s * 1e3:8.1f} "
              f"{step / pred_s:6.2f} {state / 2**20:9.2f} {pred_state / 2**20:8.2f}")
    print(f"predictions on profile {profile!r}; state = parameters + gradients + AdamW "
          "states (fp32 here; the memory model assumes bf16 parameters/gradients with fp32 "
          "master weights and Adam states, so its figure differs by design)")


if __name__ == "__main__":
    main()
