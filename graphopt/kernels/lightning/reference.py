"""Quadratic reference and recurrent single-step form of Lightning Attention (tests, decode).

Lightning Attention (Lightning Attention-2, Qin et al. 2024, arXiv:2401.04658; TransNormerLLM;
MiniMax-01, arXiv:2501.08313) is causal linear attention with a per-head decay
lambda_h = exp(-slope_h):

    o_t = sum_{u <= t} lambda_h^(t - u) (scale * q_t . k_u) v_u                     (1)

Layout "bhsd": q [B, Hq, S, D], k [B, Hk, S, D], v [B, Hk, S, Dv]; Hq a multiple of Hk
(GQA/MQA: query head h reads key/value head h // (Hq // Hk)); slope [Hq] float.
The state after position t is S_t = sum_{u <= t} lambda^(t - u) k_u^T v_u, [D, Dv] per head,
and an initial state S_{-1} adds lambda^(t + 1) q_t S_{-1} to o_t.
"""

from __future__ import annotations

import torch


def expand_kv(x: torch.Tensor, hq: int) -> torch.Tensor:
    """[B, Hk, S, X] -> [B, Hq, S, X] by repeating each key/value head Hq // Hk times."""
    hk = x.shape[1]
    return x if hk == hq else x.repeat_interleave(hq // hk, dim=1)


def lightning_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  slope: torch.Tensor, scale: float = 1.0,
                                  initial_state: torch.Tensor | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Equation (1) computed quadratically in float64-or-input precision; O(S^2) memory.

    Returns (o [B, Hq, S, Dv] in q's dtype, final state [B, Hq, D, Dv] float32 or float64).
    Differentiable by autograd (used as the test oracle).
    """
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    hq, seq = q.shape[1], q.shape[2]
    qf, kf, vf = q.to(acc) * scale, expand_kv(k, hq).to(acc), expand_kv(v, hq).to(acc)
    s = slope.to(acc).view(1, hq, 1, 1)
    pos = torch.arange(seq, device=q.device, dtype=acc)
    gap = pos.view(-1, 1) - pos.view(1, -1)
    causal = gap >= 0
    decay = torch.where(causal, torch.exp(-s * gap.clamp(min=0)), torch.zeros((), dtype=acc))
    o = ((qf @ kf.transpose(-1, -2)) * decay) @ vf
    key_decay = torch.exp(-s * (seq - 1 - pos).view(1, 1, -1, 1))
    state = (kf * key_decay).transpose(-1, -2) @ vf
    if initial_state is not None:
        h0 = initial_state.to(acc)
        o = o + (qf * torch.exp(-s * (pos + 1).view(1, 1, -1, 1))) @ h0
        state = state + torch.exp(-s * seq) * h0
    return o.to(q.dtype), state


def lightning_attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             slope: torch.Tensor, state: torch.Tensor, scale: float = 1.0
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step of (1) with a carried state (recurrent form).

    q [B, Hq, 1, D], k [B, Hk, 1, D], v [B, Hk, 1, Dv], state [B, Hq, D, Dv] (float32 or
    float64). Returns (o [B, Hq, 1, Dv] in q's dtype, new state). S_t = lambda S_{t-1} +
    k_t^T v_t; o_t = scale * q_t S_t.

    Raises:
        ValueError / TypeError: more than one token (S != 1: several tokens need the decay
            between them, use ``lightning_attention`` with ``initial_state``), shapes or
            dtypes that do not match (as ``lightning_attention``), a state that is not
            [B, Hq, D, Dv] float32/float64 on q's device; scale not a finite real number.
    """
    from graphopt.kernels.lightning.op import _scalars, validate

    validate(q, k, v, slope, None)
    scale = _scalars(scale, None, None)[0]  # as lightning_attention checks it (a review)
    b, hq, s, d = q.shape
    if s != 1:
        raise ValueError(f"lightning_attention_step takes one token (q [B, Hq, 1, D]), got "
                         f"S = {s}: use lightning_attention(..., initial_state=state, "
                         "output_final_state=True) for several")
    want = (b, hq, d, v.shape[3])
    if not isinstance(state, torch.Tensor) or tuple(state.shape) != want:
        raise ValueError(f"state must be [B, Hq, D, Dv] = {list(want)}, got "
                         f"{tuple(getattr(state, 'shape', ()))}")
    if state.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"state must be float32 or float64 (it accumulates), got {state.dtype}")
    if state.device != q.device:
        raise ValueError(f"state is on {state.device} but q is on {q.device}")
    acc = state.dtype
    kf, vf = expand_kv(k, hq).to(acc), expand_kv(v, hq).to(acc)
    lam = torch.exp(-slope.to(acc)).view(1, hq, 1, 1)
    state = lam * state + kf.transpose(-1, -2) @ vf
    o = (q.to(acc) * scale) @ state
    return o.to(q.dtype), state
