"""Kernels graphopt rewrites into (Lightning Attention, MoE permute/grouped GEMM, comm)."""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd import forward_ad


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of graphopt's kernels for inputs of ``dtype``: float64 kept,
    everything else (bf16, fp16, fp32) accumulated in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def has_tangent(*values: Any) -> bool:
    """Whether a tensor among ``values`` carries a forward-mode AD tangent (a dual tensor of
    the current ``torch.autograd.forward_ad.dual_level``)."""
    return forward_ad._current_level >= 0 and any(
        isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent is not None
        for t in values)


def refuse_forward_ad(op: str, *tensors: Any) -> None:
    """Raise when forward-mode AD tangents (``torch.autograd.forward_ad`` dual tensors) reach
    graphopt's op ``op``: its custom ops have backward formulas only, and a custom op whose
    inputs carry tangents but no ``requires_grad`` runs below autograd and drops them, which
    would be a silently zero tangent. Skipped while Dynamo traces: graphopt's backend
    refuses tangents at run time where its graph calls these ops (graphopt.pipeline);
    other backends drop them (aot_eager and inductor too).

    Raises:
        NotImplementedError: a tensor in ``tensors`` carries a tangent.
    """
    if not torch.compiler.is_compiling() and has_tangent(*tensors):
        raise NotImplementedError(
            f"{op} has no forward-mode AD formula (its tangent would be dropped silently): "
            "use reverse mode (backward, torch.func.vjp/jacrev), or the model's own "
            "PyTorch code for this computation")
