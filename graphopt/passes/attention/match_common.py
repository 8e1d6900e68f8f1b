"""Matching helpers shared by the attention pass's linear- and softmax-attention patterns.

Vocabulary: a *matcher* takes a node and returns what it matched or raises :class:`NoMatch`
whose message is the reason the report shows; matchers never edit a graph. Values of small
subgraphs (decays, masks, scales) are *evaluated* from an environment that maps placeholders
to the compile's real example inputs; a placeholder counts as a constant of the model only
when it is a module buffer (:func:`is_buffer`). The buffers an evaluation reads are recorded
(:func:`recording_buffer_reads`): the pipeline guards their values at run time, so a buffer
changed after the compile (``load_state_dict``, an in-place edit) does not keep a rewrite
made for its old value (``pipeline._guard_folded_buffers``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch
import torch.fx as fx

from graphopt.passes.fx_utils import (
    alias_classes,
    attr_value,
    is_random,
    tensor_meta,
    writes_of,
)

aten = torch.ops.aten


class NoMatch(Exception):
    """The chain is not the pattern; the message is the reason for the report."""


def is_call(node: Any, *targets: Any) -> bool:
    """True when ``node`` is an FX node calling one of ``targets``."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def arg(node: Any, i: int) -> Any:
    """The ``i``-th positional argument of ``node``, None when it has fewer."""
    return node.args[i] if i < len(node.args) else None


def is_batched(node: Any) -> bool:
    """True for a node producing a tensor of 3 or more dims (scores, not a scalar or mask row)."""
    val = tensor_meta(node) if isinstance(node, fx.Node) else None
    return val is not None and val.dim() >= 3


def _is_view(node: fx.Node) -> bool:
    """An ATen op whose output aliases an input without writing it (slice, select, view,
    expand, transpose, alias, ...)."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and any(
        r.alias_info is not None and not r.alias_info.is_write for r in target._schema.returns)


def _writes(node: fx.Node, value: fx.Node) -> bool:
    """True when ``node`` (an op) writes ``value`` in place (a ``Tensor(a!)`` argument, or
    an operand a checkpoint region's body writes: :func:`writes_of`)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return value in writes_of(node)
    schema = target._schema
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        given = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
        if given is value:
            return True
    return False


class WritesBetween:
    """Writes that would move under a rewrite: the rewritten op reads its operands (Q, K, V)
    where the replaced site is, but the original read them earlier (a loop's first block,
    the Q K^T product). An in-place write to an operand, or to anything sharing its storage
    (:func:`graphopt.passes.fx_utils.alias_classes`), between the two makes the rewritten op
    see values the original never saw: a review got 55-96 errors from ``k.mul_(2)`` after a
    MiniMax loop's first block, under ``torch.no_grad``. Computed once per graph."""

    def __init__(self, graph: fx.Graph) -> None:
        self.classes = alias_classes(graph)
        self.order = {n: i for i, n in enumerate(graph.nodes)}
        self.writers = [(self.order[n], n, targets) for n in graph.nodes
                        if (targets := writes_of(n))]

    def reason(self, operands: tuple[fx.Node, ...], at: fx.Node,
               what: str = "Q, K or V") -> str | None:
        """None, or why the operands cannot be read at ``at``: which op writes which of
        them between their first read and ``at`` (``what`` names them in the reason)."""
        roots = {self.classes.get(n, n) for n in operands}
        end = self.order.get(at)
        reads = [self.order[u] for n in operands for u in n.users if u in self.order]
        if end is None or not reads:
            return None
        start = min(reads)
        for position, writer, targets in self.writers:
            if start <= position <= end and any(self.classes.get(t, t) in roots
                                                for t in targets):
                return (f"{writer.name} writes {what} (or a view of them) in place after "
                        "the attention first reads them: the kernel, which reads Q, K, V "
                        "once where the attention ends, would not compute what the written "
                        "values give")
        return None


def written_in_place(node: fx.Node) -> fx.Node | None:
    """The first op of the graph that writes ``node``'s value in place, directly or through
    a view of it (``mask[:, :4] = 0`` is a ``slice`` then ``fill_``), else None. Such a
    value is not what evaluating its own inputs gives, so no numeric check may use it."""
    stack, seen = [node], {node}
    while stack:
        current = stack.pop()
        for user in current.users:
            if user.op != "call_function":
                continue
            if _writes(user, current):
                return user
            if _is_view(user) and user not in seen:
                seen.add(user)
                stack.append(user)
    return None


_BUFFER_READS: ContextVar[dict[int, tuple[str, torch.Tensor]] | None] = ContextVar(
    "graphopt_buffer_reads", default=None)


@contextlib.contextmanager
def recording_buffer_reads() -> Iterator[dict[int, tuple[str, torch.Tensor]]]:
    """Collect, for the block, every module buffer an evaluation read: id(tensor) -> (the
    buffer's source name, the example tensor)."""
    reads: dict[int, tuple[str, torch.Tensor]] = {}
    token = _BUFFER_READS.set(reads)
    try:
        yield reads
    finally:
        _BUFFER_READS.reset(token)


def _note_buffer_read(node: fx.Node, env: dict[fx.Node, Any]) -> None:
    reads = _BUFFER_READS.get()
    if reads is not None and is_buffer(node, env):
        source = getattr(node.meta.get("grapharg"), "source", None)
        reads[id(env[node])] = (str(getattr(source, "name", node.name)), env[node])


def evaluate(node: Any, env: dict[fx.Node, Any]) -> Any:
    """Value of a node computed from real placeholder values (small decay/mask subgraphs);
    results are memoized in ``env``.

    Raises:
        NoMatch: the node, or a value it is computed from, is written in place in the graph
            (directly or through a view: its value at run time is not the one computed
            here), draws random numbers (another value at every call), or it is not
            computable from the inputs.
    """
    if not isinstance(node, fx.Node):
        return node
    if node not in env or node.op in ("placeholder", "get_attr"):
        writer = written_in_place(node)
        if writer is not None:
            raise NoMatch(f"{node.name} is written in place in the graph ({writer.name}: "
                          f"{writer.target}), so its value cannot be proven at compile time")
    if node not in env:
        if node.op == "get_attr":  # a parameter/buffer held by the graph module (torch.export)
            value = attr_value(node.graph.owning_module, node.target)
            env[node] = value
            return value
        if node.op != "call_function":
            raise NoMatch(f"{node.name} is not computable from the inputs")
        if is_random(node):  # (a review: tril(ones) & (randint(...) > 0) drew a causal
            # mask once, was rewritten to is_causal and every later call ignored its mask;
            # the draw also advanced the caller's generator at compile time)
            raise NoMatch(f"{node.name} draws random numbers ({node.target}): its value "
                          "differs at every call, so it cannot be proven at compile time")
        args = torch.fx.node.map_arg(node.args, lambda n: evaluate(n, env))
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: evaluate(n, env))
        env[node] = node.target(*args, **kwargs)  # type: ignore[operator]
    elif node.op == "placeholder":
        _note_buffer_read(node, env)
    return env[node]


def ancestors(node: fx.Node) -> list[fx.Node]:
    """``node`` and every node it is computed from."""
    stack, seen = [node], {node}
    while stack:
        for a in stack.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return list(seen)


def is_buffer(node: fx.Node, env: dict[fx.Node, Any]) -> bool:
    """A graph input that is a module buffer (Dynamo source ``..._buffers[...]``) with a known
    value. Buffers are treated as constants of the model: a causal mask or decay read from one
    is frozen at compile time. A buffer written in place inside the graph is refused
    (``evaluate``); one changed between calls is caught by the pipeline's run-time guard on
    the buffers read (``recording_buffer_reads``)."""
    value = env.get(node)
    source = node.meta.get("grapharg")
    name = str(getattr(getattr(source, "source", None), "name", ""))
    return isinstance(value, torch.Tensor) and not value.requires_grad and "_buffers" in name


def is_parameter(node: fx.Node, env: dict[fx.Node, Any]) -> bool:
    """A graph input that is a module parameter: an ``nn.Parameter`` value in ``env``, or
    lifted by Dynamo from a module's ``_parameters`` (its source)."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    return isinstance(env.get(node), torch.nn.Parameter) or \
        "_parameters" in str(getattr(source, "name", ""))


def layer_index(node: fx.Node) -> int | None:
    """The decoder layer index from the module path (``...layers.3.self_attn``)."""
    for path, _ in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
        parts = str(path).replace("[", ".").replace("]", "").replace("'", "").split(".")
        for prev, part in zip(parts, parts[1:]):
            if prev in ("layers", "h", "layer", "blocks") and part.isdigit():
                return int(part)
    return None
