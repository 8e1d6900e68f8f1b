"""Graph dumps: readable code of every graph before/after every pass, diffs, renderings.

Layout, per graph Dynamo compiles (``graph_NNN``)::

    00_dynamo.py                 the Torch-IR graph Dynamo produced
    01_normalized.py             the pre-autograd ATen graph
    NN_<stage>.<pass>.before.py / .after.py / .diff
    joint.py | forward.py | backward.py | inference.py
    *.dot (+ .svg when Graphviz's ``dot`` is installed), when pydot is installed
    report.json, report.md

Models: torch/fx/passes/graph_transform_observer.py; torchtitan graph_trainer's dumps.
"""

from __future__ import annotations

import difflib
import shutil
import subprocess
import time
from pathlib import Path

from torch import fx

from graphopt.report import CompileReport

_claimed: set[Path] = set()


def _claim(root: Path) -> None:
    """On this process's first dump into ``root``, remove the graph_NNN folders an earlier
    run left there (only folders graphopt wrote: they hold a report.json), so one dump
    directory never mixes two runs."""
    key = root.resolve()
    if key in _claimed:
        return
    _claimed.add(key)
    for old in root.glob("graph_[0-9]*"):
        if (old / "report.json").exists() or (old / "00_dynamo.py").exists():
            shutil.rmtree(old)


def graph_code(gm: fx.GraphModule) -> str:
    """Readable Python for ``gm`` with dtype/shape annotations on every value."""
    return gm.print_readable(print_output=False, include_stride=False, include_device=True)


class Dumper:
    """Writes a compile's graphs under ``root/graph_NNN``; a no-op when ``root`` is None."""

    def __init__(self, root: Path | None, graph_id: int, report: CompileReport) -> None:
        self.dir = None if root is None else root / f"graph_{graph_id:03d}"
        self.report = report
        self._step = 0
        if root is not None and self.dir is not None:
            _claim(root)
            self.dir.mkdir(parents=True, exist_ok=True)

    @property
    def enabled(self) -> bool:
        return self.dir is not None

    def _write(self, name: str, text: str) -> None:
        assert self.dir is not None
        (self.dir / name).write_text(text)

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
        except (ImportError, RuntimeError):  # pydot missing: code dumps are enough
            return
        assert self.dir is not None
        dot_path = self.dir / f"{name}.dot"
        dot.write_raw(str(dot_path))  # type: ignore[attr-defined]
        exe = shutil.which("dot")
        if exe is not None:
            subprocess.run([exe, "-Tsvg", str(dot_path), "-o", str(dot_path.with_suffix(".svg"))],
                           check=False, capture_output=True, timeout=120)
