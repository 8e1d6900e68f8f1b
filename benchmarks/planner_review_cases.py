"""The planner cases a review of 2026-12-03 found mispriced, at published sizes, in one run:
sliding-window attention (Mistral-7B), Qwen-MoE's dense layers (a Qwen3-MoE config with
decoder_sparse_step 2), tied embeddings under PP (Gemma 3 12B's text model), ring CP across
nodes (Llama 3 8B at 128k on 64 H100s) and the ZeRO-3 working set (Llama 3 8B FSDP on 64
H100s). The configs are written from the models' published config.json sizes (no download).

    python benchmarks/planner_review_cases.py      # ~30 s on 2 cores

Run it at an older commit to see the numbers before the fixes (docs/planner.md lists them).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from graphopt.cost.profiles import load_profile
from graphopt.models import build_architecture, resolve_model
from graphopt.planner.model import plan_model
from graphopt.planner.perf import evaluate
from graphopt.planner.plan import ParallelPlan

MISTRAL_7B = {"model_type": "mistral", "architectures": ["MistralForCausalLM"],
              "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
              "sliding_window": 4096, "max_position_embeddings": 32768}
QWEN3_MOE_STEP2 = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                   "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
                   "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                   "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                   "decoder_sparse_step": 2, "mlp_only_layers": [], "vocab_size": 151936,
                   "max_position_embeddings": 40960}
GEMMA3_12B_TEXT = {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
                   "hidden_size": 3840, "num_hidden_layers": 48, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 256, "intermediate_size": 15360,
                   "vocab_size": 262208, "sliding_window": 1024,
                   "max_position_embeddings": 131072}


def main() -> None:
    h100 = load_profile("h100-sxm")
    folder = Path(tempfile.mkdtemp())

    def config(name: str, fields: dict) -> str:
        path = folder / f"{name}.json"
        path.write_text(json.dumps(fields))
        return str(path)

    print("| case | quantity | value |")
    print("|---|---|---|")
    mistral = config("mistral", MISTRAL_7B)
    for window in (None, 4096):
        d = plan_model(mistral, 16384, h100, overrides={"sliding_window": window}).dense
        print(f"| Mistral-7B, seq 16k, window {window} | layer FLOPs, GEMM s | "
              f"{d.flops:.3e}, {d.gemm_s * 1e3:.1f} ms |")
    qwen = config("qwen", QWEN3_MOE_STEP2)
    m = plan_model(qwen, 2048, h100)
    true = sum(p.numel() for p in build_architecture(resolve_model(qwen),
                                                     torch.bfloat16).parameters())
    print(f"| Qwen3-MoE, decoder_sparse_step 2 | planned / model parameters, dense/MoE "
          f"layers | {m.params / 1e9:.2f}B / {true / 1e9:.2f}B, {m.dense_layers}/"
          f"{m.moe_layers} |")
    gemma = plan_model(config("gemma", GEMMA3_12B_TEXT), 4096, h100)
    states = evaluate(ParallelPlan(pp=2, sp=False), gemma, h100, 8).memory_parts[
        "params+grads+optimizer"]
    print(f"| Gemma 3 12B text, pp=2, no ZeRO | states of the fullest stage | "
          f"{states / 1e9:.1f} GB |")
    llama = plan_model("llama3-8b", 131072, h100)
    for cp in (8, 64):
        p = evaluate(ParallelPlan(dp_shard=64 // cp, cp=cp, zero_stage=3, sp=False), llama,
                     h100, 8)
        print(f"| Llama 3 8B, 128k, 64 H100, cp={cp} ring | step, exposed CP | "
              f"{p.step_s:.2f} s, {p.comm_s['cp']:.2f} s |")
    llama = plan_model("llama3-8b", 8192, h100)
    p = evaluate(ParallelPlan(dp_shard=64, zero_stage=3), llama, h100, 64)
    print(f"| Llama 3 8B FSDP 64, 8k | memory, of which ZeRO-3 unsharded | "
          f"{p.memory_bytes / 2**30:.1f} GiB, "
          f"{p.memory_parts.get('zero3_unsharded', 0.0) / 2**30:.2f} GiB |")


if __name__ == "__main__":
    main()
