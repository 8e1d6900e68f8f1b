"""ONNX translations (onnxscript) of graphopt's custom ops, for ``torch.onnx.export``'s
``custom_translation_table``: every op becomes standard ONNX (opset 18) ops, so any ONNX
runtime runs the exported model without graphopt.

- ``graphopt::lightning_attention_fwd``: the chunked form of Lightning Attention-2
  (arXiv:2401.04658, Algorithm 1) as an ONNX ``Loop`` over chunks of C = ``block_size``
  positions carrying the [B, H, D, Dv] state, with a recurrent branch (``If`` S == 1: one
  decode step, S_t = lambda S_{t-1} + k_t^T v_t, o_t = q_t S_t) so decoding does not pay for a
  padded chunk. The sequence is zero-padded to a multiple of C; decays inside a chunk use
  positions clamped to the last real one, so padded positions neither add to nor decay the
  state and the final state is the one after position S - 1 (exact, not approximate).
  Accumulation in float32 (float64 for float64 inputs), as the op. The third output (the
  backward's state checkpoints) is computed from the loop's per-chunk start states.
- ``graphopt::moe_experts`` (one device): SwiGLU experts in one of two forms, chosen by the
  caller and reported: "gather" (per expert: the assignments routed to it by NonZero, their
  token rows gathered, two MatMuls, rows weighted and scattered back with ScatterND(add):
  compute proportional to K/E of a dense MoE; the sort + grouped GEMM of the op done as
  gather/scatter because ONNX has no grouped GEMM) or "dense" (every expert on every token,
  weighted by a dense [T, E] routing matrix that is zero off the top-k: E/K times the FLOPs,
  static shapes only, for runtimes without NonZero). Capacity (token dropping) follows
  ``capacity_keep_mask``: the first C = ceil(cf * T * K / E) assignments per expert in
  (token, k) order. Backward-only outputs (expert rows, activations, counts, the sort) are
  not produced: they are dead in an inference graph, and the exporter refuses graphs that use them.

Shapes and dtypes are the ops' (graphopt/kernels/lightning/op.py, graphopt/kernels/moe/op.py).
"""

from __future__ import annotations

from typing import Any, TypeVar, Union

import onnx_ir as ir
from onnxscript import BOOL, DOUBLE, FLOAT, INT64, graph, script
from onnxscript import opset18 as op

from graphopt.kernels.moe.dispatch import capacity_fraction

# ---------------------------------------------------------------------------- lightning

TAcc = TypeVar("TAcc", bound=Union[FLOAT, DOUBLE])  # noqa: UP007 (onnxscript reads it)
"""The accumulation dtype (float32, or float64 for float64 inputs)."""


def _acc_type(dtype: ir.DataType) -> ir.DataType:
    return ir.DataType.DOUBLE if dtype == ir.DataType.DOUBLE else ir.DataType.FLOAT


def _dim(x: Any, axis: int) -> Any:
    return op.Shape(x, start=axis, end=axis + 1)


def _ints(*values: int) -> Any:
    return op.Constant(value_ints=list(values))


def _expand_heads(x: Any, hq: int) -> Any:
    """[B, Hk, S, X] -> [B, Hq, S, X] (query head h reads key/value head h // (Hq / Hk))."""
    hk = x.shape[1] if x.shape is not None else None
    if not isinstance(hk, int):
        raise ValueError("graphopt ONNX export: lightning attention needs a static key/value "
                         "head count")
    if hk == hq:
        return x
    return op.Gather(x, _ints(*[h // (hq // hk) for h in range(hq)]), axis=1)


def lightning_attention_fwd(q: Any, k: Any, v: Any, slope: Any, scale: float,
                            initial_state: Any, block_size: int, checkpoint_every: int,
                            impl: str) -> tuple[Any, Any, Any]:
    """``graphopt::lightning_attention_fwd`` -> (o [B, Hq, S, Dv] in q's dtype, final state
    [B, Hq, D, Dv], checkpoints [B, Hq, n * D, Dv]) (module docstring). ``impl`` names a
    PyTorch kernel and does not change the function."""
    hq = q.shape[1]
    if not isinstance(hq, int):
        raise ValueError("graphopt ONNX export: lightning attention needs a static head count")
    acc = _acc_type(q.dtype)
    # the scale as a constant of the accumulation dtype (a float32 constant rounded
    # 96 ** -0.5 in float64 exports: 7e-8 off, a review)
    qf = op.Mul(op.Cast(q, to=acc), op.Constant(value=ir.tensor(float(scale), dtype=acc)))
    kf = op.Cast(_expand_heads(k, hq), to=acc)
    vf = op.Cast(_expand_heads(v, hq), to=acc)
    lam = op.Cast(slope, to=acc)
    batch, d, dv = _dim(q, 0), _dim(q, 3), _dim(v, 3)
    if initial_state is None:
        shape = op.Concat(batch, _ints(hq), d, dv, axis=0)
        state0 = op.ConstantOfShape(shape, value=ir.tensor([0.0], dtype=acc))
    else:
        state0 = op.Cast(initial_state, to=acc)

    if block_size < 2:
        raise ValueError(f"graphopt ONNX export: lightning attention with block_size "
                         f"{block_size} (the decode branch assumes blocks of 2+ positions)")
    every = _ints(int(checkpoint_every))
    o, state, ckpt = _lightning_forms(qf, kf, vf, lam, state0, _ints(int(block_size)), every)
    return op.Cast(o, to=q.dtype), state, ckpt


@script()
def _lightning_forms(q: TAcc, k: TAcc, v: TAcc, slope: TAcc, state0: TAcc, chunk: INT64,
                     every: INT64) -> tuple[TAcc, TAcc, TAcc]:
    """q, k [B, H, S, D], v [B, H, S, Dv] (scaled, heads expanded, accumulation dtype), slope
    [H], state0 [B, H, D, Dv], chunk [1], every [1] -> (o [B, H, S, Dv], final state,
    checkpoints [B, H, n * D, Dv]): the recurrent step when S == 1, else the chunk loop."""
    zero = op.Constant(value_ints=[0])
    one = op.Constant(value_ints=[1])
    seq = op.Shape(q, start=2, end=3)
    if op.Squeeze(op.Equal(seq, one)):
        decay = op.Unsqueeze(op.Exp(op.Neg(slope)), op.Constant(value_ints=[1, 2]))
        state = op.Add(op.Mul(state0, decay), op.MatMul(op.Transpose(k, perm=[0, 1, 3, 2]), v))
        o = op.MatMul(q, state)
        ckpt = op.Identity(state0)  # one checkpoint: [B, H, 1 * D, Dv]
    else:
        n = op.Div(op.Sub(op.Add(seq, chunk), one), chunk)
        padded = op.Mul(n, chunk)
        pads = op.Concat(op.Constant(value_ints=[0, 0, 0, 0, 0, 0]), op.Sub(padded, seq), zero,
                         axis=0)
        lead = op.Shape(q, start=0, end=2)
        d = op.Shape(q, start=3, end=4)
        dv = op.Shape(v, start=3, end=4)
        qs = op.Transpose(op.Reshape(op.Pad(q, pads), op.Concat(lead, n, chunk, d, axis=0)),
                          perm=[2, 0, 1, 3, 4])
        ks = op.Transpose(op.Reshape(op.Pad(k, pads), op.Concat(lead, n, chunk, d, axis=0)),
                          perm=[2, 0, 1, 3, 4])
        vs = op.Transpose(op.Reshape(op.Pad(v, pads), op.Concat(lead, n, chunk, dv, axis=0)),
                          perm=[2, 0, 1, 3, 4])
        local = op.Range(op.Squeeze(one), op.Squeeze(op.Add(chunk, one)), op.Squeeze(one))
        causal = op.GreaterOrEqual(op.Unsqueeze(local, one), op.Unsqueeze(local, zero))
        neg_slope = op.Unsqueeze(op.Neg(slope), one)  # [H, 1]
        last = op.Sub(chunk, one)

        @graph()
        def body(i: INT64, cond: BOOL, carried):
            # Chunk i: positions i*C .. i*C + C - 1, those past S - 1 zero padding.
            qc = op.Gather(qs, i, axis=0)
            kc = op.Gather(ks, i, axis=0)
            vc = op.Gather(vs, i, axis=0)
            remaining = op.Sub(seq, op.Mul(i, chunk))
            pos = op.CastLike(op.Min(local, remaining), slope)  # 1..C, clamped at S - 1
            b = op.Mul(neg_slope, op.Unsqueeze(pos, zero))  # [H, C] log-decay from the start
            b_last = op.Gather(b, last, axis=1)  # [H, 1]
            q_decay = op.Unsqueeze(op.Exp(b), op.Constant(value_ints=[-1]))  # [H, C, 1]
            # log-decays between positions as -slope * (distance): a difference of two
            # log-decays was -inf - -inf = NaN once slope * position overflowed (3e38, a
            # review)
            to_last = op.Sub(op.Gather(pos, last, axis=0), pos)  # [C]
            k_decay = op.Unsqueeze(op.Exp(op.Mul(neg_slope, op.Unsqueeze(to_last, zero))),
                                   op.Constant(value_ints=[-1]))
            distance = op.Sub(op.Unsqueeze(pos, one), op.Unsqueeze(pos, zero))  # [C, C]
            gap = op.Mul(op.Unsqueeze(neg_slope, one), op.Unsqueeze(distance, zero))
            floor = op.CastLike(op.Constant(value_float=-1e30), slope)
            decay = op.Exp(op.Where(causal, gap, floor))  # [H, C, C], 0 above the diagonal
            scores = op.Mul(op.MatMul(qc, op.Transpose(kc, perm=[0, 1, 3, 2])), decay)
            out = op.Add(op.MatMul(op.Mul(qc, q_decay), carried), op.MatMul(scores, vc))
            kv = op.MatMul(op.Transpose(op.Mul(kc, k_decay), perm=[0, 1, 3, 2]), vc)
            block = op.Unsqueeze(op.Exp(b_last), op.Constant(value_ints=[-1]))  # [H, 1, 1]
            new_state = op.Add(op.Mul(carried, block), kv)
            cond_out = op.Identity(cond)
            start = op.Identity(carried)
            return cond_out, new_state, out, start

        state, outs, starts = op.Loop(op.Squeeze(n), None, state0, body=body)
        o_all = op.Reshape(op.Transpose(outs, perm=[1, 2, 0, 3, 4]),
                           op.Concat(lead, padded, dv, axis=0))
        o = op.Slice(o_all, zero, seq, op.Constant(value_ints=[2]))
        # The op's checkpoints: the start states of full blocks 0, r, 2r, ... and the state
        # where the tail (S mod C positions, possibly none) starts.
        full = op.Div(seq, chunk)
        states = op.Concat(starts, op.Unsqueeze(state, zero), axis=0)
        ckpt = op.Concat(op.Slice(states, zero, full, zero, every),
                         op.Slice(states, full, op.Add(full, one), zero), axis=0)
        ckpt = op.Reshape(op.Transpose(ckpt, perm=[1, 2, 0, 3, 4]),
                          op.Concat(lead, op.Constant(value_ints=[-1]), dv, axis=0))
    return o, state, ckpt




# ---------------------------------------------------------------------------------- moe

MOE_FORMS = ("gather", "dense")


def moe_experts(form: str) -> Any:
    """The translation of ``graphopt::moe_experts`` in ``form`` ("gather" or "dense", module
    docstring)."""
    if form not in MOE_FORMS:
        raise ValueError(f"moe form must be one of {MOE_FORMS}, got {form!r}")

    def translate(hidden: Any, top_k_index: Any, top_k_weights: Any, gate_up: Any, down: Any,
                  capacity_factor: float, ep: int, group: str, schedule: str, chunks: int,
                  ranks_per_node: int, drop_policy: str = "position"
                  ) -> tuple[Any, ...]:
        if ep != 1:
            raise ValueError(f"graphopt ONNX export: moe_experts with ep={ep} exchanges tokens "
                             "between ranks (all-to-all), which ONNX cannot express; export "
                             "the model with moe ep=1")
        num_experts = gate_up.shape[0] if gate_up.shape is not None else None
        if not isinstance(num_experts, int):
            raise ValueError("graphopt ONNX export: moe_experts needs a static expert count")
        out = _moe_out(form, hidden, top_k_index, top_k_weights, gate_up, down,
                       capacity_factor, num_experts, drop_policy)
        # Backward-only outputs (dead in the inference graphs the exporter accepts).
        empty = op.ConstantOfShape(_ints(0))
        empty_int = op.Cast(empty, to=ir.DataType.INT64)
        return out, empty, empty, empty, empty_int, empty_int, empty_int

    translate.__name__ = f"moe_experts_{form}"
    return translate


def _moe_out(form: str, hidden: Any, index: Any, weights: Any, gate_up: Any, down: Any,
             capacity_factor: float, num_experts: int, drop_policy: str) -> Any:
    acc = _promote(hidden.dtype, weights.dtype)
    weights = op.Cast(weights, to=acc)
    flat = op.Reshape(index, _ints(-1))  # [T*K], token-major as the op's stable sort
    kept = None  # [T, K] bool under a capacity
    if 0 < capacity_factor < num_experts:  # C kept per expert (a factor >= E keeps all)
        # C = ceil(num * T*K / (den * E)) in int64, exactly as the op (capacity_fraction)
        frac = capacity_fraction(capacity_factor)
        denom = frac.denominator * num_experts
        if frac.numerator >= 2**31 or denom >= 2**31:
            # num * T*K wrapped in int64 past T*K = 748 for 1.2345678901234567 (rows kept
            # that the op drops, 0.085 off, a re-review); below 2^31 it fits up to 2^32 rows
            raise ValueError(f"graphopt ONNX export: capacity_factor {capacity_factor!r} is "
                             f"the fraction {frac.numerator}/{frac.denominator}; the graph "
                             "computes C = ceil(num * T*K / (den * E)) in int64, which would "
                             "overflow; use a factor of at least 1e-6 with fewer decimal "
                             f"places (e.g. {float(capacity_factor):.4g})")
        capacity = op.Div(op.Add(op.Mul(op.Shape(flat), _ints(frac.numerator)),
                                 _ints(denom - 1)), _ints(denom))
        keep = _capacity_keep(flat, op.Reshape(weights, _ints(-1)), capacity, num_experts,
                              drop_policy)
        # Where, not a multiply by 0: a dropped assignment adds 0 even with an inf weight
        kept = op.Reshape(keep, op.Shape(index))
        weights = op.Where(kept, weights, op.CastLike(_double(0.0), weights))
    out = op.ConstantOfShape(op.Shape(hidden), value=ir.tensor([0.0], dtype=acc))
    if form == "dense":
        # [T, E] routing matrix: w at (t, index[t, k]), zero elsewhere.
        tokens = op.Shape(hidden, start=0, end=1)
        dense = op.ScatterElements(
            op.ConstantOfShape(op.Concat(tokens, _ints(num_experts), axis=0),
                               value=ir.tensor([0.0], dtype=acc)),
            index, weights, axis=1, reduction="add")
    for e in range(num_experts):
        w1 = op.Gather(gate_up, op.Constant(value_int=e), axis=0)  # [2F, H]
        w2 = op.Gather(down, op.Constant(value_int=e), axis=0)  # [H, F]
        if form == "dense":
            rows, scale, where = hidden, op.Slice(dense, _ints(e), _ints(e + 1), _ints(1)), None
        else:
            hits = op.Transpose(op.NonZero(op.Equal(index, op.CastLike(
                op.Constant(value_int=e), index))), perm=[1, 0])  # [n, 2] (token, k)
            where = op.Slice(hits, _ints(0), _ints(1), _ints(1))  # [n, 1] token ids
            rows = op.GatherND(hidden, where)  # [n, H]
            scale = op.Unsqueeze(op.GatherND(weights, hits), _ints(1))  # [n, 1]
        y = _swiglu(rows, w1, w2)
        y = op.Mul(op.Cast(y, to=acc), scale)
        if where is not None and kept is not None:  # a dropped row adds 0, not 0 * inf
            # (NaN; the op never computes it: a review)
            y = op.Where(op.Unsqueeze(op.GatherND(kept, hits), _ints(1)), y,
                         op.CastLike(op.Constant(value_float=0.0), y))
        if where is None:  # dense: unrouted tokens' rows are 0, also where y overflowed
            y = op.Where(op.Equal(scale, op.CastLike(op.Constant(value_float=0.0), scale)),
                         op.CastLike(op.Constant(value_float=0.0), y), y)
        out = op.Add(out, y) if where is None else op.ScatterND(out, where, y, reduction="add")
    return op.Cast(out, to=hidden.dtype)


def _capacity_keep(flat: Any, weights: Any, capacity: Any, num_experts: int,
                   drop_policy: str) -> Any:
    """[T*K] bool: the assignments an expert capacity keeps, as dispatch.capacity_keep_mask.
    "position": an assignment's 1-based rank within its expert is a CumSum over a one-hot
    [T*K, E] in (token, k) order. "probs": the op's two stable sorts (weight descending,
    then expert) as TopK, whose ties keep the lower index first (ONNX TopK spec); the rank
    is the sorted position minus the expert's first position."""
    experts = op.Range(op.Constant(value_int=0), op.Constant(value_int=num_experts),
                       op.Constant(value_int=1))
    one_hot = op.Cast(op.Equal(op.Unsqueeze(flat, _ints(1)), experts), to=ir.DataType.INT64)
    if drop_policy == "position":
        rank = op.GatherElements(op.CumSum(one_hot, op.Constant(value_int=0)),
                                 op.Unsqueeze(flat, _ints(1)), axis=1)  # 1-based
        return op.LessOrEqual(op.Squeeze(rank, _ints(1)), capacity)
    if drop_policy != "probs":
        raise ValueError(f"graphopt ONNX export: unknown moe drop_policy {drop_policy!r}")
    n = op.Shape(flat)
    # ranked in double: ONNX TopK takes no bfloat16 (a review's bf16 export was invalid);
    # an upward cast keeps the order and the ties
    _, by_weight = op.TopK(op.Cast(weights, to=ir.DataType.DOUBLE), n, axis=0, largest=1,
                           sorted=1)
    _, by_expert = op.TopK(op.Gather(flat, by_weight), n, axis=0, largest=0, sorted=1)
    order = op.Gather(by_weight, by_expert)  # [T*K] assignment ids, the op's order
    counts = op.ReduceSum(one_hot, _ints(0), keepdims=0)  # [E]
    starts = op.Sub(op.CumSum(counts, op.Constant(value_int=0)), counts)
    position = op.Range(op.Constant(value_int=0), op.Squeeze(n, _ints(0)),
                        op.Constant(value_int=1))
    keep_sorted = op.Less(op.Sub(position, op.Gather(starts, op.Gather(flat, order))),
                          capacity)
    return op.ScatterElements(op.ConstantOfShape(n, value=ir.tensor([False])), order,
                              keep_sorted, axis=0)


def _double(value: float) -> Any:
    return op.Constant(value=ir.tensor(float(value), dtype=ir.DataType.DOUBLE))


def _swiglu(rows: Any, w1: Any, w2: Any) -> Any:
    """rows [n, H], gate_up w1 [2F, H] (gate rows first), down w2 [H, F] -> [n, H]:
    (silu(rows w1_g^T) * rows w1_u^T) w2^T (graphopt/kernels/moe/experts.py)."""
    gu = op.MatMul(rows, op.Transpose(w1, perm=[1, 0]))
    gate, up = op.Split(gu, num_outputs=2, axis=1)
    act = op.Mul(op.Mul(gate, op.Sigmoid(gate)), up)
    return op.MatMul(act, op.Transpose(w2, perm=[1, 0]))


def _promote(a: ir.DataType, b: ir.DataType) -> ir.DataType:
    """torch.promote_types for the float dtypes the op takes."""
    order = [ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.FLOAT, ir.DataType.DOUBLE]
    if {a, b} == {ir.DataType.FLOAT16, ir.DataType.BFLOAT16}:
        return ir.DataType.FLOAT
    return max(a, b, key=order.index)


def translation_table(moe_form: str = "gather") -> dict[Any, Any]:
    """``custom_translation_table`` for ``torch.onnx.export``: graphopt op -> translation."""
    import torch

    import graphopt.kernels.lightning.op  # noqa: F401  (registers the ops)
    import graphopt.kernels.moe.op  # noqa: F401

    return {
        torch.ops.graphopt.lightning_attention_fwd.default: lightning_attention_fwd,
        torch.ops.graphopt.moe_experts.default: moe_experts(moe_form),
    }
