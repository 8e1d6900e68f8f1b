"""Linear-attention patterns of the attention pass (mode "exact"): what counts as a MiniMax
block loop or a decayed quadratic parallel form, and the numeric checks that prove a match is
Lightning Attention before it may be rewritten. Nothing here edits a graph.

Patterns (each raises :class:`NoMatch` with the reason):
    minimax_block_loop      ``cat(dim=-2)`` of per-block outputs
                            ``(Q_b * qd) @ S + ((Q_b @ K_b^T) * D) @ V_b``, the state chain
                            ``S * exp(-slope * L) + (K_b * kd)^T @ V_b`` starting at zeros
                            (transformers' ``MiniMaxLightningAttention`` as Dynamo unrolls it);
                            or the same loop without decay (slope 0): outputs
                            ``Q_b @ S + tril(Q_b @ K_b^T) @ V_b`` (or ``* M``, M a causal
                            mask of ones), states ``S + K_b^T @ V_b`` (causal linear
                            attention, Katharopoulos et al. 2020, eq. 9, in blocks).
    decayed_parallel_form   ``((Q @ K^T) * D) @ V`` over [B, H, S, X] tensors (RetNet style).
Checks:
    check_loop_decays       every decay tensor of a loop, evaluated, equals
                            exp(-slope * (i + 1)), exp(-slope * (L - 1 - j)),
                            exp(-slope * (i - j)) masked, exp(-slope * L) within the
                            tables' rounding (``decay_deviation``).
    parallel_form_slopes    D is built from buffers/constants and equals
                            exp(-slope_h * (i - j)) below the diagonal, 0 above (slopes
                            fitted by least squares in the log domain).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from graphopt.passes.attention.match_common import (
    NoMatch,
    ancestors,
    arg,
    aten,
    evaluate,
    is_buffer,
    is_call,
)
from graphopt.passes.attention.match_symbolic import (
    SymbolicBlocks,
    check_every_length,
    follows_sizes,
    hint,
    hinted,
    seq_symbol,
    sym_expr,
    sym_value,
)
from graphopt.passes.fx_utils import tensor_meta


class LoopRefused(NoMatch):
    """The chain has the block loop's shape (every block output is inter + intra over slices
    of Q, K, V, or inter - intra, or that divided by a normalizer: ``_loop_shape``) but is
    refused as a whole; the message says why (reported, unlike a chain that is not
    loop-shaped at all)."""


@dataclass
class LoopBlock:
    """One block of a MiniMax block loop: slices [start, end) of Q, K, V and its decays."""

    q: fx.Node
    k: fx.Node
    v: fx.Node
    start: Any  # int; an FX node or SymInt in a dynamic-shape graph
    end: Any
    q_decay: fx.Node | None  # None: the query is not decayed (a loop without decay)
    diag_decay: fx.Node | None  # None: the scores are masked by tril (no table)
    state_in: fx.Node
    intra: fx.Node
    rows: fx.Node  # the block's slice of Q (its size is the block's length)


@dataclass
class BlockLoop:
    """A matched MiniMax block loop over one Q, K, V (not yet checked numerically)."""

    q: fx.Node
    k: fx.Node
    v: fx.Node
    slope: fx.Node | None  # None: a loop without decay (slope 0)
    blocks: list[LoopBlock]
    final_state: fx.Node | None
    checks: list[tuple[fx.Node, str, int, int]]  # (decay node, kind, block, length at hint)
    symbolic: SymbolicBlocks | None = None  # bounds follow the sequence length
    block_size: int = 0  # the longest block at the compile's length


def _seq_slice(node: Any) -> tuple[fx.Node, Any, Any]:
    """(base, start, end) of ``base[:, :, start:end]``; a whole-range slice is an alias.
    Bounds are ints, or FX nodes / SymInts in a dynamic-shape graph."""
    if is_call(node, aten.alias.default):
        val = tensor_meta(arg(node, 0))
        if val is None or val.dim() != 4:
            raise NoMatch("block operand is not a [B, H, S, D] tensor")
        return arg(node, 0), 0, val.shape[2]  # a SymInt stays one (no int(): no guard)
    if not is_call(node, aten.slice.Tensor) or arg(node, 1) not in (2, -2):
        raise NoMatch("block operand is not a slice of the sequence dimension")
    base, start, end = _whole(arg(node, 0)), arg(node, 2) or 0, arg(node, 3)
    val = tensor_meta(base)
    if val is None:
        raise NoMatch("block operand has no tensor value")
    if not isinstance(start, int) or not isinstance(end, int) or \
            not isinstance(val.shape[2], int):
        return base, start, end  # symbolic bounds: checked by _check_loop
    return base, start, min(end, int(val.shape[2]))


def _whole(node: Any) -> Any:
    """``node`` with whole-range slices of other dims peeled off (``x[:, :, a:b]`` in a
    dynamic-shape graph is ``slice(slice(x, 0, 0, INT64_MAX), 2, a, b)``)."""
    while is_call(node, aten.slice.Tensor) and arg(node, 1) not in (2, -2) and \
            not (arg(node, 2) or 0) and isinstance(arg(node, 3), int) and \
            arg(node, 3) >= 2**62 and (arg(node, 4) or 1) == 1:
        node = arg(node, 0)
    return node


def _split_product(node: Any, target: Any) -> tuple[Any, Any]:
    if not is_call(node, target):
        found = node.target if isinstance(node, fx.Node) else node
        raise NoMatch(f"expected {target}, found {found}")
    return arg(node, 0), arg(node, 1)


def _plain_add(node: Any) -> bool:
    """``aten.add.Tensor(a, b)`` with alpha 1 (``add(a, b, alpha=2)`` is a + 2 b)."""
    return is_call(node, aten.add.Tensor) and len(node.args) == 2 and \
        node.kwargs.get("alpha", 1) == 1


def _same_bound(a: Any, b: Any) -> bool:
    """Two slice bounds that are the same value (the same node, int or size expression)."""
    if a is b:
        return True
    ea, eb = sym_expr(a), sym_expr(b)
    return ea is not None and ea == eb


def _is_last_two_transpose(node: Any) -> bool:
    return is_call(node, aten.transpose.int) and sorted([arg(node, 1), arg(node, 2)]) in (
        [-2, -1], [2, 3])


def _other_factor(product: Any, factor: Any) -> Any:
    """The other operand of ``product = factor * x`` or ``x * factor`` (an elementwise mul
    commutes, so either spelling is the same value); None when neither operand is
    ``factor``."""
    if not is_call(product, aten.mul.Tensor):
        return None
    a, b = arg(product, 0), arg(product, 1)
    return b if a is factor else a if b is factor else None


def _scores_and_decay(weights: Any) -> tuple[Any, Any]:
    """``weights = (Q_b @ K_b^T) * D`` in either operand order: (the scores, D)."""
    a, b = _split_product(weights, aten.mul.Tensor)
    if not is_call(a, aten.matmul.default) and is_call(b, aten.matmul.default):
        return b, a
    return a, b


def _match_block_output(o: Any) -> LoopBlock:
    """o = (Q_b * qd) @ S_in + ((Q_b @ K_b^T) * dd) @ V_b (either order of the sum), or
    without decay Q_b @ S_in + tril(Q_b @ K_b^T) @ V_b (``* dd``: a mask of ones, checked
    as the decay of slope 0): ``q_decay`` None."""
    if not _plain_add(o):
        raise NoMatch("block output is not inter + intra")
    for inter, intra in ((arg(o, 0), arg(o, 1)), (arg(o, 1), arg(o, 0))):
        try:
            scaled_q, state = _split_product(inter, aten.matmul.default)
            weights, v_b = _split_product(intra, aten.matmul.default)
            if is_call(weights, aten.tril.default) and (arg(weights, 1) or 0) == 0:
                qk, dd = arg(weights, 0), None  # causal, no decay
            else:
                qk, dd = _scores_and_decay(weights)
            q_b, k_t = _split_product(qk, aten.matmul.default)
            qd = None if _same_rows(scaled_q, q_b) else _other_factor(scaled_q, q_b)
            if not isinstance(qd, (fx.Node, type(None))):  # a number times Q_b: no decay
                # table (a review: refused with a reason about the state update)
                raise NoMatch(f"the query is scaled by {qd!r}, not a decay table")
            if (qd is None and not _same_rows(scaled_q, q_b)) or \
                    not is_call(k_t, aten.transpose.int) or \
                    sorted([arg(k_t, 1), arg(k_t, 2)]) != [-2, -1]:
                raise NoMatch("intra scores are not Q_b @ K_b^T of the same block")
            (q, s0, e0), (k, s1, e1), (v, s2, e2) = (_seq_slice(x) for x in (q_b, arg(k_t, 0),
                                                                             v_b))
            if not (_same_bound(s0, s1) and _same_bound(s0, s2) and _same_bound(e0, e1)
                    and _same_bound(e0, e2)):
                raise NoMatch("q, k, v block bounds differ")
            return LoopBlock(q, k, v, s0, e0, qd, dd, state, intra, q_b)
        except NoMatch:
            continue
    raise NoMatch("block output is not (Q*qd) @ S + ((Q K^T) * D) @ V")


def _same_rows(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the same node or the same rows of one tensor (a block's query
    sliced twice)."""
    if a is b:
        return True
    try:
        (x, s0, e0), (y, s1, e1) = _seq_slice(a), _seq_slice(b)
    except NoMatch:
        return False
    return x is y and _same_bound(s0, s1) and _same_bound(e0, e1)


def _match_undecayed_update(new: fx.Node, block: LoopBlock) -> None:
    """new = S_in + K_b^T @ V_b (a block of a loop without decay)."""
    if _plain_add(new):
        for s_in, kv in ((arg(new, 0), arg(new, 1)), (arg(new, 1), arg(new, 0))):
            if s_in is block.state_in and is_call(kv, aten.matmul.default) and \
                    _is_last_two_transpose(arg(kv, 0)) and \
                    self_rows(arg(arg(kv, 0), 0), block.k, block) and \
                    self_rows(arg(kv, 1), block.v, block):
                return
    raise NoMatch("the state update of a block without query decay is not S + K_b^T @ V_b "
                  "of its own rows")


def _match_state_update(new: fx.Node, block: LoopBlock
                        ) -> tuple[fx.Node, fx.Node, fx.Node]:
    """new = S_in * exp(-slope * L) + (K_b * kd)^T @ V_b; returns (slope, block decay, kd)."""
    if not _plain_add(new):
        raise NoMatch("state update is not decayed state + K^T V")
    for decayed, kv in ((arg(new, 0), arg(new, 1)), (arg(new, 1), arg(new, 0))):
        if not (is_call(decayed, aten.mul.Tensor) and is_call(kv, aten.matmul.default)):
            continue
        s_in, bd = decayed.args
        if s_in is not block.state_in:
            s_in, bd = bd, s_in
        kt, v_b = kv.args
        if s_in is not block.state_in or not _is_last_two_transpose(kt):
            continue
        k_scaled = arg(kt, 0)
        if not is_call(k_scaled, aten.mul.Tensor) or not self_rows(v_b, block.v, block):
            continue
        k_b, kd = k_scaled.args
        if not self_rows(k_b, block.k, block) and self_rows(kd, block.k, block):
            k_b, kd = kd, k_b  # kd * K_b
        if not self_rows(k_b, block.k, block):
            raise NoMatch("the state update reads K rows other than its block's")
        exponent = arg(bd, 0) if is_call(bd, aten.exp.default) else None
        negated = next((x for x in (arg(exponent, 0), arg(exponent, 1))
                        if is_call(x, aten.neg.default)), None) \
            if is_call(exponent, aten.mul.Tensor) else None
        if negated is None:
            raise NoMatch("block decay is not exp(-slope * L)")
        return arg(negated, 0), bd, kd
    raise NoMatch("state update does not read this block's K and V")


def self_rows(node: Any, base: fx.Node, block: LoopBlock) -> bool:
    """``node`` is rows [block.start, block.end) of ``base``."""
    try:
        b, start, end = _seq_slice(node)
    except NoMatch:
        return False
    return b is base and _same_bound(start, block.start) and _same_bound(end, block.end)


def _next_state(block: LoopBlock, i: int) -> fx.Node:
    """The add that updates the state ``block`` reads (``S_in * decay + ...``; ``S_in +
    ...`` in a loop without decay)."""
    written = sorted({str(u.target) for u in block.state_in.users
                      if isinstance(u.target, torch._ops.OpOverload) and
                      u.target._schema.is_mutable})
    if written:  # (a review: ``S += K_b^T @ V_b`` under no_grad got the generic reason)
        raise NoMatch(f"block {i}'s state is updated in place ({', '.join(written)}: S += "
                      "...); the loop form takes a new state per block, S = S + K_b^T @ V_b "
                      "(decayed: S * exp(-slope * L) + ...)")
    if block.q_decay is None:
        found = next((u for u in block.state_in.users if _plain_add(u)), None)
        if found is None:
            raise NoMatch(f"block {i}'s state update is not S + K_b^T @ V_b (a loop without "
                          "decay)")
        return found
    users = [u for u in block.state_in.users if is_call(u, aten.mul.Tensor)
             and u.users and any(is_call(w, aten.add.Tensor) for w in u.users)]
    new_state = next((w for u in users for w in u.users if is_call(w, aten.add.Tensor)), None)
    if new_state is None:  # "has no state update" misled where the update has another
        # form: decayed after the sum, or a decay times an input-dependent gate (a review)
        read_by = sorted({str(u.target).split(".")[1] if str(u.target).startswith("aten.")
                          else str(u.target) for u in block.state_in.users})
        raise NoMatch(f"block {i}'s state update is not S * exp(-slope * L) + (K * kd)^T @ V "
                      f"(its state is read by {', '.join(read_by)}: e.g. decayed after the "
                      "sum, or its decay multiplied by a gate)")
    return new_state


def match_minimax_block_loop(cat: fx.Node) -> BlockLoop:
    """Match ``torch.cat(per-block outputs, dim=-2)`` of a MiniMax-style block loop."""
    outputs = arg(cat, 0)
    if len(cat.args) < 2 or arg(cat, 1) not in (-2, 2) or not isinstance(outputs, list) \
            or len(outputs) < 1:
        raise NoMatch("not a concatenation over the sequence dimension")
    try:
        blocks = [_match_block_output(o) for o in outputs]
    except NoMatch as exc:
        differs = _loop_shape(outputs)
        if differs is not None:  # a review: a block loop without decay tables (tril
            # masked, no decay) went neither rewritten nor reported; later ones: an output
            # inter - intra or normalized by a running key sum, neither reported
            raise LoopRefused(f"{differs or exc}; graphopt's kernel computes Lightning "
                              "Attention's form: (Q*qd) @ S + ((Q K^T) * D) @ V with "
                              "exponential decays, or without decay Q @ S + tril(Q K^T) @ V"
                              ) from None
        raise
    try:
        loop = _check_loop(blocks)
        operand_problem(loop.q, loop.k, loop.v, cat)
        return loop
    except LoopRefused:
        raise
    except NoMatch as exc:
        raise LoopRefused(str(exc)) from None


def _loop_shape(outputs: list[Any]) -> str | None:
    """Whether ``outputs`` are a linear-attention block loop's block outputs even where
    :func:`_match_block_output` refuses them: each is inter +/- intra (two products; an
    ``alpha`` too) or that divided by something, and the first block's products read a
    zeros state. None when not; else what differs from inter + intra, "" when nothing
    this function names (the products themselves are not the form)."""
    def form(o: Any) -> tuple[str, list[Any]] | None:
        if is_call(o, aten.div.Tensor):
            inner = form(arg(o, 0))
            if inner is None or inner[0]:
                return None
            by = arg(o, 1)
            what = f"the number {by!r}" if not isinstance(by, fx.Node) else \
                "another tensor (a normalizer, such as Katharopoulos et al.'s Q_b @ sum of keys)"
            return f"inter + intra divided by {what}", inner[1]
        if not is_call(o, aten.add.Tensor, aten.sub.Tensor) or len(o.args) != 2 or \
                not all(is_call(x, aten.matmul.default) for x in o.args[:2]):
            return None
        alpha = o.kwargs.get("alpha", 1)
        kind = "" if _plain_add(o) else \
            "inter - intra (Q_b @ S minus the intra-block term), not their sum" \
            if is_call(o, aten.sub.Tensor) and alpha == 1 else \
            f"one product {'-' if is_call(o, aten.sub.Tensor) else '+'} {alpha!r} x the " \
            "other (add/sub with alpha), not their sum"
        return kind, [y for x in o.args[:2] for y in x.args[:2]]

    found = [form(o) for o in outputs]
    if any(f is None for f in found) or not any(
            is_call(x, aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default)
            for x in found[0][1]):  # type: ignore[index]
        return None
    for i, f in enumerate(found):
        assert f is not None
        if f[0]:
            return f"block {i}'s output is {f[0]}"
    return ""


def _check_loop(blocks: list[LoopBlock]) -> BlockLoop:
    """The loop-level checks of :func:`match_minimax_block_loop` (every block matched). Block
    bounds that follow the sequence length (a dynamic-shape graph) are checked here at the
    compile's own length (hints) and at every other length by :func:`check_loop_decays`."""
    first = blocks[0]
    seq = tensor_meta(first.q)
    assert seq is not None
    symbolic = None
    if not isinstance(seq.shape[2], int) or \
            not all(isinstance(x, int) for b in blocks for x in (b.start, b.end)):
        try:
            symbol, shape_env = seq_symbol(first.q)
            exprs = [sym_expr(x) for b in blocks for x in (b.start, b.end)]
            if any(e is None or not e.free_symbols <= {symbol} for e in exprs):
                raise NoMatch("block bounds depend on other sizes than the sequence length")
        except NoMatch as exc:
            raise LoopRefused(
                f"block bounds are symbolic and {exc}, so the loop is not rewritten as one "
                "op; its blocks' products are rewritten as parallel forms where their decay "
                "matrices do not depend on the length. Compile with dynamic=False (or "
                "torch._dynamo.mark_static on the sequence dimension) to have the whole loop "
                "rewritten") from None
        symbolic = SymbolicBlocks(symbol, shape_env)
    if not is_call(first.state_in, aten.zeros.default, aten.zeros_like.default,
                   aten.new_zeros.default):
        raise NoMatch("the first block's state is not zeros (a cached state: decode path)")
    batches = {hint(v.shape[0]) for v in map(tensor_meta, (first.q, first.k, first.v))
               if v is not None and v.dim() == 4}
    if len(batches) != 1:  # K/V shared over the batch: the kernel's backward needs one B
        raise NoMatch(f"Q, K and V have different batch sizes ({sorted(batches)}): K/V "
                      "broadcast over the batch")
    lengths = [x.shape[2] for x in map(tensor_meta, (first.q, first.k, first.v))
               if x is not None]
    if len({n if isinstance(n, int) else sym_expr(n) for n in lengths}) != 1:
        # the op takes one S: K/V longer than Q (rows past Q's unread) failed at run time
        raise NoMatch(f"Q, K and V have different sequence lengths ({lengths}): the loop "
                      "reads part of K/V")
    seq_len = hint(seq.shape[2])
    checks: list[tuple[fx.Node, str, int, int]] = []
    slope = None
    final_state = None
    end = 0
    decayed = first.q_decay is not None
    for i, blk in enumerate(blocks):
        if (blk.q, blk.k, blk.v) != (first.q, first.k, first.v):
            raise NoMatch("blocks read different Q/K/V tensors")
        if (blk.q_decay is not None) != decayed:
            raise NoMatch(f"block {i} {'does not decay' if decayed else 'decays'} its query "
                          f"and block 0 {'does' if decayed else 'does not'}")
        start = min(hint(blk.start), seq_len)
        if start != end:
            raise NoMatch(f"block {i} starts at {start}, expected {end}")
        end = min(hint(blk.end), seq_len)
        length = end - start
        new_state = _next_state(blk, i)
        if not decayed:  # slope 0: the only table is an intra mask (of ones), if any
            _match_undecayed_update(new_state, blk)
            if blk.diag_decay is not None:
                checks.append((blk.diag_decay, "diagonal", i, length))
        else:
            if blk.q_decay is None or blk.diag_decay is None:
                raise NoMatch(f"block {i} decays its query but masks its scores by tril "
                              "without a decay")
            s, bd, kd = _match_state_update(new_state, blk)
            if slope is not None and s is not slope:
                raise NoMatch("blocks use different slopes")
            slope = s
            checks += [(blk.q_decay, "query", i, length), (kd, "key", i, length),
                       (blk.diag_decay, "diagonal", i, length), (bd, "block", i, length)]
        if i + 1 < len(blocks) and blocks[i + 1].state_in is not new_state:
            read = blocks[i + 1].state_in
            if is_call(read, aten.detach.default, aten.alias.default) and \
                    arg(read, 0) is new_state:
                raise NoMatch(f"block {i + 1} reads block {i}'s state detached (truncated "
                              "backpropagation through the state); the kernel "
                              "differentiates through the whole chain")
            raise NoMatch(f"block {i + 1} does not read block {i}'s state")
        final_state = new_state
    assert slope is not None or not decayed
    if end != seq_len:
        raise NoMatch("blocks do not cover the whole sequence")
    size = max(min(hint(b.end), seq_len) - min(hint(b.start), seq_len) for b in blocks)
    return BlockLoop(first.q, first.k, first.v, slope, blocks, final_state, checks, symbolic,
                     size)


def operand_problem(q: fx.Node, k: fx.Node, v: fx.Node, result: fx.Node) -> None:
    """Raise NoMatch unless Q, K, V [B, H, S, D] fit the kernel: K and V with the same
    heads, Q's heads a multiple of them (GQA), and one dtype for Q, K, V and the result the
    op replaces. graphopt::lightning_attention_fwd computes in Q's accumulation dtype and returns
    Q's dtype; eager promotes mixed dtypes (float32 Q, K with float64 V or decays computes
    in float64: a review measured 1.3e-5 where eager is exact, and K with 1 head against V
    with 4 read V out of bounds in the Triton kernel)."""
    qv, kv, vv, rv = (tensor_meta(x) for x in (q, k, v, result))
    if qv is None or kv is None or vv is None or rv is None:
        raise NoMatch("q, k, v or the result has no tensor value")
    hq, hk, hv = (hint(x.shape[1]) for x in (qv, kv, vv))
    if hk != hv or hq % hk:
        raise NoMatch(f"K has {hk} heads and V {hv}, Q {hq}: the kernel needs K and V with "
                      "the same heads and Q's heads a multiple of them (GQA)")
    dtypes = {qv.dtype, kv.dtype, vv.dtype, rv.dtype}
    if len(dtypes) != 1:
        raise NoMatch(f"Q, K, V and the result have dtypes {qv.dtype}, {kv.dtype}, "
                      f"{vv.dtype}, {rv.dtype}: eager promotes them (decays in another "
                      "dtype included), the kernel computes in Q's")


def _distances(kind: str, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(distance, mask) of a ``length``-long block's decay of ``kind`` (float64): "query"
    i + 1, "key" L - 1 - i, "block" L, "diagonal" i - j where i >= j (mask 0 above)."""
    i = torch.arange(length, dtype=torch.float64)
    if kind == "query":
        dist = (i + 1).view(-1, 1)
    elif kind == "key":
        dist = (length - 1 - i).view(-1, 1)
    elif kind == "block":
        dist = torch.tensor(float(length), dtype=torch.float64)
    else:
        gap = i.view(-1, 1) - i.view(1, -1)
        return gap.clamp(min=0).unsqueeze(0), (gap >= 0).unsqueeze(0).double()
    return dist, torch.ones_like(dist)


def expected_decay(kind: str, slope: torch.Tensor, length: int) -> torch.Tensor:
    """The decay Lightning Attention uses in a ``length``-long block (float64): "query"
    exp(-s (i + 1)), "key" exp(-s (L - 1 - i)), "block" exp(-s L), else the masked
    "diagonal" exp(-s (i - j)) for i >= j, 0 above."""
    dist, mask = _distances(kind, length)
    return torch.exp(-slope.reshape(-1, 1, 1).double() * dist) * mask


DECAY_ULPS = {torch.float32: 4}
"""A decay table entry may differ from exp(-slope d) by this many rounding units (eps) of its
dtype per unit of (1 + slope d): 4 for float32 (exp is accurate to an ulp or two there), 1
(twice the rounding) for bf16/fp16, whose tables are rounded from float32 values, so that
a table a few bf16 units off is refused. See :func:`decay_deviation`."""


def _tolerance_dtype(dtype: torch.dtype) -> torch.dtype:
    """The coarser of ``dtype`` and float32 (integer/bool tables hold exact values)."""
    if dtype.is_floating_point and torch.finfo(dtype).eps > torch.finfo(torch.float32).eps:
        return dtype
    return torch.float32


def decay_deviation(got: torch.Tensor, slope: torch.Tensor, kind: str, length: int,
                    stored: torch.dtype | None = None) -> str | None:
    """None when the evaluated decay ``got`` is exp(-slope d) as its dtype can hold it, else
    "largest relative deviation ...; <dtype> tables may deviate by ...".

    A table built as exp(-s d) in a dtype of rounding unit eps is off by at most ~eps in
    the log domain for the exp and its rounding, plus eps * s d for the rounded product
    s * d (or a slope rounded to that dtype, as a bf16 model's ``slope_rate`` is). So
    entry-wise ``|got - want| <= u * eps * (1 + s d) * want + tiny`` (u from DECAY_ULPS:
    4 for float32, 1 for bf16/fp16; above the diagonal want is 0: got must be), with eps and
    tiny (smallest normal: subnormals and flush-to-zero) of the coarser of ``got.dtype``
    and float32: transformers builds MiniMax's tables in float32 before ``.to(dtype)``,
    so a float64 model holds float32-rounded tables. The absolute error of a weight is then
    at most ``u * eps`` (max of (1 + x) e^-x is 1): the rewrite, which computes
    exp(-s d) from the slope, is exact up to the tables' own rounding. Entries where
    s d = 0 (distance 0; every entry at slope 0) are exp(0) = 1, exact in every dtype, so
    they get no allowance.

    Args:
        got: the table (any dtype) with ``numel`` of ``expected_decay(kind, slope, length)``.
        slope: [H] slopes (any float dtype; compared in float64).
        stored: a dtype the table was rounded to before it became ``got.dtype`` (a float32
            model loaded from a bf16 checkpoint holds bf16-rounded tables): the coarser of
            it and ``got.dtype`` sets the tolerance.
    Raises:
        NoMatch: ``got`` does not have the table's number of entries.
    """
    dist, mask = _distances(kind, length)
    s = slope.reshape(-1, 1, 1).double()
    want = torch.exp(-s * dist) * mask
    if got.numel() != want.numel():
        raise NoMatch(f"{kind} decay of a {length}-long block does not have "
                      f"{want.numel()} entries")
    if bool((s < 0).any()):
        return "a negative slope (weights that grow with distance, not a decay)"
    coarse = _tolerance_dtype(got.dtype)
    if stored is not None and torch.finfo(stored).eps > torch.finfo(coarse).eps:
        coarse = stored
    eps, tiny = torch.finfo(coarse).eps, torch.finfo(coarse).smallest_normal
    ulps = DECAY_ULPS.get(coarse, 1)
    error = (got.double().reshape(want.shape) - want).abs()
    if bool((error <= ulps * eps * (1 + s * dist) * want + tiny).all()):
        # exp(0) = 1 in every dtype: where slope x distance is 0 (distance 0; every entry
        # at slope 0) no rounding allowance (a review: a float64 mask of ones times
        # 1 - 3e-7 was taken for ones, 2e-7 off eager, reported exact)
        exact = ((s * dist == 0) & (mask > 0)).expand_as(want)
        if bool((got.double().reshape(want.shape)[exact] != 1).any()):
            return ("entries where slope x distance is 0 are not exactly 1 (exp(0) is 1 in "
                    "every dtype: the table is scaled, not rounded)")
        return None
    if bool((error[want == 0] > tiny).any()):
        return "nonzero entries where the decay must be 0 (above the diagonal: not causal)"
    rel = float((error / want.clamp(min=tiny)).max())
    held = str(got.dtype).split('.')[-1] + (
        f" (rounded to {str(coarse).split('.')[-1]})" if coarse is stored else "")
    return (f"largest relative deviation {rel:.1e}; {held} tables may deviate by {ulps} x "
            f"{eps:.1e} x (1 + slope x distance)")


_LAYOUT = {"query": "[H, L, 1]", "key": "[H, L, 1]", "diagonal": "[H, L, L]",
           "block": "[H, 1, 1]"}


def _decay_layout_problem(val: torch.Tensor | None, kind: str, heads: int, length: int,
                          shared: bool = False) -> str | None:
    """None when a decay table broadcasts against its operand as Lightning Attention's does:
    right-aligned with Q/K blocks [B, H, L, D], Q K^T [B, H, L, L] or the state [B, H, D, Dv]
    its shape, leading 1s aside, is [H, L, 1] (query, key), [H, L, L] (diagonal) or
    [H, 1, 1] (block). Values alone do not show it: a review's [H, 1, L, L] table (the
    heads on the batch axis, B = H) and [H, 1, L] query decay (L = D) held the right values
    in the wrong places and were rewritten (errors 16-60). ``shared``: one table for every
    head (a leading 1 where H goes) broadcasts correctly too (a loop without decay: every
    head's slope is 0)."""
    if val is None:
        return "its shape is unknown"
    shape = [hint(x) for x in val.shape]
    while len(shape) > 3 and shape[0] == 1:
        shape.pop(0)
    shape = [1] * (3 - len(shape)) + shape
    rows = {"query": (length, 1), "key": (length, 1), "diagonal": (length, length),
            "block": (1, 1)}[kind]
    if shape != [heads, *rows] and not (shared and shape == [1, *rows]):
        return (f"shape {list(val.shape)} does not broadcast as {_LAYOUT[kind]} (H = "
                f"{heads} heads, L = {length}) against its operand, so its values do not "
                "sit where Lightning Attention's decay does")
    return None


def table_rounding(got: torch.Tensor, slope: torch.Tensor, kind: str, length: int) -> float:
    """The largest relative deviation of a decay table ``got`` (one that
    :func:`decay_deviation` accepted) from exp(-slope d) computed in float64, over its
    entries above float32's smallest normal. 0 for a table computed in float64; ~1e-7 for
    transformers' MiniMax tables in a float64 model (built in float32, then ``.to``).

    Args:
        got: the table, any float dtype, ``numel`` of the [H, rows, cols] layout of
            ``kind`` (as :func:`decay_deviation` takes it).
        slope: [H] per-head slopes, any float dtype (used in float64).
        kind: "query", "key", "diagonal" or "block"; ``length``: the block length L.
    Returns:
        A unitless relative deviation (max over entries of |got - want| / want).
    Source: Lightning Attention's decay exp(-s d) (MiniMax-01, arXiv:2501.08313, eq. of the
    intra/inter-block decays); transformers' MiniMax ``decay_factors``.
    """
    dist, mask = _distances(kind, length)
    want = torch.exp(-slope.reshape(-1, 1, 1).double() * dist) * mask
    got = got.double().reshape(want.shape)
    usable = want > torch.finfo(torch.float32).smallest_normal
    if not bool(usable.any()):
        return 0.0
    return float(((got - want).abs() / want.clamp(min=1e-300))[usable].max())


def rounding_note(deviation: float, dtype: torch.dtype) -> str:
    """"" when a decay table's ``deviation`` (:func:`table_rounding`) is within ``dtype``'s
    rounding (64 units), else the report's note: the kernel computes the decays in
    ``dtype`` from the slope, so outputs differ from eager's by about the tables' rounding
    (a review: a float64 MiniMax was 3.5e-8 off eager with nothing said)."""
    if not dtype.is_floating_point or deviation <= 64 * torch.finfo(dtype).eps:
        return ""
    return (f"; NOTE: the model's decay tables deviate from exp(-slope*d) by up to "
            f"{deviation:.1e} relative (built in a coarser dtype than {dtype}, e.g. "
            f"transformers' float32 tables in a {dtype} model); the kernel computes the "
            "decays from the slope in the model's dtype, so outputs and gradients differ "
            "from eager's by about that much (closer to the exact decay)")


def check_loop_decays(loop: BlockLoop, env: dict[fx.Node, Any]) -> float:
    """Raise NoMatch unless every decay of ``loop``, evaluated, is Lightning Attention's
    (:func:`decay_deviation`); for a loop whose bounds follow the sequence length, at every
    length its graph can run at too (:func:`match_symbolic.check_every_length`). Returns
    the largest :func:`table_rounding` of its decays at the compile's length."""
    if loop.symbolic is None and any(follows_sizes(c[0]) for c in loop.checks):
        raise NoMatch("a decay follows a dynamic input size while the block bounds do not")
    if loop.slope is not None and follows_sizes(loop.slope):
        raise NoMatch("the slope follows a dynamic input size (it is checked at one length "
                      "only); the loop is not rewritten")
    env = hinted(env)  # symbolic sizes at the example inputs: every length is checked below
    slopes = [loop.slope] if loop.slope is not None else []
    for node in slopes + [c[0] for c in loop.checks]:
        for n in ancestors(node):
            if n.op == "placeholder" and not is_buffer(n, env) and \
                    not isinstance(sym_value(n), torch.SymInt):
                raise NoMatch(f"the slope or a decay depends on {n.name}, an input or a "
                              "trainable parameter: only decays computed from buffers and "
                              "constants are frozen into the kernel (the rewrite would "
                              "differentiate through every decay, the model through none)")
    q_val = tensor_meta(loop.q)
    heads = hint(q_val.shape[1]) if q_val is not None else None
    slope = evaluate(loop.slope, env) if loop.slope is not None else \
        torch.zeros(heads or 0, dtype=torch.float64)  # no decay
    if not isinstance(slope, torch.Tensor) or slope.numel() != heads:
        raise NoMatch(f"slope is not one value per query head ({heads} heads)")
    def per_head(got: torch.Tensor, length: int) -> torch.Tensor:
        if loop.slope is None and got.numel() == length * length:
            return got.reshape(1, length, length).expand(heads, length, length)  # shared
        return got

    def problem(got: Any, kind: str, length: int) -> str | None:
        """Why the evaluated table ``got`` of a ``length``-long block is not the loop's
        decay (or, without decay, its causal mask of ones); None when it is."""
        layout = _decay_layout_problem(got, kind, heads or 0, length,
                                       shared=loop.slope is None)
        if layout:
            return f"{kind} decay of a {length}-long block: {layout}"
        deviation = decay_deviation(per_head(got, length), slope, kind, length)
        if deviation is not None and loop.slope is None:  # (a review: decay jargon here)
            return (f"the intra-block mask of a {length}-long block is not a causal mask of "
                    f"ones (1 on and below the diagonal, 0 above; {deviation}): the loop "
                    "without decay is not causal linear attention")
        if deviation is not None:
            return (f"{kind} decay of a {length}-long block is not the exponential of "
                    f"-slope times the distance ({deviation}): the loop is not Lightning "
                    "Attention")
        return None

    rounding = 0.0
    for node, kind, _, length in loop.checks:
        layout = _decay_layout_problem(tensor_meta(node), kind, heads or 0, length,
                                       shared=loop.slope is None)
        if layout:
            raise NoMatch(f"{kind} decay of a {length}-long block: {layout}")
        got = evaluate(node, env)
        if not isinstance(got, torch.Tensor):
            raise NoMatch(f"{kind} decay of a {length}-long block is not a tensor")
        why = problem(got, kind, length)
        if why is not None:
            raise NoMatch(why)
        rounding = max(rounding, table_rounding(per_head(got, length), slope, kind, length))
    if loop.symbolic is not None:
        check_every_length(loop.blocks, loop.checks, loop.symbolic, slope, env,
                           decay_deviation, problem)
    return rounding


@dataclass
class DecayedParallelForm:
    """``((Q @ K^T) * decay) @ V``; ``decay`` not yet checked."""

    q: fx.Node
    k: fx.Node
    v: fx.Node
    decay: fx.Node


def match_decayed_parallel_form(node: fx.Node) -> DecayedParallelForm:
    """``matmul((matmul(Q, K^T)) * D, V)`` over [B, H, S, X] tensors, D a square mask."""
    weights, v = _split_product(node, aten.matmul.default)
    if not is_call(weights, aten.mul.Tensor):
        raise NoMatch("not a masked product")
    for qk, decay in ((arg(weights, 0), arg(weights, 1)), (arg(weights, 1), arg(weights, 0))):
        if not is_call(qk, aten.matmul.default):
            continue
        q, k_t = _split_product(qk, aten.matmul.default)
        if not is_call(k_t, aten.transpose.int) or sorted([arg(k_t, 1), arg(k_t, 2)]) != [-2, -1]:
            raise NoMatch("scores are not Q @ K^T over the last two dims")
        k = arg(k_t, 0)
        vals = [tensor_meta(x) for x in (q, k, v, decay)]
        if any(x is None for x in vals) or any(x.dim() != 4 for x in vals[:3]):  # type: ignore
            raise NoMatch("operands are not [B, H, S, D] tensors")
        qv, kv, vv = vals[:3]
        if not (qv.shape[0] == kv.shape[0] == vv.shape[0]):  # type: ignore[union-attr]
            raise NoMatch("q, k, v batch sizes differ (a broadcast batch is not rewritten)")
        operand_problem(q, k, v, node)
        seq_q, seq_k = vals[0].shape[2], vals[1].shape[2]  # type: ignore[union-attr]
        if seq_q != seq_k:
            raise NoMatch("query length differs from key length (decode); causal alignment "
                          "would be ambiguous")
        return DecayedParallelForm(q, k, v, decay)
    raise NoMatch("no Q @ K^T factor")


def parallel_form_slopes(decay: fx.Node, heads: int, env: dict[fx.Node, Any]
                         ) -> tuple[torch.Tensor, float]:
    """Slopes s_h [H] (float64) with D = exp(-s_h (i - j)) masked causal, and the matrix's
    :func:`table_rounding` against them (a float32 matrix in a float64 model: ~1e-7, for the
    report's :func:`rounding_note`); raise NoMatch for anything else."""
    for n in ancestors(decay):
        if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.SymInt):
            raise NoMatch("the decay matrix's size follows a dynamic input size (a "
                          "dynamic-shape compile slices it to a length that changes with the "
                          "sequence), so it is not frozen at compile time; compile with "
                          "dynamic=False to have it rewritten")
        if n.op == "placeholder" and not is_buffer(n, env):
            raise NoMatch("the decay matrix depends on an input or a trainable "
                          "parameter; only decays computed from buffers/constants are "
                          "frozen into the kernel")
    d = evaluate(decay, env)
    if not isinstance(d, torch.Tensor) or d.dim() < 2 or d.shape[-1] != d.shape[-2]:
        raise NoMatch("the mask is not a square [S, S] matrix")
    seq, dtype = d.shape[-1], d.dtype
    if d.dim() > 4:
        raise NoMatch("the decay matrix has more than 4 dims")
    # Aligned from the right against the [B, H, S, S] scores, as broadcasting does.
    d = d.double().reshape((1,) * (4 - d.dim()) + tuple(d.shape))
    if d.shape[1] not in (1, heads):
        raise NoMatch("the decay matrix does not have one [S, S] matrix per head")
    if d.shape[0] > 1 and not bool((d == d[:1]).all()):
        raise NoMatch("the decay matrix differs between batch elements (Lightning Attention "
                      "has one decay per head)")
    d = d[0].expand(heads, seq, seq)
    if seq > 1 and bool((d[:, 1, 0] <= 0).any()):
        raise NoMatch("the mask is not a positive decay below the diagonal")
    slopes = _fit_slopes(d[:, :, 0], _tolerance_dtype(dtype))
    deviation = decay_deviation(d.to(dtype), slopes, "diagonal", seq)
    if deviation is not None:
        raise NoMatch("the mask is not exp(-slope * (i - j)) below the diagonal and 0 above "
                      f"(non-causal or not a decay; {deviation})")
    return slopes, table_rounding(d, slopes, "diagonal", seq)


def _fit_slopes(column: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Slopes s_h [H] (float64) fitted to a decay matrix's first column
    ``column[h, i] ~ exp(-s_h i)`` by least squares in the log domain over its normal
    entries. One entry (``-log column[:, 1]``) is too coarse: a bf16 exp(-0.001) rounds to
    1, so that fit gives slope 0 and every longer distance misses."""
    heads, seq = column.shape
    tiny = torch.finfo(dtype).smallest_normal
    if seq < 2:
        return torch.zeros(heads, dtype=torch.float64)
    dist = torch.arange(seq, dtype=torch.float64).expand(heads, seq)
    usable = (column > tiny) & (dist > 0)
    logs = torch.where(usable, -torch.log(column.clamp(min=tiny)), 0.0)
    weight = torch.where(usable, dist, 0.0)
    denom = (weight * weight).sum(-1)
    # No usable entry: exp(-s) already underflows; any slope that underflows too fits.
    fallback = torch.full((heads,), -float(torch.log(torch.tensor(max(tiny, 1e-300),
                                                                   dtype=torch.float64))))
    return torch.where(denom > 0, (weight * logs).sum(-1) / denom.clamp(min=1.0), fallback)
