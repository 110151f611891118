"""`forgeflow submit` and `forgeflow pretrain` refuse bad input before anything is queued or
started: one line on stderr, exit 2, no job row (the state database is a real SQLite file)."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from flows.cli import main

CLUSTER = "configs/clusters/frenzy-testbed.yaml"


def _jobs(db: str) -> int:
    from infra.statedb import open_state_db
    from infra.statedb.schema import jobs

    with open_state_db(db).connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(jobs)).scalar()


@pytest.mark.parametrize("command", ["submit", "pretrain"])
@pytest.mark.parametrize("extra, message", [
    (["--set", "training.lerning_rate=0.1"], "training.lerning_rate"),
    (["--set", "steps"], "must look like section.field=value"),
    (["--priority", "5000"], "priority 5000 is out of range; give a whole number from -1000 to 1000"),
    (["--drill", "meteor@3"], "meteor"),
    (["--set", "checkpoint.url=runs/{user}/ckpt"], "unknown placeholder 'user'"),
])
def test_bad_input_is_one_line_exit_2_and_queues_nothing(tmp_path, monkeypatch, capsys, command, extra, message):
    db = f"sqlite:///{tmp_path / 'state.db'}"
    monkeypatch.setenv("FORGEFLOW_DB_URL", db)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert main(["cluster", "register", CLUSTER]) == 0
    capsys.readouterr()
    assert main([command, "configs/tiny-cpu.yaml", "--cluster", CLUSTER, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("error:") and err.count("\n") == 1, err
    assert _jobs(db) == 0


def test_a_second_active_job_on_a_fixed_checkpoint_url_is_refused(tmp_path, monkeypatch, capsys):
    """A spec whose checkpoint URL has no {job} shares it with every job of that spec: while one
    is queued or running, a second would resume from and prune its checkpoints."""
    from scheduler.orchestrator.seat import queue_spec
    from training.config import load_job_spec

    db = f"sqlite:///{tmp_path / 'state.db'}"
    monkeypatch.setenv("FORGEFLOW_DB_URL", db)
    fixed = load_job_spec("configs/tiny-cpu.yaml", {"checkpoint": {"url": str(tmp_path / "ckpt")}})
    first = queue_spec(fixed, CLUSTER, gpu_type="A800-80G", gpus=4)
    assert first.spec.checkpoint.url == str(tmp_path / "ckpt")
    assert main(["submit", "configs/tiny-cpu.yaml", "--cluster", CLUSTER,
                 "--set", f"checkpoint.url={tmp_path / 'ckpt'}"]) == 2
    err = capsys.readouterr().err
    assert f"is in use by job {first.job_id} (tiny-cpu)" in err and "put {job} in checkpoint.url" in err
    assert _jobs(db) == 1
    # with the default layout, two jobs of one spec never share a directory
    a = queue_spec(load_job_spec("configs/tiny-cpu.yaml"), CLUSTER, gpu_type="A800-80G", gpus=4)
    b = queue_spec(load_job_spec("configs/tiny-cpu.yaml"), CLUSTER, gpu_type="A800-80G", gpus=4)
    assert a.spec.run_dir == f"runs/tiny-cpu/{a.job_id}" and b.spec.run_dir == f"runs/tiny-cpu/{b.job_id}"
    assert a.spec.checkpoint.url == f"runs/tiny-cpu/{a.job_id}/checkpoints" != b.spec.checkpoint.url
