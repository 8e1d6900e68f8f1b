"""The ``torch.compile`` backend, registered as ``graphopt`` through the
``torch_dynamo_backends`` entry point (pyproject.toml), so it works without ``import graphopt``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import fx

from graphopt.config import GraphoptConfig


def compile(model: Any, options: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
    """``torch.compile(model, backend="graphopt", options=options, **kwargs)``, but the options
    are validated now, so a bad option raises :class:`ConfigError` here, not on the first
    call wrapped in Dynamo's ``BackendCompilerFailed``."""
    import torch

    GraphoptConfig.from_options(options, mode=kwargs.get("mode"))
    return torch.compile(model, backend="graphopt", options=dict(options or {}), **kwargs)


def graphopt_backend(gm: fx.GraphModule, example_inputs: Sequence[Any],
                     options: Mapping[str, Any] | GraphoptConfig | None = None,
                     mode: str | None = None) -> Callable[..., Any]:
    """Compile one Dynamo graph with graphopt.

    Args:
        gm: Dynamo's FX graph (Torch IR).
        example_inputs: the graph's inputs (tensors, ints for dynamic sizes).
        options: the dict given as ``torch.compile(..., options=...)``; see
            :class:`graphopt.config.GraphoptConfig` for keys.
        mode: ``torch.compile``'s mode, used by the inductor lowering.

    Raises:
        ConfigError, LoweringUnavailableError: bad options, before any compile work.
        PassFailedError: a pass failed; names it and the passes before it.
        VerificationError: ``verify`` found a numeric mismatch caused by an exact pass.
    """
    config = GraphoptConfig.from_options(options, mode=mode)
    from graphopt.pipeline import compile_graph

    return compile_graph(gm, example_inputs, config)
