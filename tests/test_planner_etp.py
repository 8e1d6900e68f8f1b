"""The planner's price of tensor-parallel experts (expert_tp = tp) against what
graphopt.parallel executes: the EP op's collectives over TP, the all-to-all's rows and the
saved activations, measured on 4 gloo ranks (dp_shard=2 x tp=2, ep=2) with expert_tp 1 and 2;
and the search generates ETP plans with the executor's constraints."""

from __future__ import annotations

import collections

import pytest
import torch

from graphopt.distributed import run_distributed
from graphopt.planner.plan import ParallelPlan

BATCH, SEQ = 2, 64


def _step_worker(rank: int, world: int) -> dict[int, tuple[dict, int, int]]:
    """For expert_tp 1 and 2: (gloo collectives of one training step by (name, shape), rows
    sent by the all-to-alls, saved-activation bytes, the ranks of rank 0's EP group, and
    with every layer recomputed the bytes the checkpoint caches of graphopt's ops) on this
    rank, float32 Mixtral whose router sends token i to experts i mod E and i + 1 mod E
    (so any run of 4 consecutive tokens sends half of its routed copies to the other EP
    rank, the uniform routing the planner assumes)."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from graphopt.models import build_model
    from graphopt.parallel import build_mesh, parallelize
    from graphopt.parallel.mesh import expert_mesh

    router = type(build_model("mixtral").model.layers[0].mlp.gate)
    original = router.forward

    def forward(self, hidden_states):
        logits, scores, index = original(self, hidden_states)
        rows = torch.arange(index.shape[0])[:, None] + torch.arange(index.shape[1])
        return logits, scores, rows % logits.shape[-1]

    router.forward = forward
    out = {}
    for etp in (1, 2):
        torch.manual_seed(0)
        model = build_model("mixtral")
        plan = ParallelPlan(dp_shard=2, tp=2, ep=2, expert_tp=etp, zero_stage=0, sp=False)
        mesh = build_mesh(plan)
        parallelize(model, plan, mesh)
        group = dist.get_process_group_ranks(expert_mesh(mesh, plan)["ep"].get_group())
        model.train()
        ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # warm
        params = {getattr(p, "_local_tensor", p).untyped_storage().data_ptr()
                  for p in model.parameters()}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor, params=params, saved=saved) -> torch.Tensor:
            local = getattr(t, "_local_tensor", t)
            try:
                storage = local.untyped_storage()
                ptr = storage.data_ptr()
            except RuntimeError:  # a wrapper subclass (funcol's AsyncCollectiveTensor)
                saved[id(t)] = t.numel() * t.element_size()
                return t
            if ptr not in params:
                saved[ptr] = storage.nbytes()
            return t

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
        calls: collections.Counter = collections.Counter()
        sent = 0
        for event in prof.events():
            if event.name.startswith("gloo:") and event.input_shapes:
                shape = tuple(event.input_shapes[0])
                calls[(event.name, shape)] += 1
                if event.name == "gloo:send":
                    sent += shape[0]
        out[etp] = (dict(calls), sent, sum(saved.values()), group,
                    _recompute_cache(plan, ids))
    return out


def _recompute_cache(plan: ParallelPlan, ids: torch.Tensor) -> tuple[int, int]:
    """Bytes of graphopt ops' and of functional collectives' outputs the checkpoint caches
    (torch's selective checkpoint storage, unwrapped) after the forward of ``plan`` with
    every layer recomputed."""
    import dataclasses

    from torch.utils._pytree import tree_flatten

    import graphopt.planner.model as plan_model
    from graphopt.models import build_model
    from graphopt.parallel import build_mesh, parallelize

    contexts = []
    original = plan_model.selective_checkpoint_context

    def recorded(full: bool = False):
        forward, recompute = original(full)
        contexts.append(forward)
        return forward, recompute

    plan_model.selective_checkpoint_context = recorded
    try:
        model = build_model("mixtral")
        plan = dataclasses.replace(plan, recompute_layers=model.config.num_hidden_layers)
        parallelize(model, plan, build_mesh(plan))
        model.train()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        cached = [0, 0]
        for forward in contexts:
            for key, outputs in forward.storage.items():
                op = str(key[0] if isinstance(key, tuple) else key)
                leaves = [getattr(x, "val", x) for x in tree_flatten(outputs)[0]]
                size = sum(x.numel() * x.element_size() for x in leaves
                           if isinstance(x, torch.Tensor))
                cached[0 if op.startswith("graphopt.") else 1] += \
                    size if op.startswith(("graphopt.", "_c10d_functional.")) else 0
        loss.backward()
    finally:
        plan_model.selective_checkpoint_context = original
    assert contexts
    return cached[0], cached[1]


@pytest.fixture(scope="module")
def measured():
    return run_distributed(_step_worker, 4)


def _config():
    from graphopt.models import build_model

    config = build_model("mixtral").config
    return (config.num_hidden_layers, config.hidden_size, config.num_experts_per_tok,
            config.num_local_experts, config.intermediate_size)


def test_ep_op_collectives_over_tp_are_the_ones_the_planner_prices(measured):
    """Per MoE layer: expert_tp = 1 all-gathers [T/tp, h] twice and [T/tp, k] once;
    expert_tp = tp all-reduces [T, h] twice and [T, k] once (T: the TP group's tokens);
    every other collective is the same in both (the planner prices those alike)."""
    from graphopt.planner.perf import ep_tp_collectives

    layers, hidden, top_k, experts, ffn = _config()
    tokens = BATCH * SEQ
    name = {"all_gather": "gloo:all_gather", "all_reduce": "gloo:all_reduce"}
    for per_rank in measured:
        extra = {}
        for etp in (1, 2):
            calls = per_rank[etp][0]
            plan = ParallelPlan(dp_shard=2, tp=2, ep=2, expert_tp=etp)
            want: collections.Counter = collections.Counter()
            for kind, nbytes in ep_tp_collectives(plan, tokens, hidden, top_k, 4):
                # the gathered/reduced tensor's bytes; gloo's event shows this rank's input
                cols = hidden if nbytes == tokens * hidden * 4 else top_k
                rows = tokens // (2 if kind == "all_gather" else 1)
                want[(name[kind], (rows, cols))] += layers
            assert {k: calls.get(k, 0) for k in want} == dict(want), (etp, calls)
            extra[etp] = {k: v for k, v in calls.items() if k not in want}
        # expert_tp = 1: the experts' gradients are all-reduced over their data-parallel
        # group (edp_shard = dp_shard*cp*tp / ep = 2; ZeRO-0), one per weight and layer;
        # expert_tp = 2: edp_shard = 1, none (the planner's DP term prices both)
        local = experts // 2
        grads = {("gloo:all_reduce", (local, 2 * ffn, hidden)): layers,
                 ("gloo:all_reduce", (local, hidden, ffn)): layers}
        assert {k: extra[1].pop(k, 0) for k in grads} == grads, extra[1]
        assert not set(grads) & set(extra[2]), extra[2]
        assert _rest(extra[1]) == _rest(extra[2]), extra


def _rest(calls):
    """Collectives other than the all-to-all's sends and receives."""
    return {k: v for k, v in calls.items() if k[0] not in ("gloo:send", "gloo:recv")}


def test_all_to_all_carries_the_tp_groups_tokens_with_tensor_parallel_experts(measured):
    """The planner prices the all-to-all with mb*s/(cp*tp) tokens per rank for
    expert_tp = 1 and mb*s/cp (every TP rank dispatches all of its group's) for
    expert_tp = tp, each sending (ep-1)/ep of its k routed copies: with the uniform router,
    each rank's rows sent by the 4 all-to-alls of a layer (dispatch, combine; forward,
    backward) are exactly that."""
    from graphopt.planner.perf import ep_tokens_per_rank

    layers, _, top_k, _, _ = _config()
    for per_rank in measured:
        for etp in (1, 2):
            plan = ParallelPlan(dp_shard=2, tp=2, ep=2, expert_tp=etp)
            tokens = ep_tokens_per_rank(plan, BATCH * SEQ)
            assert per_rank[etp][1] == layers * 4 * tokens * top_k // 2, (etp, per_rank[etp][1])


def test_tensor_parallel_experts_saved_activations_match_the_planners_extra(measured):
    """The saved-activation bytes expert_tp = 2 adds over expert_tp = 1 per rank are the
    planner's etp_activation_bytes per MoE layer within 5% (measured: 1.006x)."""
    from graphopt.planner.perf import etp_activation_bytes

    layers, hidden, top_k, _, _ = _config()
    plan = ParallelPlan(dp_shard=2, tp=2, ep=2, expert_tp=2)
    want = layers * etp_activation_bytes(plan, BATCH * SEQ, hidden, top_k, 4)
    assert etp_activation_bytes(ParallelPlan(dp_shard=2, tp=2, ep=2), 128, 64, 2, 4) == 0
    for per_rank in measured:
        got = per_rank[2][2] - per_rank[1][2]
        assert abs(got / want - 1) < 0.05, (got, want)


def test_search_generates_tensor_parallel_experts_within_the_executors_rules():
    """ETP plans are searched (expert_tp = tp, ep dividing dp_shard x cp, ep x tp in a node,
    F divisible by tp) and priced: the same plan with expert_tp = tp sends tp x the
    all-to-all tokens and holds the experts' states over ep x tp."""
    from graphopt.cost.profiles import load_profile
    from graphopt.parallel.auto import not_executable
    from graphopt.planner.model import plan_model
    from graphopt.planner.perf import evaluate
    from graphopt.planner.search import candidates

    cluster = load_profile("h100-sxm")
    model = plan_model("mixtral-8x22b", 4096, cluster)
    node = cluster.devices_per(0)
    plans = list(candidates(model, 64, 64, node))
    etp = [p for p in plans if p.expert_tp > 1]
    assert etp and all(p.expert_tp == p.tp and (p.dp_shard * p.cp) % p.ep == 0 and
                       node % (p.ep * p.tp) == 0 and model.moe_ffn % p.tp == 0 and
                       not not_executable(p) for p in etp)
    assert {(p.tp, p.ep) for p in etp} >= {(2, 2), (2, 4), (4, 2)}
    base = ParallelPlan(dp_shard=16, tp=4, ep=2, zero_stage=2)
    with_etp = ParallelPlan(dp_shard=16, tp=4, ep=2, expert_tp=4, zero_stage=2)
    one, four = (evaluate(p, model, cluster, 64) for p in (base, with_etp))
    assert four.comm_s["ep"] > 3 * one.comm_s["ep"]
    # ZeRO-2 keeps whole parameters: a rank holds 1/(ep x expert_tp) of the experts'
    assert four.memory_parts["params+grads+optimizer"] < \
        0.6 * one.memory_parts["params+grads+optimizer"]
    assert four.memory_parts["activations"] > one.memory_parts["activations"]
    assert "expert_tp=4" in with_etp.describe()


def test_ep_groups_are_placed_as_the_planner_prices_them(measured):
    """The planner's EP group (ep_group_devices) is the executor's (rank 0's group: [0, 1]
    with expert_tp = 1, the TP pair; [0, 2] with expert_tp = 2, across dp_shard); a group
    tp devices apart spans more nodes, and its all-to-all is priced over them (Mixtral
    8x22B, 8-device nodes: ep=8 with expert_tp=2 and cp=2 puts 4 EP ranks per node)."""
    from graphopt.cost.profiles import load_profile
    from graphopt.planner.model import plan_model
    from graphopt.planner.perf import ep_group_devices, ep_ranks_per_node, evaluate

    for etp in (1, 2):
        plan = ParallelPlan(dp_shard=2, tp=2, ep=2, expert_tp=etp)
        assert measured[0][etp][3] == ep_group_devices(plan), (etp, measured[0][etp][3])
    spread = ParallelPlan(dp_shard=64, tp=2, cp=2, ep=8, expert_tp=2, zero_stage=2)
    packed = ParallelPlan(dp_shard=64, tp=2, cp=2, ep=8, zero_stage=2)
    assert ep_group_devices(spread) == [0, 2, 4, 6, 8, 10, 12, 14]
    assert ep_ranks_per_node(spread, 8) == 4 and ep_ranks_per_node(packed, 8) == 8
    cluster = load_profile("h100-sxm")
    model = plan_model("mixtral-8x22b", 4096, cluster)
    # 2 x the tokens per rank (expert_tp = 2), and over two nodes: more than 2 x
    ratio = evaluate(spread, model, cluster, 1024).comm_s["ep"] / \
        evaluate(packed, model, cluster, 1024).comm_s["ep"]
    assert ratio > 4, ratio


def test_recomputed_moe_layers_hold_the_ep_ops_cache_the_planner_prices(measured):
    """A fully recomputed MoE layer keeps what the checkpoint caches of graphopt's ops that
    communicate (saved, not run again): the EP op's outputs and its TP row split or region
    mappings, ep_recompute_cache_bytes per layer under the uniform router (and 0 without
    EP); TP's functional collectives are run again, as the planner prices them (their
    outputs were cached: 2 x [T, H] per layer here)."""
    from graphopt.planner.perf import ep_recompute_cache_bytes

    layers, hidden, top_k, _, ffn = _config()
    assert ep_recompute_cache_bytes(ParallelPlan(tp=2), 128, 64, 128, 2, 4) == 0
    for per_rank in measured:
        for etp in (1, 2):
            plan = ParallelPlan(dp_shard=2, tp=2, ep=2, expert_tp=etp)
            want = layers * ep_recompute_cache_bytes(plan, BATCH * SEQ, hidden, ffn, top_k, 4)
            graphopt_bytes, collective_bytes = per_rank[etp][4]
            assert graphopt_bytes > 0 and abs(graphopt_bytes / want - 1) < 0.02, \
                (etp, graphopt_bytes, want)
            assert collective_bytes == 0, collective_bytes
