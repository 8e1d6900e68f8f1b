"""Shared by the benchmark scripts (run as ``python benchmarks/<name>.py``, so this directory
is on sys.path)."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable


def median_time(fn: Callable[[], object], reps: int, warmup: bool = True) -> float:
    """Median seconds of ``reps`` calls of ``fn`` (after one warm-up call)."""
    if warmup:
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_medians(fns: dict[str, Callable[[], object]], reps: int,
                        before_each: Callable[[], object] | None = None) -> dict[str, float]:
    """Median seconds of ``reps`` calls of each of ``fns`` (after one warm-up call each),
    timed in turns: every rep calls each configuration once, the order rotating by one per
    rep, so a burst of CPU contention falls on all configurations alike instead of on one
    row (a review: timed back to back, each configuration's reps could all land in one
    burst). ``before_each`` runs untimed before every call (a barrier)."""
    for fn in fns.values():
        fn()
    keys = list(fns)
    times: dict[str, list[float]] = {k: [] for k in keys}
    for rep in range(reps):
        shift = rep % len(keys)
        for key in keys[shift:] + keys[:shift]:
            if before_each is not None:
                before_each()
            start = time.perf_counter()
            fns[key]()
            times[key].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def cuda_median_ms(fn: Callable[[], object], reps: int, warmups: int = 3) -> float:
    """Median milliseconds of ``reps`` calls of ``fn`` on the current CUDA device, each timed
    with CUDA events (after ``warmups`` calls)."""
    import torch

    for _ in range(warmups):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def minimax_toy(kind: str, checkpointing: bool = False, reset: bool = True
                ) -> tuple[object, Callable]:
    """(model, fn): graphopt.models' MiniMax toy (float32, train mode, ``grouped_mm``
    experts so that the whole model is one graph: the eager expert loop graph-breaks; until
    2026-12-06 ``batched_mm``, which computes every expert for every token and made the
    baselines 20x slower than transformers' fast experts, a review) and
    ``fn(input_ids) -> logits`` run as ``kind``: "eager", "aot_eager", or "graphopt"
    (attention "exact" + moe, eager lowering). With ``reset`` (the default), resets Dynamo
    and graphopt's reports first; scripts that time several kinds in turns build them all
    after one reset."""
    import torch

    import graphopt
    from graphopt.models import build_model

    if reset:
        torch._dynamo.reset()
        graphopt.clear_reports()
    torch.manual_seed(0)
    model = build_model("minimax", dtype=torch.float32).train()
    model.set_experts_implementation("grouped_mm")
    if checkpointing:
        model.gradient_checkpointing_enable()

    def fn(i: torch.Tensor) -> torch.Tensor:
        return model(input_ids=i, use_cache=False).logits

    if kind == "aot_eager":
        return model, torch.compile(fn, backend="aot_eager")
    if kind == "graphopt":
        return model, torch.compile(fn, backend="graphopt", options={
            "lowering": "eager", "attention": "exact", "moe": {}})
    return model, fn


def add_size_args(parser: argparse.ArgumentParser) -> None:
    """The executed-plan benchmarks' model and batch sizes: --layers, --hidden, --seq,
    --batch (global, sequences), --reps (timed steps)."""
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
