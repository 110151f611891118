"""A stop nobody asked for is a failure: the pretrain flow recovers from it at its committed step.

Two such stops in one run of the tiny job (real torchrun, two ranks):
- attempt 0: the sigterm drill delivers SIGTERM to rank 1 after step 5, as a stray `kill` or a
  node shutting down would; both ranks stop after the same step, commit its checkpoint through
  the async engine and exit EXIT_STOPPED;
- attempt 1: the torchrun agent is SIGKILLed mid-training (as the OOM killer or a crash would);
  the reaper stops the orphaned ranks with SIGTERM and they commit the step they are on.
Neither the flow nor `forgeflow cancel` asked for either stop, so each is a failure: diagnosed,
alerted, and restarted at once (no backoff the first time) from the step the ranks committed,
without a node check (nothing points at hardware); the job finishes at its last step with no
step lost and none trained twice. (`forgeflow cancel`, the requested stop, ends a job as
cancelled without a restart: tests/integration/flows/test_submit.py.) The job is handed over as
content (the validated spec), with no YAML file left on disk."""

from __future__ import annotations

import os
import signal
import threading

import psutil

from checkpoint.manifest import committed_checkpoints
from flows.pretrain import pretrain
from infra import runfiles
from testing.node_faults import after_step
from testing.torchrun_ranks import is_agent
from training.config import load_job_spec
from training.runlog import event_steps, read_steps

KILL_AFTER = 15  # attempt 1 (resumed at step 6) has its torchrun agent killed after this step


def _kill_the_torchrun_agent_after(run_dir, step: int, killed: list[int], done: threading.Event) -> None:
    """SIGKILL the torchrun agent (this process's descendant `python -m infra.torchrun`) once
    a rank reports `step`."""
    reached = after_step(run_dir, step)
    while not done.wait(0.02):
        if not reached():
            continue
        for proc in psutil.Process().children(recursive=True):
            try:
                if is_agent(proc):  # not the reaper around it, nor its ranks
                    os.kill(proc.pid, signal.SIGKILL)
                    killed.append(proc.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
                continue
        if killed:
            return



def test_stops_nobody_asked_for_are_failures_recovered_from_their_committed_step(prefect_api, make_job, slack):
    job = make_job("unasked-stops")
    spec = load_job_spec(job)
    run_dir = spec.resolved_run_dir
    # The spec travels as content: the flow and its ranks need no YAML file of the submitter's.
    job.unlink()
    killed: list[int] = []
    done = threading.Event()
    killer = threading.Thread(target=_kill_the_torchrun_agent_after, args=(run_dir, KILL_AFTER, killed, done),
                              daemon=True)
    killer.start()
    try:
        result = pretrain(spec.model_dump(mode="json"), drill_faults=["sigterm@5:1"], backoff_s=30)
    finally:
        done.set()
        killer.join()
    # what the ranks read: the spec as this job (its id filled in; the paths here are fixed)
    assert load_job_spec(runfiles.attempt_spec_path(run_dir, 0)) == spec.for_job(result.job_id)
    assert killed, "the torchrun agent was never killed"

    assert result.finished and not result.cancelled and result.final_step == 40, result
    assert result.attempts == 3 and len(result.failures) == 2, result.failures
    for failure in result.failures:  # failures, not requested stops; restarted at once, no node check
        assert failure.status == "failed", failure
        assert failure.action == "restart in place at once (first time)", failure
    drilled, agent_killed = result.failures
    assert drilled.step == 6

    # Each restart resumed from the step its stop committed: no step lost, none trained twice.
    log = runfiles.log_path(run_dir, 0)
    stopped, resumed = event_steps(log, "stopped"), event_steps(log, "resumed")
    assert len(stopped) == 2 and stopped[0] == 6 and stopped[1] >= KILL_AFTER, stopped
    assert resumed == stopped and agent_killed.step == stopped[1], (resumed, agent_killed)
    assert [r.step for r in read_steps(log, latest_only=False)] == list(range(1, 41))
    assert {6, stopped[1]} <= {c.step for c in committed_checkpoints(spec.checkpoint)}

    texts = slack.texts()
    assert not [t for t in texts if "stopped by request" in t]
    unasked = [t for t in texts if "neither the flow nor `forgeflow cancel` asked for it" in t]
    assert len(unasked) == 2, texts
    assert any("finished" in t for t in texts)
