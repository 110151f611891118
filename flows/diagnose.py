"""The `diagnose-failure` flow: diagnose a failed job's log wherever it lives.

    fetch the log (path, file:// or s3:// URL)  →  rules  →  failure agent if no rule knows it
        →  diagnosis artifact  →  Slack alert (optional)

The pretrain flow diagnoses its own attempts; this deployment is for everything
else: a job some other launcher ran, a log a person wants a second opinion on.

The job family (whose learned rules apply, and for which the failure agent proposes what it
learns) is the name of the job whose run directory holds the log, from the orchestrator's
record: never a parameter, so a flow run cannot propose a rule for another job's family. A log
fetched from S3 belongs to no recorded job: it is diagnosed for no family (the agent's rule is
proposed for none, and on PostgreSQL only an operator's role may store that; issue 29).

Run it without a server:  python -m flows.diagnose LOG_URL
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from infra.storage import StorageOptions, open_storage
from infra.untrusted_text import fenced, printable


def _is_local(log_url: str) -> bool:
    return "://" not in log_url or log_url.startswith("file://")


def _retry_may_help(task, task_run, state) -> bool:
    """A fetch is retried through a storage or network blip, not after a refusal (PermissionError)
    or a missing log (FileNotFoundError): the same parameters get the same answer 5 s later."""
    try:
        state.result()
    except (PermissionError, FileNotFoundError):
        return False
    except BaseException:
        return True
    return True


@task(name="fetch-log", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5, retry_condition_fn=_retry_may_help)
def fetch_log(log_url: str, work_dir: str, endpoint_url: str | None = None) -> Path:
    """A local copy of the log (a local path is used where it is, if it is a job's: a flow-run
    parameter must not make a worker read, and post to Slack, any file it can read)."""
    if _is_local(log_url):
        path = Path(log_url.removeprefix("file://"))
        if not path.is_file():
            raise FileNotFoundError(f"no log file at {log_url}: give a path, file:// or s3:// URL of the log")
        if log_family(log_url) is None:
            raise PermissionError(f"refusing to read {log_url}: it is in no job's run directory (this flow reads "
                                  "job logs only; on your own machine `forgeflow diagnose FILE` reads any file)")
        return path
    # an object-store log is a job's too: under its checkpoint prefix, fetched from the endpoint
    # its spec names (a parameter must not point the worker's credentials at any bucket or host)
    from evalsuite import job_scope
    from scheduler.orchestrator.seat import cluster_orchestrator

    scope = job_scope.job_storing(cluster_orchestrator().engine, log_url)
    if scope is None:
        raise PermissionError(f"refusing to fetch {log_url}: it is under no job's checkpoint prefix (this flow reads "
                              "job logs only; on your own machine `forgeflow diagnose FILE` reads any file)")
    if endpoint_url not in (None, "", scope.spec.checkpoint.endpoint_url):
        raise PermissionError(f"refusing endpoint_url {endpoint_url}: job {scope.job_id}'s checkpoints are at "
                              f"{scope.spec.checkpoint.endpoint_url or 'AWS S3'}; leave endpoint_url unset")
    root, _, key = log_url.rstrip("/").rpartition("/")
    target = Path(work_dir) / Path(key).name
    open_storage(root, StorageOptions(endpoint_url=scope.spec.checkpoint.endpoint_url,
                                      region=scope.spec.checkpoint.region)).get_file(key, target)
    return target


def log_family(log_url: str) -> str | None:
    """The job family of a local log: the name of the job whose run directory holds it (symlinks
    resolved), from the orchestrator's record; None for a file of no job or an S3 log."""
    if not _is_local(log_url):
        return None
    from scheduler.orchestrator.job_logs import owning_job
    from scheduler.orchestrator.seat import cluster_orchestrator

    orchestrator = cluster_orchestrator()
    job_id = owning_job(orchestrator.engine, Path(log_url.removeprefix("file://")))
    return None if job_id is None else orchestrator.job(job_id)["name"]


@task(name="diagnose-log", cache_policy=NO_CACHE)
def diagnose(path: Path, job_family: str | None):
    from diagnosis.agents import build_default_agent
    from diagnosis.api import diagnose_log

    return diagnose_log(path, job_family=job_family, agent=build_default_agent(job_family=job_family))


@flow(name="diagnose-failure", log_prints=True)
def diagnose_failure(log_url: str, alert: bool = False, endpoint_url: str | None = None) -> dict:
    """Diagnose one failed job's log: root cause, kind, whether a restart helps, evidence.

    Args:
        log_url: the log: a path, file:///path (in a job's run directory: that job's name is the
            family whose learned rules apply) or s3://bucket/key under a job's checkpoint prefix
            (no family).
        alert: also send the diagnosis to Slack (the Slack webhook block `forgeflow deploy` set up, or SLACK_WEBHOOK_URL).
        endpoint_url: leave unset: an S3 log is fetched from the endpoint its job's spec names
            (a different one is refused).
    """
    with tempfile.TemporaryDirectory(prefix="forgeflow-diagnose-") as work:
        path = fetch_log(log_url, work, endpoint_url)
        job_family = log_family(log_url)   # the job's record, never a parameter
        diagnosis = diagnose(path, job_family)
    evidence = "\n".join(printable(line) for line in diagnosis.culprit_lines[:10])
    create_markdown_artifact(
        key="diagnosis",
        markdown=(f"## Diagnosis of `{log_url}`\n\n| root cause | kind | restart helps | confidence | source |\n"
                  f"|---|---|---|---|---|\n| {diagnosis.root_cause} | {diagnosis.kind} | {diagnosis.restart_helps} "
                  f"| {diagnosis.confidence:.2f} | {diagnosis.source} |\n\n**Mitigation:** {printable(diagnosis.mitigation)}\n\n"
                  + fenced(evidence)),
        description=f"{diagnosis.root_cause} in {log_url}",
    )
    if alert:
        from diagnosis.slack_format import to_alert
        from tasks.pretrain_tasks import build_notifier

        build_notifier().send(to_alert(diagnosis, job_family or log_url, "diagnosed on request; no action taken"))
    print(json.dumps(diagnosis.to_dict(), indent=2))
    return diagnosis.to_dict()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    diagnose_failure(sys.argv[1])
