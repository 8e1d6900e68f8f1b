"""Inductor lowering: Inductor compiles the forward/backward graphs graphopt transformed.

Inductor's ``compile_fx`` runs AOTAutograd with its decompositions; graphopt plugs in through
Inductor's documented hooks: ``config.custom_partitioner_fn`` (joint passes, then Inductor's
min-cut partitioner) and ``inner_compile`` (dumps, then ``compile_fx_inner``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch import fx
from torch._inductor import list_mode_options
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from graphopt.config import GraphoptConfig
from graphopt.errors import LoweringUnavailableError
from graphopt.lowering.base import (
    AOTHooks,
    Lowering,
    input_marker,
    lowering_key,
    mutated_input_marker,
)

SYMPY_EXPONENT = "Exponent must be non-negative"
"""torch's sympy error on some symbolic sizes (``pow_by_natural``), which graphopt names a
fix for (a review: plain backend='inductor' fails the same, with no hint)."""


def _source_hash() -> str:
    """Hash of graphopt's own sources: a cache entry made by other code is never reused."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _plugin_passes_key(config: GraphoptConfig) -> str:
    """Hash of the sources of the passes this compile runs that are not graphopt's own
    (``register_pass`` plugins: their module files, else their class source), and of every
    pass's options: a review got a stale entry made by an earlier version of a user's joint
    pass reused silently (its sin -> cos bug survived the fix). A pass without readable
    source gets a fresh key (never reused)."""
    import inspect
    import uuid

    from graphopt.passes import default_pipeline_names, get_pass

    defaults = default_pipeline_names()
    names = [n for n in defaults if n not in config.disable] + [
        n for n in config.enable if n not in defaults]
    digest = hashlib.sha256(repr(sorted(config.pass_options.items(), key=str)).encode())
    for name in names:
        cls = get_pass(name)
        module = inspect.getmodule(cls)
        if module is not None and module.__name__.split(".")[0] == "graphopt":
            continue  # in _source_hash
        file = getattr(module, "__file__", None)
        try:
            digest.update(Path(file).read_bytes() if file else
                          inspect.getsource(cls).encode())
        except (OSError, TypeError):
            digest.update(uuid.uuid4().bytes)
    return digest.hexdigest()[:16]


def _joint_options_key(config: GraphoptConfig) -> str:
    """What the joint passes' output depends on besides the graph: plugin passes' sources
    and every pass's options (:func:`_plugin_passes_key`), the remat options, the profile
    that prices its decision (the calibrated one, or a profile file: their contents), and
    (profile-guided mode) sizes observed at compile time, which are never reused from a
    cache."""
    plugins = _plugin_passes_key(config)
    if config.remat is None:
        return f"no-remat-{plugins}"
    key = f"{config.remat!r}-{plugins}"
    from graphopt.cost.profiles import default_profile_name, local_profile_path

    path = local_profile_path()
    if (config.remat.profile or default_profile_name()) == "local" and path.exists():
        key += hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    elif config.remat.profile and Path(str(config.remat.profile)).is_file():
        key += hashlib.sha256(Path(str(config.remat.profile)).read_bytes()).hexdigest()[:16]
    if config.remat.profile_guided:
        import uuid

        key += f"-observed-{uuid.uuid4()}"
    return key


class _JointPassPartitioner(CustomPartitionerFn):
    """Inductor's partitioner hook: graphopt's joint passes, then Inductor's min-cut
    (:func:`graphopt.lowering.base.min_cut_partition`).

    ``uuid`` keys Inductor's and AOTAutograd's caches by graphopt's sources and options, so
    a cached compile is only reused when the same passes would produce the same graphs (on
    a hit these hooks do not run and the report says so).
    """

    def __init__(self, hooks: AOTHooks, config: GraphoptConfig,
                 mark_mutated: Callable[[fx.GraphModule], None] | None = None,
                 mark_inputs: Callable[[fx.GraphModule], None] | None = None) -> None:
        self.hooks = hooks
        self.mark_mutated = mark_mutated
        # which inputs are not parameters, as the eager lowering marks them: the remat pass
        # prices and copies those it recomputes from (unmarked here before, a review: remat
        # under Inductor recomputed from a buffer the caller changed, gradients 38 off)
        self.mark_inputs = mark_inputs
        self.key = (f"graphopt-{_source_hash()}-{sorted(config.disable)}-"
                    f"{sorted(config.enable)}-{_joint_options_key(config)}")

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object],
                 **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        from graphopt.lowering.base import PARTITION_ARGS, min_cut_partition, pre_mutation_note
        from graphopt.passes.remat import offloads_kept_on_device, partition_claim_note

        if self.mark_mutated is not None:
            self.mark_mutated(gm)
        if self.mark_inputs is not None:
            self.mark_inputs(gm)
        gm.meta[PARTITION_ARGS] = (joint_inputs, kwargs)
        gm = self.hooks.run_joint(gm, "joint")
        self.hooks.graph_ready("joint", gm)
        forward, backward = min_cut_partition(gm, joint_inputs, **kwargs)
        for note in (offloads_kept_on_device(gm, forward), pre_mutation_note(forward),
                     partition_claim_note(gm, forward, kwargs.get("num_fwd_outputs"))):
            if note:
                self.hooks.note(note)
        return forward, backward

    def uuid(self) -> str:
        return self.key

    def __getstate__(self) -> dict[str, Any]:
        return {"key": self.key}  # Inductor pickles its config for cache keys; hooks aren't


class InductorLowering(Lowering):
    name = "inductor"

    def compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any], hooks: AOTHooks,
                config: GraphoptConfig) -> Callable[..., Any]:
        def inner(g: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
            if kwargs.get("is_backward"):
                kind = "backward"
            elif kwargs.get("is_inference"):
                kind = "inference"
                g = hooks.run_joint(g, "inference")
            else:
                kind = "forward"
            hooks.graph_ready(kind, g)
            with hooks.timed(lowering_key(kind)):
                try:
                    return compile_fx_inner(g, inputs, **kwargs)
                except Exception as exc:
                    if SYMPY_EXPONENT not in str(exc):
                        raise
                    raise LoweringUnavailableError(
                        f"Inductor could not compile this {kind} graph's symbolic sizes "
                        f"(torch's sympy: {SYMPY_EXPONENT!r}; backend='inductor' fails the "
                        "same, e.g. on MiniMax's lightning-attention block loop after a "
                        "dynamic recompile, a review): use options={'attention': 'exact'} "
                        "(graphopt replaces that loop), options={'lowering': 'eager'}, or "
                        "torch.compile(..., dynamic=False)") from exc

        patches: dict[str, Any] = {}
        if config.mode not in (None, "default"):
            patches.update(list_mode_options(config.mode))
        patches.update(config.inductor_config)
        if config.dump_dir is not None:  # a dump holds every graph: a cache hit would skip
            patches["force_disable_caches"] = True  # the joint/forward/backward ones
        patches["custom_partitioner_fn"] = _JointPassPartitioner(
            hooks, config, mutated_input_marker(gm), input_marker(example_inputs))
        return compile_fx(  # type: ignore[return-value]
            gm, list(example_inputs), inner_compile=inner, config_patches=patches)
