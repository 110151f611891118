"""A job that outlives its Slurm partition's MaxTime: Slurm signals it before the limit
(`--signal=B:TERM@signal_s`), the ranks commit, the flow resubmits from that checkpoint without
counting a failure or spending a restart, and the job finishes."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import yaml

from flows.pretrain import pretrain


@pytest.fixture
def short_partition(slurm):
    """A second partition on the one node whose jobs may run two minutes.

    Not one (Slurm's smallest MaxTime): Slurm checks time limits periodically, and `--signal` "may
    be sent up to 60 seconds earlier than specified" (sbatch(1)). With one minute and a 30 s
    signal, the signal could come as the job started, before its first step (seen in CI: the
    first attempt was signalled 6 s after it started, at step 0, so there was nothing to resume
    from). With two minutes it comes 30 to 90 s after the start."""
    env = {**os.environ, **slurm.env()}
    subprocess.run(["scontrol", "create", "PartitionName=short", "Nodes=ALL", "MaxTime=2", "State=UP"],
                   env=env, check=True, capture_output=True)
    yield "short"
    subprocess.run(["scontrol", "delete", "PartitionName=short"], env=env, check=False, capture_output=True)


def test_a_job_past_its_time_limit_resumes_from_its_checkpoint_and_finishes(
        prefect_api, slurm, slurm_job, short_partition, tmp_path):
    cluster = tmp_path / "cluster-short.yaml"
    cluster.write_text(yaml.safe_dump({
        "name": "local-slurm-short",
        "nodes": [{"name": slurm.node, "gpu_type": "cpu", "gpu_count": 2, "gpu_memory_gib": 4,
                   "peak_tflops": 0.05, "address": slurm.node}],
        "slurm": {"partition": short_partition, "slurm_conf": str(slurm.conf), "poll_s": 1.0, "signal_s": 30},
    }, sort_keys=False))
    # ~1 s a step in the first attempt (a slow rank from step 1): 150 steps cannot fit in two minutes
    job = slurm_job("slurm-timelimit", training={"steps": 150}, checkpoint={"interval": 5})
    result = pretrain(str(job), cluster=str(cluster), launcher="slurm", drill_faults=["slow_rank@1:0"],
                      max_restarts=0, backoff_s=0.5)
    assert result.finished and result.final_step == 150, result
    assert not result.failures and result.attempts >= 2, result  # max_restarts=0: no restart was spent
    assert len(result.interruptions) == result.attempts - 1
    assert "Slurm signalled job" in result.interruptions[0] or "TIMEOUT" in result.interruptions[0]
    run_dir = job.parent / "slurm-timelimit" / "run"
    batch = (run_dir / "logs" / "slurm-batch.attempt-0.out").read_text()
    assert "Slurm signalled the job" in batch
    # The next attempt resumed from the step the first committed on Slurm's signal, not from 0.
    resumed = [int(line.split("step=")[1].split()[0]) for line in
               (run_dir / "logs" / "rank0.log").read_text().splitlines() if "event=resumed" in line]
    assert resumed and resumed[0] > 0, resumed
