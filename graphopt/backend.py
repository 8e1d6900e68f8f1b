"""The ``torch.compile`` backend, registered as ``graphopt`` through the
``torch_dynamo_backends`` entry point (pyproject.toml), so it works without ``import graphopt``.
"""

from __future__ import annotations

import functools
import os
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import fx

from graphopt.config import GraphoptConfig
from graphopt.errors import ConfigError

PARALLEL_OPTION = "parallel"


def compile(model: Any, options: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
    """``torch.compile(model, backend="graphopt", options=options, **kwargs)``, but the options
    are validated now, so a bad option raises :class:`ConfigError` here, not on the first
    call wrapped in Dynamo's ``BackendCompilerFailed``.

    ``options["parallel"]`` (a ``ParallelPlan``, the path of its JSON, or "auto" with
    ``options["cluster"] = {"seq": ..., "global_batch": ..., "profile": ..., "cp": bool}``
    (``cp``: allow context-parallel plans, whose ranks each take a chunk of every
    sequence, docs/parallel.md): the planner's
    best executable plan for the world size, :mod:`graphopt.parallel.auto`) first shards the
    module with :func:`graphopt.parallelize` (under torchrun), then compiles each decoder
    layer's ``forward`` in place and returns the module (torchtitan compiles per block too). In
    torch 2.13 a whole-model compile of FSDP2 with a vocab-parallel embedding fails inside
    AOTAutograd, and compiling a layer together with SP's input hook (``module.compile()``)
    silently drops the gradient of the layer's input (the embedding's), with ``aot_eager``
    too; the hooks therefore run eagerly, outside the compiled forward. With the plan's
    ep > 1, ``options["moe"]`` (all_to_all, chunks, ranks_per_node, profile) configures
    the plan's expert parallelism instead of the moe pass. With pp > 1 the result is a
    :class:`graphopt.parallel.pipeline.PipelinedModel` (train with its ``step``); the
    layers of this rank's stages are compiled. ``options["mixed_precision"] = "bf16"``
    (with a plan) computes in bf16 with float32 master weights
    (:func:`graphopt.parallelize`'s ``mixed_precision``).
    """
    import torch

    if isinstance(options, GraphoptConfig):
        raise ConfigError("graphopt.compile takes the options dict (as torch.compile's "
                          "options=), not a GraphoptConfig: pass e.g. {'attention': 'exact'}")
    if options is not None and not isinstance(options, Mapping):
        GraphoptConfig.from_options(options)  # the ConfigError naming the problem
    options = dict(options or {})
    if kwargs.get("mode") is not None:  # torch.compile refuses mode= with options=
        GraphoptConfig.from_options({"mode": kwargs["mode"]})  # an unknown mode, here
        if options.get("mode") not in (None, kwargs["mode"]):
            raise ConfigError(f"mode is given twice ({kwargs['mode']!r} and option "
                              f"{options['mode']!r}); give one")
        options["mode"] = kwargs.pop("mode")
    plan = options.pop(PARALLEL_OPTION, None)
    cluster = options.pop("cluster", None)
    if cluster is not None and plan != "auto":
        raise ConfigError("option 'cluster' describes the job for parallel='auto'; drop it "
                          "or set 'parallel': 'auto'")
    auto_notes: list[str] = []
    mixed = options.pop("mixed_precision", None)
    if plan == "auto":
        import torch.distributed as dist

        from graphopt.parallel.auto import auto_plan

        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("parallel='auto' plans for the world this process runs in: "
                              "launch with torchrun (or init_process_group) first")
        plan, auto_notes = auto_plan(model, dist.get_world_size(), cluster, mixed)
    elif plan is not None:
        from graphopt.planner.plan import ParallelPlan

        plan = ParallelPlan.load(plan) if isinstance(plan, (str, os.PathLike)) else plan
        if not isinstance(plan, ParallelPlan):
            raise ConfigError(f"option 'parallel' must be 'auto', a ParallelPlan or the path "
                              f"of its JSON, got {type(plan).__name__}")
    moe = options.pop("moe", None) if plan is not None and plan.ep > 1 else None
    if mixed is not None and plan is None:
        raise ConfigError("option 'mixed_precision' applies to a parallel plan (options["
                          "'parallel']); without one, run the compiled model under "
                          "torch.autocast(device, dtype=torch.bfloat16)")
    config = GraphoptConfig.from_options(options)
    if plan is not None:
        from graphopt.parallel import parallelize
        from graphopt.parallel.apply import _checkpointed, decoder_layers

        if config.attention == "lightning":
            _refuse_per_layer_lightning(config.lightning, plan, len(decoder_layers(model)))
        model = parallelize(model, plan, moe=moe,  # moe: the plan's EP runs it
                            mixed_precision=mixed)
        model.graphopt_parallel.notes[:0] = auto_notes
        if plan.pp > 1 and plan.pp_schedule == "zero_bubble":
            # torch's zero-bubble schedule runs a stage's backward as two autograd.grad calls:
            # input gradients (retain_graph=True), then weight gradients from the kept graph.
            # A backward compiled with AOTAutograd's donated buffers refuses the first (the
            # other pipeline ranks then waited forever: a review). torch 2.13 reads the flag
            # when it compiles and again when each backward runs (a backward compiled with it
            # off still fails its run-time check while it is on), so it is off process-wide.
            # Measured (tests/test_parallel_pp.py): the weight-gradient pass does not run
            # the compiled backward again (a step's GEMMs equal interleaved 1F1B's)
            import torch._functorch.config as functorch_config

            functorch_config.donated_buffer = False
            model.graphopt_parallel.notes.append(
                "zero-bubble: AOTAutograd's donated buffers are off in this process "
                "(torch._functorch.config.donated_buffer = False; the schedule's split "
                "backward keeps the compiled layers' graphs for the weight gradients)")
        if plan.tp > 1 and "dynamic" not in kwargs:
            # torch 2.13's AOTAutograd recurses without end tracing some DTensor graphs with
            # symbolic shapes (TP without SP, DeepSeek-V3's MLA under TP: a second sequence
            # length made Dynamo mark it dynamic, the recompile raised RecursionError, with
            # backend="aot_eager" too; pytorch/pytorch#152954, #152963). Static shapes: a new
            # length recompiles (up to torch._dynamo.config.recompile_limit per layer)
            kwargs = {**kwargs, "dynamic": False}
            model.graphopt_parallel.notes.append(
                "compiled with dynamic=False (tp > 1: torch's DTensor graphs fail to compile "
                "with dynamic shapes; each new sequence length recompiles; pass dynamic=... "
                "to override)")
        parts = getattr(model, "parts", None)  # pp > 1: this rank's pipeline stages
        blocks = [b for p in parts for b in p.layers.values()] if parts is not None \
            else decoder_layers(model)
        _raise_recompile_limit(len(blocks), model.graphopt_parallel.notes)
        for block in blocks:  # forward only: the TP/SP input hooks stay eager
            forward, recompute, theirs = block.forward, None, False
            inner = getattr(type(block).forward, "__wrapped__", None)
            if plan.tp > 1 and hasattr(block, "_can_checkpoint_with_cache") and \
                    callable(inner) and "forward" not in vars(block):
                # transformers' GradientCheckpointingLayer checkpoints inside its class's
                # forward (gradient_checkpointing_enable()): compiled, that is a checkpoint
                # over DTensors, which fails as below (a review); its own forward is
                # compiled and the checkpoint runs outside, as the plan's
                forward, theirs = types.MethodType(inner, block), True
            if isinstance(forward, functools.partial) and forward.func is _checkpointed and \
                    plan.tp > 1:  # the plan's recomputation stays outside the compiled
                # forward: torch 2.13's compile of a checkpoint over DTensors fails ("expected
                # all tensors_saved_with_vc_check to be Tensors, got ... DeviceMesh"); else
                # Dynamo captures the checkpoint and its policy (under DDP's graph splitting
                # a policy outside the compiled forward fails: SAC's dispatch mode caches
                # the fake tensors DDPOptimizer runs while it compiles)
                forward, recompute = forward.args
            block.forward = torch.compile(forward, backend="graphopt", options=options,
                                          **kwargs)
            # the layout's SP, not the plan's: parallelize turns SP off where TP splits no
            # mixer (Phi3's fused projections; a review: the plan's sp=True skipped this
            # and the backward raised "'Tensor' object has no attribute '_local_tensor'")
            if plan.tp > 1 and not model.graphopt_parallel.sp:
                block.forward = functools.partial(_waited_inputs, block.forward)
            if recompute is not None:
                block.forward = functools.partial(_checkpointed, block.forward, recompute)
            elif theirs:
                block.forward = functools.partial(_transformers_checkpointed, block,
                                                  block.forward)
        return model
    compiled = torch.compile(model, backend="graphopt", options=options, **kwargs)
    if isinstance(model, torch.nn.Module) and callable(getattr(model, "generate", None)):
        # torch.compile's module wrapper hands attributes to the original module, so
        # compiled.generate runs the whole decoding uncompiled, with no word (a review: no
        # graph, no kernel call). Compiling the forward for it shared Dynamo's recompile
        # limit with the training graphs of the same code (a re-review: after a few
        # generate calls a new training shape ran eagerly), so it says so instead.
        # Set on the wrapper itself (its __setattr__ would set the caller's model's)
        object.__setattr__(compiled, "generate", functools.partial(_uncompiled_generate,
                                                                   model))
    return compiled


def _refuse_per_layer_lightning(opts: Any, plan: Any, layers: int) -> None:
    """ConfigError where ``attention="lightning"`` (options ``opts``, a LightningOptions)
    under ``plan`` cannot convert as one process does. graphopt.compile compiles each
    decoder layer on its own, and Dynamo runs one layer's compiled graph for every layer
    whose guards it passes (the same code, parameters as inputs), so a choice made per layer
    would be one layer's for all; the pass does not even see the layer index (a review:
    every layer got the depth factor of a one-layer model, 0.19-0.21 gradient error vs one
    process under DP and Ulysses, reported as "layer None of 1"). And TP/CP split the
    attention heads (each rank's slopes would be those of a model with its share of heads)
    or, under ring CP, run attention inside graphopt's ring op, which the conversion never
    sees (the same review: nothing converted, nothing said)."""
    if plan.tp > 1 or plan.cp > 1:
        raise ConfigError(
            f"attention='lightning' under tp={plan.tp}, cp={plan.cp} is not executed: TP "
            "and Ulysses CP split the attention heads over ranks (each rank's decay slopes "
            "would be those of a model with its share of the heads) and ring CP runs "
            "attention inside its own op. Convert under data parallelism / FSDP / PP, or "
            "fine-tune the converted model's checkpoint under this plan")
    per_layer = [f"lightning.slopes='minimax' (a depth factor per layer, {layers} layers)"
                 if opts.slopes == "minimax" and opts.num_layers != 1 and layers > 1 else "",
                 f"lightning.every={opts.every}" if opts.every > 1 else "",
                 f"lightning.layers={list(opts.layers)}" if opts.layers else ""]
    chosen = [p for p in per_layer if p]
    if chosen:
        raise ConfigError(
            f"attention='lightning' with {' and '.join(chosen)} under a parallel plan is not "
            "executed: graphopt.compile compiles each decoder layer on its own and one "
            "compiled graph can serve every layer, so a choice per layer cannot be made. "
            "Use lightning={'slopes': 'alibi'} (the same slopes in every layer) with every=1 "
            "and no layers patterns, or compile the whole model without a plan "
            "(torch.compile(model, backend='graphopt', options=...))")


_RAISED: list[int] = []
"""[Dynamo's recompile_limit before graphopt.compile raised it, the value it set]."""


def _raise_recompile_limit(layers: int, notes: list[str]) -> None:
    """Let each of ``layers`` compiled decoder layers have Dynamo's recompile limit to
    itself. The layers share their forward's code object, and Dynamo counts its compiled
    entries per code object; a graph guarded on something of its own layer (a KV cache's
    ``cache.layers[i]``: transformers creates one in training too when ``use_cache`` is on)
    is compiled once per layer. A review: a 12-layer Llama under a DP plan ran layers
    8..11 uncompiled (no graphopt pass) after Dynamo's warning, at the default limit of 8.
    Raises ``torch._dynamo.config.recompile_limit`` (and ``accumulated_recompile_limit``)
    to ``layers`` x its value, process-wide, and says so in ``notes``; a later call starts
    from the value before graphopt raised it (the limit does not grow with each compile)."""
    import torch._dynamo.config as dynamo_config

    current = int(dynamo_config.recompile_limit)
    per_layer = _RAISED[0] if _RAISED and _RAISED[1] == current else current
    need = per_layer * max(layers, 1)
    if need > current:
        _RAISED[:] = [per_layer, need]
        dynamo_config.recompile_limit = need
        dynamo_config.accumulated_recompile_limit = max(
            int(dynamo_config.accumulated_recompile_limit), need)
        notes.append(f"Dynamo's recompile_limit raised from {per_layer} to {need} in this "
                     f"process ({per_layer} per compiled decoder layer: the layers share "
                     "their forward's code object, and a graph guarded per layer, e.g. on a "
                     "KV cache, compiles once per layer)")


def _uncompiled_generate(model: Any, *args: Any, **kwargs: Any) -> Any:
    """``model.generate(*args, **kwargs)``, warning that it runs uncompiled."""
    import warnings

    warnings.warn("graphopt: generate() on graphopt.compile(model)'s result runs the model "
                  "uncompiled (torch.compile's module wrapper hands generate to the original "
                  "module). To compile what generate calls, compile in place: "
                  "model.compile(backend='graphopt', options={...}) (its graphs count "
                  "against Dynamo's recompile limit with the training ones)",
                  UserWarning, stacklevel=2)
    return model.generate(*args, **kwargs)


def _transformers_checkpointed(block: Any, forward: Callable[..., Any], *args: Any,
                               **kwargs: Any) -> Any:
    """``forward`` (a compiled ``GradientCheckpointingLayer`` forward) under the layer's
    own gradient checkpointing where transformers would run it
    (``gradient_checkpointing_enable()``, training, grad mode on), with its cache
    arguments dropped as it does; else ``forward`` itself."""
    import torch

    if getattr(block, "gradient_checkpointing", False) and block.training and \
            torch.is_grad_enabled():
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        if not getattr(block, "_can_checkpoint_with_cache", False):
            for key in ("cache", "layer_past", "past_key_values"):
                if kwargs.get(key) is not None:
                    kwargs[key] = None
        return block._gradient_checkpointing_func(functools.partial(forward, **kwargs), *args)
    return forward(*args, **kwargs)


def _waited_inputs(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``forward`` with each ``AsyncCollectiveTensor`` argument replaced by a plain copy.

    TP without SP: the vocab-parallel embedding's all-reduced output (DTensor ``to_local``)
    is an AsyncCollectiveTensor, which torch 2.13 mishandles as an input of a compiled
    graph: the backward handed a plain gradient to DTensor's redistribute ("'Tensor' object
    has no attribute '_local_tensor'", backend="aot_eager" too). An eager clone (one
    hidden-state copy per step) waits for the collective and keeps the autograd edge."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.utils import _pytree as pytree

    def wait(x: Any) -> Any:
        return x.clone() if isinstance(x, AsyncCollectiveTensor) else x

    return forward(*pytree.tree_map(wait, args), **pytree.tree_map(wait, kwargs))


def graphopt_backend(gm: fx.GraphModule, example_inputs: Sequence[Any],
                     options: Mapping[str, Any] | GraphoptConfig | None = None,
                     mode: str | None = None) -> Callable[..., Any]:
    """Compile one Dynamo graph with graphopt.

    Args:
        gm: Dynamo's FX graph (Torch IR).
        example_inputs: the graph's inputs (tensors, ints for dynamic sizes).
        options: the dict given as ``torch.compile(..., options=...)``; see
            :class:`graphopt.config.GraphoptConfig` for keys.
        mode: ``torch.compile``'s mode, used by the inductor lowering.

    Raises:
        ConfigError, LoweringUnavailableError: bad options, before any compile work.
        PassFailedError: a pass failed; names it and the passes before it.
        VerificationError: ``verify`` found a numeric mismatch caused by an exact pass.
    """
    if isinstance(options, Mapping) and PARALLEL_OPTION in options:
        raise ConfigError("option 'parallel' shards the module before Dynamo captures it, so "
                          "torch.compile's backend cannot apply it: use graphopt.compile(model, "
                          "options={'parallel': plan, ...}) or model = graphopt.parallelize("
                          "model, plan) before torch.compile")
    config = GraphoptConfig.from_options(options, mode=mode)

    from graphopt.pipeline import compile_graph, outside_callers_saved_tensor_hooks

    with outside_callers_saved_tensor_hooks():
        return compile_graph(gm, example_inputs, config)

