"""Options of the attention pass's softmax -> Lightning conversion:
``options={"attention": "lightning", "lightning": {...}}``. Owned by the pass
(``AttentionPass.options_cls``); parsed through the pass registry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graphopt.config import parse_section
from graphopt.errors import ConfigError

LIGHTNING_SLOPES = ("minimax", "alibi")
FEATURE_MAPS = ("identity", "silu", "relu", "elu1")


@dataclass(frozen=True)
class LightningOptions:
    """``options={"attention": "lightning", "lightning": {...}}``: softmax -> Lightning."""

    every: int = 1
    """1 converts every layer; n > 1 keeps softmax attention in layers i with
    (i + 1) % n == 0 (8: MiniMax-01's hybrid of 7 lightning layers to 1 softmax layer)."""
    layers: tuple[str, ...] = ()
    """Module-path patterns (``fnmatch``, e.g. ``"model.layers.[0-3].*"``) of the attention
    sites to convert; empty converts all (subject to ``every``). Others are kept, reported."""
    slopes: str = "minimax"
    """Per-head decay rates: "minimax" (ALiBi's geometric slopes 2^(-8(h+1)/H) scaled by
    MiniMax-01's depth factor 1 - l/(L-1)) or "alibi" (the geometric slopes alone)."""
    num_layers: int | None = None
    """Number of decoder layers for MiniMax's depth factor; None infers 1 + the largest layer
    index among the graph's attention sites (set it when graph breaks split the model)."""
    feature_map: str = "identity"
    """Applied to q and k before Lightning Attention: "identity", "silu" (TransNormerLLM /
    MiniMax-01), "relu", or "elu1" (elu(x) + 1, Katharopoulos et al. 2020)."""
    norm: str = "rms"
    """Output normalization per head: "rms" (RMSNorm without weight over Dv, as
    TransNormerLLM/MiniMax normalize lightning outputs) or "none"."""

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ConfigError(f"lightning.every must be an int >= 1, got {self.every!r}")
        if self.num_layers is not None and (isinstance(self.num_layers, bool) or not
                                            isinstance(self.num_layers, int) or
                                            self.num_layers < 1):
            raise ConfigError(f"lightning.num_layers must be an int >= 1 or None, got "
                              f"{self.num_layers!r}")
        if self.norm not in ("rms", "none"):
            raise ConfigError(f"lightning.norm must be 'rms' or 'none', got {self.norm!r}")
        if self.slopes not in LIGHTNING_SLOPES:
            raise ConfigError(f"lightning.slopes must be one of {', '.join(LIGHTNING_SLOPES)}; "
                              f"got {self.slopes!r}")
        if self.feature_map not in FEATURE_MAPS:
            raise ConfigError(f"lightning.feature_map must be one of {', '.join(FEATURE_MAPS)}"
                              f"; got {self.feature_map!r}")
        layers = (self.layers,) if isinstance(self.layers, str) else self.layers
        if not isinstance(layers, (tuple, list)) or \
                not all(isinstance(p, str) and p for p in layers):
            raise ConfigError("lightning.layers must be a list of module-path patterns such as "
                              f"'model.layers.0.*'; got {self.layers!r}")
        object.__setattr__(self, "layers", tuple(layers))

    @classmethod
    def parse(cls, value: Any) -> LightningOptions:
        return parse_section(cls, value, "lightning")
