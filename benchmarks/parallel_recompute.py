"""A plan's activation recomputation executed on 2 gloo ranks (CPU), next to the planner.

    python benchmarks/parallel_recompute.py [--layers 4] [--hidden 256] [--seq 256]
                                            [--batch 8] [--reps 5]

A Llama (transformers class, fp32, random weights) runs under graphopt.compile with each
plan (dp_shard=2 ZeRO-2, tp=2 + SP) three ways: no recomputation, ``recompute_layers`` = all
layers (full), ``selective_recompute``. Reported per row, side by side in one run:
- saved MiB: bytes autograd keeps for the backward on one rank, counted by saved-tensor
  hooks around one compiled forward (unique storages; parameters, FSDP's gathered ones
  included, excluded). The compiled
  layers' saved tensors pass through the hooks, so selective checkpointing's kept outputs are
  counted too (in eager mode they would not be);
- pred MiB: the planner's activation bytes for the same model and plan
  (``evaluate(...).memory_parts["activations"]``, fp32);
- step ms: median forward + backward of the slowest rank; pred ms: the planner's step
  time for the plan on the cost model's profile;
- ratios to the row without recomputation, measured and predicted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import add_size_args

from graphopt.distributed import run_distributed
from graphopt.planner.plan import ParallelPlan

PLANS = [dict(dp_shard=2, zero_stage=2), dict(tp=2)]
MODES = {"none": {}, "full": "layers", "selective": dict(selective_recompute=True)}


def _sizes(args: argparse.Namespace) -> dict:
    return dict(num_hidden_layers=args.layers, hidden_size=args.hidden,
                intermediate_size=4 * args.hidden, num_attention_heads=8,
                num_key_value_heads=4)


def _plan(kwargs: dict, mode: str, args: argparse.Namespace) -> ParallelPlan:
    """The plan with its recomputation; its microbatch is the rank's whole share of the
    batch (the step runs it at once, so the planner prices the same activations)."""
    extra = MODES[mode]
    dp = ParallelPlan(**kwargs).dp
    return ParallelPlan(**kwargs, microbatch=args.batch // dp,
                        **(dict(recompute_layers=args.layers) if extra == "layers" else extra))


def _worker(rank: int, world: int, args: argparse.Namespace, plan: ParallelPlan) -> dict:
    import graphopt
    from graphopt.models import build_model
    from graphopt.parallel import build_mesh

    torch.set_num_threads(1)
    torch.manual_seed(0)
    mesh = build_mesh(plan)
    model = graphopt.compile(build_model("llama", torch.float32, **_sizes(args)),
                             options={"parallel": plan, "lowering": "eager"})
    ids = torch.randint(0, 256, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(1))
    local = ids.chunk(plan.dp)[mesh["dp"].get_local_rank()]

    def loss() -> torch.Tensor:
        logits = model(input_ids=local, use_cache=False).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                 local[:, 1:].flatten())

    loss().backward()  # compile
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.nn.Parameter):  # (FSDP's gathered ones too)
            return t
        local_t = t.to_local() if hasattr(t, "to_local") else t
        seen[local_t.untyped_storage().data_ptr()] = local_t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        value = loss()
    value.backward()
    times = []
    for _ in range(args.reps):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        loss().backward()
        times.append(time.perf_counter() - t0)
    return {"saved": sum(seen.values()), "times": times}


def _predict(args: argparse.Namespace, plan: ParallelPlan) -> tuple[str, float, float]:
    """(profile name, predicted step seconds, predicted activation bytes per rank)."""
    from graphopt.cost.profiles import default_profile_name, load_profile
    from graphopt.planner.model import plan_model
    from graphopt.planner.perf import evaluate

    name = default_profile_name()
    cluster = load_profile(name)
    model = plan_model("llama", args.seq, cluster, dtype=torch.float32,
                       overrides=_sizes(args))
    pred = evaluate(plan, model, cluster, args.batch, dp_overlap=False)
    return name, pred.step_s, pred.memory_parts["activations"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_size_args(parser)
    args = parser.parse_args()
    print(f"llama {args.layers} layers, hidden {args.hidden}, seq {args.seq}, global batch "
          f"{args.batch}, fp32, 2 gloo ranks x 1 thread, graphopt.compile (eager lowering); "
          f"medians of {args.reps} forward+backward")
    print(f"{'plan':44s} {'saved MiB':>9s} {'pred MiB':>8s} {'x none':>6s} {'pred x':>6s} "
          f"{'step ms':>8s} {'pred ms':>8s} {'x none':>6s} {'pred x':>6s}")
    profile = ""
    for kwargs in PLANS:
        base: tuple[float, float, float, float] | None = None
        for mode in MODES:
            plan = _plan(kwargs, mode, args)
            ranks = run_distributed(_worker, 2, args, plan)
            step = statistics.median(max(r["times"][i] for r in ranks)
                                     for i in range(args.reps))
            saved = max(r["saved"] for r in ranks)
            profile, pred_s, pred_act = _predict(args, plan)
            base = base or (saved, pred_act, step, pred_s)
            print(f"{plan.describe():44s} {saved / 2**20:9.2f} {pred_act / 2**20:8.2f} "
                  f"{saved / base[0]:6.2f} {pred_act / base[1]:6.2f} {step * 1e3:8.1f} "
                  f"{pred_s * 1e3:8.1f} {step / base[2]:6.2f} {pred_s / base[3]:6.2f}")
    print(f"predictions on profile {profile!r}; 'x none': the ratio to the same plan without "
          "recomputation (measured, then predicted)")


if __name__ == "__main__":
    main()
