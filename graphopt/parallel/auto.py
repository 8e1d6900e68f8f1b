"""``options={"parallel": "auto", "cluster": {...}}``: search the plan for the world this
process runs in, and keep the best one graphopt executes.

Contract: :func:`auto_plan` describes the live model to the planner (its transformers
config, written as config.json, traced on the meta device by
:func:`graphopt.planner.model.plan_model`), searches ``world`` devices of the cluster
profile (:func:`graphopt.planner.search.search` with activation recomputation, which
graphopt.parallelize executes; top 200 by predicted throughput) and
returns the first plan :func:`not_executable` accepts, with notes saying what won, its
predicted step time and throughput, and which better plans were passed over and why.

The cluster dict: ``profile`` (a profile name, default: "local" when calibrated, else
h100-sxm), ``seq`` (tokens per sequence) and ``global_batch`` (sequences per step), both
required: they decide the plan (activation memory, microbatches); ``cp`` (default False):
True lets the plan use context parallelism. A CP plan changes what the training loop feeds
(each rank its chunk of every sequence, ``shard_sequence``, and ``cp_loss``): a loop
written for data parallelism trained silently wrong on a CP plan "auto" had picked (a
review: gradients 0.58 off), so CP plans are passed over unless the caller says it feeds
chunks. Plans CP would refuse for this model (:func:`graphopt.parallel.context.check_cp`:
sliding windows, chunked attention, ...; the ring with attention dropout) are passed
over too.

Errors (ConfigError): torch.distributed not initialized, a missing or unknown cluster key,
no executable plan among the top 200 (names the best and why it is not executable).
"""

from __future__ import annotations

import dataclasses
import numbers
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from graphopt.errors import ConfigError
from graphopt.planner.plan import ParallelPlan

CLUSTER_KEYS = ("profile", "seq", "global_batch", "cp")


def tied_embeddings(config: Any, model: nn.Module | None = None) -> bool:
    """Whether the LM head shares the token embedding's weight: the config says so, or the
    model's two weights are one tensor (tied by hand with the config saying untied, a
    re-review: graphopt.parallel keeps them replicated, which is what counts)."""
    if getattr(config, "tie_word_embeddings", False):
        return True
    if model is None:
        return False
    inputs = getattr(model, "get_input_embeddings", lambda: None)()
    outputs = getattr(model, "get_output_embeddings", lambda: None)()
    return inputs is not None and outputs is not None and \
        getattr(inputs, "weight", None) is getattr(outputs, "weight", 0)


def frozen_prefix_layers(model: nn.Module) -> int:
    """:attr:`graphopt.planner.model.PlanModel.frozen_prefix` of ``model``: how many of its
    first decoder layers (:func:`graphopt.parallel.apply.decoder_layers`) hold no parameter
    with ``requires_grad``, when no parameter registered before the first layer (the
    input embedding, a position table, an input projection) has it either; else 0."""
    from graphopt.parallel.apply import decoder_layers

    layers = decoder_layers(model)
    if not layers:
        return 0
    first = {id(p) for p in layers[0].parameters()}
    for p in model.parameters():
        if id(p) in first:
            break
        if p.requires_grad:
            return 0
    count = 0
    for layer in layers:
        if any(p.requires_grad for p in layer.parameters()):
            break
        count += 1
    return count


def trained_gemm_share(model: nn.Module, skip_layers: int = 0, experts: bool = False
                       ) -> float:
    """:attr:`graphopt.planner.model.PlanModel.trained_gemm` of ``model``: the share, by
    elements, of its GEMM weights outside the routed experts (2-D parameters other than an
    ``nn.Embedding``'s, unless it is the LM head's too) that have ``requires_grad``, the
    first ``skip_layers`` decoder layers left out (:func:`frozen_prefix_layers`, priced
    apart); with ``experts`` the same share of the routed experts' parameters
    (:attr:`~graphopt.planner.model.PlanModel.trained_expert_gemm`). 1.0 when there are
    none."""
    from graphopt.parallel.apply import decoder_layers

    outputs = getattr(model, "get_output_embeddings", lambda: None)()
    head = getattr(outputs, "weight", None)
    lookups = {id(m.weight) for m in model.modules()
               if isinstance(m, nn.Embedding) and m.weight is not head}
    lookups |= {id(p) for layer in decoder_layers(model)[:skip_layers]
                for p in layer.parameters()}
    trained = total = 0
    for name, p in model.named_parameters():
        if id(p) in lookups or (".experts." in name) != experts or \
                (not experts and p.dim() != 2):
            continue
        total += p.numel()
        trained += p.numel() * p.requires_grad
    return trained / total if total else 1.0


def not_executable(plan: ParallelPlan, global_batch: int | None = None,
                   config: Any = None, model: nn.Module | None = None,
                   seq: int | None = None) -> str:
    """Why graphopt.parallelize cannot run ``plan`` ("" when it can), for a job of
    ``global_batch`` sequences per step and a model of transformers ``config`` when given
    (TP splits its KV heads and vocabulary: graphopt.parallel.tp_layout refuses a tp that
    does not divide them, where the planner checks only the query heads), and with
    ``model`` what CP refuses for it (:func:`graphopt.parallel.context.check_cp`, the ring
    with attention dropout; on sequences of ``seq`` tokens: a shorter sliding window)."""
    if plan.cp > 1 and model is not None:
        why = _cp_refusal(model, plan, seq)
        if why:
            return why
    if model is not None:
        from graphopt.parallel.apply import layerdrop_refusal

        for why in layerdrop_refusal(model, plan):
            return why
    why = _experts_fsdp_problem(plan, config)
    if why:
        return why
    for name in ("num_key_value_heads", "vocab_size"):
        value = getattr(config, name, None)
        if plan.tp > 1 and isinstance(value, int) and value % plan.tp:
            return f"tp={plan.tp} does not divide the model's {name} ({value})"
    if global_batch is not None and plan.pp > 1 and \
            global_batch // (plan.dp * plan.microbatch) < plan.pp:
        return (f"{global_batch // (plan.dp * plan.microbatch)} microbatch(es) per step for "
                f"{plan.pp} pipeline stages: the pipeline runs at least one per stage")
    if (plan.pp > 1 or plan.cp > 1) and getattr(config, "output_router_logits", False) and \
            float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0):
        return ("the pipeline's" if plan.pp > 1 else "CP's") + \
            " loss leaves out the MoE load-balancing loss (aux loss on)"
    if plan.cp > 1 and plan.cp_kind == "ring" and \
            "linear_attention" in (getattr(config, "layer_types", None) or ()):
        # graphopt.parallel.context refuses it (lightning state passing needs contiguous
        # chunks); "auto" picked it for MiniMax, which parallelize then refused (a review)
        return "lightning (linear-attention) layers run CP with all-to-all, not the ring"
    if plan.tp > 1 and plan.sp and tied_embeddings(config, model):
        # graphopt.parallel.apply._apply_tp refuses it (a review: auto picked it)
        return ("SP gathers the sequence back at the LM head split over the vocabulary; a "
                "tied embedding/head pair stays replicated under TP (use sp=False)")
    if plan.expert_tp not in (1, plan.tp):
        return "tensor-parallel experts are executed over the TP group only (expert_tp = tp)"
    why = plan.zero_bubble_refusal()
    if why:
        return why
    if plan.zero_stage == 1 and plan.dp_shard > 1 and (plan.tp > 1 or plan.ep > 1 or
                                                        plan.pp > 1 or plan.cp > 1):
        return "ZeRO-1 is executed with data parallelism alone"
    if plan.tp > 1 and model is not None:
        why = _tp_refusal(model, plan)
        if why:
            return why
    if plan.pp > 1 and model is not None:  # last: the model-level check may run it once
        return _pp_refusal(model, plan)
    return ""


def _tp_refusal(model: nn.Module, plan: ParallelPlan) -> str:
    """Why graphopt.parallelize's TP would not run ``plan`` on ``model`` as the planner
    prices it ("" if it would): a model whose decoder layers hold no nn.Linear (GPT-2's
    Conv1D) is split nowhere, every rank computing and holding the whole model (a review:
    "auto" picked tp=2 for it, priced as split, over the memory it has); with real weights
    also what the derived layout refuses (:func:`graphopt.parallel.tp_layout.
    derive_tp_layout`: divisibility, SP's problems), derived once per TP degree and cached
    on the model."""
    from graphopt.parallel.apply import _default_sample, decoder_layers
    from graphopt.parallel.tp_layout import derive_tp_layout, splits_nothing

    layers = decoder_layers(model)
    if layers and not any(isinstance(m, nn.Linear) for layer in layers
                          for m in layer.modules()):
        return splits_nothing(None, plan.tp)
    if any(p.is_meta for p in model.parameters()):
        return ""
    cache = model.__dict__.setdefault("_graphopt_plan_refusals", {})
    key = ("tp", plan.tp)
    if key not in cache:
        try:
            cache[key] = derive_tp_layout(model, _default_sample(model), plan.tp)
        except ConfigError as exc:
            cache[key] = str(exc)
    layout = cache[key]
    if isinstance(layout, str):
        return layout
    nothing = splits_nothing(layout, plan.tp)
    if nothing:
        return nothing
    if layout.indivisible:  # priced as split, run whole (a review: tp=2 held 0.72 of the
        # parameters per rank where 0.5 was priced)
        return (f"tp={plan.tp} does not divide {layout.indivisible[0]} ("
                f"{len(layout.indivisible)} mixer(s) in all): they would stay whole on every "
                "TP rank, not split as the plan is priced")
    if plan.sp and layout.layers and (layout.sp_problems or layout.written_in_place):
        return f"SP cannot run this model: {(layout.sp_problems or layout.written_in_place)[0]}"
    return ""


def _pp_refusal(model: nn.Module, plan: ParallelPlan) -> str:
    """:func:`graphopt.parallel.pipeline.check_pipeline`'s refusal of ``model`` under
    ``plan`` ("" if none): the stages' structure, sliding windows, eager attention (a
    review: GPT-2 class PP plans were ranked as executed). The model-level part (which runs
    the model once, unless its weights are on the meta device) is cached on the model; a
    re-review counted 107 forwards in one ``parallel="auto"`` call before. The plan's stage
    bounds are checked per plan."""
    from graphopt.parallel.apply import decoder_layers
    from graphopt.parallel.pipeline import _plan_bounds, check_pipeline

    cache = model.__dict__.setdefault("_graphopt_plan_refusals", {})
    if "pipeline" not in cache:
        try:
            check_pipeline(model, ParallelPlan(pp=1))
            cache["pipeline"] = ""
            cache["layers"] = len(decoder_layers(model))  # (a module walk: once)
        except ConfigError as exc:
            cache["pipeline"] = str(exc)
    if cache["pipeline"]:
        return str(cache["pipeline"])
    try:
        _plan_bounds(plan, int(cache["layers"]))
    except ConfigError as exc:
        return str(exc)
    return ""


def _experts_fsdp_problem(plan: ParallelPlan, config: Any) -> str:
    """parallelize's refusal of FSDP over the experts (:func:`graphopt.parallel.expert.
    fsdp_dim`: edp_shard must divide the local experts E/ep, or their dims 2F/expert_tp
    and H) for a model of transformers ``config``, or "" (a review: 48 of the planner's
    top 50 plans for Mixtral-8x22B on 96 devices were refused there)."""
    from graphopt.models import expert_count
    from graphopt.parallel.expert import check_expert_split, experts_fsdp_degree

    experts = expert_count(config) if config is not None else 0
    ffn = int(getattr(config, "moe_intermediate_size", 0) or
              getattr(config, "intermediate_size", 0) or 0)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    if plan.ep <= 1 or not experts or not ffn or not hidden:
        return ""
    try:
        check_expert_split("the experts", experts, ffn, hidden, plan.ep, plan.expert_tp,
                           experts_fsdp_degree(plan))
    except ConfigError as exc:
        return str(exc)
    return ""


def _cp_refusal(model: nn.Module, plan: ParallelPlan, seq: int | None = None) -> str:
    """CP's refusal of ``model`` under ``plan`` on ``seq`` tokens ("" if none), cached on
    the model per (cp kind, cp, tp, seq): the check runs the model once."""
    from graphopt.parallel.context import check_cp

    cache = model.__dict__.setdefault("_graphopt_plan_refusals", {})
    key = (plan.cp_kind, plan.cp, plan.tp, seq)
    if key not in cache:
        config = getattr(model, "config", None)
        dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
        if plan.cp_kind == "ring" and dropout > 0:
            cache[key] = (f"ring attention runs without attention dropout (the model's "
                          f"attention_dropout is {dropout})")
        else:
            try:
                check_cp(model, plan, seq)
                cache[key] = ""
            except ConfigError as exc:
                cache[key] = str(exc)
    return cache[key]


def _transformers_class(model: nn.Module) -> str:
    """The name of the transformers model class ``model`` is or subclasses (the planner
    builds the architecture by that name: a review found ``class MyLlama(LlamaForCausalLM)``
    refused with an error about a temporary config.json)."""
    import transformers

    for cls in type(model).__mro__:
        if getattr(transformers, cls.__name__, None) is cls:
            if cls.__name__.endswith("PreTrainedModel") or \
                    cls.__module__.startswith("transformers.generation"):
                break  # a base of model classes, not an architecture (a re-review)
            return cls.__name__
    raise ConfigError(f"parallel='auto' plans transformers model classes, which it builds by "
                      f"name; {type(model).__name__} is none of them nor a subclass of one: "
                      "plan its architecture with `graphopt plan --model config.json` and "
                      "pass the plan (options={'parallel': 'plan.json'})")


def auto_plan(model: nn.Module, world: int, cluster: Any = None,
              mixed_precision: str | torch.dtype | None = None
              ) -> tuple[ParallelPlan, list[str]]:
    """(the best executable plan for ``world`` ranks, notes); module docstring.
    ``mixed_precision``: what ``graphopt.parallelize`` is given (None or bf16): with bf16
    the planner prices float32 master weights computing in bf16 under autocast
    (:attr:`graphopt.planner.model.PlanModel.master_weights`), not the parameters' dtype.

    Raises:
        ConfigError: ``cluster`` is not a mapping of CLUSTER_KEYS with an int ``seq`` >= 2
            and ``global_batch`` >= 1 and a bool ``cp``; ``model`` has no transformers
            config or is no transformers model class (nor a subclass of one); no plan
            graphopt executes fits ``world`` ranks.
    """
    from graphopt.cost.profiles import default_profile_name, load_profile
    from graphopt.planner.model import plan_model
    from graphopt.planner.search import search

    shape = ("options['cluster'] = {'seq': tokens per sequence, 'global_batch': sequences "
             "per step, 'profile': name (optional), 'cp': True to allow context parallelism "
             "(optional)}")
    if cluster is not None and not isinstance(cluster, Mapping):
        # (a review: "h100-sxm", as `graphopt plan --cluster` takes it, was a ValueError)
        raise ConfigError(f"parallel='auto' needs {shape}, got {cluster!r}; a profile name "
                          "goes in it as 'profile'")
    spec = dict(cluster or {})
    unknown = sorted(set(spec) - set(CLUSTER_KEYS))
    missing = [k for k in ("seq", "global_batch") if k not in spec]
    if unknown or missing:
        raise ConfigError(f"parallel='auto' needs {shape}; unknown {unknown}, missing "
                          f"{missing}")
    for key, least in (("seq", 2), ("global_batch", 1)):
        value = spec[key]
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or \
                value < least:
            raise ConfigError(f"options['cluster']['{key}'] must be an int >= {least}, got "
                              f"{value!r}")
        spec[key] = int(value)  # (numpy integers too: a re-review)
    allow_cp = spec.get("cp", False)
    if not isinstance(allow_cp, bool):
        raise ConfigError(f"options['cluster']['cp'] must be True (the training loop feeds "
                          f"each rank shard_sequence's chunk and uses cp_loss) or False, got "
                          f"{allow_cp!r}")
    config = getattr(model, "config", None)
    if config is None:
        raise ConfigError("parallel='auto' plans transformers models (it reads model.config)")
    architecture = _transformers_class(model)
    profile_name = spec.get("profile") or default_profile_name()
    profile = load_profile(profile_name)
    from graphopt.parallel.apply import mixed_precision_dtype

    own = next(model.parameters()).dtype
    compute = mixed_precision_dtype(mixed_precision, model)  # the ConfigErrors parallelize
    # raises: bf16 over float32 parameters only
    dtype = own if own in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
    if compute is not None or any(getattr(m, "gate_up_proj", None) is not None
                                  for m in model.modules()):
        dtype = torch.bfloat16  # MoE models are traced with grouped_mm (bf16 meta kernel)
    master = compute is not None
    with tempfile.TemporaryDirectory() as tmp:
        import copy

        config = copy.deepcopy(config)
        config.architectures = [architecture]  # the class the planner builds
        config.to_json_file(str(Path(tmp) / "config.json"))
        planned = plan_model(str(Path(tmp) / "config.json"), int(spec["seq"]), profile,
                             dtype=dtype, master_weights=master)
    # not the temp path; a tied embedding/head pair stays replicated under TP here
    # (tp_layout._vocab_parallel), so it is priced whole on every TP rank
    # frozen parameters (LoRA's base weights, a frozen embedding): no gradient, no optimizer
    # state, nothing to reduce (a review: every parameter was priced as trained)
    counts = {True: [0, 0], False: [0, 0]}  # by "is a routed expert": [trained, all]
    for name, p in model.named_parameters():
        count = counts[".experts." in name]
        count[0] += p.numel() * p.requires_grad
        count[1] += p.numel()
    trained, trained_experts = (counts[e][0] / counts[e][1] if counts[e][1] else 1.0
                                for e in (False, True))
    prefix = frozen_prefix_layers(model)
    planned = dataclasses.replace(planned, name=type(model).__name__, tied_head_tp=False,
                                  tied_embeddings=tied_embeddings(config, model),
                                  trained=trained, trained_experts=trained_experts,
                                  frozen_prefix=float(prefix),
                                  trained_gemm=trained_gemm_share(model, prefix),
                                  trained_expert_gemm=trained_gemm_share(model, prefix, True))
    result = search(planned, profile, world, int(spec["global_batch"]), top_k=200)

    def why_not(plan: ParallelPlan) -> str:
        if plan.cp > 1 and not allow_cp:
            return ("cp > 1 changes what each rank is fed: its chunk of every sequence "
                    "(graphopt.parallel.shard_sequence) and the loss from cp_loss; set "
                    "options['cluster']['cp'] = True if the training loop does that")
        return not_executable(plan, int(spec["global_batch"]), config, model,
                              int(spec["seq"]))

    passed = []
    for plan in result.top:
        why = why_not(plan)
        if not why:
            break
        passed.append(f"{plan.describe()} ({why})")
    else:  # every plan of the top list is one graphopt does not run here (a review: all
        # 200 were CP or SP plans for a tied 70B Llama): search the executable ones alone
        try:
            plan = search(planned, profile, world, int(spec["global_batch"]), top_k=1,
                          admit=lambda p: not why_not(p)).best
        except ConfigError as exc:
            raise ConfigError(f"no plan graphopt executes for {world} ranks fits: {exc}; "
                              f"the planner's best, {result.best.describe()}, is not "
                              f"executable: {why_not(result.best)}") from None
    pred = plan.prediction
    assert pred is not None
    shown = profile_name if isinstance(profile_name, str) else profile.name  # not a dict
    notes = [f"auto: {plan.describe()} for {world} ranks of {shown!r} (seq "
             f"{spec['seq']}, global batch {spec['global_batch']}): predicted step "
             f"{pred.step_s * 1e3:.3g} ms, {pred.tokens_per_s:.4g} tokens/s, MFU "
             f"{pred.mfu * 100:.3g}%; best of {result.evaluated} plans evaluated"]
    if passed:
        notes.append(f"auto: passed over {len(passed)} faster plan(s) graphopt does not "
                     f"execute here: {'; '.join(passed[:3])}")
    if trained < 1 or trained_experts < 1:
        notes.append(f"auto: {counts[False][0] + counts[True][0]:,} of "
                     f"{counts[False][1] + counts[True][1]:,} parameters train "
                     "(requires_grad); the frozen ones are priced without gradients, optimizer "
                     "states, their reduction or their weight-gradient GEMMs" + (
                         f"; the first {prefix} decoder layers, frozen with everything "
                         "before them, as their forward only (no backward, no saved "
                         "activations)" if prefix else ""))
    if master:
        notes.append("auto: priced as mixed precision (float32 master weights, bfloat16 "
                     "compute under torch.autocast)" + (
                         "; the MoE layers' activations as bfloat16 throughout with their "
                         "weight copies added (the planner traces grouped_mm experts in "
                         "bfloat16 only): their float32 residual stream under DDP is not "
                         "priced" if planned.moe else ""))
    elif dtype != own:  # (a review: a float32 Mixtral got the bf16 model's prediction)
        ratio = own.itemsize / dtype.itemsize
        why = ("the planner traces MoE models with grouped_mm experts, whose meta kernel takes "
               "bfloat16 only" if dtype == torch.bfloat16 else
               f"device profiles have no {own} rate")
        notes.append(f"auto: priced as {str(dtype).replace('torch.', '')}, not the model's "
                     f"{str(own).replace('torch.', '')} ({why}): activations and parameter "
                     f"bytes are about {ratio:g}x the prediction, and the step slower; plans "
                     "are ranked as for that dtype")
    return plan, notes
