"""attention: rewrite decayed causal linear attention into ``graphopt::lightning_attention``.

Mode "exact" (``options={"attention": "exact"}``) finds code that already computes Lightning
Attention in a slow form and replaces it with the chunked/Triton kernel. Matched today:
transformers' MiniMax ``MiniMaxLightningAttention`` block loop, which Dynamo unrolls into one
chain per block. Softmax attention is reported and kept (its conversion to Lightning
Attention is mode "lightning", below). Also matched: the quadratic
"parallel form" ``((Q K^T) * D) V`` (RetNet-style code) when the decay matrix D is computed
from buffers/constants only and equals exp(-slope_h * (i - j)) below the diagonal, 0 above.

Mode "lightning" (APPROXIMATE, opt-in) additionally replaces causal softmax attention
``scaled_dot_product_attention(q, k, v, is_causal=True)`` (no mask, dropout 0, query length =
key length, GQA allowed) by Lightning Attention with MiniMax-01's per-head slopes and an
RMS output normalization, for linearizing a pretrained model before fine-tuning. Sites with a
mask, dropout > 0 or a KV cache are skipped with the reason; ``lightning.every`` keeps every
n-th layer's softmax attention (MiniMax's hybrid). The pass then reports itself inexact.

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
        loop-like chain that fails a check, "kept" per softmax attention (SDPA) site.

Pseudo-code:
    for cat in graph where cat(dim=-2) of per-block outputs:
        blocks = [match_block(o) for o in cat.inputs]          # slices of one Q, K, V
        check slices tile [0, S); the state chain starts at zeros and links block i to i+1
        check decays numerically against slope
        o, state, _ = lightning_attention_fwd(Q, K, V, slope.view(H), 1.0, None, 64, 8, impl)
        replace cat by o and the last state by state; dead loop nodes are removed
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from graphopt.kernels.lightning.chunked import DEFAULT_BLOCK_SIZE, DEFAULT_CHECKPOINT_EVERY
from graphopt.passes import register_pass
from graphopt.passes.base import GraphPass, PassContext, PassResult
from graphopt.passes.fx_utils import site_name, tensor_meta

aten = torch.ops.aten
_SDPA = {aten.scaled_dot_product_attention.default,
         aten._scaled_dot_product_flash_attention_for_cpu.default,
         aten._scaled_dot_product_efficient_attention.default,
         aten._scaled_dot_product_flash_attention.default}


class NoMatch(Exception):
    """The chain is not the pattern; the message is the reason for the report."""


def _is(node: Any, *targets: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _arg(node: Any, i: int) -> Any:
    return node.args[i] if i < len(node.args) else None


@dataclass
class _Block:
    q: fx.Node
    k: fx.Node
    v: fx.Node
    start: int
    end: int
    q_decay: fx.Node
    diag_decay: fx.Node
    state_in: fx.Node
    intra: fx.Node


@dataclass
class _Loop:
    q: fx.Node
    k: fx.Node
    v: fx.Node
    slope: fx.Node
    blocks: list[_Block]
    final_state: fx.Node | None
    checks: list[tuple[fx.Node, str, int]]  # (decay node, kind, block length)


def _seq_slice(node: Any) -> tuple[fx.Node, int, int]:
    """(base, start, end) of ``base[:, :, start:end]``; a whole-range slice is an alias."""
    if _is(node, aten.alias.default):
        val = tensor_meta(_arg(node, 0))
        if val is None or val.dim() != 4:
            raise NoMatch("block operand is not a [B, H, S, D] tensor")
        return _arg(node, 0), 0, int(val.shape[2])
    if not _is(node, aten.slice.Tensor) or _arg(node, 1) not in (2, -2):
        raise NoMatch("block operand is not a slice of the sequence dimension")
    base, start, end = _arg(node, 0), _arg(node, 2) or 0, _arg(node, 3)
    val = tensor_meta(base)
    if val is None or not isinstance(start, int) or not isinstance(end, int):
        raise NoMatch("block bounds are not static integers")
    return base, start, min(end, int(val.shape[2]))


def _split_product(node: Any, target: Any) -> tuple[Any, Any]:
    if not _is(node, target):
        found = node.target if isinstance(node, fx.Node) else node
        raise NoMatch(f"expected {target}, found {found}")
    return _arg(node, 0), _arg(node, 1)


def _match_output(o: Any) -> _Block:
    """o = (Q_b * qd) @ S_in + ((Q_b @ K_b^T) * dd) @ V_b (either order of the sum)."""
    if not _is(o, aten.add.Tensor):
        raise NoMatch("block output is not inter + intra")
    for inter, intra in ((_arg(o, 0), _arg(o, 1)), (_arg(o, 1), _arg(o, 0))):
        try:
            scaled_q, state = _split_product(inter, aten.matmul.default)
            q_b, qd = _split_product(scaled_q, aten.mul.Tensor)
            weights, v_b = _split_product(intra, aten.matmul.default)
            qk, dd = _split_product(weights, aten.mul.Tensor)
            q_b2, k_t = _split_product(qk, aten.matmul.default)
            if q_b2 is not q_b or not _is(k_t, aten.transpose.int) or \
                    sorted([_arg(k_t, 1), _arg(k_t, 2)]) != [-2, -1]:
                raise NoMatch("intra scores are not Q_b @ K_b^T of the same block")
            (q, s0, e0), (k, s1, e1), (v, s2, e2) = (_seq_slice(x) for x in (q_b, _arg(k_t, 0),
                                                                             v_b))
            if not (s0 == s1 == s2 and e0 == e1 == e2):
                raise NoMatch("q, k, v block bounds differ")
            return _Block(q, k, v, s0, e0, qd, dd, state, intra)
        except NoMatch:
            continue
    raise NoMatch("block output is not (Q*qd) @ S + ((Q K^T) * D) @ V")


def _match_state_update(new: fx.Node, block: _Block
                        ) -> tuple[fx.Node, fx.Node, fx.Node]:
    """new = S_in * exp(-slope * L) + (K_b * kd)^T @ V_b; returns (slope, block decay, kd)."""
    if not _is(new, aten.add.Tensor):
        raise NoMatch("state update is not decayed state + K^T V")
    for decayed, kv in ((_arg(new, 0), _arg(new, 1)), (_arg(new, 1), _arg(new, 0))):
        if not (_is(decayed, aten.mul.Tensor) and _is(kv, aten.matmul.default)):
            continue
        s_in, bd = decayed.args
        if s_in is not block.state_in:
            s_in, bd = bd, s_in
        kt, v_b = kv.args
        if s_in is not block.state_in or not _is(kt, aten.transpose.int):
            continue
        k_scaled = _arg(kt, 0)
        if not _is(k_scaled, aten.mul.Tensor) or _seq_slice(v_b)[0] is not block.v:
            continue
        k_b, kd = k_scaled.args
        if _seq_slice(k_b)[0] is not block.k:
            continue
        if not (_is(bd, aten.exp.default) and _is(_arg(bd, 0), aten.mul.Tensor)
                and _is(_arg(_arg(bd, 0), 0), aten.neg.default)):
            raise NoMatch("block decay is not exp(-slope * L)")
        return _arg(_arg(_arg(bd, 0), 0), 0), bd, kd
    raise NoMatch("state update does not read this block's K and V")


def match_minimax_loop(cat: fx.Node) -> _Loop:
    """Match ``torch.cat(per-block outputs, dim=-2)`` of a MiniMax-style block loop."""
    outputs = _arg(cat, 0)
    if len(cat.args) < 2 or _arg(cat, 1) not in (-2, 2) or not isinstance(outputs, list) \
            or len(outputs) < 1:
        raise NoMatch("not a concatenation over the sequence dimension")
    blocks = [_match_output(o) for o in outputs]
    first = blocks[0]
    if not _is(first.state_in, aten.zeros.default, aten.zeros_like.default,
               aten.new_zeros.default):
        raise NoMatch("the first block's state is not zeros (a cached state: decode path)")
    checks: list[tuple[fx.Node, str, int]] = []
    slope = None
    final_state = None
    for i, blk in enumerate(blocks):
        if (blk.q, blk.k, blk.v) != (first.q, first.k, first.v):
            raise NoMatch("blocks read different Q/K/V tensors")
        expected_start = 0 if i == 0 else blocks[i - 1].end
        if blk.start != expected_start:
            raise NoMatch(f"block {i} starts at {blk.start}, expected {expected_start}")
        length = blk.end - blk.start
        users = [u for u in blk.state_in.users if _is(u, aten.mul.Tensor)
                 and u.users and any(_is(w, aten.add.Tensor) for w in u.users)]
        new_state = next((w for u in users for w in u.users if _is(w, aten.add.Tensor)), None)
        if new_state is None:
            raise NoMatch(f"block {i} has no state update")
        s, bd, kd = _match_state_update(new_state, blk)
        if slope is not None and s is not slope:
            raise NoMatch("blocks use different slopes")
        slope = s
        checks += [(blk.q_decay, "query", length), (kd, "key", length),
                   (blk.diag_decay, "diagonal", length), (bd, "block", length)]
        if i + 1 < len(blocks) and blocks[i + 1].state_in is not new_state:
            raise NoMatch(f"block {i + 1} does not read block {i}'s state")
        final_state = new_state
    q_val = tensor_meta(first.q)
    assert q_val is not None and slope is not None
    if blocks[-1].end != int(q_val.shape[2]):
        raise NoMatch("blocks do not cover the whole sequence")
    return _Loop(first.q, first.k, first.v, slope, blocks, final_state, checks)


def _evaluate(node: Any, env: dict[fx.Node, Any]) -> Any:
    """Value of a node computed from real placeholder values (small decay subgraphs)."""
    if not isinstance(node, fx.Node):
        return node
    if node not in env:
        if node.op != "call_function":
            raise NoMatch(f"{node.name} is not computable from the inputs")
        args = torch.fx.node.map_arg(node.args, lambda n: _evaluate(n, env))
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: _evaluate(n, env))
        env[node] = node.target(*args, **kwargs)  # type: ignore[operator]
    return env[node]


def _expected(kind: str, slope: torch.Tensor, length: int) -> torch.Tensor:
    s = slope.reshape(-1, 1, 1).double()
    i = torch.arange(length, dtype=torch.float64)
    if kind == "query":
        return torch.exp(-s * (i + 1).view(-1, 1))
    if kind == "key":
        return torch.exp(-s * (length - 1 - i).view(-1, 1))
    if kind == "block":
        return torch.exp(-s * length)
    gap = i.view(-1, 1) - i.view(1, -1)
    return (torch.exp(-s * gap.clamp(min=0)) * (gap >= 0)).unsqueeze(0)


def _check_decays(loop: _Loop, env: dict[fx.Node, Any]) -> None:
    slope = _evaluate(loop.slope, env)
    if not isinstance(slope, torch.Tensor) or slope.numel() != slope.shape[0]:
        raise NoMatch("slope is not one value per head")
    for node, kind, length in loop.checks:
        got = _evaluate(node, env)
        want = _expected(kind, slope, length)
        if not isinstance(got, torch.Tensor) or got.numel() != want.numel() or not \
                torch.allclose(got.double().reshape(want.shape), want, rtol=1e-5, atol=1e-7):
            raise NoMatch(f"{kind} decay of a {length}-long block is not the exponential of "
                          "-slope times the distance (the loop is not Lightning Attention)")


_PASS_THROUGH = {aten.add.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.where.self,
                 aten.where.ScalarOther, aten.where.ScalarSelf, aten.to.dtype,
                 aten._to_copy.default, aten.dropout.default, aten.clone.default,
                 aten.masked_fill.Scalar}


def _is_batched(node: Any) -> bool:
    val = tensor_meta(node) if isinstance(node, fx.Node) else None
    return val is not None and val.dim() >= 3


def is_handwritten_softmax_attention(node: fx.Node) -> bool:
    """softmax(Q K^T [*/ scale] [+ mask]) [dropout] @ V written out op by op (GPT-2 "eager",
    Llama's eager_attention_forward): a softmax fed by Q @ K^T through element-wise ops and
    feeding a matmul."""
    if not _is(node, aten.softmax.int, aten._softmax.default):
        return False
    upstream: Any = node.args[0]
    for _ in range(6):
        if _is(upstream, aten.matmul.default):
            if not _is(_arg(upstream, 1), aten.transpose.int):
                return False
            break
        if not _is(upstream, *_PASS_THROUGH):
            return False
        upstream = next((a for a in upstream.args if _is_batched(a)), None)
    else:
        return False
    frontier = [node]
    for _ in range(4):
        users = [u for n in frontier for u in n.users]
        if any(_is(u, aten.matmul.default) for u in users):
            return True
        frontier = [u for u in users if _is(u, *_PASS_THROUGH)]
    return False


@dataclass
class _ParallelForm:
    q: fx.Node
    k: fx.Node
    v: fx.Node
    decay: fx.Node


def match_parallel_form(node: fx.Node) -> _ParallelForm:
    """``matmul((matmul(Q, K^T)) * D, V)`` over [B, H, S, X] tensors, D a square mask."""
    weights, v = _split_product(node, aten.matmul.default)
    if not _is(weights, aten.mul.Tensor):
        raise NoMatch("not a masked product")
    for qk, decay in ((_arg(weights, 0), _arg(weights, 1)), (_arg(weights, 1),
                                                             _arg(weights, 0))):
        if not _is(qk, aten.matmul.default):
            continue
        q, k_t = _split_product(qk, aten.matmul.default)
        if not _is(k_t, aten.transpose.int) or sorted([_arg(k_t, 1), _arg(k_t, 2)]) != [-2, -1]:
            raise NoMatch("scores are not Q @ K^T over the last two dims")
        k = _arg(k_t, 0)
        vals = [tensor_meta(x) for x in (q, k, v, decay)]
        if any(x is None for x in vals) or any(x.dim() != 4 for x in vals[:3]):  # type: ignore
            raise NoMatch("operands are not [B, H, S, D] tensors")
        seq_q, seq_k = vals[0].shape[2], vals[1].shape[2]  # type: ignore[union-attr]
        if seq_q != seq_k:
            raise NoMatch("query length differs from key length (decode); causal alignment "
                          "would be ambiguous")
        return _ParallelForm(q, k, v, decay)
    raise NoMatch("no Q @ K^T factor")


def _ancestors(node: fx.Node) -> list[fx.Node]:
    """``node`` and every node it is computed from."""
    stack, seen = [node], {node}
    while stack:
        for a in stack.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return list(seen)


def _decay_slopes(decay: fx.Node, heads: int, env: dict[fx.Node, Any]) -> torch.Tensor:
    """Slopes s_h with D = exp(-s_h (i - j)) masked causal; refuse anything else."""
    for n in _ancestors(decay):
        if n.op == "placeholder":
            value = env.get(n)
            source = n.meta.get("grapharg")
            name = str(getattr(getattr(source, "source", None), "name", ""))
            if not isinstance(value, torch.Tensor) or value.requires_grad or \
                    "_buffers" not in name:
                raise NoMatch("the decay matrix depends on an input or a trainable "
                              "parameter; only decays computed from buffers/constants are "
                              "frozen into the kernel")
    d = _evaluate(decay, env)
    if not isinstance(d, torch.Tensor) or d.dim() < 2 or d.shape[-1] != d.shape[-2]:
        raise NoMatch("the mask is not a square [S, S] matrix")
    seq = d.shape[-1]
    d = d.double().reshape(-1, seq, seq)
    if d.shape[0] not in (1, heads):
        d = d.reshape(-1, heads, seq, seq)[0] if d.numel() % (heads * seq * seq) == 0 else d
    if d.shape[0] not in (1, heads):
        raise NoMatch("the decay matrix does not have one [S, S] matrix per head")
    d = d.expand(heads, seq, seq)
    if seq > 1 and bool((d[:, 1, 0] <= 0).any()):
        raise NoMatch("the mask is not a positive decay below the diagonal")
    slopes = -torch.log(d[:, 1, 0]) if seq > 1 else torch.zeros(heads, dtype=torch.float64)
    if not torch.allclose(d.unsqueeze(0), _expected("diagonal", slopes, seq), rtol=1e-5,
                          atol=1e-7):
        raise NoMatch("the mask is not exp(-slope * (i - j)) below the diagonal and 0 above "
                      "(non-causal or not a decay)")
    return slopes


def _not_constant_causal(mask: fx.Node, env: dict[fx.Node, Any]) -> str:
    """"" when ``mask`` is provably the causal mask for every call of this graph: it is built
    from constants only (no graph input: so no padding mask, no symbolic size) and evaluates to
    True / 0 on and below the diagonal and False / -inf (or < -1e30) above. Else the reason."""
    for n in _ancestors(mask):
        if n.op == "placeholder":
            return ("the attention mask depends on a graph input (a padding mask or a dynamic "
                    "size), so it cannot be proven causal for every call")
        if n.op == "call_function" and not isinstance(n.target, torch._ops.OpOverload):
            return "the attention mask is built by non-ATen code"
    try:
        m = _evaluate(mask, env)
    except Exception as exc:  # any failure means "not provable"
        return f"the attention mask could not be evaluated ({type(exc).__name__})"
    if not isinstance(m, torch.Tensor) or m.dim() < 2 or m.shape[-1] != m.shape[-2]:
        return "the attention mask is not square (query length != key length)"
    seq = m.shape[-1]
    lower = torch.ones(seq, seq, dtype=torch.bool).tril()
    allowed = m if m.dtype == torch.bool else (m == 0)
    blocked = ~m if m.dtype == torch.bool else (m < -1e30)
    if not (bool((allowed == lower).all()) and bool((blocked == ~lower).all())):
        return "the attention mask is not the causal (lower-triangular) mask"
    return ""


def minimax_slopes(heads: int, layer: int, num_layers: int) -> torch.Tensor:
    """Per-head decay rates [heads] (float32) as MiniMax-01 assigns them: ALiBi's geometric
    slopes 2^(-8 (h + 1) / H) (Press et al. 2022), scaled by the layer's depth factor
    1 - layer / (num_layers - 1) (+1e-5 so the last layer keeps a small decay)."""
    base = 2.0 ** (-8.0 / heads)
    factor = 1.0 - layer / (num_layers - 1 + 1e-5) + 1e-5
    return torch.tensor([base ** (h + 1) * factor for h in range(heads)], dtype=torch.float32)


def _layer_index(node: fx.Node) -> int | None:
    """The decoder layer index from the module path (``...layers.3.self_attn``)."""
    for path, _ in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
        parts = str(path).replace("[", ".").replace("]", "").replace("'", "").split(".")
        for prev, part in zip(parts, parts[1:]):
            if prev in ("layers", "h", "layer", "blocks") and part.isdigit():
                return int(part)
    return None


def _num_layers(gm: fx.GraphModule) -> int:
    indices = [i for n in gm.graph.nodes if _is(n, *_SDPA)
               if (i := _layer_index(n)) is not None]
    return max(indices) + 1 if indices else 1


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
        args = (q, k, v, slope, scale, None, DEFAULT_BLOCK_SIZE, DEFAULT_CHECKPOINT_EVERY,
                resolve_impl("auto", q_val.device))
        call = graph.call_function(op, args)
        call.meta["val"] = _fake(op, *args)
        out = graph.call_function(operator.getitem, (call, 0))
        out.meta["val"] = call.meta["val"][0]
    for new in (slope, call, out):
        new.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
        new.meta["graphopt_replaced"] = [node.name]
    return out


def _fake(target: Any, *args: Any, **kwargs: Any) -> Any:
    """``meta['val']`` for a new node: the target run on its inputs' fake values."""
    vals = torch.fx.node.map_arg(args, lambda n: n.meta["val"])
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    assert mode is not None
    with mode:
        return target(*vals, **kwargs)


@register_pass
@dataclass(frozen=True)
class AttentionPass(GraphPass):
    """See the module docstring."""

    name = "attention"
    stage = "pre_autograd"
    mode: str = "keep"
    every: int = 1
    norm: str = "rms"

    @property
    def exact(self) -> bool:  # type: ignore[override]
        """Exact unless it converts softmax attention (mode "lightning")."""
        return self.mode != "lightning"

    @classmethod
    def from_config(cls, config: Any) -> AttentionPass:
        return cls(mode=config.attention, every=config.lightning.every,
                   norm=config.lightning.norm)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        sdpa_sites = [n for n in graph.nodes if _is(n, *_SDPA)]
        for node in graph.nodes:
            if (_is(node, *_SDPA) and self.mode != "lightning") or \
                    is_handwritten_softmax_attention(node):
                note = "; only SDPA is converted" if self.mode == "lightning" else ""
                ctx.record("kept", site_name(node),
                           f"softmax attention (attention='{self.mode}'{note})")
        env = self._input_env(gm, ctx)
        self._env.clear()
        self._env.update(env)
        modified = False
        in_loops: set[fx.Node] = set()  # per-block pieces of loops: not parallel forms
        for cat in [n for n in graph.nodes if _is(n, aten.cat.default)]:
            try:
                loop = match_minimax_loop(cat)
            except NoMatch:
                continue  # not loop-shaped at all: nothing to report
            in_loops.update(b.intra for b in loop.blocks)
            site = site_name(cat)
            if self.mode == "keep":
                ctx.record("kept", site, "linear-attention block loop (attention='keep')")
                continue
            try:
                _check_decays(loop, env)
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
            graph.eliminate_dead_code()
        for node in [n for n in graph.nodes if _is(n, aten.matmul.default)]:
            if node in in_loops or node.graph is not graph or not node.users:
                continue
            try:
                form = match_parallel_form(node)
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
                slopes = _decay_slopes(form.decay, int(q_val.shape[1]), env)
            except NoMatch as exc:
                ctx.record("skipped", site, str(exc))
                continue
            self._rewrite_parallel(gm, node, form, slopes)
            ctx.record("rewritten", site, f"parallel form (S {int(q_val.shape[2])}) -> "
                       "graphopt::lightning_attention")
            modified = True
        if self.mode == "lightning":
            for node in sdpa_sites:
                reason = self._convert_softmax(gm, node)
                done = reason.startswith("APPROXIMATE")
                ctx.record("rewritten" if done else "skipped", site_name(node), reason)
                modified = modified or done
        if modified:
            graph.eliminate_dead_code()
        return PassResult(gm, modified)

    _env: dict[fx.Node, Any] = field(default_factory=dict, compare=False, repr=False)

    def _convert_softmax(self, gm: fx.GraphModule, node: fx.Node) -> str:
        """Replace one SDPA node; returns the report reason ("APPROXIMATE..." when done)."""
        names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale"]
        args: dict[str, Any] = dict(zip(names, node.args)) | dict(node.kwargs)
        if node.target is not aten.scaled_dot_product_attention.default:
            return f"kept: {node.target} is not the composite SDPA op"
        mask = args.get("attn_mask")
        if mask is not None:
            problem = _not_constant_causal(mask, self._env)
            if problem:
                return f"kept: {problem}"
        elif not args.get("is_causal", False):
            return "kept: non-causal attention is not converted to causal Lightning Attention"
        if args.get("dropout_p", 0.0) not in (0, 0.0):
            return "kept: attention dropout > 0 (training dropout)"
        q, k, v = args["query"], args["key"], args["value"]
        q_val, k_val = tensor_meta(q), tensor_meta(k)
        if q_val is None or k_val is None or q_val.dim() != 4:
            return "kept: operands are not [B, H, S, D]"
        if q_val.shape[2] != k_val.shape[2]:
            return "kept: query length != key length (KV cache); causal alignment differs"
        if q_val.shape[1] % k_val.shape[1]:
            return "kept: query heads are not a multiple of key heads"
        layer = _layer_index(node)
        if self.every > 1 and layer is not None and (layer + 1) % self.every == 0:
            return f"kept: layer {layer} keeps softmax attention (lightning.every={self.every})"
        heads, dim = int(q_val.shape[1]), int(q_val.shape[3])
        scale = args.get("scale") or 1.0 / dim**0.5
        slopes = minimax_slopes(heads, layer or 0, _num_layers(gm))
        self._insert_lightning(gm, node, q, k, v, slopes, float(scale))
        return (f"APPROXIMATE: softmax -> Lightning Attention (MiniMax slopes, norm "
                f"{self.norm}, layer {layer})")

    def _insert_lightning(self, gm: fx.GraphModule, node: fx.Node, q: fx.Node, k: fx.Node,
                          v: fx.Node, slopes: torch.Tensor, scale: float) -> None:
        """Replace softmax attention ``node`` by Lightning Attention (+ RMS norm)."""
        out = _insert_with_frozen_slopes(gm, node, q, k, v, slopes, scale)
        if self.norm == "rms":
            dim = [int(out.meta["val"].shape[3])]
            with gm.graph.inserting_after(out):
                norm = gm.graph.call_function(aten.rms_norm.default, (out, dim))
            norm.meta.update(out.meta, val=_fake(aten.rms_norm.default, out, dim))
            out = norm
        node.replace_all_uses_with(out)

    @staticmethod
    def _rewrite_parallel(gm: fx.GraphModule, node: fx.Node, form: _ParallelForm,
                          slopes: torch.Tensor) -> None:
        node.replace_all_uses_with(
            _insert_with_frozen_slopes(gm, node, form.q, form.k, form.v, slopes, 1.0))

    @staticmethod
    def _input_env(gm: fx.GraphModule, ctx: PassContext) -> dict[fx.Node, Any]:
        inputs = ctx.extras.get("example_inputs") or []
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        return {p: x for p, x in zip(placeholders, inputs)}

    @staticmethod
    def _rewrite(gm: fx.GraphModule, cat: fx.Node, loop: _Loop) -> None:
        from graphopt.kernels.lightning.op import resolve_impl

        graph = gm.graph
        q_val = tensor_meta(loop.q)
        assert q_val is not None
        heads = int(q_val.shape[1])
        impl = resolve_impl("auto", q_val.device)
        op = torch.ops.graphopt.lightning_attention_fwd.default
        with graph.inserting_before(cat):
            slope = graph.call_function(aten.view.default, (loop.slope, [heads]))
            slope.meta["val"] = _fake(aten.view.default, loop.slope, [heads])
            # The result does not depend on the block length (exact math); use the kernel's.
            args = (loop.q, loop.k, loop.v, slope, 1.0, None, DEFAULT_BLOCK_SIZE,
                    DEFAULT_CHECKPOINT_EVERY, impl)
            call = graph.call_function(op, args)
            call.meta["val"] = _fake(op, *args)
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
                    new_state.meta["val"] = _fake(aten._to_copy.default, outs[1],
                                                  dtype=want.dtype)
            state.replace_all_uses_with(new_state)
