"""FX helpers shared by passes: op counts, side-effect checks, readable site names."""

from __future__ import annotations

import contextlib
import operator
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef


def op_name(node: fx.Node) -> str:
    """A short stable name of what a call_function node calls, e.g. ``aten.mm.default``."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}.{target._overloadname}"
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    return str(getattr(target, "__qualname__", None) or getattr(target, "__name__", target))


def autocast_reason(nodes: Any) -> str:
    """"" unless one of ``nodes`` (a node or an iterable of nodes) runs inside an autocast
    region (``meta['autocast']``, set by normalize): there the dtype of each op is chosen at
    run time by autocast, so passes that reason about dtypes or replace ops leave it alone."""
    for node in [nodes] if isinstance(nodes, fx.Node) else nodes:
        region = node.meta.get("autocast")
        if region is not None:
            device, dtype = region
            return (f"inside an autocast region ({device}, {dtype}): op dtypes are chosen by "
                    "autocast at run time; left as written")
    return ""


def op_counts(gm: fx.GraphModule) -> Counter[str]:
    """How many call_function nodes call each target, in ``gm`` and its checkpoint bodies."""
    from graphopt.passes.regions import all_graph_modules

    return Counter(op_name(n) for g in all_graph_modules(gm) for n in g.graph.nodes
                   if n.op == "call_function")


def count_delta(before: Counter[str], after: Counter[str]) -> dict[str, int]:
    """Per op, after minus before; zero entries dropped."""
    keys = set(before) | set(after)
    return {k: after[k] - before[k] for k in sorted(keys) if after[k] != before[k]}


_aten = torch.ops.aten
_UNANNOTATED_WRITES = {
    _aten.batch_norm.default: "training", _aten.native_batch_norm.default: "training",
    _aten._batch_norm_impl_index.default: "training",
    _aten.instance_norm.default: "use_input_stats",
    _aten.cudnn_batch_norm.default: "training", _aten.miopen_batch_norm.default: "training",
}
"""Ops whose schema does not annotate that they write ``running_mean`` / ``running_var``
(in training mode, the argument named here): a PyTorch schema gap."""


def _argument_value(node: fx.Node, index: int, name: str) -> Any:
    return node.args[index] if index < len(node.args) else node.kwargs.get(name)


def argument(node: fx.Node, name: str) -> Any:
    """The value of the ATen argument ``name`` of ``node``, positional or keyword (None if
    absent): ``copy`` is ``aten.to.dtype``'s 4th argument but ``aten.to.device``'s 5th."""
    schema = node.target._schema  # type: ignore[union-attr]
    for i, arg in enumerate(schema.arguments):
        if arg.name == name:
            return _argument_value(node, i, name)
    return None


def unannotated_writes(node: fx.Node) -> list[fx.Node]:
    """The running-statistics inputs a batch/instance norm in training mode updates in
    place although its schema does not say so (:data:`_UNANNOTATED_WRITES`)."""
    flag = _UNANNOTATED_WRITES.get(node.target)  # type: ignore[call-overload]
    if flag is None:
        return []
    if argument(node, flag) is False:
        return []
    return [v for name in ("running_mean", "running_var")
            if isinstance(v := argument(node, name), fx.Node)]


def is_mutating(node: fx.Node) -> bool:
    """True when the node writes to one of its inputs (in-place or out= ops, and training
    batch norms, whose schemas do not say so: :func:`unannotated_writes`)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable or bool(unannotated_writes(node))
    return False


_GRAPHOPT_COMM = {"graphopt::moe_experts": 6, "graphopt::scatter_rows": 2,
                  "graphopt::gather_rows": 2, "graphopt::copy_to_group": 2,
                  "graphopt::reduce_from_group": 2, "graphopt::ring_attention_fwd": 5,
                  "graphopt::ring_attention_bwd": 8}  # op -> index of its group-size argument
RING_ATTENTION = ("graphopt::ring_attention_fwd", "graphopt::ring_attention_bwd")
"""Context parallelism's ring attention ops (graphopt.kernels.comm.ring_attention): they
communicate, and activation checkpointing runs them again (as it ran the Python ring
before they were ops, and as graphopt.planner.perf prices CP under recomputation)."""


def communicates(op: Any, args: tuple) -> bool:
    """True for an op call that exchanges data between ranks: torch's functional collectives
    (``_c10d_functional``), and graphopt's expert-parallel MoE op, token scatter/gather and
    ring attention with a group of more than one rank (their size argument). Such a call
    must run the same number of times on every rank: recomputing it in the backward
    (activation checkpointing, the remat pass) repeats its communication, and a
    recomputation that one rank decides and another does not (the remat ILP sees each
    rank's own token counts) hangs the group."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return False
    if schema.name.startswith(("_c10d_functional::", "c10d_functional::")):
        return True
    index = _GRAPHOPT_COMM.get(schema.name)
    return index is not None and len(args) > index and isinstance(args[index], int) and \
        args[index] > 1


KNOWN_NAMESPACES = ("aten", "prims", "graphopt")


def is_foreign_op(target: Any) -> bool:
    """True for a ``torch.library`` op of another library (namespace not aten, prims or
    graphopt): its schema does not say whether it draws random numbers or has side effects
    (``torch.library.custom_op`` tags every op ``pt2_compliant`` and nothing else), so
    passes neither merge two calls of it (cse) nor recompute it (remat). A review found a
    custom op adding ``randn_like`` noise recomputed in the backward: gradients 5e-3 off,
    silently."""
    return isinstance(target, torch._ops.OpOverload) and \
        target.namespace not in KNOWN_NAMESPACES


def is_random(node: fx.Node) -> bool:
    """True for ops that draw from the RNG (rand*, bernoulli, dropout with p > 0, ...).

    Ops tagged ``nondeterministic_seeded`` only because of a dropout argument (SDPA's
    ``dropout_p``, ``aten.dropout``'s ``p``/``train``) count as random only when that
    dropout is active.
    """
    return is_random_call(node.target, node.args, node.kwargs)


def is_random_call(target: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """:func:`is_random` for a call of ``target`` with ``args``/``kwargs`` (fx nodes or the
    values of a dispatched call: graphopt.verify watches the eager run with it)."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    schema = {a.name: a for a in target._schema.arguments}
    values = dict(zip(schema, args)) | dict(kwargs)
    for flag in ("train", "training"):  # rrelu_with_noise(training=False) draws nothing
        if flag in schema and values.get(flag, schema[flag].default_value) is False:
            return False
    for pname in ("dropout_p", "p"):
        if pname in schema and "dropout" in (target._schema.name + pname):
            value = values.get(pname, schema[pname].default_value)
            return not (type(value) in (int, float) and value == 0)
    return True


@contextlib.contextmanager
def random_ops_kept(graph: fx.Graph) -> Iterator[None]:
    """Within: PyTorch's partitioner CSE (``torch._functorch.compile_utils.fx_graph_cse``,
    run by ``min_cut_rematerialization_partition``) leaves every op of ``graph`` that
    :func:`is_random` calls random unmerged. Its own list (``compile_utils.rand_ops``) names
    a few ops only; two ``randn_like(h)`` (also ``randint_like``, ``uniform``,
    ``exponential``) of the same tensor in a training graph became one draw, the same noise
    twice and the RNG stream shifted, with ``backend="aot_eager"`` as well in torch 2.13 (a
    review). The list is extended by the graph's random ops' overload packets for the
    duration, and by other libraries' custom ops (:func:`is_foreign_op`: their schema does
    not say whether they draw; a review's ``x + rand_like(x)`` op, called twice, gave the
    same noise twice, with aot_eager too)."""
    from torch._functorch import compile_utils

    known = list(compile_utils.rand_ops)
    extra = {n.target.overloadpacket for n in graph.nodes
             if n.op == "call_function" and (is_random(n) or is_foreign_op(n.target))
             } - set(known)
    if not extra:
        yield
        return
    compile_utils.rand_ops = [*known, *extra]
    try:
        yield
    finally:
        compile_utils.rand_ops = known


def alias_classes(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """Node -> a representative of its alias class: nodes that may share storage. An ATen
    op's result joins the argument its schema says it aliases (views such as ``view``,
    ``select``, ``slice``, ``transpose``; in-place and ``out=`` results, which are the
    written argument); a ``getitem`` of an aliasing multi-result op joins that op; and
    nodes whose fake values (``meta['val']``) share a storage join (what the schemas do not
    say: ``split``/``unbind`` lists, ``type_as``/``atleast_2d`` returning their input,
    ``set_``, graph inputs that alias each other).
    Over-approximate (one class per base), which is the safe side for passes that must
    not move a value across a write."""
    parent: dict[fx.Node, fx.Node] = {}

    def find(n: fx.Node) -> fx.Node:
        root = n
        while parent.get(root, root) is not root:
            root = parent[root]
        while n is not root:
            parent[n], n = root, parent[n]
        return root

    def union(x: fx.Node, y: fx.Node) -> None:
        rx, ry = find(x), find(y)
        if rx is not ry:
            parent[rx] = ry

    aliasing: set[fx.Node] = set()
    for node in graph.nodes:
        parent.setdefault(node, node)
        if node.op != "call_function":
            continue
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            if node.args[0] in aliasing:
                union(node, node.args[0])
            continue
        if not isinstance(node.target, torch._ops.OpOverload):
            continue
        schema = node.target._schema
        sets = [r.alias_info.before_set for r in schema.returns if r.alias_info is not None]
        if not sets:
            continue
        aliased = frozenset().union(*sets)
        for i, arg in enumerate(schema.arguments):
            info = arg.alias_info
            if info is None or not (info.before_set & aliased):
                continue
            value = _argument_value(node, i, arg.name)
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, fx.Node):
                    union(node, v)
                    aliasing.add(node)
    # Aliasing the schemas do not annotate: composite ops that return their input itself
    # (type_as, atleast_2d, contiguous, dropout in eval), set_'s source, list results
    # (split, unbind), graph inputs that alias each other. The fake values record it:
    # nodes whose values share a storage share it at run time (Dynamo's graphs: its
    # example values).
    owner: dict[Any, fx.Node] = {}
    for node in graph.nodes:
        for leaf in pytree.tree_leaves(node.meta.get("val", node.meta.get("example_value"))):
            if not isinstance(leaf, torch.Tensor):
                continue
            try:
                key = StorageWeakRef(leaf.untyped_storage())
            except (NotImplementedError, RuntimeError):  # sparse, nested, some subclasses
                continue
            first = owner.setdefault(key, node)
            if first is not node:
                union(node, first)
    return {n: find(n) for n in parent}


def written_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes some op writes to in place, directly as a mutable argument (``add_``'s self,
    ``copy_``'s destination, an ``out=`` tensor). See :func:`mutated_nodes` for the
    alias-aware set."""
    out: set[fx.Node] = set()
    for node in graph.nodes:
        out.update(writes_of(node))
    return out


def writes_of(node: fx.Node) -> list[fx.Node]:
    """The nodes ``node`` writes to in place (its schema's mutable arguments and
    :func:`unannotated_writes`; for a ``tag_activation_checkpoint`` call, the operands its
    body writes: :func:`region_writes`); empty for a functional op."""
    if node.op == "call_function" and \
            node.target is torch.ops.higher_order.tag_activation_checkpoint:
        return region_writes(node)
    if node.op != "call_function" or not is_mutating(node):
        return []
    out = list(unannotated_writes(node))
    schema = node.target._schema  # type: ignore[union-attr]
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = _argument_value(node, i, arg.name)
        out += [v for v in (value if isinstance(value, (list, tuple)) else [value])
                if isinstance(v, fx.Node)]
    return out


def region_writes(call: fx.Node) -> list[fx.Node]:
    """The operands of a ``tag_activation_checkpoint(body, *operands)`` call whose body
    placeholder the body writes in place, directly or through an alias (nested regions
    included: :func:`mutated_nodes` of the body). Dynamo keeps a checkpointed block's
    in-place ops in its body (a buffer's ``add_``, a mask's ``__setitem__``), so a pass
    looking at the parent graph alone would take the operand for unwritten (a review:
    ``remove_noops``, ``cse`` and the attention pass rewrote reads around such writes,
    silently wrong). A body graphopt cannot read counts as writing every tensor operand."""
    operands = [a for a in call.args[1:] if isinstance(a, fx.Node)]
    body_node = call.args[0] if call.args else None
    owner = call.graph.owning_module
    body = getattr(owner, str(body_node.target), None) if isinstance(
        body_node, fx.Node) and body_node.op == "get_attr" and owner is not None else None
    if not isinstance(body, fx.GraphModule):
        return operands
    written = mutated_nodes(body.graph)
    placeholders = list(body.graph.find_nodes(op="placeholder"))
    return [op for ph, op in zip(placeholders, call.args[1:])
            if ph in written and isinstance(op, fx.Node)]


def mutated_nodes(graph: fx.Graph, classes: dict[fx.Node, fx.Node] | None = None
                  ) -> set[fx.Node]:
    """Nodes whose storage some op writes to in place: the written nodes and every node in
    their alias class (:func:`alias_classes`; pass ``classes`` when already computed), so
    ``b = x.clone(); b[0] = 5`` (a write through ``select``) marks ``b``, and a write to
    ``x.view(-1)`` marks ``x``."""
    classes = alias_classes(graph) if classes is None else classes
    dirty = {classes[n] for n in written_nodes(graph)}
    return {n for n, root in classes.items() if root in dirty}


MUTATED_INPUT = "graphopt_mutated_input"
"""Joint-graph placeholder meta: the forward writes this input in place (set by
``graphopt.lowering.base.mutated_input_marker``)."""

MUTATED_INPUT_GUESSED = "graphopt_mutated_input_guessed"
"""Joint-graph placeholder meta set with :data:`MUTATED_INPUT` where the marker could not
tell which input is written and marked every primal (safe for what it only stops from being
recomputed; ``graphopt.lowering.base.save_pre_mutation_values`` does not copy these)."""


def readers_of_mutated_inputs(graph: fx.Graph) -> set[fx.Node]:
    """Tensor-valued nodes that read a graph input the graph writes in place, or a view of
    one: BatchNorm's running statistics, a buffer updated in ``forward``. A functionalized
    joint graph either writes such an input back with ``copy_`` at its end or returns its
    new value for the runtime to copy; the lowering marks the latter's placeholders
    ``meta[MUTATED_INPUT]`` (``graphopt.lowering.base.mutated_input_marker``).
    Recomputing one of these readers in the backward would read the input after the write,
    so it must be saved: eager autograd saves what it computed, and AOTAutograd's
    partitioners do not know this."""
    classes = alias_classes(graph)
    mutated = mutated_nodes(graph, classes)
    dirty = {classes[n] for n in graph.nodes if n.op == "placeholder" and (
        n in mutated or n.meta.get(MUTATED_INPUT))}
    if not dirty:
        return set()
    return {n for n in graph.nodes
            if n.op == "call_function" and not is_mutating(n)
            and isinstance(n.meta.get("val"), torch.Tensor | tuple | list)
            and any(classes.get(a) in dirty for a in n.all_input_nodes)}


def grad_mode_regions(graph: fx.Graph) -> dict[fx.Node, int]:
    """Node -> the index of its grad-mode region: Dynamo writes ``torch.no_grad()`` /
    ``enable_grad()`` blocks as ``torch._C._set_grad_enabled(mode)`` calls, and each call
    starts a new region. Nodes of one region run under one grad mode."""
    region, out = 0, {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            region += 1
        out[node] = region
    return out


def between(sources: Sequence[fx.Node], ends: Sequence[fx.Node]) -> set[fx.Node]:
    """The nodes downstream of one of ``sources`` and upstream of one of ``ends`` (``ends``
    included when reached; ``sources`` not): what a rewrite of the ``sources`` -> ``ends``
    pattern replaces."""
    upstream: set[fx.Node] = set()
    stack = list(ends)
    while stack:
        node = stack.pop()
        if node not in upstream:
            upstream.add(node)
            stack.extend(node.all_input_nodes)
    found: set[fx.Node] = set()
    stack = list(sources)
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in upstream and user not in found:
                found.add(user)
                stack.append(user)
    return found


def grad_mode_reason(nodes: Iterable[fx.Node], at: fx.Node) -> str:
    """"" unless the floating-point values among ``nodes`` (a pattern a pass replaces by one
    op inserted before ``at``) and ``at`` run in more than one grad-mode region
    (:func:`grad_mode_regions`). A ``torch.no_grad()`` block inside the pattern (a block
    loop's state update, truncated backprop through the state) stops gradients the one op
    would carry: a review's loop came out with dK 0.76 and dQ 1.22 off, silently, its
    outputs exact. Integer and boolean values (routing masks) carry no gradient, so their
    grad mode does not matter."""
    regions = grad_mode_regions(at.graph)
    seen = {regions[at]}
    for node in nodes:
        val = node.meta.get("val")
        if node in regions and isinstance(val, torch.Tensor) and \
                (val.is_floating_point() or val.is_complex()):
            seen.add(regions[node])
    if len(seen) <= 1:
        return ""
    return ("part of it runs under another grad mode (a torch.no_grad() / enable_grad() "
            "block inside the pattern): one op in its place would carry gradients that "
            "block stops; left as written")


def module_path(node: fx.Node) -> str:
    """The innermost module path of a node (``model.layers.0.self_attn``), "" if unknown.
    normalize already rewrote Dynamo's paths into the model's own
    (:func:`graphopt.normalize.clean_module_path`)."""
    stack = node.meta.get("nn_module_stack") or {}
    return str(list(stack.values())[-1][0]) if stack else ""


def site_name(node: fx.Node) -> str:
    """Where a node comes from in the user's model: ``module.path:node_name``."""
    path = module_path(node)
    return f"{path}:{node.name}" if path else node.name


def tensor_meta(node: fx.Node) -> torch.Tensor | None:
    """The fake tensor a node produces (``node.meta['val']``), or None for non-tensors."""
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def eliminate_dead_code(graph: fx.Graph) -> bool:
    """``graph.eliminate_dead_code`` that also drops unused inactive dropout (p = 0 or
    ``train=False``): FX keeps every op tagged random; :func:`is_random` knows better."""

    def impure(node: fx.Node) -> bool:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
                and torch.Tag.nondeterministic_seeded in node.target.tags:
            return is_random(node) or node.is_impure(impure_random=False)
        return node.is_impure()

    return graph.eliminate_dead_code(is_impure_node=impure)


_UNANNOTATED_ALIASES = (torch.ops.aten.unsafe_split.Tensor,
                        torch.ops.aten.unsafe_split_with_sizes.default)
"""Ops whose results share their input's storage without saying so in their schema
(``unsafe_chunk`` decomposes to ``unsafe_split``); a re-review found remat pricing their
pieces at their own size, as ``split``'s were."""


def returns_alias(node: fx.Node, include_inplace: bool = False) -> bool:
    """True when every result of the node's ATen op aliases an input (views: ``view``,
    ``transpose``, ``slice``, ...; with ``include_inplace`` also in-place ops, whose result is
    the mutated input; and :data:`_UNANNOTATED_ALIASES`). ``getitem`` and non-ATen targets
    count as not aliasing."""
    target = node.target
    if target in _UNANNOTATED_ALIASES:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    rets = target._schema.returns
    return bool(rets) and all(
        r.alias_info is not None and (include_inplace or not r.alias_info.is_write)
        for r in rets)


def size_hint(size: Any) -> int | None:
    """An int or SymInt size as an int: a symbolic size's value at the compile's example
    inputs (reading it adds no guard, unlike ``int()``, which would specialize a dynamic
    dimension); None for a data-dependent size that has no example value."""
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return None if hint is None else int(hint)
    return int(size)


def unbound_sizes_dropped(mode: Any) -> contextlib.AbstractContextManager[Any]:
    """For a fake run outside any graph (analysis, pricing) under FakeTensorMode ``mode``:
    the fresh unbacked symbols its data-dependent sizes create (the EP op's received rows,
    ``nonzero``) are not left pending in the shape environment, where the next trace
    (AOTAutograd's, Inductor's FakeTensorProp) would refuse them as
    PendingUnbackedSymbolNotFound: no node of its graph binds them."""
    env = getattr(mode, "shape_env", None)
    return env.ignore_fresh_unbacked_symbols() if env is not None else contextlib.nullcontext()


def fake_call(target: Any, *args: Any, **kwargs: Any) -> Any:
    """``meta['val']`` for a new node: ``target`` run on its input nodes' fake values."""
    from torch._guards import detect_fake_mode

    vals = fx.node.map_arg(args, lambda n: n.meta["val"])
    mode = detect_fake_mode([v for v in pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)])
    assert mode is not None
    with mode:
        return target(*vals, **kwargs)


def set_fake_val(node: fx.Node) -> None:
    """``node.meta['val']`` from :func:`fake_call` on the node's own target and arguments,
    with ``meta['unbacked_bindings']`` for the sizes its fake impl creates (a data-dependent
    output, ``new_dynamic_size``): the shape environment keeps such new symbols pending until
    a node binds them, and AOTAutograd's trace refuses pending symbols no node claims
    (PendingUnbackedSymbolNotFound), as make_fx binds them for the nodes it records."""
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.symbolic_shapes import compute_unbacked_bindings

    node.meta["val"] = val = fake_call(node.target, *node.args, **node.kwargs)
    mode = detect_fake_mode([v for v in pytree.tree_leaves(val) if isinstance(v, torch.Tensor)])
    bindings = compute_unbacked_bindings(mode.shape_env, val) \
        if mode is not None and mode.shape_env is not None else None
    if bindings:
        node.meta["unbacked_bindings"] = bindings


_WRITE_VIEWS = {"view", "reshape", "select", "narrow", "transpose", "permute", "expand",
          "unsqueeze", "squeeze", "flatten", "as_strided", "t", "view_as", "unflatten",
          "getitem", "__getitem__", "detach", "data"}
"""Ops a written tensor may be reached through from the input or attribute it aliases (and every
in-place op, which returns its first argument)."""

_AUGMENTED_OPS = {"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul",
              "iand", "ior", "ixor", "ilshift", "irshift"}
"""``operator`` in-place calls (``step_t += 1``: Adam's step count, missed first, so each
verify run counted one more step)."""


def _writes_in_place(name: str) -> bool:
    return name in ("setitem", *_AUGMENTED_OPS) or name.endswith("_") and not name.endswith("__")


def written_roots(gm: fx.GraphModule) -> list[fx.Node]:
    """The ``get_attr`` and ``placeholder`` nodes of a Dynamo-level graph that an op named
    ``*_``, ``setitem``, ``operator.iadd``, ... (or an ``out=`` argument) writes in place,
    directly or through views and other in-place ops."""
    return list(write_counts(gm))


def write_counts(gm: fx.GraphModule, into_subgraphs: bool = False) -> dict[fx.Node, int]:
    """How many in-place writes (see :func:`written_roots`) each written ``get_attr`` or
    ``placeholder`` node of a Dynamo-level graph gets; a tensor's version counter grows by
    one per such write. Keys in graph order of their first write.

    ``into_subgraphs``: also count the writes a higher-order op's body graphs (a checkpoint
    region, ``wrap``) make to the operands passed after the last body."""
    counts: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        for root in roots_written_by(node):
            counts[root] = counts.get(root, 0) + 1
        if into_subgraphs and isinstance(node.target, torch._ops.HigherOrderOperator):
            for root, n in _body_writes(gm, node).items():
                counts[root] = counts.get(root, 0) + n
    return counts


def _body_writes(gm: fx.GraphModule, node: fx.Node) -> dict[fx.Node, int]:
    """Writes a higher-order op's body graphs make to its operands, by the outer graph's
    written roots; Dynamo passes a body's inputs after its last ``get_attr`` body, in order
    (``tag_activation_checkpoint(body, x, n)``, ``wrap(body, x)``)."""
    bodies = [attr_value(gm, a.target, None) for a in node.args
              if isinstance(a, fx.Node) and a.op == "get_attr"]
    last = max((i for i, a in enumerate(node.args) if isinstance(a, fx.Node)
                and a.op == "get_attr"), default=-1)
    operands = [x for a in node.args[last + 1:]
                for x in (a if isinstance(a, (list, tuple)) else [a])]
    found: dict[fx.Node, int] = {}
    for body in bodies:
        if not isinstance(body, fx.GraphModule):
            continue
        inputs = {n: i for i, n in enumerate(body.graph.find_nodes(op="placeholder"))}
        for inner, n in write_counts(body, into_subgraphs=True).items():
            if inputs.get(inner, len(operands)) < len(operands):
                for root in _roots_of(operands[inputs[inner]]):
                    found[root] = found.get(root, 0) + n
    return found


_MISSING: Any = object()


def attr_value(root: Any, target: Any, default: Any = _MISSING) -> Any:
    """The object a ``get_attr`` target (dotted, e.g. ``"layers.0.weight"``) names on
    ``root`` (a GraphModule); ``default`` where a part is missing (AttributeError without
    one)."""
    value: Any = root
    for part in str(target).split("."):
        value = getattr(value, part) if default is _MISSING else getattr(value, part, default)
    return value


def roots_written_by(node: fx.Node) -> list[fx.Node]:
    """The ``get_attr``/``placeholder`` nodes one call node writes in place (an op named
    ``*_``, ``setitem``, ``operator.iadd``, ..., or an ``out=`` argument), reached through
    views and earlier in-place ops; empty for a node that writes nothing."""
    if node.op not in ("call_function", "call_method"):
        return []
    found: dict[fx.Node, None] = {}
    if _writes_in_place(_op_name(node.target)) and node.args:
        found.update(dict.fromkeys(_roots_of(node.args[0])))
    if node.kwargs.get("out") is not None:
        found.update(dict.fromkeys(_roots_of(node.kwargs["out"])))
    return list(found)


def _roots_of(value: Any) -> list[fx.Node]:
    """The ``get_attr``/``placeholder`` nodes ``value`` (a node, or a list of them) is or
    views, through views and in-place ops."""
    found: dict[fx.Node, None] = {}
    stack = list(value) if isinstance(value, (list, tuple)) else [value]
    while stack:
        x = stack.pop()
        if not isinstance(x, fx.Node):
            continue
        if x.op in ("get_attr", "placeholder"):
            found[x] = None
        elif x.op in ("call_function", "call_method") and x.args:
            kind = _op_name(x.target)
            if kind in _WRITE_VIEWS or _writes_in_place(kind):
                head = x.args[0]
                stack += list(head) if isinstance(head, (list, tuple)) else [head]
    return list(found)


def _op_name(target: Any) -> str:
    """A call's name: a method's, a function's, an ATen overload's packet ("add_")."""
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return str(target.overloadpacket.__name__)
    return str(getattr(target, "__name__", ""))
