"""Fixtures for pretrain-flow tests: a tiny job over data prepared once, a real Prefect server
shared by the folder, and a Slack-compatible HTTP receiver on 127.0.0.1 (the Prefect test API,
`prefect_api`, is the session's: tests/conftest.py)."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from testing.prefect_server import LocalPrefectServer, stop_process_groups

TINY_JOB = {
    "training": {"global_batch_size": 8, "micro_batch_size": 2, "steps": 40, "lr": 1.0e-3,
                 "min_lr": 1.0e-4, "warmup_steps": 2, "seed": 1234,
                 "lr_decay_steps": 40},  # fixed, so a reference run cut at step 20 keeps the schedule
    "checkpoint": {"interval": 10, "keep_last": 10, "async_save": True},
    "spike": {"window": 20, "min_history": 5, "patience": 3},
}


@pytest.fixture
def make_job(tiny_data_dir: Path, tmp_path: Path):
    """Write a job spec under tmp_path (its own run dir and checkpoints); returns its path."""
    from tests.tiny_job import write_tiny_job

    def make(name: str = "flow-tiny", **sections) -> Path:
        return write_tiny_job(TINY_JOB, tiny_data_dir, tmp_path, name, **sections)

    return make


class SlackReceiver:
    def __init__(self, status: int = 200):
        self.status = status
        self.messages: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver.messages.append(json.loads(body))
                self.send_response(receiver.status)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/services/T0/B0/SECRET"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def texts(self) -> list[str]:
        return [m.get("text", "") for m in self.messages]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def slack(monkeypatch):
    receiver = SlackReceiver()
    monkeypatch.setenv("SLACK_WEBHOOK_URL", receiver.url)
    yield receiver
    receiver.close()


TWO_NODE_CLUSTER = {
    "name": "two-cpu-nodes",
    "inter_node_bandwidth_gbps": 10,
    "nodes": [
        {"name": name, "gpu_type": "cpu", "gpu_count": 1, "gpu_memory_gib": 4, "peak_tflops": 0.05,
         "address": "127.0.0.1"}
        for name in ("node-a", "node-b")
    ],
}


@pytest.fixture
def two_node_cluster(tmp_path: Path) -> Path:
    """Two one-process CPU 'nodes' on this machine (queues node-a and node-b)."""
    path = tmp_path / "cluster-two-nodes.yaml"
    path.write_text(yaml.safe_dump(TWO_NODE_CLUSTER, sort_keys=False))
    return path


def _stop(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    stop_process_groups([proc], grace_s)


class PrefectServer(LocalPrefectServer):
    """`prefect server start` on 127.0.0.1 with its own home and SQLite file (or `database_url`,
    e.g. postgresql+asyncpg://...), plus workers: testing.prefect_server's, as the benchmarks use it."""

    def __init__(self, home: Path, port: int, repo_root: Path, database_url: str | None = None):
        super().__init__(home, repo_root, port=port, database_url=database_url,
                         settings=SCHEDULER_SETTINGS)


# The scheduler service creates the runs of scheduled deployments (every 60 s by default);
# test_prefect_deployments.py's scheduled-deployment test waits for it, so it runs every 5 s on
# the test servers, and creates 3 runs ahead per deployment (100 by default: a schedule every 5 s
# would be 100 rows written, and as many runs kept due, on a server every flow test shares).
SCHEDULER_SETTINGS = {"PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5",
                      "PREFECT_SERVER_SERVICES_SCHEDULER_MAX_RUNS": "3"}


_shared_server: PrefectServer | None = None


def _stop_shared_server() -> None:
    global _shared_server
    if _shared_server is not None:
        server, _shared_server = _shared_server, None
        server.stop()


@pytest.fixture
def prefect_server(tmp_path_factory, repo_root):
    """A real Prefect server shared by this folder's modules (started on first use, stopped once
    the folder's last test is done, see pytest_runtest_teardown): starting one takes 10-20 s on
    2 cores. Tests keep apart through their own names, work pools and queues, and the workers a
    test starts are stopped after it (use_prefect_server)."""
    global _shared_server
    if _shared_server is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        _shared_server = PrefectServer(tmp_path_factory.mktemp("prefect-server"), port, repo_root)
    return _shared_server


@pytest.fixture(scope="session", autouse=True)
def _shared_prefect_server_stopped():
    """Whatever happens (an interrupted session), the shared server does not outlive it."""
    yield
    _stop_shared_server()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """The shared server goes as soon as no test of this folder is next, instead of idling
    (its services poll) through the rest of the suite; after the test's own fixtures (its
    workers) are torn down."""
    try:
        return (yield)
    finally:
        if nextitem is None or Path(__file__).parent not in Path(nextitem.path).parents:
            _stop_shared_server()


@pytest.fixture
def use_prefect_server(prefect_server, monkeypatch):
    """This process (and every subprocess it starts) talks to the real server."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.setenv("PREFECT_API_URL", prefect_server.url)
    monkeypatch.setenv("FORGEFLOW_ROOT", str(prefect_server.repo_root))
    # Before as well as after: a test of another folder that ran earlier in this worker process
    # (its own server, or Prefect's test harness) may have left an events worker holding a client
    # for that API; an event emitted here (a checkpoint commit) would go there and be lost.
    _drain_prefect_services()
    with temporary_settings(updates={PREFECT_API_URL: prefect_server.url}):
        try:
            yield prefect_server
        finally:
            _drain_prefect_services()
            prefect_server.stop_workers()  # the server outlives the test; its workers do not


def _drain_prefect_services() -> None:
    """Prefect's background services (concurrency leases, events, API logs) are process-wide
    singletons holding a client for the API they started with; stop them so later tests
    (on the session's test harness) start fresh ones instead of calling this server."""
    from prefect.concurrency.services import ConcurrencySlotAcquisitionWithLeaseService
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for service in (ConcurrencySlotAcquisitionWithLeaseService, EventsWorker, APILogWorker):
        service.drain_all(timeout=10, at_exit=False)
