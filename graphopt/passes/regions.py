"""Model passes inside activation-checkpoint regions.

Dynamo captures ``torch.utils.checkpoint.checkpoint(fn, *args)`` (what transformers'
``gradient_checkpointing_enable()`` wraps each decoder layer in) as one call
``tag_activation_checkpoint(body, *operands)`` whose ``body`` is a GraphModule of the same
pre-autograd ATen IR; normalize keeps it so (tests/test_capture.py). A pass that only walks
``gm.graph`` sees the call, not the layer: with checkpointing on, the attention and MoE
passes found nothing and said nothing. :func:`run_with_regions` runs a pre-autograd pass on
the top graph and then on every checkpoint body (recursively), in place.

Why rewriting inside the body is faithful: the region stays a region. AOTAutograd traces
the body under checkpoint's selective-checkpoint context (every op in it, graphopt's custom
ops included, tagged "prefer recompute"), so the partitioner still recomputes it in the
backward; a pass's rewrite is as exact there as at top level, and the checkpoint's memory
behaviour is the user's choice as before. Torchtitan and Megatron likewise apply their
kernels inside checkpointed blocks.

What a body's pass sees:
    ``ctx.extras["example_inputs"]``: the real value of each body placeholder whose operand
        is a top-level graph input (parameters and buffers are: Dynamo lifts them and
        passes them into the body), None where the operand is computed in the parent graph
        (a pass that needs its value refuses with the reason, as for any computed value).
    placeholder meta ``grapharg`` copied from the operand (buffers stay recognizable).
    ``ctx.extras["outer"]``: body placeholder -> (the parent's operand node, the parent's
        placeholder values), so a check may be made where a value is built (the attention
        pass proves a causal mask built outside the region there).
    ``ctx.extras["root"]``: the top graph (e.g. to count the model's decoder layers).
    report sites prefixed ``checkpoint <body>: ``.
After a body changed, placeholders it no longer reads are removed with their operands, and
the parent's dead code with them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

if TYPE_CHECKING:
    from graphopt.passes.base import GraphPass, PassContext, PassResult

CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint


def checkpoint_bodies(gm: fx.GraphModule) -> Iterator[tuple[fx.Node, str, fx.GraphModule]]:
    """(call node, body attribute name, body) for each ``tag_activation_checkpoint`` call of
    ``gm``'s graph whose body is a GraphModule held by ``gm``."""
    for call in gm.graph.find_nodes(op="call_function", target=CHECKPOINT):
        body_node = call.args[0] if call.args else None
        if not isinstance(body_node, fx.Node) or body_node.op != "get_attr":
            continue
        body = getattr(gm, str(body_node.target), None)
        if isinstance(body, fx.GraphModule):
            yield call, str(body_node.target), body


def body_inputs(call: fx.Node, body: fx.GraphModule, values: dict[fx.Node, Any]) -> list[Any]:
    """Real values of ``body``'s placeholders from ``values`` (parent node -> value; None
    where unknown) and ``grapharg`` meta copied from the operands."""
    operands = list(call.args[1:])
    placeholders = list(body.graph.find_nodes(op="placeholder"))
    out: list[Any] = []
    for i, ph in enumerate(placeholders):
        operand = operands[i] if i < len(operands) else None
        if isinstance(operand, fx.Node):
            if "grapharg" in operand.meta and "grapharg" not in ph.meta:
                ph.meta["grapharg"] = operand.meta["grapharg"]
            out.append(values.get(operand))
        else:
            out.append(operand)
    return out


def all_graph_modules(gm: fx.GraphModule) -> Iterator[fx.GraphModule]:
    """``gm`` and its checkpoint bodies, recursively."""
    yield gm
    for _, _, body in checkpoint_bodies(gm):
        yield from all_graph_modules(body)


def run_with_regions(graph_pass: GraphPass, gm: fx.GraphModule, ctx: PassContext
                     ) -> PassResult:
    """``graph_pass.run(gm, ctx)``, then (pre-autograd passes) the same pass on every
    checkpoint body, recursively; bodies are edited in place, linted and recompiled.

    Returns:
        The top graph's result, ``modified`` if any graph changed.
    """
    from graphopt.passes.base import PassResult

    result = graph_pass.run(gm, ctx)
    if graph_pass.stage != "pre_autograd":
        return result
    gm, modified = result.gm, result.modified
    inputs = ctx.extras.get("example_inputs") or []
    values = dict(zip(gm.graph.find_nodes(op="placeholder"), inputs))
    known = {node: value for node, value in values.items() if value is not None}
    parent_outer = ctx.extras.get("outer") or {}
    pruned = False
    for call, name, body in list(checkpoint_bodies(gm)):
        operands = dict(zip(body.graph.find_nodes(op="placeholder"), call.args[1:]))
        sub_ctx = dataclasses.replace(ctx, extras={
            **ctx.extras, "example_inputs": body_inputs(call, body, values),
            "root": ctx.extras.get("root", gm),
            # A body input fed by the parent's own input resolves further out (nesting).
            "outer": {ph: parent_outer.get(op, (op, known)) for ph, op in operands.items()
                      if isinstance(op, fx.Node)}})
        first = len(ctx.record_.sites) if ctx.record_ is not None else 0
        sub = run_with_regions(graph_pass, body, sub_ctx)
        if sub.gm is not body:
            setattr(gm, name, sub.gm)
        sub.gm.graph.lint()
        sub.gm.recompile()
        if ctx.record_ is not None:
            for site in ctx.record_.sites[first:]:
                site.site = f"checkpoint {name}: {site.site}"
        modified |= sub.modified
        pruned |= sub.modified and _drop_unused_inputs(call, sub.gm)
    if pruned:
        from graphopt.passes.fx_utils import eliminate_dead_code

        eliminate_dead_code(gm.graph)
    return PassResult(gm, modified)


def _drop_unused_inputs(call: fx.Node, body: fx.GraphModule) -> bool:
    """Remove the body's placeholders a rewrite left unused, and their operands of ``call``
    (so e.g. a causal mask built outside the region for a now ``is_causal`` SDPA becomes dead
    code in the parent). Only for a body no other call shares. True when any was removed."""
    body_node = call.args[0]
    if not isinstance(body_node, fx.Node) or len(body_node.users) != 1:
        return False
    placeholders = list(body.graph.find_nodes(op="placeholder"))
    operands = list(call.args[1:])
    if len(placeholders) != len(operands):
        return False
    unused = {i for i, ph in enumerate(placeholders) if not ph.users}
    for i in sorted(unused, reverse=True):
        body.graph.erase_node(placeholders[i])
    if unused:
        call.args = (body_node, *(op for i, op in enumerate(operands) if i not in unused))
        body.graph.lint()
        body.recompile()
    return bool(unused)
