import os

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest
import torch

import graphopt


@pytest.fixture(autouse=True)
def fresh_compile_state():
    torch._dynamo.reset()
    graphopt.clear_reports()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def no_env_dump_dir(monkeypatch):
    monkeypatch.delenv("GRAPHOPT_DUMP_DIR", raising=False)


@pytest.fixture(scope="session", autouse=True)
def shared_process_groups():
    """Multi-rank tests share their spawned ranks and gloo groups (one pool per world size)
    instead of spawning per call: graphopt.distributed.shared_ranks."""
    from graphopt.distributed import shared_ranks

    with shared_ranks():
        yield
