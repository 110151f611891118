"""Preemption between two partitions of the session's real Slurm (PreemptType=preempt/partition_prio,
PreemptMode=REQUEUE; testing/slurm_local.py): a job in the low partition is preempted by a job in
the high one, its ranks commit the step they are on within the low partition's GraceTime, Slurm
ends it PREEMPTED (forgeflow asks for no requeue: resuming is the flow's decision), and the flow
submits it again from that step. It waits while the high job holds the node and finishes after it
with the loss curve going on where it stopped; no restart is spent."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest
import yaml

from flows.pretrain import pretrain
from infra.runfiles import log_path
from training.runlog import event_steps, read_steps


def _slurm(slurm, *args: str, check: bool = True) -> str:
    return subprocess.run(list(args), env={**os.environ, **slurm.env()}, capture_output=True, text=True,
                          check=check).stdout.strip()


@pytest.fixture
def two_partitions(slurm):
    """"low" (tier 1, 30 s grace to commit) and "high" (tier 2) on the one node."""
    _slurm(slurm, "scontrol", "create", "PartitionName=low", "Nodes=ALL", "PriorityTier=1", "PreemptMode=REQUEUE",
           "GraceTime=30", "State=UP")
    _slurm(slurm, "scontrol", "create", "PartitionName=high", "Nodes=ALL", "PriorityTier=2", "State=UP")
    yield "low", "high"
    for name in ("high", "low"):
        _slurm(slurm, "scontrol", "delete", f"PartitionName={name}", check=False)


def test_a_low_partition_job_preempted_by_a_high_one_commits_resumes_and_finishes(
        prefect_api, slurm, slurm_job, two_partitions, tmp_path):
    low, high = two_partitions
    cluster = tmp_path / "cluster-low.yaml"
    cluster.write_text(yaml.safe_dump({
        "name": "local-slurm-low",
        "nodes": [{"name": slurm.node, "gpu_type": "cpu", "gpu_count": 2, "gpu_memory_gib": 4,
                   "peak_tflops": 0.05, "address": slurm.node}],
        "slurm": {"partition": low, "slurm_conf": str(slurm.conf), "poll_s": 1.0},
    }, sort_keys=False))
    job = slurm_job("slurm-preempted", training={"steps": 40}, checkpoint={"interval": 10})
    run_dir = job.parent / "slurm-preempted" / "run"
    results: list = []
    # from step 13 on the first attempt's steps are slow (the slow_rank drill: 0.5 s a micro batch),
    # so that the job is still training when Slurm preempts it (at full speed it once reached its
    # last step, 40, before the preemption landed, on a loaded machine)
    flow = threading.Thread(target=lambda: results.append(pretrain(
        str(job), cluster=str(cluster), launcher="slurm", max_restarts=0, backoff_s=0.5,
        drill_faults=["slow_rank@12"])), daemon=True)
    flow.start()

    def step() -> int:
        try:
            return max((r.step for r in read_steps(log_path(run_dir, 0))), default=0)
        except OSError:
            return 0

    deadline = time.monotonic() + 240
    while step() < 12 and flow.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert step() >= 12, f"the job never reached step 12 (at {step()})"
    preemptor = _slurm(slurm, "sbatch", "--parsable", f"--partition={high}", "--exclusive",
                       "--job-name=high-priority", "--output=/dev/null", "--wrap", "sleep 10").split(";")[0]
    try:
        flow.join(timeout=400)
        assert not flow.is_alive(), "the flow did not end"
    finally:
        _slurm(slurm, "scancel", preemptor, check=False)
    (result,) = results
    assert result.finished and result.final_step == 40, result
    assert not result.failures and result.attempts == 2, result  # max_restarts=0: none was spent
    assert len(result.interruptions) == 1 and "PREEMPTED" in result.interruptions[0], result.interruptions

    stopped, resumed = event_steps(log_path(run_dir, 0), "stopped"), event_steps(log_path(run_dir, 0), "resumed")
    assert stopped and resumed and resumed[0] == stopped[0] >= 12, (stopped, resumed)  # from the step committed on the signal
    # the loss curve goes on from there: the first step after the resume trains on, not from scratch
    records = read_steps(log_path(run_dir, 0), latest_only=False)
    first_loss = next(r.loss for r in records if r.step == 1)
    after = next(r.loss for r in records if r.step == resumed[0] + 1)
    assert after < first_loss - 0.2, (first_loss, after)
