"""cse: common subexpression elimination on the pre-autograd ATen graph.

Dynamo unrolls Python loops, so repeated computations (e.g. the per-block decay
``exp(-slope * block_size)`` of transformers' MiniMax lightning attention, or rotary
tables recomputed per layer) appear many times with identical inputs.

Contract:
    accepts: a normalized pre-autograd ATen graph (in-place ops and grad-mode switches allowed).
    guarantees: exact; two nodes are merged only when they call the same pure ATen op with
        the same arguments (floats compared with their sign: x * 0.0 is not x * -0.0), in
        the same grad-mode/autocast region, not changing the floating-point precision of
        an input (a cast to a less precise dtype or a promotion to a more precise one,
        complex ones by their parts' precision: the merged use would sum its users'
        gradients in the result's dtype, eager in the input's), with no in-place
        write to any tensor between them, neither output is written in place later,
        directly or through any alias (:func:`graphopt.passes.fx_utils.mutated_nodes`),
        neither of them (nor a view) is a
        graph output (the caller owns an output and may write it in place, e.g.
        ``out.data.mul_()`` or a residual ``+=`` after a graph break, while the merged twin
        is still saved for the backward: a silently wrong gradient, a review), and the op
        draws no random numbers. Exact up to the order of the backward's sums: the merged
        node's users' gradients are summed at the node, not at its inputs, in the node's
        dtype (Cohere2-MoE in float64, whose layer norm computes ``x - mean`` twice in
        float32: its weight gradients are 1.2e-7 off, relative, float32's rounding, where
        ``aot_eager`` keeps eager's order and is exact; ``disable: ["cse"]`` keeps it).
    reads meta: nothing but the graph. writes meta: nothing (the later node is erased; the
        kept node gains ``meta['graphopt_cse_merged']``, the names it replaced).
    records: "rewritten" per merged node with the op; "skipped" for a duplicate kept
        because one or both are graph outputs; nothing per unique node.

Pseudo-code:
    region = 0
    for node in graph:
        if node switches grad mode / autocast / is a HOP / writes in place: region += 1
            (getitem and SymInt arithmetic are no barrier); continue
        key = (node.target, args with merged nodes substituted, kwargs, region)
        if key seen and mergeable(node): replace node by the first one
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch
import torch.utils._pytree as pytree
from torch import fx

from graphopt.passes import register_pass
from graphopt.passes.base import GraphPass, PassContext, PassResult
from graphopt.passes.fx_utils import (
    alias_classes,
    autocast_reason,
    is_foreign_op,
    is_mutating,
    is_random,
    mutated_nodes,
    op_name,
    site_name,
)


def _hashable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_hashable(v) for v in value))
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return ("sym", str(value.node.expr))
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))
    if isinstance(value, float):  # 0.0 == -0.0 (and hash alike) but x * -0.0 != x * 0.0
        return ("float", value, math.copysign(1.0, value))
    if isinstance(value, complex):
        return ("complex", _hashable(value.real), _hashable(value.imag))
    try:
        hash(value)
    except TypeError:
        return ("unhashable", id(value))
    return (type(value).__name__, value)


def _is_pure_aten(node: fx.Node) -> bool:
    return (isinstance(node.target, torch._ops.OpOverload) and not is_mutating(node)
            and not is_random(node) and not is_foreign_op(node.target)
            and node.target is not torch.ops.aten._local_scalar_dense.default
            and not node.target._schema.name.startswith("aten::_assert"))


_PLAIN_PYTHON = {
    *(getattr(operator, name) for name in (
        "getitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos",
        "abs", "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "not_", "invert",
        "lshift", "rshift")),
    *(getattr(torch, name) for name in ("sym_max", "sym_min", "sym_float", "sym_int",
                                        "sym_not", "sym_ite", "sym_sum")
      if hasattr(torch, name)),
    math.ceil, math.floor, math.trunc, math.sqrt,
}


def _plain_python(node: fx.Node) -> bool:
    """A multi-output op's ``getitem`` or SymInt arithmetic (``operator``, ``math``,
    ``torch.sym_*``), which write nothing: no barrier. Counted as one, no duplicate was
    merged across a ``split``'s outputs or a ``view(x.shape[0] * 2, -1)`` (a review)."""
    return node.target in _PLAIN_PYTHON


def _inexact(v: Any) -> TypeGuard[torch.Tensor]:
    """A floating-point or complex tensor (``torch.finfo`` of a complex dtype is its
    parts': a complex128 -> complex64 cast merged summed gradients in float32, a review)."""
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


def _precision_change(node: fx.Node) -> str:
    """"casts float64 to float32" when ``node`` computes a floating-point result of less
    precision or range than a floating-point input ("promotes float32 to float64": of
    more), else "": merged, the two uses' gradients would be summed in the other dtype,
    where eager rounds each to the input's dtype and sums them there (a bf16 cast of a
    float32 activation: a bf16 rounding of the summed gradient)."""
    outs = [v for v in pytree.tree_leaves(node.meta.get("val")) if _inexact(v)]
    ins = [v for a in node.all_input_nodes if _inexact(v := a.meta.get("val"))]
    # (whether the input requires grad is not in the pre-autograd graph's meta)
    for o in outs:
        for i in ins:  # less precise, or a smaller range (bf16 -> fp16: two uses' gradients
            # of 4e4 each summed to inf in fp16, a re-review)
            fo, fi = torch.finfo(o.dtype), torch.finfo(i.dtype)
            if fo.eps > fi.eps or fo.max < fi.max:
                return f"casts {_name(i.dtype)} to {_name(o.dtype)}"
            # or more precise: eager rounds each use's gradient to the input's dtype and
            # sums them there, merged they are summed first and rounded once (x64 * y32
            # twice: y's gradient 4.8e-7 off; a bf16 weight times a float32 activation,
            # 0.03, a re-review)
            if fo.eps < fi.eps or fo.max > fi.max:
                return f"promotes {_name(i.dtype)} to {_name(o.dtype)}"
    return ""


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@register_pass
@dataclass(frozen=True)
class CSEPass(GraphPass):
    name = "cse"
    stage = "pre_autograd"
    exact = True

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        classes = alias_classes(graph)
        written = mutated_nodes(graph, classes)
        escaping = {classes[n] for n in graph.output_node().all_input_nodes if n in classes}
        seen: dict[Any, fx.Node] = {}
        region = 0
        modified = False
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if not _is_pure_aten(node):
                if (not isinstance(node.target, torch._ops.OpOverload)
                        and not _plain_python(node)) or is_mutating(node):
                    region += 1  # grad-mode switch, autocast, HOP or in-place write: a barrier
                    # (another library's op that declares no writes is none: it is just
                    # never merged itself)
                continue
            if node in written or autocast_reason(node):
                continue  # autocast: the same call may produce another dtype at run time
            key = (node.target, _hashable(node.args), _hashable(node.kwargs), region)
            first = seen.get(key)
            if first is None:
                seen[key] = node
                continue
            changed = _precision_change(node)
            if changed:
                ctx.record("skipped", site_name(node),
                           f"{op_name(node)}: same as {first.name}, but it {changed}: "
                           "merged, the two uses' gradients would be summed in the "
                           "result's dtype before the backward casts them to the input's "
                           "(eager casts each and sums them in the input's dtype)")
                continue
            if classes[node] in escaping and classes[first] in escaping:
                ctx.record("skipped", site_name(node),
                           f"{op_name(node)}: same as {first.name}, but both (or views of "
                           "them) are graph outputs; the caller would get one tensor twice")
                continue
            if classes[node] in escaping or classes[first] in escaping:
                ctx.record("skipped", site_name(node),
                           f"{op_name(node)}: same as {first.name}, but one of them (or a "
                           "view) is a graph output: the caller may write it in place while "
                           "the other is still read (saved for the backward)")
                continue
            node.replace_all_uses_with(first)
            first.meta.setdefault("graphopt_cse_merged", []).append(node.name)
            graph.erase_node(node)
            ctx.record("rewritten", site_name(node), f"{op_name(node)} merged into {first.name}")
            modified = True
        return PassResult(gm, modified)
