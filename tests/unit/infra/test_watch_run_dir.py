"""The hang/spike watcher (infra/watch.py) over a real run directory in a temp folder.

The worker's side is played by the worker's own writers (training.runlog.Heartbeat,
training.spike.write_spike_marker) and a scripted job that reports exit codes: on
each poll the script may beat, write a marker or let a node exit, so what the
watcher decides depends on the files, as in production.
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace
from pathlib import Path

from infra import runfiles
from infra.atomic_write import atomic_write_json
from infra.watch import watch
from training.runlog import Heartbeat
from training.spike import SpikeEvent, write_spike_marker

NODES = ("node-a", "node-b")
FAST = dict(hang_timeout_s=0.4, startup_timeout_s=0.8, failure_grace_s=0.05, poll_s=0.02)


class ScriptedJob:
    """A LaunchedJob whose nodes do what `script(job, poll_number)` says on each poll."""

    def __init__(self, run_dir: Path, script):
        self.run_dir = run_dir
        self.script = script
        self.codes: dict[str, int | None] = {n: None for n in NODES}
        self.polls = 0
        self.terminated = False
        self.beats = {rank: Heartbeat(run_dir, rank) for rank in (0, 1)}

    def poll(self) -> dict[str, int | None]:
        self.polls += 1
        assert self.polls < 2000, "the watcher never decided"
        if not self.terminated:
            self.script(self, self.polls)
        return dict(self.codes)

    def wait(self, timeout: float | None = None, any_exit: bool = False) -> dict[str, int | None]:
        if timeout and all(c is None for c in self.codes.values()):  # the watcher's wait between polls
            time.sleep(timeout)
        return dict(self.codes)

    def terminate(self, grace_s: float = 10.0) -> None:
        self.terminated, self.grace_s = True, grace_s
        self.codes = {n: (-15 if c is None else c) for n, c in self.codes.items()}

    def log_paths(self) -> dict[str, Path]:
        return {n: self.run_dir / f"{n}.log" for n in NODES}


def _watch(tmp_path, script, **kwargs):
    job = ScriptedJob(tmp_path, script)
    progress: list[int] = []
    outcome = watch(job, tmp_path, world_size=2, on_progress=progress.append, **{**FAST, **kwargs})
    return outcome, job, progress


def _finish(job: ScriptedJob, step: int) -> None:
    atomic_write_json(runfiles.finished_marker_path(job.run_dir), {"step": step, "time": time.time()})
    job.codes = {n: 0 for n in NODES}


def test_a_finished_run_reports_its_last_step_and_progress(tmp_path):
    def script(job, n):
        for beat in job.beats.values():
            beat.beat(min(n, 5))
        if n == 6:
            _finish(job, 5)

    outcome, job, progress = _watch(tmp_path, script)
    assert outcome.ok and outcome.status == "finished" and outcome.last_step == 5
    assert progress == sorted(set(progress)) and progress[-1] == 5  # each new step reported once
    assert not job.terminated


def test_exit_zero_without_the_finished_marker_is_a_failure(tmp_path):
    def script(job, n):
        job.beats[0].beat(n)
        job.beats[1].beat(n)
        if n == 3:
            job.codes = {nd: 0 for nd in NODES}

    outcome, _, _ = _watch(tmp_path, script)
    assert outcome.status == "failed" and not outcome.ok


def test_a_node_that_exits_non_zero_fails_the_attempt_and_the_rest_is_stopped(tmp_path):
    def script(job, n):
        job.beats[0].beat(n)
        job.beats[1].beat(n)
        if n == 4:
            job.codes["node-b"] = 1

    outcome, job, _ = _watch(tmp_path, script)
    assert outcome.status == "failed" and outcome.failed_nodes == ["node-b"]
    assert job.terminated and outcome.exit_codes == {"node-a": -15, "node-b": 1}
    assert outcome.last_step == 4 and outcome.spike is None
    assert set(outcome.log_paths) == set(NODES)


def test_a_spike_marker_of_this_attempt_makes_the_exit_a_spike(tmp_path):
    event = SpikeEvent(onset_step=7, last_healthy_step=6, detected_step=11, loss=9.5, median=3.1, z=12.0,
                       reason="zscore")

    def script(job, n):
        job.beats[0].beat(n)
        job.beats[1].beat(n)
        if n == 11:
            write_spike_marker(job.run_dir, event)
            job.codes = {nd: runfiles.EXIT_LOSS_SPIKE for nd in NODES}

    outcome, _, _ = _watch(tmp_path, script)
    assert outcome.status == "spike" and outcome.spike is not None
    assert (outcome.spike.onset_step, outcome.spike.detected_step, outcome.spike.loss) == (7, 11, 9.5)


def test_a_spike_marker_left_by_an_earlier_attempt_is_ignored(tmp_path):
    path = write_spike_marker(tmp_path, SpikeEvent(3, 2, 5, 9.0, 3.0, 10.0, "zscore"))
    old = time.time() - 3600
    os.utime(path, (old, old))

    def script(job, n):
        job.beats[0].beat(n)
        job.beats[1].beat(n)
        if n == 3:
            job.codes["node-a"] = 1

    outcome, _, _ = _watch(tmp_path, script)
    assert outcome.status == "failed" and outcome.spike is None


def test_a_rank_whose_heartbeat_stops_is_a_hang(tmp_path):
    def script(job, n):
        job.beats[0].beat(n)  # rank 0 keeps stepping ...
        if n <= 3:
            job.beats[1].beat(n)  # ... rank 1 stops after step 3

    outcome, job, _ = _watch(tmp_path, script)
    assert outcome.status == "hang" and outcome.stale_ranks == [1]
    assert job.terminated and outcome.last_step > 3


def test_no_heartbeat_after_the_startup_timeout_is_a_hang_of_every_rank(tmp_path):
    outcome, job, progress = _watch(tmp_path, lambda job, n: None)
    assert outcome.status == "hang" and outcome.stale_ranks == [0, 1]
    assert job.terminated and outcome.last_step == 0 and progress == []


def test_heartbeats_of_an_earlier_attempt_count_neither_as_progress_nor_as_life(tmp_path):
    # A previous attempt reached step 40; this one has not started stepping yet.
    for rank in (0, 1):
        path = runfiles.heartbeat_path(tmp_path, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"rank": rank, "step": 40, "time": time.time() - 3600, "pid": 1,
                                    "host": "h", "phase": "train"}))

    def script(job, n):
        if n >= 5:
            job.beats[0].beat(1)  # rank 0 starts; rank 1 never does

    outcome, _, progress = _watch(tmp_path, script, hang_timeout_s=30.0)
    assert outcome.status == "hang" and outcome.stale_ranks == [1]
    assert outcome.last_step == 1 and progress == [1]


def test_a_torn_heartbeat_file_is_read_on_the_next_poll(tmp_path):
    path = runfiles.heartbeat_path(tmp_path, 0)
    path.parent.mkdir(parents=True)
    path.write_text('{"rank": 0, "st')  # half written (a writer without atomic replace)
    assert runfiles.read_heartbeat(path) is None and runfiles.read_heartbeats(tmp_path) == {}


def _stops_by_itself_at_step_4(job, n):
    """The ranks get a SIGTERM the watcher did not send (torchrun's agent was killed and the reaper
    stopped the orphaned ranks, a node shutting down, a stray `kill`): they commit step 4, write the
    marker, and torchrun exits 1."""
    from training.control import write_stop_marker

    for beat in job.beats.values():
        beat.beat(min(n, 4), phase="stopping" if n >= 4 else "train")
    if n == 6:
        write_stop_marker(job.run_dir, 4, "SIGTERM")
        job.codes = {node: 1 for node in NODES}


def test_a_stop_nobody_asked_for_is_a_failure_with_its_committed_step(tmp_path):
    # a cancel recorded meanwhile did not cause it (only the watcher acts on one): still a failure
    cancel = lambda: "cancelled by ana: make room" if job_ref and job_ref[0].polls >= 6 else None  # noqa: E731
    job_ref: list = []
    job = ScriptedJob(tmp_path, _stops_by_itself_at_step_4)
    job_ref.append(job)
    outcome = watch(job, tmp_path, world_size=2, stop_requested=cancel, **FAST)
    assert outcome.status == "failed" and not outcome.ok and outcome.requested_stop is None
    assert outcome.stop.checkpoint_step == 4 and outcome.last_step == 4
    assert outcome.failed_nodes == list(NODES)  # diagnosed like any failure
    assert "stopped by SIGTERM after step 4 (checkpoint 4 committed)" in outcome.unrequested_stop
    assert "neither the flow nor `forgeflow cancel` asked for it" in outcome.unrequested_stop


def test_a_stop_after_the_lease_was_lost_is_an_eviction(tmp_path):
    # the node-side guard stopped the ranks once the orchestrator recorded the lease gone
    outcome, _, _ = _watch(tmp_path, _stops_by_itself_at_step_4, stop_when=lambda: None)
    assert outcome.status == "failed"
    job = ScriptedJob(tmp_path, _stops_by_itself_at_step_4)
    lost = lambda: "the job's GPU lease was lost" if job.polls >= 6 else None  # noqa: E731
    outcome = watch(job, tmp_path, world_size=2, stop_when=lost, **FAST)
    assert outcome.status == "evicted" and outcome.evicted == "the job's GPU lease was lost"
    assert outcome.failed_nodes == [] and outcome.unrequested_stop is None


def test_a_cancel_stops_the_ranks_gracefully_and_is_a_requested_stop(tmp_path):
    from training.control import write_stop_marker

    def script(job, n):
        job.beats[0].beat(n)
        job.beats[1].beat(n)

    class Committing(ScriptedJob):
        def terminate(self, grace_s: float = 10.0) -> None:  # the ranks commit, then exit
            write_stop_marker(self.run_dir, 5, "SIGTERM")
            super().terminate(grace_s)

    job = Committing(tmp_path, script)
    asked = lambda: "cancelled by ana: make room" if job.polls >= 5 else None  # noqa: E731
    outcome = watch(job, tmp_path, world_size=2, stop_requested=asked, stop_grace_s=7.0, **FAST)
    assert outcome.status == "stopped" and outcome.requested_stop == "cancelled by ana: make room"
    assert job.grace_s == 7.0 and outcome.stop.checkpoint_step == 5 and outcome.unrequested_stop is None


def test_the_exit_verdict_table():
    from infra.watch import exit_verdict

    stop = runfiles.StopMarker(step=4, checkpoint_step=4, signal="SIGTERM", time=0.0)
    spike = SimpleNamespace(onset_step=3)
    assert exit_verdict(None, stop, lease_lost=None) == "failed"
    assert exit_verdict(None, stop, lease_lost="lease lost") == "evicted"
    assert exit_verdict(None, None, lease_lost="lease lost") == "failed"  # a crash is what it is
    assert exit_verdict(spike, stop, lease_lost=None) == "spike"
    assert exit_verdict(None, None, lease_lost=None) == "failed"


def test_a_lost_lease_stops_the_ranks_and_the_attempt_is_evicted_not_failed(tmp_path):
    lost: list[str] = []

    def script(job, n):
        job.beats[0].beat(n)
        job.beats[1].beat(n)
        if n == 5:  # the lease thread finds the GPUs reclaimed
            lost.append("job 7 holds no GPUs under admission 1 any more")

    outcome, job, _ = _watch(tmp_path, script, stop_when=lambda: lost[0] if lost else None)
    assert outcome.status == "evicted" and not outcome.ok and job.terminated
    assert job.grace_s == FAST["failure_grace_s"]  # the GPUs may run another job: no commit wait
    assert outcome.evicted == lost[0] and outcome.last_step == 5 and outcome.failed_nodes == []
    assert outcome.exit_codes == {"node-a": -15, "node-b": -15}


def test_an_exit_seen_with_a_lost_lease_is_reported_as_what_it_is(tmp_path):
    def finished(job, n):
        job.beats[0].beat(n)
        job.beats[1].beat(n)
        if n == 4:
            _finish(job, 4)

    def failed(job, n):
        job.beats[0].beat(n)
        job.beats[1].beat(n)
        if n == 4:
            job.codes["node-b"] = 1

    def lost_from_poll_4(job_ref):
        return lambda: "lease lost" if job_ref and job_ref[0].polls >= 4 else None

    for script, status in ((finished, "finished"), (failed, "failed")):
        ref: list = []
        job = ScriptedJob(tmp_path, script)
        ref.append(job)
        outcome = watch(job, tmp_path, world_size=2, stop_when=lost_from_poll_4(ref), **FAST)
        assert outcome.status == status and outcome.evicted is None


def test_a_stop_marker_left_by_an_earlier_attempt_is_ignored(tmp_path):
    from training.control import write_stop_marker

    write_stop_marker(tmp_path, 2, "SIGTERM")
    old = time.time() - 3600
    os.utime(runfiles.stop_marker_path(tmp_path), (old, old))

    def script(job, n):
        job.beats[0].beat(n)
        job.beats[1].beat(n)
        if n == 3:
            job.codes["node-a"] = 1

    outcome, _, _ = _watch(tmp_path, script)
    assert outcome.status == "failed" and outcome.stop is None


def test_a_rank_whose_compute_stays_slow_is_reported_once_with_its_node(tmp_path):
    reported = []

    def script(job, n):
        step = n // 2 + 1  # every rank advances a step every other poll
        job.beats[0].beat(step, step_time_s=0.5, compute_s=0.10)
        # rank 1: slow in steps 3-4 only (not persistent), then from step 8 on
        job.beats[1].beat(step, step_time_s=0.5, compute_s=0.35 if step in (3, 4) or step >= 8 else 0.11)
        if step == 14:
            _finish(job, step)

    job = ScriptedJob(tmp_path, script)
    job.request = SimpleNamespace(nodes=[SimpleNamespace(node="node-a", first_global_rank=0, nproc_per_node=1),
                                         SimpleNamespace(node="node-b", first_global_rank=1, nproc_per_node=1)])
    outcome = watch(job, tmp_path, world_size=2, on_straggler=reported.append,
                    straggler_factor=2.0, straggler_patience=3, **FAST)
    assert outcome.status == "finished"
    assert [(s.rank, s.node, s.step) for s in reported] == [(1, "node-b", 10)]
    assert abs(reported[0].ratio - 3.5) < 1e-9 and outcome.stragglers == reported


# --- a hang seen from the collectives (training.collective_watch's samples) -----------------------

def _where(run_dir, rank: int, collective, since: float, step: int, at: float | None = None) -> None:
    atomic_write_json(runfiles.where_path(run_dir, rank), {"rank": rank, "time": time.time() if at is None else at,
                                                          "step": step, "collective": collective, "since": since})


def test_peers_waiting_in_a_collective_that_one_rank_never_joined_is_a_hang_naming_it(tmp_path):
    hung_at: dict[str, float] = {}

    def script(job, n):
        step = min(n, 3)
        for rank, beat in job.beats.items():
            if n <= 3:
                beat.beat(step, step_time_s=0.01, compute_s=0.005)
        if n > 3:  # rank 0 waits in all_reduce for step 4; rank 1 is somewhere else
            hung_at.setdefault("t", time.time())
            _where(job.run_dir, 0, "all_reduce", hung_at["t"], 3)
            _where(job.run_dir, 1, None, hung_at["t"], 3)

    outcome, job, _ = _watch(tmp_path, script, hang_timeout_s=300.0, collective_stall_s=0.3)
    assert outcome.status == "hang" and job.terminated
    assert outcome.stall is not None and outcome.stall.absent == [1] and outcome.stall.waiting == [0]
    assert outcome.stall.collective == "all_reduce" and outcome.stale_ranks == [1]
    assert "rank 1 on" in outcome.stall.describe() and "did not join all_reduce" in outcome.stall.describe()


def test_collective_stall_is_not_called_for_busy_phases_slow_steps_start_up_or_everyone_waiting():
    from infra.watch import collective_stall

    now = 1000.0
    nodes = {0: "node-a", 1: "node-b"}

    def beat(rank, phase="train", step_time_s=0.1):
        return runfiles.HeartbeatRecord(rank, 3, now - 20, 1, "h", phase, step_time_s, 0.05)

    def where(rank, collective, since=now - 20, at=now):
        return runfiles.WhereRecord(rank, at, 3, collective, since)

    beats = {0: beat(0), 1: beat(1)}
    hung = {0: where(0, "all_reduce"), 1: where(1, None)}
    stall = collective_stall(hung, beats, 2, now, stall_s=10, rank_nodes=nodes)
    assert stall is not None and stall.absent == [1] and stall.nodes == ["node-b"] and round(stall.waited_s) == 20
    frozen = {0: where(0, "all_reduce"), 1: where(1, None, at=now - 30)}  # rank 1 stopped sampling
    assert collective_stall(frozen, beats, 2, now, stall_s=10, rank_nodes=nodes).absent == [1]
    assert collective_stall(hung, beats, 2, now, stall_s=30, rank_nodes=nodes) is None  # not long enough yet
    slow = {0: beat(0, step_time_s=5.0), 1: beat(1, step_time_s=5.0)}  # 5 steps of 5 s > 20 s waited
    assert collective_stall(hung, slow, 2, now, stall_s=10, rank_nodes=nodes) is None
    saving = {0: beat(0, phase="checkpoint"), 1: beat(1)}  # rank 0 saves while rank 1 waits
    assert collective_stall(hung, saving, 2, now, stall_s=10, rank_nodes=nodes) is None
    starting = {0: runfiles.HeartbeatRecord(0, 0, now, 1, "h", "start"), 1: beat(1)}
    assert collective_stall(hung, starting, 2, now, stall_s=10, rank_nodes=nodes) is None
    everyone = {0: where(0, "all_reduce"), 1: where(1, "all_reduce")}  # the heartbeat timeout's case
    assert collective_stall(everyone, beats, 2, now, stall_s=10, rank_nodes=nodes) is None
    assert collective_stall({0: hung[0]}, beats, 2, now, stall_s=10, rank_nodes=nodes) is None  # no sample yet
