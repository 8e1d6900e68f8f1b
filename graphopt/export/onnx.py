"""ONNX export of graphopt-transformed models: ``graphopt.export_onnx``.

Pipeline (inference graphs; the model runs in eval mode under ``torch.no_grad``):

    model (transformers *ForCausalLM: input_ids [B, S] -> logits [B, S, V]; or any module)
     -> module rewrites          only where a graph cannot hold the pattern (below)
     -> torch.export             dynamic batch and sequence axes (Dim "batch", "seq")
     -> ep.module()              parameters as attributes, the user inputs as placeholders
     -> stage "pre_autograd"     graphopt's model passes (attention, moe, cse, ...), as in
                                 torch.compile, with the same report entries and dumps
     -> checks                   outputs unchanged; every graphopt op has an ONNX translation;
                                 no backward-only output is used
     -> torch.export again       the rewritten graph (graphopt ops are leaves: fake impls)
     -> torch.onnx.export        dynamo=True, custom_translation_table (translations.py),
                                 opset 18, the exporter's onnxscript optimizer
     -> onnx.checker             full check (with shape inference)

Module rewrite: MiniMax's lightning-attention block loop is Python control flow over the
sequence length (``for i in range(ceil(S / block))``), so torch.export specializes it to the
example length and a dynamic sequence axis is impossible. With ``attention`` "exact" or
"lightning" and a dynamic sequence, each such layer's forward is replaced, for the export only,
by the same layer calling ``graphopt::lightning_attention_fwd`` (the function the attention
pass's loop rewrite produces: exact); with static shapes the graph pass does it. The model's
own forward is restored afterwards.

Not exported: training graphs (backward, optimizer), collectives (expert parallelism ep > 1,
parallel plans), ``remat`` (a training-graph pass). Each is refused with a ConfigError naming
the fix. Source: torch.onnx's dynamo exporter (``torch.onnx.export(..., dynamo=True)``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import operator
import os
import re
import time
import types
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from graphopt.config import GraphoptConfig, require_writable_file
from graphopt.dump import Dumper
from graphopt.errors import ConfigError, GraphoptError
from graphopt.kernels.lightning.minimax import (
    decay_tables_problem,
    lightning_layers,
    minimax_lightning_layer,
)
from graphopt.models import (
    eval_mode,
    experts_implementation,
    max_positions,
    rope_kinds,
    rope_state_kept,
)
from graphopt.passes.fx_utils import attr_value
from graphopt.report import CompileReport

OPSET = 18

_NOT_FOR_EXPORT = {
    "remat": "remat plans the saved activations of training graphs; an ONNX export is an "
             "inference graph: drop 'remat'",
    "verify": "verify compares torch.compile with eager; export_onnx(check=True) compares "
              "onnxruntime with the PyTorch model: drop 'verify'",
    "lowering": "the ONNX runtime is the lowering of an exported model: drop 'lowering'",
    "inductor_config": "Inductor does not run in an ONNX export: drop 'inductor_config'",
    "mode": "torch.compile's mode picks Inductor's tuning; Inductor does not run in an ONNX "
            "export: drop 'mode'",
}


class ExportError(GraphoptError, RuntimeError):
    """The transformed graph cannot be exported to ONNX (names the op or value and the fix)."""


@dataclasses.dataclass
class OnnxExport:
    """What :func:`export_onnx` did.

    Attributes:
        path: the written .onnx file.
        report: the model passes' report (the same entries as a torch.compile report).
        translations: graphopt op -> the ONNX form it was exported as.
        module_rewrites: module paths replaced before tracing (see the module docstring).
        dynamic: the dynamic axes of each input, e.g. {"input_ids": {0: "batch", 1: "seq"}}.
        checks: (what, max abs error, tolerance) of onnxruntime vs PyTorch, filled by
            :func:`check_onnx`.
        seconds: time per step.
    """

    path: Path
    report: CompileReport
    translations: dict[str, str] = dataclasses.field(default_factory=dict)
    module_rewrites: list[str] = dataclasses.field(default_factory=list)
    dynamic: dict[str, dict[int, str]] = dataclasses.field(default_factory=dict)
    checks: list[tuple[str, float, float]] = dataclasses.field(default_factory=list)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    example_inputs: tuple = ()
    transformed: fx.GraphModule | None = dataclasses.field(default=None, repr=False)
    """The PyTorch graph after graphopt's passes (what the ONNX file computes)."""
    eager: nn.Module | None = dataclasses.field(default=None, repr=False)
    """The module as given (a causal LM wrapped as input_ids -> logits)."""
    shapes: Any = dataclasses.field(default=None, repr=False)
    """torch.export's ``dynamic_shapes`` as exported."""
    sizes: tuple[list[tuple], dict] | None = dataclasses.field(default=None, repr=False)
    """The exported program's symbolic input shapes and size ranges (the check grows the
    example along them); None when every size is static."""

    @property
    def ok(self) -> bool:
        """Every check within tolerance (True when nothing was checked). A reference that
        could not run (error and tolerance NaN, the reason in its label) does not count;
        the check against the transformed graph still does."""
        return all(err <= tol for _, err, tol in self.checks
                   if not (math.isnan(err) and math.isnan(tol)))

    def to_markdown(self) -> str:
        """The pass report plus what the export did."""
        lines = [self.report.to_markdown(), "", f"## ONNX export: {self.path}", ""]
        values = list(self.example_inputs) + [None] * len(self.dynamic)
        for (name, axes), value in zip(self.dynamic.items(), values):
            if value is not None and not any(isinstance(x, torch.Tensor) for x in
                                             torch.utils._pytree.tree_leaves(value)):
                # torch.export specializes non-tensor inputs: not an input of the file (a
                # review read "dynamic axes none" as an input that exists)
                lines.append(f"- input `{name}`: the Python value {value!r}, baked into the "
                             "file as a constant (not an ONNX input)")
                continue
            lines.append(f"- input `{name}`: dynamic axes {axes or 'none'}")
        for op_name, form in self.translations.items():
            lines.append(f"- `{op_name}` exported as {form}")
        for path in self.module_rewrites:
            lines.append(f"- module rewrite: `{path}` (MiniMax lightning layer -> "
                         "graphopt::lightning_attention_fwd before tracing)")
        for what, err, tol in self.checks:
            lines.append(f"- check {what}: max abs error {err:.3g} " + (
                "(approximate: reported, not checked)" if tol == float("inf")
                else f"(tolerance {tol:.3g})"))
        return "\n".join(lines)


class CausalLMLogits(nn.Module):
    """``input_ids [B, S] int64 -> logits [B, S, V]`` of a transformers causal LM, without the
    KV cache: the function an exported decoder-only model serves (prefill/scoring)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids, use_cache=False)
        logits = getattr(out, "logits", None)
        if not isinstance(logits, torch.Tensor):
            raise ConfigError(
                f"{type(self.model).__name__} returns {type(out).__name__} without logits: "
                "export_onnx exports a transformers model as input_ids -> logits (a causal "
                "LM); for a base model or other outputs, wrap it in an nn.Module whose "
                "forward returns the tensors to export, and export that")
        return logits


def export_onnx(model: nn.Module, example_inputs: torch.Tensor | Sequence[Any],
                options: Mapping[str, Any] | None = None, path: str | Path = "model.onnx", *,
                dynamic: bool = True, dynamic_shapes: Any = None, moe_form: str = "gather",
                check: bool = False) -> OnnxExport:
    """Export ``model`` after graphopt's model passes to an ONNX file of standard ops.

    Args:
        model: a transformers causal LM (exported as ``input_ids -> logits``, see
            :class:`CausalLMLogits`) or any ``nn.Module`` taking tensors.
        example_inputs: input_ids [B, S] int64 for a causal LM (B >= 2 and S >= 2, so the
            traced sizes are not specialized to 1), else the module's positional inputs.
        options: graphopt options for the model passes: ``attention`` ("keep" | "exact" |
            "lightning", approximate), ``lightning``, ``moe`` (ep must be 1), ``disable``,
            ``enable``, ``dump_dir``. ``remat``, ``verify``, ``lowering`` are refused.
        path: the .onnx file to write (parent directories are created).
        dynamic: causal LMs: batch and sequence axes of input_ids dynamic ("batch", "seq").
            False: static shapes (the example's).
        dynamic_shapes: other modules: torch.export's ``dynamic_shapes`` for the inputs.
        moe_form: how ``graphopt::moe_experts`` is exported: "gather" (routed tokens only) or
            "dense" (every expert on every token, masked; static-shape runtimes).
        check: run onnxruntime on the example inputs (and, when dynamic, on a second batch
            and sequence length) against the PyTorch model; see :func:`check_onnx`.

    Returns:
        :class:`OnnxExport` (path, pass report, forms, module rewrites, dynamic axes, checks).

    Raises:
        ConfigError: an option that does not apply to an export, moe ep > 1, an unknown
            moe_form, bad example inputs.
        ExportError: a graphopt op without a translation (named), a backward-only output in
            use, torch.export specializing a dynamic axis (with the reason and the fix).
        ImportError: onnx / onnxscript missing (``pip install 'graphopt[onnx]'``).
    """
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as exc:
        raise ImportError("ONNX export needs onnx and onnxscript: pip install "
                          "'graphopt[onnx]' (from a clone: pip install -e '.[onnx]')") from exc
    from graphopt.export.translations import MOE_FORMS  # imports onnxscript
    config = _export_config(options)
    if moe_form not in MOE_FORMS:
        raise ConfigError(f"moe_form must be one of {', '.join(MOE_FORMS)}, got {moe_form!r}")
    module, args, shapes, names = _prepare(model, example_inputs, dynamic, dynamic_shapes)
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"path must be the .onnx file to write (a str or Path), got "
                          f"{type(path).__name__}")
    path = Path(path)
    require_writable_file(path, "give a writable path to the .onnx file", regular=True)
    report = CompileReport(graph_id=-1, options={"export": "onnx", **dict(options or {})})
    result = OnnxExport(path=path, report=report, dynamic=_axes(names, shapes),
                        example_inputs=args, eager=module, shapes=shapes)
    # (a review: the dumped report said "dynamic: False, lowering: ``" for a dynamic export)
    report.dynamic, report.lowering = any(result.dynamic.values()), "onnx"
    # every submodule back in its own mode afterwards, and length-dependent rotary state
    # (Phi-3 longrope, dynamic NTK) as it was: tracing left a FakeTensor in the caller's
    # model (a review: its logits past the original length 1.3e-3 off, a second export
    # failed)
    with eval_mode(model), rope_state_kept(model):
        with torch.no_grad(), _module_rewrites(model, config, shapes is not None) as swapped:
            result.module_rewrites = swapped
            t0 = time.perf_counter()
            exported = _torch_export(module, args, shapes, config,
                                     loops=bool(lightning_layers(model)))
            result.sizes = _symbolic_sizes(exported)
            result.seconds["torch_export"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            gm, dumper = _run_model_passes(exported, args, config, report,
                                           "model." if module is not model else "")
            result.transformed = gm
            result.seconds["passes"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            table, result.translations = _translations(gm, moe_form)
            final = _torch_export(gm, args, shapes, config)
            result.seconds["retrace"] = time.perf_counter() - t0
            _refuse_outputs_that_are_not_tensors(final)
            t0 = time.perf_counter()
            skipped = [f"{site.site}: {site.reason}" for record in report.pass_records("moe")
                       for site in record.sites if site.action == "skipped"]
            program = _onnx_export(final, table, skipped if config.moe is not None else None)
            assert program is not None  # dynamo=True returns the program
            _name_axes(program.model, result.dynamic,
                       ["logits"] if isinstance(module, CausalLMLogits) else None)
            program.save(str(path))
            result.seconds["onnx"] = time.perf_counter() - t0
    import onnx

    onnx.checker.check_model(str(path), full_check=True)
    if not onnx.load(str(path), load_external_data=False).graph.output:
        raise ExportError(f"the model returns no tensor, so {path} has no outputs (an ONNX "
                          "graph computes tensors): return the tensors to export")
    report.status = "exported"
    dumper.write_report()  # the dump's report says how the export ended
    if check:
        check_onnx(result)
    return result


def _export_config(options: Mapping[str, Any] | None) -> GraphoptConfig:
    if options is not None and not isinstance(options, Mapping):
        raise ConfigError(f"options must be a dict of graphopt options (e.g. {{'attention': "
                          f"'exact', 'moe': {{}}}}), got a {type(options).__name__}")
    # an option that says "off" (remat None, verify False, an empty inductor_config) is
    # dropped rather than refused (a review)
    options = {k: v for k, v in (options or {}).items()
               if not (k in _NOT_FOR_EXPORT and k != "lowering" and v in (None, False, {}))}
    for key, why in _NOT_FOR_EXPORT.items():
        if key in options:
            raise ConfigError(f"option {key!r} does not apply to an ONNX export: {why}")
    config = GraphoptConfig.from_options(options)
    if config.moe is not None and config.moe.ep > 1:
        raise ConfigError(f"moe ep={config.moe.ep} exchanges tokens between ranks (all-to-all); "
                          "an ONNX graph runs on one device: export with ep=1 (the default)")
    return config


def _prepare(model: nn.Module, example_inputs: Any, dynamic: bool, dynamic_shapes: Any
             ) -> tuple[nn.Module, tuple, Any, list[str]]:
    """(module to trace, positional args, torch.export dynamic_shapes, input names)."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"export_onnx takes an nn.Module, got {type(model).__name__}")
    if getattr(model, "config", None) is not None and hasattr(model, "get_input_embeddings"):
        if getattr(model.config, "is_encoder_decoder", False):  # a review: T5 died in
            # transformers ("specify exactly one of input_ids or inputs_embeds")
            raise ConfigError(
                f"{type(model).__name__} is an encoder-decoder model; export_onnx exports a "
                "transformers model as input_ids -> logits of a decoder-only (causal) LM: "
                "wrap it in an nn.Module whose forward takes the tensors it needs "
                "(input_ids, decoder_input_ids) and returns the tensors to export, and "
                "export that")
        ids = example_inputs[0] if isinstance(example_inputs, (tuple, list)) else example_inputs
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.int64:
            raise ConfigError("a causal LM is exported as input_ids -> logits: pass input_ids "
                              "[B, S] int64 as example_inputs")
        _refuse_what_onnx_cannot_hold(model, (ids,))
        if dynamic and (ids.shape[0] < 2 or ids.shape[1] < 2):
            raise ConfigError(f"example input_ids {tuple(ids.shape)}: with dynamic axes use "
                              "B >= 2 and S >= 2 (torch.export specializes sizes 0 and 1)")
        if dynamic_shapes is not None:
            raise ConfigError("dynamic_shapes is for other modules; a causal LM takes "
                              "dynamic=True (batch and seq) or False")
        if isinstance(example_inputs, (tuple, list)) and len(example_inputs) != 1:
            raise ConfigError(f"a causal LM is exported as input_ids -> logits: pass one "
                              f"tensor, got {len(example_inputs)} inputs")
        vocab = getattr(model.config, "vocab_size", None)
        if ids.numel() and isinstance(vocab, int) and \
                not (0 <= int(ids.min()) and int(ids.max()) < vocab):
            raise ConfigError(f"example input_ids range over [{int(ids.min())}, "
                              f"{int(ids.max())}]; the model's vocabulary is [0, {vocab - 1}] "
                              "(token ids outside it fail in the embedding's gather)")
        longest = max_positions(model)
        if longest is not None and ids.shape[1] > longest:
            raise ConfigError(f"example input_ids have {ids.shape[1]} positions; the model "
                              f"takes at most {longest} (its max_position_embeddings)")
        if dynamic and longest is not None and ids.shape[1] >= longest:
            raise ConfigError(f"example input_ids have {ids.shape[1]} positions, the model's "
                              f"max_position_embeddings: a dynamic sequence axis ranges over "
                              f"[2, {longest - 1}] (a model with a position table guards "
                              f"seq < max): use at most {longest - 1} positions, or "
                              "dynamic=False (--static) to export this length")
        # a model with a position table (GPT-Neo's [max, max] mask buffer) guards seq < max
        seq_dim = torch.export.Dim("seq") if longest is None else \
            torch.export.Dim("seq", max=max(longest - 1, 2))
        shapes = ({0: torch.export.Dim("batch"), 1: seq_dim},) if dynamic else None
        return CausalLMLogits(model), (ids,), shapes, ["input_ids"]
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) \
        else (example_inputs,)
    for i, x in enumerate(torch.utils._pytree.tree_leaves(args)):
        if isinstance(x, torch.Tensor) and x.layout != torch.strided:
            raise ConfigError(f"input {i} is a {x.layout} tensor: an ONNX file takes dense "
                              "inputs; pass x.to_dense()")
    args = _separate_aliased(args)
    _refuse_what_onnx_cannot_hold(model, args)
    if not dynamic and dynamic_shapes is not None:
        raise ConfigError("dynamic=False and dynamic_shapes contradict each other: drop one")
    try:
        params = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        params = []
    names = [params[i] if i < len(params) else f"input_{i}" for i in range(len(args))]
    if isinstance(dynamic_shapes, Mapping):  # keyed by argument name, in any order: the
        # positional order (_axes read the values in the dict's order, a review)
        unknown = sorted(set(dynamic_shapes) - set(names))
        if unknown:
            raise ConfigError(f"dynamic_shapes names {unknown}, which are not among the "
                              f"inputs {names}: key it by the forward's argument names")
    return model, args, dynamic_shapes, names


def _separate_aliased(args: tuple) -> tuple:
    """``args`` with every tensor that shares memory with an earlier one cloned, and none
    requiring grad. torch.export deduplicates one tensor passed as several inputs (``(q, q,
    q)``), so the file read one input for all three and ignored the others: 106 off on
    distinct inputs while the check on the example passed; a view of another input (``q[:1]
    .expand(...)`` next to ``q``) crashed the conversion (a review). Each input of the file
    is its own tensor, so the example's are made so."""
    seen: set[int] = set()

    def separate(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        x = x.detach()
        key = x.untyped_storage().data_ptr() if x.device.type != "meta" else id(x)
        if key in seen and x.numel():
            return x.clone()
        seen.add(key)
        return x

    return torch.utils._pytree.tree_map(separate, args)


def _refuse_what_onnx_cannot_hold(model: nn.Module, args: tuple) -> None:
    """ConfigError for tensors an ONNX file run by onnxruntime cannot hold: on the meta
    device (no values to write), complex (no ONNX type onnxruntime runs), empty example
    inputs (torch.export specializes size 0); found by a review as third-party errors."""
    named = [(f"input {i}", x) for i, x in enumerate(torch.utils._pytree.tree_leaves(args))
             if isinstance(x, torch.Tensor)]
    named += [(f"parameter {n}", p) for n, p in model.named_parameters()]
    for what, t in named:
        if t.is_meta:
            raise ConfigError(f"{what} is on the meta device: an ONNX file holds real "
                              "values; materialize the model (to_empty + load weights) first")
        if t.is_complex():
            raise ConfigError(f"{what} is {t.dtype}: ONNX runtimes have no complex tensors; "
                              "export real and imaginary parts (torch.view_as_real)")
        if what.startswith("input") and t.numel() == 0:
            raise ConfigError(f"{what} is empty {tuple(t.shape)}: export with a non-empty "
                              "example (torch.export specializes sizes 0 and 1)")


def _refuse_outputs_that_are_not_tensors(exported: Any) -> None:
    """ExportError for an output that is not a tensor (a Python or symbolic number): an ONNX
    graph's outputs are tensors, and torch.onnx failed on it with its generic conversion
    error (a review)."""
    outputs = torch.utils._pytree.tree_leaves(exported.graph.output_node().args[0])
    for i, out in enumerate(outputs):
        value = out.meta.get("val") if hasattr(out, "meta") else out
        if not isinstance(value, torch.Tensor):
            raise ExportError(f"output {i} of the model is {type(value).__name__} "
                              f"{value!r}, not a tensor: an ONNX graph returns tensors; "
                              "return it as one (torch.tensor / a size as x.new_tensor) or "
                              "drop it")


def _axes(names: list[str], shapes: Any) -> dict[str, dict[int, str]]:
    if shapes is None:
        return {name: {} for name in names}
    specs = [shapes.get(name) for name in names] if isinstance(shapes, Mapping) \
        else list(shapes)
    out = {}
    for name, spec in zip(names, specs):
        spec = spec or {}
        out[name] = {axis: dim.__name__ if hasattr(dim, "__name__") else "auto"
                     for axis, dim in spec.items()} if _is_axes(spec) else {}
    return out


def _is_axes(spec: Any) -> bool:
    """Whether ``spec`` is one tensor's {axis: Dim} (not a nested input's dict of them)."""
    return isinstance(spec, dict) and all(isinstance(k, int) for k in spec)


def _torch_export(module: nn.Module, args: tuple, shapes: Any, config: GraphoptConfig,
                  loops: bool = False) -> torch.export.ExportedProgram:
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    try:
        return torch.export.export(module, args, dynamic_shapes=shapes, strict=False)
    except GuardOnDataDependentSymNode as exc:
        hint = (" transformers' eager experts loop iterates over the experts that received "
                "tokens: call model.set_experts_implementation('grouped_mm') (with "
                "options={'moe': {}}) or 'batched_mm' before exporting"
                if "expert" in str(exc) else "")
        dynamic_rope = [name for name, m in module.named_modules()  # dynamic NTK scaling
                        if any("dynamic" in k for k in rope_kinds(m))]
        if dynamic_rope:  # a review: the message named neither the module nor a way out
            hint += (f" {dynamic_rope[0]} is a rotary embedding with dynamic NTK scaling: "
                     "it recomputes its frequencies when max(position_ids) passes the "
                     "longest sequence seen, a branch on tensor values that an ONNX graph "
                     "cannot hold. Export a copy whose config.rope_parameters has a static "
                     "rope_type ('default', 'linear', 'yarn'; numerics past "
                     "max_position_embeddings change), or serve this model with "
                     "torch.compile(backend='graphopt')")
        raise ExportError("torch.export met data-dependent Python control flow: "
                          f"{str(exc).splitlines()[0]}.{hint}") from exc
    except torch._dynamo.exc.UserError as exc:
        hint = ""
        replaced = config.attention != "keep" and "attention" not in config.disable
        if loops and not replaced and "Constraints violated" in str(exc):
            hint = (" A Python loop over the sequence (MiniMax's lightning-attention blocks) "
                    "specializes the sequence axis: use options={'attention': 'exact'} (graphopt "
                    "replaces the loop; not with 'attention' disabled; `graphopt export "
                    "--attention exact`) or dynamic=False (`--static`).")
        # torch's own explanation and suggested fix follow its first line: keep them
        detail = "\n".join(str(exc).splitlines()[:12])
        raise ExportError(f"torch.export could not keep the requested dynamic axes: "
                          f"{detail}{hint}") from exc


def _run_model_passes(exported: torch.export.ExportedProgram, args: tuple,
                      config: GraphoptConfig, report: CompileReport, wrapper: str = ""
                      ) -> tuple[fx.GraphModule, Dumper]:
    """Run stage "pre_autograd" on the exported graph (parameters as attributes); returns
    the graph and its dumper. ``wrapper``: the path prefix of the model inside the module
    exported (:class:`CausalLMLogits`' ``"model."``), dropped from the nodes' module paths
    so that reports and module-path options (``lightning.layers``) name the model's own
    modules, as under torch.compile (a review: ``"model.layers.0.*"`` selected layer 0
    when compiled and nothing when exported)."""
    from graphopt.capture import check_outputs
    from graphopt.pipeline import PassRunner, copy_graph_module

    gm = exported.module(check_guards=False)  # the retrace checks the shapes again
    assert isinstance(gm, fx.GraphModule)
    _fake_attr_meta(gm)
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if wrapper and stack:
            node.meta["nn_module_stack"] = {
                key: ("" if str(value[0]) == wrapper.rstrip(".") else
                      str(value[0]).removeprefix(wrapper), *value[1:])
                for key, value in stack.items()}
    # torch.export's dtype assertions on intermediate values: side-effecting nodes that would
    # keep a region a pass replaced alive (the retrace checks dtypes again).
    for node in list(gm.graph.find_nodes(op="call_function",
                                         target=torch.ops.aten._assert_tensor_metadata.default)):
        gm.graph.erase_node(node)
    gm.recompile()
    original = copy_graph_module(gm)
    flat = [x for x in torch.utils._pytree.tree_leaves(args)]
    dumper = Dumper(config.dump_dir, report.graph_id, report)
    dumper.graph("01_exported", gm, render=True)
    runner = PassRunner(config, report, dumper, flat)
    report.graphs["model"] = len(gm.graph.nodes)
    gm = runner.run_stage("pre_autograd", gm, "inference", training=False)
    report.graphs["model_after_passes"] = len(gm.graph.nodes)
    problem = check_outputs(original, gm)
    if problem:
        raise ExportError(f"graphopt's model passes ({', '.join(runner.ran)}) changed the "
                          f"exported graph's outputs: {problem}; export with those passes "
                          "disabled (options={'disable': [...]}) and please report it")
    dumper.graph("02_after_passes", gm, render=True)
    dumper.write_report()
    return gm, dumper


def _fake_attr_meta(gm: fx.GraphModule) -> None:
    """``meta['val']`` for get_attr tensors (parameters, buffers) as fakes of the export's
    fake mode, so passes that fake-run new nodes mix no real tensors in."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if "val" in n.meta])
    for node in gm.graph.find_nodes(op="get_attr"):
        value = attr_value(gm, str(node.target))
        if isinstance(value, torch.Tensor) and "val" not in node.meta and mode is not None:
            node.meta["val"] = mode.from_tensor(value, static_shapes=True)


def _translations(gm: fx.GraphModule, moe_form: str) -> tuple[dict[Any, Any], dict[str, str]]:
    """The translation table; ExportError for a graphopt op without one or a backward-only
    output in use."""
    from graphopt.export.translations import translation_table

    table = translation_table(moe_form)
    forms = {"graphopt.lightning_attention_fwd": "ONNX Loop over chunks (chunked form, "
                                                  "recurrent If-branch for S == 1)",
             "graphopt.moe_experts": f"{moe_form} form" + (
                 " (per expert: NonZero, Gather, MatMul, ScatterND add)" if moe_form == "gather"
                 else " (every expert on every token, routing-weight mask)")}
    used: dict[str, str] = {}
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or \
                target.namespace != "graphopt":
            continue
        name = f"graphopt.{target._opname}"
        if target not in table:
            raise ExportError(f"{name} (node {node.name}) has no ONNX translation; graphopt "
                              f"translates {', '.join(sorted(forms))}. Disable the pass that "
                              "inserted it (options={'disable': [...]}) to export the "
                              "model's own ops")
        if target._opname == "moe_experts":
            dead = [u.name for u in node.users
                    if u.target is not operator.getitem or u.args[1] != 0]
            if dead:
                raise ExportError(f"{node.name}: the backward-only outputs of "
                                  f"graphopt.moe_experts are used ({dead}); ONNX export covers "
                                  "inference graphs")
        used[name] = forms[name]
    return table, used


def _name_axes(model: Any, dynamic: Mapping[str, Mapping[int, str]],
                outputs: Sequence[str] | None) -> None:
    """Give the ONNX model's symbolic dimensions the names of the export's dynamic axes
    (``batch``, ``seq``, a ``torch.export.Dim``'s name) everywhere they occur, and its
    outputs ``outputs``' names; the re-traced graph had left torch's symbols (``s72``) and
    node names (``linear_14``), found by a review. Axes left to torch.export ("auto") keep
    theirs."""
    import onnx_ir as ir

    graph = model.graph
    rename: dict[str, str] = {}
    for value in graph.inputs:
        for axis, name in dynamic.get(value.name or "", {}).items():
            dim = value.shape[axis] if value.shape is not None else None
            if name != "auto" and isinstance(dim, ir.SymbolicDim) and dim.value:
                rename[dim.value] = name
    if rename:
        _rename_dims(graph, rename)
    if outputs is not None and len(outputs) == len(graph.outputs):
        for value, name in zip(graph.outputs, outputs):
            value.name = name


def _rename_dims(graph: Any, rename: Mapping[str, str]) -> None:
    """Replace the symbols ``rename`` names in every value's symbolic dimensions of the
    onnx_ir ``graph`` (whole words: "s70 + 1" -> "seq + 1")."""
    import onnx_ir as ir

    symbol = re.compile(r"\b(" + "|".join(map(re.escape, rename)) + r")\b")

    def named(dim: Any) -> Any:  # "s70" -> "seq", "s70 + 1" -> "seq + 1"
        if not isinstance(dim, ir.SymbolicDim) or not dim.value:
            return dim
        return ir.SymbolicDim(symbol.sub(lambda m: rename[m.group(1)], dim.value))

    for value in (*graph.inputs, *graph.outputs,
                  *(out for node in ir.traversal.RecursiveGraphIterator(graph)
                    for out in node.outputs)):
        if value.shape is not None:
            value.shape = ir.Shape([named(d) for d in value.shape])


def _onnx_export(exported: torch.export.ExportedProgram, table: dict[Any, Any],
                 moe_skipped: list[str] | None = None) -> Any:
    """torch.onnx.export; an op ONNX cannot express becomes an ExportError naming it."""
    try:
        return torch.onnx.export(exported, custom_translation_table=table, dynamo=True,
                                 opset_version=OPSET, optimize=True, verbose=False)
    except Exception as exc:
        found = re.search(r"No ONNX function found for <OpOverload\(op='([^']+)'", str(exc))
        failed = re.search(r"Error when translating node %\S+ : .*?target=([\w.:]+)", str(exc))
        if found is None and failed is not None:  # a translation refused these arguments
            reason = re.search(r"<class '[^']+'>: (.+)", str(exc))  # the innermost cause
            why = reason.group(1).rstrip(".") if reason else type(exc).__name__
            target = failed.group(1)
            where = ("torch.onnx's translation of this ATen op refused these arguments: "
                     "write the call with them explicit (e.g. amax with dim), "
                     if target.startswith("torch.ops.aten.") else "")
            raise ExportError(
                f"ONNX export of {target} failed: {why}; {where}replace the module that "
                "calls it, or register a translation in graphopt/export/translations.py"
            ) from None
        if found is None:
            raise
        name = found.group(1)
        if "grouped_mm" not in name:
            hint = (" replace the module that calls it, or register a translation in "
                    "graphopt/export/translations.py")
        elif moe_skipped is None:
            hint = (" transformers' grouped_mm experts: rewrite them with options={'moe': {}} "
                    "(graphopt's moe_experts has a translation), or call "
                    "model.set_experts_implementation('batched_mm') (standard ops)")
        else:  # the moe pass ran and left these experts as they are (a review: the hint
            # sent a user who had given options={'moe': {}} back to it)
            why = "; ".join(moe_skipped[:2]) or "no MoE layer it matched"
            hint = (f" transformers' grouped_mm experts, which graphopt's moe pass left as "
                    f"they are ({why}): call model.set_experts_implementation('batched_mm') "
                    "(standard ops) before exporting")
        raise ExportError(f"ONNX has no translation of {name} (torch.onnx and graphopt know "
                          f"none).{hint}") from None


# -------------------------------------------------------------------- module rewrites

def minimax_lightning_forward(self: Any, hidden_states: torch.Tensor, *args: Any,
                              attention_mask: torch.Tensor | None = None, **kwargs: Any
                              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """MiniMax's lightning layer with its block loop as one ``graphopt::lightning_attention_fwd``
    call (no cache): ([B, S, hidden], final state [B, H, D, D])."""
    from graphopt.kernels.lightning.op import lightning_attention

    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out, state = lightning_attention(q, k, v, slope, output_final_state=True,
                                         impl="chunked")
        return out, state

    return minimax_lightning_layer(self, hidden_states, attention_mask, kernel)


@contextlib.contextmanager
def _module_rewrites(model: nn.Module, config: GraphoptConfig, dynamic_seq: bool
                     ) -> Iterator[list[str]]:
    """Swap MiniMax lightning layers' forward for the export (module docstring)."""
    swapped: list[tuple[nn.Module, Any]] = []
    if dynamic_seq and config.attention != "keep" and "attention" not in config.disable:
        for path, module in lightning_layers(model):
            problem = decay_tables_problem(module)
            if problem:  # the rewrite computes the decay from slope_rate alone
                raise ExportError(f"{path}: a dynamic export replaces this lightning layer's "
                                  f"block loop by graphopt's op, computed from slope_rate, "
                                  f"but {problem}; or export with dynamic=False (--static: "
                                  "the loop is traced at the example's length)")
        for _, module in lightning_layers(model):
            swapped.append((module, module.__dict__.get("forward")))
            module.forward = types.MethodType(minimax_lightning_forward, module)
    try:
        yield [path for path, m in lightning_layers(model) if any(m is s for s, _ in swapped)]
    finally:
        for module, previous in swapped:
            if previous is None:
                del module.forward
            else:
                module.forward = previous


# ------------------------------------------------------------------------------ checks


def check_onnx(result: OnnxExport, rtol: float | None = None, atol: float | None = None
               ) -> OnnxExport:
    """Run the exported file with onnxruntime and compare with PyTorch.

    Inputs: the export's example inputs and, when it has dynamic axes, inputs grown by one
    along the batch axis and by three along the others. References: the graphopt-transformed
    PyTorch model (``result.transformed``: the graph after the passes, the function the ONNX
    file must compute) and the eager model (``result.eager``); after an approximate rewrite
    (attention="lightning", moe capacity) the second differs by design and is reported with
    an infinite tolerance. Appends (what, max abs error, tolerance) to ``result.checks``;
    tolerance = atol + rtol * max |reference| (1e-4 each; 1e-2 for float16 models; 1e-6
    for float64 models, whose float32 islands, transformers' RoPE tables and router
    softmaxes, put onnxruntime 6e-8 to 9e-8 off in a review: 1e-4 would pass a float64 file
    that lost precision). The
    references run in eval mode, as the export traced them. With an input named
    ``attention_mask`` of 0s and 1s ([batch, seq], transformers' convention: 1 keeps a
    position, 0 is padding), outputs that start with [batch, seq] are compared at the
    positions it keeps: a padded query's row (left padding: attends to nothing) is defined
    differently by each runtime and by no model. Other masks (``key_padding_mask``: True is
    padding) are compared everywhere.

    Raises:
        ImportError: onnxruntime is not installed (``pip install onnxruntime``).
        ConfigError: a bfloat16 model (onnxruntime's CPU provider lacks the kernels).
    """
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise ImportError(f"check=True runs onnxruntime, which is not installed (the file "
                          f"{result.path} is written): pip install onnxruntime (or 'graphopt"
                          "[onnx]'), or export with check=False (graphopt export --no-check)"
                          ) from exc

    dtypes = {p.dtype for p in (result.eager.parameters() if result.eager is not None else ())}
    if torch.bfloat16 in dtypes:
        raise ConfigError("check=True runs onnxruntime's CPU provider, which has no bf16 "
                          "kernels for this graph; the file is written: check a float32 "
                          "export (or run check=False)")
    default = 1e-2 if torch.float16 in dtypes else 1e-6 if dtypes == {torch.float64} else 1e-4
    rtol = default if rtol is None else rtol
    atol = default if atol is None else atol
    session = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    cases: list[tuple[str, tuple]] = [("example inputs", result.example_inputs)]
    grown = _grown(result.example_inputs, result)
    if grown is not None:
        cases.append(grown)
    exact = all(p.exact for p in result.report.passes if p.modified)
    references = [("graphopt-transformed model", result.transformed, True),
                  ("eager model", result.eager, exact)]
    for what, inputs in cases:
        # nested inputs (a dict of tensors) are flattened as torch.export flattened them
        # (a review: the check fed the top-level tensors only and failed in onnxruntime)
        tensors = [x for x in torch.utils._pytree.tree_leaves(inputs)
                   if isinstance(x, torch.Tensor)]
        if len(tensors) != len(names):
            result.checks.append((f"onnxruntime vs PyTorch, {what}: not run, {len(names)} "
                                  f"ONNX inputs for {len(tensors)} tensors given",
                                  float("inf"), 0.0))
            continue
        got = session.run(None, dict(zip(names, [x.detach().numpy() for x in tensors])))
        kept = _kept_positions(names, tensors)
        for ref_name, module, binding in references:
            if module is None:
                continue
            try:
                with torch.no_grad(), _eval_mode(module):  # as exported: no dropout
                    want = module(*inputs)
            except RuntimeError as exc:  # e.g. float64 grouped_mm experts on the CPU
                if module is result.transformed:  # the graph the file computes must run
                    raise
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                try:  # the same experts as transformers' per-expert loop (a review: a
                    # float32 hidden size grouped_mm refuses left no eager comparison)
                    with torch.no_grad(), _eval_mode(module), experts_implementation(
                            module, "eager", lambda kind: kind != "eager") as swap:
                        want = module(*inputs) if swap else None
                except RuntimeError:
                    want = None
                if want is not None:
                    ref_name += " with eager experts (grouped_mm refuses these inputs here)"
            if want is None:
                result.checks.append((f"onnxruntime vs {ref_name}, {what}: not compared, the "
                                      f"PyTorch model fails on these inputs ({first})",
                                      float("nan"), float("nan")))
                continue
            wants = [w for w in torch.utils._pytree.tree_leaves(want)
                     if isinstance(w, torch.Tensor)]
            if len(wants) != len(got):
                result.checks.append((f"onnxruntime vs {ref_name}, {what}: {len(got)} outputs "
                                      f"for {len(wants)}", float("inf"), 0.0))
                continue
            for i, (w, g) in enumerate(zip(wants, got)):
                w = w.detach().to(torch.float64)
                g64 = torch.from_numpy(g).to(torch.float64)
                masked = kept is not None and w.shape[:2] == kept.shape and g64.shape == w.shape
                if masked:
                    g64, w = g64[kept], w[kept]
                err = float((g64 - w).abs().max()) if g64.shape == w.shape else float("inf")
                tol = atol + rtol * float(w.abs().max()) if binding else float("inf")
                label = f"onnxruntime vs {ref_name}, {what}" + (f", output {i}" if i else "") \
                    + (", positions the attention mask keeps" if masked else "")
                result.checks.append((label + ("" if binding else " (approximate rewrite)"),
                                      err, tol))
    return result


def _kept_positions(names: list[str], tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """[batch, seq] bool of the positions an ``attention_mask`` input (0/1, 1 keeps) keeps,
    when it drops some and keeps some; None otherwise (a review: any name with "mask" was
    read as 1-keeps, and a ``key_padding_mask``, True at padding, made the check compare
    only the padding)."""
    for name, x in zip(names, tensors):
        if name.lower() != "attention_mask" or x.dim() != 2:
            continue
        binary = bool(((x == 0) | (x == 1)).all())
        if binary and not bool((x != 0).all()) and bool((x != 0).any()):
            return x != 0
    return None


@contextlib.contextmanager
def _eval_mode(module: nn.Module) -> Iterator[None]:
    """``module`` in eval mode for the block, its length-dependent rotary state put back
    after it (an exported graph module has neither; otherwise ``graphopt.models.eval_mode``
    and ``rope_state_kept``)."""
    if isinstance(module, fx.GraphModule):
        yield
        return
    with eval_mode(module), rope_state_kept(module):  # each reference from the same state
        yield


def _grown(args: tuple, result: OnnxExport) -> tuple[str, tuple] | None:
    """(label, the example grown along its dynamic sizes); None when none is dynamic.

    Each size symbol of the exported program (``result.sizes``: a ``Dim``, or one that
    torch.export chose under ``Dim.AUTO``) moves once, so every input axis and derived size
    (``2 * n``) built from it moves with it: by one for a symbol that is some input's axis 0
    (batch), else by three; three fewer when that would pass the symbol's ``max`` or the
    model's max positions; not at all when neither fits its range (a review: a Dim shared by
    two axes grew by 1 and by 3, a Dim(max=6) grew to 8, a derived 2*n to 7, and the check
    died in PyTorch's shape guard). Integer inputs are drawn below the example's largest
    value, except masks (random 0/1 holes make fully masked rows, whose values runtimes
    define differently: a false alarm, a review): an ``attention_mask`` is all ones (keep
    everything), another input named like a mask (unknown polarity) repeats the example's
    last row / column."""
    import sympy

    if not result.sizes:
        return None
    shapes, symbols = result.sizes
    longest = max_positions(result.eager.model) if isinstance(result.eager, CausalLMLogits) \
        else None
    batch = {shape[0] for shape in shapes if shape and isinstance(shape[0], sympy.Symbol)}
    value: dict[Any, int] = {}
    for symbol, (hint, low, high) in symbols.items():
        low, step = max(low, 2), 1 if symbol in batch else 3
        if high is not None and hint + step > high or \
                symbol not in batch and longest is not None and hint + step > longest:
            step = -min(3, hint - low)
        value[symbol] = hint + step if step and low <= hint + step else hint
    grew: dict[Any, tuple[str, int]] = {}
    leaves, tree = torch.utils._pytree.tree_flatten_with_path(args)
    tensors = [i for i, (_, x) in enumerate(leaves) if isinstance(x, torch.Tensor)]
    if len(tensors) != len(shapes):
        return None
    gen = torch.Generator().manual_seed(1)
    names = list(result.dynamic)
    out = [x for _, x in leaves]
    for i, shape in zip(tensors, shapes):
        path, x = leaves[i]
        new = [int(d.subs(value)) if isinstance(d, sympy.Expr) else int(d) for d in shape]
        for axis, (d, old, size) in enumerate(zip(shape, x.shape, new)):
            if size != old and isinstance(d, sympy.Symbol):
                label = _size_label(result.dynamic, names, path, axis) or str(d)
                grew.setdefault(d, (label, size - old))
        input_name = _leaf_name(path, names)
        out[i] = _grow_tensor(x, new, input_name, gen) if new != list(x.shape) else x
    if not grew:
        return None
    label = ", ".join(f"{name}{step:+d}" for name, step in grew.values())
    return label, tuple(torch.utils._pytree.tree_unflatten(out, tree))


def _leaf_name(path: tuple, names: list[str]) -> str:
    """The name a tensor leaf's mask rule reads: its innermost dict key, else its input's."""
    for key in reversed(path):
        if isinstance(key, torch.utils._pytree.MappingKey):
            return str(key.key)
    index = path[0].idx if path and isinstance(path[0], torch.utils._pytree.SequenceKey) else 0
    return names[index] if index < len(names) else ""


def _size_label(dynamic: dict[str, dict[int, str]], names: list[str], path: tuple,
                axis: int) -> str | None:
    """The ``Dim`` name the user gave a top-level input's axis (for the check's label)."""
    if len(path) != 1 or not isinstance(path[0], torch.utils._pytree.SequenceKey):
        return None
    index = path[0].idx
    name = dynamic.get(names[index], {}).get(axis) if index < len(names) else None
    return name if name and name != "auto" else None


def _grow_tensor(x: torch.Tensor, shape: list[int], input_name: str,
                 gen: torch.Generator) -> torch.Tensor:
    """New values of ``x``'s kind at ``shape`` (see :func:`_grown` for masks and integers)."""
    if input_name.lower() == "attention_mask":  # 1 keeps every position
        return torch.ones(shape, dtype=x.dtype)
    if "mask" in input_name.lower():  # unknown polarity: the example's edge repeated
        index = [torch.arange(n).clamp(max=old - 1) for n, old in zip(shape, x.shape)]
        return x[torch.meshgrid(*index, indexing="ij")]
    if x.dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if not x.dtype.is_floating_point:  # ids / labels (int32, int64, ...): drawn in [0,
        # the example's max], so no ignore-index sentinel (-100) becomes another
        # negative value (a re-review: -57 failed in the loss's gather)
        high = int(x.max()) + 1 if x.numel() else 1
        return torch.randint(0, max(high, 1), shape, generator=gen, dtype=x.dtype)
    return torch.randn(shape, generator=gen, dtype=x.dtype)


def _symbolic_sizes(program: torch.export.ExportedProgram) -> tuple[list[tuple], dict] | None:
    """(each tensor input's shape, ints and sympy expressions over the size symbols, in
    pytree order; symbol -> (example value, min, max or None)) of ``program``; None when
    no input size is symbolic."""
    import sympy

    shapes: list[tuple] = []
    symbols: dict[Any, tuple[int, int, int | None]] = {}
    ranges = program.range_constraints
    users = set(program.graph_signature.user_inputs)
    for node in program.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if node.name not in users or not isinstance(val, torch.Tensor):
            continue
        shape = []
        for d in val.shape:
            if not isinstance(d, torch.SymInt):
                shape.append(int(d))
                continue
            expr = d.node.expr
            shape.append(expr)
            for symbol in expr.free_symbols:
                hint = d.node.shape_env.var_to_val.get(symbol)
                bound = ranges.get(symbol)
                if hint is None or bound is None:
                    continue
                high = bound.upper
                symbols[symbol] = (int(hint), int(bound.lower), int(high)
                                   if isinstance(high, (int, sympy.Integer)) else None)
        shapes.append(tuple(shape))
    return (shapes, symbols) if symbols else None
