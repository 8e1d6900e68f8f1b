"""Compile overhead and step time of the graphopt pipeline, side by side with torch's own
backends, on real transformers models (small configs, CPU).

    TORCHINDUCTOR_COMPILE_THREADS=1 python benchmarks/compile_overhead.py [--models ...]

For each model and backend: the first training step (Dynamo + backend compile + run), then
the median of later steps (forward + backward). graphopt's own share (normalize, passes,
dumps, bookkeeping) comes from its reports. Baselines: "aot_eager" (AOTAutograd + eager FX,
what graphopt's eager lowering adds passes to) and "inductor" (what the inductor lowering
adds passes to). Ratios are graphopt / baseline, measured in this one process.
"""

from __future__ import annotations

import argparse
import statistics
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["llama", "mixtral", "qwen3_moe",
                                                       "minimax"])
    parser.add_argument("--lowerings", nargs="+", default=["eager", "inductor"])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    # Every compile starts cold: no compile cache shared between baseline and graphopt.
    torch._inductor.config.force_disable_caches = True
    warm_up()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, seq {args.seq}, "
          f"fp32, median of {args.steps} steps")
    header = ("model", "lowering", "graphs", "first step s (base / graphopt / ratio)",
              "graphopt own s (normalize, passes)", "step ms (eager model / base / graphopt / "
              "graphopt:base)")
    print(" | ".join(header))
    for name in args.models:
        plain = measure(name, "none", None, args.seq, args.steps)
        for lowering in args.lowerings:
            base = measure(name, PAIRS[lowering], None, args.seq, args.steps)
            ours = measure(name, "graphopt", lowering, args.seq, args.steps)
            print(f"{name} | {lowering} | {ours['graphs']} | {base['first']:.2f} / "
                  f"{ours['first']:.2f} / {ours['first'] / base['first']:.2f}x | "
                  f"{ours['overhead']:.2f} ({ours['normalize']:.2f}, {ours['passes']:.3f}) | "
                  f"{plain['step'] * 1e3:.1f} / {base['step'] * 1e3:.1f} / "
                  f"{ours['step'] * 1e3:.1f} / {ours['step'] / base['step']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
