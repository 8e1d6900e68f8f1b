"""Dumps: code before/after every pass, diffs, final graphs, renderings, report files."""

import importlib.util
import json
import os

import torch

from tests.helpers import MLP


def _compile_and_train(dump_dir=None):
    options = {"lowering": "eager"}
    if dump_dir is not None:
        options["dump_dir"] = str(dump_dir)
    compiled = torch.compile(MLP(), backend="graphopt", options=options)
    compiled(torch.randn(4, 8, dtype=torch.float64)).sum().backward()


def test_dump_contents(tmp_path):
    _compile_and_train(tmp_path)
    (graph,) = tmp_path.glob("graph_*")
    names = {p.name for p in graph.iterdir()}
    expected = {"00_dynamo.py", "01_normalized.py", "joint.py", "forward.py", "backward.py",
                "report.json", "report.md"}
    for stem in ("02_pre_autograd.model.attention", "03_pre_autograd.model.moe",
                 "04_pre_autograd.model.remove_noops", "05_pre_autograd.model.cse"):
        expected |= {f"{stem}.before.py", f"{stem}.after.py", f"{stem}.diff"}
    assert expected <= names, sorted(names)
    diff = (graph / "04_pre_autograd.model.remove_noops.diff").read_text()
    assert "-" in diff and "aten.mul.Tensor" in diff  # the removed `* 1.0`
    assert "torch.ops.aten" in (graph / "backward.py").read_text()
    report = json.loads((graph / "report.json").read_text())
    assert report["status"] == "compiled"
    assert [p["name"] for p in report["passes"]] == ["attention", "moe", "remove_noops", "cse"]
    assert report["passes"][2]["op_delta"] == {"aten.mul.Tensor": -1}
    assert report["graphs"]["backward"] > 0  # written again after the lazy backward compile
    assert "graphopt_overhead" in report["timing"]
    assert "| remove_noops |" in (graph / "report.md").read_text()
    if importlib.util.find_spec("pydot") is not None:
        assert {"01_normalized.dot", "forward.dot", "backward.dot"} <= names


def test_no_dump_option_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _compile_and_train()
    assert os.listdir(tmp_path) == []


def test_dump_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHOPT_DUMP_DIR", str(tmp_path / "env"))
    _compile_and_train()
    assert len(list((tmp_path / "env").glob("graph_*/report.json"))) == 1


def test_a_new_run_replaces_the_graphs_of_an_earlier_run(tmp_path):
    stale = tmp_path / "graph_9999"  # an id this process will not reach
    stale.mkdir()
    (stale / "report.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("mine")
    import graphopt.dump as dump

    dump._claimed.discard(tmp_path.resolve())
    _compile_and_train(tmp_path)
    assert not stale.exists() and (tmp_path / "notes.txt").exists()
    assert len(list(tmp_path.glob("graph_*/report.json"))) == 1
