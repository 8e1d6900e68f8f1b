"""Inserting ``graphopt::lightning_attention_fwd`` calls: the one rewrite primitive the
attention pass's exact linear-attention rewrites and its approximate softmax conversion share.

New nodes get ``val`` (fake-run) and provenance: ``nn_module_stack`` of the node they replace
and ``graphopt_replaced = [its name]``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from graphopt.kernels.lightning.chunked import DEFAULT_BLOCK_SIZE, DEFAULT_CHECKPOINT_EVERY
from graphopt.passes.fx_utils import fake_call, size_hint, tensor_meta


def insert_lightning_fwd(gm: fx.GraphModule, before: fx.Node, q: fx.Node, k: fx.Node,
                         v: fx.Node, slope: fx.Node, scale: float, outputs: int = 1
                         ) -> list[fx.Node]:
    """Insert ``lightning_attention_fwd(q, k, v, slope, scale)`` before ``before`` (which it
    will replace; ``slope`` is a new [H] node) and return its first ``outputs`` results
    (output, final state), not yet wired in. The kernel's block length is used: the result
    does not depend on it (exact math)."""
    from graphopt.kernels.lightning.op import resolve_impl

    graph = gm.graph
    q_val, v_val = tensor_meta(q), tensor_meta(v)
    assert q_val is not None
    dims = max(int(q_val.shape[-1]), int(v_val.shape[-1]) if v_val is not None else 0)
    op = torch.ops.graphopt.lightning_attention_fwd.default
    with graph.inserting_before(before):
        args = (q, k, v, slope, scale, None, DEFAULT_BLOCK_SIZE, DEFAULT_CHECKPOINT_EVERY,
                resolve_impl("auto", q_val.device, dims, q_val.dtype))
        call = graph.call_function(op, args)
        call.meta["val"] = fake_call(op, *args)
        outs = []
        for i in range(outputs):
            item = graph.call_function(operator.getitem, (call, i))
            item.meta["val"] = call.meta["val"][i]
            outs.append(item)
    for new in (slope, call, *outs):
        new.meta["nn_module_stack"] = before.meta.get("nn_module_stack", {})
        new.meta["graphopt_replaced"] = [before.name]
    return outs


def insert_with_frozen_slopes(gm: fx.GraphModule, node: fx.Node, q: fx.Node, k: fx.Node,
                              v: fx.Node, slopes: torch.Tensor, scale: float) -> fx.Node:
    """Insert ``lightning_attention_fwd(q, k, v, slopes)[0]`` before ``node``, the slopes
    frozen as a buffer of ``gm`` (float64 for float64 q, which a float32 buffer would round:
    ~1e-10 relative error in a float64 model; float32 otherwise); returns the output node
    (not yet wired in)."""
    (out,) = insert_lightning_fwd(gm, node, q, k, v, frozen_slopes(gm, node, q, slopes), scale)
    return out


def frozen_slopes(gm: fx.GraphModule, node: fx.Node, q: fx.Node, slopes: torch.Tensor
                  ) -> fx.Node:
    """A ``get_attr`` of ``slopes`` [H] registered as a buffer of ``gm`` (float64 for a
    float64 ``q``, float32 otherwise, on ``q``'s device), inserted before ``node``."""
    q_val = tensor_meta(q)
    mode = detect_fake_mode([q_val])
    assert q_val is not None and mode is not None
    name = f"_graphopt_slope_{node.name}"
    dtype = torch.float64 if q_val.dtype == torch.float64 else torch.float32
    gm.register_buffer(name, slopes.to(dtype, copy=True).to(q_val.device))
    with gm.graph.inserting_before(node):
        slope = gm.graph.get_attr(name)
    slope.meta["val"] = mode.from_tensor(getattr(gm, name))
    return slope


def saved_bytes_note(q: fx.Node, k: fx.Node, v: fx.Node) -> str:
    """"saves X MiB for the backward (Y MiB with every chunk's state)" for a rewrite's
    report entry (graphopt.kernels.lightning.op.saved_bytes at the pass's block length and
    checkpoint interval)."""
    from graphopt.kernels.lightning.op import resolve_impl, saved_bytes

    metas = [tensor_meta(n) for n in (q, k, v)]
    vals = [val for val in metas if val is not None]
    if len(vals) != 3:
        return ""
    # Symbolic sizes are read through their example values: int() would add a guard (and
    # specialize a dynamic dimension of torch.export or a dynamic=True compile).
    hints = [tuple(size_hint(x) for x in val.shape) for val in vals]
    shapes = [tuple(x for x in shape if x is not None) for shape in hints]
    if any(len(s) != len(h) for s, h in zip(shapes, hints)):
        return ""
    # The op's "auto" resolves by device: Triton on a GPU/NPU keeps only the initial state,
    # and the passes' calls have none.
    impl = resolve_impl("auto", vals[0].device, max(shapes[0][-1], shapes[2][-1]),
                        vals[0].dtype)
    # the passes' slopes: float64 for float64 q (insert_with_frozen_slopes), else float32
    slope_dtype = torch.float64 if vals[0].dtype == torch.float64 else torch.float32
    kept, every = saved_bytes(shapes[0], shapes[1], shapes[2], vals[0].dtype, impl=impl,
                              slope_dtype=slope_dtype)
    symbolic = any(isinstance(x, torch.SymInt) for val in vals for x in val.shape)
    what = ("no state: Triton recomputes every chunk state from zero" if impl == "triton" else
            f"a state every {DEFAULT_CHECKPOINT_EVERY} of the kernel's "
            f"{DEFAULT_BLOCK_SIZE}-row chunks")
    versus = (f"{every / 2**20:.2f} MiB with every chunk's state" if every > kept else
              "a sequence this short has no more chunk states to drop")
    return (f"; saves {kept / 2**20:.2f} MiB for the backward (q, k, v, {what}; {versus})"
            f"{' at the example sizes' if symbolic else ''}")
