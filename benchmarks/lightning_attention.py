"""Lightning Attention on this CPU: graphopt's chunked kernel vs causal SDPA, vs the matmul
roofline, and vs transformers' MiniMax block loop; saved-for-backward bytes.

    python benchmarks/lightning_attention.py [--seqs 256 1024 4096 16384 32768] [--reps 3]
    python benchmarks/lightning_attention.py --only subsets   # gradients of some inputs

Shapes: B=1, H=8, D=Dv=64, float32 (the issue's). Every ratio compares numbers measured in
this run (medians of --reps after one warm-up).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from common import median_time

from graphopt.cost import lightning_flops
from graphopt.kernels.lightning import lightning_attention
from graphopt.kernels.lightning.chunked import DEFAULT_BLOCK_SIZE


def matmul_gflops(reps: int) -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    return 2 * 2048**3 / median_time(lambda: a @ b, reps) / 1e9


def bmm_ceiling_gflops(reps: int, batch: int) -> float:
    """GFLOP/s of the batched GEMMs the chunked algorithm is made of: 64 x 64 x 64, one per
    block and head (batch = H * S / C), operands streamed from memory as in the kernel."""
    a, b = torch.randn(batch, 64, 64), torch.randn(batch, 64, 64)
    return 2 * batch * 64**3 / median_time(lambda: torch.bmm(a, b), reps) / 1e9


def bench_vs_sdpa(seqs: list[int], reps: int, peak: float) -> None:
    b, h, d = 1, 8, 64
    print("\n| S | SDPA fwd ms | lightning fwd ms | fwd speedup | SDPA fwd+bwd ms | "
          "lightning fwd+bwd ms | fwd+bwd speedup | lightning GFLOP/s (fwd+bwd) | of matmul peak |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in seqs:
        q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
        slope = torch.rand(h) * 0.1
        go = torch.randn(b, h, s, d)
        with torch.no_grad():
            t_sdpa = median_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                 reps)
            t_la = median_time(lambda: lightning_attention(q, k, v, slope), reps)

        def sdpa_train() -> None:
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(go)

        def la_train() -> None:
            lightning_attention(q, k, v, slope).backward(go)

        t_sdpa_t = median_time(sdpa_train, reps)
        t_la_t = median_time(la_train, reps)
        flops = sum(lightning_flops(b, h, s, d, d, DEFAULT_BLOCK_SIZE, backward)
                    for backward in (False, True))
        gflops = flops / t_la_t / 1e9
        print(f"| {s} | {t_sdpa * 1e3:.1f} | {t_la * 1e3:.1f} | {t_sdpa / t_la:.2f}x | "
              f"{t_sdpa_t * 1e3:.1f} | {t_la_t * 1e3:.1f} | {t_sdpa_t / t_la_t:.2f}x | "
              f"{gflops:.3g} | {gflops / peak:.1%} |", flush=True)


def bench_subsets(seqs: list[int], reps: int) -> None:
    """fwd+bwd when only some inputs need gradients (the backward skips the rest: no
    reverse state scan without k/v, no dQ without q) vs all of q, k, v, side by side."""
    b, h, d = 1, 8, 64
    print("\n| S | q, k, v ms | q only ms | speedup | k, v only ms | speedup |")
    print("|---|---|---|---|---|---|")
    for s in seqs:
        base = [torch.randn(b, h, s, d) for _ in range(3)]
        slope = torch.rand(h) * 0.1
        go = torch.randn(b, h, s, d)
        times = []
        for needs in ("qkv", "q", "kv"):
            q, k, v = (x.clone().requires_grad_(n in needs) for n, x in zip("qkv", base))
            times.append(median_time(
                lambda q=q, k=k, v=v: lightning_attention(q, k, v, slope).backward(go), reps))
        print(f"| {s} | {times[0] * 1e3:.1f} | {times[1] * 1e3:.1f} | "
              f"{times[0] / times[1]:.2f}x | {times[2] * 1e3:.1f} | {times[0] / times[2]:.2f}x |",
              flush=True)


def minimax_layer(hidden: int = 512, heads: int = 8) -> torch.nn.Module:
    from transformers import MiniMaxConfig
    from transformers.models.minimax import modeling_minimax as mm

    config = MiniMaxConfig(hidden_size=hidden, num_attention_heads=heads,
                           head_dim=hidden // heads, block_size=256, num_hidden_layers=1,
                           layer_types=["linear_attention"])
    torch.manual_seed(0)
    return mm.MiniMaxLightningAttention(config, layer_idx=0)


def minimax_with_graphopt(attn: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The MiniMax layer's function with its block loop replaced by graphopt's op."""
    b, s, _ = x.shape
    heads, dh = attn.num_attention_heads, attn.head_dim
    qkv = attn.act_fn(attn.qkv_proj(x)).reshape(b, s, heads, 3 * dh)
    q, k, v = (t.transpose(1, 2) for t in torch.split(qkv, dh, dim=3))
    o = lightning_attention(q, k, v, attn.slope_rate.view(-1))
    o = attn.norm(o.transpose(1, 2).reshape(b, s, heads * dh))
    return attn.out_proj(torch.sigmoid(attn.output_gate(x)) * o)


def saved_bytes(fn: Callable[[], torch.Tensor]) -> int:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[id(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def bench_vs_minimax(seqs: list[int], reps: int) -> None:
    attn = minimax_layer()
    print("\n| S | MiniMax layer with block loop fwd+bwd ms | same layer with graphopt op ms | "
          "layer speedup | attention core: loop ms / graphopt op ms (speedup) | saved bytes: "
          "layer with loop / layer with graphopt / core ratio |")
    print("|---|---|---|---|---|---|")
    for s in seqs:
        x = torch.randn(1, s, 512, requires_grad=True)
        go = torch.randn(1, s, 512)

        def loop() -> torch.Tensor:
            return attn(x, position_embeddings=None, attention_mask=None)[0]

        def ours() -> torch.Tensor:
            return minimax_with_graphopt(attn, x)

        t_loop = median_time(lambda: loop().backward(go), reps)
        t_ours = median_time(lambda: ours().backward(go), reps)
        # The attention core alone: the layer minus its projections, norm and gate, which are
        # the same code in both layers (measured as the graphopt layer minus graphopt's op).
        qkv = [torch.randn(1, 8, s, 64, requires_grad=True) for _ in range(3)]
        slope = attn.slope_rate.view(-1)
        go_core = torch.randn(1, 8, s, 64)
        t_op = median_time(lambda: lightning_attention(*qkv, slope).backward(go_core), reps)
        t_loop_core = t_loop - (t_ours - t_op)
        op_only = saved_bytes(lambda: lightning_attention(*qkv, slope))
        b_loop, b_ours = saved_bytes(loop), saved_bytes(ours)
        shared = b_ours - op_only
        ratio = op_only / max(b_loop - shared, 1)
        print(f"| {s} | {t_loop * 1e3:.0f} | {t_ours * 1e3:.0f} | {t_loop / t_ours:.2f}x | "
              f"{t_loop_core * 1e3:.0f} / {t_op * 1e3:.0f} ({t_loop_core / t_op:.2f}x) | "
              f"{b_loop / 2**20:.0f} MiB / {b_ours / 2**20:.0f} MiB / {ratio:.2f}x |",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", nargs="+", type=int, default=[256, 512, 1024, 4096, 16384,
                                                                   32768])
    parser.add_argument("--minimax-seqs", nargs="+", type=int, default=[4096, 16384])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--only", choices=["subsets"], default=None,
                        help="only the table of gradients of some inputs")
    args = parser.parse_args()
    if args.only == "subsets":
        bench_subsets([1024, 4096, 16384], args.reps)
        return
    peak = matmul_gflops(args.reps)
    ceiling = bmm_ceiling_gflops(args.reps, batch=8 * 16384 // 64)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; fp32 2048^3 matmul: "
          f"{peak:.0f} GFLOP/s; 2048 streamed 64^3 bmms (the kernel's GEMMs at S=16k): "
          f"{ceiling:.0f} GFLOP/s ({ceiling / peak:.0%} of the matmul); B=1 H=8 D=Dv=64 fp32; "
          f"medians of {args.reps}")
    bench_vs_sdpa(args.seqs, args.reps, peak)
    bench_vs_minimax(args.minimax_seqs, args.reps)


if __name__ == "__main__":
    main()
