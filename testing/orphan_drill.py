"""The orphan drill: a job's flow process is SIGKILLed while its ranks train through the Prefect
node launcher; how long until the ranks are gone (issue 28 item 7)?

    drill = run_orphan_drill(job_yaml, lease_s=4.0)   # needs a Prefect API (a test harness will do)
    drill.gone_s, drill.stop_reason, drill.stop_step, drill.committed_steps

Two processes play the two sides, as on a cluster:

- the holder (`python -m testing.orphan_drill hold ...`, a subprocess) does what the pretrain
  flow does around a launch on the Prefect launcher: registers a one-node cluster, queues the job
  and is admitted, records the launch request (`Orchestrator.record_launch`, what node-launch
  runs), then holds the lease with the flow's own HeldJob (renewing every lease_s / 3);
- the node: the real `node-launch` flow (flows/node_launch.py), run as a Prefect flow run in a
  thread of this process, starts the node's torchrun under the reaper and checks the lease.

Once every rank has trained `kill_after_step` steps the holder is SIGKILLed, and the drill times
how long until no rank process is left. Both sides use the state database of the environment
(FORGEFLOW_DB_URL, else the SQLite file in FORGEFLOW_STATE_DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from testing.torchrun_ranks import running

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class OrphanDrill:
    job_id: int
    ranks: list[int]  # the rank processes' pids when the holder was killed
    killed_step: int  # the newest step any rank had reported then
    gone_s: float | None  # SIGKILL of the holder -> no rank process left (None: still there at the timeout)
    stop_reason: str  # what node-launch said when it ended (its exception's message)
    stop_step: int | None  # the step the ranks committed on their graceful stop (markers/stopped.json)
    lease_ran_out_s: float | None  # SIGKILL -> the lease's expiry as last renewed (0..lease_s: renewals every lease_s / 3)
    kept_until_kill: bool  # every rank and node-launch still ran when the holder was killed (after `before_kill`)
    committed_steps: list[int] = field(default_factory=list)  # every committed checkpoint


def run_orphan_drill(job_yaml: Path, *, lease_s: float, grace_s: float | None = None, nproc: int = 1,
                     cluster: str = "orphan-drill", node: str = "orphan-node", kill_after_step: int = 2,
                     timeout_s: float = 600.0, before_kill: Callable[[], None] | None = None) -> OrphanDrill:
    """The drill (module docstring); `before_kill()` runs once the ranks train, before the holder is
    killed (e.g. a database outage the holder and the node must both live through)."""
    import scheduler.orchestrator.seat as seat
    from flows.node_launch import node_launch
    from infra import runfiles
    from checkpoint.manifest import committed_checkpoints
    from training.config import load_job_spec

    grace_s = grace_s if grace_s is not None else lease_s
    # Every flow of a cluster holds its leases for seat.FLOW_LEASE_S (node-launch reads it for its
    # look period and the outage epoch): the drill's lease is the cluster's, on both sides.
    flow_lease = seat.FLOW_LEASE_S, seat.FLOW_GRACE_S
    spec = load_job_spec(job_yaml)
    run_dir = spec.resolved_run_dir
    info = run_dir.parent / "holder.json"
    info.unlink(missing_ok=True)
    seat.FLOW_LEASE_S, seat.FLOW_GRACE_S = lease_s, grace_s
    holder: subprocess.Popen | None = None
    try:
        holder = subprocess.Popen(
            [sys.executable, "-m", "testing.orphan_drill", "hold", str(info), "--cluster", cluster, "--node", node,
             "--nproc", str(nproc), "--lease", str(lease_s), "--grace", str(grace_s),
             str(job_yaml)], cwd=ROOT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not info.exists():
            if holder.poll() is not None:
                raise RuntimeError(f"the holder exited with {holder.returncode} before holding the lease")
            if time.monotonic() > deadline:
                raise TimeoutError("the holder did not hold the lease in time")
            time.sleep(0.2)
        held = json.loads(info.read_text())
        outcome: dict[str, str] = {}

        def run_node() -> None:
            try:
                node_launch(held["job_id"], held["launch"], node)
                outcome["reason"] = "torchrun exited 0 (the job finished before it was stopped)"
            except Exception as e:  # the node-launch run fails when it stopped the ranks: say why
                outcome["reason"] = str(e)

        node_thread = threading.Thread(target=run_node, name="node-launch", daemon=True)
        node_thread.start()
        beats: dict = {}
        while not beats or min(b.step for b in beats.values()) < kill_after_step or len(beats) < nproc:
            if not node_thread.is_alive():
                raise RuntimeError(f"node-launch ended before the ranks trained: {outcome.get('reason')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the ranks did not reach step {kill_after_step} in time")
            time.sleep(0.2)
            beats = runfiles.read_heartbeats(run_dir)
        ranks = sorted(b.pid for b in beats.values())
        if before_kill is not None:
            before_kill()
        kept = node_thread.is_alive() and all(running(pid) for pid in ranks)
        killed_step = max(b.step for b in runfiles.read_heartbeats(run_dir).values())
        holder.send_signal(signal.SIGKILL)  # the flow process dies: nothing renews the lease any more
        killed_at, killed_wall = time.monotonic(), time.time()
        holder.wait()
        gone_s = None
        while time.monotonic() < deadline:
            if not any(running(pid) for pid in ranks):
                gone_s = time.monotonic() - killed_at
                break
            time.sleep(0.1)
        node_thread.join(timeout=max(1.0, deadline - time.monotonic()))
        stop = runfiles.read_stop_marker(run_dir)
        expires = seat.cluster_orchestrator().admission(held["job_id"])  # nobody reclaimed it: still admitted
        return OrphanDrill(held["job_id"], ranks, killed_step, gone_s, outcome.get("reason", "node-launch still running"),
                           stop.checkpoint_step if stop else None,
                           expires.lease_expires_at - killed_wall if expires is not None else None, kept,
                           [c.step for c in committed_checkpoints(spec.checkpoint)])
    finally:
        seat.FLOW_LEASE_S, seat.FLOW_GRACE_S = flow_lease
        if holder is not None and holder.poll() is None:
            holder.kill()
            holder.wait()


def hold(info: Path, job_yaml: Path, *, cluster: str, node: str, nproc: int, lease_s: float, grace_s: float) -> None:
    """The holder's side (see the module docstring); writes `info` once it holds the lease, then
    renews until it is killed."""
    from infra.atomic_write import atomic_write_json
    from infra.launch import CHOOSE_ON_NODE_0, LaunchRequest, local_node_launches
    from scheduler.cluster import parse_cluster
    from scheduler.orchestrator import Orchestrator, OrchestratorConfig, demand_options
    from scheduler.orchestrator.lease import HeldJob
    from training.config import load_job_spec

    orch = Orchestrator(config=OrchestratorConfig(lease_s=lease_s, grace_s=grace_s))
    inventory = parse_cluster({"name": cluster, "nodes": [
        {"name": node, "gpu_type": "cpu", "gpu_count": nproc, "gpu_memory_gib": 4, "peak_tflops": 0.05,
         "address": "127.0.0.1"}]})
    orch.register(inventory, source="orphan drill")
    spec = load_job_spec(job_yaml)
    job_id = orch.submit(spec.name, demand_options(inventory, nproc), cluster=cluster)
    orch.wait_admitted(job_id, poll_s=0.2, timeout_s=120)
    request = LaunchRequest(spec.name, local_node_launches([node], nproc, CHOOSE_ON_NODE_0),
                            ["-m", "training.train", str(job_yaml)], spec.resolved_run_dir)
    launch = f"{spec.name}-a{request.attempt}"
    orch.record_launch(job_id, launch, request.to_dict())
    with HeldJob(orch, job_id):
        atomic_write_json(info, {"job_id": job_id, "launch": launch, "pid": os.getpid()})
        while True:
            time.sleep(3600)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testing.orphan_drill")
    sub = parser.add_subparsers(dest="command", required=True)
    holder = sub.add_parser("hold", help="hold a one-node job's lease as its flow would, until killed")
    holder.add_argument("info")
    holder.add_argument("job_yaml")
    holder.add_argument("--cluster", required=True)
    holder.add_argument("--node", required=True)
    holder.add_argument("--nproc", type=int, default=1)
    holder.add_argument("--lease", type=float, required=True)
    holder.add_argument("--grace", type=float, required=True)
    args = parser.parse_args(argv)
    hold(Path(args.info), Path(args.job_yaml), cluster=args.cluster, node=args.node, nproc=args.nproc,
         lease_s=args.lease, grace_s=args.grace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
