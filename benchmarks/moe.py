"""MoE experts on one device: graphopt's sorted dispatch (graphopt.kernels.moe.moe_experts)
vs transformers' per-expert loop (MixtralExperts.forward), forward+backward, side by side.

    python benchmarks/moe.py [--tokens 4096] [--experts 8] [--hidden 512] [--ffn 1024] [--reps 5]

Mixtral-style SwiGLU experts, top-2 routing with random router weights, fp32.
"""

from __future__ import annotations

import argparse

import torch
from common import median_time

from graphopt.kernels.moe import moe_experts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    torch.manual_seed(0)
    experts = MixtralExperts(MixtralConfig(hidden_size=args.hidden,
                                           intermediate_size=args.ffn,
                                           num_local_experts=args.experts))
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.02)
        experts.down_proj.normal_(0, 0.02)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.experts} "
          f"experts, top-2, hidden {args.hidden}, ffn {args.ffn}, fp32, medians of "
          f"{args.reps}")
    print("| tokens | transformers loop fwd+bwd ms | graphopt sorted dispatch ms | speedup |")
    print("|---|---|---|---|")
    for t in args.tokens:
        hidden = torch.randn(t, args.hidden, requires_grad=True)
        logits = torch.randn(t, args.experts)
        weights, index = logits.softmax(-1).topk(2, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).requires_grad_()

        def loop() -> None:
            experts(hidden, index, weights).sum().backward()

        def sorted_dispatch() -> None:
            moe_experts(hidden, index, weights, experts.gate_up_proj,
                        experts.down_proj).sum().backward()

        a = median_time(loop, args.reps)
        b = median_time(sorted_dispatch, args.reps)
        print(f"| {t} | {a * 1e3:.1f} | {b * 1e3:.1f} | {a / b:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
