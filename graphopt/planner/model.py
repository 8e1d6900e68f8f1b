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
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graphopt.cost.profiles import ClusterProfile
from graphopt.errors import ConfigError

# Published architectures (config kwargs for the transformers classes).
PLAN_MODELS: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "llama3-8b": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=128256), "Llama 3 paper (Dubey et al. 2024), Tab. 3"),
    "llama3-70b": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        intermediate_size=28672, vocab_size=128256), "Llama 3 paper, Tab. 3"),
    "llama3-405b": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=16384, num_hidden_layers=126, num_attention_heads=128,
        num_key_value_heads=8, intermediate_size=53248, vocab_size=128256),
        "Llama 3 paper, Tab. 3"),
    "gpt3-175b": ("GPT2Config", "GPT2LMHeadModel", dict(
        n_embd=12288, n_layer=96, n_head=96, vocab_size=51200),
        "GPT-3 paper (Brown et al. 2020), Tab. 2.1; vocab as in Megatron-LM"),
    "mixtral-8x22b": ("MixtralConfig", "MixtralForCausalLM", dict(
        hidden_size=6144, num_hidden_layers=56, num_attention_heads=48, num_key_value_heads=8,
        intermediate_size=16384, num_local_experts=8, num_experts_per_tok=2,
        vocab_size=32768), "mistralai/Mixtral-8x22B-v0.1 config.json (141B total)"),
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
        num_key_value_heads=128, intermediate_size=18432, moe_intermediate_size=2048,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8,
        topk_group=4, first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=129280),
        "deepseek-ai/DeepSeek-V3 config.json (671B total, 37B active)"),
    "dense-310b": ("GPT2Config", "GPT2LMHeadModel", dict(
        n_embd=16384, n_layer=96, n_head=128, vocab_size=51200),
        "the 310B GPT of Megatron-LM SC'21 Tab. 1 (Hypertron's dense 310B: same size class)"),
}


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
        """Seconds :meth:`flops_per_sequence` takes on one device at the peak FLOP/s of each
        op's dtype: MFU = this * sequences / (step time * devices)."""
        moe = self.moe.peak_s * self.moe_layers if self.moe else 0.0
        return self.dense.peak_s * self.dense_layers + moe + self.head.peak_s


_CACHE: dict[tuple[Any, ...], PlanModel] = {}


def load_model_config(spec: str | Path) -> tuple[str, str, dict[str, Any]]:
    """(config class, model class, kwargs) for a PLAN_MODELS name, a graphopt.models name or
    a transformers config.json path.

    Raises:
        ConfigError: unknown name (lists them) or an unreadable/unsupported config.json.
    """
    from graphopt.models import SPECS

    text = str(spec)
    if text in PLAN_MODELS:
        return PLAN_MODELS[text][:3]
    if text in SPECS:
        s = SPECS[text]
        return s.config_class, s.model_class, dict(s.kwargs)
    path = Path(text)
    if not path.is_file():
        raise ConfigError(f"unknown model {text!r}: not a file and not one of "
                          f"{', '.join([*PLAN_MODELS, *SPECS])}")
    try:
        data = json.loads(path.read_text())
        model_type = data.pop("model_type")
        from transformers import AutoConfig

        cfg = AutoConfig.for_model(model_type)
        arch = (data.pop("architectures", None) or [None])[0]
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"{path}: not a transformers config.json ({exc})") from exc
    if arch is None:
        raise ConfigError(f"{path}: config.json has no 'architectures' entry naming the model "
                          "class (e.g. LlamaForCausalLM)")
    allowed = {k: v for k, v in data.items() if not k.startswith("_") and k != "auto_map"}
    return type(cfg).__name__, arch, allowed


def plan_model(spec: str | Path, seq: int, cluster: ClusterProfile,
               dtype: torch.dtype = torch.bfloat16, attention: str = "flash",
               overrides: dict[str, Any] | None = None) -> PlanModel:
    """Measure ``spec`` (see :func:`load_model_config`) at sequence length ``seq`` on the
    cluster's device (see the module docstring). Cached per process.

    ``attention``: "flash" (the fused kernel, as today's frameworks run) or "megatron2021"
    (Q K^T and P V GEMMs around a fused softmax, as Megatron-LM ran in its SC'21 paper; used
    to validate against that paper). ``overrides``: config fields to change (e.g. sizes).

    Raises:
        ConfigError: unknown model or attention kind.
    """
    if attention not in ("flash", "megatron2021"):
        raise ConfigError(f"attention must be 'flash' or 'megatron2021', got {attention!r}")
    config_class, model_class, kwargs = load_model_config(spec)
    kwargs = {**kwargs, **(overrides or {})}
    key = (str(spec), seq, repr(cluster.device), dtype, attention,
           tuple(sorted((overrides or {}).items())))
    if key in _CACHE:
        return _CACHE[key]
    import transformers

    from graphopt.cost.training import _megatron_attention

    transformers.AttentionInterface.register("graphopt_megatron_cost", _megatron_attention)

    def build(layers: int, dense: int) -> Any:
        extra = {"first_k_dense_replace": dense} if "first_k_dense_replace" in kwargs else {}
        layer_key = "n_layer" if config_class == "GPT2Config" else "num_hidden_layers"
        config = _config(transformers, config_class, {**kwargs, layer_key: layers, **extra})
        if config_class == "GPT2Config":
            config.n_positions = max(seq, config.n_positions)
        config._attn_implementation = "sdpa" if attention == "flash" else \
            "graphopt_megatron_cost"
        if any("expert" in k for k in kwargs):
            config._experts_implementation = "grouped_mm"
        with torch.device("meta"):
            return getattr(transformers, model_class)(config).to(dtype)

    cfg = _config(transformers, config_class, kwargs)
    layers = int(getattr(cfg, "num_hidden_layers", getattr(cfg, "n_layer", 0)))
    dense_k = int(getattr(cfg, "first_k_dense_replace", 0) or 0)
    has_moe = any("expert" in k for k in kwargs)
    one = _measure(build(1, 1 if dense_k else 0), seq, cluster)
    moe: LayerCost | None
    if has_moe and dense_k:
        moe = _sub(_measure(build(2, 1), seq, cluster), one)
        dense = _sub(_measure(build(2, 2), seq, cluster), one)
        head = _sub(one, dense)
        n_dense, n_moe = min(dense_k, layers), max(layers - dense_k, 0)
    else:
        layer = _sub(_measure(build(2, 0), seq, cluster), one)
        head = _sub(one, layer)
        dense, moe = layer, (layer if has_moe else None)
        n_dense, n_moe = (layers, 0) if not has_moe else (0, layers)
    hidden = int(getattr(cfg, "hidden_size", getattr(cfg, "n_embd", 0)))
    heads = int(getattr(cfg, "num_attention_heads", getattr(cfg, "n_head", 0)))
    result = PlanModel(
        str(spec), seq, hidden, heads, int(getattr(cfg, "num_key_value_heads", heads) or heads),
        int(cfg.vocab_size), n_dense, n_moe, dense, moe, head,
        experts=int(getattr(cfg, "num_local_experts", getattr(cfg, "n_routed_experts",
                                                             getattr(cfg, "num_experts", 0)))
                    or 0),
        top_k=int(getattr(cfg, "num_experts_per_tok", 0) or 0),
        moe_ffn=int(getattr(cfg, "moe_intermediate_size", getattr(cfg, "intermediate_size", 0))
                    or 0),
        dtype_bytes=torch.finfo(dtype).bits // 8)
    _CACHE[key] = result
    return result


def _config(transformers: Any, config_class: str, kwargs: dict[str, Any]) -> Any:
    """The transformers config, or ConfigError naming what transformers rejected."""
    try:
        return getattr(transformers, config_class)(**kwargs)
    except Exception as exc:  # transformers' validation raises several exception classes
        raise ConfigError(f"transformers rejects this {config_class}: {type(exc).__name__}: "
                          f"{str(exc)[:300]}") from exc


def _sub(a: LayerCost, b: LayerCost) -> LayerCost:
    return LayerCost(*(max(0.0, x - y) for x, y in zip(dataclasses.astuple(a),
                                                       dataclasses.astuple(b))))


def _measure(model: Any, seq: int, cluster: ClusterProfile) -> LayerCost:
    from graphopt.cost.estimate import trace_step
    from graphopt.cost.graph_cost import graph_cost
    from graphopt.cost.memory import saved_for_backward
    from graphopt.cost.training import tp_split_times

    hidden = int(getattr(model.config, "hidden_size", getattr(model.config, "n_embd", 0)))
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    gm = trace_step(model, inputs, tracing="fake", fused_attention=True)
    device = dataclasses.replace(cluster.device, matmul_efficiency=1.0)
    cost = graph_cost(gm, device)
    gemm, split, repl = tp_split_times(gm, cost, hidden)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    total = sum(p.numel() for p in model.parameters())
    return LayerCost(gemm, split, repl, float(cost.flops), float(saved_for_backward(gm)),
                     float(total - experts), float(experts), float(cost.peak_s))
