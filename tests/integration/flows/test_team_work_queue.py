"""A team's job waits in its team's work queue (issue 30): `forgeflow submit` with PREFECT_API_URL
puts the pretrain run of a job with a team in `team-NAME` of the deployment's pool, where only the
worker holding that team's database credentials picks it up; a job without a team stays in the
deployment's own queue. Against a real Prefect server (no worker: the runs only wait)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from flows.submit import start_prefect_run, team_work_queue
from training.config import load_job_spec

REPO = Path(__file__).resolve().parents[3]


async def _deploy_pretrain(pool: str) -> None:
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    async with get_client() as client:
        await client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        flow_id = await client.create_flow_from_name("pretrain")
        await client.create_deployment(flow_id=flow_id, name="pretrain", work_pool_name=pool,
                                       entrypoint="flows/pretrain.py:pretrain")


async def _queue_of(flow_run_id: str) -> tuple[str, str]:
    from prefect import get_client

    async with get_client() as client:
        run = await client.read_flow_run(uuid.UUID(flow_run_id))
        pool = (await client.read_deployment(run.deployment_id)).work_pool_name
    return run.work_queue_name, pool


def test_a_teams_run_waits_in_its_teams_queue(use_prefect_server):
    pool = f"teams-{uuid.uuid4().hex[:6]}"
    asyncio.run(_deploy_pretrain(pool))
    spec = load_job_spec(REPO / "configs" / "tiny-cpu.yaml")
    team_run = start_prefect_run(101, spec, {}, work_queue=team_work_queue("research"))
    plain_run = start_prefect_run(102, spec, {}, work_queue=team_work_queue(None))
    assert asyncio.run(_queue_of(team_run["flow_run_id"])) == ("team-research", pool)
    assert asyncio.run(_queue_of(plain_run["flow_run_id"])) == ("default", pool)
