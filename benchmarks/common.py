"""Shared by the benchmark scripts (run as ``python benchmarks/<name>.py``, so this directory
is on sys.path)."""

from __future__ import annotations

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
