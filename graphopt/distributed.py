"""Spawning real torch.distributed process groups on this machine (gloo on 127.0.0.1), and
finding a group by the name graphopt's custom ops carry.

Used by the cost model's calibration (a measured all-reduce), by the expert-parallel
benchmark and by the multi-rank tests. ``torch.multiprocessing.spawn`` starts the ranks; each
joins a gloo group through a TCP rendezvous on a free local port. Inside
:func:`shared_ranks` the spawned ranks are kept and reused between calls (the test suite).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
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
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a gloo rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _distributed_worker(rank: int, fn: Callable[..., Any], world: int, port: int, out: str,
                        args: tuple[Any, ...]) -> None:
    import torch.distributed as dist

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
    ``fn`` must be importable (a module-level function). A failing rank raises here
    (RuntimeError with its traceback). Inside :func:`shared_ranks` the ranks and their group
    are kept between calls of the same world size."""
    if _POOLS is not None:
        return _pool(world, "gloo").run(fn, args)
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/result"
        mp.spawn(_distributed_worker, args=(fn, world, free_port(), out, args), nprocs=world)
        return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]


_POOLS: dict[tuple[int, str], _RankPool] | None = None


@contextlib.contextmanager
def shared_ranks() -> Iterator[None]:
    """Within this context :func:`run_distributed` and :func:`run_fake_world` keep their
    spawned processes (and the gloo group) alive between calls and send each call's function
    to them, instead of spawning new ones: starting 4 ranks that import torch and
    transformers takes ~16 s on 2 CPU cores, the work of a small multi-rank test often less.
    Before every call each rank resets torch.compile's caches and graphopt's reports; after
    it the ranks meet at a barrier and destroy the groups the call created (each gloo group
    keeps threads of its own). A rank that fails or dies ends its pool (the next call starts
    a fresh one). The test suite runs inside it (conftest)."""
    global _POOLS
    outer = _POOLS
    if outer is None:
        _POOLS = {}
    try:
        yield
    finally:
        if outer is None:
            pools, _POOLS = _POOLS or {}, None
            for pool in pools.values():
                pool.close()


def _pool(world: int, backend: str) -> _RankPool:
    assert _POOLS is not None
    pool = _POOLS.get((world, backend))
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close()
        pool = _POOLS[world, backend] = _RankPool(world, backend)
    return pool


class _RankPool:
    """``world`` spawned ranks in one process group ("gloo" on 127.0.0.1, or "fake": one
    process that joins torch's fake group as the rank and world each call names), each
    running the functions it is sent until closed."""

    def __init__(self, world: int, backend: str) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        procs = 1 if backend == "fake" else world
        self.backend = backend
        self.tasks = [ctx.SimpleQueue() for _ in range(procs)]
        self.results = ctx.SimpleQueue()
        port = free_port()
        self.procs = [ctx.Process(target=_pool_worker, daemon=True,
                                  args=(r, world, backend, port, self.tasks[r], self.results))
                      for r in range(procs)]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...],
            fake: tuple[int, int] | None = None) -> list[Any]:
        import io
        import multiprocessing.connection as connection

        for q in self.tasks:
            q.put((fn, args, fake))
        out: dict[int, Any] = {}
        while len(out) < len(self.procs):
            ready = connection.wait([self.results._reader,  # type: ignore[attr-defined]
                                     *(p.sentinel for p in self.procs)])
            if self.results._reader not in ready:  # type: ignore[attr-defined]
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                self.close()
                raise RuntimeError(f"rank(s) {dead} of a shared {self.backend} pool died "
                                   f"while running {getattr(fn, '__name__', fn)}")
            rank, ok, payload = self.results.get()
            if not ok:
                self.close()  # the other ranks may wait in a collective for the failed one
                raise RuntimeError(f"rank {rank} failed in {getattr(fn, '__name__', fn)}:\n"
                                   f"{payload}")
            out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        return [out[r] for r in range(len(self.procs))]

    def close(self) -> None:
        for q, p in zip(self.tasks, self.procs):
            if p.is_alive():
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


def _pool_worker(rank: int, world: int, backend: str, port: int, tasks: Any,
                 results: Any) -> None:
    import io
    import traceback

    import torch.distributed as dist

    if backend == "gloo":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
    while True:
        task = tasks.get()
        if task is None:
            break
        try:
            fn, args, fake = task
            _reset_process_state()
            if fake is not None:
                from torch.testing._internal.distributed.fake_pg import FakeStore

                dist.init_process_group("fake", store=FakeStore(), rank=fake[1],
                                        world_size=fake[0])
                try:
                    result = fn(fake[1], fake[0], *args)
                finally:
                    dist.destroy_process_group()
            else:
                result = fn(rank, world, *args)
                dist.barrier()  # no rank tears a group down while a peer still talks on it
                _destroy_subgroups()
            buf = io.BytesIO()
            torch.save(result, buf)
            results.put((rank, True, buf.getvalue()))
        except BaseException:  # reported to the caller, which closes the pool
            results.put((rank, False, traceback.format_exc()))
            break
    if dist.is_initialized():
        dist.destroy_process_group()


def _destroy_subgroups() -> None:
    """Destroy every process group but the world (the DeviceMeshes and groups a call made):
    each gloo group keeps its own threads, and hundreds of kept groups slow the machine."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    world = c10d.GroupMember.WORLD
    for pg in list(c10d._world.pg_map):
        if pg is not world:
            dist.destroy_process_group(pg)


def _reset_process_state() -> None:
    """What one call must not inherit from the last in a kept rank."""
    torch._dynamo.reset()
    import graphopt

    graphopt.clear_reports()


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
    if _POOLS is not None:
        return _pool(1, "fake").run(fn, args, fake=(world, rank))[0]
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/result"
        mp.spawn(_fake_worker, args=(fn, world, rank, out, args), nprocs=1)
        return torch.load(out, weights_only=False)
