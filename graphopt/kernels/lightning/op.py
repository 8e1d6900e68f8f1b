"""``graphopt::lightning_attention``: the custom op (fake impl + autograd) and its public API.

Layout convention: "bhsd" (q [B, Hq, S, D], heads before sequence, as SDPA and transformers'
MiniMax use after their transpose). ``layout="bshd"`` (flash-linear-attention's convention)
is accepted and costs two transposes (views, no copy).

The forward op returns (o, final state, checkpoints); the checkpoints (the state at the start
of every r-th block, n states flattened to [B, Hq, n * D, Dv]) are what the backward op
needs, so autograd saves q, k, v, slope and those states only (see chunked.py for the
selective rematerialization).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import torch

from graphopt.kernels import (
    eager_function,
    functorch_active,
    plain_eager,
    refuse_double_backward,
    refuse_forward_ad,
    transformable,
)
from graphopt.kernels.lightning.chunked import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CHECKPOINT_EVERY,
    acc_dtype,
    chunked_backward,
    chunked_forward,
    num_checkpoints,
)
from graphopt.kernels.lightning.reference import expand_kv
from graphopt.kernels.lightning.triton_kernels import (
    chunk_rows,
    packed_chunk_size,
    triton_available,
    triton_backward,
    triton_forward,
    triton_varlen_backward,
    triton_varlen_forward,
)

Tensor = torch.Tensor


def _reduce_kv(x: Tensor, hk: int) -> Tensor:
    """[B, Hq, S, X] gradients of expanded heads -> [B, Hk, S, X] (sum over each group)."""
    b, hq, s, d = x.shape
    return x if hq == hk else x.view(b, hk, hq // hk, s, d).sum(dim=2)


IMPLS = ("auto", "chunked", "triton")


TRITON_MAX_HEAD_DIM = 256
"""Largest D / Dv the Triton kernels take on a GPU. The chunk-parallel kernels tile D and Dv
by at most 64, so a program holds [C, C] and [C, 64] fp32 tiles whatever the head dim (the
per-(batch, head) kernel they replaced kept the whole [D, Dv] state and needed 416 KB of
shared memory at D = Dv = 128 on an H200). Beyond 256 "auto" takes the chunked kernel."""


def stored_checkpoints(seq: int, block_size: int, checkpoint_every: int, impl: str,
                       has_initial_state: bool) -> int:
    """States the forward keeps for the backward: ceil(floor(S / C) / r) + 1 on the chunked
    path (its backward walks the chunks from them), on Triton the initial state if there is
    one, else none (its backward recomputes every chunk's state from the initial one, or
    from zero, in two parallel passes)."""
    if impl == "triton":
        return int(has_initial_state)
    return num_checkpoints(seq, block_size, checkpoint_every)


def saved_bytes(q_shape: tuple[int, ...], k_shape: tuple[int, ...], v_shape: tuple[int, ...],
                dtype: torch.dtype, block_size: int = DEFAULT_BLOCK_SIZE,
                checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY, impl: str = "chunked",
                has_initial_state: bool = False,
                slope_dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """Bytes autograd keeps for the backward of one ``lightning_attention`` call ("bhsd"
    shapes q [B, Hq, S, D], k [B, Hk, S, D], v [B, Hk, S, Dv]; inputs in ``dtype``, the
    slope [Hq] in ``slope_dtype``; impl "chunked" or "triton", as resolved): (what the op
    saves: q, k, v, the slope and
    :func:`stored_checkpoints` states [B, Hq, D, Dv] in the accumulation dtype, where
    ``has_initial_state`` says whether the call passes an ``initial_state``; what saving
    every chunk's state would take instead: q, k, v, slope and ceil(S / C) states).
    Selective rematerialization (EPLoN's idea, see chunked.py)."""
    b, hq, s, d = q_shape
    dv = v_shape[-1]
    item = torch.empty(0, dtype=dtype).element_size()
    state = b * hq * d * dv * torch.empty(0, dtype=acc_dtype(dtype)).element_size()
    inputs = (_numel(q_shape) + _numel(k_shape) + _numel(v_shape)) * item + \
        hq * torch.empty(0, dtype=slope_dtype).element_size()
    kept = stored_checkpoints(s, block_size, checkpoint_every, impl, has_initial_state)
    return (inputs + kept * state,
            inputs + -(-s // block_size) * state)


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def resolve_impl(impl: str, device: torch.device, head_dim: int = 0,
                 dtype: torch.dtype | None = None) -> str:
    """"auto": Triton on GPU/NPU when triton is installed, ``head_dim`` (max of D, Dv)
    <= TRITON_MAX_HEAD_DIM (256) and the inputs are not float64 (the Triton kernels compute
    in float32; float64 keeps its accuracy on the chunked path), else the chunked PyTorch
    code.

    Raises:
        ValueError: unknown impl; impl="triton" on a GPU with a head dim it cannot run, or
            with float64 inputs.
        RuntimeError: impl="triton" without triton installed, or for CPU tensors without
            Triton's interpreter (TRITON_INTERPRET=1 when Python started).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    too_big = device.type != "cpu" and head_dim > TRITON_MAX_HEAD_DIM
    fp64 = dtype == torch.float64
    if impl == "auto":
        return "triton" if device.type in ("cuda", "npu", "xpu") and triton_available() \
            and not too_big and not fp64 else "chunked"
    if impl == "triton" and not triton_available():
        raise RuntimeError("impl='triton' needs triton: pip install 'graphopt[triton]' "
                           "(triton-ascend on NPU); on CPU also set TRITON_INTERPRET=1")
    if impl == "triton" and too_big:
        raise ValueError(
            f"impl='triton' supports head dims up to {TRITON_MAX_HEAD_DIM} on GPUs, got "
            f"{head_dim}; use impl='chunked' or 'auto'")
    if impl == "triton" and fp64:
        raise ValueError("impl='triton' computes in float32 and would lose float64 inputs' "
                         "accuracy; use impl='chunked' or 'auto' (both keep float64), or "
                         "cast the inputs to float32")
    if impl == "triton" and device.type == "cpu":
        from graphopt.kernels.lightning.triton_kernels import INTERPRETED

        if not INTERPRETED:
            raise RuntimeError(
                "impl='triton' on CPU tensors runs Triton's interpreter, which is chosen when "
                "triton is imported: start Python with TRITON_INTERPRET=1, or use "
                "impl='chunked' / 'auto' on CPU")
    return impl


def _effective_block(impl: str, block: int) -> int:
    """Triton tiles need a power-of-two block length >= 16."""
    return max(16, 1 << (block - 1).bit_length()) if impl == "triton" else block


def _forward_impl(q: Tensor, k: Tensor, v: Tensor, slope: Tensor, scale: float,
                  initial_state: Tensor | None, block_size: int, checkpoint_every: int,
                  impl: str) -> tuple[Tensor, Tensor, Tensor]:
    """``graphopt::lightning_attention_fwd``'s implementation (also run directly by
    :class:`_EagerLightning`). Checks its arguments (:func:`validate`): a graph may call
    the op directly, and the Triton kernels would read K/V heads out of bounds."""
    validate(q, k, v, slope, initial_state, dtypes=False)
    hq = q.shape[1]
    if impl == "triton":  # GQA in the kernels: K/V head h // (Hq / Hk), nothing expanded
        o, state, ckpt = triton_forward(q, k, v, slope, scale, initial_state, block_size)
    else:
        o, state, ckpt = chunked_forward(q, expand_kv(k, hq), expand_kv(v, hq), slope, scale,
                                         initial_state, block_size, checkpoint_every)
    # Outputs are contiguous whatever the input strides: the fake implementation says so.
    # Checkpoints are returned as [B, Hq, n * D, Dv] (see the fake implementation).
    b, h, n, d, dv = ckpt.shape
    return (o.to(q.dtype).contiguous(), state.to(acc_dtype(q.dtype)).contiguous(),
            ckpt.to(acc_dtype(q.dtype)).reshape(b, h, n * d, dv).contiguous())


lightning_attention_fwd = torch.library.custom_op("graphopt::lightning_attention_fwd",
                                                  mutates_args=())(_forward_impl)


@lightning_attention_fwd.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, slope: Tensor, scale: float,
      initial_state: Tensor | None, block_size: int,
      checkpoint_every: int, impl: str) -> tuple[Tensor, Tensor, Tensor]:
    b, hq, s, d = q.shape
    dv = v.shape[-1]
    acc = acc_dtype(q.dtype)
    n = stored_checkpoints(s, block_size, checkpoint_every, impl, initial_state is not None)
    # The n checkpoint states are flattened into one [n * D] dim: with a symbolic sequence
    # length, n may be 1 for some lengths, and tracing (torch.export) would guard on n != 1
    # when it computes the output's contiguity; n * D >= D > 1 is known without a guard.
    return (q.new_empty(b, hq, s, dv), q.new_empty(b, hq, d, dv, dtype=acc),
            q.new_empty(b, hq, n * d, dv, dtype=acc))


def _backward_impl(grad_o: Tensor, grad_state: Tensor | None, q: Tensor, k: Tensor,
                   v: Tensor, slope: Tensor, scale: float, checkpoints: Tensor,
                   block_size: int, checkpoint_every: int, need_slope_grad: bool,
                   impl: str, need_q: bool = True, need_kv: bool = True
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv, dslope, d initial_state) of ``lightning_attention_fwd`` in
    the inputs' shapes and dtypes. ``need_q`` / ``need_kv`` False (q, resp. k, v and the
    initial state, need no gradient): that part is not computed and returned as zeros
    (the chunked path skips the reverse state scan and the dK/dV products, Triton its dQ
    or dK/dV launches), unless ``need_slope_grad``, which reads both; dslope is zeros
    without ``need_slope_grad``."""
    return _gradients(grad_o, grad_state, q, k, v, slope, scale, checkpoints, block_size,
                      checkpoint_every, need_slope_grad, impl, need_q, need_kv,
                      slope_zeros=True)  # type: ignore[return-value]


def _gradients(grad_o: Tensor, grad_state: Tensor | None, q: Tensor, k: Tensor, v: Tensor,
               slope: Tensor, scale: float, checkpoints: Tensor, block_size: int,
               checkpoint_every: int, need_slope_grad: bool, impl: str, need_q: bool = True,
               need_kv: bool = True, *, slope_zeros: bool = False
               ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor]:
    """:func:`_backward_impl`; dslope is None without ``need_slope_grad`` unless
    ``slope_zeros`` (the custom op's schema returns a tensor; the eager backward,
    :class:`_EagerLightning`, discards it, and a zero fill is a kernel launch on a GPU)."""
    b, hq, _, d = q.shape
    if b * hq == 0:  # an empty batch: nothing flows back
        zeros = q.new_zeros(b, hq, d, v.shape[-1], dtype=acc_dtype(q.dtype))
        dslope = slope.new_zeros(slope.shape) if need_slope_grad else None
        return _input_grads((torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v),
                             dslope, zeros), q, k, v, slope, slope_zeros)
    count = checkpoints.shape[2] // d  # stored_checkpoints(...), flattened by the forward
    checkpoints = checkpoints.view(b, hq, count, d, v.shape[-1])
    kk, vv = _kernel_kv(k, v, hq, impl)
    if impl == "triton":
        grads = triton_backward(grad_o, grad_state, q, kk, vv, slope, scale, checkpoints,
                                block_size, need_slope_grad, need_q, need_kv)
    else:
        grads = chunked_backward(grad_o, grad_state, q, kk, vv, slope, scale, checkpoints,
                                 block_size, checkpoint_every, need_slope_grad, need_q,
                                 need_kv)
    return _input_grads(grads, q, k, v, slope, slope_zeros)


lightning_attention_bwd = torch.library.custom_op("graphopt::lightning_attention_bwd",
                                                  mutates_args=())(_backward_impl)


def _kernel_kv(k: Tensor, v: Tensor, hq: int, impl: str) -> tuple[Tensor, Tensor]:
    """K, V as the kernels take them: Triton reads GQA in place, chunked wants Hq heads."""
    return (k, v) if impl == "triton" else (expand_kv(k, hq), expand_kv(v, hq))


def _input_grads(grads: tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor], q: Tensor,
                 k: Tensor, v: Tensor, slope: Tensor, slope_zeros: bool = True
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor]:
    """Kernel gradients (dk, dv per query head from the chunked kernel, per K/V head from
    Triton) -> the inputs' shapes, dtypes and layouts (:func:`_in_layout`): each GQA group
    summed where the kernel did not; dslope, when it was not asked for, zeros if
    ``slope_zeros`` else None."""
    dq, dk, dv, dslope, dstate = grads
    hk = k.shape[1]
    if dslope is None and slope_zeros:
        dslope = slope.new_zeros(slope.shape)
    return (_in_layout(dq.to(q.dtype), q), _in_layout(_reduce_kv(dk, hk).to(k.dtype), k),
            _in_layout(_reduce_kv(dv, hk).to(v.dtype), v),
            None if dslope is None else dslope.to(slope.dtype).contiguous(),
            dstate.to(acc_dtype(q.dtype)).contiguous())


def _in_layout(grad: Tensor, like: Tensor) -> Tensor:
    """``grad`` in the memory layout ``torch.empty_like(like)`` has: ``like``'s strides where
    it is dense (a transposed view of a projection, as q/k/v usually are), contiguous
    otherwise. The fake kernels return the same layout. Contiguous gradients of transposed
    inputs met a torch 2.13 fake/real stride mismatch: ``elu_backward`` of a contiguous
    gradient and a transposed input is contiguous when run, transposed under fake tensors,
    so the traced backward viewed it as the transposed layout and failed at run time (a
    hand-written linear attention with ``elu(q) + 1`` features)."""
    if like.is_contiguous():
        return grad.contiguous()
    out = torch.empty_like(like)
    return grad if out.stride() == grad.stride() else out.copy_(grad)


@lightning_attention_bwd.register_fake
def _(grad_o: Tensor, grad_state: Tensor | None, q: Tensor, k: Tensor, v: Tensor,
      slope: Tensor, scale: float, checkpoints: Tensor, block_size: int,
      checkpoint_every: int, need_slope_grad: bool, impl: str, need_q: bool = True,
      need_kv: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    b, hq, _, d = q.shape
    acc = acc_dtype(q.dtype)
    # In the inputs' layouts, as the real implementation returns them (_in_layout).
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            slope.new_empty(slope.shape), q.new_empty(b, hq, d, v.shape[-1], dtype=acc))


def _setup_context(ctx: Any, inputs: tuple,
                   output: tuple) -> None:
    q, k, v, slope, scale, initial_state, block_size, checkpoint_every, impl = inputs
    ctx.save_for_backward(q, k, v, slope, output[2])
    # The checkpoints are the backward's state, not a result (no gradient flows into them),
    # and unused outputs get None, not a zero-filled gradient (the checkpoints' [B, Hq, n * D,
    # Dv] and the final state's when only o reaches the loss; _backward handles None).
    ctx.mark_non_differentiable(output[2])
    ctx.set_materialize_grads(False)
    ctx.scale, ctx.block_size, ctx.checkpoint_every = scale, block_size, checkpoint_every
    ctx.impl = impl
    ctx.has_initial_state = initial_state is not None


def _backward(ctx: Any, grad_o: Tensor | None,
              grad_state: Tensor | None, _grad_ckpt: Tensor | None,
              backward_op: Callable[..., tuple] | None = None) -> tuple:
    """The forward op's backward; ``backward_op``: what computes the gradients (None: the
    custom op ``lightning_attention_bwd``; _EagerLightning passes its implementation)."""
    q, k, v, slope, ckpt = ctx.saved_tensors
    if grad_o is None:
        grad_o = torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)
    need = ctx.needs_input_grad
    dq, dk, dv, dslope, dstate = (backward_op or lightning_attention_bwd)(
        grad_o, grad_state, q, k, v, slope, ctx.scale, ckpt, ctx.block_size,
        ctx.checkpoint_every, bool(need[3]), ctx.impl, bool(need[0]),
        bool(need[1] or need[2] or (ctx.has_initial_state and need[5])))
    return (dq, dk, dv, dslope if need[3] else None, None,
            dstate if ctx.has_initial_state else None, None, None, None)


lightning_attention_fwd.register_autograd(_backward, setup_context=_setup_context)
_NO_DOUBLE_BACKWARD = ("compute that term with graphopt.kernels.lightning."
                       "lightning_attention_reference (plain PyTorch ops, differentiable "
                       "twice), or keep the model's own attention for it (options "
                       "{'attention': 'keep'})")
refuse_double_backward(lightning_attention_bwd, "graphopt::lightning_attention",
                       _NO_DOUBLE_BACKWARD)
_FUNCTORCH = transformable("graphopt::lightning_attention", lightning_attention_fwd,
                           _setup_context, _backward)


_EagerLightning = eager_function("_EagerLightning", _forward_impl, _setup_context,
                                 _backward, _gradients)
"""What :func:`lightning_attention` runs in plain eager mode (graphopt.kernels.eager_function:
the op's own setup and backward around its implementation, without the custom op's Python
dispatch, ~50 us of host time per forward+backward, benchmarks/lightning_host.py; a
launch-bound step on a GPU, B=1, H=8, S=4k, is all host time)."""


def _spans(cu_seqlens: Tensor) -> list[tuple[int, int]]:
    bounds = [int(x) for x in cu_seqlens.tolist()]
    return list(zip(bounds, bounds[1:]))


def _chunked_varlen_forward(q: Tensor, k: Tensor, v: Tensor, slope: Tensor, scale: float,
                            initial_state: Tensor | None, block_size: int, cu_seqlens: Tensor
                            ) -> tuple[Tensor, Tensor]:
    """The chunked PyTorch path of packed sequences: one chunked forward per sequence (the
    boundaries are read on the host: this is the CPU / fallback path)."""
    outs, finals = [], []
    for i, (a, b) in enumerate(_spans(cu_seqlens)):
        h0 = initial_state[i:i + 1] if initial_state is not None else None
        o, final, _ = chunked_forward(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], slope, scale,
                                      h0, block_size, DEFAULT_CHECKPOINT_EVERY)
        outs.append(o)
        finals.append(final)
    return torch.cat(outs, dim=2), torch.cat(finals, dim=0)


def _chunked_varlen_backward(grad_o: Tensor, grad_state: Tensor | None, q: Tensor, k: Tensor,
                             v: Tensor, slope: Tensor, scale: float,
                             initial_state: Tensor | None, block_size: int,
                             cu_seqlens: Tensor, need_slope_grad: bool
                             ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor]:
    """Per sequence: its checkpoints again (one chunked forward), then its backward."""
    every = DEFAULT_CHECKPOINT_EVERY
    grads: list[tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor]] = []
    for i, (a, b) in enumerate(_spans(cu_seqlens)):
        h0 = initial_state[i:i + 1] if initial_state is not None else None
        qs, ks, vs = q[:, :, a:b], k[:, :, a:b], v[:, :, a:b]
        _, _, ckpt = chunked_forward(qs, ks, vs, slope, scale, h0, block_size, every)
        gs = grad_state[i:i + 1] if grad_state is not None else None
        grads.append(chunked_backward(grad_o[:, :, a:b], gs, qs, ks, vs, slope, scale, ckpt,
                                      block_size, every, need_slope_grad))
    dq, dk, dv = (torch.cat([g[j] for g in grads], dim=2) for j in range(3))  # type: ignore
    dslope = torch.stack([g[3] for g in grads]).sum(0) if need_slope_grad else None  # type: ignore
    return dq, dk, dv, dslope, torch.cat([g[4] for g in grads], dim=0)


def _varlen_forward_impl(q: Tensor, k: Tensor, v: Tensor, slope: Tensor, scale: float,
                         initial_state: Tensor | None, cu_seqlens: Tensor, block_size: int,
                         impl: str) -> tuple[Tensor, Tensor, Tensor]:
    """Packed sequences (see :func:`lightning_attention`'s ``cu_seqlens``): q [1, Hq, T, D],
    k [1, Hk, T, D], v [1, Hk, T, Dv], slope [Hq], initial_state [N, Hq, D, Dv] or None,
    cu_seqlens [N + 1] int on q's device (validated by the caller). Returns (o [1, Hq, T, Dv]
    in q's dtype, final states [N, Hq, D, Dv] float32 (float64 for float64 inputs), the
    chunk slots for the backward: int32 [triton_kernels.packed_chunk_size(T, N, chunk
    rows)] on Triton (built once in the forward, one launch), [0] on the chunked path).
    ``graphopt::lightning_attention_varlen_fwd``'s implementation; checks the shapes of
    q, k, v and slope (:func:`validate`) and cu_seqlens for graphs that call the op
    directly (a review: a bad packing on the chunked path returned outputs of another
    length than q's, where the Triton path raised)."""
    validate(q, k, v, slope, None, dtypes=False)
    _check_cu_seqlens(cu_seqlens, q.shape[2], q.device, kernel_checks=impl == "triton")
    hq = q.shape[1]
    if impl == "triton":
        o, final, chunks = triton_varlen_forward(q, k, v, slope, scale, initial_state,
                                                 block_size, cu_seqlens)
    else:
        o, final = _chunked_varlen_forward(q, *_kernel_kv(k, v, hq, impl), slope, scale,
                                           initial_state, block_size, cu_seqlens)
        chunks = cu_seqlens.new_empty(0, dtype=torch.int32)
    return o.to(q.dtype).contiguous(), final.to(acc_dtype(q.dtype)).contiguous(), chunks


lightning_attention_varlen_fwd = torch.library.custom_op(
    "graphopt::lightning_attention_varlen_fwd", mutates_args=())(_varlen_forward_impl)


@lightning_attention_varlen_fwd.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, slope: Tensor, scale: float,
      initial_state: Tensor | None, cu_seqlens: Tensor, block_size: int, impl: str
      ) -> tuple[Tensor, Tensor, Tensor]:
    _, hq, total, d = q.shape
    n = cu_seqlens.shape[0] - 1
    chunks = packed_chunk_size(total, n, chunk_rows(d, v.shape[-1], block_size)) \
        if impl == "triton" else 0
    return (q.new_empty(1, hq, total, v.shape[-1]),
            q.new_empty(n, hq, d, v.shape[-1], dtype=acc_dtype(q.dtype)),
            q.new_empty(chunks, dtype=torch.int32))


def _varlen_backward_impl(grad_o: Tensor, grad_state: Tensor | None, q: Tensor, k: Tensor,
                          v: Tensor, slope: Tensor, scale: float,
                          initial_state: Tensor | None, cu_seqlens: Tensor, block_size: int,
                          need_slope_grad: bool, impl: str, chunks: Tensor
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``lightning_attention_varlen_fwd``: (dq, dk, dv, dslope, d initial_state)
    in the inputs' shapes and dtypes (dslope zeros unless ``need_slope_grad``); ``chunks``:
    the forward's third output. ``graphopt::lightning_attention_varlen_bwd``'s
    implementation."""
    return _varlen_gradients(grad_o, grad_state, q, k, v, slope, scale, initial_state,
                             cu_seqlens, block_size, need_slope_grad, impl, chunks,
                             slope_zeros=True)  # type: ignore[return-value]


def _varlen_gradients(grad_o: Tensor, grad_state: Tensor | None, q: Tensor, k: Tensor,
                      v: Tensor, slope: Tensor, scale: float, initial_state: Tensor | None,
                      cu_seqlens: Tensor, block_size: int, need_slope_grad: bool, impl: str,
                      chunks: Tensor, *, slope_zeros: bool = False
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor]:
    """:func:`_varlen_backward_impl`; dslope None without ``need_slope_grad`` unless
    ``slope_zeros`` (as :func:`_gradients`)."""
    hq = q.shape[1]
    if impl == "triton":
        grads = triton_varlen_backward(grad_o, grad_state, q, k, v, slope, scale,
                                       initial_state, block_size, cu_seqlens, need_slope_grad,
                                       chunks if chunks.numel() else None)
    else:
        grads = _chunked_varlen_backward(grad_o, grad_state, q, *_kernel_kv(k, v, hq, impl),
                                         slope, scale, initial_state, block_size, cu_seqlens,
                                         need_slope_grad)
    return _input_grads(grads, q, k, v, slope, slope_zeros)


lightning_attention_varlen_bwd = torch.library.custom_op(
    "graphopt::lightning_attention_varlen_bwd", mutates_args=())(_varlen_backward_impl)


@lightning_attention_varlen_bwd.register_fake
def _(grad_o: Tensor, grad_state: Tensor | None, q: Tensor, k: Tensor, v: Tensor,
      slope: Tensor, scale: float, initial_state: Tensor | None, cu_seqlens: Tensor,
      block_size: int, need_slope_grad: bool, impl: str, chunks: Tensor
      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            slope.new_empty(slope.shape),
            q.new_empty(cu_seqlens.shape[0] - 1, q.shape[1], q.shape[3], v.shape[-1],
                        dtype=acc_dtype(q.dtype)))


def _varlen_setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, slope, scale, initial_state, cu_seqlens, block_size, impl = inputs
    ctx.save_for_backward(q, k, v, slope, initial_state, cu_seqlens, output[2])
    ctx.mark_non_differentiable(output[2])
    ctx.scale, ctx.block_size, ctx.impl = scale, block_size, impl
    ctx.has_initial_state = initial_state is not None
    ctx.set_materialize_grads(False)  # an unused final state: None, not zeros


def _varlen_backward(ctx: Any, grad_o: Tensor | None, grad_state: Tensor | None,
                     _grad_chunks: Tensor | None = None,
                     backward_op: Callable[..., tuple] | None = None) -> tuple:
    """The varlen forward op's backward; ``backward_op`` as in :func:`_backward`."""
    q, k, v, slope, initial_state, cu_seqlens, chunks = ctx.saved_tensors
    if grad_o is None:
        grad_o = torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)
    need = ctx.needs_input_grad
    dq, dk, dv, dslope, dstate = (backward_op or lightning_attention_varlen_bwd)(
        grad_o, grad_state, q, k, v, slope, ctx.scale, initial_state, cu_seqlens,
        ctx.block_size, bool(need[3]), ctx.impl, chunks)
    return (dq, dk, dv, dslope if need[3] else None, None,
            dstate if ctx.has_initial_state else None, None, None, None)


lightning_attention_varlen_fwd.register_autograd(_varlen_backward,
                                                 setup_context=_varlen_setup_context)
refuse_double_backward(lightning_attention_varlen_bwd, "graphopt::lightning_attention_varlen",
                       _NO_DOUBLE_BACKWARD)
_VARLEN_FUNCTORCH = transformable("graphopt::lightning_attention_varlen",
                                  lightning_attention_varlen_fwd, _varlen_setup_context,
                                  _varlen_backward)
_EagerVarlen = eager_function("_EagerVarlen", _varlen_forward_impl,
                              _varlen_setup_context, _varlen_backward, _varlen_gradients)


def _check(name: str, x: Tensor, rank: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if x.dim() != rank:
        raise ValueError(f"{name} must have {rank} dimensions, got shape {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")


def validate(q: Tensor, k: Tensor, v: Tensor, slope: Tensor,
             initial_state: Tensor | None, dtypes: bool = True) -> None:
    """Shape/dtype checks with messages naming the argument (layout "bhsd"); ``dtypes``
    False: shapes and devices only (the ops themselves take mixed dtypes, which the
    approximate softmax conversion under autocast passes, and compute in q's accumulation
    dtype)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check(name, x, 4)
    _check("slope", slope, 1)
    others: list[tuple[str, Tensor | None]] = [("k", k), ("v", v), ("slope", slope),
                                                ("initial_state", initial_state)]
    for name, other in others:
        if other is not None and other.device != q.device:
            raise ValueError(f"{name} is on {other.device} but q is on {q.device}; move all "
                             "inputs to one device")
    for name, x in (("k", k), ("v", v)):
        if dtypes and x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but q has {q.dtype}; cast q, k, v to "
                            "one dtype")
    b, hq, s, d = q.shape
    if k.shape[0] != b or k.shape[2] != s or k.shape[3] != d:
        raise ValueError(f"k must be [B, Hk, S, D] = [{b}, Hk, {s}, {d}] to match q "
                         f"{tuple(q.shape)}, got {tuple(k.shape)}")
    if d == 0 or v.shape[3] == 0:
        raise ValueError(f"head dims must be >= 1, got D = {d}, Dv = {v.shape[3]}")
    hk = k.shape[1]
    if hq == 0 or hk == 0:  # said "0 must be a multiple of 0", and Hq=0 with Hk=1 ran
        raise ValueError(f"lightning_attention needs at least one query and one key/value "
                         f"head, got Hq={hq}, Hk={hk}")
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hk})")
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(f"v must be [B, Hk, S, Dv] = [{b}, {hk}, {s}, Dv], got "
                         f"{tuple(v.shape)}")
    if slope.shape[0] != hq:
        raise ValueError(f"slope must have one entry per query head ({hq}), got "
                         f"{slope.shape[0]}")
    if initial_state is not None:
        _check("initial_state", initial_state, 4)
        want = (b, hq, d, v.shape[-1])
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state must be [B, Hq, D, Dv] = {list(want)}, got "
                             f"{tuple(initial_state.shape)}")


def lightning_attention(q: Tensor, k: Tensor, v: Tensor, slope: Tensor, *,
                        scale: float | None = None, initial_state: Tensor | None = None,
                        output_final_state: bool = False, block_size: int | None = None,
                        checkpoint_every: int | None = None, layout: str = "bhsd",
                        impl: str = "auto", cu_seqlens: Tensor | None = None
                        ) -> Tensor | tuple[Tensor, Tensor]:
    """Causal linear attention with per-head decay (Lightning Attention), exact.

    o_t = sum_{u <= t} exp(-slope_h)^(t - u) (scale q_t . k_u) v_u, plus
    exp(-slope_h)^(t + 1) scale q_t S0 when ``initial_state`` S0 is given.
    Source: Lightning Attention-2 (arXiv:2401.04658) Algorithm 1; MiniMax-01's
    ``MiniMaxLightningAttention`` computes the same function with a Python block loop.

    Args:
        q: [B, Hq, S, D] (layout "bhsd") or [B, S, Hq, D] ("bshd"); float32/bfloat16/float16/
            float64. Accumulation is float32 (float64 for float64 inputs).
        k: [B, Hk, S, D]; Hq must be a multiple of Hk (GQA/MQA).
        v: [B, Hk, S, Dv]; Dv may differ from D.
        slope: [Hq] finite decay rates (>= 0 for a decay; 0 is plain causal linear
            attention; +inf gives NaN, a negative slope grows instead of decaying; values
            are not checked: that would synchronize with the host).
        scale: multiplies q . k; None means 1 (as MiniMax and Lightning Attention use).
        initial_state: [B, Hq, D, Dv] state carried in from earlier positions (decode, CP).
        output_final_state: also return the state after position S - 1 ([B, Hq, D, Dv],
            float32/float64), so a sequence split in two gives the same result.
        block_size: chunk length C (default 64); any S works, S need not be a multiple.
        checkpoint_every: backward recomputes states from one saved state per this many
            blocks (default 8); 1 saves every block's state.
        layout: "bhsd" or "bshd".
        impl: "auto" (Triton on GPU/NPU when installed, chunked PyTorch elsewhere),
            "chunked", or "triton" (block_size rounded up to a power of two >= 16).
        cu_seqlens: [N + 1] int, packed variable-length sequences (flash-attention's
            convention): B must be 1 and sequence i is positions cu_seqlens[i] ..
            cu_seqlens[i+1] - 1; the state resets at every boundary (no attention across
            sequences); ``initial_state`` and the final state are then [N, Hq, D, Dv], one
            per sequence. On Triton every kernel is one launch for all sequences (a chunk
            table built on the device, nothing read on the host; cu_seqlens is checked by
            an asynchronous device assert); the chunked path runs one call per sequence.
            checkpoint_every does not apply: one state per sequence is saved.

    Returns:
        o in q's dtype and layout, and the final state if ``output_final_state``.

    Raises:
        ValueError / TypeError: wrong ranks, mismatched shapes or heads, non-float inputs,
            slope of the wrong length, bad layout/block_size/checkpoint_every, a scale that
            is not a constant number (a tensor requiring grad), cu_seqlens not increasing
            from 0 to S or with B > 1; impl="triton" with float64 inputs (see
            :func:`resolve_impl`).
        RuntimeError: impl="triton" without triton, or on CPU without TRITON_INTERPRET=1.
        NotImplementedError: forward-mode AD tangents on the inputs.

    torch.func.grad / vjp / jacrev and vmap of them (per-sample gradients) work in eager
    mode (graphopt.kernels.transformable; not inside torch.compile, where Dynamo meets
    pytorch#168393). Not supported: double backward (the backward op has no autograd formula
    of its own; refused by name), forward-mode AD (refused).
    On Triton with bf16 inputs the products take bf16 operands (chunk states and masked
    scores rounded to bf16, fp32 accumulation, as flash-linear-attention); fp16 and fp32
    inputs take fp32 products (fp16's range would overflow large states).
    """
    refuse_forward_ad("graphopt's lightning_attention", q, k, v, slope, initial_state)
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    if layout == "bshd":
        for name, x in (("q", q), ("k", k), ("v", v)):
            _check(name, x, 4)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    scale_f, block, every = _scalars(scale, block_size, checkpoint_every)
    if cu_seqlens is not None:
        o, state = _varlen(q, k, v, slope, cu_seqlens, initial_state, scale_f, block, impl)
        if layout == "bshd":
            o = o.transpose(1, 2)
        return (o, state) if output_final_state else o
    validate(q, k, v, slope, initial_state)
    chosen = resolve_impl(impl, q.device, max(q.shape[-1], v.shape[-1]), q.dtype)
    args = (q, k, v, slope, scale_f, initial_state, _effective_block(chosen, block), every,
            chosen)
    if functorch_active():  # torch.func.grad / vjp / jacrev / vmap
        o, state, _ = _FUNCTORCH.apply(*args)
    elif plain_eager(q, k, v, slope, initial_state):
        o, state, _ = _EagerLightning.apply(*args)
    else:
        o, state, _ = torch.ops.graphopt.lightning_attention_fwd(*args)
    if layout == "bshd":
        o = o.transpose(1, 2)
    return (o, state) if output_final_state else o


def _scalars(scale: Any, block_size: Any, checkpoint_every: Any) -> tuple[float, int, int]:
    """(scale, block_size, checkpoint_every) checked, with their defaults (1, 64, 8).

    Raises:
        TypeError: block_size / checkpoint_every not ints; scale not a real number or a
            one-element tensor, or a tensor that requires grad (the op takes a constant
            scale: a learnable one would silently get no gradient).
        ValueError: block_size or checkpoint_every < 1; scale not finite.
    """
    for name, value in (("block_size", block_size), ("checkpoint_every", checkpoint_every)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an int, got {value!r}")
    block = DEFAULT_BLOCK_SIZE if block_size is None else block_size
    every = DEFAULT_CHECKPOINT_EVERY if checkpoint_every is None else checkpoint_every
    if block < 1 or every < 1:
        raise ValueError(f"block_size and checkpoint_every must be >= 1, got {block}, {every}")
    if scale is None:
        return 1.0, block, every
    if isinstance(scale, torch.Tensor):
        if scale.requires_grad:
            raise TypeError("scale is a tensor that requires grad, but lightning_attention "
                            "takes a constant scale (it would get no gradient); for a "
                            "learnable scale multiply q by it before the call")
        if scale.numel() != 1:
            raise TypeError(f"scale must be one number, got a tensor of shape "
                            f"{tuple(scale.shape)}")
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__} {scale!r}")
    # finite (every output NaN otherwise, a review), written as comparisons: traced with a
    # symbolic scale (dynamic=True: ``head_dim ** -0.5``) they become guards, where
    # math.isfinite broke the graph (a review: fullgraph=True failed)
    if not -math.inf < scale < math.inf:  # (NaN fails both)
        raise ValueError(f"scale must be finite, got {float(scale)}")
    return (scale if isinstance(scale, float) else float(scale)), block, every


def _check_cu_seqlens(cu_seqlens: Tensor, total: int, device: torch.device,
                      kernel_checks: bool = False) -> None:
    """cu_seqlens must be a 1-D integer tensor on q's ``device`` increasing strictly from 0
    to S. On the CPU this is checked here (ValueError); on an accelerator, and in a graph
    being traced (torch.compile, make_fx, FakeTensorMode: the values are not known), by an
    asynchronous assert (RuntimeError; no host synchronization on the hot path, no
    data-dependent guard that breaks fullgraph). ``kernel_checks``: the Triton chunk-table
    launch asserts the same (triton_kernels._chunk_table), so an accelerator's eager call
    skips the assert here (its ~6 small kernels)."""
    from torch._subclasses.fake_tensor import is_fake

    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or \
            cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or \
            cu_seqlens.dtype == torch.bool or cu_seqlens.shape[0] < 2:
        raise TypeError("cu_seqlens must be a 1-D integer tensor of N + 1 >= 2 offsets, got "
                        f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens))} "
                        f"{tuple(getattr(cu_seqlens, 'shape', ()))}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} and q on {device}: put them "
                         "on one device")
    message = (f"cu_seqlens must increase strictly from 0 to S = {total} (every sequence "
               "holds a token: drop the repeated offset of an empty one)")
    if cu_seqlens.device.type == "cpu" and not torch.compiler.is_compiling() and \
            not is_fake(cu_seqlens):
        bounds = [int(x) for x in cu_seqlens.tolist()]
        if bounds[0] != 0 or bounds[-1] != total or \
                any(b <= a for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"{message}, got {bounds}")
    elif kernel_checks and not torch.compiler.is_compiling() and not is_fake(cu_seqlens):
        return
    elif cu_seqlens.device.type != "meta":  # meta: shapes only, nothing to check
        ok = (cu_seqlens[0] == 0) & (cu_seqlens[-1] == total) & \
            (cu_seqlens[1:] > cu_seqlens[:-1]).all()
        torch._assert_async(ok, message)


def _varlen(q: Tensor, k: Tensor, v: Tensor, slope: Tensor, cu_seqlens: Tensor,
            initial_state: Tensor | None, scale: float, block_size: int, impl: str
            ) -> tuple[Tensor, Tensor]:
    """Packed sequences through ``graphopt::lightning_attention_varlen_fwd``: on Triton one
    launch per kernel for all sequences (a chunk table built on the device), on the chunked
    path one chunked call per sequence."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check(name, x, 4)
    if q.shape[0] != 1:
        raise ValueError(f"cu_seqlens packs sequences along S of one batch row: q must be "
                         f"[1, Hq, S, D], got {tuple(q.shape)}")
    validate(q, k, v, slope, None)
    if q.shape[2] > 2**31 - 1:  # the chunk table and kernels index tokens in int32
        raise ValueError(f"packed sequences take at most 2^31 - 1 tokens in all, got "
                         f"T = {q.shape[2]}: split the batch")
    if isinstance(cu_seqlens, torch.Tensor) and not torch.compiler.is_compiling() and \
            torch._C._functorch.is_batchedtensor(cu_seqlens):  # (a list: _check_cu_seqlens)
        raise ValueError("cu_seqlens is batched by vmap, but every call takes one packing: "
                         "vmap over q, k, v (and the initial state) with one cu_seqlens, or "
                         "loop over the packings")
    hq, d, dv = q.shape[1], q.shape[3], v.shape[3]
    chosen = resolve_impl(impl, q.device, max(d, dv), q.dtype)
    _check_cu_seqlens(cu_seqlens, q.shape[2], q.device, kernel_checks=chosen == "triton")
    n = cu_seqlens.shape[0] - 1
    if initial_state is not None:
        _check("initial_state", initial_state, 4)
        if tuple(initial_state.shape) != (n, hq, d, dv):
            raise ValueError(f"with cu_seqlens, initial_state must be [N, Hq, D, Dv] = "
                             f"{[n, hq, d, dv]}, got {tuple(initial_state.shape)}")
        if initial_state.device != q.device:
            raise ValueError(f"initial_state is on {initial_state.device} but q is on "
                             f"{q.device}; move all inputs to one device")
    args = (q, k, v, slope, scale, initial_state, cu_seqlens,
            _effective_block(chosen, block_size), chosen)
    if functorch_active():  # torch.func.grad / vjp / jacrev / vmap
        o, state, _ = _VARLEN_FUNCTORCH.apply(*args)
    elif plain_eager(q, k, v, slope, initial_state, cu_seqlens):
        o, state, _ = _EagerVarlen.apply(*args)
    else:
        o, state, _ = torch.ops.graphopt.lightning_attention_varlen_fwd(*args)
    return o, state
