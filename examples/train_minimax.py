"""Train a small MiniMax (lightning + softmax attention, MoE) for a few steps with graphopt:
its lightning-attention block loop becomes graphopt's kernel (``attention="exact"``) and its
experts the sorted-dispatch op (``moe``; transformers' grouped_mm experts, one graph per
layer, as ``graphopt demo`` runs them; the default "eager" expert loop graph-breaks).

    python examples/train_minimax.py [--lowering eager|inductor] [--dump-dir graphopt_dump]

Prints the loss per step and the per-pass summary (rewrites per pass: attention and moe are
not 0); with --dump-dir, `graphopt explain DIR` shows the same report from the dumped files.
"""

import argparse

import torch

import graphopt
from graphopt.models import build_model, sample_batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lowering", default="eager",
                        choices=["eager", "inductor", "auto", "npu"])
    parser.add_argument("--dump-dir", default=None)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    model = build_model("minimax").train()
    model.set_experts_implementation("grouped_mm")
    options = {"lowering": args.lowering, "verify": True, "attention": "exact", "moe": {}}
    if args.dump_dir:
        options["dump_dir"] = args.dump_dir
    compiled = torch.compile(model, backend="graphopt", options=options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = sample_batch(model, batch=4, seq=128)
    for step in range(args.steps):
        loss = compiled(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")
    reports = graphopt.reports()
    rewrites = {}
    for report in reports:
        for record in report.passes:
            rewrites[record.name] = rewrites.get(record.name, 0) + record.count("rewritten")
    print(f"{len(reports)} graphs compiled; rewrites per pass: {rewrites}; verify: "
          f"{sorted({r.verify.get('status', 'off') for r in reports})}")


if __name__ == "__main__":
    main()
