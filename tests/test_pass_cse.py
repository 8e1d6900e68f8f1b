"""cse: merges identical pure ops; refuses across mutation, RNG and grad-mode changes."""

import torch

from graphopt.testing import (
    as_function,
    assert_matches_eager,
    assert_op_delta,
    run_pass,
    trace_for_pass,
)


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
