"""``options={"verify": True}``: compare the compiled graph with eager on the sample inputs.

Outputs, and when training the gradients of every input that requires grad (parameters
included) for a fixed random cotangent, are compared with per-dtype tolerances. The inputs are
cloned, so the user's parameters, their ``.grad`` and buffers are untouched. A mismatch is
localized: each snapshot taken after a pre-autograd pass is run eagerly and the first one
that differs names the pass; when all match, the compile is redone with joint passes
switched off one prefix at a time, and if even none of them fixes it the lowering is named,
unless ``torch.compile(backend="aot_eager")`` of the same graph (Dynamo's, or the last
approximate pass's output) differs from its eager run at least half as much in every
output and gradient beyond the tolerance: then the graph's own rounding in its dtype is the
cause, and the report says so without raising. Joint passes are searched with the same
criterion, and the message names the output or gradient that compiling alone does not
explain.
A mismatch caused by an exact pass raises :class:`VerificationError`; one after an
approximate pass is recorded in the report (approximation is its contract: ``verify
["approximate"]`` entries give the pass, its first ``deviation`` beyond tolerance and the
``largest`` one) and later passes are checked against that pass's output.
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from graphopt.config import GraphoptConfig
from graphopt.errors import VerificationError
from graphopt.passes.fx_utils import (
    attr_value,
    communicates,
    is_mutating,
    is_random,
    is_random_call,
    unannotated_writes,
    written_roots,
)
from graphopt.passes.regions import checkpoint_bodies
from graphopt.report import CompileReport

_TOLERANCE = {  # (rtol, atol) with atol relative to the reference's RMS magnitude (_scale)
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-4, 1e-5),
    torch.bfloat16: (2e-2, 1e-2),
    torch.float16: (2e-3, 1e-3),
}

Outcome = tuple[list[Any], list[Any]]


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) used when verify's rtol/atol are not set: a complex dtype takes its
    parts' (complex64 was (0, 0), so any rounding of a complex output failed, a review);
    another floating dtype (float8) 2.5 and 1.25 times its eps, as bf16's."""
    if dtype.is_complex:
        dtype = {torch.complex128: torch.float64, torch.complex32: torch.float16}.get(
            dtype, torch.float32)
    if dtype in _TOLERANCE:
        return _TOLERANCE[dtype]
    if dtype.is_floating_point:
        eps = torch.finfo(dtype).eps
        return 2.5 * eps, 1.25 * eps
    return 0.0, 0.0


def clone_inputs(inputs: Sequence[Any]) -> list[Any]:
    """Detached copies that require grad where the originals do; symbolic sizes -> hints.
    Inputs that share a storage (``f(base, base[1])``) get views of one copied storage with
    their offsets: Dynamo compiled the graph for that aliasing, and separate copies broke
    it (a review: "setStorage: ... out of bounds" or a false VerificationError)."""
    shared = _shared_storages(inputs)
    out: list[Any] = []
    for x in inputs:
        if isinstance(x, torch.SymInt | torch.SymFloat | torch.SymBool):
            out.append(x.node.hint)
        elif isinstance(x, torch.Tensor):
            # Same sizes and strides (a sliced input stays non-contiguous): compiled graphs
            # assert the strides they were compiled for.
            copied = shared.get(_storage_key(x))
            if copied is not None:
                y = copied.as_strided(x.shape, x.stride(), x.storage_offset())
            else:
                y = _strided_copy(x.detach())
            out.append(y.requires_grad_(x.requires_grad) if y.is_leaf else y)
        else:
            out.append(x)
    return out


def _storage_key(x: torch.Tensor) -> tuple[Any, ...]:
    try:
        return (x.device, x.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # tensor subclasses, no storage
        return (x.device, id(x))


def _shared_storages(inputs: Sequence[Any]) -> dict[tuple[Any, ...], torch.Tensor]:
    """storage key -> a copy of the whole storage (flat, the inputs' dtype) for storages
    that two or more tensor inputs of one dtype view."""
    groups: dict[tuple[Any, ...], list[torch.Tensor]] = {}
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.numel() > 0:
            groups.setdefault(_storage_key(x), []).append(x)
    copies = {}
    for key, members in groups.items():
        first = members[0]
        if len(members) < 2 or any(m.dtype != first.dtype for m in members):
            continue
        try:
            length = first.untyped_storage().nbytes() // first.element_size()
        except (RuntimeError, NotImplementedError):
            continue
        copies[key] = torch.as_strided(first.detach(), (length,), (1,), 0).clone()
    return copies


def _strided_copy(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A copy (in ``dtype``, default ``x``'s) with ``x``'s sizes and strides, gaps (a slice)
    and overlaps (an expand, stride 0) included: the storage span ``x`` covers is copied,
    then viewed the same way."""
    dtype = dtype or x.dtype
    if x.numel() == 0 or x.is_contiguous():
        return x.to(dtype, copy=True, memory_format=torch.contiguous_format)
    span = 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride()))
    flat = torch.as_strided(x, (span,), (1,), x.storage_offset()).to(dtype, copy=True)
    return flat.as_strided(x.shape, x.stride())


def run_with_grads(fn: Callable[..., Any], inputs: Sequence[Any], grads: bool,
                   seed: int = 0) -> Outcome:
    """See :func:`_run_with_grads`."""
    return _run_with_grads(fn, inputs, grads, seed)


def _run_with_grads(fn: Callable[..., Any], inputs: Sequence[Any], grads: bool,
                    seed: int = 0,
                    cotangent_dtypes: Sequence[torch.dtype | None] | None = None) -> Outcome:
    """Outputs of ``fn(*clones)``, then the clones' values after the call (so an in-place
    update of a buffer or input, e.g. BatchNorm's running statistics or an EMA, is compared
    too: a review's "exact" pass that changed an EMA update passed verify), and, if
    ``grads``, d(outputs . v)/d(inputs) for seeded v.

    Each run starts from the same RNG state (forked: the caller's is left as it was), so
    another library's custom op that draws random numbers (:func:`is_foreign_op`; graphs
    with ATen random ops are not compared) draws the same in the eager and the compiled run
    unless a pass moved it (a review: such an op made verify blame ``normalize``).
    ``cotangent_dtypes`` (per output): draw v in these dtypes, then cast (the float64 run
    uses the reference's cotangents)."""
    types = {a.device.type for a in inputs if isinstance(a, torch.Tensor)} - {"cpu", "meta"}
    kind = next(iter(sorted(types)), "cuda")
    module = getattr(torch, kind, None)
    count = module.device_count() if types and module is not None and \
        hasattr(module, "device_count") else 0
    with torch.random.fork_rng(devices=list(range(count)), device_type=kind):
        torch.random.default_generator.manual_seed(seed)
        if count:
            module.manual_seed_all(seed)  # type: ignore[union-attr]
        return _run_seeded(fn, inputs, grads, seed, cotangent_dtypes)


def warn_skipped(report: CompileReport, stacklevel: int = 2) -> None:
    """Warn (UserWarning) that ``report``'s graph was verified against nothing (its
    ``report.verify`` status is "skipped" and its detail says why): as loud as a failure
    would be. ``stacklevel`` counts from the caller, as ``warnings.warn``'s does."""
    detail = report.verify["detail"]
    warnings.warn(f"graphopt: verify=True compared nothing for graph {report.graph_id}: "
                  f"{detail}" + (". Verify such a model in eval mode (dropout off)"
                                 if "random numbers" in detail else ""),
                  stacklevel=stacklevel + 1)


_PLACEHOLDERS = threading.local()


@contextlib.contextmanager
def placeholder_inputs() -> Iterator[None]:
    """Compiled graphs called inside run on placeholder values, not data: verify waits for
    their next call. torch.distributed.pipelining's metadata inference feeds a later stage
    ``torch.empty`` tensors (``TensorMeta.to_tensor``), and verify compared eager and
    compiled on that uninitialized memory (NaN on one rank, "passed" on another: a review)."""
    depth = getattr(_PLACEHOLDERS, "depth", 0)
    _PLACEHOLDERS.depth = depth + 1
    try:
        yield
    finally:
        _PLACEHOLDERS.depth = depth


def on_placeholders() -> bool:
    """Whether this thread is inside :func:`placeholder_inputs`."""
    return getattr(_PLACEHOLDERS, "depth", 0) > 0


_WRITTEN: list[tuple[torch.Tensor, torch.Tensor]] = []
"""(module attribute the verified graph writes in place, its value before verify): set by
:func:`verify_compile` (:func:`written_attributes`) for the runs' duration. Each run's
values after the call are compared, then the attribute is put back."""

def written_attributes(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    """The module attributes (``get_attr``: a compiled ``optimizer.step``'s parameters and
    states, a compiled function's tensor attributes) that ``gm`` writes in place (an op
    named ``*_``, ``torch._foreach_*_``, ``setitem``, ``operator.iadd``, ...), through views
    and other in-place ops. Verify's runs wrote
    them for real: a compiled SGD step under verify applied its update three times on the
    first call, and the report said "passed" (a review), since these are no inputs and
    were neither copied nor compared."""
    found: dict[int, torch.Tensor] = {}
    for x in written_roots(gm):
        if x.op == "get_attr":
            value = attr_value(gm, x.target, None)
            if isinstance(value, torch.Tensor):
                found[id(value)] = value
    return list(found.values())


def _run_seeded(fn: Callable[..., Any], inputs: Sequence[Any], grads: bool,
                seed: int, cotangent_dtypes: Sequence[torch.dtype | None] | None = None
                ) -> Outcome:
    args = clone_inputs(inputs)
    try:
        out = fn(*args)
        written = [_detach(t).clone() for t, _ in _WRITTEN]
    finally:
        # always: under a dispatch mode (the reference's random-op watch) torch._foreach_*_
        # writes do not bump _version, and a restore keyed on it left a foreach SGD step's
        # update in place (a re-review: a false VerificationError on the second call)
        with torch.no_grad():
            for t, before in _WRITTEN:
                t.copy_(before)
    flat = [o for o in pytree.tree_leaves(out)]
    _LAYOUT.outputs = len(flat)
    states = [_detach(a) for a in args if isinstance(a, torch.Tensor)]  # private clones
    values = [_detach(o) for o in flat] + states + written
    if not grads:
        return values, []
    dtypes = list(cotangent_dtypes or [None] * len(flat))
    diff = [(o, d) for o, d in zip(flat, dtypes)
            if isinstance(o, torch.Tensor) and o.requires_grad]
    diff_out = [o for o, _ in diff]
    wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    if not diff_out or not wrt:
        return values, []
    gen = torch.Generator().manual_seed(seed)
    cot = [torch.randn(o.shape, generator=gen, dtype=d or o.dtype).to(o.device, o.dtype)
           for o, d in diff]
    try:
        # Keep the graph: verify's backward is the compiled function's first, which
        # compiles AOTAutograd's lazy backward graph; without retain_graph it donates the
        # saved buffers and then refuses the user's backward(retain_graph=True) (a review).
        g = torch.autograd.grad(diff_out, wrt, cot, allow_unused=True, retain_graph=True)
    except RuntimeError as exc:
        if "donated buffers" not in str(exc):
            raise
        # compiled eagerly with donated buffers (dynamic shapes): torch refuses a kept graph
        # there, for the user too; the refusal happens before the backward runs
        g = torch.autograd.grad(diff_out, wrt, cot, allow_unused=True)
    return values, [None if t is None else _detach(t) for t in g]


def _detach(x: Any) -> Any:
    """``x`` detached; a DTensor (a TP/SP or FSDP plan's parameters, their gradients and the
    layer's outputs) as this rank's local shard: both runs place it alike, and comparing
    shards needs no collective (a review: verify with a TP plan crashed in ``max_error``,
    DTensor has no sharding rule for boolean indexing)."""
    if not isinstance(x, torch.Tensor):
        return x
    x = x.detach()
    to_local = getattr(x, "to_local", None)
    return to_local() if callable(to_local) else x


def least_precise_dtype(gm: torch.fx.GraphModule) -> torch.dtype | None:
    """The floating dtype with the fewest mantissa bits that the graph computes in.

    A float64 model whose RMSNorm upcasts "to float32" (Llama) is only float32-accurate, so
    tolerances follow the least precise dtype computed, not the output dtype.
    """
    worst: torch.dtype | None = None
    for node in _all_nodes(gm):  # Dynamo's graph (fallback) has example_value, not val
        for val in pytree.tree_leaves(node.meta.get("val", node.meta.get("example_value"))):
            if isinstance(val, torch.Tensor) and val.dtype.is_floating_point and (
                    worst is None or torch.finfo(val.dtype).eps > torch.finfo(worst).eps):
                worst = val.dtype
    return worst


def compute_dtypes(gm: torch.fx.GraphModule, inputs: Sequence[Any]
                   ) -> tuple[list[torch.dtype | None], list[torch.dtype | None]]:
    """The least precise floating dtype each compared tensor is computed through, in
    :func:`_run_with_grads`' order: (each output, then each tensor input's value after the
    call; each gradient). An output: the nodes it is computed from; an input's value: the
    ops writing it in place and what they read (its own dtype when nothing writes it); a
    gradient: the nodes on a path from the input to an output and what they read. A
    higher-order op's body counts whole. None: not known (the graph-wide dtype applies).
    One graph-wide dtype before: a float64 output 1% off passed at bf16's tolerance because
    an unrelated output was computed in bf16 (a review)."""
    graph = gm.graph
    eps: dict[torch.dtype | None, float] = {None: 0.0}

    def less_precise(a: torch.dtype | None, b: torch.dtype | None) -> torch.dtype | None:
        for d in (a, b):
            if d is not None and d not in eps:
                eps[d] = torch.finfo(d).eps
        return a if eps[a] >= eps[b] else b

    # per node, in graph order: the least precise dtype it is computed through (itself and
    # everything upstream) and, as bits, the placeholders it depends on
    up: dict[torch.fx.Node, torch.dtype | None] = {}
    deps: dict[torch.fx.Node, int] = {}
    placeholders = list(graph.find_nodes(op="placeholder"))
    bit = {p: 1 << k for k, p in enumerate(placeholders)}
    for node in graph.nodes:
        own: torch.dtype | None = None
        vals = pytree.tree_leaves(node.meta.get("val", node.meta.get("example_value")))
        for val in vals:
            if isinstance(val, torch.Tensor) and val.dtype.is_floating_point:
                own = less_precise(own, val.dtype)
        if node.op == "get_attr":  # a higher-order op's body counts whole
            body = getattr(gm, str(node.target), None)
            if isinstance(body, torch.fx.GraphModule):
                own = less_precise(own, least_precise_dtype(body))
        mask = bit.get(node, 0)
        # a boolean or integer result is exact given its inputs (``x.to(bf16) > -100``
        # masking a float64 output: the mask is the same in both runs; a review found the
        # output compared at bf16's tolerance, a 1% error passing): dtypes stop there
        exact = any(isinstance(v, torch.Tensor) for v in vals) and not any(
            isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())
            for v in vals)
        for a in node.all_input_nodes:
            if not exact:
                own = less_precise(own, up[a])
            mask |= deps[a]
        up[node], deps[node] = own, mask

    def worst(nodes: Any) -> torch.dtype | None:
        found: torch.dtype | None = None
        for node in nodes:
            found = less_precise(found, up[node])
        return found

    leaves = pytree.tree_leaves(graph.output_node().args[0])
    outputs = [up[leaf] if isinstance(leaf, torch.fx.Node) else None for leaf in leaves]
    into = {n for leaf in leaves if isinstance(leaf, torch.fx.Node)
            for n in _upstream(leaf)}
    from graphopt.capture import written_by
    from graphopt.passes.fx_utils import alias_classes

    classes = alias_classes(graph)
    writers = [(n, {classes.get(t, t) for t in written_by(n)}) for n in graph.nodes
               if n.op in ("call_function", "call_method")]
    writers = [(n, targets) for n, targets in writers if targets]
    states: list[torch.dtype | None] = []
    gradients: list[torch.dtype | None] = []
    for p, x in zip(placeholders, inputs):
        if not isinstance(x, torch.Tensor):
            continue
        b = bit[p]
        # the ops writing into this input (or a view of it), not those merely reading it
        # (an unrelated bf16 write reading a float64 buffer loosened the buffer's
        # tolerance, a re-review)
        mine = [n for n, targets in writers if classes.get(p, p) in targets]
        states.append(worst(mine) if mine else x.dtype)
        if x.requires_grad:
            path = [n for n in into if deps[n] & b]
            gradients.append(worst(path) if path else None)
    return outputs + states, gradients


def _upstream(node: torch.fx.Node) -> set[torch.fx.Node]:
    """``node`` and every node it is computed from."""
    seen, stack = {node}, [node]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return seen


def _all_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Nodes of ``gm`` and of its subgraphs (checkpoint bodies, autograd.Function fwd/bwd)."""
    return [n for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes]


DtypePlan = tuple[list[torch.dtype | None], list[torch.dtype | None]]


_LAYOUT = threading.local()
"""While :func:`verify_compile` runs: ``outputs`` (how many of an outcome's values are the
graph's outputs) and ``after`` (the names of the values after them)."""


def value_name(kind: str, i: int) -> str:
    """"output i" / "gradient i"; past the graph's outputs, the input or module attribute
    whose value after the call is compared ("<name> after the call (written in place)")."""
    outputs, after = getattr(_LAYOUT, "outputs", None), getattr(_LAYOUT, "after", None)
    if kind != "output" or outputs is None or after is None or i < outputs:
        return f"{kind} {i}"
    k = i - outputs
    return f"{after[k] if k < len(after) else f'value {k}'} after the call (written in place)"


def compare_outcomes(expected: Outcome, actual: Outcome, config: GraphoptConfig,
                     compute_dtype: torch.dtype | None = None,
                     per_tensor: DtypePlan | None = None,
                     truth: Float64Reference | None = None) -> str | None:
    """None when equal within tolerance, else a one-line description of the worst mismatch.
    Each tensor's tolerance is its dtype's, or its ``per_tensor`` compute dtype's
    (:func:`compute_dtypes`; else ``compute_dtype``) where that is less precise. ``truth``:
    the same graph run in float64, which judges a tensor that only the loose rules
    (:func:`_compare_one`) accept."""
    for k, (kind, exp_list, act_list) in enumerate(
            (("output", *[o[0] for o in (expected, actual)]),
             ("gradient", expected[1], actual[1]))):
        if len(exp_list) != len(act_list):
            return f"{kind} count differs: {len(exp_list)} vs {len(act_list)}"
        floor = _group_scale(exp_list)
        for i, (e, a) in enumerate(zip(exp_list, act_list)):
            name = value_name(str(kind), i)
            problem = _compare_one(e, a, config, _dtype_at(per_tensor, k, i, compute_dtype),
                                   floor, None if truth is None else truth.judge(k, i, name))
            if problem:
                return f"{name}: {problem}"
    return None


def _dtype_at(per_tensor: DtypePlan | None, kind: int, i: int,
              default: torch.dtype | None) -> torch.dtype | None:
    """The compute dtype of output (kind 0) or gradient (kind 1) ``i``: ``per_tensor``'s
    when known, else ``default``."""
    if per_tensor is None or i >= len(per_tensor[kind]) or per_tensor[kind][i] is None:
        return default
    return per_tensor[kind][i]


def _group_scale(tensors: Any) -> float:
    """The largest RMS (:func:`_scale`) among the floating tensors of one kind (the outputs,
    or the gradients) of an outcome: the floor of each one's atol scale."""
    return max((_scale(t)[0] for t in tensors if isinstance(t, torch.Tensor) and
                (t.is_floating_point() or t.is_complex())), default=0.0)


def _compare_one(e: Any, a: Any, config: GraphoptConfig,
                 compute_dtype: torch.dtype | None, floor: float,
                 judge: Callable[[Any, Any, torch.dtype], str | None] | None = None
                 ) -> str | None:
    """None when ``a`` matches the reference ``e``, else the mismatch.

    Strict rule: rtol, and atol times ``e``'s RMS (:func:`_scale`). Two loose rules accept
    more: atol times ``floor`` (:func:`_group_scale`: the largest RMS among the outputs, or
    the gradients; a tensor whose rounding comes from summing larger values that cancel
    keeps its group's tolerance), and for 16-bit tensors a relative L2 error of 8 eps
    (:func:`_within_16bit_noise`). Either let wrong values through (a review: a float32
    output of 6.5e-4 1.1x off beside one of RMS 18; a bf16 output 1.05x off), so what they
    accept must also pass ``judge`` (:meth:`Float64Reference.judge`: its error against
    the graph run in float64 within a few times eager's or its sensitivity to rounding).
    With no float64 run (an op
    without a float64 kernel) they apply alone. (The floor was 1.0 before the group's RMS,
    so any error below atol passed: every gradient 1.5x off under bf16 at ~1e-3.)"""
    if not isinstance(e, torch.Tensor) or not isinstance(a, torch.Tensor):
        return None if e == a or (e is None and a is None) else f"{e!r} != {a!r}"
    if e.shape != a.shape or e.dtype != a.dtype:
        return f"shape/dtype {tuple(e.shape)}/{e.dtype} vs {tuple(a.shape)}/{a.dtype}"
    if not e.is_floating_point() and not e.is_complex():
        if torch.equal(e, a):
            return None
        wrong = e != a
        err = float((a[wrong].double() - e[wrong].double()).abs().max()) \
            if e.dtype != torch.bool else 1.0
        return (f"integer values differ at {int(wrong.sum())} of {e.numel()} entries "
                f"(max abs error {err:.3g})")
    dtype = e.dtype
    if compute_dtype is not None and torch.finfo(compute_dtype).eps > torch.finfo(e.dtype).eps:
        dtype = compute_dtype
    rtol, atol = default_tolerance(dtype)
    chosen = config.verify.rtol is not None or config.verify.atol is not None
    rtol = config.verify.rtol if config.verify.rtol is not None else rtol
    atol = config.verify.atol if config.verify.atol is not None else atol
    scale, sentinel = _scale(e)
    whole_e, whole_a = e, a

    def close(atol_scale: float) -> bool:
        try:
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol * atol_scale, equal_nan=True)
        except AssertionError:
            return False
        return True

    def failed() -> str:
        err = float((a.double() - e.double()).abs().max()) if e.numel() else 0.0
        return f"max abs error {err:.3g} (reference RMS |x| {scale:.3g}, rtol {rtol}, atol {atol})"

    if sentinel.any():  # fill values (finfo.min masks): relative only, out of the scale
        try:
            torch.testing.assert_close(a[sentinel], e[sentinel], rtol=rtol, atol=0.0)
        except AssertionError:
            return failed()
        a, e = a[~sentinel], e[~sentinel]
    if close(scale):
        return None
    if not (floor > scale and close(floor)) and \
            not (not chosen and _within_16bit_noise(e, a, dtype)):
        return failed()
    doubt = judge(whole_e, whole_a, dtype) if judge is not None else None
    return None if doubt is None else f"{failed()}; {doubt}"


class Float64Reference:
    """The reference graph run eagerly in float64 on the same inputs (cast up) with the
    same cotangents: an estimate of the exact result ``t`` that judges what verify's loose
    rules accept (:func:`_compare_one`). A compiled value ``a`` passes when, against ``t``,

    - its RMS error is at most ``m`` times the larger of eager's RMS error and the RMS
      sensitivity ``s`` plus ``u`` times ``t``'s RMS, and
    - its largest error is at most ``m_max`` times the larger of eager's largest error and
      the largest sensitivity plus ``u`` times ``t``'s largest |value|,

    with ``u`` the unit roundoff of the value's compute dtype and (``m``, ``m_max``) from
    :data:`_FLOAT64_MULTIPLIERS`. The sensitivity is how far rounding moves the value: a
    second float64 run in which every ATen op's floating operands (views' excepted) are
    scaled by ``1 + u_op * r`` (r uniform in [-1, 1], seeded; ``u_op`` the unit roundoff of
    the dtype the op computes in): Monte Carlo arithmetic's random rounding (Parker, 1997;
    Verificarlo), at op granularity. A value that cancels (a sum of ~1 that ends at ~1e-5)
    is that sensitive, and a correct reordering of it (a chunked kernel, which rounds each
    chunk's partial sum) moves it that far, where eager may land on float64 by luck (a
    review: bf16 eager sums in float32 and rounds once). Inputs themselves are exact and not
    perturbed (perturbing them made a bf16 RoPE frequency table, whose angle grows with the
    position, "sensitive" enough to hide a 5% error: a review); where the perturbed run's
    integer or boolean values differ from the plain run's (``mask == 1``, a floor, an
    argmax), it took another branch and measures no rounding, and the sensitivity is not
    used. The largest error catches a few wrong entries that RMS dilutes (a review: one
    sign of 65,536 flipped passed). This follows torch's own accuracy check of compiled
    models (``torch._dynamo.utils.same`` with ``fp64_ref``: RMS error within 2-3x eager's,
    more for small tensors), with the sensitivity and largest error added. Limit: inside
    one op (a reduction) the partial sums are not perturbed, so a correct reordering of a
    sum whose partial sums are far larger than random rounding predicts (a sorted row that
    cancels) can fail; widen ``verify={"atol": ...}`` there.

    Run at most once each, when a value first needs them. There is none (``unavailable``
    says why; the loose rules then apply alone) when the graph exchanges data between ranks
    or takes tensor subclasses (DTensor), writes module attributes, takes inputs that share
    a storage, reinterprets bits (``view(dtype)``), or when an op does not run in float64
    (``torch._grouped_mm`` on the CPU) or computes in another floating dtype.
    ``accepted``/``rejected``: the names of the values it judged; ``unjudged``: those it
    could not (another shape, no finite entry in common); ``discrete``: the rounded run
    branched otherwise, so no sensitivity was used (reported as ``sensitivity_unused``)."""

    def __init__(self, graph: torch.fx.GraphModule, inputs: Sequence[Any], grads: bool,
                 reference: Outcome, outputs: int,
                 run: Callable[..., Outcome]) -> None:
        self._pending: tuple[Any, ...] | None = (graph, inputs, grads, reference, outputs, run)
        self._outcomes: tuple[Outcome, Outcome] | None = None
        self.unavailable: str | None = None
        self.accepted: dict[str, None] = {}
        self.rejected: dict[str, None] = {}
        self.unjudged: dict[str, None] = {}
        self.discrete = False

    def outcomes(self) -> tuple[Outcome, Outcome] | None:
        """(the float64 outputs/gradients, laid out as the reference's; the same with each
        op's operands randomly rounded, or the first again where that run branched
        otherwise); None: unavailable."""
        if self._pending is not None:
            graph, inputs, grads, reference, outputs, run = self._pending
            self._pending = None
            try:
                truth, discrete = _float64_outcome(graph, inputs, grads, reference, outputs,
                                                   run, perturb=False)
                moved, moved_discrete = _float64_outcome(graph, inputs, grads, reference,
                                                         outputs, run, perturb=True)
                if moved_discrete != discrete:  # a comparison, rounding or index moved:
                    # the perturbed run took another branch, and what it moved measures
                    # no rounding (a review: mask == 1 broke, "sensitivity" 9.6e3)
                    self.discrete = True
                    moved = truth
                self._outcomes = (truth, moved)
            except Exception as exc:  # noqa: BLE001 - the loose rules then apply alone
                text = re.sub(r" at 0x[0-9a-f]+", "", f"{type(exc).__name__}: {exc}")
                self.unavailable = text.split("\n")[0][:300]
        return self._outcomes

    def judge(self, kind: int, i: int, name: str
              ) -> Callable[[Any, Any, torch.dtype], str | None]:
        """For output (kind 0) or gradient (kind 1) ``i`` named ``name``: a function of
        (eager value, compiled value, compute dtype) giving None (accepted, or nothing to
        judge by) or why the compiled value is off."""
        def verdict(e: Any, a: Any, dtype: torch.dtype) -> str | None:
            outcomes = self.outcomes()
            if outcomes is None:
                return None
            truth, moved = (o[kind][i] if i < len(o[kind]) else None for o in outcomes)
            doubt = _float64_doubt(e, a, truth, moved, dtype)
            (self.unjudged if doubt is None else self.rejected if doubt
             else self.accepted)[name] = None
            return doubt or None
        return verdict


_FLOAT64_MULTIPLIERS = ((3.0, 4.0), (8.0, 8.0))
"""(RMS, largest) error multipliers of :class:`Float64Reference`, for tensors of 1000
entries or more and for smaller ones, whose statistics are noisier (torch's
``torch._dynamo.utils.same``: 2-3, and 8-10 for small tensors)."""


def _float64_doubt(e: torch.Tensor, a: torch.Tensor, truth: Any, moved: Any,
                   dtype: torch.dtype) -> str | None:
    """"" when ``a`` passes against ``truth`` (:class:`Float64Reference`; ``moved``: the
    run with randomly rounded operands; ``dtype``: the compute dtype), else why not; None
    when they cannot judge (missing, another shape, no entry finite in all)."""
    if not all(isinstance(t, torch.Tensor) and t.shape == e.shape and
               (t.is_floating_point() or t.is_complex()) for t in (truth, moved)):
        return None
    wide = torch.complex128 if e.is_complex() or truth.is_complex() else torch.float64
    e64, a64, t64, m64 = (x.detach().to(wide) for x in (e, a, truth, moved))
    real = e.real if e.is_complex() else e
    # entries finite everywhere: an overflow in eager's dtype (inf where float64 is
    # finite) left the rest unjudged before (a review: a 5% error then passed as
    # "nonfinite"); NaN/Inf themselves are compared position by position elsewhere
    keep = torch.isfinite(e64) & torch.isfinite(a64) & torch.isfinite(t64) & \
        (real.abs() < torch.finfo(real.dtype).max / 2)
    if not bool(keep.any()):
        return None
    u = torch.finfo(dtype).eps / 2 if dtype.is_floating_point else \
        torch.finfo(e.real.dtype).eps / 2
    errors = [(x[keep] - t64[keep]).abs() for x in (a64, e64)]
    # NaN/Inf only in the perturbed run (sqrt(1 - p) at p = 1): no sensitivity there, eager
    # alone judges (a review: those values went unjudged)
    moves = torch.nan_to_num((m64[keep] - t64[keep]).abs(), nan=0.0, posinf=0.0)
    size = t64[keep].abs()

    def rms(x: torch.Tensor) -> float:
        return float(x.square().mean().sqrt())

    small = int(int(keep.sum()) < 1000)
    (m_rms, m_max) = _FLOAT64_MULTIPLIERS[small]
    ours, eager, sens = rms(errors[0]), rms(errors[1]), rms(moves)
    if ours > m_rms * max(eager, sens) + u * rms(size):
        return (f"against a float64 run of the same graph its RMS error is {ours:.3g}, "
                f"eager's {eager:.3g}, its sensitivity to rounding {sens:.3g} "
                f"(accepted up to {m_rms:g}x the larger, plus {u:.3g} x RMS |x| "
                f"{rms(size):.3g})")
    ours, eager, sens = (float(x.max()) for x in (errors[0], errors[1], moves))
    if ours > m_max * max(eager, sens) + u * float(size.max()):
        return (f"against a float64 run of the same graph its largest error is {ours:.3g}, "
                f"eager's {eager:.3g}, its sensitivity to rounding {sens:.3g} "
                f"(accepted up to {m_max:g}x the larger, plus {u:.3g} x max |x| "
                f"{float(size.max()):.3g})")
    return ""


class _Float64Only(TorchDispatchMode):
    """Records ops whose floating results are not float64/complex128 (``bad``)."""

    def __init__(self) -> None:
        super().__init__()
        self.bad: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if is_random_call(func, args, kwargs or {}):  # the cotangents, drawn as eager's
            return out
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) \
                    and t.dtype not in (torch.float64, torch.complex128) and \
                    len(self.bad) < 3:
                self.bad.append(f"{func} gives {str(t.dtype).replace('torch.', '')}")
        return out


def _widen_dtype(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        if value.is_complex:
            return torch.complex128
        if value.is_floating_point:
            return torch.float64
    return value


def _widen(x: Any) -> Any:
    """A floating/complex tensor cast to float64/complex128 with ``x``'s sizes and strides
    (a slice's gaps, an expand's stride 0: :func:`_strided_copy`'s layout, as the eager
    run's clone gets; a dense copy changed what ``as_strided`` read, a review)."""
    if not isinstance(x, torch.Tensor) or not (x.is_floating_point() or x.is_complex()):
        return x
    return _strided_copy(x.detach(), _widen_dtype(x.dtype)).requires_grad_(x.requires_grad)


_NARROWING_METHODS = {"float": "double", "half": "double", "bfloat16": "double",
                      "cfloat": "cdouble", "chalf": "cdouble"}
"""Tensor methods of Dynamo's graphs that name a floating dtype: their float64 form."""


def _widen_graph(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``graph`` computing in float64/complex128: dtype arguments, narrowing
    methods (``x.float()``), parameters, buffers and tensor constants cast up (complex ones
    to complex128: ``Module.to(float64)`` drops their imaginary part, a review). Raises
    ValueError for a bit reinterpretation (``view(dtype)``), whose meaning that changes."""
    import copy

    wide = copy.deepcopy(graph)
    for module in wide.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and (p.is_floating_point() or p.is_complex()):
                module._parameters[name] = torch.nn.Parameter(
                    _widen(p).detach(), requires_grad=p.requires_grad)
        for name, b in list(module._buffers.items()):
            module._buffers[name] = _widen(b)
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for n in module.graph.nodes:
            if n.target in (torch.ops.aten.view.dtype, torch.ops.aten.view_copy.dtype) or (
                    n.op == "call_method" and n.target == "view" and any(
                        isinstance(v, torch.dtype) for v in (*n.args, *n.kwargs.values()))):
                raise ValueError(f"{n.name} reinterprets bits as another dtype")
            if n.op == "call_method" and n.target in _NARROWING_METHODS:
                n.target = _NARROWING_METHODS[n.target]
            if n.op in ("call_function", "call_method"):
                n.args = torch.fx.node.map_aggregate(n.args, _widen_dtype)
                n.kwargs = torch.fx.node.map_aggregate(n.kwargs, _widen_dtype)
            elif n.op == "get_attr":
                owner, _, leaf = str(n.target).rpartition(".")
                holder = module.get_submodule(owner) if owner else module
                value = getattr(holder, leaf, None)
                if isinstance(value, torch.Tensor) and not isinstance(
                        value, torch.nn.Parameter) and leaf not in holder._buffers:
                    object.__setattr__(holder, leaf, _widen(value))
        module.recompile()
    return wide


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Creation ops without a dtype argument (``linspace``, ``ones`` in Dynamo's graph) make
    ``dtype`` meanwhile."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _float64_outcome(graph: torch.fx.GraphModule, inputs: Sequence[Any], grads: bool,
                     reference: Outcome, outputs: int, run: Callable[..., Outcome],
                     perturb: bool) -> tuple[Outcome, list[tuple[int, int]]]:
    """(``graph`` run in float64 (:class:`Float64Reference`), a digest of every integer and
    boolean value it computed). With ``perturb``, each op's floating operands are scaled by
    ``1 + u * r`` first (r uniform in [-1, 1], seeded; u the unit roundoff of the dtype the
    op computes in in ``graph``, for float64 its eps): Monte Carlo arithmetic's random
    rounding (Parker, 1997; as Verificarlo does per operation), at op granularity. Raises
    when the graph cannot be run so."""
    if _WRITTEN:
        raise ValueError("the graph writes module attributes in place")
    if any(communicates(n.target, n.args) for n in _all_nodes(graph)
           if n.op == "call_function"):
        raise ValueError("the graph exchanges data between ranks")
    if any(isinstance(x, torch.Tensor) and type(x) not in (torch.Tensor, torch.nn.Parameter)
           for x in inputs):
        raise ValueError("the graph takes tensor subclasses")
    if _shared_storages(inputs):
        raise ValueError("inputs share a storage")
    wide = _widen_graph(graph)
    widened = [_widen(x) for x in inputs]
    digest: list[tuple[int, int]] = []
    gen = torch.Generator().manual_seed(1)

    def jitter(x: Any, u: float) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel():
            r = torch.rand(x.shape, generator=gen, dtype=x.dtype) * 2 - 1
            return x * (1 + u * r.to(x.device))
        return x

    class Rounding(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            if perturb and n.op == "call_function" and isinstance(n.target,
                                                                 torch._ops.OpOverload):
                meta = n.meta.get("val", n.meta.get("example_value"))
                view = any(r.alias_info is not None for r in n.target._schema.returns)
                if isinstance(meta, torch.Tensor) and meta.is_floating_point() and \
                        not is_mutating(n) and not view:
                    # (a view's operand is its base: a jittered copy changed what
                    # as_strided read, a review). float64 ops too: in a float64 graph the
                    # reference is eager itself, and a value that cancels (a bias gradient
                    # BatchNorm makes zero) was judged against u x its own size, refusing
                    # Inductor's 1e-15 (a review); by a full ulp there, as 1 + (eps/2) r
                    # rounds back to 1 three times in four (a re-review)
                    u = torch.finfo(meta.dtype).eps / (1 if meta.dtype == torch.float64
                                                      else 2)
                    args, kwargs = self.fetch_args_kwargs_from_env(n)
                    args, kwargs = pytree.tree_map(lambda x: jitter(x, u), (args, kwargs))
                    out = getattr(self, n.op)(n.target, args, kwargs)
                    self._digest(out)
                    return out
            out = super().run_node(n)
            self._digest(out)
            return out

        def _digest(self, out: Any) -> None:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and not t.is_floating_point() and \
                        not t.is_complex() and t.numel():
                    digest.append((int(t.long().sum()), int((t != 0).sum())))

    dtypes = [v.dtype if isinstance(v, torch.Tensor) else None for v in reference[0][:outputs]]
    check = _Float64Only()
    interpreter = Rounding(wide)
    with _default_dtype(torch.float64), check:
        outcome = run(lambda *a: interpreter.run(*a), widened, grads, cotangent_dtypes=dtypes)
    if check.bad:
        raise ValueError(f"ops compute in other dtypes: {', '.join(check.bad)}")
    if [len(v) for v in outcome] != [len(v) for v in reference]:
        raise ValueError("its outputs/gradients are laid out otherwise")
    return outcome, digest


def _within_16bit_noise(e: torch.Tensor, a: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``a``, computed in a 16-bit ``dtype``, is within that dtype's rounding of the
    reference ``e`` as a whole: the same non-finite entries, and a relative L2 error
    ``||a - e|| / ||e||`` of at most 8 eps (bf16 0.0625, fp16 0.0078). Entry by entry a
    16-bit gradient summed over many contributions (an embedding's) is ~10% of its RMS
    off a float64 truth in eager itself, and any reordering upstream moves its worst entry
    that far (a review: six false alarms on MiniMax and Llama once atol stopped flooring
    at 1.0, relative L2 differences 0.5-0.6%); a wrong exact pass moves the whole tensor
    (a 1.5x gradient: 0.5)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    finite = torch.isfinite(e)
    if not torch.equal(finite, torch.isfinite(a)) or not torch.equal(e[~finite], a[~finite]):
        return False
    reference = e[finite].double()
    norm = float(reference.norm())
    return norm > 0 and float((a[finite].double() - reference).norm()) <= \
        8 * torch.finfo(dtype).eps * norm


def _scale(e: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(root-mean-square of ``e``'s finite entries below half its dtype's largest value,
    the mask of entries at or above it). Verify's atol is relative to this scale: rounding
    in a matmul or reduction grows with the magnitude of what it sums, which the tensor's
    RMS estimates. Its largest entry did before, so one large entry (or a
    ``torch.finfo(dtype).min`` attention-mask fill: an infinite atol) let every other entry
    be off by far more than the dtype's rounding (a review: 1e-4 in a float64 output)."""
    real = e.real if e.is_complex() else e
    sentinel = real.abs() >= torch.finfo(real.dtype).max / 2
    magnitude = e[torch.isfinite(e) & ~sentinel].abs().double() if e.numel() else e.double()
    if not magnitude.numel():
        return 0.0, sentinel
    peak = float(magnitude.max())
    if peak == 0.0:
        return 0.0, sentinel
    return peak * float((magnitude / peak).square().mean().sqrt()), sentinel


def nonfinite(outcome: Outcome) -> list[str]:
    """Where ``outcome`` holds NaN or Inf, e.g. ["output 0: 3 NaN", "gradient 2: 1 Inf"]."""
    found = []
    for kind, values in (("output", outcome[0]), ("gradient", outcome[1])):
        for i, t in enumerate(values):
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
                nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
                if nan or inf:
                    found.append(f"{kind} {i}: " + ", ".join(
                        f"{n} {what}" for n, what in ((nan, "NaN"), (inf, "Inf")) if n))
    return found


def max_error(expected: Outcome, actual: Outcome) -> float:
    """Largest |actual - expected| over finite entries of all outputs and gradients."""
    return max((_pair_error(e, a)[0] for e, a in _pairs(expected, actual)), default=0.0)


def _error_text(expected: Outcome, actual: Outcome) -> str:
    """:func:`max_error` for a message, naming NaN/Inf that differ in place or sign, which
    it skips (a review read "graphopt by 0" where the lowering gave 0 for eager's NaN)."""
    pairs = [_pair_error(e, a) for e, a in _pairs(expected, actual)]
    largest = max((err for err, _ in pairs), default=0.0)
    return f"{largest:.3g}" + (" on finite entries, and NaN/Inf where the other has none"
                               if any(mismatch for _, mismatch in pairs) else "")


def _pair_error(e: Any, a: Any) -> tuple[float, bool]:
    """(largest |a - e| over the entries finite on both sides, whether NaN/Inf differ in
    place or sign); (0, False) for values that are not real tensors of equal shapes."""
    if not (isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor) and
            not e.is_complex() and e.shape == a.shape and e.numel()):
        return 0.0, False
    if not e.is_floating_point():  # integers: an integer output that differed measured 0
        return float((a.double() - e.double()).abs().max()), False
    diff = (a.double() - e.double()).abs()
    diff = diff[torch.isfinite(diff)]
    mismatch = not all(torch.equal(f(e), f(a)) for f in (torch.isnan, torch.isposinf,
                                                         torch.isneginf))
    return (float(diff.max()) if diff.numel() else 0.0), mismatch


def _measured(report: CompileReport, reference: Outcome, actual: Outcome,
              config: GraphoptConfig, dtype: torch.dtype | None) -> None:
    """Record the measured error and the tolerance on every verify; NaN/Inf loudly."""
    tol_dtype = dtype or torch.float32
    rtol, atol = default_tolerance(tol_dtype)
    report.verify["max_abs_error"] = max_error(reference, actual)
    report.verify["tolerance"] = {
        "rtol": config.verify.rtol if config.verify.rtol is not None else rtol,
        "atol": config.verify.atol if config.verify.atol is not None else atol,
        "dtype": str(tol_dtype).replace("torch.", "")}
    if tol_dtype in (torch.bfloat16, torch.float16) and config.verify.rtol is None and \
            config.verify.atol is None:  # (_within_16bit_noise)
        report.verify["tolerance"]["relative_l2"] = 8 * torch.finfo(tol_dtype).eps
    bad = {"compiled": nonfinite(actual), "eager": nonfinite(reference)}
    if bad["compiled"] or bad["eager"]:
        report.verify["nonfinite"] = bad
        warnings.warn(f"graphopt verify (graph {report.graph_id}): non-finite values: compiled "
                      f"{bad['compiled'] or 'none'}, eager {bad['eager'] or 'none'}",
                      stacklevel=2)


class _RandomCalls(TorchDispatchMode):
    """Records the ATen calls that draw random numbers (:func:`is_random_call`) while the
    eager reference runs. The graph verify checks statically is Dynamo's when the capture
    guard sent it to AOTAutograd as captured (a custom ``autograd.Function``, ...): its
    ``F.dropout`` is a Python function :func:`is_random` does not know, so verify compared
    Inductor's dropout with eager's and failed the user's step with a false
    VerificationError (a review: max abs error 55 on a graph aot_eager ran)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if is_random_call(func, args, kwargs) and str(func) not in self.seen:
            self.seen.append(str(func))
        return func(*args, **kwargs)


def verify_compile(original: torch.fx.GraphModule, compiled: Callable[..., Any],
                   inputs: Sequence[Any], snapshots: list[tuple[str, bool, torch.fx.GraphModule]],
                   config: GraphoptConfig, report: CompileReport,
                   recompile: Callable[[Sequence[str]], Callable[..., Any]],
                   owner_grads: set[int] | None = None) -> None:
    """Compare ``compiled`` with ``original`` (Dynamo's graph, run eagerly); see module doc.
    ``owner_grads``: positions of inputs whose gradients are not compared (expert weights
    under the moe pass's expert parallelism: each rank's gradient covers its own experts
    over every rank's tokens, the eager run's covers every expert over this rank's tokens;
    verify then failed on every EP graph, found by a review)."""
    if any(isinstance(a, list) for a in inputs):
        report.verify = {"status": "skipped",
                         "detail": "the graph takes its inputs as one list, which the call "
                                   "consumes (compiled autograd's backward graph, which also "
                                   "accumulates into the parameters' .grad): verify cannot "
                                   "rerun it (a review: the user's call then failed)"}
        return
    written = written_attributes(original)
    _WRITTEN[:] = [(t, t.detach().clone()) for t in written]
    # names of the values compared after the outputs (inputs' values after the call, then
    # the attributes the graph writes): a wrong buffer update was "output 4" (a review)
    names = [p.name for p in original.graph.find_nodes(op="placeholder")]
    _LAYOUT.after = [names[i] if i < len(names) else f"input {i}"
                     for i, a in enumerate(inputs) if isinstance(a, torch.Tensor)] + \
        [f"module attribute {j}" for j in range(len(written))]
    try:
        _verify_compile(original, compiled, inputs, snapshots, config, report, recompile,
                        owner_grads)
    finally:
        _WRITTEN.clear()
        _LAYOUT.__dict__.clear()
    if report.verify.get("status") == "skipped":  # as loud as a failure would be (a review:
        # a train-mode graph with dropout was checked by nothing, said in the report only)
        warn_skipped(report)
    if written and report.verify.get("status") == "passed":
        report.verify["detail"] += (f"; with the {len(written)} module attribute(s) it "
                                    "writes in place (put back after each run)")


def _verify_compile(original: torch.fx.GraphModule, compiled: Callable[..., Any],
                    inputs: Sequence[Any],
                    snapshots: list[tuple[str, bool, torch.fx.GraphModule]],
                    config: GraphoptConfig, report: CompileReport,
                    recompile: Callable[[Sequence[str]], Callable[..., Any]],
                    owner_grads: set[int] | None = None) -> None:
    grads = config.verify.grads and report.training
    positions = [i for i, a in enumerate(inputs)
                 if isinstance(a, torch.Tensor) and a.requires_grad]
    skipped = {k for k, i in enumerate(positions) if i in (owner_grads or set())}

    def run_with_grads(fn: Callable[..., Any], inputs: Sequence[Any], grads: bool,
                       **kwargs: Any) -> Outcome:
        values, gradients = _run_with_grads(fn, inputs, grads, **kwargs)
        return values, [None if k in skipped else g for k, g in enumerate(gradients)]

    random_ops = [n.name for n in _all_nodes(snapshots[0][2]) if is_random(n)]
    if random_ops:
        report.verify = {"status": "skipped",
                         "detail": f"graph draws random numbers ({', '.join(random_ops[:3])}); "
                                   "eager and compiled runs cannot be compared value by value"}
        return
    written = [name for _, _, body in checkpoint_bodies(snapshots[0][2])
               for name in _input_writes(body)]
    if written:
        report.verify = {
            "status": "skipped",
            "detail": f"a checkpoint region writes in place ({', '.join(written[:3])}: e.g. "
                      "BatchNorm's running statistics); the eager reference repeats such "
                      "writes (its recomputation runs them again, and running the captured "
                      "graph eagerly did so in the forward already) while compiled graphs, "
                      "aot_eager's too, write once, so the runs cannot be compared (a review)"}
        return
    dtype = least_precise_dtype(snapshots[0][2])
    per_tensor = compute_dtypes(snapshots[0][2], inputs)

    truth: list[Float64Reference] = []  # the float64 run of the graph eager runs for
    # the reference: Dynamo's (normalize's snapshot), or the last approximate pass's

    def compare(expected: Outcome, actual: Outcome, config: GraphoptConfig) -> str | None:
        return compare_outcomes(expected, actual, config, dtype, per_tensor,
                                truth[-1] if truth else None)

    watch = _RandomCalls()

    def watched(*args: Any) -> Any:
        with watch:  # the forward only: run_with_grads draws its own seeded cotangents
            return original(*args)

    try:
        try:
            reference = run_with_grads(watched, inputs, grads)
        except Exception:  # noqa: BLE001 - the run without the watch says why
            watch.seen.clear()
            reference = run_with_grads(original, inputs, grads)
    except Exception as exc:  # noqa: BLE001 - the reason goes into the report
        # e.g. invoke_subgraph (nested_compile_region): its autograd rule runs under fake
        # mode only, so Dynamo's graph does not run eagerly with gradients (a review: verify
        # crashed the user's step with "fake_mode should be enabled for HOPs")
        report.verify = {"status": "skipped",
                         "detail": "the captured graph does not run eagerly, so there is no "
                                   f"eager reference ({type(exc).__name__}: {exc})"}
        return
    if watch.seen:
        report.verify = {"status": "skipped",
                         "detail": f"graph draws random numbers ({', '.join(watch.seen[:3])}, "
                                   "seen in its eager run); eager and compiled runs cannot be "
                                   "compared value by value"}
        return
    truth.append(Float64Reference(snapshots[0][2], inputs, grads, reference,
                                  getattr(_LAYOUT, "outputs", 0), run_with_grads))
    actual = run_with_grads(compiled, inputs, grads)
    _measured(report, reference, actual, config, dtype)
    problem = compare(reference, actual, config)
    if truth[0].accepted or truth[0].unjudged or (truth[0].unavailable and problem is None):
        report.verify["tolerance"]["float64_reference"] = {
            "accepted": list(truth[0].accepted), "unjudged": list(truth[0].unjudged),
            "unavailable": truth[0].unavailable,
            "sensitivity_unused": truth[0].discrete}
    if problem is None:
        detail = "outputs and gradients" if grads else "outputs"
        if grads and skipped:
            detail += (f" ({len(skipped)} expert-weight gradients not compared: under expert "
                       "parallelism they are the owner rank's, over every rank's tokens)")
        if report.verify.get("nonfinite"):
            report.verify.update(status="nonfinite", detail=f"{detail} match eager, but hold "
                                 f"NaN/Inf: {report.verify['nonfinite']}")
        else:
            within = (f"; 16-bit: a tensor beyond atol is accepted within relative L2 "
                      f"{report.verify['tolerance']['relative_l2']:.3g}"
                      if "relative_l2" in report.verify.get("tolerance", {}) else "")
            if truth[0].accepted:
                names = list(truth[0].accepted)
                within += (f"; {len(names)} value(s) beyond atol at their own scale "
                           f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) "
                           "accepted against a float64 run of the graph: within a few times "
                           "eager's error or their sensitivity to rounding")
            report.verify.update(status="passed", detail=f"{detail} match eager (max abs "
                                 f"error {report.verify['max_abs_error']:.3g}{within})")
        return
    talking = [n.name for _, _, g in snapshots for n in _all_nodes(g)
               if n.op == "call_function" and communicates(n.target, n.args)]
    inexact = [name for name, exact, _ in snapshots if not exact]
    if talking and inexact:  # (a review: moe ep=2 with a capacity factor raised on every
        # rank, where one process reports "approximate")
        report.verify.update(
            status="approximate",
            detail=f"differs from eager ({problem}); the graph holds approximate pass(es) "
                   f"{', '.join(dict.fromkeys(inexact))} and exchanges data between ranks, so "
                   "verify cannot tell their change from another pass's on one rank: run the "
                   "model in one process (moe ep=1) with verify to check the rest")
        return
    if talking:
        # localizing reruns the passes' snapshots (and an aot_eager baseline) on this rank
        # alone: their collectives would wait for, or pair with, the other ranks' training
        # collectives (as a review found for recompiles)
        _fail(report, f"compiled differs from eager ({problem}); the graph exchanges data "
                      f"between ranks ({', '.join(dict.fromkeys(talking[:3]))}), so verify "
                      "does not localize the cause on one rank: run the model in one "
                      "process (no parallel plan, moe ep=1) with verify to find the pass")
    reference_graph = original
    for name, exact, snapshot in snapshots:
        got = run_with_grads(snapshot, inputs, grads)
        bad = compare(reference, got, config)
        if bad is None:
            continue
        if exact:
            _fail(report, f"pass {name!r} claims to be exact but changed the numerics: {bad}")
        report.verify.setdefault("approximate", []).append(
            {"pass": name, "deviation": bad, "largest": _largest(reference, got)})
        reference, reference_graph = got, snapshot
        truth.append(Float64Reference(snapshot, inputs, grads, got,
                                      getattr(_LAYOUT, "outputs", 0), run_with_grads))
    approximate = [a["pass"] for a in report.verify.get("approximate", [])]
    if approximate:
        problem = compare(reference, actual, config)
        if problem is None:
            report.verify.update(status="approximate",
                                 detail="differs from eager only by approximate passes")
            return
    against = (f"the graph after approximate pass {approximate[-1]!r} run eagerly"
               if approximate else "eager")
    # what compiling alone does to this graph, per output and gradient: a graph that
    # sensitive to rounding in its dtype (an approximate rewrite's output norm of a
    # near-zero attention output under bf16 autocast) differs from its eager run under
    # torch.compile(backend="aot_eager") as much (a review: a false alarm that blamed the
    # lowering). Compared tensor by tensor, so noise in one cannot hide an error in another
    # (a review of that fix: a joint pass scaling one gradient by 0.9 passed).
    torchs = _aot_eager_errors(reference_graph, inputs, grads, reference)

    def unexcused(outcome: Outcome) -> str | None:
        """The first output/gradient beyond both the tolerance and 2x aot_eager's error
        (None: every one is within one of them)."""
        if torchs is None:
            return "no aot_eager baseline"
        ours = _tensor_errors(reference, outcome)
        pairs = _pairs(reference, outcome)
        if not len(ours) == len(torchs) == len(pairs):
            return "output/gradient counts differ"
        n_out = len(reference[0])
        floors = (_group_scale(reference[0]), _group_scale(reference[1]))
        for i, (o, t, (e, a)) in enumerate(zip(ours, torchs, pairs)):
            kind, j = ("output", i) if i < n_out else ("gradient", i - n_out)
            bad = None if o <= 2 * t else _compare_one(
                e, a, config, _dtype_at(per_tensor, int(i >= n_out), j, dtype),
                floors[int(i >= n_out)], truth[-1].judge(int(i >= n_out), j,
                                                         value_name(kind, j)))
            if bad:
                return f"{value_name(kind, j)}: {bad}; aot_eager's error there {t:.3g}"
        return None

    def excused(outcome: Outcome) -> bool:
        return unexcused(outcome) is None

    def acceptable(outcome: Outcome) -> bool:
        return compare(reference, outcome, config) is None or excused(outcome)

    if excused(actual):
        ours = max_error(reference, actual)
        report.verify.update(
            status="nonfinite" if report.verify.get("nonfinite") else
            "approximate" if approximate else "passed",
            detail=f"differs from {against} by {ours:.3g} ({problem}), beyond the "
                   f"tolerance, as torch.compile(backend='aot_eager') of the same graph does "
                   f"for each output and gradient (up to {max(torchs or [0.0]):.3g}): what "
                   "compiling alone does to this graph (its rounding in "
                   f"{str(dtype).replace('torch.', '')}, or another difference of torch's own "
                   "compile path), not a graphopt pass or lowering")
        return
    if torchs is not None:  # name the output/gradient that compiling alone does not explain
        problem = unexcused(actual) or problem
    joint = list(dict.fromkeys(p.name for p in report.passes if p.stage == "joint"))
    for k in range(len(joint) - 1, -1, -1):
        if acceptable(run_with_grads(recompile(joint[k:]), inputs, grads)):
            _fail(report, f"joint pass {joint[k]!r} changed the numerics: {problem}")
    _fail(report, f"lowering {report.lowering!r} differs from {against} ({problem}); no "
                  "graphopt pass is the cause (each exact pass's output matches its input's)"
          + (f"; torch.compile(backend='aot_eager') of the same graph differs by up to "
             f"{max(torchs or [0.0]):.3g}, graphopt by {_error_text(reference, actual)}"
             if torchs is not None else "") + _lowering_hint(report.lowering, reference))


def _lowering_hint(lowering: str, reference: Any) -> str:
    """What to do when the lowering alone differs (a review: Inductor computes bf16/fp16
    pointwise math in float32, as plain backend='inductor' does, and the error named no
    way out); ``reference``: the eager outputs and gradients."""
    sixteen = any(isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float16)
                  for t in pytree.tree_leaves(reference))
    if lowering == "inductor" and sixteen:
        return (". Inductor computes 16-bit pointwise math in float32, as "
                "torch.compile(backend='inductor') does: options={'inductor_config': "
                "{'emulate_precision_casts': True}} rounds as eager does; or widen "
                "options={'verify': {'rtol': ..., 'atol': ...}}, or check with "
                "lowering='eager'")
    return (". If that difference is acceptable, widen options={'verify': {'rtol': ..., "
            "'atol': ...}}; lowering='eager' runs the same graphs without the lowering's "
            "kernels")


def _input_writes(body: torch.fx.GraphModule) -> list[str]:
    """Nodes of a checkpoint region ``body`` that write in place into one of its inputs
    (through a view too), which its recomputation repeats: BatchNorm's running statistics.
    Writes into tensors the region creates repeat harmlessly (a review: MoE routing's
    ``div_``/``index_put_`` on fresh tensors skipped verify for every MoE model under
    gradient checkpointing). Conservative: a write whose tensors carry no fake value, and
    any write inside a nested region, counts."""
    from torch.multiprocessing.reductions import StorageWeakRef

    def storage(node: Any) -> Any:
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        return StorageWeakRef(val.untyped_storage()) if isinstance(val, torch.Tensor) else None

    inputs = {storage(ph) for ph in body.graph.find_nodes(op="placeholder")} - {None}
    out = [n.name for m in body.modules() if m is not body and isinstance(
        m, torch.fx.GraphModule) for n in m.graph.nodes if is_mutating(n)]
    for n in body.graph.nodes:
        if not is_mutating(n):
            continue
        schema = n.target._schema  # type: ignore[union-attr]
        targets = [n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
                   for i, a in enumerate(schema.arguments)
                   if a.alias_info is not None and a.alias_info.is_write]
        targets += unannotated_writes(n)
        stores = [storage(t) for t in targets]
        if not stores or any(s is None or s in inputs for s in stores):
            out.append(n.name)
    return out


def _pairs(expected: Outcome, actual: Outcome) -> list[tuple[Any, Any]]:
    """(expected, actual) of every output, then every gradient."""
    return [*zip(expected[0], actual[0]), *zip(expected[1], actual[1])]


def _largest(expected: Outcome, actual: Outcome) -> str:
    """Which output or gradient differs most, and by how much (the deviation a compare
    names is the first beyond tolerance: an approximate pass's output, where its largest
    change was a gradient, a review)."""
    errors = _tensor_errors(expected, actual)
    if not errors:
        return "nothing compared"
    i = max(range(len(errors)), key=errors.__getitem__)
    n_out = len(expected[0])
    kind, j = ("output", i) if i < n_out else ("gradient", i - n_out)
    return f"{value_name(kind, j)}: max abs error {errors[i]:.3g}"


def _tensor_errors(expected: Outcome, actual: Outcome) -> list[float]:
    """:func:`_pair_error` per output and gradient, inf where NaN/Inf differ (a review:
    all-NaN outputs measured 0 and were excused)."""
    return [math.inf if mismatch else err
            for err, mismatch in (_pair_error(e, a) for e, a in _pairs(expected, actual))]


def _aot_eager_errors(graph: torch.fx.GraphModule, inputs: Sequence[Any], grads: bool,
                      reference: Outcome) -> list[float] | None:
    """Per output and gradient, the largest difference between ``reference`` (``graph``
    run eagerly) and ``torch.compile(backend="aot_eager")``'s compile of ``graph``
    (AOTAutograd, no graphopt pass, eager kernels) on ``inputs``: how much compiling alone
    moves this graph's results. None when that compile fails."""
    import copy

    from torch._dynamo.backends.debugging import aot_eager

    try:
        compiled = aot_eager(copy.deepcopy(graph), list(inputs))
        return _tensor_errors(reference, _run_with_grads(compiled, inputs, grads))
    except Exception:  # noqa: BLE001 (a baseline only: verify then fails as before)
        return None


def _fail(report: CompileReport, message: str) -> None:
    report.verify = {**report.verify, "status": "failed", "detail": message}
    raise VerificationError(f"graphopt verify (graph {report.graph_id}): {message}")
