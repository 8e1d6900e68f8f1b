"""remove_noops: graph in, graph out, refusals, numerics."""

import torch

from graphopt.testing import as_function, assert_matches_eager, run_pass, trace_for_pass


def test_removes_identity_ops():
    def fn(x):
        x = torch.sin(x)  # (an identity on a graph input is kept: -k storage_offset)
        a = x.view(x.shape) * 1
        b = a.reshape(4, 6)[:, :] - 0
        c = b.contiguous().to(torch.float64).expand(4, 6)
        return torch.sin(c)

    x = torch.randn(4, 6, dtype=torch.float64)
    gm = trace_for_pass(fn, x)
    gm, record = run_pass("remove_noops", gm)
    assert record.count("rewritten") == record.nodes_before - record.nodes_after >= 6
    ops = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert ops == {torch.ops.aten.sin.default}, gm.code
    assert_matches_eager(fn, as_function(gm, fn), [x])


def test_keeps_real_ops_that_look_like_noops():
    def fn(x, y):
        return (x.view(2, 12), x * 1.5, x.to(torch.float32), x.reshape(6, 4), x + y, x[:, 1:])

    x = torch.randn(4, 6, dtype=torch.float64)
    gm = trace_for_pass(fn, x, torch.zeros(4, 6, dtype=torch.float64))
    _, record = run_pass("remove_noops", gm)
    assert record.count("rewritten") == 0 and not record.modified


def test_refuses_when_result_is_returned_or_written_in_place():
    def fn(x):
        returned = x * 1          # removing it would hand the caller an alias of x
        written = x - 0
        written.add_(1)           # removing it would write into x
        return returned, written

    x = torch.randn(3, dtype=torch.float64)
    gm = trace_for_pass(fn, x)
    gm, record = run_pass("remove_noops", gm)
    reasons = [s.reason for s in record.sites if s.action == "skipped"]
    assert record.count("rewritten") == 0
    assert any("graph output" in r for r in reasons) and any("in place" in r for r in reasons)
    assert_matches_eager(fn, as_function(gm, fn), [x])


def test_symbolic_shapes_only_removed_when_provably_equal():
    def fn(x, y):
        return x.expand(x.shape[0], 5) + y.view(y.shape[0], 5).reshape(-1, 5)

    x, y = torch.randn(3, 5), torch.randn(3, 5)
    gm = trace_for_pass(fn, x, y, dynamic=True)
    assert any(n.name.startswith("s") for n in gm.graph.find_nodes(op="placeholder"))
    gm, record = run_pass("remove_noops", gm)
    assert record.count("rewritten") == 3  # expand, view, reshape: same symbolic shape
    x, y = torch.randn(6, 5), torch.randn(6, 5)  # another size: the graph is symbolic
    torch.testing.assert_close(as_function(gm, fn)(x, y), fn(x, y))


def test_adding_zero_is_kept_for_floats_signed_zero():
    """IEEE: -0.0 + 0 = +0.0, so x + 0 is no identity for floats (1/(x + 0) at x = -0.0 is
    +inf, 1/x is -inf); integers lose nothing."""
    def fn(x, i):
        x, i = x * 2, i * 3  # (an identity on a graph input is kept: -k storage_offset)
        return 1.0 / (x + 0), 1.0 / (x * 1), (i + 0) * 2

    x = torch.tensor([-0.0, 1.0, -2.0], dtype=torch.float64)
    i = torch.tensor([1, -2])
    gm = trace_for_pass(fn, x, i)
    gm, record = run_pass("remove_noops", gm)
    removed = {s.reason.split(":")[0] for s in record.sites if s.action == "rewritten"}
    assert removed == {"aten.mul.Tensor returns its input", "aten.add.Tensor returns its input"}
    assert [n.target for n in gm.graph.nodes].count(torch.ops.aten.add.Tensor) == 1
    torch.testing.assert_close(as_function(gm, fn)(x, i), fn(x, i))
    assert as_function(gm, fn)(x, i)[0][0] == float("inf")


def test_complex_arithmetic_with_one_or_zero_is_kept():
    """PyTorch multiplies a complex tensor by 1 + 0j: inf * 0 is nan and a -0.0 part turns
    +0.0, so z * 1 and z / 1 are no identities (1/imag was -inf where eager gives +inf, a
    review); nothing is removed and the outputs are bit-equal to eager."""
    def fn(z):
        return 1.0 / (z * 1).imag, (z / 1).angle(), z * 1

    z = torch.tensor([complex(1.0, -0.0), complex(float("inf"), 1.0)], dtype=torch.complex128)
    gm = trace_for_pass(fn, z)
    gm, record = run_pass("remove_noops", gm)
    assert not [s for s in record.sites if s.action == "rewritten"], record.sites
    for got, want in zip(as_function(gm, fn)(z), fn(z)):
        torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    assert as_function(gm, fn)(z)[0][0] == float("inf")


def test_refuses_when_an_alias_is_written_or_returned():
    """Found by a hostile review; each was removed and gave wrong outputs/gradients or
    handed the caller its own input: a write through a view of the candidate or of its
    input, a view of the candidate returned, the candidate returned as a view of the input."""
    def fn(x, w):
        h = w * 3
        y = h * 1
        h.view(-1).mul_(2)                    # y must keep h's value before the write
        z = x * 1
        z.view(-1).add_(1)                    # must not write into x
        return x * y + z, (w * 1).view(-1), w.view(w.shape)

    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    gm = trace_for_pass(fn, x, w)
    gm, record = run_pass("remove_noops", gm)
    assert record.count("rewritten") == 0, [s.reason for s in record.sites]
    reasons = " ".join(s.reason for s in record.sites)
    assert "through a view" in reasons and "a view of it is a graph output" in reasons
    assert "input tensor itself" in reasons
    assert_matches_eager(fn, as_function(gm, fn), [x, w])
    x0 = x.detach().clone()
    out = as_function(gm, fn)(x.detach(), w.detach())
    assert out[2] is not w and torch.equal(x.detach(), x0)


def test_refuses_across_grad_mode_regions():
    """y = x * 1 under no_grad has no gradient; its users must not read x instead."""
    def fn(x):
        with torch.no_grad():
            y = x * 1
            v = x.view(x.shape)
            s = x[:, :]
        return x * y + x * v + x * s

    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    gm = trace_for_pass(fn, x)
    gm, record = run_pass("remove_noops", gm)
    assert record.count("rewritten") == 0
    assert all("grad-mode region" in s.reason for s in record.sites), record.sites
    assert_matches_eager(fn, as_function(gm, fn), [x])


def test_an_explicit_copy_is_kept_whatever_the_overload():
    """copy=True is aten.to.device's 5th argument (aten.to.dtype's 4th)."""
    def fn(x):
        y = x.to(x.device, x.dtype, copy=True)
        z = x.to(x.dtype, copy=True)
        x.add_(1)
        return y + z

    gm = trace_for_pass(fn, torch.randn(3, dtype=torch.float64))
    gm, record = run_pass("remove_noops", gm)
    assert record.count("rewritten") == 0
    x = torch.randn(3, dtype=torch.float64)
    torch.testing.assert_close(as_function(gm, fn)(x.clone()), fn(x.clone()))


def test_refuses_when_a_list_view_or_an_aliased_input_is_written():
    """y = x * 1 written through y.split(...)[0] (the write landed on the caller's x), and
    y = x * 1 read after a write through xv, an input that is a view of x (found by a
    second review). The fake values' shared storages say what aliases what."""
    def split_write(x):
        y = x * 1
        y.split(2, 0)[0].mul_(3)
        return y.sin()

    def aliased_inputs(x, xv):
        y = x * 1
        xv.add_(1)
        return y.sin()

    for fn, make in ((split_write, lambda b: (b,)), (aliased_inputs, lambda b: (b, b[0]))):
        base = torch.randn(4, 3, dtype=torch.float64)
        gm = trace_for_pass(fn, *make(base.clone()))
        gm, record = run_pass("remove_noops", gm)
        assert record.count("rewritten") == 0, (fn.__name__, record.sites)
        mine, ref = base.clone(), base.clone()
        torch.testing.assert_close(as_function(gm, fn)(*make(mine)), fn(*make(ref)))
        torch.testing.assert_close(mine, ref)


def test_an_arithmetic_identity_that_makes_a_strided_input_dense_is_kept():
    """``x[:, ::2] * 1`` is a new dense tensor (strides (3, 1)), the slice (6, 2): an
    ``as_strided`` after it read other elements once the multiply was removed (a review's
    signal framing: outputs 6.5, gradients 5.0 off eager, silently). Same-stride identities
    are still removed."""
    def fn(x):
        y = x[:, ::2] * 1
        z = x[:, 1:5] - 0  # strides (6, 1) -> (4, 1): kept too
        w = x.exp().t() / 1  # a transposed dense tensor keeps its strides: removed
        return y.as_strided((2, 3), (3, 1)) * 2, z.sin(), w.sin()

    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    gm = trace_for_pass(fn, x)
    gm, record = run_pass("remove_noops", gm)
    removed = [s.reason for s in record.sites if s.action == "rewritten"]
    assert len(removed) == 1 and "div" in removed[0], record.sites
    assert_matches_eager(fn, as_function(gm, fn), [x])
    compiled = torch.compile(fn, backend="graphopt", options={"lowering": "eager"})
    assert_matches_eager(fn, compiled, [x])


def test_to_memory_format_is_removed_only_where_eager_returns_its_input():
    """Eager's ``to(memory_format=f)`` returns its input when the input's suggested format
    is f, not whenever it is contiguous in f: an (N, 1, H, W) tensor is contiguous in both
    formats and eager copies it. Removed, an ``as_strided`` after it read the base's
    elements (a review: outputs 4.0 off eager)."""
    def fn(base, c):
        y = base[1:].to(memory_format=torch.channels_last)  # (2, 1, 3, 3), offset 9: copied
        z = c.to(memory_format=torch.channels_last)  # already channels_last: returned
        return torch.as_strided(y, (2, 9), (9, 1), 0) * 2, z.sin()

    base = torch.randn(3, 1, 3, 3, dtype=torch.float64, requires_grad=True)
    c = torch.randn(2, 3, 4, 4, dtype=torch.float64).to(memory_format=torch.channels_last)
    gm = trace_for_pass(fn, base, c)
    gm, record = run_pass("remove_noops", gm)
    assert record.count("rewritten") == 1, record.sites
    assert_matches_eager(fn, as_function(gm, fn), [base, c.requires_grad_()])


def test_an_arithmetic_identity_on_a_view_into_a_larger_storage_is_kept():
    """``x[1:] * 1`` has the slice's strides but a storage of its own, from offset 0;
    ``z.conj().imag * 1`` also resolves a lazy negation. Removed, an ``as_strided`` after
    them read the base's elements (a review: 4.0 off eager) and ``view(torch.int64)`` of the
    neg-bit view failed the graph. On a tensor owning its storage the identity still goes."""
    def fn(base, z, w):
        base, z = base.exp(), z.exp()
        y = base[1:] * 1
        n = z.conj().imag * 1
        return (torch.as_strided(y, (2, 3), (3, 1), 0) * 2, n.view(torch.int64),
                (w.exp() * 1).sin())

    base = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    z = torch.randn(4, dtype=torch.complex128)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    gm = trace_for_pass(fn, base, z, w)
    gm, record = run_pass("remove_noops", gm)
    assert record.count("rewritten") == 1, record.sites
    assert_matches_eager(fn, as_function(gm, fn), [base, z, w])
    compiled = torch.compile(fn, backend="graphopt", options={"lowering": "eager"})
    assert_matches_eager(fn, compiled, [base, z, w])


def test_an_arithmetic_identity_on_a_graph_input_is_kept_whatever_its_storage_offset():
    """Dynamo's guards check an input's sizes and strides, not its storage offset: compiled
    for ``arange(4.)``, the graph ran on ``base[3:7]`` and an ``as_strided`` after the
    removed ``x * 1`` read ``base[0:2]`` (a re-review: 3.0 off eager; where eager raises
    out of bounds, a value). An identity whose input is a graph input or a view of one is
    kept, with the reason."""
    def fn(x):
        return (x * 1).as_strided((2,), (1,), 0) + 0.5

    gm = trace_for_pass(fn, torch.arange(4.0, dtype=torch.float64))
    gm, record = run_pass("remove_noops", gm)
    assert record.count("rewritten") == 0 and any(
        "storage offset" in s.reason for s in record.sites if s.action == "skipped")
    for dynamic in (False, True):
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="graphopt", dynamic=dynamic,
                                 options={"lowering": "eager"})
        base = torch.arange(10.0, dtype=torch.float64)
        torch.testing.assert_close(compiled(base[:4]), fn(base[:4]))
        torch.testing.assert_close(compiled(base[3:7]), fn(base[3:7]))
