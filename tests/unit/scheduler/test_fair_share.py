"""The admission decision over a snapshot: quotas with borrowing, owners' waiting work, fair-share order."""

from __future__ import annotations

import math

import pytest

from scheduler.cluster import parse_cluster
from scheduler.fair_share import (
    DecayedUsage, Quota, RunningJob, Snapshot, TeamRules, decayed_gpu_s, decide, fair_order, holdings, team_usage,
)
from scheduler.policy import Busy, FreeGpus, Option, QueuedJob

ONE = (Option("cpu", 1, 1, 0, 10.0),)


def _cluster(gpus: int = 2):
    return parse_cluster({"name": "c", "nodes": [{"name": "n", "gpu_type": "cpu", "gpu_count": gpus,
                                                 "gpu_memory_gib": 16, "peak_tflops": 1}]})


def _decide(queue, team_of, rules, held=None, usage=None, gpus=2, busy=0, policy="has", running=()):
    cluster = _cluster(gpus)
    if busy:
        cluster.allocate("n", list(range(busy)))
    snap = Snapshot(policy, 0.0, queue, list(running), FreeGpus(cluster), rules, team_of, {}, held or {}, usage or {})
    started, _ = decide(snap)
    return [job.job_id for job, _, _ in started]


RULES = TeamRules({("A", "cpu"): Quota(1, 1), ("B", "cpu"): Quota(1, 1)})


def test_team_holds_its_nominal_quota_while_the_owner_of_the_rest_waits():
    queue = [QueuedJob("a2", 1, ONE), QueuedJob("a3", 2, ONE), QueuedJob("b1", 3, ONE)]
    team_of = {"a2": "A", "a3": "A", "b1": "B"}
    # A holds 1 (its quota), one CPU idle: B's waiting job gets it, not A's earlier borrower
    assert _decide(queue, team_of, RULES, held={("A", "cpu"): 1}, busy=1) == ["b1"]


def test_idle_quota_is_borrowed_up_to_the_limit():
    queue = [QueuedJob("a1", 1, ONE), QueuedJob("a2", 2, ONE), QueuedJob("a3", 3, ONE)]
    team_of = {j.job_id: "A" for j in queue}
    assert _decide(queue, team_of, RULES, gpus=4) == ["a1", "a2"]  # nominal 1 + borrow 1
    unlimited = TeamRules({("A", "cpu"): Quota(1, None), ("B", "cpu"): Quota(1, 1)})
    assert _decide(queue, team_of, unlimited, gpus=2) == ["a1", "a2"]  # B's idle quota only: 2 CPUs
    assert _decide(queue, team_of, unlimited, gpus=3) == ["a1", "a2", "a3"]


def test_no_quota_no_gate():
    queue = [QueuedJob(f"a{i}", i, ONE) for i in range(3)]
    assert _decide(queue, {j.job_id: "A" for j in queue}, TeamRules(), gpus=3) == ["a0", "a1", "a2"]


def test_team_without_quota_uses_idle_quota_only():
    queue = [QueuedJob("x1", 1, ONE), QueuedJob("b1", 2, ONE)]
    rules = TeamRules({("B", "cpu"): Quota(2, 0)})
    assert _decide(queue, {"x1": "", "b1": "B"}, rules, gpus=2) == ["b1"]  # B waits: its quota is claimed
    assert _decide(queue[:1], {"x1": ""}, rules, gpus=2) == ["x1"]


def test_a_refused_job_does_not_make_equal_options_look_full():
    # a1 and b1 share one options tuple: A's refusal must not skip B's job
    queue = [QueuedJob("a1", 1, ONE), QueuedJob("b1", 2, ONE)]
    rules = TeamRules({("A", "cpu"): Quota(0, 0), ("B", "cpu"): Quota(1, 0)})
    assert _decide(queue, {"a1": "A", "b1": "B"}, rules, gpus=1) == ["b1"]


def test_easy_head_held_back_by_quota_reserves_nothing():
    long = (Option("cpu", 1, 1, 0, 100.0),)
    queue = [QueuedJob("a1", 1, ONE), QueuedJob("b1", 2, long)]
    rules = TeamRules({("A", "cpu"): Quota(1, 0), ("B", "cpu"): Quota(1, 0)})
    running = [Busy("cpu", 1, 5.0)]
    # A already holds its quota: a1 is not the head; B's job starts on the idle CPU
    assert _decide(queue, {"a1": "A", "b1": "B"}, rules, held={("A", "cpu"): 1}, busy=1,
                   policy="easy", running=running) == ["b1"]


def test_fair_order_within_a_class_by_usage_over_weight():
    queue = [QueuedJob("a1", 1, ONE), QueuedJob("b1", 2, ONE), QueuedJob("c1", 3, ONE), QueuedJob("c2", 4, ONE)]
    team_of = {"a1": "A", "b1": "B", "c1": "C", "c2": "C"}
    rules = TeamRules(weights={"A": 2.0, "B": 1.0, "C": 1.0})
    usage = {"A": 100.0, "B": 60.0, "C": 10.0}  # over weight: A 50, B 60, C 10
    assert [j.job_id for j in fair_order(queue, team_of, {}, usage, rules)] == ["c1", "c2", "a1", "b1"]
    # a higher class goes first whatever its team used
    order = fair_order(queue, team_of, {"b1": 10}, usage, rules)
    assert [j.job_id for j in order] == ["b1", "c1", "c2", "a1"]


def test_decayed_usage_halves_every_half_life():
    h = 3600.0
    assert decayed_gpu_s(2, 0, 10, 10, 1e12) == pytest.approx(20.0)
    whole = decayed_gpu_s(1, 0, 100, 100, h)
    assert decayed_gpu_s(1, 0, 100, 100 + h, h) == pytest.approx(whole / 2)
    usage = DecayedUsage(h)
    usage.add("A", 1, 0, 100)
    usage.add("A", 1, 50, 60)  # ended earlier than the last one: still decayed from its own end
    assert usage.at("A", 100 + h) == pytest.approx((whole + decayed_gpu_s(1, 50, 60, 100, h)) / 2)
    running = [RunningJob("B", "cpu", 4, 0.0), RunningJob("A", "cpu", 1, 50.0)]
    now = 100.0
    got = team_usage(usage, running, now)
    assert got["B"] == pytest.approx(decayed_gpu_s(4, 0, now, now, h))
    assert got["A"] == pytest.approx(usage.at("A", now) + decayed_gpu_s(1, 50, now, now, h))
    assert holdings(running) == {("B", "cpu"): 4, ("A", "cpu"): 1}
    assert math.isfinite(DecayedUsage(1.0).at("x", 1e9))


def test_the_reserved_head_stays_first_of_its_class():
    queue = [QueuedJob("a1", 1, ONE), QueuedJob("b1", 2, ONE)]
    team_of = {"a1": "A", "b1": "B"}
    usage = {"A": 100.0, "B": 0.0}
    assert [j.job_id for j in fair_order(queue, team_of, {}, usage, TeamRules())] == ["b1", "a1"]
    assert [j.job_id for j in fair_order(queue, team_of, {}, usage, TeamRules(), head="a1")] == ["a1", "b1"]
    assert [j.job_id for j in fair_order(queue, team_of, {"b1": 5}, usage, TeamRules(), head="a1")] == ["b1", "a1"]


def test_easy_reserves_only_within_nominal_quota():
    two = (Option("cpu", 2, 1, 0, 10.0),)
    cluster = _cluster(2)
    cluster.allocate("n", [0])
    running = [Busy("cpu", 1, 5.0)]
    rules = TeamRules({("A", "cpu"): Quota(1, 1), ("B", "cpu"): Quota(1, 1)})
    # A's 2-CPU job would borrow: no reservation, so B's short job is not held back by it
    snap = Snapshot("easy", 0.0, [QueuedJob("a1", 1, two), QueuedJob("b1", 2, ONE)], running, FreeGpus(cluster),
                    rules, {"a1": "A", "b1": "B"}, {}, {("A", "cpu"): 0}, {})
    started, _ = decide(snap)
    assert [j.job_id for j, _, _ in started] == ["b1"] and snap.free.reservation is None
    # within quota, the head reserves the CPU that frees at t=5: a long job behind it waits
    long = (Option("cpu", 1, 1, 0, 100.0),)
    cluster = _cluster(2)
    cluster.allocate("n", [0])
    rules = TeamRules({("A", "cpu"): Quota(2, 0), ("B", "cpu"): Quota(0, None)})
    snap = Snapshot("easy", 0.0, [QueuedJob("a1", 1, two), QueuedJob("b1", 2, long)], running, FreeGpus(cluster),
                    rules, {"a1": "A", "b1": "B"}, {}, {}, {})
    started, _ = decide(snap)
    assert started == [] and snap.free.reservation == ("a1", "cpu", 5.0)


def test_a_waiting_head_keeps_its_teams_quota_from_the_teams_later_jobs():
    two = (Option("cpu", 2, 1, 0, 10.0),)
    rules = TeamRules({("A", "cpu"): Quota(2, 2), ("B", "cpu"): Quota(2, 2)})
    cluster = _cluster(4)
    cluster.allocate("n", [0, 1, 2])  # A holds 1 (its 2-CPU head waits), B holds 2
    queue = [QueuedJob("a-head", 1, two), QueuedJob("a-small", 2, ONE)]
    snap = Snapshot("easy", 0.0, queue, [Busy("cpu", 1, 5.0), Busy("cpu", 2, 9.0)], FreeGpus(cluster), rules,
                    {"a-head": "A", "a-small": "A"}, {}, {("A", "cpu"): 1, ("B", "cpu"): 2}, {}, head="a-head")
    started, _ = decide(snap)
    # the idle CPU would keep A at 2 of 2 until a-small ends, over quota for the head when A's
    # running job ends; the head (over its quota now) reserves nothing yet
    assert started == [] and snap.free.reservation is None
    snap.head = None  # without a head, the small job takes A's last nominal CPU
    started, _ = decide(snap)
    assert [j.job_id for j, _, _ in started] == ["a-small"]


def test_ect_keeps_fair_share_order_and_orders_by_response_ratio_within_a_team():
    """ECT orders by highest response ratio; with teams that is within a team's rank of the
    fair-share order, never across it: the team that used less goes first even when the other's
    job has waited longer (and so has the higher ratio)."""
    short = (Option("cpu", 1, 1, 0, 10.0),)
    queue = [QueuedJob("a_old", -100.0, short), QueuedJob("b_new", 0.0, short), QueuedJob("a_newer", -50.0, short)]
    team_of = {"a_old": "A", "b_new": "B", "a_newer": "A"}
    usage = {"A": 1000.0, "B": 0.0}
    assert _decide(queue, team_of, TeamRules(), usage=usage, gpus=1, policy="ect") == ["b_new"]
    # among A's jobs (equal rank), the higher response ratio goes first
    assert _decide(queue, team_of, TeamRules(), usage=usage, gpus=2, policy="ect") == ["b_new", "a_old"]
    # one team: plain HRRN
    assert _decide(queue, {j.job_id: "A" for j in queue}, TeamRules(), gpus=1, policy="ect") == ["a_old"]


def test_ect_reserves_only_within_nominal_quota():
    """A borrower's reservation would hold future GPUs beyond its team's quota, and an owner's
    job within quota could not backfill around it: with quotas, only a job within its team's
    nominal quota reserves under ECT (as under EASY)."""
    rules = TeamRules({("A", "cpu"): Quota(2, None), ("B", "cpu"): Quota(2, None)})
    big = (Option("cpu", 4, 1, 0, 100.0),)   # A would hold 2 + 4 > 2: a borrower
    long = (Option("cpu", 2, 1, 0, 200.0),)  # B holds 0: within its quota
    queue = [QueuedJob("a_big", -10.0, big), QueuedJob("b_long", 0.0, long)]
    running = [Busy("cpu", 2, 100.0)]        # A's job on 2 of the 4 CPUs until t=100
    started = _decide(queue, {"a_big": "A", "b_long": "B"}, rules, held={("A", "cpu"): 2},
                      usage={"A": 0.0, "B": 50.0}, gpus=4, busy=2, policy="ect", running=running)
    assert started == ["b_long"]
