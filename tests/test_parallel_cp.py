"""Context-parallel plans (graphopt.parallelize with cp > 1: Ulysses all-to-all attention) on
real gloo process groups, float64: the chunked run's loss, logits (from input_ids and from
inputs_embeds) and every gradient equal the single-process run, with labels unevenly
ignored over the DP ranks; three AdamW steps keep the parameters equal."""

from __future__ import annotations

import copy

import pytest
import torch

from graphopt.distributed import run_distributed
from graphopt.errors import ConfigError
from graphopt.planner.plan import ParallelPlan
from tests.helpers import config_errors
from tests.test_parallel import _full, _full_precision_rmsnorm, _held

A2A = dict(cp_kind="all_to_all")
RUNS = {
    2: [("llama", dict(cp=2, **A2A)), ("qwen3", dict(cp=2, **A2A)),
        # ring (the default kind); ZeRO-3 over cp alone (FSDP over dp_shard x cp, as the
        # planner prices and searches it)
        ("qwen3", dict(cp=2, zero_stage=3)),
        ("minimax", dict(cp=2, **A2A)),  # lightning layers pass their state
        ("llama_mha", dict(cp=2)),  # no GQA: the ring sends transformers' strided K/V
        ("llama_dynamic_rope", dict(cp=2)), ("llama_longrope", dict(cp=2, **A2A)),
        # a sliding window as long as the sequence changes nothing (it was refused in any
        # config, a review: Mistral's default 4096 kept CP from 4k-token jobs)
        ("mistral_window", dict(cp=2))],
    4: [("llama", dict(cp=2, tp=2, **A2A)),
        ("mixtral", dict(cp=2, dp_shard=2, ep=4, zero_stage=3, **A2A)),
        ("minimax", dict(cp=4, **A2A))],
}


# rotary frequencies chosen from max(position_ids) + 1 (past 8 positions: the sequences are
# 16 long): each rank's chunk alone chose its own (gradients 0.03-0.15 off, a review)
LENGTH_DEPENDENT_ROPE = {
    "llama_dynamic_rope": dict(max_position_embeddings=8, rope_parameters={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
    "llama_longrope": dict(max_position_embeddings=64, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
        "long_factor": [4.0] * 8, "original_max_position_embeddings": 8}),
}


def _run(name, plan, steps=3):
    import torch.distributed as dist

    from graphopt.models import build_model
    from graphopt.parallel import build_mesh, build_optimizer, parallelize
    from graphopt.parallel.context import chunk_positions, cp_loss, shard_sequence

    torch.manual_seed(0)
    ref = _mistral(16) if name == "mistral_window" else \
        build_model("llama", dtype=torch.float64, **LENGTH_DEPENDENT_ROPE[name]) \
        if name in LENGTH_DEPENDENT_ROPE else \
        build_model("llama", dtype=torch.float64, num_key_value_heads=4) \
        if name == "llama_mha" else build_model(name, dtype=torch.float64)
    _full_precision_rmsnorm(ref)
    _float64_decays(ref)
    mesh = build_mesh(plan)
    model = parallelize(copy.deepcopy(ref), plan, mesh)
    report = model.graphopt_parallel
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    batch = ids.chunk(plan.dp)[mesh["dp"].get_local_rank()]
    local, labels = shard_sequence(batch, mesh)
    opt = build_optimizer(model, plan, mesh, torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    rank, length = mesh["cp"].get_local_rank(), local.shape[1]
    positions = chunk_positions(length, rank, plan.cp, plan.cp_kind == "ring")
    # fewer labels in the first two sequences (DP rank 0's when dp = 2): the loss is the
    # mean over every labelled position of the global batch, not a mean of DP ranks' means
    full_labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    full_labels[:2][ids[:2] % 3 == 0] = -100
    labels = full_labels.chunk(plan.dp)[mesh["dp"].get_local_rank()][:, positions]
    # the same from transformers-style labels (unshifted, -100 where ignored)
    given = ids.clone()
    given[:2, 1:][ids[:2, :-1] % 3 == 0] = -100
    given_labels = shard_sequence(batch, mesh, labels=given.chunk(plan.dp)[
        mesh["dp"].get_local_rank()])[1]
    assert torch.equal(given_labels, labels), (given_labels, labels)
    with torch.no_grad():
        logits = _full(model(input_ids=local, use_cache=False).logits)
        embedded = logits
        if plan.devices == plan.cp and plan.zero_stage < 2:  # a plain embedding (no shards)
            embedded = _full(model(inputs_embeds=model.get_input_embeddings()(local),
                                   use_cache=False).logits)
        want = ref(input_ids=ids, use_cache=False).logits.chunk(plan.dp)[
            mesh["dp"].get_local_rank()][:, positions]
    errors = {"logits": max(float((logits - want).abs().max()),
                            float((embedded - want).abs().max())), "loss": 0.0}
    for step in range(steps):
        loss = cp_loss(model(input_ids=local, use_cache=False).logits, labels, mesh)
        loss.backward()
        ref_logits = ref(input_ids=ids, use_cache=False).logits
        ref_loss = torch.nn.functional.cross_entropy(ref_logits.flatten(0, 1),
                                                     full_labels.flatten(), ignore_index=-100)
        ref_loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # every rank's value: cp x its chunk's share; tp ranks equal
        mean /= plan.devices
        errors["loss"] = max(errors["loss"], abs(float(mean - ref_loss)) / float(ref_loss))
        if step == 0:
            errors["grads"] = max(float((_full(p.grad) - _held(n, r.grad, report)).abs().max())
                                  for (n, p), r in zip(model.named_parameters(),
                                                       ref.parameters()))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    errors["params"] = max(float((_full(p.detach()) - _held(n, r.detach(), report)).abs().max())
                           for (n, p), r in zip(model.named_parameters(), ref.parameters()))
    if plan.tp > 1 and plan.sp:  # a chunk SP cannot split: the whole sequence's need is
        # named (a review: "length 9 is not divisible by tp=2" for a sequence of 18)
        odd, _ = shard_sequence(torch.zeros(2, 9 * plan.cp, dtype=torch.long), mesh)
        try:
            model(input_ids=odd, use_cache=False)
        except ConfigError as exc:
            errors["refusal"] = str(exc)
    return errors, report.notes


def _mistral(window):
    """A tiny float64 Mistral with a sliding window of ``window`` tokens."""
    import transformers

    config = transformers.MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, sliding_window=window)
    config._attn_implementation = "sdpa"
    return transformers.MistralForCausalLM(config).double().eval()


def _float64_decays(model):
    """MiniMax precomputes its lightning decay factors from the slopes at init, in float32;
    cast to float64 they differ from float64 decays by ~1e-8 (relative), which would hide
    real errors. Both sides recompute them in float64 from the same slopes here."""
    for module in model.modules():
        if hasattr(module, "decay_factors") and hasattr(module, "slope_rate"):
            decays = module.decay_factors(module.slope_rate)
            module.query_decay, module.key_decay, module.diagonal_decay = decays


def _worker(rank, world, runs):
    return [_run(name, ParallelPlan(**kw)) for name, kw in runs]


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_plans_train_like_one_process(world):
    runs = RUNS[world]
    results = run_distributed(_worker, world, runs)
    for i, (name, kw) in enumerate(runs):
        for errors, notes in (r[i] for r in results):
            label = (name, kw, errors, notes)
            assert errors["loss"] < 1e-12 and errors["logits"] < 1e-9, label
            assert errors["grads"] < 1e-9 and errors["params"] < 1e-9, label
            kind = "ring" if kw.get("cp_kind", "ring") == "ring" else "Ulysses"
            assert any(f"CP={kw['cp']} ({kind}" in n for n in notes), label
            if kw.get("tp", 1) > 1:
                assert "CP chunk of 9 tokens is not divisible by tp=2 under SP" in \
                    errors["refusal"] and "a multiple of 4 (cp=2 x tp=2)" in \
                    errors["refusal"], label


@pytest.mark.parametrize("model, plan, message", [
    ("minimax", dict(cp=2), r"the ring holds zigzag chunks: use cp_kind='all_to_all'"),
    ("llama", dict(cp=8, **A2A), r"splits the attention heads \(4\) over cp x tp \(8 x 1\)"),
    # the load-balancing loss is not linear in the tokens: router gradients 50% off with no
    # error under cp_loss (a review)
    ("mixtral_aux", dict(cp=2), r"load-balancing loss \(output_router_logits=True, "
     r"router_aux_loss_coef=0.02\) over the whole sequence.*output_router_logits=False"),
    ("mixtral_aux", dict(cp=2, **A2A), r"load-balancing loss"),
])
def test_impossible_context_parallel_plans_are_refused(model, plan, message):
    from graphopt.models import build_model
    from graphopt.parallel import parallelize

    built = build_model("mixtral", output_router_logits=True, router_aux_loss_coef=0.02) \
        if model == "mixtral_aux" else build_model(model)
    with pytest.raises(ConfigError, match=message):
        parallelize(built, ParallelPlan(**plan))


def _bad_input_worker(rank, world):
    from graphopt.models import build_model
    from graphopt.parallel import build_mesh, parallelize
    from graphopt.parallel.context import shard_sequence

    plan = ParallelPlan(cp=2, **A2A)
    mesh = build_mesh(plan)
    model = parallelize(build_model("llama"), plan, mesh)
    ids = torch.zeros(2, 8, dtype=torch.long)
    mask = torch.ones(2, 4, dtype=torch.long)
    mask[0, 0] = 0  # one padded position
    from transformers import DynamicCache

    local, labels = shard_sequence(ids, mesh)
    packed = torch.cat([torch.arange(3), torch.arange(5)])[None]  # two sequences, one row
    causal = torch.ones(4, 4, dtype=torch.bool).tril()[None, None]
    # a review: a mesh from build_mesh(plan) used before (or instead of) the one parallelize
    # ran on was cut as Ulysses under a ring plan (gradients 109% off); now build_mesh
    # records the layout, and a chunk of the other layout or an unknown mesh is refused
    from torch.distributed.device_mesh import init_device_mesh

    from graphopt.parallel import tag_chunk
    from graphopt.parallel.context import chunk_positions

    ring_mesh = build_mesh(ParallelPlan(cp=2))
    ring_chunk, _ = shard_sequence(torch.arange(8)[None], ring_mesh)
    ring_model = parallelize(build_model("llama"), ParallelPlan(cp=2), ring_mesh)
    assert torch.equal(ring_chunk[0], chunk_positions(4, rank, 2, True)), ring_chunk
    plain = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    return config_errors(
        lambda: model(input_ids=ring_chunk),
        lambda: shard_sequence(ids, plain),
        lambda: shard_sequence(torch.zeros(2, 7, dtype=torch.long), mesh),
        lambda: shard_sequence(ids, mesh, labels=ids[:, 1:]),
        lambda: model(input_ids=local, attention_mask=mask),
        lambda: model(input_ids=local, past_key_values=DynamicCache(config=model.config)),
        lambda: model.generate(local, max_new_tokens=2),
        lambda: model(input_ids=local, position_ids=packed[:, rank * 4:(rank + 1) * 4]),
        lambda: model(input_ids=local, labels=labels),
        lambda: model(input_ids=local, attention_mask={"full_attention": causal}),
        lambda: model(input_ids=local, attention_mask=causal),
        # what CP would pass itself is accepted
        lambda: model(input_ids=local, position_ids=torch.arange(4)[None] + 4 * rank,
                      attention_mask=torch.ones(2, 4, dtype=torch.long)),
        lambda: model(local, None, None, None, None, labels),  # labels by position
        lambda: model(input_ids=local[:, :3 + rank]),  # chunks of 3 and 4 tokens
        # batches of 2 and 1 sequences: gloo aborted the process (a review)
        lambda: model(input_ids=local[:2 - rank]),
        # the ring's two half-chunks of a 5-token chunk cut by hand: a crash in the rotary
        # embedding (a review)
        lambda: ring_model(input_ids=tag_chunk(torch.zeros(2, 5, dtype=torch.long),
                                               ring_mesh)),
        # an untagged chunk under the ring: a contiguous cut by hand trained silently wrong
        # (gradients 0.83 off, a review); a tagged one, and the embeddings of one, run
        lambda: ring_model(input_ids=torch.arange(8)[None].chunk(2, dim=1)[rank]),
        lambda: ring_model(input_ids=ring_chunk[:, :2]),  # a slice loses the tag
        lambda: ring_model(inputs_embeds=ring_model.get_input_embeddings()(ring_chunk)),
        # a window shorter than the whole sequence (8 tokens) is refused on every rank
        lambda: parallelize(_mistral(4), plan, mesh)(input_ids=local))


def test_cp_with_padding_an_indivisible_sequence_or_a_kv_cache_is_a_clear_error():
    """A KV cache (decoding, generate()) under CP held only this rank's chunk, and the next
    step read it as the whole past: logits off by 0.1-1.1 without an error (a review).
    Packed sequences (position_ids restarting at 0) attended across their boundaries
    (logits 0.5 off); labels= gave a loss shifted twice, averaged per chunk; a dict of
    masks crashed and a 4-D causal mask was called padding (a later review)."""
    for messages in run_distributed(_bad_input_worker, 2):
        assert "this chunk was cut for CP 'ring' and the model runs CP 'all_to_all'" in \
            messages.pop(0)
        assert "shard_sequence does not know this mesh's CP layout" in messages.pop(0)
        assert "sequence length 7 is not divisible by 2 (cp=2)" in messages.pop(0)
        assert "labels (2, 7) must have input_ids' shape (2, 8)" in messages.pop(0)
        assert "this batch has a padding mask" in messages[0]
        assert "a KV cache (past_key_values, generate()) would hold only" in messages[1]
        assert "a KV cache (past_key_values, generate()) would hold only" in messages[2]
        assert "packed sequences (positions restarting at 0)" in messages[3]
        assert "compute the loss with graphopt.parallel.context.cp_loss" in messages[4]
        assert "a precomputed attention mask (a dict of masks or a 4-D mask)" in messages[5]
        assert "a precomputed attention mask" in messages[6]
        assert messages[7] == "ran"
        assert "compute the loss with graphopt.parallel.context.cp_loss" in messages[8]
        assert "the CP ranks hold chunks of different lengths" in messages[9]
        assert "the CP ranks hold batches of different sizes" in messages[10]
        assert "this rank's 5 tokens do not split in two" in messages[11]
        assert "under ring CP each rank holds chunks r and 2P-1-r" in messages[12]
        assert "graphopt.parallel.tag_chunk(x, mesh)" in messages[13]
        assert messages[14] == "ran"
        assert messages[15].startswith("sliding-window attention (window 4 tokens) under CP "
                                       "runs only sequences no longer than the window, where "
                                       "it changes nothing; this one has 8 tokens"), messages


@pytest.mark.parametrize("kind", ["_ulysses", "_ring"])
def test_bidirectional_attention_is_refused_under_cp(kind):
    """An encoder-style layer (is_causal False) would be computed causally: refused before
    any communication."""
    from graphopt.parallel import context

    layer = torch.nn.Module()
    layer.is_causal = False
    x = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ConfigError, match="is bidirectional .* use cp=1"):
        getattr(context, kind)(layer, x, x, x, None)


TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("name, config, message", [
    # Lfm2's short convolution mixes positions outside attention: each rank convolved its
    # chunk alone (gradient error 0.46-0.64 vs one process; a review)
    ("Lfm2", dict(TINY, layer_types=["conv", "full_attention"],
                  block_auto_adjust_ff_dim=False),
     "decoder layer 0 mixes positions outside the attention function"),
    # Doge builds a dynamic bias from dt_proj and hands it to attention as its mask: CP's
    # attention dropped it (dt_proj got no gradient; a review)
    ("Doge", dict(TINY, keep_window_size=2048), "DogeAttention passes its own attention mask"),
    # no attention at all: the ring was refused as for lightning layers, with the advice
    # cp_kind='all_to_all', which then asked for a cp dividing 0 heads (a review)
    ("Mamba", dict(vocab_size=128, hidden_size=32, num_hidden_layers=1, state_size=8),
     "no attention heads .*state-space.* use cp=1"),
])
def test_cp_refuses_models_whose_mixing_it_would_drop(name, config, message):
    """Found by running the model once with an attention function that mixes nothing
    (graphopt.parallel.context._mixing_outside_attention), before anything is sharded; the
    models CP runs pass the same probe (the plans of the test above)."""
    import transformers

    from graphopt.parallel.context import check_cp

    torch.manual_seed(0)
    model = getattr(transformers, f"{name}ForCausalLM")(
        getattr(transformers, f"{name}Config")(**config))
    for kind in ("ring", "all_to_all"):
        with pytest.raises(ConfigError, match=message):
            check_cp(model, ParallelPlan(cp=2, cp_kind=kind))
    assert model.config._attn_implementation != "graphopt_cp_probe"  # restored


class _OwnAttentionBlock(torch.nn.Module):
    """A pre-norm block with its own causal F.scaled_dot_product_attention (not transformers'
    attention interface, which CP replaces)."""

    def __init__(self, norm):
        super().__init__()
        self.norm, self.qkv, self.o = norm(32), torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)

    def forward(self, x):
        b, length, h = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, length, 3, 4, 8).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(a.transpose(1, 2).reshape(b, length, h))


class _OwnAttentionLM(torch.nn.Module):
    def __init__(self, norm, container):
        import transformers

        super().__init__()
        self.config = transformers.LlamaConfig(vocab_size=64, hidden_size=32,
                                               num_attention_heads=4, num_hidden_layers=2)
        self.embed, self.head = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64)
        blocks = [_OwnAttentionBlock(norm), _OwnAttentionBlock(norm)]
        self.blocks = container(*blocks) if container is torch.nn.Sequential else \
            container(blocks)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids=None, inputs_embeds=None, **kwargs):
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("build, message", [
    # position 0 moved by +1 in every unit: LayerNorm subtracted it, the probe saw nothing
    (lambda t: _OwnAttentionLM(torch.nn.LayerNorm, torch.nn.ModuleList), "decoder layer 0"),
    (lambda t: t.GPTNeoForCausalLM(t.GPTNeoConfig(
        vocab_size=128, hidden_size=64, num_layers=2, num_heads=4,
        attention_types=[[["global"], 2]])), "decoder layer 0"),
    # its own attention code takes the causal mask from the mask function (None in the
    # probe): moving the last position changed the others, which hid the mixing
    (lambda t: t.GPTNeoXJapaneseForCausalLM(t.GPTNeoXJapaneseConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_multiple_size=2)), "decoder layer 0"),
    # blocks in an nn.Sequential: no ModuleList of layers, the probe did not run
    (lambda t: _OwnAttentionLM(torch.nn.RMSNorm, torch.nn.Sequential),
     r"the model \(no ModuleList of decoder layers found\)"),
])
def test_cp_refuses_models_with_their_own_attention_code(build, message):
    """A review found each accepted under cp=2 and trained silently wrong (each rank attends
    within its own chunk: gradients 0.98-1.42 off, relative): attention written by the model
    itself, not through transformers' attention interface."""
    import transformers

    from graphopt.parallel.context import check_cp

    torch.manual_seed(0)
    model = build(transformers).double()
    with pytest.raises(ConfigError, match=message + ".* mixes positions outside the attention"):
        check_cp(model, ParallelPlan(cp=2, cp_kind="all_to_all"))


@pytest.mark.parametrize("name, config", [
    ("GPTNeoXJapanese", dict(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                             num_attention_heads=4, intermediate_multiple_size=2)),
    ("Lfm2", dict(TINY, layer_types=["conv", "full_attention"],
                  block_auto_adjust_ff_dim=False)),
])
def test_cp_refuses_layers_that_never_call_the_attention_function_in_any_dtype(name, config):
    """In bf16 the probe's numbers drown in rounding (8 eps = 0.06): GPT-NeoX-Japanese (its
    own attention code) and Lfm2's convolution were accepted, CP logits 0.58 off (a
    re-review), and so was GPT-NeoX-Japanese in float32 with a zero-initialized output
    projection. Every decoder layer must reach transformers' attention function."""
    import transformers

    from graphopt.parallel.context import check_cp

    torch.manual_seed(0)
    model = getattr(transformers, f"{name}ForCausalLM")(
        getattr(transformers, f"{name}Config")(**config)).to(torch.bfloat16)
    with pytest.raises(ConfigError, match="never calls transformers' attention function"):
        check_cp(model, ParallelPlan(cp=2, cp_kind="all_to_all"))


LLAMA4 = dict(TINY, intermediate_size_mlp=128, head_dim=16, num_local_experts=2,
              num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layers=[1, 0])


@pytest.mark.parametrize("build, message", [
    # the window in a composite model's text config passed the check: ring logits 0.5-0.6 off
    (lambda t: t.Gemma3ForConditionalGeneration(t.Gemma3Config(
        text_config=dict(TINY, head_dim=16, sliding_window=4,
                         layer_types=["sliding_attention", "full_attention"]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=32, patch_size=16),
        mm_tokens_per_image=4)), r"sliding-window attention \(window 4 tokens\) under CP"),
    # Llama4's chunked attention (its mask function's result was dropped: 0.35-0.41 off)
    (lambda t: t.Llama4ForCausalLM(t.Llama4TextConfig(**LLAMA4, attention_chunk_size=4)),
     r"chunked attention \(attention_chunk_size\) under CP is not executed"),
    # and its query temperature, computed from the chunk's own positions
    (lambda t: t.Llama4ForCausalLM(t.Llama4TextConfig(**LLAMA4, attention_chunk_size=None,
                                                      floor_scale=4)),
     "attention temperature tuning"),
])
def test_cp_refuses_position_dependent_attention_in_any_config(build, message):
    """A later review found three silently wrong CP runs that the probe cannot see (their
    masks and query scales bypass the attention function it replaces)."""
    import transformers

    from graphopt.parallel.context import check_cp

    torch.manual_seed(0)
    model = build(transformers)
    for kind in ("ring", "all_to_all"):
        with pytest.raises(ConfigError, match=message):
            check_cp(model, ParallelPlan(cp=2, cp_kind=kind), seq=16)


@pytest.mark.parametrize("build", [
    # every layer has RoPE and no chunking: temperature tuning (NoPE layers only) is inactive
    lambda t: t.Llama4ForCausalLM(t.Llama4TextConfig(**dict(LLAMA4, no_rope_layers=[1, 1]),
                                                     attention_chunk_size=None)),
    # a window configured but no layer uses it (layer_types all full_attention)
    lambda t: t.Qwen3ForCausalLM(t.Qwen3Config(**TINY, head_dim=16, use_sliding_window=True,
                                               sliding_window=4, max_window_layers=8)),
])
def test_cp_accepts_configs_whose_position_dependent_features_are_off(build):
    """A review of the refusals above: these were refused although nothing they refuse
    is active in them."""
    import transformers

    from graphopt.parallel.context import check_cp

    torch.manual_seed(0)
    check_cp(build(transformers), ParallelPlan(cp=2, cp_kind="all_to_all"))


def test_cp_refuses_lightning_decay_tables_that_are_not_the_slopes():
    """CP runs MiniMax's lightning layers from slope_rate (state passing between ranks),
    where transformers' forward reads the decay tables built from it at init: slopes
    edited without rebuilding the tables are refused (a review found the same in the
    ONNX export); rebuilt, they pass."""
    from graphopt.models import build_model
    from graphopt.parallel.context import check_cp

    model = build_model("minimax")
    plan = ParallelPlan(cp=2, cp_kind="all_to_all")
    layers = [m for m in model.modules() if hasattr(m, "decay_factors")]
    with torch.no_grad():
        for layer in layers:
            layer.slope_rate.mul_(2.0)
    with pytest.raises(ConfigError, match="query_decay buffer is not the decay of its "
                       "slope_rate"):
        check_cp(model, plan)
    with torch.no_grad():
        for layer in layers:
            for table, value in zip((layer.query_decay, layer.key_decay, layer.diagonal_decay),
                                    layer.decay_factors(layer.slope_rate)):
                table.copy_(value)
    check_cp(model, plan)
    # a float32 model loaded from a bf16 / fp16 checkpoint (the tables are persistent
    # buffers) holds rounded tables: not refused (it was, by float32's tolerance; a
    # re-review), and neither is a model on the meta device (it crashed on the device)
    for dtype in (torch.bfloat16, torch.float16):
        rounded = build_model("minimax")
        rounded.load_state_dict(build_model("minimax").to(dtype).state_dict())
        check_cp(rounded, plan)
    from graphopt.models import build_architecture, resolve_model

    check_cp(build_architecture(resolve_model("minimax"), dtype=torch.bfloat16), plan)


def test_cp_attention_refuses_a_sliding_window_passed_to_it_shorter_than_the_sequence():
    """The attention functions refuse a window the model passes at run time, whatever its
    config says, where it is shorter than the whole sequence (CP's attention would drop it);
    as long, it changes nothing."""
    from graphopt.parallel import context

    layer = torch.nn.Module()
    assert context._dropped_by_cp(layer, None, {"sliding_window": 4}, 8) == [
        context._window_refusal(4, 8)]
    assert context._dropped_by_cp(layer, None, {"sliding_window": 8}, 8) == []


def test_cp_probe_passes_moe_models_whose_routing_changes_the_rounding():
    """Moving position 0 can reroute it, which changes every expert GEMM's row count and so
    the rounding at later positions (~1e-7 in float32): not mixing. A review of the probe's
    first version (exact comparison) found 2-4 of 8 seeds of float32 Mixtral, Qwen3-MoE,
    DeepSeek-V3 and MiniMax refused."""
    from graphopt.models import build_model
    from graphopt.parallel.context import check_cp

    for name in ("mixtral", "minimax"):
        for seed in range(4):
            model = build_model(name, dtype=torch.float32, seed=seed)
            check_cp(model, ParallelPlan(cp=2, cp_kind="all_to_all"))
            assert not model._forward_hooks and not any(
                m._forward_hooks for m in model.modules())  # the probe's hooks are gone


def _compiled_ring_worker(rank, world):
    import graphopt
    from graphopt.models import build_model
    from graphopt.parallel.context import cp_loss, shard_sequence

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    ref = build_model("llama", dtype=torch.float64)
    _full_precision_rmsnorm(ref)
    model = graphopt.compile(copy.deepcopy(ref), options={"parallel": ParallelPlan(cp=2),
                                                          "lowering": "eager"})
    report = model.graphopt_parallel
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    local, labels = shard_sequence(ids, report.mesh)
    cp_loss(model(input_ids=local, use_cache=False).logits, labels, report.mesh).backward()
    full_labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    torch.nn.functional.cross_entropy(ref(input_ids=ids, use_cache=False).logits.flatten(0, 1),
                                      full_labels.flatten()).backward()
    grad_err = max(float((_full(p.grad) - _held(n, r.grad, report)).abs().max())
                   for (n, p), r in zip(model.named_parameters(), ref.parameters()))
    compiled = [r for r in graphopt.reports() if r.status == "compiled"]
    return (grad_err, [r.fallback for r in compiled],
            sum(torch._dynamo.utils.counters["graph_break"].values()))


def test_compiled_ring_attention_layer_is_one_graph():
    """graphopt.compile with ring CP: the ring's exchanges are inside graphopt's ops, so a
    decoder layer is one graph that graphopt compiles with its passes (Dynamo broke it at
    each of Python's P2P calls: 10 graphs per layer call), and the gradients equal one
    process."""
    for grad_err, fallbacks, breaks in run_distributed(_compiled_ring_worker, 2):
        assert grad_err < 1e-9, grad_err
        assert breaks == 0, breaks
        assert fallbacks == [None], fallbacks  # both layers share one graph


def _same_tokens_worker(rank, world):
    from graphopt.models import build_model
    from graphopt.parallel import build_mesh, parallelize
    from graphopt.parallel.context import shard_sequence

    plan = ParallelPlan(cp=2, **A2A)
    mesh = build_mesh(plan)
    model = parallelize(build_model("llama"), plan, mesh)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    local, _ = shard_sequence(ids, mesh)
    zeros, _ = shard_sequence(torch.zeros(2, 8, dtype=torch.long), mesh)
    return config_errors(
        lambda: model(input_ids=ids),  # the whole batch on every CP rank, as DP feeds it
        lambda: model(inputs_embeds=model.get_input_embeddings()(ids)),
        lambda: model(input_ids=local),
        lambda: model(input_ids=local.clone()),  # a chunk that lost shard_sequence's mark
        lambda: model(input_ids=zeros))  # equal chunks from shard_sequence: a real batch


def test_every_cp_rank_given_the_same_tokens_is_refused():
    """A CP model fed the whole batch on every rank (a loop written for data parallelism)
    ran without an error: logits 0.4 and gradients 0.58 off one process (a review). Chunks
    from shard_sequence, also equal ones, and copies of them run."""
    for messages in run_distributed(_same_tokens_worker, 2):
        assert "every CP rank was given the same tokens" in messages[0]
        assert "every CP rank was given the same tokens" in messages[1]
        assert messages[2:] == ["ran", "ran", "ran"]


def test_auto_picks_cp_only_when_allowed_and_never_one_cp_refuses():
    """parallel='auto' picked ring CP for a Llama job on 2 ranks, and a loop written for
    data parallelism then trained silently wrong; it picked ring CP for a sliding-window
    Mistral and a Llama with attention dropout, which CP then refused (a review). CP plans
    now need cluster['cp'] = True, and those CP refuses are passed over with the reason."""
    import transformers

    from graphopt.models import build_model
    from graphopt.parallel.auto import auto_plan

    cluster = {"seq": 4096, "global_batch": 64}
    plan, notes = auto_plan(build_model("llama", dtype=torch.float64), 2, cluster)
    assert plan.cp == 1 and "cp > 1 changes what each rank is fed" in notes[1], notes
    plan, _ = auto_plan(build_model("llama", dtype=torch.float64), 2, {**cluster, "cp": True})
    assert plan.cp == 2
    tiny = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)
    mistral = transformers.MistralForCausalLM(transformers.MistralConfig(
        **tiny, sliding_window=1024))
    plan, notes = auto_plan(mistral, 2, {**cluster, "cp": True})
    assert plan.cp == 1 and "sliding-window attention (window 1024 tokens) under CP" in \
        notes[1], notes
    mistral = transformers.MistralForCausalLM(transformers.MistralConfig(
        **tiny, sliding_window=4096))  # Mistral-7B's: CP runs 4096-token sequences
    plan, notes = auto_plan(mistral, 2, {**cluster, "cp": True})
    assert plan.cp == 2, notes
    dropout = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **tiny, attention_dropout=0.1))
    plan, notes = auto_plan(dropout, 2, {**cluster, "cp": True})
    assert not (plan.cp > 1 and plan.cp_kind == "ring"), plan.describe()
    with pytest.raises(ConfigError, match=r"\['cp'\] must be True"):
        auto_plan(dropout, 2, {**cluster, "cp": "yes"})


def test_graphopt_s_check_forwards_leave_length_dependent_rope_as_they_found_it():
    """transformers' dynamic NTK RoPE caches the frequencies of the longest sequence it has
    run; graphopt's own check forwards (CP's probe, the TP layout's derivation, PP's stage
    check on 16 tokens) left a model with 8 original positions computing 16 positions'
    frequencies, so a later 12-token batch differed from one process's (a review: 1.2e-3
    off under pp x cp). After the checks the rotary state and logits equal a fresh model's."""
    from graphopt.models import build_model
    from graphopt.parallel import derive_tp_layout
    from graphopt.parallel.apply import decoder_layers
    from graphopt.parallel.context import check_cp
    from graphopt.parallel.pipeline import _check_stages_compute_the_model

    def build():
        return build_model("llama", dtype=torch.float64,
                           **LENGTH_DEPENDENT_ROPE["llama_dynamic_rope"])

    model, fresh = build(), build()
    rotary = model.model.rotary_emb
    before = (rotary.inv_freq.clone(), rotary.max_seq_len_cached)
    long_ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    check_cp(model, ParallelPlan(cp=2, **A2A))
    derive_tp_layout(model, lambda: model(input_ids=long_ids, use_cache=False), 2)
    _check_stages_compute_the_model(model, decoder_layers(model))
    assert rotary.max_seq_len_cached == before[1]
    assert torch.equal(rotary.inv_freq, before[0])
    ids = long_ids[:, :12]
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits,
                                   fresh(input_ids=ids, use_cache=False).logits,
                                   rtol=0, atol=0)


def test_cp_names_a_model_that_cannot_run_as_built_not_its_attention():
    """A float64 Mixtral with grouped_mm experts cannot run eagerly at all (no float64
    grouped_mm kernel): the CP probe's failure was blamed on the attention ("does not go
    through that interface ... use cp=1", a review). The refusal names the model's own
    forward and the fix."""
    from graphopt.models import build_model
    from graphopt.parallel.context import check_cp

    model = build_model("mixtral", dtype=torch.float64)
    model.set_experts_implementation("grouped_mm")
    with pytest.raises(ConfigError, match=r"cp > 1 probes the model's attention with one "
                       r"eager forward, and the model's own forward failed: .*grouped_mm "
                       r"experts have no float64 kernel"):
        check_cp(model, ParallelPlan(cp=2, cp_kind="all_to_all"))


def _compiled_lightning_worker(rank, world):
    import torch.distributed as dist

    import graphopt
    from graphopt.models import build_model
    from graphopt.parallel.context import cp_loss, shard_sequence

    torch.manual_seed(0)
    ref = build_model("minimax", dtype=torch.float32)
    ref.set_experts_implementation("grouped_mm")
    model = graphopt.compile(copy.deepcopy(ref), options={
        "parallel": ParallelPlan(cp=2, **A2A), "attention": "exact", "lowering": "eager"})
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    local, labels = shard_sequence(ids, model.graphopt_parallel.mesh)
    loss = cp_loss(model(input_ids=local, use_cache=False).logits, labels,
                   model.graphopt_parallel.mesh)
    loss.backward()
    dist.all_reduce(loss := loss.detach().clone())
    logits = ref(input_ids=ids, use_cache=False).logits
    want = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    return float(loss) / world, float(want), dict(graphopt.graph_breaks())


def test_compiled_minimax_under_cp_is_whole_graphs():
    """graphopt.compile of MiniMax under cp=2: its lightning layers (replaced by the CP
    kernel) resolved the process group by name inside the traced code, a call Dynamo
    cannot trace: 7 graph breaks per forward (a review). The layers now hold the group
    itself: no graph break, and the loss equals one process's (float32)."""
    for loss, want, breaks in run_distributed(_compiled_lightning_worker, 2):
        assert breaks == {}, breaks
        assert abs(loss - want) <= 1e-5 * abs(want), (loss, want)
