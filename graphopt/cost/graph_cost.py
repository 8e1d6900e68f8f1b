"""Per-node and per-graph cost of an FX graph with fake-tensor shapes: FLOPs, bytes moved,
roofline time.

FLOPs come from ``torch.utils.flop_counter`` (PyTorch's own formulas for mm/bmm/addmm/
convolution/attention): each node's target is run on its fake inputs under
``FlopCounterMode``, so composite ops (``aten.matmul``, ``aten.linear``) count through their
decomposition, and symbolic shapes give sympy expressions. graphopt's own formulas (its
custom ops: :func:`lightning_flops`; grouped_mm; the CPU SDPA kernels) are given to its
counters as ``custom_mapping`` (:func:`custom_flop_formulas`), not registered in torch's
global table.

Bytes: the sizes of a node's tensor inputs and outputs (views and metadata-only ops move 0).

Time (roofline, Williams et al. 2009, "Roofline: an insightful visual performance model"):
``max(flops / rate, bytes / (bandwidth * eff_mem)) + overhead`` per launched kernel, where
``rate`` is ``peak(dtype) * eff_mm`` (the device's matmul efficiency) or, for a calibrated
profile, the measured float32 GEMM curve at that size scaled by ``peak(dtype) / peak(float32)``
and never above ``peak(dtype)`` (times ``attention_efficiency`` for fused attention kernels),
and ``eff_mem`` the streaming efficiency.

Utilization: each node also records ``peak_s = flops / peak(dtype)``, its FLOPs at the peak
of the dtype it computes in. Since ``rate <= peak(dtype)``, ``time_s >= peak_s`` node by node,
so :attr:`GraphCost.mfu` (``sum(peak_s) / sum(time_s)``) is at most 1 by construction; for a
graph in one dtype it is the usual ``flops / (time * peak(dtype))``.
"""

from __future__ import annotations

import functools
import math
import operator
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode

from graphopt.cost.profiles import DeviceProfile

aten = torch.ops.aten

# Ops that only change metadata or alias their input: no kernel, no bytes.
_FREE = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
         aten.transpose.int, aten.t.default, aten.permute.default, aten.expand.default,
         aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default, aten.alias.default,
         aten.slice.Tensor, aten.select.int, aten.detach.default, aten.split.Tensor,
         aten.split_with_sizes.default, aten.unbind.int, aten.as_strided.default,
         aten.lift_fresh_copy.default, aten.sym_size.int, aten.sym_numel.default,
         aten.empty.memory_format, aten.empty_strided.default, aten.chunk.default,
         aten.unflatten.int, aten.flatten.using_ints}


_ATTENTION = {getattr(aten, name).default for name in (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward")}


def lightning_flops(b: Any, hq: Any, s: Any, d: Any, dv: Any, block: Any,
                    backward: bool, need_q: bool = True, need_kv: bool = True) -> Any:
    """FLOPs of the chunked Lightning Attention algorithm as executed (full C x C blocks).

    Forward per head: Q K^T 2SCD + (.)V 2SCDv + KV states 2SDDv + inter 2SDDv. Backward:
    dO V^T 2SCDv for either part; dQ: (.)K 2SCD, the recomputed states and dO S^T
    (2 x 2SDDv); dK, dV: Q K^T and (.)^T Q (2 x 2SCD), (.)^T dO 2SCDv, the reverse state
    scan's Q^T dO, V dS^T and K dS (3 x 2SDDv). All of it 2SC(3D + 2Dv) + 5 x 2SDDv;
    ``need_q`` / ``need_kv`` False (the backward op's flags, autograd's needs_input_grad)
    drop that part, as the kernels do. Equal to the matmul FLOPs torch's FlopCounterMode
    counts on the chunked path (tests/test_cost.py). b, hq, s, d, dv, block: ints or
    SymInts (batch, query heads, sequence, head dims, chunk length). Source: Lightning
    Attention-2 (Qin et al. 2024), Alg. 1-2.
    """
    if not backward:
        return b * hq * 2 * s * (block * (d + dv) + 2 * d * dv)
    bwd = block * dv  # dO V^T
    if need_q:
        bwd = bwd + block * d + 2 * d * dv
    if need_kv:
        bwd = bwd + block * (2 * d + dv) + 3 * d * dv
    return b * hq * 2 * s * bwd


def _lightning_fwd(q: Any, k: Any, v: Any, slope: Any, scale: Any, initial_state: Any,
                   block_size: Any, checkpoint_every: Any, impl: Any, *, out_shape: Any = None,
                   **_: Any) -> Any:
    b, hq, s, d = q
    return lightning_flops(b, hq, s, d, v[-1], block_size, backward=False)


def _lightning_bwd(grad_o: Any, grad_state: Any, q: Any, k: Any, v: Any, slope: Any,
                   scale: Any, checkpoints: Any, block_size: Any, checkpoint_every: Any,
                   need_slope_grad: Any, impl: Any, need_q: Any = True, need_kv: Any = True,
                   *_: Any, out_shape: Any = None, **__: Any) -> Any:
    """The part need_q / need_kv ask for (the slope's gradient reads both parts)."""
    b, hq, s, d = q
    return lightning_flops(b, hq, s, d, v[-1], block_size, backward=True,
                           need_q=bool(need_q or need_slope_grad),
                           need_kv=bool(need_kv or need_slope_grad))


def _lightning_varlen_fwd(q: Any, k: Any, v: Any, slope: Any, scale: Any, initial_state: Any,
                          cu_seqlens: Any, block_size: Any, *_: Any, out_shape: Any = None,
                          **__: Any) -> Any:
    """Packed sequences (q [1, Hq, T, D]): each sequence's chunks, T tokens in all (a
    review found these ops priced at 0 FLOPs)."""
    b, hq, s, d = q
    return lightning_flops(b, hq, s, d, v[-1], block_size, backward=False)


def _lightning_varlen_bwd(grad_o: Any, grad_state: Any, q: Any, k: Any, v: Any, slope: Any,
                          scale: Any, initial_state: Any, cu_seqlens: Any, block_size: Any,
                          *_: Any, out_shape: Any = None, **__: Any) -> Any:
    b, hq, s, d = q
    return lightning_flops(b, hq, s, d, v[-1], block_size, backward=True)


def ring_attention_flops(b: Any, h: Any, local: Any, d: Any, dv: Any, cp: Any,
                         backward: bool) -> Any:
    """FLOPs one rank's ring attention executes (graphopt.kernels.comm.ring_attention):
    its 2 zigzag chunks of c = local / 2 rows attend to 2 cp + 1 key chunks over the P steps
    (every earlier chunk, and its own two causally), each a full c x c block: forward
    Q K^T and P V, 2c^2 (D + Dv) per block; backward S again, dP = dO V^T, dQ, dK, dV,
    2c^2 (3D + 2Dv). b, h, local, d, dv: ints or SymInts (batch, heads, local rows, head
    dims); cp the ring size. Returns FLOPs (int or SymInt). Equal to FlopCounterMode's
    count of the ops' matmuls (tests/test_cost.py). Source: Ring Attention (Liu et al.
    2023) with the zigzag causal balancing of Megatron-LM's context parallelism."""
    c = local // 2
    per_block = (3 * d + 2 * dv) if backward else (d + dv)
    return b * h * (2 * cp + 1) * 2 * c * c * per_block


def _ring_fwd(q: Any, k: Any, v: Any, scale: Any, group: Any, size: Any, *_: Any,
              out_shape: Any = None, **__: Any) -> Any:
    b, h, local, d = q
    return ring_attention_flops(b, h, local, d, v[-1], size, backward=False)


def _ring_bwd(grad_out: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, scale: Any,
              group: Any, size: Any, *_: Any, out_shape: Any = None, **__: Any) -> Any:
    b, h, local, d = q
    return ring_attention_flops(b, h, local, d, v[-1], size, backward=True)


def _grouped(a: Any, b: Any, *_: Any, out_shape: Any = None, **__: Any) -> Any:
    """torch._grouped_mm (MoE experts): every row of mat_a meets one group's matrix, so the
    total is that of one GEMM over all rows: 2 M K N for [M, K] x [E, K, N], and for the
    2-D x 2-D weight-gradient form [M, Ktot] x [Ktot, N] (groups along Ktot) 2 M Ktot N."""
    n = b[-1]
    if len(a) == 2:
        return 2 * a[0] * a[1] * n
    return 2 * a[0] * a[1] * a[2] * n  # 3-D x 3-D: batched


def causal_fraction(s_q: Any, s_k: Any, lower_right: bool = False) -> Any:
    """Fraction of the ``s_q x s_k`` scores a causal fused-attention kernel computes: the
    kernels skip the blocks above the causal diagonal. 1/2 for a square mask (also for a
    symbolic size), as FlashAttention's own benchmarks count causal FLOPs (Dao 2023,
    benchmarks/benchmark_flash_attention.py divides by 2 when causal). Otherwise the scores
    below the diagonal, counted exactly: aligned top-left (SDPA's ``is_causal``: query i sees
    keys 0..i; the CPU flash, memory-efficient and cuDNN kernels) or, ``lower_right``,
    bottom-right (query i sees keys 0..i + s_k - s_q: the CUDA flash kernel's
    ``is_causal``, which SDPA reaches only through ``causal_lower_right``, the KV-cache /
    chunked-prefill mask; torch/nn/attention/bias.py). A symbolic non-square size: 1."""
    import sympy

    if isinstance(s_q, int) and isinstance(s_k, int):
        if s_q <= 0 or s_k <= 0:
            return 1
        if s_q == s_k:
            return sympy.Rational(1, 2)
        if lower_right:
            d = s_k - s_q  # query i sees min(max(i + d + 1, 0), s_k) keys
            kept = s_q * d + s_q * (s_q + 1) // 2 if d >= 0 else s_k * (s_k + 1) // 2
        else:  # query i sees min(i + 1, s_k) keys
            kept = (s_q * (s_q + 1) // 2 if s_q <= s_k
                    else s_k * (s_k + 1) // 2 + (s_q - s_k) * s_k)
        return sympy.Rational(kept, s_q * s_k)
    return sympy.Rational(1, 2) if s_q == s_k else 1


def _causal(count: Any, q: Any, k: Any, is_causal: Any, lower_right: bool = False) -> Any:
    """``count`` (torch's formula: every score computed) scaled to what a causal kernel
    executes, rounded down (an int or SymInt stays one)."""
    if not is_causal:
        return count
    fraction = causal_fraction(q[-2], k[-2], lower_right)
    if fraction == 1:
        return count
    return count * int(fraction.p) // int(fraction.q)  # (SymInt-safe)


def _causal_formula(op: Any, lower_right: bool) -> Any:
    """torch's FLOP formula of fused-attention ``op`` (forward or backward), times
    :func:`causal_fraction` when the call is causal (``is_causal`` found by the op's schema;
    the CUDA flash ops' causal mask is aligned bottom-right). torch's formulas count every
    score ("We aren't accounting for causal attention here"), so a causal step was priced at
    twice the attention work its kernel does on GPU and NPU profiles (the CPU kernels were
    already counted as executed)."""
    from torch.utils.flop_counter import flop_registry

    base = flop_registry[op]
    names = [a.name for a in op.default._schema.arguments]
    where = names.index("is_causal")
    q_at = names.index("query")
    k_at = names.index("key")

    def formula(*args: Any, out_val: Any = None, **kwargs: Any) -> Any:  # takes values
        causal = kwargs.get("is_causal", args[where] if len(args) > where else False)
        count = base(*args, out_val=out_val, **kwargs)
        return _causal(count, args[q_at].shape, args[k_at].shape, causal, lower_right)

    formula._get_raw = True  # type: ignore[attr-defined]
    return formula


def _sdpa_cpu(q: Any, k: Any, v: Any, dropout_p: Any = 0.0, is_causal: bool = False,
              *_: Any, out_shape: Any = None, **__: Any) -> Any:
    """PyTorch's CPU flash-attention kernels have no formula upstream; with is_causal the
    kernel skips the blocks above the diagonal (:func:`causal_fraction`)."""
    from torch.utils.flop_counter import sdpa_flop_count

    return _causal(sdpa_flop_count(q, k, v), q, k, is_causal)


def _sdpa_cpu_bwd(grad_out: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                  dropout_p: Any = 0.0, is_causal: bool = False, *_: Any,
                  out_shape: Any = None, **__: Any) -> Any:
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return _causal(sdpa_backward_flop_count(grad_out, q, k, v), q, k, is_causal)


@functools.cache
def custom_flop_formulas() -> dict[Any, Any]:
    """graphopt's FLOP formulas (its custom ops, torch._grouped_mm, the CPU SDPA kernels) as
    a ``FlopCounterMode(custom_mapping=...)``: given to graphopt's own counters only, never
    registered in torch's global table (registering them changed a user's own
    FlopCounterMode counts once graphopt was imported: found by a review)."""
    import graphopt.kernels.comm.ring_attention  # noqa: F401  (defines the ops)
    import graphopt.kernels.lightning.op  # noqa: F401

    table: dict[Any, Any] = {
        torch.ops.graphopt.lightning_attention_fwd: _lightning_fwd,
        torch.ops.graphopt.lightning_attention_bwd: _lightning_bwd,
        torch.ops.graphopt.lightning_attention_varlen_fwd: _lightning_varlen_fwd,
        torch.ops.graphopt.lightning_attention_varlen_bwd: _lightning_varlen_bwd,
        torch.ops.graphopt.ring_attention_fwd: _ring_fwd,
        torch.ops.graphopt.ring_attention_bwd: _ring_bwd,
        aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_bwd,
    }
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention"):
        for suffix in ("", "_backward"):
            op = getattr(aten, name + suffix, None)
            if op is not None:  # the CUDA flash op's causal mask is aligned bottom-right
                table[op] = _causal_formula(
                    op, lower_right=name == "_scaled_dot_product_flash_attention")
    if hasattr(aten, "_grouped_mm"):
        table[aten._grouped_mm] = _grouped
    return table


@dataclass
class NodeCost:
    """Cost of one node: FLOPs, bytes moved, predicted seconds, and which bound it hit."""

    name: str
    op: str
    flops: Any = 0
    bytes: Any = 0
    time_s: Any = 0.0
    bound: str = "free"  # "compute" | "memory" | "overhead" | "free"
    peak_s: Any = 0.0
    """Seconds of ``flops`` at the peak FLOP/s of the node's dtype (<= ``time_s``)."""


@dataclass
class GraphCost:
    """Totals and the per-node breakdown of one graph on one device."""

    nodes: list[NodeCost] = field(default_factory=list)

    @property
    def flops(self) -> Any:
        return sum(n.flops for n in self.nodes)

    @property
    def bytes(self) -> Any:
        return sum(n.bytes for n in self.nodes)

    @property
    def time_s(self) -> Any:
        return sum(n.time_s for n in self.nodes)

    @property
    def peak_s(self) -> Any:
        """Seconds the graph's FLOPs take at the peak FLOP/s of each node's dtype."""
        return sum(n.peak_s for n in self.nodes)

    @property
    def mfu(self) -> float:
        """Model FLOPs utilization, ``peak_s / time_s`` (numeric totals; in [0, 1])."""
        time = float(self.time_s)
        return float(self.peak_s) / time if time > 0 else 0.0

    def by_op(self) -> dict[str, tuple[Any, Any, Any]]:
        """op -> (time_s, flops, bytes), largest time first (numeric totals only)."""
        acc: dict[str, list[Any]] = defaultdict(lambda: [0.0, 0, 0])
        for n in self.nodes:
            a = acc[n.op]
            a[0] += n.time_s
            a[1] += n.flops
            a[2] += n.bytes
        items = sorted(acc.items(), key=lambda kv: -float(kv[1][0]))
        return {k: (v[0], v[1], v[2]) for k, v in items}

    def top(self, k: int = 10) -> list[NodeCost]:
        return sorted(self.nodes, key=lambda n: -float(n.time_s))[:k]


def _tensor_bytes(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return 0


def _dtype_name(node: fx.Node) -> str:
    vals = [a.meta.get("val") for a in node.all_input_nodes]
    for v in vals + [node.meta.get("val")]:
        if isinstance(v, torch.Tensor) and v.dtype.is_floating_point:
            return str(v.dtype).replace("torch.", "")
    return "float32"


def node_flops(node: fx.Node) -> Any:
    """FLOPs of one call_function node from its inputs' fake values (0 if unknown)."""
    if node.op != "call_function" or not callable(node.target):
        return 0
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs),
                                         lambda n: n.meta.get("val"))
    if any(isinstance(a, fx.Node) for a in torch.utils._pytree.tree_leaves((args, kwargs))):
        return 0
    vals = [v for v in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(v, torch.Tensor)]
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(vals) if vals else None
    counter = FlopCounterMode(display=False, custom_mapping=custom_flop_formulas())
    try:
        if mode is not None:
            from graphopt.passes.fx_utils import unbound_sizes_dropped

            # the EP op's received rows: a fresh symbol left pending here made Inductor
            # refuse the graph (remat x EP x Inductor, a review)
            with mode, counter, unbound_sizes_dropped(mode):
                node.target(*args, **kwargs)
        else:
            with counter:
                node.target(*args, **kwargs)
    except Exception:
        return 0
    return counter.get_total_flops()


def node_bytes(node: fx.Node) -> Any:
    """Bytes read and written by a node's kernel (inputs + outputs; 0 for views)."""
    if node.op != "call_function" or node.target in _FREE:
        return 0
    total: Any = 0
    for a in node.all_input_nodes:
        total += _tensor_bytes(a.meta.get("val"))
    out = node.meta.get("val")
    for leaf in torch.utils._pytree.tree_leaves(out):
        total += _tensor_bytes(leaf)
    return total


def matmul_rate(device: DeviceProfile, dtype: str, flops: Any, node: fx.Node) -> Any:
    """Achievable FLOP/s for this matmul-like node in ``dtype``: peak * matmul_efficiency, or,
    when the profile has a calibrated GEMM curve (measured in float32, keyed by the cube root
    of m*n*k per batch), the curve scaled by ``peak(dtype) / peak(float32)``. Never above
    ``device.flops_for(dtype)``: utilization is measured against that peak."""
    peak = device.flops_for(dtype)
    curve = device.matmul_curve
    if not curve or not isinstance(flops, (int, float)):
        return peak * device.matmul_efficiency
    batch = 1
    out = node.meta.get("val")
    if isinstance(out, torch.Tensor) and out.dim() >= 3:
        batch = math.prod(int(s) for s in out.shape[:-2])
    size = (max(float(flops), 1.0) / 2 / max(batch, 1)) ** (1 / 3)
    fp32_rate = interpolate(curve, size)
    return min(peak, fp32_rate * peak / device.flops_for("float32"))


def interpolate(curve: Sequence[Sequence[float]], x: float) -> float:
    """Piecewise-linear in log(x) over sorted (x, y) points; clamped at the ends."""
    pts = sorted((float(a), float(b)) for a, b in curve)
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + t * (y1 - y0)
    return pts[-1][1]  # pragma: no cover


def _maximum(a: Any, b: Any) -> Any:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return max(a, b)
    import sympy

    return sympy.Max(_expr(a), _expr(b))


def _expr(x: Any) -> Any:
    """sympy expression of a SymInt/SymFloat/number."""
    node = getattr(x, "node", None)
    if node is not None and hasattr(node, "expr"):
        return node.expr
    return x


def graph_cost(gm: fx.GraphModule, device: DeviceProfile) -> GraphCost:
    """Roofline cost of every node of ``gm`` on ``device`` (see the module docstring).

    ``gm``'s nodes need ``meta['val']`` (fake tensors, as make_fx/Dynamo/AOTAutograd graphs
    have). With symbolic shapes, FLOPs/bytes/time are sympy expressions.
    """
    result = GraphCost()
    bandwidth = device.memory_bandwidth * device.memory_efficiency
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        op = _op_name(node)
        if node.target in _FREE or node.target is operator.getitem:
            result.nodes.append(NodeCost(node.name, op))
            continue
        flops = node_flops(node)
        nbytes = node_bytes(node)
        dtype = _dtype_name(node)
        # flop_counter counts GEMM/convolution/attention FLOPs only: those run at the
        # (calibrated) matmul rate; everything else is priced by its bytes.
        rate = matmul_rate(device, dtype, flops, node)
        if node.target in _ATTENTION:
            rate *= device.attention_efficiency
        compute = _div(flops, rate) if _is_nonzero(flops) else 0
        at_peak = _div(flops, device.flops_for(dtype)) if _is_nonzero(flops) else 0
        memory = _div(nbytes, bandwidth)
        time = _maximum(compute, memory)
        bound = "compute" if _ge(compute, memory) and _is_nonzero(flops) else "memory"
        if isinstance(time, (int, float)) and time < device.kernel_overhead_s:
            bound = "overhead"
        result.nodes.append(NodeCost(node.name, op, _expr(flops), _expr(nbytes),
                                     time + device.kernel_overhead_s, bound, at_peak))
    return result


def _is_nonzero(x: Any) -> bool:
    return not (isinstance(x, (int, float)) and x == 0)


def _ge(a: Any, b: Any) -> bool:
    try:
        return bool(a >= b)
    except TypeError:
        return True


def _div(a: Any, b: float) -> Any:
    if isinstance(a, (int, float)):
        return a / b
    return _expr(a) / b


def _op_name(node: fx.Node) -> str:
    from graphopt.passes.fx_utils import op_name

    return op_name(node)
