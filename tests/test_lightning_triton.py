"""The chunk-parallel Triton Lightning Attention kernels, run on CPU by Triton's interpreter
(TRITON_INTERPRET=1, set before triton is imported), against the quadratic reference."""

import os
import subprocess
import sys

import pytest

from tests.helpers import run_interpreted

pytest.importorskip("triton")

SCRIPT = r"""
import torch
from graphopt.kernels.lightning import lightning_attention, lightning_attention_reference

def run(b, hq, hk, s, d, dv, block, init, seed, train_slope=True):
    # train_slope False: the kernels' variant without the dslope terms (dK reads no chunk
    # states; the backward frees them before dK and dV are allocated)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, s, d, generator=gen).requires_grad_()
    k = torch.randn(b, hk, s, d, generator=gen).requires_grad_()
    v = torch.randn(b, hk, s, dv, generator=gen).requires_grad_()
    slope = (torch.rand(hq, generator=gen) * 0.5).requires_grad_(train_slope)
    h0 = torch.randn(b, hq, d, dv, generator=gen).requires_grad_() if init else None
    o, st = lightning_attention(q, k, v, slope, scale=0.5, initial_state=h0,
                                output_final_state=True, block_size=block, impl="triton",
                                checkpoint_every=2)
    ins = [q, k, v, slope] + ([h0] if init else [])
    ref_in = [x.detach().double().requires_grad_(x.requires_grad) for x in ins]
    o_r, st_r = lightning_attention_reference(*ref_in[:4], 0.5, ref_in[4] if init else None)
    compare(o, st, o_r, st_r, ins, ref_in, gen, "")


def compare(o, st, o_r, st_r, ins, ref_in, gen, label):
    names = [n for n, x in zip("q k v slope h0".split(), ins) if x.requires_grad]
    ins, ref_in = [x for x in ins if x.requires_grad], [x for x in ref_in if x.requires_grad]
    # outputs, final states and every input gradient (random output gradients) vs the
    # float64 reference, gradients relative to their largest entry
    torch.testing.assert_close(o.double(), o_r, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(st.double(), st_r, rtol=1e-4, atol=1e-4)
    go, gs = torch.randn(o.shape, generator=gen), torch.randn(st.shape, generator=gen)
    got = torch.autograd.grad((o * go).sum() + (st * gs).sum(), ins)
    want = torch.autograd.grad((o_r * go.double()).sum() + (st_r * gs.double()).sum(), ref_in)
    for name, g, w in zip(names, got, want):
        m = max(1.0, float(w.abs().max()))
        torch.testing.assert_close(g.double() / m, w / m, rtol=1e-4, atol=1e-4,
                                   msg=lambda x, name=name: f"{label}d{name}: {x}")

run(1, 2, 1, 37, 16, 16, 16, True, 0)      # GQA, S not a multiple of the block, state in
run(2, 2, 2, 20, 8, 12, 16, False, 1)      # D != Dv (padded tiles), B > 1
run(1, 2, 2, 64, 16, 16, 32, True, 2)      # S a multiple of the block
run(1, 1, 1, 5, 16, 16, 16, True, 3)       # shorter than one block
run(1, 2, 1, 70, 80, 72, 16, True, 4)      # D, Dv over one 64-wide tile: 2 x 2 tiles, 5 chunks
run(2, 4, 2, 20, 16, 16, 16, False, 6)     # GQA groups of 2 read in the kernels (h // 2)
run(2, 4, 2, 37, 16, 16, 16, True, 11, train_slope=False)  # fixed slopes (no dslope terms)

# Strided inputs read in place (no copy): q from a [B, S, H, D] tensor (layout "bshd"),
# k and v as the two views of one fused [B, S, Hk, D + Dv] projection, dO transposed; outputs
# and gradients (into the underlying tensors) equal the reference's, also packed (varlen)
# and through the public layout="bshd".
def strided(block, seed, cu=None):
    gen = torch.Generator().manual_seed(seed)
    b, s, hq, hk, d, dv = (1, 61, 4, 2, 16, 8) if cu is not None else (2, 45, 4, 2, 16, 8)
    qb = torch.randn(b, s, hq, d, generator=gen).requires_grad_()
    kvb = torch.randn(b, s, hk, d + dv, generator=gen).requires_grad_()
    slope = (torch.rand(hq, generator=gen) * 0.5).requires_grad_()
    go = torch.randn(b, s, hq, dv, generator=gen).transpose(1, 2)
    q, k, v = qb.transpose(1, 2), kvb[..., :d].transpose(1, 2), kvb[..., d:].transpose(1, 2)
    for x in (q, k, v, go):
        assert not x.is_contiguous() and tk._kernel_input(x, block) is x
    o = lightning_attention(q, k, v, slope, scale=0.5, block_size=block, impl="triton",
                            cu_seqlens=cu)
    got = torch.autograd.grad((o * go).sum(), (qb, kvb, slope))
    refs = [x.detach().double().requires_grad_() for x in (qb, kvb, slope)]
    rq, rk, rv = (refs[0].transpose(1, 2), refs[1][..., :d].transpose(1, 2),
                  refs[1][..., d:].transpose(1, 2))
    if cu is None:
        o_r, _ = lightning_attention_reference(rq, rk, rv, refs[2], 0.5)
    else:
        bounds = list(zip(cu.tolist(), cu.tolist()[1:]))
        o_r = torch.cat([lightning_attention_reference(rq[:, :, a:e], rk[:, :, a:e],
                                                       rv[:, :, a:e], refs[2], 0.5)[0]
                         for a, e in bounds], 2)
    want = torch.autograd.grad((o_r * go.double()).sum(), refs)
    torch.testing.assert_close(o.double(), o_r, rtol=1e-4, atol=1e-4)
    for name, g, w in zip(("q", "kv", "slope"), got, want):
        m = max(1.0, float(w.abs().max()))
        torch.testing.assert_close(g.double() / m, w / m, rtol=1e-4, atol=1e-4,
                                   msg=lambda x, name=name: f"strided d{name}: {x}")
    o_bshd = lightning_attention(qb, kvb[..., :d], kvb[..., d:], slope, scale=0.5,
                                 block_size=block, impl="triton", layout="bshd",
                                 cu_seqlens=cu)
    torch.testing.assert_close(o_bshd, o.transpose(1, 2), rtol=0, atol=0)


import graphopt.kernels.lightning.triton_kernels as tk
# a row stride whose in-chunk offsets would pass int32 (the kernels' in-tile arithmetic) is
# copied, one just inside is read in place (meta tensors: no 4 GB storage needed)
for stride, block, copied in ((2**31 // 63 + 1, 64, True), (2**31 // 63 - 16, 64, False),
                              (2**31 // 1023 + 1, 1024, True), (2**31 // 1023 + 1, 64, False)):
    x = torch.empty_strided((1, 2, 4096, 16), (0, 16, stride, 1), device="meta")
    assert (tk._kernel_input(x, block) is not x) == copied, (stride, block)
    assert tk._kernel_input(x, block).stride(2) == (16 if copied else stride)
strided(16, 13)
strided(16, 14, cu=torch.tensor([0, 7, 25, 61]))

# Gradients of some inputs only: the dQ or the dK/dV launches are skipped (need_q /
# need_kv), the gradients asked for equal the reference's.
def subset(needs):
    gen = torch.Generator().manual_seed(7)
    named = dict(q=torch.randn(1, 2, 40, 16, generator=gen),
                 k=torch.randn(1, 1, 40, 16, generator=gen),
                 v=torch.randn(1, 1, 40, 16, generator=gen),
                 slope=torch.rand(2, generator=gen) * 0.5,
                 h0=torch.randn(1, 2, 16, 16, generator=gen))
    for n, x in named.items():
        x.requires_grad_(n in needs)
    o, st = lightning_attention(named["q"], named["k"], named["v"], named["slope"],
                                scale=0.5, initial_state=named["h0"], output_final_state=True,
                                impl="triton", block_size=16)
    refs = {n: x.detach().double().requires_grad_(n in needs) for n, x in named.items()}
    o_r, st_r = lightning_attention_reference(refs["q"], refs["k"], refs["v"], refs["slope"],
                                              0.5, refs["h0"])
    go, gs = torch.randn(o.shape, generator=gen), torch.randn(st.shape, generator=gen)
    got = torch.autograd.grad((o * go).sum() + (st * gs).sum(), [named[n] for n in needs])
    want = torch.autograd.grad((o_r * go.double()).sum() + (st_r * gs.double()).sum(),
                               [refs[n] for n in needs])
    for n, g, w in zip(needs, got, want):
        m = max(1.0, float(w.abs().max()))
        torch.testing.assert_close(g.double() / m, w / m, rtol=1e-4, atol=1e-4,
                                   msg=lambda x, n=n: f"subset {needs}: d{n}: {x}")

for needs in (("q",), ("k", "v"), ("h0",), ("q", "slope")):
    subset(needs)

# Packed variable-length sequences in one launch per kernel (GQA, one initial state per
# sequence, a sequence shorter than a chunk, one of several chunks with a tail): outputs,
# final states and every gradient equal separate reference calls.
def varlen(block):
    gen = torch.Generator().manual_seed(5)
    cu = torch.tensor([0, 7, 25, 61])
    q = torch.randn(1, 2, 61, 16, generator=gen).requires_grad_()
    k, v = (torch.randn(1, 1, 61, 16, generator=gen).requires_grad_() for _ in range(2))
    slope = (torch.rand(2, generator=gen) * 0.5).requires_grad_()
    h0 = torch.randn(3, 2, 16, 16, generator=gen).requires_grad_()
    o, st = lightning_attention(q, k, v, slope, cu_seqlens=cu, initial_state=h0,
                                output_final_state=True, impl="triton", block_size=block)
    ins = [q, k, v, slope, h0]
    ref_in = [x.detach().double().requires_grad_() for x in ins]
    o_r, st_r = [], []
    for i, (a, b) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        o_i, s_i = lightning_attention_reference(*(x[:, :, a:b] for x in ref_in[:3]),
                                                 ref_in[3], 1.0, ref_in[4][i:i + 1])
        o_r.append(o_i)
        st_r.append(s_i)
    compare(o, st, torch.cat(o_r, 2), torch.cat(st_r, 0), ins, ref_in, gen,
            f"varlen block {block} ")


varlen(16)
# Chunks of several tiles (tiles of 16 rows here, 64 on a GPU): states once per chunk, the
# chunk's quadratic part tile by tile (the tiles before a query's tile, the tiles after a
# key's), the chunk's tail in its last tile, unused tiles of a short chunk or sequence.
import graphopt.kernels.lightning.triton_kernels as tk
tk.MAX_TILE = 16
run(1, 2, 1, 70, 16, 16, 64, True, 7)     # 4 tiles per chunk, a 6-row second chunk
run(2, 2, 2, 45, 8, 12, 32, False, 8)     # 2 tiles per chunk, D != Dv, B > 1
run(1, 2, 1, 70, 80, 72, 32, True, 9)     # multi-tile head dims and chunks of 2 tiles
run(1, 2, 1, 70, 16, 16, 64, True, 12, train_slope=False)
varlen(32)
gen = torch.Generator().manual_seed(10)
# bf16 / fp16 inputs (chunks of 2 tiles): fp32 accumulation, outputs and gradients in the
# input dtype, within the dtype's rounding of the float64 reference (errors relative to the
# largest entry). The interpreter's tl.dot misreads bf16 operands, so the low-precision
# product path (a GPU's bf16 path: states and masked scores rounded to the input dtype) runs
# here with fp16 (LOWP_DTYPES); bf16 runs fp32 products, checking its loads, stores, casts.
tk.LOWP_DTYPES = (torch.float16,)
# fp16 (LOWP here) also stores the chunk states in fp16 (_state_dtype), with and without
# the dslope terms.
for dtype, tol, train_slope in ((torch.bfloat16, 1e-2, True), (torch.float16, 2e-3, True),
                                (torch.float16, 2e-3, False)):
    q, k, v = (torch.randn(1, 2, 40, 16, generator=gen).to(dtype).requires_grad_()
               for _ in range(3))
    slope = (torch.rand(2, generator=gen) * 0.5).requires_grad_(train_slope)
    o = lightning_attention(q, k, v, slope, impl="triton", block_size=32, scale=0.25)
    ins = (q, k, v, slope) if train_slope else (q, k, v)
    ref_in = [x.detach().double().requires_grad_() for x in ins]
    o_r, _ = lightning_attention_reference(*ref_in[:3], ref_in[3] if train_slope
                                           else slope.double(), 0.25)
    go = torch.randn(o.shape, generator=gen).to(dtype)
    got = torch.autograd.grad((o * go).sum(), ins)
    want = torch.autograd.grad((o_r * go.double()).sum(), ref_in)
    for name, g, w in zip(("o", "dq", "dk", "dv", "dslope"), (o,) + got, (o_r,) + want):
        assert g.dtype == (torch.float32 if name == "dslope" else dtype), (name, g.dtype)
        err = float((g.detach().double() - w.detach()).abs().max() / w.detach().abs().max())
        assert err < tol, (dtype, name, err)
tk.MAX_TILE = 64
tk.LOWP_DTYPES = ()
# fp16 inputs whose carried-in state exceeds fp16's range (the output fits): fp16 takes fp32
# products, so nothing overflows (rounding the state to fp16 gave inf / NaN everywhere)
q, k, v = (torch.randn(1, 2, 32, 16, generator=gen).half() for _ in range(3))
q.requires_grad_()
h0 = torch.randn(1, 2, 16, 16, generator=gen) * 1e5
o = lightning_attention(q, k, v, torch.zeros(2), scale=0.01, initial_state=h0, impl="triton")
o_r, _ = lightning_attention_reference(q.detach().double(), k.double(), v.double(),
                                       torch.zeros(2, dtype=torch.float64), 0.01, h0.double())
assert o.isfinite().all() and o_r.abs().max() < 65504
assert float((o.double() - o_r).abs().max() / o_r.abs().max()) < 2e-3
(dq,) = torch.autograd.grad(o.float().sum(), q)
assert dq.isfinite().all()
# What the Triton forward keeps for the backward: q, k, v, slope and the initial state if
# there is one (its backward recomputes the chunk states; without an initial state it starts
# from zero, nothing stored or zero-filled), as op.saved_bytes reports for impl "triton".
from graphopt.cost.memory import measured_saved_bytes
from graphopt.kernels.lightning.op import saved_bytes
q = torch.randn(2, 2, 40, 16, requires_grad=True)
k, v = (torch.randn(2, 1, 40, 16, requires_grad=True) for _ in range(2))
slope = torch.rand(2, requires_grad=True)
inputs = (2 + 1 + 1) * 2 * 40 * 16 * 4 + 2 * 4
for h0 in (None, torch.randn(2, 2, 16, 16)):
    got = measured_saved_bytes(lambda: lightning_attention(q, k, v, slope, block_size=16,
                                                           impl="triton", initial_state=h0),
                               [h0] if h0 is not None else [])
    kept, _ = saved_bytes(q.shape, k.shape, v.shape, torch.float32, 16, 8, impl="triton",
                          has_initial_state=h0 is not None)
    state = 2 * 2 * 16 * 16 * 4 if h0 is not None else 0
    assert got == kept == inputs + state, (got, kept, h0 is None)
print("ok")
"""


def test_triton_kernels_match_reference_under_interpreter():
    run_interpreted(SCRIPT)


def test_gpu_head_dims_beyond_the_triton_limit_use_the_chunked_kernel():
    """The chunk-parallel kernels tile D and Dv by 64: head dims up to 256 run on Triton;
    beyond, "auto" takes the chunked kernel and "triton" says why not."""
    import torch

    from graphopt.kernels.lightning.op import TRITON_MAX_HEAD_DIM, resolve_impl, triton_available

    if not triton_available():
        pytest.skip("triton not installed")
    gpu = torch.device("cuda")
    assert TRITON_MAX_HEAD_DIM == 256
    assert resolve_impl("auto", gpu, 128) == resolve_impl("auto", gpu, 256) == "triton"
    assert resolve_impl("auto", gpu, 512) == "chunked"
    with pytest.raises(ValueError, match="head dims up to 256"):
        resolve_impl("triton", gpu, 512)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):  # no interpreter here
        resolve_impl("triton", torch.device("cpu"), 512)


TUNED_SCRIPT = r"""
import time
import torch
import graphopt.kernels.lightning.triton_kernels as tk
from graphopt.kernels.lightning import lightning_attention, lightning_attention_reference

tk.TUNE = True  # take the GPU's autotuned launch path, timed on the host


clock = [1.0]


def bench(fn, quantiles=None):  # each config runs once; the last one benchmarked wins
    fn()
    clock[0] *= 0.9
    return [clock[0]] * 3


tk.BENCHMARKER = bench
gen = torch.Generator().manual_seed(0)
# D 64: tiles of 32 and 64 both survive pruning. The 32-wide configs, benchmarked first,
# wrote dslope parts 0 and 1; the winning 64-wide tile writes part 0 only, and the stale
# part 1 was summed in (dslope 4.8 relative off on the tuning call, a review)
q, k, v = (torch.randn(1, 1, 24, 64, generator=gen).div(3).requires_grad_() for _ in range(3))
slope = (torch.rand(1, generator=gen) * 0.5).requires_grad_()
ref = [x.detach().double().requires_grad_() for x in (q, k, v, slope)]
o_r, _ = lightning_attention_reference(*ref[:3], ref[3], 1.0)
want = torch.autograd.grad(o_r.sum(), ref)
from triton.runtime.autotuner import Autotuner

tuner_runs = []
real_run = Autotuner.run
Autotuner.run = lambda self, *a, **kw: tuner_runs.append(call) or real_run(self, *a, **kw)
for call in range(2):  # the tuning call, then the tuned configs
    o = lightning_attention(q, k, v, slope, impl="triton", block_size=16)
    torch.testing.assert_close(o.double(), o_r, rtol=1e-4, atol=1e-4)
    for g, w in zip(torch.autograd.grad(o.sum(), (q, k, v, slope)), want):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4)
# the four tuned kernels (states, output / dV, the backward's states + dS pair, dK / dQ),
# each over BK x BV x warps x stages,
# with a chosen config
tuned = sorted((a.fn.__name__, len(a.configs), sorted(a.best_config.kwargs))
               for a in tk._AUTOTUNED.values())
assert tuned == [(name, 16, ["BK", "BV"]) for name in ("_chunk_dqdk", "_chunk_out",
                                                       "_chunk_outer", "_chunk_outer_pair")
                 ], tuned
assert all(a.best_config.kwargs == {"BK": 64, "BV": 64} for a in tk._AUTOTUNED.values())
# the second call launches the chosen configs directly (tk._CHOSEN), not through the tuner
assert tuner_runs and set(tuner_runs) == {0}, tuner_runs
print("ok")
"""


def test_autotuned_launch_path_runs_and_matches_under_interpreter():
    """The GPU path's triton.autotune launches (tiles, warps, stages; grids from the chosen
    tiles; configs wider than the head dim pruned), timed by a host timer that lets the last
    config benchmarked win: the tuning call and the next give the reference's outputs and
    gradients (the slope's too: parts written by configs benchmarked before the winner are
    zeroed again)."""
    run_interpreted(TUNED_SCRIPT)


def test_precompile_submits_every_candidate_config_once_to_parallel_compilation(monkeypatch):
    """On a GPU a tuned launch's candidates are compiled in threads before the autotuner
    times them (an H200's first calls took minutes one by one). The GPU path needs a device;
    here a stand-in kernel checks what graphopt asks of Triton: one warmup per pruned
    candidate with its options, inside Triton's AsyncCompileMode, once per launch key."""
    import torch
    from triton.runtime._async_compile import active_mode

    import graphopt.kernels.lightning.triton_kernels as tk

    calls = []

    class Kernel:
        def warmup(self, *args, grid, **kwargs):
            assert active_mode.get() is not None  # submitted to the thread pool
            calls.append(kwargs)
            if kwargs["BK"] == 32 and kwargs["num_warps"] == 8:
                raise RuntimeError("out of resources")  # left to the autotuner

    monkeypatch.setattr(tk, "COMPILE_THREADS", 4)
    kernel, x = Kernel(), torch.zeros(4, dtype=torch.bfloat16)
    meta = {"C": 64, "R": 1, "D": 64, "DV": 64, "QUERY": False}
    assert tk.precompile(kernel, (x, 3), ("BK", "BV"), meta) == 16
    assert len(calls) == 16
    assert {(c["BK"], c["BV"], c["num_warps"], c["num_stages"]) for c in calls} == {
        (bk, bv, w, s) for bk in (32, 64) for bv in (32, 64) for w in (4, 8) for s in (1, 2)}
    assert all(c["D"] == 64 and c["QUERY"] is False for c in calls)
    assert tk.precompile(kernel, (x, 3), ("BK", "BV"), meta) == 0  # once per key
    assert tk.precompile(kernel, (x.float(), 3), ("BK", "BV"), meta) == 16  # new dtype
    # head dims below 64: the autotuner's pruning drops the 64-wide tiles here too
    assert tk.precompile(kernel, (x, 3), ("BK", "BV"), {**meta, "D": 32, "DV": 32}) == 4
    monkeypatch.setattr(tk, "COMPILE_THREADS", 1)
    assert tk.precompile(kernel, (x, 3), ("BK", "BV"), {**meta, "D": 16}) == 0


PRECOMPILE_SCRIPT = r"""
import os
os.environ.pop("TRITON_INTERPRET", None)
import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver


class SM90:  # the JIT's view of a device: an H100/H200 target, no GPU behind it
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_active_torch_device(self): return torch.device("cpu")


driver.set_active(SM90())
import graphopt.kernels.lightning.triton_kernels as tk

tk.COMPILE_THREADS = 2
spec = next(s for s in tk.launch_specs(32, 32, 64) if s.name == "output")
kernel = spec.kernel
dtypes = {"*bf16": torch.bfloat16, "*fp32": torch.float32, "*i32": torch.int32}
args = tuple(torch.zeros(64, dtype=dtypes[t]) if t in dtypes else (3 if t == "i32" else 1.5)
             for t in (spec.types[n] for n in kernel.arg_names if n in spec.types))
meta = {n: v for n, v in spec.constexprs.items() if n not in spec.tuned}
assert tk.precompile(kernel, args, spec.tuned, meta) == 4  # D = 32: 32-wide tiles only
cache = kernel.device_caches[0][0]
assert len(cache) == 4, len(cache)
compiled = {k.metadata.num_warps for k in cache.values()}
assert compiled == {4, 8}, compiled
for cfg in tk._prune(tk._configs(spec.tuned), {}, **meta):  # what the autotuner then runs:
    kernel.warmup(*args, grid=(1,), **meta, **cfg.all_kwargs())  # found in the JIT cache
assert len(cache) == 4, len(cache)
assert tk.precompile(kernel, args, spec.tuned, meta) == 0
print("ok")
"""


def test_precompile_puts_each_config_into_the_jit_cache_the_autotuner_reads(tmp_path):
    """Triton's real compile path for sm_90 (no GPU: a stand-in driver gives the target;
    ptxas from the triton wheel): the threaded warmups leave one compiled kernel per
    candidate in the JIT cache, and the autotuner's own launches of those configs (same
    arguments and options) find them there instead of compiling again."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path)}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", PRECOMPILE_SCRIPT], capture_output=True,
                         text=True, env=env, timeout=600)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


STATE_PASS_SCRIPT = r"""
import torch
import graphopt.kernels.lightning.triton_kernels as tk
from graphopt.kernels.lightning import lightning_attention, lightning_attention_reference

def grads(pass_, b, hq, hk, s, d, dv, block, init, seed, cu=None, dtype=torch.float32,
          train_slope=True, state_loss=True):
    tk.STATE_PASS = pass_
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, s, d, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(b, hk, s, d, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(b, hk, s, dv, generator=gen).to(dtype).requires_grad_()
    slope = (torch.rand(hq, generator=gen) * 0.5).requires_grad_(train_slope)
    n = b if cu is None else len(cu) - 1
    h0 = torch.randn(n, hq, d, dv, generator=gen).requires_grad_() if init else None
    kw = {} if cu is None else {"cu_seqlens": torch.tensor(cu)}
    o, st = lightning_attention(q, k, v, slope, scale=0.5, initial_state=h0,
                                output_final_state=True, block_size=block, impl="triton", **kw)
    ins = [x for x in (q, k, v, slope, h0) if x is not None and x.requires_grad]
    loss = (o.float() * torch.randn(o.shape, generator=gen)).sum()
    if state_loss:
        loss = loss + (st * torch.randn(st.shape, generator=gen)).sum()
    return [o, st, *torch.autograd.grad(loss, ins)]

cases = [dict(b=1, hq=2, hk=1, s=37, d=16, dv=16, block=16, init=True, seed=0),
         dict(b=2, hq=2, hk=1, s=40, d=80, dv=72, block=16, init=False, seed=1),
         dict(b=1, hq=2, hk=2, s=64, d=16, dv=8, block=32, init=True, seed=2,
              train_slope=False, state_loss=False),
         dict(b=1, hq=2, hk=1, s=45, d=16, dv=16, block=16, init=True, seed=3,
              cu=[0, 1, 17, 45]),
         dict(b=1, hq=2, hk=2, s=40, d=16, dv=16, block=16, init=False, seed=4,
              dtype=torch.float16)]
tk.LOWP_DTYPES = (torch.float16,)
for case in cases:
    par, seq = grads("parallel", **case), grads("sequential", **case)
    for a, b in zip(par, seq):
        assert torch.equal(a, b), (case, (a - b).abs().max())
# ... and the sequential pass against the float64 reference once
tk.STATE_PASS = "sequential"
gen = torch.Generator().manual_seed(5)
q, k, v = (torch.randn(1, 2, 50, 16, generator=gen).requires_grad_() for _ in range(3))
slope = torch.rand(2, generator=gen).requires_grad_()
o = lightning_attention(q, k, v, slope, block_size=16, impl="triton")
ref = [x.detach().double().requires_grad_() for x in (q, k, v, slope)]
o_r, _ = lightning_attention_reference(*ref, 1.0)
torch.testing.assert_close(o.double(), o_r, rtol=1e-4, atol=1e-4)
for g, w in zip(torch.autograd.grad(o.sum(), (q, k, v, slope)),
                torch.autograd.grad(o_r.sum(), ref)):
    torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4)
# "auto" picks the faster by the autotuner's timer, runs each once first
calls = []
clock = {"parallel": [2.0], "sequential": [1.0]}
tk.BENCHMARKER = lambda fn, quantiles=None: clock[fn.__name__]
def parallel():
    calls.append("p")
def sequential():
    calls.append("s")
assert tk._faster(parallel, sequential) == "sequential" and calls == ["p", "s"], calls
clock = {"parallel": 0.5, "sequential": 1.0}  # do_bench's float
assert tk._faster(parallel, sequential) == "parallel"
# "auto" on a GPU: timed per bucket (here the sequential wins and is cached), but packed
# sequences always take the parallel pass (the sequential one waits on the longest)
tk.STATE_PASS, tk.INTERPRETED = "auto", False
clock = {"parallel": 2.0, "sequential": 1.0}
tiles = {"C": 16, "R": 1}
for varlen, want in ((False, ["p", "s", "s"]), (True, ["p"])):
    g = tk._Chunks(1, 4, 4, None, None, None, varlen, None)
    calls.clear()
    tk._state_pass(("forward", g, 2, 16, 16, tiles, torch.float32), parallel, sequential)
    assert calls == want, (varlen, calls)
calls.clear()
tk._state_pass(("forward", g._replace(varlen=False), 2, 16, 16, tiles, torch.float32),
               parallel, sequential)
assert calls == ["s"], calls  # the cached choice
tk.INTERPRETED = True
print("ok")
"""


def test_sequential_state_pass_equals_the_parallel_one_bit_for_bit():
    """The one-launch state passes (_chunk_states forward, _chunk_states_pair backward: each
    sequence's chunks walked in order, flash-linear-attention's way) give the parallel
    passes' numbers exactly (dense, GQA, multi-tile D/Dv, packed sequences, initial state,
    fixed slope, fp16 low precision), match the float64 reference, and "auto" picks the
    faster by the autotuner's timer."""
    run_interpreted(STATE_PASS_SCRIPT)


NO_FILL_SCRIPT = r"""
import torch
from torch.profiler import profile
from graphopt.kernels.lightning import lightning_attention, lightning_attention_reference

def fills(fn):
    with profile() as prof:
        fn()
    return [e.name for e in prof.events() if e.name in ("aten::fill_", "aten::zero_")]

gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 40, 16, generator=gen, requires_grad=True) for _ in range(3))
slope = torch.rand(2, generator=gen)  # a fixed slope (MiniMax's buffer), no initial state
do = torch.randn(1, 2, 40, 16, generator=gen)
run = lambda: lightning_attention(q, k, v, slope, block_size=16, impl="triton")
with torch.no_grad():
    assert fills(run) == [], fills(run)
o = run()
assert fills(lambda: torch.autograd.grad(run(), (q, k, v), do)) == []
got = torch.autograd.grad(o, (q, k, v), do)
# the custom op (taken under a dispatch mode; its schema returns dslope, zeros here) agrees
o2, _, ckpt = torch.ops.graphopt.lightning_attention_fwd(q, k, v, slope, 1.0, None, 16, 8,
                                                         "triton")
assert ckpt.shape == (1, 2, 0, 16) and torch.equal(o, o2)
for g, w in zip(got, torch.autograd.grad(o2, (q, k, v), do)):
    assert torch.equal(g, w)
ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
o_r, _ = lightning_attention_reference(*ref, slope.double(), 1.0)
for g, w in zip(got, torch.autograd.grad(o_r, ref, do.double())):
    torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4)
# a trained slope still gets its gradient; an initial state is still checkpointed and used
slope.requires_grad_()
h0 = torch.randn(1, 2, 16, 16, generator=gen, requires_grad=True)
o = lightning_attention(q, k, v, slope, block_size=16, impl="triton", initial_state=h0)
got = torch.autograd.grad(o, (q, k, v, slope, h0), do)
ref = [x.detach().double().requires_grad_() for x in (q, k, v, slope, h0)]
o_r, _ = lightning_attention_reference(*ref[:4], 1.0, ref[4])
for g, w in zip(got, torch.autograd.grad(o_r, ref, do.double())):
    torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4)
# torch.func.grad takes graphopt.kernels.transformable's Function: the same kernels
fg = torch.func.grad(lambda *a: (lightning_attention(*a, block_size=16, impl="triton",
                                                     initial_state=h0) * do).sum(),
                     argnums=(0, 1, 2, 3))(q.detach(), k.detach(), v.detach(), slope.detach())
for g, w in zip(fg, got):
    assert torch.equal(g, w)
# compiled (the fake says 0 checkpoint rows without an initial state, 1 with): same numbers,
# and no Dynamo warning (resolve_impl's lru_cache'd triton_available warned of "silent
# incorrectness" at every compile, a review)
import warnings
for init in (None, h0):
    f = lambda *a: lightning_attention(*a, block_size=16, impl="triton", initial_state=init)
    c = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)
    ins = (q, k, v, slope)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = c(*ins)
    assert not [w for w in caught if "lru_cache" in str(w.message)], caught
    for g, w in zip(torch.autograd.grad(out, ins, do), torch.autograd.grad(f(*ins), ins, do)):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
print("ok")
"""


def test_eager_triton_step_launches_no_zero_fill():
    """A Triton forward + backward in plain eager mode with a fixed slope and no initial
    state runs no fill kernel (each is a launch on a GPU: the forward zero-filled a first
    state, the backward a dslope placeholder and a dslope of zeros that was discarded), and
    its gradients equal the custom op's bit for bit and the float64 reference's; a trained
    slope and an initial state still get theirs."""
    run_interpreted(NO_FILL_SCRIPT)


TABLE_SCRIPT = r"""
import itertools, random
import torch
import graphopt.kernels.lightning.triton_kernels as tk

random.seed(0)
cases = [[1], [5], [1] * 70, [64] * 3, [17, 1, 300, 2], [1000]]
for _ in range(120):
    n = random.choice([1, 2, 3, 63, 64, 65, 130])
    cases.append([random.choice([1, 2, 15, 16, 17, 64, 100, random.randint(1, 300)])
                  for _ in range(n)])
for lens in cases:
    cu = torch.tensor([0, *itertools.accumulate(lens)],
                      dtype=random.choice([torch.int32, torch.int64]))
    total, c = int(cu[-1]), random.choice([16, 32, 64, 128])
    g = tk._chunks(1, total, c, cu, torch.zeros(1))
    table, offsets = tk.chunk_table_reference(cu, total, c)
    assert torch.equal(g.table, table) and torch.equal(g.offsets, offsets), (lens, c)
    assert torch.equal(g.cu, cu.to(torch.int32))
# it checks cu_seqlens too (on a GPU an asynchronous assert; the public function's own device
# assert is skipped for the Triton path)
for bad in ([0, 5, 5, 9], [1, 5, 9], [0, 5, 8], [0, 6, 5, 9], [0, 4, 9, 9] + [9] * 70):
    try:
        tk._chunks(1, 9, 16, torch.tensor(bad), torch.zeros(1))
        raise AssertionError(bad)
    except RuntimeError as e:
        assert "cu_seqlens must increase strictly from 0 to S = 9" in str(e), e
print("ok")
"""


def test_chunk_table_kernel_equals_the_torch_construction():
    """Packed sequences' chunk slots come from one Triton launch (``_chunk_table``; it was
    13 torch ops in each forward and backward): its (sequence, chunk) table and first-slot
    offsets equal the torch reference for one to 130 sequences (several blocks of the
    sequence walk), one-token sequences, lengths on and off the chunk grid, several slot
    programs, int32 and int64 cu_seqlens; it asserts cu_seqlens increases strictly from 0 to
    S (duplicates, a wrong start or end, a decrease, in a later block of the walk)."""
    run_interpreted(TABLE_SCRIPT)


VARLEN_EAGER_SCRIPT = r"""
import torch
from torch.profiler import profile
import graphopt.kernels.lightning.op as op
import graphopt.kernels.lightning.triton_kernels as tk
from graphopt.kernels.lightning import lightning_attention, lightning_attention_reference

tables = []
real_table = tk._chunk_table


class Spy:
    def __getitem__(self, grid):
        tables.append(grid)
        return real_table[grid]


tk._chunk_table = Spy()
gen = torch.Generator().manual_seed(0)
q = torch.randn(1, 2, 40, 16, generator=gen, requires_grad=True)
k, v = (torch.randn(1, 1, 40, 16, generator=gen, requires_grad=True) for _ in range(2))
slope = torch.rand(2, generator=gen)
h0 = torch.randn(3, 2, 16, 16, generator=gen, requires_grad=True)
do = torch.randn(1, 2, 40, 16, generator=gen)
cu = torch.tensor([0, 17, 18, 40])
ins = (q, k, v, h0)
run = lambda: lightning_attention(q, k, v, slope, block_size=16, impl="triton",
                                  cu_seqlens=cu, initial_state=h0, output_final_state=True)
eager_calls = []
real_apply = op._EagerVarlen.apply
op._EagerVarlen.apply = lambda *a: eager_calls.append(1) or real_apply(*a)
o, state = run()
got = torch.autograd.grad((o * do).sum() + state.square().sum(), ins)
assert eager_calls == [1] and len(tables) == 1, (eager_calls, tables)  # backward reuses it
with profile() as prof:
    o2, state2 = run()
    torch.autograd.grad((o2 * do).sum() + state2.square().sum(), ins)


def ours(e):  # an op run inside the eager Function's forward or backward
    while e is not None:
        if e.name in ("_EagerVarlen", "_EagerVarlenBackward"):
            return True
        e = e.cpu_parent
    return False


ran = {e.name for e in prof.events() if ours(e)}
assert "aten::empty" in ran and not ran & {
    "aten::fill_", "aten::zero_", "aten::cumsum", "aten::searchsorted", "aten::_to_copy"}, ran
# the custom op (taken under a dispatch mode): bit-equal, and it reuses the table too
tables.clear()
o3, state3, chunks = torch.ops.graphopt.lightning_attention_varlen_fwd(
    q, k, v, slope, 1.0, h0, cu, 16, "triton")
assert chunks.dtype == torch.int32 and chunks.numel() == tk.packed_chunk_size(40, 3, 16)
want = torch.autograd.grad((o3 * do).sum() + state3.square().sum(), ins)
assert len(tables) == 1 and torch.equal(o, o3) and torch.equal(state, state3)
for g, w in zip(got, want):
    assert torch.equal(g, w)
# float64 reference, sequence by sequence
ref = [x.detach().double().requires_grad_() for x in ins]
outs, states = [], []
for i, (a, b) in enumerate([(0, 17), (17, 18), (18, 40)]):
    o_r, s_r = lightning_attention_reference(ref[0][:, :, a:b], ref[1][:, :, a:b],
                                             ref[2][:, :, a:b], slope.double(), 1.0,
                                             ref[3][i:i + 1])
    outs.append(o_r)
    states.append(s_r)
o_r, s_r = torch.cat(outs, 2), torch.cat(states)
for g, w in zip(got, torch.autograd.grad((o_r * do.double()).sum() + s_r.square().sum(), ref)):
    torch.testing.assert_close(g.double(), w, rtol=2e-4, atol=2e-4)
# compiled with dynamic shapes: the fake's chunk buffer size matches the real one
f = lambda *a: lightning_attention(*a[:3], slope, block_size=16, impl="triton", cu_seqlens=cu,
                                   initial_state=a[3])
c = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)
for g, w in zip(torch.autograd.grad((c(*ins) * do).sum(), ins),
                torch.autograd.grad((f(*ins) * do).sum(), ins)):
    torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
torch.library.opcheck(torch.ops.graphopt.lightning_attention_varlen_fwd.default,
                      (q, k, v, slope, 1.0, h0, cu, 16, "triton"))
print("ok")
"""


def test_packed_sequences_take_the_eager_path_and_build_the_chunk_table_once():
    """Packed sequences in plain eager mode skip the custom op's dispatch (as dense calls do)
    and the backward reuses the forward's chunk table (it rebuilt it: 13 torch ops, then one
    launch): one _chunk_table launch per forward+backward, no fill, cumsum, searchsorted or
    cast kernel; gradients bit-equal to the custom op's (which reuses the table too) and
    equal to the float64 reference per sequence; torch.compile (aot_eager, dynamic) and
    opcheck agree with the fake's chunk buffer."""
    run_interpreted(VARLEN_EAGER_SCRIPT)


def test_host_benchmark_runs_and_its_launch_counts_hold():
    """benchmarks/lightning_host.py (the host-time table of docs/benchmarks.md) runs, and the
    launches it reports per call (Triton + torch kernels, deterministic) are what the docs
    say: no fill or other torch kernel in a dense step, 2 / 6 launches with the sequential
    state passes, one chunk-table launch and its check's assert for packed sequences."""
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "lightning_host.py")
    rows = {}
    for extra in ([], ["--packed"]):
        out = subprocess.run([sys.executable, script, "--reps", "3", *extra],
                             capture_output=True, text=True, timeout=600, check=False)
        assert out.returncode == 0, out.stderr[-3000:]
        for line in out.stdout.splitlines():
            cells = [c.strip() for c in line.strip("|").split("|")]
            if line.startswith("| graphopt"):
                rows[cells[0]] = (cells[2], cells[4], cells[6])
    assert rows["graphopt (impl='triton'), fixed tiles"] == ("3 + 0", "8 + 0", "-")
    assert rows["graphopt, autotuned, sequential state passes (STATE_PASS)"] == \
        ("2 + 0", "6 + 0", "-")
    assert rows["graphopt, autotuned, packed (cu_seqlens)"] == ("4 + 1", "9 + 1",
                                                                 "_assert_async")
