"""GEMM-shape table (graphopt.cost.gemm_table) and the planner's per-rank GEMM pricing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from graphopt.cost.gemm_table import GEMM_TABLES, peak_rate, rate, relative_rate
from graphopt.cost.profiles import CLUSTERS, DeviceProfile
from graphopt.errors import ConfigError
from graphopt.planner.model import LayerCost, _sub, plan_model
from graphopt.planner.perf import _gemm_factor, evaluate
from graphopt.planner.plan import ParallelPlan

H100 = CLUSTERS["h100-sxm"]
T = "sm90-bf16"
SMALL = {"hidden_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
         "num_key_value_heads": 2, "intermediate_size": 2816, "vocab_size": 4000}


def test_grid_points_are_the_measured_values_read_symmetrically_in_n_and_k():
    grid = GEMM_TABLES[T]
    # 4096 rows, N = 512, K = 4096 and N = 4096, K = 512: XLA's 649.96 and 543.12 TFLOP/s
    assert rate(T, 4096, 512, 4096) == pytest.approx((649.96 + 543.12) / 2)
    assert rate(T, 512, 4096, 4096) == rate(T, 4096, 4096, 512) == rate(T, 4096, 512, 4096)
    assert rate(T, 16384, 4096, 4096) == pytest.approx(793.13)
    assert peak_rate(T) == max(max(r) for g in grid.values() for r in g) == 808.70
    # rows between two slices: log-linear; beyond them: clamped
    mid = rate(T, 4096 * 2**0.5, 1024, 1024)
    assert rate(T, 4096, 1024, 1024) < mid < rate(T, 8192, 1024, 1024)
    assert rate(T, 1024, 4096, 4096) == rate(T, 4096, 1024, 4096)  # largest dim: the rows
    assert rate(T, 1024, 1024, 1024) == rate(T, 4096, 1024, 1024)  # rows clamped at 4096
    assert rate(T, 1 << 20, 4096, 4096) == rate(T, 16384, 4096, 4096)


def test_small_dims_keep_losing_throughput_and_large_ones_saturate():
    at = [relative_rate(T, 16384, 4096, n) for n in (16, 64, 128, 256, 512, 4096, 1 << 16)]
    assert all(0 < a < b for a, b in zip(at, at[1:-1]))  # extrapolated below 256, falling
    assert at[-1] == at[-2] <= 1.0                         # clamped above 4096
    assert relative_rate(T, 1 << 16, 1 << 16, 1 << 16) == pytest.approx(793.13 / 808.70)


def test_profiles_name_a_known_table_or_none():
    assert H100.device.gemm_table == T and CLUSTERS["a100-80gb"].device.gemm_table == ""
    with pytest.raises(ConfigError, match="gemm_table must be one of 'sm90-bf16'"):
        dataclasses.replace(H100.device, gemm_table="sm90")


def test_layer_gemms_are_recorded_with_their_token_and_tp_dimensions():
    """Every compute-bound mm of a Llama layer (forward, input and weight gradients) lands on
    its shape: 2048 tokens, hidden 1024, Q/O 1024 (8 heads x 128), FFN 2816; K/V (N = 256)
    are memory-bound on an H100 at this size and stay out, as they stay out of gemm_s."""
    model = plan_model("llama3-8b", 2048, H100, overrides=SMALL)
    sec = {k[:3]: k[3] for k in model.dense.gemm_shapes}
    assert set(sec) == {(2048, 1024, 1024), (2048, 2816, 1024)}
    # 3 GEMMs (forward, dgrad, wgrad) per projection: Q + O at 1024, 3 FFN ones at 2816
    assert sec[(2048, 1024, 1024)] == pytest.approx(6 * 2 * 2048 * 1024 ** 2 / 989.5e12)
    assert sec[(2048, 2816, 1024)] == pytest.approx(sec[(2048, 1024, 1024)] * 3 * 2816 / 2048)
    assert sum(sec.values()) < model.dense.gemm_s  # + attention and per-kernel overheads
    assert {k[:3] for k in model.head.gemm_shapes} == {(2048, 4000, 1024)}  # vocabulary: TP


def test_sub_and_mix_combine_gemm_shapes_by_shape():
    a = LayerCost(3.0, 0, 0, 0, 0, 0, gemm_shapes=((8, 4, 2, 2.0), (8, 2, 2, 1.0)))
    b = LayerCost(1.0, 0, 0, 0, 0, 0, gemm_shapes=((8, 4, 2, 1.0), (8, 2, 2, 1.0)))
    assert _sub(a, b).gemm_shapes == ((8, 4, 2, 1.0),) and _sub(a, b).gemm_s == 2.0
    assert _sub(b, a).gemm_shapes == () and _sub(b, a).gemm_s == 0.0


def test_tp_shards_are_priced_at_their_own_shape():
    model = plan_model("llama3-8b", 8192, H100)
    f1, f8 = (_gemm_factor(model.dense, ParallelPlan(tp=tp), T) for tp in (1, 8))
    # Llama 3 8B at 8k tokens: whole GEMMs run near the table's best; TP=8 cuts the K/V
    # projections to N = 128 and Q/O to 512
    assert 1.0 <= f1 < 1.05 and 1.08 < f8 < 1.2
    assert _gemm_factor(model.dense, ParallelPlan(tp=8, microbatch=4), T) < f8  # more rows
    assert _gemm_factor(model.dense, ParallelPlan(tp=8), "") == 1.0

    def step(cluster, tp):  # the compute (exposed DP traffic would dilute the ratios)
        return evaluate(ParallelPlan(dp_shard=64 // tp, zero_stage=3, tp=tp, sp=tp > 1),
                        model, cluster, 64).compute_s

    plain = dataclasses.replace(H100, device=dataclasses.replace(H100.device, gemm_table=""))
    # the table only ever slows a plan down, TP=8 more than TP=1 (matmul_efficiency is the
    # largest GEMMs' efficiency)
    assert step(plain, 1) <= step(H100, 1) < step(plain, 1) * 1.05
    assert step(H100, 8) / step(plain, 8) > step(H100, 1) / step(plain, 1) + 0.03


def test_fp32_models_are_not_priced_by_the_bf16_table():
    model = plan_model("llama3-8b", 2048, H100, torch.float32, overrides=SMALL)
    plain = dataclasses.replace(H100, device=dataclasses.replace(H100.device, gemm_table=""))
    plan = ParallelPlan(tp=2)
    assert evaluate(plan, model, H100, 8).step_s == evaluate(plan, model, plain, 8).step_s


def test_device_profile_from_json_takes_gemm_table():
    dev = DeviceProfile("x", {"float32": 1e12, "bfloat16": 4e12}, 1e9, 1e9, gemm_table=T)
    assert dev.gemm_table == T
