"""Model passes inside gradient-checkpointing regions: MiniMax (toy config, float32, CPU)
trained with and without transformers' ``gradient_checkpointing_enable()``, as eager, as
``torch.compile(backend="aot_eager")`` and as graphopt (attention "exact" + moe, eager
lowering), side by side in one process.

    python benchmarks/checkpoint_regions.py [--seq 512] [--batch 2] [--reps 5]

Saved: bytes autograd keeps for the backward of one step (``saved_tensors_hooks``, each
storage once, parameters excluded; with checkpointing, what the regions' boundaries keep).
Experts: transformers' ``grouped_mm`` (one graph; common.minimax_toy). Time: median of
``--reps`` forward + backward steps after a warm-up (compile excluded), the three runs'
steps alternating (one of each per rep, the order rotating). Rewritten: the
attention / moe report sites that were rewritten, and whether the compile ran its rewritten
graph (no fallback).
Before graphopt ran passes inside checkpoint regions, the checkpointed graphopt column had
0 rewrites: the layers' block loop and expert loop stayed as written.
"""

from __future__ import annotations

import argparse
import os

import torch
from common import interleaved_medians, minimax_toy

import graphopt
from graphopt.cost.memory import measured_saved_bytes
from graphopt.models import sample_batch

KINDS = ("eager", "aot_eager", "graphopt")


def run(checkpointing: bool, args: argparse.Namespace) -> dict[str, dict]:
    """One row per kind; the kinds' timed steps alternate (common.interleaved_medians)."""
    import torch._dynamo

    torch._dynamo.reset()
    graphopt.clear_reports()
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
    rows: dict[str, dict] = {}
    steps = {}
    for kind in KINDS:
        model, fn = minimax_toy(kind, checkpointing, reset=False)
        ids = sample_batch(model, batch=args.batch, seq=args.seq)

        def step(model=model, fn=fn, ids=ids) -> None:
            model.zero_grad(set_to_none=True)
            fn(ids).sum().backward()

        step()  # compile
        # each storage once, parameters not counted (as the other scripts; a review: every
        # packed tensor was summed, shared inputs several times)
        saved = measured_saved_bytes(lambda fn=fn, ids=ids: fn(ids), list(model.parameters()))
        rows[kind] = {"saved": saved}
        steps[kind] = step
    reports = graphopt.reports()  # graphopt's compiles alone write reports
    rows["graphopt"]["rewritten"] = sum(
        s.action == "rewritten" for r in reports for p in r.passes
        if p.name in ("attention", "moe") for s in p.sites)
    rows["graphopt"]["fallback"] = any(r.fallback for r in reports)
    for kind, seconds in interleaved_medians(steps, args.reps).items():
        rows[kind]["ms"] = seconds * 1e3
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    print(f"MiniMax toy (2 layers: lightning + softmax attention, 4 experts), float32, "
          f"batch {args.batch}, seq {args.seq}, {torch.get_num_threads()} threads")
    print("| checkpointing | run | saved for backward MiB | vs aot_eager | step ms | vs eager "
          "| attention/moe rewrites | ran rewritten graph |")
    print("|---|---|---|---|---|---|---|---|")
    for checkpointing in (False, True):
        rows = run(checkpointing, args)
        for kind, row in rows.items():
            ran = "" if kind != "graphopt" else ("no (fallback)" if row["fallback"] else "yes")
            print(f"| {'on' if checkpointing else 'off'} | {kind} | "
                  f"{row['saved'] / 2**20:.2f} | "
                  f"{row['saved'] / rows['aot_eager']['saved']:.2f}x | {row['ms']:.1f} | "
                  f"{rows['eager']['ms'] / row['ms']:.2f}x faster | "
                  f"{row['rewritten'] if kind == 'graphopt' else ''} | {ran} |")


if __name__ == "__main__":
    main()
