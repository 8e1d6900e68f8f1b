"""Dumps: code before/after every pass, diffs, final graphs, renderings, report files."""

import importlib.util
import json
import os
from pathlib import Path

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
    # and again after it: its compile time too (missing without verify, a review)
    assert report["timing"]["lowering_backward"] > 0, report["timing"]
    assert "| remove_noops |" in (graph / "report.md").read_text()
    if importlib.util.find_spec("pydot") is not None:
        assert {"01_normalized.dot", "forward.dot", "backward.dot"} <= names


def test_missing_pydot_is_said_in_the_report(tmp_path, monkeypatch):
    """A new user: without pydot the .dot drawings were missing and nothing said why."""
    from torch.fx.passes import graph_drawer

    def no_pydot(*args, **kwargs):
        raise RuntimeError("FXGraphDrawer requires the pydot package to be installed")

    monkeypatch.setattr(graph_drawer, "FxGraphDrawer", no_pydot)
    _compile_and_train(tmp_path)
    (graph,) = tmp_path.glob("graph_*")
    assert not list(graph.glob("*.dot"))
    assert "pydot is not installed: pip install pydot" in (graph / "report.md").read_text()


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
    (stale / ".owner").write_text(str(_dead_pid()))
    (tmp_path / "notes.txt").write_text("mine")
    # folders the user wrote, with the file names graphopt's have but no .owner (a review:
    # the first compile deleted both)
    mine = [tmp_path / "export", tmp_path / "graph_2024_experiments"]
    for folder in mine:
        folder.mkdir()
        (folder / "report.json").write_text("{}")
        (folder / "model.onnx").write_text("weights")
    import graphopt.dump as dump

    dump._claimed.discard(tmp_path.resolve())
    _compile_and_train(tmp_path)
    assert not stale.exists() and (tmp_path / "notes.txt").exists()
    assert all((folder / "model.onnx").read_text() == "weights" for folder in mine)
    assert len(list(tmp_path.glob("graph_*/report.json"))) == 2  # the user's and this run's
    assert len(list(tmp_path.glob("graph_*/.owner"))) == 1


def test_a_user_folder_with_a_graph_folder_name_is_never_written_or_removed(tmp_path,
                                                                          monkeypatch):
    """A user's graph_000/ without graphopt's .owner: the first run wrote its .owner and
    report.json into it, and the next run removed it with the user's files (a re-review).
    graphopt writes graph_000.pid<P> beside it instead."""
    import itertools

    import graphopt.dump as dump
    import graphopt.report

    mine = tmp_path / "graph_000"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    (mine / "report.json").write_text("{}")
    for _ in range(2):  # two runs
        monkeypatch.setattr(graphopt.report, "_graph_ids", itertools.count())
        dump._claimed.discard(tmp_path.resolve())
        _compile_and_train(tmp_path)
        assert sorted(p.name for p in mine.iterdir()) == ["notes.txt", "report.json"]
        assert (mine / "report.json").read_text() == "{}"
        assert (tmp_path / f"graph_000.pid{os.getpid()}" / "report.json").is_file()


def test_dumps_never_delete_or_share_a_live_process_folder_and_split_ranks(tmp_path,
                                                                            monkeypatch):
    """Two processes on one dump directory deleted each other's graph folders (each claims
    the directory on its first dump) and one compile died on a missing report.json (found
    by a review). A folder another live process owns is kept and this process writes
    beside it; torchrun ranks write under rank<R>/; an export writes export/; a write that
    fails warns and the compile goes on."""
    import warnings

    from graphopt.cli import _dump_order
    from graphopt.dump import Dumper
    from graphopt.report import CompileReport

    other = tmp_path / "graph_000"
    other.mkdir()
    (other / "report.json").write_text("{}")
    (other / ".owner").write_text(str(os.getppid()))  # a live process that is not this one
    mine = Dumper(tmp_path, 0, CompileReport(graph_id=0))
    assert other.exists() and mine.dir == tmp_path / f"graph_000.pid{os.getpid()}"
    assert (mine.dir / ".owner").read_text().split()[0] == str(os.getpid())
    import itertools

    monkeypatch.setattr("graphopt.dump._EXPORTS", itertools.count())
    export = Dumper(tmp_path, -1, CompileReport(graph_id=-1))
    assert export.dir == tmp_path / "export"
    # a second export of this process beside it (a review: it replaced the first's graphs)
    second = Dumper(tmp_path, -1, CompileReport(graph_id=-1))
    assert second.dir == tmp_path / "export_001"

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    ranked = Dumper(tmp_path / "job", 3, CompileReport(graph_id=3))
    assert ranked.dir == tmp_path / "job" / "rank1" / "graph_003"
    import shutil

    shutil.rmtree(tmp_path / "job")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ranked.write_report()  # its folder is gone: a warning, no exception
    assert ranked.dir is None and any("dump stopped" in str(w.message) for w in caught)

    paths = [Path(name) / "report.json" for name in
             ("graph_1000", "graph_999", "rank1/graph_002", "rank0/graph_010", "export")]
    ordered = sorted(paths, key=_dump_order)
    assert [p.parent.name for p in ordered] == ["graph_999", "graph_1000", "export",
                                                "graph_010", "graph_002"]


def _dead_pid() -> int:
    """The pid of a process that has exited."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_folder_of_a_run_that_ended_meanwhile_is_not_mixed_with_this_one(tmp_path,
                                                                            monkeypatch):
    """Two runs on one directory: the other process owned graph_001 at this one's first
    dump and exited later; this run's graph 1 then wrote its files next to the other's
    forward/backward (a review). Such a folder is now emptied first. And a single process
    removes an earlier torchrun run's rank*/ graphs (rank 0 an earlier single process's and
    those of ranks beyond its world): `graphopt explain` showed both runs' graph 0."""
    import graphopt.dump as dump
    from graphopt.dump import Dumper
    from graphopt.report import CompileReport

    def folder(path: Path, owner: int) -> Path:
        path.mkdir(parents=True)
        (path / "forward.py").write_text("theirs")
        (path / ".owner").write_text(str(owner))
        return path

    dump._claimed.add(tmp_path.resolve())  # this process claimed the directory earlier
    theirs = folder(tmp_path / "graph_001", _dead_pid())
    mine = Dumper(tmp_path, 1, CompileReport(graph_id=1))
    assert mine.dir == theirs and not (theirs / "forward.py").exists()

    single = tmp_path / "single"
    old_rank = folder(single / "rank0" / "graph_000", _dead_pid())
    Dumper(single, 0, CompileReport(graph_id=0))
    assert not old_rank.exists() and (single / "graph_000" / ".owner").exists()

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    old_single = single / "graph_000"
    (old_single / ".owner").write_text(str(_dead_pid()))
    beyond = folder(single / "rank3" / "graph_000", _dead_pid())
    kept = folder(single / "rank1" / "graph_000", os.getppid())  # rank 1, still running
    (single / "rank1\u00b2").mkdir()  # a superscript digit: isdigit() but not int()
    Dumper(single, 0, CompileReport(graph_id=0))
    assert not old_single.exists() and not beyond.exists() and kept.exists()
    assert (single / "rank0" / "graph_000" / ".owner").read_text().split()[0] == \
        str(os.getpid())
    # another host's folder is never judged dead here, nor a user's rank1_notes/ a rank
    (single / "rank1_notes").mkdir()
    (single / "rank1_notes" / "graph_000").mkdir()
    (single / "rank1_notes" / "graph_000" / "report.json").write_text("{}")
    other_host = folder(single / "rank2" / "graph_000", 1)
    (other_host / ".owner").write_text(f"{_dead_pid()} another-node")
    monkeypatch.setenv("WORLD_SIZE", "1")
    dump._claimed.discard(single.resolve())
    Dumper(single, 0, CompileReport(graph_id=0))
    assert other_host.exists() and (single / "rank1_notes" / "graph_000").exists()


def test_dumps_of_a_lambda_are_python(tmp_path):
    """Dynamo names a lambda's graph class ``<lambda>``: most dump files of a compiled lambda
    did not parse (a review); every dumped .py file is Python."""
    import ast

    compiled = torch.compile(lambda x: torch.sin(x) * 2 + x.view(-1).sum(), backend="graphopt",
                             options={"lowering": "eager", "dump_dir": str(tmp_path)})
    compiled(torch.randn(4, requires_grad=True)).sum().backward()
    files = list(tmp_path.rglob("*.py"))
    assert len(files) > 5
    for path in files:
        ast.parse(path.read_text(), filename=str(path))


def _dump_from_a_rank(rank, world, root):
    from graphopt.dump import Dumper
    from graphopt.report import CompileReport

    dirs = [Dumper(Path(root), i, CompileReport(graph_id=i)).dir for i in range(5)]
    return [str(d.relative_to(root)) for d in dirs]


def test_ranks_of_a_process_group_without_torchrun_s_env_dump_apart(tmp_path):
    """Ranks started with mp.spawn + init_process_group set no WORLD_SIZE/RANK: both dumped
    into one folder, and graph folders were lost and mixed between them (a review). The
    process group's rank decides."""
    from graphopt.distributed import run_distributed

    got = run_distributed(_dump_from_a_rank, 2, str(tmp_path))
    assert got == [[f"rank{r}/graph_{i:03d}" for i in range(5)] for r in range(2)]


def test_a_graph_folder_is_claimed_once(tmp_path):
    """Checking the owner and then writing it let two processes take one folder (a review);
    the .owner file is now created exclusively, and a folder claimed first by another
    process leaves this one a .pid sibling."""
    from graphopt.dump import _claim_folder

    folder = tmp_path / "graph_000"
    folder.mkdir()
    (folder / ".owner").write_text("")  # being claimed by another process right now
    assert _claim_folder(folder) == tmp_path / f"graph_000.pid{os.getpid()}"
    assert _claim_folder(tmp_path / "graph_001") == tmp_path / "graph_001"
    assert _claim_folder(tmp_path / "graph_001") == tmp_path / "graph_001"  # a recompile


def test_dump_dir_paths_are_absolute_and_bad_ones_are_named(tmp_path, monkeypatch):
    """A relative dump_dir was resolved at each compile (after a chdir the graphs went to
    another folder), '~nosuchuser' was a raw RuntimeError and a file was 'cannot be written
    (File exists)' (a review)."""
    import pytest

    from graphopt import ConfigError, GraphoptConfig

    monkeypatch.chdir(tmp_path)
    config = GraphoptConfig.from_options({"dump_dir": "dumps"})
    assert config.dump_dir == tmp_path / "dumps"
    with pytest.raises(ConfigError, match="'~nosuchuser_graphopt/x'.*pass a writable"):
        GraphoptConfig.from_options({"dump_dir": "~nosuchuser_graphopt/x"})
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        GraphoptConfig.from_options({"dump_dir": str(tmp_path / "file")})


def test_a_rank_keeps_its_own_graphs_from_before_its_process_group(tmp_path):
    """Graphs dumped before init_process_group go to the top level, later ones under
    rank<R>/; rank 0's first rank-folder dump removed its own earlier graphs as an earlier
    run's (a re-review)."""
    from graphopt.dump import Dumper, _claim
    from graphopt.report import CompileReport

    early = Dumper(tmp_path, 0, CompileReport(graph_id=0)).dir
    assert early == tmp_path / "graph_000"
    _claim(tmp_path, tmp_path / "rank0")
    assert (early / ".owner").is_file()
