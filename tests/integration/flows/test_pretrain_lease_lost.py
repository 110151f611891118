"""The pretrain flow's holder stalls past its GPU lease (a long GC pause, a network partition):
meanwhile another flow's policy pass reclaims the lease, re-queues the job and admits it again.
When the holder wakes, its renewal is refused (fenced by admission), the watcher stops the ranks
(its GPUs may already run another job), and the flow waits to be placed again and finishes from
the newest committed checkpoint: evicted, not failed, and no GPU was ever held twice.

Real torchrun (gloo), a real Prefect API, the orchestrator on the session's state database; the
stall is the one thing injected: the holder's renewal call blocks for lease + grace.
"""

from __future__ import annotations

import threading
import time

import yaml

import scheduler.orchestrator.service as service
import scheduler.orchestrator.seat as seat
from flows.pretrain import pretrain
from testing.node_faults import after_step
from scheduler.orchestrator import double_booked
from training.config import load_job_spec

CLUSTER = {"name": "lease-lost", "nodes": [{"name": "solo", "gpu_type": "cpu", "gpu_count": 1,
                                            "gpu_memory_gib": 4, "peak_tflops": 0.05, "address": "127.0.0.1"}]}
LEASE_S, GRACE_S, STALL_AFTER, STEPS = 2.0, 1.0, 2, 16


def test_a_holder_that_stalls_past_its_lease_stops_its_ranks_and_is_placed_again(prefect_api, make_job,
                                                                                 tmp_path, monkeypatch):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(CLUSTER, sort_keys=False))
    job = make_job("lease-lost", training={"steps": STEPS, "lr_decay_steps": STEPS}, checkpoint={"interval": 2})
    trained = after_step(load_job_spec(job).resolved_run_dir, STALL_AFTER)
    monkeypatch.setattr(seat, "FLOW_LEASE_S", LEASE_S)
    monkeypatch.setattr(seat, "FLOW_GRACE_S", GRACE_S)
    real_renew = service.Orchestrator.renew
    stalls: list[dict] = []

    def renew(self, job_id, attempt=None):
        if not stalls and threading.current_thread().name.startswith("lease-") and trained():
            stalls.append({"attempt": attempt})
            # The holder is stuck while the database stays up and the rest of the cluster keeps
            # reaching it: another flow waiting on this cluster polls (what wait_admitted does),
            # which keeps the control plane's liveness record fresh, so the stall is no outage
            # (no epoch) and the lease is overdue at lease + grace. Without such a writer the
            # stall would read as an outage (epoch.py) and the lease would be kept a lease longer.
            other = seat.cluster_orchestrator()
            deadline = time.monotonic() + 20 * (LEASE_S + GRACE_S)
            while not other.pass_due(CLUSTER["name"]):
                assert time.monotonic() < deadline, "the stalled holder's lease never became overdue"
                time.sleep(LEASE_S / 10)
            # that flow's pass reclaims the lease (and, the GPU being free, admits the re-queued
            # job again at once)
            stalls[0]["pass"] = other.reconcile(CLUSTER["name"])
        return real_renew(self, job_id, attempt)

    monkeypatch.setattr(service.Orchestrator, "renew", renew)
    # the first attempt is slowed (0.5 s a micro batch) so that it is still training when the
    # holder wakes; the drill fires once per flow run, so the attempt after the eviction runs fast
    result = pretrain(str(job), cluster=str(cluster), drill_faults=["slow_rank@1"], backoff_s=0.5,
                      hang_timeout_s=60)

    assert stalls and stalls[0]["attempt"] == 1, stalls
    reclaimed = stalls[0]["pass"]
    assert reclaimed.expired_jobs and reclaimed.expired_jobs == reclaimed.admitted, reclaimed
    assert result.finished and result.final_step == STEPS, result
    assert result.failures == [], result.failures  # evicted is not a failure: nothing was diagnosed
    assert len(result.placements) == 2 and result.placements[1]["nodes"] == ["solo"], result.placements
    orch = seat.cluster_orchestrator()
    row = orch.job(reclaimed.expired_jobs[0])
    assert (row["state"], row["attempts"], row["lost_count"]) == ("finished", 2, 1), row
    assert double_booked(orch.engine, CLUSTER["name"]) == 0
