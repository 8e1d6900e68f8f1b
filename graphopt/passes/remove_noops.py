"""remove_noops: drop ATen ops that return their input unchanged.

Contract:
    accepts: any normalized graph (pre-autograd ATen or joint), static or symbolic shapes.
    guarantees: exact; every removed node ``y = op(x, ...)`` had ``y`` equal to ``x`` in
        value, shape, dtype, device and strides (an arithmetic identity's new tensor is
        dense where ``x`` may be strided, from offset 0 of its own storage where ``x`` may
        be a view into a larger one, without ``x``'s lazy negation or conjugation) and (for
        view-like ops) already aliased ``x``; ``to(memory_format=f)`` goes only where eager
        returns ``x``, when ``x``'s suggested memory format is f. Shapes
        are compared with ``statically_known_true``, so a symbolic shape that is only equal
        for some inputs is kept.
    reads meta: ``val``. writes meta: nothing (removed nodes' users now read ``x``).
        A candidate is kept when it or its input is written in place (directly or through
        any alias: :func:`graphopt.passes.fx_utils.mutated_nodes`), when it is a graph
        output (the caller would get the input object), when a view of a non-aliasing
        candidate is an output, or when a user runs in another grad-mode region or inside
        a higher-order op (``y = x * 1`` under ``torch.no_grad()`` has no gradient; ``x``
        may have one).
    records: "rewritten" per removed node (site and op); "skipped" with the reason when a
        candidate was kept.

Pseudo-code:
    for node in graph:
        x = identity_input(node)          # view/reshape/expand to the same shape, full slice,
                                          # to/type_as/contiguous that change nothing,
                                          # x * 1, x / 1, x + 0, x - 0 with same dtype/shape
        if x and safe(node, x): node.replace_all_uses_with(x); erase(node)
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch._prims_common import suggest_memory_format
from torch.fx.experimental.symbolic_shapes import statically_known_true

from graphopt.passes import register_pass
from graphopt.passes.base import GraphPass, PassContext, PassResult
from graphopt.passes.fx_utils import (
    alias_classes,
    argument,
    autocast_reason,
    grad_mode_regions,
    mutated_nodes,
    op_name,
    site_name,
    tensor_meta,
)

aten = torch.ops.aten

_SAME_SHAPE_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                     aten.expand.default, aten.alias.default}
_ALIAS_IF_UNCHANGED = {aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten.type_as.default,
                       aten.contiguous.default}
_ARITH_IDENTITY = {aten.mul.Tensor: 1, aten.div.Tensor: 1, aten.add.Tensor: 0,
                   aten.sub.Tensor: 0, aten.mul.Scalar: 1, aten.add.Scalar: 0}


def _signed_zero_changes(target: Any, x: torch.Tensor) -> bool:
    """IEEE: -0.0 + 0 is +0.0 (so 1/(x + 0) differs from 1/x at x = -0.0); x * 1, x / 1 and
    x - 0 keep the sign. Adding zero is an identity only for integers. For complex x every
    op is: PyTorch multiplies and divides by 1 + 0j (inf * 0 is nan, a -0.0 part turns
    +0.0; a review measured 1/imag = -inf where eager gives +inf) and adds 0 + 0j."""
    return x.dtype.is_complex or target in (aten.add.Tensor, aten.add.Scalar) and \
        x.dtype.is_floating_point


def _same_meta(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.device == b.device and a.dim() == b.dim()
            and all(statically_known_true(x == y)  # type: ignore[arg-type]
                    for x, y in zip(a.shape, b.shape)))


def _full_slice(node: fx.Node, x: torch.Tensor) -> bool:
    args: list[Any] = list(node.args) + [None] * (5 - len(node.args))
    dim, start, end, step = (args[1] or 0), args[2], args[3], (args[4] or 1)
    dim = int(dim) % max(x.dim(), 1)
    start_ok = start in (None, 0)
    end_ok = end is None or (isinstance(end, int | torch.SymInt)
                             and statically_known_true(end >= x.shape[dim]))
    return bool(step == 1 and start_ok and end_ok and not node.kwargs)


def identity_input(node: fx.Node) -> fx.Node | None:
    """The input ``node`` returns unchanged, or None."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    x_node = node.args[0]
    x, y = tensor_meta(x_node), tensor_meta(node)
    if x is None or y is None or not _same_meta(x, y):
        return None
    target = node.target
    if target in _SAME_SHAPE_VIEWS:
        return x_node
    if target is aten.slice.Tensor and _full_slice(node, x):
        return x_node
    if target in _ALIAS_IF_UNCHANGED:
        copy = argument(node, "copy") is True
        fmt: Any = argument(node, "memory_format")
        if target is aten.contiguous.default:  # eager returns x when it is contiguous
            keeps_layout = x.is_contiguous(memory_format=fmt or torch.contiguous_format)
        else:  # to(): x when its suggested format is fmt (an (N, 1, H, W) x is contiguous
            # in both formats, and eager copies it to the other's strides: a review
            # measured outputs 4.0 off through an as_strided after it, removed)
            keeps_layout = fmt in (None, torch.preserve_format) or \
                suggest_memory_format(x) == fmt
        return x_node if not copy and keeps_layout else None
    if target in _ARITH_IDENTITY and len(node.args) == 2 and not node.kwargs:
        other = node.args[1]
        if type(other) in (int, float) and other == _ARITH_IDENTITY[target] and \
                not _signed_zero_changes(target, x) and _same_strides(x, y) and \
                _owns_dense_storage(x):
            return x_node
    return None


def _owns_dense_storage(x: torch.Tensor) -> bool:
    """Whether ``x`` is laid out as an arithmetic identity's new tensor is: from offset 0
    of a storage of exactly its elements, with no lazy negation or conjugation. ``x[1:] * 1``
    has ``x[1:]``'s strides but its own storage; removed, an ``as_strided`` after it read
    the base's elements (a review: outputs 4.0 off eager, and with an out-of-bounds size a
    value where eager raises), and a neg-bit view made a later ``view(int64)`` fail."""
    if x.is_neg() or x.is_conj():
        return False
    try:
        nbytes = x.untyped_storage().nbytes()
    except (NotImplementedError, RuntimeError):  # a tensor without storage (a subclass)
        return False
    return bool(statically_known_true(x.storage_offset() == 0)
                and statically_known_true(nbytes == x.numel() * x.element_size()))


def _same_strides(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether the result ``y`` of an arithmetic identity has ``x``'s strides. It is a new
    tensor laid out by TensorIterator: dense for a strided ``x`` (``x[:, ::2] * 1`` has
    strides (3, 1), the slice (6, 2)), so an op that reads strides after it (``as_strided``
    framing a signal) read other elements once it was removed (a review: outputs 6.5 and
    gradients 5.0 off eager, silently)."""
    return all(statically_known_true(a == b)  # type: ignore[arg-type]
               for a, b in zip(x.stride(), y.stride()))


@register_pass
@dataclass(frozen=True)
class RemoveNoopsPass(GraphPass):
    name = "remove_noops"
    stage = "pre_autograd"
    exact = True

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        classes = alias_classes(graph)
        mutated = mutated_nodes(graph, classes)
        outputs = set(graph.output_node().all_input_nodes)
        escaping = {classes[n] for n in outputs if n in classes}
        regions = grad_mode_regions(graph)
        inputs = {classes[n] for n in graph.find_nodes(op="placeholder") if n in classes}
        modified = False
        for node in list(graph.nodes):
            x = identity_input(node)
            if x is None:
                continue
            aliasing = node.target in _SAME_SHAPE_VIEWS or node.target in _ALIAS_IF_UNCHANGED
            reason = _unsafe_reason(node, x, aliasing, mutated, outputs,
                                    classes[node] in escaping, regions,
                                    x in classes and classes[x] in inputs)
            if reason:
                ctx.record("skipped", site_name(node), f"{op_name(node)}: {reason}")
                continue
            node.replace_all_uses_with(x)
            graph.erase_node(node)
            ctx.record("rewritten", site_name(node), f"{op_name(node)} returns its input")
            modified = True
        return PassResult(gm, modified)


def _unsafe_reason(node: fx.Node, x: fx.Node, aliasing: bool, mutated: set[fx.Node],
                   outputs: set[fx.Node], escapes: bool, regions: dict[fx.Node, int],
                   reads_input: bool) -> str:
    if autocast_reason([node, x]):
        return "kept: " + autocast_reason([node, x])
    if node in mutated or x in mutated:
        return ("kept: it or its input is written in place (directly or through a view); "
                "removing it would change what aliases what")
    if node in outputs:
        return ("kept: it is a graph output; the caller would get the input tensor itself "
                "instead of a new one")
    if not aliasing and escapes:
        return "kept: a view of it is a graph output; the caller would get an alias of the input"
    if any(regions.get(u) != regions.get(node) or
           isinstance(u.target, torch._ops.HigherOrderOperator) for u in node.users):
        return ("kept: it is used in another grad-mode region (torch.no_grad / enable_grad); "
                "its users would read a tensor with another requires_grad")
    if any(u.target is operator.setitem for u in node.users):
        return "kept: used by setitem"
    if not aliasing and reads_input:
        # (a re-review: compiled for arange(4.), the graph ran on base[3:7] and an
        # as_strided after the removed x * 1 read base[0:2], 3.0 off eager)
        return ("kept: its input is a graph input or a view of one, whose storage offset "
                "and size the compiled graph's guards do not check; its result owns a "
                "dense storage from offset 0")
    return ""
