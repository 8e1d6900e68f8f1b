"""MoE experts on one CUDA GPU: graphopt::moe_experts (sorted dispatch, torch._grouped_mm,
explicit backward) vs transformers' per-expert loop (MixtralExperts eager) and transformers'
own grouped_mm experts, forward+backward, bf16, side by side; plus correctness checks of the
op and of the moe pass on a small Mixtral on the GPU, and the combine (unpermute) alone:
fused Triton gather vs index_add.

    python benchmarks/moe_gpu.py [--reps 20] [--skip-checks] [--profile I]

``--bound`` (no GPU needed): the bytes the op's non-GEMM passes move at Mixtral size and the
speedup over transformers' grouped_mm they can give at most, from the H200 times of
2026-12-04 (docs/benchmarks.md) or ``--times GRAPHOPT_MS GROUPED_MM_MS`` of a new run.

``--profile I``: instead of the tables, torch.profiler over 5 forward+backward steps of
SHAPES[I] for transformers' grouped_mm experts and for graphopt's op, each printing its
GPU kernels by total CUDA time and the step's CPU (launch) time next to its GPU time: where
the 0.80x at hidden 1024 goes (docs/benchmarks.md: the GEMMs are shared, the non-GEMM passes
are ~1.3 ms at Mixtral size by their bytes, so the rest is kernels to find by name).

Timing: CUDA events around 20 forward+backward steps after 5 warm-ups, median per step.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from common import cuda_median_ms

from graphopt.kernels.moe import moe_experts

SHAPES = [(4096, 8, 1024, 3584), (4096, 8, 4096, 14336), (16384, 8, 4096, 14336),
          (4096, 64, 2048, 1408), (4096, 128, 2048, 768), (8192, 256, 2048, 512)]
# (tokens, experts, hidden, ffn): Mixtral size (issue 16: >= 1.2x transformers' grouped_mm
# experts, >= 2x its eager loop), then DeepSeek-like small experts (64-256).


def experts_module(e: int, h: int, f: int, impl: str) -> torch.nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=h, intermediate_size=f, num_local_experts=e)
    config._experts_implementation = impl
    torch.manual_seed(0)
    module = MixtralExperts(config)
    module.config = config
    with torch.no_grad():
        module.gate_up_proj.normal_(0, 0.02)
        module.down_proj.normal_(0, 0.02)
    return module.cuda().bfloat16()


def time_step(fn: Callable[[], object], reps: int) -> float:
    return cuda_median_ms(fn, reps, warmups=5)


def check_op() -> None:
    ex = experts_module(8, 256, 512, "eager")
    x = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w, i = torch.randn(1000, 8, device="cuda").softmax(-1).topk(2, dim=-1)
    w = w.requires_grad_()
    ref = ex.float()(x.float(), i, w)
    ex = ex.bfloat16()
    got = moe_experts(x, i, w, ex.gate_up_proj, ex.down_proj)
    err = (got.float() - ref).abs().max().item() / ref.abs().max().item()
    gx = torch.autograd.grad(got.float().square().sum(), x)[0]
    print(f"op check (bf16 vs fp32 loop): max rel error {err:.2e}, grad finite "
          f"{bool(torch.isfinite(gx).all())}")
    assert err < 3e-2
    # experts 6 and 7 get no rows: their weight gradients must be exactly 0 even when the
    # allocator hands out NaN-filled memory (torch._grouped_mm's empty groups:
    # pytorch/pytorch#172439 on Blackwell, zeroed there by graphopt)
    poison = torch.full((64, 2**20), float("nan"), device="cuda")
    del poison
    gate_up = ex.gate_up_proj.detach().requires_grad_()
    down = ex.down_proj.detach().requires_grad_()
    out = moe_experts(x, i % 6, w, gate_up, down)
    g_up, g_down = torch.autograd.grad(out.float().square().sum(), (gate_up, down))
    empty_zero = bool(g_up[6:].eq(0).all() and g_down[6:].eq(0).all())
    print(f"op check (experts with no rows): weight gradients exactly 0 {empty_zero}, others "
          f"finite {bool(torch.isfinite(g_up[:6]).all() and torch.isfinite(g_down[:6]).all())}")
    assert empty_zero


def check_no_host_sync() -> None:
    """bf16 forward+backward of the op, dropless and with a capacity that drops tokens, with
    CUDA's sync debug mode set to error: counts, offsets, the sort and the kept count stay on
    the device."""
    ex = experts_module(8, 256, 512, "eager")
    x = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w, i = torch.randn(1024, 8, device="cuda").softmax(-1).topk(2, dim=-1)
    w = w.requires_grad_()
    for cf in (None, 0.8):
        moe_experts(x, i, w, ex.gate_up_proj, ex.down_proj, capacity_factor=cf).sum().backward()
        torch.cuda.synchronize()  # warm-up done
        torch.cuda.set_sync_debug_mode("error")
        try:
            moe_experts(x, i, w, ex.gate_up_proj, ex.down_proj,
                        capacity_factor=cf).sum().backward()
            print(f"host synchronizations in forward+backward (capacity {cf}): none")
        except RuntimeError as exc:
            print(f"host synchronization found (capacity {cf}): {str(exc)[:300]}")
        finally:
            torch.cuda.set_sync_debug_mode(0)


def check_pass() -> None:
    from graphopt.models import build_model, sample_batch
    from graphopt.report import clear_reports, reports

    model = build_model("mixtral", dtype=torch.bfloat16).cuda()
    ids = sample_batch(model, 2, 64).cuda()
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits.float()
    model.set_experts_implementation("grouped_mm")
    clear_reports()
    from graphopt.backend import graphopt_backend

    torch._dynamo.register_backend(graphopt_backend, "graphopt")  # when not pip-installed
    compiled = torch.compile(lambda x: model(input_ids=x, use_cache=False).logits,
                             backend="graphopt", options={"moe": {}, "lowering": "inductor"})
    got = compiled(ids).float()
    got.sum().backward()
    sites = [s.action for r in reports() for p in r.passes if p.name == "moe" for s in p.sites]
    err = ((got - want).abs().max() / want.abs().max()).item()
    print(f"pass check (small Mixtral, bf16, inductor, CUDA): sites {sites}, max rel logit "
          f"difference vs the eager loop {err:.2e}")
    assert sites.count("rewritten") == 2 and err < 5e-2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--op-checks-only", action="store_true",
                        help="check the op (numerics, empty experts, no host sync) but not "
                        "the pass (an Inductor compile), then time")
    parser.add_argument("--bound", action="store_true",
                        help="the non-GEMM byte bound at Mixtral size (no GPU needed)")
    parser.add_argument("--times", type=float, nargs=2, default=(20.39, 20.57),
                        metavar=("GRAPHOPT_MS", "GROUPED_MM_MS"),
                        help="measured fwd+bwd ms at 4096 tokens, Mixtral size (--bound)")
    parser.add_argument("--profile", type=int, default=None, metavar="I",
                        help="profile SHAPES[I] instead of timing the tables")
    args = parser.parse_args()
    if args.bound:
        non_gemm_bound(*args.times)
        return
    if not torch.cuda.is_available():
        raise SystemExit(f"moe_gpu.py times GPU kernels and needs a CUDA GPU (this torch "
                         f"{torch.__version__} sees none); run it through the device tool "
                         "(benchmarks/gpu_session.sh)")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    if args.profile is not None:
        profile_shape(*SHAPES[args.profile])
        return
    if not args.skip_checks:
        check_op()
        check_no_host_sync()
        if not args.op_checks_only:
            check_pass()
    print("| tokens | experts | hidden | ffn | transformers loop ms | transformers grouped_mm ms "
          "| graphopt ms | vs loop | vs grouped_mm |")
    print("|---|---|---|---|---|---|---|---|---|")
    for t, e, h, f in SHAPES:
        a, b, c = measure(t, e, h, f, args.reps)
        print(f"| {t} | {e} | {h} | {f} | {a:.2f} | {b:.2f} | {c:.2f} | {a / c:.2f}x | "
              f"{b / c:.2f}x |", flush=True)
        torch.cuda.empty_cache()
    combine_rows(args.reps)


def combine_rows(reps: int) -> None:
    """The combine (unpermute) forward+backward alone: the fused Triton gather vs torch's
    index_add path, bf16 rows, fp32 routing weights (graphopt.kernels.moe.combine)."""
    from graphopt.kernels.moe.combine import combine, combine_backward

    print("\n| tokens | top-k | hidden | index_add ms | fused Triton ms | speedup | max diff |")
    print("|---|---|---|---|---|---|---|")
    for t, k, h in ((4096, 2, 4096), (16384, 2, 4096), (8192, 8, 2048)):
        y = torch.randn(t * k, h, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(t, k, device="cuda").softmax(-1)
        order = torch.argsort(torch.randint(0, 64, (t * k,), device="cuda"), stable=True)
        go = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)

        def step(fused: bool) -> Callable[[], object]:
            return lambda: (combine(y, w, order, torch.bfloat16, torch.float32, fused),
                            combine_backward(go, y, w, order, torch.float32, fused))

        diff = max(float((a.float() - b.float()).abs().max())
                   for a, b in zip((step(True)()[0], *step(True)()[1]),
                                   (step(False)()[0], *step(False)()[1])))
        plain, fused = time_step(step(False), reps), time_step(step(True), reps)
        print(f"| {t} | {k} | {h} | {plain:.3f} | {fused:.3f} | {plain / fused:.2f}x | "
              f"{diff:.1e} |", flush=True)


def non_gemm_bound(ours_ms: float, grouped_ms: float, tb_per_s: float = 4.0) -> None:
    """Bytes of the op's passes other than the grouped GEMMs, forward+backward, bf16, at
    Mixtral size (4096 tokens x top-2 = 8192 rows, H 4096, F 14336), per pass as
    graphopt.kernels.moe runs them with torch's elementwise kernels; their time at
    ``tb_per_s`` TB/s; the GEMMs' TFLOP/s at the measured times; and the speedup over
    transformers' grouped_mm if the SwiGLU passes were fused (swiglu.py: 3 + 6 [n, F]
    units instead of 5 + 14) or if every non-GEMM pass were free."""
    t, k, h, f, item = 4096, 2, 4096, 14336, 2
    n = t * k
    nf, nh = n * f * item, n * h * item
    flops = 3 * 2 * n * h * f * 3  # gate, up, down GEMMs; forward, dgrad, wgrad
    passes = {"gather rows (forward, again in the backward)": 4 * nh,
              "SwiGLU forward (silu, product)": 5 * nf,
              "combine and its backward": 4 * nh,
              "SwiGLU backward (silu, silu*u, grad_a*u, silu_backward, grad_a*silu)": 14 * nf,
              "hidden gradient (a gather of each token's k rows)": nh + nh // k}
    for name, size in passes.items():
        print(f"{name}: {size / 1e9:.2f} GB")
    total = sum(passes.values())
    ms = total / (tb_per_s * 1e12) * 1e3
    print(f"non-GEMM total {total / 1e9:.2f} GB = {ms:.2f} ms at {tb_per_s} TB/s")
    for name, took in (("graphopt", ours_ms), ("transformers grouped_mm", grouped_ms)):
        print(f"{name} {took} ms: grouped GEMMs at {flops / took / 1e9:.0f} TFLOP/s")
    saved = (5 + 14 - 3 - 6) * nf
    saved_ms = saved / (tb_per_s * 1e12) * 1e3
    print(f"fused SwiGLU saves {saved / 1e9:.2f} GB = {saved_ms:.2f} ms: "
          f"{grouped_ms / (ours_ms - saved_ms):.2f}x of grouped_mm; every non-GEMM pass free: "
          f"{grouped_ms / (ours_ms - ms):.2f}x")


def profile_shape(t: int, e: int, h: int, f: int, steps: int = 5) -> None:
    """Per implementation: its CUDA kernels by total time over ``steps`` forward+backward
    steps (after 3 warm-ups), and the wall, CPU-side and GPU time per step."""
    import time

    from torch.profiler import ProfilerActivity, profile

    grouped = experts_module(e, h, f, "grouped_mm")
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w, i = torch.randn(t, e, device="cuda").softmax(-1).topk(2, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).requires_grad_()
    g = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    runs = {"transformers grouped_mm": lambda: grouped(x, i, w).backward(g),
            "graphopt": lambda: moe_experts(x, i, w, grouped.gate_up_proj,
                                            grouped.down_proj).backward(g)}
    for name, fn in runs.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            began = time.perf_counter()
            for _ in range(steps):
                fn()
            launched = time.perf_counter() - began
            torch.cuda.synchronize()
            wall = time.perf_counter() - began
        events = prof.key_averages()
        kernels = [ev for ev in events if ev.device_type == torch.autograd.DeviceType.CUDA]
        gpu_us = sum(ev.self_device_time_total for ev in kernels) / steps
        print(f"\n== {name}: tokens {t}, experts {e}, hidden {h}, ffn {f}: per step wall "
              f"{wall / steps * 1e3:.2f} ms, CPU until the last launch "
              f"{launched / steps * 1e3:.2f} ms, GPU kernels {gpu_us / 1e3:.2f} ms")
        print(events.table(sort_by="self_device_time_total", row_limit=15,
                           max_name_column_width=60))


def measure(t: int, e: int, h: int, f: int, reps: int) -> tuple[float, float, float]:
    """Median ms of forward+backward: transformers loop, transformers grouped_mm, graphopt."""
    loop, grouped = experts_module(e, h, f, "eager"), experts_module(e, h, f, "grouped_mm")
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w, i = torch.randn(t, e, device="cuda").softmax(-1).topk(2, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).requires_grad_()
    g = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    a = time_step(lambda: loop(x, i, w).backward(g), reps)
    try:
        b = time_step(lambda: grouped(x, i, w).backward(g), reps)
    except Exception as exc:  # an older transformers without grouped_mm experts
        print(f"transformers grouped_mm failed: {type(exc).__name__}: {exc}")
        b = float("nan")
    c = time_step(lambda: moe_experts(x, i, w, loop.gate_up_proj, loop.down_proj).backward(g),
                  reps)
    return a, b, c


if __name__ == "__main__":
    main()
