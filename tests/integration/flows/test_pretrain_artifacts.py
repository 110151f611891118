"""What the pretrain flow shows in the Prefect UI while it queues and trains, on a real Prefect
API: the ranked plans (the peak `forgeflow plan` shows, the need with the safety margin, and
after admission the admitted plan marked), and the progress artifact's "step N of M (P%)"."""

from __future__ import annotations

import json
import subprocess
import sys

CLUSTER = "configs/clusters/frenzy-testbed.yaml"


def _artifacts(key: str, description_has: str) -> list:
    """Every version of artifact `key` whose description names `description_has`, oldest first."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    return sorted((a for a in found if description_has in (a.description or "")), key=lambda a: a.created)


def _table(artifact) -> list[dict]:
    return json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data


def test_plans_show_the_peak_forgeflow_plan_shows_and_mark_the_admitted_one(prefect_api, make_job, tmp_path,
                                                                            repo_root):
    from scheduler.cluster import load_cluster
    from scheduler.orchestrator.seat import cluster_orchestrator, plan_and_submit, sync_inventory
    from tasks.cluster_tasks import publish_plans, wait_for_gpus
    from training.config import load_job_spec

    job = make_job("plans-artifact")
    spec = load_job_spec(job)
    orch = cluster_orchestrator(f"sqlite:///{tmp_path / 'state.db'}")
    inventory = load_cluster(repo_root / CLUSTER)
    sync_inventory(orch, inventory)
    submitted = plan_and_submit(orch, spec, inventory.name)
    publish_plans(spec.name, inventory.name, submitted.plans)  # what the submit-job task publishes
    placement = wait_for_gpus(orch, submitted.job_id, submitted.plans, spec.name, poll_s=0.2)

    shown = subprocess.run([sys.executable, "-m", "flows.cli", "plan", str(job), "--cluster", CLUSTER, "--json",
                            "--top", "10"], cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr
    cli_plans = json.loads(shown.stdout)["plans"]

    at_submit, admitted = (_table(a) for a in _artifacts("pretrain-plans", "plans-artifact"))
    assert [r["peak_gib"] for r in at_submit] == [round(p["peak_memory_gib"], 2) for p in cli_plans]
    assert all(r["needs_gib"] > r["peak_gib"] for r in at_submit)  # the safety margin on top
    assert {r["chosen"] for r in at_submit} == {""}  # nothing admitted yet
    chosen = [r for r in admitted if r["chosen"] == "✓"]
    assert len(chosen) == 1 and all(r["chosen"] in ("", "✓") for r in admitted)
    assert (chosen[0]["gpu_type"], chosen[0]["gpus"], chosen[0]["layout"]) == (
        placement.gpu_type, placement.world_size, placement.plan.layout)


def test_the_progress_card_says_step_and_percent(prefect_api):
    from prefect.artifacts import create_progress_artifact

    from tasks.pretrain_tasks import report_progress

    artifact_id = create_progress_artifact(0.0, description="progress-card-test: training progress")
    report_progress(artifact_id, "progress-card-test", 30, 40)
    (card,) = _artifacts_by_id(artifact_id)
    assert card.data == 75.0 and card.description == "progress-card-test: step 30 of 40 (75%)"


def _artifacts_by_id(artifact_id) -> list:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterId

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(id=ArtifactFilterId(any_=[artifact_id])))
