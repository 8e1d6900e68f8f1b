"""Options of the ``moe`` pass: ``options={"moe": {...}}`` (or ``enable: ["moe"]`` for the
defaults). Owned by the pass (``MoEPass.options_cls``); parsed through the pass registry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graphopt.config import did_you_mean, parse_section
from graphopt.errors import ConfigError
from graphopt.kernels.moe.dispatch import DROP_POLICIES, capacity_factor_value

MOE_SCHEDULES = ("auto", "flat", "chunked", "hierarchical", "peer")


@dataclass(frozen=True)
class MoEOptions:
    """``options={"moe": {...}}``: rewrite MoE experts into sorted dispatch + grouped expert
    GEMMs (exact), optionally expert-parallel (``ep`` > 1, under torch.distributed).

    Vocabulary: EP = expert parallelism (experts split over ``ep`` ranks, tokens moved by
    all-to-all dispatch/combine); a *schedule* orders those transfers (see
    graphopt.kernels.comm.all_to_all).
    """

    ep: int = 1
    """EP degree: 1 (one device) or the size of each EP group; must divide the world size
    and the number of experts. EP groups are consecutive ranks."""
    all_to_all: str = "auto"
    """"flat" | "chunked" | "hierarchical" | "peer" | "auto" (the cost model's fastest for
    the layer's shape on ``profile``)."""
    chunks: Any = "auto"
    """Pieces of the chunked schedule: an int >= 1 or "auto" (the cost model's choice)."""
    ranks_per_node: int | None = None
    """Ranks sharing a node (the inner level of the hierarchical/peer schedules); default
    gcd($LOCAL_WORLD_SIZE, ep) (torchrun sets it), else ep; under a parallel plan, the EP
    group's ranks on one node of $LOCAL_WORLD_SIZE consecutive ranks
    (:func:`graphopt.parallel.expert.group_ranks_per_node`)."""
    capacity_factor: float | None = None
    """None: dropless. A float > 0: expert capacity C = ceil(cf * T * K / E); assignments
    beyond C per expert are dropped, chosen by ``drop_policy``."""
    drop_policy: str = "position"
    """Which assignments an expert keeps under a capacity (Megatron-Core's
    ``moe_token_drop_policy``): "position" (the first C in (token, k) order: Switch
    Transformer's first-come rule; docs/moe.md says how it differs from GShard's top-2) or
    "probs" (the C with the largest routing weights, Megatron-Core's default). Needs
    ``capacity_factor``."""
    profile: str | None = None
    """Cost-model profile for the "auto" choices (default: "local" when calibrated, else
    h100-sxm)."""

    def __post_init__(self) -> None:
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1:
            raise ConfigError(f"moe.ep must be an int >= 1, got {self.ep!r}")
        if self.all_to_all not in MOE_SCHEDULES:
            raise ConfigError(f"unknown moe.all_to_all {self.all_to_all!r}"
                              f"{did_you_mean(str(self.all_to_all), MOE_SCHEDULES)}; valid: "
                              f"{', '.join(MOE_SCHEDULES)}")
        if self.chunks != "auto" and (isinstance(self.chunks, bool) or not isinstance(
                self.chunks, int) or not 1 <= self.chunks <= 64):
            raise ConfigError(f"moe.chunks must be an int in 1..64 or 'auto', got "
                              f"{self.chunks!r}")
        if self.ep == 1 and (self.all_to_all != "auto" or self.chunks != "auto"):
            raise ConfigError("moe.all_to_all and moe.chunks choose how expert-parallel ranks "
                              "exchange tokens; with moe.ep=1 there is no exchange: drop them "
                              "or set moe.ep > 1")
        if self.chunks != "auto" and self.all_to_all not in ("auto", "chunked"):
            raise ConfigError(f"moe.chunks applies to the 'chunked' schedule, but "
                              f"moe.all_to_all is {self.all_to_all!r}: drop moe.chunks or set "
                              "moe.all_to_all='chunked'")
        rpn = self.ranks_per_node
        if rpn is not None and (isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1):
            raise ConfigError(f"moe.ranks_per_node must be an int >= 1, got {rpn!r}")
        if rpn is not None and self.ep > 1 and self.ep % rpn:  # (ep 1: parse's message)
            raise ConfigError(f"moe.ranks_per_node ({rpn}) must divide moe.ep ({self.ep})")
        try:  # NumPy scalars and 0-d tensors as moe_experts takes them (a review)
            cf = capacity_factor_value(self.capacity_factor)
        except ValueError:
            raise ConfigError(f"moe.capacity_factor must be a number > 0 or None (dropless), "
                              f"got {self.capacity_factor!r}") from None
        object.__setattr__(self, "capacity_factor", cf)  # the float C is computed from
        if self.drop_policy not in DROP_POLICIES:
            raise ConfigError(f"unknown moe.drop_policy {self.drop_policy!r}"
                              f"{did_you_mean(str(self.drop_policy), DROP_POLICIES)}; valid: "
                              f"{', '.join(DROP_POLICIES)}")
        if cf is None and self.drop_policy != "position":
            raise ConfigError(f"moe.drop_policy={self.drop_policy!r} chooses which tokens an "
                              "expert capacity drops, but moe.capacity_factor is None "
                              "(dropless): set moe.capacity_factor or drop moe.drop_policy")
        if self.profile is not None:
            from graphopt.cost.profiles import load_profile

            load_profile(self.profile)

    @classmethod
    def parse(cls, value: Any) -> MoEOptions:
        if value is True:
            return cls()
        parsed = parse_section(cls, value, "moe")
        if isinstance(value, dict) and parsed.ep == 1 and \
                ({"ranks_per_node", "profile"} & {k for k, v in value.items() if v is not None}):
            # options the moe pass would accept and ignore (a review); an MoEOptions object
            # may carry them for a parallel plan, whose ep replaces 1 (parallelize(moe=...))
            raise ConfigError("moe.ranks_per_node and moe.profile choose how expert-parallel "
                              "ranks exchange tokens; with moe.ep=1 there is no exchange: "
                              "drop them or set moe.ep > 1")
        return parsed
