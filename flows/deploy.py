"""`forgeflow deploy`: put forgeflow on a Prefect server, idempotently.

On the server PREFECT_API_URL points at, it creates or updates
  1. the process work pool the deployments run on;
  2. the cluster inventory, registered with the orchestrator (`scheduler.orchestrator`,
     state in FORGEFLOW_DB_URL, else SQLite in the state dir): pretrain flows queue
     there and are admitted onto GPUs nobody holds, so two flows are never placed onto
     the same GPUs (no Prefect concurrency limit is involved);
  3. the deployments of prefect.yaml (pretrain, node-launch, diagnose-failure,
     release-cancelled, evaluate on-commit and catch-up), by running `prefect deploy --all`;
  4. the Slack webhook block (prefect-slack's `SlackWebhook`): a team's existing block
     named with --slack-block, else `forgeflow-slack` made from SLACK_WEBHOOK_URL; its
     name is kept in the Prefect Variable `forgeflow_slack_block`, so flow alerts and
     the automation post through the same block (one place for the webhook secret);
  5. the automation that alerts Slack through that block when a pretrain flow run
     crashes or its heartbeat stops (workers emit heartbeats when started with
     PREFECT_RUNNER_HEARTBEAT_FREQUENCY=30).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

from infra.yaml_config import report_error

ROOT = Path(__file__).resolve().parent.parent
AUTOMATION_NAME = "forgeflow: pretrain crashed or silent"
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
    from scheduler.orchestrator.seat import cluster_orchestrator
    from scheduler.cluster import load_inventory

    # a file by its absolute path: `forgeflow submit` with no --cluster places on it
    source = cluster_source if cluster_source in ("", "local") else str(Path(cluster_source).resolve())
    summary = cluster_orchestrator().register(load_inventory(cluster_source), source=source)
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


def ensure_slack_block(reuse: str | None = None):
    """The Slack webhook block flows and the automation post through, or None (no Slack).

    `reuse`: the name of a team's existing Slack webhook block, used as it is. Otherwise
    `forgeflow-slack`, created (or updated) from SLACK_WEBHOOK_URL, or kept as the
    server already holds it. The chosen name goes into the `forgeflow_slack_block`
    Variable, which the flows' notifier reads. Returns (name, block document id).
    """
    from prefect.variables import Variable
    from prefect_slack import SlackWebhook

    from infra.notify import DEFAULT_SLACK_BLOCK, SLACK_BLOCK_VARIABLE

    if reuse:
        try:
            block = SlackWebhook.load(reuse)
        except ValueError:
            raise DeployError(
                f"--slack-block {reuse!r}: no Slack webhook block of that name on the server; create it in "
                "the Prefect UI (Blocks > Slack Incoming Webhook) or leave --slack-block out to create "
                f"{DEFAULT_SLACK_BLOCK!r} from SLACK_WEBHOOK_URL"
            ) from None
        name, block_id = reuse, block._block_document_id
        print(f"Slack: reusing the Slack webhook block {reuse!r}")
    elif os.environ.get("SLACK_WEBHOOK_URL"):
        name = DEFAULT_SLACK_BLOCK
        block_id = SlackWebhook(url=os.environ["SLACK_WEBHOOK_URL"]).save(name, overwrite=True)
        print(f"Slack: webhook block {name!r} saved from SLACK_WEBHOOK_URL (workers no longer need the variable)")
    else:
        name = DEFAULT_SLACK_BLOCK
        try:
            block_id = SlackWebhook.load(name)._block_document_id
        except ValueError:
            print("Slack: no webhook configured (set SLACK_WEBHOOK_URL or pass --slack-block NAME): "
                  "alerts are printed and kept as artifacts, no automation")
            return None
        print(f"Slack: keeping the existing webhook block {name!r}")
    Variable.set(SLACK_BLOCK_VARIABLE, name, overwrite=True)
    return name, block_id


class DeployError(RuntimeError):
    """`forgeflow deploy` cannot go on; the message says what to fix."""


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


def ensure_automation(slack_block_id) -> bool:
    """(Re)create the automation notifying through the Slack webhook block; without one
    there is nobody to alert, so none."""
    from prefect.automations import Automation

    if slack_block_id is None:
        print("automation not created: no Slack webhook block")
        return False
    block_id = slack_block_id
    try:
        Automation.read(name=AUTOMATION_NAME).delete()
    except ValueError:  # none yet
        pass
    build_automation(block_id).create()
    print(f"automation {AUTOMATION_NAME!r} created")
    return True


def deploy_all(cluster: str = "local", pool: str = "forgeflow", pool_type: str = "process",
               slack_block: str | None = None, as_json: bool = False) -> int:
    """Everything above, in order. With `as_json` the progress lines go to stderr and
    stdout gets one JSON object: what exists on the server now."""
    if not os.environ.get("PREFECT_API_URL"):
        message = ("PREFECT_API_URL is not set: start a server (`prefect server start`) and point PREFECT_API_URL "
                   "at it (e.g. http://127.0.0.1:4200/api); deployments need a server to live on")
        return report_error(message, as_json)
    try:
        with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
            ensure_work_pool(pool, pool_type)
            registered = ensure_cluster_registered(cluster)
            deploy_prefect_yaml(pool)
            slack = ensure_slack_block(slack_block)
            automation = ensure_automation(slack[1] if slack else None)
            print(f"next: `prefect worker start --pool {pool} --work-queue default` for the flows, and on "
                  f"every GPU node `prefect worker start --pool {pool} --work-queue NODE_NAME` (with "
                  "PREFECT_RUNNER_HEARTBEAT_FREQUENCY=30 so the automation sees heartbeats)")
    except DeployError as e:
        return report_error(e, as_json)
    if as_json:
        print(json.dumps({
            "pool": pool, "pool_type": pool_type, "deployments": deployment_names(),
            "cluster": {k: registered[k] for k in ("cluster", "nodes", "gpus") if k in registered},
            "slack_block": slack[0] if slack else None,
            "automation": AUTOMATION_NAME if automation else None,
        }))
    return 0


def deployment_names() -> list[str]:
    """'flow/deployment' for every deployment on the server, sorted."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        flows = {f.id: f.name for f in client.read_flows()}
        return sorted(f"{flows.get(d.flow_id, '?')}/{d.name}" for d in client.read_deployments())
