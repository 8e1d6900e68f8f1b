"""Spawning real torch.distributed process groups on this machine (gloo on 127.0.0.1), and
finding a group by the name graphopt's custom ops carry.

Used by the cost model's calibration (a measured all-reduce), by the expert-parallel
benchmark and by the multi-rank tests. torch.multiprocessing starts the ranks (forked from a
forkserver that preloaded torch, transformers and graphopt where the OS has one, else
spawned); each joins a gloo group through a TCP rendezvous on a free local port.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch


def group_by_name(name: str, size: int | None = None, what: str = "this op"
                  ) -> Any:
    """The process group named ``name`` ("" = the world), as custom ops receive it (a
    string argument survives tracing; a ProcessGroup object does not).

    Raises:
        RuntimeError: torch.distributed is not initialized (names ``what`` and the fix), or
            the group does not have ``size`` ranks.
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{what} needs an initialized torch.distributed process group "
                           "(run under torchrun, or call init_process_group first)")
    group = _resolve_process_group(name) if name else dist.group.WORLD  # type: ignore[arg-type]
    assert group is not None
    if size is not None and dist.get_world_size(group) != size:
        raise RuntimeError(f"group {name!r} has {dist.get_world_size(group)} ranks, expected "
                           f"{size}")
    return group


def all_reduce_host(value: torch.Tensor, op: Any = None, group: Any = None) -> torch.Tensor:
    """``value``, a host (CPU) tensor of any shape and dtype the backend reduces (the
    callers' flags and counts: float64, int64), all-reduced over ``group`` (None: the
    world) with ``op`` (a ``dist.ReduceOp``; None: sum), on the device the group's backend
    takes (NCCL and HCCL reduce no host tensors; gloo takes them as they are, via
    ``distributed_c10d._get_object_coll_device``). Returns a new host tensor, ``value``
    is not written. Collective: every rank of ``group`` calls it.

    Raises:
        RuntimeError: torch.distributed is not initialized (torch's own error).
    """
    import torch.distributed as dist

    try:
        kind = dist.distributed_c10d._get_object_coll_device(group)
    except (AttributeError, RuntimeError, ValueError):  # a torch without the helper
        kind = value.device.type
    out = value.to(kind).clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return out.to(value.device)


def slowest_rank_seconds(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` takes on the slowest rank: all ranks start together (a barrier) and
    the maximum of their wall times is all-reduced (what a synchronous step costs). Every
    rank of the default group must call it."""
    import time

    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    return float(all_reduce_host(elapsed, dist.ReduceOp.MAX))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a gloo rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_PRELOAD = ("torch", "torch.distributed", "transformers", "graphopt", "graphopt.parallel")


def _start(worker: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """Start ``nprocs`` processes running ``worker(i, *args)`` and wait for them (a failing
    one raises torch.multiprocessing's ProcessRaisedException). Where the OS has it, through
    a forkserver that has imported torch, transformers and graphopt once: each rank is then
    a fork of that clean server (~0.1 s) instead of a new interpreter importing them again
    (~6 s for 2 ranks, ~15 s for 4 on 2 CPU cores). Each rank gets the caller's current
    environment variables and working directory, as a spawned one would."""
    import importlib.util
    import multiprocessing

    import torch.multiprocessing as mp

    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() \
        else "spawn"
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(
            [m for m in _PRELOAD if importlib.util.find_spec(m.split(".")[0]) is not None])
    mp.start_processes(_in_caller_context, args=(worker, dict(os.environ), os.getcwd(), args),
                       nprocs=nprocs, start_method=method)


def _in_caller_context(i: int, worker: Callable[..., None], env: dict[str, str], cwd: str,
                       args: tuple[Any, ...]) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    worker(i, *args)


def _distributed_worker(rank: int, fn: Callable[..., Any], world: int, port: int, out: str,
                        args: tuple[Any, ...]) -> None:
    import torch.distributed as dist

    if "OMP_NUM_THREADS" not in os.environ:  # as torchrun: one intra-op thread per rank
        # (2 ranks of 2 threads each on 2 cores spent their time preempting each other)
        torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, f"{out}.{rank}")
        dist.barrier()  # no rank tears its group down while a peer still talks to it
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned processes joined in a real gloo
    process group on 127.0.0.1; returns every rank's (picklable) result, rank order.
    ``fn`` must be importable (a module-level function). A failing rank raises here.
    The rendezvous port is free when chosen; if another process took it before rank 0 bound
    it (concurrent test workers), the group starts again on a new port (twice at most)."""
    import tempfile

    check_room(world)
    for attempt in range(3):
        with tempfile.TemporaryDirectory() as tmp:
            out = f"{tmp}/result"
            try:
                _start(_distributed_worker, (fn, world, free_port(), out, args), world)
            except Exception as e:
                if attempt < 2 and "address already in use" in str(e).lower() \
                        and not any(os.path.exists(f"{out}.{r}") for r in range(world)):
                    continue
                raise
            return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]
    raise AssertionError("unreachable")


RANK_BYTES = 400 * 2**20
"""What one spawned rank holds at least: a Python process with torch, transformers and
graphopt imported and a small model (about 0.3-0.4 GiB resident, measured with the demo's
MiniMax)."""


def check_room(world: int) -> None:
    """Refuse (ConfigError) a world of local ranks that this machine's available memory
    (``MemAvailable``, bytes) cannot start at :data:`RANK_BYTES` each: ``graphopt demo
    --parallel 100000`` spawned ranks until the machine ran out of memory (a review). No
    check where /proc/meminfo is missing (not Linux).

    Raises:
        ConfigError: ``world`` < 1, or more ranks than fit (names how many do).
    """
    from graphopt.errors import ConfigError

    if world < 1:
        raise ConfigError(f"a world of {world} ranks: it needs at least 1")
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return  # not Linux: nothing to check against
    if world * RANK_BYTES > available:
        raise ConfigError(
            f"{world} local ranks need about {world * RANK_BYTES / 2**30:.0f} GiB "
            f"({RANK_BYTES // 2**20} MiB each) and this machine has "
            f"{available / 2**30:.1f} GiB available: use at most "
            f"{max(1, available // RANK_BYTES)} ranks here, or run the job under torchrun "
            "on more machines")


def _fake_worker(_: int, fn: Callable[..., Any], world: int, rank: int, out: str,
                 args: tuple[Any, ...]) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        torch.save(fn(rank, world, *args), out)
    finally:
        dist.destroy_process_group()


def run_fake_world(fn: Callable[..., Any], world: int, rank: int, *args: Any) -> Any:
    """Run ``fn(rank, world, *args)`` in one spawned process that is ``rank`` of a ``world``
    of ranks on torch's fake process group (collectives return without communicating):
    meshes, placements and local shapes of large worlds, checked without the hardware."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/result"
        _start(_fake_worker, (fn, world, rank, out, args), 1)
        return torch.load(out, weights_only=False)
