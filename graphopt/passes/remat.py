"""remat: keep, recompute or offload each saved activation under a memory budget (an ILP).

For every forward value the backward needs, choose keep (save) or recompute (or offload),
under a memory budget for saved activations, minimizing the predicted recomputation time.

Decision model (an ILP in the spirit of Checkmate, Jain et al. MLSys 2020, restricted to one
recomputation in the backward; built by :func:`build_ilp`, solved by scipy's HiGHS MILP):

    variables   s_v in {0,1}: v is saved;  r_v in {0,1}: v is recomputed in the backward,
                for every forward node v of the joint graph (forward and backward as the
                partitioner classifies them, after its CSE: :func:`split_as_partitioned`)
    minimize    sum_v r_v * t_v                        t_v: cost-model time of node v
    subject to  s_v + r_v >= 1        for v used by the backward          (:func:`_needed`)
                s_u + r_u >= r_v      for every forward input u of v       (recompute closure)
                sum_v s_v * b_v + r_v * g_v <= B  b_v: bytes of v's own storage, g_v: the
                         RNG state saved to recompute a seeded op (:func:`rng_state_bytes`),
                         B: the budget
                r_v = 0  for random ops (dropout: recomputing would draw new numbers), ops
                         with side effects, other libraries' custom ops (their schema does
                         not say whether they draw random numbers), higher-order ops whose
                         bodies hold any of these, and values
                         read from an input the graph mutates in place (BatchNorm's running
                         statistics, a buffer updated in forward: the backward would read
                         the updated input)
                s_v = 0  for views (they are recomputed from their base for free)

With ``offload=True`` a third variable o_v per value (a host copy saved instead of v, copied
back in the backward): it satisfies "needed", costs 2 (b_v / host bandwidth + overhead) and
uses no device memory; and a fourth, q_w for views only: w is rebuilt in the backward on the
copy of its offloaded base (through a chain of views: q_w <= o_u + q_u for w's input u). q_w
satisfies "needed" only: recomputation never reads a view through q (s_u + r_u >= r_v
holds for every input), since the partitioner would rebuild such a view from the base on
the device and so keep the base saved there (a review measured 2-10x the budget saved when
recomputed ops read views of offloaded values).

Sizes: static shapes are exact; backed symbolic sizes use the shape environment's hint;
data-dependent (unbacked) sizes use 64, or, with ``profile_guided=True``, the values
observed by running the graph once on the real inputs (:func:`observe_sizes`; MegTaiChi,
"tensor access pattern observed at run time"), with a report of how the decision changed.

Primal inputs (parameters, user inputs) are available in the backward as they were in the
forward, except those the graph mutates (above); an input that is not a parameter (after a
graph break, another graph's activation) costs its bytes when the plan holds it only to
recompute from it (h_p >= r_v, in the budget row: :func:`non_parameter_inputs`). "greedy" (for
very large graphs, or when the ILP exceeds ``time_limit``): recompute the candidates with
the most bytes per second of recomputation whose inputs are already available, until under
budget.

The decision is applied by tagging every forward node with
``torch.utils.checkpoint.CheckpointPolicy`` (MUST_SAVE / MUST_RECOMPUTE) and partitioning with
``torch._functorch.partitioners.min_cut_rematerialization_partition``, which honors the tags
(the same mechanism as PyTorch's selective activation checkpointing).

Contract:
    accepts: a joint forward+backward graph (AOTAutograd), stage "joint".
    guarantees: exact (recomputation repeats the same deterministic ops).
    respects: nodes already tagged by user code (torch.utils.checkpoint regions, selective
        activation checkpointing policies) keep their save/recompute choice (fixed in the
        ILP; a "kept" site says how many).
    records: per saved value "kept" (bytes, what recomputing would cost), per recomputed or
        offloaded value "rewritten" (bytes, predicted recompute time), and
        a summary site (budget, what PyTorch's partition saves without remat, keep-all
        bytes, saved bytes, solver, status); "kept" alone when the budget covers what that
        partition saves (nothing is tagged then: B, as a fraction, is a fraction of it, as
        torch's ``activation_memory_budget``); "skipped" with
        the least bytes any plan saves when the budget is infeasible (the ILP's minimum, then
        the fastest plan within it; greedy's least when the ILP runs out of time, and the
        report says so), or "kept" when that is not below PyTorch's partition (which then
        runs untagged).
"""

from __future__ import annotations

import contextlib
import math
import operator
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from graphopt.cost.profiles import default_profile_name, load_profile
from graphopt.passes import register_pass
from graphopt.passes.base import GraphPass, PassContext, PassResult
from graphopt.passes.fx_utils import (
    communicates,
    fake_call,
    is_foreign_op,
    is_mutating,
    is_random,
    random_ops_kept,
    readers_of_mutated_inputs,
    returns_alias,
    site_name,
)
from graphopt.passes.remat_options import RematOptions

aten = torch.ops.aten


@dataclass
class RematPlan:
    """The decision: which forward nodes are saved and which recomputed."""

    saved: set[fx.Node]
    recomputed: set[fx.Node]
    saved_bytes: int
    recompute_s: float
    solver: str
    status: str
    offloaded: set[fx.Node] = field(default_factory=set)
    device_kind: str = "gpu"
    times: dict[str, float] = field(default_factory=dict)
    ilp_infeasible: bool = False
    """No plan meets the budget as far as the ILP knows: it proved the budget infeasible
    (the plan then saves the least any plan does) or ran out of time and greedy ran."""
    held_inputs: list[fx.Node] = field(default_factory=list)
    """Graph inputs that are not parameters the backward holds to recompute from
    (:func:`held_inputs`; their bytes are in ``saved_bytes``)."""


_UNBACKED_HINT = 64  # sizes that depend on data (MoE token counts): a typical value
_OBSERVED: dict[Any, int] = {}  # symbol -> size seen in a real run (profile-guided mode)
_BACKED: dict[Any, int] = {}  # symbol -> the shape environment's hint (backed sizes)


def _concrete(x: Any) -> float:
    """A number for a possibly symbolic size or cost: sizes observed in a real run
    (profile-guided mode), else the shape environment's hint for backed symbols and
    ``_UNBACKED_HINT`` for data-dependent ones."""
    if isinstance(x, (int, float)):
        return float(x)
    import sympy

    if isinstance(x, (torch.SymInt, torch.SymFloat)):
        expr = sympy.sympify(x.node.expr)
        if isinstance(x, torch.SymInt) and not (expr.free_symbols & set(_OBSERVED)):
            from torch.fx.experimental.symbolic_shapes import optimization_hint

            return float(optimization_hint(x, fallback=_UNBACKED_HINT))
    else:
        expr = sympy.sympify(x)
    # a cost expression's backed symbols take their hints too: all at 64 made a dynamic
    # ZeRO-3 graph's (32 // s19) zero and then divided by it (a review: ZeroDivisionError)
    return float(expr.xreplace({s: _OBSERVED.get(s, _BACKED.get(s, _UNBACKED_HINT))
                                for s in expr.free_symbols}))


def observe_sizes(gm: fx.GraphModule, example_inputs: list[Any]) -> dict[Any, int]:
    """Run ``gm`` (a pre-autograd graph) once on copies of the real inputs and return the
    value of every symbolic size its outputs had (the data-dependent token counts of MoE
    routing, for example): the profile-guided mode's observation (MegTaiChi's idea of
    deciding from the access pattern seen at run time)."""
    import sympy

    observed: dict[Any, int] = {}

    class Observer(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            metas = torch.utils._pytree.tree_leaves(n.meta.get("val"))
            reals = torch.utils._pytree.tree_leaves(out)
            for meta, real in zip(metas, reals):
                if isinstance(meta, torch.Tensor) and isinstance(real, torch.Tensor):
                    for dim, size in zip(meta.shape, real.shape):
                        if isinstance(dim, torch.SymInt):
                            expr = sympy.sympify(dim.node.expr)
                            if expr.is_Symbol:
                                observed.setdefault(expr, int(size))
            return out

    from graphopt.passes.fx_utils import size_hint

    # a dynamic-shape compile's size inputs are SymInts: their values at these inputs (a
    # review: a dynamic batch raised "SymIntArrayRef expected to contain only concrete
    # integers" in the first view); a size without one leaves the observation empty
    hints = [size_hint(x) if isinstance(x, torch.SymInt) else 0 for x in example_inputs]
    if None in hints:
        return observed
    inputs = [x.detach().clone() if isinstance(x, torch.Tensor) else
              hint if isinstance(x, torch.SymInt) else x
              for x, hint in zip(example_inputs, hints)]
    with torch.no_grad():
        Observer(gm).run(*inputs)
    return observed


def _bytes(node: fx.Node) -> int:
    total = 0.0
    for leaf in torch.utils._pytree.tree_leaves(node.meta.get("val")):
        if isinstance(leaf, torch.Tensor):
            total += _concrete(leaf.numel()) * leaf.element_size()
    return int(total)


def _symbols(x: Any) -> set[Any]:
    import sympy

    return set(sympy.sympify(x.node.expr).free_symbols) if isinstance(x, torch.SymInt) \
        else set()


def _bytes_scaled(node: fx.Node, scale: float) -> int:
    """:func:`_bytes` with every symbolic size at ``scale`` times its value here."""
    import sympy

    total = 0.0
    for leaf in torch.utils._pytree.tree_leaves(node.meta.get("val")):
        if isinstance(leaf, torch.Tensor):
            numel = leaf.numel()
            if isinstance(numel, torch.SymInt):
                expr = sympy.sympify(numel.node.expr)
                numel = expr.xreplace({s: scale * _hint(s) for s in expr.free_symbols})
            total += float(numel) * leaf.element_size()
    return int(total)


def _hint(symbol: Any) -> int:
    return _OBSERVED.get(symbol, _BACKED.get(symbol, _UNBACKED_HINT))


def dynamic_sizes_note(forward: list[fx.Node], decision: RematPlan | None,
                       bytes_budget: bool) -> str:
    """For a graph with symbolic sizes (``dynamic=True``, or a recompile that made them
    dynamic), what the plan promises: it is priced at this compile's sizes, and the same
    plan runs at every size, so what it saves grows with them (a review: a 100,000-byte
    budget held at the planned length 32 saved 7.5x the budget at 256; a 0.3 fraction
    1.21x of 30% of no remat there, values growing at different rates). "" for static
    sizes."""
    symbols = sorted({s for v in forward for leaf in torch.utils._pytree.tree_leaves(
        v.meta.get("val")) if isinstance(leaf, torch.Tensor) for d in leaf.shape
        for s in _symbols(d)}, key=str)
    if not symbols:
        return ""
    sizes = ", ".join(f"{s}={_hint(s)}" for s in symbols)
    note = (f"; dynamic sizes ({sizes}): planned at these sizes, and the same plan runs at "
            "every size")
    if decision is not None:
        constant = decision.saved_bytes - sum(_bytes(v) for v in decision.saved) - sum(
            _bytes(p) for p in decision.held_inputs)  # generator states
        twice = constant + sum(_bytes_scaled(v, 2) for v in decision.saved) + sum(
            _bytes_scaled(p, 2) for p in decision.held_inputs)
        note += f", saving about {twice} bytes at twice each"
    return note + (": a byte budget holds at these sizes only" if bytes_budget else
                   ": the fraction is of no remat at these sizes, and drifts elsewhere")


def _is_view(node: fx.Node) -> bool:
    """A view op, or a piece of one (``getitem`` of ``split``/``chunk``/``unbind``): saving a
    piece keeps its whole base alive (a review: pieces priced at their own size and saved
    alone, the claim 229,376 bytes where autograd held 360,448), so it is rebuilt from its
    saved base, which is priced whole."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return returns_alias(node.args[0])
    return returns_alias(node)


def _is_tuple(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (tuple, list))


def split_joint(gm: fx.GraphModule) -> tuple[list[fx.Node], set[fx.Node]]:
    """(forward call_function nodes in order, backward nodes): backward = everything that
    depends on a tangent input."""
    backward: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" and "tangent" in node.name:
            backward.add(node)
        elif node.op == "call_function" and any(a in backward for a in node.all_input_nodes):
            backward.add(node)
    forward = [n for n in gm.graph.nodes if n.op == "call_function" and n not in backward]
    return forward, backward


def split_as_partitioned(gm: fx.GraphModule) -> tuple[list[fx.Node], set[fx.Node]]:
    """(forward, backward) as PyTorch's min-cut partitioner classifies the joint graph
    (``classify_nodes``): forward = the call_function nodes the forward outputs need (its
    ``required_fw_nodes``); backward = every other node the graph computes, tangent inputs
    included: what depends on a tangent, and what only the backward needs ("unclaimed":
    e.g. RMSNorm's ``2 * x`` of its gradient formula), which the partitioner computes in the
    backward from saved forward values. A MUST_SAVE tag on such a node does nothing (the
    partitioner bans recomputation of required forward nodes only): pricing them as saved,
    a plan claimed 27-29% more saved bytes than the partition kept on a 4-layer Llama, and
    recomputed more than its budget needed. Without the partitioner's arguments in the
    meta (:data:`graphopt.lowering.base.PARTITION_ARGS`): :func:`split_joint`."""
    from graphopt.lowering.base import PARTITION_ARGS

    args = gm.meta.get(PARTITION_ARGS)
    count = args[1].get("num_fwd_outputs") if args is not None else None
    if not isinstance(count, int):
        return split_joint(gm)
    outputs: Any = gm.graph.output_node().args[0]
    required: set[fx.Node] = set()
    stack = [o for o in outputs[:count] if isinstance(o, fx.Node)]
    while stack:
        node = stack.pop()
        if node in required or node.op == "placeholder":
            continue
        required.add(node)
        stack.extend(node.all_input_nodes)
    for node in gm.graph.nodes:  # every element of a forward op's tuple (dropout's mask:
        # only the backward reads it, but it comes from the forward's draw)
        if node.target is operator.getitem and node.args[0] in required:
            required.add(node)
    forward = [n for n in gm.graph.nodes if n.op == "call_function" and n in required]
    backward = {n for n in gm.graph.nodes
                if (n.op == "call_function" and n not in required)
                or (n.op == "placeholder" and "tangent" in n.name)}
    return forward, backward


def non_parameter_inputs(gm: fx.GraphModule, backward: set[fx.Node]
                      ) -> tuple[list[fx.Node], list[fx.Node]]:
    """(priced, read_by_backward): the joint graph's tensor inputs that are not parameters
    (marked by the lowering: :data:`graphopt.lowering.base.NOT_A_PARAMETER`): the
    batch, buffers, and after a graph break the previous graph's activations, which the
    backward keeps alive if it holds them (PyTorch's min-cut partitioner prices such
    inputs by size too). ``read_by_backward``: a backward op that depends on a tangent
    reads them, so every partition holds them (outside the budget, reported); ``priced``:
    the others, held when the plan recomputes a value that reads them (inside the budget).
    An input only tangent-free backward ops read (a clamp's mask of it) is priced: the
    min-cut computes such an op in the forward unless the input is held anyway (filed as
    read, a plan recomputed from it and held 65,536 bytes where PyTorch's partition held
    40,960, while reporting 0: a review). Left free before, remat recomputed ``h.float()``
    from a float64 input and held 393,216 bytes while claiming 131,072. Parameters are
    free: they live on anyway. ``backward``: :func:`split_as_partitioned`'s."""
    from graphopt.lowering.base import NOT_A_PARAMETER

    tangent_side = split_joint(gm)[1]

    def read_by_tangent_side(p: fx.Node) -> bool:
        # directly or through views (x.t() for x's weight gradient: a view the backward
        # reads holds x's storage; filed as priced, x went uncounted in the plan while
        # PyTorch's partition counted it, and "50%" of that baseline saved more than no
        # remat, a review)
        stack, seen = [p], {p}
        while stack:
            for u in stack.pop().users:
                if u in tangent_side:
                    return True
                if _is_view(u) and u not in seen:
                    seen.add(u)
                    stack.append(u)
        return False

    priced: list[fx.Node] = []
    read: list[fx.Node] = []
    for p in gm.graph.find_nodes(op="placeholder"):
        if p.meta.get(NOT_A_PARAMETER) and _bytes(p) and p not in backward:
            (read if read_by_tangent_side(p) else priced).append(p)
    return priced, read


def _snapshot_held_inputs(gm: fx.GraphModule, decision: RematPlan) -> list[fx.Node]:
    """The recomputed values read a forward-time copy of each held input (``clone``, saved:
    its bytes are what the plan priced for holding the input), not the input: the caller
    may write the input between forward and backward (a buffer updated by ``.data``, an
    in-place ``add_``), which eager, saving the values computed from it, does not see. A
    review: remat recomputed ``outer(buf, buf)`` from a ``buf`` written through ``.data``
    after the forward (gradients -347 vs 567), and raised autograd's in-place error for a
    plain ``buf.add_(1)`` that eager runs."""
    from torch.utils.checkpoint import CheckpointPolicy

    # (held_inputs: the non-parameter inputs a recomputed value reads, those a backward
    # op reads anyway, ``* buf``, included: their recomputed readers read the copy all the
    # same, a re-review: recomputed from the changed input, 85 off; parameters are not
    # copied: the model's weights change between forward and backward for no one)
    readers = decision.held_inputs
    if not readers:
        return []
    graph = gm.graph
    last = list(graph.find_nodes(op="placeholder"))[-1]
    for p in reversed(readers):
        with graph.inserting_after(last):
            copy = graph.call_function(aten.clone.default, (p,))
        copy.meta["val"] = fake_call(aten.clone.default, p)
        copy.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        for user in [u for u in p.users if u in decision.recomputed]:
            user.replace_input_with(p, copy)
    return readers


def held_inputs(priced: list[fx.Node], recomputed: set[fx.Node]) -> list[fx.Node]:
    """The ``priced`` inputs (:func:`non_parameter_inputs`' both lists, in the plan) whose
    forward-time copies the backward holds because it recomputes a value that reads them
    (:func:`_snapshot_held_inputs`)."""
    return [p for p in priced if any(u in recomputed for u in p.users)]


def _needed(forward: list[fx.Node], backward: set[fx.Node]) -> list[fx.Node]:
    fwd = set(forward)
    return [n for n in forward if any(u in backward for u in n.users) and n in fwd]


OFFLOADED = "graphopt_remat_offloaded"
"""Joint-graph meta set by the remat pass: {offloaded node name: bytes}; read after the
partition by :func:`offloads_kept_on_device`."""


def offloads_kept_on_device(joint: fx.GraphModule, forward: fx.GraphModule) -> str:
    """A report note when the partitioned ``forward`` still saves values the remat pass
    offloaded (torch's partitioner moved their host copies into the backward and kept the
    values on the device: seen when it recomputes, from an offloaded value, a tangent-free
    op the ILP left to it); "" when every offload holds.

    The plan's saved bytes then understate the device memory by the bytes named here; a
    review measured 1.4-7.8x the budget on Llama/Mistral/Gemma2 RMSNorms."""
    offloaded = joint.meta.get(OFFLOADED) or {}
    out = next(iter(forward.graph.find_nodes(op="output")), None)
    if not offloaded or out is None:
        return ""

    def names(node: fx.Node) -> set[str]:
        return {n.name for n in torch.utils._pytree.tree_leaves(node.args)
                if isinstance(n, fx.Node)}

    returned = set().union(*(names(o) for o in joint.graph.find_nodes(op="output")))
    kept = {name for name in names(out) if name in offloaded and name not in returned}
    if not kept:
        return ""
    total = sum(offloaded[name] for name in kept)
    return (f"remat: {len(kept)} of {len(offloaded)} offloaded values ({total} bytes: "
            f"{', '.join(sorted(kept)[:4])}) stay saved on the device too: torch's partitioner "
            "recomputes their host copies in the backward; the device holds that much more "
            "than the plan's saved bytes (without offload the plan recomputes instead and the "
            "budget holds)")


REMAT_CLAIM = "graphopt_remat_claim"
"""Joint-graph meta set by the remat pass when it tags a plan: (saved bytes it claims,
budget, names of the graph inputs the backward reads itself: outside the budget); read
after the partition by :func:`partition_claim_note`."""


def partition_claim_note(joint: fx.GraphModule, forward: fx.GraphModule,
                         num_fwd_outputs: Any) -> str:
    """A report note when the partitioned ``forward`` saves more activation bytes than the
    remat plan claimed (the partitioner chose otherwise than the plan modeled); "" when the
    claim holds. Counted as the plan counts: every saved storage once, graph inputs that are
    not parameters unless the backward reads them itself (outside the budget), without the
    pre-mutation copies and offloaded values other notes name."""
    from graphopt.lowering.base import NOT_A_PARAMETER, PRE_MUTATION_COPIES

    claim = joint.meta.get(REMAT_CLAIM)
    out = next(iter(forward.graph.find_nodes(op="output")), None)
    if claim is None or out is None or not isinstance(num_fwd_outputs, int):
        return ""
    claimed, budget, outside = claim
    priced = {p.name for p in joint.graph.find_nodes(op="placeholder")
              if p.meta.get(NOT_A_PARAMETER) and p.name not in outside}
    offloaded = joint.meta.get(OFFLOADED) or {}
    primals = {_storage(t) for p in forward.graph.find_nodes(op="placeholder")
               if p.name not in priced for t in torch.utils._pytree.tree_leaves(
                   p.meta.get("val")) if isinstance(t, torch.Tensor)}  # their views: free
    saved = [v for v in out.args[0][num_fwd_outputs:] if isinstance(v, fx.Node) and not (
        v.name in offloaded or (v.op == "placeholder" and v.name not in priced)
        or v.target is torch.ops.prims.device_put.default)]  # an offload's host copy
    held = _storage_bytes(saved, primals) - sum(
        (forward.meta.get(PRE_MUTATION_COPIES) or {}).values())
    if held <= claimed + max(256, claimed // 100):
        return ""
    return (f"remat: the partition saves {held} bytes of activations where the plan claimed "
            f"{claimed} ({held - claimed} more: torch's partitioner kept values the plan "
            "counted as recomputed)" + (f"; over the budget of {budget} bytes"
                                        if held > budget >= claimed else ""))


READS_MUTATED_INPUT = "graphopt_reads_mutated_input"
"""Node meta set by :func:`plan` on values read from an input the graph mutates in place
(``fx_utils.readers_of_mutated_inputs``): recomputing them would read the updated input."""


def rng_state_bytes(node: fx.Node) -> int:
    """Bytes PyTorch's partitioner saves when it recomputes ``node``: ops tagged
    ``nondeterministic_seeded`` (SDPA kernels, which take a dropout probability, even at
    0) are recomputed from a saved RNG state (``functionalize_rng_ops``): the generator
    state of the op's device, 5,056 bytes on CPU, a seed and an offset (16 bytes) on CUDA.
    0 for other ops. Unpriced, a plan that recomputed a 4-layer Llama's attention saved
    20 KB (2% of its budget) more than it said."""
    target = node.target
    if not (isinstance(target, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded in target.tags):
        return 0
    device = next((t.device for t in torch.utils._pytree.tree_leaves(node.meta.get("val"))
                   if isinstance(t, torch.Tensor)), None)
    if device is not None and device.type == "cpu":
        return int(torch.get_rng_state().numel())
    return 16


def regenerated(node: fx.Node) -> bool:
    """A random op (native_dropout) the user's checkpoint region tags "recompute": PyTorch's
    partitioner recomputes it, tuple elements included, from a saved generator state
    (:func:`rng_state_bytes`) whatever a plan tags its elements, so the plans price it as
    recomputed (a review: priced as its saved outputs, the ILP called every budget below
    1.0 infeasible on a checkpointed Llama with attention dropout, its "least any plan
    saves" 197,152 bytes where the applied plan held 59,808). Only ops with several outputs:
    a plan's tags land on their tuple elements, which the partitioner does not read back to
    the op; a one-output random op (``rand`` of a drop-path mask, ``randint``) follows the
    plan's MUST_SAVE, and saving its few bytes beats a 5,056-byte state (a re-review: forced
    to recompute, plans held 2.1x more and called the budget infeasible)."""
    return _is_tuple(node) and user_policy(node) == "recompute" and \
        bool(rng_state_bytes(node))


def _unsafe_to_recompute(node: fx.Node) -> bool:
    target = node.target
    if regenerated(node) and not _has_opaque_inputs(node.graph):
        return False
    if is_random(node) or is_mutating(node) or node.meta.get(READS_MUTATED_INPUT) or \
            communicates(target, node.args):  # (the EP op: a review saw ranks disagree
        return True  # on recomputing it and hang, and each recompute repeat its all-to-alls)
    if target is operator.getitem and isinstance(node.args[0], fx.Node):
        return _unsafe_to_recompute(node.args[0])  # an element of a random op's tuple
        # (native_dropout's output in a user checkpoint region: its "recompute" tag made
        # the ILP infeasible at every budget, found by a review)
    if isinstance(target, torch._ops.HigherOrderOperator):  # its body's ops decide (a
        # review: an invoke_subgraph call with dropout inside was recomputed, 2e-3 off)
        found = [getattr(node.graph.owning_module, str(a.target), None) for a in node.args
                 if isinstance(a, fx.Node) and a.op == "get_attr"]
        bodies = [b for b in found if isinstance(b, fx.GraphModule)]
        return not bodies or any(_unsafe_to_recompute(n) for b in bodies
                                 for n in b.graph.nodes if n.op == "call_function")
    if rng_state_bytes(node) and _has_opaque_inputs(node.graph):
        return True
    if isinstance(target, torch._ops.OpOverload):
        if is_foreign_op(target):
            return True
        if target._schema.name.startswith("aten::_local_scalar") or "nonzero" in \
                target._schema.name:
            return True  # data-dependent sizes
    return False


def _has_opaque_inputs(graph: fx.Graph) -> bool:
    """Whether ``graph`` takes an opaque (script) object, as a TP plan's layer graph takes
    its DeviceMesh. torch 2.13's partitioner saves the RNG state of a recomputed seeded op
    (SDPA) after such saved objects, where the runtime expects tensors only: every remat
    budget that recomputed attention under tp=2 failed the first forward with
    "expected all tensors_saved_with_vc_check to be Tensors" (a review). Seeded ops are
    not recomputed in such graphs."""
    from torch._functorch._aot_autograd.graph_compile import is_opaque_node

    return any(is_opaque_node(n) for n in graph.find_nodes(op="placeholder"))


def _record_user_regions(ctx: PassContext, user: list[fx.Node]) -> None:
    if user:
        ctx.record("kept", "user checkpoint regions",
                   f"{len(user)} values tagged by torch.utils.checkpoint / selective "
                   "checkpointing keep the user's save/recompute choice; graphopt decides "
                   "the rest")


def _partitioner_cse(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` after the common-subexpression elimination PyTorch's min-cut partitioner runs
    first (``torch._functorch.compile_utils.fx_graph_cse``, when functorch's ``cse`` config
    is on, as by default), as a new GraphModule with ``gm``'s meta; ``gm`` itself otherwise.
    The plan then prices the values the partition will see: on a 4-layer Llama the four
    layers' float masks SDPA's decomposition builds (identical ``where`` nodes) were four
    saved values to the ILP and one after the partitioner merged them; a quarter to a third
    of the bytes the plan said it saved were such twins, so it recomputed more than its
    budget needed."""
    from torch._functorch import config as functorch_config
    from torch._functorch.compile_utils import fx_graph_cse

    if not functorch_config.cse:
        return gm
    with random_ops_kept(gm.graph):
        merged = fx.GraphModule(gm, fx_graph_cse(gm.graph))
    merged.meta.update(gm.meta)
    return merged


def _partitioner_bytes(gm: fx.GraphModule, cse_done: bool = False,
                       priced: list[fx.Node] | None = None) -> int | None:
    """Activation bytes PyTorch's min-cut partitioner saves for ``gm`` without remat's tags,
    with the ``priced`` inputs it saves (:func:`non_parameter_inputs`); None when the lowering
    did not record its partitioner call."""
    from graphopt.lowering.base import partitioner_saved

    saved = partitioner_saved(gm, cse_done)
    if saved is None:
        return None
    names = {p.name for p in priced or []}
    primals = {_storage(t) for n in gm.graph.nodes
               if n.op == "placeholder" and n.name not in names
               for t in torch.utils._pytree.tree_leaves(n.meta.get("val"))
               if isinstance(t, torch.Tensor)}
    return _storage_bytes([v for v in saved if v.op != "placeholder" or v.name in names],
                          primals)


def _storage_bytes(saved: list[fx.Node], primals: set[Any]) -> int:
    """Bytes the ``saved`` values keep alive: one entry per storage, all of it (autograd
    keeps a saved view's whole storage alive: q, k, v split from one projection; a review
    found the largest view counted, 2.9x low); views of a storage in ``primals`` (a
    weight's transpose) add nothing."""
    sizes: dict[Any, float] = {}
    for v in saved:
        for t in torch.utils._pytree.tree_leaves(v.meta.get("val")):
            if isinstance(t, torch.Tensor) and _storage(t) not in primals:
                sizes[_storage(t)] = max(sizes.get(_storage(t), 0.0),
                                         _concrete(t.untyped_storage().nbytes()),
                                         _concrete(t.numel()) * t.element_size())
    return int(sum(sizes.values()))


def _storage(t: torch.Tensor) -> Any:
    return StorageWeakRef(t.untyped_storage())


def _node_times(gm: fx.GraphModule, device: Any) -> dict[str, float]:
    from graphopt.cost.graph_cost import graph_cost

    return {c.name: _concrete(c.time_s) for c in graph_cost(gm, device).nodes}


def user_policy(node: fx.Node) -> str | None:
    """"recompute" / "save" when user code (torch.utils.checkpoint, selective activation
    checkpointing) already tagged the node; None otherwise. As torch's partitioner reads
    the tags (``cleanup_recompute_tags``): a recompute-tagged value that a later region's
    recompute-tagged op reads (two checkpointed layers back to back: the hidden state
    between them), or that carries a backward hook and feeds no recomputed op, is saved
    (a review: the plan counted such layer-boundary states as recomputed, and a Llama with
    gradient checkpointing held 51,456 bytes against a claim of 31,488)."""
    tag = _recompute_tag(node)
    if tag == "recompute":
        region = node.meta.get("ac_graph_id")
        if region is not None and any(
                _recompute_tag(u) == "recompute" and u.meta.get("ac_graph_id") is not None
                and u.meta["ac_graph_id"] > region for u in node.users):
            return "save"
        if node.meta.get("has_backward_hook", False) and not any(
                _recompute_tag(u) == "recompute" for u in node.users):
            return "save"
    return tag


def _recompute_tag(node: fx.Node) -> str | None:
    from torch.utils.checkpoint import CheckpointPolicy

    tag = node.meta.get("recompute")
    if tag in (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE):
        return "recompute"
    if tag in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE):
        return "save"
    return None


def build_ilp(forward: list[fx.Node], needed: list[fx.Node], times: dict[str, float],
              budget: int, offload_cost: dict[fx.Node, float] | None = None,
              inputs: list[fx.Node] | None = None) -> tuple[Any, ...]:
    """(c, constraints, integrality, bounds, index, blocks) of the MILP in the module
    docstring; ``blocks`` is 2 (save, recompute) or 4 (+ offload, priced by
    ``offload_cost``: seconds to copy the value to host memory and back, + view rebuilt on
    an offloaded base's copy). ``inputs`` (:func:`non_parameter_inputs`' priced ones): one
    more variable each after the blocks, h_p >= r_v for every v reading p, b_p in the
    budget row."""
    from scipy.optimize import Bounds, LinearConstraint
    from scipy.sparse import lil_matrix

    index = {n: i for i, n in enumerate(forward)}
    n = len(forward)
    blocks = 4 if offload_cost is not None else 2
    held = {p: blocks * n + k for k, p in enumerate(inputs or [])}
    width = blocks * n + len(held)
    c = np.zeros(width)
    lower = np.zeros(width)
    upper = np.ones(width)
    largest = max([_bytes(v) for v in forward] + [1])
    for v, i in index.items():
        c[n + i] = max(times.get(v.name, 0.0), 1e-9)
        c[i] = 1e-12 * _bytes(v) / largest  # tie-break: of equally fast plans, fewer bytes
        if _unsafe_to_recompute(v):
            upper[n + i] = 0
        if _is_view(v) or _is_tuple(v):
            upper[i] = 0  # views come back from their base; a tuple is saved per getitem
        if blocks == 4:
            assert offload_cost is not None
            c[2 * n + i] = max(offload_cost.get(v, 0.0), 1e-9)
            c[3 * n + i] = 1e-9
            if _is_view(v) or _is_tuple(v) or not _bytes(v) or user_policy(v):
                upper[2 * n + i] = 0
            if not _is_view(v) or user_policy(v):
                upper[3 * n + i] = 0
        policy = user_policy(v)
        if policy == "recompute" and upper[n + i]:  # the user's checkpoint region
            upper[i], lower[n + i] = 0, 1
        elif policy == "save" and upper[i]:
            lower[i] = 1
    rows: list[tuple[dict[int, float], float, float]] = []
    for v in needed:
        i = index[v]
        row = {i: 1.0, n + i: 1.0}
        if blocks == 4:
            row[2 * n + i] = row[3 * n + i] = 1.0
        rows.append((row, 1.0, math.inf))
    for v, i in index.items():
        for u in v.all_input_nodes:
            if u in held:  # recomputation holds the graph input it reads
                rows.append(({held[u]: 1.0, n + i: -1.0}, 0.0, math.inf))
            if u in index:  # recomputation reads saved or recomputed inputs
                j = index[u]
                rows.append(({j: 1.0, n + j: 1.0, n + i: -1.0}, 0.0, math.inf))
                if blocks == 4 and _is_view(v):  # rebuilt on the copy of an offloaded base
                    rows.append(({2 * n + j: 1.0, 3 * n + j: 1.0, 3 * n + i: -1.0}, 0.0,
                                 math.inf))
    memory = {index[v]: float(_bytes(v)) for v in forward
              if not _is_view(v) and not _is_tuple(v)}
    memory.update({n + index[v]: float(rng_state_bytes(v)) for v in forward
                   if rng_state_bytes(v) and upper[n + index[v]]})  # recomputed: its state
    memory.update({k: float(_bytes(p)) for p, k in held.items()})
    rows.append((memory, -math.inf, budget + 0.5))  # whole bytes: <= budget, with room for
    # the solver's feasibility tolerance (the least-bytes re-solve's budget is that least)
    a = lil_matrix((len(rows), width))
    lb, ub = np.zeros(len(rows)), np.zeros(len(rows))
    for k, (coeffs, lo, hi) in enumerate(rows):
        for j, val in coeffs.items():
            a[k, j] = val
        lb[k], ub[k] = lo, hi
    return (c, LinearConstraint(a.tocsr(), lb, ub), np.ones(width),
            Bounds(lower, upper), index, blocks)


def solve_ilp(forward: list[fx.Node], needed: list[fx.Node], times: dict[str, float],
              budget: int, time_limit: float,
              offload_cost: dict[fx.Node, float] | None = None,
              inputs: list[fx.Node] | None = None
              ) -> tuple[set[fx.Node], set[fx.Node], set[fx.Node], str] | None:
    """Optimal (saved, recomputed, offloaded, status), or None when out of time without a
    plan; ``inputs``: graph inputs priced when recomputation holds them (:func:`build_ilp`).

    An infeasible budget is solved lexicographically: first the least bytes any plan saves
    (the budget row as the objective, no budget), then the fastest plan within that least
    (status "budget infeasible: ..."). Greedy ran instead before, and a review measured
    budget 0 saving 197,120 bytes where a 64 KiB budget's optimal plan saved 65,536: a
    smaller budget got more memory."""
    from scipy.optimize import LinearConstraint, milp

    c, constraints, integrality, bounds, index, blocks = build_ilp(
        forward, needed, times, budget, offload_cost, inputs)
    res = milp(c, constraints=constraints, integrality=integrality, bounds=bounds,
               options={"time_limit": time_limit})
    least_note = ""
    if res.status == 2:  # infeasible
        rows = constraints.A.tocsr()
        others = LinearConstraint(rows[:-1], constraints.lb[:-1], constraints.ub[:-1])
        least = milp(rows[-1].toarray().ravel(), constraints=others,
                     integrality=integrality, bounds=bounds,
                     options={"time_limit": time_limit})
        if least.x is None or least.status not in (0, 1):
            return None
        floor = int(math.ceil(least.fun - 1e-6))
        c, constraints, integrality, bounds, index, blocks = build_ilp(
            forward, needed, times, floor, offload_cost, inputs)
        res = milp(c, constraints=constraints, integrality=integrality, bounds=bounds,
                   options={"time_limit": time_limit})
        least_note = (f"budget infeasible: {floor} bytes is the least any plan saves"
                      + ("" if least.status == 0 else " (the ILP's best in its time limit)")
                      + "; the fastest plan within it")
    if res.x is None or res.status not in (0, 1):
        return None
    n = len(forward)
    saved = {v for v, i in index.items() if res.x[i] > 0.5}
    recomputed = {v for v, i in index.items() if res.x[n + i] > 0.5}
    offloaded = {v for v, i in index.items() if blocks == 4 and res.x[2 * n + i] > 0.5
                 and v not in saved and v not in recomputed}
    return saved, recomputed, offloaded, least_note or (
        "optimal" if res.status == 0 else "time limit (best found)")


def keep_everything(forward: list[fx.Node], needed: list[fx.Node]
                    ) -> tuple[set[fx.Node], set[fx.Node]]:
    """The no-remat plan: save every needed value; views and tuple outputs are rebuilt from
    their saved bases (which are then saved too)."""
    fwd = set(forward)
    saved = {v for v in needed if not _is_view(v) and not _is_tuple(v)}
    recomputed = {v for v in needed if _is_view(v) or _is_tuple(v)}
    for v in list(recomputed):
        stack = [u for u in v.all_input_nodes if u in fwd]
        while stack:
            u = stack.pop()
            if _is_view(u) or _is_tuple(u):
                if u not in recomputed:
                    recomputed.add(u)
                    stack += [w for w in u.all_input_nodes if w in fwd]
            else:
                saved.add(u)
    return saved, recomputed


def solve_greedy(forward: list[fx.Node], needed: list[fx.Node], times: dict[str, float],
                 budget: int, inputs: list[fx.Node] | None = None
                 ) -> tuple[set[fx.Node], set[fx.Node], str]:
    """Recompute the most bytes per second of recomputation first; a candidate's inputs that
    are not saved are recomputed with it (chains up to 8 ops); views and tuple outputs come
    back from their saved bases. Values the user's checkpoint regions tag "recompute" are
    recomputed first and "save" ones never are (the ILP fixes both; greedy ignored them and
    saved up to 5x what the user's checkpoint did, found by a review)."""
    saved, recomputed = keep_everything(forward, needed)
    fwd = set(forward)
    users_recompute = [v for v in forward if user_policy(v) == "recompute"]

    def total() -> int:  # (+ the graph inputs recomputation holds: :func:`held_inputs`,
        # + the generator states of recomputed random ops, as :func:`_plan` prices the plan:
        # left out, greedy stopped 10,934 bytes over a budget and blamed itself, a review)
        return sum(_bytes(v) for v in saved) + sum(
            _bytes(p) for p in held_inputs(inputs or [], recomputed)) + sum(
            rng_state_bytes(v) for v in recomputed)

    def closure(v: fx.Node, plan: set[fx.Node], depth: int) -> bool:
        """Add to ``plan`` what recomputing ``v`` needs (inputs not saved: recomputed too,
        up to ``depth`` levels); False if something on the way cannot be recomputed."""
        if _unsafe_to_recompute(v) or depth < 0 or user_policy(v) == "save":
            return False  # (a user-saved input was recomputed through a chain: a review)
        plan.add(v)
        for u in v.all_input_nodes:
            if u not in fwd or (u in saved and u is not v) or u in recomputed or u in plan:
                continue
            if not closure(u, plan, depth - 1):
                return False
        return True

    for v in users_recompute:  # the user's checkpoint regions first, as the ILP fixes them
        plan: set[fx.Node] = set()
        if v in saved and closure(v, plan, depth=8):
            saved.discard(v)
            recomputed |= plan
    order = {v: i for i, v in enumerate(forward)}  # ties in graph order: the same plan on
    # every run (set order broke them: 55,296 to 88,064 bytes for one graph, a review)
    candidates = sorted((v for v in saved if not _unsafe_to_recompute(v)
                         and user_policy(v) != "save"),
                        key=lambda v: (-_bytes(v) / max(times.get(v.name, 0.0), 1e-9),
                                       order[v]))
    for v in candidates:
        before = total()
        if before <= budget:
            break
        plan = set()
        saved.discard(v)
        if closure(v, plan, depth=8):
            recomputed |= plan
            if total() < before:
                continue
            recomputed -= plan  # holds a graph input larger than what it frees
        saved.add(v)
    return saved, recomputed, "greedy" + ("" if total() <= budget else " (over budget)")


def plan(gm: fx.GraphModule, budget: int, solver: str = "ilp",
         time_limit: float = 10.0, offload: bool = False, profile: Any = None,
         observed: dict[Any, int] | None = None) -> RematPlan:
    """See :func:`_plan`; ``observed`` sizes (profile-guided mode) replace the size hints."""
    with observed_sizes(observed, gm):
        return _plan(gm, budget, solver, time_limit, offload, profile)


@contextlib.contextmanager
def observed_sizes(observed: dict[Any, int] | None,
                   gm: fx.GraphModule | None = None) -> Iterator[None]:
    """Data-dependent sizes priced at their ``observed`` values (profile-guided mode) inside
    the block, at the hint outside; with ``gm``, the backed sizes of its shape environment
    at their hints in cost expressions too (:func:`_concrete`)."""
    _OBSERVED.clear()
    _OBSERVED.update(observed or {})
    _BACKED.clear()
    sizes = [d for n in (gm.graph.nodes if gm is not None else ())
             for v in torch.utils._pytree.tree_leaves(n.meta.get("val"))
             if isinstance(v, torch.Tensor) for d in v.shape if isinstance(d, torch.SymInt)]
    if sizes:
        shape_env = sizes[0].node.shape_env  # type: ignore[attr-defined]
        _BACKED.update(getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val)
    try:
        yield
    finally:
        _OBSERVED.clear()
        _BACKED.clear()


def _plan(gm: fx.GraphModule, budget: int, solver: str = "ilp",
          time_limit: float = 10.0, offload: bool = False, profile: Any = None) -> RematPlan:
    """Decide keep/recompute(/offload) for ``gm`` (a joint graph) within ``budget`` bytes of
    saved activations; ``profile`` prices nodes and host copies (default: "local" when
    calibrated, else h100-sxm)."""
    forward, backward = split_as_partitioned(gm)
    for v in readers_of_mutated_inputs(gm.graph):
        v.meta[READS_MUTATED_INPUT] = True
    needed = _needed(forward, backward)
    device = load_profile(profile or default_profile_name()).device
    times = _node_times(gm, device)
    offload_cost = None
    if offload:
        offload_cost = {v: 2 * (_bytes(v) / device.host_bandwidth + device.kernel_overhead_s)
                        for v in forward}
    result = None
    name = solver
    infeasible = False  # proven by the ILP (greedy alone proves nothing)
    # inputs a recomputed value may read: its copy is held (:func:`_snapshot_held_inputs`),
    # also of those the backward reads anyway (the copy is the plan's, the input is not)
    priced, read = non_parameter_inputs(gm, backward)
    priced = priced + read
    if solver == "ilp":
        result = solve_ilp(forward, needed, times, budget, time_limit, offload_cost, priced)
        if result is None:
            name = "greedy (ILP out of time" + (
                "; greedy does not offload)" if offload else ")")
            infeasible = True
        elif result[3].startswith("budget infeasible"):
            infeasible = True
    if result is None:
        saved, recomputed, status = solve_greedy(forward, needed, times, budget, priced)
        result = (saved, recomputed, set(), status)
    saved, recomputed, offloaded, status = result
    # values saved that nothing reads, neither the backward nor a recomputed value (a
    # mask-building chain in GPT-2's checkpointed layers): the solver's tie-break is below
    # HiGHS's gap, so such saves cost it nothing, but the partitioner does not save them and
    # the claim was 5.7% above what autograd held (a re-review)
    wanted, readers = set(needed), recomputed | offloaded
    while unread := [v for v in saved if v not in wanted and readers.isdisjoint(v.users)]:
        saved.difference_update(unread)  # (their inputs may now be unread too)
    for v in [v for v in saved if v.target is operator.getitem and v.args[0] in recomputed]:
        saved.discard(v)  # a tuple element of a recomputed op comes with it (the partitioner
        recomputed.add(v)  # ignores its MUST_SAVE; the claim counted a recomputed SDPA's
        # logsumexp as saved: the tie-break that prefers recomputing it is below HiGHS's gap)
    # a random multi-output op (native_dropout) the user's checkpoint tags "recompute" keeps
    # that tag (its elements' MUST_SAVE does not reach it): the partitioner recomputes it,
    # elements included, from a saved generator state (a review: claimed 2,672 bytes where
    # autograd held 20,736, four 5,056-byte CPU states)
    regenerated = []
    for t in forward:
        if user_policy(t) == "recompute" and rng_state_bytes(t) and t not in saved \
                and t not in recomputed:
            elements = [u for u in t.users if u.target is operator.getitem and u in saved]
            for u in elements:
                saved.discard(u)
                recomputed.add(u)
            if elements:
                regenerated.append(t)
    held = held_inputs(priced, recomputed)
    saved_bytes = sum(_bytes(v) for v in saved) + sum(rng_state_bytes(v) for v in recomputed) \
        + sum(rng_state_bytes(t) for t in regenerated) + sum(_bytes(p) for p in held)
    cost = sum(times.get(v.name, 0.0) for v in recomputed)
    if offload_cost:
        cost += sum(offload_cost[v] for v in offloaded)
    return RematPlan(saved, recomputed, saved_bytes, cost, name, status, offloaded,
                     device.kind, times, infeasible, held)


_DEVICE_PUT = torch.ops.prims.device_put.default


def _offload(gm: fx.GraphModule, v: fx.Node, backward: set[fx.Node]) -> None:
    """Save a host copy of ``v`` instead of ``v``; the backward copies it back.

    forward: h = device_put(v, cpu) (MUST_SAVE); backward: d = device_put(h, device of v)
    (MUST_RECOMPUTE, so the partitioner materializes it in the backward) replaces v in every
    backward user, and views of v that the backward reads are rebuilt on d. ``prims.
    device_put``, not ``aten._to_copy``: this runs after AOTAutograd's decompositions, and
    Inductor has a lowering for device_put but expects _to_copy decomposed (it crashed)."""
    from torch.utils.checkpoint import CheckpointPolicy

    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    val = v.meta["val"]

    def backward_users(node: fx.Node) -> list[fx.Node]:
        return [u for u in node.users if u in backward]

    def views_read_back(node: fx.Node) -> list[fx.Node]:
        """Forward views of ``node`` (through chains of views), parents first, that the
        backward reads directly or through a further view (rebuilt on the copy)."""
        found = []
        for w in node.users:
            if w in backward or not _is_view(w):
                continue
            below = views_read_back(w)
            if backward_users(w) or below:
                found += [w, *below]
        return found

    chain = views_read_back(v)
    if not backward_users(v) and not chain:
        return
    with graph.inserting_after(v):
        host = graph.call_function(_DEVICE_PUT, (v, torch.device("cpu")))
    host.meta.update(val=val.to("cpu"), recompute=CheckpointPolicy.MUST_SAVE)
    readers = backward_users(v) + [u for w in chain for u in backward_users(w)]
    first = min(readers, key=lambda u: order.get(u, len(order)))
    with graph.inserting_before(first):
        back = graph.call_function(_DEVICE_PUT, (host, val.device))
    back.meta.update(val=val, recompute=CheckpointPolicy.MUST_RECOMPUTE)
    for u in backward_users(v):
        u.replace_input_with(v, back)
    on_copy = {v: back}
    last = back
    for w in chain:  # parents first: each view is rebuilt on its rebuilt parent
        target: Any = w.target  # a view op
        args, kwargs = torch.fx.node.map_arg((w.args, w.kwargs),
                                             lambda a: on_copy.get(a, a))
        with graph.inserting_after(last):
            rebuilt = graph.call_function(target, tuple(args), dict(kwargs))
        rebuilt.meta.update(w.meta, recompute=CheckpointPolicy.MUST_RECOMPUTE)
        on_copy[w] = last = rebuilt
        for u in backward_users(w):
            u.replace_input_with(w, rebuilt)
    v.meta.pop("recompute", None)


@register_pass
@dataclass(frozen=True)
class RematPass(GraphPass):
    """See the module docstring."""

    name = "remat"
    stage = "joint"
    exact = True
    options_key = "remat"
    options_cls = RematOptions
    options: RematOptions | None = None

    @classmethod
    def from_config(cls, config: Any) -> RematPass:
        return cls(config.remat)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        from torch.utils.checkpoint import CheckpointPolicy

        if ctx.graph_kind != "joint" or self.options is None:
            ctx.record("skipped", "graph", "not a joint training graph or no remat option")
            return PassResult(gm, False)
        start = time.perf_counter()
        opts = self.options
        original, gm = gm, _partitioner_cse(gm)
        forward, backward = split_as_partitioned(gm)
        user = [v for v in forward if user_policy(v) is not None]
        observed = ctx.extras.get("observed_sizes") if opts.profile_guided else None
        with observed_sizes(observed, gm):  # (priced at the hint, profile-guided budgets were
            # fractions of a guessed size: a review measured 0.1% of no remat at 0.5)
            keep_all = sum(_bytes(v) for v in keep_everything(
                forward, _needed(forward, backward))[0])
            # fractions are of what compiling without remat saves: PyTorch's min-cut
            # partition of this graph (user checkpoint regions honored), which recomputes
            # cheap ops itself; tagging at a budget above it saved more than no remat (a
            # review: 10-26% at 1.0)
            priced, read = non_parameter_inputs(gm, backward)
            alone = _partitioner_bytes(gm, cse_done=gm is not original, priced=priced)
            bytes_budget = opts.resolve(1 << 20) == opts.resolve(1 << 21) != 0
            dynamic = dynamic_sizes_note(forward, None, bytes_budget)
        budget = opts.resolve(keep_all if alone is None else alone)
        from graphopt.report import graph_breaks

        # (a review: MiniMax's 12 graphs at "10%" held 74% of no remat, each record honest
        # about its own graph and none saying the budget was per graph)
        split = ("; graph breaks in this process: the budget covers this graph's saved "
                 "activations only (each graph gets the whole budget; tensors passed between "
                 "graphs are not counted)") if graph_breaks() else ""
        of = (f"budget {budget} bytes (without remat PyTorch's partitioner saves {alone}, "
              f"keep-all {keep_all}{split})" if alone is not None else
              f"budget {budget} bytes of keep-all {keep_all}{split}")
        if read:
            ctx.record("kept", "graph inputs held by the backward",
                       f"the backward reads {len(read)} graph inputs that are not parameters "
                       f"({sum(_bytes(p) for p in read)} bytes: the batch, buffers, or a "
                       "previous graph's activations) directly: held whatever the plan, "
                       "outside the budget")
        if alone is not None and budget >= alone:
            ctx.record("kept", "saved activations",
                       f"{of}: within the budget; nothing recomputed or offloaded, PyTorch's "
                       "partition kept" + dynamic)
            _record_user_regions(ctx, user)
            return PassResult(original, False)
        decision = plan(gm, budget, opts.solver, opts.ilp_seconds, opts.offload,
                        opts.profile, observed)
        if opts.profile_guided:
            guess = plan(gm, budget, opts.solver, opts.ilp_seconds, opts.offload,
                         opts.profile)
            changed = sum(1 for a, b in ((guess.saved, decision.saved),
                                         (guess.recomputed, decision.recomputed),
                                         (guess.offloaded, decision.offloaded))
                          for v in a ^ b)
            sizes = ", ".join(f"{k}={v}" for k, v in sorted((observed or {}).items(),
                                                            key=lambda kv: str(kv[0])))
            refused = ctx.extras.get("observe_refused")
            ctx.record("rewritten" if observed else "skipped", "profile-guided",
                       (f"observed {len(observed)} data-dependent sizes ({sizes}); "
                        f"{changed // 2} values decided differently than with the size hint "
                        f"{_UNBACKED_HINT} (saved {guess.saved_bytes} -> "
                        f"{decision.saved_bytes} bytes)") if observed else
                       f"not observed: {refused}; data-dependent sizes priced at the hint "
                       f"{_UNBACKED_HINT}" if refused else
                       "no data-dependent sizes in this graph: the static plan is exact")
        if alone is not None and decision.saved_bytes > budget \
                and decision.saved_bytes >= alone:
            # the solver's least is of its model of the graph; where PyTorch's partition
            # saves less (user checkpoint regions, a re-review: "65536 bytes is the least
            # any plan saves" next to a partition of 49152) its "least any plan" is not
            status = decision.status if decision.saved_bytes == alone else (
                f"its model of this graph saves no less; PyTorch's partition, {alone} "
                "bytes, does")
            ctx.record("kept", "saved activations",
                       f"{of}: over budget, and the least the solver found "
                       f"({decision.saved_bytes} bytes; solver {decision.solver}: "
                       f"{status}) is not below PyTorch's partition: nothing "
                       "recomputed or offloaded, PyTorch's partition kept" + dynamic)
            _record_user_regions(ctx, user)
            return PassResult(original, False)
        if not (decision.recomputed or decision.offloaded or user):
            fits = decision.saved_bytes <= budget
            ctx.record("kept" if fits else "skipped", "saved activations",
                       f"{of}: " + ("every saved activation fits; " if fits else
                                    f"over budget ({decision.saved_bytes} bytes) and nothing "
                                    "the solver may recompute helps; ")
                       + f"nothing recomputed or offloaded, PyTorch's partition kept "
                       f"(solver {decision.solver}: {decision.status})" + dynamic)
            return PassResult(original, False)
        for v in decision.offloaded:
            _offload(gm, v, backward)
        if decision.offloaded:
            here = next((t.device for t in torch.utils._pytree.tree_leaves(
                [v.meta.get("val") for v in decision.offloaded])
                if isinstance(t, torch.Tensor)), None)
            moved = sum(_bytes(v) for v in decision.offloaded)
            total = decision.saved_bytes + moved
            versus = ""
            if alone is not None:
                than = "more than" if total > alone else "less than" if total < alone \
                    else "as much as"
                versus = f", {than} PyTorch's partition without remat ({alone})"
            # (a review: "no memory is saved" where the budget-0 plan held 131% of no remat)
            note = (f" (host memory is this device's memory here: the copies run, and the "
                    f"backward holds the saved and the offloaded bytes, {total}{versus})"
                    ) if here is not None and here.type == "cpu" else ""
            ctx.record("rewritten", "offload", f"{len(decision.offloaded)} values offloaded "
                       f"to host, {sum(_bytes(v) for v in decision.offloaded)} bytes" + note)
        _record_user_regions(ctx, user)
        copied = _snapshot_held_inputs(gm, decision)
        for v in forward:
            if v in decision.offloaded:
                continue
            if v in decision.recomputed:
                v.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            elif v in decision.saved:
                v.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            # values the backward does not need stay untagged
        times = decision.times
        over = decision.saved_bytes > budget
        if dynamic:
            with observed_sizes(observed, gm):
                dynamic = dynamic_sizes_note(forward, decision, bytes_budget)
        own = [v for v in decision.recomputed if not _is_view(v) and not _is_tuple(v)]
        copies = ""
        if copied:
            also = [p for p in copied if p in read]
            copies = (f" (with copies of {len(copied)} graph inputs that are not parameters, "
                      f"held to recompute from: {sum(_bytes(p) for p in copied)} bytes" + (
                          f"; the backward also holds {len(also)} of them itself: the copy "
                          "keeps the recomputed values those of the forward if the input "
                          "is written between forward and backward (.data, a buffer "
                          "update), as eager's saved values are" if also else "") + ")")
        ctx.record("skipped" if over else "rewritten", "saved activations",
                   f"{of}: saved "
                   f"{decision.saved_bytes} bytes{copies}"
                   + f", {len(decision.recomputed)} values recomputed"
                   + (f" ({len(decision.recomputed) - len(own)} of them views or tuple "
                      "elements, which hold no memory of their own)"
                      if len(own) < len(decision.recomputed) else "")
                   + f" (predicted +{decision.recompute_s * 1e3:.3f} ms), solver "
                   f"{decision.solver}: {decision.status}, "
                   f"{time.perf_counter() - start:.2f}s"
                   + ((" -- budget infeasible: no plan saves less (the ILP's minimum)")
                      if over and decision.ilp_infeasible and decision.solver == "ilp"
                      else (" -- the ILP ran out of time: the least greedy found is "
                            f"{decision.saved_bytes} bytes (not proven minimal)")
                      if over and decision.ilp_infeasible
                      else (" -- over budget: greedy's plan saves "
                            f"{decision.saved_bytes} bytes (greedy is not exhaustive; "
                            "solver 'ilp' may meet the budget)") if over else "")
                   + dynamic)
        for v in sorted(own, key=lambda v: -_bytes(v)):  # (views of weights were listed
            if _bytes(v):  # with their bytes: 4.2x the real reduction in all, a review)
                ctx.record("rewritten", site_name(v), f"recompute ({_bytes(v)} bytes, "
                           f"predicted {times.get(v.name, 0.0) * 1e6:.1f} us)")
        for v in sorted(decision.offloaded, key=lambda v: -_bytes(v)):
            ctx.record("rewritten", site_name(v), f"offload ({_bytes(v)} bytes)")
        for v in sorted(decision.saved, key=lambda v: -_bytes(v)):
            if _bytes(v):
                ctx.record("kept", site_name(v), f"save ({_bytes(v)} bytes; recompute would "
                           f"cost {times.get(v.name, 0.0) * 1e6:.1f} us"
                           + (", not recomputable)" if _unsafe_to_recompute(v) else ")"))
        gm.meta["graphopt_remat"] = True
        gm.meta[OFFLOADED] = {v.name: _bytes(v) for v in decision.offloaded}
        gm.meta[REMAT_CLAIM] = (decision.saved_bytes, budget, {p.name for p in read})
        return PassResult(gm, True)
