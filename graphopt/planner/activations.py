"""Activation memory of a transformer layer: Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", sec. 4 and Table 2) and a Megatron-LM layer to
check the traced measurement (:func:`graphopt.cost.memory.saved_for_backward`) against it.

Table 2, bytes per layer for one microbatch (s: sequence, b: microbatch, h: hidden, a: heads,
t: tensor-parallel degree; 16-bit activations, 1-byte dropout masks):

    no parallelism                      sbh (34 + 5as/h)
    TP                                  sbh (10 + 24/t + 5as/(ht))
    TP + sequence parallelism (SP)      sbh (34/t + 5as/(ht))
    TP + selective recomputation        sbh (10 + 24/t)
    TP + SP + selective recomputation   sbh (34/t)
    full recomputation                  2 sbh (the layer input; / t with SP)

Per layer (sec. 4.1): attention 11 sbh + 5 as^2 b (QKV input 2, Q and K 4, softmax output
2as^2b, its dropout mask as^2b and output 2as^2b, V 2, projection input 2, dropout mask 1);
MLP 19 sbh (input 2, GeLU input 8, GeLU output 8, dropout mask 1); two LayerNorm inputs 4 sbh.
Under TP the [s, b, h] parts (10 sbh) stay whole; SP splits them over the sequence, and the
all-gathered inputs of the column-parallel GEMMs are gathered again in the backward instead of
kept. Selective recomputation recomputes the attention core (the 5as/h term).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from graphopt.errors import ConfigError


def korthikanti_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1,
                                 sp: bool = False, recompute: str = "none") -> float:
    """Korthikanti et al. 2022 Table 2 (module docstring): bytes of activations one GPT layer
    keeps for its backward per microbatch, on one tensor-parallel rank.

    ``recompute``: "none", "selective" (the attention core) or "full".

    Raises:
        ConfigError: unknown ``recompute``, or sizes < 1.
    """
    if recompute not in ("none", "selective", "full"):
        raise ConfigError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    if min(s, b, h, a, t) < 1:
        raise ConfigError(f"sizes must be >= 1, got s={s}, b={b}, h={h}, a={a}, t={t}")
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    core = 0.0 if recompute == "selective" else 5 * a * s / (h * t)
    return sbh * ((34 / t if sp else 10 + 24 / t) + core)


class _GatheredLinear(torch.autograd.Function):
    """Megatron-LM's column-parallel GEMM under sequence parallelism: all-gather the
    sequence-sharded input, multiply; keep only the shard, gather it again in the backward.
    The all-gather is emulated by repeating the local shard ``t`` times (single process: the
    values do not matter for what is kept)."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                t: int) -> torch.Tensor:
        ctx.save_for_backward(shard, weight)
        ctx.t = t
        return shard.repeat(t, 1, 1) @ weight.t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor  # type: ignore[override]
                 ) -> tuple[torch.Tensor, torch.Tensor, None]:
        shard, weight = ctx.saved_tensors
        full = shard.repeat(ctx.t, 1, 1)
        grad_in = (grad @ weight).chunk(ctx.t)[0]  # reduce-scatter over the sequence
        return grad_in, grad.flatten(0, 1).t() @ full.flatten(0, 1), None


class MegatronGPTLayer(nn.Module):
    """One GPT layer as one tensor-parallel rank of Megatron-LM runs it (pre-LayerNorm,
    attention with a fused scale-mask-softmax and dropout, 4h GeLU MLP, dropout on both
    residual branches): a/t heads and 4h/t MLP columns; with ``sp`` the LayerNorms and
    dropouts run on s/t tokens and the GEMM inputs are all-gathered (:class:`_GatheredLinear`);
    ``selective`` recomputes the attention core (torch.utils.checkpoint); the collectives are
    emulated within one process (reduce-scatter: the first chunk; all-reduce: identity).

    Input/output [s (or s/t with sp), b, h] with s <= ``seq``, any float dtype. Raises
    ConfigError when t does not divide the heads."""

    def __init__(self, hidden: int, heads: int, seq: int, t: int = 1, sp: bool = False,
                 dropout: float = 0.1, selective: bool = False) -> None:
        super().__init__()
        if heads % t or hidden % heads:
            raise ConfigError(f"t ({t}) must divide the heads ({heads}), heads the hidden "
                              f"size ({hidden})")
        self.h, self.heads, self.t, self.sp = hidden, heads // t, t, sp
        self.p, self.selective = dropout, selective
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Parameter(torch.randn(3 * hidden // t, hidden) * 0.02)
        self.proj = nn.Parameter(torch.randn(hidden, hidden // t) * 0.02)
        self.fc1 = nn.Parameter(torch.randn(4 * hidden // t, hidden) * 0.02)
        self.fc2 = nn.Parameter(torch.randn(hidden, 4 * hidden // t) * 0.02)
        # the causal mask is a constant (Megatron's fused softmax makes it in the kernel)
        self.register_buffer("causal", torch.ones(seq, seq, dtype=torch.bool).triu(1),
                             persistent=False)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        """Dropout keeping a 1-byte mask, as the fused GPU kernels do (PyTorch's CPU kernel
        keeps the mask in the activation dtype)."""
        if not self.training or self.p == 0:
            return x
        return x * (torch.rand_like(x) >= self.p) * (1 / (1 - self.p))

    def _column(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _GatheredLinear.apply(x, weight, self.t) if self.sp else x @ weight.t()

    def _row(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = x @ weight.t()  # partial sums: all-reduce (identity here) or reduce-scatter
        return out.chunk(self.t)[0] if self.sp else out

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s = q.shape[1]
        causal = self.get_buffer("causal")[:s, :s]
        scores = torch.baddbmm(q.new_empty(q.shape[0], s, s), q, k.transpose(1, 2),
                               beta=0.0, alpha=q.shape[-1] ** -0.5)
        probs = self._dropout(torch.softmax(scores.masked_fill(causal, float("-inf")), -1))
        return torch.bmm(probs, v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self._column(self.ln1(x), self.qkv)  # [s, b, 3h/t]
        s, b = qkv.shape[:2]
        d = self.h // (self.heads * self.t)
        q, k, v = (y.reshape(s, b * self.heads, d).transpose(0, 1)
                   for y in qkv.split(self.heads * d, -1))
        if self.selective:
            ctx = torch.utils.checkpoint.checkpoint(self._core, q, k, v, use_reentrant=False)
        else:
            ctx = self._core(q, k, v)
        ctx = ctx.transpose(0, 1).reshape(s, b, self.heads * d)
        x = x + self._dropout(self._row(ctx, self.proj))
        mlp = F.gelu(self._column(self.ln2(x), self.fc1))
        return x + self._dropout(self._row(mlp, self.fc2))


def fused_layer_activation_bytes(s: int, h: int, heads: int, kv_heads: int, ffn: int,
                                 gated: bool, dropout: bool, flash: bool = True) -> float:
    """Bytes one decoder layer keeps for its backward per sequence (b = 1, 16-bit
    activations, no parallelism, no recomputation) with Megatron-Core's fused kernels:
    Korthikanti et al.'s per-tensor count (module docstring) for pre-norm layers with grouped
    K/V heads and a gated (SwiGLU) or plain (GeLU) MLP. Kept: the first norm's input and the
    QKV GEMM's input (2 sh each), Q (2 sh) and K, V (2 sh kv/heads each), the attention
    output (2 sh, also the projection's input) and, with flash attention, its fp32
    log-sum-exp (4 heads s; without flash the 5 heads s^2 of the unfused core), the second
    norm's and the MLP GEMM's inputs (2 sh each), the activation's input (2 s ffn; gated: gate
    and up, 4 s ffn) and output (2 s ffn, the down GEMM's input), 1-byte dropout masks after
    both blocks (s h each) when ``dropout``. For a GPT layer this is Table 2's 34 sbh +
    5 as^2 b.

    Raises:
        ConfigError: sizes < 1, or heads not divisible by kv_heads.
    """
    if min(s, h, heads, kv_heads, ffn) < 1 or heads % kv_heads:
        raise ConfigError(f"sizes must be >= 1 with heads divisible by kv_heads, got s={s}, "
                          f"h={h}, heads={heads}, kv_heads={kv_heads}, ffn={ffn}")
    sh = s * h
    attention = 2 * sh * (2 + 1 + 2 * kv_heads / heads + 1)  # norm in, QKV in, Q, K+V, out
    attention += 4 * heads * s if flash else 5 * heads * s * s
    mlp = 2 * sh * 2 + (4 if gated else 2) * s * ffn + 2 * s * ffn  # norm in, GEMM in, act
    return attention + mlp + (2 * sh if dropout else 0)
