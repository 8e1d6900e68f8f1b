"""NPU lowering: graphopt's AOTAutograd call with torchair's graph compiler (Ascend GE).

torchair (bundled with torch_npu) exposes ``get_compiler(CompilerConfig)``, an FX graph
compiler for AOTAutograd's forward/backward graphs; graphopt keeps its own partitioner and
joint passes and hands torchair the partitioned graphs. Untested in CI (no Ascend device);
without torch_npu the config validation raises :class:`LoweringUnavailableError` first.
"""

from __future__ import annotations

from graphopt.config import GraphoptConfig
from graphopt.lowering import require_npu
from graphopt.lowering.base import AOTLowering, GraphCompiler


class NpuLowering(AOTLowering):
    name = "npu"

    def graph_compiler(self, config: GraphoptConfig) -> GraphCompiler:
        require_npu()
        import torch_npu  # noqa: F401  (registers the NPU device and torchair)
        import torchair
        from torchair.configs.compiler_config import CompilerConfig

        return torchair.get_compiler(CompilerConfig())  # type: ignore[no-any-return]
