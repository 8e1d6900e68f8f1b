"""Dynamic-shape MiniMax block loops: proving that an unrolled loop whose block bounds follow
the sequence length is Lightning Attention at every length its graph can run at.

After a recompile with dynamic shapes, Dynamo unrolls transformers' MiniMax loop for the
current number of blocks n and guards on n; block i reads rows
[i B, sym_min((i + 1) B, S)) and its decays are slices of the [H, B, .] tables whose length
follows S (``query_decay[:, :L]``, ``key_decay[:, -L:]``, ``diagonal_decay[..., :L, :L]``,
``exp(-slope * L)``). The numeric check at the compile's own length (``check_loop_decays``)
proves one length; this module proves the others without evaluating a table per length:

    lengths   every S the graph can run at: the symbol's value range from the ShapeEnv,
              cut to where every bound is constant beyond (proved in sympy: with S = M + t,
              t >= 0, no bound depends on t), filtered by the guards on S alone (the
              number-of-blocks guard among them); guards that mix S with other sizes are
              ignored, which can only add lengths (safe).
    blocks    at each S: the blocks' clamped bounds are contiguous from 0; block i's length
              L_i(S) is what its decays must be built for.
    decays    a table that does not follow S was checked numerically at the compile's length
              and must keep that length; one that follows S must be a prefix (query,
              diagonal) or suffix (key) slice of a table that does not, checked numerically
              once at its full length (a prefix of exp(-s (i + 1)) is the shorter table: the
              rule is exact); a block decay must be exp(-slope * X) with X(S) = L_i(S);
              a table computed from the sizes (``torch.tril(torch.ones(L, L))``) is
              evaluated at every length, from the sizes its tensor ops read (each an
              expression in S alone, else refused).
Anything else raises :class:`NoMatch` with why; bounds are evaluated from their sympy
expressions, compiled to Python functions once per expression (a model's layers share
them) as Dynamo's guard code is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx

from graphopt.passes.attention.match_common import (
    NoMatch,
    ancestors,
    arg,
    aten,
    evaluate,
    is_call,
)
from graphopt.passes.fx_utils import size_hint, tensor_meta

MAX_LENGTHS = 16384
"""Refuse a loop whose graph may run at more sequence lengths than this (each is checked)."""

_CODE: dict[tuple[sympy.Expr, sympy.Symbol], Callable[[int], Any] | None] = {}
_LENGTHS: dict[tuple[sympy.Symbol, int, int, tuple[sympy.Expr, ...]], list[int]] = {}


def sym_value(x: Any) -> Any:
    """The int or SymInt an FX node (or a literal) stands for, None for anything else."""
    if isinstance(x, fx.Node):
        x = x.meta.get("val", x.meta.get("example_value"))
    return x if isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool) else None


def sym_expr(x: Any) -> sympy.Expr | None:
    """The sympy expression of an int / SymInt / FX node holding one, else None."""
    v = sym_value(x)
    if isinstance(v, torch.SymInt):
        return v.node.expr
    return sympy.Integer(v) if isinstance(v, int) else None


def hint(x: Any) -> int:
    """The value at the compile's own example inputs (no guard is added; ``size_hint``)."""
    v = sym_value(x)
    value = None if v is None else size_hint(v)
    if value is None:
        raise NoMatch(f"{x} is not an integer size with an example value")
    return value


def _compiled(expr: sympy.Expr, symbol: sympy.Symbol) -> Callable[[int], Any] | None:
    """``expr`` as a Python function of S (printed by torch's PythonPrinter, the printer
    Dynamo's guard code uses: Min -> min, FloorDiv -> //); None where it cannot be printed
    (callers fall back to sympy substitution, ~100x slower)."""
    key = (expr, symbol)
    if key not in _CODE:
        from torch.utils._sympy.printers import PythonPrinter

        try:
            code = PythonPrinter().doprint(expr)
            _CODE[key] = eval(f"lambda {symbol.name}: {code}",  # noqa: S307 (sympy's print)
                              {"math": math, "torch": torch})
        except Exception:  # noqa: BLE001 (a function without a Python spelling)
            _CODE[key] = None
    return _CODE[key]


def _at(expr: sympy.Expr, symbol: sympy.Symbol, length: int) -> int:
    """``expr`` at S = length, an int (NoMatch if it depends on another size)."""
    if not expr.free_symbols <= {symbol}:
        raise NoMatch(f"{expr} depends on other sizes than the sequence length")
    value = _fast(expr, symbol, length)
    return int(value if value is not None else expr.subs({symbol: sympy.Integer(length)}))


def _fast(expr: sympy.Expr, symbol: sympy.Symbol, length: int) -> Any:
    """``expr`` at S = length through its compiled Python function; None if it has none or
    it fails (callers fall back to sympy)."""
    fn = _compiled(expr, symbol)
    try:
        return None if fn is None else fn(length)
    except Exception:  # noqa: BLE001 (fall back to sympy)
        return None


def hinted(env: dict[fx.Node, Any]) -> dict[fx.Node, Any]:
    """``env`` with symbolic-size values (a dynamic-shape compile's SymInt inputs) replaced
    by their values at the compile's example inputs; computing with a SymInt would add
    guards (specialize the graph) or fail. Only for checks that cover the other sizes too
    (:func:`check_every_length`, or a check of nodes that do not follow any size)."""
    if not any(isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool))
               for v in env.values()):
        return env
    return {n: (v.node.hint if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool))
                else v) for n, v in env.items()
            if n.op in ("placeholder", "get_attr")}


@dataclass
class SymbolicBlocks:
    """The sequence-length symbol S of a loop's bounds and the ShapeEnv that holds its
    range and guards."""

    symbol: sympy.Symbol
    shape_env: Any
    checked: list[int] | None = None  # the lengths proved, once check_every_length ran


def seq_symbol(q: fx.Node) -> tuple[sympy.Symbol, Any]:
    """(S, shape env) when Q's sequence size is one size symbol; else NoMatch."""
    val = tensor_meta(q)
    size = val.shape[2] if val is not None else None
    expr = _exact_quotients(size.node.expr) if isinstance(size, torch.SymInt) else None
    if not isinstance(expr, sympy.Symbol):
        raise NoMatch("the sequence length is not one size symbol")
    return expr, size.node.shape_env  # type: ignore[union-attr]


def _exact_quotients(expr: sympy.Expr) -> sympy.Expr:
    """``expr`` with every floor division a // b replaced by the polynomial quotient a / b
    when b is a product of positive powers of size symbols (and positive integers) that
    divides a. Duck sizing gives a batch equal to the sequence length the same symbol s, and
    ``view(B, -1, H, D)`` then sizes the sequence (s**2)//s, which neither sympy nor the
    ShapeEnv simplifies. Exact: size symbols are positive, so b != 0, and a = q b with q
    a polynomial in integers gives a // b = q."""
    from torch.utils._sympy.functions import FloorDiv

    def exact(a: sympy.Expr, b: sympy.Expr) -> sympy.Expr:
        if not all(isinstance(f, sympy.Symbol) or (isinstance(f, sympy.Pow) and
                   isinstance(f.base, sympy.Symbol) and f.exp.is_positive) or
                   (isinstance(f, sympy.Integer) and f > 0)
                   for f in sympy.Mul.make_args(b)):
            return FloorDiv(a, b)
        quotient, remainder = sympy.div(sympy.expand(a), b)
        return quotient if remainder == 0 else FloorDiv(a, b)

    return expr.replace(FloorDiv, exact)  # type: ignore[no-any-return]


def allowed_lengths(symbol: sympy.Symbol, shape_env: Any, exprs: list[sympy.Expr]) -> list[int]:
    """Every S >= 0 the graph can run at, up to where ``exprs`` stop changing (see the
    module doc). Raises NoMatch when an expression keeps growing with S and S is unbounded,
    or when there are more than MAX_LENGTHS."""
    vr = shape_env.var_to_range.get(symbol)
    lower = max(int(vr.lower), 0) if vr is not None and isinstance(vr.lower, sympy.Integer) \
        else 0
    upper = int(vr.upper) if vr is not None and isinstance(vr.upper, sympy.Integer) else None
    exprs = [e for e in exprs if symbol in e.free_symbols]
    top = max([abs(int(a)) for e in exprs for a in e.atoms(sympy.Integer)] + [lower]) + 1
    t = sympy.Symbol("graphopt_t", integer=True, nonnegative=True)
    for e in exprs:
        if _with_sympy_min_max(e).subs({symbol: top + t}).free_symbols:
            if upper is None:
                raise NoMatch(f"a block bound ({e}) keeps changing with the sequence length "
                              "and the length is unbounded")
            top = upper
    if lower >= top:
        return [lower]  # every allowed length behaves as this one
    upper = top if upper is None else min(upper, top)
    if upper - lower + 1 > MAX_LENGTHS:
        raise NoMatch(f"{upper - lower + 1} sequence lengths to check (over {MAX_LENGTHS})")
    guards = tuple(dict.fromkeys(g.expr for g in shape_env.guards
                                 if g.expr.free_symbols == {symbol}))
    key = (symbol, lower, upper, guards)
    if key not in _LENGTHS:
        if len(_LENGTHS) > 64 or len(_CODE) > 100_000:
            _LENGTHS.clear()
            _CODE.clear()
        _LENGTHS[key] = [c for c in range(lower, upper + 1)
                         if all(_holds(g, symbol, c) for g in guards)]
    return _LENGTHS[key]


def _with_sympy_min_max(expr: sympy.Expr) -> sympy.Expr:
    """``expr`` with torch's Min/Max (which do not simplify by assumptions: Min(16, 49 + t)
    stays) as sympy's (which do: 16 for t >= 0)."""
    def swap(x: Any) -> Any:
        name = type(x).__name__
        return (sympy.Min if name == "Min" else sympy.Max)(*x.args)

    return expr.replace(lambda x: type(x).__name__ in ("Min", "Max"), swap)


def _holds(guard: sympy.Expr, symbol: sympy.Symbol, length: int) -> bool:
    """Whether ``guard`` holds at S = length; undecidable: True (keeps the length: safe)."""
    fast = _fast(guard, symbol, length)
    if fast is not None:
        return bool(fast)
    value = guard.xreplace({symbol: sympy.Integer(length)})
    if value not in (sympy.true, sympy.false):
        value = guard.subs({symbol: sympy.Integer(length)})
    try:
        return bool(value)
    except TypeError:
        return True


def _clamp(bound: int, size: int) -> int:
    """A slice bound as Python resolves it on a dim of ``size``."""
    if bound < 0:
        bound += size
    return min(max(bound, 0), size)


def follows_sizes(node: fx.Node) -> bool:
    """Computed from a symbolic size (its value changes with the input shapes)."""
    return any(n.op == "placeholder" and isinstance(sym_value(n), torch.SymInt)
               for n in ancestors(node))


def _peel_slices(node: fx.Node) -> tuple[fx.Node, list[tuple[int, Any, Any]]]:
    """(base, [(dim, start, end)]) of a chain of step-1 slices / aliases down to a node
    that does not follow the sizes."""
    slices = []
    while follows_sizes(node):
        if is_call(node, aten.alias.default):
            node = arg(node, 0)
            continue
        if not is_call(node, aten.slice.Tensor) or (arg(node, 4) or 1) != 1:
            raise NoMatch(f"{node.name} is computed from the sequence length, not sliced "
                          "from a fixed table")
        base = arg(node, 0)
        val = tensor_meta(base)
        if val is None:
            raise NoMatch(f"{node.name} slices a value without a shape")
        dim = arg(node, 1) % val.dim()
        slices.append((dim, arg(node, 2) or 0, arg(node, 3)))
        node = base
    return node, slices


@dataclass
class ComputedTable:
    """A decay (or mask) computed from the sequence length, not sliced from a fixed table
    (``torch.tril(torch.ones(L, L))`` for a block of L rows): evaluated at every length.
    ``sizes``: the sizes its tensor ops read (``L``: an input or a size computed in the
    graph) and their expressions in S."""

    node: fx.Node
    sizes: list[tuple[fx.Node, sympy.Expr]]

    def at(self, env: dict[fx.Node, Any], symbol: sympy.Symbol, length: int) -> Any:
        """Its value at S = length (``env``: the hinted placeholder values)."""
        at_length = {n: v for n, v in env.items() if n.op in ("placeholder", "get_attr")}
        at_length.update({n: _at(e, symbol, length) for n, e in self.sizes})
        return evaluate(self.node, at_length)


def _computed_table(node: fx.Node, kind: str, symbol: sympy.Symbol) -> ComputedTable:
    """``node`` as a :class:`ComputedTable`; NoMatch when it reads other sizes than S."""
    sizes = []
    within = set(ancestors(node))
    for n in within:
        expr = sym_expr(n)
        if expr is not None and not expr.is_number and \
                any(u in within and sym_expr(u) is None for u in n.users):
            if not expr.free_symbols <= {symbol}:
                raise NoMatch(f"the {kind} decay is computed from other sizes than the "
                              f"sequence length ({n.name} = {expr})")
            sizes.append((n, expr))
    return ComputedTable(node, sizes)


def check_every_length(blocks: list[Any], checks: list[tuple[fx.Node, str, int, int]],
                       seq: SymbolicBlocks, slope: torch.Tensor,
                       env: dict[fx.Node, Any],
                       deviation: Callable[[torch.Tensor, torch.Tensor, str, int], str | None],
                       problem: Callable[[Any, str, int], str | None]) -> None:
    """Raise NoMatch unless the loop is Lightning Attention at every length its graph can run
    at (:func:`allowed_lengths`). ``checks``: (decay node, kind, block index, length at the
    hint), all already checked numerically at the hint; ``deviation``:
    match_linear.decay_deviation (a fixed table at its full length); ``problem``: why an
    evaluated table of a block of a given length is not the loop's (layout and values;
    tables computed from the length are evaluated at every length).
    ``blocks``: the loop's LoopBlocks (start / end: int, SymInt or FX node)."""
    s = seq.symbol
    starts = [sym_expr(b.start) for b in blocks]
    ends = [sym_expr(b.end) for b in blocks]
    if any(e is None for e in starts + ends):
        raise NoMatch("a block bound is not an integer size")
    fixed_tables: dict[tuple[fx.Node, str, int], None] = {}
    plans = [_decay_plan(node, kind, s) for node, kind, _, _ in checks]
    exprs = starts + ends + [e for p in plans if isinstance(p, sympy.Expr) for e in [p]] + \
        [e for p in plans if isinstance(p, ComputedTable) for _, e in p.sizes] + \
        [e for p in plans if isinstance(p, tuple) for pair in p[1] for e in pair]
    lengths_to_check = allowed_lengths(s, seq.shape_env, exprs)  # type: ignore[arg-type]
    for c in lengths_to_check:
        lengths, pos = [], 0
        for i, (a, b) in enumerate(zip(starts, ends)):
            lo, hi = _clamp(_at(a, s, c), c), _clamp(_at(b, s, c), c)  # type: ignore[arg-type]
            if lo != pos:
                raise NoMatch(f"at sequence length {c}, block {i} starts at {lo}, not where "
                              f"the previous block ended ({pos})")
            lengths.append(max(hi - lo, 0))
            pos = max(hi, lo)
        for (_, kind, i, at_hint), plan in zip(checks, plans):
            length = lengths[i]
            if plan is None:  # a fixed table: checked at the hint's length only
                if length != at_hint:
                    raise NoMatch(f"the {kind} decay of block {i} is a fixed table of a "
                                  f"{at_hint}-long block, but at sequence length {c} the block "
                                  f"is {length} long")
                continue
            if isinstance(plan, ComputedTable):
                why = problem(plan.at(env, s, c), kind, length)
                if why is not None:
                    raise NoMatch(f"at sequence length {c}, block {i}'s {kind} table, "
                                  f"computed from the length: {why}")
                continue
            if kind == "block":
                if _at(plan, s, c) != length:  # type: ignore[arg-type]
                    raise NoMatch(f"block {i}'s state decay exp(-slope * X) has X != its "
                                  f"length at sequence length {c}")
                continue
            base, slices, full = plan  # type: ignore[misc]
            key = (base, kind, full)
            if key not in fixed_tables:
                table = evaluate(base, env)
                why = deviation(table, slope, kind, full) if isinstance(
                    table, torch.Tensor) else "not a tensor"
                if why is not None:
                    raise NoMatch(f"the table block {i}'s {kind} decay is sliced from is not "
                                  f"Lightning Attention's for a {full}-long block ({why})")
                fixed_tables[key] = None
            taken = [(_clamp(_at(a, s, c), full), _clamp(_at(b, s, c), full))
                     for a, b in slices]
            want = (full - length, full) if kind == "key" else (0, length)
            if any((lo, max(hi, lo)) != want for lo, hi in taken):
                raise NoMatch(f"block {i}'s {kind} decay at sequence length {c} is rows "
                              f"{taken} of its table, not {want}")
    seq.checked = lengths_to_check


def _decay_plan(node: fx.Node, kind: str, symbol: sympy.Symbol) -> Any:
    """How a decay follows S: None (it does not), the sympy X of exp(-slope * X) (block
    decay), (base, [(start, end) exprs of the sliced seq dims], table length), or a
    :class:`ComputedTable` (computed from S, not sliced from a fixed table: a review found
    ``torch.tril(torch.ones(L, L))`` masks refused under dynamic shapes, rewritten without)."""
    if not follows_sizes(node):
        return None
    if kind == "block":
        x = arg(arg(node, 0), 1)
        expr = sym_expr(x)
        if expr is None:
            raise NoMatch("the state decay's length is not an integer size")
        return expr
    try:
        base, slices = _peel_slices(node)
    except NoMatch:
        return _computed_table(node, kind, symbol)
    val = tensor_meta(base)
    assert val is not None
    shape = [hint(d) for d in val.shape]
    seq_dims = [dim for dim, a, b in slices
                if not (sym_expr(a) == 0 and sym_expr(b) is not None
                        and _never_cuts(sym_expr(b), shape[dim]))]
    want = 2 if kind == "diagonal" else 1
    first = min(seq_dims, default=0)
    if sorted(seq_dims) != list(range(first, first + want)):
        raise NoMatch(f"the {kind} decay is not sliced along {want} adjacent sequence dim(s) "
                      "of its table")
    full = shape[first]
    if any(shape[d] != full for d in seq_dims) or math.prod(shape[first + want:]) != 1:
        raise NoMatch(f"the {kind} decay's table is not laid out [H, L{', L' * (want - 1)}]")
    exprs = [(sym_expr(a), sym_expr(b)) for dim, a, b in slices if dim in seq_dims]
    if any(a is None or b is None for a, b in exprs):
        raise NoMatch(f"the {kind} decay's slice bounds are not integer sizes")
    return base, exprs, full


def _never_cuts(end: sympy.Expr, size: int) -> bool:
    """A slice end that keeps the whole dim whatever S is (e.g. the int64 max)."""
    return end.is_number and int(end) >= size
