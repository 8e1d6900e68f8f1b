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
