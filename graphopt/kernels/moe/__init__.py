"""MoE expert computation with sorted dispatch: permute token copies by expert, run every
expert on one contiguous segment, weight and combine (the form Megablocks, Tutel and
Megatron-Core's token dispatchers use). See :mod:`graphopt.kernels.moe.dispatch`."""

from graphopt.kernels.moe.dispatch import (
    capacity_keep_mask,
    moe_experts,
    sort_by_expert,
)

__all__ = ["capacity_keep_mask", "moe_experts", "sort_by_expert"]
