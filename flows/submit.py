"""`forgeflow submit`: put a job on the shared cluster and return at once with its id (like `sbatch`).

    forgeflow submit configs/tiny-cpu.yaml [--cluster C] [--priority P] [--set k=v ...]
    job 7 (tiny-cpu) submitted: queued, position 1 of 1 ...

The job is sized (MARP plans on every GPU type), queued with the cluster's orchestrator,
and its spec, with its paths filled in for this job id, is recorded in the state database.
Then something runs its whole `pretrain` flow once the policy admits it (placement,
training, diagnosis and recovery, evaluation of its checkpoints, alerts):

- with a Prefect server configured (PREFECT_API_URL): a flow run of the `pretrain`
  deployment (`forgeflow deploy` creates it), named after the job, whose parameters hold
  the spec's content — a worker on another machine needs no file of the submitter's;
- otherwise: a detached runner on this machine (`python -m flows.job_runner`, its own
  session: it survives the terminal closing), logging to `<run dir>/runner.log`.

Either way the job's id is the one handle: `forgeflow jobs`, `forgeflow logs ID`,
`forgeflow cancel ID`. `forgeflow pretrain` is the foreground form (like `srun`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

RUNNER_LOG = "runner.log"


def add_job_options(p: argparse.ArgumentParser) -> None:
    """The options `forgeflow submit` and `forgeflow pretrain` share."""
    p.add_argument("config", help="job spec YAML")
    p.add_argument("--cluster", default=None, help="cluster inventory YAML, or 'local' for this machine "
                                                   "(default: the cluster registered with `forgeflow cluster "
                                                   "register`, if there is exactly one, else this machine)")
    p.add_argument("--priority", default="0", help="place in the shared queue: a priority class's name "
                   "(`forgeflow cluster class add`; at most the team's cap), or, while no class is defined, "
                   "a whole number -1000..1000 (higher goes first; default 0)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a field of the job spec (repeatable), e.g. --set training.steps=50")
    p.add_argument("--max-restarts", type=int, default=5)
    p.add_argument("--hang-timeout", type=float, default=300.0, help="seconds without a heartbeat = hang")
    p.add_argument("--drill", action="append", default=[], metavar="KIND@STEP[:RANK]",
                   help="inject a fault in one attempt (repeat for later attempts), e.g. cuda_error@30:1")
    p.add_argument("--launcher", choices=("local", "prefect", "slurm", "kubernetes"), default="local",
                   help="how each attempt's ranks start: on this machine (local), one node-launch run per "
                        "node (prefect), one batch job (slurm), one indexed Job (kubernetes)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "submit", help="queue a job on the shared cluster and return its id; it trains when admitted",
        description="Size the job, queue it with the cluster's orchestrator and return at once with its id. "
                    "When the policy admits it, the whole pretrain flow runs it (training, recovery, "
                    "evaluation, alerts): as a flow run of the `pretrain` deployment when PREFECT_API_URL "
                    "is set, else in a detached runner on this machine. Watch it with `forgeflow jobs`, "
                    "`forgeflow logs ID`; stop it with `forgeflow cancel ID`.")
    add_job_options(p)
    p.add_argument("--gpu-type", default=None, help="only this GPU type (default: any that holds the job)")
    p.add_argument("--gpus", type=int, default=None, help="exactly this many GPUs (default: MARP sizes it)")
    p.add_argument("--team", default=None, help="the team the job runs for (default: $FORGEFLOW_TEAM, else the "
                                                "database role's only team; needed for a role in several)")
    p.add_argument("--db", default=None, help="state database URL (default: $FORGEFLOW_DB_URL, else SQLite "
                                              "in the forgeflow state dir)")
    p.set_defaults(func=_submit)


def job_spec_from_args(args: argparse.Namespace):
    """The job spec file with the --set overrides applied, validated; the drills checked."""
    from training.config import dotted_overrides, load_job_spec
    from training.faults import parse_fault

    spec = load_job_spec(args.config, dotted_overrides(args.set))
    for drill in args.drill or []:
        parse_fault(drill)
    return spec


def queue_from_args(args: argparse.Namespace, by: str):
    """The job of `forgeflow submit` / `pretrain` queued with the cluster's orchestrator:
    (SubmittedJob, the flow's options). Bad input raises its config error before anything is queued."""
    from scheduler.orchestrator.seat import cluster_orchestrator, default_cluster_source, queue_spec
    from scheduler.orchestrator.service import check_priority

    spec = job_spec_from_args(args)
    check_priority(args.priority)
    cluster = args.cluster or default_cluster_source(cluster_orchestrator())
    cluster = cluster if cluster in ("", "local") else str(Path(cluster).resolve())
    submitted = queue_spec(spec, cluster, args.priority, gpu_type=getattr(args, "gpu_type", None),
                           gpus=getattr(args, "gpus", None), by=by, launcher=args.launcher)
    flow_options = {"cluster": cluster, "max_restarts": args.max_restarts, "hang_timeout_s": args.hang_timeout,
                    "drill_faults": args.drill or None, "launcher": args.launcher, "priority": args.priority}
    return submitted, flow_options


def _submit(args: argparse.Namespace) -> int:
    from infra.statedb.url import DB_URL_ENV
    from scheduler.orchestrator.identity import TEAM_ENV

    # --db and --team hold for this submission (the orchestrator's submit and the runner, a
    # child of this process, read them from the environment), not for whatever this process
    # does next (the CLI called in-process, as tests and scripts do)
    given = {DB_URL_ENV: args.db, TEAM_ENV: args.team}
    saved = {name: os.environ.get(name) for name, value in given.items() if value}
    os.environ.update({name: value for name, value in given.items() if value})
    try:
        return _submit_now(args)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _submit_now(args: argparse.Namespace) -> int:
    from infra.statedb import read_transaction
    from scheduler.orchestrator.identity import submit_team
    from scheduler.orchestrator.seat import cluster_orchestrator

    orch = cluster_orchestrator()
    with read_transaction(orch.engine) as conn:  # an unknown team, a role in none: one line, before
        submit_team(conn, orch.identity, args.team)  # anything is planned or registered
    submitted, flow_options = queue_from_args(args, by="forgeflow submit")
    job_id, spec = submitted.job_id, submitted.spec
    orch = cluster_orchestrator()
    try:
        if os.environ.get("PREFECT_API_URL"):  # a team's job waits in its team's work queue
            runner = start_prefect_run(job_id, spec, flow_options, work_queue=team_work_queue(orch.job(job_id)["team"]))
        else:
            runner = start_local_runner(job_id, spec, flow_options)
    except BaseException as e:
        orch.cancel(job_id, reason=f"its runner could not start: {type(e).__name__}: {e}"[:500])
        raise
    orch.set_runner(job_id, runner)
    job = orch.job(job_id)
    position, length = orch.queue_position(job_id)
    out = {"job_id": job_id, "name": spec.name, "cluster": submitted.cluster, "state": job["state"],
           "position": position, "queue_length": length, "run_dir": spec.run_dir,
           "checkpoints": spec.checkpoint.url, "runner": runner}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    where = (f"position {position} of {length} in the queue" if job["state"] == "queued" else
             "handed to Slurm, which decides where and when it runs (it holds no GPUs here)"
             if job["state"] == "delegated" else
             f"admitted: {job['placement']['world_size']}x {job['placement']['gpu_type']}")
    by = (f"flow run {runner['flow_run_id']}" + (f" ({runner['url']})" if runner.get("url") else "")
          if runner["kind"] == "prefect" else f"a runner on {runner['host']} (pid {runner['pid']}, log {runner['log']})")
    print(f"job {job_id} ({spec.name}) submitted: {where}; runs as {by}\n"
          f"  run directory {spec.run_dir}, checkpoints {spec.checkpoint.url}\n"
          f"  forgeflow jobs | forgeflow logs {job_id} --follow | forgeflow cancel {job_id}")
    return 0


def start_local_runner(job_id: int, spec, flow_options: dict) -> dict:
    """Start `flows.job_runner` for the job, detached: its own session (no hang-up when the
    terminal closes), stdin closed, output into `<run dir>/runner.log`. What `forgeflow jobs`
    and `forgeflow logs` need to find it is returned (recorded with the job)."""
    log = (spec.resolved_run_dir / RUNNER_LOG).resolve()
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "flows.job_runner", str(job_id), "--cluster", flow_options["cluster"],
           "--launcher", flow_options["launcher"], "--max-restarts", str(flow_options["max_restarts"]),
           "--hang-timeout", str(flow_options["hang_timeout_s"])]
    for drill in flow_options["drill_faults"] or []:
        cmd += ["--drill", drill]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True, cwd=os.getcwd())
    return {"kind": "local", "host": socket.gethostname(), "pid": proc.pid, "log": str(log), "cwd": os.getcwd()}


def team_work_queue(team: str | None) -> str | None:
    """The work queue a team's flow runs go to (`team-NAME`, in the deployment's pool): its worker
    holds that team's database credentials (README, "Teams: identity"). None: the deployment's own."""
    return None if team is None else f"team-{team}"


def start_prefect_run(job_id: int, spec, flow_options: dict, *, work_queue: str | None = None) -> dict:
    """A flow run of the `pretrain` deployment for the job, named after it; the spec travels as
    its content; `work_queue`: the queue it waits in (a team's, else the deployment's). A server
    without the deployment is one clear error (`forgeflow deploy`)."""
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    from infra.notify import flow_run_url
    from training.config import ConfigError

    parameters = {"job_spec": spec.model_dump(mode="json"), "job_id": job_id, **flow_options}
    try:
        run = run_deployment("pretrain/pretrain", parameters=parameters, timeout=0,
                             flow_run_name=f"{spec.name}-{job_id}", tags=[f"job-{job_id}"],
                             work_queue_name=work_queue)
    except ObjectNotFound:
        raise ConfigError(f"the Prefect server at {os.environ['PREFECT_API_URL']} has no deployment "
                          "'pretrain/pretrain'; run `forgeflow deploy` against it first (or unset "
                          "PREFECT_API_URL to run the job on this machine)") from None
    runner = {"kind": "prefect", "flow_run_id": str(run.id)}
    link = flow_run_url(run.id)
    if link:
        runner["url"] = link
    return runner
