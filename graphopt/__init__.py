"""graphopt: compiler passes and graph transformations for large-model training/inference.

Use it through ``torch.compile(model, backend="graphopt", options={...})``; no import needed.
"""

from graphopt.backend import compile, graphopt_backend
from graphopt.config import GraphoptConfig, VerifyConfig
from graphopt.errors import (
    CaptureError,
    ConfigError,
    GraphoptError,
    LoweringUnavailableError,
    PassFailedError,
    VerificationError,
)
from graphopt.export.onnx import export_onnx
from graphopt.parallel import parallelize
from graphopt.report import (
    CompileReport,
    clear_reports,
    graph_breaks,
    last_report,
    reports,
    uncompiled_frames,
)

__version__ = "0.1.0"

__all__ = [
    "CompileReport",
    "CaptureError",
    "ConfigError",
    "GraphoptConfig",
    "GraphoptError",
    "LoweringUnavailableError",
    "PassFailedError",
    "VerificationError",
    "VerifyConfig",
    "__version__",
    "clear_reports",
    "compile",
    "export_onnx",
    "graph_breaks",
    "graphopt_backend",
    "last_report",
    "parallelize",
    "reports",
    "uncompiled_frames",
]
