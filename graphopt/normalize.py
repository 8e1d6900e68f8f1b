"""Normalize a Dynamo graph (Torch IR) into the pre-autograd ATen graph that model passes see.

Contract: the result computes the same function with the same placeholders (renamed to
Dynamo's names) and outputs; every node carries ``meta['val']`` (a FakeTensor, SymInt or
constant) with symbolic shapes when the compile is dynamic; ``nn_module_stack`` and
``stack_trace`` are carried over from Dynamo's nodes so reports can name model code.
Autograd is not yet applied (``make_fx(pre_dispatch=True)``), so AOTAutograd derives the
backward of whatever model passes insert, custom ops included.

The fake inputs are made exactly as AOTAutograd makes them (``fake_mode.from_tensor`` on the
real example inputs, with Dynamo's symbolic context), so symbols and the ``item_memo`` of
0-d tensors that Dynamo made dynamic (float attributes like RMSNorm's eps under
``dynamic=True``) stay the same ones Dynamo guarded on.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch import fx
from torch._guards import TracingContext, detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx


def fake_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[FakeTensorMode, list]:
    """Fake versions of ``example_inputs`` in Dynamo's fake mode (a fresh mode if none).

    An input the graph writes in place (``fx_utils.written_roots``) that does not require
    grad gets a detached alias (same storage, sizes, strides and symbols) of the fake
    Dynamo's mode memoizes for it, so running the graph on it does not change that fake:
    AOTAutograd traces the same memoized fakes afterwards, and an in-place ``b.copy_(h)``
    of a value carrying a gradient left ``b``'s fake with a CopyBackwards grad_fn
    (AOTAutograd then failed, "modified by an inplace operation", where aot_eager
    compiled; the capture checks saw a gradient path that never existed; a review);
    ``t_()`` left it transposed. Every other input keeps the memoized fake (aliases of all
    of them made a compiled optimizer step's trace fail)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    context = TracingContext.try_get()
    fakes: list[Any] = []
    for i, x in enumerate(example_inputs):
        ph_val = placeholders[i].meta.get("example_value") if i < len(placeholders) else None
        if isinstance(x, FakeTensor):
            fakes.append(x)
        elif isinstance(x, torch.Tensor):
            sym = context.tensor_to_context.get(x) if context is not None else None
            fakes.append(fake_mode.from_tensor(
                x, symbolic_context=sym, source=sym.tensor_source if sym else None, trace=False
            ))
        elif isinstance(ph_val, torch.SymInt | torch.SymFloat | torch.SymBool):
            fakes.append(ph_val)
        else:
            fakes.append(x)
    from graphopt.passes.fx_utils import written_roots

    roots = set(written_roots(gm))
    written = {i for i, p in enumerate(placeholders) if p in roots}
    with fake_mode:
        return fake_mode, [f.detach() if i in written and isinstance(f, FakeTensor) and
                           not f.requires_grad else f for i, f in enumerate(fakes)]


def normalize(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
    """Trace ``gm`` to a pre-dispatch ATen graph with metadata on every node.

    Args:
        gm: the graph Dynamo gives the backend (parameters lifted to placeholders).
        example_inputs: Dynamo's example inputs (real tensors, ints for dynamic sizes).

    Returns:
        A new GraphModule; ``gm`` is untouched.
    """
    fake_mode, fakes = fake_inputs(gm, example_inputs)
    ours_only = _default_checkpoint_context(gm)

    def run(*args: Any) -> Any:
        return _FakeAttrs(gm, fake_mode).run(*args)

    # its "context_fn is passed" warning would be about graphopt's default
    quiet = quiet_logger("torch._higher_order_ops.wrap", logging.ERROR) if ours_only \
        else contextlib.nullcontext()
    # grad mode too: the trace runs the graph's own torch._C._set_grad_enabled calls, and a
    # forward that leaves grad mode switched (``torch.set_grad_enabled(False)`` at its end)
    # left the rest of the compile under that mode (a review: outputs without
    # requires_grad, gradients None or added where eager and aot_eager are right)
    with quiet, fx_traceback.preserve_node_meta(), fake_mode, _autocast_restored(), \
            torch.set_grad_enabled(torch.is_grad_enabled()):
        traced = make_fx(run, tracing_mode="real", pre_dispatch=True,
                         _allow_non_fake_inputs=True)(*fakes)
    _rename_placeholders(traced, gm)
    _drop_unused_dtype_ops(traced)
    _fill_missing_meta(traced)
    _clean_module_paths(traced)
    _run_meta(traced, fake_mode, fake_inputs(gm, example_inputs)[1])  # unwritten by the trace
    traced.recompile()
    return traced


@contextlib.contextmanager
def quiet_logger(name: str, level: int) -> Iterator[None]:
    """The logger ``name`` at ``level`` for the block, then at its own level again."""
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


_ENTER_AUTOCAST = torch.amp.autocast_mode._enter_autocast
_EXIT_AUTOCAST = torch.amp.autocast_mode._exit_autocast


def refresh_meta(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Recompute ``meta['requires_grad']`` (and autocast dtypes) of ``gm``, e.g. after model
    passes rewrote it, by one fake run (see :class:`_RuntimeMeta`)."""
    fake_mode, fakes = fake_inputs(gm, example_inputs)
    _run_meta(gm, fake_mode, fakes)


def _run_meta(gm: fx.GraphModule, fake_mode: FakeTensorMode, fakes: list) -> None:
    from graphopt.passes.fx_utils import unbound_sizes_dropped

    # Data-dependent sizes get fresh unbacked symbols in this run; they are not the graph's.
    fresh = unbound_sizes_dropped(fake_mode)
    # A checkpoint body runs in the HOP's own interpreter: a constant a pass registered on it
    # (e.g. frozen Lightning slopes) reaches ops as a real tensor, which fake mode then
    # converts instead of refusing. The top graph's constants are converted in get_attr.
    allow = fake_mode.allow_non_fake_inputs
    fake_mode.allow_non_fake_inputs = True
    try:
        with fake_mode, fresh, torch.set_grad_enabled(torch.is_grad_enabled()), \
                _autocast_restored():
            _RuntimeMeta(gm, fake_mode).run(*fakes)
    finally:
        fake_mode.allow_non_fake_inputs = allow


def _enter_applied(*args: Any, **kwargs: Any) -> Any:
    """Dynamo's ``_enter_autocast`` as ``torch.autocast`` enters under a trace.

    Dynamo records ``with torch.autocast(...)`` in the compiled code as
    ``_enter_autocast``/``_exit_autocast`` calls; under a pre-dispatch trace those only
    record themselves (torch.export's own trace enters the region's Python API first), so
    the region's ops were traced with float32 fake values. Conversions then traced as at
    that dtype: ``y = h.float(); y.mul_(0.5)`` on a bf16 ``h`` became an in-place write to
    ``h`` itself, and every later read of ``h`` read the scaled copy (a review: output 0.51
    and gradients 0.37 off, silently; aot_eager exact). Entered this way, autocast's
    thread-local state is set for the ops inside (the fakes get their run-time dtypes, a
    real conversion records a copy) and the pre-dispatch mode records the same enter/exit
    calls as before, so the graph still turns autocast on when it runs. Outside a trace it
    does what ``_enter_autocast`` does."""
    region = torch.amp.autocast_mode._UnmanagedAutocast(*args, **kwargs)
    region.__enter__()
    _OPEN_REGIONS.append(region)
    return region


def _exit_applied(region: Any) -> None:
    """Dynamo's ``_exit_autocast`` for a region :func:`_enter_applied` entered."""
    if isinstance(region, torch.autocast):
        region.__exit__(None, None, None)
        if region in _OPEN_REGIONS:
            _OPEN_REGIONS.remove(region)
    else:
        _EXIT_AUTOCAST(region)


_OPEN_REGIONS: list[torch.autocast] = []
"""Regions :func:`_enter_applied` entered and no exit closed yet."""


@contextlib.contextmanager
def _autocast_restored() -> Iterator[None]:
    """Close the regions a failed trace or run left open, so autocast's thread-local state
    is the caller's again (a trace that raised inside a region left it changed, and the
    fallback then ran the model under it: gradients 0.5 off, a review)."""
    depth = len(_OPEN_REGIONS)
    try:
        yield
    finally:
        while len(_OPEN_REGIONS) > depth:
            _OPEN_REGIONS.pop().__exit__(None, None, None)


def _with_applied_autocast(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` (a higher-order op's body, e.g. a ``torch.utils.checkpoint`` region) with its
    autocast calls, and those of the bodies inside it, replaced by :func:`_enter_applied` /
    :func:`_exit_applied`: such a body is traced by the op's own tracer, not by the
    interpreter (a review: a region inside a checkpoint body kept the aliasing bug, output
    0.69 and gradients 5.5 off). A copy sharing ``gm``'s attributes; ``gm`` itself when it
    has no region."""
    changed: dict[str, fx.GraphModule] = {}
    for n in gm.graph.nodes:
        body = getattr(gm, str(n.target), None) if n.op == "get_attr" else None
        if isinstance(body, fx.GraphModule):
            applied = _with_applied_autocast(body)
            if applied is not body:
                changed[str(n.target)] = applied
    if not changed and not any(n.op == "call_function" and n.target in (
            _ENTER_AUTOCAST, _EXIT_AUTOCAST) for n in gm.graph.nodes):
        return gm
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for n in graph.nodes:
        if n.op == "call_function" and n.target is _ENTER_AUTOCAST:
            n.target = _enter_applied
        elif n.op == "call_function" and n.target is _EXIT_AUTOCAST:
            n.target = _exit_applied
    out = fx.GraphModule(gm, graph)
    out.meta.update(gm.meta)  # e.g. the checkpoint context function torch's rule reads
    for name, applied in changed.items():
        setattr(out, name, applied)
    return out


class _FakeAttrs(fx.Interpreter):
    """Dynamo's graph, run with its real ``get_attr`` tensors replaced by fake copies, so the
    trace never touches real state. A compiled ``optimizer.step`` reads parameters and
    optimizer state through ``get_attr`` and writes them in place: tracing with the real
    tensors ran ``step += 1`` and ``buf.mul_(momentum)`` for real, and the fallback then ran
    the step again on the changed state (a review: Adam's step count 6 after 5 steps, SGD
    momentum off by 0.52). The fake copies end up as tensor constants of the trace, which
    the capture guard (``capture.new_constants``) sends to AOTAutograd as captured."""

    def __init__(self, gm: fx.GraphModule, fake_mode: FakeTensorMode) -> None:
        super().__init__(gm)
        self.fake_mode = fake_mode

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        # autocast regions are traced with autocast on (see _enter_applied), also those in
        # the bodies of higher-order ops (checkpoint regions), which their own tracer runs
        if target is _ENTER_AUTOCAST:
            return _enter_applied(*args, **kwargs)
        if target is _EXIT_AUTOCAST:
            return _exit_applied(*args)
        if isinstance(target, torch._ops.HigherOrderOperator):  # bodies at any position
            args = tuple(_with_applied_autocast(a) if isinstance(a, fx.GraphModule) else a
                         for a in args)
            from graphopt.passes.fx_utils import unbound_sizes_dropped

            # torch's pre-dispatch rule for a checkpoint region runs the body once untraced
            # before tracing it: a data-dependent size of that run (the EP op's received
            # rows) no node binds, and the body's trace refused it as pending. AOTAutograd
            # traces the body again and binds its own.
            with unbound_sizes_dropped(self.fake_mode):
                return super().call_function(target, args, kwargs)
        return super().call_function(target, args, kwargs)

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        value = super().get_attr(target, args, kwargs)
        if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
            return self.fake_mode.from_tensor(value)
        return value


class _RuntimeMeta(_FakeAttrs):
    """Run the traced graph once more on the fake inputs, as AOTAutograd will run it.

    Records ``meta['requires_grad']`` on every tensor-valued node (make_fx's ``meta['val']``
    is a detached snapshot, so whether autograd reaches a value is otherwise not in the
    graph; the capture guard compares the outputs' with Dynamo's), as of the end of the run,
    like Dynamo's ``example_value`` (a buffer written in place with a value that requires
    grad, ``out = zeros_like(x); out[:, i] = x[:, i] * w``, requires grad from then on; its
    creation-time False made the guard fall back on such graphs). An autocast region's
    enter/exit calls execute here, each value inside gets its run-time dtype in
    ``meta['val']`` (also after a pass rewrote the region, and in checkpoint bodies) and
    ``meta['autocast'] = (device_type, dtype)``, and passes that reason about dtypes skip
    those nodes (the dtypes of the ops they would insert are autocast's choice).
    """

    def __init__(self, gm: fx.GraphModule, fake_mode: FakeTensorMode) -> None:
        super().__init__(gm, fake_mode)  # get_attr: buffers/constants a pass added, as fakes
        self.regions: list[tuple[str, Any]] = []
        self.values: list[tuple[fx.Node, list[torch.Tensor]]] = []

    def run(self, *args: Any, **kwargs: Any) -> Any:
        out = super().run(*args, **kwargs)
        for n, tensors in self.values:  # after in-place writes (class docstring)
            n.meta["requires_grad"] = any(t.requires_grad for t in tensors)
        return out

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target is torch.ops.higher_order.tag_activation_checkpoint and args and \
                isinstance(args[0], fx.GraphModule):
            # the HOP runs its body in its own interpreter: run it here first, inside the
            # enclosing autocast regions, so the body's nodes get their run-time dtypes and
            # meta['autocast'] too (a review: remove_noops dropped a needed .float() in a
            # checkpointed block under autocast, output error 0.98)
            body = _RuntimeMeta(args[0], self.fake_mode)
            body.regions = list(self.regions)
            body.run(*args[1:])
        return super().call_function(target, args, kwargs)

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n.op == "call_function" and n.target is _ENTER_AUTOCAST:
            self.regions.append((str(n.args[0]), n.args[1] if len(n.args) > 1 else None))
        elif n.op == "call_function" and n.target is _EXIT_AUTOCAST:
            if self.regions:
                self.regions.pop()
        elif self.regions and n.op != "output":
            n.meta["autocast"] = self.regions[-1]
            if isinstance(result, torch.Tensor):
                n.meta["val"] = result.detach()
        tensors = [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
        if tensors:
            self.values.append((n, tensors))
        return result


def _default_checkpoint_context(gm: fx.GraphModule) -> bool:
    """Give each ``torch.utils.checkpoint`` region body the context function of plain
    activation checkpointing (always recompute) unless it has one: PyTorch's pre-dispatch
    rule for ``tag_activation_checkpoint`` reads ``meta["_checkpoint_context_fn"]`` without a
    default (torch 2.13), so re-tracing a graph with a checkpoint region failed. True when
    every checkpoint body got graphopt's default (the user passed no ``context_fn``)."""
    import functools

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    try:
        from torch._higher_order_ops.wrap import _always_prefer_recompute  # noqa: F401
    except ImportError:  # torch < 2.13 reads no such meta key: nothing to add
        return False
    target = torch.ops.higher_order.tag_activation_checkpoint

    def bodies_of(g: fx.GraphModule) -> list[fx.GraphModule]:  # nested regions too
        found = [getattr(g, str(n.args[0].target), None) for n in
                 g.graph.find_nodes(op="call_function", target=target)
                 if isinstance(n.args[0], fx.Node) and n.args[0].op == "get_attr"]
        return [x for b in found if isinstance(b, fx.GraphModule) for x in (b, *bodies_of(b))]

    bodies = bodies_of(gm)
    users = sum("_checkpoint_context_fn" in b.meta for b in bodies)
    for body in bodies:
        body.meta.setdefault("_checkpoint_context_fn", functools.partial(
            create_selective_checkpoint_contexts, _recompute_all_but_stateful_ops))
    return bool(bodies) and users == 0


def _recompute_all_but_stateful_ops(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Plain activation checkpointing's policy (recompute everything, as torch's
    ``_always_prefer_recompute``), except ops that exchange data between ranks
    (``fx_utils.communicates``: graphopt's expert-parallel MoE op with ep > 1 (on one device
    it is recomputed like any op), its token scatter/gather, functional collectives): they
    are saved, not run again in the backward (a recomputation would repeat the EP op's
    dispatch and combine all-to-alls and the expert GEMMs there)."""
    from torch.utils.checkpoint import CheckpointPolicy

    from graphopt.passes.fx_utils import communicates

    if communicates(op, args):  # the EP op with ep > 1 (one device: recomputed)
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_DYNAMO_SOURCE = re.compile(r"^(?:[LG]\[[^\]]*\](?:\[[^\]]*\])*|L__self___|L__self__)\.?")


def clean_module_path(path: str) -> str:
    """A module path as the user writes it: Dynamo's source prefix of the compiled object
    (``L['self']``, ``L['args'][0]``, ``G['model']``, ``L['model']``) dropped and indexing
    written with dots: ``G['m'].model.layers.0.mlp`` -> ``model.layers.0.mlp``; the compiled
    module itself is ""."""
    path = _DYNAMO_SOURCE.sub("", str(path), count=1).replace("_modules[", "[")
    return path.replace("['", ".").replace("']", "").replace("[", ".").replace("]", "") \
        .lstrip(".")


def _clean_module_paths(gm: fx.GraphModule) -> None:
    """Rewrite every node's ``nn_module_stack`` paths with :func:`clean_module_path`, so
    reports and module-path options (``lightning.layers``) use the model's own paths
    whichever way the model was handed to torch.compile; checkpoint bodies too."""
    from graphopt.passes.regions import all_graph_modules

    for node in (n for g in all_graph_modules(gm) for n in g.graph.nodes):
        stack = node.meta.get("nn_module_stack")
        if stack:
            node.meta["nn_module_stack"] = {
                key: (clean_module_path(value[0]), *value[1:]) for key, value in stack.items()}


def _rename_placeholders(traced: fx.GraphModule, original: fx.GraphModule) -> None:
    new = list(traced.graph.find_nodes(op="placeholder"))
    old = list(original.graph.find_nodes(op="placeholder"))
    for n, o in zip(new, old):
        n._rename(o.name)
        n.target = n.name
        for key in ("nn_module_stack", "stack_trace", "grapharg", "tensor_dict"):
            if key in o.meta and key not in n.meta:
                n.meta[key] = o.meta[key]


def _drop_unused_dtype_ops(gm: fx.GraphModule) -> None:
    """Erase unused calls of ATen ops that only compute a dtype (``aten.promote_types``:
    ``torch.tensor([x.shape[0], 1])`` with a symbolic size traces through ``torch._refs
    .tensor``, which records three of them). They carry no ``meta['val']``, and the pass
    runner's metadata check then failed the compile where aot_eager ran (a review)."""
    for node in list(gm.graph.nodes):
        target = node.target
        if node.op == "call_function" and not node.users and \
                isinstance(target, torch._ops.OpOverload) and not target._schema.is_mutable \
                and target._schema.returns and all(  # (ScalarType's type reads "int")
                    r.real_type.kind() == "ScalarTypeType" for r in target._schema.returns):
            gm.graph.erase_node(node)


def _fill_missing_meta(gm: fx.GraphModule) -> None:
    """``get_attr`` constants get a ``val`` too, so every node has one."""
    for node in gm.graph.nodes:
        if node.op == "get_attr" and "val" not in node.meta:
            value = getattr(gm, str(node.target), None)
            if isinstance(value, torch.Tensor):
                node.meta["val"] = value


def check_meta(gm: fx.GraphModule) -> list[str]:
    """Names of nodes (other than output, and get_attr of submodules such as a checkpoint
    region's body) that lack ``meta['val']``."""
    return [n.name for n in gm.graph.nodes if n.op != "output" and "val" not in n.meta
            and not (n.op == "get_attr" and isinstance(getattr(gm, str(n.target), None),
                                                       torch.nn.Module))
            and not (isinstance(n.target, torch._ops.OpOverload)
                     and not n.target._schema.returns)]  # e.g. _assert_async: no value
