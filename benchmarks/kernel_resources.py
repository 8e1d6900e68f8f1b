"""What graphopt's Triton kernels need on an H100/H200, measured without a GPU: every launch of
a Lightning Attention forward + backward (and the MoE combine kernels) compiled ahead of time
for sm_90 in every autotune candidate config, with the cubin's registers per thread, stack
bytes per thread (register spills) and shared memory per block.

    python benchmarks/kernel_resources.py [--quick]

Prints one markdown table per (head dim, chunk) and, per launch, how many of its candidate
configs fit (no spills, shared memory <= 227 KB): the autotuner on the GPU then times those.
--quick: D = 128 at block_size 64 only. ~4 minutes on 2 cores (each compile ~0.5-3 s).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not the interpreter

from graphopt.kernels.lightning import triton_kernels as tk  # noqa: E402
from graphopt.kernels.moe import combine as moe_combine  # noqa: E402
from graphopt.kernels.resources import compile_for_gpu  # noqa: E402


def lightning(d: int, block: int) -> None:
    print(f"\n### Lightning Attention, bf16, D = Dv = {d}, block_size {block}\n")
    print("| launch | config (BK/BV, warps, stages) | registers | stack (spills) B | "
          "shared KB |")
    print("|---|---|---|---|---|")
    summary = []
    for spec in tk.launch_specs(d, d, block):
        fits = 0
        configs = tk.launch_configs(spec)
        for consts, warps, stages in configs:
            res = compile_for_gpu(spec.kernel, spec.types, consts, warps, stages)
            fits += res.fits()
            print(f"| {spec.name} | {consts['BK']}/{consts['BV']}, {warps}, {stages} | "
                  f"{res.registers} | {res.stack} | {res.shared / 1024:.1f} |", flush=True)
        summary.append(f"{spec.name} {fits}/{len(configs)}")
    print(f"\nconfigs that fit (no spills, shared <= 227 KB): {', '.join(summary)}")


def combine() -> None:
    print("\n### MoE combine (bf16 rows, fp32 weights)\n")
    print("| kernel | BLOCK | registers | stack B | shared KB |")
    print("|---|---|---|---|---|")
    for kernel, types, consts in moe_combine.launch_specs():
        res = compile_for_gpu(kernel, types, consts, num_warps=4)
        print(f"| {kernel.fn.__name__} | {consts['BLOCK']} | {res.registers} | {res.stack} | "
              f"{res.shared / 1024:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="D = 128, block_size 64 only")
    args = parser.parse_args()
    start = time.perf_counter()
    grid = [(128, 64)] if args.quick else [(64, 64), (128, 64), (256, 64), (128, 256)]
    for d, block in grid:
        lightning(d, block)
    combine()
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
