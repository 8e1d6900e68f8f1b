"""Cost-model validation on this machine: predicted vs measured forward+backward time and peak
memory of real transformers models (eager PyTorch, fp32), printed side by side.

    python benchmarks/cost_model_local.py [--calibrate] [--reps 5]

The ``local`` profile comes from ``graphopt calibrate`` (``--calibrate`` runs it first, in this
process). Each case is traced once with ``graphopt.cost.trace_step`` (real tensors: the MoE
expert loops are data dependent) and priced with ``graphopt.cost.estimate``; the measured time
is the median of ``--reps`` steps after a warm-up; peak memory is measured with
``torch.distributed._tools.mem_tracker.MemTracker`` (parameters + gradients + activations +
temporaries of one step).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import median_time

from graphopt.cost import estimate, load_profile, trace_step
from graphopt.models import build_model, sample_batch

# (model, batch, seq, config overrides): small-to-medium configs.
CASES = [
    ("llama", 1, 128, {}), ("llama", 4, 256, {}), ("llama", 2, 512, {}),
    ("llama", 1, 256, dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                          num_key_value_heads=4, num_hidden_layers=4)),
    ("llama", 2, 512, dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                          num_key_value_heads=4, num_hidden_layers=4)),
    ("llama", 1, 1024, dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4)),
    ("mixtral", 1, 128, {}), ("mixtral", 2, 256, {}),
    ("mixtral", 1, 512, dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2)),
    ("minimax", 1, 128, {}), ("minimax", 2, 256, {}),
    ("minimax", 1, 512, dict(hidden_size=256, num_attention_heads=8, head_dim=32,
                            intermediate_size=512)),
]


def measure(model: torch.nn.Module, inputs: dict, reps: int) -> tuple[float, int]:
    from torch.distributed._tools.mem_tracker import MemTracker

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(**inputs).loss.backward()

    elapsed = median_time(step, reps)
    model.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        model(**inputs).loss.backward()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    model.zero_grad(set_to_none=True)
    return elapsed, int(peak)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calibrate", action="store_true", help="run graphopt calibrate first")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    if args.calibrate:
        from graphopt.cost.calibrate import calibrate

        calibrate(collectives=False)
    profile = load_profile("local")
    dev = profile.device
    print(f"local profile: fp32 peak {dev.peak_flops['float32'] / 1e9:.0f} GFLOP/s, "
          f"{dev.memory_bandwidth / 1e9:.1f} GB/s, overhead {dev.kernel_overhead_s * 1e6:.1f} "
          f"us ({dev.source}); torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| model | overrides | batch | seq | measured ms | predicted ms | time error | "
          "measured MiB | predicted MiB | memory error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    time_err, mem_err = [], []
    for name, batch, seq, overrides in CASES:
        model = build_model(name, **overrides).train()
        ids = sample_batch(model, batch=batch, seq=seq)
        inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
        measured_s, measured_peak = measure(model, inputs, args.reps)
        gm = trace_step(model, inputs, tracing="real")
        est = estimate(model, inputs, profile, gm=gm)
        predicted_peak = est.peak_bytes
        te = est.time_s / measured_s - 1
        me = predicted_peak / measured_peak - 1
        time_err.append(abs(te))
        mem_err.append(abs(me))
        label = ",".join(f"{k}={v}" for k, v in overrides.items()) or "-"
        print(f"| {name} | {label} | {batch} | {seq} | {measured_s * 1e3:.1f} | "
              f"{est.time_s * 1e3:.1f} | {te:+.0%} | {measured_peak / 2**20:.1f} | "
              f"{predicted_peak / 2**20:.1f} | {me:+.0%} |", flush=True)
    print(f"\ntime: median |error| {statistics.median(time_err):.1%}, worst "
          f"{max(time_err):.1%} ({len(time_err)} cases); memory: median |error| "
          f"{statistics.median(mem_err):.1%}, worst {max(mem_err):.1%}")


if __name__ == "__main__":
    main()
