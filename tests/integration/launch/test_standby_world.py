"""infra.standby with real processes: a standby world waits at its gate, runs the attempt it is
opened for, and one that does not fit is stopped and leaves nothing behind; a node check runs in
its waiting ranks, and a world failing there stops it and the check goes on cold."""

from __future__ import annotations

import time

import psutil
import pytest

from infra.autogroup import autogroup
from infra.launch import CHOOSE_ON_NODE_0, LaunchRequest, LocalLauncher, local_node_launches
from infra.nodecheck import LauncherWorldRunner, two_round_check
from infra.standby import NICE_ENV, STANDBY_NICE, WarmRestarts, can_renice, gate_path
from testing.torchrun_ranks import is_rank


def _launch(tmp_path, attempt: int, nodes: list[str], worker_args: list[str], ranks_per_node: int = 1,
            ) -> LaunchRequest:
    return LaunchRequest("job", local_node_launches(nodes, ranks_per_node, CHOOSE_ON_NODE_0), worker_args, tmp_path,
                         env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "15"}, attempt=attempt)


def _waiting_ranks(gate, count: int = 1) -> list[psutil.Process]:
    """The standby's rank processes (python -m training.standby GATE), once `count` run."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        # (the reaper's and the agent's command lines end with the ranks' command too)
        ranks = [p for p in psutil.process_iter(["cmdline"]) if str(gate) in (p.info["cmdline"] or [])
                 and "training.standby" in p.info["cmdline"] and is_rank(p)]
        if len(ranks) >= count:
            return ranks
        time.sleep(0.2)
    raise AssertionError(f"no standby rank waits for {gate}")


def _niceness(pids) -> dict[int, int]:
    found = {}
    for pid in pids:
        try:
            found[pid] = psutil.Process(pid).nice()
        except psutil.NoSuchProcess:  # (a rank that already exited)
            pass
    return found


@pytest.mark.slow  # ~25 s on 2 cores: a standby torchrun world and its attempt
def test_opened_its_ranks_run_the_attempts_worker_arguments(tmp_path, monkeypatch):
    monkeypatch.delenv(NICE_ENV)  # the default niceness (tests/conftest.py sets none)
    with WarmRestarts(enabled=True, grace_s=2) as warm:
        # two ranks: their sessions' autogroups are set together, where (without CAP_SYS_ADMIN, as in
        # a container) the kernel takes one such write per 100 ms (infra.autogroup)
        warm.prepare_next(_launch(tmp_path, 0, ["node-a"], ["-m", "training.train", "a.json"], 2))
        ranks = _waiting_ranks(gate_path(warm.standby.request), count=2)
        # while it waits, its reaper, agent and ranks run behind the training ones (where the flow
        # may raise them back: root, as here and in CI)
        waiting = warm.standby.job.pids()
        reaper = warm.standby.job.processes["node-a"].pid
        assert {r.pid for r in ranks} <= waiting and reaper in waiting
        assert set(_niceness(waiting).values()) == ({STANDBY_NICE} if can_renice() else {0})
        # torchrun starts each rank in a session of its own: the rank puts its session's autogroup
        # (where the kernel has them) behind too, or its niceness would count only within it
        if autogroup(ranks[0].pid) is not None:  # (pytest's own may be the root group: None)
            wanted = {STANDBY_NICE} if can_renice() else {0}
            deadline = time.monotonic() + 60  # (set as the rank's first statement runs)
            while {autogroup(r.pid)[1] for r in ranks} != wanted and time.monotonic() < deadline:
                time.sleep(0.05)
            assert {autogroup(r.pid)[1] for r in ranks} == wanted
        # the next attempt: training.train with a spec file that does not exist
        attempt = _launch(tmp_path, 1, ["node-a"], ["-m", "training.train", str(tmp_path / "missing.json")], 2)
        job, started_warm = warm.launch(attempt, start_cold=lambda request: None)  # (no cold start here)
        assert started_warm and job.request is attempt
        opened = _niceness(waiting)  # back to normal before the gate opened
        assert reaper in opened and set(opened.values()) == {0}, opened
        assert {group[1] for group in map(autogroup, waiting) if group is not None} <= {0}
        codes = job.wait(timeout=120)
        log = job.log_paths()["node-a"].read_text()
        # training.train's own refusal, from the waiting rank: its gate carried the attempt's arguments
        assert "missing.json" in log and "error:" in log, log[-3000:]
        assert codes["node-a"] not in (None, 0)


def test_one_that_does_not_fit_is_stopped_and_the_attempt_starts_cold(tmp_path):
    warm = WarmRestarts(enabled=True, grace_s=2)
    warm.prepare_next(_launch(tmp_path, 0, ["node-a", "node-b"], ["-m", "training.train", "a.json"]))
    standby = warm.standby
    _waiting_ranks(gate_path(standby.request))
    processes = standby.job.pids()
    logs = list(standby.job.log_paths().values())
    assert processes and all(log.exists() for log in logs)

    # node-b was cordoned: the next attempt runs on node-a alone
    started = []
    attempt = _launch(tmp_path, 1, ["node-a"], ["-m", "training.train", "a.json"])
    job, started_warm = warm.launch(attempt, start_cold=lambda request: started.append(request) or "cold job")
    assert (job, started_warm, started) == ("cold job", False, [attempt])
    assert warm.standby is None
    assert not [pid for pid in processes if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert not any(log.exists() for log in logs)  # the cold attempt's diagnosis reads no standby's shutdown
    warm.close()  # nothing left: a no-op


class _CountingRunner(LauncherWorldRunner):
    """The node check's cold runner (real torchrun worlds), remembering the worlds it ran."""

    def __init__(self, run_dir):
        super().__init__(LocalLauncher(grace_s=2), run_dir, timeout_s=90, payload_mb=1, iterations=3)
        self.ran: list[tuple[str, ...]] = []

    def __call__(self, worlds):
        self.ran.extend(worlds)
        return super().__call__(worlds)


@pytest.mark.slow  # ~20 s on 2 cores: a standby torchrun world, a node check and an attempt
def test_a_node_check_runs_in_the_waiting_ranks_which_then_train_the_attempt(tmp_path):
    nodes = ["node-a", "node-b", "node-c"]
    with WarmRestarts(enabled=True, grace_s=2) as warm:
        warm.prepare_next(_launch(tmp_path, 0, nodes, ["-m", "training.train", "a.json"]))
        standby = warm.standby
        _waiting_ranks(gate_path(standby.request))
        cold = _CountingRunner(tmp_path / "nodecheck")
        report = two_round_check(nodes, warm.node_check_runner(nodes, cold))
        # one world of three (odd count), in the standby's ranks: no torchrun world was started
        assert report.healthy == nodes and not report.faulty and cold.ran == [], report.summary()
        (world,) = report.rounds[0]
        assert world.ok and world.nodes == tuple(nodes) and "standby" in world.detail and world.seconds > 0
        # the same ranks then train the attempt they waited for
        assert warm.standby is standby
        attempt = _launch(tmp_path, 1, nodes, ["-m", "training.train", str(tmp_path / "missing.json")])
        job, started_warm = warm.launch(attempt, start_cold=lambda request: None)
        assert started_warm
        codes = job.wait(timeout=120)
        assert "missing.json" in job.log_paths()["node-a"].read_text() and codes["node-a"] not in (None, 0)


@pytest.mark.slow  # ~25 s on 2 cores: standby and cold torchrun worlds
def test_a_world_failing_in_the_standby_stops_it_and_the_check_goes_on_cold(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGEFLOW_NODECHECK_FAULT", "node-b=fail")  # inherited by the standby's ranks
    nodes = ["node-a", "node-b"]
    warm = WarmRestarts(enabled=True, grace_s=2)
    warm.prepare_next(_launch(tmp_path, 0, nodes, ["-m", "training.train", "a.json"]))
    processes = warm.standby.job.pids()
    _waiting_ranks(gate_path(warm.standby.request))
    cold = _CountingRunner(tmp_path / "nodecheck")
    report = two_round_check(nodes, warm.node_check_runner(nodes, cold))
    # round 1 in the standby: node-b's rank failed its world; then each node alone, cold
    assert not report.rounds[0][0].ok and "injected failure on node-b" in report.rounds[0][0].detail
    assert cold.ran == [("node-a",), ("node-b",)]
    assert report.faulty == ["node-b"] and report.healthy == ["node-a"], report.summary()
    # the standby is gone: its ranks' state after a failed collective is not trusted to train
    assert warm.standby is None
    assert not [pid for pid in processes if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
