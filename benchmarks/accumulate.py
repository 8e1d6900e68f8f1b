"""Gradient accumulation on 4 gloo ranks (CPU): a plain microbatch loop next to
graphopt.parallel.microbatches, with the collectives each issues and the planner's DP time.

    python benchmarks/accumulate.py [--layers 4] [--hidden 256] [--seq 256] [--batch 32]
                                    [--reps 5]

A Llama (transformers class, fp32, random weights) sharded by graphopt.parallelize; a step
is forward + backward of this rank's share of the global batch as microbatches of one
sequence (batch / 4 per rank), then AdamW. Per plan and loop: the median step of the
slowest rank (the two loops' steps alternate, the order swapped every rep) and the data-
parallel collectives of one step (torch.profiler: all-reduces, reduce-scatters, all-
gathers; graphopt.planner.perf prices the microbatches() counts,
tests/test_parallel_accumulate.py). FSDP over all ranks is the control: both loops issue
the same collectives. gloo's collectives are CPU copies on the same 2 cores the 4 ranks
compute on, so a saved all-reduce shows up in the step time directly.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
from common import add_size_args
from parallel import _sizes

from graphopt.distributed import run_distributed
from graphopt.planner.plan import ParallelPlan

PLANS = [dict(dp_replicate=4), dict(dp_replicate=2, dp_shard=2, zero_stage=3),
         dict(dp_shard=4, zero_stage=3)]


def _worker(rank: int, world: int, args: argparse.Namespace, plan_kwargs: dict) -> dict:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from graphopt.models import build_model
    from graphopt.parallel import build_mesh, build_optimizer, microbatches, parallelize

    torch.set_num_threads(1)
    plan = ParallelPlan(microbatch=1, **plan_kwargs)
    torch.manual_seed(0)
    mesh = build_mesh(plan)
    model = parallelize(build_model("llama", **_sizes(args)), plan, mesh)
    opt = build_optimizer(model, plan, mesh, torch.optim.AdamW, lr=1e-4)
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    local = ids.chunk(plan.dp)[mesh["dp"].get_local_rank()]

    def step(helper: bool) -> None:
        for mb in (microbatches(model, local) if helper else local.split(1)):
            (model(input_ids=mb, labels=mb, use_cache=False).loss / len(local)).backward()
        opt.step()
        opt.zero_grad()

    out: dict[bool, dict] = {h: {"times": []} for h in (False, True)}
    for helper in (False, True):
        step(helper)  # warm-up (optimizer states, DDP's bucket rebuild)
    for rep in range(args.reps):  # the two loops in turns, the order swapped every rep
        for helper in ((False, True) if rep % 2 == 0 else (True, False)):
            dist.barrier()
            start = time.perf_counter()
            step(helper)
            out[helper]["times"].append(time.perf_counter() - start)
    for helper in (False, True):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(helper)
        counts = collections.Counter(e.name.removeprefix("c10d::") for e in prof.events()
                                     if e.name.startswith("c10d::"))
        out[helper]["counts"] = dict(counts)
    return out


def _dp_counts(counts: dict) -> str:
    names = {"allreduce_": "AR", "_reduce_scatter_base_": "RS", "_allgather_base_": "AG"}
    return " ".join(f"{counts.get(k, 0)} {v}" for k, v in names.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_size_args(parser)
    parser.set_defaults(batch=32)
    args = parser.parse_args()
    args.model = "llama"
    m = args.batch // 4
    print(f"llama {args.layers} layers, hidden {args.hidden}, seq {args.seq}, global batch "
          f"{args.batch} (m = {m} microbatches of 1 per DP rank), fp32, 4 gloo ranks x 1 "
          f"thread; medians of {args.reps} steps")
    print("| plan | loop | step ms | DP collectives per step | step ratio plain / "
          "microbatches |")
    print("|---|---|---|---|---|")
    for kwargs in PLANS:
        plan = ParallelPlan(microbatch=1, **kwargs)
        ranks = run_distributed(_worker, 4, args, kwargs)
        steps = {h: statistics.median(max(r[h]["times"][i] for r in ranks)
                                      for i in range(args.reps)) for h in (False, True)}
        for helper in (False, True):
            print(f"| {plan.describe()} | {'microbatches()' if helper else 'plain split'} | "
                  f"{steps[helper] * 1e3:.1f} | {_dp_counts(ranks[0][helper]['counts'])} | "
                  f"{steps[False] / steps[True]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
