from __future__ import annotations


def test_deployments_trigger_on_commit_events_and_catch_up_on_a_schedule():
    from flows.evaluate import CHECKPOINT_COMMITTED, build_deployments

    on_commit, catch_up = build_deployments(job_spec="configs/tiny-cpu.yaml", suite="quick")
    assert on_commit.name == "on-commit" and on_commit.flow_name == "evaluate-checkpoint"
    (trigger,) = on_commit.triggers
    assert trigger.expect == {CHECKPOINT_COMMITTED} == {"forgeflow.checkpoint.committed"}
    assert trigger.match.model_dump()["prefect.resource.id"] == "forgeflow.checkpoint.*"
    assert "forgeflow.checkpoint.url" in trigger.parameters["checkpoint"]
    assert catch_up.flow_name == "evaluate-catch-up"
    assert catch_up.schedules and catch_up.schedules[0].schedule.interval.total_seconds() == 900
    assert catch_up.parameters == {"job_spec": "configs/tiny-cpu.yaml", "suite": "quick"}
