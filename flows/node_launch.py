"""The `node-launch` flow: one node's share of a training attempt.

Every GPU node runs one Prefect *process worker* polling a work queue named
after the node (`prefect worker start --pool forgeflow --work-queue NODE`). The
pretrain flow's Prefect launcher (tasks/launchers.py) starts one run of this
flow's deployment per node, each on that node's queue; the run starts the
node's torchrun under the reaper (infra.launch.start_node) and waits for it.
Cancelling or crashing the run kills every rank of the node: the reaper dies
with the flow-run process (PR_SET_PDEATHSIG) and takes its tree with it.

The run also outlives the pretrain flow that started it, so it checks the job's lease
itself (infra.lease_guard, scheduler.orchestrator.node_lease): once the database confirms
the lease gone (the flow died and stopped renewing it, or the job was released, reclaimed
or admitted again), it stops the ranks gracefully (they commit the step they are on), then
SIGKILLs what is left after `grace_s`. A look that does not reach the database stops nothing.

A node whose torchrun exits non-zero ends its run Failed. When the failure was
another node's (its ranks lost the peer, or the watcher stopped them), the
pretrain flow's diagnosis names that peer and the run is then marked Cancelled,
named `StoppedByPeer` (tasks.launchers.mark_stopped_by_peer): only the culprit's
run stays red.
"""

from __future__ import annotations

import signal

from prefect import flow, get_run_logger

from infra.atomic_write import atomic_write
from infra.launch import LaunchRequest, exit_code_path, node_log_path, start_node
from infra.lease_guard import LeaseGuard, look_every_s
from tasks.cluster_tasks import flow_db_retry


@flow(name="node-launch", log_prints=True)
def node_launch(job_id: int, launch: str, node: str, grace_s: float = 10.0) -> int:
    """Run one node's share of a launch of a job: its torchrun, until it exits.

    What runs is what the job's flow recorded for this launch in the state database (the
    worker command, environment, rendezvous and run directory: `Orchestrator.record_launch`),
    and only while the job holds this node; anything else is refused before a process starts.
    A flow-run parameter never chooses a command.

    Args:
        job_id: the job's id in the cluster's orchestrator.
        launch: the launch's name ("JOB-aN": attempt N; "nodecheck-K-a0": a node check's world).
        node: which of the launch's nodes this is (the work queue it was sent to).
        grace_s: seconds the ranks get between SIGTERM and SIGKILL when stopped.
    """
    from scheduler.orchestrator.node_lease import NodeLease
    from scheduler.orchestrator.seat import cluster_orchestrator

    # a state database outage is waited out (logged, alerted once it lasts), not a failed launch
    db = flow_db_retry(f"job {job_id}, launch {launch} on {node}")
    orchestrator = db.call(cluster_orchestrator, "opening the state database")
    launch_request = LaunchRequest.from_dict(db.call(lambda: orchestrator.launch_for(job_id, launch, node),
                                                     f"reading launch {launch}"))
    admission = db.call(lambda: orchestrator.admission(job_id), f"reading job {job_id}'s admission")
    if admission is None:
        raise RuntimeError(f"refusing to run launch {launch!r} of job {job_id} on node {node!r}: "
                           "the job was queued again, it holds no GPUs")
    spec = launch_request.node(node)
    logger = get_run_logger()
    logger.info("job %s, launch %s, node %s: node rank %d of %d, %d process(es), rendezvous %s:%d", job_id, launch,
                node, spec.node_rank, spec.nnodes, spec.nproc_per_node, spec.master_addr, spec.master_port)
    proc = start_node(spec, launch_request, grace_s)
    # SIGTERM to the reaper: the ranks commit their step and exit, SIGKILL after grace_s
    lease_s = orchestrator.config.lease_s
    guard = LeaseGuard(NodeLease(orchestrator.engine, lease_s, job_id, node, admission.attempt).look,
                       look_every_s(lease_s), lambda _why: proc.send_signal(signal.SIGTERM))
    guard.start()
    try:
        code = proc.wait()
    finally:
        guard.close()
    atomic_write(exit_code_path(launch_request, node), str(code))  # the launcher polls it: whole or absent
    if guard.gone_because is not None:
        raise RuntimeError(f"stopped the ranks on node {node}: {guard.gone_because} (torchrun exited with "
                           f"code {code}; see {node_log_path(launch_request, node)})")
    if code != 0:
        # A failed run (not a completed one) so the Prefect UI shows which node failed; a
        # peer's failure relabels it later (see the module docstring).
        raise RuntimeError(f"torchrun on node {node} exited with code {code}; "
                           f"see {node_log_path(launch_request, node)}")
    return code
