"""Session-wide test isolation: nothing a test does touches the user's state or the network."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import pytest

# Set before any test module imports prefect / transformers / chromadb.
_SESSION_DIR = Path(tempfile.mkdtemp(prefix="forgeflow-tests-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("ANONYMIZED_TELEMETRY", "False")  # chromadb
os.environ["FORGEFLOW_STATE_DIR"] = str(_SESSION_DIR / "state")
os.environ["PREFECT_HOME"] = str(_SESSION_DIR / "prefect-home")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.pop("FORGEFLOW_FAULT", None)
os.environ.pop("SLACK_WEBHOOK_URL", None)


@pytest.fixture(scope="session")
def session_dir() -> Path:
    return _SESSION_DIR


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def free_port() -> int:
    return _free_port()


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory) -> Path:
    """Packed tokens for tests.tiny_job's model and data, prepared once per session."""
    from tests.tiny_job import prepare_tiny_data

    return prepare_tiny_data(tmp_path_factory.mktemp("tiny-data"))


@pytest.fixture(scope="session")
def prefect_api():
    """A Prefect test API for flows run in this process, one for the session (the flow and
    Slurm integration tests share it: starting one, a fresh home's migrations, takes ~10 s on
    2 cores, up to minutes on a loaded machine)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``-n 2 --dist loadgroup``): each integration test file runs whole on
    one worker (its module fixtures - servers, a 12-step run shared by its tests - start once),
    the Slurm tests all on one (one local slurmctld/slurmd per machine), unit tests spread
    one by one, and so are the benchmarks' smoke runs (each a subprocess of its own). Without
    xdist the marks do nothing."""
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if path.startswith("tests/integration/benchmarks/"):
            continue  # each benchmark's smoke is its own subprocess: spread them over both workers
        if path.startswith("tests/integration/"):
            group = "slurm" if path.startswith("tests/integration/slurm/") else path
            item.add_marker(pytest.mark.xdist_group(group))
