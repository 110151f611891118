"""`forgeflow cluster team ...` on single-user SQLite: teams are recorded (quotas and fair share use
them), the commands say that nothing is enforced there, and bad input is one line, exit 2,
nothing written."""

from __future__ import annotations

import json

import pytest

from flows.cli import main
from scheduler.cluster import parse_cluster
from scheduler.orchestrator import Orchestrator, OrchestratorError, demand_options


@pytest.fixture
def db(tmp_path):
    return ["--db", f"sqlite:///{tmp_path / 'teams.db'}"]


def _teams(capsys, db) -> list:
    capsys.readouterr()
    assert main(["cluster", "team", "list", "--json", *db]) == 0
    return json.loads(capsys.readouterr().out)["teams"]


def test_teams_are_recorded_and_sqlite_says_it_is_single_user(db, capsys):
    assert main(["cluster", "team", "add", "research", "--weight", "2", *db]) == 0
    assert "SQLite is single-user" in capsys.readouterr().out
    assert main(["cluster", "team", "member", "add", "research", "alice", "--admin", *db]) == 0
    assert main(["cluster", "team", "add", "research", "--weight", "3", *db]) == 0
    assert "weight 2 -> 3" in capsys.readouterr().out
    assert _teams(capsys, db) == [{"team": "research", "weight": 3.0, "members": [{"member": "alice", "admin": True}]}]


@pytest.mark.parametrize("argv, said", [
    (["cluster", "team", "add", "../x"], "team name '../x' is not allowed"),
    (["cluster", "team", "add", "ok", "--weight", "0"], "--weight 0.0 is not allowed"),
    (["cluster", "team", "add", "ok", "--weight", "nan"], "--weight nan is not allowed"),
    (["cluster", "team", "member", "add", "nope", "alice"], "no team named 'nope' (teams: none)"),
])
def test_bad_team_input_is_one_line_and_writes_nothing(db, capsys, argv, said):
    code = main(argv + db)
    err = capsys.readouterr().err
    assert code == 2 and said in err and len(err.strip().splitlines()) == 1
    assert _teams(capsys, db) == []


def test_an_unknown_team_is_refused_at_submit(db, tmp_path):
    (tmp_path / "lab.yaml").write_text("name: lab\nnodes:\n  - name: n1\n    gpu_type: A100-80G\n    gpu_count: 2\n")
    assert main(["cluster", "register", str(tmp_path / "lab.yaml"), *db]) == 0
    cluster = parse_cluster({"name": "lab", "nodes": [{"name": "n1", "gpu_type": "A100-80G", "gpu_count": 2}]})
    orch = Orchestrator(db[1])
    with pytest.raises(OrchestratorError, match="unknown team 'nope'"):
        orch.submit("x", demand_options(cluster, 1), team="nope")
    job = orch.submit("y", demand_options(cluster, 1))  # single user: no team needed
    assert orch.job(job)["team"] is None and orch.job(job)["submitted_by"] == orch.actor
