"""Parallel planner (graphopt.planner): validation against published configurations, the
Hypertron setting, and search speed.

    python benchmarks/planner.py [--rows all|quick]

1. Megatron-LM SC'21 Table 1 (GPT 1.7B-1T on 32-3072 A100s): for each row, the planner's
   prediction for the published hand configuration (TP, PP, DP; microbatch 1, full
   recomputation, no sequence parallelism, DP all-reduce not overlapped: as run in 2021)
   next to the published TFLOP/s per GPU, and graphopt's best plan for the same GPUs, global
   batch and sequence under the same cost function; TFLOP/s per GPU as the paper counts
   them (eq. 3 with recomputation / time / GPUs). The A100 matmul efficiency is the one
   fitted in benchmarks/cost_model_published.py (0.66); per-layer costs are traced from
   transformers' GPT-2 block with Megatron-2021 attention (GEMMs around a fused softmax).
2. Hypertron (2,048 Ascend 910B NPUs; 141B sparse = Mixtral 8x22B, 310B dense): graphopt's
   best plan and its predicted MFU next to the paper's 56.7%. Sequence 4096 and a global
   batch of 2048 sequences (8M tokens) are assumptions (not given in our summary of the
   paper).
3. Search time for 2,048 and 16,384 devices (targets < 10 s and < 60 s on this 2-core CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from graphopt.cost.profiles import CLUSTERS
from graphopt.cost.training import MEGATRON_SC21_TABLE1, GPTConfig
from graphopt.planner.model import plan_model
from graphopt.planner.perf import evaluate
from graphopt.planner.plan import ParallelPlan
from graphopt.planner.search import search

A100_EFFICIENCY = 0.66  # fitted in benchmarks/cost_model_published.py


def megatron(rows: list[tuple]) -> None:
    cluster = CLUSTERS["a100-80gb"]
    cluster = dataclasses.replace(cluster, device=dataclasses.replace(
        cluster.device, matmul_efficiency=A100_EFFICIENCY))
    print("| params (B) | GPUs | published plan | published TFLOP/s | predicted (error) | "
          "graphopt plan | predicted TFLOP/s | ratio | search s |")
    print("|---|---|---|---|---|---|---|---|---|")
    errors = []
    for params, heads, hidden, layers, tp, pp, gpus, batch, published in rows:
        model = plan_model("gpt3-175b", 2048, cluster, torch.float16, "megatron2021",
                           {"n_embd": hidden, "n_layer": layers, "n_head": heads})
        flops = GPTConfig(layers=layers, hidden=hidden, heads=heads).model_flops_per_iteration(
            batch)
        hand = ParallelPlan(dp_replicate=gpus // (tp * pp), tp=tp, sp=False, pp=pp,
                            recompute_layers=layers // pp, zero_stage=0)
        hand.validate(devices=gpus, layers=layers, heads=heads, global_batch=batch)
        t_hand = evaluate(hand, model, cluster, batch, dp_overlap=False).step_s
        start = time.perf_counter()
        best = search(model, cluster, gpus, batch, top_k=1, dp_overlap=False).best
        took = time.perf_counter() - start
        assert best.prediction is not None
        got_hand = flops / t_hand / gpus / 1e12
        got_best = flops / best.prediction.step_s / gpus / 1e12
        errors.append(abs(got_hand / published - 1))
        print(f"| {params} | {gpus} | TP={tp} PP={pp} DP={gpus // (tp * pp)} | {published} | "
              f"{got_hand:.0f} ({got_hand / published - 1:+.1%}) | {best.describe()} | "
              f"{got_best:.0f} | {got_best / got_hand:.2f}x | {took:.1f} |", flush=True)
    print(f"published configurations: median |error| {statistics.median(errors):.1%}, worst "
          f"{max(errors):.1%} ({len(errors)} rows)")


def hypertron() -> None:
    cluster = CLUSTERS["ascend-910b"]
    print("\n| Hypertron setting | devices | graphopt plan | predicted MFU | paper MFU |")
    print("|---|---|---|---|---|")
    for name in ("mixtral-8x22b", "dense-310b"):
        model = plan_model(name, 4096, cluster)
        result = search(model, cluster, 2048, 2048, top_k=1)
        pred = result.best.prediction
        assert pred is not None
        print(f"| {name} ({model.params / 1e9:.0f}B) | 2048 x 910B | {result.best.describe()} "
              f"| {pred.mfu:.1%} | 56.7% |", flush=True)


def speed() -> None:
    from graphopt.planner import model as plan_models

    cluster = CLUSTERS["h100-sxm"]
    print("\n| model | devices | plans evaluated | model trace s | search s | target (search) |")
    print("|---|---|---|---|---|---|")
    for name, devices, target in (("llama3-405b", 2048, 10), ("deepseek-v3", 2048, 10),
                                  ("llama3-405b", 16384, 60), ("deepseek-v3", 16384, 60)):
        plan_models._CACHE.clear()
        start = time.perf_counter()
        model = plan_model(name, 8192, cluster)
        traced = time.perf_counter() - start
        result = search(model, cluster, devices, devices)
        print(f"| {name} | {devices} | {result.evaluated} | {traced:.1f} | "
              f"{result.seconds:.2f} | < {target} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", choices=["all", "quick"], default="all")
    args = parser.parse_args()
    rows = MEGATRON_SC21_TABLE1 if args.rows == "all" else MEGATRON_SC21_TABLE1[:3]
    megatron(rows)
    hypertron()
    speed()


if __name__ == "__main__":
    main()
