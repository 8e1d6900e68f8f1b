"""attention="exact" on MiniMax: forward+backward time of the compiled model with the block
loop rewritten vs kept, and vs eager, side by side in one run.

    python benchmarks/attention_pass.py [--seqs 4096 16384] [--reps 3]

Model: graphopt.models' small MiniMax (hidden 64, 4 heads of 16, MoE 4 experts) with
MiniMax's real block size 256, in two layer mixes: both layers linear attention (isolates
the rewrite) and the default mix (one linear, one softmax layer). Same graphopt pipeline and
eager lowering for both modes, so the ratio is the rewrite's effect.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", nargs="+", type=int, default=[4096, 16384])
    parser.add_argument("--llama-seqs", nargs="+", type=int,
                        default=[256, 512, 1024, 2048, 4096, 16384])
    parser.add_argument("--only", choices=["minimax", "llama"], default=None)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if args.only == "llama":
        llama_lightning(args.llama_seqs, args.reps)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, batch 1, "
          f"medians of {args.reps} forward+backward steps")
    print("| layers | S | eager ms | graphopt keep ms | graphopt exact ms | exact vs eager | "
          "exact vs keep | loops rewritten |")
    print("|---|---|---|---|---|---|---|---|")
    mixes = {"linear+linear": ["linear_attention", "linear_attention"],
             "linear+softmax": ["linear_attention", "full_attention"]}
    for label, layers in mixes.items():
        for seq in args.seqs:
            model = build_model("minimax", block_size=256, layer_types=layers)
            ids = sample_batch(model, batch=1, seq=seq)

            def logits(i, model=model):
                return model(input_ids=i, use_cache=False).logits

            times = {"eager": step_time(logits, ids, args.reps)}
            rewritten = 0
            for mode in ("keep", "exact"):
                torch._dynamo.reset()
                graphopt.clear_reports()
                fn = torch.compile(logits, backend="graphopt",
                                   options={"lowering": "eager", "attention": mode})
                times[mode] = step_time(fn, ids, args.reps)
                if mode == "exact":
                    rewritten = sum(p.count("rewritten") for r in graphopt.reports()
                                    for p in r.pass_records("attention"))
            print(f"| {label} | {seq} | {times['eager'] * 1e3:.0f} | {times['keep'] * 1e3:.0f}"
                  f" | {times['exact'] * 1e3:.0f} | {times['eager'] / times['exact']:.2f}x | "
                  f"{times['keep'] / times['exact']:.2f}x | {rewritten} |", flush=True)
    if args.only is None:
        llama_lightning(args.llama_seqs, args.reps)


if __name__ == "__main__":
    main()
