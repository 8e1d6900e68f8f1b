"""attention pass, step 1 (modes "keep" and "exact"): report softmax-attention sites, and in
mode "exact" drop a constant causal mask from SDPA in favour of ``is_causal=True``.

Contract:
    accepts: the normalized pre-autograd ATen graph the attention pass runs on, and its
        softmax-attention sites (``match_softmax.softmax_attention_sites``).
    guarantees: EXACT. An SDPA call is changed only when its ``attn_mask`` is built from
        constants/buffers, evaluates to the lower-triangular causal mask, and query length
        equals key length: then ``attn_mask=None, is_causal=True`` gives every query the same
        keys 0..i. Nothing else in the graph changes (the mask's construction becomes dead
        code, removed by the pass). Sites inside an autocast region are left as written.
    reads meta: ``val`` (shapes), ``grapharg`` (is a placeholder a module buffer),
        ``autocast`` (through ``autocast_reason``); the example inputs (``env``) to evaluate
        the mask.
    writes meta: none (the SDPA node keeps its meta; only its arguments change).
    records: per site "rewritten" (mask -> is_causal) or "kept" (softmax attention stays).

Pseudo-code:
    for site in softmax-attention sites:
        if mode == "exact" and site is the composite SDPA with a mask proven causal and
                q length == k length and not in an autocast region:
            site.attn_mask, site.is_causal = None, True;  record rewritten
        else: record kept
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from graphopt.passes.attention.match_common import aten
from graphopt.passes.attention.match_softmax import Outer, built_where, not_constant_causal
from graphopt.passes.base import PassContext
from graphopt.passes.fx_utils import autocast_reason, site_name, tensor_meta


def mask_to_is_causal(node: fx.Node, env: dict[fx.Node, Any], outer: Outer | None = None
                      ) -> str | None:
    """SDPA with a mask proven causal (and q length = k length) -> ``is_causal=True``,
    mask dropped. Returns None when ``node`` was changed, else why not. Exact: both give
    every query its keys 0..i. Under torch.compile transformers materializes the causal
    mask that eager code skips (S x S). ``outer``: a
    checkpoint body's placeholder -> (the parent's node that feeds it, the parent's values):
    a mask built outside the region is proven there."""
    if node.target is not aten.scaled_dot_product_attention.default:
        return "not an SDPA call (only SDPA's mask becomes is_causal)"
    names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal"]
    args: dict[str, Any] = dict(zip(names, node.args)) | dict(node.kwargs)
    mask = args.get("attn_mask")
    q_val, k_val = tensor_meta(args["query"]), tensor_meta(args["key"])
    if mask is None:  # a review: OPT's site was "kept" with no reason
        return "no mask to drop: already is_causal=True" if args.get("is_causal") else \
            "no mask: every query sees every key"
    if q_val is None or k_val is None or q_val.dim() != 4:
        return "query/key shapes unknown or not [B, H, S, D]"
    if q_val.shape[2] != k_val.shape[2]:
        return "query length != key length"
    problem = not_constant_causal(*built_where(mask, env, outer), outer=outer)
    if problem:
        return problem
    args.update(attn_mask=None, is_causal=True)
    node.args = (args.pop("query"), args.pop("key"), args.pop("value"))
    node.kwargs = args
    return None


def report_or_make_causal(sites: list[fx.Node], ctx: PassContext, env: dict[fx.Node, Any],
                          mode: str) -> bool:
    """Record every site as kept (with why its mask stays, in mode "exact"), or (mode
    "exact") rewritten to ``is_causal``; True when the graph changed. Inside a checkpoint
    region, ``ctx.extras["outer"]`` maps the body's inputs to where the parent builds them
    (graphopt/passes/regions.py)."""
    modified = False
    outer = ctx.extras.get("outer")
    for node in sites:
        why = "" if mode != "exact" else autocast_reason(node) or \
            mask_to_is_causal(node, env, outer)
        if why is None:
            ctx.record("rewritten", site_name(node), "softmax attention kept; its causal mask "
                       "(built from constants, input sizes and module buffers, whose values "
                       "at compile time are guarded) -> is_causal=True (exact; the S x S mask "
                       "is no longer built)")
            modified = True
        else:
            ctx.record("kept", site_name(node), f"softmax attention (attention='{mode}')"
                       + (f"; {why}" if why.startswith(("no mask", "not an SDPA")) else
                          f"; its mask stays: {why}" if why else ""))
    return modified
