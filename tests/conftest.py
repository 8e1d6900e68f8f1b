import os

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import logging

import pytest
import torch

import graphopt

# pytest (9.x) attaches its log-capture handlers to every logger that does not propagate,
# torch's structured-trace logger among them; torch computes each trace payload (graphs
# printed, guards dumped) whenever that logger has a handler, so every compile in the suite
# did that work for pytest's captured DEBUG records. It is TORCH_TRACE's output, not a
# log: unless TORCH_TRACE is set, the logger takes no handler from pytest.
if "TORCH_TRACE" not in os.environ:
    logging.getLogger("torch.__trace").addHandler = lambda handler: None  # type: ignore

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
