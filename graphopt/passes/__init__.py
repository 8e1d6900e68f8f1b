"""Pass registry (name -> lazy import) and the default pipeline, as data.

Model: xDSL ``xdsl/transforms/__init__.py``. Tests and plugins add passes with
:func:`register_pass`; users turn default passes off with ``options={"disable": [...]}`` and
add registered ones with ``options={"enable": [...]}``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from graphopt.passes.base import STAGES, GraphPass, PassContext, PassResult, Stage

if TYPE_CHECKING:
    from graphopt.config import GraphoptConfig

__all__ = [
    "GraphPass",
    "PassContext",
    "PassResult",
    "Stage",
    "build_pipeline",
    "default_pipeline_names",
    "get_pass",
    "option_keys",
    "register_pass",
    "registered_pass_names",
]

_LAZY: dict[str, str] = {
    "attention": "graphopt.passes.attention:AttentionPass",
    "remove_noops": "graphopt.passes.remove_noops:RemoveNoopsPass",
    "cse": "graphopt.passes.cse:CSEPass",
    "remat": "graphopt.passes.remat:RematPass",
    "moe": "graphopt.passes.moe:MoEPass",
}
_LOADED: dict[str, type[GraphPass]] = {}
_OPTION_KEYS: dict[str, str] = {"moe": "moe", "remat": "remat", "lightning": "attention"}
"""``torch.compile`` options key -> the pass that owns (parses) that section."""

# The default pipeline. Order within a stage matters:
PIPELINE: dict[Stage, tuple[str, ...]] = {
    "pre_autograd": (
        "attention",  # first: matches loops exactly as Dynamo unrolled them
        "moe",  # before CSE/noop removal: finds experts regions by their module boundary
        "remove_noops",  # before CSE: canonical operands let CSE see identical expressions
        "cse",
    ),
    "joint": (),  # remat/partition and comm-overlap passes land here
}


def register_pass(cls: type[GraphPass]) -> type[GraphPass]:
    """Register a pass class under ``cls.name`` (usable as a decorator).

    Raises:
        ValueError: the name is taken by another class, or the stage is unknown.
    """
    if cls.stage not in STAGES:
        raise ValueError(f"pass {cls.name!r} has unknown stage {cls.stage!r}; stages: {STAGES}")
    existing = _LOADED.get(cls.name)
    if (existing is not None and existing is not cls) or (
        cls.name in _LAZY and not _LAZY[cls.name].endswith(":" + cls.__name__)
    ):
        raise ValueError(f"a different pass is already registered as {cls.name!r}")
    _LOADED[cls.name] = cls
    if cls.options_key is not None:
        _OPTION_KEYS.setdefault(cls.options_key, cls.name)
    return cls


def get_pass(name: str) -> type[GraphPass]:
    """The pass class registered as ``name``. Raises KeyError listing the valid names."""
    if name not in _LOADED:
        if name not in _LAZY:
            raise KeyError(f"unknown pass {name!r}; registered: {registered_pass_names()}")
        module, attr = _LAZY[name].split(":")
        _LOADED[name] = getattr(importlib.import_module(module), attr)
    return _LOADED[name]


def option_keys() -> dict[str, str]:
    """Options keys owned by passes -> pass name (e.g. {"moe": "moe", "remat": "remat"})."""
    return dict(_OPTION_KEYS)


def registered_pass_names() -> list[str]:
    return sorted(set(_LAZY) | set(_LOADED))


def default_pipeline_names() -> list[str]:
    return [name for stage in STAGES for name in PIPELINE[stage]]


def build_pipeline(config: GraphoptConfig, stage: Stage) -> list[GraphPass]:
    """The passes of ``stage`` for ``config``: the defaults minus ``disable``, then ``enable``."""
    names = [n for n in PIPELINE[stage] if n not in config.disable]
    names += [n for key, n in _OPTION_KEYS.items() if key in config.pass_options
              and get_pass(n).stage == stage and n not in names  # on when options given,
              and n not in config.disable]  # unless verify's bisection turned it off
    names += [n for n in config.enable if get_pass(n).stage == stage and n not in names]
    return [get_pass(n).from_config(config) for n in names]
