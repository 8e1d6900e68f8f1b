"""Calibrate the ``local`` profile by microbenchmarks on this machine (``graphopt calibrate``).

Measured (medians of repeated timings, in a process with the default thread count):
- GEMM FLOP/s of square fp32 matmuls n = 32 .. 2048 (the ``matmul_curve``; its maximum is
  the fp32 peak), and bf16 at the largest size;
- memory bandwidth from a large tensor copy (bytes read + written per second);
- per-kernel overhead from a tiny elementwise op;
- gloo all-reduce between 2 local ranks at several sizes, fitted to alpha + m * 2(n-1)/n / B
  (latency, bandwidth of the ``local`` link).

The profile is written as JSON to ``$GRAPHOPT_CACHE_DIR/local.json`` (default
``~/.cache/graphopt``) and loaded by ``load_profile("local")``.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from graphopt.cost.profiles import (
    ClusterLevel,
    ClusterProfile,
    DeviceProfile,
    LinkProfile,
    cluster_to_dict,
)


def local_profile_path() -> Path:
    root = Path(os.environ.get("GRAPHOPT_CACHE_DIR", Path.home() / ".cache" / "graphopt"))
    return root / "local.json"


def _median_time(fn: Callable[[], Any], reps: int, min_time: float = 0.02) -> float:
    fn()
    times = []
    for _ in range(reps):
        n, start = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_time:
                break
        times.append(elapsed / n)
    return statistics.median(times)


def measure_matmul(sizes: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048),
                   dtype: torch.dtype = torch.float32, reps: int = 5
                   ) -> list[tuple[float, float]]:
    """(n, FLOP/s) of an n x n x n matmul."""
    curve = []
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        t = _median_time(lambda: torch.mm(a, b), reps)  # noqa: B023 (called right here)
        curve.append((float(n), 2 * n**3 / t))
    return curve


def measure_bandwidth(nbytes: int = 256 * 2**20, reps: int = 5) -> float:
    """Bytes/s of a large copy (read + write)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    t = _median_time(lambda: dst.copy_(src), reps)
    return 2 * nbytes / t


def measure_overhead(reps: int = 7) -> float:
    x = torch.ones(8)
    return _median_time(lambda: torch.add(x, 1.0), reps, min_time=0.01)


def _allreduce_worker(rank: int, world: int, port: int, sizes: list[int], out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    results = []
    for n in sizes:
        x = torch.ones(n // 4)
        for _ in range(2):
            dist.all_reduce(x)
        times = []
        for _ in range(5):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - start)
        results.append((n, statistics.median(times)))
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def measure_allreduce(world: int = 2, sizes: tuple[int, ...] = (4096, 2**20, 16 * 2**20)
                      ) -> LinkProfile:
    """Fit latency and bandwidth of gloo all-reduce over ``world`` local ranks."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ar.json")
        mp.spawn(_allreduce_worker, args=(world, port, list(sizes), out), nprocs=world)
        data = json.loads(Path(out).read_text())
    # t = 2(n-1) alpha + 2(n-1)/n m / B: least squares on (1, m)
    xs = [2 * (world - 1) / world * m for m, _ in data]
    ts = [t for _, t in data]
    mean_x, mean_t = statistics.fmean(xs), statistics.fmean(ts)
    slope = sum((x - mean_x) * (t - mean_t) for x, t in zip(xs, ts)) / \
        sum((x - mean_x) ** 2 for x in xs)
    bandwidth = 1 / max(slope, 1e-12)
    alpha = max((mean_t - slope * mean_x) / (2 * (world - 1)), 1e-7)
    return LinkProfile(bandwidth=bandwidth, latency=alpha)


def calibrate(path: Path | None = None, collectives: bool = True,
              log: Callable[[str], None] = print) -> ClusterProfile:
    """Measure this machine and write the ``local`` profile; returns it."""
    log(f"matmul fp32 ({torch.get_num_threads()} threads)...")
    curve = measure_matmul()
    peak32 = max(f for _, f in curve)
    log("matmul bf16...")
    bf16 = measure_matmul((1024,), torch.bfloat16)[0][1]
    log("memory bandwidth, kernel overhead...")
    bandwidth = measure_bandwidth()
    overhead = measure_overhead()
    link = LinkProfile(bandwidth=bandwidth / 2, latency=50e-6)
    if collectives:
        log("gloo all-reduce, 2 ranks...")
        link = measure_allreduce()
    device = DeviceProfile(
        "local CPU", {"float32": peak32, "bfloat16": bf16, "float16": bf16},
        memory_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        memory_bandwidth=bandwidth, kernel_overhead_s=overhead, matmul_efficiency=1.0,
        memory_efficiency=1.0, source=f"graphopt calibrate, {time.strftime('%Y-%m-%d')}",
        matmul_curve=tuple(curve))
    profile = ClusterProfile("local", device, (ClusterLevel("node", os.cpu_count() or 1,
                                                            link),),
                             "measured by graphopt calibrate")
    target = path or local_profile_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(cluster_to_dict(profile), indent=2))
    log(f"wrote {target}")
    return profile
