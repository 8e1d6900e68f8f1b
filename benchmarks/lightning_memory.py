"""Lightning Attention's peak memory of one forward+backward, graphopt's Triton kernels next to
flash-linear-attention's ``chunk_simple_gla`` (the issue-16 target: <= 0.67x fla's peak), both
run on the CPU by Triton's interpreter, side by side in one run.

    python benchmarks/lightning_memory.py [--seq 1024] [--accuracy]

``--accuracy`` (instead of the table): what storing the chunk states in the input dtype costs
in accuracy, side by side with float32 storage in one run: fp16 products (the low-precision
path, which the interpreter's tl.dot reads correctly, unlike bf16), B=2, H=2, S=700, D=32,
an initial state, slope 0.02 and 0.3, trained; max error of o, the final state and all five
gradients relative to the largest entry of the float64 chunked result.

What is measured: the CPU allocator's bytes allocated above the inputs (q, k, v, dO made
before), its high-water mark over ``o = attn(q, k, v); autograd.grad(o, (q, k, v), dO)``,
read from torch.profiler's allocation events (``profile_memory``), after one warm-up call;
in units of one q tensor (B * S * H * D bf16 elements). Every buffer either implementation
allocates is a torch tensor made on the host side of its kernels, so the CPU allocator sees
the same allocations a GPU's caching allocator would (what ``torch.cuda.max_memory_allocated``
counts in ``lightning_gpu.py``). B = 1, H = 2, bf16, D = Dv in {64, 128}; graphopt at
block_size 64 / 128 / 256 with a fixed slope (MiniMax's), at 64 with a trained slope
(dslope: its dK launch reads the chunk states, which then live until the end), and at 64 with
q, k, v as the strided views of one fused [B, S, H, 3D] projection (MiniMax's attention:
an implementation that needs contiguous [B, H, S, D] inputs copies them, and dO, first).

Two interpreter details are handled here, neither of which changes what is allocated: a
garbage collection after each interpreted launch (the interpreter's launch leaves a reference
cycle holding its arguments until the next launch; a GPU launch holds none), and the GPU's
bf16 storage path (``LOWP_DTYPES``) is switched on: numerics are not checked here (the
interpreter's tl.dot misreads bf16 operands; tests/test_lightning_triton.py and
lightning_gpu.py check them). fla 0.6.0 (``pip install fla-core==0.6.0 einops``) needs two
changes to run interpreted: its autotuner times nothing (the config does not change its
allocations) and ``chunk_h``'s two state kernels are re-made from their source with the loop
index ``i_t.to(tl.int64)`` (a Python int under the interpreter) written as
``tl.full([], i_t, tl.int64)``. Without fla the graphopt rows are printed alone.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import argparse  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import linecache  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch._C._profiler import _EventType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def _interpreter_collects() -> None:
    """gc.collect() after every interpreted kernel launch (see the module docstring)."""
    from triton.runtime import interpreter

    call = interpreter.GridExecutor.__call__

    def collected(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return call(self, *args, **kwargs)
        finally:
            gc.collect()

    interpreter.GridExecutor.__call__ = collected


def load_fla() -> Callable[..., Any] | None:
    """fla's chunk_simple_gla made runnable by the interpreter (module docstring), or None."""
    if importlib.util.find_spec("fla") is None:
        return None
    from triton.runtime import autotuner

    autotuner.Autotuner._bench = lambda self, *args, config, **kwargs: [1.0, 1.0, 1.0]
    import fla.ops.common.chunk_h as chunk_h
    from fla.ops.simple_gla import chunk_simple_gla

    path = Path(chunk_h.__file__)
    source = path.read_text()
    fixed = source.replace("i_t.to(tl.int64)", "tl.full([], i_t, tl.int64)")
    if fixed != source:
        # the interpreter reads a kernel's source through inspect (linecache): the fixed
        # text goes there under a name of its own
        name = f"<{path} for the interpreter>"
        linecache.cache[name] = (len(fixed), None, fixed.splitlines(True), name)
        namespace = {"__name__": chunk_h.__name__, "__file__": name}
        exec(compile(fixed, name, "exec"), namespace)  # noqa: S102
        for name in ("chunk_fwd_kernel_h", "chunk_bwd_kernel_dh"):
            setattr(chunk_h, name, namespace[name])  # chunk_fwd_h / chunk_bwd_dh read these
    return chunk_simple_gla


def _walk(nodes: list[Any]) -> Any:
    for node in nodes:
        yield node
        yield from _walk(node.children)


def peak_bytes(fn: Callable[[], object]) -> int:
    """High-water mark of the CPU allocator's bytes above where ``fn`` started (one warm-up
    call first)."""
    fn()
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [n for n in _walk(prof.profiler.kineto_results.experimental_event_tree())
              if n.tag == _EventType.Allocation]
    live = top = 0
    for event in sorted(events, key=lambda n: n.start_time_ns):
        live += event.extra_fields.alloc_size
        top = max(top, live)
    return top


def accuracy() -> None:
    """The ``--accuracy`` comparison (module docstring)."""
    import graphopt.kernels.lightning.triton_kernels as tk
    from graphopt.kernels.lightning import lightning_attention

    tk.LOWP_DTYPES = (torch.float16,)
    stored_in_input_dtype = tk._state_dtype
    gen = torch.Generator().manual_seed(0)
    b, h, s, d = 2, 2, 700, 32
    names = "o state dq dk dv dslope dh0".split()
    print("| slope | state storage | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for slope_value in (0.02, 0.3):
        q, k, v, go = (torch.randn(b, h, s, d, generator=gen, dtype=torch.float64) * 0.5
                       for _ in range(4))
        h0, gs = (torch.randn(b, h, d, d, generator=gen, dtype=torch.float64)
                  for _ in range(2))
        slope = torch.full((h,), slope_value, dtype=torch.float64)

        def run(dtype: torch.dtype, impl: str) -> list[torch.Tensor]:
            xs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
            sl, init = slope.clone().requires_grad_(), h0.clone().requires_grad_()
            o, st = lightning_attention(*xs, sl, initial_state=init, output_final_state=True,
                                        impl=impl)
            loss = (o.double() * go).sum() + (st.double() * gs).sum()
            return [o.detach(), st.detach(), *torch.autograd.grad(loss, (*xs, sl, init))]

        ref = run(torch.float64, "chunked")
        for label, rule in (("input dtype (fp16)", stored_in_input_dtype),
                            ("float32", lambda dtype: torch.float32)):
            tk._state_dtype = rule
            errs = [float((a.double() - r).abs().max() / r.abs().max())
                    for a, r in zip(run(torch.float16, "triton"), ref)]
            print(f"| {slope_value} | {label} | " + " | ".join(f"{e:.1e}" for e in errs)
                  + " |", flush=True)
        tk._state_dtype = stored_in_input_dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--accuracy", action="store_true",
                        help="state storage accuracy instead of the memory table")
    args = parser.parse_args()
    _interpreter_collects()
    if args.accuracy:
        accuracy()
        return
    import graphopt.kernels.lightning.triton_kernels as tk
    from graphopt.kernels.lightning import lightning_attention

    tk.LOWP_DTYPES = (torch.bfloat16,)  # the GPU's bf16 path (state storage in bf16)
    fla = load_fla()
    if fla is None:
        print("flash-linear-attention not installed: graphopt rows only", file=sys.stderr)
    b, h, s = 1, 2, args.seq
    print(f"B={b} H={h} S={s} bf16, peak above the inputs in units of one q tensor "
          f"(graphopt/fla in brackets)\n")
    print("| D | fla | graphopt 64 | graphopt 128 | graphopt 256 | graphopt 64, trained slope "
          "| graphopt 64, fused-QKV views |")
    print("|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for d in (64, 128):
        q, k, v, do = (torch.randn(b, h, s, d, generator=gen).to(torch.bfloat16)
                       for _ in range(4))
        unit = q.numel() * q.element_size()

        fused = torch.cat([t.transpose(1, 2) for t in (q, k, v)], -1).requires_grad_()

        def ours(block: int, train: bool, views: bool = False) -> Callable[[], object]:
            x = [t.clone().requires_grad_() for t in (q, k, v)]
            slope = torch.full((h,), 0.1, requires_grad=train)

            def run() -> object:
                ins = [fused[..., j * d:(j + 1) * d].transpose(1, 2) for j in range(3)] \
                    if views else x
                o = lightning_attention(*ins, slope, impl="triton", block_size=block)
                return torch.autograd.grad(o, ins, do)  # the views' gradients: the op's
            return run

        cells = []
        theirs = None
        if fla is not None:
            xf = [t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
            dof = do.transpose(1, 2).contiguous()
            slope = torch.full((h,), 0.1)

            def fla_run() -> object:
                o = fla(*xf, g_gamma=-slope, scale=1.0)[0]
                return torch.autograd.grad(o, xf, dof)
            theirs = peak_bytes(fla_run)
        cells.append(f"{theirs / unit:.2f}" if theirs else "-")
        for block, train, views in ((64, False, False), (128, False, False),
                                    (256, False, False), (64, True, False),
                                    (64, False, True)):
            got = peak_bytes(ours(block, train, views))
            ratio = f" ({got / theirs:.2f}x)" if theirs else ""
            cells.append(f"{got / unit:.2f}{ratio}")
        print(f"| {d} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
