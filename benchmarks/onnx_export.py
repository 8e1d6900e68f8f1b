"""ONNX export of graphopt-transformed models: export time, file size, and inference latency of
onnxruntime (CPU) vs PyTorch eager (transformers' own code) on the same inputs, side by side.

    python benchmarks/onnx_export.py [--seq 64 256 1024] [--batch 1] [--reps 5]

Models: MiniMax (attention="exact": lightning layers as the ONNX Loop translation, MoE as the
gather form), Mixtral (moe, gather and dense forms), Llama (attention="lightning", approximate).
Small configs widened to hidden 256 so the kernels dominate; float32; one export per model with
dynamic batch/sequence axes, then every length runs on the same file. Run in a fresh process
with TORCHINDUCTOR_COMPILE_THREADS=1; medians of --reps runs after one warm-up.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
from common import median_time

import graphopt
from graphopt.models import build_model, sample_batch

WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4,
            head_dim=32, max_position_embeddings=4096)
CASES = [
    ("minimax", {"attention": "exact", "moe": {}}, "gather", dict(WIDE, block_size=64)),
    ("mixtral", {"moe": {}}, "gather", dict(WIDE, head_dim=32)),
    ("mixtral", {"moe": {}}, "dense", dict(WIDE, head_dim=32)),
    ("llama", {"attention": "lightning"}, "gather", dict(WIDE, head_dim=32)),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    import onnxruntime as ort

    torch.set_num_threads(os.cpu_count() or 1)
    out = Path(tempfile.mkdtemp(prefix="graphopt_onnx_"))
    print(f"torch {torch.__version__}, onnxruntime {ort.__version__}, {torch.get_num_threads()} "
          "threads, float32")
    print("| model | options | moe form | export s | MB | seq | torch eager ms | "
          "onnxruntime ms | speedup | max abs err vs transformed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, options, form, overrides in CASES:
        model = build_model(name, **overrides)
        if "moe" in options:
            model.set_experts_implementation("grouped_mm")
        path = out / f"{name}_{form}.onnx"
        result = graphopt.export_onnx(model, sample_batch(model, 2, 32), options, path,
                                      moe_form=form)
        export_s = sum(result.seconds.values())
        if "moe" in options:
            model.set_experts_implementation("eager")  # transformers' own per-expert loop
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        name_in = session.get_inputs()[0].name
        for seq in args.seq:
            ids = sample_batch(model, args.batch, seq)
            feed = {name_in: ids.numpy()}
            with torch.no_grad():
                eager_s = median_time(lambda: model(input_ids=ids, use_cache=False).logits,
                                      args.reps)
                want = result.transformed(ids)
            ort_s = median_time(lambda: session.run(None, feed), args.reps)
            got = torch.from_numpy(session.run(None, feed)[0])
            err = float((got - want).abs().max())
            opts = ", ".join(f"{k}={v}" for k, v in options.items())
            print(f"| {name} | {opts} | {form} | {export_s:.1f} | "
                  f"{path.stat().st_size / 1e6:.1f} | {seq} | {eager_s * 1e3:.1f} | "
                  f"{ort_s * 1e3:.1f} | {eager_s / ort_s:.2f}x | {err:.2g} |")


if __name__ == "__main__":
    main()
