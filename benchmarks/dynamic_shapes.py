"""MiniMax trained at changing sequence lengths: torch.compile's automatic dynamic shapes
recompile the model with a symbolic length at the second length; does graphopt's exact
attention rewrite survive the recompile? Eager, ``torch.compile(backend="aot_eager")`` and
graphopt (attention "exact" + moe, eager lowering) side by side in one process.

    python benchmarks/dynamic_shapes.py [--lengths 512,490,485] [--batch 2] [--reps 5]

The first length compiles a static graph, the second recompiles with a symbolic length and
the later ones (same number of blocks) run that dynamic graph without recompiling. Time:
median of ``--reps`` forward + backward steps at each length after its first call (compile
excluded), the three runs' steps alternating (one of each per rep, the order rotating).
Reported per graphopt compile: the block loops rewritten into
``graphopt::lightning_attention`` and whether any compile fell back to its captured graph.
Before graphopt proved dynamic loops at every length (2026-12-02), the recompiled graph
kept the loop (its full blocks' products became parallel forms; the last block stayed).
"""

from __future__ import annotations

import argparse
import os

import torch
from common import interleaved_medians, minimax_toy

import graphopt
from graphopt.models import sample_batch

KINDS = ("eager", "aot_eager", "graphopt")


def run(lengths: list[int], args: argparse.Namespace) -> dict[str, dict]:
    """Per kind: step ms per length (the kinds' timed steps alternating,
    common.interleaved_medians) and, for graphopt, its compiles' block-loop rewrites."""
    import torch._dynamo

    torch._dynamo.reset()
    graphopt.clear_reports()
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
    toys = {kind: minimax_toy(kind, reset=False) for kind in KINDS}
    rows: dict[str, dict] = {kind: {"ms": {}} for kind in KINDS}
    for seq in lengths:
        steps = {}
        for kind, (model, fn) in toys.items():
            ids = sample_batch(model, batch=args.batch, seq=seq)

            def step(model=model, fn=fn, ids=ids) -> None:
                model.zero_grad(set_to_none=True)
                fn(ids).sum().backward()

            steps[kind] = step  # its warm-up call compiles or recompiles
        for kind, seconds in interleaved_medians(steps, args.reps).items():
            rows[kind]["ms"][seq] = seconds * 1e3
    reports = graphopt.reports()  # graphopt's compiles alone write reports
    rows["graphopt"].update(
        loops=[s.action for r in reports for p in r.passes if p.name == "attention"
               for s in p.sites if "block loop" in s.reason],
        dynamic=[s.action for r in reports if r.dynamic for p in r.passes
                 if p.name == "attention" for s in p.sites if "block loop" in s.reason],
        fallback=any(r.fallback for r in reports), compiles=len(reports))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="512,490,485")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    print(f"MiniMax toy (2 layers: lightning + softmax attention, block 16, 4 experts), "
          f"float32, batch {args.batch}, lengths {lengths}, {torch.get_num_threads()} threads")
    rows = run(lengths, args)
    go = rows["graphopt"]
    print(f"graphopt: {go['compiles']} compiled graphs, block loops "
          f"{go['loops']} (in dynamic-shape graphs: {go['dynamic']}), "
          f"fallback: {go['fallback']}")
    print("| length | graph | eager ms | aot_eager ms | graphopt ms | graphopt vs eager "
          "| graphopt vs aot_eager |")
    print("|---|---|---|---|---|---|---|")
    for i, seq in enumerate(lengths):
        e, a, g = (rows[k]["ms"][seq] for k in ("eager", "aot_eager", "graphopt"))
        graph = "static" if i == 0 else "dynamic"
        print(f"| {seq} | {graph} | {e:.1f} | {a:.1f} | {g:.1f} | {e / g:.2f}x faster "
              f"| {a / g:.2f}x faster |")


if __name__ == "__main__":
    main()
