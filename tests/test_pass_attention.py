"""attention pass, exact mode: transformers' MiniMax lightning-attention block loop becomes
graphopt::lightning_attention; look-alikes that are not Lightning Attention are refused."""

import copy
import re

import pytest
import torch

import graphopt
from graphopt import ConfigError, GraphoptConfig
from graphopt.config import GraphoptConfig as Config
from graphopt.models import build_model, sample_batch
from graphopt.passes.attention.softmax_to_lightning import NORM_EPS
from graphopt.testing import (
    as_function,
    assert_as_accurate_as_eager,
    assert_matches_eager,
    bind_inputs,
    run_pass,
    trace_for_pass,
)

LIGHTNING = "graphopt.lightning_attention_fwd.default"


def _layer(seq=40, block=16):
    from transformers import MiniMaxConfig
    from transformers.models.minimax import modeling_minimax as mm

    config = MiniMaxConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                           block_size=block, num_hidden_layers=1,
                           layer_types=["linear_attention"])
    torch.manual_seed(0)
    attn = mm.MiniMaxLightningAttention(config, layer_idx=0)

    def fn(x):
        return attn(x, position_embeddings=None, attention_mask=None)

    return attn, fn, torch.randn(2, seq, 64)


def _trace_and_run(mode, attn, fn, x):
    gm = trace_for_pass(fn, x)
    inputs = bind_inputs(gm, fn, x)
    return run_pass("attention", gm, Config(attention=mode), example_inputs=inputs)


@pytest.mark.parametrize("seq, block", [(40, 16), (64, 16), (7, 16)])
def test_block_loop_becomes_one_op(seq, block):
    attn, fn, x = _layer(seq, block)
    gm, record = _trace_and_run("exact", attn, fn, x)
    blocks = -(-seq // block)
    assert record.count("rewritten") == 1
    assert f"block loop of {blocks} blocks" in record.sites[0].reason
    assert "MiB for the backward" in record.sites[0].reason
    assert record.op_delta[LIGHTNING] == 1
    assert record.op_delta["aten.matmul.default"] == -4 * blocks  # the loop is gone
    assert_matches_eager(fn, as_function(gm, fn), [x.requires_grad_()], rtol=1e-5, atol=1e-5)


def test_keep_mode_reports_and_changes_nothing():
    attn, fn, x = _layer()
    gm, record = _trace_and_run("keep", attn, fn, x)
    assert not record.modified and record.op_delta == {}
    assert [s.action for s in record.sites] == ["kept"]


def test_refuses_decay_that_is_not_lightning_attention():
    attn, fn, x = _layer()
    with torch.no_grad():
        attn.query_decay.mul_(1.01)  # no longer exp(-slope * (i + 1))
    gm, record = _trace_and_run("exact", attn, fn, x)
    assert record.count("rewritten") == 0
    (site,) = [s for s in record.sites if s.action == "skipped"]
    assert "query decay" in site.reason and "not the exponential" in site.reason
    assert_matches_eager(fn, as_function(gm, fn), [x])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_block_loop_is_rewritten_and_as_accurate_as_eager(dtype):
    """A bf16/fp16 MiniMax holds its decay tables (and slope) rounded to that dtype: the
    check takes the tables' rounding, and the rewrite is as close to float64 as eager is."""
    attn, fn, x = _layer(64, 16)
    ref = copy.deepcopy(attn).double()
    attn.to(dtype)
    gm, record = _trace_and_run("exact", attn, fn, x.to(dtype))
    assert record.count("rewritten") == 1, record.sites

    def reference(x):
        return ref(x, position_embeddings=None, attention_mask=None)

    errors = assert_as_accurate_as_eager(reference, fn, as_function(gm, fn), [x.to(dtype)],
                                         list(ref.parameters()), list(attn.parameters()))
    assert len(errors) == 2 + 1 + 4  # output and state; d x; four parameters


def test_refuses_float32_tables_off_by_more_than_their_rounding():
    """float32 tables 8e-6 off exp(-slope d) are not Lightning Attention's (an rtol of 1e-5
    accepted them and the rewrite silently dropped the perturbation); tables a few float32
    ulps off are the rounding of exp and are accepted, except at distance 0, where exp(0)
    is 1 in every dtype (a table 1 ulp below 1 there is scaled, not rounded)."""
    attn, fn, x = _layer()
    with torch.no_grad():
        key, diagonal = attn.key_decay.clone(), attn.diagonal_decay.clone()
        attn.key_decay.copy_(torch.nextafter(attn.key_decay, torch.zeros(())))
        attn.diagonal_decay.copy_(torch.nextafter(attn.diagonal_decay, torch.ones(())))
    _, record = _trace_and_run("exact", attn, fn, x)
    assert record.count("rewritten") == 0
    assert any("key decay" in s.reason and "entries where slope x distance is 0 are not "
               "exactly 1" in s.reason for s in record.sites), record.sites
    with torch.no_grad():
        attn.key_decay.copy_(torch.where(key == 1, key, attn.key_decay))
    _, record = _trace_and_run("exact", attn, fn, x)
    assert record.count("rewritten") == 1, record.sites
    attn.diagonal_decay.copy_(diagonal)
    with torch.no_grad():
        attn.query_decay[..., 5, :] *= 1 + 8e-6
    gm, record = _trace_and_run("exact", attn, fn, x)
    assert record.count("rewritten") == 0
    (site,) = [s for s in record.sites if s.action == "skipped"]
    assert "query decay" in site.reason and "largest relative deviation 8.0e-06" in site.reason
    assert "float32 tables may deviate by 4 x 1.2e-07" in site.reason
    assert_matches_eager(fn, as_function(gm, fn), [x], rtol=0, atol=0)


def test_refuses_bf16_tables_off_by_a_few_of_their_units():
    """bf16 tables are allowed 1 eps (2 units of their rounding) per unit of 1 + slope d: a
    table 2% off (5 bf16 units near 1) is refused (4 eps accepted it)."""
    attn, fn, x = _layer()
    attn.to(torch.bfloat16)
    with torch.no_grad():
        attn.key_decay.mul_(0.98)
    _, record = _trace_and_run("exact", attn, fn, x.to(torch.bfloat16))
    assert record.count("rewritten") == 0
    assert any("key decay" in s.reason and "bfloat16 tables may deviate by 1 x 7.8e-03"
               in s.reason for s in record.sites), record.sites


def test_dynamic_shape_loop_is_checked_at_every_length_and_rewritten():
    """dynamic=True: Dynamo unrolls the loop for 3 blocks of 16 with bounds that follow S
    (the last block is rows [32, min(48, S))); the pass proves the decays at every length the
    guards allow (34..47 here) and rewrites the whole loop into one op: exact at the traced
    length and at others with 3 blocks, final state included."""
    attn, fn, x = _layer(40, 16)
    gm = trace_for_pass(fn, x, dynamic=True)
    gm, record = run_pass("attention", gm, Config(attention="exact"),
                          example_inputs=bind_inputs(gm, fn, x))
    [loop] = record.sites
    assert loop.action == "rewritten", loop.reason
    # Dynamo's guards: 3 blocks, and the last one neither 0/1 rows nor full
    assert "3 blocks (block 16, S 40; bounds follow the sequence length: checked at all 14 " \
        "lengths its guards allow, 34..47)" in loop.reason
    assert record.op_delta[LIGHTNING] == 1
    for seq in (40, 35, 34, 47):
        x = torch.randn(2, seq, 64, requires_grad=True)
        assert_matches_eager(fn, as_function(gm, fn), [x], rtol=1e-5, atol=1e-5)


def _dynamic_loop_pass(variant):
    """(fn, graph after the exact attention pass, its record) of :func:`_minimax_loop`
    traced with dynamic shapes at S 40 (blocks of 16: the last one 8 rows)."""
    attn = _layer(40, 16)[0]

    def fn(q, k, v):
        return _minimax_loop(attn, q, k, v, variant)

    args = [torch.randn(1, 4, 40, 16) for _ in range(3)]
    gm = trace_for_pass(fn, *args, dynamic=True)
    gm, record = run_pass("attention", gm, Config(attention="exact"),
                          example_inputs=bind_inputs(gm, fn, *args))
    return fn, gm, record


@pytest.mark.parametrize("variant", ["no_decay_mask", "computed_diagonal"])
def test_dynamic_loop_with_tables_computed_from_the_length_is_rewritten(variant):
    """A mask or decay computed from the block's length (``torch.tril(torch.ones(L, L))``,
    ``exp(-slope (i - j))`` from ``arange(L)``), not sliced from a fixed table, is evaluated
    at every length the guards allow (a review: refused as "computed from the sequence
    length" under dynamic=True where the static loop is rewritten). Outputs, final state
    and gradients equal eager at the traced length and others."""
    import re

    fn, gm, record = _dynamic_loop_pass(variant)
    [loop] = [s for s in record.sites if "block" in s.reason]
    assert loop.action == "rewritten" and re.search(
        r"checked at all 1[45] lengths its guards allow, 34\.\.4[78]\)", loop.reason), \
        record.sites
    assert record.op_delta[LIGHTNING] == 1
    for seq in (40, 34, 45):
        args = [torch.randn(1, 4, seq, 16, requires_grad=True) for _ in range(3)]
        assert_matches_eager(fn, as_function(gm, fn), args, rtol=1e-5, atol=1e-5)


def test_dynamic_loop_with_batch_equal_to_sequence_length_is_rewritten():
    """Duck sizing gives B == S one symbol s, and MiniMax's qkv ``view(B, S, H, -1)`` then
    sizes Q's sequence (s**2)//s; the pass reads that as s (an exact quotient) and proves
    the loop at every length as for B != S."""
    attn, fn, _ = _layer(40, 16)
    x = torch.randn(40, 40, 64)
    gm = trace_for_pass(fn, x, dynamic=True)
    gm, record = run_pass("attention", gm, Config(attention="exact"),
                          example_inputs=bind_inputs(gm, fn, x))
    assert record.sites[0].action == "rewritten", record.sites[0].reason
    assert "checked at all 14 lengths its guards allow, 34..47" in record.sites[0].reason
    for seq in (40, 35):
        x = torch.randn(seq, seq, 64, requires_grad=True)
        assert_matches_eager(fn, as_function(gm, fn), [x], rtol=1e-5, atol=1e-5)


def _minimax_loop(attn, q, k, v, variant):
    """transformers' MiniMax block loop (MiniMaxLightningAttention.forward, no cache) over
    attn's decay tables, with a variant that is right at one length only: "shifted_query"
    reads rows [8 - L, 8) of the query table for a last block of L rows (rows [0, 8) at
    L = 8), "constant_decay" decays the state by a fixed 8 rows after the last block."""
    b, h, s, d = q.shape
    blk = attn.block_size
    state = torch.zeros(b, h, d, d, dtype=q.dtype)
    row = state[:, :, 0]  # a view made before the loop
    outputs = []
    n = (s + blk - 1) // blk
    slope = attn.slope_rate * (s / 40) if variant == "slope_follows_s" else attn.slope_rate
    query_decay, key_decay = attn.query_decay, attn.key_decay
    diagonal_decay = attn.diagonal_decay
    if variant == "shared_slope":  # one slope (head 0's) for every head: [1, L, ...] tables
        slope, query_decay, key_decay = slope[:1], query_decay[:1], key_decay[:1]
        diagonal_decay = diagonal_decay[:, :1]
    if variant == "diagonal_on_batch":  # [H, 1, L, L]: the heads' decays on the batch axis
        diagonal_decay = diagonal_decay.transpose(0, 1)
    if variant == "query_on_features":  # [H, 1, L]: along the features (L = D = 16)
        query_decay = query_decay.transpose(-1, -2)
    if variant == "kv_shared_over_batch":
        k, v = k[:1], v[:1]
    if variant == "k_one_head":  # K broadcast over V's heads inside the products
        k = k[:, :1]
    if variant == "v_one_head":
        v = v[:, :1]
    if variant == "kv_longer":  # the loop reads K/V rows [0, S) of longer tensors (a crash)
        k, v = (torch.cat([x, x[:, :, :5]], dim=2) for x in (k, v))
    if variant == "v_float64":  # eager promotes the attention to float64
        v = v.double()
        query_decay, key_decay = query_decay.double(), key_decay.double()
        diagonal_decay = diagonal_decay.double()
        state = torch.zeros(b, h, d, d, dtype=torch.float64)
    if variant == "initial_state_written":  # through the view: the loop starts elsewhere
        row.copy_(torch.ones_like(row))
    if variant == "no_decay_normalized":  # positive features and a running key sum
        q, k = (torch.nn.functional.elu(x) + 1 for x in (q, k))
        key_sum = torch.zeros(b, h, d, 1, dtype=q.dtype)
    for i in range(n):
        start, end = i * blk, min(i * blk + blk, s)
        size = end - start
        qb, kb, vb = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
        ks, vs = kb, vb
        if variant == "next_rows":  # the state reads the next block's rows (full blocks)
            j = (i + 1) % n
            ks, vs = k[:, :, j * blk:(j + 1) * blk], v[:, :, j * blk:(j + 1) * blk]
        q_decay = query_decay[..., :size, :] if variant != "query_on_features" else \
            query_decay[..., :size]
        decay = torch.exp(-slope * size)
        if i == n - 1 and variant == "shifted_query":
            q_decay = attn.query_decay[:, 8 - size:8]
        if i == n - 1 and variant == "constant_decay":
            decay = torch.exp(-attn.slope_rate * 8)
        if variant and variant.startswith("no_decay"):  # causal linear attention without decay
            scores = torch.matmul(qb, kb.transpose(-1, -2))
            ones = torch.ones(size, size, dtype=q.dtype)
            if variant == "no_decay":  # tril masks
                scores = torch.tril(scores)
            elif variant == "no_decay_mask":  # a causal mask of ones, multiplied
                scores = scores * torch.tril(ones)
            elif variant == "no_decay_offset_mask":  # tril(x, 1): one row into the future
                scores = torch.tril(scores, 1)
            elif variant == "no_decay_full_mask":  # not causal
                scores = scores * ones
            elif variant == "no_decay_scaled_mask":  # ones scaled by 1 - 3e-7 (not rounding)
                scores = scores * (torch.tril(ones) * (1 - 3e-7))
            elif variant == "no_decay_near_one_mask":  # 1 - 3e-7 below the diagonal only
                scores = scores * (torch.tril(ones) - torch.tril(ones, -1) * 3e-7)
            elif variant == "no_decay_decayed_query":  # a decayed query, undecayed rest
                qb = qb * q_decay
                scores = torch.tril(scores)
            elif variant == "no_decay_scaled_query":  # the query scaled by a number
                qb = 0.5 * qb
                scores = torch.tril(scores)
            elif variant in ("no_decay_subtracted", "no_decay_normalized"):
                scores = torch.tril(scores)
            elif variant == "no_decay_length_mask":  # causal only for an 8-row last block
                scores = scores * torch.tril(ones, size - 8 if i == n - 1 else 0)
            if variant == "no_decay_subtracted":  # inter - intra
                outputs.append(torch.matmul(qb, state) - torch.matmul(scores, vb))
            elif variant == "no_decay_normalized":  # Katharopoulos et al. 2020 eq. 9 (its
                # denominator: Q_b @ sum of earlier keys + the block's causal key sums)
                num = torch.matmul(qb, state) + torch.matmul(scores, vb)
                outputs.append(num / (torch.matmul(qb, key_sum)
                                      + scores.sum(-1, keepdim=True)))
                key_sum = key_sum + kb.sum(-2).unsqueeze(-1)
            else:
                outputs.append(torch.matmul(qb, state) + torch.matmul(scores, vb))
            state = state + torch.matmul(kb.transpose(-1, -2), vb)
            continue
        if variant == "swapped_operands":  # every elementwise product written the other way
            intra = torch.matmul(diagonal_decay[:, :, :size, :size]
                                 * torch.matmul(qb, kb.transpose(-1, -2)), vb)
            outputs.append(torch.matmul(q_decay * qb, state) + intra)
            kv = torch.matmul((key_decay[:, -size:] * ks).transpose(-1, -2), vs)
            state = torch.exp(size * -slope) * state + kv
            continue
        diagonal = diagonal_decay[:, :, :size, :size]
        if variant == "computed_diagonal":  # exp(-slope (i - j)) below the diagonal, from
            # the block's length (transformers' decay_factors, per block)
            rows = torch.arange(size, dtype=q.dtype)
            distance = rows[:, None] - rows[None, :]
            diagonal = torch.exp(torch.where(distance >= 0, -slope * distance,
                                             float("-inf")))
        with torch.set_grad_enabled(variant != "intra_no_grad"):
            intra = torch.matmul(torch.matmul(qb, kb.transpose(-1, -2)) * diagonal, vb)
        if variant == "state_detached" and i > 0:  # truncated backprop through the state
            state = state.detach()
        inter = torch.matmul(qb * q_decay, state)
        alpha = 0.5 if variant == "alpha_output" else 1
        outputs.append(torch.add(inter, intra, alpha=alpha))
        with torch.set_grad_enabled(variant != "state_no_grad"):  # truncated backprop
            kv = torch.matmul((ks * key_decay[:, -size:]).transpose(-1, -2), vs)
            if variant == "decay_after_sum":
                state = (state + kv) * decay
            elif variant == "gated_state":  # a decay times a gate read from the input
                state = state * decay * torch.sigmoid(qb.mean()) + kv
            else:
                state = torch.add(state * decay, kv,
                                  alpha=2.0 if variant == "alpha_state" else 1)
        if variant == "write_k_after_first_block" and i == 0:
            k[:, :, :blk].mul_(2.0)  # rows the state has already read
        if variant == "state_row_zeroed":  # the next block reads the written state
            state[:, :, 0].zero_()
    if variant == "write_q_after_loop":
        q.mul_(2.0)
    if variant in ("state_read_before_cat", "output_written_after_state_read"):
        scale = state.abs().amax()
        if variant == "output_written_after_state_read":  # after the op, before the cat
            outputs[-1][:, :, 0].mul_(0.5)
        return torch.cat(outputs, dim=-2) / scale, state
    return torch.cat(outputs, dim=-2), state


@pytest.mark.parametrize("variant, reason", [
    ("shifted_query", r"query decay at sequence length \d+ is rows \[\(\d+, 8\)\]"),
    ("constant_decay", r"block decay of block 2 is a fixed table of a 8-long block, but at "
                       r"sequence length \d+ the block is \d+ long"),
    ("no_decay_length_mask", r"at sequence length \d+, block 2's diagonal table, computed "
                             r"from the length: the intra-block mask of a \d+-long block is "
                             r"not a causal mask of ones"),
])
def test_dynamic_loop_right_only_at_the_traced_length_is_refused(variant, reason):
    """A loop whose decays are Lightning Attention's at the traced length (S 40: the last
    block has 8 rows) but not at other lengths its graph runs at is left as written, with
    the length where it fails; it still computes what eager does there."""
    import re

    fn, gm, record = _dynamic_loop_pass(variant)
    loops = [s for s in record.sites if "block" in s.reason and s.action == "skipped"]
    assert len(loops) == 1 and re.search(reason, loops[0].reason), record.sites
    assert LIGHTNING not in record.op_delta
    args = [torch.randn(1, 4, 37, 16, requires_grad=True) for _ in range(3)]
    assert_matches_eager(fn, as_function(gm, fn), args, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant, batch, reason", [
    ("write_k_after_first_block", 2, "writes Q, K or V (or a view of them) in place after"),
    ("write_q_after_loop", 2, "writes Q, K or V (or a view of them) in place after"),
    ("diagonal_on_batch", 4, "does not broadcast as [H, L, L]"),
    ("query_on_features", 2, "does not broadcast as [H, L, 1]"),
    ("kv_shared_over_batch", 2, "different batch sizes"),
    ("shared_slope", 2, "slope is not one value per query head"),
    ("state_row_zeroed", 2, "writes the loop's values (or a view of them) in place"),
    ("initial_state_written", 2, "copy_ writes the loop's values (or a view of them)"),
    ("output_written_after_state_read", 2, "mul_ writes the loop's values (or a view of"),
    ("k_one_head", 2, "K has 1 heads and V 4, Q 4"),
    ("v_one_head", 2, "K has 4 heads and V 1, Q 4"),
    ("v_float64", 2, "Q, K, V and the result have dtypes torch.float32, torch.float32, "
                     "torch.float64, torch.float64"),
])
def test_loops_whose_values_sit_elsewhere_are_refused(variant, batch, reason):
    """Found by a review, each rewritten before (errors 15-96, or a crash in the backward
    or the compile): Q/K/V written in place after the loop first read them (the kernel reads
    them where the loop ends; under no_grad, as eager autograd refuses these writes); decay
    tables with the right values broadcast along the wrong axes (the heads' decays over
    the batch when B = H, a query decay along the features when L = D: values alone do not
    show it); K/V shared over the batch; one slope for every head. A later review: a row
    of the state zeroed in place after each update (a write the loop's next block reads;
    the compile crashed), K or V with one head broadcast over the other's four (the
    backward crashed, the Triton kernel read V out of bounds), a float64 V and decays with
    float32 Q and K (eager computes in float64, the kernel in float32: 1.3e-5 off where
    eager is exact). A re-review: the zero initial state written through a view made
    before the loop (5.1 off), a block output written after the op (placed at an early read
    of the state) but before the cat (0.95 off). Each is left as written, with the reason,
    and equals eager."""
    attn = _layer(40, 16)[0]

    def fn(q, k, v):
        q, k, v = q * 1, k * 1, v * 1
        return _minimax_loop(attn, q, k, v, variant)

    with torch.no_grad():
        args = [torch.randn(batch, 4, 48, 16) for _ in range(3)]  # 3 full blocks
        gm = trace_for_pass(fn, *args)
        gm, record = run_pass("attention", gm, Config(attention="exact"),
                              example_inputs=bind_inputs(gm, fn, *args))
        assert LIGHTNING not in record.op_delta, record.sites
        assert any(reason in s.reason for s in record.sites if s.action == "skipped"), \
            record.sites
        got, want = as_function(gm, fn)(*args), fn(*args)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant, reason", [
    ("no_decay_offset_mask", "block output is not (Q*qd) @ S + ((Q K^T) * D) @ V; "
                             "graphopt's kernel computes Lightning Attention's form"),
    ("no_decay_full_mask", "the intra-block mask of a 16-long block is not a causal mask of "
                           "ones (1 on and below the diagonal, 0 above; nonzero entries where "
                           "the decay must be 0"),
    # within float32's rounding allowance of exp(-s d), but 1 is exact in every dtype (a
    # review: taken for ones, 2e-7 off eager in float64)
    ("no_decay_scaled_mask", "not a causal mask of ones (1 on and below the diagonal, 0 "
                             "above; entries where slope x distance is 0 are not exactly 1"),
    ("no_decay_near_one_mask", "not a causal mask of ones (1 on and below the diagonal, 0 "
                               "above; entries where slope x distance is 0 are not exactly 1"),
    ("no_decay_decayed_query", "block 0's state update is not S * exp(-slope * L)"),
    ("no_decay_scaled_query", "block output is not (Q*qd) @ S + ((Q K^T) * D) @ V; "
                              "graphopt's kernel computes Lightning Attention's form"),
    # a review: neither was reported (each correctly left as written)
    ("no_decay_subtracted", "block 0's output is inter - intra (Q_b @ S minus the intra-block "
                            "term), not their sum; graphopt's kernel computes"),
    ("no_decay_normalized", "block 0's output is inter + intra divided by another tensor (a "
                            "normalizer, such as Katharopoulos et al.'s Q_b @ sum of keys); "
                            "graphopt's kernel computes"),
    ("alpha_output", "block 0's output is one product + 0.5 x the other (add/sub with alpha), "
                     "not their sum; graphopt's kernel computes"),
    ("decay_after_sum", "block 0's state update is not S * exp(-slope * L) + (K * kd)^T @ V "
                        "(its state is read by add, matmul"),
    ("gated_state", "block 0's state update is not S * exp(-slope * L) + (K * kd)^T @ V "
                    "(its state is read by matmul, mul"),
])
def test_loops_of_other_math_are_reported_with_what_differs(variant, reason):
    """A review: a causal block loop without decay was neither rewritten nor reported, and
    a state decayed after the sum or gated by an input was reported as "block 0 has no
    state update". Each is left as written (its per-block products may become parallel
    forms, exactly), with a reason that names the form, and equals eager in float64."""
    attn = _layer(40, 16)[0].double()

    def fn(q, k, v):
        return _minimax_loop(attn, q * 1, k * 1, v * 1, variant)

    args = [torch.randn(2, 4, 40, 16, dtype=torch.float64, requires_grad=True)
            for _ in range(3)]
    gm = trace_for_pass(fn, *args)
    gm, record = run_pass("attention", gm, Config(attention="exact"),
                          example_inputs=bind_inputs(gm, fn, *args))
    loops = [s for s in record.sites if s.reason.startswith("linear-attention block loop")]
    assert len(loops) == 1 and loops[0].action == "skipped" and reason in loops[0].reason, \
        record.sites
    # the parallel forms compute exact decays where the layer's tables are float32 ones
    assert_matches_eager(fn, as_function(gm, fn), args, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("variant", ["state_read_before_cat", "swapped_operands", "no_decay",
                                     "no_decay_mask"])
def test_float64_loops_of_other_shapes_are_rewritten_and_exact(variant):
    """``state_read_before_cat``: the op goes before the first read of the loop's final
    state when that comes before the ``cat`` (a review: ``state.abs().amax()`` there
    crashed the compile: the state was read before the op that now computes it).
    ``swapped_operands``: ``decay * x`` for ``x * decay`` in every elementwise product
    (query, key, diagonal and block decays; ``exp(L * -slope)``) is the same loop (a later
    review: it was neither rewritten nor reported). ``no_decay``/``no_decay_mask``: causal
    linear attention without decay (tril, or a causal mask of ones), the kernel at slope 0
    (a review found it reported, not rewritten). Outputs and gradients equal eager in
    float64 (decay tables recomputed in float64)."""
    attn = _layer(40, 16)[0].double()
    with torch.no_grad():
        for name, table in zip(("query_decay", "key_decay", "diagonal_decay"),
                               attn.decay_factors(attn.slope_rate)):
            getattr(attn, name).copy_(table)

    def fn(q, k, v):
        return _minimax_loop(attn, q * 1, k * 1, v * 1, variant)

    args = [torch.randn(2, 4, 40, 16, dtype=torch.float64) for _ in range(3)]
    gm = trace_for_pass(fn, *args)
    gm, record = run_pass("attention", gm, Config(attention="exact"),
                          example_inputs=bind_inputs(gm, fn, *args))
    assert [s.action for s in record.sites] == ["rewritten"], record.sites
    assert ("without decay (slope 0)" in record.sites[0].reason) == \
        variant.startswith("no_decay"), record.sites
    args = [a.requires_grad_() for a in args]
    assert_matches_eager(fn, as_function(gm, fn), args, rtol=1e-10, atol=1e-10)


def test_loop_whose_state_is_updated_in_place_is_refused_with_its_reason():
    """``S += K_b^T @ V_b`` under no_grad (a review: refused with the generic "state update
    is not S + K_b^T @ V_b"): the reason names the in-place op; outputs equal eager."""
    def fn(q, k, v):
        b, h, s, d = q.shape
        state = torch.zeros(b, h, d, d, dtype=q.dtype)
        outputs = []
        for i in range(0, s, 16):
            qb, kb, vb = q[:, :, i:i + 16], k[:, :, i:i + 16], v[:, :, i:i + 16]
            outputs.append(qb @ state + torch.tril(qb @ kb.transpose(-1, -2)) @ vb)
            with torch.no_grad():
                state += kb.transpose(-1, -2) @ vb
        return torch.cat(outputs, dim=-2)

    args = [torch.randn(1, 2, 48, 8, dtype=torch.float64) for _ in range(3)]
    gm = trace_for_pass(fn, *args)
    gm, record = run_pass("attention", gm, Config(attention="exact"),
                          example_inputs=bind_inputs(gm, fn, *args))
    [loop] = [s for s in record.sites if "block loop" in s.reason]
    assert loop.action == "skipped" and "block 0's state is updated in place " \
        "(aten.add_.Tensor: S += ...)" in loop.reason, loop
    torch.testing.assert_close(as_function(gm, fn)(*args), fn(*args), rtol=1e-12, atol=1e-12)


def test_loop_with_a_detached_state_is_refused_with_its_reason():
    """``state = state.detach()`` between blocks (truncated backprop through the state): the
    kernel would differentiate through the whole chain. The loop is left as written (its
    blocks' intra products may become parallel forms), the report names the detach, and
    the gradients equal eager's."""
    attn = _layer(40, 16)[0]

    def fn(q, k, v):
        return _minimax_loop(attn, q * 1, k * 1, v * 1, "state_detached")

    args = [torch.randn(2, 4, 48, 16) for _ in range(3)]
    gm = trace_for_pass(fn, *args)
    gm, record = run_pass("attention", gm, Config(attention="exact"),
                          example_inputs=bind_inputs(gm, fn, *args))
    loops = [s for s in record.sites if "block loop" in s.reason]
    assert [s.action for s in loops] == ["skipped"], record.sites
    assert "reads block 0's state detached" in loops[0].reason
    args = [a.requires_grad_() for a in args]
    assert_matches_eager(fn, as_function(gm, fn), args, rtol=1e-5, atol=1e-5)


def test_no_match_for_other_concatenations():
    def fn(x):
        return torch.cat([x @ x.transpose(-1, -2), x * 2], dim=-2)

    gm = trace_for_pass(fn, torch.randn(2, 4, 8, 8))
    _, record = run_pass("attention", gm, Config(attention="exact"))
    assert record.sites == [] and not record.modified


def test_softmax_attention_is_reported_as_kept():
    def fn(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    gm = trace_for_pass(fn, *(torch.randn(1, 2, 8, 4) for _ in range(3)))
    _, record = run_pass("attention", gm, Config(attention="exact"))
    assert [s.action for s in record.sites] == ["kept"]
    assert "softmax attention" in record.sites[0].reason


def test_unknown_mode_says_what_exists():
    with pytest.raises(ConfigError, match=r"unknown attention mode 'linear'; valid modes: "
                       r"keep, exact, lightning"):
        GraphoptConfig.from_options({"attention": "linear"})
    with pytest.raises(ConfigError, match=r"lightning.norm must be 'rms' or 'none'"):
        GraphoptConfig.from_options({"attention": "lightning", "lightning": {"norm": "l2"}})


def test_minimax_model_exact_mode_matches_eager_logits_and_gradients():
    model = build_model("minimax", dtype=torch.float32)
    ids = sample_batch(model, batch=2, seq=48)  # 3 blocks of 16

    def fn(i):
        return model(input_ids=i, use_cache=False).logits

    compiled = torch.compile(fn, backend="graphopt", options={"lowering": "eager",
                                                              "attention": "exact"})
    assert_matches_eager(fn, compiled, [ids], params=list(model.parameters()),
                         rtol=1e-4, atol=1e-4)
    sites = [s for r in graphopt.reports() for p in r.pass_records("attention")
             for s in p.sites]
    assert [s.action for s in sites].count("rewritten") == 1  # the one linear-attention layer
    assert [s.action for s in sites].count("kept") == 1  # the softmax-attention layer


def test_float32_rounded_decay_tables_in_a_float64_model_are_reported():
    """transformers builds MiniMax's decay tables in float32; a float64 model holds them
    float32-rounded, while the rewrite computes the decays in float64 from the slope: the
    outputs differ from eager's by ~1e-7, which the report said nothing about (a review).
    The rewritten site now says by how much the tables deviate; with tables rebuilt in
    float64 there is no note and the rewrite equals eager to float64 rounding."""
    model = build_model("minimax", dtype=torch.float64).eval()
    ids = sample_batch(model, batch=2, seq=32)

    def fn(i):
        return model(input_ids=i, use_cache=False).logits

    for rebuilt in (False, True):
        if rebuilt:
            for module in model.modules():
                if hasattr(module, "decay_factors") and hasattr(module, "slope_rate"):
                    (module.query_decay, module.key_decay,
                     module.diagonal_decay) = module.decay_factors(module.slope_rate)
        torch._dynamo.reset()
        graphopt.clear_reports()
        compiled = torch.compile(fn, backend="graphopt", options={"lowering": "eager",
                                                                  "attention": "exact"})
        with torch.no_grad():
            got, want = compiled(ids), fn(ids)
        (site,) = [s for r in graphopt.reports() for p in r.pass_records("attention")
                   for s in p.sites if s.action == "rewritten"]
        error = float((got - want).abs().max() / want.abs().max())
        if rebuilt:
            assert "NOTE" not in site.reason and error < 1e-13, (site.reason, error)
        else:
            match = re.search(r"NOTE: the model's decay tables deviate from exp\(-slope\*d\) "
                              r"by up to (\S+) relative", site.reason)
            assert match and 1e-8 < float(match[1]) < 1e-6, site.reason
            assert 1e-10 < error < 1e-6, error


def test_forward_mode_tangents_through_graphopt_s_ops_equal_eager():
    """torch.autograd.forward_ad through a compiled MiniMax whose loop became graphopt's
    lightning op: the op has no forward-mode formula and dropped the tangent (off by 2.4 of
    22 before; a review). Calls with tangents now run Dynamo's graph (a FallbackWarning and a
    report note), calls without still run the rewrite; the op's own API refuses tangents."""
    import torch.autograd.forward_ad as fwad

    from graphopt.errors import FallbackWarning
    from graphopt.kernels.lightning import lightning_attention

    model = build_model("minimax", dtype=torch.float64).eval()
    model.set_attn_implementation("eager")  # CPU SDPA has no forward-mode formula
    model.requires_grad_(False)
    embeds = model.model.embed_tokens(sample_batch(model, batch=2, seq=20)).detach()
    tangent = torch.randn_like(embeds)

    def fn(e):
        return model(inputs_embeds=e, use_cache=False).logits

    def jvp(f):
        with fwad.dual_level():
            return fwad.unpack_dual(f(fwad.make_dual(embeds, tangent)))

    graphopt.clear_reports()
    compiled = torch.compile(fn, backend="graphopt", options={"lowering": "eager",
                                                              "attention": "exact"})
    # transformers' RMSNorm computes in float32: float32-level differences
    torch.testing.assert_close(compiled(embeds), fn(embeds), rtol=1e-5, atol=1e-6)
    with pytest.warns(FallbackWarning, match="forward-mode AD"):
        got = jvp(compiled)
    want = jvp(fn)
    torch.testing.assert_close(got.primal, want.primal, rtol=0, atol=1e-12)
    torch.testing.assert_close(got.tangent, want.tangent, rtol=0, atol=1e-12)
    rewritten = [r for r in graphopt.reports()
                 if any(p.count("rewritten") for p in r.pass_records("attention"))]
    assert rewritten and any("forward-mode AD" in n for r in rewritten for n in r.notes)
    q = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    slope = torch.rand(2, dtype=torch.float64)
    with fwad.dual_level(), pytest.raises(NotImplementedError, match="forward-mode AD"):
        lightning_attention(fwad.make_dual(q, torch.randn_like(q)), q, q, slope)
    # user code calling the op, compiled: Dynamo's graph holds the op itself, so there is no
    # tangent-carrying graph to fall back to (aot_eager drops the tangent silently)
    user = torch.compile(lambda x: lightning_attention(x, x, x, slope) * 2,
                         backend="graphopt", options={"lowering": "eager"})
    user(q)
    with fwad.dual_level(), pytest.raises(NotImplementedError, match="the model calls itself"):
        user(fwad.make_dual(q, torch.randn_like(q)))


@pytest.mark.parametrize("variant, seq, dynamic", [
    ("slope_follows_s", 40, True), ("next_rows", 48, False), ("alpha_state", 40, False),
    ("alpha_output", 40, False), ("state_no_grad", 40, False), ("intra_no_grad", 40, False),
    ("kv_longer", 37, False)])
def test_loops_that_are_not_lightning_attention_are_not_rewritten(variant, seq, dynamic):
    """Through the backend: the loop is not rewritten as one op (no 'rewritten' block loop;
    loop-shaped ones are 'skipped'), and outputs and gradients equal eager's. A loop with
    a torch.no_grad() block inside (the state update: truncated backprop; the intra
    products) came out with dK 0.76 and dQ 1.22 off, its outputs exact (a review)."""
    attn = _layer(40, 16)[0]

    def fn(q, k, v):
        return _minimax_loop(attn, q, k, v, variant)

    graphopt.clear_reports()
    compiled = torch.compile(fn, backend="graphopt", dynamic=dynamic,
                             options={"lowering": "eager", "attention": "exact"})
    for length in (seq, seq - 3) if dynamic else (seq,):
        args = [torch.randn(1, 4, length, 16, requires_grad=True) for _ in range(3)]
        assert_matches_eager(fn, compiled, args, rtol=1e-5, atol=1e-5)
    reports = graphopt.reports()
    assert all(r.fallback is None for r in reports)
    assert not [s for r in reports for p in r.pass_records("attention") for s in p.sites
                if "block loop" in s.reason and s.action == "rewritten"]


def test_trainable_slope_is_not_frozen_into_the_kernel():
    """A MiniMax layer whose slope_rate is a trainable Parameter: eager differentiates it only
    through the state decay (its tables are constants), the kernel through every decay, so
    the loop is kept (the review measured a 2x slope gradient and, after one step, 0.28
    forward error when it was rewritten)."""
    attn, fn, x = _layer(48, 16)
    attn.slope_rate = torch.nn.Parameter(attn.slope_rate.clone())
    graphopt.clear_reports()
    compiled = torch.compile(fn, backend="graphopt", options={"lowering": "eager",
                                                              "attention": "exact"})
    assert_matches_eager(fn, compiled, [x.requires_grad_()], params=[attn.slope_rate],
                         rtol=1e-5, atol=1e-5)
    sites = [s for r in graphopt.reports() for p in r.pass_records("attention")
             for s in p.sites if "block loop" in s.reason or "trainable" in s.reason]
    assert sites and all(s.action == "skipped" and "trainable parameter" in s.reason
                         for s in sites), sites


def test_dynamic_loop_whose_cat_is_the_graph_output_keeps_the_rewrite():
    """The loop's cat returned as is: its length is the sum of the blocks' symbolic lengths;
    the op runs on that many rows, so the capture guard sees the same output shape (with
    the last block's end instead, it dropped every rewrite of the graph)."""
    attn = _layer(40, 16)[0]

    def fn(q, k, v):
        return _minimax_loop(attn, q, k, v, None)[0]

    sites = []
    graphopt.clear_reports()
    compiled = torch.compile(fn, backend="graphopt", dynamic=True,
                             options={"lowering": "eager", "attention": "exact"})
    for length in (40, 37):
        args = [torch.randn(1, 4, length, 16, requires_grad=True) for _ in range(3)]
        assert_matches_eager(fn, compiled, args, rtol=1e-5, atol=1e-5)
    reports = graphopt.reports()
    assert all(r.fallback is None for r in reports), [r.fallback for r in reports]
    sites = [s for r in reports for p in r.pass_records("attention") for s in p.sites]
    assert [s.action for s in sites] == ["rewritten"], sites


def test_minimax_model_recompiled_for_a_new_length_keeps_the_rewrite():
    """The usual dynamic-shape path: a second sequence length makes torch.compile recompile
    with a symbolic length (automatic dynamic shapes). The recompiled graph's loop (bounds
    follow S) is still rewritten into one op, and logits and every gradient match eager at
    the new length and at another one the recompiled graph serves."""
    model = build_model("minimax", dtype=torch.float32)

    def fn(i):
        return model(input_ids=i, use_cache=False).logits

    graphopt.clear_reports()
    compiled = torch.compile(fn, backend="graphopt", options={"lowering": "eager",
                                                              "attention": "exact"})
    for seq in (32, 24, 21):  # 32: static compile; 24: recompiled with a symbolic S
        ids = sample_batch(model, batch=2, seq=seq)
        assert_matches_eager(fn, compiled, [ids], params=list(model.parameters()),
                             rtol=1e-4, atol=1e-4)
    reports = graphopt.reports()
    assert all(r.fallback is None for r in reports)
    loops = [s for r in reports for p in r.pass_records("attention") for s in p.sites
             if "block loop" in s.reason]
    assert [s.action for s in loops] == ["rewritten"] * len(loops) and len(loops) >= 2
    assert any("bounds follow the sequence length" in s.reason for s in loops)


class ToyGatedDeltaNet(torch.nn.Module):
    """The delta rule with a data-dependent gate (Qwen3-Next's linear attention, one step per
    token): not MiniMax's fixed decay, so not rewritten."""

    def forward(self, q, k, v, beta):
        state = q.new_zeros(q.shape[0], q.shape[-1], v.shape[-1])
        outs = []
        for t in range(q.shape[1]):
            kt, vt = k[:, t].unsqueeze(-1), v[:, t].unsqueeze(1)
            state = state - beta[:, t, None, None] * kt @ (kt.transpose(1, 2) @ state - vt)
            outs.append(q[:, t].unsqueeze(1) @ state)
        return torch.cat(outs, 1)


def test_a_delta_net_layer_is_reported_as_not_rewritten():
    """A review saw Qwen3-Next's Gated DeltaNet layers under attention="exact" neither
    rewritten nor mentioned: the unmatched-layer report knew only *LightningAttention* /
    *LinearAttention* class names."""

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear_attn = ToyGatedDeltaNet()

        def forward(self, q, k, v, beta):
            return self.linear_attn(q, k, v, beta)

    args = [torch.randn(2, 5, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 3), torch.rand(2, 5)]
    gm = trace_for_pass(Model(), *args)
    _, record = run_pass("attention", gm, Config(attention="exact"))
    assert [(s.action, s.site) for s in record.sites] == [("skipped", "linear_attn")], \
        record.sites
    assert record.sites[0].reason.startswith("ToyGatedDeltaNet: no block loop graphopt "
                                             "rewrites was found")


class RwkvToySelfAttention(torch.nn.Module):
    """RWKV's time mixing: projections (linear) and an element-wise recurrence, no matmul."""

    def __init__(self):
        super().__init__()
        self.key, self.value = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        k, v = self.key(x).exp(), self.value(x)
        num, den, outs = torch.zeros_like(x[:, 0]), torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            num, den = 0.9 * num + k[:, t] * v[:, t], 0.9 * den + k[:, t]
            outs.append(num / den)
        return torch.stack(outs, 1)


def test_an_rwkv_layer_is_reported_as_not_rewritten():
    """RWKV's attention has no matmul, so the unmatched-layer report, which looked for the
    layer's products, missed it (a re-review): its projections count."""

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = RwkvToySelfAttention()

        def forward(self, x):
            return self.attention(x)

    x = torch.randn(2, 5, 4)
    _, record = run_pass("attention", trace_for_pass(Model(), x), Config(attention="exact"))
    assert [(s.action, s.site) for s in record.sites] == [("skipped", "attention")], \
        record.sites


def test_a_linear_attention_layer_whose_loop_does_not_match_is_reported():
    """A review: a MiniMax prefill with its cache under dynamic=True, batch 2, one block
    (S 10) left the loop neither rewritten nor mentioned (the matcher's no-match is silent
    by design, for concatenations that are not loops); the only record blamed the decay
    matrix's dynamic size. A linear-attention layer without a loop record now says that
    none matched; one with a loop record or a rewrite gets nothing more."""
    from graphopt.passes.attention.attention_pass import _report_unmatched
    from graphopt.passes.base import PassContext
    from graphopt.report import PassRecord

    record = PassRecord("attention", "pre_autograd", "model", True)
    ctx = PassContext(Config(), record_=record)
    ctx.record("skipped", "model.layers.0.self_attn:matmul_1", "the decay matrix's size "
               "follows a dynamic input size")
    ctx.record("rewritten", "model.layers.2.self_attn:matmul_4", "parallel form")
    ctx.record("skipped", "model.layers.4.self_attn:cat", "the slope depends on an input")
    _report_unmatched({f"model.layers.{i}.self_attn": "MiniMaxLightningAttention"
                       for i in (0, 2, 4)}, {"model.layers.4.self_attn"}, ctx)
    added = record.sites[3:]
    assert [(s.action, s.site) for s in added] == [("skipped", "model.layers.0.self_attn")]
    assert "MiniMaxLightningAttention: no block loop graphopt rewrites" in added[0].reason


def test_bf16_minimax_model_is_rewritten_and_as_accurate_as_eager():
    """The bf16 model through torch.compile: its loop is rewritten (it used to be refused on
    its rounded tables) and logits and every gradient are as close to the float64 model's
    as bf16 eager's are."""
    model = build_model("minimax", dtype=torch.float64)
    low = copy.deepcopy(model).to(torch.bfloat16)
    embeds = model.get_input_embeddings()(sample_batch(model, batch=2, seq=48)).detach()

    def run(m):
        return lambda e: m(inputs_embeds=e, use_cache=False).logits

    compiled = torch.compile(run(low), backend="graphopt",
                             options={"lowering": "eager", "attention": "exact"})
    errors = assert_as_accurate_as_eager(run(model), run(low), compiled,
                                         [embeds.to(torch.bfloat16)], list(model.parameters()),
                                         list(low.parameters()))
    assert len(errors) == 2 + len(list(low.parameters())) - 1  # logits, d embeds, d params
    sites = [s for r in graphopt.reports() for p in r.pass_records("attention")
             for s in p.sites]
    assert [s.action for s in sites].count("rewritten") == 1, sites
    assert [r.fallback for r in graphopt.reports()] == [None] * len(graphopt.reports())


class RetNetStyle(torch.nn.Module):
    """Quadratic parallel form: ((Q K^T) * D) V with a decay mask built from a buffer."""

    def __init__(self, heads=4, causal=True, trainable=False):
        super().__init__()
        slope = torch.tensor([0.5, 0.1, 0.02, 0.0][:heads])
        if trainable:
            self.slope = torch.nn.Parameter(slope)
        else:
            self.register_buffer("slope", slope)
        self.causal = causal

    def forward(self, q, k, v):
        s = q.shape[2]
        i = torch.arange(s, dtype=q.dtype)
        gap = i.view(-1, 1) - i.view(1, -1)
        decay = torch.exp(-self.slope.view(-1, 1, 1) * gap.clamp(min=0))
        if self.causal:
            decay = decay * (gap >= 0)
        return ((q @ k.transpose(-1, -2)) * decay) @ v


class NoGradScores(RetNetStyle):
    """The decayed scores under torch.no_grad(), Q and K reaching the output elsewhere (so
    the capture guard's gradient paths do not change): the one op carried dQ 4.7 and dK
    12.7 off, relative (a review)."""

    def forward(self, q, k, v):
        with torch.no_grad():
            s = q.shape[2]
            i = torch.arange(s, dtype=q.dtype)
            gap = i.view(-1, 1) - i.view(1, -1)
            decay = torch.exp(-self.slope.view(-1, 1, 1) * gap.clamp(min=0)) * (gap >= 0)
            scores = (q @ k.transpose(-1, -2)) * decay
        return scores @ v + q * k


def test_a_parallel_form_partly_under_no_grad_is_left_as_written():
    model = NoGradScores()
    qkv = [t.detach().double().requires_grad_() for t in _qkv()]
    graphopt.clear_reports()
    compiled = torch.compile(model, backend="graphopt",
                             options={"lowering": "eager", "attention": "exact"})
    assert_matches_eager(model, compiled, qkv, rtol=1e-12, atol=1e-12)
    (site,) = [s for r in graphopt.reports() for p in r.pass_records("attention")
               for s in p.sites if "parallel form" in s.reason]
    assert site.action == "skipped" and "grad mode" in site.reason


def _qkv(s=24):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(2, 4, s, 8, generator=gen, requires_grad=True) for _ in range(3)]


def test_parallel_form_becomes_one_op():
    model, qkv = RetNetStyle(), _qkv()
    gm = trace_for_pass(model, *qkv)
    gm, record = run_pass("attention", gm, Config(attention="exact"),
                          example_inputs=bind_inputs(gm, model, *qkv))
    assert record.count("rewritten") == 1 and "parallel form" in record.sites[0].reason
    assert record.op_delta[LIGHTNING] == 1
    assert_matches_eager(model, as_function(gm, model), qkv, rtol=1e-4, atol=1e-4)


def test_parallel_form_float64_keeps_float64_slopes():
    """A float64 model's frozen slopes stay float64 (a float32 buffer rounded them: ~1e-10
    relative error in float64 outputs), so the rewrite matches eager at float64 precision."""
    model = RetNetStyle()
    model.slope = model.slope.double() * 1.0000001  # not representable in float32
    qkv = [x.detach().double().requires_grad_() for x in _qkv()]
    gm = trace_for_pass(model, *qkv)
    gm, record = run_pass("attention", gm, Config(attention="exact"),
                          example_inputs=bind_inputs(gm, model, *qkv))
    assert record.count("rewritten") == 1
    frozen = [b for n, b in gm.named_buffers() if n.startswith("_graphopt_slope")]
    assert [b.dtype for b in frozen] == [torch.float64]
    assert_matches_eager(model, as_function(gm, model), qkv, rtol=1e-12, atol=1e-12)


class Float32Decay(RetNetStyle):
    """A float64 model whose decay matrix is built in float32 (as transformers builds
    MiniMax's tables), then cast."""

    def forward(self, q, k, v):
        i = torch.arange(q.shape[2], dtype=torch.float32)
        gap = i.view(-1, 1) - i.view(1, -1)
        decay = torch.exp(-self.slope.float().view(-1, 1, 1) * gap.clamp(min=0)) * (gap >= 0)
        return ((q @ k.transpose(-1, -2)) * decay.to(q.dtype)) @ v


@pytest.mark.parametrize("model_cls", [RetNetStyle, Float32Decay])
def test_a_float32_rounded_decay_matrix_in_a_float64_parallel_form_is_reported(model_cls):
    """The parallel form's slopes are fitted to the matrix; the kernel computes exp(-s d)
    from them in float64, so a float32-rounded matrix leaves outputs ~1e-7 off eager, which
    its site now says (the loop form's note, carried over; nothing was said before)."""
    model = model_cls().double()
    qkv = [x.detach().double().requires_grad_() for x in _qkv(40)]
    gm = trace_for_pass(model, *qkv)
    gm, record = run_pass("attention", gm, Config(attention="exact"),
                          example_inputs=bind_inputs(gm, model, *qkv))
    (site,) = record.sites
    assert site.action == "rewritten", site
    with torch.no_grad():
        got, want = as_function(gm, model)(*qkv), model(*qkv)
    error = float((got - want).abs().max() / want.abs().max())
    if model_cls is RetNetStyle:
        assert "NOTE" not in site.reason and error < 1e-13, (site.reason, error)
    else:
        match = re.search(r"NOTE: the model's decay tables deviate from exp\(-slope\*d\) "
                          r"by up to (\S+) relative", site.reason)
        assert match and 1e-8 < float(match[1]) < 1e-5, site.reason
        assert 1e-10 < error < 1e-5, error


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parallel_form_is_rewritten_and_as_accurate_as_eager(dtype):
    """The decay matrix computed in bf16/fp16: slopes fitted over a whole column (exp(-0.02)
    in bf16 is 1% off, so -log of one entry misses at longer distances)."""
    ref, qkv = RetNetStyle().double(), _qkv(48)
    model = RetNetStyle().to(dtype)
    low = [x.detach().to(dtype) for x in qkv]
    gm = trace_for_pass(model, *low)
    gm, record = run_pass("attention", gm, Config(attention="exact"),
                          example_inputs=bind_inputs(gm, model, *low))
    assert record.count("rewritten") == 1, record.sites
    assert_as_accurate_as_eager(ref, model, as_function(gm, model), low, [], [])


class TableDecay(torch.nn.Module):
    """((Q K^T) * D) V with D a buffer of the given [.., S, S] shape."""

    def __init__(self, table):
        super().__init__()
        self.register_buffer("table", table)

    def forward(self, q, k, v):
        return ((q @ k.transpose(-1, -2)) * self.table) @ v


def _exp_table(slopes, s=24):
    gap = torch.arange(s).view(-1, 1) - torch.arange(s).view(1, -1)
    return torch.exp(-torch.tensor(slopes).view(-1, 1, 1) * gap.clamp(min=0)) * (gap >= 0)


@pytest.mark.parametrize("table, reason", [
    # One decay per *batch* element ([B, 1, S, S], B == H == 4): not per head.
    (_exp_table([0.5, 0.1, 0.02, 0.0]).unsqueeze(1), "differs between batch elements"),
    (torch.stack([_exp_table([0.1] * 4), torch.ones(4, 24, 24)]), "differs between batch"),
    (_exp_table([-0.15] * 4), "a negative slope"),
    (_exp_table([0.1] * 4) + torch.ones(24, 24).triu(1), "above the diagonal: not causal"),
])
def test_decay_tables_that_are_not_one_causal_decay_per_head_are_refused(table, reason):
    batch = table.shape[0] if table.dim() == 4 else 2
    model = TableDecay(table)
    qkv = [torch.randn(batch, 4, 24, 8, requires_grad=True) for _ in range(3)]
    gm = trace_for_pass(model, *qkv)
    gm, record = run_pass("attention", gm, Config(attention="exact"),
                          example_inputs=bind_inputs(gm, model, *qkv))
    assert record.count("rewritten") == 0
    assert any(reason in s.reason for s in record.sites), record.sites
    assert_matches_eager(model, as_function(gm, model), qkv)


@pytest.mark.parametrize("model, reason", [
    (RetNetStyle(causal=False), "not exp(-slope * (i - j)) below the diagonal and 0 above"),
    (RetNetStyle(trainable=True), "depends on an input or a trainable parameter"),
])
def test_parallel_form_refusals(model, reason):
    qkv = _qkv()
    gm = trace_for_pass(model, *qkv)
    gm, record = run_pass("attention", gm, Config(attention="exact"),
                          example_inputs=bind_inputs(gm, model, *qkv))
    assert record.count("rewritten") == 0
    assert any(reason in s.reason for s in record.sites if s.action == "skipped"), record.sites
    assert_matches_eager(model, as_function(gm, model), qkv)


@pytest.mark.parametrize("name, implementation", [("gpt2", "eager"), ("gpt2", "sdpa"),
                                                  ("llama", "eager"), ("llama", "sdpa")])
def test_every_softmax_attention_site_is_reported(name, implementation):
    model = build_model(name, attn_implementation=implementation)
    ids = sample_batch(model, batch=1, seq=16)

    def fn(i):
        return model(input_ids=i, use_cache=False).logits

    gm = trace_for_pass(fn, ids)
    _, record = run_pass("attention", gm, Config(attention="exact"))
    layers = model.config.num_hidden_layers
    # SDPA keeps softmax attention but swaps the constant causal mask for is_causal.
    action = "rewritten" if implementation == "sdpa" else "kept"
    assert [s.action for s in record.sites] == [action] * layers, record.sites
    assert record.modified == (implementation == "sdpa")


def test_lightning_mode_converts_causal_sdpa_to_the_documented_function():
    from graphopt.kernels.lightning import lightning_attention
    from graphopt.passes.attention import minimax_slopes

    def fn(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                enable_gqa=True)

    q = torch.randn(2, 4, 24, 8)
    k, v = torch.randn(2, 2, 24, 8), torch.randn(2, 2, 24, 8)
    gm = trace_for_pass(fn, q, k, v)
    gm, record = run_pass("attention", gm, Config(attention="lightning"))
    assert record.count("rewritten") == 1 and record.sites[0].reason.startswith("APPROXIMATE")
    expected = torch.nn.functional.rms_norm(
        lightning_attention(q, k, v, minimax_slopes(4, 0, 1), scale=8 ** -0.5), [8],
        eps=NORM_EPS)
    torch.testing.assert_close(as_function(gm, fn)(q, k, v), expected)


@pytest.mark.parametrize("kwargs, reason", [
    (dict(attn_mask=torch.ones(24, 24, dtype=torch.bool)), "depends on a graph input"),
    (dict(is_causal=False), "non-causal attention"),
    (dict(is_causal=True, dropout_p=0.1), "attention dropout > 0"),
])
def test_lightning_mode_refusals(kwargs, reason):
    def fn(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)

    gm = trace_for_pass(fn, *(torch.randn(1, 2, 24, 8) for _ in range(3)))
    _, record = run_pass("attention", gm, Config(attention="lightning"))
    assert [s.action for s in record.sites] == ["skipped"] and reason in record.sites[0].reason


def test_lightning_mode_keeps_sites_whose_inputs_move_or_whose_layer_is_unknown():
    """A hand-written causal softmax attention whose K is written in place after Q K^T: the
    kernel would read the written K where the attention ends (the review's in-place hole, on
    the approximate path); and lightning.every with no decoder-layer index (a site outside
    any layer) cannot tell whether the site keeps softmax: both are kept, with the reason."""
    def hand_written(write):
        def fn(x):  # (q, k, v of one input: computed ones of three would be cross attention)
            q, k, v = x[0] * 1, x[1] * 1, x[2] * 1
            mask = torch.full((24, 24), float("-inf")).triu(1)
            p = torch.softmax(q @ k.transpose(-1, -2) * 8 ** -0.5 + mask, dim=-1)
            if write:
                k.mul_(2.0)
            return p @ v, k.sum()  # (K itself returned would be a KV cache: kept)
        return fn

    qkv = [torch.randn(1, 2, 24, 8) for _ in range(3)]
    for write in (False, True):
        fn = hand_written(write)
        with torch.no_grad():
            gm = trace_for_pass(fn, torch.stack(qkv))
            _, record = run_pass("attention", gm, Config(attention="lightning"),
                                 example_inputs=bind_inputs(gm, fn, torch.stack(qkv)))
        assert [s.action for s in record.sites] == ["skipped" if write else "rewritten"], \
            record.sites
        if write:
            assert "in place after the attention first reads them" in record.sites[0].reason

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    gm = trace_for_pass(sdpa, *qkv)
    _, record = run_pass("attention", gm, Config.from_options(
        {"attention": "lightning", "lightning": {"every": 2}}))
    assert [s.action for s in record.sites] == ["skipped"]
    assert "lightning.every=2 cannot tell" in record.sites[0].reason


def test_lightning_mode_on_llama_trains_and_is_reported_approximate():
    model = build_model("llama", num_hidden_layers=4).train()
    ids = sample_batch(model, batch=2, seq=32)
    compiled = torch.compile(lambda i: model(input_ids=i, labels=i, use_cache=False).loss,
                             backend="graphopt", options={"lowering": "eager",
                                                          "attention": "lightning",
                                                          "lightning": {"every": 2},
                                                          "verify": True})
    loss = compiled(ids)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all()
                                        for p in model.parameters() if p.grad is not None)
    records = [p for r in graphopt.reports() for p in r.pass_records("attention")]
    actions = [s.action for p in records for s in p.sites]
    assert actions.count("rewritten") == 2 and actions.count("skipped") == 2  # every=2
    assert all(not p.exact for p in records)
    assert any(r.verify.get("status") == "approximate" for r in graphopt.reports())


def test_lightning_mode_every_1_converts_every_layer():
    model = build_model("llama", num_hidden_layers=3)
    ids = sample_batch(model, batch=1, seq=16)

    def fn(i):
        return model(input_ids=i, use_cache=False).logits

    gm = trace_for_pass(fn, ids)
    _, record = run_pass("attention", gm, Config(attention="lightning"),
                         example_inputs=bind_inputs(gm, fn, ids))
    assert [s.action for s in record.sites] == ["rewritten"] * 3, record.sites


def test_exact_mode_replaces_a_constant_causal_mask_by_is_causal():
    """transformers builds the S x S causal mask under torch.compile; exact mode proves it
    causal and uses SDPA's is_causal instead, so the mask construction is dead code."""
    def fn(q, k, v):
        s = q.shape[2]
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    args = [torch.randn(1, 2, 12, 4, requires_grad=True) for _ in range(3)]
    gm = trace_for_pass(fn, *args)
    gm, record = run_pass("attention", gm, Config(attention="exact"))
    assert [s.action for s in record.sites] == ["rewritten"] and "is_causal" in \
        record.sites[0].reason
    assert record.op_delta.get("aten.tril.default") == -1  # the mask is no longer built
    (sdpa,) = [n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert sdpa.kwargs["is_causal"] is True and sdpa.kwargs["attn_mask"] is None
    assert_matches_eager(fn, as_function(gm, fn), args)


def test_a_mask_built_from_random_numbers_is_never_proven_causal():
    """A review: ``tril(ones) & (randint(0, 50, (S, S)) > 0)`` (random key dropping) drew a
    causal mask at compile time about half the time; the site became is_causal and every
    later call ignored its mask (logits 1.7, gradients 8.2 off, no warning). A random op
    in the mask's construction now keeps the site, whatever the draw (10 seeds)."""
    def fn(q, k, v):
        s = q.shape[2]
        keep = torch.randint(0, 50, (s, s)) > 0
        mask = torch.ones(s, s, dtype=torch.bool).tril() & keep
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    args = [torch.randn(1, 2, 8, 4) for _ in range(3)]
    for seed in range(10):
        gm = trace_for_pass(fn, *args)
        torch.manual_seed(seed)
        state = torch.get_rng_state()
        _, record = run_pass("attention", gm, Config(attention="exact"))
        (site,) = record.sites
        assert site.action == "kept" and "draws random numbers" in site.reason, site
        assert torch.equal(torch.get_rng_state(), state)  # nothing drawn at compile time


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_finfo_min_causal_mask_is_causal_in_every_dtype(dtype):
    """transformers fills masked positions with finfo(dtype).min: float16's is -65504, above
    the -1e30 a fill had to reach, so float16 masks were "not the causal mask" (a review)."""
    def fn(q, k, v):
        s = q.shape[2]
        mask = torch.full((s, s), torch.finfo(q.dtype).min, dtype=q.dtype).triu(1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    args = [torch.randn(1, 2, 12, 8, dtype=dtype, requires_grad=True) for _ in range(3)]
    gm = trace_for_pass(fn, *args)
    gm, record = run_pass("attention", gm, Config(attention="exact"))
    assert [s.action for s in record.sites] == ["rewritten"], record.sites
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # SDPA's causal kernel sums in another order
    assert_matches_eager(fn, as_function(gm, fn), args, rtol=tol, atol=tol)


def _mask_sites(fn, lengths):
    """Compile ``fn`` with graphopt (dynamic=True: sizes reach the backend as SymInts),
    compare with eager at each length, return the attention sites of every report."""
    graphopt.clear_reports()
    compiled = torch.compile(fn, backend="graphopt", dynamic=True,
                             options={"lowering": "eager", "attention": "exact"})
    for seq in lengths:
        args = [torch.randn(1, 2, seq, 4, requires_grad=True) for _ in range(3)]
        assert_matches_eager(fn, compiled, args)
    reports = graphopt.reports()
    assert reports and all(r.fallback is None for r in reports)
    return [s for r in reports for p in r.pass_records("attention") for s in p.sites]


def test_causal_mask_built_from_a_dynamic_size_becomes_is_causal():
    """Under dynamic shapes the backend gets the sequence length as a SymInt; the mask built
    from it is proven causal at the example size and the probe sizes (it used to be refused
    as 'depends on a graph input's values': the SymInt was not read as a size)."""
    def fn(q, k, v):
        s = q.shape[2]
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    sites = _mask_sites(fn, (12, 9, 30))
    assert sites and all(s.action == "rewritten" and "is_causal=True" in s.reason
                         for s in sites), sites


@pytest.mark.parametrize("opening", [
    lambda d: (d % 1000 == 0) & (d > 1000),  # from S = 2001
    lambda d: d * 0.5 == 1000,               # from S = 2001 (its constant is 1000)
])
def test_size_dependent_mask_with_periodic_arithmetic_is_kept(opening):
    """Masks causal at every probed size but not beyond: each opens an entry above the
    diagonal from S = 2001 only, past every probe (SIZE_PROBES and each constant + 1, + 2).
    Built with a remainder or a product with 0.5, they are refused as unprovable (both were
    proven causal and rewritten to is_causal: wrong from S = 2001)."""
    def fn(q, k, v):
        i = torch.arange(q.shape[2])
        d = i[None, :] - i[:, None]
        mask = (d <= 0) | opening(d)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    sites = _mask_sites(fn, (12, 9))
    assert sites and all(s.action == "kept" and "probing sizes cannot prove it causal" in
                         s.reason for s in sites), sites


def test_exact_mode_keeps_a_padding_mask():
    def fn(q, k, v, mask):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    args = [torch.randn(1, 2, 6, 4) for _ in range(3)] + [torch.ones(6, 6, dtype=torch.bool)]
    gm = trace_for_pass(fn, *args)
    _, record = run_pass("attention", gm, Config(attention="exact"))
    assert [s.action for s in record.sites] == ["kept"] and not record.modified


def test_a_site_with_no_mask_to_drop_says_so():
    """OPT already calls SDPA with is_causal=True and no mask: its site was "kept" under
    attention='exact' with no reason (a review)."""
    from transformers import OPTConfig, OPTForCausalLM

    model = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64,
                                     num_hidden_layers=1, num_attention_heads=4,
                                     max_position_embeddings=64, word_embed_proj_dim=32)).eval()
    ids = torch.randint(0, 64, (2, 8))
    compiled = torch.compile(model, backend="graphopt",
                             options={"lowering": "eager", "attention": "exact"})
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids).logits, model(input_ids=ids).logits)
    sites = [s for r in graphopt.last_report().pass_records("attention") for s in r.sites]
    assert sites and all(s.action == "kept" and s.reason.endswith(
        "no mask to drop: already is_causal=True") for s in sites), sites


class _CausalLinearAttention(torch.nn.Module):
    """Causal linear attention without decay written as a block loop (Katharopoulos et al.
    2020, eq. 9, in blocks of ``block`` rows): o_b = Q_b S + mask(Q_b K_b^T) V_b, S += K_b^T
    V_b; the intra mask is ``tril`` or a causal mask of ones multiplied in."""

    def __init__(self, dim: int, heads: int, block: int, masked: bool) -> None:
        super().__init__()
        self.heads, self.block, self.masked = heads, block, masked
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        # elu + 1 features (Katharopoulos et al.) on the projection, as MiniMax applies its
        # activation: elu_backward's fake strides differ from its real ones for a transposed
        # input (torch 2.13, aot_eager too), so features of the [B, H, S, D] views fail there
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2)
                   for t in (torch.nn.functional.elu(self.qkv(x)) + 1).chunk(3, dim=-1))
        state = torch.zeros(b, self.heads, q.shape[-1], v.shape[-1], dtype=x.dtype)
        outputs = []
        for i in range((s + self.block - 1) // self.block):  # MiniMax's bounds: follow S
            start, end = i * self.block, min(i * self.block + self.block, s)
            qb, kb, vb = (t[:, :, start:end] for t in (q, k, v))
            scores = torch.matmul(qb, kb.transpose(-1, -2))
            if self.masked:
                n = qb.shape[2]
                scores = scores * torch.tril(torch.ones(n, n, dtype=x.dtype))
            else:
                scores = torch.tril(scores)
            outputs.append(torch.matmul(qb, state) + torch.matmul(scores, vb))
            state = state + torch.matmul(kb.transpose(-1, -2), vb)
        return torch.cat(outputs, dim=-2).transpose(1, 2).reshape(b, s, d)


@pytest.mark.parametrize("masked, dynamic", [(False, False), (True, False), (False, True)])
def test_causal_linear_attention_without_decay_is_rewritten_through_the_backend(masked,
                                                                                  dynamic):
    """A hand-written causal linear-attention block loop without decay compiled with
    backend="graphopt" (float64): rewritten into one Lightning op at slope 0 (the report
    says so), outputs and gradients equal eager's, also at another length under
    dynamic=True."""
    torch.manual_seed(0)
    model = _CausalLinearAttention(32, 2, 16, masked).double()
    graphopt.clear_reports()
    compiled = torch.compile(model, backend="graphopt", dynamic=dynamic,
                             options={"lowering": "eager", "attention": "exact"})
    for length in (40, 37) if dynamic else (40,):
        x = torch.randn(2, length, 32, dtype=torch.float64, requires_grad=True)
        assert_matches_eager(model, compiled, [x], rtol=1e-10, atol=1e-10)
    sites = [s for r in graphopt.reports() for p in r.pass_records("attention")
             for s in p.sites]
    assert all(r.fallback is None for r in graphopt.reports())
    assert [s.action for s in sites] == ["rewritten"], sites  # one compile
    assert "block loop of 3 blocks without decay (slope 0)" in sites[0].reason, sites
    assert ("bounds follow the sequence length" in sites[0].reason) == dynamic, sites
