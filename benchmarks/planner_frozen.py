"""Planner fidelity for partly frozen models (fine-tuning): the measured time of a real CPU
training step (forward + backward, float32) with some weights frozen, as a share of the
fully trained step, next to the share the planner predicts on the ``local`` profile
(``PlanModel.trained_gemm``: a frozen weight's weight-gradient GEMM is not run;
``PlanModel.frozen_prefix``: layers frozen with everything before them run their forward
only), and what it predicted before (every parameter priced as trained).

    python benchmarks/planner_frozen.py [--calibrate] [--reps 5] [--seq 512]

Model: Llama, hidden 1024, FFN 2816, 16 heads, 2 decoder layers, vocabulary 8000, SDPA.
Freezes: LoRA's base weights (every 2-D weight, the embedding included: norms train),
a frozen embedding alone (its backward is a scatter-add, which the planner keeps), the
attention projections alone, and the embedding with the first layer (a frozen prefix).
Steps are timed in turns (``interleaved_medians``). The ``local`` profile comes from
``graphopt calibrate`` (``--calibrate`` runs it first).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import torch
import transformers
from common import interleaved_medians

from graphopt.cost.profiles import load_profile
from graphopt.parallel.auto import frozen_prefix_layers, trained_gemm_share
from graphopt.planner.model import plan_model
from graphopt.planner.perf import evaluate
from graphopt.planner.plan import ParallelPlan

FIELDS = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
              num_key_value_heads=16, vocab_size=8000, num_hidden_layers=2,
              max_position_embeddings=8192)
FREEZES = {
    "all trained": lambda name, p: True,
    "LoRA base (norms train)": lambda name, p: p.dim() < 2,
    "embedding frozen": lambda name, p: "embed_tokens" not in name,
    "attention frozen": lambda name, p: "self_attn" not in name,
    "embedding + layer 0 frozen (a prefix)": lambda name, p: not name.startswith(
        ("model.embed_tokens.", "model.layers.0.")),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibrate", action="store_true", help="run graphopt calibrate first")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seq", type=int, default=512)
    args = parser.parse_args()
    if args.calibrate:
        from graphopt.cost.calibrate import calibrate

        calibrate(collectives=False)
    profile = load_profile("local")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**FIELDS)
    config._attn_implementation = "sdpa"
    models = {}
    for label, trains in FREEZES.items():
        model = transformers.LlamaForCausalLM(config).train()
        for name, p in model.named_parameters():
            p.requires_grad_(trains(name, p))
        models[label] = model
    ids = torch.randint(0, FIELDS["vocab_size"], (1, args.seq))

    def step(model: torch.nn.Module) -> None:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)

    measured = interleaved_medians({k: (lambda m=m: step(m)) for k, m in models.items()},
                                   args.reps)
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "config.json"
        spec.write_text(json.dumps({**FIELDS, "architectures": ["LlamaForCausalLM"],
                                    "model_type": "llama"}))
        planned = plan_model(str(spec), args.seq, profile, dtype=torch.float32)

    def predicted(share: float, prefix: int = 0) -> float:
        model = dataclasses.replace(planned, trained_gemm=share, frozen_prefix=float(prefix))
        pred = evaluate(ParallelPlan(), model, profile, 1)
        assert pred is not None
        return pred.compute_s

    full = predicted(1.0)
    print(f"Llama {FIELDS}, seq {args.seq}, float32, {torch.get_num_threads()} threads; "
          f"local profile: fp32 peak {profile.device.peak_flops['float32'] / 1e9:.0f} GFLOP/s")
    print("| weights | trained_gemm | frozen_prefix | measured ms | measured / all trained | "
          "predicted / all trained | before (every weight gradient priced) |")
    print("|---|---|---|---|---|---|---|")
    for label, model in models.items():
        prefix = frozen_prefix_layers(model)
        share = trained_gemm_share(model, prefix)
        print(f"| {label} | {share:.3f} | {prefix} | {measured[label] * 1e3:.0f} | "
              f"{measured[label] / measured['all trained']:.3f} | "
              f"{predicted(share, prefix) / full:.3f} | 1.000 |")


if __name__ == "__main__":
    main()
