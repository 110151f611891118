"""Who may review learned diagnosis rules, decided by PostgreSQL itself (migration 0011, issue 29):
login roles made here — alice (team A, owns a job named llama-7b), anna (team A, not an admin),
bob (team B), olga (operator). A flow's role proposes a rule for its own job's family; a team
member cannot approve, reject, edit or delete it, nor add a rule by hand; the operator can. The
refusals are PostgreSQL's (row-level security): straight SQL as the role is refused too, and the
CLI says so in one line, exit 2, nothing changed."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from diagnosis.rules import DiagnosisLibrary
from flows.cli import main
from infra.statedb import forget_engines
from infra.statedb.identity import operator_role
from scheduler.cluster import parse_cluster
from scheduler.orchestrator import Orchestrator, demand_options

OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.35 GiB total capacity)"
PATTERN = r"CUDA out of memory\. Tried to allocate"
INVENTORY = "name: rules-lab\nnodes:\n  - name: n1\n    gpu_type: A100-80G\n    gpu_count: 2\n"
CLUSTER = parse_cluster({"name": "rules-lab", "nodes": [{"name": "n1", "gpu_type": "A100-80G", "gpu_count": 2}]})


@pytest.fixture
def site(postgres_server, tmp_path):
    tag = uuid.uuid4().hex[:8]
    db = f"forgeflow_{tag}"
    admin = sa.create_engine(postgres_server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{db}"'))
    owner_url = sa.make_url(postgres_server).set(database=db)
    Orchestrator(owner_url.render_as_string(hide_password=False))  # migrates to head: 0011's policies
    roles = {name: f"{name}_{tag}" for name in ("alice", "anna", "bob", "olga")}
    with admin.connect() as conn:
        for role in roles.values():
            conn.execute(sa.text(f'CREATE ROLE "{role}" LOGIN'))
        conn.execute(sa.text(f'GRANT "{operator_role()}" TO "{roles["olga"]}"'))
    admin.dispose()
    urls = {name: owner_url.set(username=role).render_as_string(hide_password=False) for name, role in roles.items()}
    olga = ["--db", urls["olga"]]
    (tmp_path / "lab.yaml").write_text(INVENTORY)
    assert main(["cluster", "register", str(tmp_path / "lab.yaml"), *olga]) == 0
    assert main(["cluster", "team", "add", "A", *olga]) == 0
    assert main(["cluster", "team", "add", "B", *olga]) == 0
    for team, who, flags in (("A", "alice", ["--admin"]), ("A", "anna", []), ("B", "bob", [])):
        assert main(["cluster", "team", "member", "add", team, roles[who], *flags, *olga]) == 0
    Orchestrator(urls["alice"]).submit("llama-7b", demand_options(CLUSTER, 2, duration_s=600))
    yield {"roles": roles, "urls": urls}
    forget_engines()


def _learn(url: str, family: str) -> str:
    """What the pretrain flow's failure agent does with its role's connection."""
    library = DiagnosisLibrary.load(db_url=url, job_family=family)
    return library.add_rule(PATTERN, "NodeFailure", True, must_match=[OOM], source="agent").name


def _rule(site, name: str) -> dict:
    [rule] = [r.model_dump() for r in DiagnosisLibrary.load(db_url=site["urls"]["olga"], job_family="llama-7b").learned
              if r.name == name] or [None]
    return rule


def _raw(site, who: str, sql: str, **params) -> int:
    engine = sa.create_engine(site["urls"][who])
    try:
        with engine.begin() as conn:
            return conn.execute(sa.text(sql), params).rowcount
    finally:
        engine.dispose()


def _cli(capsys, argv: list[str]) -> tuple[int, str]:
    forget_engines()
    code = main(argv)
    return code, capsys.readouterr().err


def test_a_flow_proposes_a_member_cannot_approve_an_operator_can(site, monkeypatch, capsys):
    # the flow's role (the job's owner) proposes a rule for its own job's family
    name = _learn(site["urls"]["alice"], "llama-7b")
    assert (_rule(site, name)["review"], _rule(site, name)["owner"]) == ("proposed", "agent")
    # another team's role may not propose for a family that is not its job's (PostgreSQL refuses the row)
    with pytest.raises(Exception, match="refused this role a proposed rule for job family llama-7b"):
        DiagnosisLibrary.load(db_url=site["urls"]["bob"], job_family="llama-7b").add_rule(
            r"NCCL watchdog timed out", "NCCLTimeoutError", True, source="agent")

    # a team member: approve and reject are refused, one line, exit 2, nothing changed
    for who in ("anna", "alice"):
        monkeypatch.setenv("FORGEFLOW_DB_URL", site["urls"][who])
        for argv in (["rules", "approve", name, "--global"], ["rules", "reject", name]):
            code, err = _cli(capsys, argv)
            assert code == 2 and err.count("\n") == 1, err
            assert "refused this role" in err and operator_role() in err
    assert _rule(site, name)["review"] == "proposed"
    # and straight SQL as the role changes or deletes no rule (row-level security), nor adds an approved one
    assert _raw(site, "anna", "UPDATE diagnosis_rules SET review = 'approved', scope = 'global'") == 0
    assert _raw(site, "alice", "DELETE FROM diagnosis_rules") == 0
    with pytest.raises(sa.exc.ProgrammingError, match="row-level security"):
        _raw(site, "alice", "INSERT INTO diagnosis_rules (name, pattern, rule, owner, job_family, review, scope) "
                            "VALUES ('mine', 'x y z', '{}', 'alice', 'llama-7b', 'approved', 'global')")
    # a person adding a rule by hand for every job: the operator's
    monkeypatch.setenv("FORGEFLOW_DB_URL", site["urls"]["anna"])
    code, err = _cli(capsys, ["rules", "add", "--type", "diagnosis", "--pattern",
                                                    "flux capacitor on bank \\d+", "--root-cause", "NVLinkError",
                                                    "--restart-helps", "yes"])
    assert code == 2 and err.count("\n") == 1 and "refused this role an approved rule for every job" in err, err
    assert DiagnosisLibrary.load(db_url=site["urls"]["olga"]).first_match("flux capacitor on bank 3") is None

    # the operator approves for every job, then rejects
    monkeypatch.setenv("FORGEFLOW_DB_URL", site["urls"]["olga"])
    assert _cli(capsys, ["rules", "approve", name, "--global"])[0] == 0
    approved = _rule(site, name)
    assert (approved["review"], approved["scope"], approved["reviewed_by"]) == \
        ("approved", "global", site["roles"]["olga"])
    assert DiagnosisLibrary.load(db_url=site["urls"]["bob"], job_family="gpt-1b").first_match(OOM).root_cause == \
        "NodeFailure"
    assert _cli(capsys, ["rules", "reject", name])[0] == 0
    assert _rule(site, name) is None   # rejected: applies to no family
    assert _cli(capsys, ["rules", "add", "--type", "diagnosis", "--pattern",
                                                "flux capacitor on bank \\d+", "--root-cause", "NVLinkError",
                                                "--restart-helps", "yes"])[0] == 0
