"""Registering a changed inventory (a node removed, a node with fewer GPUs) on SQLite and PostgreSQL.

A node that once ran a job keeps released allocation rows that point at its GPUs; removing
or shrinking it must still work (those rows go, the history in `allocation_events` stays),
and it must be refused with one clear error while a job holds a GPU that would go.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa
import yaml

from flows.cli import main
from infra.statedb import read_transaction
from infra.statedb.schema import allocation_events, allocations, gpus, nodes
from scheduler.cluster import parse_cluster
from scheduler.orchestrator import Orchestrator, OrchestratorConfig, OrchestratorError, demand_options, double_booked

N1 = {"name": "n1", "gpu_type": "A100-80G", "gpu_count": 4}
N2 = {"name": "n2", "gpu_type": "A100-80G", "gpu_count": 4}
TWO = {"name": "c", "nodes": [N1, N2]}


def _orchestrator(url: str) -> Orchestrator:
    o = Orchestrator(url, OrchestratorConfig(policy="has", lease_s=600))
    o.register(parse_cluster(TWO))
    return o


def _inventory(*node_specs: dict) -> object:
    return parse_cluster({"name": "c", "nodes": list(node_specs)})


def _gpu_rows(o: Orchestrator) -> dict[str, list[int]]:
    with read_transaction(o.engine) as conn:
        rows = conn.execute(sa.select(gpus.c.node, gpus.c.gpu_index).order_by(gpus.c.node, gpus.c.gpu_index)).all()
    out: dict[str, list[int]] = {}
    for node, gpu in rows:
        out.setdefault(node, []).append(gpu)
    return out


def _count(o: Orchestrator, table: sa.Table, *where) -> int:
    with read_transaction(o.engine) as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(table).where(*where)).scalar_one()


def _run_and_finish(o: Orchestrator, count: int) -> int:
    job = o.submit("done", demand_options(o.cluster("c"), count))
    assert o.job(job)["state"] == "running"
    o.release(job)
    return job


def test_a_node_that_ran_a_job_can_be_removed(state_db_url):
    o = _orchestrator(state_db_url)
    _run_and_finish(o, 8)  # every GPU of both nodes has a released allocation
    events_before = _count(o, allocation_events)

    summary = o.register(_inventory(N1))

    assert summary["removed"] == ["n2"] and summary["gpus"] == 4
    assert _gpu_rows(o) == {"n1": [0, 1, 2, 3]}
    assert _count(o, allocations, allocations.c.node == "n2") == 0  # released rows of n2 went with it
    assert _count(o, allocations, allocations.c.node == "n1") == 4  # n1's stay
    assert _count(o, allocation_events) == events_before  # the history is untouched
    assert _count(o, allocation_events, allocation_events.c.node == "n2") == 8  # 4 allocate + 4 release
    assert double_booked(o.engine, "c") == 0
    # the cluster keeps working, and n2 can come back
    job = o.submit("after", demand_options(o.cluster("c"), 4))
    assert o.admission(job).placement.nodes == ["n1"]
    o.register(_inventory(N1, N2))
    both = o.submit("both", demand_options(o.cluster("c"), 4))
    assert o.admission(both).placement.nodes == ["n2"]
    assert double_booked(o.engine, "c") == 0


def test_a_node_that_ran_a_job_can_be_shrunk_and_grown_again(state_db_url):
    o = _orchestrator(state_db_url)
    _run_and_finish(o, 8)

    summary = o.register(_inventory(N1, {**N2, "gpu_count": 2}))

    assert summary["removed"] == [] and summary["gpus"] == 6
    assert _gpu_rows(o) == {"n1": [0, 1, 2, 3], "n2": [0, 1]}
    with read_transaction(o.engine) as conn:
        kept = conn.execute(sa.select(allocations.c.gpu_index).where(allocations.c.node == "n2")).scalars().all()
    assert sorted(kept) == [0, 1]
    assert double_booked(o.engine, "c") == 0
    o.register(_inventory(N1, N2))  # grown back: GPUs 2 and 3 return and can be allocated
    job = o.submit("grown", demand_options(o.cluster("c"), 8))
    assert o.job(job)["state"] == "running"
    assert double_booked(o.engine, "c") == 0


def test_removing_a_node_a_running_job_holds_is_refused_and_changes_nothing(state_db_url):
    o = _orchestrator(state_db_url)
    _run_and_finish(o, 8)
    held = o.submit("trainer", demand_options(o.cluster("c"), 8))
    assert o.job(held)["state"] == "running"
    with read_transaction(o.engine) as conn:
        before = conn.execute(sa.select(allocations).order_by(allocations.c.id)).all()

    with pytest.raises(OrchestratorError) as refused:
        o.register(_inventory(N1))

    message = str(refused.value)
    assert "'n2' (removed)" in message and "[0, 1, 2, 3]" in message
    assert f"{held} (trainer)" in message and "forgeflow cluster drain" in message
    assert _gpu_rows(o) == {"n1": [0, 1, 2, 3], "n2": [0, 1, 2, 3]}
    with read_transaction(o.engine) as conn:
        assert conn.execute(sa.select(allocations).order_by(allocations.c.id)).all() == before
        assert conn.execute(sa.select(sa.func.count()).select_from(nodes)).scalar_one() == 2


def test_shrinking_a_node_below_gpus_a_job_holds_is_refused(state_db_url):
    o = _orchestrator(state_db_url)
    whole = o.submit("whole", demand_options(o.cluster("c"), 8))

    with pytest.raises(OrchestratorError) as refused:
        o.register(_inventory(N1, {**N2, "gpu_count": 2}))

    message = str(refused.value)
    assert "'n2' (shrunk to 2 GPU(s))" in message and "[2, 3]" in message and f"{whole} (whole)" in message
    assert _gpu_rows(o)["n2"] == [0, 1, 2, 3]
    o.release(whole)


def test_shrinking_a_node_under_gpus_nobody_holds_is_allowed(state_db_url):
    o = _orchestrator(state_db_url)
    small = o.submit("small", demand_options(o.cluster("c"), 2))
    node, held_gpus = next(iter(o.admission(small).placement.gpu_map().items()))
    assert sorted(held_gpus) == [0, 1]
    _run_and_finish(o, 2)  # a released allocation on the other node, maybe on GPUs 2, 3
    shrunk = [{**n, "gpu_count": 2} if n["name"] == node else n for n in (N1, N2)]

    o.register(_inventory(*shrunk))

    assert _gpu_rows(o)[node] == [0, 1]
    assert o.job(small)["state"] == "running"
    o.release(small)
    assert double_booked(o.engine, "c") == 0


def test_cli_refuses_removing_a_held_node_with_one_line_and_exit_2(state_db_url, tmp_path, capsys):
    two, one = tmp_path / "two.yaml", tmp_path / "one.yaml"
    two.write_text(yaml.safe_dump(TWO))
    one.write_text(yaml.safe_dump({"name": "c", "nodes": [N1]}))
    db = ["--db", state_db_url]
    assert main(["cluster", "register", str(two), *db]) == 0
    o = Orchestrator(state_db_url)
    held = o.submit("trainer", demand_options(o.cluster("c"), 8))
    capsys.readouterr()

    assert main(["cluster", "register", str(one), *db]) == 2

    err = capsys.readouterr().err
    assert err.startswith("error: cannot register this inventory of cluster 'c'")
    assert err.count("\n") == 1 and "Traceback" not in err and f"{held} (trainer)" in err
    o.release(held)  # and once the job is done, the same command works
    assert main(["cluster", "register", str(one), *db]) == 0
