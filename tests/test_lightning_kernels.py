"""Lightning Attention kernels: chunked forward/backward vs the quadratic reference,
state carrying, extreme decays, long sequences, the custom op under torch.compile, MiniMax."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphopt.kernels.lightning import (
    lightning_attention,
    lightning_attention_reference,
    lightning_attention_step,
)

TOL = {torch.float64: dict(rtol=1e-9, atol=1e-9), torch.float32: dict(rtol=2e-4, atol=2e-4),
       torch.bfloat16: dict(rtol=3e-2, atol=3e-2), torch.float16: dict(rtol=5e-3, atol=5e-3)}


def _inputs(b, hq, hk, s, d, dv, dtype, seed=0, slope_scale=0.3, init=False):
    gen = torch.Generator().manual_seed(seed)

    def mk(*shape):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64)
                / math.sqrt(shape[-1])).to(dtype).requires_grad_()

    q, k, v = mk(b, hq, s, d), mk(b, hk, s, d), mk(b, hk, s, dv)
    slope = (torch.rand(hq, generator=gen, dtype=torch.float64) * slope_scale).to(
        torch.float32 if dtype != torch.float64 else dtype).requires_grad_()
    h0 = mk(b, hq, d, dv).detach().float().requires_grad_() if init else None
    if init and dtype == torch.float64:
        h0 = h0.detach().double().requires_grad_()
    return q, k, v, slope, h0


def _check(q, k, v, slope, h0, dtype, scale=None, **kw):
    o, st_ = lightning_attention(q, k, v, slope, scale=scale, initial_state=h0,
                                 output_final_state=True, **kw)
    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v, slope)]
    h0r = None if h0 is None else h0.detach().double().requires_grad_()
    o_r, st_r = lightning_attention_reference(*ref_in, 1.0 if scale is None else scale, h0r)
    tol = TOL[dtype]
    torch.testing.assert_close(o.double(), o_r, **tol)
    torch.testing.assert_close(st_.double(), st_r, **tol)
    gen = torch.Generator().manual_seed(1)
    go = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    gs = torch.randn(st_.shape, generator=gen, dtype=torch.float64)
    ins = [q, k, v, slope] + ([h0] if h0 is not None else [])
    refs = ref_in + ([h0r] if h0r is not None else [])
    got = torch.autograd.grad((o.double() * go).sum() + (st_.double() * gs).sum(), ins)
    want = torch.autograd.grad((o_r * go).sum() + (st_r * gs).sum(), refs)
    for name, g, w in zip(["q", "k", "v", "slope", "initial_state"], got, want):
        scale_w = max(1.0, float(w.abs().max()))
        torch.testing.assert_close(g.double() / scale_w, w / scale_w, **tol,
                                   msg=lambda m, name=name: f"d{name}: {m}")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(b=st.integers(1, 2), hk=st.integers(1, 2), group=st.sampled_from([1, 2, 4]),
       s=st.integers(1, 300), d=st.sampled_from([4, 8, 16]), dv=st.sampled_from([4, 8, 12]),
       block=st.sampled_from([None, 8, 16, 64]), every=st.sampled_from([None, 1, 3]),
       init=st.booleans(), scale=st.sampled_from([None, 0.5]), seed=st.integers(0, 1000))
def test_matches_reference_float64(b, hk, group, s, d, dv, block, every, init, scale, seed):
    q, k, v, slope, h0 = _inputs(b, hk * group, hk, s, d, dv, torch.float64, seed, init=init)
    _check(q, k, v, slope, h0, torch.float64, scale=scale, block_size=block,
           checkpoint_every=every)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("s", [1, 63, 200, 2048])
def test_matches_reference_low_precision(dtype, s):
    q, k, v, slope, h0 = _inputs(2, 4, 2, s, 16, 8, dtype, seed=s, init=True)
    _check(q, k, v, slope, h0, dtype, block_size=64)
    o = lightning_attention(q, k, v, slope)
    assert o.dtype == dtype


def test_split_sequence_carrying_state_equals_whole():
    q, k, v, slope, h0 = _inputs(1, 4, 2, 333, 8, 8, torch.float64, init=True)
    whole, final = lightning_attention(q, k, v, slope, initial_state=h0, output_final_state=True)
    first, mid = lightning_attention(q[:, :, :123], k[:, :, :123], v[:, :, :123], slope,
                                     initial_state=h0, output_final_state=True)
    second, end = lightning_attention(q[:, :, 123:], k[:, :, 123:], v[:, :, 123:], slope,
                                      initial_state=mid, output_final_state=True)
    torch.testing.assert_close(torch.cat([first, second], dim=2), whole)
    torch.testing.assert_close(end, final)


def test_recurrent_decode_steps_equal_chunked():
    q, k, v, slope, h0 = _inputs(2, 4, 2, 40, 8, 6, torch.float64, init=True)
    full, final = lightning_attention(q, k, v, slope, initial_state=h0, output_final_state=True)
    state, outs = h0.detach(), []
    for t in range(40):
        o, state = lightning_attention_step(q[:, :, t:t + 1], k[:, :, t:t + 1],
                                            v[:, :, t:t + 1], slope, state)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, dim=2), full)
    torch.testing.assert_close(state, final)


@pytest.mark.parametrize("slope_value", [0.0, 50.0, 1e4])
def test_extreme_decay_is_finite_and_correct(slope_value):
    q, k, v, _, h0 = _inputs(1, 2, 2, 150, 8, 8, torch.float32, init=True)
    slope = torch.full((2,), slope_value, requires_grad=True)
    o, st_ = lightning_attention(q, k, v, slope, initial_state=h0, output_final_state=True)
    o.sum().backward()
    for t in (o, st_, q.grad, k.grad, v.grad, slope.grad, h0.grad):
        assert torch.isfinite(t).all()
    _check(q, k, v, slope, h0, torch.float32)


def test_positions_beyond_65536():
    """The last outputs of a 70k sequence equal the reference on a trailing window: with
    slope 0.01, contributions older than 3,000 positions are below exp(-30)."""
    s, window = 70_000, 3_000
    q, k, v, _, _ = _inputs(1, 1, 1, s, 4, 4, torch.float64)
    slope = torch.full((1,), 0.01, dtype=torch.float64)
    with torch.no_grad():
        o = lightning_attention(q, k, v, slope, block_size=256)
        tail, _ = lightning_attention_reference(q[:, :, -window:], k[:, :, -window:],
                                                v[:, :, -window:], slope)
    torch.testing.assert_close(o[:, :, -500:], tail[:, :, -500:], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("bad, message", [
    (dict(k=torch.randn(1, 3, 8, 4)), r"query heads \(4\) must be a multiple of key/value heads"),
    (dict(q=torch.randn(4, 8, 4)), r"q must have 4 dimensions"),
    (dict(v=torch.randn(1, 2, 9, 4)), r"v must be \[B, Hk, S, Dv\]"),
    (dict(q=torch.randint(0, 3, (1, 4, 8, 4))), r"q must be a floating-point tensor"),
    (dict(slope=torch.rand(3)), r"slope must have one entry per query head \(4\), got 3"),
    (dict(initial_state=torch.randn(1, 4, 4, 5)), r"initial_state must be \[B, Hq, D, Dv\]"),
    # no heads: "0 must be a multiple of 0", and Hq=0 with Hk=1 ran (a review)
    (dict(q=torch.randn(1, 0, 8, 4), k=torch.randn(1, 0, 8, 4), v=torch.randn(1, 0, 8, 4),
          slope=torch.rand(0)), r"at least one query and one key/value head, got Hq=0, Hk=0"),
    (dict(q=torch.randn(1, 0, 8, 4), slope=torch.rand(0)), r"at least one .* Hq=0, Hk=2"),
])
def test_bad_input_names_the_argument(bad, message):
    args = dict(q=torch.randn(1, 4, 8, 4), k=torch.randn(1, 2, 8, 4), v=torch.randn(1, 2, 8, 4),
                slope=torch.rand(4), initial_state=None)
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=message):
        lightning_attention(args["q"], args["k"], args["v"], args["slope"],
                            initial_state=args["initial_state"])


def test_bshd_layout():
    q, k, v, slope, _ = _inputs(2, 4, 2, 50, 8, 8, torch.float64)
    o = lightning_attention(q, k, v, slope)
    o2 = lightning_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), slope,
                             layout="bshd")
    torch.testing.assert_close(o2.transpose(1, 2), o)


def test_custom_op_passes_opcheck():
    q, k, v, slope, h0 = _inputs(1, 4, 2, 37, 8, 6, torch.float32, init=True)
    torch.library.opcheck(torch.ops.graphopt.lightning_attention_fwd.default,
                          (q, k, v, slope, 1.0, h0, 16, 2, "chunked"))


def test_backward_gives_gradients_in_the_inputs_layouts():
    """dq, dk, dv in the layouts of transposed q, k, v ([B, S, H, D] memory, as views of a
    projection are), by the kernel and its fake alike (opcheck compares them): contiguous
    gradients met torch 2.13's elu_backward, whose fake strides differ from its real ones
    when the gradient's layout differs from the input's, so a compiled backward viewed a
    contiguous tensor as transposed and failed (a hand-written linear attention, exact
    rewrite)."""
    q, k, v, slope, _ = _inputs(2, 4, 2, 37, 8, 6, torch.float64)
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2).detach() for x in (q, k, v))
    op = torch.ops.graphopt
    _, _, ckpt = op.lightning_attention_fwd(q, k, v, slope, 1.0, None, 16, 2, "chunked")
    grad = torch.randn(*q.shape[:3], v.shape[-1], dtype=q.dtype)
    args = (grad, None, q, k, v, slope, 1.0, ckpt, 16, 2, True, "chunked")
    dq, dk, dv, _, _ = op.lightning_attention_bwd(*args)
    assert (dq.stride(), dk.stride(), dv.stride()) == (q.stride(), k.stride(), v.stride())
    torch.library.opcheck(op.lightning_attention_bwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_compiles_without_graph_break_with_dynamic_shapes():
    def fn(q, k, v, slope):
        return lightning_attention(q, k, v, slope, block_size=16) * 2

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    for s in (40, 77):
        q, k, v, slope, _ = _inputs(1, 2, 2, s, 8, 8, torch.float64)
        out = compiled(q, k, v, slope)
        torch.testing.assert_close(out, fn(q, k, v, slope))
        out.sum().backward()
        assert q.grad is not None and slope.grad is not None


def test_equals_transformers_minimax_lightning_attention():
    from transformers import MiniMaxConfig
    from transformers.models.minimax import modeling_minimax as mm

    config = MiniMaxConfig(hidden_size=64, num_attention_heads=4, head_dim=16, block_size=16,
                           num_hidden_layers=2, layer_types=["linear_attention"] * 2)
    torch.manual_seed(0)
    attn = mm.MiniMaxLightningAttention(config, layer_idx=0).double()
    x = torch.randn(2, 50, 64, dtype=torch.float64)
    with torch.no_grad():
        expected, _ = attn(x, position_embeddings=None, attention_mask=None)
        qkv = attn.act_fn(attn.qkv_proj(x)).reshape(2, 50, 4, 48)
        q, k, v = (t.transpose(1, 2) for t in torch.split(qkv, 16, dim=3))
        o = lightning_attention(q, k, v, attn.slope_rate.view(-1), block_size=16)
        o = attn.norm(o.transpose(1, 2).reshape(2, 50, 64))
        o = attn.out_proj(torch.sigmoid(attn.output_gate(x)) * o)
    # MiniMax builds its decay buffers in float32 at __init__; ours are float64 exps of the
    # same slopes, so agreement is to float32 precision of the decays.
    torch.testing.assert_close(o, expected, rtol=1e-6, atol=1e-6)


def test_empty_sequence_with_initial_state_and_gradients():
    q = torch.randn(1, 2, 0, 4, requires_grad=True)
    h0 = torch.randn(1, 2, 4, 4, requires_grad=True)
    o, state = lightning_attention(q, q, q, torch.rand(2), initial_state=h0,
                                   output_final_state=True)
    assert o.shape == (1, 2, 0, 4)
    torch.testing.assert_close(state, h0)
    state.sum().backward()
    torch.testing.assert_close(h0.grad, torch.ones_like(h0))


def test_mixed_devices_dtypes_and_float_block_are_rejected():
    q, k, v = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    with pytest.raises(TypeError, match="k has dtype torch.float64 but q has torch.float32"):
        lightning_attention(q, k.double(), v, torch.rand(2))
    with pytest.raises(ValueError, match="k is on meta but q is on cpu"):
        lightning_attention(q, k.to("meta"), v, torch.rand(2))
    with pytest.raises(TypeError, match="block_size must be an int, got 2.7"):
        lightning_attention(q, k, v, torch.rand(2), block_size=2.7)


def test_packed_variable_length_sequences_reset_the_state_at_each_boundary():
    """cu_seqlens: three sequences of 5, 17 and 33 positions packed in one row (GQA, one
    initial state per sequence), float64: outputs, final states and every gradient equal
    three separate reference calls; nothing leaks across a boundary."""
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 17, 33]
    total = sum(lengths)
    q = torch.randn(1, 4, total, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, total, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, total, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    slope = torch.rand(4, generator=gen, dtype=torch.float64).requires_grad_()
    h0 = torch.randn(3, 4, 8, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 5, 22, 55])
    o, states = lightning_attention(q, k, v, slope, initial_state=h0, output_final_state=True,
                                    cu_seqlens=cu, block_size=8)
    go = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    gs = torch.randn(states.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad((o * go).sum() + (states * gs).sum(), (q, k, v, slope, h0))
    want_o, want_s = [], []
    for i, (a, b) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        o_i, s_i = lightning_attention_reference(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b],
                                                 slope, 1.0, h0[i:i + 1])
        want_o.append(o_i)
        want_s.append(s_i)
    want_o, want_s = torch.cat(want_o, 2), torch.cat(want_s, 0)
    want = torch.autograd.grad((want_o * go).sum() + (want_s * gs).sum(), (q, k, v, slope, h0))
    torch.testing.assert_close(o, want_o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(states, want_s, rtol=1e-10, atol=1e-10)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="increase strictly from 0 to S = 55"):
        lightning_attention(q, k, v, slope, cu_seqlens=torch.tensor([0, 5, 5, 55]))
    with pytest.raises(ValueError, match="must be \\[1, Hq, S, D\\]"):
        lightning_attention(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1),
                            v.expand(2, -1, -1, -1), slope, cu_seqlens=cu)


def test_packed_sequences_trace_under_fake_tensors_and_bad_cu_seqlens_are_named():
    """make_fx (fake and symbolic) and FakeTensorMode trace the packed path (the host check of
    cu_seqlens read fake values: DataDependentOutputException), and the traced graph equals
    eager; a complex cu_seqlens and one on another device than q are named errors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def fn(q, k, v, slope, cu):
        return lightning_attention(q, k, v, slope, cu_seqlens=cu, block_size=4)

    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 10, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    slope, cu = torch.rand(2, generator=gen, dtype=torch.float64), torch.tensor([0, 3, 10])
    for mode in ("fake", "symbolic"):
        traced = make_fx(fn, tracing_mode=mode)(q, k, v, slope, cu)
        torch.testing.assert_close(traced(q, k, v, slope, cu), fn(q, k, v, slope, cu))
    with FakeTensorMode() as fake:
        out = fn(*(fake.from_tensor(x) for x in (q, k, v, slope, cu)))
    assert out.shape == (1, 2, 10, 4)
    with pytest.raises(TypeError, match="1-D integer tensor"):
        fn(q, k, v, slope, cu.to(torch.complex64))
    with pytest.raises(ValueError, match="cu_seqlens is on meta and q on cpu"):
        fn(q, k, v, slope, cu.to("meta"))


@pytest.mark.parametrize("seq, every, dtype, slope_dtype", [
    (300, 2, torch.float32, torch.float32), (64, 8, torch.float64, torch.float32),
    (64, 8, torch.float64, torch.float64), (1000, 8, torch.bfloat16, torch.float32)])
def test_reported_saved_bytes_are_what_autograd_keeps(seq, every, dtype, slope_dtype):
    """op.saved_bytes (the attention pass's report) equals the bytes autograd's saved-tensor
    hooks see for a real forward (GQA, Dv != D, S off the block grid, a float64 slope: it
    was counted as 4 bytes per head, a review), and the checkpointed states are fewer than
    one per block."""
    from graphopt.cost.memory import measured_saved_bytes
    from graphopt.kernels.lightning.op import saved_bytes

    q = torch.randn(2, 4, seq, 16, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 2, seq, 16, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 2, seq, 8, dtype=dtype, requires_grad=True)
    slope = torch.rand(4, dtype=slope_dtype, requires_grad=True)
    got = measured_saved_bytes(lambda: lightning_attention(q, k, v, slope, block_size=32,
                                                           checkpoint_every=every,
                                                           impl="chunked"))
    kept, every_block = saved_bytes(q.shape, k.shape, v.shape, dtype, 32, every,
                                    slope_dtype=slope_dtype)
    assert got == kept
    assert kept < every_block if seq >= 300 else kept <= every_block


def test_packed_sequences_compile_fullgraph_and_check_cu_seqlens_in_the_graph():
    """cu_seqlens under torch.compile(fullgraph=True): no data-dependent guard (the values
    are checked by an assert in the graph, not read on the host), outputs and gradients equal
    eager, and a bad cu_seqlens still raises."""
    def fn(q, k, v, slope, cu):
        return lightning_attention(q, k, v, slope, cu_seqlens=cu, block_size=4)

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 12, 8, generator=gen, dtype=torch.float64,
                           requires_grad=True) for _ in range(3))
    slope = torch.rand(2, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v, slope, cu)
    want = fn(q, k, v, slope, cu)
    torch.testing.assert_close(out, want)
    got = torch.autograd.grad(out.square().sum(), (q, k, v))
    for g, w in zip(got, torch.autograd.grad(want.square().sum(), (q, k, v))):
        torch.testing.assert_close(g, w)
    with pytest.raises(RuntimeError, match="increase strictly from 0 to S = 12"):
        compiled(q, k, v, slope, torch.tensor([0, 7, 7], dtype=torch.int32))


def test_scale_impl_and_option_errors_name_the_fix():
    """A learnable (grad-requiring) scale, a non-number scale, bad options with cu_seqlens,
    float64 on Triton and Triton on CPU without the interpreter are errors that say what to
    do; "auto" keeps float64 on the exact chunked path."""
    from graphopt.kernels.lightning.op import resolve_impl
    from graphopt.kernels.lightning.triton_kernels import INTERPRETED, triton_available

    q, k, v = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    slope = torch.rand(2)
    with pytest.raises(TypeError, match="multiply q by it before the call"):
        lightning_attention(q, k, v, slope, scale=torch.tensor(0.5, requires_grad=True))
    with pytest.raises(TypeError, match="scale must be a real number, got str"):
        lightning_attention(q, k, v, slope, scale="0.5")
    torch.testing.assert_close(lightning_attention(q, k, v, slope, scale=torch.tensor(0.5)),
                               lightning_attention(q, k, v, slope, scale=0.5))
    cu = torch.tensor([0, 3, 8])
    with pytest.raises(TypeError, match="checkpoint_every must be an int"):
        lightning_attention(q[:1], k, v, slope, cu_seqlens=cu, checkpoint_every="x")
    with pytest.raises(TypeError, match="block_size must be an int"):
        lightning_attention(q, k, v, slope, cu_seqlens=cu, block_size=2.5)
    gpu = torch.device("cuda")
    assert resolve_impl("auto", gpu, 64, torch.float64) == "chunked"
    if triton_available():
        assert resolve_impl("auto", gpu, 64, torch.bfloat16) == "triton"
        with pytest.raises(ValueError, match="computes in float32"):
            resolve_impl("triton", gpu, 64, torch.float64)
        if not INTERPRETED:
            with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
                lightning_attention(q, k, v, slope, impl="triton")


def test_step_and_packed_inputs_are_validated():
    """Found by a review: the decode step took two tokens as one (no decay between them,
    error 8.3), broadcast a [1, 1, D, Dv] state and carried an fp16 one; packed sequences
    took an initial state on another device and returned garbage."""
    q, k, v = (torch.randn(2, 2, 1, 4, dtype=torch.float64) for _ in range(3))
    slope = torch.rand(2, dtype=torch.float64)
    state = torch.zeros(2, 2, 4, 4, dtype=torch.float64)
    two = torch.randn(2, 2, 2, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="takes one token"):
        lightning_attention_step(two, two, two, slope, state)
    # the step checks scale as lightning_attention does, and neither takes a NaN (every
    # output NaN) (a review)
    with pytest.raises(TypeError, match="scale must be a real number, got str 'x'"):
        lightning_attention_step(q, k, v, slope, state, scale="x")
    for call in (lambda: lightning_attention_step(q, k, v, slope, state, scale=math.nan),
                 lambda: lightning_attention(q, k, v, slope, scale=math.inf)):
        with pytest.raises(ValueError, match="scale must be finite"):
            call()
    with pytest.raises(ValueError, match=r"state must be \[B, Hq, D, Dv\]"):
        lightning_attention_step(q, k, v, slope, state[:1, :1])
    with pytest.raises(TypeError, match="float32 or float64"):
        lightning_attention_step(q, k, v, slope, state.half())
    with pytest.raises(ValueError, match="slope must have one entry per query head"):
        lightning_attention_step(q, k, v, slope[:1], state)
    x = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="initial_state is on meta but q is on cpu"):
        lightning_attention(x, x, x, torch.rand(2), impl="chunked",
                            cu_seqlens=torch.tensor([0, 3, 8]),
                            initial_state=torch.zeros(2, 2, 4, 4, device="meta"))
    with pytest.raises(ValueError, match="head dims must be >= 1"):
        lightning_attention(x[..., :0], x[..., :0], x, torch.rand(2), impl="chunked")


def test_an_empty_batch_runs_forward_and_backward():
    """B = 0 (an empty microbatch) crashed in the backward's checkpoint reshape."""
    for shape in ((0, 2, 8, 4),):
        q, k, v = (torch.randn(*shape, dtype=torch.float64, requires_grad=True)
                   for _ in range(3))
        slope = torch.rand(shape[1], dtype=torch.float64, requires_grad=True)
        o = lightning_attention(q, k, v, slope, impl="chunked")
        o.sum().backward()
        assert o.shape == shape and q.grad.shape == shape and slope.grad.shape == slope.shape


@pytest.mark.parametrize("needs", [("q",), ("k", "v"), ("k",), ("v",), ("h0",), ("q", "h0"),
                                   ("q", "slope")])
def test_gradients_of_some_inputs_skip_the_others_and_stay_exact(needs, monkeypatch):
    """Only the inputs in ``needs`` require grad: the backward is told (need_q / need_kv:
    k, v or the initial state), skips the rest (no reverse state scan without need_kv) and
    the gradients it returns equal the float64 reference's."""
    import graphopt.kernels.lightning.op as op

    seen = []
    original = op.chunked_backward

    def recorded(*args, **kwargs):
        seen.append(args[-2:])
        return original(*args, **kwargs)

    monkeypatch.setattr(op, "chunked_backward", recorded)
    q, k, v, slope, h0 = _inputs(2, 2, 1, 150, 8, 12, torch.float64, seed=3, init=True)
    named = dict(q=q, k=k, v=v, slope=slope, h0=h0)
    for name, x in named.items():
        x.requires_grad_(name in needs)
    o, st_ = lightning_attention(q, k, v, slope, initial_state=h0, output_final_state=True,
                                 impl="chunked", block_size=16, checkpoint_every=2)
    refs = {n: x.detach().clone().requires_grad_(n in needs) for n, x in named.items()}
    o_r, st_r = lightning_attention_reference(refs["q"], refs["k"], refs["v"], refs["slope"],
                                              1.0, refs["h0"])
    gen = torch.Generator().manual_seed(1)
    go = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    gs = torch.randn(st_.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad((o * go).sum() + (st_ * gs).sum(), [named[n] for n in needs])
    want = torch.autograd.grad((o_r * go).sum() + (st_r * gs).sum(), [refs[n] for n in needs])
    for name, g, w in zip(needs, got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9,
                                   msg=lambda m, n=name: f"d{n}: {m}")
    assert seen == [("q" in needs, bool({"k", "v", "h0"} & set(needs)))], seen


@pytest.mark.parametrize("varlen", [False, True])
def test_unused_outputs_get_no_zero_gradients_and_either_output_alone_is_exact(varlen):
    """The forward op's checkpoints are state for the backward (no gradient flows into them),
    and an output that does not reach the loss gets no zero-filled gradient (autograd filled
    the checkpoints' and the final state's before); a loss on only o, or only the final state,
    still gets the float64 reference's gradients (dense and packed)."""
    from tests.helpers import ZeroFills

    q, k, v, slope, h0 = _inputs(1, 2, 1, 40, 8, 4, torch.float64, init=True)
    kw = dict(cu_seqlens=torch.tensor([0, 15, 40])) if varlen else {}
    h0 = h0.detach()[:1].expand(2 if varlen else 1, -1, -1, -1).clone().requires_grad_()
    if not varlen:
        outs = torch.ops.graphopt.lightning_attention_fwd(q, k, v, slope, 1.0, h0, 16, 2,
                                                          "chunked")
        assert outs[0].requires_grad and not outs[2].requires_grad

    ins = (q, k, v, slope, h0)
    ref_in = [x.detach().requires_grad_() for x in ins]
    for pick in (0, 1):
        o, state = lightning_attention(q, k, v, slope, initial_state=h0,
                                       output_final_state=True, block_size=16, **kw)
        with ZeroFills() as fills:
            got = torch.autograd.grad((o, state)[pick].square().sum(), ins)
        if pick == 0:
            state_shape = tuple(state.shape)
            assert state_shape not in fills.shapes, fills.shapes
        if varlen:
            outs, states = [], []
            for i, (a, b) in enumerate([(0, 15), (15, 40)]):
                o_r, s_r = lightning_attention_reference(
                    ref_in[0][:, :, a:b], ref_in[1][:, :, a:b], ref_in[2][:, :, a:b],
                    ref_in[3], 1.0, ref_in[4][i:i + 1])
                outs.append(o_r)
                states.append(s_r)
            o_r, s_r = torch.cat(outs, 2), torch.cat(states)
        else:
            o_r, s_r = lightning_attention_reference(*ref_in[:4], 1.0, ref_in[4])
        want = torch.autograd.grad((o_r, s_r)[pick].square().sum(), ref_in, allow_unused=True)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, torch.zeros_like(g) if w is None else w,
                                       rtol=1e-9, atol=1e-9)


def test_plain_eager_calls_skip_the_custom_op_and_equal_it_bit_for_bit(monkeypatch):
    """In plain eager mode the public function runs the op's implementation through an
    autograd.Function (no custom-op dispatch: host time, benchmarks/lightning_host.py);
    outputs and every gradient equal the custom op's bit for bit (GQA, initial state, trained
    slope, final state in the loss). Under a dispatch mode, FakeTensor, a function mode or a
    functorch transform the custom op is taken."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    import graphopt.kernels.lightning.op as op

    q, k, v, slope, h0 = _inputs(2, 4, 2, 50, 8, 4, torch.float64, init=True)
    ins = (q, k, v, slope, h0)
    calls = []
    monkeypatch.setattr(op._EagerLightning, "apply",
                        lambda *a, real=op._EagerLightning.apply: calls.append(1) or real(*a))
    o, state = lightning_attention(q, k, v, slope, initial_state=h0, output_final_state=True,
                                   block_size=16)
    assert calls == [1]
    got = torch.autograd.grad((o.square().sum() + state.sum()), ins)
    o2, state2, _ = torch.ops.graphopt.lightning_attention_fwd(q, k, v, slope, 1.0, h0, 16, 8,
                                                               "chunked")
    want = torch.autograd.grad((o2.square().sum() + state2.sum()), ins)
    assert torch.equal(o, o2) and torch.equal(state, state2)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert op.plain_eager(q, None)

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Watch():
        assert not op.plain_eager(q)
    with FakeTensorMode():
        assert not op.plain_eager(q)
    with torch.device("cpu"):  # a torch function mode
        assert not op.plain_eager(q)
    seen = []
    torch.func.grad(lambda x: seen.append(op.plain_eager(x)) or x.sum())(q.detach())
    assert seen == [False]
    assert not op.plain_eager(q.to("meta"))


def test_eager_path_refuses_double_backward_and_hands_vmap_and_tracing_to_the_op():
    """What the eager autograd.Function must not change (a review found all three after
    it landed): double backward raises as the custom op does (through the chunked path's
    torch ops it gave a silently wrong second-order gradient, with the saved states taken
    as constants); a batched backward (is_grads_batched, which vmaps the backward) equals
    one backward per row; torch.jit.trace records the custom op; non-reentrant
    checkpointing works (the backward unpacks the saved tensors once)."""
    q, k, v, slope, _ = _inputs(1, 2, 1, 24, 4, 4, torch.float64)
    o = lightning_attention(q, k, v, slope, block_size=8, checkpoint_every=1)
    (g,) = torch.autograd.grad(o.square().sum(), q, create_graph=True)
    with pytest.raises(NotImplementedError, match="lightning_attention has no double backward"):
        torch.autograd.grad(g.square().sum(), k)
    o = lightning_attention(q, k, v, slope, block_size=8)
    rows = torch.randn(3, *o.shape, dtype=torch.float64)
    batched = torch.autograd.grad(o, (q, k), rows, is_grads_batched=True, retain_graph=True)
    for i in range(3):
        for got, want in zip(batched, torch.autograd.grad(o, (q, k), rows[i],
                                                          retain_graph=True)):
            torch.testing.assert_close(got[i], want, rtol=1e-12, atol=1e-12)
    traced = torch.jit.trace(lambda *a: lightning_attention(*a, block_size=16),
                             (q.detach(), k.detach(), v.detach(), slope.detach()))
    assert "graphopt::lightning_attention_fwd" in str(traced.graph)
    # non-reentrant checkpointing unpacks each saved tensor once (an unpack twice is refused)
    ckpt = torch.utils.checkpoint.checkpoint(
        lambda *a: lightning_attention(*a, block_size=8), q, k, v, slope, use_reentrant=False)
    for got, want in zip(torch.autograd.grad(ckpt.square().sum(), (q, k, v, slope)),
                         torch.autograd.grad(o.square().sum(), (q, k, v, slope))):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("varlen", [False, True])
def test_torch_func_transforms_match_the_reference(varlen):
    """torch.func.grad, vjp, jacrev and per-sample gradients (vmap of grad) through
    lightning_attention equal the float64 reference's (they raised: the autograd.Function
    torch.library generates for a custom op has no setup_context, pytorch#168393), dense
    (GQA, initial state, final state, trained slope) and packed; a gradient of a gradient is
    refused by name, not silently wrong."""
    from torch.func import grad, jacrev, vjp, vmap

    q, k, v, slope, h0 = (x.detach() for x in _inputs(2, 4, 2, 21, 4, 3, torch.float64,
                                                          init=True))
    spans = [(0, 8), (8, 21)]
    if varlen:  # two packed sequences in one row
        q, k, v = (x[:1] for x in (q, k, v))
        h0 = h0[:1].expand(2, -1, -1, -1).contiguous()
    kw = dict(block_size=8, cu_seqlens=torch.tensor([0, 8, 21])) if varlen else \
        dict(block_size=8, checkpoint_every=1)

    def loss(fn, q, k, v, slope, h0):
        o, state = fn(q, k, v, slope, h0)
        return o.square().sum() + (state * state.flip(-1)).sum()

    def ours(q, k, v, slope, h0):
        return lightning_attention(q, k, v, slope, initial_state=h0, output_final_state=True,
                                   **kw)

    def ref(q, k, v, slope, h0):
        if not varlen:
            return lightning_attention_reference(q, k, v, slope, 1.0, h0)
        outs = [lightning_attention_reference(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], slope,
                                              1.0, h0[i:i + 1]) for i, (a, b) in enumerate(spans)]
        return torch.cat([o for o, _ in outs], 2), torch.cat([s for _, s in outs])

    ins = (q, k, v, slope, h0)
    got = grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2, 3, 4))(*ins)
    want = grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2, 3, 4))(*ins)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)
    cot = torch.randn(q.shape[:3] + (3,), dtype=torch.float64)
    (o, _), pull = vjp(ours, *ins)
    (o_r, _), pull_r = vjp(ref, *ins)
    torch.testing.assert_close(o, o_r, rtol=1e-10, atol=1e-12)
    for g, w in zip(pull((cot, torch.zeros_like(h0))), pull_r((cot, torch.zeros_like(h0)))):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)
    small = (q[..., :5, :], k[..., :5, :], v[..., :5, :])
    if not varlen:
        jac = jacrev(lambda x: lightning_attention(x, *small[1:], slope, **kw))(small[0])
        jac_r = jacrev(lambda x: lightning_attention_reference(x, *small[1:], slope, 1.0)[0])(
            small[0])
        torch.testing.assert_close(jac, jac_r, rtol=1e-9, atol=1e-10)
        # per-sample gradients: one gradient per batch row
        rows = vmap(grad(lambda q1, k1, v1: loss(ours, q1[None], k1[None], v1[None], slope,
                                                 h0[:1])))(q, k, v)
        rows_r = vmap(grad(lambda q1, k1, v1: loss(ref, q1[None], k1[None], v1[None], slope,
                                                   h0[:1])))(q, k, v)
        torch.testing.assert_close(rows, rows_r, rtol=1e-9, atol=1e-10)
    with pytest.raises(RuntimeError, match="lightning_attention.*first-order backward only"):
        grad(lambda x: grad(lambda y: loss(ours, y, k, v, slope, h0))(x).sum())(q)
    with pytest.raises(NotImplementedError, match="lightning_attention.*forward-mode"):
        torch.func.hessian(lambda x: loss(ours, x, k, v, slope, h0))(q)
    if varlen:
        return
    # vmap inside a reverse transform, and a vmapped forward then .backward() (under vmap
    # functorch hands the backward a wrapper context: a review found its attributes lost)
    g_in = grad(lambda x: vmap(lambda r: loss(ours, r[None], k[:1], v[:1], slope, h0[:1]))(
        x).sum())(q)
    g_ref = grad(lambda x: vmap(lambda r: loss(ref, r[None], k[:1], v[:1], slope, h0[:1]))(
        x).sum())(q)
    torch.testing.assert_close(g_in, g_ref, rtol=1e-9, atol=1e-10)
    grads = []
    for fn in (ours, ref):
        leaves = [x.clone().requires_grad_() for x in (q, slope)]
        vmap(lambda r, fn=fn, s=leaves[1]: fn(r[None], k[:1], v[:1], s, h0[:1])[0])(
            leaves[0]).square().sum().backward()
        grads.append([x.grad for x in leaves])
    for g, w in zip(*grads):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)


def test_packed_sequences_refuse_int32_overflow_and_a_batched_packing():
    """Two refusals a review asked for: T >= 2^31 packed tokens (the chunk table is int32: a
    valid cu_seqlens passed its check and wrapped around), and cu_seqlens batched by vmap (an
    unclear storage error before)."""
    big = torch.empty(1, 1, 2**31, 1, device="meta")
    with pytest.raises(ValueError, match="at most 2\\^31 - 1 tokens"):
        lightning_attention(big, big, big, torch.zeros(1, device="meta"),
                            cu_seqlens=torch.tensor([0, 2**31], device="meta"))
    q = torch.randn(1, 2, 12, 4)
    cus = torch.tensor([[0, 5, 12], [0, 7, 12]])
    slope = torch.rand(2)
    with pytest.raises(ValueError, match="cu_seqlens is batched by vmap"):
        torch.func.vmap(lambda cu: lightning_attention(q, q, q, slope, cu_seqlens=cu))(cus)


@pytest.mark.parametrize("packed", [False, True])
def test_chunked_path_keeps_float32_math_under_bf16_autocast(packed):
    """graphopt.parallel's bf16 mixed precision runs the forward under autocast; eager calls
    of the chunked path rounded every matmul to bf16 (outputs 6.0e-3 off, states 3.5e-3; a
    review), compiled ones did not. The result equals the call without autocast."""
    q, k, v, slope, h0 = _inputs(1, 2, 2, 40, 16, 16, torch.float32, init=True)
    kw = dict(scale=0.5, output_final_state=True, block_size=16, impl="chunked")
    if packed:
        kw["cu_seqlens"] = torch.tensor([0, 13, 40])
        h0 = torch.cat([h0, h0 * 0.5]).detach().requires_grad_()
    plain = lightning_attention(q, k, v, slope, initial_state=h0, **kw)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = lightning_attention(q, k, v, slope, initial_state=h0, **kw)
    for a, b in zip(mixed, plain):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_cu_seqlens_as_a_list_gets_the_clear_error():
    q = torch.randn(1, 2, 20, 16)
    with pytest.raises(TypeError, match="cu_seqlens must be a 1-D integer tensor"):
        lightning_attention(q, q, q, torch.rand(2), cu_seqlens=[0, 5, 20], impl="chunked")


def test_the_forward_op_checks_kv_heads_itself():
    """A graph may call graphopt::lightning_attention_fwd directly (the attention pass
    does): K with 1 head and V with 4 was run (the Triton kernel read V out of bounds, a
    review); the op checks the shapes itself."""
    import graphopt.kernels.lightning  # noqa: F401  (registers the ops)

    q, v = torch.randn(1, 4, 20, 8), torch.randn(1, 4, 20, 8)
    k, slope = torch.randn(1, 1, 20, 8), torch.rand(4)
    with pytest.raises(ValueError, match=r"v must be \[B, Hk, S, Dv\] = \[1, 1, 20, Dv\]"):
        torch.ops.graphopt.lightning_attention_fwd(q, k, v, slope, 1.0, None, 16, 8, "chunked")


@pytest.mark.parametrize("bad", [[0, 6, 5, 10], [0, 5, 8], [0, 5, 12], [0, 5, 5, 10]])
def test_the_packed_forward_op_checks_cu_seqlens_itself(bad):
    """graphopt::lightning_attention_varlen_fwd called directly with impl="chunked" and a
    bad packing returned o of 11 or 8 rows for q's 10 (its fake says 10), where the Triton
    path raised (a review)."""
    import graphopt.kernels.lightning  # noqa: F401  (registers the ops)

    q = torch.randn(1, 2, 10, 16)
    # (an empty sequence, [0, 5, 5, 10]: the message says to drop its offset, a review)
    with pytest.raises(ValueError, match=r"cu_seqlens must increase strictly from 0 to S = 10 "
                       r"\(every sequence holds a token: drop the repeated offset"):
        torch.ops.graphopt.lightning_attention_varlen_fwd(
            q, q, q, torch.rand(2), 1.0, None, torch.tensor(bad), 16, "chunked")


@pytest.mark.parametrize("op", ["lightning", "lightning_varlen", "moe"])
def test_double_backward_is_refused_with_what_to_do(op):
    """A second backward through graphopt's ops (create_graph=True: gradient penalties,
    Hessian-vector products) said only "no autograd formula was registered" on the backward
    op (a review); the error now names the op and what to use instead."""
    from graphopt.kernels.moe import moe_experts

    gen = torch.Generator().manual_seed(0)
    if op == "moe":
        x = torch.randn(6, 8, dtype=torch.float64, generator=gen, requires_grad=True)
        weights, index = torch.randn(6, 4, dtype=torch.float64, generator=gen).softmax(-1).topk(2)
        out = moe_experts(x, index, weights, torch.randn(4, 12, 8, dtype=torch.float64),
                          torch.randn(4, 8, 6, dtype=torch.float64))
        name, fix = "graphopt::moe_experts", "keep transformers' experts"
    else:
        x = torch.randn(1, 2, 12, 4, dtype=torch.float64, generator=gen, requires_grad=True)
        packed = {"cu_seqlens": torch.tensor([0, 5, 12])} if op == "lightning_varlen" else {}
        out = lightning_attention(x, x, x, torch.rand(2, dtype=torch.float64), impl="chunked",
                                  **packed)
        name, fix = "graphopt::lightning_attention", "lightning_attention_reference"
    out = out[0] if isinstance(out, tuple) else out
    (grad,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    with pytest.raises(NotImplementedError, match=f"{name}.* has no double backward.*{fix}"):
        grad.square().sum().backward()


def test_a_symbolic_scale_traces_in_one_graph():
    """``scale=q.shape[-1] ** -0.5`` under dynamic=True, and a float scale argument whose
    value changes (automatic dynamic makes it symbolic), compile with fullgraph=True (a
    review: the finiteness check, math.isfinite, broke the graph); outputs and gradients
    equal eager at each head dim and scale."""
    from graphopt.testing import assert_matches_eager

    slope = torch.tensor([0.2, 0.9], dtype=torch.float64)

    def by_head_dim(q, k, v):
        return lightning_attention(q, k, v, slope, scale=q.shape[-1] ** -0.5)[0]

    def by_argument(q, k, v, scale):
        return lightning_attention(q, k, v, slope, scale=scale)[0]

    options = {"lowering": "eager"}
    compiled = torch.compile(by_head_dim, backend="graphopt", options=options, dynamic=True,
                             fullgraph=True)
    for head_dim in (8, 12):
        args = [torch.randn(1, 2, 12, head_dim, dtype=torch.float64, requires_grad=True)
                for _ in range(3)]
        assert_matches_eager(by_head_dim, compiled, args, rtol=1e-12, atol=1e-12)
    compiled = torch.compile(by_argument, backend="graphopt", options=options, fullgraph=True)
    args = [torch.randn(1, 2, 12, 8, dtype=torch.float64, requires_grad=True)
            for _ in range(3)]
    for scale in (0.3, 0.7, 1.1):
        torch.testing.assert_close(compiled(*args, scale), by_argument(*args, scale),
                                   rtol=1e-12, atol=1e-12)
