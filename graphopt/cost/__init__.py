"""Cost model: hardware/cluster profiles, per-node roofline costs on FX graphs, collective
alpha-beta costs, memory (model states, activation liveness), calibration of this machine,
and whole-step estimates.

    from graphopt.cost import estimate, load_profile, collective_time
    est = estimate(model, {"input_ids": ids, "labels": ids}, "h100-sxm", tracing="fake")
    # tracing="fake": a model built on the meta device (no weights); "real" runs real weights
"""

from graphopt.cost.collectives import collective_time
from graphopt.cost.estimate import Estimate, estimate, trace_step
from graphopt.cost.graph_cost import GraphCost, NodeCost, graph_cost, lightning_flops
from graphopt.cost.memory import liveness_peak, model_state_bytes
from graphopt.cost.profiles import (
    CLUSTERS,
    DEVICES,
    default_profile_name,
    load_profile,
    profile_names,
)

__all__ = ["CLUSTERS", "DEVICES", "Estimate", "GraphCost", "NodeCost", "collective_time",
           "default_profile_name", "estimate", "graph_cost", "lightning_flops",
           "liveness_peak", "load_profile", "model_state_bytes", "profile_names",
           "trace_step"]
