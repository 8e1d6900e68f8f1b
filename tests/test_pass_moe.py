"""Pass "moe": experts regions -> graphopt::moe_experts. Pass level (graph in, ops out,
refusals with reasons) and real transformers MoE models (Mixtral, Qwen3-MoE, MiniMax,
DeepSeek-V3) in float64: logits and every parameter gradient equal eager."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from graphopt.config import GraphoptConfig
from graphopt.errors import ConfigError
from graphopt.models import build_model, sample_batch
from graphopt.report import clear_reports, reports
from graphopt.testing import (
    as_function,
    assert_matches_eager,
    bind_inputs,
    run_pass,
    trace_for_pass,
)

MOE_OPTIONS = GraphoptConfig.from_options({"moe": {}})


def _block(impl: str = "batched_mm", act: str = "silu", experts: int = 4):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=experts,
                           num_experts_per_tok=2, hidden_act=act)
    config._experts_implementation = impl
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(config).double()
    block.config = config
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block


def _sites(record, action):
    return [s for s in record.sites if s.action == action]


@pytest.mark.parametrize("impl", ["batched_mm", "grouped_mm"])
def test_experts_region_becomes_one_moe_op(impl):
    block = _block(impl)
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    gm = trace_for_pass(block, x)
    inputs = bind_inputs(gm, block, x)
    out, record = run_pass("moe", gm, MOE_OPTIONS, example_inputs=inputs)
    assert record.op_delta.get("graphopt.moe_experts.default") == 1
    removed = "aten.bmm.default" if impl == "batched_mm" else \
        "transformers.grouped_mm_fallback.default"
    assert record.op_delta.get(removed, 0) < 0
    (site,) = _sites(record, "rewritten")
    assert "E=4, K=2, T=10, router softmax" in site.reason and "dropless" in site.reason
    compiled = as_function(out, block)

    def reference(x):  # torch._grouped_mm has no float64 kernel: batched_mm is the reference
        block.config._experts_implementation = "batched_mm"
        try:
            return block(x)
        finally:
            block.config._experts_implementation = impl

    assert_matches_eager(reference, compiled, [x], list(block.parameters()), rtol=1e-10,
                         atol=1e-12)


def test_without_moe_option_sites_are_kept_and_reported():
    block = _block()
    x = torch.randn(1, 4, 16, dtype=torch.float64)
    gm = trace_for_pass(block, x)
    _, record = run_pass("moe", gm, GraphoptConfig(), example_inputs=bind_inputs(gm, block, x))
    assert not record.modified
    (site,) = _sites(record, "kept")
    assert "options={'moe': {}}" in site.reason


def test_non_silu_experts_are_refused_with_the_reason():
    block = _block(act="gelu")
    x = torch.randn(1, 4, 16, dtype=torch.float64)
    gm = trace_for_pass(block, x)
    _, record = run_pass("moe", gm, MOE_OPTIONS, example_inputs=bind_inputs(gm, block, x))
    assert not record.modified
    (site,) = _sites(record, "skipped")
    assert "not SiLU" in site.reason


class _NotExperts(torch.nn.Module):
    """Same interface and SiLU, another function: y = silu(x @ W1[0]^T)[:, :H] * w0."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(4, 48, 16, dtype=torch.float64))
        self.down_proj = torch.nn.Parameter(torch.randn(4, 16, 24, dtype=torch.float64))

    def forward(self, x, index, weights):
        h = torch.nn.functional.silu(x @ self.gate_up_proj[0].t())[:, :16]
        return h * weights[:, :1] + index[:, :1] * 0 + (self.down_proj.sum() * 0)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(16, 4, dtype=torch.float64)
        self.experts = _NotExperts()

    def forward(self, x):
        w, i = torch.topk(self.router(x).softmax(-1), 2)
        return self.experts(x, i, w)


def test_a_region_that_computes_something_else_fails_the_probe():
    block = _Block()
    x = torch.randn(6, 16, dtype=torch.float64)
    gm = trace_for_pass(block, x)
    _, record = run_pass("moe", gm, MOE_OPTIONS, example_inputs=bind_inputs(gm, block, x))
    assert not record.modified
    (site,) = _sites(record, "skipped")
    assert "probe mismatch" in site.reason


def test_eager_experts_loop_is_reported_with_the_fix():
    model = build_model("mixtral", dtype=torch.float64, num_hidden_layers=1)  # eager experts
    ids = sample_batch(model, 1, 6)
    clear_reports()
    torch._dynamo.reset()
    torch.compile(model, backend="graphopt", options={"moe": {}, "lowering": "eager"})(
        input_ids=ids, use_cache=False)
    sites = [s for r in reports() for p in r.passes if p.name == "moe" for s in p.sites]
    skipped = [s for s in sites if s.site != "graph"]  # "graph": the graphs after the breaks
    assert skipped and all(s.action == "skipped" and "grouped_mm" in s.reason for s in skipped)
    assert all("no MoE router" in s.reason for s in sites if s.site == "graph")
    # a capacity factor asked for changes the result: its sites left dropless are warned
    # about, not only reported (a review: GraniteMoe trained dropless without a word)
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match=r"capacity_factor=1.0 was asked for, but 1 MoE "
                                         r"site\(s\) of this graph were not rewritten"):
        torch.compile(model, backend="graphopt", options={
            "moe": {"capacity_factor": 1.0}, "lowering": "eager"})(input_ids=ids,
                                                                   use_cache=False)


def _moe_sites_of_an_eager_equal_run(model):
    """The moe pass's site records of one no-grad compiled forward of ``model`` (vocabulary
    64, 2 x 6 token ids) with options {"moe": {}}, after checking its logits equal eager."""
    ids = torch.randint(0, 64, (2, 6))
    clear_reports()
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend="graphopt", options={"moe": {}, "lowering": "eager"})(
            input_ids=ids, use_cache=False).logits
        torch.testing.assert_close(out, model(input_ids=ids, use_cache=False).logits)
    return [s for r in reports() for p in r.passes if p.name == "moe" for s in p.sites]


def test_experts_that_receive_routing_scores_in_their_input_are_named():
    """Llama4 applies the routing scores to the experts' input (its experts take one
    tensor): the skip said "no experts module consumes the router's indices" (a review)."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(0)
    model = Llama4ForCausalLM(Llama4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1,
        moe_layers=[0], no_rope_layers=[1], attention_chunk_size=8,
        max_position_embeddings=64)).eval()
    sites = _moe_sites_of_an_eager_equal_run(model)
    assert any(s.action == "skipped" and "experts only through floating-point values "
               "(attention or the residual stream; or routing scores applied to the experts' "
               "input, as Llama4 does)" in s.reason for s in sites), sites


def test_experts_with_biases_are_named_with_their_parameters():
    """GPT-OSS's experts hold biases (and a clamped activation): the skip listed Dynamo's
    node names (a review); it names the parameters with their shapes and what the rewrite
    takes. The model runs as eager does."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64,
        layer_types=["full_attention"])).eval()
    model.set_experts_implementation("batched_mm")
    sites = _moe_sites_of_an_eager_equal_run(model)
    assert any(s.action == "skipped" and "reads 7 values, 4 of them parameters or buffers "
               "(down_proj [4, 32, 32]; down_proj_bias [4, 32]; gate_up_proj [4, 32, 64]; "
               "gate_up_proj_bias [4, 64]); the rewrite takes transformers' SwiGLU experts"
               in s.reason for s in sites), sites


def test_moe_options_on_a_model_without_experts_say_they_change_nothing():
    """moe options on a dense model were silently accepted (an empty report; a new user's
    trial): the report now says the graph has no MoE router."""
    model = build_model("llama")
    clear_reports()
    torch._dynamo.reset()
    torch.compile(model, backend="graphopt", options={"moe": {}, "lowering": "eager"})(
        input_ids=sample_batch(model, 1, 6), use_cache=False)
    sites = [s for r in reports() for p in r.passes if p.name == "moe" for s in p.sites]
    assert [s.site for s in sites] == ["graph"] and "change nothing" in sites[0].reason


MODELS = ["mixtral", "qwen3_moe", "minimax", "deepseek_v3"]


@pytest.mark.parametrize("name", MODELS)
def test_real_moe_models_train_exactly(name):
    model = build_model(name, dtype=torch.float64)
    ids = sample_batch(model, 2, 12)
    params = [p for p in model.parameters() if p.requires_grad]

    def eager(ids):
        model.set_experts_implementation("eager")
        return model(input_ids=ids, use_cache=False).logits

    compiled = torch.compile(lambda ids: model(input_ids=ids, use_cache=False).logits,
                             backend="graphopt", options={"moe": {}, "lowering": "eager"})

    def graphopt_run(ids):
        model.set_experts_implementation("grouped_mm")
        return compiled(ids)

    clear_reports()
    torch._dynamo.reset()
    assert_matches_eager(eager, graphopt_run, [ids], params, rtol=1e-9, atol=1e-11)
    layers = sum(1 for m in model.modules() if type(m).__name__.endswith("Experts"))
    rewritten = [s for r in reports() for p in r.passes if p.name == "moe"
                 for s in p.sites if s.action == "rewritten"]
    assert len(rewritten) == layers, [s for r in reports() for p in r.passes for s in p.sites]
    assert reports()[0].training


class _ScaledSiLU(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.silu(x) * 1.01


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_experts_are_rewritten_and_a_one_percent_change_is_refused(dtype):
    """bf16/fp16 probes compared at 3e-2 took silu(x) * 1.01 for SwiGLU (a review): the
    rewrite dropped the scale. The probes also run in float32 now (the region's casts
    lifted); plain SwiGLU experts of bf16/fp16 models are still rewritten."""
    for scaled in (False, True):
        model = build_model("mixtral", dtype=dtype)
        model.set_experts_implementation("grouped_mm")
        if scaled:
            for m in model.modules():
                if type(m).__name__.endswith("Experts"):
                    m.act_fn = _ScaledSiLU()
        ids = sample_batch(model, 2, 12)
        clear_reports()
        torch._dynamo.reset()
        torch.compile(model, backend="graphopt", options={"moe": {}, "lowering": "eager"})(
            input_ids=ids, use_cache=False)
        sites = [s for r in reports() if r.status == "compiled"
                 for p in r.pass_records("moe") for s in p.sites]
        assert len(sites) == 2 and all(r.fallback is None for r in reports()), sites
        if scaled:
            assert all(s.action == "skipped" and "probe mismatch" in s.reason for s in sites)
        else:
            assert all(s.action == "rewritten" for s in sites), sites


@pytest.mark.parametrize("drop_policy", ["position", "probs"])
def test_capacity_is_reported_as_approximate(drop_policy):
    block = _block()
    x = torch.randn(1, 8, 16, dtype=torch.float64)
    gm = trace_for_pass(block, x)
    config = GraphoptConfig.from_options({"moe": {"capacity_factor": 0.5,
                                                  "drop_policy": drop_policy}})
    out, record = run_pass("moe", gm, config, example_inputs=bind_inputs(gm, block, x))
    assert not record.exact
    (site,) = _sites(record, "rewritten")
    assert "APPROXIMATE" in site.reason and f"drop policy {drop_policy}" in site.reason
    from graphopt.kernels.moe import capacity_keep_mask

    flat = x.view(-1, 16)
    w, i = torch.topk(block.gate(flat)[0].float().softmax(-1), 2)
    w = w / w.sum(-1, keepdim=True)
    keep = capacity_keep_mask(i, 4, 0.5, w, drop_policy)
    assert not keep.all()
    want = block.experts(flat, i, w.double() * keep).view(1, 8, 16)
    torch.testing.assert_close(as_function(out, block)(x), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("factor", [4.0, 8.0])
def test_a_capacity_no_expert_can_reach_is_exact(factor):
    """C = ceil(cf T K / E) >= T K at cf >= E (4 experts): nothing can be dropped, so the
    site runs dropless and the pass's record is exact (a review: reported APPROXIMATE with
    a result equal to eager's); verify then holds it to exactness."""
    block = _block()
    x = torch.randn(1, 8, 16, dtype=torch.float64)
    gm = trace_for_pass(block, x)
    config = GraphoptConfig.from_options({"moe": {"capacity_factor": factor}})
    out, record = run_pass("moe", gm, config, example_inputs=bind_inputs(gm, block, x))
    assert record.exact
    (site,) = _sites(record, "rewritten")
    assert "nothing is dropped; exact" in site.reason and "APPROXIMATE" not in site.reason
    assert not site.approximate
    (call,) = [n for n in out.graph.nodes if n.target is torch.ops.graphopt.moe_experts.default]
    assert call.args[5] == -1.0  # the dropless path: no capacity sort
    want = block(x)
    want = want[0] if isinstance(want, tuple) else want
    torch.testing.assert_close(as_function(out, block)(x).view(want.shape), want,
                               rtol=1e-10, atol=1e-12)


def test_approximate_sites_are_marked_and_the_record_says_so():
    block = _block()
    x = torch.randn(1, 8, 16, dtype=torch.float64)
    gm = trace_for_pass(block, x)
    config = GraphoptConfig.from_options({"moe": {"capacity_factor": 3.99}})
    _, record = run_pass("moe", gm, config, example_inputs=bind_inputs(gm, block, x))
    (site,) = _sites(record, "rewritten")
    assert site.approximate and not record.exact


@pytest.mark.parametrize("options, message", [
    ({"moe": {"ep": 0}}, "moe.ep must be an int >= 1"),
    ({"moe": {"all_to_all": "hierarchial"}}, "did you mean 'hierarchical'"),
    ({"moe": {"chunks": 0}}, "moe.chunks"),
    ({"moe": {"ep": 2, "chunks": 10**9}}, r"moe.chunks must be an int in 1..64"),
    ({"moe": {"all_to_all": "peer"}}, "with moe.ep=1 there is no exchange"),
    ({"moe": {"ep": 2, "all_to_all": "peer", "chunks": 4}}, "applies to the 'chunked'"),
    ({"moe": {"ep": 4, "ranks_per_node": 3}}, "must divide moe.ep"),
    ({"moe": {"capacity_factor": -1}}, "capacity_factor"),
    ({"moe": {"epp": 2}}, "epp"),
    ({"moe": {"capacity_factor": 1.0, "drop_policy": "prob"}}, "did you mean 'probs'"),
    ({"moe": {"drop_policy": "probs"}}, "capacity_factor is None"),
])
def test_bad_moe_options_name_the_problem(options, message):
    with pytest.raises(ConfigError, match=message):
        GraphoptConfig.from_options(options)


def test_expert_parallel_without_a_process_group_says_how_to_fix_it():
    block = _block()
    x = torch.randn(1, 4, 16, dtype=torch.float64)
    gm = trace_for_pass(block, x)
    config = GraphoptConfig.from_options({"moe": {"ep": 2}})
    with pytest.raises(ConfigError, match="torchrun"):
        run_pass("moe", gm, config, example_inputs=bind_inputs(gm, block, x))


def test_router_ties_resolve_as_in_eager():
    """A zero router: every expert scores the same; the rewrite keeps the model's own top-k,
    so the tie-break (and the output and gradients) is eager's."""
    block = _block()
    with torch.no_grad():
        block.gate.weight.zero_()
    x = torch.randn(1, 6, 16, dtype=torch.float64, requires_grad=True)
    gm = trace_for_pass(block, x)
    out, record = run_pass("moe", gm, MOE_OPTIONS, example_inputs=bind_inputs(gm, block, x))
    assert _sites(record, "rewritten")
    assert_matches_eager(block, as_function(out, block), [x], list(block.parameters()),
                         rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("factor, drop_policy", [(0.25, "position"), (100.0, "position"),
                                                 (0.25, "probs"), (0.6, "probs")])
def test_capacity_drops_exactly_the_documented_rows_without_nan(factor, drop_policy):
    from graphopt.kernels.moe import capacity_keep_mask, moe_experts

    block = _block()
    x = torch.randn(12, 16, dtype=torch.float64, requires_grad=True)
    w, i = torch.topk(torch.randn(12, 4, dtype=torch.float64).softmax(-1), 2)
    w.requires_grad_()
    e = block.experts
    got = moe_experts(x, i, w, e.gate_up_proj, e.down_proj, capacity_factor=factor,
                      drop_policy=drop_policy)
    keep = capacity_keep_mask(i, 4, factor, w, drop_policy)
    assert keep.equal(_keep_by_rule(i, w, 4, factor, drop_policy))
    want = e(x, i, w * keep)  # a dropped assignment contributes nothing
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(got.square().sum(), [x, w, e.gate_up_proj, e.down_proj])
    want_grads = torch.autograd.grad(want.square().sum(), [x, w, e.gate_up_proj, e.down_proj])
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert (grads[1][~keep] == 0).all()  # no gradient to the weight of a dropped assignment
    if factor > 1:
        assert keep.all()  # capacity above demand: dropless


def _keep_by_rule(index, weights, num_experts, factor, drop_policy):
    """The drop rule in plain Python, independent of the op's sorts: per expert, C
    assignments kept, the first in (token, k) order ("position") or the largest weights,
    ties by (token, k) order ("probs")."""
    import math

    t, k = index.shape
    capacity = min(math.ceil(factor * t * k / num_experts), t * k)
    keep = torch.zeros(t, k, dtype=torch.bool)
    for expert in range(num_experts):
        mine = [(a, b) for a in range(t) for b in range(k) if index[a, b] == expert]
        if drop_policy == "probs":
            # stable: ties keep (token, k) order
            mine.sort(key=lambda ab: -float(weights.detach()[ab]))
        for a, b in mine[:capacity]:
            keep[a, b] = True
    return keep


def test_probs_drop_policy_keeps_the_largest_weights_and_breaks_ties_by_position():
    """Megatron-Core's "probs" policy: expert 0 holds 5 assignments, C = 2 (factor 0.4 of
    5 / 1): the two largest weights are kept; among equal weights the earlier token wins."""
    from graphopt.kernels.moe import capacity_keep_mask

    index = torch.zeros(5, 1, dtype=torch.long)
    weights = torch.tensor([[0.1], [0.7], [0.3], [0.7], [0.9]])
    keep = capacity_keep_mask(index, 1, 0.4, weights, "probs").view(-1)
    assert keep.tolist() == [False, True, False, False, True]
    weights = torch.tensor([[0.5], [0.2], [0.5], [0.5], [0.1]])
    assert capacity_keep_mask(index, 1, 0.4, weights, "probs").view(-1).tolist() == [
        True, False, True, False, False]
    assert capacity_keep_mask(index, 1, 0.4).view(-1).tolist() == [
        True, True, False, False, False]
    with pytest.raises(ValueError, match="pass them"):
        capacity_keep_mask(index, 1, 0.4, drop_policy="probs")


def test_dynamic_shapes_are_rewritten_exactly_for_every_token_count():
    """A symbolic token count (torch.compile dynamic=True, torch.export): the probes run at
    its example value and the op takes any count; two lengths, one compile, eager numerics."""
    model = build_model("mixtral", dtype=torch.float64, num_hidden_layers=1)
    reference = copy.deepcopy(model)
    model.set_experts_implementation("grouped_mm")
    clear_reports()
    torch._dynamo.reset()
    compiled = torch.compile(lambda ids: model(input_ids=ids, use_cache=False).logits,
                             backend="graphopt", options={"moe": {}, "lowering": "eager"},
                             dynamic=True)
    compiles = []
    for seq in (6, 11):
        ids = sample_batch(model, 2, seq)
        torch.testing.assert_close(compiled(ids), reference(input_ids=ids).logits,
                                   rtol=1e-10, atol=1e-10)
        compiles.append(len(reports()))
    assert compiles[0] == compiles[1]  # the second length reused the dynamic graph
    sites = [s for r in reports() for p in r.passes if p.name == "moe" for s in p.sites]
    assert sites and all(s.action == "rewritten" for s in sites), sites


def test_unaligned_expert_sizes_fall_back_to_the_per_expert_loop():
    """torch._grouped_mm needs 16-byte aligned strides; F=5 in float32 is not."""
    from graphopt.kernels.moe import moe_experts

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, generator=gen)
    w, i = torch.topk(torch.randn(6, 4, generator=gen).softmax(-1), 2)
    gate_up, down = torch.randn(4, 10, 8, generator=gen), torch.randn(4, 8, 5, generator=gen)
    got = moe_experts(x, i, w, gate_up, down)
    want = moe_experts(x.double(), i, w.double(), gate_up.double(), down.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "top_k_index": a["top_k_index"].double()}, "integer"),
    (lambda a: {**a, "gate_up": a["gate_up"].double()}, "hidden's dtype"),
    (lambda a: {**a, "top_k_index": a["top_k_index"][:, 0], "top_k_weights":
                a["top_k_weights"][:, 0]}, "integer \\[T, K\\]"),
    (lambda a: {**a, "capacity_factor": float("inf")}, "finite"),
])
def test_malformed_kernel_inputs_name_the_problem(change, message):
    from graphopt.kernels.moe import moe_experts

    w, i = torch.topk(torch.randn(6, 4).softmax(-1), 2)
    args = dict(hidden=torch.randn(6, 8), top_k_index=i, top_k_weights=w,
                gate_up=torch.randn(4, 16, 8), down=torch.randn(4, 8, 8))
    with pytest.raises(ValueError, match=message):
        moe_experts(**change(args))


def test_review_findings_clamped_swiglu_empty_batch_dynamic_ep():
    """Found by a review: (1) transformers' clamped SwiGLU (HY-V4's swiglu_limit) was
    rewritten as plain SwiGLU (error 307: unit-scale probes never reach the limit); (2) a
    graph with no tokens crashed the probes; (3) under EP a symbolic token count skipped
    the site on that rank only, leaving the others in the collectives (a hang)."""
    from transformers import HYV4Config
    from transformers.models.hy_v4.modeling_hy_v4 import HYV4MoE

    cfg = HYV4Config(hidden_size=16, moe_intermediate_size=8, n_routed_experts=4,
                     num_local_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                     n_shared_experts=1, intermediate_size=32, swiglu_limit=10.0)
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    clamped = HYV4MoE(cfg).double()
    x = 8.0 * torch.randn(1, 10, 16, dtype=torch.float64)
    gm = trace_for_pass(clamped, x)
    _, record = run_pass("moe", gm, MOE_OPTIONS, example_inputs=bind_inputs(gm, clamped, x))
    (site,) = _sites(record, "skipped")
    assert "clamped SwiGLU" in site.reason and not record.modified

    block = _block()
    empty = torch.randn(1, 0, 16, dtype=torch.float64)
    gm = trace_for_pass(block, empty)
    out, record = run_pass("moe", gm, MOE_OPTIONS, example_inputs=bind_inputs(gm, block, empty))
    assert _sites(record, "rewritten") and as_function(out, block)(empty).shape == (1, 0, 16)

    x = torch.randn(1, 6, 16, dtype=torch.float64)
    gm = trace_for_pass(block, x, dynamic=True)
    with pytest.raises(ConfigError, match="symbolic token count"):
        run_pass("moe", gm, GraphoptConfig.from_options({"moe": {"ep": 2}}),
                 example_inputs=bind_inputs(gm, block, x))


class _PlusOneExperts(torch.nn.Module):
    """Experts with transformers' five-input interface and SiLU but silu(g) * (up + 1): not
    SwiGLU, so never rewritten."""

    def __init__(self, e: int = 4, h: int = 16, f: int = 8) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(e, 2 * f, h) / h ** 0.5)
        self.down_proj = torch.nn.Parameter(torch.randn(e, h, f) / f ** 0.5)

    def expert_rows(self, x, idx, up_shift: float):  # type: ignore[no-untyped-def]
        """Each (token, k) row's expert output, silu(g) * (up + up_shift) (unweighted)."""
        k = idx.shape[-1]
        rows = x.repeat_interleave(k, dim=0)
        flat = idx.reshape(-1)
        gu = torch.bmm(self.gate_up_proj[flat], rows.unsqueeze(-1)).squeeze(-1)
        g, u = gu.chunk(2, dim=-1)
        act = F.silu(g) * (u + up_shift) if up_shift else F.silu(g) * u
        return torch.bmm(self.down_proj[flat], act.unsqueeze(-1)).squeeze(-1)

    def forward(self, x, idx, w):  # type: ignore[no-untyped-def]
        y = self.expert_rows(x, idx, 1.0)
        return (y * w.reshape(-1, 1)).view(x.shape[0], idx.shape[-1], -1).sum(1)


class _PlusOneBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(16, 4, bias=False)
        self.experts = _PlusOneExperts()

    def forward(self, x):  # type: ignore[no-untyped-def]
        w, i = torch.topk(self.gate(x).softmax(-1), 2, dim=-1)
        return self.experts(x, i, w)


def test_probes_also_use_drawn_weights_when_the_real_ones_are_degenerate():
    """A zero down_proj at compile time (zero-initialised, or not loaded yet) makes every
    probe 0 whatever the region computes; found by a review: silu(g) * (up + 1) experts were
    rewritten as SwiGLU and differed by 1.18 after one optimizer step. Drawn weights are
    probed too, so the region is refused."""
    torch.manual_seed(0)
    block = _PlusOneBlock().double()
    x = torch.randn(6, 16, dtype=torch.float64)
    for zero_down in (False, True):
        if zero_down:
            with torch.no_grad():
                block.experts.down_proj.zero_()
        gm = trace_for_pass(block, x)
        out, record = run_pass("moe", gm, MOE_OPTIONS, example_inputs=bind_inputs(gm, block, x))
        assert not record.modified, zero_down
        (site,) = _sites(record, "skipped")
        assert "probe mismatch" in site.reason


def test_a_model_level_top_k_is_reported_as_feeding_no_experts_module():
    """output_router_logits=True: transformers' load-balancing loss runs its own top-k on the
    router logits at model level; the report names that case first, not only the eager-loop
    advice (the model already uses grouped_mm, its experts site is rewritten)."""
    model = build_model("mixtral", dtype=torch.float64, num_hidden_layers=1,
                        output_router_logits=True, router_aux_loss_coef=0.5)
    model.set_experts_implementation("grouped_mm")
    ids = sample_batch(model, 2, 8)
    clear_reports()
    torch._dynamo.reset()
    compiled = torch.compile(lambda ids: model(input_ids=ids, labels=ids, use_cache=False).loss,
                             backend="graphopt", options={"moe": {}, "lowering": "eager"})
    compiled(ids).backward()
    sites = [s for r in reports() for p in r.passes if p.name == "moe" for s in p.sites]
    assert [s.action for s in sites].count("rewritten") == 1, sites
    (aux,) = [s for s in sites if s.action == "skipped"]
    assert "a top-k with no module path" in aux.reason and "load-balancing loss" in aux.reason


class _VariantExperts(_PlusOneExperts):
    """SwiGLU experts with transformers' interface whose routing weights go through
    ``variant`` before the weighted sum."""

    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant

    def forward(self, x, idx, w):  # type: ignore[no-untyped-def]
        k = idx.shape[-1]
        with torch.set_grad_enabled(self.variant != "frozen_experts"):
            y = self.expert_rows(x, idx, 0.0)
        ww = w.reshape(-1, 1)
        if self.variant == "relu":  # invisible on positive weights
            ww = torch.relu(ww)
        elif self.variant == "half_gradient":  # the same forward, half the router gradient
            ww = ww.detach() + (ww - ww.detach()) * 0.5
        elif self.variant == "detach":
            ww = ww.detach()
        return (y * ww).view(x.shape[0], k, -1).sum(1)


class _RawRouterBlock(torch.nn.Module):
    def __init__(self, variant: str) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(16, 4, bias=False)
        self.experts = _VariantExperts(variant)

    def forward(self, x):  # type: ignore[no-untyped-def]
        w, i = torch.topk(self.gate(x), 2, dim=-1)  # raw logits: weights may be negative
        return self.experts(x, i, w)


@pytest.mark.parametrize("variant,reason", [
    ("plain", None), ("relu", "computes activations with relu"),
    ("half_gradient", "not their gradient"), ("detach", "not their gradient"),
    ("frozen_experts", "grad mode")])
def test_probes_see_signed_weights_and_the_backward(variant, reason):
    """A review got relu(weights) experts (raw-logit routing) rewritten, since the probes
    drew positive weights only (output 0.9 off), and a gradient-scaling trick with the same
    forward (2x the router gradient). Probes draw signed weights and compare one VJP."""
    torch.manual_seed(0)
    block = _RawRouterBlock(variant).double()
    x = torch.randn(6, 16, dtype=torch.float64)
    gm = trace_for_pass(block, x)
    _, record = run_pass("moe", gm, MOE_OPTIONS, example_inputs=bind_inputs(gm, block, x))
    if reason is None:
        assert record.modified and _sites(record, "rewritten")
    else:
        assert not record.modified
        (site,) = _sites(record, "skipped")
        assert reason in site.reason, site.reason


class _SpelledExperts(torch.nn.Module):
    """transformers' experts interface ([E, 2F, H] gate_up, [E, H, F] down, a zero-initialised
    down_proj: only the pass's drawn-weight probes see anything) computing SwiGLU with a
    ``spelling`` of a bound, a token-count factor, or nothing."""

    def __init__(self, spelling: str, dtype: torch.dtype = torch.float64, h: int = 64,
                 zero_down: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(4, 64, h, dtype=dtype) * 0.02)
        down = torch.zeros(4, h, 32, dtype=dtype) if zero_down else \
            torch.randn(4, h, 32, dtype=dtype) / 6
        self.down_proj = torch.nn.Parameter(down)
        self.spelling = spelling

    def forward(self, x, idx, w):  # type: ignore[no-untyped-def]
        t, k = idx.shape
        rows = x.to(self.gate_up_proj.dtype).repeat_interleave(k, dim=0)
        flat = idx.reshape(-1)
        g, u = torch.bmm(self.gate_up_proj[flat], rows.unsqueeze(-1)).squeeze(-1).chunk(2, -1)
        if self.spelling == "where":  # g.clamp(max=10), u.clamp(-10, 10)
            g = torch.where(g > 10, 10.0, g)
            u = torch.where(u.abs() > 10, u.sign() * 10, u)
        elif self.spelling == "relu":  # g.clamp(max=10)
            g = g - F.relu(g - 10)
        elif self.spelling == "rational":  # a soft bound near 1e4 from allowed ops only
            g = g / (1 + g * g / 1e8)
        elif self.spelling == "step":  # g.clamp(max=1e7) from allowed ops and a comparison
            g = g - (g - 1e7) * (g > 1e7).to(g.dtype)
        elif self.spelling == "grad_growth":  # forward g; a gradient growing with g**7
            c = 5e-9 * g * g * g * g * g * g * g
            g = g + (c - c.detach())
        elif self.spelling == "histc":  # a step at 1e4 from a count of activations
            g = g / (1 + torch.histc(g.detach(), bins=1, min=-1e4, max=1e4)[0] * 0 +
                     (g.numel() - torch.histc(g.detach(), bins=1, min=-1e4, max=1e4)[0]))
        y = torch.bmm(self.down_proj[flat], (F.silu(g) * u).unsqueeze(-1)).squeeze(-1)
        if self.spelling == "token_count":  # SwiGLU at 8 tokens only
            y = y * (t / 8)
        elif self.spelling == "token_steps":  # SwiGLU below 16 tokens
            y = y * (1 + t // 16)
        elif self.spelling == "positions":  # a 16-token buffer: later positions dropped
            y = y * (torch.arange(t * k, device=y.device) < 16 * k).to(y.dtype)[:, None]
        elif self.spelling == "position_steps":
            y = y * (1 + torch.arange(t * k, device=y.device) // (16 * k)).to(y.dtype)[:, None]
        return (y * w.reshape(-1, 1).to(y.dtype)).view(t, k, -1).sum(1).to(x.dtype)


class _SpelledBlock(torch.nn.Module):
    def __init__(self, spelling: str, dtype: torch.dtype = torch.float64,
                 expert_dtype: torch.dtype | None = None,
                 index_dtype: torch.dtype = torch.int64, zero_down: bool = True) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(64, 4, bias=False, dtype=dtype)
        self.experts = _SpelledExperts(spelling, expert_dtype or dtype, zero_down=zero_down)
        self.index_dtype = index_dtype

    def forward(self, x):  # type: ignore[no-untyped-def]
        w, i = torch.topk(self.gate(x).softmax(-1), 2, dim=-1)
        return self.experts(x, i.to(self.index_dtype), w)


@pytest.mark.parametrize("spelling, dtype, reason", [
    ("where", torch.float64, "compares values (gt"),
    ("step", torch.float64, "compares values (gt"),
    ("histc", torch.float64, "turns activations into booleans or integers (histc"),
    ("grad_growth", torch.float32, "computes SwiGLU experts forward but not their gradient"),
    ("relu", torch.float64, "computes activations with relu (relu)"),
    ("rational", torch.float32, "probe mismatch"),
])
def test_bounded_swiglu_in_any_spelling_is_refused(spelling, dtype, reason):
    """A review wrote transformers' clamped SwiGLU as ``torch.where(g > 10, 10, g)`` and
    ``g - relu(g - 10)`` with a zero-initialised down_proj: rewritten as plain SwiGLU, 2.26
    off once the weights grew. Regions computing activations with ops outside SwiGLU
    experts' (FLOAT_OPS), comparing values (a step at 1e7 built from allowed ops) or
    counting activations (histc) are refused; a bound spelled with allowed ops alone (a soft
    bound near 1e4) shows on the drawn-weight probes at 1000x scale, and a gradient trick
    growing with the activations (1.0 off at 30x, unseen at unit scale) on the backward
    probe run at every scale."""
    torch.manual_seed(0)
    block = _SpelledBlock(spelling, dtype)
    x = torch.randn(8, 64, dtype=dtype)
    gm = trace_for_pass(block, x)
    _, record = run_pass("moe", gm, MOE_OPTIONS, example_inputs=bind_inputs(gm, block, x))
    assert not record.modified
    (site,) = _sites(record, "skipped")
    assert reason in site.reason, site.reason


@pytest.mark.parametrize("spelling, reason", [
    ("token_count", "probe mismatch"),
    ("token_steps", "computes with token positions or sizes as values"),
    ("positions", "compares values (lt"),
    ("position_steps", "computes with token positions or sizes as values"),
    ("plain", None)])
def test_dynamic_token_count_is_probed_at_other_counts(spelling, reason):
    """With a symbolic token count the probes also run at other counts (each symbol + 3, and
    2): a region that is SwiGLU at the example count only (``y * T / 8``) was rewritten and
    0.997 off at 16 tokens (a review). Steps past the probed counts (``y * (1 + T // 16)``,
    a 16-token buffer ``arange(T) < 16``: 9.4 and 4.7 off at 32 tokens, a later review) are
    refused: sizes and positions may only shape and index. Plain SwiGLU is rewritten."""
    rewritten = reason is None
    torch.manual_seed(0)
    block = _SpelledBlock(spelling, zero_down=False)
    x = torch.randn(8, 64, dtype=torch.float64)
    gm = trace_for_pass(block, x, dynamic=True)
    gm, record = run_pass("moe", gm, MOE_OPTIONS,
                          example_inputs=bind_inputs(gm, block, x))
    assert record.modified is rewritten, record.sites
    if not rewritten:
        assert reason in _sites(record, "skipped")[0].reason, record.sites
    for t in (8, 16, 3, 32):
        x = torch.randn(t, 64, dtype=torch.float64, requires_grad=True)
        assert_matches_eager(block, as_function(gm, block), [x], rtol=1e-9, atol=1e-9)


def test_int32_indices_are_cast_and_mixed_dtypes_are_refused():
    """A review crashed the compile (the probe raised) with int32 routing indices and with
    bf16 tokens into float32 experts. int32 indices are cast to int64 for the op (exact);
    tokens and expert weights in different dtypes are left as written, with the reason."""
    torch.manual_seed(0)
    block = _SpelledBlock("plain", index_dtype=torch.int32, zero_down=False)
    x = torch.randn(8, 64, dtype=torch.float64)
    gm = trace_for_pass(block, x)
    gm, record = run_pass("moe", gm, MOE_OPTIONS, example_inputs=bind_inputs(gm, block, x))
    assert record.modified and _sites(record, "rewritten")
    x.requires_grad_()
    assert_matches_eager(block, as_function(gm, block), [x], rtol=1e-9, atol=1e-9)

    block = _SpelledBlock("plain", torch.bfloat16, expert_dtype=torch.float32, zero_down=False)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    gm = trace_for_pass(block, x)
    _, record = run_pass("moe", gm, MOE_OPTIONS, example_inputs=bind_inputs(gm, block, x))
    assert not record.modified
    assert "graphopt's op computes in one dtype" in _sites(record, "skipped")[0].reason


class _Indexer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.score = torch.nn.Linear(64, 64, bias=False, dtype=torch.float64)

    def forward(self, x):  # type: ignore[no-untyped-def]
        _, pos = torch.topk(self.score(x), 4, dim=-1)  # positions to attend, not experts
        return x + torch.gather(x, -1, pos).sum(-1, keepdim=True)


class _IndexerThenMoE(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.indexer = _Indexer()
        self.moe = _SpelledBlock("plain", zero_down=False)

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.moe(self.indexer(x))


def test_a_top_k_reaching_experts_through_floating_values_is_not_the_router():
    """DeepSeek-V3.2's attention indexer top-k was taken as the next MoE layer's router
    (its indices reach the experts through attention and the residual stream; a review):
    the experts were rewritten under the indexer's site and the real router reported as
    "already runs graphopt ops". Routing indices reach the experts through integer ops."""
    torch.manual_seed(0)
    model = _IndexerThenMoE()
    x = torch.randn(8, 64, dtype=torch.float64)
    gm = trace_for_pass(model, x)
    gm, record = run_pass("moe", gm, MOE_OPTIONS, example_inputs=bind_inputs(gm, model, x))
    by_site = {s.site.split(":")[0]: s for s in record.sites}
    assert by_site["moe"].action == "rewritten", record.sites
    assert by_site["indexer"].action == "skipped"
    assert "no experts module consumes" in by_site["indexer"].reason
    x.requires_grad_()
    assert_matches_eager(model, as_function(gm, model), [x], rtol=1e-9, atol=1e-9)


class _SentinelBlock(torch.nn.Module):
    """transformers' experts under its own expert parallelism: routes to experts not on
    this rank become index E with weight 0 (the experts clamp them)."""

    def __init__(self) -> None:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts

        super().__init__()
        config = MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=4,
                               num_experts_per_tok=2)
        config._experts_implementation = "batched_mm"
        torch.manual_seed(0)
        self.gate = torch.nn.Linear(16, 4, bias=False).double()
        self.experts = MixtralExperts(config).double()
        self.experts._is_expert_parallel = True

    def forward(self, x):  # type: ignore[no-untyped-def]
        w, i = torch.topk(self.gate(x).softmax(-1), 2)
        drop = i >= 2
        return self.experts(x, torch.where(drop, 4, i), torch.where(drop, 0.0, w))


def test_index_clamp_and_unused_chunk_count_are_reported_as_such():
    """transformers' expert-parallel sentinel handling (``_is_expert_parallel``: indices
    >= E clamped) is skipped as such, not as "clamped SwiGLU" (a review); an explicit
    moe.chunks that the chosen schedule does not use is said to be unused."""
    from graphopt.passes.moe import ep_schedule
    from graphopt.passes.moe_options import MoEOptions

    block = _SentinelBlock()
    x = torch.randn(6, 16, dtype=torch.float64)
    gm = trace_for_pass(block, x)
    _, record = run_pass("moe", gm, MOE_OPTIONS, example_inputs=bind_inputs(gm, block, x))
    (site,) = _sites(record, "skipped")
    assert "clamps its routing indices" in site.reason, site.reason

    opts = MoEOptions(ep=2, chunks=64, profile="h100-sxm")  # all_to_all "auto"
    unused = "moe.chunks=64 applies to the chunked schedule only"
    schedule, _, note = ep_schedule(64, 2, 1024, 2048, torch.bfloat16, opts, 2)
    assert schedule == "peer" and unused in note, note  # few tokens: no chunks
    assert "; chunks" not in note and "of 64 tokens per rank" in note, note
    schedule, _, note = ep_schedule(4096, 2, 1024, 2048, torch.bfloat16, opts, 2)
    assert schedule == "chunked" and unused not in note, note
    assert "; chunks 64)" in note and "of 4096 tokens per rank" in note, note


class _ZeroExpertsBlock(torch.nn.Module):
    """LongCat-Flash-style zero-computation experts: the router scores 4 experts and 2
    identity choices; indices past the experts are folded away before the experts."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(64, 6, bias=False, dtype=torch.float64)
        self.experts = _SpelledExperts("plain", zero_down=False)

    def forward(self, x):  # type: ignore[no-untyped-def]
        w, i = torch.topk(self.gate(x).softmax(-1), 2, dim=-1)
        real = (i < 4).to(w.dtype)  # identity choices: weight 0 for the experts
        return self.experts(x, i % 4, w * real) + x * (1 - real).sum(-1, keepdim=True)


def test_a_router_scoring_more_choices_than_experts_is_refused():
    """Zero-computation experts in one-graph form were rewritten: the probes drew indices
    in [0, E) only, and at run time indices past the experts reached the op (out of bounds,
    a review). A router whose scores are wider than the experts module is refused."""
    torch.manual_seed(0)
    block = _ZeroExpertsBlock()
    x = torch.randn(8, 64, dtype=torch.float64)
    gm = trace_for_pass(block, x)
    gm, record = run_pass("moe", gm, MOE_OPTIONS, example_inputs=bind_inputs(gm, block, x))
    assert not record.modified
    assert "the router scores 6 choices and experts module experts holds 4 experts" in \
        _sites(record, "skipped")[0].reason

