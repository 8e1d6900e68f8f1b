"""attention: one pass, four steps over attention sites (see each step's module for its own
contract and pseudo-code).

Modes (``options={"attention": ...}``): "keep" (default) only reports sites; "exact"
rewrites code that already computes Lightning Attention, and SDPA's constant causal mask, with
numerics unchanged; "lightning" (APPROXIMATE, opt-in) also converts causal softmax attention
to Lightning Attention (``options={"lightning": {...}}``).

Contract:
    accepts: a normalized pre-autograd ATen graph; static shapes for the loop rewrite.
    guarantees: modes "keep" and "exact": exact (the same function up to floating-point
        reassociation and the rounding of decay buffers); mode "lightning": approximate
        (``exact`` is False, so verify reports "approximate" instead of failing). Every
        softmax-attention site the matcher recognizes is recorded: kept, rewritten, or
        skipped with the reason. Autocast regions are left as written.
    reads meta: ``val``, ``grapharg``, ``nn_module_stack``, ``autocast``;
        ``ctx.extras["example_inputs"]`` (real values to evaluate decays, masks, scales).
    writes meta: new nodes get ``val``, ``nn_module_stack`` and ``graphopt_replaced``.
    records: see the steps; and a linear-attention layer (class ``*LightningAttention*`` /
        ``*LinearAttention*``) whose products this graph computes but in which no block
        loop was matched or refused and nothing rewritten: "skipped", saying so.

Pseudo-code (the order is today's; each step is one module):
    sites = softmax_attention_sites(graph)   # match_softmax; found before any rewrite
    if mode != "lightning": sdpa_causal_mask.report_or_make_causal(sites)   # keep | exact
    linear_to_lightning.rewrite_block_loops()     # exact: MiniMax loops -> lightning op
    dead-code elimination if anything changed     # so dead matmuls are not parallel forms
    linear_to_lightning.rewrite_parallel_forms()  # exact: ((Q K^T) * D) V -> lightning op
    if mode == "lightning": softmax_to_lightning.convert_sites(sites)       # APPROXIMATE
    dead-code elimination if anything changed
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from graphopt.passes import register_pass
from graphopt.passes.attention.linear_to_lightning import (
    rewrite_block_loops,
    rewrite_parallel_forms,
)
from graphopt.passes.attention.match_softmax import (
    attention_like_softmaxes,
    softmax_attention_sites,
)
from graphopt.passes.attention.options import LightningOptions
from graphopt.passes.attention.sdpa_causal_mask import report_or_make_causal
from graphopt.passes.attention.softmax_to_lightning import SoftmaxToLightning
from graphopt.passes.base import GraphPass, PassContext, PassResult
from graphopt.passes.fx_utils import eliminate_dead_code, site_name, tensor_meta

aten = torch.ops.aten


@register_pass
@dataclass(frozen=True)
class AttentionPass(GraphPass):
    """See the module docstring."""

    name = "attention"
    stage = "pre_autograd"
    options_key = "lightning"
    options_cls = LightningOptions
    marks_approximate_sites = True  # mode "lightning" converting nothing is exact
    mode: str = "keep"
    lightning: LightningOptions = field(default_factory=LightningOptions)

    @property
    def exact(self) -> bool:  # type: ignore[override]
        """Exact unless it converts softmax attention (mode "lightning")."""
        return self.mode != "lightning"

    @classmethod
    def from_config(cls, config: Any) -> AttentionPass:
        return cls(mode=config.attention, lightning=config.lightning)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        sites = softmax_attention_sites(gm.graph)
        linear = _linear_attention_modules(gm.graph)
        env = self._input_env(gm, ctx)
        modified = False
        if self.mode != "lightning":
            modified |= report_or_make_causal(sites, ctx, env, self.mode)
        found: set[str] = set()
        loops_modified, in_loops = rewrite_block_loops(gm, ctx, env, self.mode, found)
        modified |= loops_modified
        if modified:
            eliminate_dead_code(gm.graph)
        modified |= rewrite_parallel_forms(gm, ctx, env, self.mode, in_loops)
        if self.mode == "lightning":
            modified |= SoftmaxToLightning(self.lightning).convert_sites(gm, sites, ctx, env)
            for node in attention_like_softmaxes(gm.graph):
                shape = list(tensor_meta(node).shape)  # type: ignore[union-attr]
                ctx.record("kept", site_name(node), f"softmax over {shape} scores between "
                           "products, not a softmax-attention site graphopt converts: the "
                           "scores change shape between Q K^T and the product with V (e.g. "
                           "learned attention sinks concatenated to them, as GPT-OSS does); "
                           "softmax kept")
        if modified:
            eliminate_dead_code(gm.graph)
        _report_unmatched(linear, found, ctx)
        return PassResult(gm, modified)

    @staticmethod
    def _input_env(gm: fx.GraphModule, ctx: PassContext) -> dict[fx.Node, Any]:
        """Placeholder -> the compile's real example input (for evaluating constants); a
        checkpoint body's placeholder fed by a computed value has none (None)."""
        inputs = ctx.extras.get("example_inputs") or []
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        return {p: x for p, x in zip(placeholders, inputs) if x is not None}


_LINEAR_CLASS_PARTS = ("LightningAttention", "LinearAttention", "DeltaNet", "Retention")


def _linear_attention_modules(graph: fx.Graph) -> dict[str, str]:
    """Module path -> class name of the linear-attention layers whose products this graph
    computes (by class name: ``*LightningAttention*`` / ``*LinearAttention*``, e.g.
    MiniMax's, and the other linear-attention families' ``*DeltaNet*`` (Qwen3-Next's
    Gated DeltaNet, which a review saw neither rewritten nor mentioned), ``*Retention*``,
    RWKV's ``*SelfAttention``)."""
    found: dict[str, str] = {}
    products = (aten.matmul.default, aten.bmm.default, aten.mm.default)
    # RWKV's attention has only its projections (its recurrence is element-wise): its
    # linear ops count (it went unreported, a re-review); for the others a graph with only
    # the projections is not the layer's (its loop is in another graph)
    projections = (aten.linear.default, aten.addmm.default)
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in products + projections:
            continue  # the layer's products are here (not in a checkpoint body, say)
        for path, cls in (node.meta.get("nn_module_stack") or {}).values():
            name = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
            name = name.rsplit(".", 1)[-1].strip("'>")
            rwkv = name.startswith("Rwkv") and name.endswith("SelfAttention")
            if rwkv or (node.target in products and
                        any(k in name for k in _LINEAR_CLASS_PARTS)):
                found[str(path)] = name
    return found


def _report_unmatched(linear: dict[str, str], found: set[str], ctx: PassContext) -> None:
    """A linear-attention layer in which no block loop was found (matched or refused with a
    reason) and nothing was rewritten is reported: a review found a one-block MiniMax loop
    with a symbolic batch (dynamic=True) neither rewritten nor mentioned."""
    if ctx.record_ is None:
        return
    rewritten = {s.site.rsplit(":", 1)[0] if ":" in s.site else ""  # site_name: path:node
                 for s in ctx.record_.sites if s.action == "rewritten"}
    for path, name in sorted(linear.items()):
        if not any(p == path or p.startswith(path + ".") for p in found | rewritten):
            ctx.record("skipped", path or "(graph)", f"{name}: no block loop graphopt "
                       "rewrites was found in this layer's graph (graphopt's kernel computes "
                       "MiniMax's form: a fixed per-head decay, no delta rule or "
                       "data-dependent gate; other linear-attention math, a one-token "
                       "decode step on a cached state, or a loop form the matcher does not "
                       "recognize is not rewritten); the layer runs as written")
