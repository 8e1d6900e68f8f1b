"""Eager lowering: run the transformed forward/backward FX graphs op by op (debugging, tests)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import fx
from torch._functorch.aot_autograd import make_boxed_func

from graphopt.config import GraphoptConfig
from graphopt.lowering.base import AOTLowering, GraphCompiler


class EagerLowering(AOTLowering):
    name = "eager"

    def graph_compiler(self, config: GraphoptConfig) -> GraphCompiler:
        def run_graph(gm: fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
            return make_boxed_func(gm.forward)

        return run_graph
