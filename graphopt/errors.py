"""Exceptions raised by graphopt. Every message names the problem and the fix."""

from __future__ import annotations


class GraphoptError(Exception):
    """Base class of every error graphopt raises on purpose."""


class ConfigError(GraphoptError, ValueError):
    """An option passed to ``torch.compile(..., options=...)`` is unknown or has a bad value."""


class LoweringUnavailableError(GraphoptError, RuntimeError):
    """The requested lowering needs a package or device this machine does not have."""


class PassFailedError(GraphoptError, RuntimeError):
    """A pass raised, or left a graph that fails the lint; names the pass and those before it."""


class VerificationError(GraphoptError, AssertionError):
    """``verify=True`` found outputs or gradients that differ from eager beyond tolerance."""


class FallbackWarning(UserWarning):
    """A graph skipped graphopt's model passes (capture refused it, or a pass changed its
    outputs) and runs as ``backend="aot_eager"`` would; the message says why. The report's
    ``fallback`` holds the same text. Silence with ``warnings.filterwarnings("ignore",
    category=graphopt.errors.FallbackWarning)``."""


class CaptureError(GraphoptError, RuntimeError):
    """Dynamo's graph cannot be compiled faithfully (e.g. Dynamo would drop an in-place
    write); names the construct and how to change it."""
