"""Distributed checkpoints of parallelized models: save under one plan, resume under another.

Contract: :class:`ModelState` and :class:`OptimizerState` are ``torch.distributed.checkpoint``
``Stateful`` objects over a model returned by :func:`graphopt.parallelize` (or
``graphopt.compile(options={"parallel": ...})``) and its optimizer::

    state = {"model": ModelState(model), "optimizer": OptimizerState(model, opt)}
    torch.distributed.checkpoint.save(state, checkpoint_id=path)   # every rank
    torch.distributed.checkpoint.load(state, checkpoint_id=path)   # any plan, any world size
    # one process, no graphopt: sd = {"model": plain.state_dict()}
    # torch.distributed.checkpoint.load(sd, checkpoint_id=path, no_dist=True)
    # plain.load_state_dict(sd["model"])

The checkpoint holds every tensor once, as the unparallelized model would name and shape it
(``model.state_dict()`` of the original model; optimizer states keyed by the same names, as
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` does), so DCP reshards
on load: a checkpoint written by dp_shard=4 x ep=2 loads into tp=2, into pp=2, or into one
process.

What each parallelism changes, and how it is undone (no data moves: each rank saves the
chunks it holds, DCP writes each chunk once):
- TP/SP, FSDP2/HSDP: the parameters are DTensors already; DCP saves their chunks.
- DDP/replicate, replicated modules: plain tensors; equal on every rank, saved once.
- EP (:mod:`graphopt.parallel.expert`): an experts parameter is this rank's ``E/ep`` experts
  [E/ep, ...] as a plain tensor (or, with ZeRO-2/3 and edp_shard > 1, an FSDP2 DTensor over
  edp_shard split on dim 0 or 1). Saved as it is, DCP would write one rank's experts under the
  full name and load them on every rank (silently wrong experts after a resume). Here it is
  viewed as a DTensor of the global [E, ...] over the expert mesh's (dp_replicate, edp_shard,
  ep) axes: Shard(0) over ep; FSDP's split over edp_shard as Shard(1), or as
  ``_StridedShard(0, split_factor=ep)`` when FSDP splits the experts dim after EP did (the
  right-to-left order FSDP2 + TP uses, torch.distributed.tensor.placement_types).
- PP (:class:`graphopt.parallel.pipeline.PipelinedModel`): stage names map back to the
  model's (``parts.0.layers.5.mlp...`` -> ``model.layers.5.mlp...``); a tied embedding is
  saved under both of the model's names (first stage: the embedding, last: the LM head).

- ZeRO-1: ``ZeroRedundancyOptimizer`` keeps each parameter's states on its owner rank only;
  each rank saves its local optimizer's.

- Tensor-parallel experts (expert_tp = tp > 1): a rank holds slice t of every local
  expert's FFN dim, in ``gate_up_proj`` [E, 2F, H] two boxes of the global tensor (rows
  [t F/etp, (t+1) F/etp) of the gate half and the same rows of the up half), which no
  DTensor placement describes (DTensor has one box per rank; a ``_StridedShard`` view was
  written as overlapping chunks). They are handed to DCP as :class:`ExpertBoxes`, a tensor
  that implements DCP's ``_Checkpointable`` protocol (``__create_write_items__``,
  ``__create_chunk_list__``, ``__get_tensor_shard__``, as DTensor does): one write/read
  item per box, each a view of this rank's storage; ``down_proj`` [E, H, F] is one box
  (columns). With FSDP over edp_shard the box is FSDP's local part of the held slice.

Refused (ConfigError): a model graphopt did not parallelize.

Pseudo-code::

    model_state: sd = get_model_state_dict(model) (PP: each stage's state_dict, names mapped)
                 for experts parameters: sd[name] = DTensor.from_local(local, expert mesh, ...)
    load: dcp.load writes into those tensors in place (they alias the parameters); anything
          that does not alias is copied back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from graphopt.errors import ConfigError


def _report(model: nn.Module) -> Any:
    report = getattr(model, "graphopt_parallel", None)
    if report is None or report.parallel_plan is None:
        raise ConfigError("ModelState/OptimizerState need a model returned by "
                          "graphopt.parallelize or graphopt.compile(options={'parallel': ...}); "
                          "for a plain model use model.state_dict() with "
                          "torch.distributed.checkpoint directly")
    return report


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class ExpertBoxes(torch.Tensor):
    """A global experts tensor ([E, 2F, H] ``gate_up_proj`` or [E, H, F] ``down_proj``) of
    which this rank holds the boxes ``boxes`` = [(global offsets, view of this rank's
    storage)], as ``torch.distributed.checkpoint`` takes it: DCP's ``_Checkpointable``
    protocol (torch/distributed/_checkpointable.py; DTensor implements it with one box per
    rank) with one write item per box on save and one chunk per box on load, which copies
    into the views (the parameters, in place). A wrapper with the global shape and no data
    of its own: any other use raises RuntimeError. Module docstring: tensor-parallel
    experts."""

    boxes: list[tuple[tuple[int, ...], torch.Tensor]]

    @staticmethod
    def __new__(cls, shape: torch.Size,
                boxes: list[tuple[tuple[int, ...], torch.Tensor]],
                like: torch.Tensor) -> ExpertBoxes:
        out = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=like.dtype,
                                                  device=like.device)
        out.boxes = boxes
        return out

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:
        raise RuntimeError(
            f"ExpertBoxes stands for a checkpoint's tensor-parallel experts tensor only "
            f"({func} called on it): torch.distributed.checkpoint's save and load take it, "
            "other tensor operations do not (async_save's host staging among them: use "
            "torch.distributed.checkpoint.save with expert_tp > 1); for the values use the "
            "model's parameters")

    def _chunk(self, offsets: tuple[int, ...], view: torch.Tensor) -> Any:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=view.shape)

    def __create_write_items__(self, fqn: str, obj: object) -> list[object]:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import (
            TensorWriteData,
            WriteItem,
            WriteItemType,
        )

        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)),
                          type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=self._chunk(offsets, view),
                              properties=TensorProperties.create_from_tensor(view),
                              size=self.shape))
                for offsets, view in self.boxes]

    def __create_chunk_list__(self) -> list[object]:
        return [self._chunk(offsets, view) for offsets, view in self.boxes]

    def copy_into(self, target: torch.Tensor) -> None:
        """Copy these boxes into ``target``'s (the same global tensor on this rank, e.g.
        another model's ModelState): a no-op where they are the same views (what
        ``torch.distributed.checkpoint.load`` wrote already).

        Raises:
            ConfigError: the two hold different boxes (another layout): go through
                torch.distributed.checkpoint, which reshards.
        """
        assert isinstance(target, ExpertBoxes)
        mine = dict(target.boxes)
        if self.shape != target.shape or sorted(dict(self.boxes)) != sorted(mine):
            raise ConfigError(
                f"an in-memory state of tensor-parallel experts holds other boxes of the "
                f"[{', '.join(map(str, self.shape))}] tensor than this rank's (another plan): "
                "save it with torch.distributed.checkpoint.save and load that, which "
                "reshards")
        with torch.no_grad():
            for offsets, view in self.boxes:
                dst = mine[offsets]
                if view.data_ptr() != dst.data_ptr() or view.stride() != dst.stride():
                    dst.copy_(view)

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        for offsets, view in self.boxes:
            if torch.Size(offsets) == index.offset:
                return view
        raise ValueError(f"no box of {index.fqn} at {index.offset} on this rank")


class _Experts:
    """Views of this rank's expert tensors as DTensors of the global [E, ...], or with
    tensor-parallel experts as :class:`ExpertBoxes` (module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        report = _report(model)
        self.experts: dict[str, tuple[int, int, int]] = dict(report.experts)
        self.plan, self.mesh = report.parallel_plan, report.mesh
        self.ffn: tuple[int, int] = tuple(report.expert_ffn)  # type: ignore[assignment]

    def owner(self, name: str) -> tuple[str, int, int] | None:
        """(parameter name in the module: gate_up_proj | down_proj, this rank's first
        expert, E the global expert count) if ``name`` is an experts parameter, else
        None."""
        for path, (start, _, e) in self.experts.items():
            for kind in ("gate_up_proj", "down_proj"):
                if name == f"{path}.{kind}":
                    return kind, start, e
        return None

    def global_view(self, t: torch.Tensor, owner: tuple[str, int, int]) -> torch.Tensor:
        """This rank's experts tensor ``t`` ([E/ep, ...], plain or an FSDP2 DTensor over
        edp_shard) as a DTensor [E, ...] sharing its storage, or with tensor-parallel
        experts as :class:`ExpertBoxes`."""
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor.placement_types import _StridedShard

        from graphopt.parallel.mesh import expert_mesh

        kind, start, e = owner
        if self.ffn[1] > 1:
            return self._boxes(t, kind, start, e)
        emesh = expert_mesh(self.mesh, self.plan)
        mesh = emesh["dp_replicate", "edp_shard", "ep"]
        ep = self.plan.ep
        fsdp: Any = Replicate()
        if isinstance(t, DTensor):
            split = [p for p in t.placements if p.is_shard()]
            dim = split[0].dim if split else None  # type: ignore[attr-defined]
            if dim == 0:
                fsdp = _StridedShard(0, split_factor=ep)
            elif dim is not None:
                fsdp = Shard(dim)
        shape = torch.Size((e, *t.shape[1:]))
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(_local(t), mesh, [Replicate(), fsdp, Shard(0)],
                                  run_check=False, shape=shape, stride=stride)

    def _boxes(self, t: torch.Tensor, kind: str, start: int, e: int) -> ExpertBoxes:
        """This rank's part of a tensor-parallel experts tensor as boxes of the global one:
        its held slice (expert.held_part: experts [start, start + E/ep), FFN slice t of
        etp), or with FSDP over edp_shard FSDP's local box of it, mapped to global
        offsets; ``gate_up_proj``'s held rows are split at the gate/up boundary."""
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = _local(t)
        if isinstance(t, DTensor):
            sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh,
                                                                   t.placements)
        else:
            sizes, offsets = tuple(local.shape), (0,) * local.dim()
        part, etp = self.ffn
        held = t.shape  # the held slice [E/ep, 2F/etp, H] or [E/ep, H, F/etp]
        boxes: list[tuple[tuple[int, ...], torch.Tensor]] = []
        if kind == "down_proj":
            f = held[2]
            shape = torch.Size((e, held[1], f * etp))
            if local.numel():
                boxes.append(((start + offsets[0], offsets[1], part * f + offsets[2]), local))
        else:
            f = held[1] // 2
            shape = torch.Size((e, 2 * f * etp, held[2]))
            for half in (0, 1):  # rows [half f, (half + 1) f) of the held slice
                lo, hi = max(half * f, offsets[1]), min((half + 1) * f, offsets[1] + sizes[1])
                if lo < hi and sizes[0] and sizes[2]:
                    view = local[:, lo - offsets[1]:hi - offsets[1]]
                    boxes.append(((start + offsets[0],
                                   half * f * etp + part * f + lo - half * f, offsets[2]),
                                  view))
        return ExpertBoxes(shape, boxes, local)


def _named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict under the unparallelized model's names (module docstring)."""
    from graphopt.parallel.pipeline import PipelinedModel, _original

    if isinstance(model, PipelinedModel):
        out: dict[str, torch.Tensor] = {}
        for part in model.parts:
            for name, t in part.state_dict().items():
                out[_original(name, model.prefix)] = t
        return out
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return dict(get_model_state_dict(model))  # type: ignore[arg-type]


class ModelState:
    """A ``torch.distributed.checkpoint`` Stateful over a parallelized model's parameters and
    persistent buffers, named and shaped as the unparallelized model's (module docstring).

    Raises:
        ConfigError: ``model`` was not parallelized by graphopt.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.experts = _Experts(model)
        self._targets: dict[str, torch.Tensor] = {}

    def state_dict(self) -> dict[str, Any]:
        """{name: tensor}: DTensors where sharded (experts over the expert mesh), plain where
        replicated; each aliases this rank's storage."""
        out: dict[str, Any] = {}
        self._targets = {}
        for name, t in _named_tensors(self.model).items():
            self._targets[name] = t
            owner = self.experts.owner(name)
            out[name] = self.experts.global_view(t, owner) if owner is not None else t
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy what ``torch.distributed.checkpoint.load`` wrote into the tensors
        :meth:`state_dict` returned back into the model (a no-op where they alias it).

        Raises:
            KeyError: a name of the model is missing from ``state_dict``.
            ConfigError: a tensor of another shape than this rank's (a one-process state
                dict under EP).
        """
        if not self._targets:
            self.state_dict()
        with torch.no_grad():
            for name, target in self._targets.items():
                loaded = state_dict[name]
                if isinstance(loaded, ExpertBoxes):  # a no-op after DCP's load (it wrote
                    # into these views); another model's state is copied
                    owner = self.experts.owner(name)
                    assert owner is not None
                    loaded.copy_into(self.experts.global_view(target, owner))
                    continue
                src, dst = _local(loaded), _local(target)
                if src.shape != dst.shape:  # a one-process state dict (a review: torch's
                    # "The size of tensor a (2) must match the size of tensor b (4)")
                    raise ConfigError(
                        f"{name}: the state dict holds {list(src.shape)} where this rank "
                        f"holds {list(dst.shape)}: ModelState.load_state_dict copies the "
                        "state_dict() of another ModelState of the same plan. To load a "
                        "one-process state dict, load it into the model before "
                        "graphopt.parallelize, or save it with dcp.save({'model': sd}, "
                        "checkpoint_id=..., no_dist=True) and dcp.load it here (DCP "
                        "reshards; docs/parallel.md, Checkpoints)")
                if src.data_ptr() != dst.data_ptr():
                    dst.copy_(src)


class OptimizerState:
    """A ``torch.distributed.checkpoint`` Stateful over the optimizer of a parallelized model:
    states keyed by the unparallelized model's parameter names, experts' states as global
    DTensors like their parameters (module docstring). Built on
    ``torch.distributed.checkpoint.state_dict.{get,set}_optimizer_state_dict``, which
    initializes empty states with a zero-learning-rate step; for a fresh optimizer that
    step is undone (the live optimizer's states emptied again; the checkpoint holds them
    with step 0). A run resumed from a checkpoint saved before any step (every ``step``
    state 0) starts with an empty optimizer, as a fresh one (Rprop's step sizes, ASGD's
    eta, NAdam's mu_product are then exact too); SGD, which counts no steps, resumes from
    those zero states (exact without dampening).

    ZeRO-1 (``ZeroRedundancyOptimizer``): each rank saves the states of the parameters it
    owns (its local ``.optim``), so the checkpoint again holds each state once.

    Raises:
        ConfigError: ``model`` was not parallelized by graphopt.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        self.zero1 = optimizer if isinstance(optimizer, ZeroRedundancyOptimizer) else None
        self.model = model
        self.optimizer: Any = self.zero1.optim if self.zero1 is not None else optimizer
        self.experts = _Experts(model)
        self._names: dict[str, str] = dict(getattr(model, "original_names", {}))

    def state_dict(self) -> dict[str, Any]:
        """{"state.<name>.<state key>": tensor, "param_groups.<name>.<hyperparameter>":
        value}: torch's flattened optimizer state dict (``StateDictOptions(
        flatten_optimizer_state_dict=True)``, as torchtitan saves it), so a rank holding
        other parameters (another PP split) loads only its own entries."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if self.zero1 is not None:  # ZeroRedundancyOptimizer copies its hyperparameters
            # into .optim only when it steps: a scheduler's newer learning rate was saved
            # one step late (a review: lr 0.005 for 0.00333, resumed parameters 4e-3 off)
            for outer, inner in zip(self.zero1.param_groups, self.optimizer.param_groups):
                inner.update({k: v for k, v in outer.items() if k != "params"})
        fresh = not self.optimizer.state
        with _without_grads(self.optimizer):
            self._own = get_optimizer_state_dict(self.model, self.optimizer, options=_FLAT())
        if fresh:  # torch created the states with a zero-learning-rate step. Left in the
            # live optimizer it counted as a real step (Adam's bias correction: the first
            # update 26% too small; NAdam's mu_product; SGD's dampened momentum started from
            # zeros; found by reviews): the live optimizer is made empty again, its states
            # start at its first real step. The checkpoint keeps these tensors, step 0.
            for key, v in self._own.items():
                if key.endswith(".step") and isinstance(v, torch.Tensor):
                    v.zero_()
            self.optimizer.state.clear()
        self._keys: dict[str, str] = {}
        self._owners: dict[str, tuple[str, int, int]] = {}
        out: dict[str, Any] = {}
        for key, v in self._own.items():
            kind, rest = key.split(".", 1)
            fqn, leaf = rest.rsplit(".", 1)
            name = self._names.get(fqn, fqn)
            owner = self.experts.owner(name) if kind == "state" else None
            new = f"{kind}.{name}.{leaf}"
            self._keys[new] = key
            if owner is not None:
                self._owners[new] = owner
            out[new] = self.experts.global_view(v, owner) \
                if owner is not None and isinstance(v, torch.Tensor) and v.dim() else v
        return out

    def _saved_before_first_step(self) -> bool:
        """Whether the loaded states are those :meth:`state_dict` saves for an optimizer that
        had not stepped: every ``step`` state 0 (they count real steps, the same on every
        rank). Read from the states, so a checkpoint needs no marker of its own (a marker
        key made older checkpoints fail to load: a review). An optimizer without a step
        count (SGD) is never taken for fresh: zero momentum can follow real steps (all
        gradients zero; an expert no token reached, on some ranks only: a re-review), and
        emptying it then would be wrong; SGD with dampening resumed from a save before any
        step therefore starts its momentum from zeros, not from the first gradient."""
        steps = [v for k, v in self._own.items() if k.startswith("state.")
                 and k.endswith(".step")]

        def zero(v: Any) -> bool:
            if isinstance(v, torch.Tensor):
                local = _local(v)
                return not local.numel() or not bool(local.ne(0).any())
            return isinstance(v, (int, float)) and v == 0

        return bool(steps) and all(zero(v) for v in steps)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Give the loaded states and hyperparameters back to the optimizer (states copied
        into the tensors :meth:`state_dict` returned where they do not alias them)."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        if not hasattr(self, "_own"):
            self.state_dict()
        with torch.no_grad():
            for new, key in self._keys.items():
                mine, loaded = self._own[key], state_dict[new]
                if isinstance(loaded, ExpertBoxes):  # as ModelState.load_state_dict
                    assert isinstance(mine, torch.Tensor)
                    loaded.copy_into(self.experts.global_view(mine, self._owners[new]))
                    continue
                if isinstance(mine, torch.Tensor):
                    src, dst = _local(loaded), _local(mine)
                    if src.data_ptr() != dst.data_ptr():
                        dst.copy_(src)
                else:
                    self._own[key] = loaded
        with _without_grads(self.optimizer):
            set_optimizer_state_dict(self.model, self.optimizer, self._own, options=_FLAT())
        if self._saved_before_first_step():  # its states are the zero-learning-rate
            # step's, which a fresh optimizer does not have (a review: Rprop resumed with
            # step sizes of 1e-6, ASGD with eta 0, 5e-2 and 7e-3 off after 3 steps); the
            # optimizer starts as a fresh one does
            self.optimizer.state.clear()
        if self.zero1 is not None:  # its step copies the wrapper's hyperparameters into
            for outer, inner in zip(self.zero1.param_groups, self.optimizer.param_groups):
                outer.update({k: v for k, v in inner.items() if k != "params"})  # .optim


@contextlib.contextmanager
def _without_grads(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """For a fresh optimizer (no states yet), its parameters' gradients set aside: torch's
    state-dict helpers create the states with a zero-learning-rate step only where no
    parameter has a gradient, and otherwise save and load no states at all (a review: a
    warm-up backward before loading left step 2 for 4, parameters 3.5e-2 off)."""
    held: dict[torch.Tensor, torch.Tensor] = {}
    if not optimizer.state:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    held[param], param.grad = param.grad, None
    try:
        yield
    finally:
        for param, grad in held.items():
            param.grad = grad


def _FLAT() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)
