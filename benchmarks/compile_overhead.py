"""Compile overhead and step time of the graphopt pipeline, side by side with torch's own
backends, on real transformers models (small configs, CPU).

    TORCHINDUCTOR_COMPILE_THREADS=1 python benchmarks/compile_overhead.py [--models ...]

For each model and backend: the first training step (Dynamo + backend compile + run), then
the median of later steps (forward + backward). graphopt's own share (normalize, passes,
dumps, bookkeeping) comes from its reports. Baselines: "aot_eager" (AOTAutograd + eager FX,
what graphopt's eager lowering adds passes to) and "inductor" (what the inductor lowering
adds passes to). Ratios are graphopt / baseline, measured in one run; each measurement
runs in a fresh subprocess (after a warm-up compile) so none pays another's one-time or
cache costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch._inductor.config

import graphopt
from graphopt.models import build_model, sample_batch

PAIRS = {"eager": "aot_eager", "inductor": "inductor"}


def _step(fn, ids, labels):
    loss = fn(ids, labels)
    loss.backward()
    return loss


def measure(name: str, backend: str, lowering: str | None, seq: int, steps: int) -> dict:
    torch._dynamo.reset()
    graphopt.clear_reports()
    model = build_model(name, dtype=torch.float32)
    ids, labels = sample_batch(model, 2, seq), sample_batch(model, 2, seq, seed=1)

    def loss_fn(i, lab):
        return model(input_ids=i, labels=lab, use_cache=False).loss

    fn = loss_fn
    if backend != "none":
        options = {"options": {"lowering": lowering}} if backend == "graphopt" else {}
        fn = torch.compile(loss_fn, backend=backend, **options)
    start = time.perf_counter()
    _step(fn, ids, labels)
    first = time.perf_counter() - start
    times = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        _step(fn, ids, labels)
        times.append(time.perf_counter() - start)
    reports = graphopt.reports() if backend == "graphopt" else []
    return {
        "first": first, "step": statistics.median(times),
        "overhead": sum(r.timing.get("graphopt_overhead", 0.0) for r in reports),
        "passes": sum(r.timing.get("passes", 0.0) for r in reports),
        "normalize": sum(r.timing.get("normalize", 0.0) for r in reports),
        "graphs": len(reports),
    }


def warm_up() -> None:
    """Pay one-time costs (imports, Dynamo/Inductor initialization) before measuring."""
    for backend, options in (("aot_eager", {}), ("inductor", {}),
                             ("graphopt", {"options": {"lowering": "eager"}})):
        torch._dynamo.reset()
        torch.compile(lambda x: (x.sin() * 2).sum(), backend=backend, **options)(
            torch.randn(8, requires_grad=True)).backward()


def run_one(name: str, backend: str, lowering: str | None, seq: int, steps: int) -> dict:
    cmd = [sys.executable, __file__, "--one", name, backend, str(lowering), "--seq", str(seq),
           "--steps", str(steps)]
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["llama", "mixtral", "qwen3_moe",
                                                       "minimax"])
    parser.add_argument("--lowerings", nargs="+", default=["eager", "inductor"])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=1,
                        help="alternate baseline/graphopt processes this many times; report "
                             "the best (lowest) median of each")
    parser.add_argument("--one", nargs=3, metavar=("MODEL", "BACKEND", "LOWERING"))
    args = parser.parse_args()
    if args.one:
        torch._inductor.config.force_disable_caches = True  # every compile starts cold
        warm_up()
        name, backend, lowering = args.one
        print(json.dumps(measure(name, backend, None if lowering == "None" else lowering,
                                 args.seq, args.steps)))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, seq {args.seq}, "
          f"batch 2, fp32, median of {args.steps} training steps; inductor caches disabled")
    print("| model | lowering | graphs | first step s: baseline / graphopt (ratio) | "
          "graphopt own s (normalize, passes) | step ms: eager model / baseline / graphopt "
          "(ratio) |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        plain = run_one(name, "none", None, args.seq, args.steps)
        for lowering in args.lowerings:
            runs = [(run_one(name, PAIRS[lowering], None, args.seq, args.steps),
                     run_one(name, "graphopt", lowering, args.seq, args.steps))
                    for _ in range(args.repeats)]
            base = min((r[0] for r in runs), key=lambda r: r["step"])
            ours = min((r[1] for r in runs), key=lambda r: r["step"])
            print(f"| {name} | {lowering} (vs {PAIRS[lowering]}) | {ours['graphs']} | "
                  f"{base['first']:.2f} / {ours['first']:.2f} "
                  f"({ours['first'] / base['first']:.2f}x) | "
                  f"{ours['overhead']:.2f} ({ours['normalize']:.2f}, {ours['passes']:.3f}) | "
                  f"{plain['step'] * 1e3:.1f} / {base['step'] * 1e3:.1f} / "
                  f"{ours['step'] * 1e3:.1f} ({ours['step'] / base['step']:.2f}x) |", flush=True)


if __name__ == "__main__":
    main()
