"""Kernels graphopt rewrites into (Lightning Attention, MoE permute/grouped GEMM, comm)."""

from __future__ import annotations

from typing import Any

import torch


def refuse_forward_ad(op: str, *tensors: Any) -> None:
    """Raise when forward-mode AD tangents (``torch.autograd.forward_ad`` dual tensors) reach
    graphopt's op ``op``: its custom ops have backward formulas only, and a custom op whose
    inputs carry tangents but no ``requires_grad`` runs below autograd and drops them, which
    would be a silently zero tangent. Skipped while Dynamo traces (a compiled graph with
    graphopt's ops runs tangent-carrying calls on Dynamo's captured graph instead: see
    graphopt.pipeline).

    Raises:
        NotImplementedError: a tensor in ``tensors`` carries a tangent.
    """
    from torch.autograd import forward_ad

    if forward_ad._current_level < 0 or torch.compiler.is_compiling():
        return
    if any(isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent is not None
           for t in tensors):
        raise NotImplementedError(
            f"{op} has no forward-mode AD formula (its tangent would be dropped silently): "
            "use reverse mode (backward, torch.func.vjp/jacrev), or the model's own "
            "PyTorch code for this computation")
