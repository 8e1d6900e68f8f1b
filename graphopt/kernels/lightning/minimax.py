"""MiniMax's lightning-attention layer (transformers' ``MiniMaxLightningAttention``) around a
Lightning Attention kernel: the module-level form of the attention pass's block-loop rewrite,
for where a graph cannot hold the loop (context parallelism: the sequence is split over
ranks; ONNX export with a dynamic sequence axis: the loop count depends on it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Tensor = torch.Tensor

LIGHTNING_PARTS = ("qkv_proj", "act_fn", "slope_rate", "norm", "output_gate", "out_proj",
                   "num_attention_heads", "head_dim")
"""The parts of transformers' MiniMaxLightningAttention the layer reads."""


def lightning_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of MiniMax-form linear-attention layers (``layer_type ==
    "linear_attention"`` with :data:`LIGHTNING_PARTS`)."""
    return [(path, m) for path, m in model.named_modules()
            if getattr(m, "layer_type", None) == "linear_attention"
            and all(hasattr(m, a) for a in LIGHTNING_PARTS)]


def decay_tables_problem(layer: Any) -> str | None:
    """None when ``layer``'s decay tables (transformers' ``query_decay``, ``key_decay``,
    ``diagonal_decay`` buffers, which its forward reads, built from ``slope_rate`` in
    ``__init__``) are exp(-slope x distance) of its ``slope_rate`` as their dtype holds it
    (:func:`graphopt.passes.attention.match_linear.decay_deviation`, the attention pass's
    rule), else what differs. The module-level rewrite computes the decay from
    ``slope_rate`` alone, so a model whose slopes were edited without rebuilding the tables
    would silently compute another function (a review: 8.7e-3 logit error in an ONNX
    export). Tables rounded to bf16/fp16 and widened again (a float32 model loaded from a
    bf16 checkpoint) are compared at that dtype's tolerance: the rewrite then differs from
    transformers' loop by the tables' rounding (logits 9e-5 off in the review's case). A
    layer without the tables (another form) or on the meta device: None."""
    from graphopt.passes.attention.match_linear import NoMatch, decay_deviation

    tables = [(kind, getattr(layer, f"{kind}_decay", None))
              for kind in ("query", "key", "diagonal")]
    length = getattr(layer, "block_size", None)
    if not isinstance(length, int) or any(t is None for _, t in tables):
        return None
    if any(t is not None and t.is_meta for _, t in tables) or layer.slope_rate.is_meta:
        return None  # no values yet (a meta-device model): checked when it has them
    slope = layer.slope_rate.detach().reshape(-1).cpu()
    for kind, table in tables:
        assert table is not None
        table = table.detach().cpu()
        try:
            problem = decay_deviation(table, slope, kind, length, _stored(table))
        except NoMatch as exc:
            problem = str(exc)
        if problem:
            return (f"its {kind}_decay buffer is not the decay of its slope_rate "
                    f"({problem}); rebuild the tables with layer.decay_factors(slope_rate)")
    return None


def _stored(table: Tensor) -> torch.dtype | None:
    """bfloat16 or float16 when it holds every entry of a wider ``table`` exactly (it was
    rounded to that dtype: ``slope_rate`` and the tables are persistent buffers, so a
    float32 model loaded from a bf16 checkpoint holds bf16-rounded tables, a review), else
    None. bf16 first: its values also fit fp16's wider mantissa (inside fp16's range), and
    a table bf16 holds has no more precision than bf16's."""
    if not table.is_floating_point() or table.element_size() <= 2:
        return None
    for dtype in (torch.bfloat16, torch.float16):
        if torch.equal(table.to(dtype).to(table.dtype), table):
            return dtype
    return None


def _padding_zeroed(layer: Any, states: Tensor, attention_mask: Tensor) -> Tensor:
    """``states`` [B, S, N] with padding positions zeroed by the installed transformers' own
    ``apply_mask_to_padding_states`` of the layer's modeling module: its condition changed
    between versions (4.x skipped batch 1; 5.x zeroes at any batch, so a padded batch of one
    leaked padding into the lightning state here: 5e-2 logit error, a review)."""
    import sys

    own = getattr(sys.modules.get(type(layer).__module__), "apply_mask_to_padding_states", None)
    if own is not None:
        return own(states, attention_mask)
    return (states * attention_mask[:, :, None]).to(states.dtype)


def minimax_lightning_layer(layer: Any, hidden_states: Tensor, attention_mask: Tensor | None,
                            kernel: Callable[[Tensor, Tensor, Tensor, Tensor],
                                             tuple[Tensor, Tensor | None]]
                            ) -> tuple[Tensor, Tensor | None]:
    """hidden [B, S, hidden] -> ([B, S, hidden], what ``kernel`` returns as the state).

    ``kernel(q, k, v, slope)`` takes q, k, v [B, H, S, D] and slope [H] and returns (o [B, H,
    S, D], state or None). Projections, SiLU, padding zeroing (as transformers'
    ``apply_mask_to_padding_states``), the norm, the output gate and the output projection
    are the layer's own, as in its forward.
    """
    b, length, _ = hidden_states.shape
    heads, dim = layer.num_attention_heads, layer.head_dim
    qkv = layer.act_fn(layer.qkv_proj(hidden_states))
    if attention_mask is not None and attention_mask.dim() == 2:
        qkv = _padding_zeroed(layer, qkv, attention_mask)
    qkv = qkv.reshape(b, length, heads, 3 * dim)
    q, k, v = (t.transpose(1, 2) for t in torch.split(qkv, dim, dim=3))
    out, state = kernel(q, k, v, layer.slope_rate.reshape(-1).to(q.dtype))
    out = layer.norm(out.transpose(1, 2).reshape(b, length, heads * dim))
    out = torch.sigmoid(layer.output_gate(hidden_states)) * out
    return layer.out_proj(out), state
