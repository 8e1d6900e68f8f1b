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
    expr = sympy.sympify(a) - sympy.sympify(b)

    def diff(x: float) -> float:
        # subs, not lambdify: torch's shape expressions use its own FloorDiv/Mod functions
        value = int(round(x)) if symbol.is_integer else x
        return float(expr.subs(symbol, value))
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


def attention_costs(profile: Any, heads: int = 8, head_dim: int = 64, batch: int = 1,
                    dtype: Any = None, train: bool = True) -> tuple[Any, Any, sympy.Symbol]:
    """Predicted seconds of causal softmax attention (SDPA) and of Lightning Attention
    (graphopt's op, chunked) as sympy expressions in the sequence length S, on ``profile``:
    both are traced once with a symbolic S (forward, + backward when ``train``) and priced
    per node. Returns (softmax_time(S), lightning_time(S), S)."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from graphopt.cost.graph_cost import graph_cost
    from graphopt.cost.profiles import load_profile
    from graphopt.kernels.lightning import lightning_attention

    prof = load_profile(profile)
    dtype = dtype or torch.float32
    slope = torch.full((heads,), 0.1)

    def softmax_attn(q: Any, k: Any, v: Any, s: Any) -> Any:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def lightning(q: Any, k: Any, v: Any, s: Any) -> Any:
        return lightning_attention(q, k, v, s)

    exprs = []
    symbol = None
    def make_step(fn: Any) -> Any:
        def step(q: Any, k: Any, v: Any, s: Any) -> Any:
            out = fn(q, k, v, s)
            if not train:
                return out
            return torch.autograd.grad(out.float().sum(), (q, k, v))
        return step

    for fn in (softmax_attn, lightning):
        step = make_step(fn)

        q, k, v = (torch.randn(batch, heads, 256, head_dim, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        example = (q, k, v, slope)
        gm = make_fx(step, tracing_mode="symbolic")(*example)
        if symbol is None:
            symbol = sympy.Symbol("S", positive=True, integer=True)
        subs: dict[Any, Any] = {}
        for node, real in zip(gm.graph.find_nodes(op="placeholder"), example):
            for i, (dim, size) in enumerate(zip(node.meta["val"].shape, real.shape)):
                if isinstance(dim, torch.SymInt):
                    expr = sympy.sympify(dim.node.expr)
                    is_seq = real is q and i == 2
                    if expr.is_Symbol:
                        subs.setdefault(expr, symbol if is_seq else int(size))
        total = total_expr(graph_cost(gm, prof.device), "time_s")
        exprs.append(total.subs(subs))
    assert symbol is not None
    return exprs[0], exprs[1], symbol


def attention_crossover(profile: Any, heads: int = 8, head_dim: int = 64, batch: int = 1,
                        dtype: Any = None, train: bool = True) -> float | None:
    """The sequence length above which Lightning Attention is predicted faster than causal
    softmax attention on ``profile`` (None if one is faster everywhere in [16, 2^24])."""
    softmax_t, lightning_t, s = attention_costs(profile, heads, head_dim, batch, dtype, train)
    return crossover(softmax_t, lightning_t, s, lo=16)
