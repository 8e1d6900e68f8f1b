"""Random numbers under TP and CP (graphopt.parallel.rng): dropout masks are drawn per rank
where a rank holds a split of the values (TP's heads and FFN columns, SP's and CP's sequence
shards) and alike where TP keeps them replicated. Checked on transformers' Starcoder2
(attention, residual and embedding dropout; eager attention, float64, 2 gloo ranks): the
masks each rank drew, put together, replayed in one process give the TP run's loss and every
gradient; activation checkpointing replays the same masks."""

from __future__ import annotations

import contextlib

import pytest
import torch

from graphopt.distributed import run_distributed
from graphopt.parallel.rng import (
    HEAD_TAG,
    SEQUENCE_TAG,
    SHARED_TAG,
    draws_randomly,
    region_base,
    region_seed,
)
from graphopt.planner.plan import ParallelPlan


def _starcoder2(dropout=0.5, attention=0.5, attn_implementation="eager", embedding=None):
    import transformers

    config = transformers.Starcoder2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attention_dropout=attention, residual_dropout=dropout,
        embedding_dropout=dropout if embedding is None else embedding,
        tie_word_embeddings=False, sliding_window=None, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    return transformers.Starcoder2ForCausalLM(config).double()


def _loss(model, ids):
    logits = model(input_ids=ids, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _ids():
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


@contextlib.contextmanager
def _recorded_masks():
    """Seeds the generator alike on every rank and patches F.dropout to record each call's
    keep mask (yielded list): drawn with the same generator calls as dropout
    (``dropout(ones)``), so a kept element whose input is 0 is recorded kept (an all-dropped
    attention row makes o_proj's output row exactly its zero bias)."""
    original = torch.nn.functional.dropout
    masks: list[torch.Tensor] = []

    def dropout(input, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return input
        keep = original(torch.ones_like(input), p, True) != 0
        masks.append(keep)
        return input * keep / (1 - p)

    torch.nn.functional.dropout = dropout
    try:
        torch.manual_seed(5)
        yield masks
    finally:
        torch.nn.functional.dropout = original


def _full_grads(model):
    return {n.replace(".inner.", "."): p.grad.full_tensor() if hasattr(p.grad, "full_tensor")
            else p.grad for n, p in model.named_parameters()}


class _Checkpointed(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(self.inner, *args, use_reentrant=False,
                                                 **kwargs)


def _tp_worker(rank, world, sp, recompute):
    import graphopt.parallel.rng as rng
    from graphopt.parallel import parallelize

    layers = recompute if isinstance(recompute, int) else 0
    model = parallelize(_starcoder2(), ParallelPlan(tp=2, sp=sp, recompute_layers=layers))
    model.train()
    if recompute == "mixers":  # a checkpoint around each attention alone, hooks inside
        for layer in model.model.layers:
            layer.self_attn = _Checkpointed(layer.self_attn)
    with _recorded_masks() as masks:  # every TP rank seeded alike
        loss = _loss(model, _ids())
        loss.backward()
    grads = _full_grads(model)
    notes = [n for n in model.graphopt_parallel.notes if "random numbers" in n]
    return loss.item(), grads, masks, notes, rng.region_seed(HEAD_TAG, rank, 7)


def _replay(masks):
    """The loss and gradients of one process that applies ``masks`` in call order."""
    model = _starcoder2().train()
    it = iter(masks)
    original = torch.nn.functional.dropout

    def replay(input, p=0.5, training=True, inplace=False):
        return input if not training or p == 0 else input * next(it) / (1 - p)

    torch.nn.functional.dropout = replay
    try:
        loss = _loss(model, _ids())
        loss.backward()
    finally:
        torch.nn.functional.dropout = original
    assert next(it, None) is None
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _combine(first, second, split_calls):
    """One process's masks from two TP ranks': equal where the values are replicated, put
    together on dim 1 (heads [B, H, S, S] or sequence [B, S, D]) where they are split."""
    combined = []
    for a, b in zip(first, second, strict=True):
        if a.shape == b.shape and a.dim() == 3 and a.shape[1] == 16:  # replicated [B, S, D]
            assert torch.equal(a, b), "replicated values got different masks on TP ranks"
            combined.append(a)
        else:
            agree = float((a == b).double().mean())
            split_calls.append(agree)
            combined.append(torch.cat([a, b], 1))
    return combined


@pytest.mark.parametrize("sp", [False, True])
def test_tp_dropout_masks_split_by_rank_and_replay_in_one_process(sp):
    """Before: every TP rank drew the same masks on its heads (attention dropout) and, under
    SP, on its sequence shard (residual dropout): identical fraction 1.0 where independent
    masks at p = 0.5 agree on half. Now they are independent, the replicated ones equal, and
    the TP run computes exactly the model one process computes with those masks."""
    results = run_distributed(_tp_worker, 2, sp, 0)
    (loss, grads, first, notes, seed0), (loss1, _, second, _, seed1) = results
    assert notes and "per TP rank" in notes[0]
    assert seed0 % 2**32 != seed1 % 2**32  # mt19937 reads the low 32 bits only
    split: list[float] = []
    masks = _combine(first, second, split)
    # layers x (attention probabilities; under SP also the attention's and the MLP's
    # residual dropout on the writer's sequence shard)
    assert len(split) == 2 * (3 if sp else 1), [tuple(m.shape) for m in first]
    assert max(split) < 0.8, split
    want_loss, want = _replay(masks)
    assert loss == loss1
    assert abs(loss - want_loss) <= 1e-12 * abs(want_loss)
    for name, g in want.items():
        assert float((grads[name] - g).abs().max()) <= 1e-10 * float(g.abs().max()), name


def _compiled_worker(rank, world):
    import graphopt

    model = graphopt.compile(_starcoder2(), options={
        "parallel": ParallelPlan(tp=2, sp=True), "lowering": "eager"})
    model.train()
    with _recorded_masks() as masks:
        loss = _loss(model, _ids())
        loss.backward()
    grads = _full_grads(model)
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from graphopt.parallel.rng import Generators

    seeds = sum(len(_debug_get_cache_entry_list(f.__code__))
                for f in (Generators.seed, Generators.states, Generators.set_states))
    return loss.item(), grads, masks, len(graphopt.reports()), seeds


def test_tp_dropout_in_layers_graphopt_compile_compiled():
    """graphopt.compile with a plan compiles each decoder layer's forward in place: the
    region hooks inside it switch the generators outside the compiled graphs (graph
    breaks), and the result is the same exact replay as uncompiled. Dynamo traces none of
    the hooks' generator calls (it compiled ``Generators.seed`` once per seed, up to its
    recompile limit, with a warning: a review)."""
    (loss, grads, first, compiled, seeds), (_, _, second, _, _) = \
        run_distributed(_compiled_worker, 2)
    assert compiled > 1 and seeds == 0, (compiled, seeds)
    split: list[float] = []
    want_loss, want = _replay(_combine(first, second, split))
    assert len(split) == 6 and max(split) < 0.8, split
    assert abs(loss - want_loss) <= 1e-12 * abs(want_loss)
    for name, g in want.items():
        assert float((grads[name] - g).abs().max()) <= 1e-10 * float(g.abs().max()), name


@pytest.mark.parametrize("recompute", [2, "mixers"])
def test_tp_dropout_under_activation_checkpointing_replays_the_same_masks(recompute):
    """recompute_layers checkpoints each decoder layer, "mixers" each attention alone (its
    hooks inside the checkpoint, entered from the sequence region): the recomputation
    enters the same regions from the restored generator state (the mixer reads which
    stream it is in from the restored seed), so the gradients equal the run without it
    bit for bit under SP."""
    plain = run_distributed(_tp_worker, 2, True, 0)
    recomputed = run_distributed(_tp_worker, 2, True, recompute)
    for (loss, grads, masks, *_), (loss_r, grads_r, masks_r, *_) in zip(plain, recomputed):
        assert loss == loss_r
        # + the recomputation: the layers' 3 masks each, or the attentions' 2 each
        assert len(masks_r) == len(masks) + (6 if recompute == 2 else 4)
        for name in grads:
            assert torch.equal(grads[name], grads_r[name]), name


def _jitter_worker(rank, world):
    """Mixtral's router jitter noise (``uniform_`` in the MoE block, which TP keeps
    replicated; SP refuses the in-place write) with attention dropout on, so the head
    regions are hooked: the noise must stay the same on both TP ranks."""
    from graphopt.models import build_model
    from graphopt.parallel import parallelize

    model = parallelize(build_model("mixtral", dtype=torch.float64, router_jitter_noise=0.1,
                                    attention_dropout=0.3, attn_implementation="eager"),
                        ParallelPlan(tp=2, sp=False))
    model.train()
    noise: list[torch.Tensor] = []
    original = torch.Tensor.uniform_

    def recording(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        noise.append(out.detach().clone())
        return out

    torch.Tensor.uniform_ = recording
    try:
        torch.manual_seed(5)
        _loss(model, torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1)))
    finally:
        torch.Tensor.uniform_ = original
    return noise


def test_router_jitter_stays_alike_over_tp_ranks():
    first, second = run_distributed(_jitter_worker, 2)
    assert len(first) == len(second) == 2  # one per MoE block
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def _cp_worker(rank, world):
    from graphopt.parallel import build_mesh, cp_loss, parallelize, shard_sequence

    plan = ParallelPlan(cp=2)
    mesh = build_mesh(plan)
    model = parallelize(_starcoder2(attention=0.0), plan, mesh)
    model.train()
    with _recorded_masks() as masks:
        chunk, labels = shard_sequence(_ids(), mesh)
        out = model(input_ids=chunk, use_cache=False)
        cp_loss(out.logits, labels, mesh).backward()
    return masks, [n for n in model.graphopt_parallel.notes if "random numbers" in n]


def test_cp_ranks_draw_their_own_masks_on_their_chunks():
    """Each CP rank holds a chunk of every sequence: seeded alike, they drew the same
    residual and embedding dropout masks on their chunks (identical fraction 1.0)."""
    (first, notes), (second, _) = run_distributed(_cp_worker, 2)
    assert notes and "per CP rank" in notes[0]
    assert len(first) == len(second) == 5  # embedding + 2 x (attention, MLP) residual
    for a, b in zip(first, second, strict=True):
        assert a.shape == b.shape and float((a == b).double().mean()) < 0.8


def test_region_seeds():
    """The rank and kind change the seed's low 32 bits (the CPU generator's whole seed);
    the base is read back only from a seed of the same kind and rank."""
    seeds = {region_seed(tag, rank, 12345) % 2**32 for tag in (HEAD_TAG, SEQUENCE_TAG)
             for rank in range(4)}
    assert len(seeds) == 8
    assert region_base(region_seed(SEQUENCE_TAG, 3, 12345), SEQUENCE_TAG, 3) == 12345
    assert region_base(region_seed(SEQUENCE_TAG, 3, 12345), SEQUENCE_TAG, 2) is None
    assert region_base(region_seed(SHARED_TAG, 0, 12345), SEQUENCE_TAG, 0) is None
    assert region_base(5, SEQUENCE_TAG, 0) is None
    assert region_seed(SEQUENCE_TAG, 0, 2**40) < 2**63


def test_models_without_randomness_get_no_regions():
    from graphopt.models import build_model

    assert not draws_randomly(build_model("llama"))
    assert draws_randomly(build_model("llama", attention_dropout=0.1))
    assert draws_randomly(build_model("mixtral", router_jitter_noise=0.1))
    assert draws_randomly(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1)))


def _pp_cp_worker(rank, world):
    from graphopt.parallel import build_mesh, parallelize, shard_sequence

    plan = ParallelPlan(pp=2, cp=2, microbatch=1)
    mesh = build_mesh(plan)
    # (no embedding dropout: pp > 1 refuses draws outside the stages' modules)
    model = _starcoder2(attention=0.0, attn_implementation="sdpa", embedding=0.0).train()
    model = parallelize(model, plan, mesh)
    with _recorded_masks() as masks:
        chunk, labels = shard_sequence(_ids(), mesh)
        model.step(chunk, labels=labels)
    return mesh["pp"].get_local_rank(), mesh["cp"].get_local_rank(), masks


def test_pipeline_stages_under_cp_draw_their_own_masks_per_cp_rank():
    """Under PP the stages seed their own draws; the CP ranks of a stage seeded them alike
    and drew the same masks on their chunks (identical fraction 1.0)."""
    by_stage: dict[int, dict[int, list[torch.Tensor]]] = {}
    for pp_rank, cp_rank, masks in run_distributed(_pp_cp_worker, 4):
        by_stage.setdefault(pp_rank, {})[cp_rank] = masks
    for stage in by_stage.values():
        first, second = stage[0], stage[1]
        assert first and len(first) == len(second)
        for a, b in zip(first, second, strict=True):
            assert a.shape == b.shape and float((a == b).double().mean()) < 0.8


def _pp_tp_worker(rank, world, sp):
    from graphopt.parallel import build_mesh, parallelize

    plan = ParallelPlan(pp=2, tp=2, sp=sp, microbatch=1)
    mesh = build_mesh(plan)
    # (no embedding dropout: pp > 1 refuses draws outside the stages' modules)
    model = _starcoder2(attention=0.0, attn_implementation="sdpa", embedding=0.0).train()
    model = parallelize(model, plan, mesh)
    with _recorded_masks() as masks:
        model.step(_ids(), labels=_ids())
    return mesh["pp"].get_local_rank(), mesh["tp"].get_local_rank(), masks


@pytest.mark.parametrize("sp", [False, True])
def test_pipeline_stages_under_tp_split_masks_only_where_sp_splits_the_sequence(sp):
    """PP x TP (world 4): a stage's layers keep their TP regions. Residual dropout acts on
    the replicated hidden state without SP (the TP ranks of a stage draw the same masks, as
    one process would) and on each rank's sequence shard with SP (their own masks)."""
    by_stage: dict[int, dict[int, list[torch.Tensor]]] = {}
    for pp_rank, tp_rank, masks in run_distributed(_pp_tp_worker, 4, sp):
        by_stage.setdefault(pp_rank, {})[tp_rank] = masks
    for stage in by_stage.values():
        first, second = stage[0], stage[1]
        assert first and len(first) == len(second)
        for a, b in zip(first, second, strict=True):
            agree = float((a == b).double().mean())
            assert a.shape == b.shape and (agree < 0.8 if sp else agree == 1.0)
