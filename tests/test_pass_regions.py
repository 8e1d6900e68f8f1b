"""Model passes inside torch.utils.checkpoint regions (graphopt/passes/regions.py): the
attention and MoE passes rewrite the layers transformers' gradient checkpointing wraps, the
region stays a region (recomputed in the backward), and refusals inside it are reported."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import graphopt
from graphopt.config import GraphoptConfig as Config
from graphopt.models import build_model, sample_batch
from graphopt.passes.regions import CHECKPOINT
from graphopt.testing import (
    as_function,
    assert_matches_eager,
    bind_inputs,
    run_pass,
    trace_for_pass,
)

LIGHTNING = "graphopt.lightning_attention_fwd.default"


def float64_tables(model):
    """Rebuild MiniMax's slope and decay buffers in float64 (transformers builds them in
    float32 before ``.to(float64)``: the rewrite, exact, would differ from eager by their
    float32 rounding, ~1e-7), so float64 comparisons can be tight."""
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    for m in model.modules():
        if isinstance(m, MiniMaxLightningAttention):
            default = torch.get_default_dtype()
            torch.set_default_dtype(torch.float64)
            try:
                slope = m.get_slope_rate()
                tables = m.decay_factors(slope)
            finally:
                torch.set_default_dtype(default)
            m.slope_rate = slope
            m.query_decay, m.key_decay, m.diagonal_decay = tables
    return model


def _layer():
    from transformers import MiniMaxConfig
    from transformers.models.minimax import modeling_minimax as mm

    config = MiniMaxConfig(hidden_size=32, num_attention_heads=2, head_dim=16, block_size=16,
                           num_hidden_layers=1, layer_types=["linear_attention"])
    torch.manual_seed(0)
    attn = float64_tables(mm.MiniMaxLightningAttention(config, layer_idx=0).double())

    def body(x):
        return attn(x, position_embeddings=None, attention_mask=None)[0]

    def fn(x):
        return checkpoint(body, x, use_reentrant=False).tanh()

    return attn, fn, torch.randn(2, 40, 32, dtype=torch.float64, requires_grad=True)


class DecayedLinearAttention(torch.nn.Module):
    """RetNet-style parallel form in a checkpoint region; its decay matrix built inside the
    region from a buffer, or outside it and passed in."""

    def __init__(self, decay_outside):
        super().__init__()
        self.register_buffer("slope", torch.tensor([0.5, 0.1], dtype=torch.float64))
        self.decay_outside = decay_outside

    def decay(self, s):
        gap = torch.arange(s, dtype=torch.float64).view(-1, 1) - torch.arange(
            s, dtype=torch.float64).view(1, -1)
        return torch.exp(-self.slope.view(-1, 1, 1) * gap.clamp(min=0)) * (gap >= 0)

    def body(self, q, k, v, decay):
        decay = self.decay(q.shape[2]) if decay is None else decay
        return ((q @ k.transpose(-1, -2)) * decay) @ v

    def forward(self, q, k, v):
        decay = self.decay(q.shape[2]) if self.decay_outside else None
        return checkpoint(self.body, q, k, v, decay, use_reentrant=False)


def test_block_loop_inside_a_checkpoint_region_is_rewritten_there():
    attn, fn, x = _layer()
    gm = trace_for_pass(fn, x)
    assert len(gm.graph.find_nodes(op="call_function", target=CHECKPOINT)) == 1
    gm, record = run_pass("attention", gm, Config(attention="exact"),
                          example_inputs=bind_inputs(gm, fn, x))
    (site,) = record.sites
    assert site.action == "rewritten" and site.site.startswith("checkpoint wrap_body0: ")
    assert "block loop of 3 blocks" in site.reason
    assert record.modified and record.op_delta[LIGHTNING] == 1  # counted inside the body
    assert record.op_delta["aten.matmul.default"] == -12
    # Still one checkpoint region, now holding the op.
    (call,) = gm.graph.find_nodes(op="call_function", target=CHECKPOINT)
    body = getattr(gm, str(call.args[0].target))
    assert any("lightning_attention_fwd" in str(n.target) for n in body.graph.nodes)
    assert_matches_eager(fn, as_function(gm, fn), [x], params=list(attn.parameters()),
                         rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("outside", [False, True])
def test_parallel_form_in_a_region_and_a_refusal_reported_with_the_region(outside):
    """A decay matrix built inside the region from a buffer is frozen and rewritten; one
    computed outside reaches the body as an input without a known value: kept, and the
    report says why and in which region."""
    model = DecayedLinearAttention(outside)
    qkv = [torch.randn(2, 2, 24, 8, dtype=torch.float64, requires_grad=True)
           for _ in range(3)]
    gm = trace_for_pass(model, *qkv)
    gm, record = run_pass("attention", gm, Config(attention="exact"),
                          example_inputs=bind_inputs(gm, model, *qkv))
    (site,) = record.sites
    assert site.site.startswith("checkpoint wrap_body0: ")
    if outside:
        assert site.action == "skipped" and "depends on an input" in site.reason
        assert not record.modified and record.op_delta == {}
    else:
        assert site.action == "rewritten" and "parallel form" in site.reason
        assert record.op_delta[LIGHTNING] == 1
    assert_matches_eager(model, as_function(gm, model), qkv, rtol=1e-12, atol=1e-12)


def _saved_bytes(fn, *args):
    """Bytes autograd saves for the backward of ``fn(*args)`` (saved-tensor hooks)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    out.sum().backward()
    return total


@pytest.mark.parametrize("checkpointing", [False, True])
def test_minimax_with_gradient_checkpointing_is_rewritten_and_still_checkpointed(
        checkpointing):
    """transformers' gradient_checkpointing_enable(): the attention and MoE passes rewrite
    inside each layer's region; logits and every gradient equal eager and aot_eager in
    float64; and the compiled model saves no more for the backward than aot_eager does, so
    the regions are still recomputed (without checkpointing it saves several times more)."""
    model = float64_tables(build_model("minimax", dtype=torch.float64))
    model.train()
    model.set_experts_implementation("batched_mm")  # one graph: the eager loop graph-breaks
    if checkpointing:
        model.gradient_checkpointing_enable()
    ids = sample_batch(model, batch=2, seq=48)

    def fn(i):
        return model(input_ids=i, use_cache=False).logits

    compiled = torch.compile(fn, backend="graphopt", options={
        "lowering": "eager", "attention": "exact", "moe": {}})
    aot = torch.compile(fn, backend="aot_eager")
    params = list(model.parameters())
    assert_matches_eager(fn, compiled, [ids], params=params, rtol=1e-12, atol=1e-12)
    assert_matches_eager(aot, compiled, [ids], params=params, rtol=1e-12, atol=1e-12)
    # The rewritten graph is what ran (a fallback to Dynamo's graph would also match eager).
    assert [r.fallback for r in graphopt.reports()] == [None] * len(graphopt.reports())
    sites = {p.name: p.sites for r in graphopt.reports() for p in r.passes}
    rewritten = [s.site for name in ("attention", "moe") for s in sites[name]
                 if s.action == "rewritten"]
    # The linear-attention layer, the softmax layer's SDPA mask (-> is_causal; in a region
    # proven where the parent builds it), two MoE layers.
    assert len(rewritten) == 4, rewritten
    assert all(s.startswith("checkpoint ") == checkpointing for s in rewritten), rewritten
    saved, saved_aot = _saved_bytes(compiled, ids), _saved_bytes(aot, ids)
    if checkpointing:
        assert saved <= 1.1 * saved_aot, (saved, saved_aot)
    else:
        assert saved < saved_aot  # the rewrites save less than the loops they replace


def _llama(checkpointing):
    model = build_model("llama", dtype=torch.float64)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model, sample_batch(model, batch=2, seq=24)


def test_causal_mask_built_outside_the_region_is_proven_there_and_dropped():
    """Llama with gradient checkpointing: the causal mask is built in the parent graph and
    enters each layer's region as an input; it is proven causal where it is built, each
    SDPA gets is_causal, and the unused mask inputs (and the mask itself) are removed."""
    model, ids = _llama(True)

    def fn(i):
        return model(input_ids=i, use_cache=False).logits

    gm = trace_for_pass(fn, ids)
    calls = gm.graph.find_nodes(op="call_function", target=CHECKPOINT)
    before = [len(c.args) for c in calls]
    gm, record = run_pass("attention", gm, Config(attention="exact"),
                          example_inputs=bind_inputs(gm, fn, ids))
    assert [s.action for s in record.sites] == ["rewritten"] * 2, record.sites
    assert all(s.site.startswith("checkpoint wrap_body") and "is_causal=True" in s.reason
               for s in record.sites)
    after = [len(c.args) for c in gm.graph.find_nodes(op="call_function", target=CHECKPOINT)]
    assert after == [n - 1 for n in before]  # the mask input of each region
    assert_matches_eager(fn, as_function(gm, fn), [ids], params=list(model.parameters()),
                         rtol=1e-12, atol=1e-12)


def test_lightning_conversion_is_the_same_with_and_without_checkpointing():
    """attention='lightning' (approximate) inside regions: the same sites converted with the
    same per-layer MiniMax slopes (the layer count is the whole model's, not a region's), so
    the checkpointed compile equals the plain one."""
    results = []
    for checkpointing in (False, True):
        graphopt.clear_reports()
        model, ids = _llama(checkpointing)
        compiled = torch.compile(lambda i, m=model: m(input_ids=i, use_cache=False).logits,
                                 backend="graphopt",
                                 options={"lowering": "eager", "attention": "lightning"})
        results.append(compiled(ids))
        sites = [s for r in graphopt.reports() for p in r.pass_records("attention")
                 for s in p.sites]
        assert [s.reason.startswith("APPROXIMATE") for s in sites] == [True, True], sites
        assert [r.fallback for r in graphopt.reports()] == [None], graphopt.reports()[0].notes
    torch.testing.assert_close(results[1], results[0], rtol=1e-12, atol=1e-12)


class MaskedLayer(torch.nn.Module):
    """SDPA under a causal mask that is edited in place through a view (a prefix-LM mask)
    before use, inside a checkpoint region or not; or plain regions nested two deep."""

    def __init__(self, variant):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96, dtype=torch.float64)
        self.variant = variant

    def attend(self, x, mask):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 16).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, s, 32)

    def forward(self, x):
        s = x.shape[1]
        mask = torch.full((s, s), torch.finfo(x.dtype).min, dtype=x.dtype).triu(1)
        mask = mask[None, None].expand(x.shape[0], 1, -1, -1).clone()
        if self.variant == "nested":
            return checkpoint(lambda y, m: checkpoint(self.attend, y, m, use_reentrant=False),
                              x, mask, use_reentrant=False)
        mask[:, :, :, :4] = 0.0  # the 4 prefix tokens are visible to all: not causal
        if self.variant == "prefix_lm_region":
            return checkpoint(self.attend, x, mask, use_reentrant=False)
        return self.attend(x, mask)


@pytest.mark.parametrize("variant", ["prefix_lm", "prefix_lm_region", "nested"])
def test_masks_written_in_place_are_not_proven_and_nested_regions_are_entered(variant):
    """A mask written through a view after it was built is not what evaluating its inputs
    gives: kept, with that reason (it was 'proven causal' and dropped: wrong outputs). Regions
    nested two deep are entered, and the mask built two levels out is proven there."""
    model = MaskedLayer(variant)
    x = torch.randn(2, 8, 32, dtype=torch.float64, requires_grad=True)
    gm = trace_for_pass(model, x)
    gm, record = run_pass("attention", gm, Config(attention="exact"),
                          example_inputs=bind_inputs(gm, model, x))
    (site,) = record.sites
    if variant == "nested":
        assert site.action == "rewritten" and "is_causal=True" in site.reason
        assert site.site.startswith("checkpoint wrap_body0: checkpoint wrap_body0: ")
    else:
        assert site.action == "kept" and "is written in place in the graph" in site.reason
    assert_matches_eager(model, as_function(gm, model), [x], params=list(model.parameters()),
                         rtol=1e-12, atol=1e-12)


def test_nested_regions_compile_without_falling_back():
    model = MaskedLayer("nested")
    x = torch.randn(2, 8, 32, dtype=torch.float64, requires_grad=True)
    compiled = torch.compile(model, backend="graphopt",
                             options={"lowering": "eager", "attention": "exact"})
    assert_matches_eager(model, compiled, [x], params=list(model.parameters()),
                         rtol=1e-12, atol=1e-12)
    assert [r.fallback for r in graphopt.reports()] == [None]


@pytest.mark.parametrize("verify", [False, True])
def test_a_compiled_layer_inside_a_user_checkpoint_compiles_on_its_first_call(verify):
    """``checkpoint(compiled_layer)`` (activation checkpointing outside the compiled
    function, as graphopt.parallelize does for a plan's recomputation with tp > 1): the first
    call compiles inside the checkpoint's saved-tensor hooks. graphopt's compile-time work
    (and verify on the first call) saved tensors there, counted as the region's, and the
    backward raised "A different number of tensors was saved during the original forward
    and recomputation"; with aot_eager it worked. Gradients equal eager, for the full and
    the selective policy."""
    import functools

    from graphopt.parallel.apply import _checkpointed  # checkpoint(f, context_fn=policy)

    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    for full in (True, False):
        torch._dynamo.reset()
        ref, model = (build_model("llama", torch.float64) for _ in range(2))
        for layer in model.model.layers:
            inner = torch.compile(layer.forward, backend="graphopt",
                                  options={"lowering": "eager", "verify": verify})
            layer.forward = functools.partial(_checkpointed, inner, full)
        model(input_ids=ids, use_cache=False).logits.sum().backward()
        ref(input_ids=ids, use_cache=False).logits.sum().backward()
        assert graphopt.last_report().fallback is None
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)


class WritesInRegion(torch.nn.Module):
    """A checkpointed block writes a buffer or an operand in place; the parent graph reads it
    around the region (a review: the passes looked at the parent graph only)."""

    def __init__(self, variant):
        super().__init__()
        self.variant = variant
        self.lin = torch.nn.Linear(4, 4, dtype=torch.float64)
        self.register_buffer("s", torch.ones(4, dtype=torch.float64))
        self.register_buffer("mask", torch.ones(6, 6, dtype=torch.bool).tril())

    def forward(self, x):
        if self.variant == "buffer":  # remove_noops: `s * 1` taken for `s`
            snap = self.s * 1

            def body(y):
                self.s.add_(1)
                return torch.tanh(self.lin(y))
            return checkpoint(body, x, use_reentrant=False) * snap
        if self.variant == "nested":  # the write two regions deep
            def outer(y):
                snap = self.s * 1

                def inner(z):
                    self.s.mul_(2)
                    return torch.tanh(self.lin(z))
                return checkpoint(inner, y, use_reentrant=False) * snap
            return checkpoint(outer, x, use_reentrant=False)
        if self.variant == "operand":  # cse: two zeros() merged, one written in the region
            acc_a, acc_b = torch.zeros(4, dtype=x.dtype), torch.zeros(4, dtype=x.dtype)

            def block(y, acc):
                acc.add_(self.lin(y).sum(0))
                return y * 2
            y = checkpoint(block, x, acc_a, use_reentrant=False)
            return y.sum(0) + acc_b, acc_a.sum()
        # attention="exact": a causal mask buffer made prefix-LM inside a region before use

        def prefix(y):
            self.mask[:, :2] = True
            return torch.tanh(y)
        y = checkpoint(prefix, x, use_reentrant=False)
        q = k = v = self.lin(y).view(1, 6, 2, 2).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=self.mask).sum(1)


@pytest.mark.parametrize("variant", ["buffer", "nested", "operand", "mask"])
def test_writes_inside_a_checkpoint_region_are_seen_by_the_passes(variant):
    """remove_noops, cse and the attention pass take a value written in place inside a
    checkpoint body for written (fx_utils.region_writes): outputs and gradients equal eager
    (they were 0.68 / 1.0 / 1.04 / 0.61 off, a review), and the attention pass says why it
    kept the mask."""
    torch.manual_seed(0)
    x = torch.randn(6 if variant == "mask" else 3, 4, dtype=torch.float64)
    if variant == "mask":
        x = x[None]
    grad = variant != "operand"  # eager refuses an operand written under non-reentrant checkpoint
    x.requires_grad_(grad)
    options = {"lowering": "eager", "attention": "exact"}
    with torch.set_grad_enabled(grad):
        want_model, got_model = WritesInRegion(variant), WritesInRegion(variant)
        got_model.load_state_dict(want_model.state_dict())
        want = want_model(x)
        got = torch.compile(got_model, backend="graphopt", options=options)(x)
    want, got = ([t] if isinstance(t, torch.Tensor) else list(t) for t in (want, got))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_model.s, want_model.s)
    (report,) = graphopt.reports()
    assert report.fallback is None, report.notes
    if grad:
        gx = torch.autograd.grad(sum(t.sum() for t in got), x)
        wx = torch.autograd.grad(sum(t.sum() for t in want), x)
        torch.testing.assert_close(gx, wx, rtol=1e-12, atol=1e-12)
    if variant == "mask":
        (site,) = [s for p in report.passes if p.name == "attention" for s in p.sites]
        assert site.action == "kept" and "is written" in site.reason, site
