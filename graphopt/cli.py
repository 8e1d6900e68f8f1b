"""The ``graphopt`` command line (typer + rich): demo, export, explain, passes, calibrate,
estimate, plan."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from graphopt.models import SPECS, ModelSource, expert_count, model_names
from graphopt.planner.search import SearchResult
from graphopt.report import CompileReport

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="markdown",
                  help="graphopt: compiler passes for large-model training and inference "
                       "(torch.compile backend 'graphopt').")
# Piped output (CI logs, files) would otherwise be cut to 80 columns.
console = Console(width=None if sys.stdout.isatty() else 160)

_DTYPES = {"float32": "float32", "float64": "float64", "bfloat16": "bfloat16"}
_MODEL_HELP = (f"A model name ({', '.join(model_names())}; the last {len(SPECS)} are toy test "
               "configs) or a transformers config.json; built on the meta device.")
_OVERRIDE_HELP = "Config override key=value (int/float), e.g. --override hidden_size=512."


def _fail(message: str, code: int = 2) -> NoReturn:
    """Print ``message`` in red and exit with ``code``. The message is escaped: exception
    text such as ``pip install 'graphopt[npu]'`` or a path with brackets is not rich markup."""
    console.print(f"[red]{escape(message)}[/]")
    raise typer.Exit(code)


@app.command()
def demo(
    model: str = typer.Option("minimax", help=f"Real transformers model: {', '.join(SPECS)} "
                              "(small config, random weights)."),
    lowering: str = typer.Option("eager", help="eager | inductor | auto | npu."),
    attention: str = typer.Option("exact", help="keep | exact (MiniMax's lightning-attention "
                                  "loop -> graphopt's kernel) | lightning (approximate)."),
    dtype: str = typer.Option("float32", help="float32 | float64 | bfloat16."),
    batch: int = typer.Option(2, min=1, help="Sequences per batch."),
    seq: int = typer.Option(64, min=2, help="Tokens per sequence (>= 2: the loss predicts "
                            "the next token)."),
    dump_dir: Path | None = typer.Option(None, help="Write every graph and the report here."),
    verify: bool = typer.Option(True, help="Also run graphopt's verify on each graph."),
    moe: bool = typer.Option(True, help="MoE models: compile with transformers' grouped_mm "
                             "experts and options={'moe': {}} (sorted dispatch + grouped "
                             "GEMMs; eager keeps its per-expert loop as the reference). "
                             "Dense models ignore it."),
    parallel: int = typer.Option(0, min=0, help="N >= 2: spawn N local ranks (gloo, no "
                                 "torchrun) and run one planned training step of MiniMax "
                                 "(float64, eager modules) with the planner's fastest plan "
                                 "of 3+ axes (fewer when N ranks cannot hold 3: 2 ranks), "
                                 "compared with one process. Takes --batch and --seq only."),
) -> None:
    """Compile a real model with backend="graphopt", run a training step and an inference
    step, compare both with eager, and print the report."""
    import torch

    import graphopt
    from graphopt.demo import run_demo

    if parallel:
        ignored = [name for name, value, default in (
            ("--model", model, "minimax"), ("--lowering", lowering, "eager"),
            ("--attention", attention, "exact"), ("--dtype", dtype, "float32"),
            ("--dump-dir", dump_dir, None), ("--no-verify", verify, True),
            ("--no-moe", moe, True)) if value != default]
        if ignored:
            _fail(f"--parallel runs MiniMax in float64 with eager modules; it does not take "
                  f"{', '.join(ignored)}: drop {'them' if len(ignored) > 1 else 'it'}, or "
                  "drop --parallel")
        if parallel < 2:
            _fail("--parallel needs N >= 2 ranks (N = 1 would compare one process with itself)")
        _parallel_demo(parallel, batch, seq)
        return

    if dtype not in _DTYPES:
        raise typer.BadParameter(f"dtype must be one of {', '.join(_DTYPES)}")
    if model not in SPECS:
        raise typer.BadParameter(f"unknown model {model!r}; available: {', '.join(SPECS)}")
    moe = moe and expert_count(SPECS[model].kwargs) > 0  # dense models: no MoE setup
    options: dict[str, Any] = {"lowering": lowering, "attention": attention}
    if moe:
        options["moe"] = {}
    if dump_dir is not None:
        options["dump_dir"] = str(dump_dir)
    try:  # a bad --lowering/--attention: Typer's usage error, as for --model and --dtype
        graphopt.GraphoptConfig.from_options(options)
    except graphopt.GraphoptError as exc:  # also npu without torch_npu
        raise typer.BadParameter(str(exc)) from None
    try:
        graphopt.clear_reports()
        with console.status("[bold]compiling and running[/]") as status:
            result = run_demo(model, lowering, getattr(torch, dtype), batch, seq, dump_dir,
                              verify, attention=attention, moe=moe,
                              progress=lambda msg: status.update(f"[bold]{escape(msg)}[/]"))
    except graphopt.GraphoptError as exc:
        _fail(str(exc))
    except Exception as exc:  # Dynamo wraps a backend's errors: show graphopt's own
        inner = getattr(exc, "inner_exception", None)
        if isinstance(inner, graphopt.GraphoptError):
            _fail(f"{type(inner).__name__}: {inner}")
        raise
    _print_reports(graphopt.reports(), sites=0)
    table = Table(title=f"{model}: compiled vs eager ({dtype}, lowering {lowering}, "
                        f"attention {attention}" + (", moe" if moe else "") + ")")
    for col in ("check", "max abs error", "tolerance", "ok"):
        table.add_column(col)
    approximate = attention == "lightning"
    failed = False
    for name, err, tol in result.checks:
        if err <= tol:
            ok = "[green]yes[/]"
        elif approximate and math.isfinite(err):  # NaN/Inf fail in every mode
            ok = "[yellow]differs (approximate)[/]"
        else:
            ok, failed = "[red]NO[/]", True
        table.add_row(name, f"{err:.3g}", f"{tol:.3g}", ok)
    console.print(table)
    console.print(f"compile + first training step {result.train_s:.1f}s, inference step "
                  f"{result.infer_s:.1f}s; graphs compiled: {len(graphopt.reports())}"
                  + (f"; dumps in {escape(str(dump_dir))}" if dump_dir else ""))
    if approximate:
        console.print("attention='lightning' replaces softmax attention by Lightning Attention "
                      "(APPROXIMATE): outputs are expected to differ from eager; the run "
                      "checks that it compiles, trains with finite values and reports each "
                      "site.")
    if failed:
        raise typer.Exit(1)


def _parallel_demo(world: int, batch: int, seq: int) -> None:
    """``graphopt demo --parallel N``: see graphopt.demo.run_parallel_demo."""
    import graphopt
    from graphopt.demo import run_parallel_demo

    if batch < 2 * world:
        if batch != 2:  # the default batch (2) cannot feed N data-parallel ranks
            console.print(f"--batch {batch} raised to {2 * world}: two sequences per rank")
        batch = 2 * world
    try:
        with console.status(f"[bold]planning and running on {world} local ranks[/]"):
            result = run_parallel_demo(world, batch, seq)
    except graphopt.GraphoptError as exc:
        _fail(str(exc))
    table = Table(title=f"MiniMax on {world} ranks: {result.plan}")
    for col in ("check", "value", "ok"):
        table.add_column(col)
    # relative, at float32's level: transformers' RMSNorm computes in float32 in a float64
    # model, and CPU float32 reductions round differently for different batch sizes, so a
    # 3-way split differs from one process by ~1e-7 (1e-17 for 2 and 4 ranks); plain
    # FSDP2 does the same (a review: --parallel 3 and 5 failed an absolute 1e-9)
    tol = 1e-6
    good = result.loss_error < tol and result.grad_error < tol
    table.add_row("loss vs one process (float64, relative)", f"{result.loss_error:.3g}",
                  "[green]yes[/]" if result.loss_error < tol else "[red]NO[/]")
    table.add_row("every gradient vs one process (relative)", f"{result.grad_error:.3g}",
                  "[green]yes[/]" if result.grad_error < tol else "[red]NO[/]")
    table.add_row("step time: measured / predicted",
                  f"{result.measured_s * 1e3:.1f} ms / {result.predicted_s * 1e3:.1f} ms", "")
    console.print(table)
    for line in result.why + result.notes:
        console.print(f"- {escape(line)}")
    console.print("measured: forward + backward of the slowest rank, float64, eager modules, "
                  "gloo on this machine's cores; predicted: the planner's model of the same "
                  "plan on the cost model's default profile (traced in bf16, costed at its "
                  "float64 rate); the measured step is the first (FSDP's lazy init and "
                  "Python overheads of a tiny model included)")
    if not good:
        raise typer.Exit(1)


@app.command()
def export(
    onnx: Path = typer.Option(..., "--onnx", help="The .onnx file to write."),
    model: str = typer.Option("minimax", help=f"Real transformers model: {', '.join(SPECS)} "
                              "(small config, random weights), exported as input_ids -> logits."),
    attention: str = typer.Option("exact", help="keep | exact | lightning (approximate)."),
    moe: bool = typer.Option(True, help="MoE models: rewrite the experts (grouped_mm "
                             "experts -> graphopt::moe_experts) before exporting."),
    moe_form: str = typer.Option("gather", help="How moe_experts is exported: gather (routed "
                                 "tokens only) | dense (every expert on every token, masked: "
                                 "E/K times the FLOPs, no data-dependent shapes)."),
    batch: int = typer.Option(2, min=1, help="Example batch (dynamic axis unless --static; "
                              ">= 2 then)."),
    seq: int = typer.Option(32, min=2, help="Example sequence length."),
    static: bool = typer.Option(False, help="Export the example's shapes (no dynamic axes)."),
    check: bool = typer.Option(True, help="Compare onnxruntime with PyTorch (needs "
                               "onnxruntime)."),
    dump_dir: Path | None = typer.Option(None, help="Write the graphs before/after each pass."),
) -> None:
    """Export a real model after graphopt's passes to ONNX (standard ops, dynamic batch and
    sequence axes) and check it with onnxruntime."""
    import graphopt
    from graphopt.models import build_model, sample_batch

    if model not in SPECS:
        raise typer.BadParameter(f"unknown model {model!r}; available: {', '.join(SPECS)}")
    options: dict[str, Any] = {"attention": attention}
    if not moe and expert_count(SPECS[model].kwargs) > 0:
        _fail(f"{model} is a MoE model: its experts export through graphopt's moe translation "
              "(transformers' eager experts loop is data-dependent and its grouped_mm op has "
              "no ONNX form); drop --no-moe")
    moe = moe and expert_count(SPECS[model].kwargs) > 0
    if moe_form != "gather" and not moe:  # (a review: accepted, and did nothing)
        _fail(f"--moe-form {moe_form}: {model} has no experts (a dense model), so it would do "
              "nothing; drop --moe-form")
    if moe:
        options["moe"] = {}
    if dump_dir is not None:
        options["dump_dir"] = str(dump_dir)
    try:
        net = build_model(model)
        if moe:
            net.set_experts_implementation("grouped_mm")  # type: ignore[operator]
        with console.status("[bold]exporting[/]"):
            result = graphopt.export_onnx(net, sample_batch(net, batch, seq), options, onnx,
                                          dynamic=not static, moe_form=moe_form, check=check)
    except (graphopt.GraphoptError, ImportError) as exc:
        _fail(str(exc))
    _print_reports([result.report], sites=10, more=(
        f"all are in {dump_dir}/export/report.md" if dump_dir is not None else
        "export with --dump-dir DIR to write them all to report.md"))
    table = Table(title=f"{model} -> {onnx}")
    for col in ("what", "how"):
        table.add_column(col)
    for name, axes in result.dynamic.items():
        table.add_row(f"input {name}", f"dynamic axes {axes}" if axes else "static")
    for op_name, form in result.translations.items():
        table.add_row(op_name, form)
    for path in result.module_rewrites:
        table.add_row(path, "module rewrite before tracing (MiniMax lightning loop -> "
                            "graphopt::lightning_attention_fwd)")
    console.print(table)
    if result.checks:
        checks = Table(title="onnxruntime vs PyTorch")
        for col in ("check", "max abs error", "tolerance", "ok"):
            checks.add_column(col)
        for what, err, tol in result.checks:
            # an infinite tolerance: an approximate rewrite's difference, reported only (a
            # new user read "tolerance inf, ok yes" as a pass)
            checks.add_row(what, f"{err:.3g}", "n/a (approximate)" if tol == float("inf")
                           else f"{tol:.3g}",
                           "-" if tol == float("inf") else
                           "[green]yes[/]" if err <= tol else "-" if err != err and tol != tol
                           else "[red]NO[/]")  # NaN, NaN: a reference that cannot run
        console.print(checks)
    console.print(f"wrote {escape(str(onnx))} ({onnx.stat().st_size / 1e6:.1f} MB) in "
                  f"{sum(result.seconds.values()):.1f}s")
    if not result.ok:
        raise typer.Exit(1)


def _dump_order(report: Path) -> tuple:
    """Sort key of a report.json path relative to its dump directory
    (``[rank<R>/]graph_NNN[.pid<P>]/report.json`` or ``[rank<R>/]export/report.json``): rank,
    then graph id as a number (graph_1000 after graph_999), then the folder name."""
    folders = report.parts[:-1]
    rank = int(folders[0][4:]) if len(folders) == 2 and folders[0][4:].isdigit() else -1
    name = folders[-1]
    digits = name[6:].split(".")[0] if name.startswith("graph_") else ""
    return rank, int(digits) if digits.isdigit() else 10**9, name


@app.command()
def explain(
    dump_dir: Path = typer.Argument(..., help="A dump directory (or one graph_NNN in it)."),
    sites: int = typer.Option(20, min=0, help="Sites to list per pass (0: none)."),
) -> None:
    """Render the report(s) of a dump directory in the terminal."""
    if not dump_dir.is_dir():
        _fail(f"{dump_dir} " + ("is not a directory" if dump_dir.exists() else
                                "does not exist") + ": give a dump directory")
    paths = sorted(dump_dir.glob("report.json")) or sorted(
        [*dump_dir.glob("graph_*/report.json"), *dump_dir.glob("export*/report.json"),
         *dump_dir.glob("rank*/graph_*/report.json"),
         *dump_dir.glob("rank*/export*/report.json")],
        key=lambda path: _dump_order(path.relative_to(dump_dir)))
    if not paths:
        _fail(f"no report.json in {dump_dir} or its graph_*, export or rank*/ folders; "
              "compile with options={'dump_dir': ...} or GRAPHOPT_DUMP_DIR first")
    reports, labels = [], []
    for path in paths:
        try:
            reports.append(CompileReport.from_dict(json.loads(path.read_text())))
        except (ValueError, TypeError, KeyError, AttributeError, OSError,
                RecursionError) as exc:
            _fail(f"cannot read {path}: {type(exc).__name__}: {exc} (not a readable "
                  "graphopt report, or written by another version)")
        # the folder, so ranks' and other processes' graphs (graph_000.pid<P>) stay apart
        folder = path.parent.relative_to(dump_dir).as_posix()
        labels.append(_report_label(reports[-1]) if folder == "." else folder)
    try:
        _print_reports(reports, sites, labels)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        _fail(f"cannot render the reports of {dump_dir}: {type(exc).__name__}: {exc} (a "
              "report.json with fields of the wrong type: not written by this graphopt)")


@app.command()
def passes() -> None:
    """List the registered passes, their stage, exactness and whether they run by default."""
    import importlib

    from graphopt.passes import default_pipeline_names, get_pass, registered_pass_names

    table = Table(title="graphopt passes (in pipeline order where default)")
    for col in ("name", "stage", "exact", "default", "what it does"):
        table.add_column(col)
    defaults = default_pipeline_names()
    for name in defaults + [n for n in registered_pass_names() if n not in defaults]:
        cls = get_pass(name)
        doc = (importlib.import_module(cls.__module__).__doc__ or "").strip()
        first = doc.split("\n\n", 1)[0].split(":", 1)[-1]  # the first paragraph, whole
        exact = cls.__dict__.get("exact", cls.exact)
        exact_text = "depends on options" if isinstance(exact, property) else str(exact)
        table.add_row(name, cls.stage, exact_text, str(name in defaults),
                      " ".join(first.split()))
    console.print(table)


@app.command()
def calibrate(
    out: Path | None = typer.Option(None, help="Write here instead of the cache "
                                    "($GRAPHOPT_CACHE_DIR/local.json)."),
    collectives: bool = typer.Option(True, help="Also time gloo all-reduce on 2 local ranks."),
) -> None:
    """Measure this machine (GEMM curve, memory bandwidth, kernel overhead, gloo all-reduce)
    and write the 'local' cost-model profile."""
    from graphopt.cost.calibrate import calibrate as run
    from graphopt.errors import GraphoptError

    try:
        with console.status("[bold]calibrating[/]") as status:
            profile = run(out, collectives, log=lambda m: status.update(f"[bold]{m}[/]"))
    except GraphoptError as exc:
        _fail(str(exc))
    dev = profile.device
    table = Table(title=f"local profile ({dev.source})")
    table.add_column("quantity")
    table.add_column("value")
    table.add_row("fp32 matmul peak", f"{dev.peak_flops['float32'] / 1e9:.0f} GFLOP/s")
    table.add_row("bf16 matmul", f"{dev.peak_flops['bfloat16'] / 1e9:.0f} GFLOP/s")
    for n, f in dev.matmul_curve:
        table.add_row(f"  matmul n={int(n)}", f"{f / 1e9:.0f} GFLOP/s")
    table.add_row("memory bandwidth", f"{dev.memory_bandwidth / 1e9:.1f} GB/s")
    table.add_row("per-op overhead", f"{dev.kernel_overhead_s * 1e6:.1f} us")
    table.add_row("attention / GEMM rate", f"{dev.attention_efficiency:.2f}")
    link = profile.levels[0].link
    table.add_row("local link (gloo)" if collectives else
                  "local link (not measured: memory bandwidth / 2, 50 us assumed)",
                  f"{link.bandwidth / 1e9:.2f} GB/s, {link.latency * 1e6:.0f} us")
    console.print(table)
    from graphopt.cost.profiles import local_profile_path

    console.print(f"wrote {escape(str(out))} (use it with --profile {escape(str(out))})"
                  if out is not None else
                  f"wrote {escape(str(local_profile_path()))} (profile 'local')")


@app.command()
def estimate(
    model: str = typer.Option("llama", help=_MODEL_HELP),
    profile: str | None = typer.Option(None, help="Cluster profile name or JSON/YAML file "
                                       "(default: 'local' when `graphopt calibrate` has "
                                       "run, else h100-sxm)."),
    batch: int = typer.Option(2, min=1),
    seq: int = typer.Option(128, min=2),
    dtype: str = typer.Option("float32", help="float32 | float64 | bfloat16 | float16."),
    train: bool = typer.Option(True, help="Forward + backward (else forward only)."),
    top: int = typer.Option(8, min=0, help="Cost contributors to list."),
    override: list[str] = typer.Option([], help=_OVERRIDE_HELP),
) -> None:
    """Predict one step's time, MFU and memory of a model on a profile (no compile needed);
    the model is built on the meta device and traced with fake tensors."""
    import torch

    from graphopt.cost import estimate as run
    from graphopt.errors import GraphoptError
    from graphopt.models import build_architecture, model_config, resolve_model

    dtypes = (*_DTYPES, "float16")  # every profile lists a float16 rate (a review)
    if dtype not in dtypes:
        raise typer.BadParameter(f"dtype must be one of {', '.join(dtypes)}")
    overrides = _parse_overrides(override)
    try:
        source = resolve_model(model)
        net = build_architecture(source, getattr(torch, dtype), overrides, seq=seq)
        # on the meta device directly: token values do not matter to the fake trace, and
        # real ids of batch x seq took that memory first (80 GB for 1e5 x 1e5, a review)
        ids = torch.zeros((batch, seq), dtype=torch.long, device="meta")
        est = run(net, {"input_ids": ids, "labels": ids, "use_cache": False}, profile,
                  train=train, tracing="fake")
    except (GraphoptError, ValueError, TypeError) as exc:  # transformers' config validation
        _fail(f"{type(exc).__name__}: {exc}")
    console.print(f"{escape(model)} batch {batch} seq {seq} {dtype} on "
                  f"{escape(est.profile.name)} ({escape(est.profile.device.name)}): "
                  f"{'fwd+bwd' if train else 'fwd'} "
                  f"{est.time_s * 1e3:.2f} ms, {est.flops / 1e9:.2f} GFLOP, MFU "
                  f"{est.mfu * 100:.1f}%, memory {est.peak_bytes / 2**20:.1f} MiB "
                  f"(params {est.param_bytes / 2**20:.1f}, activations"
                  f"{' and gradients' if train else ''} "
                  f"{est.activation_bytes / 2**20:.1f}; one device, no optimizer states: "
                  "`graphopt plan` adds them and the sharding)")
    _positions_note(model_config(source, overrides), [seq])  # (the built one is extended)
    capacity = est.profile.device.memory_bytes
    if train and capacity and est.peak_bytes > capacity:
        console.print(f"[yellow]does not fit one {escape(est.profile.device.name)} "
                      f"({capacity / 2**30:.0f} GiB) even before optimizer states: see "
                      "`graphopt plan` for a sharded plan[/]")
    _print_toy_note(source)
    if not top:  # --top 0: no table (it printed an empty one)
        return
    table = Table(title="top cost contributors (by op)")
    for col in ("op", "ms", "GFLOP", "MB moved"):
        table.add_column(col)
    for op, (t, f, b) in list(est.cost.by_op().items())[:top]:
        table.add_row(op, f"{float(t) * 1e3:.3f}", f"{float(f) / 1e9:.3f}",
                      f"{float(b) / 1e6:.1f}")
    console.print(table)


@app.command()
def plan(
    model: str = typer.Option(..., help=_MODEL_HELP),
    cluster: str = typer.Option("h100-sxm", help="Cluster profile name or JSON/YAML file."),
    devices: int = typer.Option(..., min=1, help="Number of devices."),
    seq: int = typer.Option(4096, min=2, help="Sequence length (tokens)."),
    global_batch: int = typer.Option(..., min=1, help="Sequences per iteration."),
    top: int | None = typer.Option(None, min=1, help="Plans to list [default: 5]."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the best plans (and the "
                                         "hand configurations' verdicts) here."),
    dtype: str = typer.Option("bfloat16", help="bfloat16 | float32."),
    override: list[str] = typer.Option([], help=_OVERRIDE_HELP),
    published: list[Path] = typer.Option([], help="A plan JSON (graphopt.parallelize's "
                                          "format) a job is known to run with: evaluated "
                                          "with the search, so the result never loses to "
                                          "it; repeatable."),
    seq_buckets: str | None = typer.Option(None, help="Comma-separated sequence lengths "
                                           "(2k,8k,32k,128k): plan each and say where the "
                                           "best plan changes (global batch in tokens is "
                                           "kept: sequences scale inversely)."),
    plot: Path | None = typer.Option(None, help="Draw the step-time breakdown (compute, "
                                     "bubble, exposed TP/CP/EP/PP/DP) and memory of the top "
                                     "plans and the hand configurations to this PNG "
                                     "(needs matplotlib)."),
    activations: str = typer.Option("traced", help="What dense layers keep for the "
                                    "backward: traced (the transformers model's eager "
                                    "autograd) | fused (fused norm/activation/attention "
                                    "kernels, as Megatron-Core runs; Korthikanti et al. 2022)."),
    recompute: bool = typer.Option(True, "--recompute/--no-recompute", help="Also search "
                                   "activation recomputation (full and selective; "
                                   "graphopt.parallelize applies it per decoder layer)."),
    master_weights: bool = typer.Option(False, "--master-weights", help="float32 "
                                        "parameters computing in --dtype under "
                                        "torch.autocast, as graphopt.parallelize(..., "
                                        "mixed_precision='bf16') runs (default: bf16 "
                                        "parameters, float32 optimizer states, as "
                                        "Megatron-LM)."),
    trained: float = typer.Option(1.0, min=0.0, max=1.0, help="Share of the weight "
                                  "matrices (other than routed experts and embeddings) "
                                  "of the layers after --frozen-prefix that train, by "
                                  "elements (LoRA's frozen base weights: ~0): the rest hold "
                                  "no gradient or optimizer state and compute no weight "
                                  "gradient (parallel='auto' reads this off requires_grad)."),
    trained_experts: float = typer.Option(1.0, min=0.0, max=1.0, help="The same share "
                                          "for the routed experts (MoE models)."),
    frozen_prefix: int = typer.Option(0, min=0, help="Leading decoder layers that run no "
                                      "backward (they and the input embedding frozen): "
                                      "priced as their forward."),
) -> None:
    """Search DP/ZeRO/TP+SP/CP/PP/EP plans with the cost model; print the best ones and why
    common hand configurations lose."""
    import torch

    from graphopt.cost.profiles import load_profile
    from graphopt.errors import GraphoptError
    from graphopt.models import resolve_model
    from graphopt.planner.model import plan_model
    from graphopt.planner.search import search

    if dtype not in ("bfloat16", "float32"):
        raise typer.BadParameter("dtype must be bfloat16 or float32")
    if activations not in ("traced", "fused"):
        raise typer.BadParameter("--activations must be traced or fused")
    from graphopt.config import require_writable_file
    from graphopt.errors import ConfigError

    for flag, path in (("--json", json_out), ("--plot", plot)):
        # checked before the search: the plot was written first and a bad path lost both
        try:
            if path is not None:
                require_writable_file(path, "give a file in an existing, writable folder",
                                      create_folder=False)
        except ConfigError as exc:
            raise typer.BadParameter(f"{flag} {path}: not a writable file path ({exc})"
                                     ) from None
    if plot is not None:  # before the search too (a new user waited for the tables first)
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise typer.BadParameter("--plot needs matplotlib: pip install 'graphopt[plot]'")
    overrides = _parse_overrides(override)
    from graphopt.planner.plan import ParallelPlan

    try:
        known = [(path.stem, ParallelPlan.load(path)) for path in published]
    except (OSError, ValueError, TypeError, KeyError) as exc:
        _fail(f"--published: {type(exc).__name__}: {exc}")
    if seq_buckets is not None:
        unused = [flag for flag, used in (("--json", json_out), ("--plot", plot),
                                          ("--published", published),
                                          ("--top", top is not None)) if used]
        if unused:  # one best plan per bucket: these would silently do nothing (a review)
            _fail(f"--seq-buckets prints the best plan of each bucket; {', '.join(unused)} "
                  f"{'applies' if len(unused) == 1 else 'apply'} to one sequence length: "
                  f"drop {'it' if len(unused) == 1 else 'them'}, or drop --seq-buckets")
        _plan_buckets(model, cluster, devices, seq, global_batch, dtype, overrides, seq_buckets,
                      activations, recompute, master_weights,
                      (trained, trained_experts, frozen_prefix))
        return
    try:
        profile = load_profile(cluster)
        source = resolve_model(model)
        with console.status(f"[bold]tracing {escape(model)} (seq {seq}) on the meta "
                            "device[/]") as st:
            pm = _fine_tune(plan_model(model, seq, profile, getattr(torch, dtype),
                                       activations=activations, overrides=overrides,
                                       master_weights=master_weights),
                            trained, trained_experts, frozen_prefix)
            st.update("[bold]searching[/]")
            result = search(pm, profile, devices, global_batch, top_k=top or 5,
                            progress=lambda n: st.update(f"[bold]searching: {n} plans "
                                                         "evaluated[/]"), published=known,
                            recompute=recompute)
    except GraphoptError as exc:
        _fail(str(exc))
    table = Table(title=f"{escape(model)} ({pm.params / 1e9:.3g}B params), {devices} x "
                        f"{escape(profile.device.name)}, seq {seq}, global batch {global_batch}"
                        f"{', float32 master weights' if master_weights else ''}"
                        f"{_fine_tune_title(trained, trained_experts, frozen_prefix)}: "
                        f"{result.evaluated} plans in {result.seconds:.2f}s "
                        f"({result.pruned_memory} out of memory)")
    for col in ("#", "plan", "step s", "tokens/s", "MFU", "memory GiB", "bubble s",
                "exposed comm s (tp/cp/ep/pp/dp)"):
        table.add_column(col)
    for i, p in enumerate(result.top, 1):
        pred = p.prediction
        assert pred is not None
        comm = "/".join(f"{pred.comm_s[k]:.2g}" for k in ("tp", "cp", "ep", "pp", "dp"))
        table.add_row(str(i), p.describe(), f"{pred.step_s:.3g}", f"{pred.tokens_per_s:,.0f}",
                      f"{pred.mfu:.1%}", f"{pred.memory_bytes / 2**30:.1f}",
                      f"{pred.bubble_s:.2g}", comm)
    console.print(table)
    if devices > profile.max_devices:  # (a review: 10,000 devices of a 4,096-device
        # profile were planned with no word)
        console.print(f"note: cluster {escape(profile.name)!r} describes "
                      f"{profile.max_devices:,} devices; its outermost level "
                      f"({escape(profile.levels[-1].name)}) was extended to hold {devices:,}, "
                      "at the same link speed")
    from graphopt.models import model_config
    from graphopt.parallel.auto import not_executable

    # the model's config: TP must divide its KV heads and vocabulary, lightning layers run
    # CP with all-to-all, PP drops an MoE aux loss (a review found --json defaulting to a
    # plan parallelize refuses when these were not checked)
    config = model_config(source, overrides, seq)
    _positions_note(model_config(source, overrides), [seq])
    # and the model itself on the meta device, where a PP, CP or TP plan needs it: the
    # stages' structure, CP's refusals, layers TP splits nothing of (a review: GPT-2 class
    # PP and TP plans and sliding-window CP plans were ranked as executed)
    meta = _meta_model(source, config, dtype, overrides, seq) \
        if any(p.pp > 1 or p.cp > 1 or p.tp > 1 for p in result.top) else None

    def not_executed(plan: ParallelPlan) -> str:
        why = not_executable(plan, global_batch, config, meta, seq)
        pred = plan.prediction
        if why or pred is None or dtype != "bfloat16" or plan.zero_stage != 1 or \
                plan.dp_shard == 1:
            return why
        # the planner prices Megatron's distributed optimizer (bf16 parameters and
        # gradients whole, float32 master weights sharded with Adam's states: 2 + 2 +
        # 12 / dp bytes per parameter); graphopt's ZeRO-1 (DDP + ZeroRedundancyOptimizer
        # under bf16 autocast) holds float32 parameters and gradients whole: 4 + 4 + 8 / dp
        # (a review measured 12.0 bytes per parameter at dp = 2 where 10.0 was priced)
        from graphopt.planner.perf import USABLE_MEMORY

        held = pred.memory_bytes + pm.params * (4 - 4 / plan.dp_shard)
        usable = USABLE_MEMORY * profile.device.memory_bytes
        if held > usable:  # (a bf16 model trained in its own dtype holds less: 4 + 4/dp)
            return (f"it would not fit under mixed_precision='bf16' (float32 weights): "
                    f"graphopt's ZeRO-1 holds float32 parameters and gradients whole, "
                    f"{held / 2**30:.1f} GiB per device, {usable / 2**30:.1f} usable (the "
                    "planner priced Megatron's distributed optimizer)")
        return ""

    ranked = list(result.top)
    reasons = [not_executed(p) for p in ranked]
    for i, why in enumerate(reasons, 1):  # the planner also ranks plans for other executors
        if why:
            console.print(f"[yellow]plan {i} is not run by graphopt.parallelize as "
                          f"priced:[/] {escape(why)} (parallel='auto' passes over it)")
    if all(reasons):  # the best plan graphopt runs, for the --json file's default
        try:
            deeper = search(pm, profile, devices, global_batch, top_k=200,
                            published=known, recompute=recompute)
        except GraphoptError:
            deeper = None
        runnable = [p for p in (deeper.top if deeper else []) if not not_executed(p)]
        if runnable:
            ranked.append(runnable[0])
            reasons.append("")
            pred = runnable[0].prediction
            assert pred is not None
            console.print(f"best plan graphopt.parallelize executes (rank "
                          f"{deeper.top.index(runnable[0]) + 1 if deeper else '?'}): "
                          f"{escape(runnable[0].describe())}, step {pred.step_s:.3g} s, "
                          f"MFU {pred.mfu:.1%}" + (" (in --json after the ranked ones)"
                                                   if json_out else ""))
    _print_hand_configurations(result)
    _print_toy_note(source)
    if plot is not None:
        from graphopt.planner.plot import plot_plans

        try:
            plot_plans(result, plot, title=f"{model}, {devices} x {profile.device.name}, seq "
                                           f"{seq}, global batch {global_batch}")
        except ImportError as exc:
            _fail(str(exc))
        console.print(f"wrote {escape(str(plot))}")
    if json_out is not None:
        json_out.write_text(json.dumps({
            "model": model, "cluster": cluster, "devices": devices, "seq": seq,
            "global_batch": global_batch,
            # what the predictions assume (a re-review: a fine-tune's plan file read as a
            # full training run's)
            "priced_as": {"dtype": dtype, "master_weights": master_weights,
                          "activations": activations, "trained": trained,
                          "trained_experts": trained_experts, "frozen_prefix": frozen_prefix},
            "plans": [p.to_dict() for p in ranked],
            # why graphopt.parallelize does not run each plan ("": it does); ParallelPlan.
            # load and options={"parallel": file} take the first it runs
            "not_executed": reasons,
            "hand": [{"name": n, "plan": p.to_dict(), "verdict": w}
                     for n, p, w in result.hand]}, indent=2))
        console.print(f"wrote {escape(str(json_out))}")


def _parse_length(text: str) -> int:
    """'8k' -> 8192, '4096' -> 4096."""
    text = text.strip().lower()
    try:
        length = int(text[:-1]) * 1024 if text.endswith("k") else int(text)
    except ValueError:
        length = 0
    if length < 2:  # as --seq: the loss predicts the next token
        raise typer.BadParameter(f"--seq-buckets takes lengths >= 2 such as 2k,8k,32768; got "
                                 f"{text!r}")
    return length


def _meta_model(source: Any, config: Any, dtype: str, overrides: dict[str, Any],
                seq: int) -> Any:
    """The model on the meta device, for the executability checks that need it (PP's stage
    structure, CP's refusals), or None when transformers cannot build it (the config-level
    checks still run). MoE models in bf16 (the dtype their trace takes)."""
    import torch

    from graphopt.errors import GraphoptError
    from graphopt.models import build_architecture, expert_count

    try:
        return build_architecture(source, torch.bfloat16 if expert_count(config) else
                                  getattr(torch, dtype), overrides, seq=seq)
    except GraphoptError:
        return None


def _fine_tune(pm: Any, trained: float, trained_experts: float, frozen_prefix: int) -> Any:
    """``pm`` (a PlanModel) with `graphopt plan`'s fine-tuning flags, as
    ``parallel="auto"`` reads them off a model: ``trained`` is the share of the weight
    matrices of the layers after the prefix (``PlanModel.trained_gemm``, which leaves the
    prefix out); the parameter shares that price gradients and optimizer states also drop
    the prefix's layers and the input embedding, which a frozen prefix freezes (a
    re-review: `--frozen-prefix 4` alone priced them as trained, 40% more memory)."""
    import dataclasses

    from graphopt.errors import ConfigError

    if frozen_prefix >= pm.layers:
        raise ConfigError(f"--frozen-prefix {frozen_prefix}: the model has {pm.layers} "
                          "decoder layers and at least one has to train; give fewer")
    if trained_experts < 1 and pm.moe is None:
        raise ConfigError("--trained-experts: this model has no routed experts; drop it")
    dense_share = pm.dense_layers / pm.layers
    moe_params = pm.moe.params if pm.moe else 0.0
    others = pm.params - (pm.moe.expert_params * pm.moe_layers if pm.moe else 0.0)
    frozen = frozen_prefix * (dense_share * pm.dense.params + (1 - dense_share) * moe_params)
    if frozen_prefix:  # the input embedding: the whole head when tied, else about half
        frozen += pm.head.params if pm.tied_embeddings else pm.head.params / 2
    held = max(others - frozen, 0.0) / others if others else 1.0
    moe_held = 1 - frozen_prefix * (1 - dense_share) / pm.moe_layers if pm.moe_layers else 1.0
    return dataclasses.replace(pm, trained=trained * held,
                               trained_experts=trained_experts * moe_held,
                               trained_gemm=trained, trained_expert_gemm=trained_experts,
                               frozen_prefix=float(frozen_prefix))


def _fine_tune_title(trained: float, trained_experts: float, frozen_prefix: int) -> str:
    parts = [f"{share:.3g} of the {what} trained" for share, what in
             ((trained, "weight matrices"), (trained_experts, "experts")) if share < 1]
    if frozen_prefix:
        parts.append(f"first {frozen_prefix} layers frozen")
    return "".join(f", {p}" for p in parts)


def _plan_buckets(model: str, cluster: str, devices: int, seq: int, global_batch: int,
                  dtype: str, overrides: dict[str, Any], buckets: str,
                  activations: str = "traced", recompute: bool = True,
                  master_weights: bool = False,
                  fine_tune: tuple[float, float, int] = (1.0, 1.0, 0)) -> None:
    """Plan each sequence-length bucket at the same tokens per iteration and print where the
    best plan changes (the basis for re-planning per batch bucket)."""
    import torch

    from graphopt.cost.profiles import load_profile
    from graphopt.errors import GraphoptError
    from graphopt.models import model_config, resolve_model
    from graphopt.parallel.auto import not_executable
    from graphopt.planner.model import plan_model
    from graphopt.planner.search import search

    lengths = [_parse_length(x) for x in buckets.split(",") if x.strip()]
    if not lengths:
        raise typer.BadParameter(f"--seq-buckets takes comma-separated lengths such as "
                                 f"2k,8k,32768; got {buckets!r}")
    tokens = seq * global_batch
    longer = [n for n in lengths if n > tokens]
    if longer:  # one sequence would already hold more tokens than the iteration
        raise typer.BadParameter(f"--seq-buckets {', '.join(map(str, longer))}: longer than the "
                                 f"{tokens:,} tokens per iteration (--seq x --global-batch); "
                                 "raise --global-batch or drop those buckets")
    table = Table(title=f"{escape(model)} on {devices} devices, {tokens:,} tokens per "
                        "iteration, best plan graphopt executes per sequence bucket"
                        f"{', float32 master weights' if master_weights else ''}"
                        f"{_fine_tune_title(*fine_tune)}")
    for col in ("seq", "global batch", "best plan", "step s", "MFU", "memory GiB", "change"):
        table.add_column(col)
    previous = None
    try:
        profile = load_profile(cluster)
        source = resolve_model(model)
        for length in lengths:
            batch = max(1, tokens // length)
            # a length that does not divide the tokens rounds the batch down, to a multiple
            # of gcd(global batch, devices) where it can: 262 sequences ruled out 8-way data
            # parallelism, and the bucket's "re-plan" followed the rounding, not the length
            # (a re-review: 15-20% slower plans); the row says so (a review: 262,143 tokens
            # under a header of 262,144)
            step = math.gcd(global_batch, devices)
            if batch * length != tokens and batch >= step:
                batch -= batch % step
            held = str(batch) if batch * length == tokens else \
                f"{batch} ({batch * length:,} tokens)"
            pm = _fine_tune(plan_model(model, length, profile, getattr(torch, dtype),
                                       activations=activations, overrides=overrides,
                                       master_weights=master_weights), *fine_tune)
            # the plans graphopt.parallelize runs for this model (a re-review: every bucket's
            # best was a PP plan for GPT-3, whose structure the stages cannot cut)
            config = model_config(source, overrides, length)
            meta = _meta_model(source, config, dtype, overrides, length)

            def runs(plan: Any, batch: int = batch, config: Any = config,
                     meta: Any = meta, length: int = length) -> bool:
                return not not_executable(plan, batch, config, meta, length)

            try:
                best = search(pm, profile, devices, batch, top_k=1, recompute=recompute,
                              admit=runs).best
            except GraphoptError as exc:
                table.add_row(str(length), held, f"[red]{escape(str(exc))}[/]",
                              "", "", "", "")
                continue
            pred = best.prediction
            assert pred is not None
            shape = best.describe().replace(f", mb={best.microbatch}", "")
            change = "" if previous is None else ("same" if shape == previous else
                                                  "[yellow]re-plan[/]")
            previous = shape
            table.add_row(str(length), held, best.describe(), f"{pred.step_s:.3g}",
                          f"{pred.mfu:.1%}", f"{pred.memory_bytes / 2**30:.1f}", change)
    except GraphoptError as exc:
        _fail(str(exc))
    console.print(table)
    _positions_note(model_config(source, overrides), lengths)


def _positions_note(config: Any, lengths: list[int]) -> None:
    """Say so where a model with a learned position table (GPT-2's ``n_positions``) was
    planned at longer sequences than the table holds: the planner prices it with the table
    extended (``model_config``), a model that the built one cannot run as is (a review
    found it silent)."""
    held = getattr(config, "n_positions", None)
    longer = [n for n in lengths if isinstance(held, int) and n > held]
    if longer:
        console.print(f"note: the model's learned position table holds {held} positions; "
                      f"seq {', '.join(map(str, longer))} was priced with it extended to "
                      f"the sequence (run it with a longer table: --override "
                      f"n_positions={max(longer)})")


def _parse_overrides(items: list[str]) -> dict[str, Any]:
    """``--override key=value`` options as config kwargs (an int, else a float: "1e6"
    and "0.5" are floats; rope_theta=1e6 was refused before, a review)."""
    out: dict[str, Any] = {}
    for item in items:
        key, _, value = item.partition("=")
        key = key.strip()
        if not key:  # "=5" reached the config check as "override(s)  not a field"
            raise typer.BadParameter(f"--override takes key=number with a config field name "
                                     f"before '=', e.g. hidden_size=512; got {item!r}")
        try:
            try:
                out[key] = int(value)
            except ValueError:
                out[key] = float(value)
                if not math.isfinite(out[key]):
                    raise ValueError(value) from None
        except ValueError:
            raise typer.BadParameter(f"--override takes key=number (int or float), got "
                                     f"{item!r}") from None
        if _is_count(key) and out[key] < 1:  # hidden_size=0 ended in a ZeroDivisionError,
            # num_hidden_layers=0 estimated an empty model (a review)
            raise typer.BadParameter(f"--override {item}: {key} is a size or count, it must "
                                     "be at least 1")
    return out


_COUNTS = frozenset((
    "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "n_embd",
    "n_layer", "n_head", "num_local_experts", "num_experts", "n_routed_experts",
    "num_experts_per_tok"))
"""transformers config keys that size or count something and cannot be 0 (keys such as
DeepSeek's n_shared_experts or num_nextn_predict_layers can)."""


def _is_count(key: str) -> bool:
    return key in _COUNTS


def _print_hand_configurations(result: SearchResult) -> None:
    """The valid hand configurations as a table with verdicts; the others one per line with
    what makes them invalid for this job (never an empty table)."""
    if result.hand:
        hand = Table(title="common hand configurations")
        for col in ("configuration", "plan", "verdict"):
            hand.add_column(col)
        for name, p, why in result.hand:
            hand.add_row(escape(name), p.describe(), escape(why))
        console.print(hand)
    else:
        console.print("[yellow]none of the common hand configurations is valid for this job "
                      "(reasons below)[/]")
    for name, p, why in result.hand_invalid:
        console.print(f"[yellow]not valid for this job:[/] {escape(name)} ({p.describe()}): "
                      f"{escape(why)}")


def _print_toy_note(source: ModelSource) -> None:
    """Say so when the numbers are for a toy test config, not a real model size."""
    if source.toy:
        console.print(f"[yellow]{escape(source.toy_note())}[/]")


def _print_reports(reports: list[CompileReport], sites: int,
                   labels: list[str] | None = None,
                   more: str = "--sites N to list more; all are in report.md") -> None:
    """The summary table, skip reasons, ``sites`` sites per pass (``more``: how to see
    the rest), notes and verify failures of ``reports``."""
    names = {id(r): label for r, label in zip(reports, labels or [])}

    def _graph_label(report: CompileReport) -> str:
        return names.get(id(report)) or _report_label(report)

    def _graph_ref(report: CompileReport) -> str:
        """The label in a sentence: "graph 0", "rank0/graph_000" (not "graph graph_000")."""
        label = _graph_label(report)
        return label if label.rsplit("/", 1)[-1].startswith("graph_") else f"graph {label}"

    summary = Table(title="graphopt compile report", caption=(
        "nodes: FX nodes of the captured graph before -> after the model passes; rewrites / "
        "skips: pass sites rewritten / left as they are with a reason (listed below, or "
        "by graphopt explain of the dump); "
        "graphopt s: graphopt's own compile time, total s: with AOTAutograd and the "
        "lowering; verify: the numeric check against the captured graph (option verify). "
        "A graph Dynamo restarted or that aborted never runs: its rewrites and skips are "
        "shown in parentheses and left out of the per-pass totals"))
    for col in ("graph", "status", "lowering", "train", "nodes", "rewrites", "skips",
                "graphopt s", "total s", "verify"):
        summary.add_column(col, no_wrap=True)
    for r in reports:
        ran = not _discarded(r)
        rewrites = str(sum(p.count("rewritten") for p in r.passes))
        skips = str(sum(p.count("skipped") for p in r.passes))
        summary.add_row(
            _graph_label(r),
            "ok" if ran else r.status.split(":")[0],
            r.lowering, "yes" if r.training else "no",
            f"{r.graphs.get('model', '?')}->{r.graphs.get('model_after_passes', '?')}",
            rewrites if ran else f"({rewrites})", skips if ran else f"({skips})",
            f"{r.timing.get('graphopt_overhead', 0.0):.2f}", f"{r.timing.get('total', 0.0):.2f}",
            str(r.verify.get("status", "off" if ran else "not run")))
    console.print(summary)
    per_pass: dict[str, list[Any]] = {}
    for r in reports:
        if _discarded(r):
            continue
        for p in r.passes:
            agg = per_pass.setdefault(p.name, [p.stage, p.exact, 0, 0, 0, 0.0])
            agg[2] += p.count("kept") + p.count("matched")
            agg[3] += p.count("rewritten")
            agg[4] += p.count("skipped")
            agg[5] += p.time_s
    table = Table(title="per pass, all graphs", caption=(
        "exact: the pass keeps eager numerics (False: approximate, opt-in); kept: sites "
        "matched and reported only"))
    for col in ("pass", "stage", "exact", "kept", "rewritten", "skipped", "time ms"):
        table.add_column(col, no_wrap=True)
    for name, (stage, exact, m, rw, sk, t) in per_pass.items():
        table.add_row(name, stage, str(exact), str(m), str(rw), str(sk), f"{t * 1e3:.1f}")
    console.print(table)
    if not sites:  # the summary's caption promises the skips' reasons below (a new user
        # saw "skips 1" and no reason anywhere but a dump)
        reasons: dict[tuple[str, str], list[Any]] = {}  # (pass, reason) -> [count, example]
        for r in reports:
            for p in r.passes:
                for s in p.sites:
                    if s.action == "skipped":
                        entry = reasons.setdefault((p.name, s.reason),
                                                   [0, f"{_graph_ref(r)} {s.site}"])
                        entry[0] += 1
        for (name, reason), (count, example) in reasons.items():
            console.print(f"{name}: {count} site(s) skipped, e.g. [cyan]{escape(example)}[/]"
                          + (f" - {escape(reason)}" if reason else ""))
    if sites:
        for r in reports:
            for p in r.passes:
                for s in p.sites[:sites]:
                    console.print(f"{_graph_ref(r)} {p.name}: {s.action} "
                                  f"[cyan]{escape(s.site)}[/]"
                                  + (f" - {escape(s.reason)}" if s.reason else ""))
                if len(p.sites) > sites:
                    console.print(f"{_graph_ref(r)} {p.name}: ... {len(p.sites) - sites} "
                                  f"more sites ({more})")
    for r in reports:
        for note in r.notes:
            console.print(f"{_graph_ref(r)}: note: {escape(note)}")
        if r.verify.get("status") == "failed":
            console.print(f"[red]{_graph_ref(r)} verify failed: "
                          f"{escape(str(r.verify.get('detail')))}[/]")


def _discarded(report: CompileReport) -> bool:
    """Whether the graph never runs: Dynamo restarted its trace, or its compile raised."""
    return report.status.startswith(("restarted", "aborted"))


def _report_label(report: CompileReport) -> str:
    """The graph's id in the tables, "onnx" for an ONNX export's graph."""
    return "onnx" if report.options.get("export") == "onnx" else str(report.graph_id)


_NO_MEMORY = ("can't allocate memory", "not enough memory", "out of memory",
              "Storage size calculation overflowed")
"""torch's messages for a tensor this machine cannot hold (or whose size overflows int64)."""


def main() -> None:
    """The ``graphopt`` command. Sizes no machine can hold (``--batch``/``--seq`` of 1e11)
    reached torch's allocator and ended in its RuntimeError's traceback (a review); they end
    with one line naming the cause and the fix."""
    try:
        app(standalone_mode=True)
    except RuntimeError as exc:
        if not any(m in str(exc) for m in _NO_MEMORY):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        message = (f"out of memory: {first}. The sizes asked for (--batch, --seq, "
                   "--override) need more memory than this machine has, or overflow a "
                   "tensor's size: use smaller ones")
        console.print(f"[red]{escape(message)}[/]")
        sys.exit(2)


if __name__ == "__main__":
    main()
