"""The attention pass (registered as "attention"), one module per responsibility:

- ``attention_pass``: :class:`AttentionPass`, options and the order of the steps;
- ``sdpa_causal_mask``: report softmax-attention sites; exact SDPA causal mask -> is_causal;
- ``linear_to_lightning``: exact MiniMax block loop / parallel form -> lightning_attention;
- ``softmax_to_lightning``: APPROXIMATE softmax -> Lightning Attention (mode "lightning");
- ``lightning_call``: inserting the ``graphopt::lightning_attention_fwd`` call;
- ``match_linear``, ``match_softmax``, ``match_common``: the patterns (no graph edits).
"""

from graphopt.passes.attention.attention_pass import AttentionPass
from graphopt.passes.attention.softmax_to_lightning import minimax_slopes

__all__ = ["AttentionPass", "minimax_slopes"]
