"""Rematerialization Pareto table: peak memory and step time of a Llama training step with
graphopt's remat pass vs PyTorch's min-cut partitioner with ``activation_memory_budget`` at
the same budgets, vs full activation checkpointing, all executing the same eager ATen ops.

    python benchmarks/remat.py [--budgets 1.0 0.75 0.5 0.3] [--reps 5] [--layers 4]

Each cell runs in a fresh process (Dynamo caches and allocator state do not leak between
cells). Peak: how far the resident set rises during one step above where it rested before
it (activations, gradients, temporaries; see ``_step_peak_rss``); time: median of ``--reps``
steps after the compile. Saved: bytes autograd keeps for the backward (parameters and inputs
excluded), counted with ``saved_tensors_hooks``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch


def _model(layers: int, hidden: int, seq: int, batch: int) -> tuple:
    from graphopt.models import build_model, sample_batch

    model = build_model("llama", num_hidden_layers=layers, hidden_size=hidden,
                        intermediate_size=2 * hidden, num_attention_heads=8,
                        num_key_value_heads=4).train()
    return model, sample_batch(model, batch=batch, seq=seq)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _step_peak_rss(step: object) -> int:
    """Bytes the resident set grows by, at its highest, during one step: the peak is reset
    with /proc/self/clear_refs (5) and read back as VmHWM. Tensor storages are mmapped
    (MALLOC_MMAP_THRESHOLD_ set by the parent), so freed memory leaves the RSS.
    torch's MemTracker cannot be used here: it is a dispatch mode, under which Dynamo runs
    the model eagerly instead of the compiled graphs."""
    import gc

    gc.collect()
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    step()  # type: ignore[operator]
    return (_status_kib("VmHWM") - before) * 1024


def cell(kind: str, budget: float, args: argparse.Namespace) -> dict:
    model, ids = _model(args.layers, args.hidden, args.seq, args.batch)
    if kind == "checkpointing":
        model.gradient_checkpointing_enable()

    def loss(i: torch.Tensor) -> torch.Tensor:
        return model(input_ids=i, labels=i, use_cache=False).loss

    solve_s = 0.0
    if kind == "graphopt":
        import graphopt

        fn = torch.compile(loss, backend="graphopt", options={
            "lowering": "eager", "remat": {"budget": budget, "solver": args.solver}})
    elif kind == "pytorch":
        from functorch.compile import min_cut_rematerialization_partition
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch import config as functorch_config

        functorch_config.activation_memory_budget = budget

        def nop(gm: torch.fx.GraphModule, _: list) -> object:
            return gm

        backend = aot_autograd(fw_compiler=nop, bw_compiler=nop,
                               partition_fn=min_cut_rematerialization_partition)
        fn = torch.compile(loss, backend=backend)
    else:  # eager, with or without checkpointing
        fn = loss
    start = time.perf_counter()
    fn(ids).backward()
    compile_s = time.perf_counter() - start
    if kind == "graphopt":
        for r in graphopt.reports():
            for p in r.pass_records("remat"):
                solve_s += p.time_s
    model.zero_grad(set_to_none=True)
    times = []
    for _ in range(args.reps):
        start = time.perf_counter()
        fn(ids).backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    from graphopt.cost.memory import measured_saved_bytes

    saved = measured_saved_bytes(lambda: fn(ids), [*model.parameters(), ids])
    model.zero_grad(set_to_none=True)
    peak = _step_peak_rss(lambda: fn(ids).backward())
    return {"ms": statistics.median(times) * 1e3, "peak_mib": peak / 2**20,
            "saved_mib": saved / 2**20, "compile_s": compile_s,
            "solve_s": solve_s}


def solver_time(layers: int, solver: str) -> None:
    """Seconds the remat pass takes (graph analysis, cost model, solve) on the joint graph
    of a ``layers``-layer Llama (small width: the graph's size is what matters)."""
    import graphopt
    from graphopt.models import build_model, sample_batch

    model = build_model("llama", num_hidden_layers=layers).train()
    ids = sample_batch(model, batch=1, seq=64)
    fn = torch.compile(lambda i: model(input_ids=i, labels=i, use_cache=False).loss,
                       backend="graphopt", options={"lowering": "eager",
                                                    "remat": {"budget": 0.5,
                                                              "solver": solver}})
    fn(ids).backward()
    for r in graphopt.reports():
        for p in r.pass_records("remat"):
            summary = next(s for s in p.sites if s.site == "saved activations")
            print(f"{layers} layers: joint graph {p.nodes_before} nodes, remat pass "
                  f"{p.time_s:.2f} s ({solver}); {summary.reason}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budgets", nargs="+", type=float, default=[1.0, 0.75, 0.5, 0.3])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--solver", default="ilp")
    parser.add_argument("--cell", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--solver-time", type=int, metavar="LAYERS",
                        help="only: time the remat decision on a LAYERS-layer Llama graph")
    args = parser.parse_args()
    if args.solver_time:
        solver_time(args.solver_time, args.solver)
        return
    if args.cell:
        print(json.dumps(cell(args.cell[0], float(args.cell[1]), args)))
        return
    base = [sys.executable, __file__, "--reps", str(args.reps), "--layers", str(args.layers),
            "--hidden", str(args.hidden), "--seq", str(args.seq), "--batch", str(args.batch),
            "--solver", args.solver]

    def run(kind: str, budget: float) -> dict:
        """Time in a process with the default allocator; memory in one where tensors are
        mmapped (so that freed memory leaves the resident set; slower, so not timed)."""
        results = []
        for env in (dict(os.environ), dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")):
            out = subprocess.run(base + ["--cell", kind, str(budget)], capture_output=True,
                                 text=True, check=True, env=env).stdout
            results.append(json.loads(out.strip().splitlines()[-1]))
        timed, measured = results
        return dict(measured, ms=timed["ms"], compile_s=timed["compile_s"],
                    solve_s=timed["solve_s"])

    print(f"Llama {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch "
          f"{args.batch}, fp32, torch {torch.__version__}, medians of {args.reps} steps")
    print("| config | budget | step ms | step peak MiB | saved MiB | compile s (solver s) |")
    print("|---|---|---|---|---|---|")
    for kind in ("eager", "checkpointing"):
        r = run(kind, 1.0)
        print(f"| {kind} | - | {r['ms']:.0f} | {r['peak_mib']:.1f} | {r['saved_mib']:.1f} | "
              f"- |", flush=True)
    for budget in args.budgets:
        for kind in ("pytorch", "graphopt"):
            r = run(kind, budget)
            label = "PyTorch min-cut" if kind == "pytorch" else "graphopt remat"
            print(f"| {label} | {budget:g} | {r['ms']:.0f} | {r['peak_mib']:.1f} | "
                  f"{r['saved_mib']:.1f} | {r['compile_s']:.1f}"
                  + (f" ({r['solve_s']:.2f})" if kind == "graphopt" else "") + " |",
                  flush=True)


if __name__ == "__main__":
    main()
