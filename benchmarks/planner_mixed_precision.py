"""Planner fidelity under bf16 mixed precision: saved-for-backward bytes per decoder layer of
a real CPU training forward next to what the planner prices, for a float32 model, float32
master weights under ``torch.autocast(bf16)`` (``graphopt.parallelize(...,
mixed_precision="bf16")``; ``plan_model(..., master_weights=True)``) and a bf16 model.

    python benchmarks/planner_mixed_precision.py [--seq 512]

A layer's bytes are the run with 2 decoder layers minus the run with 1 (Llama, hidden 256, 4
heads, 2 KV heads, FFN 688, SDPA); the real run counts each storage autograd saves once,
parameters apart. The ``master weights`` row also prints the bf16 model's price, which the
planner gave such runs before ``master_weights`` existed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import transformers

from graphopt.cost.profiles import CLUSTERS
from graphopt.planner.model import plan_model

FIELDS = dict(hidden_size=256, intermediate_size=688, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=1000, max_position_embeddings=8192)


def saved_bytes(layers: int, seq: int, mode: str) -> int:
    """Bytes autograd saves in one training forward (parameters apart)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**FIELDS, num_hidden_layers=layers)
    config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(config).train()
    if mode == "bf16":
        model = model.to(torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, FIELDS["vocab_size"], (1, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
        model(input_ids=ids, labels=ids, use_cache=False)
    return sum(n for ptr, n in seen.items() if ptr not in params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=512)
    seq = parser.parse_args().seq
    h100 = CLUSTERS["h100-sxm"]
    print(f"Llama {FIELDS}, seq {seq}: saved bytes per decoder layer")
    print(f"{'run':<34}{'real MB':>9}{'planned MB':>12}{'ratio':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "config.json"
        spec.write_text(json.dumps({**FIELDS, "num_hidden_layers": 2, "model_type": "llama",
                                    "architectures": ["LlamaForCausalLM"]}))
        for mode, label in (("fp32", "float32"), ("autocast", "float32 master + autocast bf16"),
                            ("bf16", "bf16 model")):
            real = saved_bytes(2, seq, mode) - saved_bytes(1, seq, mode)
            dtype = torch.float32 if mode == "fp32" else torch.bfloat16
            planned = plan_model(str(spec), seq, h100, dtype=dtype,
                                 master_weights=mode == "autocast").dense.activation_bytes
            line = f"{label:<34}{real / 1e6:>9.3f}{planned / 1e6:>12.3f}{planned / real:>7.3f}"
            if mode == "autocast":
                old = plan_model(str(spec), seq, h100, dtype=dtype).dense.activation_bytes
                line += f"   (bf16 model's price: {old / 1e6:.3f} MB, {old / real:.3f})"
            print(line)


if __name__ == "__main__":
    main()
