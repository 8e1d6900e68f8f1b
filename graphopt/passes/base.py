"""The one interface every graphopt pass implements.

Vocabulary: a *stage* is where in the pipeline a pass runs ("pre_autograd": the normalized
ATen graph before AOTAutograd, so AOTAutograd derives the backward of whatever the pass
inserts; "joint": the graph AOTAutograd hands to the partitioner, i.e. the joint
forward+backward graph when training or the forward graph under ``torch.no_grad``). The
*graph kind* says which of these a pass is looking at: "model", "joint" or "inference".

Model: torch/fx/passes/infra/pass_base.py (requires/call/ensures) and xDSL's ModulePass.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from torch import fx

from graphopt.report import Action, PassRecord

if TYPE_CHECKING:
    from graphopt.config import GraphoptConfig

Stage = Literal["pre_autograd", "joint"]
STAGES: tuple[Stage, ...] = ("pre_autograd", "joint")


@dataclass(frozen=True)
class PassResult:
    """What a pass returns: the (possibly new) graph module and whether it changed."""

    gm: fx.GraphModule
    modified: bool


@dataclass
class PassContext:
    """What a pass may read about the compile it runs in, and where it records its sites."""

    config: GraphoptConfig
    graph_kind: str = "model"
    training: bool = False
    record_: PassRecord | None = field(default=None, repr=False)
    extras: dict[str, Any] = field(default_factory=dict)

    def record(self, action: Action, site: str, reason: str = "",
               approximate: bool = False) -> None:
        """Report one site: "matched", "rewritten", "skipped" (give the reason) or "kept";
        ``approximate``: this rewrite changes the numerics (see GraphPass.exact_for)."""
        if self.record_ is not None:
            self.record_.record(action, site, reason, approximate)


class GraphPass(ABC):
    """A named graph transformation.

    Subclasses are small frozen dataclasses (typed options as fields) with class-level
    ``name``, ``stage`` and ``exact``; the module docstring holds the Contract. ``run`` may
    mutate ``gm`` in place; the runner lints and recompiles afterwards.
    """

    name: ClassVar[str]
    stage: ClassVar[Stage]
    exact: ClassVar[bool] = True
    """True: numerics unchanged (checked by verify). False: approximate, opt-in, reported."""

    options_key: ClassVar[str | None] = None
    """The ``torch.compile`` options key whose section this pass owns (e.g. "moe")."""
    options_cls: ClassVar[Any] = None
    """Frozen dataclass of the pass's options, with ``parse(value)`` (validation + errors)."""

    @classmethod
    def parse_options(cls, value: Any) -> Any:
        """Parse this pass's options section (raises ConfigError naming the fix)."""
        if cls.options_cls is None:
            raise TypeError(f"pass {cls.name!r} has no options")
        return cls.options_cls.parse(value)

    @classmethod
    def from_config(cls, config: GraphoptConfig) -> GraphPass:
        """Build the pass with its options taken from ``config``."""
        return cls()

    marks_approximate_sites: ClassVar[bool] = False
    """True: the pass records every rewrite that changes the numerics with
    ``approximate=True``, so a run of an inexact pass that recorded none is exact (the moe
    pass: a capacity factor >= E drops nothing; mode "lightning" converting no site)."""

    def exact_for(self, record: PassRecord) -> bool:
        """Whether this run (its ``record``) left the numerics unchanged: ``exact``, or
        for a pass that ``marks_approximate_sites``, no site recorded approximate."""
        return self.exact or (self.marks_approximate_sites
                              and not any(s.approximate for s in record.sites))

    @abstractmethod
    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        """Transform ``gm`` and record every site looked at in ``ctx``."""
