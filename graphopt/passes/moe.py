"""moe: rewrite MoE experts into ``graphopt::moe_experts`` (sorted dispatch + grouped expert
GEMMs; expert-parallel all-to-all dispatch/combine when ``moe.ep`` > 1).

A MoE *site* is a top-k router (``aten.topk`` on softmax / sigmoid router scores, DeepSeek's
group-limited top-k included) whose indices and weights feed an *experts region*: the nodes
of one module (transformers' ``*Experts``, by ``nn_module_stack``) whose only inputs are the
tokens [T, H], the top-k indices [T, K] (int64), the top-k weights [T, K], and two expert
weights gate_up [E, 2F, H] and down [E, H, F], and whose one output is [T, H]. The router,
shared experts and everything else stay as they are (routing numerics are the model's own;
ties resolve as eager does). Spellings: transformers' "grouped_mm" and "batched_mm" experts
(and any other one-graph form with that interface). The "eager" experts loop is split by
graph breaks (data-dependent ``nonzero``), so it never reaches one graph: those sites are
reported as skipped with the fix (``experts_implementation="grouped_mm"``).

Contract:
    accepts: a normalized pre-autograd ATen graph (a symbolic token count with ep = 1
        only: the probes run at its example value; with ep > 1 it is a ConfigError, since
        skipping one rank's site would leave the others waiting in its collectives; for the
        same reason an EP rewrite sets Dynamo's ``fail_on_recompile_limit_hit`` and turns
        ``automatic_dynamic_shapes`` off).
    guarantees: exact. A region is replaced only when (1) it has the interface above, its
        indices reached through integer ops only, tokens and expert weights in one dtype,
        (2) it uses no random or mutating-input op, (3) its activation is SiLU (SwiGLU
        experts), nothing bounds it (no clamp/minimum/maximum: transformers' clamped
        SwiGLU) and every floating-point value is computed by an op of ``FLOAT_OPS``, and
        (4) on four probes with the region's shapes and dtypes (random routing; every token's
        first choice on expert 0; the last expert unused; hidden rows 30x larger) the
        region, run on the real expert
        weights of the compile's example inputs (and on drawn weights), equals
        ``moe_experts`` within the dtype's tolerance relative to the largest output (bf16 and
        fp16 regions also in float32, their casts lifted, at float32's: 3e-2 let a 1%
        change of the activation pass); drawn weights also at 30x and 1000x; a symbolic
        token count also at other values (:func:`_other_sizes`). Capacity
        (``moe.capacity_factor``) changes the function and is reported as such.
    reads meta: ``val``, ``nn_module_stack``, ``ctx.extras["example_inputs"]``.
    writes meta: new nodes get ``val``, the region output's ``nn_module_stack`` and
        ``graphopt_replaced`` (the region output's name).
    records: per site "rewritten" (E, K, T, router kind, shared experts, EP schedule and the
        cost model's prediction) or "skipped" with the reason; with no ``moe`` option, "kept".

Pseudo-code:
    for topk in graph:
        region = nodes of the experts module fed by topk's indices
        check interface, ops, activation; probe region vs moe_experts
        out = graphopt::moe_experts(tokens, idx, w, gate_up, down, cf, ep, group, schedule, ...)
        replace region output by out[0]; dead region nodes are removed
"""

from __future__ import annotations

import math
import operator
import os
import re
import warnings
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.experimental.symbolic_shapes import statically_known_true

from graphopt.errors import ConfigError
from graphopt.passes import register_pass
from graphopt.passes.base import GraphPass, PassContext, PassResult
from graphopt.passes.fx_utils import (
    autocast_reason,
    eliminate_dead_code,
    grad_mode_reason,
    is_mutating,
    is_random,
    module_path,
    set_fake_val,
    site_name,
    size_hint,
    tensor_meta,
    writes_of,
)
from graphopt.passes.moe_options import MoEOptions

aten = torch.ops.aten
GROUPED_MM_FIX = ("build the model with experts_implementation='grouped_mm' (or 'batched_mm') "
                  "so router and experts reach one graph, where its class offers them "
                  "(transformers' set_experts_implementation; a class without them, e.g. "
                  "DBRX or JetMoE, keeps its eager loop and is not rewritten)")
EAGER_LOOP_FIX = ("the router's indices leave this graph at a graph break (transformers' eager "
                  "experts loop breaks on a data-dependent nonzero); " + GROUPED_MM_FIX)


class Skip(Exception):
    """A site the pass leaves untouched; the message is the reported reason."""


@dataclass
class Region:
    """An experts region: its nodes, its single output and its classified inputs."""

    path: str
    nodes: list[fx.Node]
    output: fx.Node
    hidden: fx.Node
    index: fx.Node
    weights: fx.Node
    gate_up: fx.Node
    down: fx.Node


def _under(node: fx.Node, path: str) -> bool:
    p = module_path(node)
    return p == path or p.startswith(path + ".")


def find_region(topk: fx.Node) -> Region:
    """The experts region fed by ``topk``'s indices (see the module docstring).

    Raises:
        Skip: no such region, or one with another interface.
    """
    idx = next((u for u in topk.users if u.target is operator.getitem and u.args[1] == 1), None)
    if idx is None:
        raise Skip("top-k indices are unused")
    # (node, whether the path to it passed a floating-point value): routing indices reach
    # the experts through integer ops; a path through floating values (attention, the
    # residual stream) is not routing (a review: DeepSeek-V3.2's attention indexer top-k
    # was taken as the router of the next MoE layer)
    frontier: list[tuple[fx.Node, bool]] = [(u, False) for u in idx.users]
    seen: set[tuple[fx.Node, bool]] = set()
    path, by_value = "", ""
    while frontier and not path:  # the first module that consumes the indices
        node, through_float = frontier.pop(0)
        if (node, through_float) in seen:
            continue
        seen.add((node, through_float))
        if "experts" in module_path(node).rsplit(".", 1)[-1]:
            if not through_float:
                path = module_path(node)
            by_value = by_value or module_path(node)
            continue
        if node.target is aten.one_hot.default or node.op == "output":
            if not module_path(topk):  # a model-level top-k, no router module
                # no module path: a model-level top-k, or one in the function Dynamo
                # resumes after a graph break (DBRX's router, a review: "outside any module"
                # misdescribed it)
                raise Skip("a top-k with no module path (model-level, or resumed after a "
                           "graph break) feeds one_hot or the graph output, "
                           "not an experts module: transformers' load-balancing loss "
                           "(output_router_logits: nothing to rewrite), or an experts loop "
                           f"that breaks the graph ({GROUPED_MM_FIX})")
            if not through_float:
                raise Skip(EAGER_LOOP_FIX)
            continue
        frontier += [(u, through_float or _floating(node)) for u in node.users]
    if not path and by_value:  # a review: Llama4 was told no experts module took them
        raise Skip("no experts module consumes the router's indices in this graph: they "
                   f"reach {by_value} only through floating-point values (attention or the "
                   "residual stream; or routing scores applied to the experts' input, as "
                   "Llama4 does), and the pass rewrites experts that take the indices and "
                   "weights (transformers' experts interface: hidden, top_k_index, "
                   "top_k_weights)")
    if not path:
        raise Skip("no experts module consumes the router's indices in this graph")
    graph = topk.graph
    nodes = [n for n in graph.nodes if n.op == "call_function" and _under(n, path)]
    _check_router_width(topk, nodes, path)
    inside = set(nodes)
    # Sizes (SymInt values of a dynamic-shape graph) are not data: they may come from outside
    # and be used outside; the probes evaluate them at their example values.
    inputs = {a for n in nodes for a in n.all_input_nodes if a not in inside and not _is_size(a)}
    outputs = [n for n in nodes if any(u not in inside for u in n.users) and not _is_size(n)]
    if len(outputs) != 1:
        raise Skip(f"experts module {path} has {len(outputs)} outputs, expected 1")
    params = [n for n in inputs if n.op in ("placeholder", "get_attr") and _rank(n) == 3]
    ints = [n for n in inputs if _rank(n) == 2 and not _meta(n).is_floating_point()]
    floats = [n for n in inputs if n not in params and _rank(n) == 2
              and _meta(n).is_floating_point()]
    hidden = [n for n in floats if _meta(n).shape == _meta(outputs[0]).shape]
    weights = [n for n in floats if n not in hidden]
    if len(params) != 2 or len(ints) != 1 or len(hidden) != 1 or len(weights) != 1 or \
            len(inputs) != 5:
        # (a review: GPT-OSS's reason was a bare list of node names; its experts hold
        # biases and a clamped activation)
        held = sorted(f"{_attribute(n.name)} {list(_meta(n).shape)}" for n in inputs
                      if n.op in ("placeholder", "get_attr"))
        raise Skip(f"experts module {path} reads {len(inputs)} values, {len(held)} of them "
                   f"parameters or buffers ({'; '.join(held)}); the rewrite takes "
                   "transformers' SwiGLU experts: tokens [T, H], top-k indices and weights "
                   "[T, K], and two weights, gate_up [E, 2F, H] and down [E, H, F] (no "
                   "biases or other parameters, as GPT-OSS's experts hold)")
    t, h = _meta(hidden[0]).shape
    pairs = [(a, b) for a, b in (params, params[::-1]) if _swiglu_layout(a, b, h)]
    if not pairs or tuple(_meta(ints[0]).shape) != tuple(_meta(weights[0]).shape) or \
            _meta(ints[0]).shape[0] != t:
        raise Skip(f"experts module {path}: weight shapes "
                   f"{[tuple(_meta(p).shape) for p in params]} are not transformers' "
                   "[E, 2F, H] / [E, H, F], or routing is not [T, K]")
    gate_up, down = pairs[0]
    done = [n.name for n in nodes if str(n.target).startswith("graphopt.")]
    if done:
        raise Skip(f"experts module {path} already runs graphopt ops ({done[0]}): it was made "
                   "expert-parallel by graphopt.parallelize")
    return Region(path, nodes, outputs[0], hidden[0], ints[0], weights[0], gate_up, down)


def _attribute(name: str) -> str:
    """The attribute name in a Dynamo placeholder's name
    (``l_..._experts_parameters_down_proj_bias_`` -> ``down_proj_bias``)."""
    found = re.search(r"_(?:parameters|buffers)_(.+?)_?$", name)
    return found.group(1) if found else name


def _check_router_width(topk: fx.Node, nodes: list[fx.Node], path: str) -> None:
    """Skip unless the router scores as many choices as the experts module holds experts
    (the first dim of its 3-D parameters): with more (zero-computation experts, another
    rank's experts) indices past the experts would reach graphopt's op, which the probes,
    drawing indices in [0, E), never show (a review: out of bounds at run time)."""
    if any(str(n.target).startswith("graphopt.") for n in nodes):
        return  # made expert-parallel by graphopt.parallelize: this rank's E / ep experts
    scores = topk.args[0].meta.get("val") if isinstance(topk.args[0], fx.Node) else None
    weights = [a for n in nodes for a in n.all_input_nodes
               if a.op in ("placeholder", "get_attr") and _rank(a) == 3]
    if not isinstance(scores, torch.Tensor) or not scores.dim() or not weights:
        return
    experts = _meta(weights[0]).shape[0]
    if not statically_known_true(scores.shape[-1] == experts):
        raise Skip(f"the router scores {scores.shape[-1]} choices and experts module {path} "
                   f"holds {experts} experts: indices past its experts (zero-computation "
                   "experts, another rank's experts) would reach graphopt's op")


def _swiglu_layout(gate_up: fx.Node, down: fx.Node, hidden: int) -> bool:
    """gate_up [E, 2F, H] and down [E, H, F] (transformers' experts layout)."""
    e, f2, h = _meta(gate_up).shape
    return h == hidden and f2 % 2 == 0 and tuple(_meta(down).shape) == (e, hidden, f2 // 2)


def _meta(node: fx.Node) -> torch.Tensor:
    val = tensor_meta(node)
    if val is None:
        raise Skip(f"{node.name} has no tensor meta")
    return val


def _rank(node: fx.Node) -> int:
    val = tensor_meta(node)
    return -1 if val is None else val.dim()


def router_kind(topk: fx.Node) -> str:
    """"softmax" | "sigmoid" | "group-limited sigmoid" | ...: what the top-k scores are."""
    ops, frontier, seen, path = set(), [topk.args[0]], set(), module_path(topk)
    while frontier:
        node = frontier.pop()
        if not isinstance(node, fx.Node) or node in seen or node.op != "call_function" \
                or not _under(node, path):
            continue
        seen.add(node)
        ops.add(getattr(node.target, "_opname", ""))
        frontier += node.all_input_nodes
    kind = "softmax" if "softmax" in ops else "sigmoid" if "sigmoid" in ops else "other"
    if "topk" in ops:  # a top-k over expert groups before the expert top-k (DeepSeek-V3)
        kind = f"group-limited {kind}"
    return kind


def _extract(region: Region, lift: torch.dtype | None = None,
             at: dict[Any, int] | None = None) -> fx.GraphModule:
    """The region as a callable graph (tokens, index, weights, gate_up, down) -> out; with
    ``lift``, every ``lift`` dtype argument (casts, factory dtypes) becomes float32: the
    same ops at float32 precision. Sizes computed outside the region are constants: their
    example values, or with ``at`` (symbol -> value) their expressions there."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for name in ("hidden", "index", "weights", "gate_up", "down"):
        env[getattr(region, name)] = graph.placeholder(name)
    for node in region.nodes:
        env[node] = graph.node_copy(
            node, lambda n: env[n] if n in env else _size_at(n.meta["val"], at))
        if lift is not None:
            def up(a: Any) -> Any:
                return torch.float32 if a is lift else a

            env[node].args = pytree.tree_map(up, env[node].args)
            env[node].kwargs = pytree.tree_map(up, env[node].kwargs)
    graph.output(env[region.output])
    return fx.GraphModule(torch.nn.Module(), graph)


def _size_at(size: Any, at: dict[Any, int] | None) -> Any:
    """``size`` (an int or SymInt; anything else is returned as is) as an int: its example
    value, or with ``at`` (symbol -> value) its expression evaluated there."""
    if not isinstance(size, torch.SymInt):
        return size
    if at is None:
        return _hint(size)
    value = sympy.sympify(size.node.expr).xreplace(
        {symbol: sympy.Integer(v) for symbol, v in at.items()})
    if not value.is_number:
        raise Skip("a size of the experts region has no example value (data-dependent)")
    return int(value)


def _other_sizes(region: Region) -> list[dict[Any, int]]:
    """Symbol values other than the example's at which a dynamic-shape region is also
    probed: every symbol its inputs' shapes and the sizes it reads from outside follow, at
    its example value + 3, then at 2 (dynamic sizes are >= 2). A region right at the example
    token count only (``y * T / 8``, a review: 0.997 off at twice the count) fails there.
    Empty for static shapes."""
    vals = [_meta(n) for n in (region.hidden, region.index, region.weights, region.gate_up,
                               region.down)]
    sizes: list[Any] = [d for v in vals for d in v.shape
                        if isinstance(d, torch.SymInt)]
    inside = set(region.nodes)
    sizes += [a.meta["val"] for n in region.nodes for a in n.all_input_nodes
              if a not in inside and _is_size(a)]
    symbols: dict[Any, int] = {}
    for size in sizes:
        env = size.node.shape_env
        for symbol in sympy.sympify(size.node.expr).free_symbols:
            hint = env.backed_var_to_val.get(symbol)
            if hint is None:
                raise Skip("a size of the experts region has no example value "
                           "(data-dependent)")
            symbols[symbol] = int(hint)
    if not symbols:
        return []
    return [{s: v + 3 for s, v in symbols.items()},
            {s: 2 if v != 2 else 5 for s, v in symbols.items()}]


def _probes(region: Region, real: dict[fx.Node, Any], at: dict[Any, int] | None = None,
            kinds_at: tuple[str, ...] | None = None) -> list[tuple[torch.Tensor, ...]]:
    """Probe inputs (tokens, index, weights, gate_up, down) at the example sizes, or with
    ``at`` at those symbol values (then only the ``kinds_at`` kinds of routing)."""
    gen = torch.Generator().manual_seed(0)
    h, idx, w = _meta(region.hidden), _meta(region.index), _meta(region.weights)
    device = h.device
    t, k = (_size_at(n, at) for n in idx.shape)
    e = _meta(region.gate_up).shape[0]
    drawn = [(torch.randn([_size_at(d, at) for d in _meta(node).shape], generator=gen)
              * _size_at(_meta(node).shape[-1], at) ** -0.5).to(device, _meta(node).dtype)
             for node in (region.gate_up, region.down)]
    # The compile-time weights, and drawn ones too: real weights can be degenerate (a
    # zero-initialised down_proj, weights not loaded yet) and make every probe 0 on both
    # sides; a review got silu(g) * (up + 1) experts rewritten that way (error 1.18 after
    # one optimizer step).
    real_params = [v for v in (real.get(region.gate_up), real.get(region.down))
                   if isinstance(v, torch.Tensor) and v.device.type != "meta"]
    params = drawn if len(real_params) < 2 else [v.detach().to(device) for v in real_params]
    probes: list[tuple[torch.Tensor, ...]] = []
    if t == 0:  # a graph specialized to no tokens: nothing flows through it, nothing to probe
        return probes
    kinds = [(params, kind) for kind in ("random", "expert0", "last_unused", "large")]
    if params is not drawn:  # the drawn weights at unit scale, and larger: a bound on the
        # activation past what the real weights reach (degenerate weights reach nothing)
        kinds += [(drawn, "random"), (drawn, "large")]
    if h.dtype != torch.float16:  # fp16 overflows at activations of 1e3 cubed
        kinds.append((drawn, "huge"))
    if kinds_at is not None:
        kinds = [(ws, kind) for ws, kind in kinds if kind in kinds_at]
    for weights_set, kind in kinds:
        pool = e - 1 if kind == "last_unused" and e > k else e
        index = torch.stack([torch.randperm(pool, generator=gen)[:k] for _ in range(t)])
        if kind == "expert0":
            index = torch.where(index == 0, index[:, :1], index)
            index[:, 0] = 0
        hidden = torch.randn(t, _size_at(h.shape[1], at), generator=gen)
        if kind == "large":  # real hidden states are normed and scaled: 30x a unit probe
            hidden = hidden * 30
        if kind == "huge":  # activations of ~1e3 (a bound that far out still shows)
            hidden = hidden * 1000
        hidden = hidden.to(device, h.dtype)
        # signed: the op is linear in the routing weights, and transforms invisible on
        # positive ones (relu, abs of the weights; a review got both rewritten, output 0.9
        # and 1.8 off) must show
        weights = (torch.rand(t, k, generator=gen) * 2 - 1).to(device, w.dtype)
        probes.append((hidden, index.to(device, idx.dtype), weights, *weights_set))
    return probes


_SATURATING = frozenset({"clamp", "clamp_min", "clamp_max", "clip", "minimum", "maximum",
                         "hardtanh", "fmin", "fmax"})
"""Ops that bound a value: an experts region with one is not plain SwiGLU, and probes at one
input scale cannot show the bound (transformers' swiglu_limit clamps beyond it)."""

FLOAT_OPS = frozenset({
    # the expert products
    "mm", "bmm", "matmul", "_grouped_mm", "grouped_mm", "grouped_mm_fallback", "einsum",
    # SwiGLU and the routing-weighted sum
    "silu", "mul", "add", "sub", "neg", "div", "sum",
    # data movement
    "view", "reshape", "_unsafe_view", "expand", "permute", "transpose", "t", "unsqueeze",
    "squeeze", "flatten", "contiguous", "clone", "alias", "chunk", "split",
    "split_with_sizes", "unbind", "slice", "select", "narrow", "cat", "stack", "index",
    "index_select", "gather", "take_along_dim", "repeat_interleave", "repeat", "getitem",
    "to", "_to_copy", "type_as",
    # no forward effect; a gradient trick with it is caught by the backward probe
    "detach",
    # the combine and its buffers
    "index_add", "index_add_", "index_put", "index_put_", "scatter", "scatter_add",
    "scatter_add_", "zeros", "zeros_like", "new_zeros", "empty", "empty_like", "new_empty",
    "histc", "bincount"})
"""Ops an experts region may compute floating-point values with: those of every experts
spelling transformers ships (grouped_mm and batched_mm; collected from 16 MoE model classes)
and their plain equivalents. Anything else (``where``, ``relu``, ``tanh``, a comparison of
activations, ...) can bound the activation in a way probes at a few scales need not reach:
a review wrote clamped SwiGLU as ``torch.where(g > 10, 10, g)`` and ``g - relu(g - 10)``,
rewritten as plain SwiGLU (2.26 off once the weights grew). Integer-valued ops (routing
positions, counts) are not restricted: the probes' random routing exercises them."""


def check_region(region: Region, real: dict[fx.Node, Any]) -> None:
    """Raise Skip unless the region computes SwiGLU experts (see guarantees (2)-(4))."""
    ops = {_opname(n) for n in region.nodes}
    bad = [n.name for n in region.nodes if is_random(n)]
    bad += [n.name for n in region.nodes if is_mutating(n) and any(
        a not in region.nodes for a in n.all_input_nodes[:1])]
    bad += [n.name for n in region.nodes if not is_mutating(n) and any(  # checkpoint bodies
        a not in region.nodes for a in writes_of(n))]
    if bad:
        raise Skip(f"experts module {region.path} has random or input-mutating ops: {bad[:3]}")
    if "silu" not in ops:
        acts = sorted(ops & {"gelu", "relu", "sigmoid", "tanh"}) or ["unknown"]
        raise Skip(f"experts activation {acts} is not SiLU (only SwiGLU experts are rewritten)")
    problem = _op_problem(region)
    if problem:
        raise Skip(f"experts module {region.path} {problem}")
    dtypes = {_meta(n).dtype for n in (region.hidden, region.gate_up, region.down)}
    if len(dtypes) != 1:
        raise Skip(f"experts module {region.path} takes tokens in {_meta(region.hidden).dtype} "
                   f"and expert weights in {_meta(region.gate_up).dtype}/"
                   f"{_meta(region.down).dtype}: graphopt's op computes in one dtype")
    fn = _extract(region)
    dtype = _meta(region.hidden).dtype
    tol = {torch.float64: 1e-9, torch.float32: 1e-4}.get(dtype, 3e-2)
    probes = _probes(region, real)
    checks = [(fn, probe, tol) for probe in probes]
    for at in _other_sizes(region):  # a dynamic-shape region: other token counts too
        checks += [(_extract(region, at=at), probe, tol) for probe in
                   _probes(region, real, at, ("random", "expert0"))]
    if tol > 1e-4:
        # bf16/fp16 rounding hides a small change of the function (silu(x) * 1.01 passed
        # at 3e-2, a review): the same probes and ops in float32 too (grouped_mm has no
        # float64), the region's casts to its dtype lifted to float32
        lifted = _extract(region, lift=dtype)
        checks += [(lifted, tuple(t.float() if t.is_floating_point() else t for t in probe),
                    1e-4) for probe in probes]
    for region_fn, probe, tolerance in checks:
        try:
            want = region_fn(*probe)
        except (RuntimeError, ValueError, TypeError, IndexError) as exc:
            raise Skip(f"experts module {region.path}: its probe at {probe[0].shape[0]} "
                       f"tokens failed ({type(exc).__name__}: {str(exc)[:200]})") from None
        try:
            got = _dropless_op(*probe)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise Skip(f"experts module {region.path}: graphopt's op cannot run this "
                       f"region's inputs ({type(exc).__name__}: {str(exc)[:200]})") from None
        if want.shape != got.shape or want.dtype != got.dtype or \
                not _close(want, got, tolerance):
            raise Skip(f"experts module {region.path} does not compute SwiGLU experts "
                       "(probe mismatch)")
    # the backward too, on one probe at float32 precision or better: a region with the same
    # forward and another backward (w.detach() + (w - w.detach()) * 0.5, a gradient-scaling
    # trick) was rewritten to the op's true gradient (a review: 2x the router gradient)
    # (every probe at float32 precision or better: a gradient trick growing with the
    # activations, g + (c - c.detach()) with c = 5e-9 g**7, was 8e-4 off on the first, unit
    # scale probe and 1.0 at 30x, a review)
    precise = [c for c in checks if c[2] <= 1e-4]  # none: no tokens to probe
    if precise and not all(_same_vjp(*c) for c in precise):
        raise Skip(f"experts module {region.path} computes SwiGLU experts forward but not "
                   "their gradient (a gradient transform in the region, e.g. detach or "
                   "gradient scaling; probe mismatch in the backward)")


def _op_problem(region: Region) -> str:
    """Why the region's ops are not SwiGLU experts' ("" when they are): a bound on the
    activations (clamp, minimum, ...), a clamp of the indices, a comparison, token positions
    or sizes used as values, activations turned into booleans or integers, an op outside
    :data:`FLOAT_OPS`. Probes at a few scales and token counts cannot show these."""
    floats = {_opname(n): n for n in region.nodes if _floating(n)}
    limits = sorted(set(floats) & _SATURATING)
    if limits:  # HY-V4 / GLM5-Next / DeepSeek-V4 clamp gate and up at swiglu_limit
        return (f"limits its activations ({', '.join(limits)}: "
                "a clamped SwiGLU); graphopt's kernel is plain SwiGLU")
    index_limits = sorted(_opname(n) for n in region.nodes
                       if _opname(n) in _SATURATING and not _floating(n))
    if index_limits:
        return (f"clamps its routing indices "
                f"({', '.join(index_limits)}: transformers' expert-parallel sentinels, "
                "indices >= E at run time); graphopt's op takes indices in [0, E): use "
                "graphopt's expert parallelism (moe.ep, graphopt.parallelize) instead")
    compared = [n for n in region.nodes if _opname(n) in _COMPARISONS]
    if compared:
        return (f"compares values ({compared[0].name}: "
                f"{_opname(compared[0])}): SwiGLU experts select by the routing indices "
                "alone (a masked range of indices, zero-computation experts, or a step in "
                "the activations or token positions is not what graphopt's op computes)")
    positional = _position_uses(region)
    if positional:
        return (f"computes with token positions or sizes as "
                f"values ({positional[0].name}: {_opname(positional[0])}), not only as "
                "indices or shapes: its function may change with the token count where "
                "no probe runs")
    tested = _activation_tests(region)
    if tested:  # a comparison of activations, or activations cast to integers: a step
        # built from allowed ops, g - (g - 10) * (g > 10), is a clamp probes need not reach
        return (f"turns activations into booleans or "
                f"integers ({tested[0].name}: {_opname(tested[0])}), a data-dependent "
                "step SwiGLU experts do not have; graphopt's kernel is plain SwiGLU")
    others = sorted(set(floats) - FLOAT_OPS)
    if others:
        return (f"computes activations with "
                f"{', '.join(others)} ({floats[others[0]].name}), which is not in "
                "SwiGLU experts (an op that can bound or gate the activation where probes "
                "do not reach); graphopt's kernel is plain SwiGLU")
    return ""


def _dropless_op(hidden: torch.Tensor, index: torch.Tensor, *rest: torch.Tensor
                 ) -> torch.Tensor:
    """graphopt's op on one device, dropless, on a probe (tokens, index, weights, gate_up,
    down; the index cast to int64 as the rewrite casts it): the output the rewritten region
    would compute."""
    from graphopt.kernels.moe.op import moe_experts_op

    return moe_experts_op(hidden, index.long(), *rest, -1.0, 1, "", "flat", 1, 1)[0]


def _activation_tests(region: Region) -> list[fx.Node]:
    """Nodes of the region computing a non-floating value (boolean, integer) from a
    floating value derived from the tokens, the routing weights or the expert weights
    (activations): in SwiGLU experts only the indices decide integer values."""
    tainted = {region.hidden, region.weights, region.gate_up, region.down}
    found = []
    for node in region.nodes:
        if not any(a in tainted for a in node.all_input_nodes):
            continue
        if _floating(node) and _opname(node) not in ("histc", "bincount"):
            tainted.add(node)
        elif not _is_size(node) and _opname(node) not in ("sym_size", "sym_numel",
                                                          "sym_stride", "getitem"):
            found.append(node)  # (histc of activations counts those within its bounds:
            # a comparison with a float result, a review's step at 1e4)
    return found


_COMPARISONS = frozenset({
    "lt", "gt", "le", "ge", "eq", "ne", "where", "masked_fill", "masked_fill_",
    "masked_scatter", "logical_and", "logical_or", "logical_not", "logical_xor", "isin",
    "sign", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "__and__",
    "__or__", "__xor__", "__invert__", "lt_", "gt_", "le_", "ge_", "eq_", "ne_", "signbit",
    "heaviside", "isclose", "isfinite", "isinf", "isnan", "nan_to_num", "argmax", "argmin",
    "amax", "amin", "max", "min", "remainder", "fmod"})
"""Ops no transformers experts spelling uses (none of the 16 classes' grouped_mm and
batched_mm regions) that select or step on values: a comparison of indices masks a range
(zero-computation experts: indices >= E kept out by ``idx < E``; the op then read out of
bounds, a review), of token positions or activations a step where probes need not land."""

_INDEX_ARGS = {"index": (1,), "index_select": (2,), "gather": (2,), "take_along_dim": (1,),
               "scatter": (2,), "scatter_add": (2,), "scatter_add_": (2,), "index_add": (2,),
               "index_add_": (2,), "index_put": (1,), "index_put_": (1,),
               "repeat_interleave": (1,), "_grouped_mm": (2,), "grouped_mm": (2,),
               "grouped_mm_fallback": (2,)}
"""Arguments through which integer tensors enter a floating-point op as indices (and
grouped GEMMs' offsets), by op name: positions a probe's values exercise."""


def _position_uses(region: Region) -> list[fx.Node]:
    """Nodes of the region where a token position or a size is used as a value: an
    integer tensor built from sizes (``arange(T)``, ``full((T,), T)``) and what is computed
    from it entering a floating-point op other than as an index or offsets, and a size
    (SymInt) as a scalar operand of an op computing floating-point values (``y * (T //
    16)``). A review: ``y * (arange(T) < 16)`` and ``y * (1 + T // 16)`` were rewritten,
    exact at the probed counts and 4.7 / 9.4 off at 32 tokens."""
    shapes = {"view", "reshape", "_unsafe_view", "expand", "new_zeros", "zeros", "empty",
              "new_empty", "empty_like", "zeros_like", "slice", "narrow", "split",
              "split_with_sizes", "chunk", "unflatten", "flatten", "permute", "transpose",
              "unsqueeze", "squeeze", "select", "repeat_interleave", "getitem", "sym_size"}
    positions: set[fx.Node] = set()
    found = []
    for node in region.nodes:
        name = _opname(node)
        sized = any(isinstance(a, torch.SymInt) or (isinstance(a, fx.Node) and _is_size(a))
                    for a in pytree.tree_leaves((node.args, node.kwargs)))
        if not _floating(node):
            if name == "arange" or (sized and name in ("full", "new_full")) or \
                    any(a in positions for a in node.all_input_nodes):
                positions.add(node)
            continue
        if sized and name not in shapes:
            found.append(node)
            continue
        allowed = {id(a) for i in _INDEX_ARGS.get(name, ()) if i < len(node.args)
                   for a in pytree.tree_leaves(node.args[i])}
        allowed |= {id(a) for a in pytree.tree_leaves(node.kwargs.get("offs"))}
        if any(a in positions and id(a) not in allowed for a in node.all_input_nodes):
            found.append(node)
    return found


def _opname(node: fx.Node) -> str:
    """The op's name: ``mul`` for aten.mul.Tensor, ``getitem`` for operator.getitem."""
    target = node.target
    return str(getattr(target, "_opname", None) or getattr(target, "__name__", target))


def _floating(node: fx.Node) -> bool:
    """Whether ``node`` computes a floating-point tensor (one of its results, for ops
    returning several)."""
    vals = pytree.tree_leaves(node.meta.get("val"))
    return any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in vals)


def _close(want: torch.Tensor, got: torch.Tensor, tolerance: float) -> bool:
    """allclose with atol relative to ``want``'s largest entry: an absolute atol let a 1%
    change of outputs of size 0.01 pass at 1e-4 (a review)."""
    scale = float(want.detach().abs().max()) if want.numel() else 0.0
    return torch.allclose(got.double(), want.double(), rtol=tolerance,
                          atol=tolerance * max(scale, 1e-6))


def _same_vjp(region_fn: fx.GraphModule, probe: tuple[torch.Tensor, ...],
              tolerance: float) -> bool:
    """Whether the region's and graphopt's op's vector-Jacobian products agree on ``probe``
    (tokens, index, weights, gate_up, down) for a random cotangent, with respect to the
    tokens, routing weights and both expert weights."""
    gen = torch.Generator().manual_seed(1)
    with torch.enable_grad():
        results = []
        for fn in (region_fn, _dropless_op):
            inputs = [t.detach().clone().requires_grad_(t.is_floating_point())
                      for t in probe]
            out = fn(*inputs)
            if not out.requires_grad:
                return False
            cot = torch.randn(out.shape, generator=gen).to(out)
            diff = [t for t in inputs if t.requires_grad]
            grads = torch.autograd.grad(out, diff, cot, allow_unused=True)
            results.append([torch.zeros_like(t) if g is None else g
                            for t, g in zip(diff, grads)])
            gen.manual_seed(1)  # the same cotangent for both
    return all(_close(want, got, tolerance) for want, got in zip(*results))


@register_pass
@dataclass(frozen=True)
class MoEPass(GraphPass):
    """See the module docstring."""

    name = "moe"
    stage = "pre_autograd"
    options_key = "moe"
    options_cls = MoEOptions
    marks_approximate_sites = True  # a capacity factor >= E drops nothing: exact
    options: MoEOptions | None = None

    @property
    def exact(self) -> bool:  # type: ignore[override]
        return self.options is None or self.options.capacity_factor is None

    @classmethod
    def from_config(cls, config: Any) -> MoEPass:
        return cls(config.moe)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        real = {p: x for p, x in zip(gm.graph.find_nodes(op="placeholder"),
                                     ctx.extras.get("example_inputs") or []) if x is not None}
        for node in gm.graph.find_nodes(op="get_attr"):  # weights held by the graph (export)
            try:
                value = gm.get_parameter(str(node.target))
            except AttributeError:  # a buffer or a submodule
                continue
            if isinstance(value, torch.Tensor):
                real[node] = value
        modified = False
        skipped: list[str] = []
        topks = list(gm.graph.find_nodes(op="call_function", target=aten.topk.default))
        if self.options is not None and not topks:  # asked for, nothing to do: say so
            argmax = gm.graph.find_nodes(op="call_function", target=aten.argmax.default)
            ctx.record("skipped", "graph", "no MoE router (top-k over expert scores) in this "
                       "graph: the moe options change nothing here" + (
                           "; argmax routing (top-1, e.g. Switch / NLLB-MoE) and its "
                           "experts are not rewritten (graphopt's op takes top-k routing "
                           "into SwiGLU experts)" if argmax else ""))
        for topk in topks:
            if topk.graph is not gm.graph or not topk.users:
                continue
            if _feeds_topk(topk):
                continue  # a group top-k (DeepSeek-V3): the expert top-k comes after it
            site = site_name(topk)
            try:
                if _symbolic(topk) and self.options is not None and self.options.ep > 1:
                    # skipping would run this rank's experts locally while the other ranks
                    # wait in the expert-parallel collectives (a hang)
                    raise ConfigError(
                        f"{site}: moe.ep={self.options.ep} with a symbolic token count (a "
                        "dynamic-shape compile, or Dynamo's automatic dynamic recompile when "
                        "this rank's token count changed): every rank must run the expert-"
                        "parallel graph; compile with dynamic=False (a changed token count "
                        "then recompiles with static shapes)")
                region = find_region(topk)
                if autocast_reason(region.nodes):
                    raise Skip(autocast_reason(region.nodes))
                mixed = grad_mode_reason(region.nodes, region.output)  # frozen experts
                if mixed:  # computed under no_grad: the op would carry their gradients
                    raise Skip(mixed)
                detail = self._describe(region, topk)
                if self.options is None:
                    ctx.record("kept", site, f"{detail}; set options={{'moe': {{}}}} to rewrite")
                    continue
                check_region(region, real)
                how, drops = self._rewrite(gm, region)
                modified = True
                ctx.record("rewritten", site, f"{detail}; {how}", approximate=drops)
            except Skip as why:
                ctx.record("skipped", site, str(why))
                skipped.append(f"{site}: {why}")
        if skipped and self.options is not None and self.options.capacity_factor is not None:
            # the option changes the model's result; a skip leaves it unapplied, which the
            # report alone said (a review: GraniteMoe's eager experts, a graph break per
            # expert, trained dropless at capacity_factor=0.25 without a word)
            warnings.warn(f"graphopt: moe.capacity_factor={self.options.capacity_factor} was "
                          f"asked for, but {len(skipped)} MoE site(s) of this graph were not "
                          f"rewritten and run dropless, as the model defines them: "
                          f"{skipped[0]}", UserWarning, stacklevel=2)
        if modified:
            eliminate_dead_code(gm.graph)
        return PassResult(gm, modified)

    @staticmethod
    def _describe(region: Region, topk: fx.Node) -> str:
        e = _meta(region.gate_up).shape[0]
        t, k = _meta(region.index).shape
        parent = region.path.rsplit(".", 1)[0]
        shared = any(module_path(n).startswith(parent + ".shared_expert")
                     for n in topk.graph.nodes)
        return (f"{region.path}: E={e}, K={k}, T={t}, router {router_kind(topk)}"
                + (", shared experts kept dense" if shared else ""))

    def _rewrite(self, gm: fx.GraphModule, region: Region) -> tuple[str, bool]:
        """Replace the region by ``graphopt::moe_experts``: (how, whether it can drop)."""
        import graphopt.kernels.moe.op  # noqa: F401  (registers graphopt::moe_experts)

        moe_experts_op = torch.ops.graphopt.moe_experts.default
        opts = self.options
        assert opts is not None
        e, f2, h = _meta(region.gate_up).shape
        group, ep, schedule, chunks, rpn, note = "", 1, "flat", 1, 1, "one device"
        gate_up, down = region.gate_up, region.down
        if opts.ep > 1:
            (group, rank), rpn = ep_group(opts.ep, e), ranks_per_node(opts)
            ep = opts.ep
            schedule, chunks, note = self._schedule(region, opts, rpn)
            note += _fail_on_recompile_limit()
        cf = -1.0 if opts.capacity_factor is None else float(opts.capacity_factor)
        # C = ceil(cf T K / E) >= T K at cf >= E (each rank's own T under EP): no drops, so
        # the op runs dropless and the site is exact (a review: reported APPROXIMATE)
        unreachable = cf >= e
        if unreachable:
            cf = -1.0
        with gm.graph.inserting_before(region.output):
            if ep > 1:  # the module holds every expert: the op takes this rank's E / ep
                gm.meta.setdefault(OWNER_GRADS, set()).update(
                    w.name for w in (gate_up, down) if w.op == "placeholder")
                per = e // ep
                gate_up, down = (_slice(gm.graph, w, rank * per, (rank + 1) * per)
                                 for w in (gate_up, down))
            index = region.index
            if _meta(index).dtype != torch.int64:  # the op sorts int64 indices
                index = gm.graph.call_function(aten._to_copy.default, (index,),
                                               {"dtype": torch.int64})
                set_fake_val(index)
            args = (region.hidden, index, region.weights, gate_up, down, cf,
                    ep, group, schedule, chunks, rpn, opts.drop_policy)
            call = gm.graph.call_function(moe_experts_op, args)
            out = gm.graph.call_function(operator.getitem, (call, 0))
        set_fake_val(call)
        out.meta["val"] = call.meta["val"][0]
        for node in (call, out):
            node.meta["nn_module_stack"] = region.output.meta.get("nn_module_stack", {})
            node.meta["graphopt_replaced"] = [region.output.name]
        region.output.replace_all_uses_with(out)
        drop = (f"dropless (capacity factor {opts.capacity_factor} >= E = {e}: an expert "
                f"can take every assignment, nothing is dropped; exact)" if unreachable else
                "dropless" if cf < 0 else (f"capacity factor {cf}, drop policy "
                                           f"{opts.drop_policy} (APPROXIMATE: drops tokens)"))
        return f"sorted dispatch + grouped GEMM, {drop}, {note}", cf >= 0

    @staticmethod
    def _schedule(region: Region, opts: MoEOptions, rpn: int) -> tuple[str, int, str]:
        t, k = _meta(region.index).shape
        e, f2, h = _meta(region.gate_up).shape
        auto = opts.all_to_all == "auto" or opts.chunks == "auto"
        # "auto" must pick the same schedule on every rank without communicating (a rank
        # recompiles alone when its token count changes), and ranks' token counts differ:
        # it is chosen for AUTO_TOKENS per rank, not this rank's count
        tokens = AUTO_TOKENS if auto else int(t)
        schedule, chunks, note = ep_schedule(tokens, int(k), int(h), int(f2) // 2,
                                             _meta(region.hidden).dtype, opts, rpn)
        if auto:
            note += f" (auto: chosen for {AUTO_TOKENS} tokens per rank, the same on every rank)"
        return schedule, chunks, note


AUTO_TOKENS = 4096
"""Tokens per rank at which moe.all_to_all / moe.chunks "auto" are chosen in a compiled graph
(set them explicitly to tune for another count; graphopt.parallelize instead takes the
largest first-step count over the ranks with one all-reduce)."""


def ep_schedule(tokens: int, top_k: int, hidden: int, ffn: int, dtype: torch.dtype,
                opts: MoEOptions, rpn: int) -> tuple[str, int, str]:
    """(schedule, chunks, note) for an EP layer of this shape: ``opts.all_to_all`` and
    ``opts.chunks``, "auto" ones chosen by the cost model (graphopt.cost.moe) on
    ``opts.profile``; the note gives every schedule's predicted forward+backward time."""
    from graphopt.cost.moe import MoELayerShape, choose_schedule, schedule_times
    from graphopt.cost.profiles import default_profile_name, load_profile

    shape = MoELayerShape(tokens, top_k, hidden, ffn, dtype.itemsize,
                          str(dtype).replace("torch.", ""))
    profile = opts.profile or default_profile_name()
    cluster = load_profile(profile)
    if opts.ep > cluster.max_devices:  # e.g. the local profile: more ranks than devices
        cluster = cluster.scaled(opts.ep)
    best, best_chunks, times = choose_schedule(shape, opts.ep, cluster, rpn)
    schedule = best if opts.all_to_all == "auto" else opts.all_to_all
    chunks = opts.chunks if opts.chunks != "auto" else (
        best_chunks if schedule == "chunked" else
        schedule_times(shape, opts.ep, cluster, rpn, backward=True)["chunked"][1])
    pred = ", ".join(f"{s} {v * 1e3:.3g} ms" for s, v in times.items())
    how = "chosen by the cost model" if opts.all_to_all == "auto" else "set by moe.all_to_all"
    if opts.chunks != "auto" and schedule != "chunked":  # a review: silently unused
        how += f"; moe.chunks={opts.chunks} applies to the chunked schedule only"
    if schedule == "hierarchical" and (rpn in (1, opts.ep)):  # one level: the kernel runs
        how += f"; runs as flat: {rpn} rank(s) per node"  # the flat exchange (a review)
    # chunks only where the schedule uses them; the token count of the prediction, which
    # is this call's unless "auto" (a review read tables of two counts as contradictory)
    used = f"; chunks {chunks}" if schedule == "chunked" else ""
    per_node = f"{rpn} rank{'s' if rpn != 1 else ''} per node"
    return schedule, int(chunks), (f"EP={opts.ep} ({per_node}), schedule {schedule} "
                                   f"({how}{used}); predicted fwd+bwd of {tokens} tokens per "
                                   f"rank on {profile}: {pred}")


def _slice(graph: fx.Graph, weight: fx.Node, start: int, end: int) -> fx.Node:
    """``weight[start:end]`` (dim 0) as a graph node with its meta."""
    node = graph.call_function(aten.slice.Tensor, (weight, 0, start, end))
    node.meta["val"] = _meta(weight)[start:end]
    node.meta["nn_module_stack"] = weight.meta.get("nn_module_stack", {})
    return node


def _is_size(node: fx.Node) -> bool:
    """A SymInt-valued node (size arithmetic of a dynamic-shape graph)."""
    return isinstance(node.meta.get("val"), torch.SymInt)


def _hint(size: Any) -> int:
    """A size as an int: a symbolic size's example value (no guard is added)."""
    hint = size_hint(size)
    if hint is None:
        raise Skip("the token count has no example value (data-dependent size)")
    return hint


OWNER_GRADS = "graphopt_owner_grads"
"""Model-graph meta set by the moe pass with ep > 1: names of the placeholders (expert
weights) whose gradients are the owner rank's by design; verify does not compare them."""


def _fail_on_recompile_limit() -> str:
    """Make Dynamo raise, not fall back to eager, when a frame hits its recompile limit
    (``torch._dynamo.config.fail_on_recompile_limit_hit``), and recompile a changed shape
    statically (``automatic_dynamic_shapes`` off); a note for the report.

    With expert parallelism every rank must run the compiled EP graph: a rank that hit the
    limit (8 token counts with dynamic=False) ran its modules eagerly, which hold every
    expert, computed its MoE layers alone and went on while the other ranks waited in the
    EP collectives forever (gloo's default timeout is 30 min; a review). An error stops the
    job instead; the fix is in the message (raise ``recompile_limit`` or pad the batches to
    fewer lengths). Under ``dynamic=None`` (torch.compile's default) a rank whose token
    count changed recompiled with a symbolic count, which the pass refuses (ConfigError)
    on that rank alone while the others waited in the collectives (a later review): with
    automatic dynamic shapes off it recompiles with static shapes, as ``dynamic=False``
    does, exactly. Process-wide Dynamo settings, set once and reported."""
    import torch._dynamo.config as dynamo_config

    notes = []
    if not dynamo_config.fail_on_recompile_limit_hit:
        dynamo_config.fail_on_recompile_limit_hit = True
        notes.append("torch._dynamo.config.fail_on_recompile_limit_hit set to True (a rank "
                     "past Dynamo's recompile limit would run its experts eagerly, outside "
                     "the EP collectives, and the other ranks would hang)")
    if dynamo_config.automatic_dynamic_shapes:
        dynamo_config.automatic_dynamic_shapes = False
        notes.append("torch._dynamo.config.automatic_dynamic_shapes set to False (a rank "
                     "whose token count changed would recompile with a symbolic count, "
                     "which expert parallelism refuses, while the other ranks wait; it "
                     "recompiles with static shapes instead, as with dynamic=False)")
    return "".join(f"; {n}" for n in notes)


def _symbolic(topk: fx.Node) -> bool:
    val = topk.args[0].meta.get("val") if isinstance(topk.args[0], fx.Node) else None
    return isinstance(val, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in val.shape)


def _feeds_topk(topk: fx.Node) -> bool:
    """Whether another top-k of the same router module depends on this one."""
    path, frontier, seen = module_path(topk), list(topk.users), set()
    while frontier:
        node = frontier.pop()
        if node in seen or not _under(node, path):
            continue
        seen.add(node)
        if node.target is aten.topk.default:
            return True
        frontier += list(node.users)
    return False


def ranks_per_node(opts: MoEOptions) -> int:
    """``opts.ranks_per_node``, else the gcd of $LOCAL_WORLD_SIZE (torchrun) and ep."""
    if opts.ranks_per_node is not None:
        return opts.ranks_per_node
    return math.gcd(local_world_size() or opts.ep, opts.ep)


def local_world_size() -> int:
    """$LOCAL_WORLD_SIZE (torchrun's ranks per node), or 0 when unset.

    Raises:
        ConfigError: it is set to something other than an int >= 1 (a re-review: a bare
            ValueError from int()).
    """
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    if not value:
        return 0
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"LOCAL_WORLD_SIZE={value!r} must be an int >= 1 (ranks per node, "
                          "set by torchrun): fix or unset it, or give moe.ranks_per_node")
    return int(value)




def ep_group(ep: int, num_experts: int) -> tuple[str, int]:
    """(name of this rank's EP group, this rank's index in it): consecutive ranks, created
    once per ep, collectively (every rank compiles the same graphs in the same order).

    Raises:
        ConfigError: torch.distributed not initialized, ep not dividing the world size or the
            number of experts.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(f"moe.ep={ep} needs torch.distributed: run under torchrun (or call "
                          "init_process_group) before compiling, or set moe.ep=1")
    world = dist.get_world_size()
    if world % ep:
        raise ConfigError(f"moe.ep ({ep}) must divide the world size ({world})")
    if num_experts % ep:
        raise ConfigError(f"moe.ep ({ep}) must divide the number of experts ({num_experts})")
    if ep == world:
        return "", dist.get_rank()
    from graphopt.parallel.mesh import ep_mesh

    mesh = ep_mesh(ep)["ep"]  # the mesh owns the groups
    return str(mesh.get_group().group_name), mesh.get_local_rank()
