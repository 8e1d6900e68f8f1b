"""Parallel planner (graphopt.planner): validation against published configurations, the
Hypertron setting, and search speed.

    python benchmarks/planner.py [--rows all|quick]

1. Megatron-LM SC'21 Table 1 (GPT 1.7B-1T on 32-3072 A100s): for each row, the planner's
   prediction for the published hand configuration (TP, PP, DP; microbatch 1, full
   recomputation, no sequence parallelism, DP all-reduce not overlapped: as run in 2021)
   next to the published TFLOP/s per GPU, and graphopt's best plan for the same GPUs, global
   batch and sequence under the same cost function; TFLOP/s per GPU as the paper counts
   them (eq. 3 with recomputation / time / GPUs). The A100 GEMM efficiency is fitted on the
   table's rows and each row's error is leave-one-out (as for source 4); per-layer costs are
   traced from transformers' GPT-2 block with Megatron-2021 attention (GEMMs around a fused
   softmax), activations counted as Megatron's fused kernels keep them.
2. Hypertron (2,048 Ascend 910B NPUs; 141B sparse = Mixtral 8x22B, 310B dense): graphopt's
   best plan and its predicted MFU next to the paper's 56.7%. Sequence 4096 and a global
   batch of 2048 sequences (8M tokens) are assumptions (not given in our summary of the
   paper).
3. Search time for 2,048 and 16,384 devices (targets < 10 s and < 60 s on this 2-core CPU).
   Tensor-parallel experts: for MoE jobs, the best plan next to the best one with
   expert_tp = tp, side by side under the same model (``--only etp``).
4. Megatron-Core r0.8.0 on H100 (NVIDIA/Megatron-LM README of July 2024, its weak-scaling
   table images/model_table.png: GPT 1.7B-462B, vocabulary 131,072, sequence 4096, TP/PP/DP,
   batch, TFLOP/s per GPU; DP/TP/PP communication overlapped) and torchtitan on H100
   (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md Tables 1 and 3 and
   benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, the bfloat16 torch.compile rows
   without Float8 or async TP: Llama 3.1 8B/70B, FSDP, FSDP + TP, selective per-op or full
   activation checkpointing; tokens/s per GPU and peak memory). Each row's own convention:
   Megatron's FLOPs per iteration (megatron/training/training.py
   num_floating_point_operations at the r0.8.0 commit) / its TFLOP/s -> seconds per
   iteration; torchtitan's tokens/s per GPU -> seconds per iteration. One parameter per source
   is fitted (the GEMM efficiency of its GPUs: torchtitan's run at 500 W, Megatron's at
   700 W), and each row's error is leave-one-out: predicted with the efficiency fitted on the
   other rows of its source.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
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


def megatron(rows: list[tuple]) -> list[float]:
    base = CLUSTERS["a100-80gb"]
    jobs, models = [], {}
    for params, heads, hidden, layers, tp, pp, gpus, batch, published in rows:
        models[params] = plan_model("gpt3-175b", 2048, base, torch.float16, "megatron2021",
                                    "fused",
                                    {"n_embd": hidden, "n_layer": layers, "n_head": heads})
        flops = GPTConfig(layers=layers, hidden=hidden, heads=heads).model_flops_per_iteration(
            batch)
        hand = ParallelPlan(dp_replicate=gpus // (tp * pp), tp=tp, sp=False, pp=pp,
                            recompute_layers=layers // pp, zero_stage=0)
        hand.validate(devices=gpus, layers=layers, heads=heads, global_batch=batch)
        jobs.append((params, hand, batch, gpus, flops, flops / (published * 1e12 * gpus)))

    def predict(job, eff: float) -> float:
        params, hand, batch, *_ = job
        return evaluate(hand, models[params], _with_efficiency(base, eff), batch,
                        dp_overlap=False).step_s

    eff, loo = _fit(jobs, predict)
    cluster = _with_efficiency(base, eff)
    print("| params (B) | GPUs | published plan | published TFLOP/s | predicted (leave-one-out "
          "error) | graphopt plan | predicted TFLOP/s | ratio | search s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for job, err in zip(jobs, loo):
        params, hand, batch, gpus, flops, published_s = job
        t_hand = evaluate(hand, models[params], cluster, batch, dp_overlap=False).step_s
        start = time.perf_counter()
        best = search(models[params], cluster, gpus, batch, top_k=1, dp_overlap=False).best
        took = time.perf_counter() - start
        assert best.prediction is not None
        published = flops / published_s / gpus / 1e12
        got_best = flops / best.prediction.step_s / gpus / 1e12
        print(f"| {params} | {gpus} | TP={hand.tp} PP={hand.pp} DP={hand.dp} | "
              f"{published:.0f} | {published / (1 + err):.0f} ({err:+.1%}) | "
              f"{best.describe()} | {got_best:.0f} | {t_hand / best.prediction.step_s:.2f}x | "
              f"{took:.1f} |", flush=True)
    return _summary(loo, f"fitted A100 GEMM efficiency {eff:.3f} (benchmarks/"
                         f"cost_model_published.py fits {A100_EFFICIENCY} to its own step model)")


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


def expert_tp() -> None:
    """The best plan and the best with tensor-parallel experts (expert_tp = tp), ranked in
    one search (top 200) per job."""
    print("\n| job | best plan | tokens/s | best expert_tp = tp plan (rank) | tokens/s | "
          "ratio | its EP / TP / DP s vs the best's |")
    print("|---|---|---|---|---|---|---|")
    for name, cl, devices, batch, seq in (("mixtral-8x22b", "h100-sxm", 256, 1024, 4096),
                                          ("mixtral-8x22b", "ascend-910b", 2048, 2048, 4096),
                                          ("deepseek-v3", "h100-sxm", 2048, 2048, 8192)):
        cluster = CLUSTERS[cl]
        result = search(plan_model(name, seq, cluster), cluster, devices, batch, top_k=200)
        best = result.best
        etp = next((p for p in result.top if p.expert_tp > 1), None)
        b = best.prediction
        assert b is not None
        if etp is None:
            print(f"| {name}, {devices} x {cl}, batch {batch} | {best.describe()} | "
                  f"{b.tokens_per_s:,.0f} | none in the top {len(result.top)} | | | |")
            continue
        e = etp.prediction
        assert e is not None
        parts = " / ".join(f"{e.comm_s[k]:.3g} vs {b.comm_s[k]:.3g}" for k in ("ep", "tp", "dp"))
        print(f"| {name}, {devices} x {cl}, batch {batch} | {best.describe()} | "
              f"{b.tokens_per_s:,.0f} | {etp.describe()} ({result.top.index(etp) + 1}) | "
              f"{e.tokens_per_s:,.0f} | {e.tokens_per_s / b.tokens_per_s:.3f} | {parts} |",
              flush=True)


def speed() -> None:
    from graphopt.planner import model as plan_models

    cluster = CLUSTERS["h100-sxm"]
    print("\n| model | devices | plans evaluated | model trace s | search s | target (search) |")
    print("|---|---|---|---|---|---|")
    # issue 17: search time under 5 s at 16,384 devices
    for name, devices, target in (("llama3-405b", 2048, 5), ("deepseek-v3", 2048, 5),
                                  ("llama3-405b", 16384, 5), ("deepseek-v3", 16384, 5)):
        plan_models._CACHE.clear()
        start = time.perf_counter()
        model = plan_model(name, 8192, cluster)
        traced = time.perf_counter() - start
        result = search(model, cluster, devices, devices)
        print(f"| {name} | {devices} | {result.evaluated} | {traced:.1f} | "
              f"{result.seconds:.2f} | < {target} |", flush=True)


MEGATRON_CORE_H100 = [
    # params, heads, hidden, layers, TP, PP, DP, GPUs, batch, TFLOP/s per GPU (published)
    ("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1),
    ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6),
    ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7),
    ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5),
    ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8),
    ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4),
    ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9),
]
"""Megatron-LM README (commit f2e5db4, July 2024), images/model_table.png."""

TORCHTITAN_H100 = [
    # name, model, GPUs, dp_shard, tp, local batch, recompute, tokens/s per GPU, GiB, source
    ("8B FSDP 8, SAC", "llama3-8b", 8, 8, 1, 2, "selective", 6667, 77.0,
     "llama3_h100_202412 Table 1"),
    ("8B FSDP 128, SAC", "llama3-8b", 128, 128, 1, 2, "selective", 6514, 62.0,
     "llama3_h100_202412 Table 3"),
    ("8B FSDP 8 x TP 8, SAC", "llama3-8b", 64, 8, 8, 12, "selective", 4378, None,
     "asyncTP_llama3_h100_2025-06"),
    ("70B FSDP 32 x TP 8, full AC", "llama3-70b", 256, 32, 8, 16, "full", 597.3, None,
     "asyncTP_llama3_h100_2025-06"),
]
"""torchtitan benchmarks (bfloat16, torch.compile, no Float8, vanilla TP); sequence 8192
(train_configs/llama3_*.toml at the benchmark's torchtitan commit 9dec370). Grand Teton
H100s: 96 GB HBM2e, 500 W, 400 Gb/s RDMA per GPU. The local batch is one microbatch (no
gradient accumulation)."""


def _fit(rows: list, predict) -> tuple[float, list[float]]:
    """The GEMM efficiency minimizing the squared log errors of ``predict(row, eff)`` (seconds)
    against each row's published seconds (its last element), and each row's leave-one-out
    error (fitted on the other rows)."""
    grid = [0.40 + 0.005 * i for i in range(101)]
    table = {eff: [math.log(predict(r, eff) / r[-1]) for r in rows] for eff in grid}

    def best(skip: int | None) -> float:
        return min(grid, key=lambda e: sum(x * x for i, x in enumerate(table[e]) if i != skip))

    loo = [math.exp(table[best(i)][i]) - 1 for i in range(len(rows))]
    return best(None), loo


def _summary(loo: list[float], fitted: str) -> list[float]:
    errors = [abs(e) for e in loo]
    print(f"{fitted}; leave-one-out |error|: median {statistics.median(errors):.1%}, worst "
          f"{max(errors):.1%} ({len(errors)} rows)")
    return errors


def _with_efficiency(cluster, eff: float, memory: float | None = None):
    device = dataclasses.replace(cluster.device, matmul_efficiency=eff,
                                 memory_bytes=memory or cluster.device.memory_bytes)
    return dataclasses.replace(cluster, device=device)


def megatron_core() -> list[float]:
    base = CLUSTERS["h100-sxm"]
    rows, models = [], {}
    for label, heads, hidden, layers, tp, pp, dp, gpus, batch, tflops in MEGATRON_CORE_H100:
        plan = ParallelPlan(dp_shard=dp, zero_stage=1, tp=tp, sp=tp > 1, pp=pp)
        plan.validate(devices=gpus, layers=layers, heads=heads, global_batch=batch)
        models[label] = plan_model("gpt3-175b", 4096, base, torch.bfloat16, "flash", "fused",
                                   {"n_embd": hidden, "n_layer": layers, "n_head": heads,
                                    "vocab_size": 131072, "n_positions": 4096})
        # Megatron-LM r0.8.0 num_floating_point_operations (no GQA, 4h GeLU MLP)
        flops = 12 * batch * 4096 * layers * hidden ** 2 * (
            (2 + 4096 / hidden) + 4 + 131072 / (2 * layers * hidden))
        rows.append((label, plan, batch, gpus, flops, flops / (tflops * 1e12 * gpus)))

    def predict(row, eff: float) -> float:
        label, plan, batch, *_ = row
        return evaluate(plan, models[label], _with_efficiency(base, eff), batch).step_s

    eff, loo = _fit(rows, predict)
    print("\n| Megatron-Core r0.8.0 H100 | GPUs | published plan | published TFLOP/s/GPU | "
          "predicted (leave-one-out error) | predicted GiB / 80 GB | graphopt plan | "
          "predicted TFLOP/s/GPU | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    cluster = _with_efficiency(base, eff)
    for row, err in zip(rows, loo):
        label, plan, batch, gpus, flops, published_s = row
        pred = evaluate(plan, models[label], cluster, batch)
        best = search(models[label], cluster, gpus, batch, top_k=1,
                      published=[("published", plan)]).best
        assert best.prediction is not None
        tf = flops / published_s / gpus / 1e12
        print(f"| {label} | {gpus} | TP={plan.tp} PP={plan.pp} DP={plan.dp} | {tf:.1f} | "
              f"{tf / (1 + err):.1f} ({err:+.1%}) | {pred.memory_bytes / 2**30:.1f} | "
              f"{best.describe()} | {flops / best.prediction.step_s / gpus / 1e12:.1f} | "
              f"{pred.step_s / best.prediction.step_s:.2f}x |", flush=True)
    return _summary(loo, f"fitted H100 GEMM efficiency {eff:.3f}")


def torchtitan() -> list[float]:
    base = CLUSTERS["h100-sxm"]
    rows, models = [], {}
    for label, name, gpus, shard, tp, local, ac, tps, gib, source in TORCHTITAN_H100:
        layers = plan_model(name, 8192, base, activations="fused").layers
        plan = ParallelPlan(dp_shard=shard, zero_stage=3, tp=tp, sp=tp > 1, microbatch=local,
                            selective_recompute=ac == "selective",
                            recompute_layers=layers if ac == "full" else 0)
        batch = shard * local
        plan.validate(devices=gpus, layers=layers, global_batch=batch)
        models[label] = plan_model(name, 8192, base, activations="fused")
        rows.append((label, plan, batch, gpus, gib, source, batch * 8192 / (tps * gpus)))

    def predict(row, eff: float) -> float:
        label, plan, batch, *_ = row
        return evaluate(plan, models[label], _with_efficiency(base, eff, 96e9), batch).step_s

    eff, loo = _fit(rows, predict)
    print("\n| torchtitan H100 (96 GB, 500 W) | published tokens/s/GPU | predicted "
          "(leave-one-out error) | published GiB | predicted GiB / 96 GB | source |")
    print("|---|---|---|---|---|---|")
    cluster = _with_efficiency(base, eff, 96e9)
    for row, err in zip(rows, loo):
        label, plan, batch, gpus, gib, source, published_s = row
        pred = evaluate(plan, models[label], cluster, batch)
        tps = batch * 8192 / published_s / gpus
        print(f"| {label} | {tps:,.0f} | {tps / (1 + err):,.0f} ({err:+.1%}) | "
              f"{gib if gib else '-'} | {pred.memory_bytes / 2**30:.1f} | {source} |",
              flush=True)
    return _summary(loo, f"fitted GEMM efficiency {eff:.3f} (500 W)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", choices=["all", "quick"], default="all")
    parser.add_argument("--only", choices=["published", "etp"], default=None,
                        help="only the Megatron-Core and torchtitan validation tables, or "
                             "only the tensor-parallel experts table")
    args = parser.parse_args()
    if args.only == "published":
        megatron_core()
        torchtitan()
        return
    if args.only == "etp":
        expert_tp()
        return
    rows = MEGATRON_SC21_TABLE1 if args.rows == "all" else MEGATRON_SC21_TABLE1[:3]
    megatron(rows)
    hypertron()
    expert_tp()
    speed()
    megatron_core()
    torchtitan()


if __name__ == "__main__":
    main()
