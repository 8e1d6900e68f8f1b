"""The graphopt pipeline: normalize, model passes, AOTAutograd + joint passes, lowering.

    Dynamo FX graph (Torch IR) + example inputs
     -> normalize               pre-autograd ATen graph, meta['val'] on every node
     -> stage "pre_autograd"    model passes (graphopt.passes.PIPELINE)
     -> lowering.compile        AOTAutograd; the partitioner hook runs stage "joint"
     -> forward/backward/inference graphs compiled by the lowering (eager | inductor | npu)
     -> verify (optional)       eager vs compiled, localized to the first bad pass

After each pass the runner lints and recompiles the graph, checks that every node still has
``meta['val']``, times the pass, records op-count changes and dumps before/after when asked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import is_fake

from graphopt.capture import Capture, capture, check_gradient_paths, check_outputs
from graphopt.config import GraphoptConfig
from graphopt.dump import Dumper, graph_code
from graphopt.errors import (
    ConfigError,
    FallbackWarning,
    GraphoptError,
    PassFailedError,
    VerificationError,
)
from graphopt.lowering import AOTHooks, get_lowering
from graphopt.normalize import check_meta, refresh_meta
from graphopt.passes import PassContext, Stage, build_pipeline
from graphopt.passes.fx_utils import count_delta, op_counts
from graphopt.passes.regions import all_graph_modules, checkpoint_bodies, run_with_regions
from graphopt.report import (
    CompileReport,
    PassRecord,
    joint_records_key,
    load_joint_records,
    next_graph_id,
    register,
    save_joint_records,
)

Snapshot = tuple[str, bool, fx.GraphModule]
"""(pass name, pass is exact, a copy of the graph after that pass)."""


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A structural copy sharing parameters/constants; node meta is copied shallowly.
    Checkpoint bodies are copied too (passes edit them in place: a snapshot sharing them
    would show later passes' rewrites)."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    copy = fx.GraphModule(gm, graph)
    copy.meta = dict(gm.meta)
    for _, name, body in list(checkpoint_bodies(copy)):
        setattr(copy, name, copy_graph_module(body))
    return copy


class PassRunner:
    """Runs one stage's passes with lint, meta check, timing, report entries and dumps."""

    def __init__(self, config: GraphoptConfig, report: CompileReport, dumper: Dumper,
                 example_inputs: Sequence[Any] = ()) -> None:
        self.config = config
        self.report = report
        self.dumper = dumper
        self.example_inputs = list(example_inputs)
        # the inputs' values for passes that evaluate constants (decays, masks) or probe
        # with the real weights; fake ones (Dynamo's DDPOptimizer compiles every split graph
        # after the first with FakeTensors) are unknown: a real probe met them and the moe
        # and attention passes crashed under DDP (a review)
        self.value_inputs = [None if isinstance(x, torch.Tensor) and is_fake(x) else x
                             for x in self.example_inputs]
        if any(x is None and y is not None
               for x, y in zip(self.value_inputs, self.example_inputs)):
            report.notes.append(
                "this graph's example inputs are fake tensors (Dynamo's DDPOptimizer "
                "compiles the split graphs after the first so): passes that need input "
                "values (lightning decays, a mask) leave such sites with the reason, the moe "
                "pass probes with drawn weights; torch._dynamo.config.optimize_ddp = False "
                "compiles the model as one graph")
        self.ran: list[str] = []
        self.joint_extras: dict[str, Any] = {}
        """What joint passes get in ``ctx.extras`` (e.g. sizes observed by remat's
        profile-guided mode)."""

    def run_stage(self, stage: Stage, gm: fx.GraphModule, graph_kind: str, training: bool,
                  snapshots: list[Snapshot] | None = None) -> fx.GraphModule:
        for graph_pass in build_pipeline(self.config, stage):
            record = PassRecord(graph_pass.name, stage, graph_kind, graph_pass.exact)
            self.report.passes.append(record)
            before_code = graph_code(gm) if self.dumper.enabled else ""
            before = op_counts(gm)
            record.nodes_before = len(gm.graph.nodes)
            ctx = PassContext(self.config, graph_kind, training, record,
                              extras={"example_inputs": self.value_inputs}
                              if stage == "pre_autograd" else dict(self.joint_extras))
            start = time.perf_counter()
            try:
                result = run_with_regions(graph_pass, gm, ctx)
                gm = result.gm
                gm.graph.lint()
                gm.recompile()
                missing = [m for g in all_graph_modules(gm) for m in check_meta(g)]
                if missing:
                    raise PassFailedError(f"nodes without meta['val']: {missing[:5]}")
            except ConfigError:
                raise  # the user's input (moe.ep > 1 without a process group): not a pass bug
            except Exception as exc:
                earlier = ", ".join(self.ran) or "none"
                raise PassFailedError(
                    f"pass {graph_pass.name!r} (stage {stage}, {graph_kind} graph) failed: "
                    f"{type(exc).__name__}: {exc}. Passes that ran before it: {earlier}. "
                    f"Work around it with options={{'disable': [{graph_pass.name!r}]}}."
                ) from exc
            record.time_s = time.perf_counter() - start
            self.report.add_time("passes", record.time_s)
            record.nodes_after = len(gm.graph.nodes)
            record.op_delta = count_delta(before, op_counts(gm))
            # a pass's own flag gates what runs after it (meta refresh, the buffer guard):
            # one that changed ops or nodes is recorded as modified whatever it returned (a
            # plugin pass that turned sin into cos said modified=False, a review)
            changed = bool(record.op_delta) or record.nodes_after != record.nodes_before
            if changed and not result.modified:
                self.report.notes.append(
                    f"pass {graph_pass.name!r} returned modified=False but changed the "
                    f"{graph_kind} graph ({record.nodes_before} -> {record.nodes_after} "
                    f"nodes, op counts {record.op_delta}): recorded as modified")
            record.modified = result.modified or changed
            record.exact = graph_pass.exact_for(record)
            self.ran.append(graph_pass.name)
            self.dumper.pass_step(stage, graph_pass.name, graph_kind, before_code, gm)
            if snapshots is not None:
                snapshots.append((graph_pass.name, record.exact, copy_graph_module(gm)))
        return gm


@contextlib.contextmanager
def outside_callers_saved_tensor_hooks() -> Iterator[None]:
    """Run graphopt's compile-time work (and verify) apart from a caller's saved-tensor
    hooks. A first call under the caller's non-reentrant ``torch.utils.checkpoint``
    compiles inside its hooks: tensors saved by probes and re-traces were counted as the
    region's, and the backward's recomputation (no compile) raised "A different number of
    tensors was saved during the original forward and recomputation"; identity hooks keep
    that work out of the caller's. Only then: a graph of ``torch.func.grad``/``vjp``/
    ``jacrev`` disables saved-tensor hooks while it runs and raises under any hooks (as
    with aot_eager inside a checkpoint). The graph's disable and enable calls bracket it;
    a failure between them left hooks disabled for the whole process (every later compile
    and eager checkpoint raised "torch.func... don't yet support saved tensor hooks", a
    review), so the disabled state is restored on the way out."""
    autograd = torch._C._autograd
    disabled = autograd._saved_tensors_hooks_get_disabled_error_message()
    try:
        if autograd._top_saved_tensors_default_hooks(True) is None:
            yield
        else:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                yield
    finally:
        if autograd._saved_tensors_hooks_get_disabled_error_message() != disabled:
            if disabled is None:
                autograd._saved_tensors_hooks_enable()
            else:
                autograd._saved_tensors_hooks_disable(disabled)


def _is_training(example_inputs: Sequence[Any]) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs
    )


def _is_dynamic(gm: fx.GraphModule) -> bool:
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val", node.meta.get("example_value"))
        if isinstance(val, torch.SymInt | torch.SymFloat):
            return True
        if isinstance(val, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in val.shape):
            return True
    return False


def _model_stage(gm: fx.GraphModule, captured: Capture, runner: PassRunner,
                 config: GraphoptConfig, report: CompileReport, dumper: Dumper
                 ) -> tuple[fx.GraphModule, list[Snapshot] | None]:
    """Run the model passes on the captured graph, or fall back to Dynamo's graph (capture
    refused it, or a pass changed an output's shape/dtype/requires_grad)."""
    report.dynamic = _is_dynamic(captured.gm)
    report.graphs["model"] = len(captured.gm.graph.nodes)
    fallback = captured.fallback
    if fallback is None:
        model = captured.gm
        dumper.graph("01_normalized", model, render=True)
        snapshots = [("normalize", True, copy_graph_module(model))] \
            if config.verify.enabled else None
        passed = runner.run_stage("pre_autograd", model, "model", report.training, snapshots)
        try:
            if any(r.modified for r in report.passes):
                refresh_meta(passed, runner.example_inputs)
            problem = check_outputs(gm, passed) or check_gradient_paths(gm, passed)
        except torch._dynamo.exc.RestartAnalysis:
            raise
        except Exception as exc:
            problem = f"a fake run of the rewritten graph failed ({type(exc).__name__}: {exc})"
        if not problem:
            return passed, snapshots
        fallback = (f"model passes ({', '.join(runner.ran)}) changed the graph's outputs: "
                    f"{problem}; their rewrites are dropped (please report this bug)")
        for record in report.passes:  # the sites' records say so too (a review read
            if record.stage == "pre_autograd":  # "rewritten" for dropped rewrites)
                for site in record.sites:
                    if site.action == "rewritten":
                        site.action = "skipped"
                        site.reason = f"rewrite dropped: {problem}; was: {site.reason}"
    else:  # capture refused the graph: no model pass ran; each one's record says why, so
        # a user who asked for one (moe, attention) finds the reason under its name too
        for graph_pass in build_pipeline(config, "pre_autograd"):
            record = PassRecord(graph_pass.name, "pre_autograd", "model", graph_pass.exact)
            record.record("skipped", "whole graph",
                          f"not run: model passes skipped for this graph ({fallback})")
            report.passes.append(record)
    report.fallback = fallback
    warnings.warn(f"graphopt: model passes skipped for this graph: {fallback}. It runs as "
                  "backend='aot_eager' would (joint passes still run); see "
                  "graphopt.last_report()", FallbackWarning, stacklevel=2)
    report.notes.append(f"model passes skipped: {fallback}. The graph went to AOTAutograd "
                        "as Dynamo captured it (aot_eager's path); joint passes still run")
    snapshots = [("dynamo graph", True, copy_graph_module(gm))] \
        if config.verify.enabled else None
    return gm, snapshots


_MAX_TENSORIFY_RETRIES = 4
"""Compiles of one graph after tensorify restarts whose retrace would drop a write (each
restart marks more floats; the tensorify pass may need a round per autograd level)."""


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any],
                  config: GraphoptConfig, *, attempt: int = 0) -> Callable[..., Any]:
    """Run the whole pipeline on one Dynamo graph; returns what Dynamo should call.

    ``attempt``: how many times this same graph was compiled before (see
    :mod:`graphopt.restart`: a tensorify restart whose retrace would drop an in-place
    write compiles the graph again, at most ``_MAX_TENSORIFY_RETRIES`` times).

    Raises:
        CaptureError: Dynamo's graph would lose an in-place write to a 0-d float64 tensor,
            or reads such a tensor's value with ``.item()`` across a write
            (:mod:`graphopt.restart`).
    """
    from graphopt import restart

    report = CompileReport(graph_id=next_graph_id(), options=_options_summary(config))
    register(report)
    dumper = Dumper(config.dump_dir, report.graph_id, report)

    def refuse(error: Exception) -> Exception:
        report.status = f"aborted: {type(error).__name__}"
        dumper.write_report()
        return error

    if attempt:
        report.notes.append(
            f"compiled again (attempt {attempt + 1}) after AOTAutograd's "
            "TensorifyScalarRestartAnalysis: Dynamo's retrace would drop an in-place write "
            "(torch bug; see graphopt.restart)")
    stale = restart.stale_reads(gm)
    if stale:
        raise refuse(restart.stale_read_error(stale))
    dropped = {} if attempt else restart.dropped_writes(gm)  # (a retry's graph has them; the
    # first compile's trace may have written its fakes)
    if dropped:  # a symbol marked by an earlier restart (TensorifyState is global)
        try:
            restart.unmark_dropped(dropped)
        except Exception as exc:
            raise refuse(exc) from None
        report.status = ("restarted by graphopt (Dynamo traces again): Dynamo's graph lacks "
                         f"the in-place write(s) {', '.join(dropped.values())}; unmarked "
                         "their value symbols")
        dumper.write_report()
        raise torch._dynamo.exc.TensorifyScalarRestartAnalysis
    marked = restart.specialized_symbols()
    try:
        return _compile_graph(gm, example_inputs, config, report, dumper)
    except torch._dynamo.exc.TensorifyScalarRestartAnalysis:
        lost = restart.writes_a_retrace_drops(gm)
        if not lost:
            report.status = "restarted by Dynamo: TensorifyScalarRestartAnalysis"
            dumper.write_report()
            raise
        if attempt >= _MAX_TENSORIFY_RETRIES:
            raise refuse(restart.lost_write_error(
                lost, f"AOTAutograd asked to restart {attempt + 1} times")) from None
        new = restart.specialized_symbols() - marked  # the write's symbol and any other
        # floats': the next compile's tensorify pass specializes the others, with guards
        report.status = ("restarted by graphopt (same graph compiled again): AOTAutograd "
                         "raised TensorifyScalarRestartAnalysis, and Dynamo's retrace would "
                         f"drop {', '.join(lost.values())}")
        dumper.write_report()
        try:
            return compile_graph(gm, example_inputs, config, attempt=attempt + 1)
        finally:
            restart.unmark(new)
    except torch._dynamo.exc.RestartAnalysis as exc:
        # Dynamo's control flow (e.g. TensorifyScalarRestartAnalysis: specialize a float and
        # trace again); the next report holds the real compile.
        report.status = f"restarted by Dynamo: {type(exc).__name__}"
        dumper.write_report()
        raise
    except Exception as exc:
        report.status = f"aborted: {type(exc).__name__}"
        dumper.write_report()
        raise


def _compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], config: GraphoptConfig,
                   report: CompileReport, dumper: Dumper) -> Callable[..., Any]:
    start = time.perf_counter()
    report.training = _is_training(example_inputs)
    lowering = get_lowering(config.lowering, example_inputs)
    report.lowering = lowering.name
    dumper.graph("00_dynamo", gm)

    t0 = time.perf_counter()
    captured = capture(gm, example_inputs)
    report.add_time("normalize", time.perf_counter() - t0)
    runner = PassRunner(config, report, dumper, example_inputs)
    from graphopt.passes.attention.match_common import recording_buffer_reads

    with recording_buffer_reads() as buffer_reads:
        model, snapshots = _model_stage(gm, captured, runner, config, report, dumper)
    # only the model passes read the inputs' values; the runner lives on in the lowering's
    # hooks (a lazily compiled backward), which kept the first call's inputs alive (a review)
    runner.example_inputs, runner.value_inputs = [], []
    report.graphs["model_after_passes"] = len(model.graph.nodes)
    if config.remat is not None and config.remat.profile_guided and report.training:
        from graphopt.passes.fx_utils import communicates
        from graphopt.passes.remat import observe_sizes

        talking = [n.name for n in model.graph.nodes
                   if n.op == "call_function" and communicates(n.target, n.args)]
        if talking:  # its collectives would pair with the other ranks' training ones: a
            # rank recompiling alone (a new length) hung the group (a review: EP + FSDP)
            runner.joint_extras["observe_refused"] = (
                f"the graph exchanges data between ranks ({', '.join(talking[:3])}): "
                "running it once at compile time would pair its collectives with the other "
                "ranks' training collectives (a rank that recompiles alone hangs the group)")
        else:
            t0 = time.perf_counter()
            runner.joint_extras["observed_sizes"] = observe_sizes(model, list(example_inputs))
            report.add_time("remat_observe", time.perf_counter() - t0)

    hooks = make_hooks(runner, dumper, report)
    hooked_before = _hooked_time(report)
    t0 = time.perf_counter()
    compiled = lowering.compile(model, example_inputs, hooks, config)
    hooked = _hooked_time(report) - hooked_before
    report.add_time("aot_autograd", time.perf_counter() - t0 - hooked)
    _joint_records_through_cache(model, config, report)
    total = time.perf_counter() - start
    report.timing["total"] = total
    report.timing["graphopt_overhead"] = total - sum(  # (a backward compiled eagerly too)
        report.timing.get(k, 0.0) for k in ("aot_autograd", "lowering", "lowering_backward"))
    report.status = "compiled"
    compiled = _forward_ad_through_dynamo_graph(gm, compiled, model, report, dumper)
    if config.verify.enabled:
        assert snapshots is not None
        if _recompile_that_communicates(model):
            # not "verified at the graph's first compile": that compile may have been another
            # graph (DeepSeek-V3's dense first layer; its MoE layers, the only graphs with
            # the EP op, recompile the same forward and were never checked, a review)
            detail = ("verify: skipped for this recompile: the graph exchanges data between "
                      "ranks (expert-parallel op or collectives) and ranks may recompile "
                      "independently (a shape change on one rank); verifying it on this rank "
                      "alone would wait for ranks that run no verification. This graph's "
                      "numerics are not checked (the frame's first compile was, and may have "
                      "been another graph, e.g. a dense layer before MoE layers)")
            from graphopt.verify import warn_skipped

            report.notes.append(detail)
            report.verify = {"status": "skipped", "detail": detail}
            warn_skipped(report)
        else:
            compiled = _verify_on_first_call(gm, compiled, list(example_inputs), snapshots,
                                             model, config, report, dumper)
    modified = any(r.modified for r in report.passes if r.stage == "pre_autograd")
    if buffer_reads and modified and report.fallback is None:
        compiled = _guard_folded_buffers(gm, compiled, example_inputs, buffer_reads, model,
                                         report, dumper)
    dumper.write_report()  # after every note above (a review: the buffer guard's was missing)
    return compiled


def _guard_folded_buffers(original: fx.GraphModule, compiled: Callable[..., Any],
                          example_inputs: Sequence[Any],
                          reads: dict[int, tuple[str, torch.Tensor]], model: fx.GraphModule,
                          report: CompileReport, dumper: Dumper) -> Callable[..., Any]:
    """``compiled``, guarded on the values of the module buffers the model passes read.

    The attention pass proves masks causal and fits slopes from buffers at compile time
    (``match_common.evaluate``), and Dynamo does not guard buffer values: a buffer changed
    after the compile (``load_state_dict`` of other values, ``m.mask[:, :4] = True``) kept a
    rewrite made for its old value (a review: output 2.5 off, input gradient 102, silently).
    Each call checks that each such input is the same tensor at the same version counter
    and data pointer (microseconds); otherwise its values are compared with a copy taken at
    compile time. Writes that bypass the version counter into the same memory
    (``buffer.data[...] = ...``, through ``numpy()`` or the storage) are not seen, as
    autograd's own checks of saved tensors do not see them; ``.data = new`` is.
    Equal: accepted (and remembered). Different: the call runs Dynamo's graph as captured,
    eagerly (as ``backend="eager"``: correct, uncompiled), with a FallbackWarning once;
    ``torch._dynamo.reset()`` recompiles for the new values. A graph whose passes exchange
    data between ranks (the expert-parallel op) raises GraphoptError instead: Dynamo's
    graph has no such exchange, and the other ranks would wait for it."""
    from graphopt.passes.fx_utils import communicates

    guards = [_BufferGuard(i, reads[id(x)][0], weakref.ref(x), _version(x), _data_ptr(x),
                           x.detach().clone())
              for i, x in enumerate(example_inputs)
              if isinstance(x, torch.Tensor) and id(x) in reads and not is_fake(x)]
    if not guards:
        return compiled
    names = ", ".join(g.name for g in guards)
    report.notes.append(f"values of buffers read at compile time ({names}) are guarded: a "
                        "call where one changed runs Dynamo's graph eagerly")
    warned: list[bool] = []

    def unchanged(args: Sequence[Any]) -> bool:
        for guard in guards:
            x, value = args[guard.index], guard.value
            if isinstance(x, torch.Tensor) and x is guard.ref() and guard.version is not None \
                    and _version(x) == guard.version and _data_ptr(x) == guard.data_ptr:
                continue
            if not (isinstance(x, torch.Tensor) and x.shape == value.shape
                    and x.dtype == value.dtype and bool(torch.equal(x.detach(), value))):
                return False
            guard.ref, guard.version, guard.data_ptr = weakref.ref(x), _version(x), _data_ptr(x)
        return True

    exchanges = any(communicates(n.target, n.args) for n in model.graph.nodes
                    if n.op == "call_function")

    def call(*args: Any) -> Any:
        if unchanged(args):
            return compiled(*args)
        if exchanges:
            raise GraphoptError(
                f"a buffer whose value the model passes read at compile time ({names}) has "
                "changed, and this graph exchanges data between ranks (expert parallelism), "
                "so it cannot fall back to Dynamo's graph on this rank alone: change buffers "
                "before the first call, or call torch._dynamo.reset() on every rank after "
                "changing them")
        approximate = [s.site for p in report.passes for s in p.sites if s.approximate]
        # (a review: a Lightning model whose temperature buffer changed ran softmax
        # attention again; the warning said only "uncompiled")
        other = (f"; the compiled graph held {len(approximate)} APPROXIMATE rewrite(s) "
                 f"({', '.join(approximate[:2])}{', ...' if len(approximate) > 2 else ''}), "
                 "so these calls compute the model as written, a different function"
                 ) if approximate else ""
        _note_fallback_once(warned, report, dumper, (
            f"a buffer whose value the model passes read at compile time ({names}) has "
            "changed; calls with the new value run Dynamo's graph as captured, eagerly "
            f"(uncompiled){other}; torch._dynamo.reset() recompiles for it"))
        return original(*args)

    return call


def _note_fallback_once(warned: list[bool], report: CompileReport, dumper: Dumper,
                        why: str) -> None:
    """The first time a compiled graph's call runs Dynamo's graph instead: note ``why`` in
    the report (and its dump) and warn with a FallbackWarning."""
    if warned:
        return
    warned.append(True)
    report.notes.append(why)
    dumper.write_report()
    warnings.warn(f"graphopt: {why}", FallbackWarning, stacklevel=4)


@dataclasses.dataclass
class _BufferGuard:
    """One guarded buffer input: its position, source name, the tensor last accepted (and
    its version counter) and its value at compile time."""

    index: int
    name: str
    ref: weakref.ref[torch.Tensor]
    version: int | None
    data_ptr: int
    value: torch.Tensor


def _data_ptr(x: torch.Tensor) -> int:
    try:
        return int(x.data_ptr())
    except RuntimeError:  # no storage (a tensor subclass)
        return -1


def _version(x: torch.Tensor) -> int | None:
    """The tensor's version counter (in-place writes bump it); None for inference tensors,
    which have none (their values are compared on every call)."""
    try:
        return int(x._version)
    except RuntimeError:
        return None


def _recompile_that_communicates(model: fx.GraphModule) -> bool:
    """Whether Dynamo is recompiling a frame (not its first compile) whose graph calls an op
    that communicates (``fx_utils.communicates``). A review found verify there hanging:
    only the rank whose batch shape changed recompiled, and its verification's extra
    forward/backward all-to-alls waited for ranks that were in their normal step."""
    from graphopt.passes.fx_utils import communicates

    compile_id = torch._guards.CompileContext.current_compile_id()
    if compile_id is None or not compile_id.frame_compile_id:
        return False
    return any(communicates(n.target, n.args) for n in model.graph.nodes
               if n.op == "call_function")


def _forward_ad_through_dynamo_graph(original: fx.GraphModule, compiled: Callable[..., Any],
                                     model: fx.GraphModule, report: CompileReport,
                                     dumper: Dumper) -> Callable[..., Any]:
    """``compiled``, except for calls with forward-mode AD tangents (``torch.autograd.
    forward_ad`` dual tensors) when the passes put graphopt's custom ops in the graph: those
    ops have backward formulas only, and a custom op whose inputs carry tangents but no
    ``requires_grad`` runs below autograd and drops them (a review: MiniMax's tangent off by
    2.4 of 22 with attention="exact"). Such calls run Dynamo's graph as captured, eagerly
    (ATen ops carry tangents; the Inductor lowering, like ``backend="inductor"``, does not
    on any graph), with a FallbackWarning once. When Dynamo's graph itself calls graphopt's
    ops (user code calling ``lightning_attention``), a call with tangents raises
    NotImplementedError instead."""
    from graphopt.kernels import has_tangent

    def graphopt_ops(gm: fx.GraphModule) -> list[str]:
        return sorted({str(n.target) for g in all_graph_modules(gm) for n in g.graph.nodes
                       if n.op == "call_function" and isinstance(
                           n.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
                       and str(n.target).startswith("graphopt.")})

    ops = graphopt_ops(model)
    if not ops:
        return compiled
    own = graphopt_ops(original)
    warned: list[bool] = []

    def call(*args: Any) -> Any:
        if not has_tangent(*args):
            return compiled(*args)
        if own:
            raise NotImplementedError(
                f"forward-mode AD tangents reach graphopt's ops ({', '.join(own)}), which the "
                "model calls itself and which have no forward-mode formula: use reverse mode "
                "(backward, torch.func.vjp/jacrev)")
        _note_fallback_once(warned, report, dumper, (
            f"forward-mode AD tangents reach graphopt's ops ({', '.join(ops)}), which have no "
            "forward-mode formula: calls with tangents run Dynamo's graph as captured, "
            "eagerly"))
        return original(*args)

    return call


def _joint_records_through_cache(model: fx.GraphModule, config: GraphoptConfig,
                                 report: CompileReport) -> None:
    """On a lowering cache hit the joint passes do not run: report the decisions they made
    when the cache entry was made (stored beside Inductor's cache), or say how to force a
    fresh compile."""
    if report.lowering != "inductor":  # the only lowering with a compile cache
        return
    # the training and the no_grad graph (and static recompiles) share their code: their
    # inputs' shapes, dtypes and grad flags tell them apart (a review saw a warm training
    # graph report the inference graph's records)
    inputs = [(tuple(str(d) for d in v.shape), str(v.dtype), v.requires_grad)
              if isinstance(v := n.meta.get("example_value", n.meta.get("val")), torch.Tensor)
              else repr(type(v)) for n in model.graph.find_nodes(op="placeholder")]
    key = joint_records_key(model.code, repr(config.pass_options), report.lowering,
                            sorted(config.disable), sorted(config.enable), inputs,
                            report.training)
    if {"joint", "forward", "inference"} & set(report.graphs):
        save_joint_records(key, [p for p in report.passes if p.stage == "joint"])
        return
    restored = load_joint_records(key)
    if restored is not None:
        report.passes.extend(restored)
        report.notes.append("forward/backward graphs came from the lowering's compile cache; "
                            "the joint-pass records shown were stored when that entry was "
                            "made")
    else:
        report.notes.append("forward/backward graphs came from the lowering's compile cache; "
                            "joint passes ran when that entry was made, their records are not "
                            "stored: for a fresh compile set torch.compiler.config."
                            "force_disable_caches = True (or TORCHINDUCTOR_FORCE_DISABLE_CACHES"
                            "=1)")


def _owner_grad_inputs(model: fx.GraphModule) -> set[int]:
    """Positions of the graph inputs whose gradients the passes made rank-local by design
    (``OWNER_GRADS`` in the model graph's meta: expert weights under the moe pass's EP)."""
    from graphopt.passes.moe import OWNER_GRADS

    names = model.meta.get(OWNER_GRADS) or set()
    return {i for i, ph in enumerate(model.graph.find_nodes(op="placeholder"))
            if ph.name in names}


def _verify_on_first_call(original: fx.GraphModule, compiled: Callable[..., Any],
                          example_inputs: Sequence[Any], snapshots: list[Snapshot],
                          model: fx.GraphModule, config: GraphoptConfig, report: CompileReport,
                          dumper: Dumper) -> Callable[..., Any]:
    """Verify on the first call, outside Dynamo's compile context (lazy backward compiles
    of some lowerings must not nest in it); errors surface from the model call itself."""
    # what verify needs, dropped once it ran (a review: the first call's inputs, activations
    # after a graph break, stayed alive as long as the compiled code)
    from graphopt.verify import on_placeholders

    state: dict[str, Any] = {"inputs": example_inputs, "snapshots": snapshots,
                             "model": model, "original": original,
                             "placeholders": on_placeholders()}  # examples hold no data
    failed: list[str] = []  # the message, not the exception: its traceback would keep
    # every failing call's frames and inputs alive (a re-review)

    def call(*args: Any) -> Any:
        if failed:  # a VerificationError is not a first-call warning: the graph it
            # found wrong stays refused (a review: later calls returned its results)
            raise VerificationError(failed[0])
        # DDPOptimizer runs each split graph once on fake tensors while Dynamo compiles:
        # not the first real call (verify there ran inside the compile context, a review)
        if state and not on_placeholders() and \
                not any(is_fake(a) for a in args if isinstance(a, torch.Tensor)):
            held = dict(state)
            state.clear()
            try:
                _verify_once(held, args, compiled, config, report, dumper)
            except VerificationError as exc:
                failed.append(str(exc))
                raise
        return compiled(*args)

    return call


def _verify_once(held: dict[str, Any], args: Sequence[Any], compiled: Callable[..., Any],
                 config: GraphoptConfig, report: CompileReport, dumper: Dumper) -> None:
    """:func:`graphopt.verify.verify_compile` on the first real call (``held``: what
    :func:`_verify_on_first_call` kept for it)."""
    from graphopt.verify import verify_compile

    examples, traced = held["inputs"], held["model"]
    # where the example inputs are fake (DDPOptimizer): verify on this call's (cloned) inputs
    fake = any(is_fake(a) for a in examples if isinstance(a, torch.Tensor)) or \
        held["placeholders"]  # compiled on a pipeline's metadata inference: no data either
    t0 = time.perf_counter()
    try:  # isolated from a caller's checkpoint (saved-tensor hooks, SAC's mode):
        with torch.enable_grad() if report.training else torch.no_grad(), \
                outside_callers_saved_tensor_hooks(), \
                torch.utils._python_dispatch._disable_current_modes():
            verify_compile(held["original"], compiled, list(args) if fake else examples,
                           held["snapshots"], config, report,
                           recompile=lambda disabled: _recompile(
                               traced, examples, config, disabled),
                           owner_grads=_owner_grad_inputs(traced))
    finally:
        report.add_time("verify", time.perf_counter() - t0)
        dumper.write_report()


def make_hooks(runner: PassRunner, dumper: Dumper, report: CompileReport) -> AOTHooks:
    def run_joint(g: fx.GraphModule, kind: str) -> fx.GraphModule:
        return runner.run_stage("joint", g, kind, kind == "joint")

    def graph_ready(kind: str, g: fx.GraphModule) -> None:
        report.graphs[kind] = len(g.graph.nodes)
        dumper.graph(kind, g, render=kind != "joint")
        if kind == "backward":  # compiled lazily, after the backend returned
            dumper.write_report()

    def timed_done(key: str) -> None:
        if key == "lowering_backward":  # its time too (a review: the dumped report lacked
            dumper.write_report()  # it without verify, which writes the report again)

    return AOTHooks(run_joint=run_joint, graph_ready=graph_ready, add_time=report.add_time,
                    note=report.notes.append, timed_done=timed_done)


def _hooked_time(report: CompileReport) -> float:
    """graphopt's hooks' and the graph compilers' time inside AOTAutograd's call. The
    backward's compiler counts too: AOTAutograd compiles it inside that call when it does
    not defer it (force_non_lazy_backward_lowering, a cache); aot_autograd held it before,
    and the overhead (total minus both) went negative (a review: -0.93 s)."""
    return sum(report.timing.get(k, 0.0)
               for k in ("passes", "lowering", "lowering_backward", "dump"))


def _recompile(model: fx.GraphModule, example_inputs: Sequence[Any], config: GraphoptConfig,
               disabled_joint: Sequence[str]) -> Callable[..., Any]:
    """Compile the model-pass output again with some joint passes off (verify's bisection)."""
    quiet = dataclasses.replace(config, dump_dir=None, verify=dataclasses.replace(
        config.verify, enabled=False), disable=tuple(config.disable) + tuple(disabled_joint),
        enable=tuple(n for n in config.enable if n not in disabled_joint))
    report = CompileReport(graph_id=-1)
    runner = PassRunner(quiet, report, Dumper(None, -1, report))
    lowering = get_lowering(quiet.lowering, example_inputs)
    return lowering.compile(copy_graph_module(model), example_inputs,
                            make_hooks(runner, Dumper(None, -1, report), report), quiet)


def _options_summary(config: GraphoptConfig) -> dict[str, Any]:
    data = dataclasses.asdict(config)
    data["dump_dir"] = str(config.dump_dir) if config.dump_dir else None
    return data


__all__ = ["GraphoptError", "PassRunner", "compile_graph", "copy_graph_module"]
