"""A small kit for testing passes: get the graph a pass sees, run one pass, compare.

    gm = trace_for_pass(fn, *args)                       # normalized pre-autograd ATen graph
    gm, record = run_pass("cse", gm)                     # one pass, with its report record
    assert_op_delta(record, {"aten.exp.default": -3})    # counts of replaced nodes
    assert_matches_eager(fn, as_function(gm, fn), args)  # outputs and gradients

Models: PyTorch test/inductor/test_pattern_matcher.py (``common(fn, args, expected_matches)``)
and xDSL's ``rewrite_and_compare``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx

from graphopt.config import GraphoptConfig
from graphopt.normalize import normalize
from graphopt.passes import get_pass
from graphopt.passes.base import GraphPass, PassContext
from graphopt.passes.fx_utils import count_delta, op_counts
from graphopt.passes.regions import run_with_regions
from graphopt.report import PassRecord


def trace_for_pass(fn: Callable[..., Any], *args: Any, dynamic: bool = False) -> fx.GraphModule:
    """The normalized pre-autograd ATen graph of ``fn(*args)`` as a model pass sees it.

    Uses Dynamo with ``fullgraph=True`` (a graph break raises), then graphopt's normalize.
    The graph takes Dynamo's flat inputs (ordered by first use; parameters and dynamic
    sizes lifted): call it like ``fn`` through :func:`as_function`.
    """
    captured: list[fx.GraphModule] = []

    def backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        captured.append(normalize(gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(*args)
    return captured[0]


def bind_inputs(gm: fx.GraphModule, fn: Callable[..., Any], *args: Any,
                **kwargs: Any) -> list[Any]:
    """The flat graph inputs for the user-level call ``fn(*args, **kwargs)``.

    Dynamo orders graph inputs by first use and lifts parameters and dynamic sizes; each
    placeholder keeps its Dynamo source (an expression such as ``L['self']._modules['up']
    ._parameters['weight']`` or ``L['x'].size()[0]``), which is evaluated here.
    """
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    bound = inspect.signature(target).bind(*args, **kwargs)
    local_vars: dict[str, Any] = {**inspect.getclosurevars(target).nonlocals,
                                  **bound.arguments}
    if isinstance(fn, torch.nn.Module):
        local_vars["self"] = fn
    global_vars = getattr(target, "__globals__", {})
    values = []
    for node in gm.graph.find_nodes(op="placeholder"):
        source = node.meta["grapharg"].source
        expr = source.name if isinstance(source.name, str) else source.name()
        value = eval(expr, {"L": local_vars, "G": global_vars})
        val = node.meta.get("val")
        if isinstance(value, float) and isinstance(val, torch.Tensor):
            value = torch.tensor(value, dtype=val.dtype)  # a dynamic float, wrapped by Dynamo
        values.append(value)
    return values


def as_function(gm: fx.GraphModule, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``gm`` callable like ``fn`` (same arguments); returns the graph's output tuple/value."""
    def call(*args: Any, **kwargs: Any) -> Any:
        out = gm(*bind_inputs(gm, fn, *args, **kwargs))
        return out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out
    return call


def run_pass(graph_pass: str | GraphPass, gm: fx.GraphModule,
             config: GraphoptConfig | None = None, graph_kind: str = "model",
             training: bool = False, example_inputs: Sequence[Any] = ()
             ) -> tuple[fx.GraphModule, PassRecord]:
    """Run one pass (by name or instance) on ``gm``; lint, recompile, return the record.

    ``example_inputs``: real values of the graph inputs (``bind_inputs``), for passes that
    check constants numerically (the attention pass's decay check)."""
    config = config or GraphoptConfig()
    if isinstance(graph_pass, str):
        graph_pass = get_pass(graph_pass).from_config(config)
    record = PassRecord(graph_pass.name, graph_pass.stage, graph_kind, graph_pass.exact)
    before = op_counts(gm)
    record.nodes_before = len(gm.graph.nodes)
    ctx = PassContext(config, graph_kind, training, record,
                      extras={"example_inputs": list(example_inputs)})
    result = run_with_regions(graph_pass, gm, ctx)
    result.gm.graph.lint()
    result.gm.recompile()
    record.modified = result.modified
    record.exact = graph_pass.exact_for(record)
    record.nodes_after = len(result.gm.graph.nodes)
    record.op_delta = count_delta(before, op_counts(result.gm))
    return result.gm, record


def assert_op_delta(record: PassRecord, expected: Mapping[str, int]) -> None:
    """The pass changed op counts exactly as ``expected`` (ops not named: unchanged)."""
    assert record.op_delta == dict(expected), (
        f"{record.name}: op-count change {record.op_delta}, expected {dict(expected)}")


def assert_matches_eager(reference: Callable[..., Any], candidate: Callable[..., Any],
                         inputs: Sequence[Any], params: Sequence[torch.Tensor] = (),
                         rtol: float | None = None, atol: float | None = None,
                         seed: int = 0) -> None:
    """Outputs of ``candidate`` equal ``reference``'s, and so do the gradients of
    ``sum(outputs * v)`` (v seeded random) with respect to ``params`` and to the inputs that
    require grad. Both are run on the same inputs; ``torch.testing.assert_close`` tolerances.
    """
    ref = pytree.tree_leaves(reference(*inputs))
    got = pytree.tree_leaves(candidate(*inputs))
    assert len(ref) == len(got), f"{len(got)} outputs, expected {len(ref)}"
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=rtol, atol=atol)
    wrt = list(params) + [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    diff = [(r, g) for r, g in zip(ref, got) if isinstance(r, torch.Tensor) and r.requires_grad]
    if not wrt or not diff:
        return
    gen = torch.Generator().manual_seed(seed)
    cot = [torch.randn(r.shape, generator=gen, dtype=r.dtype) for r, _ in diff]
    g_ref = torch.autograd.grad([r for r, _ in diff], wrt, cot, allow_unused=True)
    g_got = torch.autograd.grad([g for _, g in diff], wrt, cot, allow_unused=True)
    for i, (r, g) in enumerate(zip(g_ref, g_got)):
        assert (r is None) == (g is None), f"gradient {i}: one side is None"
        if r is not None:
            try:
                torch.testing.assert_close(g, r, rtol=rtol, atol=atol)
            except AssertionError as exc:
                raise AssertionError(f"gradient {i} of {len(wrt)}: {exc}") from None


def assert_as_accurate_as_eager(reference: Callable[..., Any], eager: Callable[..., Any],
                                candidate: Callable[..., Any], inputs: Sequence[torch.Tensor],
                                ref_params: Sequence[torch.Tensor],
                                params: Sequence[torch.Tensor], slack: float = 2.0,
                                seed: int = 0) -> dict[str, tuple[float, float]]:
    """A low-precision ``candidate`` is as close to a float64 ``reference`` as the
    low-precision ``eager`` run is: for the outputs and the gradients of ``sum(out * v)`` (v
    seeded random) with respect to the inputs and ``params`` (``ref_params`` are the
    reference's copies, in the same order), ``err(candidate) <= slack * err(eager)``,
    errors as max |x - ref| / max |ref| (eager's floored at the inputs' dtype eps).
    Matching eager at a bf16 ``rtol`` would compare two
    roundings with each other; this compares each with the truth.

    Args:
        inputs: low-precision tensors; the reference gets float64 copies.
    Returns:
        {name: (eager error, candidate error)}, names "out{i}", "d_input{i}", "d_param{i}".
    Raises:
        AssertionError: naming the first output or gradient that misses.
    """
    def run(fn: Callable[..., Any], xs: Sequence[torch.Tensor], ps: Sequence[torch.Tensor],
            dtype: torch.dtype | None) -> tuple[int, list[torch.Tensor]]:
        xs = [(x.detach().to(dtype) if dtype else x.detach()).requires_grad_(
            x.is_floating_point()) for x in xs]
        outs = [o for o in pytree.tree_leaves(fn(*xs)) if isinstance(o, torch.Tensor)
                and o.requires_grad]
        gen = torch.Generator().manual_seed(seed)
        cot = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
               for o in outs]
        wrt = [x for x in xs if x.requires_grad] + list(ps)
        grads = torch.autograd.grad(outs, wrt, cot, allow_unused=True)
        return len(outs), [t.detach().double()
                           for t in [*outs, *(g for g in grads if g is not None)]]

    n_out, want = run(reference, inputs, ref_params, torch.float64)
    _, base = run(eager, inputs, params, None)
    _, got = run(candidate, inputs, params, None)
    assert len(want) == len(base) == len(got), "different numbers of outputs or gradients"
    n_in = len([x for x in inputs if x.is_floating_point()])
    floor = torch.finfo(next(x.dtype for x in inputs if x.is_floating_point())).eps
    errors = {}
    for i, (w, b, g) in enumerate(zip(want, base, got)):
        name = (f"out{i}" if i < n_out else f"d_input{i - n_out}" if i < n_out + n_in
                else f"d_param{i - n_out - n_in}")
        scale = float(w.abs().max()) or 1.0
        e_base, e_got = (float((x - w).abs().max()) / scale for x in (b, g))
        errors[name] = (e_base, e_got)
        assert e_got <= slack * max(e_base, floor), (
            f"{name}: error {e_got:.2e} vs float64, more than {slack} x eager's {e_base:.2e}")
    return errors
