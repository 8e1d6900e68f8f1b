"""Train a small Llama with a parallel plan on CPU ranks.

    torchrun --nproc-per-node 4 examples/parallel_train.py                   # dp_shard=2 x tp=2
    torchrun --nproc-per-node 4 examples/parallel_train.py --plan plan.json  # any plan file
    ... --plan plans.json --index 2  # the third plan of `graphopt plan --json plans.json`
    ... --bf16               # bf16 compute, float32 master weights and optimizer states
    ... --save ckpt/         # a torch.distributed.checkpoint after the last step
    ... --resume ckpt/       # start from it (saved under any plan, e.g. --plan other.json)

graphopt.compile with options={"parallel": plan} builds the DeviceMesh, shards the model
(graphopt.parallelize: TP+SP layout derived from the model, FSDP2 over dp_shard, EP, PP, CP,
the plan's activation recomputation) and compiles each decoder layer with graphopt; AdamW on
random tokens, gradients clipped by the whole model's norm. A pipeline plan (pp > 1) trains
with ``model.step``; under CP (cp > 1) each rank takes its chunk of every sequence
(``shard_sequence``) and CP's loss (``cp_loss``, or ``model.step``'s under PP). The
checkpoint holds the model, the optimizer and the step, so a resumed run continues with the
next step's batch. Rank 0 prints the loss per step and where each parameter lives. gloo on
CPU; on GPUs torchrun + NCCL run the same code.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import graphopt
from graphopt.models import build_model
from graphopt.parallel import (
    ModelState,
    OptimizerState,
    PipelinedModel,
    clip_grad_norm_,
    microbatches,
    optimizer_for,
)
from graphopt.parallel.context import cp_loss, shard_sequence
from graphopt.planner.plan import ParallelPlan


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", help="plan JSON (ParallelPlan.save or graphopt plan --json); "
                        "default dp_shard=2, tp=2, ZeRO-3 when 4 ranks run, else pure FSDP")
    parser.add_argument("--index", type=int, default=None, help="which plan of a `graphopt "
                        "plan --json` file (default: the best one graphopt runs)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision")
    parser.add_argument("--save", help="write a checkpoint here after the last step")
    parser.add_argument("--resume", help="load a checkpoint (written under any plan) first")
    args = parser.parse_args()
    if args.resume and not os.path.isfile(os.path.join(args.resume, ".metadata")):
        parser.error(f"--resume {args.resume}: no checkpoint there (a directory written by "
                     "--save, holding .metadata)")
    if "RANK" not in os.environ:  # a review: torch's env:// rendezvous error said only that
        parser.error("run under torchrun, which starts the ranks: torchrun --nproc-per-node 4 "
                     "examples/parallel_train.py (the plan's degrees must multiply to the "
                     "rank count)")
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if args.plan:
        plan = ParallelPlan.load(args.plan, args.index)
        if plan.devices != world:  # one line, not a traceback per rank (a review)
            dist.destroy_process_group()
            parser.error(f"--plan {args.plan}: the plan uses {plan.devices} devices and "
                         f"torchrun started {world} ranks; launch {plan.devices} "
                         f"(--nproc-per-node) or search a plan for {world} devices "
                         f"(graphopt plan --devices {world} --json ...)")
    elif world % 2 == 0 and world >= 4:
        plan = ParallelPlan(dp_shard=world // 2, tp=2, zero_stage=3)
    else:
        plan = ParallelPlan(dp_shard=world, zero_stage=3)
    torch.manual_seed(0)  # the same weights on every rank
    model = graphopt.compile(build_model("llama", num_hidden_layers=2), options={
        "parallel": plan, "lowering": "eager", **({"mixed_precision": "bf16"} if args.bf16
                                                  else {})})
    mesh = model.graphopt_parallel.mesh  # the plan's DeviceMesh
    opt = optimizer_for(model, torch.optim.AdamW, lr=1e-3)
    # model, optimizer and step under the unparallelized names and shapes (docs/parallel.md)
    progress = {"step": torch.zeros((), dtype=torch.int64)}
    state = {"model": ModelState(model), "optimizer": OptimizerState(model, opt),
             "progress": progress}
    if args.resume:
        dcp.load(state, checkpoint_id=args.resume)
    start = int(progress["step"])
    for step in range(start, start + args.steps):
        gen = torch.Generator().manual_seed(1234 + step)  # the step's global batch
        batch = torch.randint(0, 256, (2 * plan.dp * plan.pp, 64), generator=gen)
        local = batch.chunk(plan.dp)[mesh["dp"].get_local_rank()]
        labels = None
        if plan.cp > 1:  # this rank's chunk of every sequence, labels shifted across chunks
            local, labels = shard_sequence(local, mesh)
        if isinstance(model, PipelinedModel):  # the loss only on the last stage's ranks
            loss = model.step(local, labels=labels)
        else:  # microbatches of plan.microbatch, gradients accumulated (as planned;
            loss = torch.zeros(())  # replicas all-reduce once, in the last one's backward)
            for i, mb in enumerate(microbatches(model, local)):
                if labels is None:
                    part = model(input_ids=mb, labels=mb, use_cache=False).loss
                else:  # CP's loss: the mean over every labelled position of all chunks
                    lb = labels.split(plan.microbatch)[i]
                    part = cp_loss(model(input_ids=mb, use_cache=False).logits, lb, mesh)
                part = part * len(mb) / len(local)
                part.backward()
                loss += part.detach()
        clip_grad_norm_(model, max_norm=1.0)  # the whole model's norm, equal on every rank
        opt.step()
        opt.zero_grad()
        held = torch.tensor([0.0 if loss is None else float(loss), float(loss is not None)])
        dist.all_reduce(held)  # mean over the ranks that hold a loss
        if rank == 0:
            print(f"step {step}: loss {float(held[0] / held[1]):.4f}")
    progress["step"].fill_(start + args.steps)
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
