"""SIGTERM stops a decider (`forgeflow cluster serve`) at any moment of its busy loop, promptly.

Its handler only flags the stop and wakes a pipe (infra.stop_signal). One that called
threading.Event.set() hung the decider for good when the signal landed while the loop held
the same Event's lock inside Event.wait(). Real parts: the decider is a real process on a
SQLite state database with frenzy-testbed registered, and another thread of the test
submits and releases jobs through the library the whole time, so the decider makes passes.
Each stop must finish within STOP_WITHIN_S: a deadlocked handler never finishes.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from infra.statedb import read_transaction
from infra.statedb.schema import clusters
from scheduler.cluster import load_cluster
from scheduler.orchestrator import Orchestrator, OrchestratorConfig, demand_options, double_booked

ROOT = Path(__file__).resolve().parents[3]
FRENZY = ROOT / "configs" / "clusters" / "frenzy-testbed.yaml"
CONFIG = OrchestratorConfig(policy="has", lease_s=600)
STOP_WITHIN_S = 2.0


class Churn:
    """Flows with no view of the cluster submit and release jobs until stopped (decider work)."""

    def __init__(self, url: str, seed: int):
        self.url, self.rng = url, random.Random(seed)
        self.cluster = load_cluster(FRENZY)
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Churn":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join(30)
        assert self.error is None, f"the churning flows failed: {self.error!r}"

    def _run(self) -> None:
        live: list[int] = []
        try:
            while not self.done.is_set():
                flow = Orchestrator(self.url, CONFIG)
                live.append(flow.submit(f"churn-{len(live)}", demand_options(self.cluster, self.rng.randint(1, 4))))
                if len(live) > 6:
                    Orchestrator(self.url, CONFIG).release(live.pop(0))
                self.done.wait(0.01)
        except BaseException as e:  # noqa: BLE001 - reported by __exit__
            self.error = e


def _registered(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    Orchestrator(url, CONFIG).register(load_cluster(FRENZY))
    return url


def _lines(stream) -> "queue.Queue[str | None]":  # noqa: ANN001 - a text pipe
    """The process's stdout lines as they come (None at its end), readable with a timeout."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in stream:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _next_line(lines: "queue.Queue[str | None]", timeout_s: float, what: str) -> str:
    try:
        line = lines.get(timeout=timeout_s)
    except queue.Empty:
        raise AssertionError(f"no line within {timeout_s} s: {what}") from None
    assert line is not None, f"the process ended: {what}"
    return line


def _heartbeat(url: str) -> float | None:
    with read_transaction(Orchestrator(url, CONFIG).engine) as conn:
        return conn.execute(sa.select(clusters.c.decider_seen_at)).scalar()


def test_200_sigterms_at_random_moments_each_stop_the_serve_loop(tmp_path):
    """The handler installation and serve loop of `forgeflow cluster serve`, re-armed 200 times in
    one process (start-up once), each round stopped by a SIGTERM at a random moment."""
    url, rounds = _registered(tmp_path), 200
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    worker = subprocess.Popen([sys.executable, str(Path(__file__).with_name("serve_stop_worker.py")), url,
                               str(rounds)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    lines, passes = _lines(worker.stdout), 0
    try:
        with Churn(url, seed):
            for n in range(rounds):
                assert _next_line(lines, 60, f"round {n} never started") == f"serving {n}"
                time.sleep(rng.uniform(0.0, 0.03))  # somewhere in start-up, a pass, a read or a wait
                worker.send_signal(signal.SIGTERM)
                stopped = _next_line(lines, STOP_WITHIN_S, f"round {n} did not stop after its SIGTERM "
                                                           f"(seed {seed}): the handler deadlocked?")
                assert stopped.startswith(f"stopped {n} "), stopped
                passes += int(stopped.split()[2])
        assert worker.wait(30) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert passes > 0, "the decider made no pass: nothing was tested while it worked"
    assert _heartbeat(url) is None  # every stop was clean: the heartbeat was cleared on the way out
    assert double_booked(Orchestrator(url, CONFIG).engine) == 0


@pytest.mark.slow  # ~16 s on 2 cores: `forgeflow cluster serve` started, run and stopped
def test_forgeflow_cluster_serve_stops_on_sigterm_with_its_summary(tmp_path):
    """The real command, five times, SIGTERMed at a random moment after it began deciding."""
    url = _registered(tmp_path)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with Churn(url, seed):
        for n in range(5):
            as_json = n % 2 == 1
            proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "cluster", "serve", "--db", url]
                                    + (["--json"] if as_json else []),
                                    cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
            try:
                if as_json:  # prints nothing until it stops: wait for its first heartbeat
                    deadline = time.monotonic() + 60
                    while _heartbeat(url) is None:
                        assert proc.poll() is None and time.monotonic() < deadline, "it never beat"
                        time.sleep(0.02)
                else:
                    lines = _lines(proc.stdout)
                    assert _next_line(lines, 60, "it never started").startswith("deciding for cluster 'frenzy-testbed'")
                time.sleep(rng.uniform(0.0, 0.5))
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(STOP_WITHIN_S)
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"forgeflow cluster serve #{n} still ran {STOP_WITHIN_S} s after its "
                                         f"SIGTERM (seed {seed})") from None
                out = proc.stdout.read() if as_json else "\n".join(iter(lines.get, None))
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            assert proc.returncode == 0, (n, proc.returncode, out)
            if as_json:
                summary = json.loads(out)
                assert set(summary) == {"actor", "passes", "admitted", "expired"}, summary
            else:
                assert out.splitlines()[-1].startswith("stopped: ") and "admitted" in out.splitlines()[-1], out
            assert _heartbeat(url) is None
