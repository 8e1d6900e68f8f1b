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

Refused (ConfigError): a model graphopt did not parallelize; tensor-parallel experts
(expert_tp > 1: each rank holds two chunks of ``gate_up_proj``, its slice of the gate half
and of the up half, and DCP takes one chunk per rank and tensor).

Pseudo-code::

    model_state: sd = get_model_state_dict(model) (PP: each stage's state_dict, names mapped)
                 for experts parameters: sd[name] = DTensor.from_local(local, expert mesh, ...)
    load: dcp.load writes into those tensors in place (they alias the parameters); anything
          that does not alias is copied back.
"""

from __future__ import annotations

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


class _Experts:
    """Views of this rank's expert tensors as DTensors of the global [E, ...] (module
    docstring)."""

    def __init__(self, model: nn.Module) -> None:
        report = _report(model)
        self.experts: dict[str, tuple[int, int, int]] = dict(report.experts)
        self.plan, self.mesh = report.parallel_plan, report.mesh
        if self.experts and self.plan.expert_tp > 1:
            raise ConfigError(
                f"checkpoints of tensor-parallel experts (expert_tp={self.plan.expert_tp}) "
                "are not written: each TP rank holds a slice of both halves of gate_up_proj "
                "[E, 2F, H], two chunks per rank, which torch.distributed.checkpoint cannot "
                "describe (one chunk per rank and tensor; a strided placement was saved as "
                "overlapping chunks). Train runs that save or resume with expert_tp=1")

    def owner(self, name: str) -> int | None:
        """E (the global expert count) if ``name`` is an experts parameter, else None."""
        for path, (_, _, e) in self.experts.items():
            if name in (f"{path}.gate_up_proj", f"{path}.down_proj"):
                return e
        return None

    def global_view(self, t: torch.Tensor, e: int) -> torch.Tensor:
        """This rank's experts tensor ``t`` ([E/ep, ...], plain or an FSDP2 DTensor over
        edp_shard) as a DTensor [E, ...] sharing its storage."""
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor.placement_types import _StridedShard

        from graphopt.parallel.mesh import expert_mesh

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
            e = self.experts.owner(name)
            out[name] = self.experts.global_view(t, e) if e is not None else t
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy what ``torch.distributed.checkpoint.load`` wrote into the tensors
        :meth:`state_dict` returned back into the model (a no-op where they alias it).

        Raises:
            KeyError: a name of the model is missing from ``state_dict``.
        """
        if not self._targets:
            self.state_dict()
        with torch.no_grad():
            for name, target in self._targets.items():
                src, dst = _local(state_dict[name]), _local(target)
                if src.data_ptr() != dst.data_ptr():
                    dst.copy_(src)


class OptimizerState:
    """A ``torch.distributed.checkpoint`` Stateful over the optimizer of a parallelized model:
    states keyed by the unparallelized model's parameter names, experts' states as global
    DTensors like their parameters (module docstring). Built on
    ``torch.distributed.checkpoint.state_dict.{get,set}_optimizer_state_dict``, which
    initializes empty states with a zero-learning-rate step; for a fresh optimizer that
    step is undone (the live optimizer's states emptied again; the checkpoint holds them
    with step 0). A run resumed from a checkpoint saved before any step starts from those
    zero states: exact for Adam/AdamW, not for NAdam (mu_product) or SGD with dampening.

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

        fresh = not self.optimizer.state
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
        out: dict[str, Any] = {}
        for key, v in self._own.items():
            kind, rest = key.split(".", 1)
            fqn, leaf = rest.rsplit(".", 1)
            name = self._names.get(fqn, fqn)
            e = self.experts.owner(name) if kind == "state" else None
            new = f"{kind}.{name}.{leaf}"
            self._keys[new] = key
            out[new] = self.experts.global_view(v, e) \
                if e is not None and isinstance(v, torch.Tensor) and v.dim() else v
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Give the loaded states and hyperparameters back to the optimizer (states copied
        into the tensors :meth:`state_dict` returned where they do not alias them)."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        if not hasattr(self, "_own"):
            self.state_dict()
        with torch.no_grad():
            for new, key in self._keys.items():
                mine, loaded = self._own[key], state_dict[new]
                if isinstance(mine, torch.Tensor):
                    src, dst = _local(loaded), _local(mine)
                    if src.data_ptr() != dst.data_ptr():
                        dst.copy_(src)
                else:
                    self._own[key] = loaded
        set_optimizer_state_dict(self.model, self.optimizer, self._own, options=_FLAT())
        if self.zero1 is not None:  # its step copies the wrapper's hyperparameters into
            for outer, inner in zip(self.zero1.param_groups, self.optimizer.param_groups):
                outer.update({k: v for k, v in inner.items() if k != "params"})  # .optim


def _FLAT() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)
