"""``graphopt demo``: a real model through the backend, a training and an inference step,
each compared with eager."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from graphopt.errors import ConfigError
from graphopt.models import build_model, expert_count, learned_positions, sample_batch
from graphopt.verify import default_tolerance

TOLERANCE = 2
"""The demo's checks allow twice verify's tolerance of the dtype (bf16: rtol 2e-2, so 4%
of the loss; float32/float64 models: float32's 1e-4, since transformers' RMSNorm computes
in float32). It was 10x: 20% of the loss in bf16 (a review)."""


@dataclass
class DemoResult:
    checks: list[tuple[str, float, float]] = field(default_factory=list)
    train_s: float = 0.0
    infer_s: float = 0.0

    @property
    def ok(self) -> bool:
        return all(err <= tol for _, err, tol in self.checks)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def run_demo(model_name: str, lowering: str, dtype: torch.dtype, batch: int, seq: int,
             dump_dir: Path | None, verify: bool,
             progress: Callable[[str], None] = lambda msg: None,
             attention: str = "exact", moe: bool = False) -> DemoResult:
    """Train one step (forward, backward, SGD update) and run one inference step with the
    compiled model and an identical eager copy; record the largest differences.

    ``moe``: the compiled copy of an MoE model uses transformers' grouped_mm experts (one
    graph per forward) and graphopt's MoE pass; the eager copy keeps the per-expert loop.
    Dense models (no experts) ignore it.

    Raises:
        ConfigError: unknown ``model_name`` (lists the valid ones); ``seq`` longer than the
            model's learned position table (GPT-2's ``n_positions``).
    """
    progress(f"building {model_name}")
    eager = build_model(model_name, dtype=dtype)
    longest = learned_positions(eager)
    if longest is not None and seq > longest:
        raise ConfigError(f"seq {seq} is longer than {model_name}'s learned position table "
                          f"({longest} positions; its index fails in the lookup): use seq <= "
                          f"{longest}")
    compiled_model = copy.deepcopy(eager)
    options: dict[str, Any] = {"lowering": lowering, "verify": verify,  # validated by the CLI
                               "attention": attention}
    if moe and expert_count(eager.config):
        compiled_model.set_experts_implementation("grouped_mm")  # type: ignore[operator]
        options["moe"] = {}
    ids = sample_batch(eager, batch, seq)
    labels = sample_batch(eager, batch, seq, seed=1)
    if dump_dir is not None:
        options["dump_dir"] = str(dump_dir)
    compiled = torch.compile(compiled_model, backend="graphopt", options=options)
    # float64: transformers computes some parts in float32 inside a float64 model (RMSNorm's
    # upcast is a downcast there, MiniMax's decay tables are float32 buffers), which a
    # compiled graph may fuse or recompute differently: 10 float32 eps (1.2e-6; measured
    # 1.4e-7 through Inductor, 7.5e-8 with attention="exact"). Before, float32's 1e-4 let
    # a float64 result 1e-4 off pass (a review).
    rtol = 10 * torch.finfo(torch.float32).eps if dtype == torch.float64 else \
        default_tolerance(dtype)[0]
    result = DemoResult()

    def step(model: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out = model(input_ids=ids, labels=labels, use_cache=False)
        out.loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                 if p.grad is not None}
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.sub_(1e-2 * p.grad)
                    p.grad = None
        return out.loss.detach(), grads

    progress("compiling + training step (forward, backward, SGD)")
    start = time.perf_counter()
    loss_c, grads_c = step(compiled)
    result.train_s = time.perf_counter() - start
    loss_e, grads_e = step(eager)
    scale = max(1.0, float(loss_e.abs()))
    result.checks.append(("training loss", _max_err(loss_c, loss_e), TOLERANCE * rtol * scale))
    # the same parameters must get gradients (a lost gradient path is the worst bug: pairing
    # the two lists by position hid missing ones, a review)
    names_c = set(grads_c)
    compiled_names = {n.replace("_orig_mod.", "", 1) for n in names_c}
    if compiled_names != set(grads_e):
        missing = sorted(set(grads_e) - compiled_names) + sorted(compiled_names - set(grads_e))
        result.checks.append((f"parameters with a gradient: compiled {len(names_c)}, eager "
                              f"{len(grads_e)} (differ at {', '.join(missing[:3])})",
                              float("inf"), 0.0))
    else:
        by_name = {n.replace("_orig_mod.", "", 1): g for n, g in grads_c.items()}
        grad_err = gradient_error(by_name, grads_e)
        result.checks.append((f"{len(grads_e)} parameter gradients (relative)", grad_err,
                              TOLERANCE * rtol))

    progress("compiling + inference step (torch.no_grad)")
    start = time.perf_counter()
    with torch.no_grad():
        logits_c = compiled(input_ids=ids, use_cache=False).logits
        result.infer_s = time.perf_counter() - start  # the compiled step alone
        logits_e = eager(input_ids=ids, use_cache=False).logits
    scale = max(1.0, float(logits_e.abs().max()))
    result.checks.append(("inference logits after the update", _max_err(logits_c, logits_e),
                          TOLERANCE * rtol * scale))
    return result


def gradient_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest gradient error relative to its own parameter's largest gradient (an
    all-zero one absolutely) over the parameters of ``want``: max(1, |g|) before let 8 of
    the demo's 21 gradients, all below 1, be off by 5x unnoticed (a review)."""
    return max(_max_err(got[n], e) / (float(e.abs().max()) or 1.0) for n, e in want.items())


@dataclass
class ParallelDemoResult:
    """What ``graphopt demo --parallel N`` measured (every rank's view merged)."""

    plan: str
    why: list[str]
    predicted_s: float
    measured_s: float
    loss_error: float
    grad_error: float
    notes: list[str]


MIN_AXES = 3
FALLBACK_PLAN: dict[str, Any] = dict(pp=2, dp_shard=2, ep=2, zero_stage=3)


def demo_plan(world: int, batch: int, seq: int) -> tuple[Any, list[str]]:
    """The planner's fastest plan graphopt executes for the demo's MiniMax on ``world``
    ranks of the cost model's default profile that uses at least three parallel axes
    (among dp_replicate, dp_shard, tp, cp, pp, ep), or the most axes ``world`` ranks can
    hold (2 ranks: two); pp=2 x dp_shard=2 x ep=2 when no searched plan does (named as
    such). ``batch``: sequences per step; ``seq``: tokens per sequence.

    Raises:
        ConfigError: no executable plan for ``world`` ranks (e.g. ``world`` = 1).
    """
    import dataclasses

    from graphopt.cost.profiles import default_profile_name, load_profile
    from graphopt.models import resolve_model
    from graphopt.parallel.auto import not_executable
    from graphopt.planner.model import plan_model
    from graphopt.planner.perf import evaluate
    from graphopt.planner.plan import ParallelPlan
    from graphopt.planner.search import search

    name = default_profile_name()
    # traced in bf16 (grouped_mm experts), run in float64: costed at the float64 rate
    profile = load_profile(name).with_rate_of("bfloat16", "float64")
    model = plan_model(str(resolve_model("minimax").name), seq, profile, dtype=torch.bfloat16)
    result = search(model, profile, world, batch, top_k=500)

    def axes(p: Any) -> int:
        return sum(getattr(p, a) > 1 for a in ("dp_replicate", "dp_shard", "tp", "cp", "pp",
                                               "ep"))

    usable = [p for p in result.top if not not_executable(p, batch)
              and p.cp == 1 and p.tp == 1]  # eager MiniMax: exact vs one process
    for need in range(MIN_AXES, 0, -1):  # 3 axes need 4+ ranks; fewer ranks, fewer axes
        for plan in usable:
            if axes(plan) >= need:
                return plan, [f"the planner's fastest executable plan with {need}+ axes on "
                              f"{name!r} (of {result.evaluated}; its overall best: "
                              f"{result.best.describe()})"]
    plan = ParallelPlan(**FALLBACK_PLAN)
    if plan.devices != world:
        raise ConfigError(f"the planner found no executable plan for the demo's MiniMax on "
                          f"{world} ranks (batch {batch}): use --parallel 4")
    plan = dataclasses.replace(plan, prediction=evaluate(plan, model, profile, batch))
    return plan, [f"no searched plan uses {MIN_AXES}+ axes; the demo's fixed "
                  f"{plan.describe()} (the planner's best: {result.best.describe()})"]


def _parallel_worker(rank: int, world: int, plan_kwargs: dict[str, Any], batch: int,
                     seq: int) -> dict[str, Any]:
    import warnings

    import torch.distributed as dist

    from graphopt.distributed import all_reduce_host
    from graphopt.parallel import build_mesh, microbatches, parallelize
    from graphopt.planner.plan import ParallelPlan

    # torch 2.13 deprecates slicing flattened mesh dims from the root (graphopt's meshes
    # still do, once per axis); the demo's output is for the numerics, not that notice
    warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
    plan = ParallelPlan(**plan_kwargs)
    reference = build_model("minimax", dtype=torch.float64)
    mesh = build_mesh(plan)
    model: Any = parallelize(copy.deepcopy(reference), plan, mesh)
    ids = sample_batch(reference, batch, seq)
    local = ids.chunk(plan.dp)[mesh["dp"].get_local_rank()]

    def next_token(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                 labels[:, 1:].flatten())

    dist.barrier()
    start = time.perf_counter()
    if plan.pp > 1:
        loss = model.step(local)
    else:  # the plan's microbatches, gradients accumulated and reduced as it prices them
        loss = torch.zeros((), dtype=torch.float64)
        for mb in microbatches(model, local):
            part = next_token(model(input_ids=mb, use_cache=False).logits, mb) * len(mb) \
                / len(local)
            part.backward()
            loss += part.detach()
    elapsed = time.perf_counter() - start
    ref_loss = next_token(reference(input_ids=ids, use_cache=False).logits, ids)
    ref_loss.backward()
    refs = dict(reference.named_parameters())
    names = getattr(model, "original_names", {})
    report = model.graphopt_parallel
    grad_error = 0.0
    for name, param in model.named_parameters():
        full = names.get(name, name)
        want: Any = refs[full].grad
        for path, (a, b, _) in report.experts.items():
            if full.startswith(path + "."):
                want = want[a:b]
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        grad_error = max(grad_error, float((grad - want).abs().max()) /
                         max(float(want.abs().max()), 1e-30))
    # the dp ranks' mean loss on the last stage: gather it to every rank
    value = torch.tensor([float(loss.detach()) if loss is not None else 0.0,
                          1.0 if loss is not None else 0.0], dtype=torch.float64)
    value = all_reduce_host(value)
    mean = value[0] / value[1]
    ref = float(ref_loss.detach())
    return {"loss_error": abs(float(mean) - ref) / abs(ref),
            "grad_error": grad_error,
            "seconds": elapsed, "notes": report.notes}


def run_parallel_demo(world: int, batch: int = 8, seq: int = 32) -> ParallelDemoResult:
    """One planned training step of MiniMax (float64, eager modules) on ``world`` spawned
    gloo ranks (no torchrun needed), compared with the single-process step: loss and every
    gradient (each rank's share), and the measured step time next to the prediction.

    Raises:
        ConfigError: the planner finds no plan for this world and batch; this machine's
            available memory cannot start ``world`` ranks
            (:func:`graphopt.distributed.check_room`).
    """
    from graphopt.distributed import check_room, run_distributed

    check_room(world)  # before planning for that world
    plan, why = demo_plan(world, batch, seq)
    import dataclasses

    kwargs = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)
              if f.name != "prediction"}
    ranks = run_distributed(_parallel_worker, world, kwargs, batch, seq)
    assert plan.prediction is not None
    return ParallelDemoResult(
        plan.describe(), why, plan.prediction.step_s,
        max(r["seconds"] for r in ranks), max(r["loss_error"] for r in ranks),
        max(r["grad_error"] for r in ranks), ranks[-1]["notes"])

