"""Compatibility: the attention patterns moved to ``graphopt.passes.attention``.
``passes/moe.py`` still imports ``module_path`` from here."""

from graphopt.passes.attention.match_common import module_path

__all__ = ["module_path"]
