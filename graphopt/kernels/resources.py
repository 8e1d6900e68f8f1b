"""What a Triton kernel needs on a GPU, found without one: compile it ahead of time for a
target (``triton.compile`` to a cubin for NVIDIA sm_90 = H100/H200) and read the cubin's
resource usage (registers per thread, stack bytes per thread = register spills, shared
memory) with the ``cuobjdump`` that ships in triton's NVIDIA backend.

Used by ``benchmarks/kernel_resources.py`` (every kernel x autotune config x head dim) and
by tests (the configs the kernels launch compile, fit shared memory and do not spill), so a
kernel that only the interpreter accepts, or one that spills its tiles to local memory,
shows up before a GPU session.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any

H100_SHARED_BYTES = 227 * 1024
"""Shared memory a block may use on sm_90 (H100/H200: 228 KB per SM, 227 KB per block)."""

MAX_REGISTERS = 255
"""Registers per thread the sm_90 ISA allows; more live values spill to the stack."""


@dataclass(frozen=True)
class Resources:
    """One compiled kernel: registers per thread, stack bytes per thread (spilled registers
    and local arrays; 0 for a kernel that keeps its tiles in registers), shared memory bytes
    per block (dynamic, as triton launches it, + static)."""

    registers: int
    stack: int
    shared: int

    def fits(self) -> bool:
        """Within one sm_90 block's shared memory and without spills."""
        return self.stack == 0 and self.shared <= H100_SHARED_BYTES


def _cuobjdump() -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    if not os.path.exists(path):
        raise RuntimeError(f"no cuobjdump at {path}: this triton build lacks the NVIDIA "
                           "backend's tools; install the triton wheel from PyPI")
    return path


def compile_for_gpu(kernel: Any, types: dict[str, str], constexprs: dict[str, Any],
                    num_warps: int = 4, num_stages: int = 1, arch: int = 90) -> Resources:
    """Compile ``kernel`` (a ``triton.jit`` function) for NVIDIA sm_``arch`` without a GPU.

    Args:
        kernel: the jit function (``triton.autotune`` wrappers: pass ``.fn``).
        types: argument name -> triton signature type ("*bf16", "*fp32", "*i32", "i32",
            "fp32", ...); every non-constexpr argument must be named.
        constexprs: argument name -> value for the ``tl.constexpr`` arguments.
        num_warps, num_stages: launch options, as a ``triton.Config`` gives them.
        arch: compute capability x 10 (90: H100/H200).

    Returns:
        the cubin's :class:`Resources`.

    Raises:
        KeyError: a runtime argument without a type, or a constexpr without a value.
        triton.CompilationError (and subclasses): the kernel does not compile for the
            target (the interpreter accepts more than the compiler does).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    missing = [p.name for p in kernel.params if p.is_constexpr and p.name not in constexprs]
    if missing:
        raise KeyError(f"{kernel.fn.__name__}: no value for the constexprs {missing}")
    sig = {name: "constexpr" if name in constexprs else types[name]
           for name in kernel.arg_names}
    src = ASTSource(kernel, sig, constexprs={(kernel.arg_names.index(n),): v
                                             for n, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", out)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage: {out[-500:]}")
    regs, stack, static = (int(x) for x in found.groups())
    return Resources(regs, stack, static + int(compiled.metadata.shared))


def argument_types(kernel: Any, explicit: dict[str, str], default_pointer: str,
                   floats: tuple[str, ...] = ()) -> dict[str, str]:
    """Signature types by graphopt's kernel naming: ``explicit`` names win (e.g.
    {"SLOPE": "*fp32", "H": "i32"}); other UPPER-CASE runtime arguments are pointers to
    ``default_pointer``, arguments in ``floats`` fp32 scalars, other lower-case ones int32
    scalars. ``tl.constexpr`` parameters are left to :func:`compile_for_gpu`."""
    out = {}
    for param in kernel.params:
        if param.is_constexpr:
            continue
        name = param.name
        if name in explicit:
            out[name] = explicit[name]
        elif name.isupper():
            out[name] = default_pointer
        else:
            out[name] = "fp32" if name in floats else "i32"
    return out
