"""Context-parallel Lightning Attention on gloo ranks (CPU): per-rank forward+backward time of
a sequence split over P ranks (state passing, graphopt.kernels.lightning.cp) next to one
rank running the whole sequence, in one run.

    python benchmarks/lightning_cp.py [--seq 16384] [--heads 8] [--dim 64] [--reps 3]

Each rank uses 1 thread. Reported: median step time of the slowest rank, speed-up over
P = 1 and scaling efficiency = speed-up / P; the bytes the ranks exchange (one all-gather of
[B, H, D, D] states forward, its reduce-scatter backward) next to what passing K and V
would move. This machine has 2 cores: P = 4 runs 4 single-thread ranks on 2 cores, so its
efficiency is capped near 0.5 by the hardware, not by the method.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from graphopt.distributed import run_distributed, slowest_rank_seconds


def _worker(rank: int, world: int, args: argparse.Namespace) -> list[float]:

    from graphopt.kernels.lightning.cp import lightning_attention_cp

    torch.set_num_threads(1)
    length = args.seq // world
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, args.heads, length, args.dim, generator=gen,
                           requires_grad=True) for _ in range(3))
    slope = torch.linspace(0.01, 0.5, args.heads)
    grad = torch.randn(1, args.heads, length, args.dim, generator=gen)
    times = []
    for _ in range(args.reps + 1):
        times.append(slowest_rank_seconds(
            lambda: lightning_attention_cp(q, k, v, slope, "", block_size=64).backward(grad)))
    return times[1:]  # the first step warms up allocations: not timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    print(f"lightning attention fwd+bwd, B=1, H={args.heads}, D={args.dim}, S={args.seq}, "
          f"fp32, 1 thread per rank; median of {args.reps}")
    print(f"{'ranks':>5s} {'ms/step':>9s} {'speed-up':>9s} {'efficiency':>10s} "
          f"{'state bytes':>12s} {'K+V bytes':>10s}")
    base = None
    for world in (1, 2, 4):
        step = statistics.median(run_distributed(_worker, world, args)[0])
        base = base or step
        state = 0 if world == 1 else 2 * world * args.heads * args.dim * args.dim * 4
        kv = 0 if world == 1 else 2 * args.seq * args.heads * args.dim * 4 * (world - 1) // world
        print(f"{world:5d} {step * 1e3:9.1f} {base / step:9.2f} {base / step / world:10.2f} "
              f"{state:12d} {kv:10d}")


if __name__ == "__main__":
    main()
