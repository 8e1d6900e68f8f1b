"""Options of the ``remat`` pass: ``options={"remat": {"budget": ...}}``. Owned by the pass
(``RematPass.options_cls``); parsed through the pass registry."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from graphopt.config import parse_section
from graphopt.errors import ConfigError


@dataclass(frozen=True)
class RematOptions:
    """``options={"remat": {...}}``: choose keep or recompute per saved activation.

    budget: memory for saved activations: bytes (int), "NNGiB"/"NNMiB"/"NNKiB", "NN%" or a
    float in [0, 1]: a fraction of what compiling without remat saves (PyTorch's min-cut
    partition of the graph, which recomputes cheap ops itself; as torch's
    ``activation_memory_budget``), or of keep-all (every value the backward reads saved)
    where the lowering does not say how it partitions. A budget at or above what the
    partition without remat saves changes nothing (the report says so). Priced at the
    compile's sizes: under dynamic shapes the same plan runs at every size, so a byte budget
    holds at those sizes only and a fraction drifts (the report names the sizes and what the
    plan saves at twice each).
    solver: "ilp" (exact, scipy/HiGHS, falls back to greedy past ``time_limit``) or "greedy".
    """

    budget: Any = None
    """Required: with no budget remat would do nothing."""
    solver: str = "ilp"
    time_limit: float | None = None
    """Seconds the ILP may take (None: :attr:`ilp_seconds`' default, 10); not with solver
    "greedy", which does not use it (a review: accepted and ignored)."""
    offload: bool = False
    """Also consider copying saved values to host memory and back (priced by the profile's
    host bandwidth); "ilp" only."""
    profile: str | None = None
    """Cost-model profile that prices recomputation and host copies (default: "local" when
    calibrated, else h100-sxm)."""
    profile_guided: bool = False
    """Run the graph once at compile time on the real inputs, record its data-dependent
    sizes (MoE token counts), decide with them, and report how the decision changed."""

    @property
    def ilp_seconds(self) -> float:
        """The ILP's time limit in seconds: ``time_limit``, or 10."""
        return float(self.time_limit) if self.time_limit is not None else 10.0

    def __post_init__(self) -> None:
        if self.solver not in ("ilp", "greedy"):
            raise ConfigError(f"remat.solver must be 'ilp' or 'greedy', got {self.solver!r}")
        if self.time_limit is not None and self.solver == "greedy":
            raise ConfigError("remat.time_limit bounds the ILP solver; solver 'greedy' does not "
                              "use it: drop one of them")
        if self.time_limit is not None and (
                isinstance(self.time_limit, bool) or not isinstance(self.time_limit, (int, float))
                or not math.isfinite(self.time_limit) or self.time_limit <= 0):
            raise ConfigError(f"remat.time_limit must be finite seconds > 0, got "
                              f"{self.time_limit!r}")
        if self.offload is True and self.solver == "greedy":
            raise ConfigError("remat.offload needs solver 'ilp' (greedy decides keep or "
                              "recompute only, so offload would do nothing): drop one of them")
        if self.budget is None:
            raise ConfigError("remat needs a budget, e.g. options={'remat': {'budget': '50%'}} "
                              "(bytes, 'NNGiB', 'NN%' or a fraction in [0, 1]); without one "
                              "every activation is kept and remat would do nothing")
        self.resolve(1)  # validates the budget's form
        for flag in ("offload", "profile_guided"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"remat.{flag} must be a bool, got {getattr(self, flag)!r}")
        if self.profile is not None:
            from graphopt.cost.profiles import load_profile

            load_profile(self.profile)  # unknown names fail here, listing the valid ones

    def resolve(self, keep_all_bytes: int) -> int:
        """The budget in bytes, given what a fraction is of (bytes)."""
        b = self.budget
        if isinstance(b, numbers.Integral) and not isinstance(b, bool):
            b = int(b)  # numpy integers are bytes too (a review)
        elif isinstance(b, numbers.Real) and not isinstance(b, (bool, int)):
            b = float(b)
        if isinstance(b, bool):
            raise ConfigError(f"remat.budget must be bytes, 'NNGiB', 'NN%' or a fraction; got "
                              f"{b!r}")
        if isinstance(b, int):
            if b < 0:
                raise ConfigError(f"remat.budget must be >= 0 bytes, got {b}")
            if 0 < b < 1024:
                hint = ("for no reduction write 1.0 or '100%'" if b == 1 else
                        f"for a percentage write '{b}%' (= {b / 100})" if b <= 100 else
                        "for a fraction write a float in [0, 1] or 'NN%'")
                raise ConfigError(f"remat.budget={b} is read as {b} bytes; {hint}; for bytes "
                                  "use >= 1024 or 'NNKiB'")
            return b
        if isinstance(b, float):
            if not 0 <= b <= 1:  # 0.0 as 0 bytes and "0%" (a review: "0%" was refused)
                raise ConfigError(f"remat.budget as a fraction must be in [0, 1], got {b}")
            return int(b * keep_all_bytes)
        if isinstance(b, str):
            text = b.strip()
            units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "%": None}
            for unit, scale in units.items():
                if text.endswith(unit):
                    try:
                        number = float(text[: -len(unit)])
                    except ValueError:
                        break
                    if not math.isfinite(number) or number < 0 or \
                            (scale is None and not 0 <= number <= 100) or \
                            (scale is not None and not math.isfinite(number * scale)):
                        break  # 1e308GiB overflowed int() (a review)
                    return int(number / 100 * keep_all_bytes) if scale is None \
                        else int(number * scale)
        raise ConfigError(f"remat.budget must be bytes, 'NNGiB'/'NNMiB'/'NNKiB', 'NN%' with NN "
                          f"in [0, 100], or a fraction in [0, 1]; got {b!r}")

    @classmethod
    def parse(cls, value: Any) -> RematOptions:
        return parse_section(cls, value, "remat")
