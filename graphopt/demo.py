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

from graphopt.models import build_model, expert_count, sample_batch
from graphopt.verify import default_tolerance


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
        ConfigError: unknown ``model_name`` (lists the valid ones).
    """
    progress(f"building {model_name}")
    eager = build_model(model_name, dtype=dtype)
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
    rtol, _ = default_tolerance(torch.float32 if dtype == torch.float64 else dtype)
    result = DemoResult()

    def step(model: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
        out = model(input_ids=ids, labels=labels, use_cache=False)
        out.loss.backward()
        grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
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
    result.checks.append(("training loss", _max_err(loss_c, loss_e), 10 * rtol * scale))
    grad_err = max(_max_err(c, e) / max(1.0, float(e.abs().max()))
                   for c, e in zip(grads_c, grads_e))
    result.checks.append((f"{len(grads_e)} parameter gradients (relative)", grad_err, 10 * rtol))

    progress("compiling + inference step (torch.no_grad)")
    start = time.perf_counter()
    with torch.no_grad():
        logits_c = compiled(input_ids=ids, use_cache=False).logits
        logits_e = eager(input_ids=ids, use_cache=False).logits
    result.infer_s = time.perf_counter() - start
    scale = max(1.0, float(logits_e.abs().max()))
    result.checks.append(("inference logits after the update", _max_err(logits_c, logits_e),
                          10 * rtol * scale))
    return result
