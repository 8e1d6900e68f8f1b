"""The attention pass (registered as "attention"): ``attention_pass`` holds
:class:`AttentionPass`; the patterns it matches are in ``match_linear`` (linear attention),
``match_softmax`` (softmax attention) and ``match_common`` (shared helpers)."""

from graphopt.passes.attention.attention_pass import AttentionPass, minimax_slopes

__all__ = ["AttentionPass", "minimax_slopes"]
