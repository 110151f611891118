"""Identity and authorisation from PostgreSQL itself (issue 30): three login roles made here —
a member of team A, a member of team B, an operator — plus a second, non-admin member of team A.

The refusals asserted are the database's: another team's job is not there for a role (row-level
security hides it: the role's own UPDATE touches no row), a node or an inventory change is refused
by PostgreSQL's policies/privileges (SQLSTATE 42501), and `submitted_by` is the role the database
says the submitter connects as. The CLI says each refusal in one line and exits 2; nothing changes.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from flows.cli import main
from infra.statedb import forget_engines
from infra.statedb.identity import operator_role
from infra.statedb.url import DB_URL_ENV
from scheduler.cluster import parse_cluster
from scheduler.orchestrator import Orchestrator, OrchestratorError, demand_options
from scheduler.orchestrator.identity import TEAM_ENV

REPO = Path(__file__).resolve().parents[3]
INVENTORY = "name: teams-lab\nnodes:\n  - name: n1\n    gpu_type: A100-80G\n    gpu_count: 2\n" \
            "  - name: n2\n    gpu_type: A100-80G\n    gpu_count: 2\n"
CLUSTER = parse_cluster({"name": "teams-lab", "nodes": [{"name": "n1", "gpu_type": "A100-80G", "gpu_count": 2},
                                                  {"name": "n2", "gpu_type": "A100-80G", "gpu_count": 2}]})


@pytest.fixture
def site(postgres_server, tmp_path):
    """A migrated database on the session's PostgreSQL (its superuser owns the schema) and the URLs of
    fresh login roles: alice (team A), anna (team A, not an admin), bob (team B), olga (operator),
    carol (in no team). Teams, members and the inventory are set up by olga through the CLI."""
    tag = uuid.uuid4().hex[:8]
    db = f"forgeflow_{tag}"
    admin = sa.create_engine(postgres_server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{db}"'))
    owner_url = sa.make_url(postgres_server).set(database=db)
    Orchestrator(owner_url.render_as_string(hide_password=False))  # migrates: policies, the operator role
    roles = {name: f"{name}_{tag}" for name in ("alice", "anna", "bob", "olga", "carol")}
    with admin.connect() as conn:
        for role in roles.values():
            conn.execute(sa.text(f'CREATE ROLE "{role}" LOGIN'))
        conn.execute(sa.text(f'GRANT "{operator_role()}" TO "{roles["olga"]}"'))
    admin.dispose()
    urls = {name: owner_url.set(username=role).render_as_string(hide_password=False) for name, role in roles.items()}
    olga = ["--db", urls["olga"]]
    (tmp_path / "lab.yaml").write_text(INVENTORY)
    assert main(["cluster", "register", str(tmp_path / "lab.yaml"), *olga]) == 0
    assert main(["cluster", "team", "add", "A", "--weight", "2", *olga]) == 0
    assert main(["cluster", "team", "add", "B", *olga]) == 0
    for team, who, flags in (("A", "alice", ["--admin"]), ("A", "anna", []), ("B", "bob", [])):
        assert main(["cluster", "team", "member", "add", team, roles[who], *flags, *olga]) == 0
    yield {"roles": roles, "urls": urls, "owner": owner_url.render_as_string(hide_password=False),
           "inventory": tmp_path / "lab.yaml"}
    forget_engines()


def _as(site, who: str) -> Orchestrator:
    return Orchestrator(site["urls"][who])


def _cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def _raw(site, as_role: str, sql: str, **params):
    """A statement as the role, straight to PostgreSQL (no forgeflow code in between)."""
    engine = sa.create_engine(site["urls"][as_role])
    try:
        with engine.begin() as conn:
            result = conn.execute(sa.text(sql), params)
            return result.rowcount if result.returns_rows is False else result.all()
    finally:
        engine.dispose()


def _running_job_of_alice(site) -> int:
    job = _as(site, "alice").submit("alice-train", demand_options(CLUSTER, 2, duration_s=600))
    assert _as(site, "alice").job(job)["state"] == "queued"  # a team role leaves the pass to the decider
    assert job in _as(site, "olga").reconcile().admitted  # the operator's pass admits it
    return job


def test_submitted_by_is_the_role_and_the_team_is_its_own(site):
    job = _running_job_of_alice(site)
    row = _as(site, "olga").job(job)
    assert (row["submitted_by"], row["team"], row["state"]) == (site["roles"]["alice"], "A", "running")
    # a role cannot write another name: PostgreSQL refuses the row (WITH CHECK of jobs_submit)
    with pytest.raises(sa.exc.ProgrammingError, match="row-level security"):
        _raw(site, "bob", "INSERT INTO jobs (cluster, name, options, priority, state, submitted_at, queued_at, "
                          "attempts, lost_count, submitted_by, team) VALUES ('teams-lab', 'fake', '{}', 0, 'queued', 0, 0, "
                          "0, 0, :owner, 'B')", owner=site["roles"]["alice"])


def test_team_b_cannot_cancel_cordon_or_register(site, capsys):
    job = _running_job_of_alice(site)
    bob = ["--db", site["urls"]["bob"]]
    before = _as(site, "olga").job(job)

    # cancel: team A's job does not exist for bob (row-level security hides it), straight from PostgreSQL
    assert _raw(site, "bob", "SELECT id FROM jobs WHERE id = :j", j=job) == []
    assert _raw(site, "bob", "UPDATE jobs SET stop_requested = '{}' WHERE id = :j", j=job) == 0
    code, out, err = _cli(capsys, ["cancel", str(job), *bob])
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert f"no job with id {job} that role {site['roles']['bob']!r} may see" in err

    # cordon a node team A's job holds: PostgreSQL's policy on nodes refuses it
    node = next(iter(before["placement"]["nodes"]))["node"]
    code, out, err = _cli(capsys, ["cluster", "cordon", node, "--reason", "mine now", *bob])
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert 'new row violates row-level security policy for table "nodes"' in err and "operator role" in err

    # register an inventory (here: the same one with a third node)
    bigger = site["inventory"].with_name("bigger.yaml")
    bigger.write_text(INVENTORY + "  - name: n3\n    gpu_type: A100-80G\n    gpu_count: 2\n")
    code, out, err = _cli(capsys, ["cluster", "register", str(bigger), *bob])
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "the state database refused this:" in err and "operator role" in err

    # nothing changed
    after = _as(site, "olga").job(job)
    assert (after["state"], after["stop_requested"], after["attempts"]) == ("running", None, before["attempts"])
    status = json.loads(_cli(capsys, ["cluster", "status", "--json", "--db", site["urls"]["olga"]])[1])
    assert [(n["node"], n["state"]) for n in status["nodes"]] == [("n1", "ready"), ("n2", "ready")]


def test_a_team_mate_sees_but_may_not_cancel_and_a_flow_cordons_only_its_own_node(site, capsys):
    job = _running_job_of_alice(site)
    held = next(iter(_as(site, "olga").job(job)["placement"]["nodes"]))["node"]
    free = ({"n1", "n2"} - {held}).pop()
    # anna (team A, not its admin) sees the job; PostgreSQL refuses her change of it
    code, out, err = _cli(capsys, ["cancel", str(job), "--db", site["urls"]["anna"]])
    assert code == 2 and 'violates row-level security policy for table "jobs"' in err
    assert _as(site, "olga").job(job)["stop_requested"] is None
    # alice (its owner) may cordon the node her job holds, not another one, and may not uncordon
    alice = ["--db", site["urls"]["alice"]]
    assert _cli(capsys, ["cluster", "cordon", held, "--reason", "ECC errors", *alice])[0] == 0
    assert _cli(capsys, ["cluster", "cordon", free, *alice])[0] == 2
    assert _cli(capsys, ["cluster", "uncordon", held, *alice])[0] == 2
    nodes = {n["node"]: n for n in json.loads(_cli(capsys, ["cluster", "status", "--json", *alice])[1])["nodes"]}
    assert nodes[held]["state"] == "cordoned" and nodes[free]["state"] == "ready"
    assert nodes[held]["changed_by"] == site["roles"]["alice"]  # the role, not a self-declared name
    # ... and her own job she cancels
    code, out, err = _cli(capsys, ["cancel", str(job), *alice])
    assert code == 0 and "asked to stop" in out


def test_jobs_shows_owner_and_team_and_only_what_the_role_may_see(site, capsys):
    a_job = _running_job_of_alice(site)
    b_job = _as(site, "bob").submit("bob-train", demand_options(CLUSTER, 1, duration_s=600))

    def listed(who: str, *extra: str) -> dict[int, dict]:
        code, out, _ = _cli(capsys, ["jobs", "--json", *extra, "--db", site["urls"][who]])
        assert code == 0
        return {j["job_id"]: j for j in json.loads(out)["jobs"]}

    assert set(listed("bob")) == {b_job}
    assert set(listed("anna")) == {a_job}  # her team's
    everything = listed("olga")
    assert set(everything) == {a_job, b_job}
    assert (everything[a_job]["owner"], everything[a_job]["team"]) == (site["roles"]["alice"], "A")
    assert (everything[b_job]["owner"], everything[b_job]["team"]) == (site["roles"]["bob"], "B")
    assert set(listed("anna", "--mine")) == set() and set(listed("alice", "--mine")) == {a_job}
    code, table, _ = _cli(capsys, ["jobs", "--db", site["urls"]["bob"]])
    assert "bob-train" in table and "alice-train" not in table and " B " in table
    queue = json.loads(_cli(capsys, ["cluster", "queue", "--json", "--db", site["urls"]["olga"]])[1])
    assert {j["job_id"]: j["team"] for j in queue["running"] + queue["queued"]} == {a_job: "A", b_job: "B"}
    # cluster status shows the GPUs alice's job holds as busy to bob, without its name
    status = json.loads(_cli(capsys, ["cluster", "status", "--json", "--db", site["urls"]["bob"]])[1])
    held = [g for n in status["nodes"] for g in n["gpus"] if g["job_id"] == a_job]
    assert len(held) == 2 and {g["job"] for g in held} == {"(another team's)"}


@pytest.mark.parametrize("who, team, said", [
    ("bob", "Z", "unknown team 'Z' (teams: A, B)"),
    ("bob", "A", "is not a member of team 'A'"),
    ("carol", None, "is in no team, so it may not submit"),
])
def test_bad_team_input_is_one_line_and_changes_nothing(site, capsys, monkeypatch, who, team, said):
    for name in (TEAM_ENV, DB_URL_ENV):  # `forgeflow submit` sets both for its runner: removed after the test
        monkeypatch.setenv(name, "unset")  # (recorded, so the undo removes what the command sets)
        monkeypatch.delenv(name)
    argv = ["submit", str(REPO / "configs" / "tiny-cpu.yaml"), "--cluster", str(site["inventory"]),
            "--db", site["urls"][who]] + (["--team", team] if team else [])
    code, out, err = _cli(capsys, argv)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and said in err
    with pytest.raises(OrchestratorError, match=said.split(" (")[0].replace("'", ".")):
        _as(site, who).submit("x", demand_options(CLUSTER, 1), team=team)  # the library refuses it too
    assert _raw(site, "olga", "SELECT count(*) FROM jobs") == [(0,)]


def test_team_commands_take_the_operator_role(site, capsys):
    bob = ["--db", site["urls"]["bob"]]
    code, out, err = _cli(capsys, ["cluster", "team", "add", "C", *bob])
    assert code == 2 and "permission denied for table teams" in err and len(err.strip().splitlines()) == 1
    code, out, err = _cli(capsys, ["cluster", "team", "member", "add", "B", site["roles"]["carol"], *bob])
    assert code == 2 and "permission denied for table team_members" in err
    code, out, err = _cli(capsys, ["cluster", "quota", "set", "B", "A100-80G", "4", *bob])  # a later revision's table
    assert code == 2 and "permission denied for table quotas" in err
    olga = ["--db", site["urls"]["olga"]]
    assert _cli(capsys, ["cluster", "quota", "set", "B", "A100-80G", "2", *olga])[0] == 0
    assert _cli(capsys, ["cluster", "team", "member", "add", "Z", site["roles"]["carol"], *olga])[0] == 2
    code, out, err = _cli(capsys, ["cluster", "team", "member", "add", "B", "nobody_at_all", *olga])
    assert code == 2 and "no database role named 'nobody_at_all'" in err
    teams = json.loads(_cli(capsys, ["cluster", "team", "list", "--json", *bob])[1])["teams"]
    assert [(t["team"], t["weight"], [m["member"] for m in t["members"]]) for t in teams] == [
        ("A", 2.0, sorted([site["roles"]["alice"], site["roles"]["anna"]])), ("B", 1.0, [site["roles"]["bob"]])]


def test_the_operators_decider_admits_team_jobs(site, capsys):
    """A team role's process leaves every pass to the decider; `cluster serve` as the operator admits
    its job. As a team role, serve is refused by the database (the decider's columns are an operator's)."""
    import threading

    code, out, err = _cli(capsys, ["cluster", "serve", "--seconds", "1", "--db", site["urls"]["bob"]])
    assert code == 2 and "permission denied for table clusters" in err
    stop = threading.Event()
    decider = threading.Thread(target=_as(site, "olga").serve, kwargs={"stop": stop}, daemon=True)
    decider.start()
    try:
        bob = _as(site, "bob")
        job = bob.submit("bob-train", demand_options(CLUSTER, 1, duration_s=600))
        admission = bob.wait_admitted(job, poll_s=0.1, timeout_s=60)
        assert admission.placement.world_size == 1 and bob.job(job)["submitted_by"] == site["roles"]["bob"]
    finally:
        stop.set()
        decider.join(timeout=30)


def test_a_role_cannot_shadow_the_membership_the_policies_read(site):
    """The policies' functions name their tables and functions with the schema: a role with a schema
    of its own (per-user schemas are common) cannot put a team_members or forgeflow_is_operator of
    its own first in its search_path and so join team A or become an operator."""
    job = _running_job_of_alice(site)
    bob = site["roles"]["bob"]
    owner = sa.create_engine(site["owner"])
    with owner.begin() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{bob}" AUTHORIZATION "{bob}"'))
    owner.dispose()
    engine = sa.create_engine(site["urls"]["bob"])
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(f'SET search_path = "{bob}", public'))
            conn.execute(sa.text(f'CREATE TABLE "{bob}".team_members (member text, team text, is_admin boolean)'))
            conn.execute(sa.text(f"INSERT INTO \"{bob}\".team_members VALUES ('{bob}', 'A', true)"))
            conn.execute(sa.text(f'CREATE FUNCTION "{bob}".forgeflow_is_operator() RETURNS boolean '
                                 "LANGUAGE sql AS $$ SELECT true $$"))
            assert conn.execute(sa.text("SELECT id FROM jobs WHERE id = :j"), {"j": job}).all() == []
            assert conn.execute(sa.text("UPDATE jobs SET stop_requested = '{}' WHERE id = :j"), {"j": job}).rowcount == 0
    finally:
        engine.dispose()


def test_a_role_in_two_teams_says_which(site, capsys, monkeypatch):
    for name in (TEAM_ENV, DB_URL_ENV):  # `forgeflow submit` sets both for its runner: removed after the test
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    assert main(["cluster", "team", "member", "add", "B", site["roles"]["anna"], "--db", site["urls"]["olga"]]) == 0
    capsys.readouterr()
    code, out, err = _cli(capsys, ["submit", str(REPO / "configs" / "tiny-cpu.yaml"), "--cluster",
                                   str(site["inventory"]), "--db", site["urls"]["anna"]])
    assert code == 2 and "is in teams A, B; say which with --team" in err and len(err.strip().splitlines()) == 1
    assert _raw(site, "olga", "SELECT count(*) FROM jobs") == [(0,)]
    job = _as(site, "anna").submit("anna-train", demand_options(CLUSTER, 1), team="B")
    assert _as(site, "olga").job(job)["team"] == "B"


def test_a_preemption_is_recorded_by_the_decider_ended_by_the_victims_role_and_counted_in_usage(site):
    """The decider (operator) asks team A's job to give way to team B's; alice's own flow releases
    it as preempted and ends the record (only its own: bob can neither write nor end records);
    `cluster usage` counts it as suffered by A and caused by B."""
    from scheduler.orchestrator import OrchestratorConfig
    from scheduler.orchestrator.usage import usage

    whole = demand_options(CLUSTER, 4, duration_s=600)
    victim = _as(site, "alice").submit("alice-big", whole)
    decider = Orchestrator(site["urls"]["olga"], OrchestratorConfig(preempt_stop_s=300))
    assert victim in decider.reconcile().admitted
    attempt = _as(site, "alice").admission(victim).attempt
    urgent = _as(site, "bob").submit("bob-urgent", whole, priority=10)
    assert decider.preempt() == {"asked": [[victim, urgent]], "forced": []}
    # bob may not forge a record nor end the one of alice's job
    with pytest.raises(sa.exc.ProgrammingError, match="row-level security|permission denied"):
        _raw(site, "bob", "INSERT INTO preemptions (cluster, job_id, preempted_by, asked_at) "
                          "VALUES ('teams-lab', :j, :j, 0)", j=urgent)
    assert _raw(site, "bob", "UPDATE preemptions SET ended_at = 1 WHERE job_id = :j", j=victim) == 0
    assert usage(decider.engine, since_s=3600)["rows"] == [] or all(
        r["preemptions_suffered"] == 0 for r in usage(decider.engine, since_s=3600)["rows"])

    assert _as(site, "alice").release(victim, outcome="preempted", attempt=attempt) == "running"
    assert decider.job(victim)["state"] == "queued"
    decider.reconcile()
    assert decider.job(urgent)["state"] == "running"
    rows = {r["team"]: r for r in usage(decider.engine, since_s=3600)["rows"]}
    assert (rows["A"]["preemptions_suffered"], rows["A"]["preemptions_caused"]) == (1, 0)
    assert (rows["B"]["preemptions_suffered"], rows["B"]["preemptions_caused"]) == (0, 1)
    records = _raw(site, "bob", "SELECT job_id, preempted_by, ended_at IS NOT NULL, forced FROM preemptions")
    assert [tuple(r) for r in records] == [(victim, urgent, True, False)]
