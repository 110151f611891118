"""An evaluation created through Prefect's API touches one job's files only (evalsuite.job_scope).

A flow run of the on-commit or catch-up deployment takes its parameters from whoever can create
flow runs. Here such runs are created from a real deployment on the (ephemeral) Prefect API and
run by Prefect's flow engine, as a worker runs them; the job is a real one queued with the
orchestrator on a real SQLite state database. Refused: a file path for the spec or the suite, a
checkpoint or output folder outside the job, a job the orchestrator does not know, preload and
history paths. Each refusal is checked on the check the flow makes first when the API created
its run (flows.evaluate._confined_to_its_job, over the real state database); one refused run
through the API shows the flow makes it and touches nothing. A node session reads what to serve
from its session folder, never from parameters.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

CLUSTER = "configs/clusters/frenzy-testbed.yaml"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from testing.tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("scope-model") / "hf")


@pytest.fixture
def job(tmp_path, monkeypatch, tiny_model):
    """A job queued with the orchestrator, and an exported checkpoint in its checkpoint prefix."""
    from scheduler.orchestrator.seat import queue_spec
    from training.config import load_job_spec

    monkeypatch.setenv("FORGEFLOW_DB_URL", f"sqlite:///{tmp_path / 'state.db'}")
    monkeypatch.setenv("FORGEFLOW_STATE_DIR", str(tmp_path / "state"))
    spec = load_job_spec("configs/tiny-cpu.yaml", {"run_dir": str(tmp_path / "runs" / "{name}" / "{job}"),
                                                   "checkpoint": {"url": str(tmp_path / "ckpt" / "{job}")}})
    submitted = queue_spec(spec, CLUSTER, gpu_type="A800-80G", gpus=4)
    step = Path(submitted.spec.checkpoint.url) / "step-00000010"
    shutil.copytree(tiny_model, step, ignore=shutil.ignore_patterns("data"))
    return submitted, step


def _through_the_api(flow, parameters: dict):
    """Create a flow run of a deployment of `flow` and run it with Prefect's flow engine (what a
    worker does with a run the API created); returns its result or raises its error."""
    from prefect import get_client
    from prefect.flow_engine import run_flow

    with get_client(sync_client=True) as client:
        deployment = client.create_deployment(flow_id=client.create_flow(flow), name="scope-test")
        run = client.create_flow_run_from_deployment(deployment, parameters=parameters)
    assert run.deployment_id == deployment
    return run_flow(flow, flow_run=run, parameters=run.parameters)


def _spec_content(submitted) -> str:
    return json.dumps(submitted.spec.model_dump(mode="json"))


def test_the_jobs_own_checkpoint_is_evaluated_with_its_recorded_spec(prefect_api, job, tmp_path):
    from flows.evaluate import evaluate_checkpoint

    submitted, step = job
    forged = submitted.spec.model_dump(mode="json")
    forged["run_dir"] = str(tmp_path / "elsewhere")   # only the job id and name of the content count
    result = _through_the_api(evaluate_checkpoint, {"checkpoint": str(step), "suite": "capitals-mc",
                                                    "job_spec": json.dumps(forged)})
    assert set(result["results"]) == {"capitals-mc"}
    assert (submitted.spec.resolved_run_dir / "eval" / "step-00000010-capitals-mc").is_dir()
    assert not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("case, message", [
    ("output_dir outside", "is outside job {job}'s run directory"),
    ("suite file", "is a path; an evaluation through the API takes a suite name"),
    ("suite file by a bare name", "is a path; an evaluation through the API takes a suite name"),
    ("checkpoint outside", "is outside job {job}'s checkpoints"),
    ("spec as a path", "not a file path"),
    ("unknown job", "names job 99999, which the cluster orchestrator does not know"),
    ("spec of no job", "belongs to no orchestrator job"),
    ("preload_root", "preload_root is not a parameter of an evaluation through the API"),
    ("history_path", "history_path is not a parameter"),
    ("checkpoint of no job", "is in no job's checkpoints"),
    ("cluster file", "is not the inventory of a cluster registered"),
])
def test_parameters_outside_the_job_are_refused(job, tmp_path, tiny_model, monkeypatch, case, message):
    from evalsuite.job_scope import EvalScopeError
    from flows.evaluate import _confined_to_its_job

    submitted, step = job
    spec = _spec_content(submitted)
    suite_file = tmp_path / "suite.yaml"
    suite_file.write_text("name: s\ndatasets: [{name: capitals-mc}]\npreload_root: /\n")
    parameters = {"checkpoint": str(step), "suite": "capitals-mc", "job_spec": spec}
    local = submitted.spec.model_dump(mode="json") | {"job": "local"}
    parameters |= {
        "output_dir outside": {"output_dir": str(tmp_path / "out")},
        "suite file": {"suite": str(suite_file)},
        "suite file by a bare name": {"suite": "capitals-mc"},   # a file of that name where the worker runs
        "checkpoint outside": {"checkpoint": str(tiny_model)},
        "spec as a path": {"job_spec": "configs/tiny-cpu.yaml"},
        "unknown job": {"job_spec": json.dumps(submitted.spec.model_dump(mode="json") | {"job": "99999"})},
        "spec of no job": {"job_spec": json.dumps(local)},
        "preload_root": {"preload_root": str(tmp_path / "shm")},
        "history_path": {"history_path": str(tmp_path / "history.json")},
        "checkpoint of no job": {"checkpoint": str(tiny_model), "job_spec": None},
        "cluster file": {"submitter": "slurm", "slurm_cluster_file": str(tmp_path / "cluster.yaml")},
    }[case]
    if case == "suite file by a bare name":
        monkeypatch.chdir(tmp_path)
        (tmp_path / "capitals-mc").write_text(suite_file.read_text())
    parameters.pop("submitter", None)   # the flow's own parameter; the check reads the cluster file
    with pytest.raises(EvalScopeError, match=message.format(job=submitted.job_id).replace("(", r"\(")):
        _confined_to_its_job(**({"output_dir": None, "preload_root": None, "history_path": None,
                                 "slurm_cluster_file": None} | parameters))
    assert not (tmp_path / "out").exists() and not (submitted.spec.resolved_run_dir / "eval").exists()


def test_a_run_through_the_api_with_a_parameter_outside_the_job_is_refused_and_touches_nothing(
        prefect_api, job, tmp_path):
    from evalsuite.job_scope import EvalScopeError
    from flows.evaluate import evaluate_checkpoint

    submitted, step = job
    with pytest.raises(EvalScopeError, match=f"is outside job {submitted.job_id}'s run directory"):
        _through_the_api(evaluate_checkpoint, {"checkpoint": str(step), "suite": "capitals-mc",
                                               "job_spec": _spec_content(submitted),
                                               "output_dir": str(tmp_path / "out")})
    assert not (tmp_path / "out").exists() and not (submitted.spec.resolved_run_dir / "eval").exists()


def test_the_catch_up_through_the_api_skips_a_registered_entry_of_no_job(prefect_api, job, caplog):
    from prefect.variables import Variable

    from flows.evaluate import evaluate_catch_up
    from tasks.eval_tasks import EVAL_JOBS_VARIABLE

    submitted, _ = job
    forged = submitted.spec.model_dump(mode="json") | {"job": "local", "name": "forged"}
    Variable.set(EVAL_JOBS_VARIABLE, {"forged": {"suite": "quick", "spec": forged}}, overwrite=True)
    try:
        assert _through_the_api(evaluate_catch_up, {}) == []
    finally:
        Variable.set(EVAL_JOBS_VARIABLE, {}, overwrite=True)
    # the flow's log (its records: once an earlier test ran a flow in this process, Prefect's
    # console handler writes to that test's captured stderr, so the console is not read here)
    printed = caplog.text
    assert "skipping job 'forged'" in printed and "belongs to no orchestrator job" in printed


def test_a_node_session_serves_only_an_evaluations_session_folder(tmp_path):
    from evalsuite.errors import EvalConfigError
    from flows.evaluate import evaluate_node_work

    with pytest.raises(EvalConfigError, match="holds no evaluation session"):
        evaluate_node_work.fn("serve", "n1", str(tmp_path))
    from tasks.eval_tasks import write_session_record

    write_session_record(tmp_path / "session", "s3://bucket/model", None, 1)
    with pytest.raises(EvalConfigError, match="a node is a work queue's name"):
        evaluate_node_work.fn("serve", "../../etc", str(tmp_path / "session"))
