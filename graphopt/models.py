"""Small real transformers models (random weights, no downloads) for demo, tests, benchmarks.

Each entry builds the library's own model class from a small config, so graphopt sees the
exact code users run (MiniMax's Python block loop, Mixtral's routing loop, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from graphopt.errors import ConfigError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    config_class: str
    model_class: str
    kwargs: dict[str, Any]


# MoE models are built with transformers' "eager" experts (the per-expert Python loop; it runs
# in float64, so it is the reference of the exactness tests). Switch a model to one-graph
# experts with ``model.set_experts_implementation("grouped_mm")`` before compiling it with
# options={"moe": ...}: the eager loop graph-breaks and the MoE pass reports it.
_MOE = dict(experts_implementation="eager")
_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

SPECS: dict[str, ModelSpec] = {
    "llama": ModelSpec("llama", "LlamaConfig", "LlamaForCausalLM", dict(_COMMON)),
    "qwen3": ModelSpec("qwen3", "Qwen3Config", "Qwen3ForCausalLM", dict(_COMMON, head_dim=16)),
    "mixtral": ModelSpec("mixtral", "MixtralConfig", "MixtralForCausalLM",
                         dict(_COMMON, **_MOE, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ModelSpec("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                           dict(_COMMON, **_MOE, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=64, decoder_sparse_step=1,
                                mlp_only_layers=[])),
    # MLA attention, one dense layer then MoE: sigmoid router with group-limited top-k,
    # a shared expert next to the routed ones.
    "deepseek_v3": ModelSpec("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
                             dict(_COMMON, **_MOE, num_key_value_heads=4, moe_intermediate_size=32,
                                  n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                                  n_group=2, topk_group=1, first_k_dense_replace=1,
                                  q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                                  qk_nope_head_dim=8, v_head_dim=16)),
    "gpt2": ModelSpec("gpt2", "GPT2Config", "GPT2LMHeadModel",
                      dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                           bos_token_id=0, eos_token_id=0)),
    # Both layer types: linear (lightning) attention and softmax attention; MoE MLPs.
    "minimax": ModelSpec("minimax", "MiniMaxConfig", "MiniMaxForCausalLM",
                         dict(_COMMON, **_MOE, head_dim=16, num_local_experts=4,
                              num_experts_per_tok=2, block_size=16,
                              layer_types=["linear_attention", "full_attention"],
                              full_attn_alpha_factor=1.0, full_attn_beta_factor=1.0,
                              linear_attn_alpha_factor=1.0, linear_attn_beta_factor=1.0,
                              mlp_alpha_factor=1.0, mlp_beta_factor=1.0)),
}


_EXPERT_FIELDS = ("num_local_experts", "n_routed_experts", "num_experts")
"""Config fields that count routed experts (Mixtral/MiniMax, DeepSeek, Qwen-MoE)."""


def expert_count(config: Any) -> int:
    """Routed experts per MoE layer of a transformers config, or of the kwargs that build
    one (a Mapping); 0 for a dense model."""
    for name in _EXPERT_FIELDS:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if value:
            return int(value)
    return 0


def build_model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0,
                attn_implementation: str = "sdpa", **overrides: Any) -> torch.nn.Module:
    """Build ``SPECS[name]`` with random weights (seeded), in eval mode, no dropout.

    Raises:
        ConfigError: unknown model name (lists the valid ones).
        ImportError: transformers is not installed (install ``graphopt[models]``).
    """
    if name not in SPECS:
        raise ConfigError(f"unknown model {name!r}; available: {', '.join(SPECS)}")
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("real models need transformers: pip install 'graphopt[models]'") from exc
    spec = SPECS[name]
    config = getattr(transformers, spec.config_class)(**{**spec.kwargs, **overrides})
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = getattr(transformers, spec.model_class)(config)
    return model.to(dtype).eval()


def sample_batch(model: torch.nn.Module, batch: int = 2, seq: int = 32,
                 seed: int = 0) -> torch.Tensor:
    """Token ids [batch, seq] (int64) within the model's vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    vocab = int(model.config.vocab_size)  # type: ignore[union-attr,arg-type]
    return torch.randint(0, vocab, (batch, seq), generator=gen)


def logits_fn(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``ids -> logits`` without the KV cache, the function tests and the demo compile."""
    def run(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, use_cache=False).logits
    return run
