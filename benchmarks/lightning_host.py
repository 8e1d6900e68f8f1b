"""Host (CPU-side) time of one Lightning Attention forward+backward, graphopt's Triton path
next to flash-linear-attention's ``chunk_simple_gla``, with every kernel body skipped: what a
GPU step costs the CPU before any kernel runs (Python wrappers, custom-op and autograd
dispatch, allocations, grid and argument set-up), and how many kernels each launches.

    python benchmarks/lightning_host.py [--reps 200] [--packed]

Why it matters (issue 16: faster than SDPA flash from S=4k at B=1, H=8): such a step's GPU
time is ~0.1-0.3 ms, so a step whose CPU side takes longer than its kernels is bound by the
host, and SDPA's flash forward and backward are one C++ launch each.

What is measured: both run on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``)
with the interpreter's launch replaced by a counter (no kernel body runs); fla's
autotuner times nothing (its choice does not change the host path) and is warm before timing.
graphopt is timed with fixed tiles (the interpreter's launches), through its autotuned
launches (``TUNE``: triton.autotune wrappers around every tuned kernel, as on a GPU), and
autotuned with the sequential state passes (``STATE_PASS``: one launch per state pass
instead of an outer-product launch and a scan; on a GPU "auto" times both per shape).
Per call: median of ``--reps`` wall-clock times of ``o = attn(q, k, v)`` under no_grad
(fwd) and of ``o = attn(q, k, v); autograd.grad(o, (q, k, v), dO)`` (fwd+bwd) after
warm-ups; B=1, H=8, S=256, D=64, bf16, fixed slope (MiniMax's); ``--packed``: the same 256
tokens as two packed sequences of 100 and 156 (cu_seqlens), graphopt and fla.
Launches are printed as "Triton + torch": the Triton kernels launched, then the other ops
that would each launch a kernel on a GPU (fills, copies, casts: ``torch_kernels``, from the
profiler).
Not included: Triton's own launcher on a GPU (its argument binding and the driver call, per
launch, the same for both sides: the launch counts are printed so it can be added). fla-core
0.6.0 is loaded as in lightning_memory.py (``PYTHONPATH=<unpacked wheel>``); without it the
graphopt row is printed alone.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import argparse  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median_time  # noqa: E402

LAUNCHES: list[str] = []


def _skip_kernel_bodies() -> None:
    """An interpreted launch counts itself and returns (module docstring): the interpreter's
    own per-launch set-up (it re-reads the kernel's annotations) is skipped too."""
    from triton.runtime import interpreter

    def counted(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        if not warmup:
            LAUNCHES.append(self.fn.__name__)
        if self.fn.__name__ == "_chunk_table":
            args[4].numpy()[:] = 1  # its cu_seqlens check passes (no aten op: not counted)

    interpreter.InterpretedFunction.run = counted


# aten ops that only allocate or make views: no kernel on a GPU (``to`` without
# ``_to_copy`` below it returns its input)
NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "view",
             "as_strided", "detach", "alias", "transpose", "t", "permute", "expand", "reshape",
             "_reshape_alias", "_unsafe_view", "unsqueeze", "squeeze", "select", "slice",
             "narrow", "split", "chunk", "unflatten", "flatten", "resolve_conj",
             "resolve_neg", "lift_fresh", "result_type", "to", "contiguous", "size", "stride",
             "unbind"}


def torch_kernels(fn: Callable[[], object]) -> list[str]:
    """The aten ops one call of ``fn`` runs that would each launch a kernel on a GPU: the
    outermost ops the profiler records that do more than allocate, view or return their
    input (``zeros`` once, not also its ``fill_``): fills, copies, casts, arithmetic outside
    Triton."""
    from torch.profiler import profile

    def counted(e: Any) -> bool:
        return e.name.startswith("aten::") and e.name[6:] not in NO_KERNEL

    def outermost(e: Any) -> bool:
        parent = e.cpu_parent
        while parent is not None:
            if counted(parent):
                return False
            parent = parent.cpu_parent
        return True

    with profile() as prof:
        fn()
    return [e.name[6:] for e in prof.events() if counted(e) and outermost(e)]


def host_time(fn: Callable[[], object], reps: int) -> tuple[float, list[str], list[str]]:
    """(median seconds per call after warm-ups, Triton kernels launched by one call, other
    kernels it would launch on a GPU: :func:`torch_kernels`)."""
    for _ in range(4):
        fn()
    sec = median_time(fn, reps)
    LAUNCHES.clear()
    fn()
    return sec, list(LAUNCHES), torch_kernels(fn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--packed", action="store_true",
                        help="packed sequences (cu_seqlens [0, 100, 256]) instead")
    args = parser.parse_args()
    from lightning_memory import load_fla

    import graphopt.kernels.lightning.triton_kernels as tk
    from graphopt.kernels.lightning import lightning_attention

    tk.LOWP_DTYPES = (torch.bfloat16,)  # the GPU's bf16 path
    _skip_kernel_bodies()
    fla = load_fla()
    b, h, s, d = 1, 8, 256, 64
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(b, h, s, d, generator=gen).to(torch.bfloat16)
                   for _ in range(4))
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    slope = torch.full((h,), 0.1)

    cu = torch.tensor([0, 100, s], dtype=torch.int32)  # --packed: two sequences

    def ours(train: bool, tuned: bool, state_pass: str = "parallel",
             packed: bool = False) -> Callable[[], object]:
        kw = {"cu_seqlens": cu} if packed else {}

        def run() -> object:
            # tuned: the GPU's launch path, triton.autotune wrappers (warm: the chosen configs
            # are cached after the first call; the host timer below picks one)
            tk.TUNE, tk.BENCHMARKER = tuned, (lambda fn, quantiles=None: [1.0, 1.0, 1.0]
                                              if tuned else None)
            tk.STATE_PASS = state_pass
            try:
                with torch.set_grad_enabled(train):
                    o = lightning_attention(*x, slope, impl="triton", **kw)
                    return torch.autograd.grad(o, x, do) if train else o
            finally:
                tk.TUNE, tk.BENCHMARKER, tk.STATE_PASS = False, None, "auto"
        return run

    rows = [("graphopt (impl='triton'), fixed tiles", ours(False, False), ours(True, False)),
            ("graphopt (impl='triton'), autotuned launches (the GPU's path)", ours(False, True),
             ours(True, True)),
            ("graphopt, autotuned, sequential state passes (STATE_PASS)",
             ours(False, True, "sequential"), ours(True, True, "sequential"))]
    if args.packed:
        rows = [("graphopt, autotuned, packed (cu_seqlens)", ours(False, True, packed=True),
                 ours(True, True, packed=True))]
    if fla is None:
        print("flash-linear-attention not installed: graphopt rows only", file=sys.stderr)
    else:
        xf = [t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
        dof = do.transpose(1, 2).contiguous()
        gamma = -slope  # fla's log decay, made once (not a kernel of each call)

        # fla takes cu_seqlens as int64 (its own prepare_* helpers' dtype)
        fla_kw = {"cu_seqlens": cu.long()} if args.packed else {}

        def theirs(train: bool) -> Callable[[], object]:
            def run() -> object:
                with torch.set_grad_enabled(train):
                    o = fla(*xf, g_gamma=gamma, scale=1.0, **fla_kw)[0]
                    return torch.autograd.grad(o, xf, dof) if train else o
            return run
        rows.append(("fla chunk_simple_gla" + (", packed" if args.packed else ""),
                     theirs(False), theirs(True)))
    print(f"B={b} H={h} S={s} D={d} bf16, fixed slope; host time with kernel bodies skipped, "
          f"median of {args.reps}; forward under no_grad (as lightning_gpu.py's fwd rows)\n")
    print("| implementation | fwd us | fwd launches | fwd+bwd us | fwd+bwd launches | "
          "Triton kernels (fwd+bwd) | torch kernels (fwd+bwd) |")
    print("|---|---|---|---|---|---|---|")
    for name, fwd, both in rows:
        t_fwd, n_fwd, o_fwd = host_time(fwd, args.reps)
        t_both, launched, others = host_time(both, args.reps)
        print(f"| {name} | {t_fwd * 1e6:.0f} | {len(n_fwd)} + {len(o_fwd)} | "
              f"{t_both * 1e6:.0f} | {len(launched)} + {len(others)} | {', '.join(launched)} "
              f"| {', '.join(others) or '-'} |", flush=True)

if __name__ == "__main__":
    main()
