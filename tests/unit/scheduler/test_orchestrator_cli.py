"""`forgeflow cluster ...` against a SQLite state database, in process (jobs queued through the library)."""

from __future__ import annotations

import json

import pytest

from flows.cli import main
from scheduler.cluster import load_cluster
from scheduler.orchestrator import Orchestrator, job_options
from training.config import load_job_spec


@pytest.fixture
def db(tmp_path) -> list[str]:
    return ["--db", f"sqlite:///{tmp_path / 'cli.db'}"]


def _json(capsys, argv: list[str]) -> tuple[int, dict]:
    code = main(argv + ["--json"])
    return code, json.loads(capsys.readouterr().out)


def test_register_submit_cordon_status_queue(db, capsys):
    code, reg = _json(capsys, ["cluster", "register", "configs/clusters/frenzy-testbed.yaml", *db])
    assert code == 0 and reg["gpus"] == 11
    orch, spec = Orchestrator(db[1]), load_job_spec("configs/tiny-cpu.yaml")
    options = job_options(spec, load_cluster("configs/clusters/frenzy-testbed.yaml"), gpus=4, gpu_type="A800-80G")
    first, second = (orch.submit(spec.name, options) for _ in range(2))
    assert orch.job(first)["state"] == "running" and orch.queue_position(second) == (1, 1)
    code, cordon = _json(capsys, ["cluster", "cordon", "a800-80g-x4", "--reason", "xid 79", *db])
    assert cordon["state"] == "cordoned" and cordon["running_jobs"] == [first]
    code, status = _json(capsys, ["cluster", "status", *db])
    node = next(n for n in status["nodes"] if n["node"] == "a800-80g-x4")
    assert node["state"] == "cordoned" and node["reason"] == "xid 79" and node["busy_gpus"] == 4
    code, queue = _json(capsys, ["cluster", "queue", *db])
    assert [j["job_id"] for j in queue["queued"]] == [second]
    assert main(["cluster", "status", *db]) == 0 and "cordoned" in capsys.readouterr().out  # the table


@pytest.mark.parametrize("argv, message", [
    (["cluster", "cordon", "nope"], "no node named 'nope'"),
    (["submit", "configs/tiny-cpu.yaml", "--gpus", "64"], "asks for 64 GPU"),
    (["cluster", "register", "configs/clusters/missing.yaml"], "no such cluster file"),
    (["cluster", "serve", "--cluster", "nope", "--seconds", "1"], "no cluster named 'nope'"),
])
def test_bad_input_exits_2_and_changes_nothing(db, capsys, argv, message):
    assert main(["cluster", "register", "configs/clusters/frenzy-testbed.yaml", *db]) == 0
    capsys.readouterr()
    _, before = _json(capsys, ["cluster", "status", *db])
    assert main(argv + db) == 2
    assert message in capsys.readouterr().err
    _, after = _json(capsys, ["cluster", "status", *db])
    before.pop("at"), after.pop("at")
    assert before == after


def test_unreachable_database_is_one_error(capsys):
    assert main(["cluster", "status", "--db", "postgresql+psycopg://nobody@127.0.0.1:1/x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot reach the state database") and "Traceback" not in err


def test_user_text_in_the_tables_is_shown_as_written(db, capsys):
    """A cordon reason, a job name or a cancel reason is someone's text: rich markup in it
    (`[/oops]` used to crash `cluster status` for everyone) and terminal escapes are not obeyed."""
    assert main(["cluster", "register", "configs/clusters/frenzy-testbed.yaml", *db]) == 0
    orch, spec = Orchestrator(db[1]), load_job_spec("configs/tiny-cpu.yaml")
    options = job_options(spec, load_cluster("configs/clusters/frenzy-testbed.yaml"), gpus=4, gpu_type="A800-80G")
    running, queued = orch.submit("[/oops]", options), orch.submit("[bold]q[/bold]", options)
    orch.request_stop(queued, "[/x] :smile: \x1b]0;title\x07done")
    assert main(["cluster", "cordon", "a800-80g-x4", "--reason", "[/oops] [red]xid[/red] \x1b[2J", *db]) == 0
    capsys.readouterr()
    assert main(["cluster", "status", *db]) == 0
    out = capsys.readouterr().out
    assert "[/oops] [red]xid[/red]" in out and "\x1b[2J" not in out
    assert main(["cluster", "queue", "--ended", "5", *db]) == 0
    out = capsys.readouterr().out
    assert "[/oops]" in out and "[bold]q[/bold]" in out and "[/x] :smile:" in out and "\x1b" not in out
    assert main(["jobs", "--all", *db]) == 0
    out = capsys.readouterr().out
    assert "[/oops]" in out and "[/x] :smile: done" in out and "\x1b" not in out
