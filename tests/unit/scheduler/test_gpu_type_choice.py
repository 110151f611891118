"""A GPU type a person names (--gpu-type of plan and submit) is checked against the GPU
catalogue and the cluster's own types: a typo is one line naming the known types, exit 2,
nothing queued; an alias is the inventory's name (the state database is a real SQLite file)."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from flows.cli import main
from scheduler.gpus import UnknownGpuType, checked_gpu_type, known_gpu_types

CLUSTER = "configs/clusters/frenzy-testbed.yaml"


def _jobs(db: str) -> list:
    from infra.statedb import open_state_db
    from infra.statedb.schema import jobs

    with open_state_db(db).connect() as conn:
        return conn.execute(sa.select(jobs.c.id, jobs.c.options)).all()


def test_names_aliases_and_the_clusters_own_types():
    assert checked_gpu_type("a100") == "A100-40G"
    assert checked_gpu_type("h100 80gb hbm3") == "H100-80G"
    assert checked_gpu_type("my-asic", present=["My-ASIC", "A100-40G"]) == "My-ASIC"
    with pytest.raises(UnknownGpuType) as refused:
        checked_gpu_type("A100-4OG", present=["My-ASIC"])
    message = str(refused.value)
    assert "unknown GPU type 'A100-4OG'" in message and "this cluster's own (My-ASIC)" in message
    assert all(name in message for name in known_gpu_types()) and "\n" not in message


def test_submit_with_an_unknown_gpu_type_is_one_line_and_queues_nothing(tmp_path, monkeypatch, capsys):
    db = f"sqlite:///{tmp_path / 'state.db'}"
    monkeypatch.setenv("FORGEFLOW_DB_URL", db)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert main(["cluster", "register", CLUSTER]) == 0
    capsys.readouterr()
    assert main(["submit", "configs/tiny-cpu.yaml", "--cluster", CLUSTER, "--gpu-type", "A100-4OG"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown GPU type 'A100-4OG'") and err.count("\n") == 1, err
    assert "A800-80G" in err and "H100-80G" in err   # the known types, to pick from
    assert _jobs(db) == []


def test_an_alias_queues_on_the_inventorys_type(tmp_path, monkeypatch):
    from scheduler.orchestrator.seat import queue_spec
    from training.config import load_job_spec

    db = f"sqlite:///{tmp_path / 'state.db'}"
    monkeypatch.setenv("FORGEFLOW_DB_URL", db)
    job = queue_spec(load_job_spec("configs/tiny-cpu.yaml"), CLUSTER, gpu_type="a800", gpus=4)
    [(job_id, options)] = _jobs(db)
    chosen = [o for per_policy in options.values() for o in per_policy]   # {policy: [option, ...]}
    assert job_id == job.job_id and chosen and {o["gpu_type"] for o in chosen} == {"A800-80G"}


def test_plan_refuses_an_unknown_type_among_known_ones(capsys):
    # Before: the unknown one was silently dropped and the plans were the known type's.
    assert main(["plan", "configs/tiny-cpu.yaml", "--cluster", CLUSTER,
                 "--gpu-type", "A100-40G", "--gpu-type", "B300"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown GPU type 'B300'") and err.count("\n") == 1, err
