"""How close `forgeflow jobs`' estimated start of a queued job comes to when it really starts.

What is replayed: the Acme-like job mix (`scheduler.traces.generate_acme_trace`: ~93 % short
evaluation jobs, ~3 % pretraining jobs holding ~94 % of GPU time) at offered load 0.8 of the
cluster's effective capacity (as benchmarks/simulate_policies.py sets it), with the simulator's
runtime noise (`apply_runtime_noise`, sigma 0.3: a job's true run time is its predicted run time
x a log-normal factor, the prediction its median), on a lab cluster of 16 nodes x 8 A100-80G
(NVLink) and 16 nodes x 4 A40 (192 GPUs); `--jobs` (400) jobs, options from the simulator's
`JobCatalogue` (MARP plans), HAS policy.

How: through the LIVE orchestrator (`Orchestrator.submit` / `release`, every decision one
transaction) on its SQLite state database, in virtual time: the clocks the orchestrator stamps its
rows with (`scheduler.orchestrator.service`'s `time.time`, and the database's clock, which on
SQLite is the time each transaction reads once it holds the lock, `infra.statedb.transactions`)
are the replay's, advanced from event to event (arrivals from the trace; ends at admission + true run
time, when the job is released); leases are set longer than the replay, so none lapses. A running
training job (pretrain, SFT) reports its progress at every event as its flow would
(`Orchestrator.report_progress`: step reached, steps, and rank 0's last step time, which is the
job's true mean step time (true run time / steps) x a log-normal step-to-step jitter, sigma
STEP_JITTER = 0.1, drawn per report); evaluation jobs report none, so their end is the cost model's
prediction only. (The replay's jobs never fail or slow down mid-run, so a measured step time is a
better guide here than on a real cluster: `eta_without_progress_*` is the same estimate with
every report ignored, the other bound.) After each
event the state is read back with `start_estimates.read_queue_state` (what `forgeflow jobs` reads);
the database does not change between events, so an estimate "at time t" is
`estimate_starts(state read after the last event before t, now=t)`: exactly what a `forgeflow
jobs` at t would print.

Per job that waited at least MIN_WAIT_S (60 virtual seconds; shorter waits make a percentage
meaningless), two estimates: at submit (the state right after its submission) and one quarter of
the way through its real wait. Error = |estimated start - real start| / real wait, in percent (=
|estimated wait - real wait| / real wait, both waits counted from submission). A job the estimate
says cannot start (none here: no node is cordoned) counts 100 %.

Keys: `eta_median_abs_error_pct` (quarter-wait; goal <= 25), `eta_p90_abs_error_pct`,
`eta_at_submit_median_abs_error_pct`, `baseline_median_abs_error_pct` (quarter-wait) and
`baseline_at_submit_median_abs_error_pct`, `eta_without_progress_median_abs_error_pct` (the same
estimate with the running jobs' progress ignored: what the measured step time buys), `jobs`,
`waited_jobs` (those scored), `min_wait_s`, `trace_seed`, `estimate_ms_p50` (one estimate of a
whole queue).

Baseline (fair: the same predicted run times, no policy, no progress): for a queued job whose
first option runs on GPU type T, now + (remaining predicted GPU-seconds of the jobs running on T,
each max(0, admitted + predicted run time - now) x its GPUs, plus predicted run time x GPUs of
every job ahead of it in the queue whose first option is on T) / the cluster's GPUs of type T:
the backlog ahead of it drained at full width. (While every GPU of the type is busy that backlog
drains one second per second, so the baseline's start stays put until a job starts or ends off
its prediction: its submit and quarter-wait figures are often the same.)

Why SQLite: since queue and lease times come from the database's clock (`db_now()`: PostgreSQL's
`transaction_timestamp()`), a replay on PostgreSQL stamps admissions with the real time while
its events run in virtual time, and every figure that reads an admission time is wrong by the
Unix epoch (seen 2026-11-29: baseline 2,314,285 %). The estimate reads the same rows through
the same code (`read_queue_state`) on either database, so the figures do not depend on which.

Held out: the reported figure is trace seed 7, chosen before any tuning and first run once the
estimator and this script were final; development used seeds 0, 1 and 2 (`--seed`). Measured
(2026-11-28, this 2-core box): seed 7, 226 of 400 jobs waited (median 15.3 h): median error 5.6 %
at a quarter of the wait, p90 21.9 %, 6.9 % at submit; without progress 11.3 %; baseline 169 %.
Development seeds, quarter-wait median / p90 / at submit / baseline: 0: 6.4 / 12.0 / 5.7 / 124 %;
1: 5.9 / 13.1 / 6.0 / 101 %; 2: 6.7 / 13.5 / 8.6 / 65 %.
Measured 2026-11-29 on SQLite, after fair-share ordering (issue 30) and the database's clock
(issue 28): seed 7, 221 of 400 jobs waited: 7.1 % at a quarter of the wait, p90 19.6 %, 8.2 % at
submit; without progress 13.4 %; baseline 142.9 %.

Run:  .venv/bin/python benchmarks/queue_eta.py [--jobs 400] [--seed 7]
      .venv/bin/python benchmarks/queue_eta.py --smoke   # 60 jobs (seed 0) on 4 + 4 nodes: seconds, same keys
Last line: one JSON object (HEADLINE_KEYS).
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import math
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.headline import checked_headline  # noqa: E402
from infra.statedb import forget_engines  # noqa: E402
from scheduler.cluster import Cluster, parse_cluster  # noqa: E402
from scheduler.orchestrator import Orchestrator, OrchestratorConfig  # noqa: E402
import infra.statedb.transactions as statedb_transactions  # noqa: E402
import scheduler.orchestrator.service as orchestrator_service  # noqa: E402
from scheduler.orchestrator.start_estimates import QueueState, estimate_starts, read_queue_state  # noqa: E402
from scheduler.simulate import JobCatalogue, effective_capacity  # noqa: E402
from scheduler.traces import apply_runtime_noise, generate_acme_trace  # noqa: E402

HEADLINE_KEYS = (
    "eta_median_abs_error_pct", "eta_p90_abs_error_pct", "eta_at_submit_median_abs_error_pct",
    "baseline_median_abs_error_pct", "baseline_at_submit_median_abs_error_pct",
    "eta_without_progress_median_abs_error_pct", "jobs", "waited_jobs", "min_wait_s", "trace_seed",
    "estimate_ms_p50",
)
HELD_OUT_SEED = 7
LOAD, SIGMA = 0.8, 0.3
STEP_JITTER = 0.1
MIN_WAIT_S = 60.0


def lab_cluster(a100_nodes: int = 16, a40_nodes: int = 16) -> Cluster:
    return parse_cluster({"name": "lab", "inter_node_bandwidth_gbps": 200, "nodes": [
        {"name": "a100", "replicas": a100_nodes, "gpu_type": "A100-80G", "gpu_count": 8, "intra_link": "NVLink"},
        {"name": "a40", "replicas": a40_nodes, "gpu_type": "A40", "gpu_count": 4}]})


class VirtualTime:
    """The `time` module as the orchestrator sees it during the replay: `time()` is the replay's
    clock; everything else is the real module's."""

    def __init__(self) -> None:
        self.now = 0.0

    def time(self) -> float:
        return self.now

    def __getattr__(self, name: str):
        return getattr(time, name)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def replay(url: str, cluster: Cluster, trace: list, catalogue: JobCatalogue, clock: VirtualTime, seed: int) -> dict:
    """Every job through the live orchestrator in virtual time; returns arrivals, starts and the
    state read back after each event: {"arrival": {id: t}, "start": {id: t}, "snapshots": [(t, state)]}."""
    orch = Orchestrator(url, OrchestratorConfig(policy="has", lease_s=1e12, grace_s=60))
    orch.register(cluster, source="benchmarks/queue_eta.py")
    events: list[tuple[float, int, int, str]] = []  # (time, 0 = end / 1 = arrival, seq, trace job id)
    for seq, job in enumerate(trace):
        heapq.heappush(events, (job.arrival_s, 1, seq, job.job_id))
    by_trace = {j.job_id: j for j in trace}
    job_of: dict[str, int] = {}  # trace id -> orchestrator id
    arrival: dict[int, float] = {}
    start: dict[int, float] = {}
    training: dict[int, tuple[float, int, float]] = {}  # running training job: (start, steps, true step s)
    snapshots: list[tuple[float, QueueState]] = []
    seq = len(trace)
    jitter = random.Random(seed)
    while events:
        clock.now = now = events[0][0]
        admitted: list[int] = []
        while events and events[0][0] == now:
            _, kind, _, trace_id = heapq.heappop(events)
            orch.last_pass = None
            if kind == 0:
                job_id = job_of[trace_id]
                training.pop(job_id, None)
                orch.release(job_id)
            else:
                job = by_trace[trace_id]
                job_id = job_of[trace_id] = orch.submit(trace_id, catalogue.options(job))
                arrival[job_id] = now
            admitted += orch.last_pass.admitted if orch.last_pass else []
        for job_id in admitted:
            start[job_id] = now
            row = orch.job(job_id)
            job = by_trace[row["name"]]
            true_s = row["predicted_run_s"] * job.runtime_factor
            heapq.heappush(events, (now + true_s, 0, seq, job.job_id))
            seq += 1
            steps = catalogue.steps.get(job.job_id)
            if steps:
                training[job_id] = (now, max(1, round(steps)), true_s / max(1, round(steps)))
        for job_id, (began, steps, step_s) in training.items():  # what each running flow reports
            orch.report_progress(job_id, phase="training", step=min(steps, int((now - began) / step_s)),
                                 steps=steps, step_s=step_s * math.exp(jitter.gauss(0.0, STEP_JITTER)))
        state = read_queue_state(orch.engine, cluster.name)
        if state.waiting:
            snapshots.append((now, state))
    missing = [j for j in arrival if j not in start]
    if missing:
        raise RuntimeError(f"{len(missing)} job(s) never started, e.g. {missing[0]}")
    return {"arrival": arrival, "start": start, "snapshots": snapshots}


def baseline_start(state: QueueState, job_id: int, now: float) -> float:
    """now + the predicted backlog ahead of the job on its first option's GPU type / that type's GPUs."""
    ahead = []
    for w in state.waiting:
        if w.job_id == job_id:
            break
        ahead.append(w)
    mine = next(w for w in state.waiting if w.job_id == job_id)
    gpu_type = mine.options[0].gpu_type
    work = sum(r.num_gpus * max(0.0, r.admitted_at + (r.predicted_run_s or 0.0) - now)
               for r in state.running if r.gpu_type == gpu_type)
    work += sum(w.options[0].num_gpus * w.options[0].run_s for w in ahead if w.options and w.options[0].gpu_type == gpu_type)
    return now + work / state.cluster.total_gpus_by_type()[gpu_type]


def score(run: dict) -> dict:
    """Errors of the estimate and the baseline at submit and at a quarter of each job's wait."""
    times = [t for t, _ in run["snapshots"]]
    cache: dict[tuple[int, float, bool], dict[int, float | None]] = {}
    estimate_ms: list[float] = []

    def estimates(at: float, with_progress: bool = True) -> tuple[QueueState, dict[int, float | None]]:
        i = bisect.bisect_right(times, at) - 1
        state = run["snapshots"][i][1]
        key = (i, at, with_progress)
        if key not in cache:
            used = state if with_progress else replace(
                state, running=[replace(r, progress=None) for r in state.running])
            t0 = time.perf_counter()
            cache[key] = {e.job_id: e.start_s for e in estimate_starts(used, at)}
            estimate_ms.append(1e3 * (time.perf_counter() - t0))
        return state, cache[key]

    errors: dict[str, list[float]] = {k: [] for k in ("eta", "eta_submit", "base", "base_submit", "no_progress")}
    unknown = 0

    def pct(estimated: float | None, real: float, wait: float) -> float:
        return 100.0 if estimated is None else 100.0 * abs(estimated - real) / wait

    for job_id, arrived in run["arrival"].items():
        real = run["start"][job_id]
        wait = real - arrived
        if wait < MIN_WAIT_S:
            continue
        quarter = arrived + wait / 4
        state, at_quarter = estimates(quarter)
        submit_state, at_submit = estimates(arrived)
        _, no_progress = estimates(quarter, with_progress=False)
        unknown += at_quarter[job_id] is None
        errors["eta"].append(pct(at_quarter[job_id], real, wait))
        errors["eta_submit"].append(pct(at_submit[job_id], real, wait))
        errors["no_progress"].append(pct(no_progress[job_id], real, wait))
        errors["base"].append(pct(baseline_start(state, job_id, quarter), real, wait))
        errors["base_submit"].append(pct(baseline_start(submit_state, job_id, arrived), real, wait))
    return {"errors": errors, "unknown": unknown, "estimate_ms": estimate_ms}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=400)
    parser.add_argument("--seed", type=int, default=None,
                        help=f"trace seed (default {HELD_OUT_SEED}, the reported figure; development used 0, 1, 2)")
    parser.add_argument("--smoke", action="store_true",
                        help="60 jobs on 4 + 4 nodes, trace seed 0 (some of them wait): seconds, same keys")
    args = parser.parse_args()
    cluster = lab_cluster(4, 4) if args.smoke else lab_cluster()
    if args.smoke:
        args.jobs = 60
    if args.seed is None:
        args.seed = 0 if args.smoke else HELD_OUT_SEED

    trace = apply_runtime_noise(generate_acme_trace(args.jobs, cluster_gpus=round(effective_capacity(cluster)),
                                                    load=LOAD, seed=args.seed), SIGMA, seed=1000 + args.seed)
    catalogue = JobCatalogue(cluster)  # MARP plans per job, before the clock starts

    tmp = Path(tempfile.mkdtemp(prefix="forgeflow-queue-eta-"))
    url = f"sqlite:///{tmp / 'state.db'}"
    clock = VirtualTime()
    # The orchestrator's clock and the database's (on SQLite, the time each transaction reads once
    # it holds the lock) are the replay's; see the docstring for why not PostgreSQL's.
    patched = (orchestrator_service, statedb_transactions)
    real_times = [module.time for module in patched]
    for module in patched:
        module.time = clock
    started = time.perf_counter()
    try:
        run = replay(url, cluster, trace, catalogue, clock, seed=2000 + args.seed)
    finally:
        for module, real in zip(patched, real_times):
            module.time = real
        forget_engines()
        shutil.rmtree(tmp, ignore_errors=True)
    replay_s = time.perf_counter() - started
    scored = score(run)
    errors = scored["errors"]
    if not errors["eta"]:
        raise SystemExit(f"no job of the {args.jobs} waited {MIN_WAIT_S:.0f} s or more: nothing to score")
    median = {k: statistics.median(v) for k, v in errors.items()}
    waits = [run["start"][j] - t for j, t in run["arrival"].items() if run["start"][j] - t >= MIN_WAIT_S]
    print(f"{args.jobs} Acme-like jobs (seed {args.seed}, load {LOAD}, noise sigma {SIGMA}) on {cluster.total_gpus} "
          f"GPUs through the live orchestrator on PostgreSQL in {replay_s:.1f} s; {len(waits)} waited >= "
          f"{MIN_WAIT_S:.0f} s (median wait {statistics.median(waits) / 3600:.2f} h)")
    print(f"estimated start error (|est - real| / real wait): at a quarter of the wait median "
          f"{median['eta']:.1f} %, p90 {percentile(errors['eta'], 90):.1f} %; at submit median "
          f"{median['eta_submit']:.1f} %; without progress {median['no_progress']:.1f} %")
    print(f"baseline (backlog / GPUs of the type): quarter-wait median {median['base']:.1f} %, at submit "
          f"{median['base_submit']:.1f} %; estimates that said 'cannot start': {scored['unknown']}")
    print(json.dumps(checked_headline({
        "eta_median_abs_error_pct": round(median["eta"], 1),
        "eta_p90_abs_error_pct": round(percentile(errors["eta"], 90), 1),
        "eta_at_submit_median_abs_error_pct": round(median["eta_submit"], 1),
        "baseline_median_abs_error_pct": round(median["base"], 1),
        "baseline_at_submit_median_abs_error_pct": round(median["base_submit"], 1),
        "eta_without_progress_median_abs_error_pct": round(median["no_progress"], 1),
        "jobs": args.jobs,
        "waited_jobs": len(errors["eta"]),
        "min_wait_s": MIN_WAIT_S,
        "trace_seed": args.seed,
        "estimate_ms_p50": round(percentile(scored["estimate_ms"], 50), 2),
    }, HEADLINE_KEYS)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
