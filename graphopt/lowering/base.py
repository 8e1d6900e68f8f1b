"""Shared lowering machinery: the callbacks into graphopt and the AOTAutograd driver."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import fx
from torch._functorch.aot_autograd import aot_module_simplified

from graphopt.config import GraphoptConfig

GraphCompiler = Callable[[fx.GraphModule, Sequence[Any]], Callable[..., Any]]


@dataclass
class AOTHooks:
    """What a lowering calls back: joint passes, and "this graph is final" for dumps/report."""

    run_joint: Callable[[fx.GraphModule, str], fx.GraphModule]
    """Run the joint-stage passes on a graph of kind "joint" or "inference"."""
    graph_ready: Callable[[str, fx.GraphModule], None]
    """Called with kind "joint" | "forward" | "backward" | "inference" before compiling it."""
    add_time: Callable[[str, float], None]

    @contextmanager
    def timed(self, key: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add_time(key, time.perf_counter() - start)


class Lowering(ABC):
    """Compiles the model-pass output (a pre-autograd ATen graph) into a callable."""

    name: ClassVar[str]

    @abstractmethod
    def compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any], hooks: AOTHooks,
                config: GraphoptConfig) -> Callable[..., Any]:
        """Return the compiled callable (Dynamo calls it with the flat inputs)."""


class AOTLowering(Lowering):
    """Runs graphopt's own AOTAutograd call; subclasses give the graph compiler."""

    @abstractmethod
    def graph_compiler(self, config: GraphoptConfig) -> GraphCompiler:
        """Compiles one forward, backward or inference graph (boxed-callable convention)."""

    def partition(self, joint: fx.GraphModule, joint_inputs: Sequence[Any],
                  **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        """Split the joint graph; the default keeps every activation the backward needs. After
        the remat pass tagged the nodes (keep / recompute), the min-cut partitioner applies
        the tags."""
        from torch._functorch.partitioners import (
            default_partition,
            min_cut_rematerialization_partition,
        )

        if joint.meta.get("graphopt_remat"):
            return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        return default_partition(joint, joint_inputs, **kwargs)

    def compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any], hooks: AOTHooks,
                config: GraphoptConfig) -> Callable[..., Any]:
        compiler = self.graph_compiler(config)

        def for_kind(kind: str) -> GraphCompiler:
            def compile_one(g: fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
                if kind == "inference":
                    g = hooks.run_joint(g, "inference")
                hooks.graph_ready(kind, g)
                with hooks.timed("lowering"):
                    return compiler(g, inputs)
            return compile_one

        def partition(joint: fx.GraphModule, joint_inputs: Sequence[Any],
                      **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
            joint = hooks.run_joint(joint, "joint")
            hooks.graph_ready("joint", joint)
            return self.partition(joint, joint_inputs, **kwargs)

        return aot_module_simplified(  # type: ignore[no-any-return]
            gm, list(example_inputs), fw_compiler=for_kind("forward"),  # type: ignore[arg-type]
            bw_compiler=for_kind("backward"),  # type: ignore[arg-type]
            inference_compiler=for_kind("inference"),  # type: ignore[arg-type]
            partition_fn=partition,
        )
