"""Executing parallel plans: one DeviceMesh, torch.distributed's engines, derived TP layout.

    plan = graphopt.parallel.ParallelPlan.load("plan.json")   # or ParallelPlan(dp_shard=8, ...)
    mesh = graphopt.parallel.build_mesh(plan)          # under torchrun
    model = graphopt.parallelize(model, plan, mesh)     # TP/SP, EP, CP, PP, FSDP/HSDP, DDP
    opt = graphopt.parallel.build_optimizer(model, plan, mesh, torch.optim.AdamW, lr=...)
    # pp = 1: accumulate microbatches, data-parallel reductions as the planner prices them:
    for mb in graphopt.parallel.microbatches(model, local):   # plan.microbatch sequences
        (loss_fn(model, mb) * len(mb) / len(local)).backward()
    # pp > 1: model is a PipelinedModel; train with model.step(input_ids)
    # cp > 1: feed shard_sequence(ids, mesh)'s chunk and train on cp_loss
    # gradient clipping by the whole model's norm (torch's sees one rank's under PP/EP):
    graphopt.parallel.clip_grad_norm_(model, max_norm=1.0)
    # fp16 loss scaling: graphopt.parallel.GradScaler (torch's checks one rank's gradients;
    # under PP: model.step(ids, scaler=scaler)), then scaler.step(opt); scaler.update()
    # checkpoints (save under one plan, resume under any other or in one process):
    state = {"model": graphopt.parallel.ModelState(model),
             "optimizer": graphopt.parallel.OptimizerState(model, opt)}
    torch.distributed.checkpoint.save(state, checkpoint_id=path)  # or .load(state, ...)

See docs/parallel.md.
"""

from graphopt.parallel.accumulate import microbatches
from graphopt.parallel.apply import (
    ParallelReport,
    build_optimizer,
    optimizer_for,
    parallelize,
)
from graphopt.parallel.checkpoint import ModelState, OptimizerState
from graphopt.parallel.clip import clip_grad_norm_, grad_norm
from graphopt.parallel.context import cp_loss, shard_sequence, tag_chunk
from graphopt.parallel.mesh import build_mesh
from graphopt.parallel.pipeline import PipelinedModel
from graphopt.parallel.scaler import GradScaler
from graphopt.parallel.tp_layout import TPLayout, derive_tp_layout
from graphopt.planner.plan import ParallelPlan

__all__ = ["GradScaler", "ModelState", "OptimizerState", "ParallelPlan", "ParallelReport",
           "PipelinedModel", "TPLayout", "build_mesh",
           "build_optimizer", "clip_grad_norm_", "cp_loss", "derive_tp_layout", "grad_norm",
           "microbatches", "optimizer_for", "parallelize", "shard_sequence", "tag_chunk"]
