"""Symbolic costs: with ``dynamic=True`` / ``tracing_mode="symbolic"`` graphs, FLOPs, bytes and
roofline times are sympy expressions in the shape symbols (s0, s1, ...). Helpers here turn a
:class:`~graphopt.cost.graph_cost.GraphCost` into one expression, evaluate it, and solve for
crossovers (the sequence length where Lightning Attention gets cheaper than softmax attention
on a profile, for example).
"""

from __future__ import annotations

from typing import Any

import sympy

from graphopt.cost.graph_cost import GraphCost, _expr


def total_expr(cost: GraphCost, what: str = "time_s") -> sympy.Expr:
    """Sum of ``what`` ("time_s" | "flops" | "bytes") over the graph's nodes, simplified."""
    total = sympy.Integer(0)
    for node in cost.nodes:
        total += sympy.sympify(_expr(getattr(node, what)))
    return sympy.simplify(total)


def evaluate(expr: Any, **values: float) -> float:
    """``expr`` with its symbols replaced by ``values`` (names as printed: s0, s1, ...)."""
    expr = sympy.sympify(expr)
    subs = {sym: values[str(sym)] for sym in expr.free_symbols if str(sym) in values}
    missing = [str(s) for s in expr.free_symbols if str(s) not in values]
    if missing:
        raise ValueError(f"no value for symbol(s) {', '.join(sorted(missing))}")
    return float(expr.subs(subs))


def crossover(a: Any, b: Any, symbol: sympy.Symbol, lo: float = 1,
              hi: float = 1 << 24) -> float | None:
    """The smallest x in [lo, hi] where ``a(x) = b(x)`` changes sign (a - b), found by
    scanning powers of two then bisecting; None if a - b keeps its sign on [lo, hi]."""
    diff = sympy.lambdify(symbol, sympy.sympify(a) - sympy.sympify(b), "math")
    x, prev = lo, diff(lo)
    while x < hi:
        nxt = min(x * 2, hi)
        cur = diff(nxt)
        if (prev <= 0) != (cur <= 0):
            left, right = x, nxt
            for _ in range(60):
                mid = (left + right) / 2
                if (diff(mid) <= 0) == (prev <= 0):
                    left = mid
                else:
                    right = mid
            return (left + right) / 2
        x, prev = nxt, cur
    return None
