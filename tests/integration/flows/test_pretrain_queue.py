"""Two jobs `forgeflow submit` sent to a real Prefect server (flow runs of the pretrain deployment,
the spec as content) share a cluster sized for one job:
the second waits in the orchestrator's queue (visible in its artifact), then runs when the
first finishes; cancelling a waiting run takes it out of the queue, and cancelling the running
one kills every training process it started (the deployment runs on a worker)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from uuid import UUID

import psutil
import pytest
import yaml

from flows.deploy import deploy_all
from scheduler.orchestrator import Orchestrator
from testing.torchrun_ranks import is_rank

POOL = "forgeflow-queue-test"
ONE_SLOT = {
    "name": "one-slot",
    "nodes": [{"name": "solo", "gpu_type": "cpu", "gpu_count": 1, "gpu_memory_gib": 4, "peak_tflops": 0.05,
               "address": "127.0.0.1"}],
}


def _job(orch: Orchestrator, name: str) -> dict | None:
    from scheduler.orchestrator.views import queue_snapshot

    snap = queue_snapshot(orch.engine, "one-slot", include_done=50)
    return next((j for j in snap["queued"] + snap["running"] + snap["ended"] if j["name"] == name), None)


def _until(what, check, timeout_s: float = 300.0, every_s: float = 0.25):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            print(f"[{time.strftime('%H:%M:%S')}] {what}: done")
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out waiting for {what}")


def _ranks(job) -> list[psutil.Process]:
    """The training ranks (not their torchrun) of the job whose spec is `job`: they read the spec
    the flow wrote into the job's run directory (runfiles.attempt_spec_path)."""
    from infra.runfiles import attempt_spec_path
    from training.config import load_job_spec

    spec_dir = str(attempt_spec_path(load_job_spec(job).resolved_run_dir, 0).parent)
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "training.train" in cmd and any(a.startswith(spec_dir) for a in cmd) and is_rank(p):
            found.append(p)
    return found


@pytest.fixture
def one_slot(use_prefect_server, tmp_path):
    """The deployments `forgeflow deploy` makes for a one-GPU cluster (its inventory, returned),
    a worker for their flow runs, and the on-commit deployment's trigger paused: this test's
    jobs commit checkpoints, each of which it would evaluate in a flow run of its own, competing
    for the CPUs with the jobs under test (test_checkpoint_event_trigger tests it). Resumed for
    the tests after this one, on the same server."""
    from prefect import get_client

    inventory = tmp_path / "one-slot.yaml"
    inventory.write_text(yaml.safe_dump(ONE_SLOT, sort_keys=False))
    assert deploy_all(cluster=str(inventory), pool=POOL) == 0
    with get_client(sync_client=True) as client:
        on_commit = client.read_deployment_by_name("evaluate-checkpoint/on-commit")
        triggers = client.read_resource_related_automations(f"prefect.deployment.{on_commit.id}")
        assert triggers, "no automation runs the on-commit deployment"
        for automation in triggers:
            client.pause_automation(automation.id)
        try:
            use_prefect_server.start_worker(POOL, "default")
            yield inventory
        finally:
            for automation in triggers:
                client.resume_automation(automation.id)


def _final_state(client, run_id, timeout_s: float = 600.0):
    return _until(f"flow run {run_id} to end", lambda: (s := client.read_flow_run(run_id).state).is_final() and s,
                  timeout_s)


@pytest.mark.slow
def test_second_run_waits_for_the_first_and_a_cancelled_waiter_leaves_the_queue(one_slot, make_job):
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.states import Cancelling

    inventory = one_slot
    orch = Orchestrator()

    specs = {}

    def submit(name: str, steps: int, checkpoint_interval: int = 10, drill: tuple[str, ...] = ()):
        """`forgeflow submit` with PREFECT_API_URL set: a flow run of the deployment, the spec as content."""
        job = specs[name] = make_job(name, training={"steps": steps, "lr_decay_steps": steps},
                                     checkpoint={"interval": checkpoint_interval})
        done = subprocess.run([sys.executable, "-m", "flows.cli", "submit", str(job), "--cluster", str(inventory),
                               *(f"--drill={d}" for d in drill), "--json"], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        out = json.loads(done.stdout)
        assert out["runner"]["kind"] == "prefect"
        return out["job_id"], UUID(out["runner"]["flow_run_id"])

    first_job, first_id = submit("queue-first", 10)
    _until("the first job to hold the GPU", lambda: (j := _job(orch, "queue-first")) and j["state"] == "running")
    # The first job must still hold the GPU when the second's flow run shows that it waits, but on
    # a loaded machine its 10 steps can be over before the second flow run has even started (the
    # waiting artifact never came): its training ranks are paused from when they start until the
    # artifact is seen, as on a slow machine (SIGSTOP; the flow's hang timeout is 300 s).
    paused = _until("the first job's training ranks to start", lambda: _ranks(specs["queue-first"]),
                    timeout_s=240, every_s=0.2)
    try:
        for rank in paused:
            rank.suspend()
        second_job, second_id = submit("queue-second", 10)
        _until("the second job to queue", lambda: (j := _job(orch, "queue-second")) and j["state"] == "queued")

        with get_client(sync_client=True) as client:
            def waiting_artifact():
                artifacts = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[second_id])))
                return [a for a in artifacts if a.key == f"queue-queue-second-{second_job}"
                        and "waiting for GPUs, position 1 of 1" in (a.data or "")
                        and "expected to start" in (a.data or "") and f"job {first_job}" in (a.data or "")]
            assert _until("the waiting artifact", waiting_artifact, timeout_s=240)
    finally:
        for rank in paused:
            try:
                rank.resume()
            except psutil.NoSuchProcess:
                pass
    with get_client(sync_client=True) as client:
        assert _final_state(client, first_id).is_completed()
        assert _final_state(client, second_id).is_completed()
        run = client.read_flow_run(second_id)
        # named after its job; the spec travels as content (this job's paths), not as a path
        assert run.name == f"queue-second-{second_job}"
        assert run.parameters["job_spec"]["name"] == "queue-second" and run.parameters["job_id"] == second_job
    one, two = _job(orch, "queue-first"), _job(orch, "queue-second")
    assert one["state"] == two["state"] == "finished"
    assert two["admitted_at"] >= one["finished_at"]  # it ran only once the first gave the GPU back

    # The holder's cancellation must leave none of its training ranks alive (it was
    # test_prefect_deployments' test_cancelling_the_flow_run_kills_every_training_process:
    # the same deployment run on a worker, cancelled while it trains; sharing this run
    # saves a deployment and a flow run's start-up).
    # The holder trains until cancelled: no periodic checkpoints (writing them costs CPU too), and
    # from its second step on at the slow_rank drill's pace (0.5 s of sleep a micro batch): it
    # holds the GPU while the waiter's flow run starts without taking a core from it.
    _, holder_run = submit("queue-holder", 100000, checkpoint_interval=100000, drill=("slow_rank@1",))
    _until("the holder to run", lambda: (j := _job(orch, "queue-holder")) and j["state"] == "running")
    _, waiter_run = submit("queue-waiter", 10)
    _until("the waiter to queue", lambda: (j := _job(orch, "queue-waiter")) and j["state"] == "queued")
    with get_client(sync_client=True) as client:  # its flow run waits for GPUs (submit queued the job itself)
        _until("the waiter's flow run to run", lambda: client.read_flow_run(waiter_run).state.is_running())
    running = _until("the holder's training ranks to start", lambda: _ranks(specs["queue-holder"]), timeout_s=240)
    pids = {p.pid for p in running}
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(waiter_run, Cancelling(), force=True)
        assert _final_state(client, waiter_run, 180).is_cancelled()
        # Out of the queue, never admitted: the flow withdraws it when the worker's SIGTERM comes
        # after the flow opened the state database; one that comes sooner (a loaded machine is
        # still importing) is the release-cancelled deployment's, triggered by the Cancelled event.
        waiter = _until("the waiter to leave the queue",
                        lambda: (j := _job(orch, "queue-waiter"))["state"] != "queued" and j, timeout_s=120)
        assert waiter["state"] == "cancelled" and waiter["admitted_at"] is None, waiter
        client.set_flow_run_state(holder_run, Cancelling(), force=True)
        assert _final_state(client, holder_run, 180).is_cancelled()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(psutil.pid_exists(pid) for pid in pids):
        time.sleep(0.5)
    alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"training ranks outlived the cancelled flow run: {alive}"
    held = _job(orch, "queue-holder")
    assert held["state"] in ("cancelled", "finished")  # released in `finally` (a graceful stop counts as either)
    assert orch.cluster("one-slot").free_gpus_by_type() == {"cpu": 1}
