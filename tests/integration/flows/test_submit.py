"""Submit and forget on the embedded default (no Prefect server): `forgeflow submit` returns at
once with a job id, and a detached runner trains the job when the orchestrator admits it.

One CPU slot, two jobs of one spec: the first trains, the second waits for the slot; the
first is cancelled once it committed a checkpoint (its ranks commit the step they are on,
its slot goes to the second), and the second trains to the end. The submitting processes
have exited long before; nothing but the job ids ties the commands together."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest
import yaml

from scheduler.orchestrator import Orchestrator
from testing.torchrun_ranks import is_rank

ONE_SLOT = {
    "name": "submit-slot",
    "nodes": [{"name": "solo", "gpu_type": "cpu", "gpu_count": 1, "gpu_memory_gib": 4, "peak_tflops": 0.05,
               "address": "127.0.0.1"}],
}


def _until(what, check, timeout_s: float = 300.0, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def embedded(tmp_path, monkeypatch):
    """The environment of a user with no Prefect server: its own state dir and Prefect home."""
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("FORGEFLOW_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    return env


def _forgeflow(env, *argv, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "flows.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=120)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def _ranks_of(run_dir: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "training.train" in cmd and any(a.startswith(run_dir) for a in cmd) and is_rank(p):
            found.append(p)
    return found


@pytest.mark.slow
def test_submit_two_jobs_cancel_the_first_the_second_trains_to_the_end(embedded, make_job, tmp_path):
    from checkpoint.manifest import committed_checkpoints
    from training.config import parse_job_spec

    inventory = tmp_path / "one-slot.yaml"
    inventory.write_text(yaml.safe_dump(ONE_SLOT, sort_keys=False))
    job = make_job("submitted", training={"steps": 100000, "lr_decay_steps": 100000})  # until cancelled
    # the default layout: each job's run directory and checkpoints carry its id
    per_job = ["--set", f"run_dir={tmp_path}/runs/{{name}}/{{job}}", "--set", "checkpoint.url={run_dir}/checkpoints"]
    # the first trains until cancelled; after the checkpoint at step 10 that the test waits for, at
    # the slow_rank drill's pace (0.5 s of sleep a micro batch), so that it holds its slot without
    # taking a core from the processes under test
    first = json.loads(_forgeflow(embedded, "submit", str(job), "--cluster", str(inventory), *per_job,
                                  "--drill", "slow_rank@10", "--json").stdout)
    second = json.loads(_forgeflow(embedded, "submit", str(job), "--cluster", str(inventory), *per_job,
                                   "--set", "training.steps=20", "--json").stdout)
    # submit returned with ids; nothing has trained yet (the runners start on their own)
    assert first["job_id"] != second["job_id"] and first["runner"]["kind"] == "local"
    assert second["state"] == "queued" and second["position"] == 1
    assert first["run_dir"] != second["run_dir"] and first["checkpoints"] != second["checkpoints"]
    assert first["run_dir"].endswith(f"/submitted/{first['job_id']}")

    orch = Orchestrator()
    one, two = first["job_id"], second["job_id"]
    spec_one = parse_job_spec(orch.job(one)["spec"])
    assert spec_one.job == str(one) and spec_one.run_dir == first["run_dir"]  # the recorded spec is the job's
    _until("the first job's checkpoint at step 10", lambda: [r for r in committed_checkpoints(spec_one.checkpoint)
                                                            if r.step >= 10], timeout_s=300)
    assert orch.job(two)["state"] == "queued"  # the slot is taken
    # what a user sees: the second waits for the first's slot, with an estimated start
    def listed():
        listing = json.loads(_forgeflow(embedded, "jobs", "--json").stdout)["jobs"]
        return tuple(next(j for j in listing if j["job_id"] == i) for i in (one, two))

    # the flow records progress at most every 5 s: the listing catches up with the checkpoint
    running, waiting = _until("forgeflow jobs to show the first job past step 10",
                              lambda: (found := listed())[0]["step"] is not None and found[0]["step"] >= 10 and found,
                              timeout_s=120, every_s=2)
    assert running["state"] == "running" and running["loss"] is not None
    assert waiting["state"] == "queued" and waiting["position"] == 1
    assert waiting["waiting_reason"] == "no_room" and f"job {one}" in waiting["why"]
    assert waiting["estimated_start"] is not None and waiting["estimated_start"] > time.time()
    ranks = _ranks_of(first["run_dir"])
    assert ranks, "the first job's ranks are not running"

    done = _forgeflow(embedded, "cancel", str(one), "--reason", "make room")
    assert f"job {one} (submitted) is running" in done.stdout, done.stdout
    ended = _until("the first job to end", lambda: (j := orch.job(one))["state"] != "running" and j, timeout_s=180)
    assert ended["state"] == "cancelled" and "make room" in ended["reason"] and "cancelled by" in ended["reason"]
    _until("the first job's ranks to exit", lambda: not [p for p in ranks if p.is_running()
                                                         and p.status() != psutil.STATUS_ZOMBIE], timeout_s=60)
    kept = committed_checkpoints(spec_one.checkpoint)
    assert kept and kept[-1].step >= 10  # committed on the way out, or the one before: intact either way
    assert ended["progress"]["phase"] == "cancelled"

    finished = _until("the second job to finish", lambda: (j := orch.job(two))["state"] in ("finished", "failed",
                                                                                             "cancelled") and j,
                      timeout_s=400)
    assert finished["state"] == "finished", finished["reason"]
    assert finished["admitted_at"] >= ended["finished_at"]  # it got the slot the first gave back
    assert finished["progress"]["phase"] == "finished" and finished["progress"]["step"] == 20
    spec_two = parse_job_spec(finished["spec"])
    assert [r.step for r in committed_checkpoints(spec_two.checkpoint)][-1] == 20
    runner = psutil.Process(finished["runner"]["pid"]) if psutil.pid_exists(finished["runner"]["pid"]) else None
    _until("the second job's runner to exit", lambda: runner is None or not runner.is_running()
           or runner.status() == psutil.STATUS_ZOMBIE, timeout_s=60)
    log = open(finished["runner"]["log"]).read()
    assert f"job {two} (submitted): finished" in log
    assert orch.cluster("submit-slot").free_gpus_by_type() == {"cpu": 1}
    listing = json.loads(_forgeflow(embedded, "jobs", "--json").stdout)["jobs"]
    assert {j["job_id"]: j["state"] for j in listing if j["job_id"] in (one, two)} == {one: "cancelled",
                                                                                     two: "finished"}
    # cancelling a job that ended is one line and exit 2, nothing changed
    again = _forgeflow(embedded, "cancel", str(two), check=False)
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "already finished" in again.stderr
