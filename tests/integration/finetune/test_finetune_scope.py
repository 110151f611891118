"""A fine-tuning run created through Prefect's API touches one job's files only (issue 29, item 1).

The `finetune` deployment takes `spec_path` from whoever can create a flow run, and the spec names
folders to read (model_dir, data) and write (run_dir, checkpoint_url). Runs are created here from a
real deployment on the (ephemeral) Prefect API and run by Prefect's flow engine, as a worker runs
them, for a job queued with the orchestrator on a real SQLite state database: a spec outside every
job's run directory, or naming a folder outside its job's, is refused in one line before anything
else is read; a spec whose folders are all its job's passes the check (and is then read as usual).
"""

from __future__ import annotations

from pathlib import Path

import pytest

CLUSTER = "configs/clusters/frenzy-testbed.yaml"


@pytest.fixture
def run_dir(tmp_path, monkeypatch) -> Path:
    """The run directory of a job queued with the orchestrator."""
    from scheduler.orchestrator.seat import queue_spec
    from training.config import load_job_spec

    monkeypatch.setenv("FORGEFLOW_DB_URL", f"sqlite:///{tmp_path / 'state.db'}")
    monkeypatch.setenv("FORGEFLOW_STATE_DIR", str(tmp_path / "state"))
    spec = load_job_spec("configs/tiny-cpu.yaml", {"run_dir": str(tmp_path / "runs" / "{name}" / "{job}"),
                                                   "checkpoint": {"url": str(tmp_path / "ckpt" / "{job}")}})
    submitted = queue_spec(spec, CLUSTER, gpu_type="A800-80G", gpus=4)
    folder = submitted.spec.resolved_run_dir
    (folder / "hf").mkdir(parents=True)
    return folder


def _through_the_api(parameters: dict):
    from prefect import get_client
    from prefect.flow_engine import run_flow

    from flows.finetune import finetune

    with get_client(sync_client=True) as client:
        deployment = client.create_deployment(flow_id=client.create_flow(finetune), name="scope-test")
        run = client.create_flow_run_from_deployment(deployment, parameters=parameters)
    assert run.deployment_id == deployment
    return run_flow(finetune, flow_run=run, parameters=run.parameters)


def _spec(folder: Path, **fields) -> str:
    values = {"name": "ft", "model_dir": str(folder / "hf"), "run_dir": str(folder / "ft"),
              "training": "{steps: 1, seq_length: 8}", **fields}
    return "".join(f"{k}: {v}\n" for k, v in values.items())


@pytest.mark.parametrize("case, message", [
    ("spec outside", "is in no job's run directory"),
    ("model_dir outside", "model_dir {outside} is outside job"),
    ("run_dir outside", "run_dir {outside} is outside job"),
    ("data outside", "data.data_dir {outside} is outside job"),
    ("checkpoint elsewhere", "checkpoint_url s3://other-team/ckpt is outside job"),
    ("base file", "without 'base:'"),
    ("eval suite file", "eval_suite '/etc/suite.yaml' is a path"),
])
def test_a_run_through_the_api_names_only_its_jobs_folders(prefect_api, run_dir, tmp_path, case, message):
    from training.config import ConfigError

    outside = tmp_path / "elsewhere"
    spec = run_dir / "ft.yaml"
    text = {
        "spec outside": _spec(run_dir),
        "model_dir outside": _spec(run_dir, model_dir=outside),
        "run_dir outside": _spec(run_dir, run_dir=outside),
        "data outside": _spec(run_dir, data=f"{{kind: prepared, data_dir: {outside}}}"),
        "checkpoint elsewhere": _spec(run_dir, checkpoint_url="s3://other-team/ckpt"),
        "base file": _spec(run_dir, base=str(tmp_path / "base.yaml")),
        "eval suite file": _spec(run_dir, eval_suite="/etc/suite.yaml"),
    }[case]
    if case == "spec outside":
        spec = tmp_path / "ft.yaml"
    spec.write_text(text)
    with pytest.raises(ConfigError, match=message.format(outside=outside).replace("(", r"\(")) as refused:
        _through_the_api({"spec_path": str(spec), "evaluate": False})
    assert "\n" not in str(refused.value)
    assert not outside.exists() and not (run_dir / "ft").exists()


def test_a_spec_of_its_jobs_own_folders_passes_the_check(prefect_api, run_dir):
    """Everything in the job's run directory and checkpoint prefix: the check lets it through, and
    the spec is read as a direct run reads it (here: the model folder is empty, the usual error)."""
    from training.config import ConfigError

    spec = run_dir / "ft.yaml"
    spec.write_text(_spec(run_dir, checkpoint_url=f"file://{run_dir / 'ft' / 'checkpoints'}",
                          data=f"{{kind: prepared, data_dir: {run_dir / 'data'}}}", eval_suite="quick"))
    with pytest.raises(ConfigError, match="is not a Hugging Face model folder"):
        _through_the_api({"spec_path": str(spec), "evaluate": False})
