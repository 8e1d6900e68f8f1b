"""Graph dumps: readable code of every graph before/after every pass, diffs, renderings.

Layout, per graph Dynamo compiles (``graph_NNN``)::

    00_dynamo.py                 the Torch-IR graph Dynamo produced
    01_normalized.py             the pre-autograd ATen graph
    NN_<stage>.<graph>.<pass>.before.py / .after.py / .diff
    joint.py | forward.py | backward.py | inference.py
    *.dot (+ .svg when Graphviz's ``dot`` is installed), when pydot is installed
    report.json, report.md
    .owner                       "<pid> <host>" of the process writing the folder

Under torch.distributed (``WORLD_SIZE`` > 1) each rank writes under ``rank<R>/``. A folder
another live process owns is never removed or written: that process's graph takes
``graph_NNN.pid<P>`` (a review ran two processes on one dump directory: each deleted the
other's folders and one compile died on a missing report.json). A failed write warns and
stops this graph's dump; it never fails the compile.

Models: torch/fx/passes/graph_transform_observer.py; torchtitan graph_trainer's dumps.
"""

from __future__ import annotations

import difflib
import itertools
import os
import re
import shutil
import socket
import subprocess
import time
import warnings
from pathlib import Path

from torch import fx

from graphopt.report import CompileReport

_claimed: set[Path] = set()


def _claim(top: Path, root: Path) -> None:
    """On this process's first dump into ``root`` (``top`` or, for a rank, ``top/rank<R>``),
    remove the graph_NNN folders an earlier run left there (only folders graphopt wrote and
    no live process owns), so one dump directory never mixes two runs. A single process
    also removes an earlier multi-rank run's ``rank*/`` folders, and rank 0 of a
    multi-rank run an earlier single process's folders and those of ranks beyond this
    world (a review: ``graphopt explain`` listed a torchrun run's graphs next to a later
    single process's, both as graph 0)."""
    key = root.resolve()
    if key in _claimed:
        return
    _claimed.add(key)
    stale = _graph_folders(root)
    if root == top:
        stale += [f for rank in _rank_folders(top) for f in _graph_folders(rank)]
    elif root.name == "rank0":
        world = _world_size()
        stale += _graph_folders(top) + [
            f for rank in _rank_folders(top) if int(rank.name[4:]) >= world
            for f in _graph_folders(rank)]
    for old in stale:
        if _owner(old) != os.getpid():  # this process's own graphs from before its process
            _remove_if_dead(old)          # group came up (a re-review: rank 0 deleted them)


def _rank_folders(top: Path) -> list[Path]:
    """``rank<R>`` folders (exactly: a user's ``rank1_notes/`` is not one)."""
    return [p for p in top.glob("rank[0-9]*") if p.name[4:].isascii() and p.name[4:].isdigit()]


_GRAPH_FOLDER = re.compile(r"(graph_\d{3,}|export(_\d{3,})?)(\.pid\d+)?")


def _graph_folders(root: Path) -> list[Path]:
    """The folders :class:`Dumper` names: ``graph_NNN`` or ``export[_NNN]``, either with
    ``.pid<P>`` (exactly: a user's ``graph_2024_experiments/`` is not one)."""
    return [p for pattern in ("graph_[0-9]*", "export*") for p in root.glob(pattern)
            if _GRAPH_FOLDER.fullmatch(p.name)]


def _remove_if_dead(folder: Path) -> None:
    """Remove a graph folder graphopt wrote unless a live process other than this one owns
    it. Only the ``.owner`` marker, which :class:`Dumper` writes first, makes a folder
    graphopt's: a review's dump directory held the user's ``export/`` and
    ``graph_2024_experiments/`` with a ``report.json`` each, and the first compile deleted
    both."""
    if (folder / ".owner").is_file() and not _owned_by_another_live_process(folder):
        shutil.rmtree(folder, ignore_errors=True)


_HOST = socket.gethostname()


def _owner_tag() -> str:
    """What ``.owner`` holds: "<pid> <host>" (a dump directory may be shared by nodes)."""
    return f"{os.getpid()} {_HOST}"


def _owner(folder: Path) -> int | None:
    """The pid that owns ``folder``; -1 for a process on another host (its liveness cannot
    be checked here: treated as alive, so a node never removes another node's dumps)."""
    try:
        pid, _, host = (folder / ".owner").read_text().strip().partition(" ")
        return int(pid) if not host or host == _HOST else -1
    except (OSError, ValueError):
        return None


def _owned_by_another_live_process(folder: Path) -> bool:
    pid = _owner(folder)
    if pid is None or pid == os.getpid():
        return False
    if pid == -1:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _world_size() -> int:
    """The initialized process group's size, else torchrun's WORLD_SIZE, else 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    world = os.environ.get("WORLD_SIZE", "1")
    return int(world) if world.isdigit() else 1


def _rank_root(root: Path) -> Path:
    """``root/rank<R>`` for a rank of a multi-process job (an initialized process group, or
    torchrun's env), else ``root``. (Ranks started by ``mp.spawn`` + ``init_process_group``
    set no env: both wrote one folder, a review found graphs lost and mixed.)"""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return root / f"rank{dist.get_rank()}"
    world, rank = os.environ.get("WORLD_SIZE"), os.environ.get("RANK")
    if world is not None and rank is not None and world.isdigit() and int(world) > 1:
        return root / f"rank{rank}"
    return root


def _claim_folder(folder: Path) -> Path:
    """Make ``folder`` this process's: its ``.owner`` appears whole and only once (a hard
    link of a written file; ``O_EXCL`` where the filesystem has no hard links), so two
    processes never both take one folder (checking the owner, then writing it, let two
    processes on one directory write into one graph folder, a review); a folder another
    process claimed first gets a ``.pid<P>`` sibling."""
    for candidate in (folder, folder.with_name(f"{folder.name}.pid{os.getpid()}")):
        candidate.mkdir(parents=True, exist_ok=True)
        if _create_owner(candidate) or _owner(candidate) == os.getpid():
            return candidate  # (this process's already: a recompile)
    raise FileExistsError(f"{folder}: claimed by another process")


def _create_owner(folder: Path) -> bool:
    """Create ``folder/.owner`` holding this process's tag; False if it exists."""
    owner, staged = folder / ".owner", folder / f".owner.{os.getpid()}"
    staged.write_text(_owner_tag())
    try:  # no moment at which another process reads an empty owner (taken as dead)
        os.link(staged, owner)
        return True
    except FileExistsError:
        return False
    except OSError:  # no hard links on this filesystem
        try:
            with owner.open("x") as handle:
                handle.write(_owner_tag())
            return True
        except FileExistsError:
            return False
    finally:
        staged.unlink(missing_ok=True)


def graph_code(gm: fx.GraphModule) -> str:
    """Readable Python for ``gm`` with dtype/shape annotations on every value. The class
    is named after the compiled callable, which is not an identifier for a lambda
    (``class <lambda>(...)``: a review found most dump files of a lambda unparsable); such
    a name becomes ``GraphModule``."""
    code = gm.print_readable(print_output=False, include_stride=False, include_device=True)
    name = type(gm).__name__
    if not name.isidentifier():
        code = code.replace(f"class {name}(", "class GraphModule(", 1)
    return code


_EXPORTS = itertools.count()
"""Exports dumped by this process (``export``, then ``export_001``, ...)."""


class Dumper:
    """Writes a compile's graphs under ``root/graph_NNN`` (an export's under ``root/export``,
    ``export_001``, ...); a no-op when ``root`` is None."""

    def __init__(self, root: Path | None, graph_id: int, report: CompileReport) -> None:
        self.dir: Path | None = None
        self.report = report
        self._step = 0
        if root is None:
            return
        top, root = root, _rank_root(root)
        if graph_id >= 0:
            folder = root / f"graph_{graph_id:03d}"
        else:  # one folder per export of this process (a review: a second export into the
            exports = next(_EXPORTS)  # same directory replaced the first one's graphs)
            folder = root / ("export" if exports == 0 else f"export_{exports:03d}")
        try:
            _claim(top, root)
            if _owned_by_another_live_process(folder) or \
                    (folder.exists() and not (folder / ".owner").is_file()):
                # another live process's, or not graphopt's at all (a user's graph_000/ or
                # export/: writing there marked it, and the next run removed the user's
                # files, a re-review)
                folder = folder.with_name(f"{folder.name}.pid{os.getpid()}")
            elif _owner(folder) not in (None, os.getpid()):
                # written by a process that has ended since this one's first dump (two
                # runs on one directory: the other's graph_001 got this run's files too)
                _remove_if_dead(folder)
            folder = _claim_folder(folder)
        except OSError as exc:
            self._failed(exc)
            return
        self.dir = folder

    @property
    def enabled(self) -> bool:
        return self.dir is not None

    def _write(self, name: str, text: str) -> None:
        if self.dir is None:
            return
        try:
            (self.dir / name).write_text(text)
        except OSError as exc:
            self._failed(exc)

    def _failed(self, exc: OSError) -> None:
        warnings.warn(f"graphopt: dump stopped for this graph ({type(exc).__name__}: {exc}); "
                      "the compile goes on", stacklevel=3)
        self.dir = None

    def graph(self, name: str, gm: fx.GraphModule, render: bool = False) -> None:
        """Write ``gm`` as ``name.py`` (and ``name.dot``/``.svg`` when ``render``)."""
        if self.dir is None:
            return
        start = time.perf_counter()
        self._write(f"{name}.py", graph_code(gm))
        if render:
            self._render(name, gm)
        self.report.add_time("dump", time.perf_counter() - start)

    def pass_step(self, stage: str, pass_name: str, graph_kind: str, before: str,
                  gm: fx.GraphModule) -> None:
        """Write the code before/after one pass and their unified diff."""
        if self.dir is None:
            return
        start = time.perf_counter()
        self._step += 1
        stem = f"{self._step + 1:02d}_{stage}.{graph_kind}.{pass_name}"
        after = graph_code(gm)
        self._write(f"{stem}.before.py", before)
        self._write(f"{stem}.after.py", after)
        diff = difflib.unified_diff(before.splitlines(keepends=True),
                                    after.splitlines(keepends=True),
                                    fromfile=f"{stem}.before.py", tofile=f"{stem}.after.py")
        self._write(f"{stem}.diff", "".join(diff))
        self.report.add_time("dump", time.perf_counter() - start)

    def write_report(self) -> None:
        if self.dir is None:
            return
        start = time.perf_counter()
        self.report.add_time("dump", 0.0)
        self._write("report.json", self.report.to_json())
        self._write("report.md", self.report.to_markdown())
        self.report.add_time("dump", time.perf_counter() - start)

    def _render(self, name: str, gm: fx.GraphModule) -> None:
        try:
            from torch.fx.passes.graph_drawer import FxGraphDrawer

            dot = FxGraphDrawer(gm, name).get_main_dot_graph()
        except (ImportError, RuntimeError):  # pydot missing: code dumps are enough, and the
            # report says why there are no drawings (a new user found none, silently)
            note = "dump: no .dot graph drawings (pydot is not installed: pip install pydot)"
            if self.dir is not None and note not in self.report.notes:
                self.report.notes.append(note)
            return
        if self.dir is None:
            return
        dot_path = self.dir / f"{name}.dot"
        try:
            dot.write_raw(str(dot_path))  # type: ignore[attr-defined]
        except OSError as exc:
            self._failed(exc)
            return
        exe = shutil.which("dot")
        if exe is not None:
            subprocess.run([exe, "-Tsvg", str(dot_path), "-o", str(dot_path.with_suffix(".svg"))],
                           check=False, capture_output=True, timeout=120)
