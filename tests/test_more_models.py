"""More transformers model classes (small configs, random weights, float64, train mode):
graphopt's compiled loss and every parameter gradient equal eager's, and the report shows
what happened to each graph (model passes ran, or the capture guard fell back and why)."""

from __future__ import annotations

import pytest
import torch
import transformers

import graphopt
from graphopt.testing import assert_matches_eager

_C = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
_MOE = dict(experts_implementation="eager")  # transformers' float64 reference loop

MODELS = {  # name: (config class, model class, config kwargs, rtol)
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_C, sliding_window=None), 1e-7),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _C, 1e-7),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_C, pad_token_id=0), 1e-7),
    "falcon": ("FalconConfig", "FalconForCausalLM",
               dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    new_decoder_architecture=True, num_kv_heads=2), 1e-7),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", _C, 1e-7),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(_C, head_dim=8), 1e-7),
    # Mamba2 computes its SSM in float32 whatever the model dtype: float32 tolerance (CSE
    # merges repeated expressions, which reorders the backward's gradient sums)
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM",
               dict(vocab_size=128, hidden_size=32, state_size=8, num_hidden_layers=2,
                    expand=2, conv_kernel=4, num_heads=8, head_dim=8, n_groups=1,
                    chunk_size=8), 1e-4),
    "mamba": ("MambaConfig", "MambaForCausalLM",
              dict(vocab_size=128, hidden_size=32, state_size=8, num_hidden_layers=2,
                   expand=2, conv_kernel=4), 1e-7),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(_C, **_MOE, num_experts=4, num_experts_per_tok=2), 1e-7),
    "jetmoe": ("JetMoeConfig", "JetMoeForCausalLM",
               dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_key_value_heads=2,
                    kv_channels=8, intermediate_size=64, num_local_experts=4,
                    num_experts_per_tok=2, max_position_embeddings=64), 1e-7),
}
FALLBACK = {"mamba": "functorch transform"}  # its selective scan vmaps (torch.vmap)


@pytest.mark.parametrize("name", list(MODELS))
def test_training_step_matches_eager(name):
    config_cls, model_cls, kwargs, rtol = MODELS[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))
    model = model.double().train()
    ids = torch.randint(0, 128, (2, 16))

    def loss(i):
        return model(input_ids=i, labels=i, use_cache=False).loss

    compiled = torch.compile(loss, backend="graphopt", options={"lowering": "eager"})
    assert_matches_eager(loss, compiled, [ids], params=list(model.parameters()), rtol=rtol,
                         atol=rtol * 1e-2)
    reports = [r for r in graphopt.reports() if r.status == "compiled"]
    assert reports and any(r.training and "backward" in r.graphs for r in reports)
    if name in FALLBACK:
        assert all(r.fallback and FALLBACK[name] in r.fallback for r in reports)
    else:  # the model passes really ran on every graph
        assert all(r.fallback is None and [p.name for p in r.passes][:2] == ["attention", "moe"]
                   for r in reports), [r.fallback for r in reports]
