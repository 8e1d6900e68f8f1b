"""One DeviceMesh per plan: the only source of process groups when a plan runs.

Vocabulary (as in :mod:`graphopt.planner.plan` and torchtitan's ``ParallelDims``): a mesh
*axis* is a parallel dimension (dp_replicate, dp_shard, cp, tp, pp); a tensor *dim* is a
dimension of a tensor. ``plan.mesh_order`` lists the axes innermost first (tp on the fastest
links by default); ``init_device_mesh`` takes them outermost first, so the order is reversed.
Every axis is in the mesh, size 1 included, so code can always ask ``mesh["tp"]``.

Flattened axes (``DeviceMesh._flatten``), built once here:
- ``dp``: dp_replicate x dp_shard (gradient all-reduce / data loading);
- ``dp_shard_cp``: dp_shard x cp (the FSDP shard group: parameters are sharded over CP too,
  as torchtitan does);
- ``dp_cp``: dp_replicate x dp_shard x cp (replicas' gradient all-reduce when CP ranks hold
  copies of the parameters);
- ``ep_fold``: dp_shard x cp x tp, the devices MoE layers fold EP over (Megatron-Core "MoE
  parallel folding"); EP groups are consecutive blocks of ``plan.ep`` ranks in it.

Picture for dp_shard=2, tp=2 on 4 ranks (mesh_order tp innermost)::

    dp_shard 0: [rank 0 | rank 1]   <- a tp group
    dp_shard 1: [rank 2 | rank 3]
                  ^ a dp_shard group: ranks 0, 2
"""

from __future__ import annotations

import os
from typing import Any

from graphopt.errors import ConfigError
from graphopt.planner.plan import ParallelPlan

FLAT_AXES = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
             "dp_cp": ("dp_replicate", "dp_shard", "cp"), "ep_fold": ("dp_shard", "cp", "tp")}


def mesh_shape(plan: ParallelPlan) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(axis names outermost first, sizes) for ``init_device_mesh``."""
    names = tuple(reversed(plan.mesh_order))
    return names, tuple(getattr(plan, name) for name in names)


def build_mesh(plan: ParallelPlan, device_type: str | None = None) -> Any:
    """The plan's DeviceMesh over the default process group (torchrun, or
    ``torch.distributed.init_process_group``), with flattened axes (module docstring).

    Args:
        plan: a valid plan; its degrees must multiply to the world size.
        device_type: "cpu" | "cuda" | "npu"; default: cuda if available, else cpu.

    Raises:
        ConfigError: torch.distributed is not initialized, or the plan's device count is
            not the world size (the message names both and the fix).
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_available() and not dist.is_initialized() and "TORCHELASTIC_RUN_ID" in os.environ:
        # (a re-review: under torchrun the message said to launch with torchrun)
        raise ConfigError("torchrun started this rank, but torch.distributed is not "
                          "initialized: call torch.distributed.init_process_group() (backend "
                          "nccl on GPUs, gloo on CPUs) before building the plan's mesh")
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(f"running a parallel plan needs torch.distributed: launch "
                          f"{plan.devices} ranks with torchrun (--nproc-per-node, --nnodes; "
                          f"{plan.describe()}), or call torch.distributed.init_process_group "
                          "first")
    world = dist.get_world_size()
    if plan.devices != world:
        raise ConfigError(f"the plan uses {plan.devices} devices ({plan.describe()}) but the "
                          f"world size is {world}: launch {plan.devices} ranks or search a "
                          f"plan for {world} devices (graphopt plan --devices {world})")
    plan.validate()
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    names, sizes = mesh_shape(plan)
    mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
    for flat, axes in FLAT_AXES.items():
        ordered = tuple(a for a in names if a in axes)  # flatten keeps mesh order
        mesh[ordered]._flatten(flat)
    # shard_sequence cuts the layout the plan's CP runs; a mesh built here and handed to it
    # before (or instead of) the one parallelize ran on got Ulysses' contiguous chunks
    # under a ring plan: gradients 109% off, silently (a review)
    mesh._graphopt_cp_kind = plan.cp_kind  # type: ignore[attr-defined]
    return mesh


EXPERT_AXES = ("pp", "dp_replicate", "edp_shard", "ep", "etp")


def expert_mesh(mesh: Any, plan: ParallelPlan) -> Any:
    """The MoE layers' mesh over the same ranks as ``mesh`` (MoE parallel folding,
    Megatron-Core; torchtitan's ``dp_shard_in_ep``): axes ``(pp, dp_replicate, edp_shard,
    ep, etp)``. The fold dp_shard x cp x tp (ranks in ``mesh``'s order, innermost fastest)
    is cut into blocks of ``plan.ep`` consecutive ranks: an EP group; ranks at the same
    place in different blocks hold the same experts and form ``edp_shard`` (the experts'
    FSDP group; with dp_replicate, ``edp`` = dp_replicate x edp_shard is flattened). With
    ``expert_tp`` = tp > 1 (tensor-parallel experts) the TP group is ``etp``, each of its
    ranks holding a slice of every local expert's FFN dim, and EP folds over dp_shard x cp
    only; ``etp`` has size 1 otherwise. Built once per mesh (collective: every rank calls
    it).

    Picture for dp_shard=2, tp=2, ep=2 on 4 ranks: EP groups [0, 1] and [2, 3] (the TP
    groups); edp_shard groups [0, 2] and [1, 3]. With expert_tp=2 as well (dp_shard=2 x
    tp=2, ep=2, expert_tp=2): EP groups [0, 2] and [1, 3], etp groups [0, 1] and [2, 3].

    Raises:
        ConfigError: expert_tp other than 1 or tp (the ETP group must be the TP group,
            whose ranks hold the same tokens), or ep not dividing the fold.
    """
    from torch.distributed.device_mesh import DeviceMesh

    cached = getattr(mesh, "_graphopt_expert_mesh", None)
    if cached is not None:
        return cached
    check_expert_tp(plan)
    etp = plan.expert_tp
    names = mesh.mesh_dim_names
    fold = [a for a in names if a in ("dp_shard", "cp") + (("tp",) if etp == 1 else ())]
    size = plan.dp_shard * plan.cp * (plan.tp if etp == 1 else 1)
    if size % plan.ep:
        raise ConfigError(f"ep ({plan.ep}) must divide "
                          + ("dp_shard*cp*tp" if etp == 1 else "dp_shard*cp") + f" ({size})")
    order = [names.index("pp"), names.index("dp_replicate")] + [names.index(a) for a in fold] \
        + ([names.index("tp")] if etp > 1 else [])
    grid = mesh.mesh.permute(order).reshape(plan.pp, plan.dp_replicate, size // plan.ep,
                                            plan.ep, etp)
    experts = DeviceMesh(mesh.device_type, grid, mesh_dim_names=EXPERT_AXES)
    experts["dp_replicate", "edp_shard"]._flatten("edp")
    mesh._graphopt_expert_mesh = experts
    return experts


def check_expert_tp(plan: ParallelPlan) -> None:
    """Raise ConfigError unless ``plan.expert_tp`` is 1 or tp: graphopt executes
    tensor-parallel experts over the TP group (Megatron's ETP = TP), whose ranks hold the
    same tokens at the MoE block; other ETP groups would first all-gather tokens, which is
    not built."""
    fold = plan.dp_shard * plan.cp  # what EP folds over when expert_tp = tp
    if plan.expert_tp not in (1, plan.tp):
        raise ConfigError(f"expert_tp={plan.expert_tp} with tp={plan.tp}: graphopt splits "
                          "experts over the TP group only (expert_tp = tp, whose ranks hold "
                          "the same tokens) or not at all: use expert_tp=1"
                          + (f" or expert_tp={plan.tp}" if plan.tp > 1 and fold % plan.ep == 0
                             else ""))
    if plan.expert_tp > 1 and fold % plan.ep:
        raise ConfigError(f"expert_tp={plan.expert_tp}: with tensor-parallel experts EP folds "
                          f"over dp_shard x cp ({fold}) only, which ep={plan.ep} does not "
                          f"divide: use an ep that divides {fold}, or expert_tp=1 (EP then "
                          "folds over dp_shard x cp x tp)")


def axis_group(mesh: Any, axis: str) -> Any:
    """The process group of ``axis`` (a plan axis or a flattened one) for this rank."""
    return mesh[axis].get_group()


_EP_MESHES: dict[tuple[int, int], Any] = {}


def ep_mesh(ep: int, ranks_per_node: int | None = None) -> Any:
    """The expert-parallel mesh ``(ep_replicas, ep_node, ep_local)`` over the default process
    group, with ``ep`` = ep_node x ep_local flattened: EP groups are blocks of ``ep``
    consecutive ranks, each split into nodes of ``ranks_per_node`` (the hierarchical and
    peer all-to-all schedules' two levels). Created once per (ep, ranks_per_node), which
    like any mesh is collective: every rank calls it in the same order (every rank compiles
    the same graphs and runs the same schedule).

    Raises:
        ConfigError: torch.distributed is not initialized; ep does not divide the world size
            or ranks_per_node does not divide ep.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(f"expert parallelism (ep={ep}) needs torch.distributed: run under "
                          "torchrun (or call init_process_group) first")
    rpn = ranks_per_node or ep
    world = dist.get_world_size()
    if world % ep or ep % rpn:
        raise ConfigError(f"ep ({ep}) must divide the world size ({world}) and ranks per node "
                          f"({rpn}) must divide ep")
    key = (ep, rpn)
    if key not in _EP_MESHES:
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(device, (world // ep, ep // rpn, rpn),
                                mesh_dim_names=("ep_replicas", "ep_node", "ep_local"))
        mesh["ep_node", "ep_local"]._flatten("ep")
        _EP_MESHES[key] = mesh
    return _EP_MESHES[key]
