"""Capture guard (graphopt.capture): constructs that re-tracing would get wrong either keep
their numerics through normalize or fall back to Dynamo's graph (AOTAutograd's path); each
is compiled with graphopt and compared with eager, outputs and every gradient, in float64."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphopt
import graphopt.capture
from graphopt.distributed import run_distributed
from graphopt.errors import FallbackWarning
from graphopt.testing import assert_matches_eager

EAGER = {"lowering": "eager"}


class RoundSTE(torch.autograd.Function):
    """Straight-through estimator: round forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, g):
        return g


class STEModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.down(RoundSTE.apply(self.up(x) * 3).sin())


def _compile_and_compare(model, inputs, options=EAGER, rtol=1e-9, atol=1e-9):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="graphopt", options=dict(options))
    assert_matches_eager(model, compiled, inputs, params=list(model.parameters()),
                         rtol=rtol, atol=atol)
    reports = [r for r in graphopt.reports() if r.status == "compiled"]
    assert reports, "nothing was compiled by graphopt"
    return reports


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


def test_custom_autograd_function_keeps_its_backward():
    torch.manual_seed(0)
    with pytest.warns(FallbackWarning, match="model passes skipped for this graph: .*"
                      "autograd_function_apply"):  # not only in the report
        (report,) = _compile_and_compare(STEModel().double(), [_x(4, 8)],
                                         options={**EAGER, "moe": {}})
    assert report.fallback and "autograd_function_apply" in report.fallback
    assert report.training and "backward" in report.graphs
    # model passes skipped, and each one's record says so (a review: a fallback left a
    # requested pass, e.g. moe on Jamba, without a record of its own)
    assert [p.name for p in report.passes if p.stage == "pre_autograd"] == [
        "attention", "moe", "remove_noops", "cse"]
    for record in report.passes:
        assert not record.modified and [s.action for s in record.sites] == ["skipped"]
        assert record.sites[0].reason.startswith("not run: model passes skipped for this "
                                                 "graph (") and "autograd_function" in \
            record.sites[0].reason


def test_output_invariant_catches_a_lost_backward(monkeypatch):
    """Defence in depth: were autograd_function_apply on the allow-list, normalize would
    inline the forward under no_grad; the requires_grad invariant must refuse that graph."""
    monkeypatch.setattr(graphopt.capture, "KNOWN_HOPS",
                        graphopt.capture.KNOWN_HOPS | {"autograd_function_apply"})
    torch.manual_seed(0)
    (report,) = _compile_and_compare(STEModel().double(), [_x(4, 8)])
    assert "gradient paths differ: lost for" in report.fallback


class AutocastInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.lin(x)
            z = y.to(torch.bfloat16) + 1  # a no-op cast inside the region
        return y.float() * 2, z


def test_autocast_region_inside_the_graph_keeps_dtypes():
    torch.manual_seed(0)
    model = AutocastInside()
    x = torch.randn(4, 8, requires_grad=True)
    (report,) = _compile_and_compare(model, [x], rtol=0, atol=0)
    assert report.fallback is None
    noops = report.pass_records("remove_noops")[0]
    assert noops.count("rewritten") == 0
    assert any("autocast" in s.reason for s in noops.sites)
    assert torch.compile(model, backend="graphopt", options=EAGER)(x)[0].dtype == torch.float32


class AutocastCopyWrittenInPlace(nn.Module):
    """A float32 copy of a bf16 autocast result, changed in place, next to a later read of
    the bf16 result (``variant``: how the copy is spelled; "alias" converts to the dtype
    the value already has, which returns it itself in eager)."""

    def __init__(self, variant, checkpointed):
        super().__init__()
        self.lin, self.lin2 = nn.Linear(16, 16), nn.Linear(16, 16)
        self.variant, self.checkpointed = variant, checkpointed

    def body(self, x):
        h = self.lin(x)  # bf16 at run time
        if self.variant == "float":
            y = h.float()
            y.mul_(0.5)
        elif self.variant == "to":
            y = h.to(torch.float32)
            y.add_(1.0)
        elif self.variant == "type_as":
            y = h.type_as(x)
            y.masked_fill_(y > 0, 0.0)
        else:
            y = h.to(torch.bfloat16)
            y.mul_(2)
        return self.lin2(h), y

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if self.checkpointed:
                return torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)
            return self.body(x)


@pytest.mark.parametrize("variant, checkpointed", [
    ("float", False), ("to", False), ("type_as", False), ("alias", False), ("float", True)])
def test_a_copy_made_inside_an_autocast_region_stays_a_copy(variant, checkpointed):
    """normalize traced the compiled code's autocast regions without autocast, so a bf16
    value was float32 in the trace and ``h.float()`` traced as ``h`` itself: the in-place
    write to the copy became a write to ``h`` and the later ``lin2(h)`` read it (a review:
    output 0.51 and gradients 0.37 off, no fallback; aot_eager exact). The regions are now
    traced with autocast on, as they run."""
    import torch.utils.checkpoint  # noqa: F401

    torch.manual_seed(0)
    model = AutocastCopyWrittenInPlace(variant, checkpointed)
    x = torch.randn(4, 16, requires_grad=True)
    graphopt.clear_reports()
    (report,) = _compile_and_compare(model, [x], rtol=0, atol=0)
    assert report.fallback is None


class _RegionInCheckpoint(nn.Module):
    """An autocast region inside a torch.utils.checkpoint body (``disabled``: an
    enabled=False region under an outer bf16 one), with a cast copy written in place."""

    def __init__(self, disabled):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.disabled = disabled

    def body(self, a):
        if self.disabled:
            with torch.autocast("cpu", enabled=False):
                h = self.l2(a.float())
                y = h.bfloat16()
                y.mul_(0.5)
                return self.l3(h), y
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.l2(a)
            y = h.float()
            y.mul_(0.5)
            return self.l3(h), y

    def forward(self, x):
        import torch.utils.checkpoint as checkpoint

        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.disabled):
            return checkpoint.checkpoint(self.body, self.l1(x), use_reentrant=False)


@pytest.mark.parametrize("disabled", [False, True])
def test_an_autocast_region_inside_a_checkpoint_body_keeps_its_copies(disabled):
    """A checkpoint body is traced by the higher-order op's own tracer: its regions kept
    the aliasing bug (output 0.69, gradients 5.5 off; the enabled=False variant crashed at
    run time), a review of the first fix."""
    torch.manual_seed(0)
    model = _RegionInCheckpoint(disabled)
    x = torch.randn(4, 16, requires_grad=True)
    graphopt.clear_reports()
    (report,) = _compile_and_compare(model, [x], rtol=0, atol=0)
    assert report.fallback is None


def test_a_trace_that_fails_inside_an_autocast_region_leaves_autocast_as_it_was(monkeypatch):
    """The trace now enters regions for real: one that raised inside a region left
    autocast's state changed, and the fallback then ran under it (gradients 0.5 off)."""
    import graphopt.normalize as normalize

    def broken_exit(region):
        raise RuntimeError("simulated failure inside the region")

    monkeypatch.setattr(normalize, "_exit_applied", broken_exit)
    torch.manual_seed(0)
    model = _RegionInCheckpoint(True)
    x = torch.randn(4, 16, requires_grad=True)
    graphopt.clear_reports()
    (report,) = _compile_and_compare(model, [x], rtol=0, atol=0)
    assert "simulated failure" in (report.fallback or "")
    assert not torch.is_autocast_enabled("cpu")


def test_ambient_autocast_matches_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (report,) = _compile_and_compare(model, [x], rtol=0, atol=0)
    assert report.fallback is None and report.passes


class VmapModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8, dtype=torch.float64))

    def forward(self, x):
        return torch.vmap(lambda row: torch.tanh(self.w @ row))(x)


class NestedRegion(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        @torch.compiler.nested_compile_region
        def block(y):
            return torch.relu(self.lin(y))

        return block(block(x))


class ScanModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        from torch._higher_order_ops.associative_scan import associative_scan

        return associative_scan(lambda a, b: a * torch.sigmoid(b) + b, self.lin(x), dim=0,
                                combine_mode="generic")


@pytest.mark.parametrize("model_cls,hop", [(VmapModel, "vmap"),
                                           (NestedRegion, "invoke_subgraph"),
                                           (ScanModel, "associative_scan|vmap")])
def test_unknown_constructs_fall_back_and_stay_exact(model_cls, hop):
    torch.manual_seed(0)
    reports = _compile_and_compare(model_cls().double(), [_x(6, 8)])
    assert any(r.fallback and any(h in r.fallback for h in hop.split("|")) for r in reports), \
        [r.fallback for r in reports]


def test_flex_attention_inference():
    """flex_attention has no CPU backward (eager raises too): compared without grad."""
    from torch.nn.attention.flex_attention import flex_attention

    def attend(q, k, v):
        return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: torch.where(
            qi >= ki, s, -float("inf")))

    q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.float64) for _ in range(3))
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(attend, backend="graphopt", options=EAGER)(q, k, v)
        torch.testing.assert_close(out, attend(q, k, v), rtol=1e-9, atol=1e-9)
    assert "flex_attention" in graphopt.last_report().fallback


def _dtensor_tp_world1(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)).double()
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)).double()
    model.load_state_dict(ref.state_dict())
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(4, 8, dtype=torch.float64)
    compiled = torch.compile(model, backend="graphopt", options=EAGER)
    out = compiled(x)
    out.sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(out, ref(x), rtol=1e-9, atol=1e-9)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, rtol=1e-9, atol=1e-9,
                                   msg=name)
    return [r.fallback for r in graphopt.reports() if r.status == "compiled"]


def test_dtensor_parameters_compile_world_size_one():
    (fallbacks,) = run_distributed(_dtensor_tp_world1, 1)
    assert fallbacks and all(f and "DTensor" in f for f in fallbacks), fallbacks


def test_inference_mode_block_falls_back_and_keeps_gradients():
    """make_fx's pre-dispatch re-trace drops Dynamo's _enter_inference_mode, so the ops of
    the block were differentiated (gradient off by 13-19; found by a review)."""
    class Model(nn.Module):
        def forward(self, x):
            a = torch.exp(x)
            with torch.inference_mode():
                b = torch.exp(x)
            return a + b

    with pytest.warns(FallbackWarning, match="inference_mode"):
        (report,) = _compile_and_compare(Model(), [_x(5)])
    assert "inference_mode" in report.fallback


# --- found by a review of capture under torch.compile features (each failed before) ---


def _graphopt(fn, **options):
    return torch.compile(fn, backend="graphopt", options={"lowering": "eager", **options})


def test_a_compiled_optimizer_step_updates_its_state_once():
    """torch.compile(opt.step): Dynamo's graph reads parameters and momentum buffers through
    get_attr and writes them in place; normalize's trace ran those writes on the real
    tensors, then the fallback ran the step again (weights off by 0.12, momentum by 0.52
    after 3 steps). The trace now sees fake copies, and falls back naming the constant."""
    def train(compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Linear(4, 4).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        step = _graphopt(opt.step) if compiled else opt.step
        for i in range(3):
            x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
            model(x).pow(2).sum().backward()
            step()
            opt.zero_grad()
        return model.weight.detach().clone(), opt.state[model.weight]["momentum_buffer"]

    graphopt.clear_reports()
    weight, momentum = train(True)
    assert any("new tensor constant" in (r.fallback or "") for r in graphopt.reports())
    want_weight, want_momentum = train(False)
    torch.testing.assert_close(weight, want_weight, rtol=0, atol=1e-14)
    torch.testing.assert_close(momentum, want_momentum, rtol=0, atol=1e-14)


def test_a_checkpointed_block_under_autocast_keeps_its_casts():
    """The run-time dtypes of autocast regions were not given to checkpoint bodies, so
    remove_noops saw the bf16 -> fp32 cast inside a checkpointed block as a no-op (output
    error 0.98 of 1.3); the model passes still run (no fallback)."""
    import torch.utils.checkpoint as checkpoint

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(16, 16)
            self.gain = nn.Parameter(torch.ones(16))

        def forward(self, x):  # type: ignore[no-untyped-def]
            h = self.linear(x).float()
            return ((h + 256.0) - 256.0) * self.gain  # exact in fp32, coarse in bf16

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block()

        def forward(self, x):  # type: ignore[no-untyped-def]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return checkpoint.checkpoint(self.block, x, use_reentrant=False)

    torch.manual_seed(0)
    model, x = Model(), torch.randn(4, 16, requires_grad=True)
    graphopt.clear_reports()
    torch._dynamo.reset()
    assert_matches_eager(model, _graphopt(model), [x], list(model.parameters()), rtol=0,
                         atol=1e-6)
    assert graphopt.last_report().fallback is None


def test_data_of_a_one_element_tensor_in_forward_falls_back_and_runs():
    """``h / h.norm().data`` froze the traced (fake) 0-d value into the graph as a constant
    and crashed at run time; fake constants of any size now fall back."""
    def fn(x):
        h = x.sin()
        return h / h.norm().data

    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    graphopt.clear_reports()
    torch._dynamo.reset()
    assert_matches_eager(fn, _graphopt(fn), [x], rtol=0, atol=1e-14)
    assert "new tensor constant" in (graphopt.last_report().fallback or "")


def test_literal_tensors_in_forward_keep_the_model_passes():
    """``torch.tensor([0, 2, 2])`` (an index) and ``torch.tensor([..], dtype=...)`` in
    forward become real constants of the re-trace; they equal Dynamo's literal calls, so
    the graph is not a fallback (it was: "new tensor constant"), and stays exact."""
    class Gather(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):  # type: ignore[no-untyped-def]
            idx = torch.tensor([0, 2, 2])
            w = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
            return (self.linear(x)[:, idx] * w + torch.as_tensor([[0.5], [1.5]])).sum(0)

    class Checkpointed(Gather):  # the literals inside a checkpoint region's body
        def forward(self, x):  # type: ignore[no-untyped-def]
            import torch.utils.checkpoint as checkpoint

            return checkpoint.checkpoint(super().forward, x, use_reentrant=False)

    for cls in (Gather, Checkpointed):
        torch.manual_seed(0)
        model = cls().double()
        graphopt.clear_reports()
        (report,) = _compile_and_compare(model, [_x(2, 4)])
        assert report.fallback is None and report.passes, report.fallback


def test_a_tensor_of_a_symbolic_size_compiles_after_the_dynamic_recompile():
    """``torch.tensor([x.shape[0], 1, 2, 3])``: the recompile with a symbolic size traced
    three unused ``aten.promote_types`` calls without ``meta['val']``, and the pass runner
    failed the compile where aot_eager ran (a review)."""
    class SizeScaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):  # type: ignore[no-untyped-def]
            scale = torch.tensor([x.shape[0], 1, 2, 3])
            return (self.linear(x) * scale).pow(2).sum()

    torch.manual_seed(0)
    model = SizeScaled().double()
    torch._dynamo.reset()
    graphopt.clear_reports()
    compiled = _graphopt(model)
    for n in (3, 4, 5):
        assert_matches_eager(model, compiled, [_x(n, 4)], list(model.parameters()), rtol=0,
                             atol=1e-12)
    assert any(r.dynamic and r.passes for r in graphopt.reports())


class _Mutating(nn.Module):
    """Writes in place in forward: a parameter under no_grad (a constrained weight), buffer
    slices, a ring buffer and a step counter, the input (returned as a view)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16, dtype=torch.float64))
        self.v = nn.Parameter(torch.randn(16, 16, dtype=torch.float64))
        self.register_buffer("buf", torch.randn(16, dtype=torch.float64))
        self.register_buffer("ring", torch.zeros(4, 16, dtype=torch.float64))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))

    def forward(self, x, state):  # type: ignore[no-untyped-def]
        with torch.no_grad():
            self.w.clamp_(-1.0, 1.0)
        b_old = self.buf * 1.0
        h = torch.sin(x @ self.w) * b_old
        self.buf[:8].mul_(0.5)
        self.buf.add_(h.detach().mean(0))
        h2 = torch.cos(h @ self.v) + self.buf
        self.ring.index_copy_(0, (self.ptr % 4).reshape(1), h2.detach().mean(0, keepdim=True))
        self.ptr += 1
        state.mul_(0.9).add_(h2.detach().sum(0))
        return torch.tanh(h2 * b_old) + self.ring.sum(0), state[:4]


@pytest.mark.parametrize("options", [{}, {"remat": {"budget": 0}}])
def test_in_place_writes_to_parameters_buffers_and_inputs_train_like_eager(options):
    """A review's training loop (SGD, 3 steps): graphopt matched eager exactly (weights,
    buffers, the input state, every gradient) where torch 2.13's aot_eager was 11 off in
    the clamped weight's gradient; pinned so a refactor cannot lose it."""
    def train(compiled: bool) -> list[torch.Tensor]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _Mutating()
        step_fn = _graphopt(model, **options) if compiled else model
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
        state = torch.zeros(16, dtype=torch.float64)
        seen = []
        for step in range(3):
            x = torch.randn(5, 16, dtype=torch.float64, requires_grad=True,
                            generator=torch.Generator().manual_seed(step))
            y, view = step_fn(x, state)
            loss = (y ** 2).sum() + view.sum()
            opt.zero_grad()
            loss.backward()
            seen += [loss.detach(), x.grad, model.w.grad.clone(), model.v.grad.clone()]
            opt.step()
        return seen + [model.w.detach(), model.v.detach(), state, *model.buffers()]

    graphopt.clear_reports()
    got = train(True)
    assert all(r.fallback is None for r in graphopt.reports())
    for g, w in zip(got, train(False)):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)


class _ScaledByCounter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8, dtype=torch.float64)
        self.register_buffer("count", torch.zeros(1, dtype=torch.float64))

    def forward(self, x):  # type: ignore[no-untyped-def]
        self.count.add_(1)
        return self.lin(x).tanh() * self.count


@pytest.mark.parametrize("options", [{}, {"remat": {"budget": 0}}])
def test_a_buffer_written_then_read_by_the_backward_keeps_eager_gradients(options):
    """A review: torch 2.13's aot_eager doubles the weight gradient of
    ``count.add_(1); lin(x).tanh() * count`` (5.25 -> 10.50) where graphopt matched eager;
    pinned so a refactor of the mutation handling cannot lose it."""
    def grads(compiled: bool) -> list[torch.Tensor]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _ScaledByCounter()
        fn = _graphopt(model, **options) if compiled else model
        out = []
        for step in range(3):
            x = torch.randn(4, 8, dtype=torch.float64,
                            generator=torch.Generator().manual_seed(step))
            model.zero_grad()
            fn(x).pow(2).sum().backward()
            out += [model.lin.weight.grad.clone(), model.count.clone()]
        return out

    graphopt.clear_reports()
    got = grads(True)
    assert graphopt.reports() and all(r.fallback is None for r in graphopt.reports())
    for g, w in zip(got, grads(False), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def test_batch_norm_inside_a_checkpoint_and_compiled_autograd_on_the_eager_lowering():
    """Train-mode BatchNorm in a checkpoint region: the eager lowering's backward refused
    the running statistics' version counters (input mutations now stay in the graph, as
    aot_eager keeps them). Compiled autograd's graphs take a list of tensors, which the
    eager lowering's AOTAutograd call refused: they are flattened and fall back."""
    import copy

    import torch.utils.checkpoint as checkpoint

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear, self.bn = nn.Linear(6, 6), nn.BatchNorm1d(6)

        def forward(self, x):  # type: ignore[no-untyped-def]
            return checkpoint.checkpoint(lambda t: self.bn(self.linear(t)).relu(), x,
                                         use_reentrant=False).sin()

    torch.manual_seed(0)
    model = Model().double()
    reference, aot = copy.deepcopy(model), copy.deepcopy(model)
    x = torch.randn(5, 6, dtype=torch.float64)
    torch._dynamo.reset()
    _graphopt(model)(x).sum().backward()
    reference(x).sum().backward()
    torch._dynamo.reset()
    torch.compile(aot, backend="aot_eager")(x).sum().backward()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=1e-12)
    # eager's recomputation updates the running statistics a second time; compiled
    # checkpoints (aot_eager, graphopt) update them once
    assert int(reference.bn.num_batches_tracked) == 2 and int(model.bn.num_batches_tracked) == 1
    torch.testing.assert_close(model.bn.running_mean, aot.bn.running_mean, rtol=0, atol=0)

    mlp = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    copy_mlp = copy.deepcopy(mlp)
    x = torch.randn(5, 4, dtype=torch.float64)
    torch._dynamo.reset()
    graphopt.clear_reports()
    with torch._dynamo.compiled_autograd._enable(_graphopt):
        _graphopt(mlp)(x).pow(2).sum().backward()
    copy_mlp(x).pow(2).sum().backward()
    for got, want in zip(mlp.parameters(), copy_mlp.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=1e-12)
    assert any("compiled autograd" in (r.fallback or "") for r in graphopt.reports())


def test_a_buffer_written_in_place_with_a_gradient_is_captured():
    """``out = zeros_like(x); out[:, i] = x[:, i] * 2`` (RWKV's and Qwen3-Next's recurrent
    loops): normalize recorded whether autograd reaches ``out`` when it was created (False),
    Dynamo after the writes (True), so the capture guard saw a lost gradient path and fell
    back on a plain ATen graph (found by a review of transformers model families)."""
    def fn(x, w):
        x = x * w
        out = torch.zeros_like(x)
        for i in range(x.shape[1]):
            out[:, i] = x[:, i] * 2
        return out.sum(), out

    x = torch.randn(2, 4, 3, dtype=torch.float64)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    graphopt.clear_reports()
    loss, out = _graphopt(fn)(x, w)
    assert graphopt.last_report().fallback is None
    want_loss, want_out = fn(x, w)
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(torch.autograd.grad(loss, w), torch.autograd.grad(want_loss, w),
                               rtol=0, atol=1e-14)


def test_an_output_of_data_dependent_size_is_captured():
    """``a[a > 0]`` returned from the graph (capture_dynamic_output_shape_ops): the re-trace
    names its unbacked size u1 where Dynamo's is u0, and the shape check fell back on
    every such graph (a review of torch.compile features)."""
    def fn(x):
        a = x.sin() * 1
        return a[a > 0] * 2, a.cos()

    x = torch.randn(16, dtype=torch.float64)
    graphopt.clear_reports()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        got = torch.compile(fn, backend="graphopt", fullgraph=True,
                            options={"lowering": "eager"})(x)
    for g, w in zip(got, fn(x)):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    report = graphopt.last_report()
    assert report.fallback is None
    assert any(p.count("rewritten") for p in report.pass_records("remove_noops"))


def test_an_in_place_add_of_a_gradient_carrying_value_is_captured():
    """``out = x @ w1; out.add_(x @ w2)`` (Llama 4's MoE: shared experts plus routed ones):
    Dynamo's graph keeps reading ``out`` after the write, so the guard's reachability missed
    w2 there ("gained for [w2]") and fell back on every Llama 4 MoE graph (a review)."""
    def fn(x, w1, w2):
        out = x @ w1
        out.add_(x @ w2)
        return out.sum()

    x = torch.randn(4, 3, dtype=torch.float64)
    w1, w2 = (torch.randn(3, 3, dtype=torch.float64, requires_grad=True) for _ in range(2))
    graphopt.clear_reports()
    got = torch.autograd.grad(_graphopt(fn)(x, w1, w2), (w1, w2))
    assert graphopt.last_report().fallback is None
    for g, w in zip(got, torch.autograd.grad(fn(x, w1, w2), (w1, w2))):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-14)


@pytest.mark.parametrize("start", ["clone", "zeros"])
def test_a_setitem_of_a_gradient_carrying_value_is_captured(start):
    """``z[:, 1] = x[:, 1].exp() * w``: Dynamo's setitem node has no value (it returns
    None), so the guard dropped what it writes and fell back ("gained for [w]", a review)
    whether ``z`` was a clone of ``x`` or fresh zeros."""
    def fn(x, w):
        z = x.clone() if start == "clone" else torch.zeros_like(x)
        z[:, 1] = x[:, 1].exp() * w
        return z.cos().sum()

    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    graphopt.clear_reports()
    got = torch.autograd.grad(_graphopt(fn)(x, w), (x, w))
    assert graphopt.last_report().fallback is None
    for g, want in zip(got, torch.autograd.grad(fn(x, w), (x, w))):
        torch.testing.assert_close(g, want, rtol=0, atol=1e-14)


def test_a_meta_function_failing_in_the_re_trace_falls_back_quietly(capfd, caplog):
    """``linalg_solve_triangular``'s meta function fails on symbolic sizes (Qwen3-Next's
    dynamic graphs): the graph falls back with the reason in the report, and FakeTensorMode's
    ~20-line traceback per op is not printed (a review of transformers model families)."""
    def fn(a, b):
        a = a.tril() + 3 * torch.eye(a.shape[-1], dtype=a.dtype)
        return torch.linalg.solve_triangular(a, b, upper=False).sum()

    graphopt.clear_reports()
    compiled = torch.compile(fn, backend="graphopt", dynamic=True,
                             options={"lowering": "eager"})
    with pytest.warns(FallbackWarning, match="normalize failed"):
        for n in (4, 5):
            a = torch.randn(2, n, n, dtype=torch.float64)
            b = torch.randn(2, n, 3, dtype=torch.float64)
            torch.testing.assert_close(compiled(a, b), fn(a, b), rtol=0, atol=1e-12)
    printed = capfd.readouterr().err + caplog.text
    assert "failed while attempting to run meta" not in printed


def test_the_guard_still_sees_a_lost_path_next_to_a_detached_written_buffer():
    """The write propagation above must not make a value autograd does not track carry
    gradient paths: with ``buf.copy_(x * w); y = buf.detach()`` in both graphs, a re-trace
    that loses x's path (``x.detach().sin()`` standing in for it) is still caught (a review
    of that change found it masked)."""
    from graphopt.capture import check_gradient_paths
    from graphopt.normalize import normalize

    graphs = {}

    def grab(name):
        def backend(gm, example_inputs):
            graphs[name] = (gm, example_inputs)
            return gm.forward
        return backend

    def spelled(lose):
        def fn(x, w, v):
            buf = torch.zeros_like(x)
            buf.copy_(x * w)
            return buf.detach() + v + (x.detach() if lose else x).sin()
        return fn

    args = [torch.randn(4, requires_grad=True) for _ in range(3)]
    for name in ("ref", "lost"):
        torch._dynamo.reset()
        torch.compile(spelled(name == "lost"), backend=grab(name), fullgraph=True)(*args)
    assert "lost for ['l_x_']" in check_gradient_paths(graphs["ref"][0],
                                                        normalize(*graphs["lost"]))


@pytest.mark.parametrize("transform", ["grad", "vjp", "jacrev"])
def test_torch_func_transforms_inside_a_compiled_function_compile_and_leave_hooks_working(
        transform):
    """``torch.func.grad``/``vjp``/``jacrev`` inside the compiled function: the graph disables
    saved-tensor hooks while it runs, and graphopt compiled it under identity hooks of its
    own, so it raised where aot_eager works, and left hooks disabled for the process (every
    later compile and eager checkpoint raised; a review). It falls back with the reason,
    equals eager, and checkpointing works afterwards."""
    from torch.utils.checkpoint import checkpoint

    def inner(w, x):
        return (x * w).sin().sum()

    def f(x, w):
        if transform == "grad":
            g = torch.func.grad(inner)(w, x)
        elif transform == "vjp":
            _, pull = torch.func.vjp(lambda w: (x * w).sin(), w)
            (g,) = pull(torch.ones_like(x))
        else:
            g = torch.func.jacrev(inner)(w, x)
        return g * w

    x = torch.randn(3, dtype=torch.float64)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    got = torch.compile(f, backend="graphopt", options={"lowering": "eager"})(x, w)
    torch.testing.assert_close(got, f(x, w), rtol=1e-12, atol=1e-12)
    assert "functorch" in (graphopt.last_report().fallback or "")
    assert torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() is None
    checkpoint(torch.sin, w, use_reentrant=False).sum().backward()


def test_dropped_rewrites_are_not_reported_as_rewritten():
    """When the pipeline drops the model passes' rewrites (here a test pass that loses a
    gradient path), their site records say so: a review read "rewritten" for rewrites
    that had been dropped."""
    import tests.helpers  # noqa: F401  (registers test_detach_output)

    torch._dynamo.reset()
    graphopt.clear_reports()
    model = nn.Linear(4, 4).double()
    compiled = torch.compile(model, backend="graphopt",
                             options={**EAGER, "enable": ["test_detach_output"]})
    with pytest.warns(FallbackWarning, match="requires_grad=False, expected True"):
        out = compiled(_x(2, 4))
    assert out.requires_grad
    (report,) = [r for r in graphopt.reports() if r.status == "compiled"]
    (record,) = [p for p in report.passes if p.name == "test_detach_output"]
    assert [s.action for s in record.sites] == ["skipped"]
    assert record.sites[0].reason.startswith("rewrite dropped: output 0 has requires_grad")


def _write_back_after_read(x, w, b):
    h1 = (x + b).sin()
    h2 = torch.maximum(b, b)
    h3 = torch.where(h1 > 0, h1, h2 * 0.0)
    h1.add_(1)
    h7 = torch.where(h1 > 0, h1, h2 * 0.0)
    b.copy_(h3)
    return h7, h2


def _read_then_write_back(x, w, b):
    h2 = b * 2  # read before the write: no gradient path (Dynamo agrees)
    s1, s2 = x.cos(), x.cos()  # merged by cse
    b.copy_(x.sin() + h2)  # now b carries one from x
    return h2, b * x + s1 * s2 + w


@pytest.mark.parametrize("fn", [_write_back_after_read, _read_then_write_back])
def test_a_write_back_of_a_value_with_a_gradient_leaves_dynamos_fakes_alone(fn):
    """normalize traced on the fakes Dynamo's mode memoizes: b.copy_(value with a gradient)
    gave fake b a CopyBackwards grad_fn, so AOTAutograd failed ("modified by an inplace
    operation") where aot_eager compiles, or the capture check saw a gradient path that
    does not exist and skipped every model pass (a review)."""
    def run(compiled):
        gen = torch.Generator().manual_seed(1203)
        x, w, b = (torch.randn(4, 4, dtype=torch.float64, generator=gen) for _ in range(3))
        x.requires_grad_()
        w.requires_grad_()
        outs = compiled(x, w, b)
        (outs[0].sum() + outs[1].square().sum()).backward()
        return [o.detach() for o in outs] + [b, x.grad] + ([w.grad] if w.grad is not None
                                                          else [])

    torch._dynamo.reset()
    want = run(fn)
    got = run(torch.compile(fn, backend="graphopt", options={"lowering": "eager"}))
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    report = graphopt.last_report()
    assert report.status == "compiled" and report.fallback is None, report.fallback
    if fn is _read_then_write_back:
        assert report.pass_records("cse")[0].count("rewritten") == 1


# --- Dynamo's tensorify restart drops in-place writes to 0-d float64 tensors (torch 2.13;
# backend="aot_eager" leaves the counter at 0). graphopt.restart compiles around it ---


def _counter_step(n, x):
    n.add_(1)
    return x * n


def _counter_iadd(n, x):
    n += 1
    return x * 2


def _counter_chain(n, x):
    n.mul_(2).add_(1)
    return x + 1


def _counter_copy(n, x):
    n.copy_(x.detach().sum())
    return x.sin()


def _run_counter(fn, compiled: bool, lowering: str = "eager", calls: int = 4):
    """Calls 0-1 compile once, call 2 recompiles for requires_grad, call 3 for a new size."""
    torch._dynamo.reset()
    step = _graphopt(fn, lowering=lowering) if compiled else fn
    n = torch.zeros((), dtype=torch.float64)
    seen = []
    for i in range(calls):
        x = torch.linspace(0.5, 2.0, 3 + (i >= 3), dtype=torch.float64, requires_grad=i >= 2)
        y = step(n, x)
        seen.append(y.detach().clone())
        if x.requires_grad:
            y.sum().backward()
            seen.append(x.grad)
    return seen + [n.clone()]


def _counter_out(n, x):
    torch.add(n, 1, out=n)
    return x * 2


def _counter_read(n, x):
    v = n.add_(1).item()
    return x * v


@pytest.mark.parametrize("fn", [_counter_step, _counter_iadd, _counter_chain, _counter_copy,
                                _counter_out, _counter_read])
def test_an_in_place_write_to_a_0d_float64_input_is_kept(fn):
    """AOTAutograd's tensorify pass restarts Dynamo for the 0-d float64 input's value symbol,
    and Dynamo's retrace removes the write whose result is unused (n stayed 0 and x * n
    was 0, as under aot_eager); every recompile of the frame dropped it with no restart.
    graphopt compiles the same graph again instead; outputs, gradients and n match eager."""
    graphopt.clear_reports()
    with torch._dynamo.config.patch(capture_scalar_outputs=fn is _counter_read):
        got = _run_counter(fn, compiled=True)
    statuses = [r.status for r in graphopt.reports()]
    assert sum("same graph compiled again" in s for s in statuses) == 3, statuses
    for g, w in zip(got, _run_counter(fn, compiled=False), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-15)


def test_an_in_place_write_to_a_0d_float64_input_is_kept_by_inductor():
    got = _run_counter(_counter_step, compiled=True, lowering="inductor", calls=2)
    for g, w in zip(got, _run_counter(_counter_step, compiled=False, calls=2), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-15)


class _StepCounted(nn.Module):
    """A float64 step-count buffer read after its update (a review's reproducer)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).double()
        self.register_buffer("steps", torch.zeros((), dtype=torch.float64))

    def forward(self, x):  # type: ignore[no-untyped-def]
        self.steps.add_(1)
        return self.lin(x) * self.steps.rsqrt()


def test_a_step_count_buffer_trains_like_eager():
    def train(compiled: bool) -> list[torch.Tensor]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _StepCounted()
        step = _graphopt(model) if compiled else model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(3):
            x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
            step(x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        return [*model.parameters(), model.steps]

    got = train(True)
    assert float(got[-1]) == 3.0
    for g, w in zip(got, train(False), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-14)


def test_a_write_dropped_before_graphopt_sees_the_graph_is_traced_again():
    """TensorifyState is global: after aot_eager's restart marked the symbol, Dynamo's graph
    of another frame arrives already lacking the write. graphopt finds it (the fake input's
    version counter exceeds the graph's writes), unmarks the symbol and restarts."""
    torch._dynamo.reset()
    torch.compile(_counter_step, backend="aot_eager")(torch.zeros((), dtype=torch.float64),
                                                       torch.ones(3, dtype=torch.float64))
    graphopt.clear_reports()

    def other(n, x):
        n.add_(1)
        return x * n

    n = torch.zeros((), dtype=torch.float64)
    y = _graphopt(other)(n, torch.ones(3, dtype=torch.float64))
    assert float(n) == 1.0 and y.tolist() == [1.0, 1.0, 1.0]
    assert graphopt.reports()[0].status.startswith(
        "restarted by graphopt (Dynamo traces again): Dynamo's graph lacks the in-place "
        "write(s) L['n']")


def test_a_write_graphopt_cannot_keep_is_refused_by_name(monkeypatch):
    """A second restart of the same graph raises CaptureError naming the write and the fix,
    never compiles without it."""
    from torch._dynamo.symbolic_convert import TensorifyState

    def always_restarts(gm, *args):  # type: ignore[no-untyped-def]
        for node in gm.graph.nodes:
            memo = getattr(node.meta.get("example_value"), "item_memo", None)
            if memo is not None:
                TensorifyState.specialize(memo.node._expr.name)
        raise torch._dynamo.exc.TensorifyScalarRestartAnalysis

    monkeypatch.setattr(graphopt.pipeline, "_compile_graph", always_restarts)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"CaptureError.*add_ of L\['n'\].*shape \(1,\)"):
        _graphopt(_counter_step)(torch.zeros((), dtype=torch.float64), torch.ones(3))


def test_a_write_kept_through_two_tensorify_restarts():
    """A float clamp bound that changes between calls: the retry's tensorify pass asked to
    restart again for the float (a round per autograd level) and graphopt refused the
    counter it had kept (a review); it now compiles again while the write is still there."""
    def f(n, x, p):
        n.add_(1)
        return x.clamp(min=-p, max=p) * n

    def run(compiled: bool) -> list[torch.Tensor]:
        torch._dynamo.reset()
        step = _graphopt(f) if compiled else f
        n, seen = torch.zeros((), dtype=torch.float64), []
        for p in (0.5, 0.75, 0.25):
            x = torch.linspace(-1, 1, 5, dtype=torch.float64, requires_grad=True)
            step(n, x, p).sum().backward()
            seen.append(x.grad)
        return seen + [n]

    graphopt.clear_reports()
    got = run(True)
    assert any("same graph compiled again" in r.status for r in graphopt.reports())
    for g, w in zip(got, run(False), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-15)


def test_a_write_inside_a_checkpoint_body_is_not_a_lost_write():
    """The write is in the checkpoint region's body graph: counting only the top-level
    graph's writes called it lost, and the unmark/restart loop ran 100 times until Dynamo
    gave up compiling the frame (a review)."""
    from torch.utils.checkpoint import checkpoint

    def body(x, n):
        n.add_(1)
        return x.sin() * 2

    def f(x, n):
        return checkpoint(body, x, n, use_reentrant=False) * n

    torch._dynamo.reset()
    graphopt.clear_reports()
    n = torch.tensor(2.0, dtype=torch.float64)
    compiled = _graphopt(f)
    outs = [compiled(torch.linspace(0.1, 1, 3, dtype=torch.float64), n) for _ in range(2)]
    assert float(n) == 4.0
    want = torch.linspace(0.1, 1, 3, dtype=torch.float64).sin() * 2
    torch.testing.assert_close(outs[1], want * 4, rtol=0, atol=1e-15)
    assert [r.status for r in graphopt.reports()].count("compiled") == 1


def test_an_item_read_made_stale_by_a_write_is_refused():
    """torch keeps a 0-d float64 tensor's value symbol across an in-place write, so the second
    .item() returned the first's value: 4.0 where eager gives 8.0, as aot_eager (a review)."""
    def f(x, n):
        a = n.item()
        n.mul_(3)
        b = n.item()
        return x * a + b

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True), \
            pytest.raises(Exception, match=r"CaptureError: the graph reads L\['n'\] with .item"):
        _graphopt(f)(torch.ones(3, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64))


@pytest.mark.parametrize("device, stale", [("cpu", ["n"]), ("cuda", [])])
def test_only_cpu_values_are_taken_for_stale(device, stale):
    """torch memoizes the value of CPU 0-d tensors only; a CUDA counter read before its
    write was refused too (a re-review; checked on fake tensors, no GPU here)."""
    from torch import fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from graphopt import restart

    def f(x, n):
        a = n.item()
        n.add_(1)
        return x * a

    gm = fx.symbolic_trace(f)
    with FakeTensorMode():
        values = {"x": torch.empty(2, dtype=torch.float64, device=device),
                  "n": torch.empty((), dtype=torch.float64, device=device)}
    for node in gm.graph.find_nodes(op="placeholder"):
        node.meta["example_value"] = values[node.name]
    assert restart.stale_reads(gm) == stale


class _LeavesGradModeSwitched(nn.Module):
    """A forward that leaves grad mode switched (legal; eager and aot_eager keep it)."""

    def __init__(self, direction):
        super().__init__()
        self.a, self.b, self.direction = nn.Linear(8, 8), nn.Linear(8, 8), direction

    def forward(self, x):
        if self.direction == "off":  # trained, then "the rest of the step evaluates"
            h = torch.tanh(self.a(x))
            torch.set_grad_enabled(False)
            return h, h * 2
        t = self.a(x)  # called under no_grad: t has no gradient, u has one
        with torch.enable_grad():
            u = self.b(x)
        torch.set_grad_enabled(True)
        return t, u


@pytest.mark.parametrize("direction", ["off", "on"])
@pytest.mark.parametrize("options", [EAGER, {**EAGER, "remat": {"budget": "50%"}}])
def test_a_forward_that_leaves_grad_mode_switched_trains_like_eager(direction, options):
    """A review: the normalize trace ran the graph's ``_set_grad_enabled`` calls and left the
    mode switched for the rest of the compile, so the capture guard compared against the
    wrong mode and fell back to a graph traced under it: ``h`` without requires_grad (the
    layer silently untrained) or a gradient for ``a`` that eager does not have. Outputs'
    requires_grad, the grad mode after the call and every gradient equal eager's, with no
    fallback."""
    def step(model, compiled):
        model.zero_grad(set_to_none=True)
        w = torch.ones(8, dtype=torch.float64, requires_grad=True)  # outside the module
        with torch.set_grad_enabled(direction == "off"):
            first, second = compiled(x)
        after = torch.is_grad_enabled()
        torch.set_grad_enabled(True)
        flags = (first.requires_grad, second.requires_grad, after)
        (first * w + second).sum().backward()
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        return flags, grads + [w.grad], (first.detach(), second.detach())

    torch.manual_seed(0)
    model = _LeavesGradModeSwitched(direction).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    want = step(model, model)
    graphopt.clear_reports()
    compiled = torch.compile(model, backend="graphopt", options=options)
    try:
        for _ in range(2):
            got = step(model, compiled)
    finally:
        torch.set_grad_enabled(True)
    assert got[0] == want[0]
    for a, b in zip(got[1] + list(got[2]), want[1] + list(want[2])):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    reports = graphopt.reports()
    assert reports and all(r.fallback is None and r.status == "compiled" for r in reports), \
        [(r.status, r.fallback) for r in reports]


class _DataWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.register_buffer("ema", torch.zeros(4, 8))

    def forward(self, x):
        self.ema.data.mul_(0.5)
        self.ema.add_(x.detach())
        return self.a(x) + self.ema


def test_a_data_write_in_forward_falls_back_with_the_line_that_does_it():
    """A review: the fallback for ``buffer.data.mul_`` in forward said only "new tensor
    constant '_tensor_constant0' of shape (4, 8)"; it now says what such a constant is and
    the model's line that reads it. The fallback stays exact (buffers too)."""
    torch.manual_seed(0)
    model = _DataWrite().double()
    reference = _DataWrite().double()
    reference.load_state_dict(model.state_dict())
    graphopt.clear_reports()
    compiled = torch.compile(model, backend="graphopt", options=EAGER)
    with pytest.warns(FallbackWarning):
        for _ in range(2):
            x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
            assert_matches_eager(reference, compiled, [x], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model.ema, reference.ema, rtol=0, atol=0)
    reasons = [r.fallback for r in graphopt.reports()]
    assert reasons and "a value the trace did not follow (such as .data of a parameter or " \
        "buffer) frozen into the graph; read at " in reasons[0] and \
        "self.ema.data.mul_(0.5)" in reasons[0], reasons
