"""Node check with real torchrun worlds on this machine; one 'node' is made faulty."""

from __future__ import annotations

import pytest

from infra.launch import LocalLauncher
from infra.nodecheck import LauncherWorldRunner, two_round_check


def _runner(tmp_path, fault: str = "") -> LauncherWorldRunner:
    return LauncherWorldRunner(
        LocalLauncher(grace_s=2),
        tmp_path,
        timeout_s=90,
        payload_mb=1,
        iterations=3,
        env={"FORGEFLOW_NODECHECK_FAULT": fault},
    )


def test_faulty_node_found_in_two_rounds(tmp_path):
    report = two_round_check(["node-a", "node-b", "node-c", "node-d"], _runner(tmp_path, "node-c=fail"))
    assert report.faulty == ["node-c"], report.summary()
    assert len(report.rounds) == 2
    assert report.healthy == ["node-a", "node-b", "node-d"]


def test_odd_count_puts_three_in_one_world(tmp_path):
    nodes = ["node-a", "node-b", "node-c", "node-d", "node-e"]
    report = two_round_check(nodes, _runner(tmp_path, "node-e=fail"))
    assert [r.nodes for r in report.rounds[0]] == [("node-a", "node-b"), ("node-c", "node-d", "node-e")]
    assert report.faulty == ["node-e"], report.summary()


def test_a_stalled_node_fails_its_world_by_timeout(tmp_path):
    runner = _runner(tmp_path, "node-b=stall")
    runner.timeout_s = 20  # a stall is only ever seen as a timeout
    report = two_round_check(["node-a", "node-b"], runner)
    # the runner's deadline or node-a's own collective timeout (same length) ends the world first
    assert report.rounds[0][0].ok is False, report.rounds[0][0]
    # no good partner for either: round 2 runs each alone, and only node-b stalls alone too
    assert [r.nodes for r in report.rounds[1]] == [("node-a",), ("node-b",)]
    assert report.faulty == ["node-b"] and report.healthy == ["node-a"], report.summary()


def test_all_healthy(tmp_path):
    report = two_round_check(["node-a", "node-b"], _runner(tmp_path))
    assert report.faulty == [] and report.healthy == ["node-a", "node-b"]
    assert report.rounds[0][0].ok and report.rounds[0][0].seconds > 0
