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
  (:func:`writes_a_retrace_drops`) and the restart asks for nothing but those symbols, the
  same Dynamo graph is compiled again (the symbols are now marked specialized, so the
  tensorify pass passes) and the symbols are unmarked afterwards;
- a graph Dynamo hands over already lacking the write (:func:`dropped_writes`: the input's
  fake tensor was written more often than the graph's nodes write it) has its symbols
  unmarked and Dynamo is asked to trace again.

Anything else (a restart that also specializes other floats) raises :class:`CaptureError`
naming the input and the fix, never a silently lost write.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from graphopt.errors import CaptureError
from graphopt.passes.fx_utils import roots_written_by, write_counts


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
    the symbols the tensorify pass has just marked: ``{symbol: "add_ of L['n']"}``."""
    found: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.users or node.op not in ("call_function", "call_method"):
            continue
        roots = roots_written_by(node)
        symbol = _memo_symbol(node.meta.get("example_value"))
        if roots and symbol is not None:
            name = node.target if isinstance(node.target, str) else \
                getattr(node.target, "__name__", str(node.target))
            found.setdefault(symbol, f"{name} of {', '.join(_source(r) for r in roots)}")
    return found


def dropped_writes(gm: fx.GraphModule) -> dict[str, str]:
    """The 0-d float64 inputs of Dynamo's graph ``gm`` whose writes the trace made but the
    graph lacks: the fake tensor's version counter (one per in-place write Dynamo traced)
    exceeds the graph's writes of it, and its value symbol is marked specialized.
    ``{symbol: "L['n'] (written 1 time(s) in the trace, 0 in the graph)"}``."""
    counts = write_counts(gm)
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


def lost_write_error(writes: dict[str, str], why: str) -> CaptureError:
    """The error for writes graphopt cannot keep; names them and the fix."""
    return CaptureError(
        f"Dynamo's graph would lose the in-place write(s) {', '.join(writes.values())} to a "
        f"0-d float64 CPU tensor ({why}). This is a torch 2.13 bug in Dynamo's tensorify "
        "restart (backend='aot_eager' computes the same wrong result); graphopt refuses to "
        "compile it rather than drop the write. Fix: give the tensor shape (1,) instead of "
        "(), keep it in float32, or update it outside the compiled function")


__all__ = ["dropped_writes", "lost_write_error", "specialized_symbols", "unmark",
           "writes_a_retrace_drops"]
