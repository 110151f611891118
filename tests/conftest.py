"""Session-wide test isolation: nothing a test does touches the user's state or the network."""

from __future__ import annotations

import os
import socket
import tempfile
import time
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
# Idle OpenMP threads sleep, as the launchers give every rank (infra.launch.node_env): for the
# tests that start torchrun themselves, and this process's own torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ["FORGEFLOW_STATE_DIR"] = str(_SESSION_DIR / "state")
os.environ["PREFECT_HOME"] = str(_SESSION_DIR / "prefect-home")
# checkpoint.host_copy: this session's shard copies next to its state, not in the machine's /dev/shm
os.environ["FORGEFLOW_HOST_CHECKPOINT_DIR"] = str(_SESSION_DIR / "host-checkpoints")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
# A flow run without PREFECT_API_URL starts Prefect's ephemeral server and waits 20 s for it by
# default: with three workers' torchrun worlds on two cores, its imports alone took longer
# (a benchmark smoke failed on it). Not a test of start-up speed: wait as a loaded machine needs.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
# infra.standby: a standby world starts at normal priority here. Behind the training ranks (its
# default, niceness 19) it also waits behind every other test running on the machine, so a test
# that waits for its ranks took twice as long; tests/integration/launch/test_standby_world.py
# checks the default.
os.environ["FORGEFLOW_STANDBY_NICE"] = "0"
# infra.standby: no standby world unless a test asks for one (warm_standby=True: the recovery and
# node-loss drills, test_standby_world.py). By its default (two cores per rank) every one-rank
# job here would start one, a torchrun agent and a rank importing torch and megatron (about
# 10 CPU-seconds) while its attempt trains, wasted when the job needs no restart, on cores that
# three test workers already share.
os.environ["FORGEFLOW_WARM_STANDBY"] = "off"
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
    import httpx
    from prefect.testing.utilities import prefect_test_harness

    # Prefect's start-up check retries only a refused connection while the server comes up; a
    # connection reset on that /health request (httpx.ReadError, seen once on a loaded machine:
    # every test on that worker then errored at setup) ends it. Such a start is tried again on a
    # new port (the failed server is stopped at exit, where Prefect registered its stop).
    for tries_left in (2, 1, 0):
        harness = prefect_test_harness(server_startup_timeout=180)
        try:
            harness.__enter__()
        except httpx.TransportError:
            if not tries_left:
                raise
            continue
        try:
            yield
        finally:
            harness.__exit__(None, None, None)
        return


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under `-n N --dist loadgroup` (make test): tests/xdist_schedule.py's units (each
    integration file whole on one worker, the Slurm tests together, the flow files that share
    a Prefect server together; benchmark smokes and unit tests one by one), longest first by
    the durations the last run recorded. Any other --dist: xdist's own."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from tests.xdist_schedule import DURATIONS_KEY, GroupedScheduling

    cache = getattr(config, "cache", None)  # None under -p no:cacheprovider
    return GroupedScheduling(config, log, cache.get(DURATIONS_KEY, {}) if cache else {})


_durations: dict[str, float] = {}
_STARTED = time.monotonic()
_workers: dict[str, dict[str, float]] = {}  # xdist worker -> tests, busy seconds, last report


def pytest_runtest_logreport(report):
    """Each test's seconds (set-up, call, tear-down) for the next run's scheduling order, and
    on the xdist controller each worker's share (pytest_terminal_summary prints it)."""
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration
    node = getattr(report, "node", None)  # the worker that ran it, on the controller
    if node is not None:
        worker = _workers.setdefault(node.gateway.id, {"tests": 0, "busy_s": 0.0, "last_s": 0.0})
        worker["tests"] += report.when == "call"
        worker["busy_s"] += report.duration
        worker["last_s"] = time.monotonic() - _STARTED


def pytest_terminal_summary(terminalreporter):
    """One line per xdist worker: its tests, the seconds it was busy and when it ran its last
    one, so a run shows whether both workers finished together (tests/xdist_schedule.py)."""
    if _workers:
        terminalreporter.write_line("xdist workers: " + "; ".join(
            f"{name} {w['tests']:.0f} tests, {w['busy_s']:.0f} s busy, last at {w['last_s']:.0f} s"
            for name, w in sorted(_workers.items())))


def pytest_sessionfinish(session):
    """The controller (or a run without xdist) keeps this run's durations in pytest's cache,
    over those of earlier runs for tests this run did not run."""
    config = session.config
    if hasattr(config, "workerinput") or not _durations or getattr(config, "cache", None) is None:
        return
    from tests.xdist_schedule import DURATIONS_KEY

    known = config.cache.get(DURATIONS_KEY, {})
    known.update({nodeid: round(seconds, 2) for nodeid, seconds in _durations.items()})
    config.cache.set(DURATIONS_KEY, known)
