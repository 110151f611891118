"""The `release-cancelled-job` flow: a submitted job whose flow run was cancelled in Prefect leaves the queue.

`forgeflow submit` queues the job with the orchestrator, then creates its `pretrain` flow run.
Cancelled in the Prefect UI (or through the API) before a worker started it, that run never
runs the flow that would end the job: the job stayed queued, was admitted, held its GPUs until
its lease ran out, and was queued again, up to `max_requeues` times. The `release-cancelled`
deployment (prefect.yaml) is triggered by every cancelled flow run of `pretrain`; this flow
finds the job that run was to run (`Orchestrator.job_run_by`) and does what `forgeflow cancel`
does (`request_stop`): a queued job leaves the queue at once, a running one is asked to stop.

The parameter is only a flow run's id, and a flow run may be created with any: nothing is
released unless Prefect says that run is cancelled and it carries the job's tag (`job-ID`,
which submit gives it) — a cancelled run of another job, or a live one, releases nothing.
"""

from __future__ import annotations

from prefect import flow, get_run_logger

RESOURCE_PREFIX = "prefect.flow-run."


@flow(name="release-cancelled-job", log_prints=False)
def release_cancelled_job(flow_run: str) -> int | None:
    """Release the job the cancelled flow run `flow_run` (its id, or the event's resource id
    `prefect.flow-run.ID`) was to run; returns its id, or None when there is nothing to release."""
    from uuid import UUID

    from prefect import get_client

    from scheduler.orchestrator.seat import cluster_orchestrator

    logger = get_run_logger()
    run_id = flow_run.removeprefix(RESOURCE_PREFIX)
    try:
        UUID(run_id)
    except ValueError:
        raise ValueError(f"flow_run={flow_run!r} is not a flow run id (a UUID, or prefect.flow-run.UUID)") from None
    orch = cluster_orchestrator()
    job_id = orch.job_run_by(run_id)
    if job_id is None:
        logger.info("no queued or running job is run by flow run %s: nothing to release", run_id)
        return None
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(UUID(run_id))
    if run.state is None or not run.state.is_cancelled() or f"job-{job_id}" not in (run.tags or []):
        logger.warning("flow run %s (%s) is not a cancelled run of job %s: job left as it is", run_id,
                       run.state.name if run.state else "no state", job_id)
        return None
    was = orch.request_stop(job_id, f"its flow run {run.name} was cancelled in Prefect", by="Prefect cancellation")
    logger.info("job %s (%s): %s", job_id, "taken out of the queue" if was == "queued"
                else "asked to stop; it ends cancelled", f"flow run {run.name} was cancelled")
    return job_id
