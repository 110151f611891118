"""Estimated starts and wait reasons on a small hand-built cluster; expected values worked out by hand.

The cluster: node-a 4x A100-80G, node-b 2x A40, node-c 2x V100-32G (cordoned: xid 79). At
t=1000 job 1 holds node-a GPUs 0-1 (admitted at 0, predicted 1,600 s: ends at 1600) and job 2
holds GPUs 2-3 (predicted 100,000 s, but its flow reported step 50 of 100 at 20 s a step at
t=900: ends at 900 + 50 x 20 = 1900). HAS walks the queue in order at each end:

    t=1000  job 5 (1x A40) fits and starts; job 6 (2x A40) fitted the idle A40s before the
            pass but job 5, ahead of it, took one: job 6 waits behind job 5
    t=1400  job 5 ends (1000 + 400): job 6 starts
    t=1600  job 1 ends: 2 A100 free; job 3 (4x A100) does not fit, job 4 (2x A100) does
    t=1700  job 6 ends
    t=1900  job 2 ends: 2 A100 free, still not 4
    t=2100  job 4 ends (1600 + 500): job 3 starts
    job 7 (8x A40) never: the cluster has 2; job 8 (2x V100) never: node-c is cordoned
"""

from __future__ import annotations

from scheduler.cluster import parse_cluster
from scheduler.orchestrator.start_estimates import (
    QueueState,
    RunningJob,
    WaitingJob,
    estimate_starts,
)
from scheduler.policy import Option

NOW = 1000.0


def _option(gpu_type: str, gpus: int, run_s: float) -> Option:
    return Option(gpu_type=gpu_type, num_gpus=gpus, unit=1, min_memory_bytes=0, run_s=run_s, dp=gpus)


def _cluster():
    cluster = parse_cluster({"name": "hand", "nodes": [
        {"name": "node-a", "gpu_type": "A100-80G", "gpu_count": 4},
        {"name": "node-b", "gpu_type": "A40", "gpu_count": 2},
        {"name": "node-c", "gpu_type": "V100-32G", "gpu_count": 2}]})
    cluster.allocate("node-a", [0, 1, 2, 3])
    cluster.cordon("node-c")
    return cluster


def _state(policy: str = "has", **changes) -> QueueState:
    running = [
        RunningJob(1, "A100-80G", (("node-a", (0, 1)),), admitted_at=0.0, predicted_run_s=1600.0),
        RunningJob(2, "A100-80G", (("node-a", (2, 3)),), admitted_at=500.0, predicted_run_s=100_000.0,
                   progress={"phase": "training", "step": 50, "steps": 100, "step_s": 20.0, "at": 900.0}),
    ]
    waiting = [
        WaitingJob(3, "big", 5, 10.0, (_option("A100-80G", 4, 1000.0),)),
        WaitingJob(4, "pair", 0, 20.0, (_option("A100-80G", 2, 500.0),)),
        WaitingJob(5, "one-a40", 0, 30.0, (_option("A40", 1, 400.0),)),
        WaitingJob(6, "two-a40", 0, 40.0, (_option("A40", 2, 300.0),)),
        WaitingJob(7, "too-big", 0, 50.0, (_option("A40", 8, 100.0),)),
        WaitingJob(8, "v100", 0, 60.0, (_option("V100-32G", 2, 100.0),)),
    ]
    state = QueueState(_cluster(), waiting, running, {"node-c": ("cordoned", "xid 79")}, policy)
    for key, value in changes.items():
        setattr(state, key, value)
    return state


def test_golden_starts_and_reasons_under_has():
    got = {e.job_id: e for e in estimate_starts(_state(), NOW)}
    assert [e.position for e in got.values()] == [1, 2, 3, 4, 5, 6]
    assert {j: (e.reason, e.start_s, e.option, e.behind, e.until_job) for j, e in got.items()} == {
        3: ("no_room", 2100.0, "4x A100-80G", None, 4),
        4: ("no_room", 1600.0, "2x A100-80G", None, 1),
        5: ("next", NOW, "1x A40", None, None),
        6: ("behind", 1400.0, "2x A40", 5, 5),
        7: ("infeasible", None, None, None, None),
        8: ("out_of_service", None, None, None, None),
    }
    assert got[3].why == "no GPU type has room now: wants 4x A100-80G (0 free); GPUs come free when job 4 ends"
    assert got[6].why.startswith("waiting behind job 5 (ahead in the queue)")
    assert "wants 8x A40 (2 in the cluster)" in got[7].why
    assert "node-c (cordoned: xid 79)" in got[8].why and "uncordon" in got[8].why


def test_measured_progress_moves_the_estimate():
    """Without job 2's progress its predicted end (500 + 100,000 s) holds node-a: job 3 waits for it."""
    state = _state()
    state.running[1] = RunningJob(2, "A100-80G", (("node-a", (2, 3)),), admitted_at=500.0, predicted_run_s=100_000.0)
    got = {e.job_id: e for e in estimate_starts(state, NOW)}
    assert (got[3].start_s, got[3].until_job) == (100_500.0, 2)  # job 4 ends at 2100, job 2 at 100,500
    assert got[4].start_s == 1600.0


def test_a_running_job_past_its_end_is_expected_to_overrun_by_as_much_again():
    job = RunningJob(1, "A100-80G", (("node-a", (0, 1)),), admitted_at=0.0, predicted_run_s=600.0)
    assert job.expected_end_s(1000.0) == 1400.0  # 400 s late now: 400 s more
    assert job.expected_end_s(500.0) == 600.0


def test_priority_order_names_the_higher_priority_job():
    """Job 4 asks for the same two A40s as job 3 but job 3 has the higher priority."""
    cluster = _cluster()
    state = QueueState(cluster, [WaitingJob(3, "urgent", 9, 50.0, (_option("A40", 2, 100.0),)),
                                 WaitingJob(4, "early", 0, 10.0, (_option("A40", 1, 100.0),))], [], {}, "has")
    got = {e.job_id: e for e in estimate_starts(state, NOW)}
    assert (got[3].reason, got[3].start_s) == ("next", NOW)
    assert (got[4].reason, got[4].behind, got[4].start_s) == ("behind", 3, NOW + 100.0)
    assert got[4].why.startswith("waiting behind job 3 (priority 9 > 0)")


def test_fcfs_places_like_has_here():
    got = {e.job_id: e for e in estimate_starts(_state("fcfs"), NOW)}
    assert (got[5].start_s, got[6].start_s, got[6].behind) == (NOW, 1400.0, 5)
    assert got[7].reason == "infeasible" and got[8].reason == "out_of_service"


def test_ect_runs_its_own_order():
    """ECT walks the queue by response ratio ((wait + run) / run): job 6's (960 + 300) / 300 = 4.2 beats
    job 5's (970 + 400) / 400 = 3.4, so job 6 takes both A40s now and job 5 waits behind it (300 s)."""
    got = {e.job_id: e for e in estimate_starts(_state("ect"), NOW)}
    assert (got[6].reason, got[6].start_s) == ("next", NOW)
    assert (got[5].reason, got[5].behind, got[5].start_s) == ("behind", 6, 1300.0)
    assert got[5].why.startswith("waiting behind job 6 (first in the ect policy's order)")


def test_an_empty_queue_has_no_estimates():
    assert estimate_starts(_state(waiting=[]), NOW) == []
