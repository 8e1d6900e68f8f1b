"""Lightning Attention on one CUDA GPU: graphopt's Triton kernels (forward + backward)
checked against the float32 reference, and timed next to graphopt's chunked PyTorch kernel,
causal flash attention (SDPA) and flash-linear-attention's chunk_simple_gla when it is
importable (same function: decay g = -slope per step).

    python benchmarks/lightning_gpu.py

B=1, H=8, D=Dv=64 (issue 3's shapes), bf16, forward+backward, CUDA-event
medians of 10 after 3 warm-ups.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from common import cuda_median_ms

from graphopt.kernels.lightning import lightning_attention
from graphopt.kernels.lightning.reference import lightning_attention_reference


def timed(fn: Callable[[], object]) -> float:
    return cuda_median_ms(fn, reps=10, warmups=3)


def check() -> None:
    torch.manual_seed(0)
    for s, d in ((300, 64), (1024, 64)):
        q, k, v = (torch.randn(2, 4, s, d, device="cuda") * 0.3 for _ in range(3))
        slope = torch.linspace(0.01, 0.3, 4, device="cuda")
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        want = lightning_attention_reference(qs, ks, vs, slope)[0]
        g = torch.randn_like(want)
        wg = torch.autograd.grad(want, (qs, ks, vs), g)
        qt, kt, vt = (t.clone().requires_grad_() for t in (q, k, v))
        try:
            got = lightning_attention(qt, kt, vt, slope, impl="triton")
        except Exception as exc:
            print(f"triton failed at S={s} D={d}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        gg = torch.autograd.grad(got, (qt, kt, vt), g)
        err = max([((got - want).abs().max() / want.abs().max()).item()] +
                  [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(gg, wg)])
        print(f"triton fp32 vs reference, S={s} D={d}: max rel error (o, dq, dk, dv) {err:.2e}")
        assert err < 1e-2


def main() -> None:
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    check()
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception as exc:  # not installed, or incompatible with this torch/triton
        print(f"flash-linear-attention unavailable: {type(exc).__name__}: {exc}")
        chunk_simple_gla = None
    print("| S | D | graphopt triton ms | graphopt chunked ms | fla chunk_simple_gla ms | "
          "SDPA flash (causal) ms | triton vs fla | triton vs SDPA |")
    print("|---|---|---|---|---|---|---|---|")
    for d in (64,):  # D=128: the backward kernel needs 416 KB of shared memory (see docs)
        for s in (4096, 16384, 65536):
            q, k, v = (torch.randn(1, 8, s, d, device="cuda", dtype=torch.bfloat16) * 0.3
                       for _ in range(3))
            for t in (q, k, v):
                t.requires_grad_()
            slope = torch.linspace(0.01, 0.3, 8, device="cuda")
            go = torch.randn_like(q)
            try:
                tri = timed(lambda: lightning_attention(q, k, v, slope, impl="triton")
                            .backward(go))
            except Exception as exc:
                print(f"triton failed at S={s} D={d}: {type(exc).__name__}: {str(exc)[:200]}")
                tri = float("nan")
            chk = timed(lambda: lightning_attention(q, k, v, slope, impl="chunked").backward(go))
            sdpa = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
                         .backward(go))
            fla = float("nan")
            if chunk_simple_gla is not None:
                try:
                    qf, kf, vf = (t.detach().transpose(1, 2).contiguous().requires_grad_()
                                  for t in (q, k, v))
                    gate = (-slope).view(1, 1, 8).expand(1, s, 8).contiguous()
                    gof = go.transpose(1, 2).contiguous()
                    fla = timed(lambda: chunk_simple_gla(qf, kf, vf, g=gate, scale=1.0)[0]
                                .backward(gof))
                    if s == 4096:
                        ours = lightning_attention(q, k, v, slope, impl="triton").float()
                        theirs = chunk_simple_gla(qf, kf, vf, g=gate, scale=1.0)[0]
                        diff = (theirs.transpose(1, 2).float() - ours).abs().max() / \
                            ours.abs().max()
                        print(f"fla vs graphopt output, S={s} D={d}: max rel diff "
                              f"{diff.item():.2e}")
                except Exception as exc:
                    print(f"fla failed: {type(exc).__name__}: {str(exc)[:200]}")
            print(f"| {s} | {d} | {tri:.2f} | {chk:.2f} | {fla:.2f} | {sdpa:.2f} | "
                  f"{fla / tri:.2f}x | {sdpa / tri:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
