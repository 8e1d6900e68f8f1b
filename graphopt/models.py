"""Models by name: small real transformers models (random weights, no downloads) for demo,
tests and benchmarks, published architectures at full size, and the one loader the cost
model and the planner share.

Each ``SPECS`` entry builds the library's own model class from a small ("toy") config, so
graphopt sees the exact code users run (MiniMax's Python block loop, Mixtral's routing loop,
...). ``PUBLISHED_MODELS`` are real architectures (built on the meta device only).
:func:`resolve_model` turns either name, or a transformers config.json path, into a
:class:`ModelSource`; :func:`build_architecture` instantiates it on the meta device.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graphopt.errors import ConfigError


@contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[None]:
    """``module`` in eval mode for the block, then every submodule back in its own mode
    (``module.train(flag)`` afterwards would set a wrapped model's submodules to the
    wrapper's mode: an eval-mode model came back training, dropout on)."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def eager_forward_failed(check: str, exc: Exception) -> ConfigError:
    """The refusal of a parallel plan whose check runs the model eagerly (``check`` says
    which check, e.g. "pp > 1 checks its stages against one eager forward of the model")
    when the model's own forward raised ``exc``: the model cannot run as built, which is not
    the plan's fault (a review: a float64 Mixtral with grouped_mm experts died with torch's
    "mat_a" message, blamed on the pipeline's stages and on CP's attention)."""
    hint = (" (grouped_mm experts have no float64 kernel: call model."
            "set_experts_implementation('eager') or use float32/bfloat16)"
            if "mat_a" in str(exc) or "grouped_mm" in str(exc) else "")
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return ConfigError(f"{check}, and the model's own forward failed: {first}{hint}")


def refuse_aux_loss(config: Any, plan: str, loss: str, missing: str) -> None:
    """Raise :class:`ConfigError` when ``config`` adds transformers' MoE load-balancing loss
    (``output_router_logits`` with a nonzero ``router_aux_loss_coef``) that the parallel
    form ``plan`` ("pp > 1", "cp > 1"), training on ``loss``, cannot compute (``missing``
    says why): the loss was dropped without a word, router gradients 2.7-50% off one
    process (reviews).

    Raises:
        ConfigError: the auxiliary loss is on; names ``output_router_logits=False`` or
            the plan's dimension = 1 as the fix.
    """
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    if getattr(config, "output_router_logits", False) and coef:
        raise ConfigError(f"{plan} trains on {loss}; this MoE model adds a load-balancing loss "
                          f"(output_router_logits=True, router_aux_loss_coef={coef}) "
                          f"{missing}: set config.output_router_logits=False (no auxiliary "
                          f"loss) or use {plan.split()[0]}=1")


def rope_kinds(module: torch.nn.Module) -> list[str]:
    """The ``rope_type`` names of a transformers rotary embedding (one per layer type where
    the model keeps a dict of them); [] for any other module."""
    kind = getattr(module, "rope_type", None)
    kinds = list(kind.values()) if isinstance(kind, dict) else [kind]
    return [k for k in kinds if isinstance(k, str)]


def length_dependent_rope(module: torch.nn.Module) -> bool:
    """A transformers rotary embedding whose frequencies follow the sequence length:
    ``dynamic`` NTK scaling (inverse frequencies recomputed from ``max(position_ids) + 1``)
    or ``longrope`` (Phi-3: the long factors past the original length)."""
    return any("dynamic" in k or k == "longrope" for k in rope_kinds(module))


@contextmanager
def rope_state_kept(module: torch.nn.Module) -> Iterator[None]:
    """Put back, after the block, what a forward changed in ``module``'s rotary embeddings
    whose frequencies follow the sequence length (transformers' ``dynamic_rope_update``:
    ``dynamic`` NTK grows and caches ``inv_freq`` with the longest sequence seen, ``longrope``
    writes it in place): graphopt's own check forwards (CP's probe, the TP layout's, PP's
    stage check) ran 8-16 tokens and left the model computing another sequence's
    frequencies than one process given the same batches would (a review: 1.2e-3 off under
    pp x cp)."""
    saved = []
    for m in module.modules():
        if length_dependent_rope(m):
            attrs = {k: v for k, v in vars(m).items() if k != "_buffers"}
            buffers = dict(m._buffers)
            values = {k: b.detach().clone() for k, b in buffers.items() if b is not None}
            saved.append((m, attrs, buffers, values))
    try:
        yield
    finally:
        for m, attrs, buffers, values in saved:
            for k in [k for k in vars(m) if k not in attrs and k != "_buffers"]:
                delattr(m, k)
            m.__dict__.update(attrs)
            m._buffers.clear()
            m._buffers.update(buffers)
            with torch.no_grad():
                for k, value in values.items():
                    buffer = buffers[k]
                    assert buffer is not None
                    buffer.copy_(value)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    config_class: str
    model_class: str
    kwargs: dict[str, Any]


# MoE models are built with transformers' "eager" experts (the per-expert Python loop; it runs
# in float64, so it is the reference of the exactness tests). Switch a model to one-graph
# experts with ``model.set_experts_implementation("grouped_mm")`` before compiling it with
# options={"moe": ...}: the eager loop graph-breaks and the MoE pass reports it.
_MOE = dict(experts_implementation="eager")
_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

SPECS: dict[str, ModelSpec] = {
    "llama": ModelSpec("llama", "LlamaConfig", "LlamaForCausalLM", dict(_COMMON)),
    "qwen3": ModelSpec("qwen3", "Qwen3Config", "Qwen3ForCausalLM", dict(_COMMON, head_dim=16)),
    "mixtral": ModelSpec("mixtral", "MixtralConfig", "MixtralForCausalLM",
                         dict(_COMMON, **_MOE, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ModelSpec("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                           dict(_COMMON, **_MOE, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=64, decoder_sparse_step=1,
                                mlp_only_layers=[])),
    # MLA attention, one dense layer then MoE: sigmoid router with group-limited top-k,
    # a shared expert next to the routed ones.
    "deepseek_v3": ModelSpec("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
                             dict(_COMMON, **_MOE, num_key_value_heads=4, moe_intermediate_size=32,
                                  n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                                  n_group=2, topk_group=1, first_k_dense_replace=1,
                                  q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                                  qk_nope_head_dim=8, v_head_dim=16)),
    "gpt2": ModelSpec("gpt2", "GPT2Config", "GPT2LMHeadModel",
                      dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                           bos_token_id=0, eos_token_id=0)),
    # Both layer types: linear (lightning) attention and softmax attention; MoE MLPs.
    "minimax": ModelSpec("minimax", "MiniMaxConfig", "MiniMaxForCausalLM",
                         dict(_COMMON, **_MOE, head_dim=16, num_local_experts=4,
                              num_experts_per_tok=2, block_size=16,
                              layer_types=["linear_attention", "full_attention"],
                              full_attn_alpha_factor=1.0, full_attn_beta_factor=1.0,
                              linear_attn_alpha_factor=1.0, linear_attn_beta_factor=1.0,
                              mlp_alpha_factor=1.0, mlp_beta_factor=1.0)),
}


_EXPERT_FIELDS = ("num_local_experts", "n_routed_experts", "num_experts")
"""Config fields that count routed experts (Mixtral/MiniMax, DeepSeek, Qwen-MoE)."""


def expert_count(config: Any) -> int:
    """Routed experts per MoE layer of a transformers config, or of the kwargs that build
    one (a Mapping); 0 for a dense model."""
    for name in _EXPERT_FIELDS:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if value:
            return int(value)
    return 0


# Published architectures at their real sizes: (config class, model class, config kwargs,
# source). Build them on the meta device only (billions of parameters).
PUBLISHED_MODELS: dict[str, tuple[str, str, dict[str, Any], str]] = {
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
        n_embd=12288, n_layer=96, n_head=96, vocab_size=51200, n_positions=2048),
        "GPT-3 paper (Brown et al. 2020), Tab. 2.1 (context 2048); vocab as in Megatron-LM"),
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


def model_names() -> list[str]:
    """Names :func:`resolve_model` accepts besides config.json paths."""
    return [*PUBLISHED_MODELS, *SPECS]


@dataclass(frozen=True)
class ModelSource:
    """A model architecture resolved by :func:`resolve_model`: transformers class names and
    the config kwargs that build it."""

    name: str
    config_class: str
    model_class: str
    kwargs: dict[str, Any]
    toy: bool
    """A ``SPECS`` test config: real model code at a tiny size, not a published model."""
    source: str = ""

    def toy_note(self) -> str:
        """One line saying this is a toy model and what to use instead ("" if not a toy)."""
        if not self.toy:
            return ""
        hidden = self.kwargs.get("hidden_size", self.kwargs.get("n_embd"))
        layers = self.kwargs.get("num_hidden_layers", self.kwargs.get("n_layer"))
        return (f"note: {self.name!r} is a toy model: graphopt's small test config of "
                f"{self.model_class} (hidden {hidden}, {layers} layers), not a published "
                f"model; for real sizes use one of {', '.join(PUBLISHED_MODELS)} or a "
                "transformers config.json")


def resolve_model(spec: str | Path) -> ModelSource:
    """The architecture named by ``spec``: a ``PUBLISHED_MODELS`` name, a ``SPECS`` (toy)
    name, or a transformers config.json path (its ``model_type`` and ``architectures``).

    Raises:
        ConfigError: unknown name (lists the valid ones), missing file, or a file that is
            not a transformers config.json.
    """
    text = str(spec)
    if text in PUBLISHED_MODELS:
        config_class, model_class, kwargs, source = PUBLISHED_MODELS[text]
        return ModelSource(text, config_class, model_class, dict(kwargs), False, source)
    if text in SPECS:
        s = SPECS[text]
        return ModelSource(text, s.config_class, s.model_class, dict(s.kwargs), True,
                           "graphopt.models.SPECS")
    path = Path(text)
    if not path.is_file():
        what = "config file does not exist" if path.suffix == ".json" else "not a file"
        raise ConfigError(f"unknown model {text!r}: {what}, and not one of "
                          f"{', '.join(model_names())}")
    return _from_config_json(path)


def _from_config_json(path: Path) -> ModelSource:
    """A :class:`ModelSource` from a transformers config.json (ConfigError if it is not)."""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("the file holds no JSON object")
        model_type = data.pop("model_type")
        from transformers import AutoConfig

        try:
            cfg = AutoConfig.for_model(model_type)
        except ValueError as exc:  # its message lists every model type (~12 kB)
            import transformers

            raise ConfigError(f"{path}: model_type {model_type!r} is not one transformers "
                              f"{transformers.__version__} knows; fix the config.json's "
                              "model_type (e.g. 'llama', 'qwen3_moe') or upgrade "
                              "transformers") from exc
        archs = data.pop("architectures", None)
        arch = archs if isinstance(archs, str) else (archs or [None])[0]
    except ConfigError:
        raise
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"{path}: not a transformers config.json ({exc})") from exc
    if arch is None:
        raise ConfigError(f"{path}: config.json has no 'architectures' entry naming the model "
                          "class (e.g. LlamaForCausalLM)")
    if str(arch).endswith("ForConditionalGeneration") and isinstance(data.get("text_config"),
                                                                      dict):
        raise ConfigError(f"{path}: {arch} is a multimodal model; graphopt plans its language "
                          "model: save its 'text_config' as its own config.json (with that "
                          "section's model_type, e.g. gemma3_text, and architectures "
                          "[...ForCausalLM]) and pass that")
    if not str(arch).endswith(("ForCausalLM", "LMHeadModel")):
        raise ConfigError(f"{path}: architecture {arch} is not a causal LM: graphopt prices and "
                          "runs a language-model training step (next-token loss over [batch, "
                          "seq] token ids, LM head included); set 'architectures' to the "
                          f"model's causal-LM class (e.g. "
                          f"{str(arch).split('For')[0].removesuffix('Model')}ForCausalLM)")
    kwargs = {k: v for k, v in data.items() if not k.startswith("_") and k != "auto_map"}
    return ModelSource(str(path), type(cfg).__name__, arch, kwargs, False, f"file {path}")


def model_config(source: ModelSource, overrides: Mapping[str, Any] | None = None,
                 seq: int | None = None) -> Any:
    """The transformers config of ``source`` with ``overrides`` (config fields) applied;
    GPT-2's learned positions are extended to ``seq``.

    Raises:
        ConfigError: an override that is not a field of the config class, or a value
            transformers rejects (its message included).
    """
    import transformers

    cls = getattr(transformers, source.config_class)
    unknown = [k for k in overrides or {} if not hasattr(cls(), k)]
    if unknown:
        raise ConfigError(f"override(s) {', '.join(unknown)} not a field of "
                          f"{source.config_class}; use its field names (e.g. hidden_size)")
    try:
        config = cls(**{**source.kwargs, **(overrides or {})})
    except Exception as exc:  # transformers' validation raises several exception classes
        raise ConfigError(f"transformers rejects this {source.config_class}: "
                          f"{type(exc).__name__}: {str(exc)[:300]}") from exc
    if seq is not None and hasattr(config, "n_positions"):
        config.n_positions = max(seq, config.n_positions)
    return config


def check_sizes(cfg: Any) -> None:
    """Raise ConfigError for sizes no model has (found by reviews: a zero vocabulary ended
    in a reshape error deep in the trace, heads not divisible by KV heads were planned, and
    ``graphopt estimate`` priced them or crashed on a top-k above the expert count).

    Args:
        cfg: a transformers ``PretrainedConfig`` (sizes are counts: heads, layers, experts,
            hidden and FFN widths in elements).
    Raises:
        ConfigError: a non-positive size, query heads not divisible by KV heads (GQA),
            ``num_experts_per_tok`` outside [1, experts], ``n_group`` not dividing the
            experts or ``topk_group`` outside [1, n_group], a non-positive sliding window.
    """
    for names in (("vocab_size",), ("hidden_size", "n_embd"), ("num_hidden_layers", "n_layer"),
                  ("num_attention_heads", "n_head"), ("num_key_value_heads",), ("head_dim",),
                  ("intermediate_size", "n_inner")):
        name = next((n for n in names if getattr(cfg, n, None) is not None), None)
        if name is not None and not int(getattr(cfg, name)) > 0:
            raise ConfigError(f"{name} must be a positive integer, got {getattr(cfg, name)!r}; "
                              "fix the config or the override")
    heads = int(getattr(cfg, "num_attention_heads", getattr(cfg, "n_head", 1)) or 1)
    kv = getattr(cfg, "num_key_value_heads", None)
    if kv is not None and heads % int(kv):
        raise ConfigError(f"num_attention_heads ({heads}) must be divisible by "
                          f"num_key_value_heads ({kv}): each KV head serves a whole group of "
                          "query heads (GQA); fix the config or the override")
    # MoE and MLA sizes (a review: these ended in tracebacks from deep in the trace, or
    # were accepted and priced as nonsense)
    for name in ("moe_intermediate_size", "kv_lora_rank", "q_lora_rank",
                 "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        value = getattr(cfg, name, None)
        if value is not None and not (isinstance(value, int) and value > 0):
            raise ConfigError(f"{name} must be a positive integer, got {value!r}; fix the "
                              "config or the override")
    experts = next((getattr(cfg, n) for n in ("num_local_experts", "num_experts",
                                              "n_routed_experts")
                    if isinstance(getattr(cfg, n, None), int)), None)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    if experts is not None and isinstance(top_k, int) and not 1 <= top_k <= experts:
        raise ConfigError(f"num_experts_per_tok ({top_k}) must be in [1, {experts}] (the "
                          "routed experts); fix the config or the override")
    groups, chosen = getattr(cfg, "n_group", None), getattr(cfg, "topk_group", None)
    if experts is not None and isinstance(groups, int) and groups > 0:
        if experts % groups:
            raise ConfigError(f"n_group ({groups}) must divide the routed experts "
                              f"({experts}): group-limited routing splits them evenly")
        if isinstance(chosen, int) and not 1 <= chosen <= groups:
            raise ConfigError(f"topk_group ({chosen}) must be in [1, n_group={groups}]")
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", True) is False:
        window = None  # switched off: transformers 5's Qwen2-MoE then stores 0 (a review:
        # parallel="auto" refused every Qwen1.5-MoE / Qwen2-57B-A14B config)
    if window is not None and not (isinstance(window, int) and window > 0):
        raise ConfigError(f"sliding_window must be a positive integer or null, got "
                          f"{window!r}; fix the config or the override")


def max_positions(model: torch.nn.Module) -> int | None:
    """The longest sequence a transformers model takes (None when its config does not say)."""
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def learned_positions(model: torch.nn.Module) -> int | None:
    """The rows of ``model``'s learned position table (GPT-2's ``wpe``: an ``nn.Embedding``
    other than the token embedding with :func:`max_positions` rows), which a longer
    sequence indexes past; None for models without one (RoPE's nominal length is no
    limit)."""
    longest = max_positions(model)
    lookup = getattr(model, "get_input_embeddings", lambda: None)()
    if longest is not None and any(isinstance(m, torch.nn.Embedding) and m is not lookup and
                                   m.num_embeddings == longest for m in model.modules()):
        return longest
    return None


def build_architecture(source: ModelSource, dtype: torch.dtype = torch.float32,
                       overrides: Mapping[str, Any] | None = None, *, seq: int | None = None,
                       attn_implementation: str = "sdpa") -> torch.nn.Module:
    """``source`` instantiated on the meta device (no weights) in ``dtype``, in training
    mode; MoE models use transformers' grouped_mm experts (a fake trace cannot run the
    eager per-expert loop). What ``graphopt estimate`` and the planner trace.

    Raises:
        ConfigError: as :func:`model_config` and :func:`check_sizes`; an MoE model in a
            dtype other than bfloat16;
            transformers cannot build the model class.
    """
    import transformers

    config = model_config(source, overrides, seq)
    check_sizes(config)
    config._attn_implementation = attn_implementation
    if expert_count(config):
        if dtype != torch.bfloat16:
            raise ConfigError(f"{source.name} is an MoE model: it is traced with transformers' "
                              "grouped_mm experts (no data-dependent expert loop), and "
                              f"torch._grouped_mm takes bfloat16 only, not {dtype}; use "
                              "dtype bfloat16 (--dtype bfloat16)")
        config._experts_implementation = "grouped_mm"
        _check_grouped_mm_alignment(config, source.name)
    try:
        with torch.device("meta"):
            return getattr(transformers, source.model_class)(config).to(dtype)
    except Exception as exc:  # model __init__ validation, any exception class
        raise ConfigError(f"transformers cannot build {source.model_class} from this config: "
                          f"{type(exc).__name__}: {str(exc)[:300]}") from exc


def _check_grouped_mm_alignment(config: Any, name: str) -> None:
    """torch._grouped_mm needs each matrix row to be a multiple of 16 bytes (8 bfloat16
    values): an expert width of 100 died in its meta kernel with a raw RuntimeError in
    ``graphopt plan`` and ``parallel="auto"`` (a review).

    Raises:
        ConfigError: the hidden size or the expert FFN width is not a multiple of 8.
    """
    ffn = "moe_intermediate_size" if getattr(config, "moe_intermediate_size", None) \
        else "intermediate_size"
    sizes = {key: getattr(config, key, None) for key in ("hidden_size", ffn)}
    bad = {k: v for k, v in sizes.items() if isinstance(v, int) and v % 8}
    if bad:
        shown = ", ".join(f"{k}={v} ({2 * v} bytes)" for k, v in bad.items())
        padded = ", ".join(f"{k}={-(-v // 8) * 8}" for k, v in bad.items())
        raise ConfigError(f"{name} is an MoE model, traced with torch._grouped_mm experts, "
                          "which need matrix rows of a multiple of 16 bytes (8 bfloat16 "
                          f"values): {shown} is not. The planner cannot price it: plan padded "
                          f"sizes (graphopt plan --override {padded}), which a GPU run with "
                          "grouped_mm needs too, or give parallel=ParallelPlan(...) instead "
                          "of 'auto'")


def build_model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0,
                attn_implementation: str = "sdpa", **overrides: Any) -> torch.nn.Module:
    """Build ``SPECS[name]`` with random weights (seeded), in eval mode, no dropout.

    Raises:
        ConfigError: unknown model name (lists the valid ones).
        ImportError: transformers is not installed (install ``graphopt[models]``).
    """
    if name not in SPECS:
        raise ConfigError(f"unknown model {name!r}; available: {', '.join(SPECS)}")
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("real models need transformers: pip install 'graphopt[models]'") from exc
    spec = SPECS[name]
    config = getattr(transformers, spec.config_class)(**{**spec.kwargs, **overrides})
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = getattr(transformers, spec.model_class)(config)
    return model.to(dtype).eval()


def sample_batch(model: torch.nn.Module, batch: int = 2, seq: int = 32,
                 seed: int = 0) -> torch.Tensor:
    """Token ids [batch, seq] (int64) within the model's vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    vocab = int(model.config.vocab_size)  # type: ignore[union-attr,arg-type]
    return torch.randint(0, vocab, (batch, seq), generator=gen)


def logits_fn(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``ids -> logits`` without the KV cache, the function tests and the demo compile."""
    def run(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, use_cache=False).logits
    return run


@contextmanager
def experts_implementation(module: torch.nn.Module, kind: str,
                           replace: Callable[[str], bool]) -> Iterator[bool]:
    """The block with ``module``'s transformers MoE experts set to ``kind`` ("eager": the
    per-expert loop, "batched_mm", "grouped_mm"; transformers' ``set_experts_implementation``)
    where ``replace(current kind)``, set back after; yields whether any was switched. The
    outermost transformers model is switched (it sets its submodules'; a model without
    experts keeps "eager"). The kinds compute the same function (transformers'
    ``integrations/moe.py``): "batched_mm" gathers each token's expert weights (static
    shapes, any dtype, a fake trace runs it); "eager" loops over the experts hit.

    Raises:
        ValueError: transformers' own, for a kind it does not know."""
    models: list[Any] = [
        m for m in module.modules() if hasattr(m, "set_experts_implementation") and
        replace(getattr(getattr(m, "config", None), "_experts_implementation", None)
                or "eager")][:1]
    kinds = [m.config._experts_implementation or "eager" for m in models]
    for m in models:
        m.set_experts_implementation(kind)
    try:
        yield bool(models)
    finally:
        for m, was in zip(models, kinds):
            m.set_experts_implementation(was)
