"""Predicted iteration time, memory and MFU of a :class:`ParallelPlan` (the planner's
performance model), from per-layer costs measured on the traced model
(:mod:`graphopt.planner.model`) and the collective models of :mod:`graphopt.cost`.

Per device, m = B / (dp * mb) microbatches of mb sequences; stage i has L_i layers (L/pp, or
the plan's ``stage_layers``); the slowest stage sets the pipeline's slot and the fullest its
memory (even stages: the first, second and last are priced; uneven: all):

    layer    t = [(gemm*g/eff + split)/tp + repl/(tp if SP else 1)] * mb/cp   (x 4/3 if
             recomputed: one more forward; + the traced recomputation of the recomputed ops
             under selective checkpointing); MoE layers likewise (experts' grouped GEMMs);
             the LM head + loss on the last stage; g >= 1 prices the layer's GEMMs at
             their per-rank shapes on a profile with a GEMM-shape table (_gemm_factor),
             else 1; frozen weights' weight-gradient GEMMs (traced, LayerCost.weight_grad_s)
             are left out of gemm (PlanModel.trained_gemm / trained_expert_gemm), the 4/3 of a
             recomputed layer stays its fully trained forward; a frozen prefix
             (PlanModel.frozen_prefix) runs t/3 per layer, keeps no activations, has its
             forward's collectives only and takes the first recompute slots unrecomputed
    TP       4 all-reduces (or all-gather + reduce-scatter with SP) of mb*s/cp*h per layer,
             6 with recomputation (Megatron-LM SC'21 sec. 3) or with selective
             checkpointing under SP (the forward's all-gathers are recomputed)
    CP       ring: KV blocks of the local chunk (K and V of every query head: the executor
             repeats GQA's KV heads first; heads of the config's widths, MLA's 192 / 128)
             passed cp-1 times forward, 2(cp-1) backward,
             and the forward's once more in a recomputed or selectively checkpointed layer
             (ring attention's exchange is not a saved op), overlapped with the layer's
             attention except what exceeds half its time;
             all-to-all (Ulysses): 8 all-to-alls per layer (q, k, v, output and their
             gradients, of mb*s/cp tokens x heads/tp x the head widths; K/V at the KV heads'
             count unless the executor repeats them), exposed, 12 in a fully recomputed
             layer (the forward's run again)
    EP       dispatch + combine per MoE layer, forward and backward: the faster of the flat
             and hierarchical all-to-all of graphopt.cost.moe (tokens mb*s/(cp*tp) per rank;
             with tensor-parallel experts, expert_tp = tp, mb*s/cp: every TP rank dispatches
             all of its group's tokens). With tp > 1 the EP op also communicates over TP
             (graphopt.parallel.expert): expert_tp = 1 all-gathers its rows share of the
             output in the forward and of the input's and routing weights' gradients in the
             backward; expert_tp = tp all-reduces the partial output in the forward and the
             input's and routing weights' partial gradients in the backward (Megatron-LM's
             reduce-from / copy-to region mappings). Counted per MoE layer on 4 gloo ranks
             (dp_shard=2 x tp=2, ep=2; tests/test_planner_etp.py): the rest of a layer's TP
             collectives are the same for both
    PP       1F1B: (m + pp - 1) slots; interleaved with v stages: m + (pp - 1)/v slots, v x the
             p2p sends (Narayanan et al. SC'21 sec. 2.2); one slot = stage compute + TP/CP/EP
             + 2 p2p of mb*s/cp*h/tp. Zero bubble (torch's ScheduleInterleavedZeroBubble,
             the ZB-H1 schedule of Qi et al. ICLR 2024 with v stages per rank): the backward
             splits into input (B) and weight (W) gradients and W fills the bubble, which
             becomes (pp - 1)(T_F + T_B - T_W)/v (their sec. 3.1) = (pp - 1)/v x slot/3 with
             T_F = T_B = T_W (a layer's backward is two GEMMs per forward GEMM, one for each),
             with a slot 1.18x interleaving's (``ZERO_BUBBLE_SLOT``, measured: torch's
             schedule runs two autograd passes per backward); memory as interleaved (ZB-H1
             keeps 1F1B's peak, their Table 2)
    DP       gradients: reduce-scatter over dp_shard x cp (the experts': over edp_shard,
             the fold's ranks holding the same experts), then an all-gather of the updated
             parameters (ZeRO-1/2, the distributed optimizer) or, with ZeRO-3, all-gathers of
             the parameters for every microbatch's forward and backward (FSDP with
             reshard-after-forward); all-reduce over dp_replicate; gradients and
             gathered parameters in the model's dtype (fp32: 4 bytes). When each runs is
             what graphopt's executor does (collectives counted with torch.profiler,
             tests/test_parallel_accumulate.py; :func:`_dp_sync`): at pp = 1 (with
             graphopt.parallel.microbatches) replicas reduce once per step and FSDP
             reduce-scatters and gathers in every microbatch (ZeRO-2 gathers once per
             forward), HSDP's all-reduce once; under pp > 1 torch's schedules reduce once;
             experts reduced by graphopt's gradient hook, in every backward. Overlapped
             with the backward of every microbatch (2/3 of the compute) unless
             ``dp_overlap=False`` (Megatron-LM 2021 measured without overlap: the
             published-table validation uses that). The once-per-step reduction runs in
             the last backward (DDP's no_sync, Megatron-LM's distributed optimizer), yet
             hiding it under that one only made the Megatron-Core validation worse (worst
             row 6.3% -> 19.4%): the window is fitted, not derived
    memory   parameters/gradients/Adam states of the stage's layers (+ the embedding on the
             first, the LM head on the last; graphopt.cost.memory.model_state_bytes in the
             model's dtype: bf16 2 + 2 + 12 bytes per parameter, fp32 4 + 4 + 8; master
             weights (PlanModel.master_weights) 4 + 4 + 8, FSDP2 at ZeRO-2 and its
             replicate holding 16-bit unsharded parameters too, the layers it holds priced
             as the 16-bit model, the others under autocast with its 16-bit weight copies
             held per microbatch in flight; frozen parameters (PlanModel.trained) with
             no gradient or optimizer state (and no weight-gradient GEMMs in the compute:
             PlanModel.trained_gemm); ZeRO over
             dp_shard x cp, the experts' over edp_shard; under pp > 1 with ZeRO-2/3 the
             stage's gradients unsharded (float32 under mixed precision: FSDP2 accumulates
             them in its reduce dtype) and ZeRO-3's parameters gathered as well: torch's
             schedules run FSDP without gradient sync until the last backward, measured in
             tests/test_parallel_accumulate.py) + saved activations of
             min(m, pp - i) in-flight microbatches on stage i (x (1 + (pp-1)/(pp v))
             interleaved), /tp with SP (without SP the [b, s, h] share, 10/34 after
             Korthikanti et al. 2022, stays whole); a recomputed layer keeps only its
             input; selective checkpointing keeps what the traced policy keeps; the LM
             head's activations on the last stage; tensor-parallel experts keep their
             dispatched rows unsplit over TP: (1 - 1/tp) x mb*s/cp x ((2k + 1) h bytes +
             2k int64 indices) more per kept MoE layer (the input, the permuted and the
             expert output rows, k routed copies each); the difference measured on 4 gloo
             ranks is 1.006x that (tests/test_planner_etp.py). A recomputed MoE layer under
             EP also holds what the checkpoint caches of the ops that communicate (saved,
             not run again): the EP op's outputs and its TP row split or region mappings
             (ep_recompute_cache_bytes, measured 1.0003x). TP/SP's collectives of a fully
             recomputed layer run again (6 per layer, nothing cached), as in Megatron-LM
             and torchtitan, whose published tables validate this model, and in graphopt's
             executor (graphopt.planner.model.selective_checkpoint_context)
    MFU      model FLOPs (traced, no recomputation) priced at the peak FLOP/s of each op's
             dtype (the rates the layer times are bounded by) * B / (time * devices); for a
             one-dtype model, model FLOPs * B / (time * devices * peak(dtype)); at most 1
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from graphopt.cost.collectives import collective_time
from graphopt.cost.gemm_table import relative_rate
from graphopt.cost.memory import model_state_bytes
from graphopt.cost.profiles import ClusterProfile
from graphopt.planner.model import LayerCost, PlanModel
from graphopt.planner.plan import ParallelPlan, Prediction

ZERO_BUBBLE_SHARE = 1 / 3
"""The zero-bubble schedule's bubble over 1F1B's: (T_F + T_B - T_W) / (T_F + T_B + T_W) with
T_F = T_B = T_W (Qi et al. 2024, sec. 3.1)."""

ZERO_BUBBLE_SLOT = 1.18
"""The zero-bubble schedule's time per microbatch over interleaving's: torch 2.13's
ScheduleInterleavedZeroBubble runs the input and the weight gradients as two autograd
passes. Measured by benchmarks/pipeline.py (pp=2, v=2, Llama hidden 256 on CPU ranks): 37.7
vs 31.9 ms per microbatch, while the bubble fell to 0.38x (formula: 1/3). An upper bound for
large GEMMs, where the second pass's fixed costs weigh less; a GPU measurement is pending.
With it, zero bubble wins only with few microbatches per stage (m < ~3.4 (pp - 1) / v)."""

USABLE_MEMORY = 0.92
"""Fraction of device memory a plan may use (allocator fragmentation, workspace)."""


_CACHE: dict[tuple[object, ...], float] = {}
"""Collective times by (kind, bytes, group, the cluster's levels (links included) and device
name, stride): keyed by what they depend on, so two profiles with one name and different
links (a review priced a 100x slower NVLink at the cached speed) never share entries."""


_CLUSTER_KEYS: dict[tuple[object, ...], int] = {}
"""(levels, device name) -> a small int standing for them in :data:`_CACHE`'s keys."""


def _side_cache(obj: object, name: str) -> dict[Any, Any]:
    """A dict kept on ``obj`` (a frozen dataclass: set with ``object.__setattr__``, not a
    field, so equality, hashing and ``dataclasses.replace`` ignore it; a replaced object
    starts empty)."""
    cache = obj.__dict__.get(name)
    if cache is None:
        cache = {}
        object.__setattr__(obj, name, cache)
    return cache


def _cluster_key(cluster: ClusterProfile) -> int:
    """The cluster's entry in :data:`_CLUSTER_KEYS`, kept on the profile object after the
    first call (hashing the levels' nested dataclasses on every collective was a fifth of
    the search's time)."""
    cache = _side_cache(cluster, "_collective_key")
    if "key" not in cache:
        cache["key"] = _CLUSTER_KEYS.setdefault((cluster.levels, cluster.device.name),
                                                len(_CLUSTER_KEYS))
    return cache["key"]


def _coll(kind: str, nbytes: float, group: int, cluster: ClusterProfile, stride: int) -> float:
    if group <= 1:
        return 0.0
    key = (kind, nbytes, group, _cluster_key(cluster), stride)
    t = _CACHE.get(key)
    if t is None:
        t = _CACHE[key] = collective_time(kind, nbytes, group, cluster, stride=stride)
    return t


def _pair_stride(span: int, cluster: ClusterProfile) -> int:
    """The stride that prices a transfer between two ranks as at the level of ``span``
    devices (collective_time places a group of 2 at stride s over 2 s devices): half the span
    rounded up (a 9-device ring crosses a node of 8), at most half the cluster."""
    return max(1, min(-(-span // 2), cluster.max_devices // 2))


def fsdp_working_set(dense_layer: float, moe_layer: float, root: float,
                     param_bytes: int, trained: float = 1.0) -> float:
    """Bytes ZeRO-3 (FSDP2 ``fully_shard`` per decoder layer, ``reshard_after_forward``)
    holds unsharded at once on a device, beyond its shards: the parameters of the layer being
    computed and of the next one, prefetched (FSDP2's default forward and backward
    prefetch of one unit), and the computed layer's unsharded gradients until their
    reduce-scatter, in the parameter dtype and (16-bit parameters) again in float32, the
    reduce dtype graphopt's executor and torchtitan give FSDP2's MixedPrecisionPolicy; plus
    the root unit's parameters (embedding, final norm, LM head: FSDP2 keeps the root
    gathered between forward and backward). ``dense_layer`` / ``moe_layer``:
    one layer's parameters on this device (after TP and EP; 0 for a kind the stage lacks);
    ``root``: the root unit's. Found by a review: plans at the memory limit left this out
    (Llama 3 70B's best plan on 512 H100s: ~5 GiB). ``trained``: the share of parameters
    that train (frozen ones have no gradient)."""
    layer = max(dense_layer, moe_layer)
    grad_bytes = param_bytes + (4 if param_bytes < 4 else 0)
    return param_bytes * (2 * layer + root) + grad_bytes * layer * trained


@functools.lru_cache(maxsize=1 << 16)
def _states_total(params: float, nb: int, zero: int, dp: int, pipelined: bool,
                  master: bool = False, trained: float = 1.0, copy16: bool = False) -> float:
    """Bytes of ``params`` parameters' states on a device (model_state_bytes' total, ZeRO
    stage ``zero`` over ``dp`` ranks); with ``pipelined`` (pp > 1) and ZeRO-2/3 also what
    torch's pipeline schedules hold until the step's last backward, where FSDP runs without
    gradient sync: the unsharded gradients, accumulated in float32 under mixed precision
    (FSDP2's MixedPrecisionPolicy reduce_dtype, as graphopt.parallel applies it: 4 bytes
    per parameter where the model's dtype has 2; a review measured 4.0), in place of the
    sharded ones, and under ZeRO-3 the parameters gathered by each backward (measured:
    tests/test_parallel_accumulate.py). Cached: a search asks for the same few hundred
    thousand times.

    ``master`` (:attr:`PlanModel.master_weights`): float32 parameters and gradients (4 + 4
    bytes), AdamW's 8, sharded as graphopt.parallel runs each stage: ZeRO-1
    (ZeroRedundancyOptimizer) the optimizer states, ZeRO-2/3 (FSDP2) all three;
    ``copy16``: FSDP2 also holds its ``nb``-byte unsharded parameters (MixedPrecisionPolicy's
    param_dtype; ZeRO-2's ``reshard_after_forward=False``, and its ``replicate``) from the
    forward to the backward.

    ``trained``: the share of ``params`` that trains (requires_grad); the rest holds its
    parameters only (no gradient, no optimizer state)."""
    if master:
        shard = dp if zero >= 2 else 1
        total = params * (4 / shard + trained * (4 / shard + 8 / (dp if zero >= 1 else 1))
                          + nb * copy16)
        if pipelined and zero >= 2:
            total += params * (trained * (4 - 4 / dp) + nb * (zero == 3))
        return total
    states = model_state_bytes(params, param_bytes=nb, grad_bytes=nb, zero_stage=zero, dp=dp)
    total = states.params + trained * (states.grads + states.optimizer)
    if pipelined and zero >= 2:
        total += params * (trained * (max(nb, 4) - nb / dp) + nb * (zero == 3))
    return total


def _dp_sync(grads: float, plan: ParallelPlan, m: int, group: int, zero: int, stride: int,
             cluster: ClusterProfile, hook: bool = False, gathered: float | None = None
             ) -> tuple[float, float]:
    """(seconds in every microbatch's backward, seconds once per step) of the data-parallel
    traffic for ``grads`` bytes of gradients (and, gathered, parameters) sharded (ZeRO stage
    ``zero``) or reduced over ``group`` ranks ``stride`` apart, then all-reduced (sharded)
    over dp_replicate, as graphopt's executor runs it (counted with torch.profiler on gloo
    ranks, tests/test_parallel_accumulate.py):

    - pp = 1 with graphopt.parallel.microbatches: replicas (ZeRO-0/1) all-reduce once
      (ZeRO-1 adds the updated parameters' all-gather); FSDP reduce-scatters and all-gathers
      in every microbatch (ZeRO-2: one all-gather per forward, the backward reshards;
      ZeRO-3: forward and backward), HSDP's all-reduce once.
    - pp > 1 (torch's pipeline schedules hold the gradients unsynced until the last
      backward): one reduction per step; ZeRO-3 gathers once per microbatch's backward and
      per warm-up forward (m + min(m, pp)), the other forwards find the parameters the
      previous backward left gathered.
    - ``hook``: experts whose gradients graphopt.parallel.expert's hook all-reduces, in every
      backward.

    ``gathered``: bytes of the parameters ZeRO gathers where they differ from ``grads``
    (master weights: FSDP2 gathers 16-bit parameters and reduces float32 gradients)."""
    if not grads and not (gathered and zero >= 1):
        return 0.0, 0.0
    reduce = _coll("reduce_scatter" if zero >= 1 else "all_reduce", grads, group, cluster,
                   stride) if grads else 0.0
    gather = _coll("all_gather", grads if gathered is None else gathered, group, cluster,
                   stride) if zero >= 1 else 0.0
    replicas = _coll("all_reduce", grads / (group if zero >= 1 else 1), plan.dp_replicate,
                     cluster, plan.stride("dp_replicate")) if grads else 0.0
    if hook:
        return reduce + replicas, 0.0
    if plan.pp > 1:
        if zero == 3:
            return gather * (m + min(m, plan.pp)) / m, reduce + replicas
        return 0.0, reduce + gather + replicas
    if zero >= 2:
        return reduce + gather * (2 if zero == 3 else 1), replicas
    return 0.0, reduce + gather + replicas


def ep_group_devices(plan: ParallelPlan) -> list[int]:
    """The devices of the first EP group: EP takes ``plan.ep`` consecutive ranks of its fold
    (dp_shard x cp x tp, or dp_shard x cp with tensor-parallel experts, innermost first in
    ``mesh_order``; graphopt.parallel.mesh.expert_mesh), so with expert_tp = tp its ranks
    are tp devices apart. Checked against the executor's groups in
    tests/test_planner_etp.py."""
    fold = [a for a in plan.mesh_order if a in ("dp_shard", "cp") +
            (("tp",) if plan.expert_tp == 1 else ()) and getattr(plan, a) > 1]
    out = []
    for i in range(plan.ep):
        at, rest = 0, i
        for axis in fold:
            rest, coord = divmod(rest, getattr(plan, axis))
            at += coord * plan.stride(axis)
        out.append(at)
    return out


_EP_NODES: dict[tuple[object, ...], int] = {}


def ep_ranks_per_node(plan: ParallelPlan, node: int) -> int:
    """The most ranks of one EP group (:func:`ep_group_devices`) on one node of ``node``
    devices: the all-to-all's intra-node share (a review priced an expert_tp = 2 EP group
    of 8 ranks spanning 2 nodes as one node's, 4.5x too fast)."""
    key = (plan.mesh_order, plan.dp_shard, plan.cp, plan.tp, plan.ep, plan.expert_tp, node)
    if key not in _EP_NODES:
        nodes = [d // node for d in ep_group_devices(plan)]
        _EP_NODES[key] = max(nodes.count(n) for n in set(nodes))
    return _EP_NODES[key]


def _ep_comm(tokens: int, top_k: int, hidden: int, ffn: int, nbytes: int, ep: int,
             cluster: ClusterProfile, ranks_per_node: int) -> float:
    if ep <= 1 or tokens == 0:
        return 0.0
    key = ("ep", tokens, top_k, hidden, ffn, nbytes, ep, ranks_per_node, cluster.levels,
           cluster.device.name)
    if key not in _CACHE:
        from graphopt.cost.moe import MoELayerShape, a2a_latency

        lat = a2a_latency(MoELayerShape(tokens, top_k, hidden, ffn, nbytes), ep, cluster,
                          ranks_per_node)
        _CACHE[key] = 2 * min(lat["flat"], lat["hierarchical"])  # forward + backward
    return _CACHE[key]


def ep_tokens_per_rank(plan: ParallelPlan, tokens: int) -> int:
    """Tokens one rank dispatches in EP's all-to-all when its TP group holds ``tokens`` at
    the MoE block: its 1/tp share (expert_tp = 1 splits the rows over TP), or all of them
    with tensor-parallel experts (every TP rank dispatches the group's tokens to its
    slice of the experts). Measured: tests/test_planner_etp.py."""
    return tokens if plan.expert_tp > 1 else tokens // plan.tp


def ep_tp_collectives(plan: ParallelPlan, tokens: int, hidden: int, top_k: int,
                      nbytes: int) -> list[tuple[str, float]]:
    """(kind, bytes) of the collectives over TP that one MoE layer's expert-parallel op runs
    per microbatch, forward and backward, as graphopt.parallel.expert executes it with
    ``tokens`` tokens of ``hidden`` features at the MoE block (the TP group's: mb * s/cp),
    ``top_k`` routed experts and ``nbytes`` bytes per element. expert_tp = 1 splits the rows
    over TP (``graphopt::scatter_rows`` / ``gather_rows``): all-gathers of the output
    (forward) and of the input's gradient and the routing weights' (backward); expert_tp =
    tp (Megatron-LM's reduce-from / copy-to mappings, ``graphopt::reduce_from_group`` /
    ``copy_to_group``): all-reduces of the partial output (forward) and of the input's and
    routing weights' partial gradients (backward). Bytes are the gathered / reduced tensor
    (graphopt.cost.collectives' convention). Empty without EP or TP. Measured on 4 gloo
    ranks: tests/test_planner_etp.py."""
    if plan.ep <= 1 or plan.tp <= 1:
        return []
    kind = "all_reduce" if plan.expert_tp > 1 else "all_gather"
    rows = tokens * hidden * nbytes
    return [(kind, rows), (kind, rows), (kind, tokens * top_k * nbytes)]


def ep_recompute_cache_bytes(plan: ParallelPlan, tokens: int, hidden: int, ffn: int,
                             top_k: int, nbytes: int) -> float:
    """Bytes a fully recomputed MoE layer still holds per microbatch under EP (0 without
    it): graphopt's checkpoint policy saves the ops that communicate (they are not run
    again: graphopt.planner.model.selective_checkpoint_context), so the checkpoint caches
    their outputs. The EP op (graphopt::moe_experts) with T = :func:`ep_tokens_per_rank`
    tokens and R = T k received rows (uniform routing): the output [T, H], the combined
    rows [T k, H], the experts' gate/up output [R, 2F/expert_tp], their input rows [R, H]
    and the sort [T k] int64; with TP its row split (expert_tp = 1: scatter_rows' share of
    the input [T, H], indices [T, k] int64 and weights [T, k], gather_rows' output
    [tokens, H]) or its region mappings (expert_tp = tp: copy_to_group's input [T, H] and
    weights [T, k], reduce_from_group's output [T, H]); ``tokens`` the TP group's at the
    MoE block (mb * s/cp), ``ffn`` F, ``nbytes`` per element of the model's dtype; returns
    bytes. The cache read from torch's checkpoint storage on 4 gloo ranks is 1.0003x this
    (tests/test_planner_etp.py; the rest: the counts and piece sizes)."""
    if plan.ep <= 1:
        return 0.0
    t = ep_tokens_per_rank(plan, tokens)
    rows = t * top_k
    out = (t * hidden + rows * hidden + rows * 2 * ffn // plan.expert_tp +
           rows * hidden) * nbytes + rows * 8
    if plan.tp > 1 and plan.expert_tp == 1:
        out += t * hidden * nbytes + rows * (8 + nbytes) + tokens * hidden * nbytes
    elif plan.expert_tp > 1:
        out += (2 * t * hidden + rows) * nbytes
    return out


def etp_activation_bytes(plan: ParallelPlan, tokens: int, hidden: int, top_k: int,
                         nbytes: int) -> float:
    """Saved-activation bytes one MoE layer holds per microbatch with tensor-parallel
    experts beyond expert_tp = 1 (0 without them): each TP rank dispatches all ``tokens``
    rows of its group, not its 1/tp share, so the input, the k routed copies permuted for
    the experts and the k expert outputs ((2k + 1) rows of ``hidden`` x ``nbytes``) and two
    int64 indices per routed copy are (1 - 1/tp) larger (in a kept layer; a recomputed
    one holds :func:`ep_recompute_cache_bytes`). The difference measured on 4 gloo ranks
    is 1.006x this (tests/test_planner_etp.py)."""
    if plan.expert_tp <= 1:
        return 0.0
    return (1 - 1 / plan.tp) * tokens * ((2 * top_k + 1) * hidden * nbytes + 2 * top_k * 8)


def _head_split(model: PlanModel) -> bool:
    """Whether the embedding/LM head is split over TP (see PlanModel.tied_head_tp)."""
    return model.tied_head_tp or not model.tied_embeddings


def _split_time(gemm_s: float, split_s: float, replicated_s: float, plan: ParallelPlan,
                eff: float, mb: int) -> float:
    per_seq = (gemm_s / eff + split_s) / plan.tp + replicated_s / (plan.tp if plan.sp else 1)
    return per_seq * mb / plan.cp


def _layer_time(cost: LayerCost, plan: ParallelPlan, eff: float, mb: int,
                table: str = "", frozen_s: float = 0.0) -> float:
    """One layer's forward + backward; ``frozen_s``: seconds of ``cost.gemm_s`` not run
    (:func:`_frozen_gemm_s`), at the layer's mean shape efficiency."""
    return _split_time((cost.gemm_s - frozen_s) * _gemm_factor(cost, plan, table),
                       cost.split_s, cost.replicated_s, plan, eff, mb)


def _frozen_gemm_s(cost: LayerCost, model: PlanModel) -> float:
    """Seconds of ``cost.gemm_s`` that frozen weights do not compute: their weight-gradient
    GEMMs (:attr:`PlanModel.trained_gemm`, :attr:`PlanModel.trained_expert_gemm`)."""
    return (1 - model.trained_gemm) * cost.weight_grad_s + \
        (1 - model.trained_expert_gemm) * cost.expert_weight_grad_s


def _selective_time(cost: LayerCost, plan: ParallelPlan, eff: float, mb: int,
                    table: str = "") -> float:
    """Recomputation selective checkpointing adds to one layer (split like the layer; its
    GEMMs at the layer's mean shape efficiency)."""
    return _split_time(cost.selective_gemm_s * _gemm_factor(cost, plan, table),
                       cost.selective_split_s, cost.selective_replicated_s, plan, eff, mb)


def _gemm_factor(cost: LayerCost, plan: ParallelPlan, table: str) -> float:
    """How much slower than ``matmul_efficiency`` the layer's GEMMs run at this plan's
    per-rank shapes: ``sum(t_i / r_i) / sum(t_i)`` over :attr:`LayerCost.gemm_shapes` (the
    token dimension x microbatch / cp, the TP dimension / tp; ``r_i`` the table's rate
    relative to its best shape, :func:`graphopt.cost.gemm_table.relative_rate`), the rest
    of ``gemm_s`` at 1. 1.0 without a table. Not cached itself: its callers run inside
    :func:`_slowest_stage`, cached per (tp, cp, microbatch, ...)."""
    if not table or not cost.gemm_shapes or cost.gemm_s <= 0:
        return 1.0
    covered = slowed = 0.0
    for tokens, split, kept, seconds in cost.gemm_shapes:
        rel = relative_rate(table, tokens * plan.microbatch / plan.cp,
                            max(split / plan.tp, 1.0), kept)
        covered += seconds
        slowed += seconds / rel
    return (slowed + max(cost.gemm_s - covered, 0.0)) / cost.gemm_s


_STAGES: dict[tuple[object, ...], tuple[tuple[float, ...], list[int]]] = {}


def _stages(plan: ParallelPlan, layers: int) -> tuple[tuple[float, ...], list[int]]:
    """(:func:`stage_sizes`, the stages that can be the slowest or the fullest), cached by
    (stage_layers, pp, layers). Even stages: the first (most microbatches in flight,
    embedding), the second (next most), the last (LM head). Uneven stages (stage_layers):
    memory goes with layers x (pp - i), and a middle stage one layer lighter but earlier can
    be the fullest (a review found (2, 14, 15, 1) priced at its third stage, 51.8 GiB, while
    its second needs 71). A stage's compute depends on its size and on being the last; its
    memory on its size, on being an end and on its index only through the microbatches in
    flight (more on an earlier stage): so the first stage of each size, the second and the
    ends give the same slowest and fullest stage (ties: the same first one) as all of
    them (checked on 33,000 plans against pricing every stage)."""
    key = (plan.stage_layers, plan.pp, layers)
    hit = _STAGES.get(key)
    if hit is None:
        sizes = stage_sizes(plan, layers)
        first_of_size: dict[float, int] = {}
        for i, n in enumerate(sizes):
            first_of_size.setdefault(n, i)
        pp = plan.pp
        hit = _STAGES[key] = (sizes, sorted({0, min(1, pp - 1), pp - 1,
                                             *first_of_size.values()}))
    return hit


def stage_sizes(plan: ParallelPlan, layers: int) -> tuple[float, ...]:
    """Decoder layers of each pipeline stage (all of a rank's virtual-stage chunks): the
    plan's ``stage_layers``, else layers / pp each."""
    return tuple(map(float, plan.stage_layers)) if plan.stage_layers else \
        (layers / plan.pp,) * plan.pp


def _priced_stages(plan: ParallelPlan, model: PlanModel
                   ) -> tuple[tuple[float, ...], list[int]]:
    """:func:`_stages` of the model, every stage with a frozen prefix (a stage's compute and
    memory then depend on where it is, not only on its size and ends)."""
    sizes, picks = _stages(plan, model.layers)
    return sizes, list(range(plan.pp)) if model.frozen_prefix else picks


def frozen_in_stage(plan: ParallelPlan, model: PlanModel, sizes: tuple[float, ...],
                    i: int) -> float:
    """Layers of :attr:`PlanModel.frozen_prefix` on pipeline rank ``i``: stages hold
    consecutive layers, the first stage the first ones; with v virtual stages (interleaved,
    zero bubble) rank i holds chunks i, i + pp, ..., of layers / (pp v) each, as
    graphopt.parallel.pipeline deals them (a re-review found them priced as consecutive:
    an interleaved plan of 24 layers with 12 frozen cost as much as with none, 1.4x high)."""
    prefix = model.frozen_prefix
    if plan.virtual_stages > 1 and not plan.stage_layers:
        chunk = sizes[i] / plan.virtual_stages
        return sum(min(max(prefix - (i + k * plan.pp) * chunk, 0.0), chunk)
                   for k in range(plan.virtual_stages))
    start = sum(sizes[:i])
    return min(max(prefix - start, 0.0), sizes[i])


def _slowest_stage(plan: ParallelPlan, model: PlanModel, eff: float, table: str
                   ) -> tuple[float, float, float, float, float, int, float, float]:
    """(compute s per microbatch, trained dense layers, trained MoE layers, fully recomputed
    layers, frozen-prefix layers, index) of the plan's slowest stage, and one dense and one
    MoE layer's time. Cached on the model per what they depend on (the search prices ~10^5
    plans that share far fewer of them)."""
    key = (eff, table, plan.tp, plan.sp, plan.cp, plan.microbatch, plan.selective_recompute,
           plan.recompute_layers, plan.stage_layers, plan.pp,
           plan.virtual_stages if model.frozen_prefix else 1)  # (which layers a rank holds)
    cache = _side_cache(model, "_slowest_stage")
    hit = cache.get(key)
    if hit is not None:
        return hit
    mb, pp = plan.microbatch, plan.pp
    dense_share = model.dense_layers / max(model.layers, 1)
    sizes, picks = _priced_stages(plan, model)
    # a full recomputation reruns a third of the layer as it is with every weight trained
    # (the forward), also where frozen weights skip their weight-gradient GEMMs
    fwd_dense = _layer_time(model.dense, plan, eff, mb, table) / 3
    fwd_moe = _layer_time(model.moe, plan, eff, mb, table) / 3 if model.moe else 0.0
    t_dense = _layer_time(model.dense, plan, eff, mb, table,
                          _frozen_gemm_s(model.dense, model))
    t_moe = _layer_time(model.moe, plan, eff, mb, table,
                        _frozen_gemm_s(model.moe, model)) if model.moe else 0.0
    head = model.head
    head_frozen = _frozen_gemm_s(head, model)
    t_head = _layer_time(head, plan, eff, mb, table, head_frozen) if _head_split(model) \
        else ((head.gemm_s - head_frozen) / eff + head.split_s + head.replicated_s) * mb / \
        plan.cp
    sel_dense = sel_moe = 0.0
    if plan.selective_recompute:
        sel_dense = _selective_time(model.dense, plan, eff, mb, table)
        sel_moe = _selective_time(model.moe, plan, eff, mb, table) if model.moe else 0.0

    def stage_compute(i: int) -> tuple[float, float, float, float, float]:
        """(compute s, trained dense layers, trained MoE layers, fully recomputed layers,
        frozen-prefix layers) of stage i. A frozen-prefix layer runs its forward only, not
        checkpointed (graphopt.parallel skips the checkpoint of a layer with nothing to
        differentiate), and takes one of the stage's first recompute_layers slots."""
        n = sizes[i]
        frozen = frozen_in_stage(plan, model, sizes, i)
        dense_n, moe_n = (n - frozen) * dense_share, (n - frozen) * (1 - dense_share)
        rec = max(0.0, min(plan.recompute_layers, n) - frozen)
        rec_share = rec / (n - frozen) if n > frozen else 0.0
        t = dense_n * t_dense + moe_n * t_moe + rec_share * (dense_n * fwd_dense +
                                                               moe_n * fwd_moe)
        t += (dense_n * sel_dense + moe_n * sel_moe) * (1 - rec_share)
        t += frozen * (dense_share * fwd_dense + (1 - dense_share) * fwd_moe)
        if pp == 1:
            t += t_head
        elif i == pp - 1:  # LM head + loss on the last stage, the embedding (a lookup)
            t += t_head    # on the first
        return t, dense_n, moe_n, rec, frozen

    stages = {i: stage_compute(i) for i in picks}
    slowest = max(picks, key=lambda i: stages[i][0])
    hit = cache[key] = (*stages[slowest], slowest, t_dense, t_moe)
    return hit


def evaluate(plan: ParallelPlan, model: PlanModel, cluster: ClusterProfile, global_batch: int,
             dp_overlap: bool = True) -> Prediction:
    """Predict one iteration of ``plan`` (see the module docstring) for ``model`` on
    ``cluster`` at ``global_batch`` sequences.

    Raises:
        ConfigError: the plan is invalid for this job (:meth:`ParallelPlan.validate` with
            the model's layers, heads, KV heads, experts and sequence and the global batch;
            it was priced without an error before, e.g. a global batch the microbatches do
            not divide, or ep > 1 on a dense model).
    """
    plan.validate(layers=model.layers, heads=model.heads, kv_heads=model.kv_heads,
                  experts=model.experts, global_batch=global_batch, seq=model.seq)
    pred = evaluate_within(plan, model, cluster, global_batch, dp_overlap, math.inf)
    assert isinstance(pred, Prediction)
    return pred


def evaluate_within(plan: ParallelPlan, model: PlanModel, cluster: ClusterProfile,
                    global_batch: int, dp_overlap: bool, bound_s: float,
                    capacity: float = math.inf) -> Prediction | float | None:
    """:func:`evaluate`; or None as soon as a lower bound of the plan's step time (its
    compute and bubble, then its pipeline slots without DP's exposed time) exceeds
    ``bound_s`` seconds: the search skips plans that cannot enter its top list; or, for a
    plan whose memory exceeds ``capacity`` bytes, that memory (a float: the search drops
    the plan and keeps the smallest such footprint for its error; most of a large search's
    plans are over it, and communication is not priced for them)."""
    cluster = cluster.scaled(plan.devices) if plan.devices > cluster.max_devices else cluster
    dev = cluster.device
    eff = dev.matmul_efficiency
    mb, pp, tp, cp = plan.microbatch, plan.pp, plan.tp, plan.cp
    m = global_batch // (plan.dp * mb)
    seq, h, nb = model.seq, model.hidden, model.dtype_bytes
    master = model.master_weights
    # master weights where FSDP2 holds the layers (graphopt.parallel's fully_shard at
    # ZeRO-2/3 over dp_shard x cp, its replicate for data parallelism with TP or PP): its
    # MixedPrecisionPolicy gives them 16-bit parameters and inputs, so they compute as the
    # 16-bit model (a review: the autocast trace priced ZeRO-3 llama3-8b mb=2 at 72 GiB
    # where it holds 62); else (DDP, no data parallelism) autocast over float32 weights
    fsdp2 = master and plan.dp * cp > 1 and (
        (plan.dp_shard * cp > 1 and plan.zero_stage >= 2) or tp > 1 or pp > 1)
    if fsdp2 and model.bf16_layers is not None:
        views = _side_cache(model, "_fsdp2_view")
        if not views:
            dense, moe, head = model.bf16_layers
            views[0] = dataclasses.replace(model, dense=dense, moe=moe, head=head,
                                           bf16_layers=None)
        model = views[0]
    act = mb * seq // cp * h * nb  # one microbatch's [b, s/cp, h] activation, bytes
    dense_share = model.dense_layers / max(model.layers, 1)
    sizes, picks = _priced_stages(plan, model)
    table = dev.gemm_table if model.dtype_bytes == 2 else ""  # the table is bf16's
    compute, dense_n, moe_n, recomputed, frozen_n, slowest, t_dense, t_moe = _slowest_stage(
        plan, model, eff, table)
    v = plan.virtual_stages
    zero_bubble = plan.pp_schedule == "zero_bubble"
    ramp = (pp - 1) / v * (ZERO_BUBBLE_SHARE if zero_bubble else 1.0)
    if zero_bubble:
        compute *= ZERO_BUBBLE_SLOT
    if (m + ramp) * compute > bound_s * (1 + 1e-9):  # ties are not pruned: the
        return None  # bound is computed from tokens/s, its last digit can fall below
    rec_share = recomputed / (dense_n + moe_n) if dense_n + moe_n else 0.0
    moe_tokens = mb * seq // cp  # tokens at a MoE block: its TP group's
    # the dense parameters' gradient group is dp_shard x cp (CP ranks hold the same
    # parameters; graphopt.parallel shards and reduces over mesh["dp_shard_cp"], as
    # Megatron-LM's data-parallel group with CP); the experts' is edp_shard, the fold's
    # ranks that hold the same experts (dp_shard*cp*tp / (ep*expert_tp)), as
    # graphopt.parallel.expert executes it
    # (with ep = 1 the experts are dense parameters, replicated over tp). The ZeRO stage
    # each group gets is the one the executor runs: ZeRO-2/3 by FSDP over the group;
    # ZeRO-1 by ZeroRedundancyOptimizer over dp_shard, for the dense parameters only
    # (refused with cp > 1 or ep > 1 over dp_shard > 1, so unsharded otherwise)
    zero = plan.zero_stage
    shard_group = plan.dp_shard * cp
    zero_dense = zero if shard_group > 1 and (zero >= 2 or plan.dp_shard > 1) else 0
    dense_stride = plan.group_stride(("dp_shard", "cp"))
    if plan.ep > 1:
        edp_shard = plan.edp_shard
        # FSDP shards the experts only where it shards the dense parameters too
        # (apply._apply_dp: dp_shard x cp > 1); else their gradient hook all-reduces
        zero_experts = zero if zero >= 2 and edp_shard > 1 and shard_group > 1 else 0
        expert_stride = plan.group_stride(("dp_shard", "cp", "tp"), edp_shard)
    else:
        edp_shard, zero_experts, expert_stride = shard_group, zero_dense, dense_stride
    # the residual stream between layers (a recomputed layer's kept input, PP's sends): under
    # master weights float32 (autocast's residual adds) except where FSDP2 holds the layers
    # and casts their inputs to its param_dtype (cast_forward_inputs)
    stream = act * 4 / nb if master and not fsdp2 else act
    # memory: the fullest stage
    tp_share = 1 / tp if plan.sp else 10 / 34 + 24 / (34 * tp)
    head_tp = tp if _head_split(model) else 1

    def layer_bytes(cost: LayerCost) -> float:
        """Saved bytes per microbatch that grow with its tokens (autocast's parameter
        casts apart: :func:`cast_bytes`)."""
        return cost.selective_activation_bytes if plan.selective_recompute and \
            cost.selective_activation_bytes else cost.activation_bytes - cost.cast_bytes

    def cast_bytes(cost: LayerCost | None) -> float:
        """Autocast's 16-bit parameter copies a kept layer's autograd holds per microbatch
        (master weights without FSDP2, whose 16-bit parameters autocast does not copy;
        selective checkpointing recomputes them)."""
        if cost is None or not master or fsdp2 or (plan.selective_recompute and
                                                   cost.selective_activation_bytes):
            return 0.0
        return cost.cast_bytes

    def expert_casts() -> float:
        """Master weights, an MoE layer kept: the 16-bit copies of its experts that
        graphopt.parallel.expert's op makes per microbatch where FSDP2 does not hold them
        (ZeRO-0/1 experts), and autocast's of its other weights without FSDP2 (its trace
        is the 16-bit model's: grouped_mm takes no float32 experts)."""
        if not master or model.moe is None or (plan.selective_recompute and
                                               model.moe.selective_activation_bytes):
            return 0.0
        experts = model.moe.expert_params / (plan.ep * plan.expert_tp) \
            if zero_experts < 2 else 0.0
        return nb * (experts + (0.0 if fsdp2 else model.moe.params / tp))

    def stage_memory(i: int) -> tuple[float, float, float, float]:
        """(total, model states, activations, ZeRO-3 working set) bytes of stage i: its
        layers' and (first, last) the embedding's / LM head's states; its layers' saved
        activations for each microbatch in flight (1F1B: pp - i on stage i; interleaved: the
        first stage's pp x (1 + (pp-1)/(pp v))), the LM head's on the last stage; under
        ZeRO-3 what FSDP holds unsharded at once (:func:`fsdp_working_set`)."""
        # a frozen-prefix layer keeps nothing for a backward it does not run
        frozen = round(frozen_in_stage(plan, model, sizes, i))
        n_dense = round((sizes[i] - frozen) * dense_share)
        n_moe = round(sizes[i]) - frozen - n_dense if model.moe else 0
        a_dense = layer_bytes(model.dense)
        a_moe = layer_bytes(model.moe) if model.moe else 0.0
        rec = min(max(plan.recompute_layers - frozen, 0), n_dense + n_moe)
        # the largest layers are the recomputed ones
        rec_moe = min(rec, n_moe) if a_moe >= a_dense else max(0, rec - n_dense)
        kept = (n_dense - (rec - rec_moe)) * a_dense + (n_moe - rec_moe) * a_moe
        kept_mb = kept * mb / cp * tp_share
        casts = ((n_dense - (rec - rec_moe)) * cast_bytes(model.dense) +
                 (n_moe - rec_moe) * cast_bytes(model.moe)) / tp + \
            (n_moe - rec_moe) * expert_casts()
        stage_act = kept_mb + rec * stream / tp + casts
        if n_moe:  # tensor-parallel experts' unsplit rows in the kept MoE layers; in
            # the recomputed ones what the checkpoint caches of the EP op (not run again)
            stage_act += (n_moe - rec_moe) * etp_activation_bytes(plan, moe_tokens, h,
                                                                  model.top_k, nb)
            stage_act += rec_moe * ep_recompute_cache_bytes(plan, moe_tokens, h,
                                                            model.moe_ffn, model.top_k, nb)
        in_flight = min(m, pp - i) * (1 + (pp - 1) / (pp * v) if v > 1 else 1)
        acts = stage_act * in_flight
        # the backward's transient, for the microbatch being back-propagated: a recomputed
        # layer rebuilt whole, or under selective checkpointing one layer's recomputed ops
        rebuild = 0.0
        if rec:
            rebuild = max(a_dense if n_dense else 0.0, a_moe if n_moe else 0.0) * mb / cp \
                * tp_share
            if not (n_dense and n_moe):  # recomputed layers are the stage's first: the kept
                rebuild = max(0.0, rebuild - kept_mb)  # ones are freed when they rebuild
            # the rebuilt layer's autocast weight copies (master weights without FSDP2)
            rebuild += max(cast_bytes(model.dense) if n_dense else 0.0,
                           cast_bytes(model.moe) if n_moe else 0.0) / tp
        elif plan.selective_recompute:
            full = max(model.dense.activation_bytes - a_dense if n_dense else 0.0,
                       model.moe.activation_bytes - a_moe if n_moe and model.moe else 0.0)
            rebuild = full * mb / cp * tp_share
        acts += rebuild
        if i == pp - 1:
            head_casts = cast_bytes(model.head) / head_tp * in_flight
            acts += (model.head.activation_bytes - model.head.cast_bytes) * mb / cp / \
                head_tp + head_casts
        ends = (i == 0) + (i == pp - 1)  # embedding on the first, LM head on the last
        extra = model.head.params / head_tp * (min(ends, 1) if model.tied_embeddings
                                               else ends / 2)
        n = sizes[i]
        layer_params = (model.dense.params * n * dense_share +
                        (model.moe.params * n * (1 - dense_share) if model.moe else 0.0)) / tp
        experts = model.moe.expert_params * n * (1 - dense_share) / (
            plan.ep * plan.expert_tp) if model.moe else 0.0
        # FSDP2's unsharded 16-bit copy held from forward to backward: ZeRO-2, replicate
        states = _states_total(layer_params + extra, nb, zero_dense, shard_group, pp > 1,
                               master, model.trained, fsdp2 and zero_dense < 3) + \
            _states_total(experts, nb, zero_experts, edp_shard, pp > 1, master,
                          model.trained_experts, zero_experts == 2)
        gathered = 0.0
        if zero_dense == 3 and pp == 1:  # (under PP the states hold them all: above)
            moe_layer = (model.moe.params / tp + (model.moe.expert_params / (
                plan.ep * plan.expert_tp) if zero_experts == 3 else 0.0)) \
                if model.moe and n_moe else 0.0
            gathered = fsdp_working_set(model.dense.params / tp if n_dense else 0.0,
                                        moe_layer, extra, nb, model.trained)
        return states + acts + gathered, states, acts, gathered

    fullest = max((stage_memory(i) for i in picks), key=lambda x: x[0])
    memory, states_total, activations, gathered = fullest
    if memory > capacity:  # the search drops it: its memory is all it needs
        return float(memory)
    # communication per microbatch and stage
    tp_stride = plan.stride("tp")
    # 4 per layer; recomputation repeats the forward's 2 (full: Megatron-LM SC'21 sec. 3;
    # selective: torchtitan's policy keeps reduce-scatter outputs, not all-gather ones)
    n_tp = 4 + 2 * rec_share + (2 * (1 - rec_share) if plan.selective_recompute and plan.sp
                                else 0.0)
    # (frozen-prefix layers: the forward's collectives only, throughout)
    tp_comm = ((dense_n + moe_n) * n_tp + frozen_n * 2) * _coll("all_reduce", act, tp,
                                                                cluster, tp_stride)
    moe_frozen = frozen_n * (1 - model.dense_layers / max(model.layers, 1))
    cp_comm = 0.0
    if cp > 1:
        qk = model.head_dim or h // model.heads  # head widths (MLA: 192 / 128)
        vd = model.v_head_dim or qk
        tokens_cp = mb * seq // cp * nb / tp  # bytes per head and width unit on a rank
        # the ring's K and V blocks: the executor repeats K/V to every query head first
        # (graphopt.parallel.context._ring; a review found them priced at the KV heads'
        # size: 4-8x low for GQA)
        kv = tokens_cp * model.heads * (qk + vd)
        if plan.cp_kind == "ring":
            rerun = rec_share + (1 - rec_share) * plan.selective_recompute
            # every rank sends at each of the cp - 1 steps; a step ends with its slowest
            # send, which crosses the widest level the ring spans (a ring over nodes: the
            # NIC, not NVLink; a review found 64 ranks on 8 nodes priced at NVLink speed)
            hop = _pair_stride(cp * plan.stride("cp"), cluster)
            ring = (3 + rerun) * (cp - 1) * _coll("p2p", kv, 2, cluster, hop)
            per_layer = max(0.0, ring - 0.5 * max(t_dense, t_moe))
            # the forward's cp - 1 sends under the forward's attention
            per_frozen = max(0.0, ring / (3 + rerun) - 0.5 * max(t_dense, t_moe) / 3)
        else:
            # q, k, v and the output in the forward, their gradients in the backward; full
            # recomputation runs the forward's 4 again (functional collectives). K and V
            # are the KV heads' share of q's size, or q's when the executor repeats them
            # (the KV heads per TP rank not divisible by cp: graphopt.parallel.context)
            kv_heads = model.kv_heads if (model.kv_heads // tp) % cp == 0 else model.heads
            stride = plan.stride("cp")
            per_frozen = sum(
                _coll("all_to_all", tokens_cp * heads * width, cp, cluster, stride)
                for heads, width in ((model.heads, qk), (model.heads, vd),  # q, output
                                     (kv_heads, qk), (kv_heads, vd)))       # k, v
            per_layer = (2 + rec_share) * per_frozen
        cp_comm = (dense_n + moe_n) * per_layer + frozen_n * per_frozen
    ep_comm = (moe_n + moe_frozen / 2) * _ep_comm(  # forward + backward, or the forward
        ep_tokens_per_rank(plan, moe_tokens), model.top_k, h, model.moe_ffn, nb, plan.ep,
        cluster, ep_ranks_per_node(plan, cluster.devices_per(0))) \
        if model.moe and plan.ep > 1 else 0.0
    if model.moe and plan.ep > 1:  # the EP op's TP collectives (docstring)
        tp_comm += (moe_n + moe_frozen / 2) * sum(
            _coll(kind, size, tp, cluster, tp_stride) for kind, size in
            ep_tp_collectives(plan, moe_tokens, h, model.top_k, nb))
    # the stages' sends run in lockstep, so the slowest hop sets the time: at the level of
    # the devices the whole pipeline spans (a pair at stride("pp") spans 2 x stride, one
    # node for tp=4, pp=4 on 8-device nodes, where the 4 -> 8 hop crosses nodes: priced
    # intra-node whatever the network's latency, a review)
    p2p = 2 * v * _coll("p2p", stream / tp, 2, cluster,
                        _pair_stride(pp * plan.stride("pp"), cluster)) if pp > 1 else 0.0
    slot = compute + tp_comm + cp_comm + ep_comm + p2p
    if (m + ramp) * slot > bound_s * (1 + 1e-9):  # the step without DP's exposed time,
        return None                               # a lower bound as well
    total = m * slot + ramp * slot
    bubble = ramp * slot
    # data parallel gradient / parameter traffic
    dense_params = (model.dense.params * model.dense_layers +
                    (model.moe.params * model.moe_layers if model.moe else 0.0)) / (tp * pp)
    # the embedding on the first stage, the LM head on the last: halves of head.params, or
    # with tied embeddings a full copy on each (one all-reduce of its gradient between them)
    tied = pp > 1 and model.tied_embeddings
    dense_params += model.head.params / head_tp / (2 if pp > 1 and not tied else 1)
    expert_params = (model.moe.expert_params * model.moe_layers / (pp * plan.ep *
                                                                    plan.expert_tp)
                     if model.moe else 0.0)
    # master weights: float32 gradients reduced; FSDP2 gathers 16-bit parameters, ZeRO-1
    # (ZeroRedundancyOptimizer) the updated float32 ones
    # (frozen parameters: FSDP2 gathers them, nothing reduces them, ZeRO-1 updates none)
    gb = 4 if master else nb

    def gather_bytes(params: float, zero_stage: int, trained: float) -> float:
        return (nb if zero_stage >= 2 else gb * trained) * params

    each, once = _dp_sync(gb * dense_params * model.trained, plan, m, shard_group,
                          zero_dense, dense_stride, cluster,
                          gathered=gather_bytes(dense_params, zero_dense, model.trained))
    e_each, e_once = _dp_sync(gb * expert_params * model.trained_experts, plan, m, edp_shard,
                              zero_experts, expert_stride, cluster,
                              hook=plan.ep > 1 and not zero_experts,
                              gathered=gather_bytes(expert_params, zero_experts,
                                                    model.trained_experts))
    each, once = each + e_each, once + e_once
    if tied:  # the two copies' gradients summed: first and last stage, whose span is
        # pp x stride (the pair priced at the level of that span, as the ring's hop above)
        once += _coll("all_reduce", gb * model.head.params / head_tp, 2, cluster,
                      _pair_stride(pp * plan.stride("pp"), cluster))
    # overlapped with the backwards (2/3 of the compute) of all m microbatches, also the
    # once-per-step reduction (which DDP's no_sync and Megatron-LM run in the last one's):
    # hiding that under the last backward only moved the Megatron-Core validation from
    # 2.3% / 6.3% (median / worst) to 2.0% / 19.4% and its fitted efficiency from 0.765 to
    # 0.825 (docs/planner.md), so the fitted window stays
    dp_time = m * each + once
    exposed_dp = max(0.0, dp_time - 2 / 3 * compute * m) if dp_overlap else dp_time
    total += exposed_dp
    at_peak = model.peak_s_per_sequence() * global_batch
    return Prediction(
        step_s=total, compute_s=compute * m, bubble_s=bubble,
        comm_s={"tp": tp_comm * m, "cp": cp_comm * m, "ep": ep_comm * m, "pp": p2p * m,
                "dp": exposed_dp},
        memory_bytes=memory,
        memory_parts={"params+grads+optimizer": states_total, "activations": activations,
                      "zero3_unsharded": gathered},
        mfu=at_peak / (total * plan.devices) if total > 0 else 0.0,
        tokens_per_s=global_batch * seq / total if total > 0 else math.inf)
