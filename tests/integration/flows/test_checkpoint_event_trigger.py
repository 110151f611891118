"""The on-commit evaluation gets the checkpoint (a typed reference) and the job spec from the
checkpoint event itself, not a path.

The pretrain flow announces each committed checkpoint (tasks.checkpoint_events); the
`evaluate-checkpoint/on-commit` deployment, deployed from prefect.yaml by `forgeflow deploy`,
is triggered by it. The evaluation may run on a machine without the job's YAML file, so the
event carries the validated spec as content and the trigger hands it over as `job_spec`. No
worker serves the run here: the test reads what the server created, then deletes it.
"""

from __future__ import annotations

from pathlib import Path

from checkpoint.manifest import CheckpointRef
from tests.integration.flows.test_prefect_deployments import deployed_once, triggered_runs  # noqa: F401 (fixture)
from training.config import load_job_spec, parse_job_spec

REPO = Path(__file__).resolve().parents[3]


def test_the_checkpoint_event_hands_the_spec_itself_to_the_evaluation(deployed_once, tmp_path):  # noqa: F811
    from prefect import get_client

    from tasks.checkpoint_events import emit_checkpoint_committed

    spec = load_job_spec(REPO / "configs" / "tiny-cpu.yaml")
    ref = CheckpointRef(str(tmp_path / "ckpt"), 20)
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("evaluate-checkpoint/on-commit")
        emit_checkpoint_committed(ref, spec)
        runs: list = []
        try:
            runs = triggered_runs(client, deployment.id, lambda r: r.parameters.get("checkpoint") == ref.to_dict())
            assert len(runs) == 1, "the checkpoint event did not trigger one on-commit run"
            assert CheckpointRef.from_dict(runs[0].parameters["checkpoint"]) == ref   # root, step, format
            given = runs[0].parameters["job_spec"]
            assert given == spec.model_dump(mode="json")      # the spec itself, as JSON
            assert parse_job_spec(given) == spec               # and it validates back to the same spec
        finally:
            for run in runs:
                client.delete_flow_run(run.id)
