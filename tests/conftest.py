"""Shared test setup: offline Hugging Face libraries, the real data folder, small helpers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fedpeft.plugins import load_built_ins

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

# importing fedpeft registers nothing; its built-ins register on first need (a run, a command, a config's
# validation). Many tests are parametrized over the registries, which pytest reads at collection: register now.
load_built_ins()

REPO = Path(__file__).resolve().parents[1]


def _data_dir() -> Path | None:
    candidates = [os.environ.get("FEDPEFT_DATA_DIR"), REPO.parent / "shared" / "data", REPO / "data"]
    for c in candidates:
        if c and (Path(c) / "sst2" / "train.jsonl").is_file():
            return Path(c).resolve()
    return None


# The real datasets, for the tests that read data (most runtime tests); the pure-maths tests need none.
DATA_DIR = _data_dir()
if DATA_DIR is not None:
    os.environ["FEDPEFT_DATA_DIR"] = str(DATA_DIR)


def pytest_report_header(config) -> str:
    if DATA_DIR is None:
        return ("datasets: not found (set FEDPEFT_DATA_DIR to a folder holding sst2/train.jsonl, ...; in this "
                "project ../shared/data): the tests marked needs_data are skipped, the others run")
    return f"datasets: {DATA_DIR}"


def pytest_runtest_setup(item) -> None:
    """Tests that read the real datasets are marked needs_data: without the data they are skipped with the
    reason, unless FEDPEFT_TESTS_NEED_DATA is set (CI), where missing data is an error. Tests marked cuda are
    skipped without a CUDA device (benchmarks/gpu_check.sh runs them where there is one)."""
    if item.get_closest_marker("cuda") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device (run benchmarks/gpu_check.sh on a machine with one)")
    if DATA_DIR is None and item.get_closest_marker("needs_data") is not None:
        message = ("needs the real datasets: set FEDPEFT_DATA_DIR to a folder holding sst2/train.jsonl, ... "
                   "(in this project ../shared/data)")
        if os.environ.get("FEDPEFT_TESTS_NEED_DATA"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)


@pytest.fixture(autouse=True)
def _isolated_cwd(tmp_path, monkeypatch):
    """Every test runs in its own empty directory (run outputs land there)."""
    monkeypatch.chdir(tmp_path)
    yield


@pytest.fixture(autouse=True, scope="session")
def _quiet():
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    yield


@pytest.fixture
def flower_task_identity():
    """The task identity a ServerApp process has (Flower stamps every Message it makes with its run), for tests
    that build Flower messages in this process; restored afterwards."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved
