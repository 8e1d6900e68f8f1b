"""Apply a ``ParallelPlan`` to a model with torch.distributed's own engine.

Contract: ``parallelize(model, plan)`` shards ``model`` in place over one DeviceMesh
(:mod:`graphopt.parallel.mesh`) and returns it; a forward/backward of the result on this
rank's share of the batch gives the single-process loss and, gathered, its gradients
(checked in float64 by tests/test_parallel.py). What each axis becomes:

- tp (+ sp): DTensor ``parallelize_module`` with the layout graphopt derives from the model's
  data flow (:mod:`graphopt.parallel.tp_layout`): ColwiseParallel readers, RowwiseParallel
  writers, vocab-parallel embedding and LM head; with SP, SequenceParallel norms and
  PrepareModuleInput all-gathers in front of each mixer. SP needs every decoder layer's
  mixers sharded; otherwise TP runs without SP and the report says why.
- dp_shard: FSDP2 ``fully_shard`` per decoder layer and at the root over ``dp_shard_cp``;
  ZeRO-3 reshards parameters after forward, ZeRO-2 keeps them gathered until backward
  (parameters, gradients and optimizer states stay sharded between steps). ZeRO-0/1 keep
  replicas (``replicate``) and, for ZeRO-1, :func:`build_optimizer` shards the optimizer
  states with ``ZeroRedundancyOptimizer`` over the dp_shard group.
- dp_replicate: with dp_shard > 1, HSDP (``fully_shard`` on the 2-D mesh
  dp_replicate x dp_shard_cp: shard inside, all-reduce across); else ``replicate``.
- ep: each rank keeps only its experts (:mod:`graphopt.parallel.expert`: EP folded over
  dp_shard x cp x tp, ``graphopt::moe_experts`` all-to-all dispatch/combine; with
  expert_tp = tp, over dp_shard x cp, each TP rank holding a slice of every expert's FFN
  dim); dense data parallelism ignores the expert parameters, whose gradients are reduced
  over the ranks holding the same experts.
- pp: decoder-layer stages run by torch.distributed.pipelining (:mod:`graphopt.parallel.
  pipeline`); the result is a PipelinedModel trained with its ``step``.
- cp: the sequence split over CP ranks, softmax attention by Ulysses all-to-all
  (:mod:`graphopt.parallel.context`); parameters are replicated over CP (FSDP's shard
  group is dp_shard x cp, DDP's dp x cp).
- recompute_layers / selective_recompute: activation checkpointing per decoder layer
  (:func:`apply_recompute`), as the planner priced it.

Pseudo-code::

    mesh = build_mesh(plan)
    if tp > 1: layout = derive_tp_layout(model); parallelize_module(model, mesh["tp"], ...)
    if dp_shard > 1 and zero >= 2: fully_shard(layers..., root, mesh=dp mesh, reshard=zero==3)
    elif dp > 1: replicate(model, mesh=dp mesh)
    if ep > 1: keep this rank's experts; experts' forward = moe_experts over the EP group
    if recompute: layer.forward = checkpoint(layer.forward, policy) (full or selective)
    report: every parameter with its placements and local shape
"""

from __future__ import annotations

import functools
import os
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from graphopt.errors import ConfigError
from graphopt.parallel.mesh import build_mesh
from graphopt.parallel.tp_layout import (
    CallSite,
    TPLayout,
    derive_tp_layout,
    sequence_reducing_modules,
    sequence_sharded_params,
    splits_nothing,
)
from graphopt.planner.plan import ParallelPlan


@dataclass
class ParallelReport:
    """What :func:`parallelize` did: the plan, the TP layout, what stayed replicated and
    why, and every parameter's placement ``(name, placements, local shape)``."""

    plan: str
    tp_layout: TPLayout | None = None
    sp: bool = False
    notes: list[str] = field(default_factory=list)
    parameters: list[tuple[str, str, tuple[int, ...]]] = field(default_factory=list)
    experts: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """EP: experts module path -> (first expert, end, E) this rank holds."""
    expert_ffn: tuple[int, int] = (0, 1)
    """Tensor-parallel experts (expert_tp > 1): (this rank's slice, expert_tp) of each
    expert's FFN dim (:func:`graphopt.parallel.expert.held_part`)."""
    parallel_plan: ParallelPlan | None = None
    """The plan executed (with the planner's prediction when it came from a search)."""
    mesh: Any = None
    """The DeviceMesh it runs on."""
    step_starts: list[float] = field(default_factory=list)
    """perf_counter() at the start of the first step and of the last 64 (each forward of the
    model, or each PipelinedModel.step): consecutive differences are measured step times."""

    optimizer_steps: list[float] = field(default_factory=list)
    """perf_counter() after each of the last 65 steps of an optimizer over this model's
    parameters: when there are two or more, consecutive differences are the measured step
    times (a step with gradient accumulation has several forwards: timing forwards gave a
    microbatch's time, 52 ms for a 225 ms step, a review)."""

    forwards: int = 0
    """Forward calls (or PipelinedModel.step calls) so far."""
    _forwards_at_step: int = -1

    def record_optimizer_step(self) -> None:
        """Note the end of an optimizer step (an optimizer step post-hook that
        :func:`parallelize` registers); one per forward at most (a wrapping optimizer,
        ZeRO-1's, steps its inner one too)."""
        import time

        if self.forwards == self._forwards_at_step:
            return
        self._forwards_at_step = self.forwards
        self.optimizer_steps.append(time.perf_counter())
        if len(self.optimizer_steps) > 65:
            del self.optimizer_steps[0]

    def record_step_start(self) -> None:
        """Note the start of a training step (perf_counter seconds); called by a forward
        pre-hook that :func:`parallelize` registers, or by ``PipelinedModel.step``."""
        import time

        self.forwards += 1
        self.step_starts.append(time.perf_counter())
        if len(self.step_starts) > 66:  # bounded over a long training run
            del self.step_starts[1]

    def _gaps(self) -> tuple[list[float], str]:
        """(measured step times, what they are between): optimizer steps when two or more
        ran, else the model's forwards (or PipelinedModel.step calls), the first excluded
        (compilation, lazy init)."""
        if len(self.optimizer_steps) >= 2:
            steps = self.optimizer_steps
            return [b - a for a, b in zip(steps, steps[1:])], "steps"
        starts = self.step_starts
        return ([b - a for a, b in zip(starts[1:], starts[2:])],
                "forward calls: no optimizer step over this model seen")

    @property
    def measured_step_s(self) -> float | None:
        """Median time between consecutive optimizer steps (forward + backward + optimizer
        + data, all microbatches), or without optimizer steps between forward calls; None
        before there are two."""
        import statistics

        gaps, _ = self._gaps()
        return statistics.median(gaps) if gaps else None

    def step_time(self) -> str:
        """"predicted X ms (the planner), measured Y ms" for the executed plan."""
        pred = getattr(self.parallel_plan, "prediction", None)
        gaps, between = self._gaps()
        measured = self.measured_step_s
        return (f"step: predicted {pred.step_s * 1e3:.3g} ms" if pred else
                "step: no prediction (a hand-written plan)") + (
            f", measured {measured * 1e3:.3g} ms (median of {len(gaps)} {between})"
            if measured is not None else ", measured: run 3 steps first")

    def to_markdown(self) -> str:
        """The plan, notes, what stayed replicated and a table of parameter placements."""
        lines = [f"# parallel plan: {self.plan}", ""] + [f"- {n}" for n in self.notes]
        if self.tp_layout is not None:
            lines += [f"- kept replicated: `{p}`: {why}" for p, why in
                      self.tp_layout.kept.items()]
        lines += [f"- {self.step_time()}"]
        lines += ["", "| parameter | placements | local shape |", "|---|---|---|"]
        lines += [f"| {n} | {pl} | {tuple(s)} |" for n, pl, s in self.parameters]
        return "\n".join(lines) + "\n"


def parallelize(model: nn.Module, plan: ParallelPlan | str, mesh: Any = None,
                sample: Callable[[], Any] | None = None, moe: Any = None,
                mixed_precision: str | torch.dtype | None = None) -> nn.Module:
    """Shard ``model`` as ``plan`` says (module docstring); returns ``model``, or with
    ``plan.pp > 1`` a :class:`graphopt.parallel.pipeline.PipelinedModel` holding this
    rank's stages (``model`` itself then refuses a forward: keep the returned module).

    Args:
        model: a module on this rank's device, identical on every rank (same seed/weights),
            or on the meta device (a model too large for one rank, torchtitan's flow):
            materialize it after parallelize with ``model.to_empty(device=...)``, make its
            non-persistent buffers and ties again (transformers: ``model.init_weights()``),
            then load weights (``set_model_state_dict(..., full_state_dict=True)`` or
            ``dcp.load`` into :class:`ModelState`); a forward before the buffers are
            written, or with the ties broken, is a ConfigError (docs/parallel.md).
        plan: a ParallelPlan or the path of its JSON (:meth:`ParallelPlan.save`, or the
            output of ``graphopt plan --json``, whose best plan is taken).
        mesh: the DeviceMesh from :func:`graphopt.parallel.build_mesh` (built if None).
        sample: runs one forward of ``model`` on a small input; TP derives its layout from
            it (default: ``model(input_ids=<1 x 8 token ids>, use_cache=False)`` for
            transformers models).
        moe: with ep > 1, the all-to-all choices of ``options["moe"]`` (a dict or
            MoEOptions: ``all_to_all``, ``chunks``, ``ranks_per_node``, ``profile``; ``ep``
            comes from the plan). "auto" (default) is resolved by the cost model at the
            first step.
        mixed_precision: None (compute in the parameters' dtype) or "bf16"/``torch.
            bfloat16``: compute in bf16 while parameters (master weights), gradients,
            their reduction and optimizer states stay float32, as torchtitan's
            ``mixed_precision_param``/``mixed_precision_reduce``: ``torch.autocast``
            around the forward (PP: each stage's), and FSDP2's
            ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)`` too where
            FSDP2 (ZeRO-2/3, HSDP, its replicate) holds the parameters; expert-parallel
            experts compute in the autocast dtype (see :func:`mixed_precision_dtype`).

    Raises:
        ConfigError: an invalid plan, a plan that does not match the world size, an axis
            that is not executed yet, a model TP cannot split (heads, sizes, vocabulary).
    """
    if isinstance(plan, (str, os.PathLike)):
        plan = ParallelPlan.load(plan)
    on_meta = any(p.is_meta for p in model.parameters())
    if not isinstance(plan, ParallelPlan):
        raise ConfigError(f"plan must be a ParallelPlan or the path of its JSON, got "
                          f"{type(plan).__name__}")
    from graphopt.parallel.pipeline import PipelinedModel

    done = getattr(model, "graphopt_parallel", None)
    if done is not None or isinstance(model, PipelinedModel):  # (a review: torch's
        # AssertionError "Each distinct composable distributed API can only be applied to a
        # module once")
        raise ConfigError(f"this model is already parallelized ({getattr(done, 'plan', '')}"
                          f"): parallelize a fresh model, loading its state with "
                          "graphopt.parallel.ModelState (docs/parallel.md, Checkpoints), to "
                          "run another plan")
    unexecuted: list[str] = []  # what is wrong whatever the job raised when it was built
    if plan.recompute_layers:  # (a list was a TypeError below: a review)
        count = len(decoder_layers(model))
        # uneven stages (the plan's stage_layers): the largest stage's layers (the
        # planner's recompute_layers for a layout; a review found llama3-70b's best plan,
        # stages 19/21/21/19 recomputing 21, refused against ceil(80 / 4) = 20)
        per_stage = max(plan.stage_layers) if plan.stage_layers else -(-count // plan.pp)
        if plan.recompute_layers > per_stage:
            unexecuted.append(f"recompute_layers={plan.recompute_layers} exceeds the decoder "
                              f"layers per pipeline rank ({per_stage} of {count})")
    unexecuted += layerdrop_refusal(model, plan)
    compute_dtype = mixed_precision_dtype(mixed_precision, model)
    if unexecuted:
        raise ConfigError("cannot execute this parallel plan: " + "; ".join(unexecuted))
    if plan.zero_stage == 1 and plan.dp_shard > 1 and plan.tp > 1:
        raise ConfigError("ZeRO-1 with tp > 1 is not built yet (ZeroRedundancyOptimizer "
                          "takes plain tensors): use zero_stage=2 or 3 with tp")
    if plan.cp > 1:
        from graphopt.parallel.context import check_cp

        check_cp(model, plan)
        if plan.zero_stage == 1 and plan.dp_shard > 1:
            raise ConfigError("ZeRO-1 with cp > 1 is not executed: use zero_stage 2 or 3")
    if plan.pp > 1:
        from graphopt.parallel.pipeline import check_pipeline

        check_pipeline(model, plan)
        if plan.zero_stage == 1 and plan.dp_shard > 1:
            raise ConfigError("ZeRO-1 with pp > 1 is not executed: use zero_stage 2 or 3")
        why = plan.zero_bubble_refusal()
        if why:
            raise ConfigError(why)
    moe_opts = _moe_options(moe, plan)
    if plan.ep > 1:  # refuse before anything changes
        from graphopt.parallel.expert import check_experts, experts_fsdp_degree, find_experts
        from graphopt.parallel.mesh import check_expert_tp

        found = find_experts(model)
        if not found:
            raise ConfigError(f"ep={plan.ep} but the model has no routed-experts module "
                              "(parameters gate_up_proj [E, 2F, H], down_proj [E, H, F]): "
                              "use ep=1")
        check_expert_tp(plan)
        # FSDP shards the experts over edp_shard where it shards the dense parameters
        edp = experts_fsdp_degree(plan)
        for path, module in found.items():
            check_experts(path, module, plan.ep, plan.expert_tp, edp)
        if plan.zero_stage == 1 and plan.dp_shard > 1:
            raise ConfigError("ZeRO-1 with ep > 1 is not executed (ZeroRedundancyOptimizer "
                              "would broadcast one rank's experts over ranks holding others): "
                              "use zero_stage 2 or 3")
    if plan.zero_stage >= 2 and plan.dp_replicate > 1 and plan.dp_shard * plan.cp == 1:
        # (a review: dp_replicate=2 with ZeRO-3 ran full replicas, describe() said neither)
        raise ConfigError(f"zero_stage={plan.zero_stage} shards over dp_shard (x cp), which "
                          f"is 1 here: dp_replicate={plan.dp_replicate} keeps whole replicas "
                          f"and nothing would be sharded. For FSDP use dp_shard="
                          f"{plan.dp_replicate} (HSDP: dp_replicate x dp_shard), or "
                          "zero_stage=1 for plain data parallelism")
    mesh = mesh if mesh is not None else build_mesh(plan)
    report = ParallelReport(plan.describe(), parallel_plan=plan, mesh=mesh)
    if plan.dp * plan.cp > 1:  # (a review: per-rank batch statistics, replicas drifted)
        from graphopt.parallel.batch_norm import sync_batch_norms

        synced = sync_batch_norms(model, mesh["dp_cp"].get_group())
        if synced:
            report.notes.append(
                f"BatchNorm: {len(synced)} module(s) ({synced[0]}"
                f"{', ...' if len(synced) > 1 else ''}) normalize by the statistics of the "
                f"whole batch over dp={plan.dp}" + (f" x cp={plan.cp}" if plan.cp > 1 else "")
                + " (all-reduced, SyncBatchNorm's semantics on any device; InstanceNorms' "
                "running statistics likewise)")
    before = weakref.WeakValueDictionary({id(p): p for p in model.parameters()})
    if plan.tp > 1:
        layout = derive_tp_layout(model, sample or _default_sample(model), plan.tp)
        report.tp_layout = layout
        if layout.unchecked:  # (a meta-device model's modules above the probe's bound)
            unchecked = (
                f"TP layout of a meta-device model: {len(layout.unchecked)} module(s) "
                f"({', '.join(layout.unchecked[:2])}{', ...' if len(layout.unchecked) > 2 else ''}"
                ") are larger than its value checks materialize (tp_layout.PROBE_PARAMETERS), "
                "so they were split (or run under SP) on a shape-only check: code there that "
                "mixes heads or positions would be split wrongly, silently. Derive the layout "
                "of a smaller copy on a real device once (same code, smaller sizes: "
                "graphopt.parallel.derive_tp_layout) to check it")
            report.notes.append(unchecked)
            warnings.warn(f"graphopt: {unchecked}", stacklevel=2)
        # (a layout with decoder layers but no split mixer, GPT-2's untied head alone:
        # SP's input preparation of its blocks crashed in torch, a review)
        report.sp = plan.sp and bool(layout.layers) and bool(layout.mixers)
        if report.sp and layout.written_in_place:
            raise ConfigError(f"SP cannot run {layout.written_in_place[0]}: its caller writes "
                              "its output in place, which autograd forbids on the sequence "
                              "shard SP hands back (a view from DTensor's to_local); use "
                              "ParallelPlan(..., sp=False)")
        if report.sp and layout.sp_problems:
            raise ConfigError(f"SP cannot run this model: {layout.sp_problems[0]}"
                              + (f" ({len(layout.sp_problems) - 1} more reason(s) in "
                                 "derive_tp_layout(...).sp_problems)"
                                 if len(layout.sp_problems) > 1 else "")
                              + "; use ParallelPlan(..., sp=False)")
        reducing = sequence_reducing_modules(model, layout) if report.sp else []
        if reducing:
            raise ConfigError(f"SP splits the residual stream inside the decoder layers over "
                              f"the sequence, but {reducing[0]} "
                              f"({type(model.get_submodule(reducing[0])).__name__}) computes "
                              "statistics over it outside the mixers TP splits: each TP rank "
                              "would normalize by its sequence shard alone; use "
                              "ParallelPlan(..., sp=False)")
        stray = sequence_sharded_params(model, layout) if report.sp else []
        if stray:
            raise ConfigError(f"SP splits the residual stream inside the decoder layers over "
                              f"the sequence, but {stray[0]} ({len(stray)} parameter(s) in "
                              "all) acts on it outside the norms and the mixers TP splits: "
                              "its gradient would cover one sequence shard per rank; use "
                              "ParallelPlan(..., sp=False)")
        message = splits_nothing(layout, plan.tp) or (
            f"TP={plan.tp} keeps {len(layout.indivisible)} mixer(s) whole on every TP rank "
            f"because tp does not divide their sizes ({'; '.join(layout.indivisible[:2])}"
            f"{' ...' if len(layout.indivisible) > 2 else ''}): choose a tp that divides them "
            "to split them" if layout.indivisible else "")
        if message:
            report.notes.append(message)
            warnings.warn(f"graphopt: {message}", stacklevel=2)
        whole = {m: why for m, why in layout.kept.items()
                 if not any(i.startswith(f"{m}: ") for i in layout.indivisible)}
        if whole:  # (a review: a mixer whose 2-way split fails to run, 3 heads, was kept
            # whole with the reason in the layout only)
            first = next(iter(whole))
            report.notes.append(f"TP={plan.tp} keeps {len(whole)} module(s) whole on "
                                f"every TP rank (replicated, not split), e.g. {first}: "
                                f"{whole[first]}")
        if plan.sp and not report.sp:
            report.notes.append("SP off: no decoder layer has a mixer TP splits")
        elif report.sp and layout.replicated:
            report.notes.append(f"SP: {len(layout.replicated)} replicated module(s) all-gather "
                                "their input and keep their sequence shard of the output")
        _apply_tp(model, layout, mesh["tp"], report.sp)
        from graphopt.parallel.rng import install_tp_regions

        regions = install_tp_regions(model, layout, mesh["tp"].get_local_rank(), report.sp)
        if regions is not None:
            report.notes.append(
                f"TP: random numbers (dropout) drawn per TP rank where TP splits the values "
                f"(in {regions.split_mixers} split mixer(s) between their readers and "
                f"writer" + (", and on the decoder layers' sequence shards under SP"
                             if report.sp else "") + "), and alike on every TP rank "
                "elsewhere (Megatron-LM's model-parallel RNG tracker; graphopt.parallel.rng)")
    if plan.ep > 1:
        from graphopt.parallel.expert import apply_ep, choose_schedule_at_first_step

        assert moe_opts is not None
        auto = moe_opts.all_to_all == "auto" or moe_opts.chunks == "auto"
        report.experts = apply_ep(
            model, plan, mesh, "flat" if auto else moe_opts.all_to_all,
            1 if moe_opts.chunks == "auto" else moe_opts.chunks, moe_opts.ranks_per_node)
        if plan.expert_tp > 1:
            report.expert_ffn = (mesh["tp"].get_local_rank(), plan.expert_tp)
        report.notes.append(f"EP={plan.ep}: this rank holds experts "
                            f"{_expert_ranges(report.experts)}"
                            + (f", each expert's FFN dim split over tp={plan.tp} (expert_tp)"
                               if plan.expert_tp > 1 else
                               f", tokens split over tp={plan.tp}" if plan.tp > 1 else ""))
        if auto:
            choose_schedule_at_first_step(model, plan, moe_opts, report.notes)
        else:
            report.notes.append(f"EP schedule {moe_opts.all_to_all} (chunks "
                                f"{moe_opts.chunks}), set by moe.all_to_all")
        if callable(getattr(model, "generate", None)):
            # every EP rank must join every forward: generate() on a rank whose sequences
            # ended (EOS) stopped calling it and the others waited forever (a review);
            # transformers' synced_gpus keeps such a rank stepping until all are done
            setattr(model, "generate",  # noqa: B010
                    functools.partial(_synced_generate, getattr(model, "generate")))  # noqa: B009
    if plan.cp > 1 and plan.pp == 1:
        from graphopt.parallel.context import apply_cp

        report.notes.append(apply_cp(model, plan, mesh))
    if plan.pp > 1:
        from graphopt.parallel.context import apply_cp
        from graphopt.parallel.pipeline import pipeline

        full = model
        model = pipeline(model, plan, mesh, sp=report.sp)
        if plan.cp > 1:  # after the stages' probe (it compares the model with its stages
            # in one process); the stages pass the chunk's positions themselves
            report.notes.append(apply_cp(full, plan, mesh, hook=False))
        report.notes.append(
            f"PP={plan.pp} ({plan.pp_schedule}, {plan.virtual_stages} stage(s) per rank): "
            "this rank runs " + ", ".join(
                f"stage {p.index} (layers {p.start}..{p.end - 1}"
                + (", embedding" if p.first else "") + (", norm + LM head" if p.last else "")
                + ")" for p in list[Any](model.parts)))
    if plan.recompute_layers or plan.selective_recompute:
        report.notes.append(apply_recompute(model, plan))
    _apply_dp(model, plan, mesh, report, compute_dtype)
    if compute_dtype is not None:
        report.notes.append(_apply_autocast(model, compute_dtype))
    _time_optimizer_steps(model, report)
    _refuse_stale_optimizers(model, before)
    _refuse_unmade_state(model, on_meta)
    if plan.pp > 1:
        model.register_load_state_dict_pre_hook(_refuse_model_names)
    if plan.pp == 1:  # PipelinedModel.step records its own starts (and checks S under SP)
        model.register_forward_pre_hook(lambda *_: report.record_step_start())
        model.register_forward_pre_hook(_microbatch_check(plan.microbatch), with_kwargs=True)
        if report.sp:
            model.register_forward_pre_hook(_sp_length_check(plan.tp, plan.cp,
                                                             plan.cp_kind == "ring"),
                                            with_kwargs=True)
    if plan.tp > 1:
        before_forward, after_forward = _tp_rng_check(mesh["tp"].get_group())
        if plan.pp > 1:  # PipelinedModel.step runs the stages, never its own forward (the
            # check did not run under PP: a re-review)
            step: Callable[..., Any] = model.step  # type: ignore[assignment]

            def checked_step(*args: Any, **kwargs: Any) -> Any:
                before_forward(model, args)
                out = step(*args, **kwargs)
                after_forward(model)
                return out

            object.__setattr__(model, "step", checked_step)
        else:  # outside Dynamo's trace: torch.compile of the whole model traced
            # all_gather_object and died with an internal error (a review)
            model.register_forward_pre_hook(torch.compiler.disable(before_forward))
            model.register_forward_hook(torch.compiler.disable(after_forward))
            if callable(getattr(model, "generate", None)) and report.sp:
                setattr(model, "generate", _sp_generate_refusal)  # noqa: B010
            elif callable(getattr(model, "generate", None)):
                setattr(model, "generate", functools.partial(  # noqa: B010
                    _tp_sampling_check, getattr(model, "generate"),  # noqa: B009
                    model, mesh["tp"].get_group()))
    if plan.cp > 1 and plan.pp == 1:  # (PP: each stage offsets its seed by the CP rank)
        from graphopt.parallel.rng import install_cp_region

        if install_cp_region(model, mesh["cp"].get_local_rank()):
            report.notes.append("CP: random numbers (dropout) drawn per CP rank: each holds "
                                "its chunk of every sequence (graphopt.parallel.rng)")
    names = getattr(model, "original_names", {})
    report.parameters = [(names.get(name, name), _expert_placement(names.get(name, name),
                                                                   report) + _placements(p),
                          tuple(_local(p).shape)) for name, p in model.named_parameters()]
    model.graphopt_parallel = report  # type: ignore[assignment]
    if plan.pp > 1:  # the stages run its modules, never its forward
        # (bound to this module: copy.deepcopy copies hooks, and a copy's own forward is
        # not this one; weakref.ref deep-copies as itself, a re-review)
        full.register_forward_pre_hook(
            functools.partial(_pipelined_forward_refusal, weakref.ref(full)))
    return model


def _pipelined_forward_refusal(original: Any, module: nn.Module, *_: Any) -> None:
    if module is not original():
        return
    # a review: `graphopt.parallelize(model, plan)` with pp > 1 and the result dropped ran
    # the whole model, unpipelined, on every rank without a word
    raise ConfigError("this model was split into pipeline stages (pp > 1): "
                      "graphopt.parallelize returned a PipelinedModel that runs them; "
                      "keep it (model = graphopt.parallelize(model, plan, mesh)) and "
                      "train with model.step(input_ids)")


def _moe_options(moe: Any, plan: ParallelPlan) -> Any:
    """MoEOptions for the plan's EP (its ``ep`` is the plan's); None without EP."""
    from graphopt.passes.moe_options import MoEOptions

    if plan.ep == 1:
        return None
    import dataclasses

    if moe is None or isinstance(moe, dict):
        fields = dict(moe or {})
        if fields.get("ep", plan.ep) != plan.ep:
            raise ConfigError(f"moe.ep ({fields['ep']}) differs from the plan's ep "
                              f"({plan.ep}): drop moe.ep, the plan decides it")
        fields["ep"] = plan.ep
        options = MoEOptions.parse(fields)
    else:
        if moe.ep not in (1, plan.ep):
            raise ConfigError(f"moe.ep ({moe.ep}) differs from the plan's ep ({plan.ep}): "
                              "drop moe.ep, the plan decides it")
        options = dataclasses.replace(moe, ep=plan.ep)
    if options.capacity_factor is not None:  # the plan's EP experts are dropless
        raise ConfigError("moe.capacity_factor / moe.drop_policy: a parallel plan's expert "
                          "parallelism is dropless (graphopt.parallel.expert); token "
                          "dropping applies to the moe pass (torch.compile with "
                          "options={'moe': {'ep': ..., 'capacity_factor': ...}} under "
                          "torchrun, no plan): drop them here")
    return options


def _expert_ranges(held: dict[str, tuple[int, int, int]]) -> str:
    ranges = {(a, b, e) for a, b, e in held.values()}
    return ", ".join(f"{a}..{b - 1} of {e}" for a, b, e in sorted(ranges)) + \
        f" in {len(held)} MoE layer(s)"


def _default_sample(model: nn.Module) -> Callable[[], Any]:
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is None:
        raise ConfigError("tp > 1 needs a sample forward to derive the layout, and this "
                          "model has no config.vocab_size to make token ids from: call "
                          "graphopt.parallelize(model, plan, sample=lambda: "
                          "model(example_input)) yourself (graphopt.compile's 'parallel' "
                          "option runs token ids only)")
    device = next(model.parameters()).device
    ids = torch.arange(8, device=device).remainder(vocab).unsqueeze(0)
    return lambda: model(input_ids=ids, use_cache=False)


def _prepare(site: CallSite, before: Any, after: Any, outputs: int | None = None) -> Any:
    """PrepareModuleInput redistributing the hidden-state argument at ``site`` from
    ``before`` to ``after``; with ``outputs`` (0: one tensor, n: an n-tuple led by the hidden
    states) also the output back from ``after`` to ``before`` (PrepareModuleInputOutput)."""
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleInputOutput

    if site.keyword is not None:
        kw: dict[str, Any] = dict(input_kwarg_layouts={site.keyword: before},
                                  desired_input_kwarg_layouts={site.keyword: after})
    else:
        layouts = (None,) * (site.position or 0)
        kw = dict(input_layouts=(*layouts, before), desired_input_layouts=(*layouts, after))
    if outputs is None:
        return PrepareModuleInput(**kw, use_local_output=True)
    rest: tuple[Any, ...] = (None,) * (outputs - 1) if outputs else ()
    return PrepareModuleInputOutput(
        **kw, use_local_input=True, output_layouts=(after, *rest) if outputs else after,
        desired_output_layouts=(before, *rest) if outputs else before, use_local_output=True)


def _apply_tp(model: nn.Module, layout: TPLayout, tp_mesh: Any, sp: bool) -> None:
    """Megatron-style TP (+ SP) through ``parallelize_module`` (module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    # A mixer inside a module SP keeps replicated (DeepSeek-V3's shared experts in its MoE
    # block) gets the whole sequence from that module's gather: plain TP there (no input
    # gather, an all-reduced output); preparing it for SP too gathered the already whole
    # sequence again and counted its weight gradients tp times.
    nested = {m for m in layout.mixers if any(m.startswith(r + ".") for r in layout.replicated)}
    plan: dict[str, Any] = {p: ColwiseParallel() for p in layout.colwise}
    plan.update({p: SequenceParallel(sequence_dim=dim, use_local_output=True)
                 for p, dim in layout.head_norms.items()})
    plan.update({p: RowwiseParallel(output_layouts=Shard(1) if sp and p.rsplit(".", 1)[0]
                                    not in nested else Replicate())
                 for p in layout.rowwise})
    if layout.embedding is not None:
        plan[layout.embedding] = RowwiseParallel(input_layouts=Replicate(),
                                                 output_layouts=Replicate())
        assert layout.lm_head is not None  # found together with the embedding
        plan[layout.lm_head] = ColwiseParallel(
            input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate())
    if sp:
        plan.update({p: SequenceParallel(use_local_output=True) for p in layout.norms})
        plan.update({p: _prepare(site, Shard(1), Replicate())
                     for p, site in layout.mixers.items() if p not in nested})
        plan.update({p: _prepare(site, Shard(1), Replicate(), outputs)
                     for p, (site, outputs) in layout.replicated.items()})
        first = next(iter(layout.layers))  # the replicated embedding output -> its shard
        plan[first] = _prepare(layout.layers[first], Replicate(), Shard(1))
        if layout.lm_head is None:
            raise ConfigError("SP needs the LM head sharded to gather the sequence back; this "
                              "model's head stays replicated (a tied embedding/head pair stays "
                              "replicated under TP): use ParallelPlan(..., sp=False)")
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    parallelize_module(model, tp_mesh, plan)
    for name, param in model.named_parameters():
        # torch 2.13's SequenceParallel replicates a norm's weight as a new nn.Parameter,
        # requires_grad=True whatever the original's: frozen norms were trained (a review:
        # Llama's RMSNorms with SP, Qwen3's q_norm / k_norm with or without)
        if name in frozen:
            param.requires_grad_(False)
    for param in model.parameters():
        if param.requires_grad:  # frozen parameters get no gradient (and torch refuses the
            param.register_post_accumulate_grad_hook(_grad_like_param)  # hook: a review)


def _batch_input(args: tuple, kwargs: dict) -> Any:
    """A model forward's token input: input_ids (or inputs_embeds) [B, S, ...], by keyword or
    as the first tensor argument; None when there is none."""
    x = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    if x is None:
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return x


def _refuse_stale_optimizers(model: Any, before: Any) -> None:
    """An optimizer built before :func:`parallelize` holds the parameters FSDP/TP replaced
    by sharded ones: its steps update tensors the model no longer uses, and nothing trained
    (a re-review: parameters unchanged, no warning). A global optimizer step pre-hook
    raises ConfigError at the first step of such an optimizer (weak references only)."""
    now = {id(p) for p in model.parameters()}
    replaced = weakref.WeakValueDictionary(
        {k: p for k, p in before.items() if k not in now})
    if not len(replaced):
        return
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def hook(optimizer: Any, *_: Any) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if replaced.get(id(p)) is p:
                    raise ConfigError(
                        "this optimizer holds parameters that graphopt.parallelize replaced "
                        "with sharded ones (FSDP/TP): its steps would update tensors the "
                        "model no longer uses. Build the optimizer after parallelize, from "
                        "the model's parameters (graphopt.parallel.build_optimizer, or "
                        "optimizer_for)")

    register_optimizer_step_pre_hook(hook)


def _time_optimizer_steps(model: nn.Module, report: ParallelReport) -> None:
    """Record the end of every optimizer step over ``model``'s parameters in ``report``
    (a global optimizer step post-hook holding weak references only)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    ours = {id(p) for p in model.parameters()}  # (tensors compare by value: no WeakSet)
    box = weakref.ref(report)

    def hook(optimizer: Any, *_: Any) -> None:
        held = box()
        if held is not None and any(id(p) in ours for g in optimizer.param_groups
                                    for p in g["params"][:1]):
            held.record_optimizer_step()

    register_optimizer_step_post_hook(hook)


def _microbatch_check(microbatch: int) -> Callable[..., None]:
    """Forward pre-hook (pp = 1): warn once when a forward with gradients (training; models
    are often trained in eval mode, without dropout) gets more sequences than
    the plan's ``microbatch``. The planner prices B / (dp x microbatch) accumulated
    microbatches and the activations of one; a whole local batch at once holds them all (a
    review: 3.8-9.7x the predicted activation bytes; Llama 3 8B on 64 H100 at 8k tokens,
    predicted 34 GB, about 487 GB fed the docs' way then)."""
    warned: list[bool] = []

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = _batch_input(args, kwargs)
        if warned or not torch.is_grad_enabled() or \
                not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[0] <= microbatch:
            return
        warned.append(True)
        warnings.warn(f"graphopt: this training forward got {x.shape[0]} sequences, the "
                      f"plan's microbatch is {microbatch}: the plan's memory prediction "
                      "assumes the local batch is run as microbatches of that size with "
                      "gradients accumulated (split it: for mb in graphopt.parallel."
                      "microbatches(model, local): (loss(mb) * len(mb) / len(local))"
                      ".backward(); docs/parallel.md)", stacklevel=2)
    return hook


def _rng_digest(device: torch.device) -> str:
    """A digest of this process's CPU random state and, on an accelerator, ``device``'s
    (under PP the stages seed their draws from the CPU one:
    graphopt.parallel.pipeline.DecoderStage.random_stream)."""
    import hashlib

    states = [torch.get_rng_state()]
    if device.type != "cpu":
        try:
            states.append(torch.get_device_module(device).get_rng_state(device))
        except (AttributeError, TypeError, RuntimeError):
            pass  # a device whose generator state cannot be read here: the CPU's alone
    return hashlib.sha1(b"".join(s.cpu().numpy().tobytes() for s in states)).hexdigest()


def _rng_states_differ(module: nn.Module, group: Any) -> tuple[torch.device, str, bool]:
    """(the module's device, this rank's :func:`_rng_digest` there, whether the ranks of
    ``group`` hold different digests). Collective: one all-gather over ``group``."""
    import torch.distributed as dist

    local = next((_local(p) for p in module.parameters()), None)
    device = local.device if local is not None else torch.device("cpu")
    digest = _rng_digest(device)
    states: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(states, digest, group=group)
    return device, digest, len(set(states)) > 1


def _tp_rng_check(group: Any) -> tuple[Callable[..., None], Callable[..., None]]:
    """(before, after) the first training forward: the TP ranks must draw alike (replicated
    regions compute the same values on every TP rank), so where that forward draws random
    numbers (dropout, Mixtral's router jitter noise, any op that advances a generator) the
    ranks' random states must have agreed before it (the split regions seed from that
    shared state and the TP rank: graphopt.parallel.rng). TP ranks seeded by global rank
    (a data-parallel habit) drew
    different masks and their replicated parameters drifted apart, silently (a review:
    gradients up to 1.49 apart). Whether the forward draws is read from the generators
    themselves (a later review: the check looked for modules named ``*dropout*`` and missed
    ``router_jitter_noise``, router gradients 0.28 apart)."""
    import torch.distributed as dist

    pending: dict[str, Any] = {}
    done: list[bool] = []

    def before(module: nn.Module, args: tuple) -> None:
        if done or pending or not module.training or not torch.is_grad_enabled():
            return
        device, digest, differ = _rng_states_differ(module, group)
        for part in getattr(module, "parts", ()):  # PP: whether a stage drew is its own
            part.drew = False  # record (each stage call draws its seed from the generator)
        pending.update(device=device, digest=digest, differ=differ)

    def after(module: nn.Module, *_: Any) -> None:
        if not pending:
            return
        device, digest, differ = pending["device"], pending["digest"], pending["differ"]
        pending.clear()
        done.append(True)
        drew: list[Any] = [None] * dist.get_world_size(group)
        parts = getattr(module, "parts", None)
        mine = any(p.drew for p in parts) if parts is not None else \
            _rng_digest(device) != digest
        dist.all_gather_object(drew, mine, group=group)
        if differ and any(drew):
            raise ConfigError(
                "the training forward draws random numbers (dropout, router jitter noise, "
                "...) and the TP ranks' random states differ: the ranks of a TP group must "
                "draw alike where TP keeps values replicated, or their replicated parameters "
                "drift apart. Seed every rank of a TP group alike before the first step "
                "(e.g. torch.manual_seed(seed + data-parallel rank), not seed + global "
                "rank), or train without dropout or noise")
    return before, after


def _sp_generate_refusal(*args: Any, **kwargs: Any) -> Any:
    """``generate`` of a model parallelized with SP: raises ConfigError. Decoding feeds one
    token per step, which SP cannot split over the TP ranks (a review: the prefill ran, then
    the first decoding step failed with "pad to a multiple of tp")."""
    raise ConfigError("generate() under sequence parallelism (SP): decoding feeds one token "
                      "per step, which SP cannot split over the TP ranks. Parallelize the "
                      "model for generation with ParallelPlan(..., sp=False) (the same TP "
                      "weights: load them through graphopt.parallel.checkpoint.ModelState)")


def _sp_length_check(tp: int, cp: int = 1, ring: bool = False) -> Callable[..., None]:
    """Forward pre-hook: under SP the sequence is split over the TP ranks; a length tp does
    not divide would make the ranks' collectives disagree (gloo aborts the process). Under
    CP the length seen is this rank's chunk: the message names the whole sequence's
    requirement (cp x tp, 2 x cp x tp for the ring), not the chunk's (a review: "length 9
    is not divisible by tp=2" for a sequence of 18)."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = _batch_input(args, kwargs)
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] % tp:
            if cp > 1:
                parts = (2 if ring else 1) * cp * tp
                raise ConfigError(
                    f"this rank's CP chunk of {x.shape[1]} tokens is not divisible by tp={tp} "
                    f"under SP (each chunk is split over the TP ranks): pad the sequence to "
                    f"a multiple of {parts} ({'2 x ' if ring else ''}cp={cp} x tp={tp}) "
                    "before shard_sequence, or use ParallelPlan(..., sp=False)")
            raise ConfigError(f"sequence length {x.shape[1]} is not divisible by tp={tp} "
                              "under SP (the sequence is split over the TP ranks): pad to a "
                              "multiple of tp or use ParallelPlan(..., sp=False)")
    return hook


def _grad_like_param(param: torch.Tensor) -> None:
    """Keep a gradient sharded like its parameter. DTensor's embedding backward returns the
    vocab-parallel table's gradient Replicate (full size on every rank); resharding it at
    once keeps gradient memory what the plan's memory model says."""
    grad: Any = param.grad
    placements = getattr(param, "placements", None)
    if grad is not None and placements is not None and grad.placements != placements:
        param.grad = grad.redistribute(placements=placements)


def apply_recompute(model: nn.Module, plan: ParallelPlan) -> str:
    """Activation recomputation as the plan prices it (graphopt.planner.perf): on each
    pipeline rank (the whole model without PP), ``plan.recompute_layers`` decoder layers are
    fully recomputed (MoE layers first, the planner's "largest layers"; then in order, as
    Megatron-LM's "block" method), and with ``plan.selective_recompute`` the others keep
    only :data:`graphopt.planner.model.SELECTIVE_SAVE`'s outputs (torchtitan's per-op
    policy). Each layer's ``forward`` runs under non-reentrant ``torch.utils.checkpoint``
    (module hooks: TP/SP, FSDP, stay outside it, as torchtitan's checkpoint_wrapper inside
    fully_shard); ops exchanging data between ranks are saved, not recomputed. Only while
    gradients are enabled. Returns a note for the report."""
    parts = getattr(model, "parts", None)
    layers = [b for p in parts for b in p.layers.values()] if parts is not None \
        else decoder_layers(model)
    moe = [any(getattr(m, "gate_up_proj", None) is not None for m in b.modules())
           for b in layers]
    order = sorted(range(len(layers)), key=lambda i: (not moe[i], i))
    full = set(order[:plan.recompute_layers])
    for i, block in enumerate(layers):
        if i in full or plan.selective_recompute:
            block.forward = functools.partial(  # type: ignore[method-assign]
                _checkpointed, block.forward, i in full)
    return (f"activation recomputation: {len(full)} of this rank's {len(layers)} decoder "
            "layers fully" + (f", the other {len(layers) - len(full)} selectively "
                              "(GEMM/attention outputs kept)" if plan.selective_recompute
                              else "") + " (non-reentrant torch.utils.checkpoint per layer)")


LAYERDROP_OPTIONS = ("layerdrop", "decoder_layerdrop", "encoder_layerdrop")


def layerdrop_refusal(model: nn.Module, plan: ParallelPlan) -> list[str]:
    """Why ``plan`` cannot run ``model``'s LayerDrop: one message naming the config
    options and the fix, or [] (no LayerDrop > 0 in ``model.config``, or one rank per
    axis but TP). Raises nothing; :func:`parallelize` raises the ConfigError.

    LayerDrop (Fan et al. 2019; OPT's, BART's ``layerdrop``) skips each layer on a
    random draw per forward. Ranks drawing apart (DP ranks seeded apart, CP's per-rank
    region, EP) skip different layers, and the per-layer collectives (FSDP's gathers, DDP's
    reductions, CP's and EP's exchanges) wait for each other forever (a review: OPT under
    CP with dropout hung in an FSDP all-gather). TP alone is fine: its ranks are seeded
    alike (checked at the first training forward)."""
    config = getattr(model, "config", None)
    drops = {name: getattr(config, name, 0) for name in LAYERDROP_OPTIONS}
    drops = {name: p for name, p in drops.items() if isinstance(p, int | float) and p > 0}
    if not drops or max(plan.dp, plan.cp, plan.pp, plan.ep) == 1:
        return []
    return [f"LayerDrop ({', '.join(f'{k}={v}' for k, v in drops.items())}) skips layers on "
            "each rank's own random draw, and the ranks' per-layer collectives would then "
            "wait for each other forever: set it to 0 in the model's config to train with "
            "data, context, pipeline or expert parallelism"]


def _tp_sampling_check(generate: Callable[..., Any], model: nn.Module, group: Any,
                       *args: Any, **kwargs: Any) -> Any:
    """transformers' ``generate`` under TP, refusing to sample (``do_sample``) from TP ranks
    whose random states differ: each rank would draw other tokens and the vocabulary-split
    embedding would then sum different tokens' rows, silently (a review: ranks seeded by
    global rank diverged after 3 tokens). The training forward's check
    (:func:`_tp_rng_check`) does not see this: sampling draws outside the forward.

    Raises:
        ConfigError: sampling, with the TP ranks' random states different (on every rank).
    """
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    if kwargs.get("do_sample", getattr(config, "do_sample", False)):
        if _rng_states_differ(model, group)[2]:
            raise ConfigError(
                "generate(do_sample=True) under TP with the TP ranks' random states "
                "different: each rank would sample other tokens. Seed every rank of a TP "
                "group alike before generating (e.g. torch.manual_seed(seed + "
                "data-parallel rank)), or generate greedily")
    return generate(*args, **kwargs)


def _synced_generate(generate: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """transformers' ``generate`` with ``synced_gpus=True`` unless the caller set it."""
    kwargs.setdefault("synced_gpus", True)
    return generate(*args, **kwargs)


_CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "cache", "layer_past")


def _checkpointed(forward: Callable[..., Any], full: bool, *args: Any, **kwargs: Any) -> Any:
    """``forward(*args, **kwargs)`` under activation checkpointing (:func:`apply_recompute`).

    A KV cache given to the layer would be updated again by the recomputation (transformers
    makes a ``DynamicCache`` whenever ``use_cache`` is on, its configs' default: a review
    saw every recompute plan fail in the backward with torch's "index 4 encountered during
    backward but not found in storage"). Found by name, given by keyword or by position
    (GPT-2's blocks take it positionally, a re-review):
    - a cache that holds nothing for this layer yet (the one transformers made for this
      forward) is not passed (``use_cache=False``), as transformers' own gradient
      checkpointing does, in training or in eval mode with gradients on; warned;
    - a cache holding a prefix for this layer (``get_seq_length(layer_idx) > 0``) is kept
      and the layer is not recomputed (the prefix's keys are part of the attention, and
      dropping them broke the shapes: transformers' gradient checkpointing fails there);
      warned.

    A layer with nothing to differentiate (no input and no parameter requiring a gradient:
    the frozen first layers of a fine-tuning) runs as is: its forward keeps nothing for a
    backward, and the checkpoint around it made graphopt.compile's AOTAutograd take its
    inference path, which refused the policy's tags ("RNG ops in recompute regions", in a
    model without random ops: a review)."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    module = getattr(forward, "__self__", None)
    if isinstance(module, nn.Module) and not any(
            p.requires_grad for p in module.parameters()) and not any(
            isinstance(t, torch.Tensor) and t.requires_grad
            for t in torch.utils._pytree.tree_leaves((args, kwargs))):
        return forward(*args, **kwargs)
    args, kwargs, cached, prefix = _without_empty_cache(forward, args, kwargs)
    if prefix:
        warnings.warn("graphopt: a layer under activation recomputation was given a KV "
                      "cache holding a prefix; the recomputation would update it again, so "
                      "the layer runs as is, not recomputed (more activation memory than "
                      "the plan priced)", UserWarning, stacklevel=2)
        return forward(*args, **kwargs)
    if cached:
        warnings.warn(f"graphopt: activation recomputation replays each layer in the "
                      f"backward, so the layers run without their KV cache ({cached} not "
                      "passed, use_cache=False), as transformers' gradient checkpointing "
                      "does; pass use_cache=False to train without one",
                      UserWarning, stacklevel=2)
    from torch.utils.checkpoint import checkpoint

    from graphopt.planner.model import selective_checkpoint_context

    return checkpoint(forward, *args, use_reentrant=False,
                      context_fn=functools.partial(selective_checkpoint_context, full),
                      **kwargs)


def _without_empty_cache(forward: Callable[..., Any], args: tuple[Any, ...],
                         kwargs: dict[str, Any]
                         ) -> tuple[tuple[Any, ...], dict[str, Any], str, bool]:
    """(args, kwargs with a KV cache that holds nothing for this layer set to None and
    ``use_cache`` False, the cache argument's name or "", whether a cache holds a prefix
    for this layer: then nothing is changed). Positional arguments are named through
    ``forward``'s signature."""
    import inspect

    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):  # no signature: keyword arguments only
        parameters = []  # type: ignore[assignment]
    names = [p.name for p in parameters
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:len(args)]
    given = {**dict(zip(names, args)), **kwargs}
    found = [name for name in _CACHE_ARGUMENTS if given.get(name) is not None]
    if not found:
        return args, kwargs, "", False
    module = getattr(forward, "__self__", None)
    index = next((m.layer_idx for m in (module.modules() if module is not None else ())
                  if isinstance(getattr(m, "layer_idx", None), int)), None)
    for name in found:
        length = getattr(given[name], "get_seq_length", None)
        if index is not None and callable(length) and length(index) > 0:
            return args, kwargs, "", True
    changes = {**dict.fromkeys(found), **({"use_cache": False} if "use_cache" in given
                                          else {})}
    positional = list(args)
    for i, name in enumerate(names):
        if name in changes:
            positional[i] = changes.pop(name)
    return tuple(positional), {**kwargs, **changes}, ", ".join(found), False


def mixed_precision_dtype(value: str | torch.dtype | None, model: nn.Module
                          ) -> torch.dtype | None:
    """The compute dtype of ``parallelize(..., mixed_precision=value)``: None or bf16.

    Raises:
        ConfigError: an unknown value; fp16 (it needs loss scaling, not built); parameters
            that are not float32 (mixed precision keeps float32 master weights).
    """
    if value is None:
        return None
    if value in ("bf16", "bfloat16", torch.bfloat16):
        dtype = torch.bfloat16
    elif value in ("fp16", "float16", torch.float16):
        raise ConfigError("mixed_precision='fp16' needs loss scaling, which "
                          "graphopt.parallelize does not run for you: use 'bf16', or your own "
                          "torch.autocast(dtype=torch.float16) with graphopt.parallel."
                          "GradScaler (torch's checks one rank's gradients for inf)")
    else:
        raise ConfigError(f"mixed_precision must be None or 'bf16', got {value!r}")
    wrong = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
    if wrong:
        raise ConfigError(f"mixed_precision='bf16' keeps float32 master weights, but the "
                          f"model has {', '.join(wrong)} parameters: load it in float32 "
                          "(model.float()), or train in its dtype without mixed_precision")
    return dtype


def _mp_policy(dtype: torch.dtype | None) -> dict[str, Any]:
    """FSDP2's ``mp_policy`` keyword for the compute dtype (none without one)."""
    if dtype is None:
        return {}
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return {"mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)}


def _apply_autocast(model: nn.Module, dtype: torch.dtype) -> str:
    """``torch.autocast`` around the model's forward (PP: each stage's), also where FSDP2
    casts the parameters: a model's float32 buffers meet bf16 activations there (MiniMax's
    decay tables: "expected m1 and m2 to have the same dtype" under FSDP2's param_dtype
    alone), and autocast keeps norms and softmax in float32. Returns a note."""
    from torch.distributed._composable.replicate_with_fsdp import ReplicateModule
    from torch.distributed.fsdp import FSDPModule

    parts = list(getattr(model, "parts", []))
    fsdp = any(isinstance(u, (FSDPModule, ReplicateModule)) for u in parts or [model])
    for unit in parts or [model]:
        unit.forward = functools.partial(_autocast_forward, unit.forward, unit, dtype)
    if parts:  # checked before the schedule, where every rank raises together (a
        # re-review: stage 0 raised inside it and stage 1 waited for its activations)
        setattr(model, "compute_dtype", dtype)  # noqa: B010
    return (f"mixed precision: {dtype} compute (torch.autocast around the "
            + ("stages'" if parts else "model's") + " forward"
            + (", FSDP2 MixedPrecisionPolicy param_dtype: bf16 parameter all-gathers, "
               "float32 gradient reduction" if fsdp else "")
            + "), float32 master weights, gradients and optimizer states")


def check_outer_autocast(device: str, dtype: torch.dtype) -> None:
    """Raise ConfigError when the caller's ``torch.autocast`` on ``device`` computes in
    another dtype than ``mixed_precision``'s ``dtype``: the inner autocast would win without
    a word (a review: a user's autocast(float16) around a mixed_precision="bf16" model ran
    bf16). PipelinedModel.step checks it before its schedule, on every rank together."""
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) != dtype:
        raise ConfigError(
            f"the model was parallelized with mixed_precision computing in {dtype}, but "
            f"it is called inside torch.autocast(dtype={torch.get_autocast_dtype(device)}); "
            "one of them has to go: drop the outer autocast, or parallelize without "
            "mixed_precision and keep your own autocast (with graphopt.parallel.GradScaler "
            "for float16)")


def _autocast_forward(forward: Callable[..., Any], unit: nn.Module, dtype: torch.dtype,
                      *args: Any, **kwargs: Any) -> Any:
    # the parameters' device now: a model parallelized on the meta device (or moved
    # after) autocasts where it runs (a review: "unsupported autocast device_type 'meta'")
    device = next((p.device.type for p in unit.parameters()), "cpu")
    check_outer_autocast(device, dtype)
    with torch.autocast(device, dtype=dtype):
        return forward(*args, **kwargs)


def _apply_dp(model: nn.Module, plan: ParallelPlan, mesh: Any, report: ParallelReport,
              dtype: torch.dtype | None = None) -> None:
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import fully_shard

    shard = plan.dp_shard * plan.cp > 1 and plan.zero_stage >= 2
    experts: set[nn.Parameter] = set()
    plain_ddp = False  # torch's composable replicate (DDP), which builds itself lazily
    if plan.ep > 1:  # the experts' own reduction first: FSDP2 then skips them
        from graphopt.parallel.expert import expert_params, find_experts, reduce_expert_grads

        report.notes.append(reduce_expert_grads(model, plan, mesh, shard, dtype))
        experts = {p for p in expert_params(model) if not hasattr(p, "placements")}
    fsdp_kwargs: dict[str, Any] = {"ignored_params": experts} if experts else {}
    fsdp_kwargs.update(_mp_policy(dtype))
    units = list(getattr(model, "parts", [model]))  # PP: each stage is an FSDP root
    if shard:
        dp_mesh = mesh["dp_replicate", "dp_shard_cp"] if plan.dp_replicate > 1 \
            else mesh["dp_shard_cp"]
        for unit in units:
            blocks = _blocks(unit)
            # a block run at two depths (weights shared across depth) is no FSDP unit of
            # its own: the root's unit holds it, gathered for the whole forward and reduced
            # once (fully_shard on it twice was torch's AssertionError: a review)
            shared = [b for i, b in enumerate(blocks) if any(b is c for c in blocks[:i])]
            for block in blocks:
                if not any(block is b for b in shared):
                    fully_shard(block, mesh=dp_mesh,
                                reshard_after_forward=plan.zero_stage == 3, **fsdp_kwargs)
            if shared:
                report.notes.append(f"FSDP: {len(shared)} decoder layer(s) appear twice in "
                                    "the layer list (shared weights): sharded with the root, "
                                    "not as units of their own")
            fully_shard(unit, mesh=dp_mesh, reshard_after_forward=plan.zero_stage == 3,
                        **fsdp_kwargs)
        kind = "HSDP" if plan.dp_replicate > 1 else "FSDP"
        report.notes.append(f"{kind} (ZeRO-{plan.zero_stage}) over {dp_mesh.mesh_dim_names}")
    elif plan.dp * plan.cp > 1 and plan.pp > 1:  # replicas of each stage
        for unit in units:
            replicate(unit, mesh=mesh["dp_cp"], **fsdp_kwargs)
        report.notes.append(f"replicas (FSDP2 replicate) of each stage over dp={plan.dp}"
                            + (f" x cp={plan.cp}" if plan.cp > 1 else ""))
    elif plan.dp * plan.cp > 1 and plan.tp == 1:  # DDP: plain tensors (ZeRO-1's input)
        from torch.distributed._composable import replicate as ddp

        ddp(model, process_group=mesh["dp_cp"].get_group(),
            ignored_modules=list(find_experts(model).values()) if experts else None)
        plain_ddp = True
        report.notes.append(f"replicas over dp={plan.dp}" + (
            f" x cp={plan.cp}" if plan.cp > 1 else "") + (
            " + ZeRO-1 optimizer sharding (build_optimizer)" if plan.dp_shard > 1 and
            plan.zero_stage == 1 else ""))
    elif plan.dp * plan.cp > 1:  # with TP: FSDP2's replicate handles DTensor parameters
        replicate(model, mesh=mesh["dp_cp"], **fsdp_kwargs)
        report.notes.append(f"replicas (FSDP2 replicate) over dp={plan.dp} x cp={plan.cp}")
    if plan.zero_stage == 2 and _fsdp_units(model):
        _keep_zero2_sharded_when_idle(model)
    if plan.dp * plan.cp > 1:
        _refuse_inference_mode_first(model)
    if plan.dp * plan.cp > 1 or plan.tp > 1:
        _refuse_parameter_changes(model, plain_ddp, plan.dp * plan.cp > 1)
        model.register_load_state_dict_pre_hook(_refuse_whole_tensors)
        if callable(getattr(model, "resize_token_embeddings", None)) and not plain_ddp:
            object.__setattr__(model, "resize_token_embeddings", _refused_resize)


def _refused_resize(*args: Any, **kwargs: Any) -> Any:
    """transformers' ``resize_token_embeddings`` on a model whose embedding FSDP2 or TP made
    a DTensor (a review: torch's "got mixed torch.Tensor and DTensor" from inside)."""
    raise ConfigError("resize_token_embeddings after graphopt.parallelize is not executed "
                      "(the embedding and LM head are sharded DTensors): resize the model "
                      "before parallelize")


def _refuse_whole_tensors(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                          *_: Any) -> None:
    """``load_state_dict`` pre-hook of a parallelized model: ConfigError naming the fix when
    ``state_dict`` holds plain tensors for parameters FSDP2 or TP made DTensors (a one-process
    state dict; a review: torch's "mixed torch.Tensor and DTensor" from deep inside, or with
    ``assign=True`` an AttributeError at the next forward)."""
    from torch.distributed.tensor import DTensor

    plain = [name for name, p in module.named_parameters() if isinstance(p, DTensor) and
             isinstance(state_dict.get(prefix + name), torch.Tensor) and
             not isinstance(state_dict[prefix + name], DTensor)]
    if plain:
        raise ConfigError(
            f"load_state_dict got whole (plain) tensors for {len(plain)} parameter(s) this "
            f"plan shards as DTensors ({', '.join(plain[:3])}{', ...' if len(plain) > 3 else ''}"
            "): load a one-process state dict into the model before graphopt.parallelize, "
            "or here with torch.distributed.checkpoint.state_dict.set_model_state_dict("
            "model, sd, options=StateDictOptions(full_state_dict=True)), which shards it "
            "(FSDP/TP; under EP: dcp.save it in one process with no_dist=True, then dcp.load "
            "into graphopt.parallel.ModelState(model); docs/parallel.md, Checkpoints)")


def _refuse_model_names(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                        *_: Any) -> None:
    """``load_state_dict`` pre-hook of a pipelined model (PP): ConfigError naming the fix
    when ``state_dict`` holds the one-process model's names, not this rank's stages'
    (``parts.<i>...``; a review: ``set_model_state_dict(..., full_state_dict=True)``, which
    shards such a state dict under FSDP2 / TP, failed in torch listing every key as
    unexpected)."""
    names = set(getattr(module, "original_names", {}).values())
    theirs = [k[len(prefix):] for k in state_dict
              if k.startswith(prefix) and k[len(prefix):] in names]
    if theirs:
        raise ConfigError(
            f"load_state_dict got the one-process model's names ({', '.join(theirs[:2])}"
            f"{', ...' if len(theirs) > 2 else ''}) for a pipelined model (pp > 1), whose "
            "parameters are this rank's stages' (parts.<i>...): save the state dict in one "
            "process with dcp.save({'model': sd}, checkpoint_id=..., no_dist=True), then "
            "dcp.load({'model': graphopt.parallel.ModelState(model)}, ...) on every rank, "
            "which maps the names (docs/parallel.md, Checkpoints)")


def _fsdp_held(model: nn.Module) -> tuple[set[int], set[int]]:
    """ids of the (sharded, gathered) parameters FSDP2 holds in ``model`` now. A parameter
    replaced by ``load_state_dict(assign=True)`` with a DTensor of the same layout is a
    sharded one (FSDP2's load hook takes the new tensor over); a gathered one is what the
    module exposes between FSDP2's all-gather and its reshard (ZeRO-2 keeps them from a
    forward to its backward: :func:`master_parameters`)."""
    sharded = {id(p.sharded_param) for p in _fsdp_params(model)}
    return sharded, set(master_parameters(model))


def _refuse_parameter_changes(model: nn.Module, ddp: bool, data_parallel: bool) -> None:
    """ConfigError before a forward with gradients of a data- or tensor-parallel model when,
    since the wrappers took it (at :func:`parallelize`; ``ddp``, torch's composable
    ``replicate`` for dp_replicate / ZeRO-1: at its first forward, where it builds its
    reducer whatever the grad mode):

    - a parameter was added (LoRA adapters added late): no data-parallel wrapper reduces its
      gradient, so each rank kept its own (a re-review: 1.45e-2 off one process under
      FSDP2, silently), and the TP layout does not split it;
    - a parameter was replaced by another tensor (a submodule replaced, ``load_state_dict(
      assign=True)``): the wrappers hold the old one, so the new one's gradient was never
      reduced (a review: 1.0e-2 - 3.1e-2 off one process under FSDP2, HSDP, TP, and DDP
      after its first forward, silently). Taken: a tensor FSDP2 holds (its load hook takes
      one of the old one's layout over) and, without data parallelism, a tensor of the old
      one's layout (a DTensor of its placements, or a plain tensor);
    - ``data_parallel``: a parameter's dtype changed (``model.float()``): DDP's buckets keep
      the old dtype (a review: gradients 5.3e-2 off, replicas apart, silently) and FSDP2
      failed inside its all-gather;
    - ``ddp``: a parameter's ``requires_grad`` changed. DDP fixes the gradients it
      all-reduces: a parameter unfrozen later kept its rank's own gradient and the replicas
      drifted apart, silently; one frozen later made DDP fail with advice graphopt cannot
      take (``find_unused_parameters``). FSDP2 (ZeRO-2/3), TP and PP follow such changes.
      A model with nothing to train fails DDP's first forward: named here.

    The routed experts under EP are not checked here: their own reduction looks them up
    each forward (:func:`graphopt.parallel.expert.expert_params`), and the EP forward checks
    their shapes."""
    from torch.distributed.tensor import DTensor

    from graphopt.parallel.expert import expert_params

    def layout(p: torch.Tensor) -> Any:
        return (p.placements, p.device_mesh) if isinstance(p, DTensor) else None

    # Taken by tensor (a module wrapped after parallelize renames its parameters, not a
    # change: a checkpoint wrapper around each attention, tests/test_parallel_rng.py), the
    # layouts by name (a replacement of the old one's layout is taken without DP). The
    # experts EP holds now are skipped (their hook finds them on their modules each
    # forward); a whole experts module swapped in is not one of them (a re-review: its
    # experts were skipped by name, never reduced, 2.3e-3 off, and ran without EP).
    # Strong references: torch's swap_tensors (Module._apply of DTensor parameters: the
    # meta-device flow's to_empty, .to) refuses a tensor with a weak one (a review: to_empty
    # failed after parallelize under every FSDP2 / TP plan); a swap keeps the object.
    taken: dict[int, tuple[Any, bool, torch.dtype, str]] = {}
    layouts: dict[str, Any] = {}

    def ours() -> dict[str, torch.Tensor]:
        skip = {id(p) for p in expert_params(model)}
        return {name: p for name, p in model.named_parameters() if id(p) not in skip}

    swapped_experts: set[str] = set()  # the experts' names: a tensor there that EP does
    # not hold is refused whatever its layout (it would run without EP)

    def take() -> None:
        layouts.update({name: layout(p) for name, p in model.named_parameters()})
        held_now = ours()
        swapped_experts.update(set(layouts) - set(held_now))
        taken.update({id(p): (p, p.requires_grad, p.dtype, name)
                      for name, p in held_now.items()})

    if not ddp:
        take()

    def held(p: torch.Tensor) -> tuple[Any, bool, torch.dtype, str] | None:
        entry = taken.get(id(p))
        return entry if entry is not None and entry[0] is p else None

    @torch.compiler.disable
    def check() -> None:
        if ddp and not taken:  # DDP's first forward: it builds its reducer now
            take()
            if not any(entry[1] for entry in taken.values()):
                raise ConfigError(
                    "every parameter DDP holds is frozen (requires_grad=False): DDP "
                    "(dp_replicate, ZeRO-1) needs one to train. To evaluate a frozen model, "
                    "parallelize it without data parallelism, or use zero_stage=2/3")
        if not torch.is_grad_enabled():
            return
        params = ours()
        new = [name for name, p in params.items() if held(p) is None]
        if new:
            sharded, gathered = _fsdp_held(model)
            new = [name for name in new if id(params[name]) not in sharded | gathered and (
                data_parallel or name in swapped_experts or
                layouts.get(name, False) != layout(params[name]))]
        added = sorted(name for name in new if name not in layouts)
        if added:
            raise ConfigError(
                f"{len(added)} parameter(s) were added after graphopt.parallelize "
                f"({', '.join(added[:3])}{', ...' if len(added) > 3 else ''}): no "
                "data-parallel wrapper reduces their gradients, so each rank would keep its "
                "own (and tensor parallelism does not split them). Add them (e.g. LoRA "
                "adapters) before parallelize")
        moved = [name for name in new if name in layouts]
        if moved:
            raise ConfigError(
                f"{len(moved)} parameter(s) were replaced by other tensors after "
                f"{'DDP took the model at its first forward' if ddp else 'graphopt.parallelize'}"
                f" ({', '.join(moved[:3])}{', ...' if len(moved) > 3 else ''}): the "
                "data/tensor-parallel wrappers hold the old ones, so the new ones' gradients "
                "would not be reduced. Replace modules and load weights before parallelize; "
                "after it, load in place (load_state_dict without assign=True, or "
                "param.copy_() under torch.no_grad()) or resume with dcp.load({'model': "
                "graphopt.parallel.ModelState(model)}, ...) (docs/parallel.md, Checkpoints)")
        if ddp:  # a parameter DDP took that left the model (a held one shared into its
            # place: a head re-tied to the embedding) stalls its bucket: that step's
            # gradients went unreduced (8e-2 off, a re-review), then torch named
            # find_unused_parameters
            now = {id(p) for p in params.values()}
            gone = [entry[3] for entry in taken.values() if id(entry[0]) not in now]
            if gone:
                raise ConfigError(
                    f"{len(gone)} parameter(s) DDP took at its first forward are no longer "
                    f"in the model ({', '.join(gone[:3])}{', ...' if len(gone) > 3 else ''}:"
                    " re-tied or shared in place of another?): DDP waits for their "
                    "gradients, so the others' would not be all-reduced. Tie or share "
                    "parameters before the first forward, or use zero_stage=2/3")
        known = {name: entry for name, p in params.items() if (entry := held(p)) is not None}
        cast = [f"{name} ({entry[2]} -> {params[name].dtype})"
                for name, entry in known.items() if params[name].dtype != entry[2]] \
            if data_parallel else []
        if cast:
            raise ConfigError(
                f"{len(cast)} parameter(s) changed dtype after "
                f"{'DDP took the model at its first forward' if ddp else 'parallelize'}"
                f" ({', '.join(cast[:3])}{', ...' if len(cast) > 3 else ''}): the "
                "data-parallel wrappers keep buffers of the old dtype. Convert the model "
                "before parallelize (for bf16 compute over float32 weights: "
                "mixed_precision='bf16')")
        changed = [f"{name} ({'unfrozen' if params[name].requires_grad else 'frozen'})"
                   for name, entry in known.items()
                   if ddp and params[name].requires_grad != entry[1]]
        if changed:
            raise ConfigError(
                f"{len(changed)} parameter(s) changed requires_grad after DDP took the model "
                f"at its first forward ({', '.join(changed[:3])}"
                f"{', ...' if len(changed) > 3 else ''}). DDP (this plan's data parallelism: "
                "dp_replicate, ZeRO-1) fixes which gradients it all-reduces then, so an "
                "unfrozen parameter would keep each rank's own gradient (replicas drift "
                "apart) and a frozen one would stall its reduction. Set requires_grad before "
                "the first forward (for a new set, parallelize the model again, from a "
                "checkpoint), or use zero_stage=2/3 (FSDP2 follows requires_grad)")

    _before_each_forward(model, check)


def _refuse_unmade_state(model: nn.Module, on_meta: bool) -> None:
    """ConfigError before a forward of a parallelized model whose state is not what it was
    made of (a review of the meta-device flow found each, silently wrong, as in plain
    torch):

    - parameters that were one tensor when parallelized (tied embeddings) are two now:
      ``to_empty`` (or ``load_state_dict(assign=True)``) unties plain tensors, and each
      copy trained on its own (DDP: gradients 1.1e-1 off one process);
    - a model parallelized on the meta device whose non-persistent buffers were not
      written since they were materialized: checkpoints do not hold them, so RoPE's
      ``inv_freq`` held uninitialised memory (loss 7.6e-2 off). ``Module._apply`` is
      wrapped on each module owning such a buffer, so each ``to_empty`` that reaches it
      (the model's, a wrapper's, a submodule's, the transformers model's under PP, whose
      stages share its modules; a second one: re-reviews found these unchecked) fills the
      new buffer with a sentinel byte pattern and records it (:func:`_recording_apply`);
      written means replaced, changed in place (the version counter) or through ``.data``
      (the bytes: a zero table written with ``.data.zero_()`` is told from fresh zero
      pages), as ``init_weights`` does (transformers' ``_init_weights`` recomputes rotary
      tables; torchtitan's ``init_weights(buffer_device)``); a conversion (``.double()``)
      keeps what it converts;
    - a parameter still on the meta device (under PP, transformers' ``init_weights`` on the
      whole model re-ties the last stage's head to an embedding that rank never
      materialized: the backward failed, and the other rank waited in gloo)."""
    by_tensor: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
    ties = [names for names in by_tensor.values() if len(names) > 1]
    pp = hasattr(model, "parts")
    # (name, owner, key) of each non-persistent buffer; (buffer, version) once materialized
    fresh: list[tuple[str, nn.Module, str]] = []
    made: dict[tuple[int, str], tuple[torch.Tensor, int]] = {}
    if on_meta:
        for path, module in model.named_modules():
            keys = [k for k, b in module._buffers.items()
                    if b is not None and k in module._non_persistent_buffers_set]
            if not keys:
                continue
            fresh.extend((f"{path}.{k}" if path else k, module, k) for k in keys)
            object.__setattr__(module, "_apply",
                               functools.partial(_recording_apply, module._apply, module,
                                                 keys, made))

    def unwritten(owner: nn.Module, key: str) -> bool:
        buf = owner._buffers.get(key)
        return buf is not None and _unwritten(made.get((id(owner), key)), buf)

    @torch.compiler.disable
    def check() -> None:
        if fresh:
            unset = [name for name, owner, key in fresh if unwritten(owner, key)]
            if unset:
                how = ("under PP: recompute them on the modules the stages share (the "
                       "model you built), e.g. pretrained._init_weights(module) for each "
                       "rotary embedding; its init_weights() would re-tie an embedding a "
                       "stage does not hold" if pp else
                       "transformers: model.init_weights() after to_empty, before loading "
                       "the weights; or compute them yourself")
                raise ConfigError(
                    f"{len(unset)} non-persistent buffer(s) ({', '.join(unset[:3])}"
                    f"{', ...' if len(unset) > 3 else ''}) hold uninitialised memory: the "
                    "model was materialized (to_empty) after graphopt.parallelize on the "
                    "meta device, and checkpoints do not hold non-persistent buffers. Make "
                    f"them again before the first forward ({how})")
        if on_meta:
            meta = [name for name, p in model.named_parameters() if p.is_meta]
            if meta and len(meta) < len(list(model.parameters())):
                raise ConfigError(
                    f"{len(meta)} parameter(s) are on the meta device at this forward "
                    f"({', '.join(meta[:3])}{', ...' if len(meta) > 3 else ''}) while the "
                    "others were materialized" + (
                        ": under PP, transformers' init_weights() / tie_weights() on the "
                        "whole model ties a stage's head to an embedding this rank never "
                        "materialized; recompute the buffers alone (pretrained."
                        "_init_weights(rotary_emb)), the pipeline keeps the tie"
                        if pp else ": materialize the whole model (model.to_empty(device="
                        "...)) after graphopt.parallelize"))
        if ties:
            params = dict(model.named_parameters(remove_duplicate=False))
            untied = [names for names in ties if len({id(params.get(n)) for n in names}) > 1]
            if untied:
                raise ConfigError(
                    f"parameters {' and '.join(untied[0][:2])} were one tensor (tied) when "
                    "the model was parallelized and are separate tensors now (to_empty on a "
                    "meta-device model, or load_state_dict(assign=True), unties them): each "
                    "would train on its own. Tie them again before the forward "
                    "(transformers: model.tie_weights(), or model.init_weights() after "
                    "to_empty)")

    if ties or on_meta:
        _before_each_forward(model, check)


_SENTINEL = 0xA5
"""The byte a materialized non-persistent buffer is filled with until something writes it
(its contents are uninitialised memory then; fresh pages are zeros, a common true value)."""


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _unwritten(entry: tuple[torch.Tensor, int] | None, buf: torch.Tensor) -> bool:
    """Whether ``buf`` is the recorded (``entry``) materialized buffer, unwritten since:
    the same tensor, version counter and sentinel bytes (writes through ``.data`` move no
    counter). Boolean buffers (no sentinel) by tensor and counter."""
    if entry is None or entry[0] is not buf or buf._version != entry[1]:
        return False
    return buf.dtype == torch.bool or bool((_bytes_view(buf) == _SENTINEL).all())


def _recording_apply(apply: Callable[..., Any], module: nn.Module, keys: list[str],
                     made: dict[tuple[int, str], tuple[torch.Tensor, int]],
                     *args: Any, **kwargs: Any) -> Any:
    """``module._apply`` recording (in ``made``: tensor, version counter) each of its
    ``keys`` buffers that it materialized (from the meta device, or by ``to_empty``: torch's
    ``Module.to_empty`` passes a lambda of its own), filled with the sentinel byte. A
    conversion (``.to``, ``.double()``) of an unwritten buffer stays unwritten; of a
    written one, written."""
    fn = args[0] if args else kwargs.get("fn")
    emptied = "to_empty" in getattr(fn, "__qualname__", "")
    before = {key: module._buffers.get(key) for key in keys}
    out = apply(*args, **kwargs)
    for key in keys:
        old, buf = before[key], module._buffers.get(key)
        if buf is None or buf is old or buf.is_meta or buf.numel() == 0:
            continue
        if not emptied and old is not None and not old.is_meta and \
                not _unwritten(made.get((id(module), key)), old):
            continue  # a conversion of written values
        with torch.no_grad():
            if buf.dtype != torch.bool:
                _bytes_view(buf).fill_(_SENTINEL)
        made[(id(module), key)] = (buf, buf._version)
    return out


def _refuse_inference_mode_first(model: nn.Module) -> None:
    """ConfigError on every rank when a data-parallel model's first forward (``model.step``
    under PP) runs under ``torch.inference_mode()``: FSDP2 and DDP then allocate their
    gathered-parameter and bucket buffers as inference tensors, which training cannot write
    later (a review: "Inplace update to inference tensor outside InferenceMode" at the first
    training step, and under PP x FSDP a hang, one rank raising while the others waited).
    Once a forward ran outside inference mode, later ones under it are exact."""
    seen: list[bool] = []

    def check() -> None:
        if seen:
            return
        if torch.is_inference_mode_enabled():
            raise ConfigError(
                "the first forward of a data-parallel model runs under torch.inference_mode"
                "(): FSDP2/DDP would allocate their buffers as inference tensors that "
                "training cannot write later. Evaluate under torch.no_grad() instead (or "
                "after a training step)")
        seen.append(True)

    _before_each_forward(model, check)


def _before_each_forward(model: nn.Module, run: Callable[[], None]) -> None:
    """Call ``run()`` before each forward of ``model``, ahead of its other pre-hooks
    (FSDP2's starts the forward), or under PP (a PipelinedModel, whose stages run inside
    ``step``) before each ``step``."""
    if hasattr(model, "parts"):
        step: Callable[..., Any] = model.step  # type: ignore[assignment]

        def wrapped_step(*args: Any, **kwargs: Any) -> Any:
            run()
            return step(*args, **kwargs)

        object.__setattr__(model, "step", wrapped_step)
    else:
        model.register_forward_pre_hook(lambda *_: run(), prepend=True)


def _keep_zero2_sharded_when_idle(model: nn.Module) -> None:
    """ZeRO-2 keeps each FSDP2 unit's parameters gathered from its forward until the backward
    reshards them (``reshard_after_forward=False``). A forward never followed by a backward
    (an evaluation, with or without ``torch.no_grad()``) left them gathered, and FSDP2 then
    exposes the gathered copies as the module's parameters. Reviews found, all silent:
    an optimizer built afterwards stepped the copies and the sharded master weights never
    moved (update error 1.0; bf16 Adam states under mixed precision); the next forward
    reused the weights gathered before ``optimizer.step`` (FSDP2's ``unshard`` returns
    early when gathered; 0.64-1.0 update errors after 2 steps); ``model.zero_grad()``
    cleared the copies' gradients and the sharded ones added into the next step (0.023);
    the clip norm missed gathered parameters' gradients. So, on every rank together
    (:func:`reshard`, idle units only): each unit reshards after a forward run without
    gradients, as ZeRO-3 does after every forward, and the root before its forward
    (``model.step`` under PP). What one rank may call alone looks the sharded parameters
    up instead (:func:`master_parameters`, no collective): the root's ``zero_grad`` clears
    them too, ``build_optimizer`` and the gradient norm and clip take them (re-reviews:
    resharding from the root's ``parameters()`` or ``zero_grad``, called by one rank
    between forward and backward, ``model.device`` in rank-0 logging, made that rank's
    backward all-gather alone and hang). An optimizer whose first step would update the
    gathered copies raises ConfigError (:func:`_refuse_gathered_copies`: built by hand
    after such a forward, through a wrapper or a ``torch.compile``'d model). Not done: a
    parameter frozen after such a forward through ``named_parameters()`` or an attribute
    may be the copy."""

    def hook(module: Any, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            module.reshard()

    for unit in _fsdp_units(model):
        unit.register_forward_hook(hook)
    # before FSDP2's own pre-forward (which starts the forward: then nothing is idle)
    _before_each_forward(model, lambda: reshard(model))
    zero_grad = model.zero_grad

    def master_zero_grad(set_to_none: bool = True) -> None:
        zero_grad(set_to_none)  # the module's parameters: FSDP2's copies where gathered
        for param in master_parameters(model).values():  # and the sharded ones behind them
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.detach_()
                    param.grad.zero_()

    object.__setattr__(model, "zero_grad", master_zero_grad)
    global _STEP_HOOK
    _ZERO2_MODELS.add(model)
    if _STEP_HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _STEP_HOOK = register_optimizer_step_pre_hook(_refuse_gathered_copies)


_ZERO2_MODELS: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Models parallelized with ZeRO-2 in this process (:func:`_refuse_gathered_copies`)."""
_CHECKED: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
_STEP_HOOK: Any = None


def _refuse_gathered_copies(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Global optimizer step pre-hook (torch.optim's ``register_optimizer_step_pre_hook``),
    once per optimizer: ConfigError when it holds FSDP2's gathered copies of a ZeRO-2
    model's parameters (``FSDPParam._unsharded_param``) instead of the sharded ones. Such
    copies get no gradient (FSDP2 reduce-scatters into the sharded parameters), so the
    optimizer skipped them and nothing trained, silently."""
    if optimizer in _CHECKED or not _ZERO2_MODELS:
        return
    copies = {i for model in list(_ZERO2_MODELS) for i in master_parameters(model)}
    if any(id(p) in copies for group in optimizer.param_groups for p in group["params"]):
        raise ConfigError(
            "this optimizer holds FSDP2's gathered copies of a ZeRO-2 model's parameters "
            "(it was built after a forward that no backward followed, an evaluation, which "
            "leaves the units gathered): they get no gradients and would never train. Build "
            "it with graphopt.parallel.build_optimizer (it takes the sharded parameters), "
            "or before any evaluation, or run evaluations under torch.no_grad()")
    _CHECKED[optimizer] = True  # only once passed: a caught refusal refuses again


def _fsdp_units(model: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def master_parameters(model: nn.Module) -> dict[int, nn.Parameter]:
    """id(gathered copy) -> the sharded parameter it stands for, for every FSDP2 parameter
    of ``model`` whose gathered copy exists (``FSDPParam._unsharded_param``). A local
    lookup, no collective: what ``build_optimizer``, ``zero_grad`` and the gradient norm
    use where resharding could hang (a re-review: one rank resharding between forward and
    backward made its backward all-gather alone)."""
    return {id(copy): fsdp_param.sharded_param for fsdp_param in _fsdp_params(model)
            for copy in [getattr(fsdp_param, "_unsharded_param", None)] if copy is not None}


def _fsdp_params(model: nn.Module) -> list[Any]:
    """Every ``FSDPParam`` of the FSDP2 units of ``model`` (all of each unit's groups)."""
    return [fsdp_param for unit in _fsdp_units(model)
            for group in unit._get_fsdp_state()._fsdp_param_groups
            for fsdp_param in group.fsdp_params]


def reshard(model: nn.Module) -> None:
    """Put every FSDP2 unit of ``model`` that holds gathered parameters while idle (a
    forward ran and no backward followed) back on its sharded parameters. Nothing happens
    while a forward or backward is under way (a unit in another training state) or for
    units already sharded; models without FSDP are left alone. Uses FSDP2's parameter
    groups (``torch.distributed.fsdp._fully_shard``: ``FSDPParamGroup.reshard``)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    groups = [g for unit in _fsdp_units(model)
              for g in unit._get_fsdp_state()._fsdp_param_groups]
    if any(g._training_state != TrainingState.IDLE for g in groups):
        return  # inside a forward or backward: FSDP2 runs its own schedule
    for group in groups:
        if group.is_unsharded:
            group.reshard()


def _blocks(unit: nn.Module) -> list[nn.Module]:
    """FSDP's units inside ``unit``: a pipeline stage's layers, else the decoder layers."""
    layers = getattr(unit, "layers", None)
    if isinstance(layers, nn.ModuleDict):
        return list(layers.values())
    return decoder_layers(unit)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (FSDP's unit of sharding, PP's unit of a stage): the items of the
    ModuleList holding the most parameters, then the longest. Not merely the longest:
    StableLM's per-head q/k LayerNorms (a ModuleList of 4 in each layer) outnumbered its 2
    decoder layers, and PP cut the norms into stages (a review)."""
    best: list[nn.Module] = []
    best_key = (-1, -1)
    for m in model.modules():
        if isinstance(m, nn.ModuleList):
            key = (sum(p.numel() for p in m.parameters()), len(m))
            if key > best_key:
                best, best_key = list(m), key
    return best


def optimizer_for(model: nn.Module, optimizer_class: type[torch.optim.Optimizer],
                  **kwargs: Any) -> torch.optim.Optimizer:
    """:func:`build_optimizer` with the plan and mesh :func:`parallelize` recorded on
    ``model`` (e.g. after ``graphopt.compile(options={"parallel": "auto", ...})``).

    Raises:
        ConfigError: ``model`` was not parallelized by graphopt.
    """
    report = getattr(model, "graphopt_parallel", None)
    if report is None or report.parallel_plan is None:
        raise ConfigError("optimizer_for needs a model returned by graphopt.parallelize or "
                          "graphopt.compile(options={'parallel': ...})")
    return build_optimizer(model, report.parallel_plan, report.mesh, optimizer_class, **kwargs)


def build_optimizer(model: nn.Module, plan: ParallelPlan, mesh: Any,
                    optimizer_class: type[torch.optim.Optimizer], **kwargs: Any
                    ) -> torch.optim.Optimizer:
    """The optimizer for a parallelized model: ZeRO-1 (``plan.zero_stage == 1`` with
    dp_shard > 1) shards its states over the dp_shard group with
    ``torch.distributed.optim.ZeroRedundancyOptimizer``; otherwise ``optimizer_class`` as
    is (FSDP already shards states for ZeRO-2/3; a DTensor parameter's states are sharded
    like it). FSDP2 units are resharded first, so the optimizer holds the sharded master
    parameters even where a forward left some gathered (ZeRO-2 without a backward:
    :func:`_keep_zero2_sharded_when_idle`; :func:`master_parameters`)."""
    if plan.zero_stage == 1 and plan.dp_shard > 1:
        if plan.tp > 1:
            raise ConfigError("ZeRO-1 with tp > 1 is not built yet (ZeroRedundancyOptimizer "
                              "takes plain tensors): use zero_stage=2 or 3 with tp")
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class,
                                       process_group=mesh["dp_shard"].get_group(), **kwargs)
    masters = master_parameters(model)
    return optimizer_class([masters.get(id(p), p) for p in model.parameters()], **kwargs)


def _expert_placement(name: str, report: ParallelReport) -> str:
    for path, (start, end, e) in report.experts.items():
        if name.startswith(path + "."):
            t, etp = report.expert_ffn
            return f"ep: experts {start}..{end - 1} of {e} (dim 0); " + (
                f"etp: FFN slice {t} of {etp} (gate and up rows, down columns); "
                if etp > 1 else "")
    return ""


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _placements(p: torch.Tensor) -> str:
    placements = getattr(p, "placements", None)
    if placements is None:
        return "replicated (plain tensor)"
    names = getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ()
    return ", ".join(f"{axis}: {pl}" for axis, pl in zip(names, placements))
