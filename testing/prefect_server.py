"""A local `prefect server start` with process workers, for tests and benchmarks.

`LocalPrefectServer` runs the server on 127.0.0.1 with its own PREFECT_HOME and
SQLite file (or a `database_url`, e.g. postgresql+asyncpg://...) and starts
process workers on its work queues; a worker can be pinned to CPU cores, which
is how a benchmark stands in for separate machines on one box (each "node"
worker and every flow run it starts see only that node's cores).

Stopping is the hard part: uvicorn treats a second SIGTERM like the first and
waits for its websockets, and Prefect starts flow runs in their own sessions;
`stop_process_groups` handles both.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process_groups(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """Stop process groups (each started with start_new_session) together, and everything they
    started. SIGTERM first; then SIGINT, because uvicorn (the server) treats a second SIGTERM like
    the first and keeps waiting for its open websocket connections to close (that wait was the
    20-30 s teardowns in CI), while a SIGINT after it forces the exit; then SIGKILL. Descendants
    that left the group (Prefect starts flow runs in their own sessions) are killed at the end."""
    descendants: list[psutil.Process] = []
    for proc in procs:
        try:
            descendants += psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            pass
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGINT, 2.0), (signal.SIGKILL, 10.0)):
        alive = [p for p in procs if p.poll() is None]
        if not alive:
            break
        for proc in alive:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        for proc in alive:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    for child in descendants:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(descendants, timeout=5)


class LocalPrefectServer:
    """`prefect server start` on 127.0.0.1 with its own home and database, plus workers."""

    def __init__(self, home: Path, repo_root: Path, port: int | None = None, database_url: str | None = None,
                 startup_timeout_s: float = 180.0, settings: dict[str, str] | None = None):
        self.home = Path(home)
        self.repo_root = Path(repo_root)
        self.url = f"http://127.0.0.1:{port or free_port()}/api"
        self.env = dict(os.environ, PREFECT_HOME=str(self.home), PREFECT_API_URL=self.url,
                        PREFECT_API_DATABASE_CONNECTION_URL=database_url or
                        f"sqlite+aiosqlite:///{self.home / 'prefect.db'}",
                        PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_WORKER_QUERY_SECONDS="1",
                        PREFECT_WORKER_PREFETCH_SECONDS="5", PREFECT_RUNNER_HEARTBEAT_FREQUENCY="30",
                        PREFECT_LOGGING_LEVEL="WARNING", FORGEFLOW_ROOT=str(self.repo_root))
        self.env.update(settings or {})  # Prefect settings for the server and its workers
        self.logs = self.home / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        port_arg = self.url.rsplit(":", 1)[1].split("/", 1)[0]
        self.server = self._spawn("server", [sys.executable, "-m", "prefect", "server", "start",
                                             "--host", "127.0.0.1", "--port", port_arg])
        self.workers: list[subprocess.Popen] = []
        deadline = time.monotonic() + startup_timeout_s  # PostgreSQL migrations take a minute on 2 cores
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                raise RuntimeError(f"prefect server exited: {(self.logs / 'server.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        stop_process_groups([self.server])  # not left running behind the error
        raise RuntimeError(f"prefect server did not answer /api/health in {startup_timeout_s:.0f} s")

    def _spawn(self, name: str, command: list[str], cpus: set[int] | None = None) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "ab")
        # The affinity is set in the child before exec, so the worker and every flow run it starts
        # inherit it (setting it afterwards would miss threads the worker had already started).
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        return subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=self.repo_root, start_new_session=True,
                                preexec_fn=pin)

    def start_worker(self, pool: str, queue: str, cpus: set[int] | None = None,
                     limit: int | None = None) -> subprocess.Popen:
        """A process worker for `queue` of `pool`; with `cpus`, it and its flow runs use only those
        cores; with `limit`, it runs at most that many flow runs at once (`--limit`)."""
        command = [sys.executable, "-m", "prefect", "worker", "start",
                   "--pool", pool, "--work-queue", queue, "--type", "process"]
        worker = self._spawn(f"worker-{queue}", command + (["--limit", str(limit)] if limit else []), cpus)
        self.workers.append(worker)
        return worker

    def stop_workers(self) -> None:
        stop_process_groups(self.workers)
        self.workers = []

    def stop(self) -> None:
        # Workers first (together): a worker stopping may still report to the server.
        self.stop_workers()
        stop_process_groups([self.server])
