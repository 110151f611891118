"""Teams on one cluster (issue 30): quotas with borrowing, owners' waiting work, priority classes,
the cluster file's policy, and `forgeflow cluster usage` — on a real PostgreSQL and on SQLite."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import sqlalchemy as sa

from infra.statedb import read_transaction, write_transaction
from infra.statedb.schema import jobs, priority_classes, quotas, teams
from scheduler.cluster import parse_cluster
from scheduler.orchestrator import Orchestrator, OrchestratorConfig, OrchestratorError, demand_options, double_booked
from scheduler.orchestrator.history import over_quota
from scheduler.orchestrator.usage import usage

TWO_CPUS = {"name": "two", "policy": "has",
            "nodes": [{"name": "n1", "gpu_type": "cpu", "gpu_count": 2, "gpu_memory_gib": 16, "peak_tflops": 1}]}


def _orchestrator(url: str, inventory=TWO_CPUS, team_names=("A", "B")) -> Orchestrator:
    orch = Orchestrator(url, OrchestratorConfig(lease_s=600))
    orch.register(parse_cluster(inventory))
    with write_transaction(orch.engine) as conn:
        for name in team_names:
            conn.execute(sa.insert(teams).values(name=name, weight=1.0))
    return orch


def _held(orch: Orchestrator, team: str) -> int:
    with read_transaction(orch.engine) as conn:
        return sum(r.placement["world_size"] for r in conn.execute(sa.select(jobs.c.placement).where(
            jobs.c.team == team, jobs.c.state == "running")))


def test_a_team_keeps_to_its_quota_while_the_owner_waits_and_borrows_when_it_is_idle(state_db_url):
    orch = _orchestrator(state_db_url)
    other = Orchestrator(state_db_url, OrchestratorConfig(lease_s=600))  # a second process's view
    orch.set_quota("A", "cpu", 1, 1)
    orch.set_quota("B", "cpu", 1, 1)
    one = demand_options(orch.cluster(), 1, duration_s=10)
    b1 = orch.submit("b1", one, team="B")
    a1, a2, a3 = (other.submit(f"a{i}", one, team="A") for i in (1, 2, 3))
    b2 = orch.submit("b2", one, team="B")
    assert [orch.job(j)["state"] for j in (b1, a1, a2, a3, b2)] == ["running", "running", "queued", "queued", "queued"]
    other.release(b1)  # the free CPU goes to B's waiting job, not to A's earlier borrower
    assert orch.job(b2)["state"] == "running" and _held(orch, "A") == 1
    orch.release(b2)  # B is idle: A borrows B's quota
    assert orch.job(a2)["state"] == "running" and _held(orch, "A") == 2
    b3 = other.submit("b3", one, team="B")  # B waits for a running borrower to end (no preemption yet)
    assert orch.job(b3)["state"] == "queued"
    orch.release(a1)  # A's own job ends: B gets its quota back before A's next borrower
    assert orch.job(b3)["state"] == "running" and orch.job(a3)["state"] == "queued" and _held(orch, "A") == 1
    for job in (a2, b3):
        other.release(job)
    assert orch.job(a3)["state"] == "running"
    assert over_quota(orch.engine, "two") == 0 and double_booked(orch.engine) == 0


def test_priority_classes_and_team_caps(state_db_url):
    orch = _orchestrator(state_db_url)
    one = demand_options(orch.cluster(), 1, duration_s=10)
    assert orch.job(orch.submit("plain", one, priority=5))["priority"] == 5  # no class defined: an integer
    with write_transaction(orch.engine) as conn:
        conn.execute(sa.insert(priority_classes), [{"name": "low", "value": -10}, {"name": "normal", "value": 0},
                                                   {"name": "urgent", "value": 100}])
    from scheduler.orchestrator.quotas import set_cap
    with write_transaction(orch.engine) as conn:
        set_cap(conn, "B", "normal")
    assert orch.job(orch.submit("u", one, priority="urgent", team="A"))["priority"] == 100
    with read_transaction(orch.engine) as conn:
        before = conn.execute(sa.select(sa.func.count()).select_from(jobs)).scalar()
    with pytest.raises(OrchestratorError, match="team 'B' may submit at most at class 'normal'"):
        orch.submit("u", one, priority="urgent", team="B")
    with pytest.raises(OrchestratorError, match="no priority class named 'top'"):
        orch.submit("u", one, priority="top", team="B")
    with pytest.raises(OrchestratorError, match="give one by name"):
        orch.submit("u", one, priority=7)
    with read_transaction(orch.engine) as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(jobs)).scalar() == before


def test_the_cluster_file_chooses_the_policy(state_db_url):
    inventory = {**TWO_CPUS, "policy": "easy"}
    orch = Orchestrator(state_db_url, OrchestratorConfig(lease_s=600))
    orch.register(parse_cluster(inventory))
    cluster = orch.cluster()
    long = orch.submit("long", demand_options(cluster, 1, duration_s=1000))
    head = orch.submit("head", demand_options(cluster, 2, duration_s=10))  # waits for `long`
    short = orch.submit("short", demand_options(cluster, 1, duration_s=1))  # ends before head's start
    late = orch.submit("late", demand_options(cluster, 1, duration_s=5000))  # would delay the head
    assert orch.policy == "easy"
    assert [orch.job(j)["state"] for j in (long, head, short, late)] == ["running", "queued", "running", "queued"]
    orch.release(short)
    assert orch.job(late)["state"] == "queued"  # never past the head's reservation
    orch.release(long)
    assert orch.job(head)["state"] == "running"


def _cli(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args, "--db", url], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow  # ~30-40 s on 2 cores per database: a CLI process per bad input
def test_operator_commands_refuse_bad_input_with_one_line(state_db_url):
    orch = _orchestrator(state_db_url)
    ok = _cli(state_db_url, "cluster", "quota", "set", "A", "cpu", "1", "--borrow", "1")
    assert ok.returncode == 0, ok.stderr
    for args, says in ((("cluster", "quota", "set", "B", "cpu", "3"), "larger than cluster 'two''s 2"),
                       (("cluster", "quota", "set", "B", "cpu", "2"), "add up to more than"),
                       (("cluster", "quota", "set", "C", "cpu", "1"), "no team named 'C'"),
                       (("cluster", "team", "cap", "A", "urgent"), "no priority class named 'urgent'")):
        bad = _cli(state_db_url, *args)
        assert bad.returncode == 2 and says in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert _cli(state_db_url, "cluster", "class", "add", "urgent", "100").returncode == 0
    assert _cli(state_db_url, "cluster", "team", "cap", "A", "urgent").returncode == 0
    with read_transaction(orch.engine) as conn:
        assert conn.execute(sa.select(quotas.c.team, quotas.c.nominal)).all() == [("A", 1)]


def test_usage_is_the_sum_over_the_allocation_history(state_db_url):
    orch = _orchestrator(state_db_url)
    one = demand_options(orch.cluster(), 1, duration_s=10)
    a, b = orch.submit("a", one, team="A"), orch.submit("b", one, team="B")
    orch.release(a)
    report = usage(orch.engine, since_s=3600)
    with read_transaction(orch.engine) as conn:
        rows = conn.execute(sa.text("SELECT j.team, a.allocated_at, a.released_at FROM allocations a "
                                    "JOIN jobs j ON j.id = a.job_id")).all()
    by_team = {r["team"]: r for r in report["rows"]}
    a_row = next(r for r in rows if r[0] == "A")
    assert by_team["A"]["gpu_hours"] == {"cpu": pytest.approx((a_row[2] - a_row[1]) / 3600)}
    assert by_team["B"]["gpu_hours_total"] > 0 and by_team["A"]["admissions"] == 1
    out = _cli(state_db_url, "cluster", "usage", "--since", "1h", "--by", "team", "--json")
    assert out.returncode == 0 and {r["team"] for r in json.loads(out.stdout)["rows"]} == {"A", "B"}
    bad = _cli(state_db_url, "cluster", "usage", "--since", "soon")
    assert bad.returncode == 2 and "--since 'soon'" in bad.stderr
    orch.release(b)


def test_forgeflow_jobs_says_a_job_waits_for_its_teams_quota(state_db_url):
    from scheduler.orchestrator.start_estimates import queue_estimates

    orch = _orchestrator(state_db_url)
    orch.set_quota("A", "cpu", 1, 0)
    one = demand_options(orch.cluster(), 1, duration_s=10)
    a1, a2 = orch.submit("a1", one, team="A"), orch.submit("a2", one, team="A")
    assert orch.job(a2)["state"] == "queued"  # a CPU is idle, but A may not borrow it
    estimate = queue_estimates(orch.engine, "two")[a2]
    assert estimate.reason == "quota" and "team 'A' holds 1 of its 1 cpu" in estimate.why
    orch.release(a1)
    assert orch.job(a2)["state"] == "running"


def test_a_job_queued_before_easy_lists_existed_runs_when_the_cluster_switches_to_easy(state_db_url):
    orch = Orchestrator(state_db_url, OrchestratorConfig(lease_s=600))
    orch.register(parse_cluster(TWO_CPUS))
    both = demand_options(orch.cluster(), 2, duration_s=10)
    first, old = orch.submit("first", both), orch.submit("old", both)
    with write_transaction(orch.engine) as conn:  # stored as before issue 30: no EASY/SJF list
        stored = dict(conn.execute(sa.select(jobs.c.options).where(jobs.c.id == old)).scalar())
        conn.execute(sa.update(jobs).where(jobs.c.id == old).values(options={**stored, "easy": [], "sjf": []}))
    switched = Orchestrator(state_db_url, OrchestratorConfig(lease_s=600))
    switched.register(parse_cluster({**TWO_CPUS, "policy": "easy"}))
    from scheduler.orchestrator.start_estimates import queue_estimates
    assert queue_estimates(switched.engine, "two")[old].reason == "no_room"  # not 'infeasible'
    switched.release(first)
    assert switched.policy == "easy" and switched.job(old)["state"] == "running"


def test_submit_at_a_class_above_the_teams_cap_is_one_line_and_queues_nothing(state_db_url, tmp_path):
    import os
    from pathlib import Path

    orch = _orchestrator(state_db_url)
    with write_transaction(orch.engine) as conn:
        conn.execute(sa.insert(priority_classes), [{"name": "normal", "value": 0}, {"name": "urgent", "value": 100}])
    assert _cli(state_db_url, "cluster", "team", "cap", "B", "normal").returncode == 0
    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "FORGEFLOW_DB_URL": state_db_url, "FORGEFLOW_STATE_DIR": str(tmp_path / "state")}
    out = subprocess.run([sys.executable, "-m", "flows.cli", "submit", str(repo / "configs" / "tiny-cpu.yaml"),
                          "--team", "B", "--priority", "urgent"], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env=env)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == ["error: team 'B' may submit at most at class 'normal'; give one of: normal"]
    with read_transaction(orch.engine) as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(jobs)).scalar() == 0


def test_a_new_weight_reaches_a_process_that_keeps_its_view(state_db_url):
    from scheduler.orchestrator.teams import add_team

    orch = _orchestrator(state_db_url)  # teams A and B, weight 1 each, no quota
    cluster = orch.cluster()
    two = demand_options(cluster, 2, duration_s=100)
    a_used, b_used = orch.submit("a-used", demand_options(cluster, 1, duration_s=9), team="A"), \
        orch.submit("b-used", demand_options(cluster, 1, duration_s=9), team="B")
    time.sleep(0.3)
    orch.release(b_used)  # B used 1 CPU for 0.3 s, A keeps going: A has used more
    time.sleep(0.3)
    orch.release(a_used)
    holder = orch.submit("holder", two)
    b = orch.submit("b", two, team="B")  # first in arrival order; only one of the two fits after holder
    a = orch.submit("a", two, team="A")
    add_team(orch.engine, "A", 1000.0)  # now A's usage over its weight is below B's
    orch.rules_changed()  # what `forgeflow cluster team add` calls: this process's view reads it back
    orch.release(holder)
    assert orch.job(a)["state"] == "running" and orch.job(b)["state"] == "queued"


def test_the_queue_people_see_is_the_order_the_next_pass_takes(state_db_url):
    """`forgeflow cluster queue`, `forgeflow jobs` and a waiting job's position show the queue in
    fair-share order (a team that used less goes first within a priority), the order the pass
    admits in: before, they showed arrival order, so the job shown second started first."""
    from scheduler.orchestrator.start_estimates import queue_estimates
    from scheduler.orchestrator.views import job_list, queue_snapshot

    _orchestrator(state_db_url)  # the teams, written behind its back: a process that starts after them
    orch = Orchestrator(state_db_url, OrchestratorConfig(lease_s=600))
    both = demand_options(orch.cluster(), 2, duration_s=10)
    hog = orch.submit("hog", both, team="A")  # A uses both CPUs from now on
    a1 = orch.submit("a1", both, team="A")
    b1 = orch.submit("b1", both, team="B")  # later, but B has used nothing
    time.sleep(0.05)
    assert [orch.job(j)["state"] for j in (hog, a1, b1)] == ["running", "queued", "queued"]
    assert orch.queue_position(b1) == (1, 2) and orch.queue_position(a1) == (2, 2)
    assert [j["job_id"] for j in queue_snapshot(orch.engine, "two")["queued"]] == [b1, a1]
    assert {e.job_id: e.position for e in queue_estimates(orch.engine, "two").values()} == {b1: 1, a1: 2}
    listed = {j["job_id"]: j.get("position") for j in job_list(orch.engine, cluster="two")["jobs"]}
    assert listed[b1] == 1 and listed[a1] == 2
    orch.release(hog)
    assert orch.job(b1)["state"] == "running" and orch.job(a1)["state"] == "queued"  # position 1 went first
