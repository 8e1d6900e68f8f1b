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
