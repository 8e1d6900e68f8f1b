"""In-place writes to 0-d float64 CPU tensors that Dynamo's tensorify restart drops.

A torch 2.13 bug, which ``backend="aot_eager"`` shares: Dynamo gives every 0-d CPU float64
input (a step counter, a scale buffer) a float symbol for its value
(``FakeTensor.item_memo``). AOTAutograd's ``tensorify_python_scalars`` pass cannot
tensorify a symbol the graph never reads through ``.item()``, so it asks Dynamo to
specialize it (``TensorifyState``) and raises ``TensorifyScalarRestartAnalysis``. On the
retrace, ``OutputGraph.remove_tensorify_specialized_graphargs`` removes every node whose
fake value memoizes a specialized symbol and whose users are all ``.item()`` calls; a write
whose result is unused (``n.add_(1)``, ``n += 1``, ``n.fill_(3.0)``) has no users at all,
so it is removed, and the compiled function never writes ``n``. ``TensorifyState`` is global
and outlives the frame, so a later recompile of the same frame drops the write with no
restart.

graphopt compiles around it (:func:`graphopt.pipeline.compile_graph`):

- when AOTAutograd raises the restart for a graph that holds such a write
  (:func:`writes_a_retrace_drops`), the same Dynamo graph is compiled again: the symbols are
  now marked, so the tensorify pass passes; other floats it marked are specialized in the
  graph with guards, as the retrace would have done. The pass may ask once per autograd
  level, so this repeats a few times at most; the new marks are removed afterwards;
- a graph Dynamo hands over already lacking the write (:func:`dropped_writes`: the input's
  fake tensor was written more often than the graph's nodes, body graphs included, write
  it) has its symbols unmarked and Dynamo is asked to trace again, once per frame compile;
- a graph that reads such a tensor with ``.item()`` before a write and uses the value after
  it is refused (:func:`stale_reads`): torch answers a later ``.item()`` with the earlier
  value, and the two programs give the same graph.

Where graphopt cannot keep a write it raises :class:`CaptureError` naming the input and the
fix, never a silently lost write.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from graphopt.errors import CaptureError
from graphopt.passes.fx_utils import op_name, roots_written_by, write_counts

_unmarked: set[tuple[Any, str]] = set()
"""(frame compile id, symbol) pairs :func:`unmark_dropped` has unmarked: a second time in the
same frame compile means the marks and restarts would go round in a loop."""


def _state() -> Any:
    from torch._dynamo.symbolic_convert import TensorifyState

    return TensorifyState


def specialized_symbols() -> set[str]:
    """A copy of the float symbols Dynamo was asked to specialize (``TensorifyState``)."""
    return set(_state().force_specializations)


def unmark(symbols: set[str]) -> None:
    """Remove float symbols (names like ``"zf3"``) from ``TensorifyState``."""
    _state().force_specializations.difference_update(symbols)


def _memo_symbol(value: Any) -> str | None:
    """The name of the float symbol Dynamo memoizes for a fake 0-d CPU float64 tensor's
    value, when a tensorify restart marked it specialized; None otherwise."""
    from torch._subclasses.fake_tensor import FakeTensor

    if not isinstance(value, FakeTensor) or value.dtype != torch.float64:
        return None
    memo = value.item_memo
    name = getattr(getattr(getattr(memo, "node", None), "_expr", None), "name", None)
    if isinstance(name, str) and _state().should_specialize(name):
        return name
    return None


def _source(node: fx.Node) -> str:
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    name = getattr(source, "name", None)
    return name if isinstance(name, str) else str(node.target)


def writes_a_retrace_drops(gm: fx.GraphModule) -> dict[str, str]:
    """The in-place writes of Dynamo's graph ``gm`` that Dynamo's next trace removes, given
    the symbols the tensorify pass has just marked: ``{symbol: "add_ of L['n']"}``. Those
    are the writes whose users are all ``.item()`` calls (none at all, or
    ``n.add_(1).item()``, whose value the retrace also replaces by a constant)."""
    found: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method") or \
                any(user.target != "item" for user in node.users):
            continue
        roots = roots_written_by(node)
        symbol = _memo_symbol(node.meta.get("example_value"))
        if roots and symbol is not None:
            found.setdefault(symbol,
                             f"{op_name(node)} of {', '.join(_source(r) for r in roots)}")
    return found


def dropped_writes(gm: fx.GraphModule) -> dict[str, str]:
    """The 0-d float64 inputs of Dynamo's graph ``gm`` whose writes the trace made but the
    graph lacks: the fake tensor's version counter (one per in-place write Dynamo traced)
    exceeds the graph's writes of it, and its value symbol is marked specialized.
    ``{symbol: "L['n'] (written 1 time(s) in the trace, 0 in the graph)"}``."""
    counts = write_counts(gm, into_subgraphs=True)
    found: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("example_value")
        symbol = _memo_symbol(value)
        if symbol is None:
            continue
        traced, kept = int(value._version), counts.get(node, 0)
        if traced > kept:
            found[symbol] = (f"{_source(node)} (written {traced} time(s) in the trace, "
                             f"{kept} in the graph)")
    return found


def unmark_dropped(dropped: dict[str, str]) -> None:
    """Unmark the symbols of writes :func:`dropped_writes` found, so that Dynamo's next trace
    keeps them.

    Raises:
        CaptureError: this frame compile already unmarked one of them (the tensorify pass
            marked it again and the retrace dropped the write again: a loop).
    """
    from torch._guards import CompileContext

    frame = CompileContext.current_compile_id()
    key = (frame.frame_id, frame.frame_compile_id) if frame is not None else None
    again = {s: w for s, w in dropped.items() if (key, s) in _unmarked}
    if again:
        raise lost_write_error(again, "Dynamo dropped them again after graphopt asked it to "
                                      "trace again")
    _unmarked.update((key, s) for s in dropped)
    unmark(set(dropped))


def stale_reads(gm: fx.GraphModule) -> list[str]:
    """``.item()`` reads of a 0-d float64 CPU input that a later in-place write makes stale
    while the value is still used after it.

    torch 2.13's fake tensor keeps the memoized value symbol across the write, so Dynamo
    answers a second ``n.item()`` after ``n.mul_(3)`` with the first read's value (under
    ``capture_scalar_outputs``; ``backend="aot_eager"`` computes the same stale value). The
    graph looks the same as a program that means the old value, so both are refused.
    """
    from torch._subclasses.fake_tensor import FakeTensor

    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    last_write: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        for root in roots_written_by(node):
            last_write[root] = order[node]
    found = []
    for node in gm.graph.nodes:
        if node.target != "item" or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        root = node.args[0]
        value = root.meta.get("example_value")
        if root.op != "placeholder" or not isinstance(value, FakeTensor) or \
                value.dtype != torch.float64 or value.dim() != 0 or \
                value.device.type != "cpu":  # (torch memoizes CPU values only)
            continue
        written = last_write.get(root, -1)
        if order[node] < written and any(order[u] > written for u in node.users):
            found.append(_source(root))
    return found


def stale_read_error(sources: list[str]) -> CaptureError:
    """The error for :func:`stale_reads`; names the inputs and the fix."""
    return CaptureError(
        f"the graph reads {', '.join(sources)} with .item() before an in-place write and uses "
        "that value after the write. torch 2.13 keeps the value read before the write for "
        "a later .item() of a 0-d float64 CPU tensor (capture_scalar_outputs; "
        "backend='aot_eager' computes the same stale value), so graphopt cannot tell a "
        "stale read from an intended one and refuses the graph. Fix: keep the value as a "
        "tensor (n.clone() instead of n.item()), give the tensor shape (1,) or dtype "
        "float32, or leave torch._dynamo.config.capture_scalar_outputs off")


def lost_write_error(writes: dict[str, str], why: str) -> CaptureError:
    """The error for writes graphopt cannot keep; names them and the fix."""
    return CaptureError(
        f"Dynamo's graph would lose the in-place write(s) {', '.join(writes.values())} to a "
        f"0-d float64 CPU tensor ({why}). This is a torch 2.13 bug in Dynamo's tensorify "
        "restart (backend='aot_eager' computes the same wrong result); graphopt refuses to "
        "compile it rather than drop the write. Fix: give the tensor shape (1,) instead of "
        "(), keep it in float32, or update it outside the compiled function")


__all__ = ["dropped_writes", "lost_write_error", "specialized_symbols", "stale_read_error",
           "stale_reads", "unmark", "unmark_dropped", "writes_a_retrace_drops"]
