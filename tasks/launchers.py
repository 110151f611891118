"""Launchers the pretrain flow can use, by name: `local`, `prefect`, `slurm` and `kubernetes`.

`PrefectLauncher` implements `infra.launch.Launcher` here rather than in infra/,
because libraries never import Prefect. It starts one run of the `node-launch`
deployment (flows/node_launch.py) per node on the work queue named after the
node, and follows those runs. (`slurm` and `kubernetes` are library launchers:
infra/slurm.py, infra/kubernetes.py.)
Like the local launcher it assumes the job's run
directory is on storage every node sees (NFS, Lustre, or one machine): the
watcher reads every rank's heartbeat and the diagnosis every node's log there.

When one node fails, the others stop with it, and their node-launch runs end Failed or
Cancelled too. Once the diagnosis names the failed node, `mark_stopped_by_peer` turns the
others' runs into Cancelled runs named `StoppedByPeer` whose message names the peer, so
the Prefect UI shows the culprit's run alone as a failure.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from uuid import UUID

from prefect import get_run_logger

from infra.atomic_write import atomic_write_json
from infra.launch import (LaunchRequest, LocalLauncher, clear_rendezvous, exit_code_path, node_log_path,
                          node_runs_path, stopped_by_peer, wait_for_exit)

NODE_LAUNCH_DEPLOYMENT = "node-launch/node-launch"
STOPPED_BY_PEER = "StoppedByPeer"  # the state name of a node-launch run a peer's failure stopped


READ_PAGE = 200  # the server's default page limit (PREFECT_API_DEFAULT_LIMIT)


@dataclass
class PrefectJob:
    """A training attempt running as one node-launch flow run per node.

    The watcher polls often (every 0.5 s); the states of all node runs are read with
    one filtered `read_flow_runs` call (one per 200 nodes) at most every `poll_s`, so
    the load on the Prefect server does not grow with the node count (it was one
    `read_flow_run` per node per poll: 200 calls/s for a 100-node job).
    """

    request: LaunchRequest
    flow_run_ids: dict[str, UUID]
    poll_s: float = 1.0
    api_calls: int = 0  # requests this job made to the Prefect API (benchmarks/watcher_scale.py)
    _cached: dict[str, object] = field(default_factory=dict)
    _read_at: float = -1e9

    def _states(self, fresh: bool = False) -> dict[str, object]:
        """Every node run's state, from one batched read at most every `poll_s`."""
        if not fresh and self._cached and time.monotonic() - self._read_at < self.poll_s:
            return self._cached
        from prefect import get_client
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        ids = list(self.flow_run_ids.values())
        by_id: dict[UUID, object] = {}
        with get_client(sync_client=True) as client:
            for start in range(0, len(ids), READ_PAGE):
                page = ids[start:start + READ_PAGE]
                runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=page)),
                                             limit=len(page))
                self.api_calls += 1
                by_id.update({run.id: run.state for run in runs})
        self._cached = {node: by_id.get(run_id) for node, run_id in self.flow_run_ids.items()}
        self._read_at = time.monotonic()
        return self._cached

    def poll(self) -> dict[str, int | None]:
        codes: dict[str, int | None] = {}
        for node, state in self._states().items():
            if state is None or not state.is_final():
                codes[node] = None
                continue
            marker = exit_code_path(self.request, node)
            if marker.exists():
                codes[node] = int(marker.read_text().strip() or 1)
            elif state.is_completed():
                codes[node] = 0
            else:  # crashed or cancelled before torchrun said anything: as if killed
                codes[node] = 143 if state.is_cancelled() else 137
        return codes

    def wait(self, timeout: float | None = None, any_exit: bool = False) -> dict[str, int | None]:
        return wait_for_exit(self.poll, timeout, any_exit, interval_s=0.5)  # API reads are rate-limited

    def terminate(self, grace_s: float = 10.0) -> None:
        """Cancel every node's run; the worker kills it and the reaper the ranks."""
        from prefect import get_client
        from prefect.states import Cancelled, Cancelling

        states = self._states(fresh=True)
        with get_client(sync_client=True) as client:
            for node, run_id in self.flow_run_ids.items():
                state = states.get(node)
                if state is not None and state.is_final():
                    continue
                # A run no worker has picked up yet has no process to stop.
                running = state is not None and (state.is_running() or state.is_pending())
                client.set_flow_run_state(run_id, Cancelling() if running else Cancelled(), force=True)
                self.api_calls += 1
        deadline = time.monotonic() + grace_s + 30  # the worker notices cancellations on its next poll
        while time.monotonic() < deadline:
            if all(s is not None and s.is_final() for s in self._states(fresh=True).values()):
                return
            time.sleep(1.0)
        get_run_logger_or_print(f"node-launch runs of {self.request.job_name} still not final after cancel")

    def log_paths(self) -> dict[str, Path]:
        return {n.node: node_log_path(self.request, n.node) for n in self.request.nodes}


def get_run_logger_or_print(message: str) -> None:
    try:
        get_run_logger().warning(message)
    except Exception:  # outside a flow or task run
        print(message)


class PrefectLauncher:
    """Start each node's share of a launch of job `job_id` on that node's Prefect worker queue.

    The launch request (command, environment, run directory) is recorded with the job in the
    state database (`Orchestrator.record_launch`); each node-launch run gets only the job id,
    the launch's name and its node, and runs what was recorded, while the job holds that node."""

    def __init__(self, job_id: int | None, deployment: str = NODE_LAUNCH_DEPLOYMENT, grace_s: float = 10.0):
        if job_id is None:
            raise ValueError("the prefect launcher runs only jobs the cluster's orchestrator knows: "
                             "run the job through `forgeflow submit` or the pretrain flow")
        self.job_id = job_id
        self.deployment = deployment
        self.grace_s = grace_s

    def start(self, request: LaunchRequest) -> PrefectJob:
        from prefect.deployments import run_deployment

        from infra.statedb.retry import StateDbRetry
        from scheduler.orchestrator.seat import cluster_orchestrator

        clear_rendezvous(request)  # node rank 0's run publishes this attempt's port afresh
        launch = f"{request.job_name}-a{request.attempt}"
        StateDbRetry().call(lambda: cluster_orchestrator().record_launch(self.job_id, launch, request.to_dict()),
                            f"job {self.job_id} recording launch {launch}")  # waits out a database outage
        runs: dict[str, UUID] = {}
        job = PrefectJob(request, runs)
        try:
            for spec in sorted(request.nodes, key=lambda n: n.node_rank):
                run = run_deployment(
                    self.deployment,
                    parameters={"job_id": self.job_id, "launch": launch, "node": spec.node,
                                "grace_s": self.grace_s},
                    work_queue_name=spec.node,
                    flow_run_name=f"{request.job_name}-a{request.attempt}-{spec.node}",
                    timeout=0,  # start it and return: the watcher follows it
                    tags=["forgeflow", f"job:{request.job_name}"],
                )
                runs[spec.node] = run.id
        except BaseException:
            job.terminate(grace_s=1.0)
            raise
        atomic_write_json(node_runs_path(request.run_dir, request.attempt),
                          {node: str(run_id) for node, run_id in runs.items()})
        return job


def mark_stopped_by_peer(run_dir: Path, attempt: int, culprits: list[str], cause: str = "") -> dict[str, str]:
    """The node-launch runs of attempt `attempt` (of the job in `run_dir`) that stopped only because a peer in
    `culprits` failed (infra.launch.stopped_by_peer) end Cancelled, named StoppedByPeer, the
    peer and `cause` in their message: not red, and saying who was. Only runs that ended
    Failed, Crashed or Cancelled change; an attempt not launched by PrefectLauncher has no
    runs (no node-runs file) and nothing changes. Returns node -> message of the runs changed."""
    from prefect import get_client
    from prefect.states import Cancelled

    try:
        runs = json.loads(node_runs_path(run_dir, attempt).read_text())
    except FileNotFoundError:
        return {}
    changed: dict[str, str] = {}
    with get_client(sync_client=True) as client:
        for node, message in stopped_by_peer(runs, culprits, cause).items():
            state = client.read_flow_run(UUID(runs[node])).state
            if state is None or not state.is_final() or state.is_completed():
                continue
            client.set_flow_run_state(UUID(runs[node]), Cancelled(name=STOPPED_BY_PEER, message=message), force=True)
            changed[node] = message
    return changed


def _slurm_launcher(grace_s: float, cluster=None, gpu_type: str = "cpu", job_id: int | None = None):
    from infra.slurm import SlurmLauncher, SlurmSettings

    settings = getattr(cluster, "slurm", None) or SlurmSettings()
    return SlurmLauncher(settings=settings, gpu_type=gpu_type, grace_s=grace_s)


def node_check_launcher(name: str, grace_s: float = 2.0, cluster=None, gpu_type: str = "cpu",
                        job_id: int | None = None):
    """The launcher a node check runs on: the training one, except that on Slurm the check's jobs
    name their nodes (`--nodelist`) even when training delegates: a check tests given nodes."""
    slurm = getattr(cluster, "slurm", None)
    if name == "slurm" and slurm is not None and slurm.mode != "pin":
        from infra.slurm import SlurmLauncher

        return SlurmLauncher(settings=slurm.model_copy(update={"mode": "pin"}), gpu_type=gpu_type, grace_s=grace_s)
    return make_launcher(name, grace_s=grace_s, cluster=cluster, gpu_type=gpu_type, job_id=job_id)


def _kubernetes_launcher(grace_s: float, cluster=None, gpu_type: str = "cpu", job_id: int | None = None):
    from infra.kubernetes import KubernetesLauncher

    settings = getattr(cluster, "kubernetes", None)
    if settings is None:  # unlike Slurm there are no defaults: the image and the run volume are the site's
        where = f"cluster {cluster.name!r}" if cluster is not None else "the pretrain run (no cluster file given)"
        raise ValueError(
            f"launcher 'kubernetes' needs a 'kubernetes:' section in the cluster file, and {where} has none: "
            "add one with at least 'image' (the forgeflow image) and 'run_volume_claim' (a ReadWriteMany PVC "
            "for run directories), e.g.\n  kubernetes:\n    image: registry.example/forgeflow:1.0\n"
            "    run_volume_claim: forgeflow-runs\nor pick another launcher (local, prefect, slurm)")
    return KubernetesLauncher(settings, gpu_type=gpu_type, grace_s=grace_s)


LAUNCHERS = {
    "local": lambda grace_s, cluster=None, gpu_type="cpu", job_id=None: LocalLauncher(grace_s=grace_s),
    "prefect": lambda grace_s, cluster=None, gpu_type="cpu", job_id=None: PrefectLauncher(job_id, grace_s=grace_s),
    "slurm": _slurm_launcher,
    "kubernetes": _kubernetes_launcher,
}
"""Launchers by the name a pretrain flow parameter gives; each is built from the grace time,
the cluster inventory (a Slurm cluster's `slurm:` section, a Kubernetes one's `kubernetes:`),
the placed GPU type and the job's id in the orchestrator."""


def make_launcher(name: str, grace_s: float = 10.0, cluster=None, gpu_type: str = "cpu", job_id: int | None = None):
    """The launcher a pretrain flow parameter names; `grace_s` is SIGTERM-to-SIGKILL time for ranks."""
    if name not in LAUNCHERS:
        raise ValueError(f"unknown launcher {name!r}: use one of {sorted(LAUNCHERS)}")
    return LAUNCHERS[name](grace_s, cluster=cluster, gpu_type=gpu_type, job_id=job_id)
