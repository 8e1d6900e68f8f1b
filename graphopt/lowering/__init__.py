"""Lowerings: how the transformed graph is turned into something that runs.

The table is keyed by name; ``auto`` resolves by the device of the example inputs ("npu" for
Ascend NPU tensors, else "inductor"). An unknown name lists the valid ones. Every lowering
runs AOTAutograd on the model-pass output and calls back into graphopt (:class:`AOTHooks`)
so joint passes, dumps and timing are the same whatever compiles the graphs.
Model: JAX ``register_lowering(..., platform=...)``, Thunder executors.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch

from graphopt.errors import ConfigError, LoweringUnavailableError
from graphopt.lowering.base import AOTHooks, Lowering

__all__ = ["AOTHooks", "Lowering", "get_lowering", "require_npu", "resolve_lowering_name"]

_TABLE: dict[str, str] = {
    "eager": "graphopt.lowering.eager:EagerLowering",
    "inductor": "graphopt.lowering.inductor:InductorLowering",
    "npu": "graphopt.lowering.npu:NpuLowering",
}


def resolve_lowering_name(name: str, example_inputs: Sequence[Any]) -> str:
    """Resolve ``auto`` by the device of the tensor inputs; other names pass through."""
    if name != "auto":
        return name
    devices = {x.device.type for x in example_inputs if isinstance(x, torch.Tensor)}
    return "npu" if "npu" in devices else "inductor"


def get_lowering(name: str, example_inputs: Sequence[Any]) -> Lowering:
    """The lowering called ``name`` (after resolving ``auto``)."""
    name = resolve_lowering_name(name, example_inputs)
    if name not in _TABLE:
        raise ConfigError(f"unknown lowering {name!r}; valid: auto, {', '.join(_TABLE)}")
    module, attr = _TABLE[name].split(":")
    cls = getattr(importlib.import_module(module), attr)
    return cls()


def require_npu() -> None:
    """Raise :class:`LoweringUnavailableError` unless torch_npu and the torchair it ships
    can be imported (names what is missing and the fix)."""
    from graphopt.config import npu_available

    if not npu_available():
        raise LoweringUnavailableError(
            "lowering='npu' needs torch_npu (with its bundled torchair) and the Ascend CANN "
            "toolkit: on an Ascend machine install CANN, then torch_npu matching your torch "
            "(`pip install torch-npu==<your torch version>`, or `pip install "
            "'graphopt[npu]'`), or use lowering='inductor' or 'eager' here"
        )
    try:  # installed is not importable: without the CANN toolkit's environment it fails at
        # import, which surfaced at the first call inside Dynamo's error (a review)
        importlib.import_module("torch_npu")
    except Exception as exc:  # noqa: BLE001 - named in the error
        raise LoweringUnavailableError(
            f"lowering='npu': torch_npu is installed but does not import ({type(exc).__name__}: "
            f"{exc}); source the Ascend CANN toolkit's set_env.sh (and check that torch_npu "
            "matches your torch), or use lowering='inductor' or 'eager' here") from exc
    try:  # the graph compiler: torchair, bundled with torch_npu since 2.1; an older or
        # partial install imported torch_npu and failed on torchair at the first call, as a
        # bare ModuleNotFoundError inside Dynamo's error (a review)
        torchair = importlib.import_module("torchair")
        # what NpuLowering calls: an older torchair without them passed this check and
        # failed at the first call (No module named 'torchair.configs', a review)
        importlib.import_module("torchair.configs.compiler_config").CompilerConfig  # noqa: B018
        torchair.get_compiler  # noqa: B018
    except Exception as exc:  # noqa: BLE001 - named in the error
        raise LoweringUnavailableError(
            f"lowering='npu': torch_npu imports but its graph compiler torchair does not "
            f"({type(exc).__name__}: {exc}); install a torch_npu that bundles torchair "
            "(2.1 or later, matching your torch), or use lowering='inductor' or 'eager' "
            "here") from exc
