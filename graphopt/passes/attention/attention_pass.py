"""attention: rewrite decayed causal linear attention into ``graphopt::lightning_attention``.

Mode "exact" (``options={"attention": "exact"}``) finds code that already computes Lightning
Attention in a slow form and replaces it with the chunked/Triton kernel. Matched today:
transformers' MiniMax ``MiniMaxLightningAttention`` block loop, which Dynamo unrolls into one
chain per block. Softmax attention is reported and kept (its conversion to Lightning
Attention is mode "lightning", below). Also matched: the quadratic
"parallel form" ``((Q K^T) * D) V`` (RetNet-style code) when the decay matrix D is computed
from buffers/constants only and equals exp(-slope_h * (i - j)) below the diagonal, 0 above.

Mode "lightning" (APPROXIMATE, opt-in) additionally replaces causal softmax attention by
Lightning Attention with per-head slopes (MiniMax-01's or ALiBi's), an optional q/k feature
map and an RMS output normalization, for linearizing a pretrained model before fine-tuning
(MiniMax-01's hybrid keeps every n-th layer softmax: ``lightning.every``; ``lightning.layers``
selects sites by module path). Spellings matched: ``scaled_dot_product_attention`` (is_causal,
or a mask proven causal) and hand-written ``softmax(Q K^T * scale [+ mask]) [dropout 0] @ V``
(GPT-2's and Llama's "eager" attention: scale as a multiply, a divide or a constant one-element
tensor; the mask added, ``masked_fill``-ed or ``where``-selected; K^T as ``transpose(-2, -1)``
or ``permute(0, 1, 3, 2)``; GQA through ``repeat_kv``, bound before the repeat). A mask must
be computed from constants/buffers and evaluate to the causal mask. Refused with the reason:
a mask from a graph input (padding, or a mask passed across a graph break), non-causal or
sliding-window masks, dropout > 0, query length != key length (KV cache), a K permuted other
than over its last two dims (a product that is not Q K^T), a trainable or input-dependent
scale, an unknown layer index with per-layer slopes. The pass then reports itself inexact.

Contract:
    accepts: a normalized pre-autograd ATen graph; static shapes (a loop over a symbolic
        number of blocks cannot be unrolled by Dynamo anyway).
    guarantees: exact, i.e. the same function up to floating-point reassociation and the
        rounding of the decay buffers: a loop is rewritten only when its decay tensors,
        evaluated from the compile's real example inputs, equal exp(-slope * (i + 1)),
        exp(-slope * (L - 1 - j)), exp(-slope * (i - j)) (masked) and exp(-slope * L) for
        every block (rtol 1e-5); MiniMax builds them from ``slope_rate`` in ``__init__``.
    reads meta: ``val`` (shapes/dtypes), ``ctx.extras["example_inputs"]``.
    writes meta: new nodes get ``val`` and ``graphopt_replaced`` (names of the loop's output
        nodes), ``nn_module_stack`` of the replaced output.
    records: "rewritten" per loop (blocks, block size, S), "skipped" with the reason for a
        loop-like chain that fails a check; per softmax-attention site "kept" (modes keep,
        exact) or "rewritten" (APPROXIMATE, with slopes/feature map/norm/layer) / "skipped"
        with the reason (mode lightning).

Pseudo-code:
    for cat in graph where cat(dim=-2) of per-block outputs:
        blocks = [match_block(o) for o in cat.inputs]          # slices of one Q, K, V
        check slices tile [0, S); the state chain starts at zeros and links block i to i+1
        check decays numerically against slope
        o, state, _ = lightning_attention_fwd(Q, K, V, slope.view(H), 1.0, None, 64, 8, impl)
        replace cat by o and the last state by state; dead loop nodes are removed
"""

from __future__ import annotations

import fnmatch
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from graphopt.kernels.lightning.chunked import DEFAULT_BLOCK_SIZE, DEFAULT_CHECKPOINT_EVERY
from graphopt.passes import register_pass
from graphopt.passes.attention.match_common import (
    NoMatch,
    aten,
    is_call,
    layer_index,
    module_path,
)
from graphopt.passes.attention.match_linear import (
    BlockLoop,
    DecayedParallelForm,
    check_loop_decays,
    match_decayed_parallel_form,
    match_minimax_block_loop,
    parallel_form_slopes,
)
from graphopt.passes.attention.match_softmax import (
    SDPA_OPS,
    is_handwritten_softmax_attention,
    match_handwritten_softmax_attention,
    match_sdpa_causal,
    not_constant_causal,
    num_decoder_layers,
)
from graphopt.passes.base import GraphPass, PassContext, PassResult
from graphopt.passes.fx_utils import (
    autocast_reason,
    eliminate_dead_code,
    fake_call,
    site_name,
    tensor_meta,
)


def _insert_with_frozen_slopes(gm: fx.GraphModule, node: fx.Node, q: fx.Node, k: fx.Node,
                               v: fx.Node, slopes: torch.Tensor, scale: float) -> fx.Node:
    """Insert ``lightning_attention_fwd(q, k, v, slopes)[0]`` before ``node``, the slopes
    frozen as a float32 buffer of ``gm``; returns the output node (not yet wired in)."""
    from graphopt.kernels.lightning.op import resolve_impl

    graph = gm.graph
    q_val = tensor_meta(q)
    mode = detect_fake_mode([q_val])
    assert q_val is not None and mode is not None
    name = f"_graphopt_slope_{node.name}"
    gm.register_buffer(name, slopes.to(torch.float32, copy=True).to(q_val.device))
    op = torch.ops.graphopt.lightning_attention_fwd.default
    with graph.inserting_before(node):
        slope = graph.get_attr(name)
        slope.meta["val"] = mode.from_tensor(getattr(gm, name))
        v_val = tensor_meta(v)
        dims = max(int(q_val.shape[-1]), int(v_val.shape[-1]) if v_val is not None else 0)
        args = (q, k, v, slope, scale, None, DEFAULT_BLOCK_SIZE, DEFAULT_CHECKPOINT_EVERY,
                resolve_impl("auto", q_val.device, dims))
        call = graph.call_function(op, args)
        call.meta["val"] = fake_call(op, *args)
        out = graph.call_function(operator.getitem, (call, 0))
        out.meta["val"] = call.meta["val"][0]
    for new in (slope, call, out):
        new.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
        new.meta["graphopt_replaced"] = [node.name]
    return out


def minimax_slopes(heads: int, layer: int, num_layers: int, kind: str = "minimax"
                   ) -> torch.Tensor:
    """Per-head decay rates [heads] (float32) as MiniMax-01 assigns them: ALiBi's geometric
    slopes 2^(-8 (h + 1) / H) (Press et al. 2022), scaled by the layer's depth factor
    1 - layer / (num_layers - 1) (+1e-5 so the last layer keeps a small decay).
    ``kind="alibi"``: the geometric slopes alone (no depth factor)."""
    base = 2.0 ** (-8.0 / heads)
    factor = 1.0 if kind == "alibi" else 1.0 - layer / (num_layers - 1 + 1e-5) + 1e-5
    return torch.tensor([base ** (h + 1) * factor for h in range(heads)], dtype=torch.float32)


@register_pass
@dataclass(frozen=True)
class AttentionPass(GraphPass):
    """See the module docstring."""

    name = "attention"
    stage = "pre_autograd"
    mode: str = "keep"
    every: int = 1
    norm: str = "rms"
    layers: tuple[str, ...] = ()
    slopes: str = "minimax"
    num_layers: int | None = None
    feature_map: str = "identity"

    @property
    def exact(self) -> bool:  # type: ignore[override]
        """Exact unless it converts softmax attention (mode "lightning")."""
        return self.mode != "lightning"

    @classmethod
    def from_config(cls, config: Any) -> AttentionPass:
        opts = config.lightning
        return cls(mode=config.attention, every=opts.every, norm=opts.norm, layers=opts.layers,
                   slopes=opts.slopes, num_layers=opts.num_layers, feature_map=opts.feature_map)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        softmax_sites = [n for n in graph.nodes
                         if is_call(n, *SDPA_OPS) or is_handwritten_softmax_attention(n)]
        env = self._input_env(gm, ctx)
        self._env.clear()
        self._env.update(env)
        modified = False
        if self.mode != "lightning":
            for node in softmax_sites:
                if self.mode == "exact" and not autocast_reason(node) and \
                        self._mask_to_is_causal(node):
                    ctx.record("rewritten", site_name(node), "softmax attention kept; its "
                               "causal mask (built from constants) -> is_causal=True (exact; "
                               "the S x S mask is no longer built)")
                    modified = True
                else:
                    ctx.record("kept", site_name(node),
                               f"softmax attention (attention='{self.mode}')")
        in_loops: set[fx.Node] = set()  # per-block pieces of loops: not parallel forms
        for cat in [n for n in graph.nodes if is_call(n, aten.cat.default)]:
            try:
                loop = match_minimax_block_loop(cat)
            except NoMatch:
                continue  # not loop-shaped at all: nothing to report
            in_loops.update(b.intra for b in loop.blocks)
            site = site_name(cat)
            if autocast_reason(cat):
                ctx.record("skipped", site, autocast_reason(cat))
                continue
            if self.mode == "keep":
                ctx.record("kept", site, "linear-attention block loop (attention='keep')")
                continue
            try:
                check_loop_decays(loop, env)
            except NoMatch as exc:
                ctx.record("skipped", site, str(exc))
                continue
            self._rewrite(gm, cat, loop)
            val = tensor_meta(loop.q)
            assert val is not None
            ctx.record("rewritten", site, f"block loop of {len(loop.blocks)} blocks "
                       f"(block {loop.blocks[0].end}, S {int(val.shape[2])}) -> "
                       "graphopt::lightning_attention")
            modified = True
        if modified:
            eliminate_dead_code(graph)
        for node in [n for n in graph.nodes if is_call(n, aten.matmul.default)]:
            if node in in_loops or node.graph is not graph or not node.users or \
                    autocast_reason(node):
                continue
            try:
                form = match_decayed_parallel_form(node)
            except NoMatch:
                continue
            site = site_name(node)
            if self.mode == "keep":
                ctx.record("kept", site, "decayed linear attention, parallel form "
                           "(attention='keep')")
                continue
            q_val = tensor_meta(form.q)
            assert q_val is not None
            try:
                slopes = parallel_form_slopes(form.decay, int(q_val.shape[1]), env)
            except NoMatch as exc:
                ctx.record("skipped", site, str(exc))
                continue
            self._rewrite_parallel(gm, node, form, slopes)
            ctx.record("rewritten", site, f"parallel form (S {int(q_val.shape[2])}) -> "
                       "graphopt::lightning_attention")
            modified = True
        if self.mode == "lightning":
            for node in softmax_sites:
                reason = autocast_reason(node) or self._convert_softmax(gm, node)
                done = reason.startswith("APPROXIMATE")
                ctx.record("rewritten" if done else "skipped", site_name(node), reason)
                modified = modified or done
        if modified:
            eliminate_dead_code(graph)
        return PassResult(gm, modified)

    _env: dict[fx.Node, Any] = field(default_factory=dict, compare=False, repr=False)

    def _convert_softmax(self, gm: fx.GraphModule, node: fx.Node) -> str:
        """Replace one softmax-attention site (SDPA node or hand-written softmax); returns the
        report reason ("APPROXIMATE..." when done, "kept: ..." with the reason otherwise)."""
        try:
            if is_call(node, *SDPA_OPS):
                found = match_sdpa_causal(node, self._env)
            else:
                found = match_handwritten_softmax_attention(node, self._env)
            q, k, v, scale, output = found.q, found.k, found.v, found.scale, found.output
        except NoMatch as exc:
            return f"kept: {exc}"
        q_val, k_val = tensor_meta(q), tensor_meta(k)
        assert q_val is not None and k_val is not None
        if q_val.shape[1] % k_val.shape[1]:
            return "kept: query heads are not a multiple of key heads"
        layer = layer_index(node)
        if self.every > 1 and layer is not None and (layer + 1) % self.every == 0:
            return f"kept: layer {layer} keeps softmax attention (lightning.every={self.every})"
        path = module_path(node)
        if self.layers and not any(fnmatch.fnmatchcase(path, p) for p in self.layers):
            return f"kept: {path or 'this site'} is not selected by lightning.layers"
        heads = int(q_val.shape[1])
        depth = self.num_layers or num_decoder_layers(gm)
        if layer is None and self.slopes == "minimax" and depth > 1:
            return ("kept: the decoder-layer index of this site is unknown (a graph shared by "
                    "several layers after a graph break), so MiniMax's per-layer slopes cannot "
                    "be chosen; use lightning.slopes='alibi' or remove the graph break")
        slopes = minimax_slopes(heads, layer or 0, depth, self.slopes)
        q, k = (self._feature_map(gm, output, x) for x in (q, k))
        self._insert_lightning(gm, output, q, k, v, slopes, scale)
        return (f"APPROXIMATE: softmax -> Lightning Attention ({self.slopes} slopes, feature "
                f"map {self.feature_map}, norm {self.norm}, layer {layer} of {depth})")

    def _mask_to_is_causal(self, node: fx.Node) -> bool:
        """SDPA with a mask proven causal (and q length = k length) -> ``is_causal=True``,
        mask dropped. Exact: both give every query its keys 0..i. Under torch.compile
        transformers materializes the causal mask that eager code skips (S x S)."""
        if node.target is not aten.scaled_dot_product_attention.default:
            return False
        names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal"]
        args: dict[str, Any] = dict(zip(names, node.args)) | dict(node.kwargs)
        mask = args.get("attn_mask")
        q_val, k_val = tensor_meta(args["query"]), tensor_meta(args["key"])
        if mask is None or q_val is None or k_val is None or q_val.dim() != 4 or \
                q_val.shape[2] != k_val.shape[2] or not_constant_causal(mask, self._env):
            return False
        args.update(attn_mask=None, is_causal=True)
        node.args = (args.pop("query"), args.pop("key"), args.pop("value"))
        node.kwargs = args
        return True

    def _feature_map(self, gm: fx.GraphModule, before: fx.Node, x: fx.Node) -> fx.Node:
        """``lightning.feature_map`` applied to q or k (new nodes before ``before``)."""
        maps: dict[str, list[tuple[Any, tuple[Any, ...]]]] = {
            "identity": [], "silu": [(aten.silu.default, ())], "relu": [(aten.relu.default, ())],
            "elu1": [(aten.elu.default, ()), (aten.add.Tensor, (1.0,))],
        }
        for target, extra in maps[self.feature_map]:
            with gm.graph.inserting_before(before):
                new = gm.graph.call_function(target, (x, *extra))
            new.meta.update(val=fake_call(target, x, *extra),
                            nn_module_stack=before.meta.get("nn_module_stack", {}),
                            graphopt_replaced=[before.name])
            x = new
        return x

    def _insert_lightning(self, gm: fx.GraphModule, node: fx.Node, q: fx.Node, k: fx.Node,
                          v: fx.Node, slopes: torch.Tensor, scale: float) -> None:
        """Replace softmax attention ``node`` by Lightning Attention (+ RMS norm)."""
        out = _insert_with_frozen_slopes(gm, node, q, k, v, slopes, scale)
        if self.norm == "rms":
            dim = [int(out.meta["val"].shape[3])]
            with gm.graph.inserting_after(out):
                norm = gm.graph.call_function(aten.rms_norm.default, (out, dim))
            norm.meta.update(out.meta, val=fake_call(aten.rms_norm.default, out, dim))
            out = norm
        want = tensor_meta(node)
        if want is not None and want.dtype != out.meta["val"].dtype:
            with gm.graph.inserting_after(out):
                cast = gm.graph.call_function(aten._to_copy.default, (out,),
                                              {"dtype": want.dtype})
            cast.meta.update(out.meta, val=fake_call(aten._to_copy.default, out, dtype=want.dtype))
            out = cast
        node.replace_all_uses_with(out)

    @staticmethod
    def _rewrite_parallel(gm: fx.GraphModule, node: fx.Node, form: DecayedParallelForm,
                          slopes: torch.Tensor) -> None:
        node.replace_all_uses_with(
            _insert_with_frozen_slopes(gm, node, form.q, form.k, form.v, slopes, 1.0))

    @staticmethod
    def _input_env(gm: fx.GraphModule, ctx: PassContext) -> dict[fx.Node, Any]:
        inputs = ctx.extras.get("example_inputs") or []
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        return {p: x for p, x in zip(placeholders, inputs)}

    @staticmethod
    def _rewrite(gm: fx.GraphModule, cat: fx.Node, loop: BlockLoop) -> None:
        from graphopt.kernels.lightning.op import resolve_impl

        graph = gm.graph
        q_val = tensor_meta(loop.q)
        assert q_val is not None
        heads = int(q_val.shape[1])
        v_val = tensor_meta(loop.v)
        impl = resolve_impl("auto", q_val.device, max(
            int(q_val.shape[-1]), int(v_val.shape[-1]) if v_val is not None else 0))
        op = torch.ops.graphopt.lightning_attention_fwd.default
        with graph.inserting_before(cat):
            slope = graph.call_function(aten.view.default, (loop.slope, [heads]))
            slope.meta["val"] = fake_call(aten.view.default, loop.slope, [heads])
            # The result does not depend on the block length (exact math); use the kernel's.
            args = (loop.q, loop.k, loop.v, slope, 1.0, None, DEFAULT_BLOCK_SIZE,
                    DEFAULT_CHECKPOINT_EVERY, impl)
            call = graph.call_function(op, args)
            call.meta["val"] = fake_call(op, *args)
            outs = []
            for i in range(2):
                item = graph.call_function(operator.getitem, (call, i))
                item.meta["val"] = call.meta["val"][i]
                outs.append(item)
        for new in (call, outs[0], outs[1], slope):
            new.meta["nn_module_stack"] = cat.meta.get("nn_module_stack", {})
            new.meta["graphopt_replaced"] = [cat.name]
        cat.replace_all_uses_with(outs[0])
        state = loop.final_state
        if state is not None and state.users:
            want = tensor_meta(state)
            new_state = outs[1]
            if want is not None and want.dtype != outs[1].meta["val"].dtype:
                with graph.inserting_after(outs[1]):
                    new_state = graph.call_function(
                        aten._to_copy.default, (outs[1],), {"dtype": want.dtype})
                    new_state.meta["val"] = fake_call(aten._to_copy.default, outs[1],
                                                  dtype=want.dtype)
            state.replace_all_uses_with(new_state)
