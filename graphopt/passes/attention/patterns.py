"""Graph patterns of the attention pass: what counts as a MiniMax block loop, a quadratic
"parallel form", a causal softmax-attention site, and the numeric checks (decays, causal
masks) that decide whether a match may be rewritten. Matchers raise :class:`NoMatch` with the
reason the report shows; nothing here edits a graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from graphopt.passes.fx_utils import tensor_meta

aten = torch.ops.aten
SDPA_OPS = {aten.scaled_dot_product_attention.default,
         aten._scaled_dot_product_flash_attention_for_cpu.default,
         aten._scaled_dot_product_efficient_attention.default,
         aten._scaled_dot_product_flash_attention.default}


class NoMatch(Exception):
    """The chain is not the pattern; the message is the reason for the report."""


def is_call(node: Any, *targets: Any) -> bool:
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
class BlockLoop:
    q: fx.Node
    k: fx.Node
    v: fx.Node
    slope: fx.Node
    blocks: list[_Block]
    final_state: fx.Node | None
    checks: list[tuple[fx.Node, str, int]]  # (decay node, kind, block length)


def _seq_slice(node: Any) -> tuple[fx.Node, int, int]:
    """(base, start, end) of ``base[:, :, start:end]``; a whole-range slice is an alias."""
    if is_call(node, aten.alias.default):
        val = tensor_meta(_arg(node, 0))
        if val is None or val.dim() != 4:
            raise NoMatch("block operand is not a [B, H, S, D] tensor")
        return _arg(node, 0), 0, int(val.shape[2])
    if not is_call(node, aten.slice.Tensor) or _arg(node, 1) not in (2, -2):
        raise NoMatch("block operand is not a slice of the sequence dimension")
    base, start, end = _arg(node, 0), _arg(node, 2) or 0, _arg(node, 3)
    val = tensor_meta(base)
    if val is None or not isinstance(start, int) or not isinstance(end, int):
        raise NoMatch("block bounds are not static integers")
    return base, start, min(end, int(val.shape[2]))


def _split_product(node: Any, target: Any) -> tuple[Any, Any]:
    if not is_call(node, target):
        found = node.target if isinstance(node, fx.Node) else node
        raise NoMatch(f"expected {target}, found {found}")
    return _arg(node, 0), _arg(node, 1)


def _match_output(o: Any) -> _Block:
    """o = (Q_b * qd) @ S_in + ((Q_b @ K_b^T) * dd) @ V_b (either order of the sum)."""
    if not is_call(o, aten.add.Tensor):
        raise NoMatch("block output is not inter + intra")
    for inter, intra in ((_arg(o, 0), _arg(o, 1)), (_arg(o, 1), _arg(o, 0))):
        try:
            scaled_q, state = _split_product(inter, aten.matmul.default)
            q_b, qd = _split_product(scaled_q, aten.mul.Tensor)
            weights, v_b = _split_product(intra, aten.matmul.default)
            qk, dd = _split_product(weights, aten.mul.Tensor)
            q_b2, k_t = _split_product(qk, aten.matmul.default)
            if q_b2 is not q_b or not is_call(k_t, aten.transpose.int) or \
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
    if not is_call(new, aten.add.Tensor):
        raise NoMatch("state update is not decayed state + K^T V")
    for decayed, kv in ((_arg(new, 0), _arg(new, 1)), (_arg(new, 1), _arg(new, 0))):
        if not (is_call(decayed, aten.mul.Tensor) and is_call(kv, aten.matmul.default)):
            continue
        s_in, bd = decayed.args
        if s_in is not block.state_in:
            s_in, bd = bd, s_in
        kt, v_b = kv.args
        if s_in is not block.state_in or not is_call(kt, aten.transpose.int):
            continue
        k_scaled = _arg(kt, 0)
        if not is_call(k_scaled, aten.mul.Tensor) or _seq_slice(v_b)[0] is not block.v:
            continue
        k_b, kd = k_scaled.args
        if _seq_slice(k_b)[0] is not block.k:
            continue
        if not (is_call(bd, aten.exp.default) and is_call(_arg(bd, 0), aten.mul.Tensor)
                and is_call(_arg(_arg(bd, 0), 0), aten.neg.default)):
            raise NoMatch("block decay is not exp(-slope * L)")
        return _arg(_arg(_arg(bd, 0), 0), 0), bd, kd
    raise NoMatch("state update does not read this block's K and V")


def match_minimax_loop(cat: fx.Node) -> BlockLoop:
    """Match ``torch.cat(per-block outputs, dim=-2)`` of a MiniMax-style block loop."""
    outputs = _arg(cat, 0)
    if len(cat.args) < 2 or _arg(cat, 1) not in (-2, 2) or not isinstance(outputs, list) \
            or len(outputs) < 1:
        raise NoMatch("not a concatenation over the sequence dimension")
    blocks = [_match_output(o) for o in outputs]
    first = blocks[0]
    if not is_call(first.state_in, aten.zeros.default, aten.zeros_like.default,
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
        users = [u for u in blk.state_in.users if is_call(u, aten.mul.Tensor)
                 and u.users and any(is_call(w, aten.add.Tensor) for w in u.users)]
        new_state = next((w for u in users for w in u.users if is_call(w, aten.add.Tensor)), None)
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
    return BlockLoop(first.q, first.k, first.v, slope, blocks, final_state, checks)


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


def check_decays(loop: BlockLoop, env: dict[fx.Node, Any]) -> None:
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
    if not is_call(node, aten.softmax.int, aten._softmax.default):
        return False
    upstream: Any = node.args[0]
    for _ in range(6):
        if is_call(upstream, aten.matmul.default):
            if not is_call(_arg(upstream, 1), aten.transpose.int, aten.permute.default):
                return False
            break
        if not is_call(upstream, *_PASS_THROUGH):
            return False
        upstream = next((a for a in upstream.args if _is_batched(a)), None)
    else:
        return False
    frontier = [node]
    for _ in range(4):
        users = [u for n in frontier for u in n.users]
        if any(is_call(u, aten.matmul.default) for u in users):
            return True
        frontier = [u for u in users if is_call(u, *_PASS_THROUGH)]
    return False


@dataclass
class ParallelForm:
    q: fx.Node
    k: fx.Node
    v: fx.Node
    decay: fx.Node


def match_parallel_form(node: fx.Node) -> ParallelForm:
    """``matmul((matmul(Q, K^T)) * D, V)`` over [B, H, S, X] tensors, D a square mask."""
    weights, v = _split_product(node, aten.matmul.default)
    if not is_call(weights, aten.mul.Tensor):
        raise NoMatch("not a masked product")
    for qk, decay in ((_arg(weights, 0), _arg(weights, 1)), (_arg(weights, 1),
                                                             _arg(weights, 0))):
        if not is_call(qk, aten.matmul.default):
            continue
        q, k_t = _split_product(qk, aten.matmul.default)
        if not is_call(k_t, aten.transpose.int) or sorted([_arg(k_t, 1), _arg(k_t, 2)]) != [-2, -1]:
            raise NoMatch("scores are not Q @ K^T over the last two dims")
        k = _arg(k_t, 0)
        vals = [tensor_meta(x) for x in (q, k, v, decay)]
        if any(x is None for x in vals) or any(x.dim() != 4 for x in vals[:3]):  # type: ignore
            raise NoMatch("operands are not [B, H, S, D] tensors")
        seq_q, seq_k = vals[0].shape[2], vals[1].shape[2]  # type: ignore[union-attr]
        if seq_q != seq_k:
            raise NoMatch("query length differs from key length (decode); causal alignment "
                          "would be ambiguous")
        return ParallelForm(q, k, v, decay)
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


def _is_buffer(node: fx.Node, env: dict[fx.Node, Any]) -> bool:
    """A graph input that is a module buffer (Dynamo source ``..._buffers[...]``) with a known
    value. Buffers are treated as constants of the model: a causal mask or decay read from one
    is frozen at compile time (a model that rewrites such a buffer in place is not supported)."""
    value = env.get(node)
    source = node.meta.get("grapharg")
    name = str(getattr(getattr(source, "source", None), "name", ""))
    return isinstance(value, torch.Tensor) and not value.requires_grad and "_buffers" in name


def decay_slopes(decay: fx.Node, heads: int, env: dict[fx.Node, Any]) -> torch.Tensor:
    """Slopes s_h with D = exp(-s_h (i - j)) masked causal; refuse anything else."""
    for n in _ancestors(decay):
        if n.op == "placeholder" and not _is_buffer(n, env):
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


def not_constant_causal(mask: fx.Node, env: dict[fx.Node, Any], blocked: bool = False) -> str:
    """"" when ``mask`` is provably the causal mask for every call of this graph: it is built
    from constants only (no graph input: so no padding mask, no symbolic size) and evaluates to
    True / 0 on and below the diagonal and False / -inf (or < -1e30) above (a boolean mask
    with ``blocked=True``, as ``masked_fill`` takes it: False on and below, True above).
    Else the reason."""
    for n in _ancestors(mask):
        if n.op == "placeholder" and not _is_buffer(n, env):
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
    if m.dtype == torch.bool:
        m = ~m if blocked else m
        allowed, masked = m, ~m
    else:
        allowed, masked = (m == 0), (m < -1e30)
    if not (bool((allowed == lower).all()) and bool((masked == ~lower).all())):
        return "the attention mask is not the causal (lower-triangular) mask"
    return ""


def minimax_slopes(heads: int, layer: int, num_layers: int, kind: str = "minimax"
                   ) -> torch.Tensor:
    """Per-head decay rates [heads] (float32) as MiniMax-01 assigns them: ALiBi's geometric
    slopes 2^(-8 (h + 1) / H) (Press et al. 2022), scaled by the layer's depth factor
    1 - layer / (num_layers - 1) (+1e-5 so the last layer keeps a small decay).
    ``kind="alibi"``: the geometric slopes alone (no depth factor)."""
    base = 2.0 ** (-8.0 / heads)
    factor = 1.0 if kind == "alibi" else 1.0 - layer / (num_layers - 1 + 1e-5) + 1e-5
    return torch.tensor([base ** (h + 1) * factor for h in range(heads)], dtype=torch.float32)


def layer_index(node: fx.Node) -> int | None:
    """The decoder layer index from the module path (``...layers.3.self_attn``)."""
    for path, _ in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
        parts = str(path).replace("[", ".").replace("]", "").replace("'", "").split(".")
        for prev, part in zip(parts, parts[1:]):
            if prev in ("layers", "h", "layer", "blocks") and part.isdigit():
                return int(part)
    return None


def module_path(node: fx.Node) -> str:
    """The innermost module path of a node (``model.layers.0.self_attn``), "" if unknown."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = str(list(stack.values())[-1][0]).replace("L['self'].", "").replace("L__self___", "")
    return path.replace("['", ".").replace("']", "").replace("[", ".").replace("]", "")


def num_layers(gm: fx.GraphModule) -> int:
    """1 + the largest decoder-layer index of an attention site (SDPA or hand-written)."""
    indices = [i for n in gm.graph.nodes
               if is_call(n, *SDPA_OPS) or is_handwritten_softmax_attention(n)
               if (i := layer_index(n)) is not None]
    return max(indices) + 1 if indices else 1


_CASTS = {aten.to.dtype, aten._to_copy.default, aten.clone.default, aten.alias.default,
          aten.contiguous.default, aten.to.dtype_layout}
_NEG_INF = -1e30  # a fill value at or below this blocks a position (finfo.min, -inf)


@dataclass
class SoftmaxAttention:
    """softmax(Q K^T * scale [+ causal mask]) @ V written out op by op.

    q: [B, Hq, S, D]; k: [B, Hk, S, D] and v: [B, Hk, S, Dv] before ``repeat_kv`` when both
    are repeated the same way (GQA/MQA); ``output`` is the ``P @ V`` matmul node."""

    q: fx.Node
    k: fx.Node
    v: fx.Node
    scale: float
    output: fx.Node


def _constant_scalar(node: Any, env: dict[fx.Node, Any], what: str) -> float:
    """A Python number, or a one-element tensor computed from constants/buffers only."""
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return float(node)
    if not isinstance(node, fx.Node):
        raise NoMatch(f"{what} is {node!r}, not a number")
    for n in _ancestors(node):
        if n.op == "placeholder" and not _is_buffer(n, env):
            raise NoMatch(f"{what} depends on a graph input or a trainable parameter; only "
                          "constants and buffers are folded into the kernel")
    try:
        value = _evaluate(node, env)
    except NoMatch:
        raise
    except Exception as exc:
        raise NoMatch(f"{what} could not be evaluated ({type(exc).__name__})") from exc
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise NoMatch(f"{what} is not a single number (a per-position or per-head tensor)")
    return float(value.reshape(()))


def _k_transposed(k_t: Any) -> fx.Node:
    """K from K^T; refuses permutes that are not a swap of the last two dims."""
    val = tensor_meta(k_t) if isinstance(k_t, fx.Node) else None
    if val is None or val.dim() != 4:
        raise NoMatch("scores are not a product of [B, H, S, D] tensors")
    if is_call(k_t, aten.transpose.int):
        dims = sorted(int(d) % 4 for d in k_t.args[1:3])
        if dims == [2, 3]:
            return k_t.args[0]  # type: ignore[return-value]
        raise NoMatch(f"K operand is transpose{tuple(k_t.args[1:3])}, not a transpose of the "
                      "last two dims: the product is not Q K^T")
    if is_call(k_t, aten.permute.default):
        dims = [int(d) % 4 for d in k_t.args[1]]  # type: ignore[union-attr]
        if dims == [0, 1, 3, 2]:
            return k_t.args[0]  # type: ignore[return-value]
        raise NoMatch(f"K operand is permute{tuple(dims)}, not a transpose of the last two "
                      "dims: the product is not Q K^T")
    raise NoMatch("the second factor of the scores is not a transposed K")


def _unrepeat(x: fx.Node) -> tuple[fx.Node, int]:
    """(kv, n) for transformers' ``repeat_kv``: reshape(expand(kv[:, :, None], [B, Hk, n, S,
    D]), [B, Hk * n, S, D]); (x, 1) for anything else."""
    if not is_call(x, aten.reshape.default, aten.view.default, aten._unsafe_view.default):
        return x, 1
    expand: Any = x.args[0]
    if not is_call(expand, aten.expand.default) or \
            not is_call(expand.args[0], aten.unsqueeze.default) or \
            int(expand.args[0].args[1]) % 5 != 2:
        return x, 1
    base: fx.Node = expand.args[0].args[0]
    bval, eval_, xval = tensor_meta(base), tensor_meta(expand), tensor_meta(x)
    if bval is None or eval_ is None or xval is None or bval.dim() != 4:
        return x, 1
    b, hk, s, d = bval.shape
    if tuple(eval_.shape) != (b, hk, eval_.shape[2], s, d) or \
            tuple(xval.shape) != (b, hk * eval_.shape[2], s, d):
        return x, 1
    return base, int(eval_.shape[2])


def match_softmax_attention(softmax: fx.Node, env: dict[fx.Node, Any]) -> SoftmaxAttention:
    """Match hand-written causal softmax attention around ``softmax`` (GPT-2's and Llama's
    ``eager`` attention): scale by a multiply, a divide or a one-element constant tensor;
    the causal mask added (float), ``masked_fill``-ed or ``where``-selected (bool), proven
    causal by evaluation; casts and dropout with p = 0 after the softmax; GQA through
    ``repeat_kv``. Raises NoMatch with the reason for anything else."""
    if not is_call(softmax, aten.softmax.int, aten._softmax.default):
        raise NoMatch("not a softmax")
    val = tensor_meta(softmax)
    if val is None or int(softmax.args[1]) % val.dim() != val.dim() - 1:  # type: ignore
        raise NoMatch("softmax is not over the last (key) dimension")
    scale, mask, qk = _scores(softmax.args[0], env)  # type: ignore[arg-type]
    if mask is None:
        raise NoMatch("no attention mask: non-causal attention is not converted to causal "
                      "Lightning Attention")
    mask_node, blocked = mask
    problem = not_constant_causal(mask_node, env, blocked=blocked)
    if problem:
        raise NoMatch(problem)
    output = _probabilities_times_v(softmax)
    q, k = qk.args[0], _k_transposed(qk.args[1])
    v = output.args[1]
    vals = [tensor_meta(x) if isinstance(x, fx.Node) else None for x in (q, k, v)]
    if any(x is None or x.dim() != 4 for x in vals):
        raise NoMatch("q, k, v are not [B, H, S, D] tensors")
    if vals[0].shape[2] != vals[1].shape[2]:  # type: ignore[union-attr]
        raise NoMatch("query length != key length (KV cache); causal alignment differs")
    (k0, nk), (v0, nv) = _unrepeat(k), _unrepeat(v)  # type: ignore[arg-type]
    if nk == nv and nk > 1:
        k, v = k0, v0
    return SoftmaxAttention(q, k, v, scale, output)  # type: ignore[arg-type]


def _scores(x: fx.Node, env: dict[fx.Node, Any]
            ) -> tuple[float, tuple[fx.Node, bool] | None, fx.Node]:
    """Walk from the softmax input up to ``Q @ K^T``: (scale, (mask, blocked) or None, qk)."""
    scale, mask = 1.0, None

    def set_mask(node: fx.Node, blocked: bool) -> None:
        nonlocal mask
        if mask is not None:
            raise NoMatch("two masks on the scores")
        mask = (node, blocked)

    for _ in range(12):
        if is_call(x, aten.matmul.default):
            return scale, mask, x
        if is_call(x, *_CASTS):
            x = x.args[0]  # type: ignore[assignment]
        elif is_call(x, aten.mul.Tensor, aten.div.Tensor):
            a, b = x.args
            if not (isinstance(a, fx.Node) and _is_batched(a)):
                a, b = b, a
            if x.target is aten.div.Tensor and a is not x.args[0]:
                raise NoMatch("scores divide a tensor (not a scale)")
            factor = _constant_scalar(b, env, "the scale")
            scale = scale * factor if x.target is aten.mul.Tensor else scale / factor
            x = a  # type: ignore[assignment]
        elif is_call(x, aten.add.Tensor):
            a, b = x.args
            if _leads_to_scores(b) and not _leads_to_scores(a):
                a, b = b, a
            if not isinstance(b, fx.Node):
                raise NoMatch("a constant is added to the scores")
            set_mask(b, blocked=False)
            x = a  # type: ignore[assignment]
        elif is_call(x, aten.masked_fill.Scalar):
            if _constant_scalar(x.args[2], env, "the fill value") > _NEG_INF:
                raise NoMatch("masked_fill with a finite value is not a mask")
            set_mask(x.args[1], blocked=True)  # type: ignore[arg-type]
            x = x.args[0]  # type: ignore[assignment]
        elif is_call(x, aten.where.self, aten.where.ScalarOther):
            cond, a, other = x.args
            if _constant_scalar(other, env, "the masked value") > _NEG_INF:
                raise NoMatch("where() with a finite value is not a mask")
            set_mask(cond, blocked=False)  # type: ignore[arg-type]
            x = a  # type: ignore[assignment]
        else:
            target = getattr(x, "target", x)
            raise NoMatch(f"the scores pass through {target}, which is not a scale, mask or "
                          "cast")
    raise NoMatch("softmax input is not Q @ K^T")


def _leads_to_scores(node: Any) -> bool:
    """True when ``node`` is (casts/scales/masks of) a matmul: the scores side of an add."""
    for _ in range(12):
        if is_call(node, aten.matmul.default):
            return True
        if not is_call(node, *_CASTS, aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor,
                       aten.masked_fill.Scalar):
            return False
        node = next((a for a in node.args if isinstance(a, fx.Node) and _is_batched(a)), None)
    return False


def _probabilities_times_v(softmax: fx.Node) -> fx.Node:
    """The ``P @ V`` matmul fed by the softmax through casts and inactive dropout."""
    node = softmax
    for _ in range(6):
        users = [u for u in node.users if is_call(u, aten.matmul.default) and u.args[0] is node]
        if users:
            return users[0]
        nxt = [u for u in node.users if is_call(u, *_CASTS, aten.dropout.default)]
        if not nxt:
            break
        node = nxt[0]
        if is_call(node, aten.dropout.default):
            p, train = _arg(node, 1), _arg(node, 2)
            if train is not False and p not in (0, 0.0):
                raise NoMatch("attention dropout > 0 (training dropout)")
    raise NoMatch("the probabilities do not feed a matmul with V")
