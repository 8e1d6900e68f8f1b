"""Context parallelism for a plan: the sequence is split over the CP ranks; softmax attention
exchanges heads for sequence with all-to-all (DeepSpeed-Ulysses, Jacobs et al. 2023,
``cp_kind="all_to_all"``) or passes keys and values around a ring (``cp_kind="ring"``:
graphopt.kernels.comm.ring_attention, zigzag load balancing: rank r holds chunks r and
2P-1-r of 2P).

Contract: :func:`apply_cp` makes a transformers model run on this rank's contiguous chunk
of every sequence (rank r of P: positions r*S/P .. (r+1)*S/P - 1):
- attention goes through transformers' attention interface as ``"graphopt_cp"``: q, k, v
  [B, H, S/P, D] are all-to-all'ed to [B, H/P, S, D] (this rank's heads, the whole
  sequence), causal SDPA runs on them, and a second all-to-all returns [B, S/P, H, D]
  (``all_to_all_single_autograd``: the backward is the reverse all-to-all). KV heads that
  P does not divide are repeated to the query heads first. Exact: every head sees every
  key; causality is global (SDPA's ``is_causal`` on the whole sequence), so no load
  balancing is needed.
- positions: a forward pre-hook passes ``position_ids`` of the chunk (global positions;
  the chunk's length read from ``input_ids`` or ``inputs_embeds``) when
  the caller gives none, so rotary embeddings are those of the whole sequence. A rotary
  embedding whose frequencies follow the sequence length (``dynamic`` NTK, ``longrope``)
  is given the whole sequence's last position too, so it picks them as one process does.
- masks: the mask function registered for ``"graphopt_cp"`` accepts no padding (a padding
  ``attention_mask`` raises ConfigError: sequences without padding, one per row, are what
  CP runs; packed rows would need a document mask that CP's attention does not apply).
- linear attention (MiniMax's lightning layers: ``layer_type == "linear_attention"`` with
  ``qkv_proj``, ``slope_rate``, ``norm``, ``output_gate``, ``out_proj``): the block loop
  is replaced by :func:`graphopt.kernels.lightning.cp.lightning_attention_cp`, which passes
  the recurrent KV state between ranks (each rank's chunk state, one all-gather, a decayed
  prefix as the chunk's initial state); the projections, norm and gate are the module's
  own, in the module's order.

:func:`shard_sequence` gives a rank its chunk (and next-token labels across chunk
boundaries); :func:`cp_loss` is the next-token loss whose gradients, averaged by data
parallelism over dp x cp ranks, are the whole batch's mean-loss gradients.

Refused (ConfigError): every CP rank given the same tokens (the whole batch instead of
its chunk, as a loop written for data parallelism feeds it: logits 0.4 and gradients 0.58
off without an error, a review; chunks from :func:`shard_sequence` are exempt, since a
sequence's chunks may be equal), a KV cache passed in (``past_key_values``, ``generate()``:
it would hold only this rank's chunk), a padding or precomputed (dict, 4-D) attention mask,
``position_ids`` other than the chunk's own (packed sequences), ``labels=`` (transformers'
loss would shift inside the chunk; :func:`cp_loss` is CP's), heads not divisible by cp
(Ulysses), chunked attention or position-dependent query scaling in any of the model's
configs (a composite model's text config too), a sliding window (in a config, or passed to
the attention function) shorter than the whole sequence (a window at least as long changes
nothing; checked per batch, or against the planner's sequence length), linear-attention
layers of another form than MiniMax's or with the ring's zigzag layout (their state
passing needs contiguous chunks), a sequence length the CP size (x 2 for the ring) does
not divide, dropout in attention under the ring; and,
found by running the model once (:func:`_mixing_outside_attention`), layers that mix
positions outside the attention function (convolutions, state-space layers) and attention
given its own mask or bias, soft-capping or sinks, which CP's attention would drop.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from graphopt.errors import ConfigError
from graphopt.kernels.lightning.minimax import (
    LIGHTNING_PARTS,
    decay_tables_problem,
    minimax_lightning_layer,
)
from graphopt.models import eager_forward_failed, length_dependent_rope, refuse_aux_loss
from graphopt.planner.plan import ParallelPlan

ATTENTION = "graphopt_cp"
RING = "graphopt_cp_ring"
_GROUPS: dict[int, Any] = {}


def check_cp(model: nn.Module, plan: ParallelPlan, seq: int | None = None) -> None:
    """Raise ConfigError unless ``model`` can run the plan's CP (module docstring) on
    sequences of ``seq`` tokens (None: any length; a sliding window is then checked
    against each batch's length at run time)."""
    config = getattr(model, "config", None)
    if config is None:
        raise ConfigError("cp > 1 runs transformers models (attention interface): this model "
                          "has no config; use cp=1")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    if not heads:  # (a review: Mamba was told to choose a cp dividing 0 heads)
        raise ConfigError("cp > 1 splits the sequence around attention, and this model's "
                          "config has no attention heads (num_attention_heads: a state-space "
                          "or convolutional model?), whose layers mix positions CP would "
                          "compute on each rank's chunk alone: use cp=1")
    if plan.cp_kind == "all_to_all" and heads % (plan.cp * plan.tp):
        raise ConfigError(f"Ulysses CP splits the attention heads ({heads}) over cp x tp "
                          f"({plan.cp} x {plan.tp}): choose a cp dividing heads / tp")
    for c in _configs(model):
        # CP's loss is cp_loss over the logits (labels= is refused); the MoE load-balancing
        # loss is not linear in the tokens, so neither it nor each chunk's own share adds
        # up to one process's (a review: router gradients 50% off with no error; 24-26%
        # with each chunk's aux loss / cp)
        refuse_aux_loss(c, "cp > 1", "cp_loss over the logits",
                        "over the whole sequence's router logits, which no CP rank holds")
        kinds = getattr(c, "layer_types", None)  # per layer, where the config lists them
        if "chunked_attention" in (kinds or ()) or (
                not kinds and getattr(c, "attention_chunk_size", None)):
            raise ConfigError("chunked attention (attention_chunk_size) under CP is not "
                              "executed (CP's attention is causal over the whole sequence): "
                              "use cp=1")
        nope = getattr(c, "no_rope_layers", None)  # Llama 4: 0 = a layer without RoPE,
        # where the temperature tuning applies
        if getattr(c, "attn_temperature_tuning", None) and (nope is None or 0 in nope):
            raise ConfigError("attention temperature tuning (attn_temperature_tuning) scales "
                              "queries by positions the model counts from its input, which "
                              "under CP would be each rank's chunk: use cp=1")
    window = sliding_window(model)
    if window is not None and seq is not None and seq > window:
        raise ConfigError(_window_refusal(window, seq))
    for path, module in model.named_modules():
        if getattr(module, "layer_type", None) == "linear_attention" and \
                not all(hasattr(module, a) for a in LIGHTNING_PARTS):
            # before the ring's advice, which only lightning layers can take (a review:
            # Mamba was told to use cp_kind='all_to_all')
            raise ConfigError(f"{path}: a linear-attention (or state-space) layer without "
                              f"MiniMax's parts ({', '.join(LIGHTNING_PARTS)}); graphopt "
                              "passes the state of that form only: use cp=1")
        if getattr(module, "layer_type", None) == "linear_attention" and \
                plan.cp_kind == "ring":
            raise ConfigError(f"{path}: lightning layers pass their state over contiguous "
                              "chunks, the ring holds zigzag chunks: use "
                              "cp_kind='all_to_all'")
        if getattr(module, "layer_type", None) == "linear_attention" and \
                (problem := decay_tables_problem(module)):
            raise ConfigError(f"{path}: CP runs lightning layers from slope_rate, but "
                              f"{problem}")
    problem = _mixing_outside_attention(model)
    if problem:
        raise ConfigError(f"context parallelism cannot run this model: {problem}; use cp=1")


def sliding_window(model: nn.Module) -> int | None:
    """The smallest sliding window (tokens) among ``model``'s configs' sliding-window
    attention layers (a config's ``sliding_window`` where ``layer_types`` lists
    "sliding_attention", or without ``layer_types`` where ``use_sliding_window`` is not
    off); None when it has none. A window W lets query i read keys i-W < j <= i
    (transformers' ``masking_utils.sliding_window_overlay``), so it changes nothing on
    sequences of at most W tokens. Raises nothing."""
    windows = []
    for c in _configs(model):
        kinds = getattr(c, "layer_types", None)  # per layer, where the config lists them
        sliding = "sliding_attention" in kinds if kinds else bool(
            getattr(c, "sliding_window", None) and getattr(c, "use_sliding_window", True))
        if sliding:
            windows.append(int(getattr(c, "sliding_window", None) or 0))
    return min(windows) if windows else None


def _window_refusal(window: int, seq: int) -> str:
    return (f"sliding-window attention (window {window} tokens) under CP runs only sequences "
            f"no longer than the window, where it changes nothing; this one has {seq} tokens. "
            "CP computes causal attention over the whole sequence (the window lives in the "
            "masks transformers builds, which CP does not): use cp=1, or sequences of at "
            f"most {window} tokens")


def _configs(model: nn.Module) -> list[Any]:
    """Every transformers config of ``model``: its modules' and their sub-configs (a
    composite model's ``text_config``: a review found Gemma3ForConditionalGeneration's
    sliding window, in its text config, passing the check)."""
    from transformers import PretrainedConfig

    found: dict[int, Any] = {}
    stack = [c for m in model.modules() if isinstance(c := getattr(m, "config", None),
                                                      PretrainedConfig)]
    while stack:
        c = stack.pop()
        if id(c) not in found:
            found[id(c)] = c
            stack += [v for v in vars(c).values() if isinstance(v, PretrainedConfig)]
    return list(found.values())


PROBE = "graphopt_cp_probe"
PROBE_TOKENS = 8


def _mixing_outside_attention(model: nn.Module) -> str:
    """Why CP would compute ``model`` wrongly ("" when it would not), found by running it.

    CP splits the sequence and exchanges positions only inside the attention function (and
    MiniMax's lightning layers, whose state it passes): anything else that mixes positions
    would see only its own chunk (a short convolution: Lfm2; a state-space layer), and a
    model that hands attention its own mask or bias (Doge's dynamic mask, soft-capping,
    attention sinks) would lose it. The probe runs the model (no grad, eval mode, one
    sequence of PROBE_TOKENS random embeddings) with an attention function that mixes
    nothing (each position its own value) and the lightning layers' outputs zeroed, moves
    the first position's embedding, and names the first decoder layer whose later positions
    changed by more than 100x the rounding noise (measured by moving the last position,
    which nothing causal reads back) and more than a dtype's rounding of the first
    position's change (1e-10 float64, 1e-5 float32, 8 eps below). Reviews found both kinds
    silently wrong (gradient errors 0.46-1.0). Structurally, whatever the dtype and
    weights, every decoder layer must call the attention function (or be a lightning
    layer), and a model without a ModuleList of layers must call it at all. A model with
    parameters on the meta device is not probed (the attention functions still refuse
    masks they would drop, at run time)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from graphopt.parallel.apply import decoder_layers

    params = list(model.parameters())
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None)
    layers = decoder_layers(model)
    if not params or any(p.is_meta for p in params) or not isinstance(hidden, int):
        return ""
    extra: list[str] = []
    outputs: list[list[torch.Tensor]] = []
    # which decoder layer holds each module: every layer must reach the attention function
    # (or be a lightning layer, whose state CP passes)
    layer_of = {id(m): i for i, layer in enumerate(layers) for m in layer.modules()}
    lightning = {layer_of[id(m)] for m in model.modules()
                 if getattr(m, "layer_type", None) == "linear_attention" and id(m) in layer_of}
    called: set[int] = set()
    calls: list[bool] = []

    def no_mixing(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
        calls.append(True)
        if id(module) in layer_of:
            called.add(layer_of[id(module)])
        extra.extend(_dropped_by_cp(module, attention_mask, kwargs))
        out = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
        return out.transpose(1, 2).contiguous(), None

    def zero_output(module: nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, tuple):
            return (torch.zeros_like(output[0]), *output[1:])
        return torch.zeros_like(output)

    def record(module: nn.Module, args: Any, output: Any) -> None:
        outputs[-1].append(_sequence_output(output))

    AttentionInterface.register(PROBE, no_mixing)
    AttentionMaskInterface.register(PROBE, _no_padding_mask)
    configs = {id(c): (c, c._attn_implementation) for m in model.modules()
               if (c := getattr(m, "config", None)) is not None
               and hasattr(c, "_attn_implementation")}
    hooks = [m.register_forward_hook(zero_output) for m in model.modules()
             if getattr(m, "layer_type", None) == "linear_attention"]
    # the model's own output too: mixing after the last layer, or in a model whose layers
    # are not a ModuleList (an nn.Sequential of blocks: a review found one accepted unprobed)
    hooks += [layer.register_forward_hook(record) for layer in [*layers, model]]
    for c, _ in configs.values():
        c._attn_implementation = PROBE
    from graphopt.models import eval_mode, rope_state_kept

    failed: Exception | None = None
    x: torch.Tensor | None = None
    try:
        embedding: torch.Tensor = model.get_input_embeddings().weight  # type: ignore[operator]
        dtype = embedding.dtype if embedding.is_floating_point() else torch.float32
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(1, PROBE_TOKENS, hidden, generator=gen, dtype=dtype)
        # +-1 on every unit, half of them each way (random signs): +1 on every unit was
        # erased by LayerNorm, which subtracts the mean (a review: a model with its own
        # F.sdpa behind LayerNorms passed the probe); unit size on every channel keeps a
        # depthwise convolution's smallest mixing visible (a fresh Lfm2: 3e-5 of it)
        delta = torch.ones(hidden, dtype=dtype)
        delta[torch.randperm(hidden, generator=gen)[:hidden // 2]] = -1
        x, delta = x.to(embedding.device), delta.to(embedding.device)
        first, last = x.clone(), x.clone()
        first[:, 0] += delta
        last[:, -1] += delta
        with torch.no_grad(), eval_mode(model), rope_state_kept(model):
            for e in (x, first, last):
                outputs.append([])
                model(inputs_embeds=e, use_cache=False)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - the reason goes into the refusal
        failed = exc
    finally:
        for c, name in configs.values():
            c._attn_implementation = name
        for h in hooks:
            h.remove()
    if failed is not None and x is not None:
        try:  # the model's own forward: a model that cannot run as built is not CP's case
            with torch.no_grad(), eval_mode(model), rope_state_kept(model):
                model(inputs_embeds=x, use_cache=False)
        except Exception as exc:  # noqa: BLE001
            raise eager_forward_failed("cp > 1 probes the model's attention with one eager "
                                       "forward", exc) from exc
    if failed is not None:
        return (f"its CP probe (one forward through a stand-in of transformers' attention "
                f"interface, module docstring) failed with {type(failed).__name__}: "
                f"{failed}. A model whose attention does not go through that interface (or "
                "that needs the attention weights it returns) cannot run CP's attention")
    if extra:
        return extra[0]
    # Moving the last position shows the rounding noise: nothing causal reads it from
    # earlier positions, but an MoE router sending it elsewhere changes the row counts of
    # every expert GEMM, and so the rounding everywhere (a review: float32 Mixtral, MiniMax,
    # DeepSeek-V3 differed by ~1e-7 at other positions). Mixing is a change well above that
    # (a freshly initialized short convolution: 3e-5 of position 0's change), and above a
    # dtype's rounding of position 0's change where moving the last position happened not
    # to reroute anything (the expert GEMMs' rounding: ~1e-7 of it in float32).
    tol = {torch.float64: 1e-10, torch.float32: 1e-5}.get(dtype, 8 * torch.finfo(dtype).eps)
    for i, (base, moved, noisy) in enumerate(zip(*outputs)):
        where = f"decoder layer {i}" if i < len(layers) else (
            "the model after its decoder layers" if layers else
            "the model (no ModuleList of decoder layers found)")
        if any(not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[1] != PROBE_TOKENS
               for t in (base, moved, noisy)):
            return (f"{where} returns no [B, S, ...] tensor its CP probe can compare "
                    "(logits, last_hidden_state or a tensor), so graphopt cannot tell "
                    "whether it mixes positions outside the attention function")
        changed = float((base[:, :1] - moved[:, :1]).abs().max())
        later = float((base[:, 1:] - moved[:, 1:]).abs().max())
        noise = float((base[:, :-1] - noisy[:, :-1]).abs().max())
        # moving the last position must leave earlier ones within rounding: a layer that
        # attends with its own code and takes its causal mask from the mask function (which
        # gives None here) reads later positions, and that noise hid its mixing (a review:
        # GPTNeoXJapanese, gradients 1.4 off under CP)
        last_changed = float((base[:, -1:] - noisy[:, -1:]).abs().max())
        if later > max(100.0 * noise, tol * changed) or noise > tol * last_changed:
            return (f"{where} mixes positions outside the attention function (a "
                    "convolution, a state-space layer, its own attention code?), which CP "
                    "would compute on each rank's chunk alone")
    # Structural, whatever the weights and dtype: a layer that never calls transformers'
    # attention function computes its attention (or convolution, state-space scan) itself,
    # which CP would run on each rank's chunk alone. The numbers above miss mixing under
    # bf16's rounding or behind zero-initialized weights (a re-review: GPT-NeoX-Japanese
    # and Bloom accepted in bf16, CP logits 0.58 off; Lfm2's convolution in bf16/fp16).
    missing = [i for i in range(len(layers)) if i not in called and i not in lightning]
    if missing:
        return (f"decoder layer {missing[0]} never calls transformers' attention function, "
                "which CP replaces (its own attention code, a convolution or a state-space "
                "layer?): CP would compute it on each rank's chunk alone")
    if not layers and not calls:
        return ("the model never calls transformers' attention function, which CP replaces "
                "(its own attention code?): CP would compute it on each rank's chunk alone")
    return ""


def _sequence_output(output: Any) -> Any:
    """The [B, S, ...] tensor of a layer's or model's output (its first tensor; a model
    output's ``logits`` or ``last_hidden_state``); None when there is none."""
    for name in ("logits", "last_hidden_state"):
        if isinstance(t := getattr(output, name, None), torch.Tensor):
            return t
    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    return output if isinstance(output, torch.Tensor) else None


def _dropped_by_cp(module: nn.Module, attention_mask: torch.Tensor | None,
                   kwargs: dict[str, Any], length: int | None = None) -> list[str]:
    """What CP's attention functions would drop from this call: a mask or bias the model
    built itself (CP's mask function gives None), soft-capping, attention sinks, a sliding
    window shorter than the whole sequence of ``length`` tokens (None: not checked here,
    CP's forward pre-hook checks it)."""
    name = type(module).__name__
    out = [f"{name} passes its own attention mask or bias (CP computes plain causal "
           "attention)"] if attention_mask is not None else []
    out += [f"{name} uses attention {key} ({kwargs[key]!r}), which CP's attention does not "
            "apply" for key in ("softcap", "s_aux", "sinks") if kwargs.get(key) is not None]
    window = kwargs.get("sliding_window")
    if window is not None and length is not None and int(window) < length:
        out.append(_window_refusal(int(window), length))
    return out


def _lightning_cp_forward(self: Any, hidden_states: torch.Tensor, *args: Any,
                          **kwargs: Any) -> tuple[torch.Tensor, None]:
    """MiniMax's lightning attention layer on this rank's chunk (module docstring): hidden
    [B, L, hidden] -> ([B, L, hidden], None)."""
    from graphopt.kernels.lightning.cp import lightning_attention_cp

    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor
               ) -> tuple[torch.Tensor, None]:
        return lightning_attention_cp(q, k, v, slope, self.graphopt_cp_group), None

    out, _ = minimax_lightning_layer(self, hidden_states, None, kernel)
    return out, None


def _ulysses(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, dropout: float = 0.0,
             scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function: q [B, H, L, D], k/v [B, Hk, L, D] of this rank's
    chunk -> ([B, L, H, D], None); module docstring."""
    import torch.distributed._functional_collectives as funcol

    _require_causal(module, kwargs, attention_mask, query.shape[2])
    group = _GROUPS[id(module.config)]
    size = dist.get_world_size(group)
    heads = query.shape[1]
    if key.shape[1] % size:  # repeat KV heads so they split like the query heads
        key, value = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (key, value))

    def scatter_heads(x: torch.Tensor) -> torch.Tensor:  # [B, h, L, D] -> [B, h/P, P*L, D]
        b, h, length, d = x.shape
        x = x.reshape(b, size, h // size, length, d).permute(1, 0, 2, 3, 4).contiguous()
        x = funcol.all_to_all_single_autograd(x, None, None, group)
        return x.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * length, d)

    q, k, v = (scatter_heads(t) for t in (query, key, value))
    out = nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scaling, dropout_p=dropout if module.training else 0.0,
        enable_gqa=k.shape[1] != q.shape[1])
    b, h, seq, d = out.shape  # gather heads back, scatter the sequence
    out = out.reshape(b, h, size, seq // size, d).permute(2, 0, 1, 3, 4).contiguous()
    out = funcol.all_to_all_single_autograd(out, None, None, group)
    out = out.permute(1, 0, 2, 3, 4).reshape(b, h * size, seq // size, d)
    return out.transpose(1, 2).contiguous(), None


def _ring(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          attention_mask: torch.Tensor | None, dropout: float = 0.0,
          scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function: this rank's zigzag chunks q [B, H, 2c, D], k/v
    [B, Hk, 2c, D] -> ([B, 2c, H, D], None) by ring attention (module docstring)."""
    from graphopt.kernels.comm.ring_attention import ring_attention

    _require_causal(module, kwargs, attention_mask, query.shape[2])
    if dropout and module.training:
        raise ConfigError("ring attention runs without attention dropout: set the model's "
                          "attention_dropout to 0 or use cp_kind='all_to_all'")
    heads = query.shape[1]
    key, value = (t.repeat_interleave(heads // t.shape[1], dim=1) if t.shape[1] != heads
                  else t for t in (key, value))
    out = ring_attention(query, key, value, _GROUPS[id(module.config)], scaling)
    return out.transpose(1, 2).contiguous(), None


def _require_causal(module: nn.Module, kwargs: dict[str, Any],
                    attention_mask: torch.Tensor | None, local: int) -> None:
    """CP attention is causal over the whole sequence; a bidirectional layer, or one with a
    mask, bias, soft-cap or sinks of its own (:func:`_dropped_by_cp`), would be computed
    wrongly, so it is refused (before any communication: every rank refuses)."""
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise ConfigError(f"{type(module).__name__} is bidirectional (is_causal=False); "
                          "context parallelism runs causal attention only: use cp=1")
    length = None if kwargs.get("sliding_window") is None else \
        local * dist.get_world_size(_GROUPS[id(module.config)])  # the whole sequence's
    dropped = _dropped_by_cp(module, attention_mask, kwargs, length)
    if dropped:
        raise ConfigError(f"context parallelism cannot run this model: {dropped[0]}; use "
                          "cp=1")


def _no_padding_mask(*args: Any, attention_mask: torch.Tensor | None = None,
                     **kwargs: Any) -> None:
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ConfigError(_PADDING)
    return None


def apply_cp(model: nn.Module, plan: ParallelPlan, mesh: Any, hook: bool = True) -> str:
    """Make ``model`` run on this rank's sequence chunk (module docstring); returns a note.
    ``hook=False`` (pipeline stages, which pass the chunk's positions and check the batch
    themselves: graphopt.parallel.pipeline) installs the attention only, not the forward
    pre-hook on ``model``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, _ulysses)
    AttentionInterface.register(RING, _ring)
    for name in (ATTENTION, RING):
        AttentionMaskInterface.register(name, _no_padding_mask)
    group = mesh["cp"].get_group()
    rank = mesh["cp"].get_local_rank()
    ring = plan.cp_kind == "ring"
    mesh._graphopt_cp_kind = plan.cp_kind  # shard_sequence cuts the same layout
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = RING if ring else ATTENTION
            _GROUPS[id(config)] = group

    import types

    swapped = 0
    for module in model.modules():
        if getattr(module, "layer_type", None) == "linear_attention":
            # the group object, not its name: resolving a name is a call Dynamo cannot
            # trace (7 graph breaks per MiniMax forward, a review); Dynamo takes the object
            module.graphopt_cp_group = group  # type: ignore[assignment]
            module.forward = types.MethodType(_lightning_cp_forward, module)
            swapped += 1

    rope = [m for m in model.modules() if length_dependent_rope(m)]
    for module in rope:
        module.register_forward_pre_hook(_whole_sequence_rope(plan.cp), with_kwargs=True)
        module.register_forward_hook(_drop_last_position)

    signature = inspect.signature(model.forward)
    window = sliding_window(model)

    def positions(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        try:  # arguments by name, also those passed by position (labels, masks)
            given = dict(signature.bind_partial(*args, **kwargs).arguments)
        except TypeError:
            given = dict(kwargs)
        given.update(given.pop("kwargs", None) or {})
        ids = given.get("input_ids")
        if ids is None:  # inputs_embeds [B, L, H]: the same chunk, embedded by the caller
            ids = given.get("inputs_embeds")
        length = ids.shape[1] if isinstance(ids, torch.Tensor) else 0
        batch = ids.shape[0] if isinstance(ids, torch.Tensor) else 0
        device = ids.device if isinstance(ids, torch.Tensor) else None
        own = chunk_positions(length, rank, plan.cp, ring, device)
        # every CP rank refuses together (the cause may sit in one rank's chunk only, and a
        # rank that went on alone waited in the next collective: a review); then the sum of
        # lengths and of their squares tell whether the chunks are equal, and the same of a
        # fingerprint of the tokens (untagged inputs) whether every rank got the same ones
        tagged = not isinstance(ids, torch.Tensor) or getattr(ids, SHARDED, False)
        check_layout(ids, plan.cp_kind)  # the same on every CP rank
        flags = torch.tensor([float(bool(problem)) for problem in _refusals(given, own)]
                             + [float(length), float(length) ** 2, float(batch),
                                float(batch) ** 2, float(not tagged)],
                             dtype=torch.float64, device=device)
        mark = _fingerprint(ids).reshape(1) if isinstance(ids, torch.Tensor) and not tagged \
            else torch.zeros(1, dtype=torch.float64, device=device)
        flags = torch.cat([flags, mark, mark * mark])
        dist.all_reduce(flags, group=group)
        *refused, total, squares, batches, batch_squares, untagged, marks, mark_squares = \
            flags.tolist()
        for (_, message), flag in zip(_REFUSALS, refused):
            if flag:
                raise ConfigError(message)
        if ring and untagged and length:  # every rank refuses together
            raise ConfigError(UNTAGGED_RING)
        if squares * plan.cp != total * total:
            raise ConfigError(f"the CP ranks hold chunks of different lengths (this rank "
                              f"{length}, {total / plan.cp:g} on average): Ulysses, the ring "
                              "and the positions CP passes need equal chunks; cut the "
                              "sequence with graphopt.parallel.context.shard_sequence (pad it "
                              "to a multiple of the CP size)")
        if batch_squares * plan.cp != batches * batches:  # (gloo aborted the process on
            # the collectives' size mismatch: a review)
            raise ConfigError(f"the CP ranks hold batches of different sizes (this rank "
                              f"{batch} sequences, {batches / plan.cp:g} on average): the CP "
                              "ranks of a group must cut the same batch, each its chunk of "
                              "every sequence (graphopt.parallel.context.shard_sequence)")
        if window is not None and length * plan.cp > window:  # equal chunks: every rank
            raise ConfigError(_window_refusal(window, length * plan.cp))
        if ring and length % 2:  # the same on every rank: the chunks are equal
            raise ConfigError(f"ring CP holds two chunks per rank (zigzag); this rank's "
                              f"{length} tokens do not split in two: cut the sequence with "
                              "graphopt.parallel.context.shard_sequence (pad it to a "
                              "multiple of 2 x the CP size)")
        if untagged == plan.cp and length and \
                abs(mark_squares * plan.cp - marks * marks) <= 1e-9 * marks * marks:
            raise ConfigError(
                "every CP rank was given the same tokens: under CP each rank runs its own "
                "chunk of every sequence; feed ids, labels = graphopt.parallel."
                "shard_sequence(batch, mesh) and train on graphopt.parallel.cp_loss("
                "model(ids).logits, labels, mesh) (a loop written for data parallelism "
                "trains silently wrong on a CP plan)")
        if given.get("position_ids") is None and isinstance(ids, torch.Tensor):
            kwargs["position_ids"] = own.unsqueeze(0)
        return args, kwargs

    if hook:
        model.register_forward_pre_hook(positions, with_kwargs=True)
        embed = getattr(model, "get_input_embeddings", lambda: None)()
        if isinstance(embed, nn.Module):  # inputs_embeds of a tagged chunk: tagged too
            embed.register_forward_hook(_carry_tag)
    what = (f"ring attention): this rank holds chunks {rank} and {2 * plan.cp - 1 - rank} of "
            f"{2 * plan.cp} (zigzag); keys and values pass around the ring" if ring else
            f"Ulysses all-to-all): this rank holds sequence chunk {rank} of {plan.cp}; "
            "attention heads exchanged for the sequence")
    return (f"CP={plan.cp} ({what}" + (
                f"; {swapped} lightning layer(s) pass their KV state between ranks"
                if swapped else ""))


def _whole_sequence_rope(size: int) -> Any:
    """Forward pre-hook for a :func:`graphopt.models.length_dependent_rope` module under CP
    of ``size`` equal chunks: appends the sequence's last position (``size * L - 1``) to
    the chunk's ``position_ids`` [B, L], so the frequencies are chosen from the whole
    sequence's length, as in one process (each rank's chunk alone picked its own:
    gradients 0.03-0.15 off, a review); :func:`_drop_last_position` removes the extra
    position's cos/sin."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        given = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        if not isinstance(given, torch.Tensor):
            raise ConfigError(f"{type(module).__name__}: a length-dependent rotary embedding "
                              "under CP needs position_ids (its frequencies follow the whole "
                              "sequence's length): use cp=1")
        last = given.new_full((*given.shape[:-1], 1), size * given.shape[-1] - 1)
        extended = torch.cat([given, last], dim=-1)
        if "position_ids" in kwargs:
            kwargs = {**kwargs, "position_ids": extended}
        else:
            args = (args[0], extended, *args[2:])
        return args, kwargs
    return hook


def _drop_last_position(module: nn.Module, args: Any, output: Any) -> Any:
    """Forward hook after :func:`_whole_sequence_rope`: cos and sin [B, L + 1, D] -> the
    chunk's [B, L, D]."""
    if isinstance(output, tuple):
        return tuple(o[..., :-1, :] for o in output)
    return output[..., :-1, :]


_PADDING = ("context parallelism runs causal attention without padding; this batch has a "
            "padding mask: pack sequences without padding or use cp=1")
_REFUSALS = (
    ("padding", _PADDING),
    ("mask", "CP builds its own causal attention, so a precomputed attention mask (a dict of "
             "masks or a 4-D mask) would be dropped: pass a 2-D padding mask [B, S] without "
             "padding, or none"),
    ("cache", "CP splits the sequence over ranks, so a KV cache (past_key_values, "
              "generate()) would hold only this rank's chunk: decode with a plan without CP "
              "(cp=1) or in one process; CP runs training and whole-sequence forwards"),
    ("positions", "position_ids other than this rank's positions in one sequence (0..S-1 "
                  "over the CP ranks, as shard_sequence cuts it) are not executed under CP: "
                  "packed sequences (positions restarting at 0) would attend across their "
                  "boundaries, which CP's causal attention does not mask; omit position_ids "
                  "(graphopt passes the chunk's) or use cp=1"),
    ("labels", "transformers' loss from labels= shifts the labels inside this rank's chunk "
               "and averages per chunk; under CP pass no labels and compute the loss with "
               "graphopt.parallel.context.cp_loss on shard_sequence's labels"),
)


def _refusals(kwargs: dict[str, Any], own: torch.Tensor) -> list[bool]:
    """Per entry of _REFUSALS, whether this rank's call is refused. A review found each
    silently wrong or crashing: a padding mask; a dict of precomputed masks (crashed) or a
    4-D mask; a KV cache (decode logits off by 0.1-1.1); packed position_ids (logits 0.5
    off: transformers masks packed sequences apart, CP's mask function gives None); labels
    (the loss shifted twice, per-chunk mean)."""
    mask = kwargs.get("attention_mask")
    precomputed = (isinstance(mask, dict) and any(v is not None for v in mask.values())) or \
        (isinstance(mask, torch.Tensor) and mask.dim() != 2)
    padded = isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all())
    cached = any(kwargs.get(k) is not None for k in ("past_key_values", "cache"))
    given = kwargs.get("position_ids")
    positions = isinstance(given, torch.Tensor) and not (
        given.shape[-1] == own.numel() and bool((given == own.to(given.device)).all()))
    labels = kwargs.get("labels") is not None
    return [padded, precomputed, cached, positions, labels]


def chunk_positions(local: int, rank: int, size: int, ring: bool,
                    device: Any = None) -> torch.Tensor:
    """Global positions of this rank's ``local`` tokens: a contiguous chunk, or the ring's
    zigzag chunks r and 2P-1-r."""
    if not ring:
        return torch.arange(local, device=device) + rank * local
    c = local // 2
    return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange((2 * size - 1 - rank) * c, (2 * size - rank) * c,
                               device=device)])


SHARDED = "_graphopt_cp_chunk"
"""Attribute :func:`shard_sequence` sets on the chunks it returns, the CP layout they were
cut for ("ring" or "all_to_all"): CP's forward pre-hook skips its same-tokens check for them
(a sequence whose chunks are equal, all padding say, is a legitimate batch) and refuses a
chunk of the other layout."""


def _fingerprint(x: torch.Tensor) -> torch.Tensor:
    """A float64 number that differs between token id [B, L] (or embedding [B, L, H])
    tensors of different values, on the tensor's device (no host sync): their mean weighted
    by 1 + position / L."""
    with torch.no_grad():
        length = x.shape[1]
        w = 1 + torch.arange(length, device=x.device, dtype=torch.float64) / max(length, 1)
        w = w.view(1, length, *([1] * (x.dim() - 2)))
        return (x.detach().to(torch.float64) * w).mean() if x.numel() else w.sum() * 0


def check_layout(chunk: Any, cp_kind: str) -> None:
    """Refuse (ConfigError) a chunk :func:`shard_sequence` cut for the other CP layout than
    ``cp_kind`` ("ring": zigzag chunks, "all_to_all": contiguous) the model runs; untagged
    inputs pass (the caller's other checks cover them)."""
    cut = getattr(chunk, SHARDED, None)
    if isinstance(cut, str) and cut != cp_kind:
        raise ConfigError(f"this chunk was cut for CP {cut!r} and the model runs CP "
                          f"{cp_kind!r}: cut it with shard_sequence on the mesh "
                          "graphopt.parallelize ran on (or build_mesh of the same plan)")


def shard_sequence(ids: torch.Tensor, mesh: Any, labels: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(this CP rank's tokens of ``ids`` [B, S], their next-token labels, -100 past the last
    position): a contiguous chunk (Ulysses) or chunks r and 2P-1-r of 2P (ring), as the
    plan that :func:`apply_cp` ran says. ``labels`` [B, S] (transformers' convention: the
    model's ``labels=``, unshifted, -100 where ignored, e.g. a fine-tuning prompt): the
    next-token labels are taken from it instead of ``ids``, so a masked prompt needs no
    chunk indices by hand.

    The layout is the plan's, recorded on ``mesh`` by :func:`graphopt.parallel.build_mesh`
    and by :func:`apply_cp`; the chunk is tagged with it, and the model's forward refuses a
    chunk cut for the other layout.

    Raises:
        ConfigError: S not divisible by the CP size (x 2 for the ring); a mesh neither
            built by ``build_mesh(plan)`` nor run by ``graphopt.parallelize`` (the layout
            is unknown).
    """
    kind = getattr(mesh, "_graphopt_cp_kind", None)
    if kind is None:
        raise ConfigError("shard_sequence does not know this mesh's CP layout (zigzag chunks "
                          "for the ring, contiguous for all-to-all): pass the mesh from "
                          "graphopt.parallel.build_mesh(plan), or the one "
                          "graphopt.parallelize(model, plan, mesh) ran on")
    size, rank = mesh["cp"].size(), mesh["cp"].get_local_rank()
    ring = kind == "ring"
    seq = ids.shape[1]
    parts = 2 * size if ring else size
    if seq % parts:
        raise ConfigError(f"sequence length {seq} is not divisible by {parts} (cp={size}"
                          + (", two chunks per rank for the ring" if ring else "") + "): pad "
                          "or pack sequences to a multiple")
    if labels is not None and tuple(labels.shape) != tuple(ids.shape):
        raise ConfigError(f"labels {tuple(labels.shape)} must have input_ids' shape "
                          f"{tuple(ids.shape)} (transformers' convention: not shifted)")
    source = ids if labels is None else labels
    shifted = torch.cat([source[:, 1:], torch.full_like(source[:, :1], -100)], dim=1)
    index = chunk_positions(seq // size, rank, size, ring, ids.device)
    chunk = ids[:, index]
    setattr(chunk, SHARDED, kind)
    return chunk, shifted[:, index]


def _carry_tag(module: nn.Module, args: tuple, output: Any) -> None:
    """Forward hook of the input embedding under CP: the embeddings of a chunk
    :func:`shard_sequence` tagged carry its tag (``inputs_embeds=embed(ids)``), outside
    compiled code (a tensor attribute set there would only cost a graph break)."""
    cut = getattr(args[0], SHARDED, None) if args else None
    if cut is not None and isinstance(output, torch.Tensor) and \
            not torch.compiler.is_compiling():
        setattr(output, SHARDED, cut)


def tag_chunk(x: torch.Tensor, mesh: Any) -> torch.Tensor:
    """``x`` (returned, tagged in place) marked as this CP rank's chunk cut for ``mesh``'s
    layout, as :func:`shard_sequence` marks its chunks: for a tensor made from them that
    lost the tag (``inputs_embeds`` from its ids, a copy to another device) or a cut made by
    hand with :func:`chunk_positions`. Under ring CP the model refuses untagged chunks:
    nothing else shows that they are the zigzag chunks r and 2P-1-r (a contiguous cut, right
    for Ulysses, trained silently wrong: gradients 0.83 off, a review).

    Args:
        x: this rank's chunk, token ids [B, L] (int64) or embeddings [B, L, H] (any float
            dtype), L = S / cp, positions :func:`chunk_positions` of the mesh's layout.
        mesh: the DeviceMesh of ``graphopt.parallel.build_mesh(plan)`` or the one
            ``graphopt.parallelize`` ran on (it records the layout).
    Raises:
        ConfigError: a mesh without a recorded CP layout (as :func:`shard_sequence`).
    Source: the ring's load-balanced zigzag layout (chunks r and 2P-1-r of 2P), as in
    Megatron-LM's context parallelism and torch's ``context_parallel`` (round-robin
    load balancing).
    """
    kind = getattr(mesh, "_graphopt_cp_kind", None)
    if kind is None:
        raise ConfigError("tag_chunk does not know this mesh's CP layout: pass the mesh from "
                          "graphopt.parallel.build_mesh(plan), or the one "
                          "graphopt.parallelize(model, plan, mesh) ran on")
    setattr(x, SHARDED, kind)
    return x


UNTAGGED_RING = (
    "under ring CP each rank holds chunks r and 2P-1-r of the sequence's 2P (zigzag), and "
    "nothing shows how this rank's untagged input was cut (a contiguous cut, right for "
    "Ulysses, trains silently wrong here): cut the batch with ids, labels = "
    "graphopt.parallel.shard_sequence(batch, mesh), which tags its chunks; mark a tensor "
    "made from them (inputs_embeds, a device copy) or a zigzag cut of your own with "
    "graphopt.parallel.tag_chunk(x, mesh)")


def cp_loss(logits: torch.Tensor, labels: torch.Tensor, mesh: Any) -> torch.Tensor:
    """Next-token cross-entropy of this chunk (logits [B, L, V], labels [B, L] from
    :func:`shard_sequence`, -100 ignored) scaled so that data parallelism's average over
    the dp x cp ranks gives the gradient of the mean loss over every labelled position of
    the global batch (all DP ranks' sequences; Megatron-LM's per-token loss): n * (this
    chunk's sum) / (labelled positions over the dp x cp ranks, one all-reduce over the
    flattened ``dp_cp`` axis), n = dp x cp. Its value averaged over the dp x cp ranks is
    that mean loss. DP ranks whose batches hold different numbers of labels are weighted
    by their label counts, not averaged per rank. bf16/fp16 logits are summed in float32
    (the result is float32), as transformers' own loss upcasts."""
    # in float32 at least, as transformers' loss upcasts (a bf16 sum was 400x less accurate)
    upcast = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
    summed = nn.functional.cross_entropy(upcast.flatten(0, 1), labels.flatten(),
                                         ignore_index=-100, reduction="sum")
    count = (labels != -100).sum().to(torch.float64)
    ranks = mesh["dp_cp"]
    dist.all_reduce(count, group=ranks.get_group())
    return summed * ranks.size() / count.to(summed.dtype)
