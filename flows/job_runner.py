"""The detached runner of a job `forgeflow submit` queued on the embedded default (no Prefect
server): it takes the job up in the state database and runs its whole `pretrain` flow.

    python -m flows.job_runner JOB_ID [--cluster C] [--launcher L] [--max-restarts N] ...

`forgeflow submit` starts it in its own session with its output in `<run dir>/runner.log`;
it needs nothing from the submitter but the job id: the spec is the one recorded with the
job (its content, paths filled in for the job). Exit status: 0 when the job finished, 1 when
it stopped or failed, 2 when the job cannot be run (unknown, or already ended).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

START_LOCK = ".forgeflow-temporary-server.lock"  # in PREFECT_HOME


def start_temporary_server() -> None:
    """Without a Prefect server configured, start this process's temporary one now, one runner of
    a Prefect home at a time (an exclusive lock in PREFECT_HOME until it answers). On a fresh home
    it migrates the home's database first: two runners started together (two `forgeflow submit`s
    in a row) migrated it at once, and the loser's server failed to start ("duplicate column
    name", a traceback in runner.log) and was started again, seconds later. The flow then uses
    the server started here (Prefect keeps one per process)."""
    import fcntl

    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return
    from prefect.server.api.server import SubprocessASGIServer

    home = Path(PREFECT_HOME.value()).expanduser()
    home.mkdir(parents=True, exist_ok=True)
    with open(home / START_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        SubprocessASGIServer().start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flows.job_runner", description=__doc__.split("\n\n")[0])
    p.add_argument("job_id", type=int)
    p.add_argument("--cluster", default="local")
    p.add_argument("--launcher", default="local")
    p.add_argument("--max-restarts", type=int, default=5)
    p.add_argument("--hang-timeout", type=float, default=300.0)
    p.add_argument("--drill", action="append", default=[])
    args = p.parse_args(argv)

    from flows.cli import temporary_server_defaults
    from infra.statedb.retry import StateDbRetry
    from scheduler.orchestrator import OrchestratorError
    from scheduler.orchestrator.seat import cluster_orchestrator

    temporary_server_defaults()
    try:  # a runner started during a database outage waits it out (logged) instead of failing
        job = StateDbRetry().call(lambda: cluster_orchestrator().job(args.job_id), f"runner of job {args.job_id} starting")
    except OrchestratorError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if job["state"] not in ("queued", "running", "delegated"):  # delegated: in a site's Slurm (issue 32)
        print(f"error: job {args.job_id} ({job['name']}) is {job['state']}: nothing to run", file=sys.stderr)
        return 2

    from flows.pretrain import pretrain

    start_temporary_server()
    print(f"runner of job {args.job_id} ({job['name']}): running the pretrain flow", flush=True)
    result = pretrain.with_options(flow_run_name=f"{job['name']}-{args.job_id}")(
        job_spec=job["spec"], cluster=args.cluster, job_id=args.job_id, launcher=args.launcher,
        max_restarts=args.max_restarts, hang_timeout_s=args.hang_timeout, drill_faults=args.drill or None)
    print(f"job {args.job_id} ({job['name']}): " + ("finished" if result.finished else
          f"stopped: {result.stopped_because}") + f" (last step {result.final_step})", flush=True)
    return 0 if result.finished else 1


if __name__ == "__main__":
    sys.exit(main())
