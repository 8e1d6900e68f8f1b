"""verify=True: catches a deliberately wrong pass and names it; tolerates approximate ones."""

import pytest
import torch

import graphopt
from graphopt import VerificationError
from tests.helpers import MLP


def _run(options, train=True):
    model = MLP()
    compiled = torch.compile(model, backend="graphopt",
                             options={"lowering": "eager", "verify": True, **options})
    x = torch.randn(4, 8, dtype=torch.float64)
    if train:
        return compiled(x).sum().backward()
    with torch.no_grad():
        return compiled(x)


def test_verify_passes_for_exact_pipeline():
    _run({})
    report = graphopt.last_report()
    assert report.verify == {"status": "passed", "detail": "outputs and gradients match eager"}
    assert "verify" in report.timing


def test_wrong_exact_pass_is_caught_and_named():
    with pytest.raises(VerificationError, match=r"pass 'test_wrong_exact' claims to be exact "
                       r"but changed the numerics: output 0: max abs error"):
        _run({"enable": ["test_wrong_exact"]})
    assert graphopt.last_report().verify["status"] == "failed"


def test_wrong_exact_pass_caught_in_inference_too():
    with pytest.raises(VerificationError, match="test_wrong_exact"):
        _run({"enable": ["test_wrong_exact"]}, train=False)


def test_wrong_joint_pass_is_caught_and_named():
    with pytest.raises(VerificationError, match=r"joint pass 'test_wrong_joint' changed the "
                       r"numerics"):
        _run({"enable": ["test_wrong_joint"]})


def test_approximate_pass_is_reported_not_raised():
    _run({"enable": ["test_wrong_approximate"]})
    verify = graphopt.last_report().verify
    assert verify["status"] == "approximate"
    assert verify["approximate"][0]["pass"] == "test_wrong_approximate"


def test_graph_with_active_dropout_is_skipped_with_reason():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)).train()
    compiled = torch.compile(model, backend="graphopt",
                             options={"lowering": "eager", "verify": True})
    compiled(torch.randn(4, 8))
    verify = graphopt.last_report().verify
    assert verify["status"] == "skipped" and "random" in verify["detail"]


def test_verify_leaves_user_parameters_and_grads_untouched():
    model = MLP()
    before = [p.detach().clone() for p in model.parameters()]
    compiled = torch.compile(model, backend="graphopt",
                             options={"lowering": "eager", "verify": True})
    compiled(torch.randn(4, 8, dtype=torch.float64))
    assert all(p.grad is None for p in model.parameters())
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)


def test_nan_and_inf_outputs_are_compared_position_by_position():
    from graphopt.config import GraphoptConfig
    from graphopt.verify import compare_outcomes

    config = GraphoptConfig()
    ref = ([torch.tensor([float("inf"), 1.0, float("nan")])], [])
    assert compare_outcomes(ref, ([torch.tensor([float("inf"), 1.0, float("nan")])], []),
                            config) is None
    assert compare_outcomes(ref, ([torch.tensor([float("inf"), 1000.0, float("nan")])], []),
                            config) is not None
    compiled = torch.compile(lambda x: x.log(), backend="graphopt",
                             options={"lowering": "eager", "verify": True})
    compiled(torch.randn(8))  # NaN for negative inputs on both sides: passes, no crash
    assert graphopt.last_report().verify["status"] == "passed"
