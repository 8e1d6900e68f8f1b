"""attention pass, step 4 (mode "lightning", APPROXIMATE, opt-in): replace causal softmax
attention by Lightning Attention, for linearizing a pretrained model before fine-tuning.

Each converted site computes ``norm(lightning_attention(phi(q), phi(k), v, slopes, scale))``:
per-head slopes (MiniMax-01's: ALiBi's geometric slopes times a depth factor, or ALiBi's),
an optional q/k feature map phi and an RMS output norm. MiniMax-01's hybrid keeps every n-th
layer's softmax (``lightning.every``); ``lightning.layers`` selects sites by module path.
Spellings (``match_softmax``): SDPA (is_causal, or a mask proven causal) and hand-written
``softmax(Q K^T * scale [+ mask]) [dropout 0] @ V`` (GPT-2's and Llama's eager attention).

Contract:
    accepts: the normalized pre-autograd ATen graph, its softmax-attention sites
        (``match_softmax.softmax_attention_sites``) and the example inputs (``env``) to prove
        masks causal and fold constant scales.
    guarantees: APPROXIMATE: a converted site computes Lightning Attention, not softmax
        attention (the pass's ``exact`` is False in this mode, so verify reports
        "approximate"). Every site is either converted or reported "skipped" with the
        matcher's reason: a mask from a graph input (padding, or a mask passed across a graph
        break), non-causal or sliding-window masks, dropout > 0, query length != key length
        (cross attention, decode steps), keys/values read from or stored into a KV cache
        (``kv_cache_reason``; warned once per graph), keys/values not computed from the
        queries' inputs (cross attention, ``cross_attention_reason``), a K permuted other
        than over its last two dims, a run-time scale that would promote the scores'
        dtype, an unknown layer index with per-layer slopes, an autocast region,
        ``lightning.every`` / ``lightning.layers``. A scale computed from a graph input or
        a trainable temperature (``dynamic=True`` lifts transformers' ``self.scaling`` to a
        graph input) multiplies phi(q) in the graph, so it stays live and differentiable.
        The output keeps the site's dtype.
    reads meta: ``val``, ``nn_module_stack`` (layer index, module path), ``grapharg``,
        ``autocast``.
    writes meta: new nodes get ``val``, ``nn_module_stack`` and ``graphopt_replaced`` of the
        replaced ``P @ V`` (or SDPA) node; slopes become a float32 buffer of the module.
    records: per site "rewritten" ("APPROXIMATE: ...", slopes, feature map, norm, layer) or
        "skipped" with the reason.

Pseudo-code:
    for site in softmax-attention sites:
        q, k, v, scale, out = match_softmax_attention_site(site)   # or skipped: reason
        check GQA heads, lightning.every, lightning.layers, a known layer index
        slopes = minimax_slopes(H, layer, num_layers, kind)
        o = lightning_attention_fwd(phi(q) * runtime factors, phi(k), v, buffer(slopes),
                                    constant scale)[0]
        replace out by cast(rms_norm(float32 or float64 o, eps=NORM_EPS), out.dtype)
"""

from __future__ import annotations

import fnmatch
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from graphopt.errors import ConfigError
from graphopt.passes.attention.lightning_call import insert_with_frozen_slopes, saved_bytes_note
from graphopt.passes.attention.match_common import (
    NoMatch,
    WritesBetween,
    ancestors,
    aten,
    is_buffer,
    is_parameter,
    layer_index,
)
from graphopt.passes.attention.match_softmax import (
    Outer,
    match_softmax_attention_site,
    num_decoder_layers,
)
from graphopt.passes.attention.options import LightningOptions
from graphopt.passes.base import PassContext
from graphopt.passes.fx_utils import (
    autocast_reason,
    between,
    fake_call,
    grad_mode_reason,
    is_mutating,
    module_path,
    site_name,
    tensor_meta,
    writes_of,
)
from graphopt.report import on_clear

_DECIDED: dict[str, bool] = {}
"""Softmax-attention site (module path) -> whether the last graph of this process that
held it converted it (:meth:`SoftmaxToLightning.convert_sites` warns on a change);
``graphopt.clear_reports()`` forgets it (a review: a new model with the same module paths
was warned about the one before)."""
on_clear(_DECIDED.clear)

NORM_EPS = 1e-6
"""eps of the RMS output norm, in float32 (float64 for float64 models) whatever the model's
dtype, as MiniMax-01's lightning layers normalize (transformers' MiniMaxRMSNorm: eps 1e-6,
float32). It was aten.rms_norm's default, the dtype's machine epsilon: 7.8e-3 in bf16,
above the mean square of a typical head's output (~1e-4, a review on Llama), so the norm
did almost nothing in bf16 and normalized in float32: a converted model computed a
different function per dtype (logits 0.22-0.29 off its float64 conversion)."""

_FEATURE_MAPS: dict[str, list[tuple[Any, tuple[Any, ...]]]] = {
    "identity": [], "silu": [(aten.silu.default, ())], "relu": [(aten.relu.default, ())],
    "elu1": [(aten.elu.default, ()), (aten.add.Tensor, (1.0,))],
}


def minimax_slopes(heads: int, layer: int, num_layers: int, kind: str = "minimax"
                   ) -> torch.Tensor:
    """Per-head decay rates [heads] (float32) as MiniMax-01 assigns them: ALiBi's geometric
    slopes 2^(-8 (h + 1) / H) (Press et al. 2022), scaled by the layer's depth factor
    1 - layer / (num_layers - 1) (+1e-5 so the last layer keeps a small decay).
    ``kind="alibi"``: the geometric slopes alone (no depth factor)."""
    base = 2.0 ** (-8.0 / heads)
    factor = 1.0 if kind == "alibi" else 1.0 - layer / (num_layers - 1 + 1e-5) + 1e-5
    return torch.tensor([base ** (h + 1) * factor for h in range(heads)], dtype=torch.float32)


_PASS_THROUGH = {aten.cat.default, aten.expand.default, aten.reshape.default,
                 aten.view.default, aten._unsafe_view.default, aten.clone.default,
                 aten.transpose.int, aten.permute.default, aten.unsqueeze.default,
                 aten.slice.Tensor, aten.alias.default, aten._to_copy.default,
                 aten.contiguous.default}
"""Ops through which a site's keys/values are the same values (layout, GQA's repeat_kv,
the cache's concatenation)."""


def kv_cache_reason(k: fx.Node, v: fx.Node) -> str:
    """Why a site's keys or values belong to a KV cache (non-empty: the site is kept), else
    "". They do when, through layout ops, they come from a graph input concatenated with
    this step's (a dynamic cache of earlier steps: a decode step or a later prefill chunk)
    or from a graph input the graph writes in place (a static cache), or when they are also
    returned or written in place (stored for later steps: a prefill with ``use_cache``).
    Keys/values that are a graph input as they are (a graph break before the attention)
    are not a cache. A converted prefill with softmax decode steps after it computed neither
    model: a review measured decode logits 1.2-1.4 off the Lightning model and 0.23-0.29
    off the softmax one."""
    for x, what in ((k, "keys"), (v, "values")):
        seen: set[fx.Node] = set()
        todo = [(x, False)]
        while todo:
            n, concatenated = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if n.op == "placeholder" and (concatenated or any(
                    n in writes_of(u) for u in n.users)):
                return (f"the {what} come from a KV cache of earlier steps (a graph input "
                        + ("concatenated with this step's" if concatenated else
                           "written in place") + "): Lightning Attention would need its "
                        "recurrent state there, not past softmax keys/values; "
                        + _USE_CACHE_FALSE)
            if n.op == "call_function" and n.target in _PASS_THROUGH:  # tensors only (not
                todo.extend((i, concatenated or n.target is aten.cat.default)  # a dynamic
                            for i in n.all_input_nodes  # size's SymInt input)
                            if isinstance(tensor_meta(i), torch.Tensor))
        for n in seen:
            for user in n.users:
                if n.op != "placeholder" and (user.op == "output" or is_mutating(user)
                                              or n in writes_of(user)):
                    return (f"the {what} are also returned or written in place (a KV cache "
                            "for later decode steps, which would read softmax keys/values "
                            "of a Lightning model): " + _USE_CACHE_FALSE)
    return ""


_USE_CACHE_FALSE = "run with use_cache=False"
"""How every :func:`kv_cache_reason` ends (the KV-cache warning counts those sites)."""


def cross_attention_reason(q: fx.Node, k: fx.Node, v: fx.Node, env: dict[fx.Node, Any]
                           ) -> str:
    """Why a site's keys or values come from another sequence than its queries (non-empty:
    the site is kept), else "". Self-attention computes q, k and v from the same hidden
    states, so the graph inputs each is computed from, parameters and buffers aside, are the
    same for q and k (RoPE reads positions for both), and v reads none that q does not;
    cross attention's keys and values read the encoder's states (in a decoder's first
    layer) or its keys lack the decoder's input (later layers). Causal cross attention with equal
    lengths was converted, as if keys were the queries' positions (a review: logits 1.5 and
    gradients 277 off a softmax model whose keys came from a second input). Where q, k and v
    are each a graph input as they are (through layout ops: a graph break just before the
    attention, or a function of q, k, v) the graph cannot tell, and the site is taken for
    self-attention as the caller's function of (q, k, v) says; keys computed in an earlier
    graph next to queries computed in this one are kept."""
    if all(_graph_input(x) is not None for x in (q, k, v)):
        return ""

    def inputs(x: fx.Node) -> set[fx.Node]:
        # (0-d tensors are scalars, not sequences: under dynamic=True Dynamo passes a q/k
        # norm's epsilon as one, and every Qwen3 / Gemma3 / OLMo2 site was kept as "cross
        # attention", a review)
        return {n for n in ancestors(x) if n.op == "placeholder"
                and isinstance(val := tensor_meta(n), torch.Tensor) and val.dim() > 0
                and not is_buffer(n, env) and not is_parameter(n, env)}

    mine = inputs(q)
    for x, what in ((k, "keys"), (v, "values")):
        theirs = inputs(x)
        only = sorted(n.name for n in theirs - mine)
        # values skip what only positions need (RoPE's cos/sin inputs in a checkpoint body)
        missing = sorted(n.name for n in mine - theirs) if x is k else []
        if only or missing:
            return (f"the {what} are not computed from the queries' inputs ("
                    + "; ".join(part for part in (
                        f"they read {', '.join(only[:3])}, which the queries do not"
                        if only else "",
                        f"they do not read {', '.join(missing[:3])}" if missing else "")
                        if part)
                    + "): cross attention, or keys computed before a graph break; only "
                      "self-attention is converted")
    return ""


def _graph_input(x: fx.Node) -> fx.Node | None:
    """The graph input ``x`` is, through single-operand layout ops, or None."""
    while x.op == "call_function" and x.target in _PASS_THROUGH and x.target is not \
            aten.cat.default and isinstance(x.args[0], fx.Node):
        x = x.args[0]
    return x if x.op == "placeholder" else None


def _promoting_factor(q: fx.Node, factors: tuple[tuple[fx.Node, bool], ...]) -> str:
    """Why multiplying q by a run-time scale factor would change q's dtype, or ""."""
    q_val = tensor_meta(q)
    for node, _ in factors:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and q_val is not None \
                and torch.result_type(q_val, val) != q_val.dtype:
            return (f"the run-time scale {node.name} ({val.dtype}, {val.dim()} dims) would "
                    f"promote q ({q_val.dtype}) where it multiplies it")
    return ""


def _scaled(gm: fx.GraphModule, before: fx.Node, q: fx.Node,
            factors: tuple[tuple[fx.Node, bool], ...]) -> fx.Node:
    """``q * f`` (or ``q / f``) for each run-time scale factor ``f`` of the scores (new nodes
    before ``before``): (phi(q) f) . phi(k) = f (phi(q) . phi(k)), the kernel's constant
    ``scale`` times the factors, and gradients reach a trainable temperature."""
    for node, divides in factors:
        target = aten.div.Tensor if divides else aten.mul.Tensor
        with gm.graph.inserting_before(before):
            new = gm.graph.call_function(target, (q, node))
        new.meta.update(val=fake_call(target, q, node),
                        nn_module_stack=before.meta.get("nn_module_stack", {}),
                        graphopt_replaced=[before.name])
        q = new
    return q


def _warn_at_the_recompile_limit() -> None:
    """Warn when this compile is the last Dynamo allows for its frame: past
    ``torch._dynamo.config.recompile_limit``, Dynamo runs the frame without compiling it,
    i.e. as softmax attention, a different function from the converted calls (a review:
    lengths 2-9 ran Lightning Attention and 10-12 softmax, with no word from graphopt)."""
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    limit = int(torch._dynamo.config.recompile_limit)
    if compile_id is None or compile_id.frame_compile_id is None or \
            compile_id.frame_compile_id + 1 < limit or \
            torch._dynamo.config.fail_on_recompile_limit_hit:
        return
    warnings.warn(f"graphopt: attention='lightning' converted a graph in Dynamo's last "
                  f"compile of this frame (recompile_limit={limit}): later calls that need "
                  "another compile (a new input shape) run uncompiled, i.e. as softmax "
                  "attention, a different function. Compile with dynamic=True or "
                  "mark_dynamic, raise torch._dynamo.config.recompile_limit, or set "
                  "torch._dynamo.config.fail_on_recompile_limit_hit = True to get an "
                  "error instead", stacklevel=2)


def _escaping_value(found: Any) -> str:
    """Why a value computed inside the site (the attention probabilities) is read outside it
    ("" when none is): the softmax would stay to compute it, so the graph would return
    softmax weights next to a Lightning output they did not produce (a review: with
    ``output_attentions=True``, layer 0's returned weights equalled eager's exactly while its
    output came from Lightning Attention)."""
    region = between((found.q, found.k, found.v), (found.output,))
    for node in sorted(region - {found.output}, key=lambda n: n.name):
        outside = [u for u in node.users if u not in region]
        if outside:
            returned = any(u.op == "output" for u in outside)
            return (f"{node.name}, computed inside the attention, is also read outside it "
                    + ("(the graph returns it: output_attentions=True returns the attention "
                       "weights)" if returned else f"(by {outside[0].name})")
                    + ": converting would leave it as softmax attention computes it, next to "
                    "a Lightning output it did not produce")
    return ""


@dataclass(frozen=True)
class SoftmaxToLightning:
    """One conversion with the ``lightning.*`` options."""

    options: LightningOptions = field(default_factory=LightningOptions)

    def convert_sites(self, gm: fx.GraphModule, sites: list[fx.Node], ctx: PassContext,
                      env: dict[fx.Node, Any]) -> bool:
        """Convert or report every site; True when the graph changed."""
        modified = False
        # In a checkpoint body: the whole model's graph (layer count) and the parent's
        # builders of the body's inputs (a causal mask built outside the region).
        root, outer = ctx.extras.get("root", gm), ctx.extras.get("outer")
        writes = WritesBetween(gm.graph)
        cached = masked = dropped = returned = autocast = 0
        changed: list[str] = []
        for node in sites:
            in_autocast = autocast_reason(node)
            autocast += bool(in_autocast)
            reason = in_autocast or self.convert(gm, node, env, root, outer, writes)
            done = reason.startswith("APPROXIMATE")
            ctx.record("rewritten" if done else "skipped", site_name(node), reason,
                       approximate=done)
            modified = modified or done
            cached += reason.endswith(_USE_CACHE_FALSE)  # kv_cache_reason's
            masked += "depends on a graph input's values" in reason
            dropped += "training dropout" in reason
            returned += "output_attentions=True" in reason
            path = module_path(node) or site_name(node)
            if _DECIDED.setdefault(path, done) != done:
                changed.append(f"{path} ({'converted' if done else 'kept'} here, "
                               f"{'kept' if done else 'converted'} before)")
                _DECIDED[path] = done
        if changed:  # one model, two functions (a review: a Mistral converted at S <= its
            # window, kept after a longer recompile, and then kept at the short length too)
            warnings.warn(f"graphopt: attention='lightning' decided {len(changed)} site(s) "
                          f"differently from an earlier graph of this process: "
                          f"{'; '.join(changed[:3])}. The model computes softmax attention in "
                          "some calls and Lightning Attention in others; see the report's "
                          "reasons (dropout in training, a sliding window at some lengths)",
                          stacklevel=2)
        if dropped:  # as loud (a review: the model fine-tuned as softmax attention in train
            # mode and evaluated as Lightning, whose layers never trained)
            warnings.warn(f"graphopt: attention='lightning' kept {dropped} softmax-attention "
                          "site(s) of this graph because their attention dropout is on "
                          "(training): an eval-mode graph converts them, so the model would "
                          "train as softmax attention and run as Lightning Attention; set the "
                          "model's attention dropout to 0 to train the converted model",
                          stacklevel=2)
        if autocast:  # as loud: Trainer / accelerate wrap forward in autocast, so a fine-tune
            # trained the softmax model without a word (a review)
            warnings.warn(f"graphopt: attention='lightning' kept {autocast} softmax-attention "
                          "site(s) of this graph because they run inside an autocast region "
                          "that the compiled function enters; enter autocast around the "
                          "compiled call instead (the sites then convert)", stacklevel=2)
        if returned:  # as loud: the user asked for Lightning and gets softmax attention
            warnings.warn(f"graphopt: attention='lightning' kept {returned} softmax-attention "
                          "site(s) of this graph because the graph returns their attention "
                          "weights (output_attentions=True), which Lightning Attention does "
                          "not compute; call the model without output_attentions to convert "
                          "them", stacklevel=2)
        if cached:  # loud: a forward that returns transformers' default cache (use_cache=True)
            warnings.warn(f"graphopt: attention='lightning' kept {cached} softmax-attention "
                          "site(s) of this graph because they read or fill a KV cache (a "
                          "converted prefill followed by softmax decode steps would compute "
                          "neither model); call the model with use_cache=False to convert "
                          "them", stacklevel=2)
        if masked and not modified:  # as loud: generate() passes an all-ones mask even
            # without padding, so following the advice above converted nothing, silently
            # (a review)
            warnings.warn(f"graphopt: attention='lightning' kept {masked} softmax-attention "
                          "site(s) of this graph because their attention mask is a graph "
                          "input whose values could pad: a mask passed in (generate() "
                          "passes one even without padding) or one built before a graph "
                          "break; call the model without attention_mask (and without graph "
                          "breaks before attention) to convert them", stacklevel=2)
        if modified:
            _warn_at_the_recompile_limit()
        self._report_unused_patterns(sites, ctx)
        return modified

    def _report_unused_patterns(self, sites: list[fx.Node], ctx: PassContext) -> None:
        """A ``lightning.layers`` pattern that selects no site of this graph is reported and
        warned about (a typo would otherwise silently convert nothing)."""
        paths = sorted({module_path(n) for n in sites})
        for pattern in self.options.layers:
            if not any(fnmatch.fnmatchcase(path, pattern) for path in paths):
                message = (f"lightning.layers pattern {pattern!r} selects no attention site of "
                           f"this graph; its sites are {paths[:4]}"
                           + (" ..." if len(paths) > 4 else ""))
                ctx.record("skipped", "lightning.layers", message)
                warnings.warn(f"graphopt: {message}", stacklevel=2)

    def convert(self, gm: fx.GraphModule, node: fx.Node, env: dict[fx.Node, Any],
                root: fx.GraphModule | None = None, outer: Outer | None = None,
                writes: WritesBetween | None = None) -> str:
        """Replace one softmax-attention site (SDPA node or hand-written softmax); returns the
        report reason ("APPROXIMATE..." when done, "kept: ..." with the reason otherwise).
        ``root``: the whole model's graph when ``gm`` is a checkpoint body (MiniMax slopes
        need the layer count); ``outer``: see ``match_softmax.built_where``."""
        try:
            found = match_softmax_attention_site(node, env, outer)
        except NoMatch as exc:
            return f"kept: {exc}"
        q_val, k_val = tensor_meta(found.q), tensor_meta(found.k)
        assert q_val is not None and k_val is not None
        if q_val.shape[1] % k_val.shape[1]:
            return "kept: query heads are not a multiple of key heads"
        v_val = tensor_meta(found.v)
        if v_val is not None and v_val.shape[1] != k_val.shape[1]:
            # the matmuls broadcast them; Lightning pairs each key head with its value head
            # (a review: the kernel's shape error at the first call)
            return (f"kept: keys have {k_val.shape[1]} head(s) and values "
                    f"{v_val.shape[1]}; Lightning Attention pairs each key head with one "
                    "value head")
        opts, layer = self.options, layer_index(node)
        if opts.every > 1 and layer is None:
            return ("kept: the decoder-layer index of this site is unknown (a graph shared by "
                    f"several layers after a graph break), so lightning.every={opts.every} "
                    "cannot tell whether it keeps softmax attention")
        if opts.every > 1 and layer is not None and (layer + 1) % opts.every == 0:
            return f"kept: layer {layer} keeps softmax attention (lightning.every={opts.every})"
        moved = (writes or WritesBetween(gm.graph)).reason((found.q, found.k, found.v),
                                                           found.output) or \
            grad_mode_reason(between((found.q, found.k, found.v), (found.output,)),
                             found.output)
        if moved:
            return f"kept: {moved}"
        escaped = _escaping_value(found)
        if escaped:
            return f"kept: {escaped}"
        other_sequence = kv_cache_reason(found.k, found.v) or \
            cross_attention_reason(found.q, found.k, found.v, env)
        if other_sequence:
            return f"kept: {other_sequence}"
        path = module_path(node)
        if opts.layers and not any(fnmatch.fnmatchcase(path, p) for p in opts.layers):
            return f"kept: {path or 'this site'} is not selected by lightning.layers"
        depth = opts.num_layers or num_decoder_layers(root if root is not None else gm)
        if layer is None and opts.slopes == "minimax" and depth > 1:
            return ("kept: the decoder-layer index of this site is unknown (a graph shared by "
                    "several layers after a graph break), so MiniMax's per-layer slopes cannot "
                    "be chosen; use lightning.slopes='alibi' or remove the graph break")
        if opts.slopes == "minimax" and (layer or 0) >= depth:
            # the depth factor 1 - layer / (depth - 1) turned negative: slopes that grow
            # with distance, NaN logits in float32 at 400 tokens (a review)
            raise ConfigError(f"{site_name(node)}: lightning.num_layers={depth} but this "
                              f"attention is in decoder layer {layer}: MiniMax's depth "
                              "factor would be negative (weights that grow with distance, "
                              "not a decay); set lightning.num_layers to the model's layer "
                              "count or leave it None (counted from the model)")
        slopes = minimax_slopes(int(q_val.shape[1]), layer or 0, depth, opts.slopes)
        promoted = _promoting_factor(found.q, found.factors)
        if promoted:
            return f"kept: {promoted}"
        q, k = (self._feature_map(gm, found.output, x) for x in (found.q, found.k))
        q = _scaled(gm, found.output, q, found.factors)
        self._insert(gm, found.output, q, k, found.v, slopes, found.scale)
        return (f"APPROXIMATE: softmax -> Lightning Attention ({opts.slopes} slopes, feature "
                f"map {opts.feature_map}, norm {opts.norm}, layer {layer} of {depth})"
                + saved_bytes_note(found.q, found.k, found.v))

    def _feature_map(self, gm: fx.GraphModule, before: fx.Node, x: fx.Node) -> fx.Node:
        """``lightning.feature_map`` applied to q or k (new nodes before ``before``)."""
        for target, extra in _FEATURE_MAPS[self.options.feature_map]:
            with gm.graph.inserting_before(before):
                new = gm.graph.call_function(target, (x, *extra))
            new.meta.update(val=fake_call(target, x, *extra),
                            nn_module_stack=before.meta.get("nn_module_stack", {}),
                            graphopt_replaced=[before.name])
            x = new
        return x

    def _insert(self, gm: fx.GraphModule, node: fx.Node, q: fx.Node, k: fx.Node,
                v: fx.Node, slopes: torch.Tensor, scale: float) -> None:
        """Replace softmax attention ``node`` by Lightning Attention (+ RMS norm)."""
        out = insert_with_frozen_slopes(gm, node, q, k, v, slopes, scale)
        if self.options.norm == "rms":
            dim = [int(out.meta["val"].shape[3])]
            if out.meta["val"].dtype not in (torch.float32, torch.float64):
                with gm.graph.inserting_after(out):
                    up = gm.graph.call_function(aten._to_copy.default, (out,),
                                                {"dtype": torch.float32})
                up.meta.update(out.meta, val=fake_call(aten._to_copy.default, out,
                                                       dtype=torch.float32))
                out = up
            with gm.graph.inserting_after(out):
                norm = gm.graph.call_function(aten.rms_norm.default, (out, dim, None, NORM_EPS))
            norm.meta.update(out.meta, val=fake_call(aten.rms_norm.default, out, dim, None,
                                                     NORM_EPS))
            out = norm
        want = tensor_meta(node)
        if want is not None and want.dtype != out.meta["val"].dtype:
            with gm.graph.inserting_after(out):
                cast = gm.graph.call_function(aten._to_copy.default, (out,),
                                              {"dtype": want.dtype})
            cast.meta.update(out.meta, val=fake_call(aten._to_copy.default, out, dtype=want.dtype))
            out = cast
        node.replace_all_uses_with(out)
