"""Calibrate the ``local`` profile by microbenchmarks on this machine (``graphopt calibrate``).

Measured (medians of repeated timings, in a process with the default thread count):
- GEMM FLOP/s of square fp32 matmuls n = 32 .. 2048 (the ``matmul_curve``; its maximum is
  the fp32 peak), and bf16 at the largest size;
- memory bandwidth from a large tensor copy (bytes read + written per second);
- per-op overhead of eager training (a tiny transformers GPT-2, forward and backward, divided
  by the ATen ops it dispatches: not one of the validated models or sizes);
- the fused attention kernel's rate relative to the GEMM rate (causal SDPA fwd+bwd);
- gloo all-reduce between 2 local ranks at several sizes, fitted to alpha + m * 2(n-1)/n / B
  (latency, bandwidth of the ``local`` link).

The profile is written as JSON to ``$GRAPHOPT_CACHE_DIR/local.json`` (default
``~/.cache/graphopt``) and loaded by ``load_profile("local")``. Other work on the machine
slows every timing: calibrate warns, and says so in the profile's ``source``, when other
processes used more than :data:`OTHER_LOAD_LIMIT` of the CPUs while it measured
(:class:`OtherLoad`), or when repeated timings spread more than 2x.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import warnings
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
    local_profile_path,
)

_SPREAD: list[float] = []
"""The slowest / fastest timing ratio of each :func:`_median_time` since the last
:func:`calibrate` began (a busy machine spreads them)."""


def _busy_ticks() -> int | None:
    """Clock ticks every CPU of the machine spent busy (user, nice, system, irq, softirq,
    steal; ``/proc/stat``'s first line); None where there is no ``/proc/stat``."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
    return user + nice + system + irq + softirq + steal


class OtherLoad:
    """The share of this machine's CPU time that other processes used while the block ran:
    (every CPU's busy time - this process's and its children's CPU time) / (wall time x
    CPUs), from ``/proc/stat`` and ``os.times`` (Linux; ``share`` stays None elsewhere).
    Children count as this process's when they are started and reaped inside the block
    (``os.times`` adds a child's CPU time when it is waited for). ``/proc/stat`` is the
    host's: in a container limited to fewer CPUs, other tenants' work counts too.

    Sustained work next to calibrate (a test suite, a compile) slows every timing alike, so
    repeated timings agree and the spread check (:data:`_SPREAD`) misses it: a review's
    runs beside a 2-worker pytest saved 525-673 us per op (7 us idle) without a warning."""

    def __init__(self) -> None:
        self.share: float | None = None

    def __enter__(self) -> OtherLoad:
        self._start = (_busy_ticks(), os.times(), time.perf_counter())
        return self

    def __exit__(self, *exc: Any) -> None:
        busy0, times0, wall0 = self._start
        busy1, times1, wall1 = _busy_ticks(), os.times(), time.perf_counter()
        cpus, tick = os.cpu_count() or 1, os.sysconf("SC_CLK_TCK")
        if busy0 is None or busy1 is None or wall1 <= wall0:
            return
        ours = sum(b - a for a, b in zip(times0[:4], times1[:4]))  # user, sys, children's
        self.share = max(0.0, ((busy1 - busy0) / tick - ours) / ((wall1 - wall0) * cpus))


OTHER_LOAD_LIMIT = 0.2
"""Share of the machine other processes may use during calibrate before it warns."""


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
    _SPREAD.append(max(times) / min(times))
    return statistics.median(times)


def measure_matmul(sizes: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048),
                   dtype: torch.dtype = torch.float32, reps: int = 5
                   ) -> list[tuple[float, float]]:
    """(n, FLOP/s) of an n x n x n matmul: the better of two passes over ``sizes``.

    Warns (UserWarning) when the two passes differ by more than 2x at some size: another
    process was using the cores (a run next to a test suite measured 0.1 GFLOP/s at n = 64
    where an idle run measures ~100, and saved it as the profile)."""
    passes = []
    for _ in range(2):
        times = []
        for n in sizes:
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            times.append(_median_time(lambda: torch.mm(a, b), reps))  # noqa: B023
        passes.append(times)
    unstable = [n for n, t1, t2 in zip(sizes, *passes) if max(t1, t2) > 2 * min(t1, t2)]
    if unstable:
        warnings.warn(f"graphopt calibrate: matmul times at n = {unstable} differ by more than "
                      "2x between two passes: another process is probably using the cores; "
                      "rerun calibrate on an idle machine", stacklevel=2)
    return [(float(n), 2 * n**3 / min(t1, t2)) for n, t1, t2 in zip(sizes, *passes)]


def measure_bandwidth(nbytes: int = 256 * 2**20, reps: int = 5) -> float:
    """Bytes/s of a large copy (read + write)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    t = _median_time(lambda: dst.copy_(src), reps)
    return 2 * nbytes / t


class _CountOps:
    """Counts the ATen ops a callable dispatches."""

    @staticmethod
    def count(fn: Callable[[], Any]) -> int:
        from torch.utils._python_dispatch import TorchDispatchMode

        class Count(TorchDispatchMode):
            ops = 0

            def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                                   kwargs: dict | None = None) -> Any:
                Count.ops += 1
                return func(*args, **(kwargs or {}))

        with Count():
            fn()
        return Count.ops


def measure_overhead(reps: int = 9) -> float:
    """Seconds per dispatched op of eager training where Python dominates: a tiny
    transformers GPT-2 (1 layer, hidden 8, 8 tokens), forward + backward, timed and divided by
    the ATen ops it dispatches (Python, nn.Module, dispatcher and autograd bookkeeping per op,
    with the amount of Python per op that transformers model code has). Falls back to a stack
    of small torch.nn modules when transformers is not installed."""
    torch.manual_seed(0)
    try:
        from transformers import GPT2Config, GPT2LMHeadModel

        net: torch.nn.Module = GPT2LMHeadModel(GPT2Config(
            vocab_size=16, n_embd=8, n_layer=1, n_head=2, n_positions=8, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0))
        ids = torch.randint(0, 16, (1, 8))

        def loss() -> torch.Tensor:
            return net(input_ids=ids, labels=ids, use_cache=False).loss
    except ImportError:
        layers: list[torch.nn.Module] = []
        for _ in range(16):
            layers += [torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.GELU()]
        net = torch.nn.Sequential(*layers)
        x = torch.randn(2, 8)

        def loss() -> torch.Tensor:
            return net(x).sum()

    def step() -> None:
        net.zero_grad(set_to_none=True)
        loss().backward()

    ops = _CountOps.count(step)
    return _median_time(step, reps, min_time=0.05) / max(ops, 1)


def measure_attention_efficiency(reps: int = 5) -> float:
    """FLOP/s of causal SDPA forward+backward (B=1, H=8, S=1024, D=64) over the fp32 GEMM
    rate at the same FLOP count (the matmul curve's value for n = 512)."""
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v = (torch.randn(1, 8, 1024, 64, requires_grad=True) for _ in range(3))

    def step() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum() \
            .backward()

    import graphopt.cost.graph_cost  # noqa: F401  (the CPU SDPA formulas, causal-aware)
    from graphopt.cost.graph_cost import custom_flop_formulas

    counter = FlopCounterMode(display=False, custom_mapping=custom_flop_formulas())
    with counter:
        step()
    flops = counter.get_total_flops()
    rate = flops / _median_time(step, reps)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    gemm = 2 * 512**3 / _median_time(lambda: torch.mm(a, b), reps)
    return min(1.0, rate / gemm)


def _allreduce_worker(rank: int, world: int, sizes: list[int]) -> list[tuple[int, float]]:
    import torch.distributed as dist

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
    return results


def measure_allreduce(world: int = 2, sizes: tuple[int, ...] = (4096, 2**20, 16 * 2**20)
                      ) -> LinkProfile:
    """Fit latency and bandwidth of gloo all-reduce over ``world`` local ranks."""
    from graphopt.distributed import run_distributed

    data = run_distributed(_allreduce_worker, world, list(sizes))[0]
    # t = 2(n-1) alpha + 2(n-1)/n m / B: least squares on (1, m)
    xs = [2 * (world - 1) / world * m for m, _ in data]
    ts = [t for _, t in data]
    mean_x, mean_t = statistics.fmean(xs), statistics.fmean(ts)
    slope = sum((x - mean_x) * (t - mean_t) for x, t in zip(xs, ts)) / \
        sum((x - mean_x) ** 2 for x in xs)
    bandwidth = 1 / max(slope, 1e-12)
    alpha = max((mean_t - slope * mean_x) / (2 * (world - 1)), 1e-7)
    return LinkProfile(bandwidth=bandwidth, latency=alpha)


def check_writable(path: Path) -> None:
    """Raise ConfigError unless a file can be written at ``path`` (creating its folder);
    :func:`calibrate` calls it before measuring, so a bad path fails in a second, not after
    the benchmarks. An existing file is left as it is."""
    from graphopt.config import require_writable_file

    require_writable_file(path, "pass --out with a writable file path (e.g. ./local.json), "
                          "or set GRAPHOPT_CACHE_DIR to a writable folder",
                          what="the profile to ")


def calibrate(path: Path | None = None, collectives: bool = True,
              log: Callable[[str], None] = print) -> ClusterProfile:
    """Measure this machine and write the ``local`` profile; returns it.

    Raises:
        ConfigError: ``path`` (default :func:`local_profile_path`) cannot be written;
            checked before anything is measured.
    """
    target = path or local_profile_path()
    check_writable(target)
    _SPREAD.clear()
    with OtherLoad() as other:
        log(f"matmul fp32 ({torch.get_num_threads()} threads)...")
        curve = measure_matmul()
        peak32 = max(f for _, f in curve)
        log("matmul bf16...")
        bf16 = measure_matmul((1024,), torch.bfloat16)[0][1]
        log("memory bandwidth, kernel overhead...")
        bandwidth = measure_bandwidth()
        overhead = measure_overhead()
        attention = measure_attention_efficiency()
        link = LinkProfile(bandwidth=bandwidth / 2, latency=50e-6)
        if collectives:  # inside: its ranks are children spawned and reaped in the block,
            # so os.times counts all of their CPU time as calibrate's own (a re-review)
            log("gloo all-reduce, 2 ranks...")
            link = measure_allreduce()
    busy_note = ""
    if other.share is not None and other.share > OTHER_LOAD_LIMIT:
        busy_note = (f"; other processes used {other.share:.0%} of the CPUs while it "
                     "measured: slower than this machine is")
    device = DeviceProfile(
        "local CPU", {"float32": peak32, "bfloat16": bf16, "float16": bf16},
        memory_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        memory_bandwidth=bandwidth, kernel_overhead_s=overhead, matmul_efficiency=1.0,
        memory_efficiency=1.0, attention_efficiency=attention, kind="cpu",
        host_bandwidth=bandwidth / 2,  # "host" is this memory: a copy reads and writes
        source=f"graphopt calibrate, {time.strftime('%Y-%m-%d')}{busy_note}",
        threads=torch.get_num_threads(), matmul_curve=tuple(curve))
    profile = ClusterProfile("local", device, (ClusterLevel("node", os.cpu_count() or 1,
                                                            link),),
                             "measured by graphopt calibrate")
    target.write_text(json.dumps(cluster_to_dict(profile), indent=2))
    log(f"wrote {target}")
    if busy_note:
        warnings.warn(f"graphopt calibrate: other processes used {other.share:.0%} of this "
                      f"machine's CPU time while it measured (more than "
                      f"{OTHER_LOAD_LIMIT:.0%}): the profile written prices this machine "
                      "slower than it is; rerun graphopt calibrate on an idle machine",
                      stacklevel=2)
    busy = sum(r > 2 for r in _SPREAD)
    if busy:  # (a review: next to other work it saved 0 GFLOP/s at n = 64 and 619 us per
        # op, against 78 GFLOP/s and 9 us idle, with one warning about n = 1024 only)
        warnings.warn(f"graphopt calibrate: {busy} of {len(_SPREAD)} measurements had "
                      "repeated timings more than 2x apart: another process was probably "
                      "using the cores, and the profile written prices this machine slower "
                      "than it is; rerun graphopt calibrate on an idle machine", stacklevel=2)
    return profile
