"""cse: merges identical pure ops; refuses across mutation, RNG and grad-mode changes."""

import operator

import pytest
import torch

from graphopt.testing import (
    as_function,
    assert_matches_eager,
    assert_op_delta,
    run_pass,
    trace_for_pass,
)
from tests.helpers import noisy


def test_merges_repeated_expressions():
    def fn(x, slope):
        decays = [torch.exp(-slope * 16) for _ in range(3)]  # like MiniMax's unrolled loop
        return sum(d * x for d in decays)

    x, slope = torch.randn(4, 1, 1, dtype=torch.float64), torch.rand(4, 1, 1, dtype=torch.float64)
    gm = trace_for_pass(fn, x, slope)
    gm, record = run_pass("cse", gm)
    assert_op_delta(record, {"aten.exp.default": -2, "aten.mul.Tensor": -4,
                             "aten.neg.default": -2})
    assert record.count("rewritten") == 8
    assert_matches_eager(fn, as_function(gm, fn), [x.requires_grad_(), slope.requires_grad_()])


def test_does_not_merge_random_ops():
    def fn(x):
        return torch.rand_like(x) + torch.rand_like(x)

    gm = trace_for_pass(fn, torch.randn(3))
    _, record = run_pass("cse", gm)
    assert record.count("rewritten") == 0


def test_does_not_merge_another_librarys_op():
    """A torch.library op of another library may draw random numbers (noise injection) or
    have side effects; its schema does not say (a review), so two calls stay two."""
    def fn(x):
        return noisy(x) + noisy(x)

    gm = trace_for_pass(fn, torch.randn(3))
    _, record = run_pass("cse", gm)
    assert record.count("rewritten") == 0

    def around(x):  # declared without writes: no barrier for the ops around it
        return torch.sin(x) * 2 + noisy(x) + torch.sin(x) * 2

    _, record = run_pass("cse", trace_for_pass(around, torch.randn(3)))
    assert_op_delta(record, {"aten.sin.default": -1, "aten.mul.Tensor": -1})


def test_does_not_merge_across_in_place_write():
    def fn(x):
        a = torch.sin(x)
        x.add_(1)
        b = torch.sin(x)
        return a + b

    gm = trace_for_pass(fn, torch.randn(3))
    gm, record = run_pass("cse", gm)
    assert record.count("rewritten") == 0
    x = torch.randn(3)
    torch.testing.assert_close(as_function(gm, fn)(x.clone()), fn(x.clone()))


def test_does_not_merge_across_grad_mode_change():
    def fn(x):
        a = torch.exp(x)
        with torch.no_grad():
            b = torch.exp(x)
        return a + b

    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    gm = trace_for_pass(fn, x)
    gm, record = run_pass("cse", gm)
    assert record.count("rewritten") == 0
    assert_matches_eager(fn, as_function(gm, fn), [x])


def test_does_not_merge_values_written_through_a_view():
    """A write through select/slice/view lands on a view node; its base is written too
    (found by a hostile review: these were merged and gave wrong outputs and gradients)."""
    def fn(x):
        b, c = x.clone(), x.clone()
        b[0] = 5.0                            # select + copy_ on b's storage
        m1, m2 = torch.zeros(6, dtype=x.dtype), torch.zeros(6, dtype=x.dtype)
        m1[:3] = 1.0                          # slice + fill_
        m2[3:] = 1.0
        y, z = x * 2, x * 2
        y.view(-1).add_(1)                    # view + add_
        return b * c + (m1 - 2 * m2) * x + y * z

    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    gm = trace_for_pass(fn, x)
    gm, record = run_pass("cse", gm)
    merged = [s.reason for s in record.sites if s.action == "rewritten"]
    assert not any(r.startswith(("aten.clone", "aten.zeros", "aten.mul.Tensor merged into mul"))
                   for r in merged), merged
    assert_matches_eager(fn, as_function(gm, fn), [x])


def test_signed_zero_scalars_are_different_arguments():
    def fn(x):
        return torch.atan2(x * 0.0, -torch.ones_like(x)) - torch.atan2(x * -0.0,
                                                                      -torch.ones_like(x))

    x = torch.rand(4, dtype=torch.float64) + 0.5
    gm = trace_for_pass(fn, x)
    gm, record = run_pass("cse", gm)
    assert all("aten.mul" not in s.reason for s in record.sites)
    torch.testing.assert_close(as_function(gm, fn)(x), fn(x))  # 2*pi, not 0
    assert record.count("rewritten") == 2  # the two -ones_like(x) merge


def test_two_equal_graph_outputs_stay_two_tensors():
    def fn(x):
        return x * 2, x * 2

    gm = trace_for_pass(fn, torch.randn(3))
    gm, record = run_pass("cse", gm)
    assert record.count("rewritten") == 0
    assert any("graph outputs" in s.reason for s in record.sites if s.action == "skipped")
    x = torch.randn(3)
    a, b = as_function(gm, fn)(x)
    assert a is not b
    a.add_(1)
    torch.testing.assert_close(b, x * 2)


@pytest.mark.parametrize("edit", ["data", "in_place"])
def test_a_returned_tensor_is_not_merged_with_one_saved_for_backward(edit):
    """Found by a review: ``a = x.exp(); b = x.exp(); return a, (b * w).sin().sum()`` merged
    a and b, so autograd saved the returned tensor. A caller that edits it before backward
    (``a.data.mul_(3)``) got a w gradient 15.4 off, silently; ``a.mul_(3)`` raised "modified
    by an inplace operation". Eager and aot_eager are right in both cases."""
    import graphopt

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(6, dtype=torch.float64))

        def forward(self, x):
            a, b = x.exp(), x.exp()
            return a, (b * self.w).sin().sum()

    def grad(model, x):
        a, loss = model(x)
        (a.data if edit == "data" else a).mul_(3.0)
        loss.backward()
        return model.w.grad

    torch.manual_seed(0)
    eager, x = Model(), torch.randn(4, 6, dtype=torch.float64)
    model = Model()
    model.load_state_dict(eager.state_dict())
    graphopt.clear_reports()
    compiled = torch.compile(model, backend="graphopt", options={"lowering": "eager"})
    torch.testing.assert_close(grad(compiled, x.clone()), grad(eager, x.clone()),
                               rtol=1e-12, atol=1e-12)
    (report,) = graphopt.reports()
    (record,) = report.pass_records("cse")
    assert report.fallback is None and record.count("rewritten") == 0
    assert any("saved for the backward" in s.reason for s in record.sites)


def test_training_batch_norms_are_not_merged():
    """aten.batch_norm updates its running statistics in training mode although its schema
    does not say so: two equal calls are two updates."""
    bn = torch.nn.BatchNorm1d(4).double().train()

    def fn(x):
        return bn(x) + bn(x)

    x = torch.randn(5, 4, dtype=torch.float64)
    gm = trace_for_pass(fn, x)
    gm, record = run_pass("cse", gm)
    assert not any("batch_norm" in s.reason for s in record.sites if s.action == "rewritten")
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.aten.batch_norm.default) == 2


def test_aliasing_the_schemas_do_not_annotate_is_seen():
    """Writes through split/unbind lists, through type_as/atleast_2d (they return their
    input itself) and through set_ (found by a second review: each was merged, error 1-5).
    alias_classes reads shared storages from the fake values."""
    def fn(x, w):
        a, a2 = x * 2, x * 2
        a.unbind(0)[0].add_(1)
        b, b2 = x * 3, x * 3
        b.split([1, 3])[1].fill_(5.0)
        c, c2 = x * 4, x * 4
        c.type_as(w).mul_(3)
        d, d2 = x * 5, x * 5
        torch.atleast_2d(d).sub_(1)
        e, e2 = x * 6, x * 6
        y = torch.empty(0, dtype=x.dtype)
        y.set_(e)
        y.add_(1)
        return a + a2 + b + b2 + c + c2 + d + d2 + e + e2

    x, w = torch.randn(4, 3, dtype=torch.float64), torch.randn(2, dtype=torch.float64)
    gm = trace_for_pass(fn, x, w)
    gm, record = run_pass("cse", gm)
    assert not any(s.reason.startswith("aten.mul") for s in record.sites
                   if s.action == "rewritten"), record.sites
    torch.testing.assert_close(as_function(gm, fn)(x.clone(), w), fn(x.clone(), w))


@pytest.mark.parametrize("narrow", [torch.float32, torch.bfloat16])
def test_narrowing_casts_are_not_merged(narrow):
    """Two casts of a float64 activation to float32 (bf16), merged, had the backward sum
    both uses' gradients in float32 (bf16) before casting back, where eager sums them in
    float64. Duplicate casts to a less precise dtype are kept, with the reason; the
    gradient equals eager at float64 precision."""
    w1, w2 = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)

    def fn(x):
        a = x.to(narrow) @ w1.to(narrow)
        b = x.to(narrow) @ w2.to(narrow)
        return (a.to(torch.float64) * 3 + b.to(torch.float64)).sum(-1)

    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    gm = trace_for_pass(fn, x)
    gm, record = run_pass("cse", gm)
    skipped = [s for s in record.sites if s.action == "skipped"]
    assert skipped and all("casts float64 to" in s.reason for s in skipped), record.sites
    assert record.count("rewritten") == 0, record.sites
    assert_matches_eager(fn, as_function(gm, fn), [x], rtol=1e-13, atol=1e-13)


def test_casts_to_a_smaller_range_are_not_merged():
    """bf16 -> fp16 is more precise but of smaller range: two casts merged, the backward
    summed both uses' gradients (4e4 each) in fp16: inf where eager gives 8e4 (a
    re-review)."""
    def fn(x):
        return (x.to(torch.float16) * 4e4).float().sum() + (x.to(torch.float16) * 4e4).float().sum()

    x = torch.randn(4, dtype=torch.bfloat16, requires_grad=True)
    gm = trace_for_pass(fn, x)
    gm, record = run_pass("cse", gm)
    assert any("casts bfloat16 to float16" in s.reason for s in record.sites), record.sites
    (got,) = torch.autograd.grad(as_function(gm, fn)(x), x)
    (want,) = torch.autograd.grad(fn(x), x)
    assert torch.isfinite(got).all() and torch.equal(got, want), (got, want)



@pytest.mark.parametrize("src,narrow", [(torch.float64, torch.complex64),
                                        (torch.complex128, torch.complex64),
                                        (torch.complex128, torch.float32)])
def test_narrowing_casts_into_or_out_of_complex_are_not_merged(src, narrow):
    """Complex values were left out of the narrowing check: two casts of a float64 (or
    complex128) activation to complex64 were merged, their gradients summed in float32
    (a review: 5.8e-3 off eager, 2.4e-8 relative)."""
    def fn(x):
        a = (x.to(narrow) * 3).abs()
        b = (x.to(narrow) * 0.5).sin().abs()
        return (a.double() * 1e4 + b.double()).sum()

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, dtype=src, generator=gen).requires_grad_()
    gm = trace_for_pass(fn, x)
    gm, record = run_pass("cse", gm)
    skipped = [s.reason for s in record.sites if s.action == "skipped"]
    assert any(f"casts {str(src)[6:]} to {str(narrow)[6:]}" in r for r in skipped), \
        record.sites
    assert_matches_eager(fn, as_function(gm, fn), [x], rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("dynamic", [False, True])
def test_merges_across_getitem_and_shape_arithmetic(dynamic):
    """A multi-output op's ``getitem`` and SymInt arithmetic write nothing; counted as
    barriers, ``x.exp()`` twice around a ``chunk`` or a ``view(x.shape[0] * 2, -1)``
    under dynamic shapes was not merged (a review)."""
    def fn(x):
        a = x.exp()
        p, q = x.chunk(2)
        v = x.view(x.shape[0] * 2, -1)
        b = x.exp()
        return (a * b).sum() + (torch.cat([q, p]) * v.sum()).sum()

    x = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    gm = trace_for_pass(fn, x, dynamic=dynamic)
    assert any(n.target is operator.getitem for n in gm.graph.nodes)
    gm, record = run_pass("cse", gm)
    assert_op_delta(record, {"aten.exp.default": -1})
    assert_matches_eager(fn, as_function(gm, fn), [x])
    if dynamic:
        y = torch.randn(6, 2, dtype=torch.float64, requires_grad=True)
        assert_matches_eager(fn, as_function(gm, fn), [y])


@pytest.mark.parametrize("wide,narrow", [(torch.float64, torch.float32),
                                         (torch.float32, torch.bfloat16)])
def test_ops_promoting_an_input_are_not_merged(wide, narrow):
    """The mirror of a narrowing cast: ``x64 * y32`` twice. Eager casts each use's gradient
    to float32 and sums them there; merged, they were summed in float64 and cast once
    (a re-review: y's gradient 4.8e-7 off; a bf16 weight times a float32 activation,
    0.03)."""
    def fn(x, y):
        return ((x * y).sin() * 3 + (x * y).cos()).sum()

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, dtype=wide, generator=gen)
    y = torch.randn(64, dtype=torch.float64, generator=gen).to(narrow).requires_grad_()
    gm = trace_for_pass(fn, x, y)
    gm, record = run_pass("cse", gm)
    assert any(f"promotes {str(narrow)[6:]} to {str(wide)[6:]}" in s.reason
               for s in record.sites if s.action == "skipped"), record.sites
    (got,) = torch.autograd.grad(as_function(gm, fn)(x, y), y)
    (want,) = torch.autograd.grad(fn(x, y), y)
    assert torch.equal(got, want), (got - want).abs().max()
