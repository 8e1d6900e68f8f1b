"""Memory: model states (parameters, gradients, optimizer states, ZeRO sharding) and
activation liveness over a traced forward+backward graph.

Model states per parameter (mixed-precision Adam, ZeRO paper: Rajbhandari et al. 2020,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", sec. 3.1): parameters
in the compute dtype (2 B for bf16), gradients (2 B), and optimizer states K = 12 B (fp32
master weights, Adam m and v). ZeRO stage 1 shards the optimizer states over the DP group,
stage 2 also the gradients, stage 3 also the parameters. Plain fp32 Adam: 4 + 4 + 8 B.

Activations: :func:`liveness_peak` walks a graph in execution order, allocating each
non-view output when produced and freeing it after its last user (the graph's outputs stay
alive to the end), and returns the largest live total: the peak the graph needs beyond its
inputs. On a make_fx trace of forward + autograd.grad this is the activation memory a
training step holds (saved tensors plus the transients of the largest op).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from graphopt.cost.graph_cost import _FREE
from graphopt.errors import ConfigError
from graphopt.passes.fx_utils import returns_alias


@dataclass(frozen=True)
class ModelStates:
    """Bytes per device of parameters, gradients and optimizer states."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    def __add__(self, other: ModelStates) -> ModelStates:
        """States of two parameter sets held by one device (e.g. dense + experts)."""
        return ModelStates(self.params + other.params, self.grads + other.grads,
                           self.optimizer + other.optimizer)


def model_state_bytes(num_params: float, *, param_bytes: int = 2, grad_bytes: int = 2,
                      optimizer: str = "adam", mixed_precision: bool = True,
                      zero_stage: int = 0, dp: int = 1) -> ModelStates:
    """Parameters/gradients/optimizer bytes per device for ``num_params`` parameters held by
    this device (after TP/PP/EP sharding), sharded by ZeRO ``zero_stage`` over ``dp`` ranks.

    Raises:
        ConfigError: num_params not a finite number >= 0, unknown optimizer, zero_stage
            not in 0..3, dp < 1.
    """
    if isinstance(num_params, bool) or not isinstance(num_params, numbers.Real) or \
            not 0 <= num_params < math.inf:  # gave negative or NaN bytes (a review)
        raise ConfigError(f"num_params must be a finite number >= 0, got {num_params!r}")
    if zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if dp < 1:
        raise ConfigError(f"dp must be >= 1, got {dp}")
    per_param = {"adam": 8, "adamw": 8, "sgd": 0, "sgd_momentum": 4}
    if optimizer not in per_param:
        raise ConfigError(f"unknown optimizer {optimizer!r}; valid: {', '.join(per_param)}")
    opt = per_param[optimizer] + (4 if mixed_precision and param_bytes < 4 else 0)
    params = num_params * param_bytes / (dp if zero_stage >= 3 else 1)
    grads = num_params * grad_bytes / (dp if zero_stage >= 2 else 1)
    states = num_params * opt / (dp if zero_stage >= 1 else 1)
    return ModelStates(params, grads, states)


def _bytes(val: Any) -> int:
    total = 0
    for leaf in torch.utils._pytree.tree_leaves(val):
        if isinstance(leaf, torch.Tensor):
            total += leaf.numel() * leaf.element_size()
    return total


def _is_view(node: fx.Node) -> bool:
    """No new storage: a view, an in-place op, or a metadata-only op."""
    return node.target in _FREE or returns_alias(node, include_inplace=True)


def _storage_root(node: fx.Node, roots: dict[fx.Node, fx.Node]) -> fx.Node:
    return roots.get(node, node)


def liveness_peak(gm: fx.GraphModule) -> int:
    """Peak bytes of tensors produced inside ``gm`` that are alive at once (inputs
    excluded; views share their base's storage; outputs live to the end)."""
    nodes = list(gm.graph.nodes)
    roots: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        if node.op == "call_function" and (_is_view(node) or node.target.__name__ ==
                                           "getitem") and node.all_input_nodes:
            roots[node] = _storage_root(node.all_input_nodes[0], roots)
    position = {n: i for i, n in enumerate(nodes)}
    last_use: dict[fx.Node, int] = {}
    for node in nodes:
        for a in node.all_input_nodes:
            root = _storage_root(a, roots)
            last_use[root] = max(last_use.get(root, -1), position[node])
    output = next((n for n in reversed(nodes) if n.op == "output"), None)
    keep = {_storage_root(a, roots) for a in output.all_input_nodes} if output else set()
    live = peak = 0
    frees: dict[int, list[fx.Node]] = {}
    for root, pos in last_use.items():
        frees.setdefault(pos, []).append(root)
    for i, node in enumerate(nodes):
        if node.op == "call_function" and node not in roots:
            live += _bytes(node.meta.get("val"))
            peak = max(peak, live)
        for root in frees.get(i, []):
            if root.op == "call_function" and root not in keep:
                live -= _bytes(root.meta.get("val"))
        if node.op == "call_function" and node not in roots and node not in last_use \
                and node not in keep:
            live -= _bytes(node.meta.get("val"))  # produced and never used
    return peak


def saved_for_backward(gm: fx.GraphModule) -> int:
    """Bytes of the forward values a traced training step keeps for its backward: tensors
    made before the loss (the graph's first output) and read after it; views count as their
    base's storage once, and graph inputs (parameters, data) are not counted.

    Activation checkpointing traced by make_fx (torch.utils.checkpoint, selective or not)
    marks each op of a checkpointed region with ``meta["recompute"]`` (a
    ``torch.utils.checkpoint.CheckpointPolicy``) instead of recomputing it in the graph: a
    value marked for recomputation is not kept; the values it is recomputed from are (the
    nearest ones marked to save, or made outside a checkpointed region), as the compiler's
    partitioner does for such regions (see :func:`recomputed_nodes`)."""
    saved, _ = _saved_and_recomputed(gm)
    return sum(_bytes(r.meta.get("val")) for r in saved if r.op == "call_function")


def parameter_casts_saved(gm: fx.GraphModule, params: int) -> int:
    """Bytes of :func:`saved_for_backward` that are dtype casts of the graph's first
    ``params`` inputs (:func:`graphopt.cost.estimate.trace_step` puts the parameters first):
    ``torch.autocast``'s 16-bit copies of float32 weights, which each GEMM keeps for its
    input gradient (:attr:`graphopt.planner.model.LayerCost.cast_bytes`). ``params``: the
    number of parameter inputs. Returns bytes (an int; 0 for a trace without such casts)."""
    first = set([n for n in gm.graph.nodes if n.op == "placeholder"][:params])
    saved, _ = _saved_and_recomputed(gm)
    return sum(_bytes(r.meta.get("val")) for r in saved if r.op == "call_function" and
               r.target is torch.ops.aten._to_copy.default and r.args[0] in first)


def recomputed_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Forward nodes of a traced training step (see :func:`saved_for_backward`) that its
    backward recomputes under the checkpoint policies marked on them: the ones the backward
    needs, directly or through other recomputed nodes, and marked for recomputation. Empty
    without activation checkpointing."""
    return _saved_and_recomputed(gm)[1]


def _saved_and_recomputed(gm: fx.GraphModule) -> tuple[set[fx.Node], set[fx.Node]]:
    from torch.utils.checkpoint import CheckpointPolicy

    recompute = (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)
    nodes = list(gm.graph.nodes)
    output = next(n for n in reversed(nodes) if n.op == "output")
    first = output.args[0][0] if isinstance(output.args[0], (tuple, list)) else output.args[0]
    position = {n: i for i, n in enumerate(nodes)}
    loss = position[first]
    roots: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        if node.op == "call_function" and (_is_view(node) or node.target.__name__ ==
                                           "getitem") and node.all_input_nodes:
            roots[node] = _storage_root(node.all_input_nodes[0], roots)
    saved: set[fx.Node] = set()
    recomputed: set[fx.Node] = set()
    # (value, the checkpointed region that needs it: None for the backward itself)
    stack: list[tuple[fx.Node, Any]] = [
        (n, None) for n in nodes[:loss]
        if n.op == "call_function" and any(position[u] > loss for u in n.users)]
    while stack:
        node, region = stack.pop()
        node = _storage_root(node, roots)  # a view's storage is its base's
        own = node.meta.get("ac_graph_id")
        # recomputed inside its own region; a region's inputs are kept (checkpoint inputs)
        if node.op == "call_function" and node.meta.get("recompute") in recompute and \
                (region is None or own == region):
            if node not in recomputed:  # rebuilt in the backward from its inputs
                recomputed.add(node)
                stack.extend((a, own) for a in node.all_input_nodes)
        else:
            saved.add(node)
    return saved, recomputed


def measured_saved_bytes(step: Any, exclude: list[torch.Tensor] | tuple = ()) -> int:
    """Bytes autograd saves for the backward while ``step()`` (a callable returning a
    tensor) runs for real, counted by saved-tensor hooks (torch.autograd.graph): each
    storage once, storages of ``exclude`` (parameters, inputs) not at all. Runs the backward
    of the output's sum to free what was saved. Returns bytes."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = step()
    out.float().sum().backward()
    return sum(seen.values())
