"""attention pass, steps 2 and 3 (mode "exact"): rewrite code that already computes decayed
causal linear attention (Lightning Attention) in a slow form into one
``graphopt::lightning_attention_fwd`` call.

Matched (patterns in ``match_linear``): transformers' MiniMax ``MiniMaxLightningAttention``
block loop, which Dynamo unrolls into one chain per block, and the quadratic "parallel form"
``((Q K^T) * D) V`` (RetNet-style code) when the decay matrix D is computed from
buffers/constants only and equals exp(-slope_h * (i - j)) below the diagonal, 0 above.

Contract:
    accepts: the normalized pre-autograd ATen graph and the compile's real example inputs
        (``env``: placeholder -> value) to evaluate decays. Under dynamic shapes Dynamo
        unrolls the loop for a fixed number of blocks with bounds that follow S; such a
        loop is rewritten only once its decays are proved at every length its guards allow
        (``match_symbolic.check_every_length``), and the op then runs on the rows the
        blocks cover (their lengths summed: the cat's own length expression).
    guarantees: EXACT, i.e. the same function up to floating-point reassociation and the
        rounding of the decay buffers: a loop is rewritten only when its decay tensors,
        evaluated from the example inputs, equal exp(-slope * (i + 1)),
        exp(-slope * (L - 1 - j)), exp(-slope * (i - j)) (masked) and exp(-slope * L) for
        every block within the tables' own rounding (u eps of the coarser of their dtype
        and float32 per unit of 1 + slope * distance, u = 4 for float32 and 1 for
        bf16/fp16; ``match_linear.decay_deviation``), so bf16/fp16 models are rewritten and
        a float32 table 8e-6 off or a bf16 table 2% off is not. A value written in place in
        the graph (directly or through a view) is never evaluated (``evaluate`` refuses).
        MiniMax builds them from ``slope_rate`` in ``__init__``. A parallel form's slopes
        are fitted by least squares in the log domain and frozen as a buffer of the graph
        module (float64 for a float64 model, else float32). Chains inside an autocast
        region are left as written.
    reads meta: ``val`` (shapes/dtypes), ``grapharg`` (buffers), ``autocast``.
    writes meta: new nodes get ``val``, ``graphopt_replaced`` (the replaced output node's
        name) and that node's ``nn_module_stack``.
    records: "rewritten" per loop (blocks, block size, S at the example inputs and, for
        bounds that follow S, how many lengths were checked and their range) or parallel
        form (S); "skipped" with the reason for a loop or parallel form that fails a check
        (at a dynamic loop: the sequence length where it fails), or is in an autocast
        region; "kept" for each in mode "keep".

Pseudo-code:
    for cat in graph where cat(dim=-2) of per-block outputs:
        loop = match_minimax_block_loop(cat)                     # slices of one Q, K, V
        check_loop_decays(loop, env)                             # numerically, vs slope
        o, state = lightning_attention_fwd(Q, K, V, slope.view(H), 1.0)
        replace cat by o and the loop's last state by state
    (the pass removes dead code here)
    for matmul not inside a loop: form = match_decayed_parallel_form(matmul)
        slopes, rounding = parallel_form_slopes(form.decay, H, env)
        replace matmul by lightning_attention_fwd(Q, K, V, buffer(slopes), 1.0)[0]
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from graphopt.passes.attention.lightning_call import (
    frozen_slopes,
    insert_lightning_fwd,
    insert_with_frozen_slopes,
    saved_bytes_note,
)
from graphopt.passes.attention.match_common import NoMatch, WritesBetween, aten, is_call
from graphopt.passes.attention.match_linear import (
    BlockLoop,
    LoopRefused,
    check_loop_decays,
    match_decayed_parallel_form,
    match_minimax_block_loop,
    parallel_form_slopes,
    rounding_note,
)
from graphopt.passes.attention.match_symbolic import hint, sym_expr
from graphopt.passes.base import PassContext
from graphopt.passes.fx_utils import (
    autocast_reason,
    between,
    fake_call,
    grad_mode_reason,
    module_path,
    site_name,
    tensor_meta,
)


def rewrite_block_loops(gm: fx.GraphModule, ctx: PassContext, env: dict[fx.Node, Any],
                        mode: str, found: set[str] | None = None) -> tuple[bool, set[fx.Node]]:
    """Rewrite every MiniMax block loop (mode "exact"; report them otherwise). Returns
    (graph changed, the loops' per-block intra products: not parallel forms); adds the
    module path of every loop it matched or refused to ``found``."""
    modified = False
    in_loops: set[fx.Node] = set()
    writes = WritesBetween(gm.graph)
    for cat in [n for n in gm.graph.nodes if is_call(n, aten.cat.default)]:
        site = site_name(cat)
        try:
            loop = match_minimax_block_loop(cat)
        except LoopRefused as exc:  # loop-shaped: say why (its blocks' products may still
            # be rewritten as parallel forms below: they are not added to in_loops)
            ctx.record("skipped", site, f"linear-attention block loop: {exc}")
            if found is not None:
                found.add(module_path(cat))
            continue
        except NoMatch:
            continue  # not loop-shaped at all: nothing to report
        if found is not None:
            found.add(module_path(cat))
        in_loops.update(b.intra for b in loop.blocks)
        if autocast_reason(cat):
            ctx.record("skipped", site, autocast_reason(cat))
            continue
        if mode == "keep":
            ctx.record("kept", site, "linear-attention block loop (attention='keep')")
            continue
        try:
            rounding = check_loop_decays(loop, env)
        except NoMatch as exc:
            ctx.record("skipped", site, f"linear-attention block loop: {exc}")
            continue
        at = _insertion_point(gm, cat, loop)
        # the loop's values (its zero initial state too) up to the cat: a write after the
        # op but before the cat (a block output halved there, a review: 0.95 off) changes
        # what the cat reads and not what the op computed
        moved = writes.reason((loop.q, loop.k, loop.v), at) or \
            writes.reason(_loop_values(loop, cat), cat, what="the loop's values")
        moved = moved or grad_mode_reason(_loop_values(loop, cat) + (cat,), at)
        if moved:
            ctx.record("skipped", site, f"linear-attention block loop: {moved}")
            continue
        _replace_loop(gm, cat, loop, at)
        val = tensor_meta(loop.q)
        assert val is not None
        checked = loop.symbolic.checked if loop.symbolic is not None else None
        lengths = "" if not checked else (
            f"; bounds follow the sequence length: checked at all {len(checked)} lengths its "
            f"guards allow, {checked[0]}..{checked[-1]}")
        ctx.record("rewritten", site, f"block loop of {len(loop.blocks)} blocks "
                   + ("without decay (slope 0) " if loop.slope is None else "")
                   + f"(block {loop.block_size}, S {hint(val.shape[2])}{lengths}) -> "
                   "graphopt::lightning_attention"
                   + saved_bytes_note(loop.q, loop.k, loop.v)
                   + rounding_note(rounding, val.dtype))
        modified = True
    return modified, in_loops


def rewrite_parallel_forms(gm: fx.GraphModule, ctx: PassContext, env: dict[fx.Node, Any],
                           mode: str, in_loops: set[fx.Node]) -> bool:
    """Rewrite every decayed parallel form outside ``in_loops`` (mode "exact"; report them in
    mode "keep"). Returns whether the graph changed."""
    graph = gm.graph
    modified = False
    writes = WritesBetween(graph)
    for node in [n for n in graph.nodes if is_call(n, aten.matmul.default)]:
        if node in in_loops or node.graph is not graph or not node.users or \
                autocast_reason(node):
            continue
        try:
            form = match_decayed_parallel_form(node)
        except NoMatch:
            continue
        site = site_name(node)
        if mode == "keep":
            ctx.record("kept", site, "decayed linear attention, parallel form "
                       "(attention='keep')")
            continue
        q_val = tensor_meta(form.q)
        assert q_val is not None
        try:
            slopes, rounding = parallel_form_slopes(form.decay, int(q_val.shape[1]), env)
        except NoMatch as exc:
            ctx.record("skipped", site, str(exc))
            continue
        moved = writes.reason((form.q, form.k, form.v), node) or \
            grad_mode_reason(between((form.q, form.k, form.v), (node,)), node)
        if moved:
            ctx.record("skipped", site, f"decayed linear attention, parallel form: {moved}")
            continue
        node.replace_all_uses_with(
            insert_with_frozen_slopes(gm, node, form.q, form.k, form.v, slopes, 1.0))
        ctx.record("rewritten", site, f"parallel form (S {int(q_val.shape[2])}) -> "
                   "graphopt::lightning_attention" + saved_bytes_note(form.q, form.k, form.v)
                   + rounding_note(rounding, q_val.dtype))
        modified = True
    return modified


def _insertion_point(gm: fx.GraphModule, cat: fx.Node, loop: BlockLoop) -> fx.Node:
    """Where the op goes: before the loop's ``cat`` or before the first user of its final
    state, whichever comes first (a state read before the ``cat``, ``state.abs().amax()``
    in a review, otherwise read the op's state before the op)."""
    users = list(loop.final_state.users) if loop.final_state is not None else []
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return min([cat, *users], key=order.__getitem__)


def _loop_values(loop: BlockLoop, cat: fx.Node) -> tuple[fx.Node, ...]:
    """Every value the loop computes from Q, K, V (its blocks' slices, products, states and
    outputs: the nodes both downstream of Q, K or V and upstream of the ``cat`` or the
    final state) and its initial zero state."""
    ends = [cat] + ([loop.final_state] if loop.final_state is not None else [])
    found = between((loop.q, loop.k, loop.v), ends)
    # the first block's zero state: written through a view made before the loop
    # (``state[:, :, 0].copy_(init)``, a review: 5.1 off), the loop did not start at zero
    return tuple(found - {cat}) + (loop.blocks[0].state_in,)


def _replace_loop(gm: fx.GraphModule, cat: fx.Node, loop: BlockLoop, at: fx.Node) -> None:
    """Replace the loop's concatenated output by one Lightning call inserted before ``at``
    (:func:`_insertion_point`), and its last state (when used) by the call's final state,
    cast back to the loop's state dtype."""
    graph = gm.graph
    q_val = tensor_meta(loop.q)
    assert q_val is not None
    heads = int(q_val.shape[1])
    if loop.slope is None:  # a loop without decay: slope 0
        slope = frozen_slopes(gm, at, loop.q, torch.zeros(heads))
    else:
        with graph.inserting_before(at):
            slope = graph.call_function(aten.view.default, (loop.slope, [heads]))
        slope.meta["val"] = fake_call(aten.view.default, loop.slope, [heads])
    q, k, v = loop.q, loop.k, loop.v
    cat_val = tensor_meta(cat)
    assert cat_val is not None
    if loop.symbolic is not None and sym_expr(cat_val.shape[2]) != sym_expr(q_val.shape[2]):
        # the blocks cover rows [0, sum of their lengths) (= S where the guards hold, but
        # not provably): the op runs on exactly those rows, counted as the cat counts them,
        # so its output has the loop's shape expression (the capture guard compares them)
        total = _covered_rows(gm, at, loop)
        q, k, v = (_rows_before(gm, at, x, total) for x in (q, k, v))
    out, final = insert_lightning_fwd(gm, at, q, k, v, slope, 1.0, outputs=2)
    cat.replace_all_uses_with(out)
    state = loop.final_state
    if state is not None and state.users:
        want = tensor_meta(state)
        new_state = final
        if want is not None and want.dtype != final.meta["val"].dtype:
            with graph.inserting_after(final):
                new_state = graph.call_function(
                    aten._to_copy.default, (final,), {"dtype": want.dtype})
                new_state.meta["val"] = fake_call(aten._to_copy.default, final,
                                                  dtype=want.dtype)
        state.replace_all_uses_with(new_state)


def _covered_rows(gm: fx.GraphModule, before: fx.Node, loop: BlockLoop) -> fx.Node:
    """sym_size(Q rows of block 0, 2) + ... + sym_size(Q rows of block n-1, 2), inserted
    before ``before``: the loop's row count in the expression its ``cat`` has."""
    graph = gm.graph
    total: fx.Node | None = None
    with graph.inserting_before(before):
        for block in loop.blocks:
            size = graph.call_function(aten.sym_size.int, (block.rows, 2))
            size.meta["val"] = tensor_meta(block.rows).shape[2]  # type: ignore[union-attr]
            if total is None:
                total = size
                continue
            added = graph.call_function(operator.add, (total, size))
            added.meta["val"] = total.meta["val"] + size.meta["val"]
            total = added
    assert total is not None
    return total


def _rows_before(gm: fx.GraphModule, before: fx.Node, x: fx.Node, end: fx.Node) -> fx.Node:
    """``x[:, :, :end]`` inserted before ``before`` (end: the rows the loop covers)."""
    with gm.graph.inserting_before(before):
        node = gm.graph.call_function(aten.slice.Tensor, (x, 2, 0, end))
    node.meta["val"] = fake_call(aten.slice.Tensor, x, 2, 0, end)
    return node
