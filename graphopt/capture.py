"""Capture guard: model passes only ever see a graph that provably computes what Dynamo's did.

Contract: :func:`capture` returns either the normalized pre-autograd ATen graph (see
:mod:`graphopt.normalize`) or a *fallback*: Dynamo's own graph, untouched, with the reason.
A fallback graph skips the model passes and goes to AOTAutograd + the lowering exactly as
``torch.compile(backend="aot_eager")`` would take it (joint passes may still run), so
graphopt is never less correct than AOTAutograd. The pipeline records the reason in the
report (``CompileReport.fallback``).

Fallback when, checked in this order:
1. an input is a tensor subclass (DTensor, ...) or a list of tensors (compiled autograd's
   graphs), or a value inside the graph is a tensor subclass (SP hooks traced into a
   compiled layer build DTensors from plain inputs): AOTAutograd desugars subclasses and
   flattens lists, the pre-dispatch re-trace does not;
2. the graph calls a higher-order op outside :data:`KNOWN_HOPS` (``autograd_function_apply``
   of a custom ``torch.autograd.Function``, ``invoke_subgraph``, ``flex_attention``,
   ``associative_scan``, ...), functorch transforms (``torch.vmap``, ``torch.func.grad``)
   or a ``torch.inference_mode()`` block: re-tracing inlines or mis-traces them (a custom
   backward would be lost; inference-mode ops would be differentiated);
3. normalize raises (Dynamo's own restart requests are re-raised, not swallowed);
4. an invariant fails (:func:`check_outputs`, :func:`check_gradient_paths`,
   :func:`new_constants`): the outputs' count, shapes, dtypes or requires_grad differ from
   Dynamo's example values, the set of inputs that reach an output through autograd-tracked
   values (those that get gradients) differs, or the trace baked a tensor into the graph as
   a new constant.

The same output check runs again after the model passes (:func:`check_outputs`), so a pass
that changed an output's dtype or detached it is caught before AOTAutograd.

Pseudo-code::

    reason = unsupported_inputs(inputs) or subclass_values(gm) or unknown_hops(gm)
    if not reason:
        try: model = normalize(gm, inputs)
        except RestartAnalysis: raise
        except Exception as e: reason = f"normalize failed: {e}"
    reason = reason or check_outputs(gm, model) or new_constants(gm, model)
    return Capture(model, None) if not reason else Capture(gm, reason)
"""

from __future__ import annotations

import logging
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from graphopt.normalize import normalize, quiet_logger

KNOWN_HOPS = frozenset({
    "tag_activation_checkpoint",  # torch.utils.checkpoint: body re-traced, tags kept
    "wrap",  # a plain function-call boundary: inlining it is exact
    "wrap_with_set_grad_enabled",  # re-traced under the same grad mode
})
"""Higher-order ops normalize re-traces faithfully (tests in tests/test_capture.py)."""

_FUNCTORCH_MARKERS = ("_vmap_increment_nesting", "_grad_increment_nesting",
                      "_jvp_increment_nesting", "_add_batch_dim")


@dataclass(frozen=True)
class Capture:
    """The graph model passes see, or Dynamo's graph with ``fallback`` saying why not."""

    gm: fx.GraphModule
    fallback: str | None = None


def capture(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Capture:
    """Normalize ``gm`` if that is provably faithful, else fall back (see module docstring).

    Raises:
        torch._dynamo.exc.RestartAnalysis: Dynamo asked to restart (e.g. to specialize a
            float); it is Dynamo's control flow, not a capture failure.
    """
    reason = unsupported_inputs(example_inputs) or subclass_values(gm) or unknown_hops(gm)
    if reason:
        return Capture(gm, reason)
    try:
        # FakeTensorMode logs a failing meta function's traceback (~20 lines per op:
        # linalg_solve_triangular on symbolic sizes, Qwen3-Next) before raising; the
        # failure is the fallback reason in the report
        with quiet_logger("torch._subclasses.fake_tensor", logging.CRITICAL):
            model = normalize(gm, example_inputs)
    except torch._dynamo.exc.RestartAnalysis:
        raise
    except Exception as exc:  # anything normalize cannot do: AOTAutograd still can
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return Capture(gm, f"normalize failed ({type(exc).__name__}: {first[:200]})")
    problem = check_outputs(gm, model) or check_gradient_paths(gm, model) or \
        new_constants(gm, model)
    if problem:
        return Capture(gm, f"normalized graph differs from Dynamo's: {problem}")
    return Capture(model)


def unsupported_inputs(example_inputs: Sequence[Any]) -> str:
    """The reason to fall back for tensor-subclass inputs (DTensor, ...) or list inputs, or
    ""."""
    for i, x in enumerate(example_inputs):
        if isinstance(x, (list, tuple, dict)):  # the trace would hold their real tensors
            return (f"input {i} is a {type(x).__name__} of tensors (compiled autograd's "
                    "graphs); AOTAutograd flattens it, graphopt's model passes do not")
        if isinstance(x, torch.Tensor) and is_traceable_wrapper_subclass(x):
            return (f"input {i} is a {type(x).__name__} (tensor subclass); AOTAutograd "
                    "desugars it, graphopt's model passes do not")
    return ""


def subclass_values(gm: fx.GraphModule) -> str:
    """The reason to fall back for a graph that builds tensor-subclass values from plain
    inputs (``DTensor.from_local(...).redistribute(...).to_local()``: SP's hooks traced into
    a compiled layer), or "". The re-trace turned such a redistribution into a plain chunk
    whose backward dropped DTensor's all-gather: a review measured each TP rank's router and
    expert gradients at its own sequence shard's share (relative error 0.5-0.9)."""
    for node in gm.graph.nodes:
        for value in pytree.tree_leaves(node.meta.get("example_value")):
            if isinstance(value, torch.Tensor) and is_traceable_wrapper_subclass(value):
                return (f"{node.name} is a {type(value).__name__} (tensor subclass) built "
                        "inside the graph; AOTAutograd desugars it, graphopt's model passes "
                        "do not")
    return ""


def unknown_hops(gm: fx.GraphModule) -> str:
    """The reason to fall back for higher-order ops / functorch transforms normalize does
    not re-trace faithfully, or ""."""
    calls = [node for module in gm.modules() if isinstance(module, fx.GraphModule)
             for node in module.graph.nodes if node.op == "call_function"]
    for node in calls:  # a higher-order op names the construct better than its insides
        target = node.target
        if isinstance(target, torch._ops.HigherOrderOperator) and \
                target.name() not in KNOWN_HOPS:
            what = " (a custom torch.autograd.Function)" \
                if target.name() == "autograd_function_apply" else ""
            return (f"higher-order op {target.name()!r}{what} is not in normalize's "
                    "allow-list; re-tracing it could change its numerics or lose its backward")
    for node in calls:
        name = getattr(node.target, "__name__", "")
        if name in _FUNCTORCH_MARKERS:
            return f"functorch transform ({name}: torch.vmap/torch.func) in the graph"
        if name == "_enter_inference_mode":
            return ("torch.inference_mode() block in the graph: the pre-dispatch re-trace "
                    "drops it and would differentiate the ops inside (use torch.no_grad() "
                    "to have the model passes run)")
    return ""


def _values(node: fx.Node, key: str) -> list[Any]:
    args = node.args[0]
    items = args if isinstance(args, (tuple, list)) else [args]
    return [a.meta.get(key) if isinstance(a, fx.Node) else a for a in items]


def _node_requires_grad(node: fx.Node) -> bool | None:
    """Whether autograd reaches ``node``'s value: ``meta['requires_grad']`` in normalized
    graphs (see graphopt.normalize), Dynamo's ``example_value`` otherwise; None if unknown."""
    if "requires_grad" in node.meta:
        return bool(node.meta["requires_grad"])
    tensors = [t for t in pytree.tree_leaves(node.meta.get("example_value"))
               if isinstance(t, torch.Tensor)]
    return any(t.requires_grad for t in tensors) if tensors else None


def _requires_grad(node: fx.Node) -> list[bool | None]:
    args = node.args[0]
    return [_node_requires_grad(a) if isinstance(a, fx.Node) else None
            for a in (args if isinstance(args, (tuple, list)) else [args])]


def grad_inputs(gm: fx.GraphModule) -> int | None:
    """Bit i set when placeholder i reaches an output through values autograd tracks, i.e.
    when it gets a gradient; None when the graph carries no requires_grad information.

    An in-place write carries its inputs' bits into every value sharing the written
    storage (:func:`graphopt.passes.fx_utils.alias_classes`), read from then on: Dynamo's
    graph keeps reading ``out`` after ``out.add_(x @ w2)`` where the normalized graph reads
    the ``add_`` node (Llama 4's MoE fell back on that: "gained for [w2]", a review)."""
    from graphopt.passes.fx_utils import alias_classes

    carried: dict[fx.Node, int] = {}
    known = False
    for i, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        flag = _node_requires_grad(node)
        known = known or flag is not None
        carried[node] = (1 << i) if flag else 0
    if not known:
        return None
    classes = alias_classes(gm.graph)
    written: dict[fx.Node, int] = {}

    def bits_of(n: fx.Node) -> int:  # a value autograd does not track carries nothing
        if not (n.op == "placeholder" or _node_requires_grad(n)):  # (a detach of a buffer)
            return 0
        return carried.get(n, 0) | written.get(classes.get(n, n), 0)

    for node in gm.graph.nodes:
        tracked = _node_requires_grad(node)
        if tracked is None and node.target in _INPLACE_OPERATORS:
            # Dynamo's ``z[i] = v`` node has no value (setitem returns None): it writes
            # what autograd tracks when a value it reads is tracked (before, its bits were
            # dropped and ``z[:, 1] = x.exp() * w`` fell back as "gained for [w]", a review)
            tracked = any(_node_requires_grad(a) for a in node.all_input_nodes)
        if node.op not in ("call_function", "call_method", "call_module") or \
                not tracked:  # a write under no_grad carries nothing
            continue
        bits = 0
        for arg in node.all_input_nodes:
            bits |= bits_of(arg)
        carried[node] = bits
        for target in _writes(node):
            root = classes.get(target, target)
            written[root] = written.get(root, 0) | bits
    reached = 0
    for arg in gm.graph.output_node().all_input_nodes:
        reached |= bits_of(arg)
    return reached


_INPLACE_OPERATORS = frozenset((operator.setitem, operator.iadd, operator.isub, operator.imul,
                                operator.itruediv, operator.ifloordiv, operator.imod,
                                operator.ipow, operator.iand, operator.ior, operator.ixor,
                                operator.ilshift, operator.irshift, operator.imatmul))


def written_by(node: fx.Node) -> list[fx.Node]:
    """What ``node`` writes in place, in a normalized ATen graph or in Dynamo's graph (see
    :func:`_writes`)."""
    return _writes(node)


def _writes(node: fx.Node) -> list[fx.Node]:
    """What ``node`` writes in place: ATen schemas (normalized graphs); in Dynamo's graphs
    ``x.add_(...)``-style methods and functions (trailing underscore), ``x[i] = v``,
    augmented assignment, ``inplace=True`` and ``out=`` arguments."""
    from graphopt.passes.fx_utils import writes_of

    if isinstance(node.target, torch._ops.OpOverload):
        return writes_of(node)
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    out = [o for o in pytree.tree_leaves(node.kwargs.get("out")) if isinstance(o, fx.Node)]
    if first is not None and (
            node.target in _INPLACE_OPERATORS or node.kwargs.get("inplace") is True or
            (isinstance(name, str) and name.endswith("_") and not name.startswith("_"))):
        out.append(first)
    return out


def check_outputs(reference: fx.GraphModule, candidate: fx.GraphModule) -> str:
    """"" when ``candidate``'s outputs match ``reference``'s in count, shape, dtype and
    requires_grad, else what differs. ``reference`` is Dynamo's graph (``example_value``
    meta) or an earlier normalized graph (``val`` meta)."""
    ref_key = "example_value" if _has_key(reference, "example_value") else "val"
    expected = _values(reference.graph.output_node(), ref_key)
    actual = _values(candidate.graph.output_node(), "val")
    if len(expected) != len(actual):
        return f"{len(actual)} outputs instead of {len(expected)}"
    grads = zip(_requires_grad(reference.graph.output_node()),
                _requires_grad(candidate.graph.output_node()))
    names: tuple[dict[str, str], dict[str, str]] = ({}, {})  # unbacked symbols: _same_size
    for i, ((e, a), (e_grad, a_grad)) in enumerate(zip(zip(expected, actual), grads)):
        if not isinstance(e, torch.Tensor):
            continue
        if not isinstance(a, torch.Tensor):
            return f"output {i} is {type(a).__name__}, expected a tensor"
        if e.dtype != a.dtype:
            return f"output {i} has dtype {a.dtype}, expected {e.dtype}"
        if len(e.shape) != len(a.shape) or any(
                not _same_size(x, y, names) for x, y in zip(e.shape, a.shape)):
            return f"output {i} has shape {tuple(a.shape)}, expected {tuple(e.shape)}"
        if e_grad is not None and a_grad is not None and e_grad != a_grad:
            return (f"output {i} has requires_grad={a_grad}, expected {e_grad} (a gradient "
                    "path was lost or added)")
    return ""


def check_gradient_paths(reference: fx.GraphModule, candidate: fx.GraphModule) -> str:
    """"" when the same inputs reach the outputs through autograd-tracked values in both
    graphs (so the same inputs get gradients), else which input lost or gained its path."""
    want, have = grad_inputs(reference), grad_inputs(candidate)
    if want is None or have is None or want == have:
        return ""
    names = [n.name for n in candidate.graph.find_nodes(op="placeholder")]
    lost = [names[i] for i in range(len(names)) if want >> i & 1 and not have >> i & 1]
    gained = [names[i] for i in range(len(names)) if have >> i & 1 and not want >> i & 1]
    return (f"gradient paths differ: lost for {lost[:3]}, gained for {gained[:3]} (a custom "
            "backward or a grad-mode switch was traced through)")


def _has_key(gm: fx.GraphModule, key: str) -> bool:
    return any(key in n.meta for n in gm.graph.output_node().all_input_nodes)


def _same_size(a: Any, b: Any, names: tuple[dict[str, str], dict[str, str]]) -> bool:
    """Equal ints, or the same symbolic expression (both graphs share Dynamo's shape env;
    an expression that differs in form only costs a needless fallback), with data-dependent
    (unbacked) symbols numbered by first appearance over all outputs of each graph
    (``names``: one map per graph, shared by every call of one comparison), so Dynamo's
    ``u0, u1`` match the re-trace's ``u2, u3`` but not ``u2, u2``: the re-trace creates new
    ones (every graph returning ``x[x > 0]`` fell back, a review)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return _unbacked_renumbered(str(a), names[0]) == _unbacked_renumbered(str(b), names[1])


def _unbacked_renumbered(expr: str, names: dict[str, str]) -> str:
    return re.sub(r"\bu\d+\b", lambda m: names.setdefault(m.group(), f"u#{len(names)}"), expr)


def new_constants(reference: fx.GraphModule, candidate: fx.GraphModule) -> str:
    """"" unless ``candidate`` holds tensor constants that ``reference`` does not (a value
    the trace turned into a constant, such as a vmapped tensor). Real one-element constants
    are the model's own (``torch.tensor(1e-6)`` in forward), and so are real constants equal
    to a ``torch.tensor(<literal>)`` call of ``reference`` (``torch.tensor([0, 2, 2])`` as an
    index; :func:`_is_literal`); a fake one of any size is a traced value frozen into the
    graph (``x.norm().data``, a ``get_attr`` tensor of Dynamo's graph: optimizer state),
    which crashed at run time or lost its updates."""
    known = {id(t) for t in _tensor_attrs(reference)}
    literals = _literal_tensors(reference)

    def new(value: Any) -> bool:
        return isinstance(value, torch.Tensor) and id(value) not in known and (
            value.numel() > 1 or isinstance(value, FakeTensor))

    readers = {}  # qualified name -> the get_attr node reading it, checkpoint bodies too
    for prefix, module in candidate.named_modules():
        if isinstance(module, fx.GraphModule):
            for n in module.graph.find_nodes(op="get_attr"):
                readers[f"{prefix}.{n.target}" if prefix else str(n.target)] = n
    values: dict[str, Any] = dict(candidate.named_buffers())
    for name in readers:
        owner, _, attr = name.rpartition(".")
        values[name] = getattr(candidate.get_submodule(owner) if owner else candidate, attr,
                               None)
    for name, value in values.items():
        if new(value) and not (name in readers and _is_literal(readers[name], value, literals)):
            where = _user_line(readers[name]) if name in readers else ""
            return (f"new tensor constant {name!r} of shape {tuple(value.shape)}: a value the "
                    "trace did not follow (such as .data of a parameter or buffer) frozen "
                    "into the graph" + (f"; read at {where}" if where else ""))
    return ""


def _user_line(node: fx.Node) -> str:
    """The model's source line (file:line: code) of the first reader of ``node`` that has
    one (Dynamo's ``stack_trace`` meta), else ""."""
    for user in [node, *node.users]:
        trace = str(user.meta.get("stack_trace") or "").strip().splitlines()
        files = [i for i, line in enumerate(trace) if line.strip().startswith("File ")]
        if files:
            i = files[-1]
            place = trace[i].strip().removeprefix("File ").replace('"', "")
            code = trace[i + 1].strip() if i + 1 < len(trace) else ""
            return f"{place}: {code}" if code else place
    return ""


_LITERAL_FACTORIES = (torch.tensor, torch.as_tensor)


def _literal_tensors(gm: fx.GraphModule) -> list[torch.Tensor]:
    """The tensors ``gm``'s ``torch.tensor(<literal>)`` calls build (Dynamo keeps
    ``torch.tensor([0, 2, 2])`` in forward as such a call on Python constants)."""
    out = []
    nodes = [n for m in gm.modules() if isinstance(m, fx.GraphModule) for n in m.graph.nodes]
    for node in nodes:  # checkpoint bodies (submodules) too
        if node.op != "call_function" or node.target not in _LITERAL_FACTORIES:
            continue
        if any(isinstance(a, fx.Node) for a in pytree.tree_leaves((node.args, node.kwargs))):
            continue
        try:
            value = node.target(*node.args, **node.kwargs)
        except Exception:  # noqa: BLE001 (a call Dynamo kept but we cannot replay: no match)
            continue
        if isinstance(value, torch.Tensor):
            out.append(value)
    return out


def _is_literal(node: fx.Node, value: torch.Tensor, literals: list[torch.Tensor]) -> bool:
    """Whether the re-trace's constant ``value`` (read by ``node``) is one of the model's
    own literals: a real tensor, read only through ``lift_fresh_copy`` (how ``torch.tensor``
    traces; a frozen traced value is read directly), equal in dtype, shape and every value to
    a literal of Dynamo's graph not matched before (the match is removed from
    ``literals``)."""
    if isinstance(value, FakeTensor) or not node.users or any(
            u.target is not torch.ops.aten.lift_fresh_copy.default for u in node.users):
        return False
    for i, lit in enumerate(literals):
        if lit.dtype == value.dtype and lit.shape == value.shape and \
                lit.device == value.device and torch.equal(lit, value):
            del literals[i]
            return True
    return False


def _tensor_attrs(gm: fx.GraphModule) -> list[torch.Tensor]:
    out = list(gm.buffers()) + list(gm.parameters())
    for node in gm.graph.find_nodes(op="get_attr"):
        value = getattr(gm, str(node.target), None)
        if isinstance(value, torch.Tensor):
            out.append(value)
    return out
