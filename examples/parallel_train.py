"""Train a small Llama with a parallel plan on CPU ranks.

    torchrun --nproc-per-node 4 examples/parallel_train.py                   # dp_shard=2 x tp=2
    torchrun --nproc-per-node 4 examples/parallel_train.py --plan plan.json  # any plan file
    ... --save ckpt/         # a torch.distributed.checkpoint after the last step
    ... --resume ckpt/       # start from it (saved under any plan, e.g. --plan other.json)

One DeviceMesh from the plan (graphopt.parallel.build_mesh), the model sharded by
graphopt.parallelize (TP+SP layout derived from the model, FSDP2 ZeRO-3 over dp_shard), each
decoder layer compiled by graphopt, trained with AdamW on random tokens. Rank 0 prints the loss
per step and where each parameter lives. gloo on CPU; on GPUs torchrun + NCCL run the same code.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import graphopt
from graphopt.models import build_model
from graphopt.parallel import (
    ModelState,
    OptimizerState,
    build_mesh,
    build_optimizer,
    clip_grad_norm_,
)
from graphopt.planner.plan import ParallelPlan


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", help="plan JSON (graphopt plan --json); default dp_shard=2, "
                        "tp=2, ZeRO-3 when 4 ranks run, else pure FSDP")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--save", help="write a checkpoint here after the last step")
    parser.add_argument("--resume", help="load a checkpoint (written under any plan) first")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if args.plan:
        plan = ParallelPlan.load(args.plan)
    elif world % 2 == 0 and world >= 4:
        plan = ParallelPlan(dp_shard=world // 2, tp=2, zero_stage=3)
    else:
        plan = ParallelPlan(dp_shard=world, zero_stage=3)
    torch.manual_seed(0)  # the same weights on every rank
    model = build_model("llama", num_hidden_layers=2)
    mesh = build_mesh(plan)
    model = graphopt.parallelize(model, plan, mesh)
    # Each decoder layer's forward is compiled (graphopt.compile does the same with
    # options={"parallel": plan}): its SP input hook stays eager, see docs/parallel.md.
    for block in model.model.layers:
        block.forward = torch.compile(block.forward, backend="graphopt",
                                      options={"lowering": "eager"})
    opt = build_optimizer(model, plan, mesh, torch.optim.AdamW, lr=1e-3)
    # model and optimizer under the unparallelized names and shapes (docs/parallel.md)
    state = {"model": ModelState(model), "optimizer": OptimizerState(model, opt)}
    if args.resume:
        dcp.load(state, checkpoint_id=args.resume)
    gen = torch.Generator().manual_seed(1234)
    for step in range(args.steps):
        batch = torch.randint(0, 256, (2 * plan.dp, 64), generator=gen)  # global batch
        local = batch.chunk(plan.dp)[mesh["dp"].get_local_rank()]
        loss = model(input_ids=local, labels=local, use_cache=False).loss
        loss.backward()
        clip_grad_norm_(model, max_norm=1.0)  # the whole model's norm, equal on every rank
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step}: loss {float(mean) / world:.4f}")
    if args.save:
        dcp.save(state, checkpoint_id=args.save)
    if rank == 0:
        report = model.graphopt_parallel
        print(f"plan: {report.plan}; SP {'on' if report.sp else 'off'}")
        for note in report.notes:
            print(f"  {note}")
        for name, placement, shape in report.parameters[:6]:
            print(f"  {name}: {placement}, local {shape}")
        print(f"  ... {len(report.parameters)} parameters; compiled graphs: "
              f"{len(graphopt.reports())} ({graphopt.last_report().fallback or 'passes ran'})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
