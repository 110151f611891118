"""`forgeflow deploy`: put forgeflow on a Prefect server, idempotently.

On the server PREFECT_API_URL points at, it creates or updates
  1. the process work pool the deployments run on;
  2. the cluster inventory, registered with the orchestrator (`scheduler.orchestrator`,
     state in FORGEFLOW_DB_URL, else SQLite in the state dir): pretrain flows queue
     there and are admitted onto GPUs nobody holds, so two flows are never placed onto
     the same GPUs (no Prefect concurrency limit is involved);
  3. the deployments of prefect.yaml (pretrain, node-launch, diagnose-failure,
     evaluate on-commit and catch-up), by running `prefect deploy --all`;
  4. the automation that alerts Slack when a pretrain flow run crashes or its
     heartbeat stops (workers emit heartbeats when started with
     PREFECT_RUNNER_HEARTBEAT_FREQUENCY=30).
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
AUTOMATION_NAME = "forgeflow: pretrain crashed or silent"
WEBHOOK_BLOCK_NAME = "forgeflow-slack"
HEARTBEAT_SILENCE_S = 120  # three missed heartbeats at a 30 s frequency


def ensure_work_pool(pool: str, pool_type: str = "process") -> None:
    """A `process` pool (workers on the machines), or a `kubernetes` pool whose base job
    template (infra.kubernetes.prefect_base_job_template) runs each flow run as a Job."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectAlreadyExists

    if pool_type not in ("process", "kubernetes"):
        raise ValueError(f"unknown pool type {pool_type!r}: use 'process' or 'kubernetes'")
    template: dict = {}
    if pool_type == "kubernetes":
        from infra.kubernetes import prefect_base_job_template

        template = prefect_base_job_template()
    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=pool, type=pool_type, base_job_template=template))
            print(f"work pool {pool!r} created (type {pool_type})")
        except ObjectAlreadyExists:
            existing = client.read_work_pool(pool)
            if existing.type != pool_type:
                raise RuntimeError(f"work pool {pool!r} exists with type {existing.type!r}, not {pool_type!r}: "
                                   "choose another --pool name or delete it (`prefect work-pool delete`)") from None
            if template:
                client.update_work_pool(pool, WorkPoolUpdate(base_job_template=template))
            print(f"work pool {pool!r} exists (type {pool_type})")


def ensure_cluster_registered(cluster_source: str) -> dict:
    """Register (or update) the inventory with the orchestrator; node health already there is kept."""
    from infra.statedb import database_url, redact
    from tasks.cluster_tasks import cluster_orchestrator
    from tasks.pretrain_tasks import load_cluster

    summary = cluster_orchestrator().register(load_cluster(cluster_source), source=cluster_source)
    print(f"cluster {summary['cluster']!r} registered with the orchestrator: {summary['nodes']} nodes, "
          f"{summary['gpus']} GPUs (state database {redact(database_url())})")
    return summary


def deploy_prefect_yaml(pool: str) -> None:
    env = dict(os.environ, FORGEFLOW_ROOT=str(ROOT), FORGEFLOW_POOL=pool)
    command = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all", "--prefect-file",
               str(ROOT / "prefect.yaml")]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"`prefect deploy --all` failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    print("deployments from prefect.yaml created")


def _is_private(url: str) -> bool:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_private or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_automation(webhook_block_id):
    """Crashed, or no heartbeat for HEARTBEAT_SILENCE_S while running → a Slack message."""
    from prefect.automations import Automation, CompoundTrigger, EventTrigger, Posture, SendNotification

    pretrain_flow = {"prefect.resource.role": "flow", "prefect.resource.name": "pretrain"}
    crashed = EventTrigger(expect={"prefect.flow-run.Crashed"}, match={"prefect.resource.id": "prefect.flow-run.*"},
                           match_related=pretrain_flow, posture=Posture.Reactive, threshold=1)
    silent = EventTrigger(
        after={"prefect.flow-run.heartbeat"},
        expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"},
        match={"prefect.resource.id": "prefect.flow-run.*"}, match_related=pretrain_flow,
        for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1,
        within=timedelta(seconds=HEARTBEAT_SILENCE_S),
    )
    return Automation(
        name=AUTOMATION_NAME,
        description="Alert when a pretrain flow run crashes or stops heartbeating (its process died or hangs).",
        trigger=CompoundTrigger(require="any", triggers=[crashed, silent], within=None),
        actions=[SendNotification(
            block_document_id=webhook_block_id,
            subject="forgeflow: pretrain flow run needs attention",
            body=("Flow run {{ flow_run.name }} ({{ flow_run.id }}) of deployment "
                  "{{ deployment.name if deployment else 'none' }}: {{ event.event }} "
                  "(state {{ flow_run.state.name }}). Crashed means the flow process died; "
                  "a missing heartbeat means it stopped answering."),
        )],
    )


def ensure_automation() -> bool:
    """(Re)create the automation; without a webhook there is nobody to alert, so none."""
    from prefect.automations import Automation
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    from tasks.pretrain_tasks import slack_webhook_url

    url = slack_webhook_url()
    if not url:
        print("automation not created: set SLACK_WEBHOOK_URL or the `slack-webhook-url` Secret block first")
        return False
    # Slack's incoming-webhook payload; the URL (which is the credential) is kept as a block secret.
    block = CustomWebhookNotificationBlock(
        name="forgeflow", url="{{webhook_url}}", method="POST", json_data={"text": "*{{subject}}*\n{{body}}"},
        secrets={"webhook_url": url}, allow_private_urls=_is_private(url),
    )
    block_id = block.save(WEBHOOK_BLOCK_NAME, overwrite=True)
    try:
        Automation.read(name=AUTOMATION_NAME).delete()
    except ValueError:  # none yet
        pass
    build_automation(block_id).create()
    print(f"automation {AUTOMATION_NAME!r} created")
    return True


def deploy_all(cluster: str = "local", pool: str = "forgeflow", pool_type: str = "process") -> int:
    if not os.environ.get("PREFECT_API_URL"):
        print("PREFECT_API_URL is not set: start a server (`prefect server start`) and point PREFECT_API_URL "
              "at it (e.g. http://127.0.0.1:4200/api); deployments need a server to live on")
        return 2
    ensure_work_pool(pool, pool_type)
    ensure_cluster_registered(cluster)
    deploy_prefect_yaml(pool)
    ensure_automation()
    print(f"next: `prefect worker start --pool {pool} --work-queue default` for the flows, and on every GPU "
          f"node `prefect worker start --pool {pool} --work-queue NODE_NAME` (with "
          "PREFECT_RUNNER_HEARTBEAT_FREQUENCY=30 so the automation sees heartbeats)")
    return 0
