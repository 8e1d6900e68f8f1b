"""The compile report: what each pass matched, rewrote and skipped (and why), with timings.

One :class:`CompileReport` per graph Dynamo hands to the backend. Reports of this process are
kept in order (:func:`reports`, :func:`last_report`) so that tests and users can assert that a
pass really ran; with a dump directory they are also written as ``report.json`` and
``report.md``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

Action = Literal["matched", "rewritten", "skipped", "kept"]


@dataclass
class SiteRecord:
    """One region a pass looked at: its action and why."""

    action: Action
    site: str
    reason: str = ""
    approximate: bool = False
    """A rewrite that changes the numerics (of an approximate pass whose options can also
    leave a site exact: a capacity factor no expert can reach)."""


@dataclass
class PassRecord:
    """What one pass did to one graph."""

    name: str
    stage: str
    graph_kind: str
    exact: bool
    time_s: float = 0.0
    modified: bool = False
    nodes_before: int = 0
    nodes_after: int = 0
    op_delta: dict[str, int] = field(default_factory=dict)
    sites: list[SiteRecord] = field(default_factory=list)

    def record(self, action: Action, site: str, reason: str = "",
               approximate: bool = False) -> None:
        self.sites.append(SiteRecord(action, site, reason, approximate))

    def count(self, action: Action) -> int:
        return sum(1 for s in self.sites if s.action == action)


@dataclass
class CompileReport:
    """Everything graphopt did to one Dynamo graph.

    ``timing`` keys (seconds): normalize, passes, aot_autograd (AOTAutograd's own work, our
    hooks excluded), lowering (graph compilers), lowering_backward (the backward's compiler:
    AOTAutograd compiles it lazily, at the first backward, after total is taken), dump,
    verify, total (backend call, forward side) and graphopt_overhead = normalize + passes +
    dump + bookkeeping, i.e. the backend time that is neither AOTAutograd, nor the lowering
    compiler, nor verification.
    """

    graph_id: int
    status: str = "compiling"
    """"compiling" | "compiled" | "restarted by Dynamo: <why>" (Dynamo asked to re-trace,
    e.g. to specialize a float; a later report holds the compile) | "aborted: <exception>"."""
    fallback: str | None = None
    """Why the model passes were skipped (Dynamo's graph went to AOTAutograd as captured);
    None when they ran. See graphopt.capture."""
    lowering: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    training: bool = False
    dynamic: bool = False
    passes: list[PassRecord] = field(default_factory=list)
    graphs: dict[str, int] = field(default_factory=dict)
    timing: dict[str, float] = field(default_factory=dict)
    verify: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    graph_breaks: dict[str, int] = field(default_factory=dict)
    """Dynamo's graph breaks in this process (since :func:`clear_reports`) when this graph
    was compiled: first line of the reason -> count. Dynamo counts them per process, not per
    backend or model, so breaks of other ``torch.compile`` calls made since then are
    included. A break splits the model into several graphs (each its own report); code
    between them runs eagerly."""
    uncompiled_frames: dict[str, int] = field(default_factory=dict)
    """Frames Dynamo gave up on in this process (since :func:`clear_reports`) when this
    graph was compiled: see :func:`uncompiled_frames`. Later ones (the recompile limit
    reached after the last compile) are in ``graphopt.uncompiled_frames()``, not here."""

    def pass_records(self, name: str) -> list[PassRecord]:
        return [p for p in self.passes if p.name == name]

    def add_time(self, key: str, seconds: float) -> None:
        self.timing[key] = self.timing.get(key, 0.0) + seconds

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["timing"] = {k: round(v, 6) for k, v in self.timing.items()}
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> CompileReport:
        passes = [
            PassRecord(**{**p, "sites": [SiteRecord(**s) for s in p["sites"]]})
            for p in data.get("passes", [])
        ]
        return CompileReport(**{**data, "passes": passes})

    def to_markdown(self) -> str:
        lines = [
            f"# graphopt report: graph {self.graph_id}",
            "",
            f"- status: {self.status}",
            *([f"- FALLBACK (model passes skipped): {self.fallback}"] if self.fallback else []),
            f"- lowering: `{self.lowering}`; training: {self.training}; dynamic: {self.dynamic}",
            "- graphs: " + ", ".join(f"{k} {v} nodes" for k, v in self.graphs.items()),
            "- timing (s): " + ", ".join(f"{k} {v:.3f}" for k, v in self.timing.items()),
        ]
        if self.graph_breaks:
            lines.append(f"- graph breaks so far (this process, all torch.compile calls): "
                         f"{sum(self.graph_breaks.values())} ("
                         + "; ".join(f"{n}x {r}" for r, n in self.graph_breaks.items()) + ")")
        if self.uncompiled_frames:
            lines.append("- frames run uncompiled (no graphopt pass sees them) so far: "
                         + "; ".join(f"{n}x {r}" for r, n in self.uncompiled_frames.items()))
        if self.verify:
            lines.append(f"- verify: {self.verify.get('status')} {self.verify.get('detail', '')}"
                         + (f"; tolerance {self.verify['tolerance']}"
                            if "tolerance" in self.verify else ""))
        lines += ["", "| pass | stage | graph | exact | time (ms) | nodes | kept | rewritten "
                  "| skipped |", "|---|---|---|---|---|---|---|---|---|"]
        for p in self.passes:  # "kept" counts matched sites too, as `graphopt explain` does
            lines.append(
                f"| {p.name} | {p.stage} | {p.graph_kind} | {p.exact} | {p.time_s * 1e3:.1f} | "
                f"{p.nodes_before} -> {p.nodes_after} | {p.count('kept') + p.count('matched')} | "
                f"{p.count('rewritten')} | {p.count('skipped')} |"
            )
        for p in self.passes:
            if not p.sites and not p.op_delta:
                continue
            lines += ["", f"## {p.name} ({p.graph_kind})", ""]
            if p.op_delta:
                delta = ", ".join(f"{op} {d:+d}" for op, d in sorted(p.op_delta.items()))
                lines.append(f"op-count change: {delta}")
                lines.append("")
            for s in p.sites:
                lines.append(f"- {s.action}: `{s.site}`" + (f": {s.reason}" if s.reason else ""))
        for note in self.notes:
            lines.append(f"\nnote: {note}")
        return "\n".join(lines) + "\n"


_lock = threading.Lock()
_reports: list[CompileReport] = []
_graph_ids = itertools.count()


_baselines: dict[str, tuple[Any, dict[str, int]]] = {}
"""Dynamo counter category -> (its Counter when :func:`clear_reports` ran, a copy)."""


def graph_breaks() -> dict[str, int]:
    """Dynamo's graph breaks since :func:`clear_reports` (or process start): the first line
    of each reason -> count."""
    out: dict[str, int] = {}
    for reason, n in _since_clear("graph_break").items():
        short = str(reason).strip().splitlines()[0] if str(reason).strip() else "unknown"
        out[short] = out.get(short, 0) + n
    return out


def uncompiled_frames() -> dict[str, int]:
    """Frames Dynamo gave up on since :func:`clear_reports` (or process start), each of
    which runs uncompiled: plain Python and eager kernels, so no graphopt pass (a Lightning
    or MoE rewrite included) applies to the code in it. For example a graph break inside a
    loop, a ``try`` block or a context manager Dynamo cannot resume in (frames it calls are
    still compiled on their own), ``torch._dynamo.skip_frame()``, a backend failure under
    ``torch._dynamo.config.suppress_errors``, and a frame past
    ``torch._dynamo.config.recompile_limit`` (every later new shape runs eagerly). Dynamo
    does not count these among graph breaks, so a review saw a model whose rewrite had
    quietly stopped after its 8th sequence length.

    Read from Dynamo's compilation metrics (``torch._dynamo.utils.get_compilation_metrics``:
    one entry per frame compile, with its failure), which Dynamo keeps for its last 64
    compiles: each graphopt compile and each call of this function collects the new
    failures, so a failure followed by more than 64 compiles without either is missed. A
    frame Dynamo gave up on before :func:`clear_reports` keeps running eagerly without a new
    entry (Dynamo does not convert it again). A compiled ``nn.Module`` past the recompile
    limit is named by the frame Dynamo compiled, torch's wrapper (``inner`` in
    ``torch/_dynamo/external_utils.py``), not the module's ``forward``.

    Returns:
        "<Dynamo's reason, first line> (frame <function> (<file> line <n>))" -> count; for
        the recompile limit "<reason> (<limit type>, frame <function> (...))", the function
        taken from an earlier compile of the same frame (no function when none is kept).
    """
    _collect_failed_frames()
    out: dict[str, int] = {}
    with _lock:
        for key in _failed_frames:
            out[key] = out.get(key, 0) + 1
    return out


_failed_frames: list[str] = []
"""The keys of failed frame compiles collected since :func:`clear_reports`."""
_seen_metrics: dict[int, Any] = {}
"""id -> Dynamo metrics entry already collected or present at :func:`clear_reports` (the
entry is held so that its id is not reused)."""


def _collect_failed_frames() -> None:
    """Add the failed forward frame compiles in Dynamo's metrics not seen before to
    :data:`_failed_frames`."""
    from torch._dynamo.utils import get_compilation_metrics

    def where(m: Any) -> str:
        return f"{m.co_name} ({m.co_filename} line {m.co_firstlineno})"

    metrics = get_compilation_metrics()
    names = {_frame_id(m.compile_id): where(m) for m in metrics
             if m.co_name is not None and _frame_id(m.compile_id) is not None}
    with _lock:
        for m in metrics:
            if m.fail_type is None or m.is_forward is False or id(m) in _seen_metrics:
                continue
            _seen_metrics[id(m)] = m
            lines = [line.strip() for line in str(m.fail_reason or m.fail_type).strip()
                     .splitlines() if line.strip()] or [str(m.fail_type)]
            limit = next((line.split("Limit type:", 1)[1].strip() for line in lines
                          if "Limit type:" in line), None)
            # (the recompile limit's entry names no function: an earlier compile of its
            # frame does)
            frame = where(m) if m.co_name is not None else names.get(_frame_id(m.compile_id))
            parts = ([limit] if limit else []) + ([f"frame {frame}"] if frame else [])
            _failed_frames.append(f"{lines[0]} ({', '.join(parts) or m.fail_type})")


def _frame_id(compile_id: Any) -> str | None:
    """The frame part of Dynamo's compile id ("<frame>/<compile>", e.g. "0/2"), or None."""
    if compile_id is None:
        return None
    text = str(compile_id)
    return text.split("/", 1)[0] if "/" in text else None


def _since_clear(category: str) -> dict[str, int]:
    """Dynamo's ``counters[category]`` minus what :func:`clear_reports` saw. A Counter that
    is no longer the one seen there was cleared since (``counters.clear()``, as torch's
    TestCase does): all of it is new (a review: a running baseline hid later entries)."""
    from torch._dynamo.utils import counters

    current = counters[category]
    with _lock:
        seen, base = _baselines.get(category, (None, {}))
    if seen is not current:
        base = {}
    return {r: n - base.get(r, 0) for r, n in current.items() if n > base.get(r, 0)}


def register(report: CompileReport) -> None:
    """Keep ``report`` in this process's list, with the graph breaks counted so far."""
    report.graph_breaks = graph_breaks()
    report.uncompiled_frames = uncompiled_frames()
    with _lock:
        _reports.append(report)


def next_graph_id() -> int:
    with _lock:
        return next(_graph_ids)


def reports() -> list[CompileReport]:
    """All compile reports of this process, oldest first."""
    with _lock:
        return list(_reports)


def last_report() -> CompileReport:
    """The newest compile report. Raises LookupError when nothing was compiled yet."""
    with _lock:
        if not _reports:
            raise LookupError(
                "no graph has been compiled with backend='graphopt' yet (the compiled code "
                "has not run, or Dynamo skipped it: module.compile() on a torch.nn built-in "
                "module such as nn.Linear or nn.Sequential compiles nothing in torch 2.13, "
                "even for aot_eager; use torch.compile(module, backend='graphopt'))")
        return _reports[-1]


_on_clear: list[Callable[[], None]] = []
"""What :func:`clear_reports` also forgets (registered by passes that remember decisions
across graphs: attention='lightning''s per-site decisions)."""


def on_clear(forget: Callable[[], None]) -> None:
    """Call ``forget`` on every :func:`clear_reports`."""
    _on_clear.append(forget)


def clear_reports() -> None:
    """Forget this process's reports and the decisions passes compare across graphs, and
    start counting graph breaks from here."""
    from torch._dynamo.utils import counters, get_compilation_metrics

    for forget in _on_clear:
        forget()
    with _lock:
        _reports.clear()
        _baselines["graph_break"] = (counters["graph_break"], dict(counters["graph_break"]))
        _failed_frames.clear()
        _seen_metrics.clear()
        _seen_metrics.update((id(m), m) for m in get_compilation_metrics())


def _joint_records_dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "graphopt_joint_records"


def joint_records_key(*parts: Any) -> str:
    """A key for the joint-pass records of one compile: the model-pass output's code and
    every option the joint passes depend on, plus graphopt's version."""
    from graphopt import __version__

    digest = hashlib.sha256(repr((__version__, *parts)).encode())
    return digest.hexdigest()[:32]


def save_joint_records(key: str, records: list[PassRecord]) -> None:
    """Store joint-pass records beside Inductor's cache (best effort: a read-only cache
    directory only loses the records)."""
    try:
        path = _joint_records_dir()
        path.mkdir(parents=True, exist_ok=True)
        (path / f"{key}.json").write_text(json.dumps([asdict(r) for r in records]))
    except OSError:
        pass


def load_joint_records(key: str) -> list[PassRecord] | None:
    """The records stored under ``key``, or None."""
    try:
        data = json.loads((_joint_records_dir() / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    return [PassRecord(**{**p, "sites": [SiteRecord(**s) for s in p["sites"]]}) for p in data]
