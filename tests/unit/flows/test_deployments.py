"""The evaluation deployments as `forgeflow deploy` creates them: read from prefect.yaml."""

from __future__ import annotations

import inspect
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]


def _deployments() -> dict[str, dict]:
    config = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    return {d["name"]: d for d in config["deployments"]}


def _flow(entrypoint: str):
    from prefect.flows import load_flow_from_entrypoint

    return load_flow_from_entrypoint(str(ROOT / entrypoint))


def test_on_commit_is_triggered_by_checkpoint_committed_events():
    from prefect.events import DeploymentEventTrigger

    from tasks.checkpoint_events import CHECKPOINT_COMMITTED

    on_commit = _deployments()["on-commit"]
    flow = _flow(on_commit["entrypoint"])
    assert flow.name == "evaluate-checkpoint"
    (raw,) = on_commit["triggers"]
    assert raw.pop("type") == "event"
    trigger = DeploymentEventTrigger.model_validate(raw)   # what `prefect deploy` builds from it
    assert trigger.expect == {CHECKPOINT_COMMITTED} == {"forgeflow.checkpoint.committed"}
    assert trigger.match.model_dump()["prefect.resource.id"] == "forgeflow.checkpoint.*"
    assert trigger.parameters["checkpoint"] == "{{ event.payload.checkpoint }}"   # the typed reference
    # Every parameter the deployment or its trigger passes is one the flow takes.
    accepted = set(inspect.signature(flow.fn).parameters)
    assert set(on_commit.get("parameters", {})) | set(trigger.parameters) <= accepted


def test_catch_up_runs_every_15_minutes_over_the_registered_jobs():
    catch_up = _deployments()["catch-up"]
    flow = _flow(catch_up["entrypoint"])
    assert flow.name == "evaluate-catch-up"
    assert [s["interval"] for s in catch_up["schedules"]] == [900]
    # No job hard-wired: the flow evaluates every job registered for evaluation.
    assert "job_spec" not in catch_up.get("parameters", {})
    assert set(catch_up.get("parameters", {})) <= set(inspect.signature(flow.fn).parameters)
    assert inspect.signature(flow.fn).parameters["job_spec"].default is None


def test_evaluation_deployments_are_defined_only_in_prefect_yaml():
    import flows.evaluate as evaluate

    assert not [name for name in dir(evaluate) if "deployment" in name.lower()]
    for name in ("on-commit", "catch-up"):
        assert _deployments()[name]["entrypoint"].startswith("flows/evaluate.py:")
