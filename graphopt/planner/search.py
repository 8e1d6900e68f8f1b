"""Search the parallel space: every factorization of the device count over
pp x dp_replicate x dp_shard x cp x tp (with ep folded over dp_shard x cp x tp for MoE
models, and tensor-parallel experts: expert_tp = tp with ep over dp_shard x cp),
pipeline schedule, microbatch size, ZeRO stage and recomputation, pruned by
divisibility and memory, scored by :func:`graphopt.planner.perf.evaluate`.

When nothing is left, :func:`no_layout_reason` says which rule emptied the space and
what to change. Pruning (each rule keeps the space's optimum under the performance model, or is a
structural rule of the frameworks that execute plans): tp and ep*expert_tp inside one node
(their collectives sit on every layer's critical path; Megatron-Core and torchtitan place
them on NVLink/HCCS), dividing the node size so groups never straddle nodes; tp divides the
heads; pp x virtual stages (any v dividing the layers per stage) divides the layers; cp only
when the sequence splits into 2*cp chunks of >= 1024 tokens, as ring attention or (heads
dividing over tp x cp) Ulysses all-to-all; microbatch in {1, 2, 4, 8};
ZeRO 1 or 3 over dp_shard; recomputation none, half or all layers of a stage. Memory is
checked before time. The per-layer costs are measured once per model (graphopt.planner.model)
and collective times are cached, so a plan costs microseconds.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from graphopt.cost.profiles import ClusterProfile
from graphopt.errors import ConfigError
from graphopt.planner.model import PlanModel
from graphopt.planner.perf import USABLE_MEMORY, evaluate, evaluate_within
from graphopt.planner.plan import ParallelPlan, Prediction


@dataclass
class SearchResult:
    """The best plan, the next best, the hand configurations' verdicts, and search stats."""

    best: ParallelPlan
    top: list[ParallelPlan]
    hand: list[tuple[str, ParallelPlan, str]]
    """(name, plan with prediction, why it loses to ``best``)."""
    evaluated: int
    pruned_memory: int
    seconds: float
    hand_invalid: list[tuple[str, ParallelPlan, str]] = dataclasses.field(default_factory=list)
    """(name, plan, what makes it invalid for this job): hand configurations left out."""
    device_memory_bytes: float = 0.0
    """Memory of one device of the cluster searched (the plot's capacity line)."""


MAX_DEVICES = 2 ** 40
"""The largest device count :func:`search` plans for (it enumerates divisors up to the
square root: 2**40 takes ~2 s)."""


def _divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending (O(sqrt n): 10**8 devices took 33 s by trial)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _splits(model: PlanModel, devices: int, node: int) -> Iterator[tuple[int, int, int, int]]:
    """(pp, tp, cp, dp) with pp dividing the layers, tp the heads, the KV heads (Megatron's
    num_query_groups % tp == 0; graphopt's executor refuses the rest too) and the node size, cp
    splitting the sequence into 2*cp chunks of >= 1024 tokens, and their product
    ``devices`` (the global batch is not considered)."""
    seq = model.seq
    for pp in _divisors(devices):
        if pp > model.layers:
            continue
        for tp in (d for d in _divisors(devices // pp)
                   if node % d == 0 and model.heads % d == 0 and model.kv_heads % d == 0):
            rest = devices // (pp * tp)
            for cp in _divisors(rest):
                if cp == 1 or (seq % (2 * cp) == 0 and seq // (2 * cp) >= 1024):
                    yield pp, tp, cp, rest // cp


def candidates(model: PlanModel, devices: int, global_batch: int, node: int,
               recompute: bool = True) -> Iterator[ParallelPlan]:
    """Structurally valid plans (see the module docstring); without activation
    recomputation when ``recompute`` is False."""
    for pp, tp, cp, dp in _splits(model, devices, node):
        if global_batch % dp == 0:
            yield from _inner(model, pp, tp, cp, dp, global_batch, node, recompute)


def _gib(nbytes: float) -> str:
    """Bytes as GiB with enough digits for small (toy or test) memories: 80 -> "80.0",
    1.2 MB -> "0.00112"."""
    gib = nbytes / 2**30
    return f"{gib:.1f}" if gib >= 1 else f"{gib:.3g}"


def no_layout_reason(model: PlanModel, devices: int, global_batch: int, node: int) -> str:
    """Why :func:`candidates` yields nothing for this job, and what to change. Only the
    global batch can empty it: pp = tp = cp = 1, dp = devices is always a split, and
    microbatch 1 divides any per-replica batch, so no dp divides the global batch."""
    splits = list(_splits(model, devices, node))
    dps = sorted({dp for *_, dp in splits})
    # the same pp/tp/cp with dp cut to a divisor of the batch is a valid layout
    fewer = max(pp * tp * cp * math.gcd(dp, global_batch) for pp, tp, cp, dp in splits)
    return (f"no plan for {model.name} on {devices} devices: the global batch "
            f"({global_batch}) is not divisible by any data-parallel degree x microbatch "
            f"these devices allow (dp = devices / (pp x tp x cp) is one of "
            f"{', '.join(map(str, dps))}; microbatch >= 1); use a global batch that is a "
            f"multiple of {dps[0]}, or {fewer} device{'s' if fewer > 1 else ''}")


def stage_layouts(layers: int, pp: int) -> list[tuple[int, ...]]:
    """Pipeline stage sizes the search tries: even (``()``) when pp divides the layers, else
    the executor's balanced split (the remainder on middle stages); and, for pp > 1, the
    first and last stages one layer lighter than the heaviest middle one (the embedding and
    the LM head + loss take their place: Llama 3 405B's 126 layers on 16 stages are 7, 8 x
    14, 7)."""
    from graphopt.parallel.pipeline import stage_layers

    if pp == 1:
        return [()]
    out: list[tuple[int, ...]] = [()] if layers % pp == 0 else \
        [tuple(end - start for start, end in stage_layers(layers, pp))]
    for ends in (-(-layers // pp) - 1, -(-layers // pp) - 2):
        middle = layers - 2 * ends if pp > 2 else 0
        if ends < 1 or (pp == 2 and ends * 2 >= layers) or (pp > 2 and middle < pp - 2):
            continue
        layout: tuple[int, ...]
        if pp == 2:
            layout = (layers - ends, ends)  # only the last stage has the LM head
        else:
            base, extra = divmod(middle, pp - 2)
            layout = (ends, *(base + (k < extra) for k in range(pp - 2)), ends)
        if min(layout[1:-1] or layout) >= ends and layout not in out and \
                sorted(layout) != sorted(out[0] or (layers // pp,) * pp):
            out.append(layout)
            break
    return out


def _inner(model: PlanModel, pp: int, tp: int, cp: int, dp: int, global_batch: int,
           node: int, recompute: bool = True) -> Iterator[ParallelPlan]:
    layouts = stage_layouts(model.layers, pp)
    even = layouts[0] == ()
    per_stage = model.layers // pp
    # Interleaved 1F1B: any virtual stage count v >= 2 with pp x v dividing the layers
    # (Megatron-LM's published runs use v = 3 and others, not only 2).
    vs = [1] + ([v for v in _divisors(per_stage) if v > 1] if pp > 1 and even else [])
    selective = recompute and \
        model.dense.selective_activation_bytes < model.dense.activation_bytes
    for shard in _divisors(dp):
        fold = shard * cp * tp
        eps = [e for e in _divisors(fold) if node % e == 0 and model.experts % e == 0] \
            if model.experts else [1]
        # ZeRO shards over dp_shard x cp (FSDP's group in graphopt.parallel)
        zeros = (1, 3) if shard * cp > 1 else (1,)
        # ring attention always; Ulysses all-to-all when the heads split over tp x cp
        kinds = ("ring", "all_to_all") if cp > 1 and model.heads % (tp * cp) == 0 and \
            model.kv_heads % (tp * cp) == 0 else ("ring",)
        for ep, zero, v, mb, kind in itertools.product(eps, zeros, vs, (1, 2, 4, 8), kinds):
            if (global_batch // dp) % mb:
                continue
            # tensor-parallel experts as graphopt.parallel executes them: expert_tp = tp,
            # EP over dp_shard x cp, ep x tp in a node, the FFN dim divisible by tp
            etps = [1] + [tp] * (tp > 1 and ep > 1 and (shard * cp) % ep == 0 and
                                 node % (ep * tp) == 0 and model.moe_ffn % tp == 0)
            if zero == 1 and shard * cp > 1 and max(tp, cp, pp, ep) > 1:
                # graphopt.parallelize runs ZeRO-1 (ZeroRedundancyOptimizer) for data
                # parallelism alone; with TP/CP/PP/EP it runs ZeRO-2 (FSDP2 without
                # resharding after forward), priced the same with sharded gradients (a
                # review: 19 of 165 ranked plans were refused by the executor)
                zero = 2
            if v > 1 and (global_batch // (dp * mb)) % pp:
                continue  # interleaved 1F1B: microbatches a multiple of pp
            # zero bubble (weight gradients deferred) with v > 1, where the executor runs it
            # (ParallelPlan.zero_bubble_refusal, checked on each plan below)
            schedules = ["1f1b"] if v == 1 else ["interleaved", "zero_bubble"]
            for layout, schedule, etp in itertools.product(layouts if v == 1 else [()],
                                                           schedules, etps):
                most = max(layout) if layout else per_stage
                # recomputation: none, selective (per-op), half or all layers of a stage
                for rec, sel in [(0, False)] + [(0, True)] * selective + \
                        [(r, False) for r in sorted({most // 2, most} - {0}) if recompute]:
                    # SP splits each rank's s/cp tokens over tp: only when tp divides them
                    # (a review got tp=4 + SP for 4095 tokens, which the executor refuses),
                    # and gathers them back at an LM head split over the vocabulary (not
                    # a tied pair kept whole: PlanModel.tied_head_tp)
                    plan = ParallelPlan(dp_replicate=dp // shard, dp_shard=shard,
                                        zero_stage=zero, tp=tp,
                                        sp=tp > 1 and model.seq % (tp * cp) == 0 and (
                                            model.tied_head_tp or not model.tied_embeddings),
                                        cp=cp,
                                        cp_kind=kind,
                                        pp=pp,
                                        virtual_stages=v,
                                        pp_schedule=schedule,
                                        microbatch=mb, ep=ep, expert_tp=etp,
                                        recompute_layers=rec,
                                        selective_recompute=sel, stage_layers=layout)
                    if not plan.zero_bubble_refusal():  # the executor's rule, not priced
                        yield plan


def search(model: PlanModel, cluster: ClusterProfile, devices: int, global_batch: int,
           top_k: int = 5, progress: Callable[[int], None] | None = None,
           dp_overlap: bool = True, published: list[tuple[str, ParallelPlan]] | None = None,
           recompute: bool = True,
           admit: Callable[[ParallelPlan], bool] | None = None) -> SearchResult:
    """Best plans for ``devices`` devices of ``cluster`` (see the module docstring); with
    ``recompute=False`` no activation recomputation is searched (plans graphopt.parallelize
    runs as predicted); with ``admit``, only the candidates it accepts are evaluated
    (``parallel="auto"``: the plans graphopt executes for this model).

    ``published``: (name, plan) of configurations a job is known to run with (a paper's or a
    team's); each valid one is evaluated with the candidates, so the result is never slower
    than it under the same model even when the pruned space lacks it (e.g. uneven stages or
    schedules the enumeration leaves out), and it is reported with the hand configurations.

    Raises:
        ConfigError: no plan fits in memory (the message gives the smallest footprint);
            devices, global_batch or top_k < 1; devices > :data:`MAX_DEVICES`; a model
            without layers.
    """
    start = time.perf_counter()
    for name, value in (("devices", devices), ("global_batch", global_batch),
                        ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
    if model.layers < 1:
        raise ConfigError(f"{model.name} has {model.layers} decoder layers: nothing to plan")
    if devices > MAX_DEVICES:  # the divisor enumeration is O(sqrt n): 1e23 hung (a review)
        raise ConfigError(f"devices={devices}: the planner searches up to {MAX_DEVICES:,} "
                          "devices (2**40)")
    if devices > cluster.max_devices:
        cluster = cluster.scaled(devices)
    node = cluster.devices_per(0)
    capacity = USABLE_MEMORY * cluster.device.memory_bytes
    heap: list[tuple[float, float, int, ParallelPlan]] = []
    evaluated = pruned = 0
    smallest = float("inf")
    extra = []
    # SP means nothing without TP: a published tp=1 plan with sp=True (the plan type's
    # default) is the search's sp=False one, listed twice before (a review)
    published = [(name, replace(plan, sp=False) if plan.tp == 1 and plan.sp else plan)
                 for name, plan in published or []]
    for name, plan in published:
        problems = plan.problems(devices=devices, layers=model.layers, heads=model.heads,
                                 experts=model.experts, global_batch=global_batch,
                                 seq=model.seq, kv_heads=model.kv_heads)
        if problems:
            raise ConfigError(f"published configuration {name!r} ({plan.describe()}) is not "
                              f"valid for this job: {'; '.join(problems)}")
        extra.append(plan)
    seen = set(extra)
    rest = candidates(model, devices, global_batch, node, recompute)
    if seen:
        rest = (p for p in rest if p not in seen)
    tokens = global_batch * model.seq
    refused = 0
    for i, plan in enumerate(itertools.chain(extra, rest)):
        if admit is not None and not admit(plan):
            refused += 1
            continue
        evaluated += 1
        if progress is not None and evaluated % 2000 == 0:
            progress(evaluated)
        # once the top list is full, a plan whose compute + bubble alone is slower than its
        # last entry cannot enter it (published plans are always evaluated)
        bound = tokens / heap[0][0] if len(heap) == top_k and i >= len(extra) else math.inf
        pred = evaluate_within(plan, model, cluster, global_batch, dp_overlap, bound,
                               capacity)
        if pred is None:
            continue
        if isinstance(pred, float):  # its memory, over the capacity
            pruned += 1
            smallest = min(smallest, pred)
            continue
        # equal throughput: less memory first (the plan with headroom), then search order
        entry = (pred.tokens_per_s, -pred.memory_bytes, -i, replace(plan, prediction=pred))
        if len(heap) < top_k:
            heapq.heappush(heap, entry)
        elif entry[:3] > heap[0][:3]:
            heapq.heapreplace(heap, entry)
    if not heap and evaluated == 0 and refused:  # the batch allowed layouts: blaming it
        # was wrong (a review: "not divisible by any data-parallel degree" for a batch of 1,
        # which dp = 1 divides, when admit refused every layout)
        raise ConfigError(f"none of the {refused} layouts for {model.name} on {devices} "
                          "devices is admitted (the executor runs none of them for this job)")
    if not heap and evaluated == 0:
        raise ConfigError(no_layout_reason(model, devices, global_batch, node))
    if not heap:
        fewer = devices - devices % node if devices > node else 1 << (devices.bit_length() - 1)
        if fewer != devices:  # offered only where it fits (a review: 9 devices were told to
            try:              # plan 8, which fit nothing either)
                search(model, cluster, fewer, global_batch, top_k=1, dp_overlap=dp_overlap,
                       recompute=recompute, admit=admit)
            except ConfigError:
                fewer = devices
        hint = (f", or plan {fewer} devices: every plan uses all {devices}, and a count with "
                f"few divisors leaves few layouts (17 devices fit none of Llama 3 70B's where "
                f"16 do, a review)") if fewer != devices else ""
        raise ConfigError(f"no plan for {model.name} fits {devices} x {cluster.device.name} "
                          f"({_gib(capacity)} GiB usable): the smallest needs "
                          f"{_gib(smallest)} GiB per device; add devices or shorten "
                          f"the sequence{hint}" + (
                              "" if recompute else ", or allow activation recomputation "
                              "(recompute=True; drop graphopt plan's --no-recompute), with "
                              "which a plan may fit: none with it was searched"))
    ranked = [p for *_, p in sorted(heap, key=lambda x: x[:3], reverse=True)]
    hand, invalid = [], []
    listed: list[tuple[str, ParallelPlan, list[str]]] = [
        (f"published: {n}", p, []) for n, p in published or []]
    for name, plan, problems in listed + hand_configurations(model, devices, global_batch,
                                                             node, cluster):
        if not recompute and (plan.recompute_layers or plan.selective_recompute):
            problems = [*problems, "uses activation recomputation, which this search leaves "
                        "out (recompute=False, graphopt plan --no-recompute)"]
        if problems:
            invalid.append((name, plan, "; ".join(problems)))
            continue
        plan = replace(plan, prediction=evaluate(plan, model, cluster, global_batch,
                                                 dp_overlap))
        hand.append((name, plan, why_slower(plan, ranked[0], capacity)))
    return SearchResult(ranked[0], ranked, hand, evaluated, pruned,
                        time.perf_counter() - start, invalid, cluster.device.memory_bytes)


def hand_configurations(model: PlanModel, devices: int, global_batch: int, node: int,
                        cluster: ClusterProfile) -> list[tuple[str, ParallelPlan, list[str]]]:
    """Common hand-chosen plans (pure DP, FSDP, Megatron TP-in-node with PP to fit, ...),
    without predictions, each with what makes it invalid for this job (empty: valid)."""
    # Megatron's recipe: the widest TP in the node that splits the query and the KV heads
    # (num_query_groups % tp == 0) and the devices, then the fewest pipeline stages that
    # fit (uneven stages, the executor's balanced split, where pp does not divide the
    # layers: DeepSeek-V3's 61). A review found tp halved from the node size only (6 devices:
    # 6 -> 3 -> 1, skipping 2), KV heads ignored, and PP never tried for odd layer counts.
    tp = max(t for t in _divisors(devices) if t <= node and model.heads % t == 0
             and model.kv_heads % t == 0)
    capacity = USABLE_MEMORY * cluster.device.memory_bytes
    pps = [p for p in _divisors(devices // tp) if p <= model.layers]
    # (memory probes, unvalidated: a plan the job does not admit is reported as such below)
    pp = next((p for p in pps if isinstance(evaluate_within(
        _megatron(devices, tp, p, model.layers), model, cluster, global_batch, True,
        math.inf, capacity), Prediction)),
              pps[-1])  # none fits: the deepest, reported OOM
    ep = max((e for e in _divisors(devices) if model.experts and model.experts % e == 0
              and e <= node), default=1)
    plans = {
        "data parallel (DDP)": ParallelPlan(dp_replicate=devices),
        "FSDP (ZeRO-3)": ParallelPlan(dp_shard=devices, zero_stage=3),
        f"Megatron TP={tp} in node + DP": ParallelPlan(dp_replicate=devices // tp, tp=tp),
        (f"Megatron TP={tp} + PP={pp} + DP, full recompute" if pp > 1 else
         f"Megatron TP={tp} + DP, full recompute"): _megatron(devices, tp, pp, model.layers),
    }
    if model.experts:
        plans[f"FSDP + EP={ep}"] = ParallelPlan(dp_shard=devices, zero_stage=3, ep=ep)
    return [(name, plan, plan.problems(devices=devices, layers=model.layers, heads=model.heads,
                                       experts=model.experts, global_batch=global_batch,
                                       seq=model.seq, kv_heads=model.kv_heads))
            for name, plan in plans.items()]


def _megatron(devices: int, tp: int, pp: int, layers: int) -> ParallelPlan:
    """TP + PP + DP with full activation recomputation (Megatron-LM SC'21's configurations)."""
    layout = stage_layouts(layers, pp)[0]
    return ParallelPlan(dp_replicate=devices // (tp * pp), tp=tp, pp=pp,
                        recompute_layers=max(layout, default=layers // pp),
                        stage_layers=layout)


def why_slower(plan: ParallelPlan, best: ParallelPlan, capacity: float) -> str:
    """One line: out of memory, or the cost term that makes ``plan`` slower than ``best``."""
    p, b = plan.prediction, best.prediction
    assert p is not None and b is not None
    def bare(q: ParallelPlan) -> ParallelPlan:  # SP means nothing without TP
        return dataclasses.replace(q, prediction=None, sp=q.sp and q.tp > 1)

    if bare(plan) == bare(best):
        return "this is the best plan"
    if p.memory_bytes > capacity:
        return (f"OOM: needs {p.memory_bytes / 2**30:.1f} GiB per device, "
                f"{capacity / 2**30:.1f} GiB usable")
    terms = _terms(p)
    extra = {k: terms[k] - _terms(b).get(k, 0.0) for k in terms}
    worst = max(extra, key=lambda k: extra[k])
    ratio = b.tokens_per_s / p.tokens_per_s
    if ratio < 1.005:
        return (f"ties the best plan ({ratio:.3f}x its step time; "
                f"{p.memory_bytes / 2**30:.1f} vs {b.memory_bytes / 2**30:.1f} GiB per device)")
    kind = {"bubble": "bubble-bound", "compute": "compute (recomputation/less efficient "
            "split)"}.get(worst, f"comm-bound ({worst})")
    return (f"{ratio:.2f}x slower than the best plan: {kind}, +{extra[worst]:.3g} s per "
            "iteration")


def _terms(pred: Prediction) -> dict[str, float]:
    return {"compute": pred.compute_s, "bubble": pred.bubble_s, **pred.comm_s}
