"""The attention pass (registered as "attention"): ``attention_pass`` holds
:class:`AttentionPass`, ``patterns`` the graph patterns it matches."""

from graphopt.passes.attention.attention_pass import AttentionPass
from graphopt.passes.attention.patterns import minimax_slopes

__all__ = ["AttentionPass", "minimax_slopes"]
