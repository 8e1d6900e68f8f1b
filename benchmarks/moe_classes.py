"""Which transformers MoE classes graphopt's moe pass rewrites, and how exactly.

Each class is built from a small config (random weights, nothing downloaded, float32, train
mode, transformers' ``grouped_mm`` experts), compiled with
``options={"moe": {}, "lowering": "eager"}``, and compared with the same model running
transformers' eager experts loop: the logits and every parameter gradient of
``logits.pow(2).mean()``, as relative errors (gradients relative to the largest gradient of
the model: a parameter whose gradient is rounding noise, DeepSeek-V4's hash-routed gates,
does not dominate). Prints one row per class with what the pass did at each MoE site.

    python benchmarks/moe_classes.py            # ~20 s on 2 cores
    python benchmarks/moe_classes.py Lfm2Moe    # one class

A correctness sweep, not a timing: the tests pin 16 classes (tests/test_pass_moe.py and
tests/test_more_models.py); this covers the others found in transformers 5.24.
"""

from __future__ import annotations

import sys
import warnings

import torch

import graphopt

_SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              max_position_embeddings=64, num_experts_per_tok=2)
_MLA = dict(num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, kv_lora_rank=16,
            q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
            first_k_dense_replace=0, n_group=1, topk_group=1)
CLASSES = {  # name: (config class, model class, config kwargs)
    "FlexOlmo": ("FlexOlmoConfig", "FlexOlmoForCausalLM", dict(num_experts=4, pad_token_id=0)),
    "Lfm2Moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM",
                dict(num_experts=4, num_dense_layers=0,
                     layer_types=["full_attention", "conv"])),
    "DeepseekV2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", _MLA),
    "Glm4MoeLite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", _MLA),
    "GlmMoeDsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM",
                  dict(_MLA, index_n_heads=2, index_head_dim=8, index_topk=4)),
    "GraniteMoeShared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM",
                         dict(num_local_experts=4, shared_intermediate_size=16)),
    "Qwen3_5Moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                   dict(num_experts=4, shared_expert_intermediate_size=16,
                        layer_types=["full_attention", "full_attention"])),
    "Phimoe": ("PhimoeConfig", "PhimoeForCausalLM", dict(num_local_experts=4)),
    "DeepseekV4": ("DeepseekV4Config", "DeepseekV4ForCausalLM",
                   dict(num_local_experts=4, n_routed_experts=4,
                        mlp_layer_types=["hash_moe", "moe"])),
}


def build(name: str) -> torch.nn.Module:
    import transformers

    config_cls, model_cls, extra = CLASSES[name]
    config = getattr(transformers, config_cls)(**{**_SMALL, **extra})
    config.experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config).float().train()


def compare(name: str) -> str:
    model = build(name)
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    params = [p for p in model.parameters() if p.requires_grad]

    def logits(i: torch.Tensor) -> torch.Tensor:
        return model(input_ids=i, use_cache=False).logits

    def run(fn, impl: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.set_experts_implementation(impl)
        for p in params:
            p.grad = None
        torch.manual_seed(5)  # routers that draw (PhiMoE's sparsemixer) draw alike
        out = fn(ids)
        out.pow(2).mean().backward()
        return out.detach(), [p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                              for p in params]

    want, want_grads = run(logits, "eager")
    torch._dynamo.reset()
    graphopt.clear_reports()
    compiled = torch.compile(logits, backend="graphopt", options={"moe": {}, "lowering": "eager"})
    got, got_grads = run(compiled, "grouped_mm")
    scale = max(float(g.abs().max()) for g in want_grads)
    out_err = float((got - want).abs().max() / want.abs().max())
    grad_err = max(float((a - b).abs().max()) for a, b in zip(got_grads, want_grads)) / scale
    sites = [f"{s.action}: {s.reason[:70]}" for r in graphopt.reports() for p in r.passes
             if p.name == "moe" for s in p.sites]
    fallbacks = {r.fallback[:60] for r in graphopt.reports() if r.fallback}
    return (f"| {name} | {out_err:.1e} | {grad_err:.1e} | {'; '.join(sites) or '-'} | "
            f"{'; '.join(fallbacks) or '-'} |")


def main() -> None:
    warnings.simplefilter("ignore")
    names = sys.argv[1:] or list(CLASSES)
    print("| class | logits (relative) | gradients (of the largest) | moe sites | fallback |")
    print("|---|---|---|---|---|")
    for name in names:
        try:
            print(compare(name), flush=True)
        except Exception as exc:  # noqa: BLE001 (one class failing is a row, not a stop)
            print(f"| {name} | error | {type(exc).__name__}: {str(exc)[:120]} | | |", flush=True)


if __name__ == "__main__":
    main()
