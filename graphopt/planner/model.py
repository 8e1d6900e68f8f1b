"""What the planner knows about a model: per-layer costs measured by the cost model on the
traced graph of the real transformers model class, built on the meta device (no weights).

Method: the model is instantiated with 1 and with 2 decoder layers (for models with dense
and MoE layers, also with the second layer dense), one training step of each (forward, loss,
backward) is traced with fake tensors for one sequence of the planning length, and priced
node by node (:func:`graphopt.cost.graph_cost.graph_cost`: FLOPs from
torch.utils.flop_counter, bytes, roofline time at the device's peak). The difference of two
traces is one layer; the rest is the embedding, final norm, LM head and loss. Saved
activations are read off the same traced step: forward values the backward reads
(:func:`graphopt.cost.memory.saved_for_backward`). Parameter
counts are those of the instantiated modules. Attention is priced as the fused flash kernel
accelerators run; MoE experts as transformers' grouped_mm experts (the FLOPs of T*K rows).
"""

from __future__ import annotations

import dataclasses
import itertools
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graphopt.cost.profiles import ClusterProfile
from graphopt.errors import ConfigError
from graphopt.models import (
    build_architecture,
    check_sizes,
    expert_count,
    model_config,
    resolve_model,
)


@dataclass(frozen=True)
class LayerCost:
    """One decoder layer, one sequence of the planning length, forward + backward on one
    device without parallelism. Times in seconds at the device's peak (GEMMs: divide by the
    matmul efficiency); bytes; FLOPs."""

    gemm_s: float
    """GEMM/attention nodes (compute-bound): split by TP/CP."""
    split_s: float
    """Other nodes on per-head / FFN-width tensors: split by TP."""
    replicated_s: float
    """Other nodes on [b, s, h] tensors (norms, residuals): replicated by TP without
    sequence parallelism, split with it."""
    flops: float
    activation_bytes: float
    """Saved for backward (forward activations autograd keeps)."""
    params: float
    """Parameters other than routed experts."""
    expert_params: float = 0.0
    """Parameters of all routed experts of the layer."""
    peak_s: float = 0.0
    """Seconds of ``flops`` at the peak FLOP/s of each op's dtype (MFU's denominator; at
    most the layer's time, see :mod:`graphopt.cost.graph_cost`)."""
    selective_activation_bytes: float = 0.0
    """Saved for backward under selective (per-op) activation checkpointing: the layer keeps
    its input, its attention outputs and every other GEMM output and recomputes the rest
    (:data:`SELECTIVE_SAVE`, torchtitan's op-level policy)."""
    selective_gemm_s: float = 0.0
    """Recomputation that policy adds in the backward, split as ``gemm_s`` ..."""
    selective_split_s: float = 0.0
    """... ``split_s`` ..."""
    selective_replicated_s: float = 0.0
    """... and ``replicated_s``."""
    cast_bytes: float = 0.0
    """Of ``activation_bytes`` (and ``selective_activation_bytes``): the 16-bit copies of
    the parameters that ``torch.autocast`` makes and autograd keeps (:attr:`PlanModel.
    master_weights`; 0 otherwise). They do not grow with the tokens of a microbatch; each
    microbatch in flight holds its own."""
    weight_grad_s: float = 0.0
    """Of ``gemm_s``: the weight-gradient GEMMs of parameters other than routed experts
    (:func:`weight_gradient_gemms`; compute-bound ones, as ``gemm_s``), which a frozen
    weight does not compute (:attr:`PlanModel.trained_gemm`): a third of a linear layer's
    GEMM FLOPs."""
    expert_weight_grad_s: float = 0.0
    """Of ``gemm_s``: the routed experts' weight-gradient GEMMs
    (:attr:`PlanModel.trained_expert_gemm`)."""
    gemm_shapes: tuple[tuple[int, int, int, float], ...] = ()
    """The 2-D GEMMs (``mm``/``addmm``) inside ``gemm_s`` whose shape is known per rank:
    (token dimension, dimension TP splits, dimension kept whole, seconds of its FLOPs at
    peak), one entry per distinct shape (seconds summed; compute-bound GEMMs only, as in
    ``gemm_s``, whose per-kernel overheads are not slowed by the table). The token
    dimension (the sequence here) scales with microbatch / cp, the split one with 1 / tp;
    the planner prices them with the device's GEMM-shape table
    (:mod:`graphopt.cost.gemm_table`) when it has one. GEMMs without a token dimension
    (routed experts' per-expert GEMMs, batched GEMMs) stay at ``matmul_efficiency``."""


@dataclass(frozen=True)
class PlanModel:
    """A model as the planner sees it (see the module docstring)."""

    name: str
    seq: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    dense_layers: int
    moe_layers: int
    dense: LayerCost
    moe: LayerCost | None
    head: LayerCost
    """Embedding + final norm + LM head + loss (first/last pipeline stage)."""
    experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    dtype_bytes: int = 2
    tied_embeddings: bool = False
    """The LM head shares the embedding matrix (``tie_word_embeddings``): under PP the first
    and the last stage each hold a full copy and all-reduce its gradient (Megatron-LM's
    embedding group); counted once in ``head.params``."""
    tied_head_tp: bool = True
    """Whether a tied embedding/head pair is split over TP (Megatron-LM's vocabulary-parallel
    embedding, what the planner's validations price). False: it stays whole on every TP rank
    (graphopt.parallelize keeps a tied pair replicated), with its full logits, its full
    compute and no SP (``parallel="auto"`` sets it: a review found auto's tied plans priced
    as split and SP plans chosen that parallelize refuses)."""
    head_dim: int = 0
    """Width of a query/key head (0: hidden / heads): ``head_dim`` where the config gives it
    (Qwen3: 128 with hidden / heads 64-80), MLA's nope + rope width (DeepSeek-V3: 192)."""
    v_head_dim: int = 0
    """Width of a value head (0: ``head_dim``): MLA's ``v_head_dim`` (DeepSeek-V3: 128).
    Context parallelism moves heads of these widths (a review found CP priced at
    hidden / heads: DeepSeek-V3's ring traffic 2.86x low)."""
    activations: str = "traced"
    """What dense layers' ``activation_bytes`` count: "traced" (what the transformers
    model's eager autograd keeps) or "fused" (what Megatron-Core's fused kernels keep:
    :func:`graphopt.planner.activations.fused_layer_activation_bytes`)."""
    bf16_layers: tuple[LayerCost, LayerCost | None, LayerCost] | None = None
    """Master weights: (dense, MoE, head) as traced for the 16-bit model, which is what the
    layers compute where FSDP2 holds them (graphopt.parallelize's ZeRO-2/3, and its
    ``replicate`` under TP or PP): its MixedPrecisionPolicy gives them 16-bit parameters and
    casts their inputs, so the residual stream is 16-bit and autocast copies nothing."""
    trained: float = 1.0
    """Share of the parameters other than routed experts that train (``requires_grad``):
    the others hold no gradient and no optimizer state and are not reduced
    (``parallel="auto"`` reads it off the model: frozen base weights under LoRA)."""
    trained_experts: float = 1.0
    """The same share for the routed experts' parameters."""
    trained_gemm: float = 1.0
    """Share of the GEMM weights other than routed experts (2-D parameters that are not
    input embeddings, the LM head included) that train, by elements: the share of
    :attr:`LayerCost.weight_grad_s` the backward computes (a weight-gradient GEMM's FLOPs
    are 2 x tokens x the weight's elements). LoRA's frozen base weights: about 0; a frozen
    embedding alone: 1 (its backward is a scatter-add, not a GEMM). The layers of
    :attr:`frozen_prefix` are left out (priced as their forward)."""
    trained_expert_gemm: float = 1.0
    """The same share of the routed experts' parameters: of
    :attr:`LayerCost.expert_weight_grad_s`."""
    frozen_prefix: float = 0.0
    """Leading decoder layers that run no backward: they and the input embedding hold no
    parameter with ``requires_grad`` (a fine-tune of the top layers), so autograd keeps
    nothing for them and differentiates nothing there. Priced as their forward (a third
    of the traced layer), their forward's collectives, no saved activations and no
    recomputation (``parallel="auto"`` reads it off the model,
    :func:`graphopt.parallel.auto.frozen_prefix_layers`); :attr:`trained_gemm` then
    covers the other layers."""
    master_weights: bool = False
    """float32 parameters, gradients and reductions computed in ``dtype_bytes`` under
    ``torch.autocast`` (``graphopt.parallelize(..., mixed_precision="bf16")``, torchtitan's
    mixed precision); False: everything in the 16-bit dtype with float32 optimizer states
    (Megatron-LM's bf16 with its distributed optimizer's float32 main parameters). Dense
    layers were traced under autocast: the residual stream, norms and RoPE are float32,
    GEMM inputs are cast copies (measured 0.71-0.78x float32's saved bytes, not 0.5x);
    :attr:`bf16_layers` are what the layers FSDP2 holds compute."""

    def __post_init__(self) -> None:
        if self.frozen_prefix < 0:
            raise ConfigError(f"frozen_prefix must be >= 0 (leading frozen decoder layers), "
                              f"got {self.frozen_prefix}")
        for name in ("trained", "trained_experts", "trained_gemm", "trained_expert_gemm"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} is a share of parameters: 0 to 1, got "
                                  f"{getattr(self, name)}")

    @property
    def layers(self) -> int:
        """Decoder layers, dense and MoE."""
        return self.dense_layers + self.moe_layers

    @property
    def params(self) -> float:
        """Parameters of the whole model (routed experts included)."""
        moe = self.moe.params + self.moe.expert_params if self.moe else 0.0
        return self.dense.params * self.dense_layers + moe * self.moe_layers + self.head.params

    def flops_per_sequence(self) -> float:
        """Model FLOPs of forward + backward of one sequence (no recomputation): MFU's
        numerator."""
        moe = self.moe.flops * self.moe_layers if self.moe else 0.0
        return self.dense.flops * self.dense_layers + moe + self.head.flops

    def peak_s_per_sequence(self) -> float:
        """Seconds the FLOPs one sequence's step needs take on one device at the peak
        FLOP/s of each op's dtype: MFU = this * sequences / (step time * devices). The
        model FLOPs of MFU are what the training run needs (Chowdhery et al. 2022, PaLM,
        appendix B): frozen weights' weight-gradient GEMMs are not counted, and the layers
        of :attr:`frozen_prefix` count their forward (a third), as the step time prices
        them (a fine-tune's MFU counted the full training step's FLOPs: LoRA on
        Llama-3-8B showed 65.8% where the same kernels' efficiency gave 44.6%)."""
        def needed(cost: LayerCost) -> float:
            return cost.peak_s - (1 - self.trained_gemm) * cost.weight_grad_s - \
                (1 - self.trained_expert_gemm) * cost.expert_weight_grad_s

        frozen = min(self.frozen_prefix, self.layers)
        dense_share = self.dense_layers / max(self.layers, 1)
        total = needed(self.head)
        for share, cost in ((dense_share, self.dense), (1 - dense_share, self.moe)):
            if cost is not None and share > 0:
                total += share * ((self.layers - frozen) * needed(cost)
                                  + frozen * cost.peak_s / 3)
        return total


_CACHE: dict[tuple[Any, ...], PlanModel] = {}

SELECTIVE_SAVE = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                  torch.ops.aten._grouped_mm.default,
                  torch.ops.aten._scaled_dot_product_flash_attention.default,
                  torch.ops.aten._scaled_dot_product_efficient_attention.default)
"""Ops whose outputs selective activation checkpointing keeps (every second ``mm``/``addmm``
is recomputed instead): torchtitan's per-op policy (torchtitan's ``_save_list`` in
parallelize_llama.py: GEMMs and attention kept, pointwise ops and norms recomputed; addmm
counted as mm for models with biased linears)."""


RERUN_SELECTIVE = ("all_gather_into_tensor", "all_gather_into_tensor_coalesced",
                   "wait_tensor")
"""Functional collectives the selective policy runs again in the backward (the other
collectives' outputs are kept): all-gathers, as torchtitan's per-op policy (its
``_save_list`` keeps reduce-scatter outputs, not all-gather ones), and the waits on a
collective (a wait on a kept output does not communicate; a kept wait after a rerun
all-gather would hold the gathered tensor anyway)."""

_REGIONS = itertools.count(1)


def _draws_random(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the call draws from the generator: a seeded op (``nondeterministic_seeded``)
    unless its dropout probability is 0. Kept by the selective policy, such an op (CUDA's
    flash / memory-efficient SDPA with dropout) does not advance the generator in the
    recomputation, and every later random op of the layer draws another mask than in the
    forward (a review: a gradient off by its own size, simulated on the CPU); recomputed,
    it draws the forward's numbers again from the checkpoint's restored RNG state."""
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return False
    for i, argument in enumerate(func._schema.arguments):
        if argument.name in ("dropout_p", "p"):
            value = kwargs.get(argument.name, args[i] if i < len(args) else None)
            return not (isinstance(value, int | float) and value == 0)
    return True


def selective_checkpoint_context(full: bool = False) -> tuple[Any, Any]:
    """``context_fn`` for ``torch.utils.checkpoint`` applying :data:`SELECTIVE_SAVE`, or with
    ``full`` recomputing every op (full activation recomputation). Either way graphopt's
    ops that exchange data between ranks (``graphopt.passes.fx_utils.communicates``: the
    expert-parallel MoE op and its TP row split / region mappings) are saved, not run
    again in the backward (graphopt.normalize's checkpoint policy does the same): a
    recomputation would repeat the all-to-alls and the expert GEMMs. Functional
    collectives (TP/SP's, from DTensor) are run again under ``full``, as Megatron-LM's and
    torchtitan's full recomputation do and as graphopt.planner.perf prices it (2 more TP
    collectives per layer, the layer's input the only activation kept; caching their
    outputs held 2 more [T, H] tensors per recomputed layer); under the selective policy
    the all-gathers run again (SP's gathered layer inputs are not kept: torchtitan's
    policy, which keeps reduce-scatter outputs only, and what perf prices: 2 more TP
    collectives per selective layer with SP) and the other collectives' outputs are kept.
    An attention op with dropout is recomputed, not kept (:func:`_draws_random`).
    Ring attention (CP) runs again under both, as perf prices it. Every rank recomputes
    the same layers, so the rerun collectives match across ranks."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from graphopt.passes.fx_utils import RING_ATTENTION, communicates

    count = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if communicates(func, args):
            functional = func.namespace in ("_c10d_functional", "c10d_functional")
            ring = func._schema.name in RING_ATTENTION  # run again, full or selective
            gather = functional and func._schema.name.split("::")[-1] in RERUN_SELECTIVE
            return CheckpointPolicy.PREFER_RECOMPUTE if (full and functional) or ring or \
                gather else CheckpointPolicy.MUST_SAVE
        if full:
            return CheckpointPolicy.PREFER_RECOMPUTE
        mode = "recompute" if ctx.is_recompute else "forward"
        gemm = func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        count[mode] += gemm
        save = func in SELECTIVE_SAVE and not (gemm and count[mode] % 2 == 0) and \
            not _draws_random(func, args, kwargs)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    forward, recompute = create_selective_checkpoint_contexts(policy,
                                                              allow_cache_entry_mutation=True)
    # traced by make_fx, each op is marked with its policy and this region id (read by
    # graphopt.cost.memory: a region's inputs are kept, not recomputed from other regions)
    forward.ac_graph_id = next(_REGIONS)
    return forward, recompute


def _fused_cost_attention(module: Any, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask: Any, **kwargs: Any) -> Any:
    """transformers' SDPA attention routed to the fused kernels an accelerator runs (see
    ``graphopt.cost.estimate._FlashAttention``), entered per call so that activation
    checkpointing's recomputation in the backward takes the same kernels. Only traced on the
    meta device, for costs (the values are not those of the model):

    - ``sliding_window`` W (Mistral, Gemma 2/3's local layers; query i sees keys
      i - W + 1 .. i) is priced as a windowed flash kernel executes it: the first W queries
      as one causal W x W call, the other S - W queries as one non-causal call on W keys
      (S W - W^2 / 2 scores in all, not S^2 / 2), with q, k, v (GQA heads repeated once,
      as the one-call trace does) kept whole, as FlashAttention-2's ``window_size`` keeps
      them. The two outputs' concatenation is a copy the kernel does not make, kept for
      o_proj's backward: a windowed layer is priced one [S, heads x head_dim] tensor and
      its copy too high (Mistral-7B at 16k: +128 MiB of 3.4 GiB saved, +0.9 ms of 41 ms;
      the window takes 8.7 ms of GEMM time off).
    - ``softcap`` (Gemma 2: tanh on the scores, fused into the kernel) is priced as plain
      attention (a few elementwise ops per score on top of 4 D multiply-adds)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from graphopt.cost.estimate import _FlashAttention

    kwargs.pop("softcap", None)
    window = kwargs.pop("sliding_window", None)
    s = query.shape[2]
    with _FlashAttention():
        if not window or attention_mask is not None or key.shape[2] != s or s <= window:
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        w = int(window)
        if key.shape[1] != query.shape[1]:
            groups = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        heads: Any = types.SimpleNamespace(num_key_value_groups=1, is_causal=True)
        first, _ = sdpa_attention_forward(heads, query[:, :, :w], key[:, :, :w],
                                          value[:, :, :w], None, **kwargs)
        rest, _ = sdpa_attention_forward(heads, query[:, :, w:], key[:, :, :w],
                                         value[:, :, :w], None, **{**kwargs, "is_causal": False})
        return torch.cat([first, rest], dim=1), None


def plan_model(spec: str | Path, seq: int, cluster: ClusterProfile,
               dtype: torch.dtype = torch.bfloat16, attention: str = "flash",
               activations: str = "traced", overrides: dict[str, Any] | None = None,
               master_weights: bool = False) -> PlanModel:
    """Measure ``spec`` (see :func:`graphopt.models.resolve_model`: a published or toy
    model name, or a transformers config.json) at sequence length ``seq`` on the
    cluster's device (see the module docstring). Cached per process.

    ``attention``: "flash" (the fused kernel, as today's frameworks run) or "megatron2021"
    (Q K^T and P V GEMMs around a fused softmax, as Megatron-LM ran in its SC'21 paper; used
    to validate against that paper). ``activations``: "traced" (dense layers keep what the
    transformers model's eager autograd keeps: fp32 norm copies, unfused activation
    intermediates) or "fused" (what fused norm/activation/attention kernels keep, as
    Megatron-Core runs: Korthikanti et al.'s count, :mod:`graphopt.planner.activations`;
    MoE layers stay traced). ``overrides``: config fields to change (e.g. sizes).
    ``master_weights``: price float32 parameters computing in ``dtype`` under
    ``torch.autocast`` (:attr:`PlanModel.master_weights`): dense layers are traced under
    autocast (:func:`graphopt.cost.estimate.trace_step`'s ``autocast``); MoE models' layers
    keep the 16-bit trace (their grouped_mm experts take bfloat16 only).

    Raises:
        ConfigError: unknown model, attention or activations kind; a bfloat16/float16
            ``dtype`` on a device profile without that rate; ``master_weights`` with a
            ``dtype`` other than bfloat16 or with ``activations="fused"``.
    """
    if attention not in ("flash", "megatron2021"):
        raise ConfigError(f"attention must be 'flash' or 'megatron2021', got {attention!r}")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 2:
        raise ConfigError(f"seq must be an int >= 2 (tokens per sequence), got {seq!r}")
    if isinstance(cluster, (str, Path)):  # a profile name or file, as the CLI takes
        from graphopt.cost.profiles import load_profile

        cluster = load_profile(cluster)
    cluster.device.require_rate(str(dtype).replace("torch.", ""))
    source = resolve_model(spec)
    if activations not in ("traced", "fused"):
        raise ConfigError(f"activations must be 'traced' or 'fused', got {activations!r}")
    if master_weights and dtype != torch.bfloat16:
        raise ConfigError(f"master_weights prices graphopt.parallelize(..., mixed_precision="
                          f"'bf16'): float32 parameters computing in bfloat16 under "
                          f"torch.autocast; dtype is {dtype}: give torch.bfloat16 (or drop "
                          "master_weights)")
    if master_weights and activations == "fused":
        raise ConfigError("master_weights prices what transformers' code keeps under "
                          "torch.autocast (float32 residual stream and norms, 16-bit weight "
                          "copies); activations='fused' counts Megatron-Core's 16-bit fused "
                          "kernels: use activations='traced' with master_weights")
    key = (str(spec), seq, repr(cluster.device), dtype, attention, activations,
           repr(sorted((overrides or {}).items())), master_weights)  # values may be lists
    if key in _CACHE:
        return _CACHE[key]
    import transformers

    from graphopt.cost.training import _megatron_attention

    transformers.AttentionInterface.register("graphopt_megatron_cost", _megatron_attention)
    transformers.AttentionInterface.register("graphopt_fused_cost", _fused_cost_attention)
    cfg = model_config(source, overrides, seq)
    check_sizes(cfg)
    attn = "graphopt_fused_cost" if attention == "flash" else "graphopt_megatron_cost"

    types = [str(t) for t in (getattr(cfg, "layer_types", None) or ())]

    def build(layers: int, dense: int, kind: str | None) -> Any:
        """``layers`` layers of ``kind``, the first ``dense`` of them dense (MoE models;
        all of them where the model has no MoE layer)."""
        dense = dense if has_moe else layers
        extra: dict[str, Any] = {}
        if hasattr(cfg, "first_k_dense_replace"):  # DeepSeek
            extra["first_k_dense_replace"] = dense
        elif hasattr(cfg, "mlp_only_layers"):  # Qwen-MoE
            extra.update(mlp_only_layers=list(range(dense)), decoder_sparse_step=1)
        if types:  # mixed layers (MiniMax: linear, full attention): all of one kind
            extra["layer_types"] = [kind] * layers
        layer_key = "n_layer" if source.config_class == "GPT2Config" else "num_hidden_layers"
        fields = {**(overrides or {}), layer_key: layers, **extra}
        try:
            return build_architecture(source, build_dtype, fields, seq=seq,
                                      attn_implementation=attn)
        except ConfigError as exc:
            if repr(attn) not in str(exc):
                raise
            # a model whose attention classes sit in a fixed table (Falcon) takes no
            # registered attention function: its own SDPA path, which the fake trace
            # prices as the fused kernel, or its eager one (the unfused GEMMs of 2021)
            return build_architecture(source, build_dtype, fields, seq=seq,
                                      attn_implementation="sdpa" if attention == "flash"
                                      else "eager")

    layers = int(getattr(cfg, "num_hidden_layers", getattr(cfg, "n_layer", 0)))
    flags = moe_layer_flags(cfg, layers)
    has_moe = any(flags)
    # master weights: float32 parameters traced under autocast; an MoE model's grouped_mm
    # experts take bfloat16 parameters only, so it keeps the 16-bit trace
    mixed_dtype = dtype if master_weights and not has_moe else None
    build_dtype = torch.float32 if mixed_dtype is not None else dtype
    mixed = has_moe and not all(flags)  # dense layers among MoE ones: both measured

    def costs(kind: str | None) -> tuple[LayerCost, LayerCost, LayerCost | None]:
        """(head, dense layer, MoE layer) from models of 1 and 2 layers of ``kind``."""
        one = _measure(build(1, 1 if mixed else 0, kind), seq, cluster, mixed_dtype)
        if mixed:
            moe = _sub(_measure(build(2, 1, kind), seq, cluster, mixed_dtype), one)
            dense = _sub(_measure(build(2, 2, kind), seq, cluster, mixed_dtype), one)
            return _sub(one, dense), dense, moe
        layer = _sub(_measure(build(2, 0, kind), seq, cluster, mixed_dtype), one)
        return _sub(one, layer), layer, (layer if has_moe else None)

    moe: LayerCost | None
    kinds: list[str | None] = list(dict.fromkeys(types[:layers])) or [None]
    measured = {kind: costs(kind) for kind in kinds}
    head = measured[kinds[0]][0]
    # one layer's cost: the mean over the layers of each category (dense or MoE, by
    # moe_layer_flags), by the kinds they have (totals exact; a pipeline stage is priced with
    # the mean mix)
    n_moe = sum(flags)
    n_dense = layers - n_moe
    per_layer = types[:layers]
    dense = _mix(measured, 1, [t for t, f in zip(per_layer, flags) if not f] if has_moe
                 else per_layer)
    moe = _mix(measured, 2, [t for t, f in zip(per_layer, flags) if f]) if has_moe else None
    hidden = int(getattr(cfg, "hidden_size", getattr(cfg, "n_embd", 0)))
    heads = int(getattr(cfg, "num_attention_heads", getattr(cfg, "n_head", 0)))
    kv_heads = int(getattr(cfg, "num_key_value_heads", heads) or heads)
    if activations == "fused":
        from graphopt.planner.activations import fused_layer_activation_bytes

        act = str(getattr(cfg, "hidden_act", getattr(cfg, "activation_function", "")))
        ffn = int(getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None)
                  or 4 * hidden)
        dropout = any(float(getattr(cfg, k, 0) or 0) > 0 for k in (
            "resid_pdrop", "attn_pdrop", "hidden_dropout", "attention_dropout"))
        dense = dataclasses.replace(dense, activation_bytes=fused_layer_activation_bytes(
            seq, hidden, heads, kv_heads, ffn, act in ("silu", "swish"), dropout,
            flash=attention == "flash"))
    result = PlanModel(
        str(spec), seq, hidden, heads, kv_heads,
        int(cfg.vocab_size), n_dense, n_moe, dense, moe, head,
        experts=expert_count(cfg) if has_moe else 0,
        top_k=int(getattr(cfg, "num_experts_per_tok", 0) or 0),
        moe_ffn=int(getattr(cfg, "moe_intermediate_size", getattr(cfg, "intermediate_size", 0))
                    or 0),
        dtype_bytes=torch.finfo(dtype).bits // 8, activations=activations,
        master_weights=master_weights,
        # (an MoE model's trace is the 16-bit model's already)
        bf16_layers=None if not master_weights else (dense, moe, head) if mixed_dtype is None
        else _bf16_layers(spec, seq, cluster, dtype, attention, overrides),
        tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        head_dim=_qk_head_dim(cfg, hidden, heads),
        v_head_dim=int(getattr(cfg, "v_head_dim", 0) or _qk_head_dim(cfg, hidden, heads)))
    _CACHE[key] = result
    return result


def _qk_head_dim(cfg: Any, hidden: int, heads: int) -> int:
    """A query/key head's width: MLA's nope + rope dims, else ``head_dim``, else
    hidden / heads."""
    nope, rope = (getattr(cfg, n, None) for n in ("qk_nope_head_dim", "qk_rope_head_dim"))
    if nope and rope:
        return int(nope) + int(rope)
    return int(getattr(cfg, "head_dim", 0) or hidden // max(heads, 1))


def moe_layer_flags(cfg: Any, layers: int) -> list[bool]:
    """Which of the ``layers`` decoder layers of transformers config ``cfg`` are MoE layers,
    as the model classes decide: DeepSeek's first ``first_k_dense_replace`` are dense;
    Qwen-MoE's layer i is MoE unless i is in ``mlp_only_layers`` or (i + 1) is not a
    multiple of ``decoder_sparse_step`` (Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer); other
    MoE models (Mixtral, ...) are MoE in every layer; dense models in none."""
    if expert_count(cfg) == 0:
        return [False] * layers
    if hasattr(cfg, "first_k_dense_replace"):
        k = int(cfg.first_k_dense_replace or 0)
        return [i >= k for i in range(layers)]
    if hasattr(cfg, "mlp_only_layers") or hasattr(cfg, "decoder_sparse_step"):
        only = set(getattr(cfg, "mlp_only_layers", None) or ())
        step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
        return [i not in only and (i + 1) % step == 0 for i in range(layers)]
    return [True] * layers


def _mix(measured: dict[str | None, tuple[LayerCost, LayerCost, LayerCost | None]],
         index: int, types: list[str]) -> LayerCost:
    """The mean of ``measured[kind][index]`` over ``types`` (each layer's kind); the one
    kind's cost when the model has no layer types (or none in ``types``)."""
    if None in measured or not types:
        cost = next(iter(measured.values()))[index]
        assert cost is not None
        return cost
    parts = []
    for kind in types:
        cost = measured[kind][index]
        assert cost is not None
        parts.append((cost, 1 / len(types)))
    return _combine(parts)


def _bf16_layers(spec: str | Path, seq: int, cluster: ClusterProfile, dtype: torch.dtype,
                 attention: str, overrides: dict[str, Any] | None
                 ) -> tuple[LayerCost, LayerCost | None, LayerCost]:
    """(dense, MoE, head) of the 16-bit model's trace (:attr:`PlanModel.bf16_layers`)."""
    plain = plan_model(spec, seq, cluster, dtype, attention, "traced", overrides)
    return plain.dense, plain.moe, plain.head


def _sub(a: LayerCost, b: LayerCost) -> LayerCost:
    """``a - b`` field by field (GEMM shapes by shape), clamped at 0."""
    return _combine([(a, 1.0), (b, -1.0)])


def _combine(parts: list[tuple[LayerCost, float]]) -> LayerCost:
    """Sum of ``weight * cost`` over ``parts``, every number and every GEMM shape's seconds
    clamped at 0 (a shape whose seconds cancel is dropped)."""
    values: dict[str, float] = {}
    shapes: dict[tuple[int, int, int], float] = {}
    for cost, weight in parts:
        for f in dataclasses.fields(LayerCost):
            if f.name != "gemm_shapes":
                values[f.name] = values.get(f.name, 0.0) + weight * getattr(cost, f.name)
        for *key, seconds in cost.gemm_shapes:
            shapes[tuple(key)] = shapes.get(tuple(key), 0.0) + weight * seconds  # type: ignore
    return LayerCost(**{k: max(0.0, v) for k, v in values.items()}, gemm_shapes=tuple(
        (*k, v) for k, v in sorted(shapes.items()) if v > 1e-15))


def _lightning_kernel_layers(model: Any) -> int:
    """Run ``model``'s MiniMax-form linear-attention layers with graphopt's Lightning kernel
    (:func:`graphopt.kernels.lightning.lightning_attention`, the op graphopt.compile's
    attention pass puts in place of transformers' block loop, with the pass's block length)
    so that the trace prices what graphopt executes; fake-tracing the loop itself also took
    seconds per thousand tokens (one Python iteration per block per layer). Returns the
    number of layers swapped."""
    import types

    from graphopt.kernels.lightning import lightning_attention
    from graphopt.kernels.lightning.minimax import lightning_layers, minimax_lightning_layer

    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        out, state = lightning_attention(q, k, v, slope, scale=1.0, output_final_state=True)
        return out, state

    def forward(self: Any, hidden_states: torch.Tensor, *args: Any,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        return minimax_lightning_layer(self, hidden_states, mask, kernel)

    layers = lightning_layers(model)
    for _, layer in layers:
        layer.forward = types.MethodType(forward, layer)
    return len(layers)


def _measure(model: Any, seq: int, cluster: ClusterProfile,
             autocast: torch.dtype | None = None) -> LayerCost:
    """Two fake traces of one training step: as built, and with every decoder layer under
    selective activation checkpointing (:func:`selective_checkpoint_context`; make_fx marks
    the policy on each op and :mod:`graphopt.cost.memory` reads what is saved and
    recomputed); under ``torch.autocast(dtype=autocast)`` where given."""
    from graphopt.cost.estimate import trace_step
    from graphopt.cost.graph_cost import graph_cost
    from graphopt.cost.memory import parameter_casts_saved, recomputed_nodes, saved_for_backward
    from graphopt.cost.training import tp_split_times

    hidden = int(getattr(model.config, "hidden_size", getattr(model.config, "n_embd", 0)))
    _lightning_kernel_layers(model)
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    gm = trace_step(model, inputs, tracing="fake", fused_attention=True, autocast=autocast)
    device = dataclasses.replace(cluster.device, matmul_efficiency=1.0)
    cost = graph_cost(gm, device)
    gemm, split, repl = tp_split_times(gm, cost, hidden)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    total = sum(p.numel() for p in model.parameters())
    selective = (float(saved_for_backward(gm)), 0.0, 0.0, 0.0)
    if getattr(model, "supports_gradient_checkpointing", False):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={
            "use_reentrant": False, "context_fn": selective_checkpoint_context})
        model.train()
        try:
            sac = trace_step(model, inputs, tracing="fake", fused_attention=True,
                             autocast=autocast)
        except RuntimeError:  # checkpointing refused the recomputation (ops replayed
            sac = None        # differently): no selective choice for this model
        finally:
            model.activation_checkpointing_disable()
        if sac is not None:
            rec = {n.name for n in recomputed_nodes(sac)}
            rec_cost = graph_cost(sac, device)
            rec_cost.nodes = [c for c in rec_cost.nodes if c.name in rec]
            selective = (float(saved_for_backward(sac)),
                         *tp_split_times(sac, rec_cost, hidden))
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    grad_gemms = weight_gradient_gemms(gm, trained)
    compute = {c.name: float(c.time_s) for c in cost.nodes if c.bound == "compute"}
    wgrad = {True: 0.0, False: 0.0}  # by "is a routed expert"
    for name, gemms in grad_gemms.items():
        wgrad[".experts." in name] += sum(compute.get(g, 0.0) for g in gemms)
    return LayerCost(gemm, split, repl, float(cost.flops), float(saved_for_backward(gm)),
                     float(total - experts), float(experts), float(cost.peak_s), *selective,
                     cast_bytes=float(parameter_casts_saved(gm, len(dict(
                         model.named_parameters())))) if autocast is not None else 0.0,
                     gemm_shapes=gemm_shapes(gm, cost, seq, hidden),
                     weight_grad_s=wgrad[False], expert_weight_grad_s=wgrad[True])


_aten = torch.ops.aten
_GEMMS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten._grouped_mm.default}
_PASS_THROUGH = {_aten.t.default, _aten.transpose.int, _aten.permute.default,
                 _aten.view.default, _aten._unsafe_view.default, _aten.reshape.default,
                 _aten.clone.default, _aten._to_copy.default, _aten.add.Tensor,
                 _aten.squeeze.dim, _aten.unsqueeze.default, _aten.expand.default,
                 _aten.alias.default}


def weight_gradient_gemms(gm: torch.fx.GraphModule, names: list[str]) -> dict[str, set[str]]:
    """For each trainable parameter of a :func:`graphopt.cost.estimate.trace_step` graph
    (``names``: the model's ``requires_grad`` parameters in ``named_parameters`` order, as
    the trace returns their gradients after the loss), the GEMM nodes (``mm``, ``addmm``,
    ``bmm``, ``_grouped_mm``) whose output becomes its gradient through layout, cast and
    accumulation ops only (``t``, views, ``add`` of a tied weight's contributions). An
    embedding's gradient (``embedding_dense_backward``) and a bias's (``sum``) have none.
    Source: the backward of ``Y = X W^T`` is ``dX = dY W`` and ``dW = dY^T X``
    (the weight-gradient GEMM, Narayanan et al. SC'21 Sec. 3.1's 2 x forward FLOPs split as
    one GEMM each)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    grads = torch.utils._pytree.tree_leaves(out.args)[1:]  # after the loss
    found: dict[str, set[str]] = {}
    for name, grad in zip(names, grads):
        gemms: set[str] = set()
        stack, seen = [grad], set()
        while stack:
            node = stack.pop()
            if not isinstance(node, torch.fx.Node) or node in seen or node.op != "call_function":
                continue
            seen.add(node)
            if node.target in _GEMMS:
                gemms.add(node.name)
            elif node.target in _PASS_THROUGH:
                stack.extend(a for a in node.args if isinstance(a, torch.fx.Node))
        found[name] = gemms
    return found


def gemm_shapes(gm: torch.fx.GraphModule, cost: Any, tokens: int, hidden: int
                ) -> tuple[tuple[int, int, int, float], ...]:
    """:attr:`LayerCost.gemm_shapes` of a priced trace of ``tokens`` tokens: every
    ``mm``/``addmm`` with a dimension equal to ``tokens`` (forward: the rows; the weight
    gradient: the contraction). Of the other two the one TP splits is the one not equal to
    ``hidden`` (a column-parallel output, a row-parallel input, the vocabulary), the first
    when both or neither are (the table is read symmetrically in them)."""
    aten = torch.ops.aten
    nodes = {n.name: n for n in gm.graph.nodes}
    shapes: dict[tuple[int, int, int], float] = {}
    for c in cost.nodes:
        node = nodes.get(c.name)
        if c.bound != "compute" or node is None or node.target not in (
                aten.mm.default, aten.addmm.default):
            continue
        a, b = node.args[-2:] if node.target is aten.addmm.default else node.args[:2]
        va, vb = (getattr(x, "meta", {}).get("val") for x in (a, b))
        if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)):
            continue
        m, k, n = (int(va.shape[0]), int(va.shape[1]), int(vb.shape[1]))
        for i, d in enumerate((m, k, n)):
            if d == tokens:
                x, y = [e for j, e in enumerate((m, k, n)) if j != i]
                split, kept = (y, x) if x == hidden and y != hidden else (x, y)
                key = (d, split, kept)
                shapes[key] = shapes.get(key, 0.0) + float(c.peak_s)
                break
    return tuple((*k, v) for k, v in sorted(shapes.items()))
