"""Grow and shrink, live (issue 31 items 2-3): job A (the planner sizes it at one GPU) trains on an
elastic cluster of two "GPUs"; the decider's elastic pass grows it into the idle one (A's ranks
commit the step they are on, its flow yields and is re-admitted at dp=2 on the GPUs it was
promised, resuming from that step on the new layout). Job B arrives; the pass shrinks A back to
one GPU the same way and B gets the other. A finishes with no step lost or trained twice and its
loss curve continuing across both resizes; no GPU is ever held by two jobs.

Real torchrun (gloo), a real Prefect API, the orchestrator on the session's state database. The
decider is this test's thread calling `Orchestrator.resize` (what `forgeflow cluster serve` does
each beat), with no minimum interval and no resize cost, so that a tiny job is worth resizing.
B is a plain GPU demand; the test ends it a few seconds after it starts.
"""

from __future__ import annotations

import threading
import time

import yaml

import scheduler.orchestrator.seat as seat
from flows.pretrain import pretrain
from infra import runfiles
from scheduler.elastic import ElasticConfig
from scheduler.orchestrator import Orchestrator, OrchestratorError, demand_options, double_booked
from training.config import load_job_spec
from training.runlog import event_steps, read_steps

CLUSTER = {"name": "elastic-live", "policy": "elastic",
           "nodes": [{"name": "duo", "gpu_type": "cpu", "gpu_count": 2, "gpu_memory_gib": 4, "peak_tflops": 0.05,
                      "address": "127.0.0.1"}]}
STEPS, ARRIVE_AFTER = 300, 10  # A grows after 10 steps; B arrives 10 steps after A resumed on two



def _step(run_dir) -> int:
    return max((b.step for b in runfiles.read_heartbeats(run_dir).values()), default=0)


def _decider(run_dir, seen: dict, done: threading.Event) -> None:
    """The elastic pass every half second once A trained ARRIVE_AFTER steps on one GPU; B arrives
    once A trained ARRIVE_AFTER steps more after the pass grew it; B ends 3 s after it started."""
    orch = Orchestrator(seat.cluster_orchestrator().engine.url,
                        elastic=ElasticConfig(min_resize_interval_s=0.0, resize_cost_s=0.0))
    seen["asked"], arrive_at, b_started = [], None, None
    while not done.wait(0.2) and _step(run_dir) < ARRIVE_AFTER:  # A trains on one GPU first
        pass
    while not done.wait(0.5):
        try:
            seen["asked"] += orch.resize(CLUSTER["name"], stop_s=120)["asked"]
        except OrchestratorError:
            continue  # A's flow has not registered the cluster yet
        if arrive_at is None and any(to > frm for _, frm, to, _ in seen["asked"]):
            grown_at = time.time()
            while not done.wait(0.1):  # until A trains on two GPUs: its rank 1 beats again
                beats = runfiles.read_heartbeats(run_dir)
                if 1 in beats and beats[1].time >= grown_at and beats[1].phase != "start":
                    arrive_at = beats[1].step + ARRIVE_AFTER
                    break
        if "b" not in seen and arrive_at is not None and _step(run_dir) >= arrive_at:
            seen["b"] = orch.submit("b", demand_options(orch.cluster(CLUSTER["name"]), 1, duration_s=3),
                                    cluster=CLUSTER["name"])
        if "b" in seen and b_started is None and orch.job(seen["b"])["state"] == "running":
            b_started = time.monotonic()
        if b_started is not None and time.monotonic() - b_started > 3:
            orch.release(seen["b"])
            return


def test_a_data_parallel_job_shrinks_for_a_new_job_and_grows_back_when_it_ends(
        prefect_api, make_job, tmp_path, monkeypatch):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(CLUSTER, sort_keys=False))
    job = make_job("elastic", training={"steps": STEPS, "lr_decay_steps": STEPS},
                   checkpoint={"interval": 50})
    run_dir = load_job_spec(job).resolved_run_dir
    monkeypatch.setattr(seat, "FLOW_LEASE_S", 3.0)
    seen: dict = {}
    done = threading.Event()
    decider = threading.Thread(target=_decider, args=(run_dir, seen, done), daemon=True)
    decider.start()
    try:
        result = pretrain(str(job), cluster=str(cluster), hang_timeout_s=120)
    finally:
        done.set()
        decider.join(timeout=30)

    a, b = result.job_id, seen.get("b")
    assert [(job_id, frm, to) for job_id, frm, to, _ in seen["asked"]] == [(a, 1, 2), (a, 2, 1)], seen
    assert result.finished and result.final_step == STEPS and result.failures == [], result
    assert [p["world_size"] for p in result.placements] == [1, 2, 1], result.placements

    log = runfiles.log_path(run_dir, 0)
    stopped, resumed = event_steps(log, "stopped"), event_steps(log, "resumed")
    assert len(stopped) == 2 and resumed == stopped, (stopped, resumed)  # each resize resumed at its stop step
    records = read_steps(log, latest_only=False)
    assert [r.step for r in records] == list(range(1, STEPS + 1))  # none lost, none trained twice
    loss = {r.step: r.loss for r in records}
    for at in stopped:  # the curve goes on across each resize (the global batch is kept)
        assert abs(loss[at + 1] - loss[at]) < 0.15 * loss[at], (at, loss[at], loss[at + 1])

    orch = seat.cluster_orchestrator()
    assert orch.job(a)["state"] == "finished" and orch.job(b)["state"] == "finished"
    assert double_booked(orch.engine, CLUSTER["name"]) == 0
