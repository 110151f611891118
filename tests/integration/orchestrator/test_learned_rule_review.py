"""Learned diagnosis rules have an owner, a job family and a review (migration 0010), on SQLite and
PostgreSQL: the failure agent's rule is proposed and applies only to the family that learned it,
so one family's rule cannot turn another family's OOM into a NodeFailure; an operator approves it
(for its family or every job) or rejects it with `forgeflow rules approve|reject`."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

from diagnosis.rules import DiagnosisLibrary
from flows.cli import main
from infra.statedb import forget_engines

# A line the seeds name OutOfMemory; the rule a confused agent learned from it names a NodeFailure.
OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.35 GiB total capacity)"
BAD_PATTERN = r"CUDA out of memory\. Tried to allocate"


def _learn(url: str, family: str | None) -> str:
    library = DiagnosisLibrary.load(db_url=url, job_family=family)
    return library.add_rule(BAD_PATTERN, "NodeFailure", True, must_match=[OOM], source="agent").name


def _cause(url: str, family: str | None) -> str:
    rule = DiagnosisLibrary.load(db_url=url, job_family=family).first_match(OOM)
    return rule.root_cause


def test_the_agents_rule_is_proposed_for_its_family_until_approved(state_db_url, monkeypatch, capsys):
    forget_engines()
    monkeypatch.setenv("FORGEFLOW_DB_URL", state_db_url)
    name = _learn(state_db_url, "llama-7b")
    [stored] = [r for r in DiagnosisLibrary.load(db_url=state_db_url, job_family="llama-7b").learned]
    assert (stored.name, stored.owner, stored.job_family, stored.review, stored.scope) == \
        (name, "agent", "llama-7b", "proposed", "family")
    assert _cause(state_db_url, "llama-7b") == "NodeFailure"     # the job family that learned it
    assert _cause(state_db_url, "gpt-1b") == "OutOfMemoryError"       # any other: the seeds stand
    assert _cause(state_db_url, None) == "OutOfMemoryError"

    assert main(["rules", "list", "--learned"]) == 0
    assert f"[proposed: applies to job family llama-7b; by agent]" in capsys.readouterr().out

    assert main(["rules", "approve", name]) == 0                 # approved for its family
    assert "applies to job family llama-7b" in capsys.readouterr().out
    assert _cause(state_db_url, "gpt-1b") == "OutOfMemoryError"
    assert main(["rules", "approve", name, "--global", "--json"]) == 0
    approved = json.loads(capsys.readouterr().out)
    assert approved["review"] == "approved" and approved["scope"] == "global" and approved["reviewed_by"]
    assert _cause(state_db_url, "gpt-1b") == "NodeFailure"

    assert main(["rules", "reject", name]) == 0
    assert _cause(state_db_url, "llama-7b") == "OutOfMemoryError"     # rejected: no job uses it
    with pytest.raises(Exception, match="exists already"):      # nor is it proposed again
        _learn(state_db_url, "llama-7b")


def test_a_persons_rule_applies_to_every_job_or_the_family_given(state_db_url, monkeypatch, capsys):
    forget_engines()
    monkeypatch.setenv("FORGEFLOW_DB_URL", state_db_url)
    assert main(["rules", "add", "--type", "diagnosis", "--pattern", "flux capacitor on bank \\d+",
                 "--root-cause", "NVLinkError", "--restart-helps", "yes"]) == 0
    assert main(["rules", "add", "--type", "diagnosis", "--pattern", "warp core breach in module",
                 "--root-cause", "ECCError", "--restart-helps", "no", "--job-family", "llama-7b"]) == 0
    out = capsys.readouterr().out
    assert "(applies to every job)" in out and "(applies to job family llama-7b)" in out
    other = DiagnosisLibrary.load(db_url=state_db_url, job_family="gpt-1b")
    assert other.first_match("flux capacitor on bank 3").root_cause == "NVLinkError"
    assert other.first_match("warp core breach in module x") is None   # another family: not its rule
    assert DiagnosisLibrary.load(db_url=state_db_url, job_family="llama-7b").first_match(
        "warp core breach in module x").root_cause == "ECCError"


@pytest.mark.parametrize("argv, message", [
    (["rules", "approve", "no-such-rule"], "no learned rule 'no-such-rule'"),
    (["rules", "reject", "no-such-rule"], "no learned rule 'no-such-rule'"),
])
def test_reviewing_an_unknown_rule_is_one_line_exit_2(state_db_url, monkeypatch, capsys, argv, message):
    forget_engines()
    monkeypatch.setenv("FORGEFLOW_DB_URL", state_db_url)
    _learn(state_db_url, "llama-7b")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_migration_0010_keeps_a_persons_rules_and_proposes_the_agents(state_db_url):
    """Rules stored before review states: a person's applied everywhere and still do; the agent's
    no longer outrank the seeds for every job."""
    from alembic import command

    from infra.statedb.migrate import alembic_config

    forget_engines()
    engine = sa.create_engine(state_db_url)
    cfg = alembic_config()
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0009")
        rules = sa.table("diagnosis_rules", sa.column("name"), sa.column("pattern"), sa.column("rule", sa.JSON))
        conn.execute(sa.insert(rules), [
            {"name": "agent-NodeFailure-1", "pattern": BAD_PATTERN, "rule": {
                "name": "agent-NodeFailure-1", "pattern": BAD_PATTERN, "root_cause": "NodeFailure",
                "restart_helps": True, "source": "agent", "added_at": 1.0}},
            {"name": "user-ECCError-1", "pattern": "uncorrectable ECC on bank \\d+", "rule": {
                "name": "user-ECCError-1", "pattern": "uncorrectable ECC on bank \\d+", "root_cause": "ECCError",
                "restart_helps": False, "source": "user", "added_at": 2.0}},
        ])
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
    engine.dispose()
    library = DiagnosisLibrary.load(db_url=state_db_url, job_family="llama-7b")
    assert [r.name for r in library.learned] == ["user-ECCError-1"]
    assert library.first_match("uncorrectable ECC on bank 4").root_cause == "ECCError"
    assert library.first_match(OOM).root_cause == "OutOfMemoryError"
