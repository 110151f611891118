"""Preemption that ends in a checkpoint, live (issue 31 item 1): job A (low priority) trains on
the only GPU; job B (high priority) arrives; the decider's preemption pass asks A to stop; A's
ranks commit the step they are on, its flow releases it as preempted (queued again at its
submit time), B is admitted; once B ends, A is admitted again, resumes from exactly the
committed step and finishes: no step lost, none trained twice, one alert says "preempted by job B".

Real torchrun (gloo), a real Prefect API, the orchestrator on the session's state database. B is
a plain GPU demand submitted through the library; the test ends it once it holds the GPU (what
B's own flow would do when it finished).
"""

from __future__ import annotations

import threading
import time

import sqlalchemy as sa
import yaml

from infra.statedb import read_transaction
from infra.statedb.schema import allocation_events

import scheduler.orchestrator.seat as seat
from flows.pretrain import pretrain
from tasks import checkpoint_events
from infra import runfiles
from scheduler.orchestrator import demand_options, double_booked
from testing.node_faults import after_step
from training.config import load_job_spec
from training.runlog import event_steps, read_steps

CLUSTER = {"name": "preempt-live", "nodes": [{"name": "solo", "gpu_type": "cpu", "gpu_count": 1,
                                              "gpu_memory_gib": 4, "peak_tflops": 0.05, "address": "127.0.0.1"}]}
STEPS, ARRIVE_AFTER = 40, 12



def _urgent_job(run_dir, seen: dict, done: threading.Event) -> None:
    """Once A trained ARRIVE_AFTER steps: B (high priority) arrives and the decider's preemption
    pass runs; once B holds the GPU, B ends."""
    reached = after_step(run_dir, ARRIVE_AFTER)
    while not done.wait(0.05) and not reached():
        pass
    if done.is_set():
        return
    orch = seat.cluster_orchestrator()
    seen["b"] = orch.submit("urgent", demand_options(orch.cluster(CLUSTER["name"]), 1, duration_s=5),
                            cluster=CLUSTER["name"], priority=10)
    seen["asked"] = orch.preempt(CLUSTER["name"], stop_s=120)["asked"]
    seen["a_at_ask"] = dict(orch.job(seen["asked"][0][0])) if seen["asked"] else None
    while not done.wait(0.1):
        if orch.job(seen["b"])["state"] == "running":
            seen["a_while_b_runs"] = orch.job(seen["asked"][0][0])
            orch.release(seen["b"])
            return


def test_a_low_priority_job_commits_yields_to_a_high_one_and_resumes_at_its_committed_step(
        prefect_api, make_job, slack, tmp_path, monkeypatch):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(CLUSTER, sort_keys=False))
    job = make_job("preempted", training={"steps": STEPS, "lr_decay_steps": STEPS})
    run_dir = load_job_spec(job).resolved_run_dir
    monkeypatch.setattr(seat, "FLOW_LEASE_S", 3.0)  # the holder reads stop requests every second
    announced: list[int] = []  # each checkpoint-committed event triggers one evaluation
    monkeypatch.setattr(checkpoint_events, "emit_checkpoint_committed", lambda ref, spec: announced.append(ref.step))
    seen: dict = {}
    done = threading.Event()
    urgent = threading.Thread(target=_urgent_job, args=(run_dir, seen, done), daemon=True)
    urgent.start()
    try:
        # slowed first attempt (0.5 s a micro batch): still training when B arrives
        result = pretrain(str(job), cluster=str(cluster), drill_faults=["slow_rank@1"], hang_timeout_s=120)
    finally:
        done.set()
        urgent.join(timeout=30)

    a, b = result.job_id, seen.get("b")
    assert seen.get("asked") == [[a, b]], seen
    assert seen["a_while_b_runs"]["state"] == "queued", seen["a_while_b_runs"]
    assert seen["a_while_b_runs"]["reason"] == f"preempted by job {b}"
    assert seen["a_while_b_runs"]["queued_at"] == seen["a_while_b_runs"]["submitted_at"]
    assert result.finished and not result.cancelled and result.final_step == STEPS, result
    assert result.failures == [] and len(result.placements) == 2, result

    # resumed from exactly the step its stop committed: no step lost, none trained twice
    log = runfiles.log_path(run_dir, 0)
    stopped, resumed = event_steps(log, "stopped"), event_steps(log, "resumed")
    assert len(stopped) == 1 and stopped[0] >= ARRIVE_AFTER and resumed == stopped, (stopped, resumed)
    assert [r.step for r in read_steps(log, latest_only=False)] == list(range(1, STEPS + 1))
    # every commit, the one made on the way out included, is announced once: evaluated once
    assert stopped[0] in announced and announced == sorted(set(announced)) and announced[-1] == STEPS, announced

    orch = seat.cluster_orchestrator()
    a_row, b_row = orch.job(a), orch.job(b)
    assert a_row["state"] == "finished" and a_row["attempts"] == 2 and a_row["lost_count"] == 0, a_row
    assert b_row["state"] == "finished"
    with read_transaction(orch.engine) as conn:  # the history, in commit order: A, preempt, B, A again
        events = [(job, event) for job, event in conn.execute(  # (the worker's state database is shared)
            sa.select(allocation_events.c.job_id, allocation_events.c.event)
            .where(allocation_events.c.job_id.in_([a, b])).order_by(allocation_events.c.id))]
    assert events == [(a, "allocate"), (a, "preempt"), (b, "allocate"), (b, "release"), (a, "allocate"),
                      (a, "release")], events
    assert double_booked(orch.engine, CLUSTER["name"]) == 0
    preempted = [t for t in slack.texts() if f"preempted by job {b}" in t]
    assert len(preempted) == 1 and f"after step {stopped[0]}" in preempted[0], slack.texts()


def _urgent_job_while_recovering(name: str, seen: dict, done: threading.Event) -> None:
    """Once A's flow is recovering from its failure (diagnosed, checking its node: `forgeflow jobs`
    says "recovering"): B arrives and the decider's preemption pass runs; once B holds the GPU, B ends."""
    from scheduler.orchestrator.views import job_list

    orch = seat.cluster_orchestrator()
    while not done.wait(0.05):
        if any(j["name"] == name and j["state"] == "recovering" for j in job_list(orch.engine)["jobs"]):
            break
    if done.is_set():
        return
    seen["b"] = orch.submit("urgent", demand_options(orch.cluster(RECOVERING), 1, duration_s=5),
                            cluster=RECOVERING, priority=10)
    seen["asked"] = orch.preempt(RECOVERING, stop_s=120)["asked"]
    while not done.wait(0.1):
        if orch.job(seen["b"])["state"] == "running":
            orch.release(seen["b"])
            return


RECOVERING = "preempt-recovering"


def test_a_job_preempted_while_it_recovers_yields_then_resumes_from_its_newest_checkpoint(
        prefect_api, make_job, tmp_path, monkeypatch):
    """Issue 31: the preemption arrives while A's flow is between attempts (a CUDA error diagnosed,
    its node being checked). A launches nothing more, yields (released as preempted, queued at its
    submit time), B runs, and A resumes from its newest committed checkpoint: no checkpoint lost,
    no step after it trained twice, no restart counted for the preemption."""
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({**CLUSTER, "name": RECOVERING}, sort_keys=False))
    job = make_job("preempted-recovering", training={"steps": 24, "lr_decay_steps": 24})
    run_dir = load_job_spec(job).resolved_run_dir
    monkeypatch.setattr(seat, "FLOW_LEASE_S", 3.0)
    seen: dict = {}
    done = threading.Event()
    urgent = threading.Thread(target=_urgent_job_while_recovering, args=("preempted-recovering", seen, done),
                              daemon=True)
    urgent.start()
    import flows.pretrain

    real_node_check = flows.pretrain.node_check

    def node_check_meanwhile_preempted(*args, **kwargs):  # the real check; B arrives while it runs
        checked = real_node_check(*args, **kwargs)
        deadline = time.monotonic() + 60
        while "asked" not in seen and time.monotonic() < deadline:
            time.sleep(0.05)
        return checked

    monkeypatch.setattr(flows.pretrain, "node_check", node_check_meanwhile_preempted)
    try:
        result = pretrain(str(job), cluster=str(cluster), drill_faults=["cuda_error@14"], backoff_s=0.5,
                          hang_timeout_s=120)
    finally:
        done.set()
        urgent.join(timeout=30)

    a, b = result.job_id, seen.get("b")
    assert seen.get("asked") == [[a, b]], seen
    assert result.finished and result.final_step == 24, result
    assert len(result.failures) == 1 and result.failures[0].root_cause == "CUDAError", result.failures
    assert len(result.placements) == 2, result.placements  # the failed attempt, then after B

    log = runfiles.log_path(run_dir, 0)
    assert event_steps(log, "resumed") == [10]  # the newest committed checkpoint before the failure at 14
    steps = [r.step for r in read_steps(log, latest_only=False)]
    assert steps == list(range(1, 15)) + list(range(11, 25)), steps  # 11-14 again, once: after the checkpoint

    orch = seat.cluster_orchestrator()
    with read_transaction(orch.engine) as conn:
        events = [(j, e) for j, e in conn.execute(
            sa.select(allocation_events.c.job_id, allocation_events.c.event)
            .where(allocation_events.c.job_id.in_([a, b])).order_by(allocation_events.c.id))]
    assert events == [(a, "allocate"), (a, "preempt"), (b, "allocate"), (b, "release"), (a, "allocate"),
                      (a, "release")], events
    assert double_booked(orch.engine, RECOVERING) == 0
