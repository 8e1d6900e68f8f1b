"""attention="exact" on MiniMax and attention="lightning" on Llama: forward+backward time,
side by side in one run.

    TORCHINDUCTOR_COMPILE_THREADS=1 python benchmarks/attention_pass.py \
        [--only minimax|llama] [--configs small medium] [--seqs 4096 16384] [--reps 3]

MiniMax: graphopt.models' MiniMax (MoE 4 experts, grouped_mm experts so the model is one
graph) with MiniMax's real block size 256, "small" (hidden 64, 4 heads of 16) and "medium"
(hidden 512, 8 heads of 64), in two layer mixes: both layers linear attention (isolates the
rewrite) and one linear + one softmax layer. keep vs exact with the same eager lowering is
the rewrite's effect; exact with the inductor lowering vs the eager model is what a user gets.
Llama: attention="lightning" vs "keep" (approximate; where Lightning Attention pays off).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import graphopt
from graphopt.models import build_model, sample_batch


def step_time(fn, ids, reps: int) -> float:
    fn(ids).sum().backward()  # compile + warm up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn(ids).sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def llama_lightning(seqs: list[int], reps: int) -> None:
    """Llama (graphopt.models' small config) with attention="lightning" vs "keep"."""
    print("\n| Llama S | keep (softmax) ms | lightning ms | lightning speedup |")
    print("|---|---|---|---|")
    for seq in seqs:
        model = build_model("llama")
        ids = sample_batch(model, batch=1, seq=seq)

        def logits(i, model=model):
            return model(input_ids=i, use_cache=False).logits

        times = {}
        for mode in ("keep", "lightning"):
            torch._dynamo.reset()
            fn = torch.compile(logits, backend="graphopt",
                               options={"lowering": "eager", "attention": mode})
            times[mode] = step_time(fn, ids, reps)
        print(f"| {seq} | {times['keep'] * 1e3:.0f} | {times['lightning'] * 1e3:.0f} | "
              f"{times['keep'] / times['lightning']:.2f}x |", flush=True)


CONFIGS = {
    "small": dict(),  # graphopt.models' MiniMax: hidden 64, 4 heads of 16
    "medium": dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=8, head_dim=64),
}


def minimax_exact(seqs: list[int], reps: int, configs: list[str]) -> None:
    """MiniMax, attention="exact": eager vs graphopt (keep and exact, eager lowering; exact
    with the inductor lowering)."""
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, batch 1, "
          f"medians of {reps} forward+backward steps")
    print("| config | layers | S | eager ms | keep (eager lowering) ms | exact (eager lowering) "
          "ms | exact (inductor) ms | exact vs keep | exact (inductor) vs eager | sites "
          "rewritten |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    mixes = {"linear+linear": ["linear_attention", "linear_attention"],
             "linear+softmax": ["linear_attention", "full_attention"]}
    for config in configs:
        for label, layers in mixes.items():
            for seq in seqs:
                # grouped_mm experts: one graph (the eager expert loop graph-breaks, which
                # passes the causal mask between graphs as an input).
                model = build_model("minimax", block_size=256, layer_types=layers,
                                    experts_implementation="grouped_mm", **CONFIGS[config])
                ids = sample_batch(model, batch=1, seq=seq)

                def logits(i, model=model):
                    return model(input_ids=i, use_cache=False).logits

                times = {"eager": step_time(logits, ids, reps)}
                rewritten = 0
                for key, mode, lowering in (("keep", "keep", "eager"),
                                            ("exact", "exact", "eager"),
                                            ("exact_inductor", "exact", "inductor")):
                    torch._dynamo.reset()
                    graphopt.clear_reports()
                    fn = torch.compile(logits, backend="graphopt",
                                       options={"lowering": lowering, "attention": mode})
                    times[key] = step_time(fn, ids, reps)
                    if key == "exact":
                        rewritten = sum(p.count("rewritten") for r in graphopt.reports()
                                        for p in r.pass_records("attention"))
                t = {k: v * 1e3 for k, v in times.items()}
                print(f"| {config} | {label} | {seq} | {t['eager']:.0f} | {t['keep']:.0f} | "
                      f"{t['exact']:.0f} | {t['exact_inductor']:.0f} | "
                      f"{t['keep'] / t['exact']:.2f}x | {t['eager'] / t['exact_inductor']:.2f}x"
                      f" | {rewritten} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", nargs="+", type=int, default=[4096, 16384])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--llama-seqs", nargs="+", type=int,
                        default=[256, 512, 1024, 2048, 4096, 16384])
    parser.add_argument("--only", choices=["minimax", "llama"], default=None)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if args.only != "llama":
        minimax_exact(args.seqs, args.reps, args.configs)
    if args.only != "minimax":
        llama_lightning(args.llama_seqs, args.reps)


if __name__ == "__main__":
    main()
