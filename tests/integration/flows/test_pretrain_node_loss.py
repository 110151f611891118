"""A node of a two-node job dies: the pretrain flow finds it with the node check, cordons it in
the orchestrator's database, is placed again on the node that is left (data parallel 2 -> 1,
same global batch) and finishes from the last committed checkpoint, with nobody stepping in.

The fault is physical: every process of node-b (its torchrun, its rank, later its node-check
rank) is SIGKILLed from step 6 on (testing.node_faults.NodeLoss); nothing reads a flag to fail.
Restarts are warm where they can be: the standby world waiting on both nodes dies with node-b, so
the node check and the next attempt start cold. Real torchrun (gloo), a real Prefect API, the
orchestrator on the session's state database.
"""

from __future__ import annotations

import re
import socket

import sqlalchemy as sa
import yaml

from flows.pretrain import pretrain
from infra import runfiles
from infra.launch import LaunchRequest, LocalLauncher, local_node_launches
from testing.node_faults import NodeLoss, after_step
from infra.statedb import open_state_db, read_transaction
from infra.statedb.schema import allocations, jobs
from scheduler.orchestrator.views import cluster_status
from training.config import load_job_spec
from training.runlog import events

CLUSTER = {  # its own name: the cordon it leaves must not meet other tests' two-node clusters
    "name": "elastic-two-nodes",
    "inter_node_bandwidth_gbps": 10,
    "nodes": [{"name": name, "gpu_type": "cpu", "gpu_count": 1, "gpu_memory_gib": 4, "peak_tflops": 0.05,
               "address": "127.0.0.1"} for name in ("node-a", "node-b")],
}
STEPS, INTERVAL, LOSE_AFTER = 16, 4, 6
# The tolerance of the reshard tests (tests/integration/checkpoint/test_reshard_resume.py, where it
# is justified): a data-parallel size of 1 instead of 2 sums the same gradients in another order.
REL_TOL = 2e-3


def _losses(run_dir) -> dict[int, float]:
    """step -> loss from rank 0's log; a step trained again after a resume keeps its last value."""
    text = runfiles.log_path(run_dir, 0).read_text()
    return {int(step): float(loss) for step, loss in re.findall(r" step=(\d+) loss=(\S+) ", text)}


def _uninterrupted(job_path, tmp_path, placement: dict) -> dict[int, float]:
    """The same job on the first attempt's layout, with no fault."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["-m", "training.train", str(job_path), "--set", f"training.tensor_parallel={placement['tp']}",
            "--set", f"training.pipeline_parallel={placement['pp']}"]
    request = LaunchRequest("reference", local_node_launches(["ref"], placement["world_size"], port), args,
                            tmp_path / "reference-launch")
    job = LocalLauncher().start(request)
    try:
        assert job.wait(timeout=600)["ref"] == 0
    finally:
        job.terminate()
    return _losses(load_job_spec(job_path).resolved_run_dir)


def test_a_lost_node_is_cordoned_and_the_job_finishes_on_the_node_left(prefect_api, make_job, tmp_path):
    cluster = tmp_path / "elastic-two-nodes.yaml"
    cluster.write_text(yaml.safe_dump(CLUSTER, sort_keys=False))
    sections = {"training": {"steps": STEPS, "lr_decay_steps": STEPS}, "checkpoint": {"interval": INTERVAL}}
    job = make_job("node-loss", **sections)
    run_dir = load_job_spec(job).resolved_run_dir

    with NodeLoss("node-b", trigger=after_step(run_dir, LOSE_AFTER)) as lost:
        # warm restarts on: the standby world waiting on both nodes loses node-b's processes too
        result = pretrain(str(job), cluster=str(cluster), backoff_s=0.5, hang_timeout_s=60, warm_standby=True)

    assert lost.lost_at is not None and lost.killed, "node-b was never lost"
    assert result.finished and result.final_step == STEPS, result
    first, last = result.placements[0], result.placements[-1]
    assert first["nodes"] == ["node-a", "node-b"] and first["dp"] == 2, result.placements
    assert last["nodes"] == ["node-a"] and last["world_size"] == 1 and last["dp"] == 1, result.placements
    failure = result.failures[0]
    assert "node check" in failure.action and "cordoned ['node-b']" in failure.action, failure
    # so the node check ran its worlds through the launcher (world-NNN-...), not in that standby,
    # and the attempt on node-a alone started cold
    checked = sorted(p.name for p in (run_dir / "nodecheck" / "attempt-0").iterdir())
    assert checked and all(name.startswith("world-") for name in checked), checked
    assert [f["warm"] for f in events(runfiles.log_path(run_dir, 0), "started")] == ["False", "False"]

    # The cordon is in the orchestrator's database (every flow sees it, it survives restarts).
    engine = open_state_db()
    node_b = next(n for n in cluster_status(engine, "elastic-two-nodes")["nodes"] if n["node"] == "node-b")
    assert node_b["state"] == "cordoned" and "failed the node check" in node_b["reason"], node_b
    # The job's allocations: both nodes first, then only the node that is left.
    with read_transaction(engine) as conn:
        job_id = conn.execute(sa.select(jobs.c.id).where(jobs.c.name == "node-loss")
                              .order_by(jobs.c.id.desc())).scalars().first()
        rows = conn.execute(sa.select(allocations.c.node, allocations.c.allocated_at)
                            .where(allocations.c.job_id == job_id)).all()
    by_time: dict[float, set[str]] = {}
    for node, at in rows:
        by_time.setdefault(at, set()).add(node)
    assert [by_time[t] for t in sorted(by_time)] == [{"node-a", "node-b"}, {"node-a"}], rows

    # Resumed on one rank instead of two, from a committed checkpoint: the step node-a's rank had
    # reached, when node-b vanished before that rank's optimizer update (it held a whole replica
    # and committed it alone: Checkpointer.save_after_failure); else the last interval's.
    text = runfiles.log_path(run_dir, 0).read_text()
    resumed = re.search(r"event=resumed step=(\d+) skipped_batches=\d+ world_size=(\d+) saved_world_size=(\d+)",
                        text)
    assert resumed, text[-3000:]
    resumed_step, world, saved_world = map(int, resumed.groups())
    assert (world, saved_world) == (1, 2)
    saved = re.search(r"event=save_after_failure step=(\d+) saved=True", text)
    if saved:
        assert resumed_step == int(saved[1]) >= LOSE_AFTER, text[-3000:]
    else:
        assert resumed_step % INTERVAL == 0 and resumed_step >= LOSE_AFTER - INTERVAL, text[-3000:]

    # The loss curve continues the uninterrupted run's (same global batch and data order).
    got = _losses(run_dir)
    want = _uninterrupted(make_job("node-loss-reference", **sections), tmp_path, first)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in range(resumed_step + 1, STEPS + 1):
        assert abs(got[step] - want[step]) <= REL_TOL * abs(want[step]), (step, got[step], want[step])
