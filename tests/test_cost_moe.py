"""graphopt.cost.moe: the EP schedule model's limiting cases and the auto choice."""

import pytest

from graphopt.cost.moe import MoELayerShape, a2a_latency, choose_schedule, schedule_times
from graphopt.cost.profiles import CLUSTERS
from graphopt.errors import ConfigError

LAYER = MoELayerShape(tokens=4096, top_k=8, hidden=7168, ffn=2048)


def test_one_rank_has_no_communication():
    times = schedule_times(LAYER, 1, "h200")
    device = CLUSTERS["h200"].device
    compute = LAYER.expert_flops / (device.flops_for("bfloat16") * device.matmul_efficiency)
    for schedule, (seconds, _) in times.items():
        assert seconds == pytest.approx(compute), schedule


def test_limiting_cases():
    inside = schedule_times(LAYER, 8, "h200")  # one node: 2-D a2a is the flat one
    assert inside["hierarchical"][0] == pytest.approx(inside["flat"][0])
    across = schedule_times(LAYER, 64, "h200", backward=True)
    assert across["peer"][0] <= across["flat"][0]  # no barrier can only start earlier
    assert across["chunked"][0] <= across["flat"][0]  # C=1 is flat; the best C is kept
    small = a2a_latency(MoELayerShape(128, 8, 7168, 2048), 64, "h200")
    assert small["hierarchical"] < small["flat"]  # N-1 instead of P-L inter-node messages
    one_domain = a2a_latency(LAYER, 64, "cloudmatrix384")
    assert one_domain["hierarchical"] == pytest.approx(one_domain["flat"])


def test_auto_choice_and_errors():
    best, chunks, times = choose_schedule(LAYER, 64, "h200")
    assert times[best] == min(times.values()) and chunks >= 1
    with pytest.raises(ConfigError, match="exceeds cluster"):
        schedule_times(LAYER, 10**6, "h200")
    with pytest.raises(ConfigError, match="must divide the EP size"):
        schedule_times(LAYER, 12, "h200", ranks_per_node=8)
    # a review: ep=0 was a ZeroDivisionError, ep=-4 chose 'peer', negative sizes passed
    for ep in (0, -4):
        with pytest.raises(ConfigError, match="ep must be an int >= 1"):
            choose_schedule(LAYER, ep, "h200")
    with pytest.raises(ConfigError, match="MoELayerShape.tokens must be a number >= 0"):
        MoELayerShape(tokens=-1, top_k=2, hidden=8, ffn=8)
