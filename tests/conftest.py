import os

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest
import torch

import graphopt

# Under pytest-xdist (README's `-n 2`) the workers share the cores: each takes its share of
# torch's threads instead of all of them (two workers of 2 threads each on 2 cores slowed
# the compute-bound tests)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, torch.get_num_threads() // _WORKERS))


@pytest.fixture(autouse=True)
def fresh_compile_state():
    torch._dynamo.reset()
    graphopt.clear_reports()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def no_env_dump_dir(monkeypatch):
    monkeypatch.delenv("GRAPHOPT_DUMP_DIR", raising=False)
