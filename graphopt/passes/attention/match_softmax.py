"""Softmax-attention patterns of the attention pass: which nodes are softmax-attention sites,
what a convertible site binds (q, k, v, scale), and the proof that a mask is causal.

One detector = the matcher. :func:`match_softmax_attention_site` is the only matcher; its
first step, :func:`is_softmax_attention_site`, is also how the pass finds sites. A node that
passes the first step is a *site*: every later refusal raises :class:`NoMatch` with the
reason, so a site is always either converted or reported with why not. Only that first step
raises :class:`NotASite` (nothing to report: a router's softmax, a plain matmul).

A site is
    an SDPA call (any of ``SDPA_OPS``; only the composite op is converted), or
    a softmax over scores computed from a product (matmul, bmm, mm, baddbmm, einsum)
    through ops that keep the scores' [.., Sq, Sk] shape, whose probabilities reach a
    product through such ops (``softmax(Q K^T ...) ... @ V`` in any spelling).
Convertible (hand-written, :func:`match_handwritten_softmax_attention`):
    softmax(Q @ K^T [* or / scale] [+ mask]) [casts, dropout p=0] @ V over [B, H, S, D],
    scale a number or a one-element tensor (constants and buffers are folded; one computed
    from a graph input or a trainable parameter is kept as a run-time factor, see
    ``SoftmaxAttention.factors``), K^T a transpose(-2, -1) or
    permute(0, 1, 3, 2), the mask added (float), ``masked_fill``-ed or ``where``-selected
    (bool) and proven causal by :func:`not_constant_causal`; GQA through ``repeat_kv``.
"""

from __future__ import annotations

import math
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
    is_batched,
    is_buffer,
    is_call,
    layer_index,
    written_in_place,
)
from graphopt.passes.attention.match_symbolic import hinted
from graphopt.passes.fx_utils import size_hint, tensor_meta

SDPA_OPS = {aten.scaled_dot_product_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention.default}
_SOFTMAX = (aten.softmax.int, aten._softmax.default)
_PRODUCTS = (aten.matmul.default, aten.bmm.default, aten.mm.default, aten.baddbmm.default,
             aten.einsum.default)
_CASTS = {aten.to.dtype, aten._to_copy.default, aten.clone.default, aten.alias.default,
          aten.contiguous.default, aten.to.dtype_layout}
_NEG_INF = -1e30  # a fill value at or below this blocks a position (finfo.min, -inf)


def _blocking(dtype: torch.dtype | None) -> float:
    """The largest fill value that blocks a position in a ``dtype`` mask: ``_NEG_INF``, or
    the dtype's own ``finfo.min`` (transformers' masks: float16's -65504 was not proven
    causal, a review's false refusal)."""
    if dtype is not None and dtype.is_floating_point:
        return max(_NEG_INF, torch.finfo(dtype).min)
    return _NEG_INF
_SITE_DEPTH = 12  # ops between the softmax and each product; >= every walk of the matcher


class NotASite(NoMatch):
    """The node is not a softmax-attention site at all; nothing to report."""


@dataclass
class SoftmaxAttention:
    """softmax(Q K^T * scale [+ causal mask]) @ V, hand-written or as one SDPA call.

    q: [B, Hq, S, D]; k: [B, Hk, S, D] and v: [B, Hk, S, Dv] before ``repeat_kv`` when both
    are repeated the same way (GQA/MQA); ``output`` is the ``P @ V`` matmul (or SDPA) node."""

    q: fx.Node
    k: fx.Node
    v: fx.Node
    scale: float
    output: fx.Node
    factors: tuple[tuple[fx.Node, bool], ...] = ()
    """Scale factors known only when the graph runs, as ``(node, divides)``: a one-element
    tensor computed from a graph input (``dynamic=True`` lifts float module attributes such
    as transformers' ``self.scaling`` to graph inputs) or a trainable temperature. The
    conversion multiplies (divides) ``phi(q)`` by each, so they stay live and differentiable;
    the constant part is ``scale``."""


def _reaches_product(start: list[fx.Node], step: str, shape: tuple[int, ...] | None
                     ) -> bool:
    """True when a product is among ``start`` or reached from it by following ``step``
    ("all_input_nodes" or "users") through call_function nodes of the scores' shape (any
    shape for None)."""
    frontier, seen = start, set(start)
    for _ in range(_SITE_DEPTH):
        calls = [n for n in frontier if n.op == "call_function"]
        if any(is_call(n, *_PRODUCTS) for n in calls):
            return True
        frontier = []
        for n in calls:
            val = tensor_meta(n)
            if shape is not None and (val is None or val.dim() < 2 or
                                      tuple(val.shape[-2:]) != shape):
                continue
            for m in getattr(n, step):
                if m not in seen:
                    seen.add(m)
                    frontier.append(m)
    return False


def is_softmax_attention_site(node: fx.Node) -> bool:
    """The first step of :func:`match_softmax_attention_site`: an SDPA call, or a softmax of
    scores computed from a product whose probabilities feed a product (see module doc)."""
    if is_call(node, *SDPA_OPS):
        return True
    val = tensor_meta(node)
    if not is_call(node, *_SOFTMAX) or val is None or val.dim() < 2 or \
            not isinstance(node.args[0], fx.Node):
        return False
    shape = tuple(val.shape[-2:])
    return _reaches_product([node.args[0]], "all_input_nodes", shape) and \
        _reaches_product(list(node.users), "users", shape)


def attention_like_softmaxes(graph: fx.Graph) -> list[fx.Node]:
    """Softmaxes over [B, H, S_q, S_k]-like (4-d or more) scores that sit between products
    as attention does but are not :func:`is_softmax_attention_site` (the scores change shape
    between the products: GPT-OSS concatenates learned sinks to them and drops the sink
    column after). Mode "lightning" reports them as kept: a review saw GPT-OSS left as it
    was with nothing in the report."""
    out = []
    for n in graph.nodes:
        val = tensor_meta(n)
        if not is_call(n, *_SOFTMAX) or val is None or val.dim() < 4 or \
                not isinstance(n.args[0], fx.Node) or is_softmax_attention_site(n):
            continue
        if _reaches_product([n.args[0]], "all_input_nodes", None) and \
                _reaches_product(list(n.users), "users", None):
            out.append(n)
    return out


def softmax_attention_sites(graph: fx.Graph) -> list[fx.Node]:
    """Every softmax-attention site of ``graph``, in graph order."""
    return [n for n in graph.nodes if is_softmax_attention_site(n)]


Outer = dict[fx.Node, tuple[fx.Node, dict[fx.Node, Any]]]
"""A checkpoint body's placeholder -> (the parent's node that feeds it, the parent's values):
``ctx.extras["outer"]`` (graphopt/passes/regions.py)."""


def built_where(node: fx.Node, env: dict[fx.Node, Any], outer: Outer | None
                ) -> tuple[fx.Node, dict[fx.Node, Any]]:
    """Where ``node``'s value is built: (the parent's node, a copy of the parent's values)
    for a checkpoint body's input, else (``node``, a copy of ``env``)."""
    if written_in_place(node) is not None:  # written inside the region: not the parent's value
        return node, dict(env)
    built, values = (outer or {}).get(node, (node, env))
    return built, dict(values)


def num_decoder_layers(gm: fx.GraphModule) -> int:
    """1 + the largest decoder-layer index of a softmax-attention site of ``gm`` or its
    checkpoint bodies (1 if none known)."""
    from graphopt.passes.regions import all_graph_modules

    indices = [i for g in all_graph_modules(gm) for n in softmax_attention_sites(g.graph)
               if (i := layer_index(n)) is not None]
    return max(indices) + 1 if indices else 1


def match_softmax_attention_site(node: fx.Node, env: dict[fx.Node, Any],
                                 outer: Outer | None = None) -> SoftmaxAttention:
    """Match a causal softmax-attention site convertible to Lightning Attention.

    Raises NotASite when ``node`` is not a site, NoMatch with the reason for a site that is
    not convertible (non-causal, padding mask, dropout, KV cache, not Q K^T, ...)."""
    if not is_softmax_attention_site(node):
        raise NotASite(f"{node.name} is not a softmax-attention site")
    if is_call(node, *SDPA_OPS):
        return match_sdpa_causal(node, env, outer)
    return match_handwritten_softmax_attention(node, env, outer)


def match_sdpa_causal(node: fx.Node, env: dict[fx.Node, Any], outer: Outer | None = None
                      ) -> SoftmaxAttention:
    """``scaled_dot_product_attention`` with ``is_causal`` or a mask proven causal (where it
    is built: :func:`built_where`), no dropout, query length = key length."""
    names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale"]
    args: dict[str, Any] = dict(zip(names, node.args)) | dict(node.kwargs)
    if node.target is not aten.scaled_dot_product_attention.default:
        raise NoMatch(f"{node.target} is not the composite SDPA op")
    q, k, v = args["query"], args["key"], args["value"]
    q_val, k_val = tensor_meta(q), tensor_meta(k)
    if q_val is None or k_val is None or q_val.dim() != 4:
        raise NoMatch("operands are not [B, H, S, D]")
    if q_val.shape[2] != k_val.shape[2]:  # first: a decode step is not "non-causal"
        raise NoMatch(LENGTHS_DIFFER)
    mask = args.get("attn_mask")
    if mask is not None:
        problem = not_constant_causal(*built_where(mask, env, outer))
        if problem:
            raise NoMatch(problem)
    elif not args.get("is_causal", False):
        raise NoMatch("non-causal attention is not converted to causal Lightning Attention")
    if args.get("dropout_p", 0.0) not in (0, 0.0):
        raise NoMatch("attention dropout > 0 (training dropout)")
    scale = args.get("scale")
    if isinstance(scale, fx.Node):  # a SymFloat under dynamic=True (numbers are not written)
        return SoftmaxAttention(q, k, v, 1.0, node, ((scale, False),))
    return SoftmaxAttention(q, k, v, float(scale or 1.0 / int(q_val.shape[3]) ** 0.5), node)


def match_handwritten_softmax_attention(softmax: fx.Node, env: dict[fx.Node, Any],
                                        outer: Outer | None = None) -> SoftmaxAttention:
    """Match hand-written causal softmax attention around ``softmax`` (GPT-2's and Llama's
    ``eager`` attention): scale by a multiply, a divide or a one-element constant tensor;
    the causal mask added (float), ``masked_fill``-ed or ``where``-selected (bool), proven
    causal by evaluation; casts and dropout with p = 0 after the softmax; GQA through
    ``repeat_kv``. Raises NoMatch with the reason for anything else."""
    if not is_call(softmax, *_SOFTMAX):
        raise NoMatch("not a softmax")
    val = tensor_meta(softmax)
    if val is None or int(softmax.args[1]) % val.dim() != val.dim() - 1:  # type: ignore
        raise NoMatch("softmax is not over the last (key) dimension")
    scale, factors, mask, qk = _scores(softmax.args[0], env)  # type: ignore[arg-type]
    if mask is None:
        raise NoMatch("no attention mask: non-causal attention is not converted to causal "
                      "Lightning Attention")
    mask_node, blocked = mask
    problem = not_constant_causal(*built_where(mask_node, env, outer), blocked=blocked,
                                  outer=outer)
    if problem:
        raise NoMatch(problem)
    output = _probabilities_times_v(softmax)
    q, k = qk.args[0], _k_transposed(qk.args[1])
    v = output.args[1]
    vals = [tensor_meta(x) if isinstance(x, fx.Node) else None for x in (q, k, v)]
    if any(x is None or x.dim() != 4 for x in vals):
        raise NoMatch("q, k, v are not [B, H, S, D] tensors")
    if vals[0].shape[2] != vals[1].shape[2]:  # type: ignore[union-attr]
        raise NoMatch(LENGTHS_DIFFER)
    (k0, nk), (v0, nv) = _unrepeat(k), _unrepeat(v)  # type: ignore[arg-type]
    if nk == nv and nk > 1:
        k, v = k0, v0
    return SoftmaxAttention(q, k, v, scale, output, factors)  # type: ignore[arg-type]


LENGTHS_DIFFER = ("query length != key length (cross attention over another sequence, or a "
                  "decode step reading cached keys); causal alignment differs")
"""The reason for a site whose queries and keys differ in length (a review: BART's cross
attention was said to read a KV cache, and counted in the KV-cache warning)."""

SIZE_PROBES = (1, 2, 5, 16, 37)
"""Sizes a mask that depends on input sizes only is evaluated at (besides the example's), and
past every integer constant of its construction (see :func:`not_constant_causal`)."""

MAX_PROBED_CONSTANT = 4096
"""A size-dependent mask whose construction uses a larger integer constant (a sliding window
of 8k, say) is not accepted: probing past it would build masks of more than 8k x 8k."""


def not_constant_causal(mask: fx.Node, env: dict[fx.Node, Any], blocked: bool = False,
                        outer: Outer | None = None) -> str:
    """"" when ``mask`` is the causal mask for every call of this graph, else the reason.

    Accepted: a mask built from constants and buffers only, or from those and the *sizes* of
    graph inputs (``aten.sym_size`` of an input, or a size input of a dynamic-shape graph:
    transformers builds its causal mask from ``arange(seq)``), never from input values (a
    padding mask). It must evaluate to True / 0 on and below the diagonal and False / -inf (or
    < -1e30) above (a boolean mask with ``blocked=True``, as ``masked_fill`` takes it: False
    on and below, True above). A size-dependent mask is evaluated at the example sizes, at
    every size of SIZE_PROBES, just past each constant of its construction (scalars and
    the values of buffers of at most MAX_TABLE_CONSTANTS values, floor and ceil; a larger
    table read with the sizes is refused) and just past :func:`_threshold_bound`, where the
    constants add up (a
    sliding window of w is causal up to size w and not beyond: its w is such a constant; the
    mask of a graph is a fixed dataflow of comparisons, whose outcome changes only where a
    size crosses one of its constants). Constants over MAX_PROBED_CONSTANT are refused, and so
    is a size-dependent value built with an op outside :data:`_PROBEABLE`, in a dtype that is
    not exact for positions, with a non-integer factor or a constant of 2**31 or more
    (:func:`_not_probeable`), where that argument fails; so is a bound past DENSE_PROBES
    (every length up to the bound is probed, and each constant at c-1..c+2). A size other
    than the sequence length (:func:`_size_groups`: an int argument, another input's length)
    whose value enters the mask is refused (:func:`_value_uses`); one that only shapes or
    indexes it (transformers' batch ``expand`` and ``arange``) is probed one at a time at 1,
    2 and around the lengths. One proof per mask and pass run (cached in the mask's meta,
    keyed by its inputs). A dynamic-shape
    compile's SymInt sizes are taken at the example inputs (``hinted``).
    """
    # one proof per mask and pass run: the layers' sites share transformers' mask (a 4-layer
    # Llama proved it 8 times, 5.9 s of the attention pass)
    key = (blocked, outer is None, tuple(sorted(  # names and ids only: meta may be copied
        (n.name, id(env.get(n))) for n in ancestors(mask) if n.op in ("placeholder",
                                                                       "get_attr"))))
    cached = mask.meta.get("graphopt_causal_proof")
    if cached is not None and cached[0] == key:
        return cached[1]
    result = _not_constant_causal(mask, env, blocked, outer)
    mask.meta["graphopt_causal_proof"] = (key, result)
    return result


def _not_constant_causal(mask: fx.Node, env: dict[fx.Node, Any], blocked: bool,
                         outer: Outer | None) -> str:
    # A dynamic-shape compile passes its sizes as SymInts: take them at the example inputs
    # (computing with a SymInt specializes the graph); the probes below cover other sizes.
    env = hinted(env)
    sizes: list[fx.Node] = []
    constants: set[int] = set()
    tables: list[fx.Node] = []
    for n in ancestors(mask):
        if _is_size(n, env):
            sizes.append(n)
            continue
        value = env.get(n)
        if n.op in ("placeholder", "get_attr") and isinstance(value, torch.Tensor) and \
                not _only_sizes_read(n, mask):
            # a buffer's values are constants of the construction too (a window held in a
            # 0-d buffer); a large table sliced by the sizes is not probed (below)
            if value.numel() <= MAX_TABLE_CONSTANTS:
                constants |= _crossings(value.detach().double().flatten().tolist())
            else:
                tables.append(n)
        if n.op == "placeholder" and not is_buffer(n, env) and not _only_sizes_read(n, mask):
            if outer and n in outer:
                return ("the attention mask is derived inside a checkpoint region from an "
                        "input built outside it; the proof follows a mask passed in "
                        "unchanged, not one sliced or combined inside the region")
            # an input: a padding mask, or a causal mask built in an earlier graph (the
            # mask function graph-breaks before transformers' eager experts loop, a review)
            return ("the attention mask depends on a graph input's values (a padding mask, "
                    "or a mask built before a graph break), so it cannot be proven causal "
                    "for every call")
        if n.op == "call_function" and not isinstance(n.target, torch._ops.OpOverload):
            return (f"the attention mask is built by non-ATen code ({n.name}: "
                    f"{getattr(n.target, '__name__', n.target)}, e.g. arithmetic on sizes "
                    "or int arguments, which the proof does not follow)")
        if n.op == "call_function":
            constants |= _crossings([a for a in _flat_args(n)
                                     if isinstance(a, int | float) and not isinstance(a, bool)])
    seq, others = _size_groups(mask, sizes, env)
    used = _value_uses(mask, others)
    if used:
        return (f"the attention mask computes with {used.name}, a size other than the "
                "sequence length (an int argument, another input's length: a window or a "
                "valid length?); the proof covers every sequence length, not every value of "
                "that size")
    dependent = _size_dependent(mask, env)
    for n in sorted(dependent, key=_graph_order(mask).__getitem__):
        why = _not_probeable(n, env, dependent)
        if why:
            return (f"the attention mask reads input sizes and {why}: probing sizes cannot "
                    "prove it causal for every size")
    if sizes and tables:
        return (f"the attention mask reads input sizes and a tensor table ({tables[0].name}, "
                f"{env[tables[0]].numel()} values): probing sizes cannot prove every slice of "
                "it causal")
    if sizes and max(constants, default=0) > MAX_PROBED_CONSTANT:
        return (f"the attention mask reads input sizes and the constant "
                f"{max(constants)} (a sliding window?); masks past {MAX_PROBED_CONSTANT} are "
                "not probed, so it is not proven causal for every size")
    threshold = _threshold_bound(mask, env) if sizes else 0
    if threshold > DENSE_PROBES:  # probing between sparse points missed a band of lengths
        # (282..290) and a single length (291) past the dense range (a review)
        return (f"the attention mask reads input sizes and compares values that may cross "
                f"at sizes up to {threshold} (the sum of its constants); lengths past "
                f"{DENSE_PROBES} are not all probed, so it is not proven causal for every "
                "size")
    # every length up to the bound (bands between two comparisons' crossings: 52..59 for
    # 2 * n > 100 and 3 * n < 177, a review), then around each constant (== flips at c
    # itself) and just past the bound
    probe_sizes = sorted(set(SIZE_PROBES) | set(range(1, min(threshold, DENSE_PROBES) + 3))
                         | {c + d for c in constants for d in (-1, 0, 1, 2)
                            if 2 < c + d <= MAX_PROBED_CONSTANT + 2}
                         | {threshold + 1, threshold + 2})
    try:  # other sizes only shape the mask (the batch of an expand): their example values
        fixed = {n: int(evaluate(n, dict(env))) for n in others}
    except Exception as exc:  # noqa: BLE001 - not provable
        return f"the attention mask reads a size that could not be evaluated ({exc!r})"
    sparse = set(SIZE_PROBES) | {threshold + 1, threshold + 2} | {
        c + d for c in constants for d in (-1, 0, 1, 2) if 2 < c + d <= threshold + 2}
    probes: list[dict[fx.Node, Any]] = [env]
    for size in probe_sizes if sizes else ():
        base = {**{k: v for k, v in env.items() if k not in sizes}, **fixed,
                **{n: size for n in seq}}
        probes.append(base)
        for other in others if size in sparse else ():  # one at a time (a batch arange
            # read as index positions), at the sparse lengths
            for value in {1, 2, max(1, size - 1), size + 1} - {fixed[other]}:
                probes.append({**base, other: value})
    for probe_env in probes:
        problem = _causal_at(mask, dict(probe_env), blocked)
        if problem and sizes and probe_env is not env:
            moved = [f"{n.name}={probe_env[n]}" for n in others if probe_env[n] != fixed[n]]
            return f"{problem} (at input sizes length {probe_env[seq[0]]}" + \
                "".join(f", {m}" for m in moved) + ")"
        if problem:
            return problem
    return ""


_COMPARISONS = frozenset(("lt", "le", "gt", "ge", "eq", "ne"))


def _threshold_bound(mask: fx.Node, env: dict[fx.Node, Any]) -> int:
    """An upper bound on the size at which a comparison of the mask's construction can change
    its outcome: for ``a < b``, the sum of bounds on the constant parts of ``a`` and ``b``.

    A constant is only one place a comparison may flip: ``(i - j) - 40 < 41`` is a window of
    81 tokens, built from 40 and 41, causal up to size 81 (a review: probed past 41 and 42
    only, "proven causal", then 0.16 off at 200 tokens). Bounds (``_magnitude``): a scalar
    or a buffer or a value computed from constants only its largest absolute value, a size
    or a graph input 0 (the variable part), a product the product of its factors' bounds (at
    least 1 each), any other op the sum of its arguments' bounds. Over a mask of affine
    integer comparisons (what :func:`_not_probeable` leaves), every crossing lies at or
    below this bound.
    """
    bound: dict[fx.Node, float] = {}

    def magnitude(a: Any) -> float:
        if isinstance(a, (list, tuple)):  # index lists, shape lists (a review: index hid
            return sum(magnitude(x) for x in a)  # the 281 of (i - 281).clamp(min=0))
        if isinstance(a, fx.Node):
            return bound.get(a, 0.0)
        if isinstance(a, int | float) and not isinstance(a, bool) and math.isfinite(a) \
                and abs(a) < 2**31:
            return float(abs(a))
        return 0.0

    order = _graph_order(mask)
    dependent = _size_dependent(mask, env)
    worst = 0.0
    for n in sorted(ancestors(mask), key=order.__getitem__):
        value = env.get(n)
        if _is_size(n, env):
            bound[n] = 0.0
        elif n.op in ("placeholder", "get_attr"):
            bound[n] = (float(value.detach().double().abs().nan_to_num(0, 0, 0).max())
                        if isinstance(value, torch.Tensor) and value.numel() and
                        not _only_sizes_read(n, mask) else 0.0)
            if bound[n] >= 2**31:
                bound[n] = 0.0
        elif n.op == "call_function" and n not in dependent:  # a constant: its value
            try:
                value = evaluate(n, dict(env))
                t = torch.as_tensor(value).detach().double().abs().nan_to_num(0, 0, 0)
                bound[n] = float(t.max()) if t.numel() else 0.0
            except Exception:  # noqa: BLE001 - then the sum of its arguments' bounds
                bound[n] = sum(magnitude(a) for a in (*n.args, *n.kwargs.values()))
            if bound[n] >= 2**31:
                bound[n] = 0.0
        elif n.op == "call_function":
            args = [*n.args, *n.kwargs.values()]
            name = getattr(n.target, "_opname", "")
            if name == "mul":
                bound[n] = math.prod(max(magnitude(a), 1.0) for a in args)
            else:
                bound[n] = sum(magnitude(a) for a in args)
            if name in _COMPARISONS:
                worst = max(worst, bound[n])
    return int(math.ceil(min(worst, 2.0**31)))


DENSE_PROBES = 256
"""A size-dependent mask is evaluated at every length up to its threshold bound (then
around each constant and past the bound); a bound past this is refused."""

MAX_TABLE_CONSTANTS = 64
"""A buffer of at most this many values feeding a size-dependent mask: its values are probed
past like the scalar constants; a larger one refuses the proof."""


def _crossings(values: list[Any]) -> set[int]:
    """The integers a size may cross at each value: floor and ceil (a window of 47.5 changes
    the mask between sizes 47 and 48), absolute, finite values below 2**31."""
    out: set[int] = set()
    for a in values:
        if isinstance(a, int | float) and math.isfinite(a) and abs(a) < 2**31:
            out |= {abs(math.floor(a)), abs(math.ceil(a))}
    return out


_PROBEABLE = frozenset((
    # views and copies
    "unsqueeze", "squeeze", "view", "reshape", "_unsafe_view", "expand", "slice", "select",
    "permute", "transpose", "t", "clone", "contiguous", "alias", "detach", "index",
    "lift_fresh_copy", "to", "_to_copy", "type_as",
    # constructors (sizes, fill values)
    "arange", "new_ones", "new_zeros", "new_full", "ones", "zeros", "full", "ones_like",
    "zeros_like", "full_like", "scalar_tensor",
    # piecewise linear in the index with integer slopes
    "add", "sub", "rsub", "neg", "abs", "mul", "maximum", "minimum", "clamp", "clamp_min",
    "clamp_max", "where", "masked_fill", "tril", "triu",
    # comparisons and logic
    "lt", "le", "gt", "ge", "eq", "ne", "__and__", "__or__", "__xor__", "__invert__",
    "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "logical_and", "logical_or",
    "logical_xor", "logical_not",
    # transformers' packed-sequence detection (position_ids.diff, cumsum): a heuristic
    "cumsum", "diff"))
"""ATen op names (``_opname``) a size-dependent mask may be built with: ops that are
piecewise linear in an index with integer slopes, so that the mask's comparisons flip only
where a size crosses a bound of its constants (:func:`_threshold_bound`). An allow-list (a
review found masks a deny-list let through: ``atan``, a buffer multiplier of 0.5, ``alpha``,
a reduction with ``any`` that is wrong for a band of sizes only)."""

_EXACT_DTYPES = (torch.bool, torch.int32, torch.int64, torch.float32, torch.float64)
"""Dtypes a size-dependent value may have: positions in bf16 are exact up to 256 only, in
fp16 up to 2048, in int8/uint8 they wrap at 128/256 (a review: masks built so were causal at
every probe and wrong from there)."""


_VIEWS = frozenset(("unsqueeze", "squeeze", "view", "reshape", "_unsafe_view", "expand",
                    "slice", "select", "permute", "transpose", "t", "index"))
"""Ops whose values are their first argument's, moved or repeated: their other arguments
(dims, shapes, bounds, index positions) shape or position it."""

_CONSTRUCTORS = frozenset(("full", "new_full", "full_like", "scalar_tensor", "ones", "zeros",
                           "new_ones", "new_zeros", "ones_like", "zeros_like"))


def _flat_args(node: fx.Node) -> list[Any]:
    """Every argument of ``node``, lists and tuples (shapes, index lists) flattened."""
    return list(torch.utils._pytree.tree_leaves((node.args, dict(node.kwargs))))


_ARITHMETIC = frozenset(("add", "sub", "rsub", "neg", "abs", "mul", "maximum", "minimum",
                         "clamp", "clamp_min", "clamp_max", "cumsum", "diff", "arange"))


def _computes_positions(node: fx.Node, name: str) -> torch.Tensor | None:
    """The fake value whose dtype must be exact for ``node``: its result for arithmetic and
    for a cast of a non-boolean, the first input's for a comparison; None for ops that only
    select or fill (``full(min, dtype=bf16).triu(1)``, transformers' float mask in the
    model's dtype, holds fill values, not positions)."""
    val = node.meta.get("val")
    if name in _ARITHMETIC:
        return val if isinstance(val, torch.Tensor) else None
    if name in _CONSTRUCTORS and any(isinstance(a, fx.Node) for a in node.args[1:]):
        return val if isinstance(val, torch.Tensor) else None  # full((1,), s, dtype=bf16)
    if name in ("to", "_to_copy", "type_as"):
        src = tensor_meta(node.args[0]) if isinstance(node.args[0], fx.Node) else None
        return val if isinstance(val, torch.Tensor) and not (
            isinstance(src, torch.Tensor) and src.dtype == torch.bool) else None
    if name in _COMPARISONS:
        ins = [tensor_meta(a) for a in node.all_input_nodes]
        return next((t for t in ins if isinstance(t, torch.Tensor)
                     and t.dtype not in _EXACT_DTYPES), None)
    return None


def _dtype(node: fx.Node) -> torch.dtype | None:
    val = tensor_meta(node)
    return val.dtype if isinstance(val, torch.Tensor) else None


def _graph_order(mask: fx.Node) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(mask.graph.nodes)}


def _size_dependent(mask: fx.Node, env: dict[fx.Node, Any]) -> set[fx.Node]:
    """The nodes of the mask's construction computed from an input size (sizes included)."""
    order = _graph_order(mask)
    out: set[fx.Node] = set()
    for n in sorted(ancestors(mask), key=order.__getitem__):
        if _is_size(n, env) or any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _not_probeable(node: fx.Node, env: dict[fx.Node, Any], dependent: set[fx.Node]) -> str:
    """Why the probing argument fails for ``node`` of a size-dependent mask ("" when it
    holds): an op outside :data:`_PROBEABLE`, a dtype outside :data:`_EXACT_DTYPES`, an
    ``alpha`` other than 1, a product with a factor that is not an integer (a scalar or a
    constant tensor: ``d * 0.5 < 1000`` first holds at d = 2000, past every probe) or of two
    size-dependent values (polynomial), ``cumsum`` of a non-boolean, a constant of 2**31 or
    more outside a view (overflow or lost exactness hidden from the probes; a float mask's
    blocking fill is allowed), or a tensor not computed from sizes read at size-dependent
    positions (a table)."""
    if node.op != "call_function" or _is_size(node, env):
        return ""
    name = getattr(node.target, "_opname", "")
    if name not in _PROBEABLE:
        return f"is built with {node.target} (not piecewise linear in the index)"
    exact = _computes_positions(node, name)
    if exact is not None and exact.dtype not in _EXACT_DTYPES:
        return (f"computes {node.name} in {exact.dtype} (positions are exact in int32/int64 "
                "and float32/float64 only)")
    inputs = [a for a in node.all_input_nodes if a in dependent]
    if name == "mul" and len(inputs) > 1 and torch.bool not in map(_dtype, inputs):
        return (f"multiplies two size-dependent values ({node.target}: polynomial in the "
                "index)")
    if name == "cumsum" and not (inputs and _dtype(inputs[0]) == torch.bool):
        return "sums a size-dependent value that is not boolean (cumsum: it grows faster)"
    if node.kwargs.get("alpha", 1) != 1:
        return f"scales with alpha={node.kwargs['alpha']} ({node.target})"
    scalars = [a for a in _flat_args(node)
               if isinstance(a, int | float) and not isinstance(a, bool)]
    fill = name in ("where", "masked_fill") or (
        name in _CONSTRUCTORS and (_dtype(node) or torch.int64).is_floating_point)
    if name not in _VIEWS and any(math.isfinite(a) and abs(a) >= 2**31 and not (
            fill and a <= _NEG_INF) for a in scalars):  # (a mask's blocking fill, finfo.min,
        # is fine; a view's ints are dims and clamped bounds, a slice's end 2**63 - 1)
        return (f"uses a constant of 2**31 or more in {node.target} (positions past it "
                "overflow or lose exactness)")
    if name in ("slice", "select", "index") and isinstance(node.args[0], fx.Node) and \
            node.args[0] not in dependent:
        return f"reads {node.args[0].name} at size-dependent positions (a table)"
    if name == "mul":
        factors = [*[a for a in scalars if not math.isinf(a)],
                   *[a for a in node.args if isinstance(a, fx.Node) and a not in dependent],
                   *[a for a in inputs if (_dtype(a) or torch.bool).is_floating_point]]
        # (a size-dependent float factor too: full_like(d, 0.5), a review)
        for factor in factors:
            try:
                value = evaluate(factor, dict(env)) if isinstance(factor, fx.Node) else factor
            except Exception:  # noqa: BLE001 - not provable
                return f"multiplies by {factor} (not evaluable)"
            t = torch.as_tensor(value, dtype=torch.float64)
            if not bool(((t == t.round()) & ((t == 0) | (t.abs() >= 1))).all()):
                return f"multiplies by a non-integer factor ({node.target})"
    return ""


def _value_uses(mask: fx.Node, others: list[fx.Node]) -> fx.Node | None:
    """The first of ``others`` (sizes other than the sequence length) whose value enters the
    mask's values, rather than only shaping it (a batch size in an ``expand``) or indexing
    (transformers' batch arange: those are probed one at a time); None when none does.
    Probing cannot cover every value of such a size: a window passed as an int
    and a `(d < w) | (w >= max_len)` switch of two ints were proven causal at the probes
    and wrong at every length past the window (a review)."""
    if not others:
        return None
    carried: dict[fx.Node, fx.Node | None] = {}
    order = _graph_order(mask)
    for n in sorted(ancestors(mask), key=order.__getitem__):
        if n in others:
            carried[n] = n
            continue
        name = getattr(n.target, "_opname", "")
        top = [a for a in (*n.args, *n.kwargs.values()) if isinstance(a, fx.Node)]
        # a view's or an index's values are its tensor's: sizes in shape lists (a batch
        # expand, ones([w])) and index positions (transformers' batch arange) do not carry
        # here; those sizes are probed one at a time instead
        value_args = top[:1] if name in _VIEWS else top
        carried[n] = next((carried[a] for a in value_args if carried.get(a) is not None),
                          None)
    return carried.get(mask)


def _size_groups(mask: fx.Node, sizes: list[fx.Node], env: dict[fx.Node, Any]
                 ) -> tuple[list[fx.Node], list[fx.Node]]:
    """(sizes that are the attention's sequence length, the other sizes): the sequence
    length is the symbol of the mask's last dim in a dynamic-shape graph (a size whose
    symbol differs, or every size when the mask's dims are not symbolic, is another)."""
    val = tensor_meta(mask)
    last = val.shape[-1] if val is not None and val.dim() else None
    symbol = str(last.node.expr) if isinstance(last, torch.SymInt) else None
    if symbol is None:  # no symbolic dims to tell them apart: every size is the length
        return list(sizes), []
    seq, others = [], []
    for n in sizes:
        v = n.meta.get("val", n.meta.get("example_value"))
        same = symbol is not None and isinstance(v, torch.SymInt) and str(v.node.expr) == symbol
        (seq if same else others).append(n)
    return seq, others


def _is_size(node: fx.Node, env: dict[fx.Node, Any]) -> bool:
    """A size of a graph input: ``aten.sym_size.int(input, dim)`` or an int graph input."""
    if node.op == "placeholder":
        return isinstance(env.get(node), int) and not isinstance(env.get(node), bool)
    return node.op == "call_function" and node.target is torch.ops.aten.sym_size.int and \
        isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder"


def _only_sizes_read(node: fx.Node, mask: fx.Node) -> bool:
    """``node`` is not the mask itself and every use of it on the way to ``mask`` reads only
    its size."""
    if node is mask:
        return False
    on_path = set(ancestors(mask))
    uses = [user for user in node.users if user in on_path]
    return bool(uses) and all(user.target is torch.ops.aten.sym_size.int for user in uses)


def _causal_at(mask: fx.Node, env: dict[fx.Node, Any], blocked: bool) -> str:
    try:
        m = evaluate(mask, env)
    except NoMatch as exc:
        return f"the attention mask is not provable: {exc}"
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
        allowed, masked = (m == 0), (m <= _blocking(m.dtype))
    if not (bool((allowed == lower).all()) and bool((masked == ~lower).all())):
        return "the attention mask is not the causal (lower-triangular) mask" + \
            _window_note(allowed, masked, lower)
    return ""


def _window_note(allowed: torch.Tensor, masked: torch.Tensor, lower: torch.Tensor) -> str:
    """": a sliding window of W positions ..." where the mask is causal with keys W or more
    positions back masked as well (Mistral's / Gemma's sliding layers, a review found the
    reason unnamed), else ""."""
    seq = lower.shape[-1]
    if not bool((masked == ~allowed).all()) or bool((allowed & ~lower).any()):
        return ""
    rows = allowed.reshape(-1, seq, seq)
    if not bool((rows == rows[:1]).all()):
        return ""
    width = int(rows[0].sum(-1).max())
    i = torch.arange(seq)
    band = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < width)
    if width >= seq or not bool((rows[0] == band).all()):
        return ""
    return (f": a sliding window of {width} position{'s' if width != 1 else ''} (shorter "
            f"than the sequence, {seq}); "
            "is_causal and Lightning Attention both attend to the whole prefix")


def _constant_scalar(node: Any, env: dict[fx.Node, Any], what: str) -> float:
    """A Python number, or a one-element tensor computed from constants/buffers only."""
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return float(node)
    if not isinstance(node, fx.Node):
        raise NoMatch(f"{what} is {node!r}, not a number")
    for n in ancestors(node):
        if n.op == "placeholder" and not is_buffer(n, env):
            raise NoMatch(f"{what} depends on a graph input or a trainable parameter; only "
                          "constants and buffers are folded into the kernel")
    try:
        value = evaluate(node, env)
    except NoMatch:
        raise
    except Exception as exc:
        raise NoMatch(f"{what} could not be evaluated ({type(exc).__name__})") from exc
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise NoMatch(f"{what} is not a single number (a per-position or per-head tensor)")
    return float(value.reshape(()))


def _runtime_scalar(node: fx.Node, env: dict[fx.Node, Any]) -> bool:
    """True for a scale factor that is one number known only at run time: a node whose
    value depends on a graph input or a trainable parameter (not constants and buffers only,
    which ``_constant_scalar`` folds) and is a symbolic number or a tensor of one element
    with at most 4 dims (so it broadcasts over [B, H, S, D] without changing its shape)."""
    if not any(n.op == "placeholder" and not is_buffer(n, env) for n in ancestors(node)):
        return False
    val = node.meta.get("val")
    if isinstance(val, (torch.SymFloat, torch.SymInt)):
        return True
    return (isinstance(val, torch.Tensor) and val.dim() <= 4
            and all(size_hint(d) == 1 for d in val.shape))


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


def _scores(x: fx.Node, env: dict[fx.Node, Any]
            ) -> tuple[float, tuple[tuple[fx.Node, bool], ...], tuple[fx.Node, bool] | None,
                       fx.Node]:
    """Walk from the softmax input up to ``Q @ K^T``: (constant scale, run-time scale
    factors (see ``SoftmaxAttention.factors``), (mask, blocked) or None, qk)."""
    scale, mask = 1.0, None
    factors: list[tuple[fx.Node, bool]] = []

    def set_mask(node: fx.Node, blocked: bool) -> None:
        nonlocal mask
        if mask is not None:
            raise NoMatch("two masks on the scores")
        mask = (node, blocked)

    for _ in range(12):
        if is_call(x, aten.matmul.default):
            return scale, tuple(factors), mask, x
        if is_call(x, *_CASTS):
            x = x.args[0]  # type: ignore[assignment]
        elif is_call(x, aten.mul.Tensor, aten.div.Tensor):
            a, b = x.args
            if not (isinstance(a, fx.Node) and is_batched(a)):
                a, b = b, a
            if x.target is aten.div.Tensor and a is not x.args[0]:
                raise NoMatch("scores divide a tensor (not a scale)")
            divides = x.target is aten.div.Tensor
            if isinstance(b, fx.Node) and _runtime_scalar(b, env):
                writer = written_in_place(b)
                if writer is not None:  # the conversion reads it at the attention's output
                    raise NoMatch(f"the run-time scale {b.name} is written in place in the "
                                  f"graph ({writer.name}), after the scores read it")
                factors.append((b, divides))
            else:
                factor = _constant_scalar(b, env, "the scale")
                scale = scale / factor if divides else scale * factor
            x = a  # type: ignore[assignment]
        elif is_call(x, aten.add.Tensor):
            a, b = x.args
            if _leads_to_scores(b) and not _leads_to_scores(a):
                a, b = b, a
            if not isinstance(b, fx.Node):
                raise NoMatch("a constant is added to the scores")
            if _dtype(b) == torch.bool:  # scores + bool adds 1 where True: no mask (the
                # proof read the bool as one and the rewrite made it causal; a review)
                raise NoMatch("a boolean tensor is added to the scores (it adds 1 where "
                              "True, it masks nothing)")
            set_mask(b, blocked=False)
            x = a  # type: ignore[assignment]
        elif is_call(x, aten.masked_fill.Scalar):
            if _constant_scalar(x.args[2], env, "the fill value") > _blocking(_dtype(x)):
                raise NoMatch("masked_fill with a finite value is not a mask")
            set_mask(x.args[1], blocked=True)  # type: ignore[arg-type]
            x = x.args[0]  # type: ignore[assignment]
        elif is_call(x, aten.where.self, aten.where.ScalarOther):
            cond, a, other = x.args
            if _constant_scalar(other, env, "the masked value") > _blocking(_dtype(x)):
                raise NoMatch("where() with a finite value is not a mask")
            set_mask(cond, blocked=False)  # type: ignore[arg-type]
            x = a  # type: ignore[assignment]
        elif is_call(x, *_PRODUCTS):
            raise NoMatch(f"the scores are computed by {x.target}, not by a matmul Q @ K^T "
                          "of [B, H, S, D] tensors")
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
        node = next((a for a in node.args if isinstance(a, fx.Node) and is_batched(a)), None)
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
            p, train = arg(node, 1), arg(node, 2)
            if train is not False and p not in (0, 0.0):
                raise NoMatch("attention dropout > 0 (training dropout)")
    raise NoMatch("the probabilities do not feed a matmul with V")
