"""Average JCT of HAS+MARP and ECT (ours) against three baselines, under fair conditions.

Headline setting ("fair"): the Acme-like job mix (`generate_acme_trace`: the
NSDI'24 shares — ~93 % short evaluation jobs, ~3 % pretraining jobs holding ~94 %
of GPU time, 7B–123B models) on the Crius cluster with Crius Table 1's node
shapes (configs/clusters/crius-sim.yaml: A100 80x4 NVLink, A40 160x2, A10 160x2,
V100 20x16 NVLink), 2,000 jobs, 5 seeds, and:

* **Estimates, not the truth.** Every policy orders, sizes and backfills on the
  cost model's predicted run times; each job's actual run time is the
  prediction × a log-normal factor (median 1, sigma `runtime_noise_sigma`, swept
  0.1 / 0.3 / 0.5; the same factors for every policy of a seed).
* **Offered load from effective capacity.** Trace work is in reference-A100
  GPU-seconds, so the arrival rate is set against the cluster's worth in A100s
  (sum of peak TFLOP/s / 312: ~730, not 1,280 GPUs). Swept 0.6-0.95; the realised
  load of each trace (its work over its arrival span) is printed next to it.
* **Baselines** (all run the GPUs the user asked for, fastest type that has them
  free, first-fit): FCFS-opportunistic (Frenzy's baseline: jobs behind a waiting
  one may start), FCFS + EASY backfilling (what Slurm sites run: the head job
  reserves the earliest predicted slot; later jobs start only if they cannot
  delay it), SJF on estimates. They are fair because they see the same
  predictions, the same cluster and the same trace as HAS and ECT, and EASY/SJF
  are what a site would run instead of a new scheduler; none of them gets
  MARP's resizing, which is what HAS claims as its advantage.

Elastic (`scheduler.elastic`, policy ``elastic``): jobs are admitted as FCFS-opportunistic
admits them (the requested GPUs, fastest type with room), then running data-parallel training
jobs change size with the free GPUs: a queued job that cannot start makes running jobs shrink
(grown ones back to their request first, then below it, down to a quarter) when its predicted
completion improves by more than they lose; idle GPUs let running jobs grow (up to 4x their
request) when the remaining time saved beats a restart. Only the data-parallel degree
changes (same GPU type, tensor/pipeline degrees and global batch), each at most once per
300 s. Every resize costs a restart: the job makes no progress for `resize_cost_s` = 11.97 s,
the measured `seconds_to_resume_p50` of benchmarks/recovery.py on the project's box (its GPUs
count as busy meanwhile). Plain GPU demands (evaluation, debug) never resize. It sees the same
predictions, cluster and trace as the others; its defaults were chosen on seeds 100-104, not on
the reported seeds 0-4. Its goal: average JCT <= 0.75 x FCFS-opportunistic's at load 0.8.

Ratios are policy / baseline average JCT per seed (paired on the same trace),
reported as mean ± standard deviation and min-max over seeds; per-category
average JCTs (evaluation, pretrain, sft, debug) are printed per policy. The
"best" policy is whichever of HAS and ECT has the lower mean ratio against EASY.
Frenzy reports 12-18 % lower average JCT than its baselines; the script prints
whether HAS reproduces that here.

Secondary (old keys, kept for comparison): the former setting — clairvoyant run
times, load counted over the raw GPU count (offered load ~1.4 of the effective
capacity), FCFS-opportunistic as the only baseline — on the Acme-like trace and on
the Frenzy-like queue (60 GPT-2/BERT jobs on the Frenzy testbed); the old
`jct_ratio_*` keys are the mean of those two workloads. Note crius-sim.yaml's
node shapes changed (was 8 GPUs on every node), so old-key values differ from
runs before that change.

Run:  .venv/bin/python benchmarks/simulate_policies.py [--acme-jobs 2000] [--seeds 5] [--out runs/benchmarks]
      .venv/bin/python benchmarks/simulate_policies.py --smoke   # 100 + 10 jobs, 1 seed, charts in a temp dir
Last line: one JSON object (HEADLINE_KEYS: offered_load, runtime_noise_sigma, jct_ratio_has_vs_fcfs_fair,
jct_ratio_best_vs_easy_backfill, ..., jct_ratio_elastic_vs_fcfs_fair, jct_ratio_elastic_vs_easy_backfill,
resizes_per_job, gpu_utilisation_elastic, and the old keys).
"""

from __future__ import annotations

import json
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.headline import checked_headline  # noqa: E402

from scheduler.cluster import load_cluster  # noqa: E402
from scheduler.elastic import ElasticConfig  # noqa: E402
from scheduler.simulate import (  # noqa: E402
    SIM_POLICIES as POLICIES,
    SIM_POLICY_LABELS as POLICY_LABELS,
    JobCatalogue,
    Simulator,
    effective_capacity,
    offered_load,
    plot_jct_cdf,
    simulate,
)
from scheduler.traces import apply_runtime_noise, generate_acme_trace, generate_frenzy_queue, trace_shares  # noqa: E402

CLUSTERS = Path(__file__).resolve().parents[1] / "configs" / "clusters"
OURS = ("has", "ect")
BASELINES = ("fcfs", "easy", "sjf")
HEADLINE_LOAD, HEADLINE_SIGMA = 0.8, 0.3
LOADS = (0.6, 0.7, 0.8, 0.9, 0.95)
SIGMAS = (0.1, 0.3, 0.5)
HEADLINE_KEYS = (
    "offered_load", "offered_load_realised", "runtime_noise_sigma", "seeds", "jct_ratio_has_vs_fcfs_fair",
    "jct_ratio_has_vs_fcfs_fair_sd", "jct_ratio_has_vs_easy_backfill", "jct_ratio_has_vs_sjf", "best_policy_fair",
    "jct_ratio_best_vs_easy_backfill", "jct_ratio_best_vs_easy_backfill_sd", "jct_ratio_best_vs_fcfs_fair",
    "jct_ratio_best_vs_sjf", "frenzy_claim_reproduced", "frenzy_queue_jct_ratio_has_vs_fcfs_fair",
    "frenzy_queue_jct_ratio_has_vs_easy_backfill", "fair_avg_jct_h_by_category", "load_sweep_has_vs_fcfs",
    "load_sweep_best_vs_easy", "sigma_sweep_has_vs_fcfs", "jct_ratio_has_vs_fcfs", "jct_ratio_best_vs_fcfs",
    "best_policy", "acme_jct_ratio_has_vs_fcfs", "acme_jct_ratio_ect_vs_fcfs", "frenzy_jct_ratio_has_vs_fcfs",
    "frenzy_jct_ratio_ect_vs_fcfs", "acme_avg_jct_h", "frenzy_avg_jct_h",
    "jct_ratio_elastic_vs_fcfs_fair", "jct_ratio_elastic_vs_fcfs_fair_sd", "jct_ratio_elastic_vs_easy_backfill",
    "elastic_goal_met", "resizes_per_job", "gpu_utilisation_elastic", "gpu_utilisation_fcfs", "resize_cost_s",
    "load_sweep_elastic_vs_fcfs",
)
ELASTIC = ElasticConfig()  # resize_cost_s: benchmarks/recovery.py's seconds_to_resume_p50 (11.97 s)
ELASTIC_GOAL = 0.75  # elastic / FCFS-opportunistic average JCT at the headline load


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.mean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def fmt(s: dict[str, float]) -> str:
    return f"{s['mean']:.3f} ± {s['sd']:.3f} [{s['min']:.3f}-{s['max']:.3f}]"


def run_point(cluster, catalogue: JobCatalogue, make_jobs, seeds: list[int], sigma: float, capacity: float | None,
              png: Path | None = None) -> dict:
    """All policies on each seed's trace with noise `sigma`; paired ratios and per-category JCTs."""
    runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
    loads = []
    for seed in seeds:
        jobs = apply_runtime_noise(make_jobs(seed), sigma, seed=1000 + seed)
        if capacity:
            loads.append(offered_load(jobs, capacity))
        options = {j.job_id: catalogue.options(j) for j in jobs}
        results = {p: Simulator(cluster, jobs, p, catalogue, options, elastic=ELASTIC).run() for p in POLICIES}
        for p, r in results.items():
            runs[p].append(r.summary())
        if png is not None and seed == seeds[0]:
            plot_jct_cdf(results, png, title=f"JCT CDF — {png.stem} on {cluster.name}")
    out: dict = {"realised_load": spread(loads) if loads else None, "policies": {}}
    for p in POLICIES:
        row = {
            "avg_jct_h": statistics.mean(r["avg_jct_s"] for r in runs[p]) / 3600,
            "utilisation": statistics.mean(r["utilisation"] for r in runs[p]),
            "us_per_decision": statistics.mean(r["us_per_decision"] for r in runs[p]),
            "resizes_per_job": statistics.mean(r["resizes"] / max(1, r["finished"]) for r in runs[p]),
            "by_category_h": {c: statistics.mean(r["avg_jct_s_by_category"].get(c, 0.0) for r in runs[p]) / 3600
                              for c in runs[p][0]["avg_jct_s_by_category"]},
        }
        for b in BASELINES:
            row[f"vs_{b}"] = spread([r["avg_jct_s"] / q["avg_jct_s"] for r, q in zip(runs[p], runs[b])])
        out["policies"][p] = row
    return out


def print_point(title: str, point: dict) -> None:
    load = point["realised_load"]
    print(f"\n{title}" + (f"  (realised offered load {fmt(load)})" if load else ""))
    print(f"  {'policy':28s} {'avg JCT h':>9s}  {'vs FCFS-opp (mean ± sd [min-max])':34s} "
          f"{'vs EASY':34s} {'vs SJF':34s} {'util':>5s}")
    for p, row in point["policies"].items():
        print(f"  {POLICY_LABELS[p]:28s} {row['avg_jct_h']:9.3f}  {fmt(row['vs_fcfs']):34s} "
              f"{fmt(row['vs_easy']):34s} {fmt(row['vs_sjf']):34s} {row['utilisation']:5.1%}"
              + (f"  {row['resizes_per_job']:.3f} resizes/job" if row["resizes_per_job"] else ""))
    cats = list(next(iter(point["policies"].values()))["by_category_h"])
    print(f"  avg JCT by category (h): {'policy':28s} " + " ".join(f"{c:>11s}" for c in cats))
    for p, row in point["policies"].items():
        print(f"  {'':25s}{POLICY_LABELS[p]:28s} " + " ".join(f"{row['by_category_h'][c]:11.3f}" for c in cats))


def legacy(crius, testbed, acme_jobs: int, frenzy_jobs: int, seeds: list[int], out: Path) -> dict:
    """The former figures: clairvoyant, acme load 0.8 over the raw GPU count, FCFS-opportunistic baseline."""
    summary = {}
    for name, cluster, make in (
        ("acme", crius, lambda s: generate_acme_trace(acme_jobs, cluster_gpus=crius.total_gpus, load=0.8, seed=s)),
        ("frenzy", testbed, lambda s: generate_frenzy_queue(frenzy_jobs, seed=s)),
    ):
        runs = {p: [] for p in ("fcfs", "has", "ect")}
        for seed in seeds:
            results = simulate(cluster, make(seed), runs)
            for p, r in results.items():
                runs[p].append(r.summary()["avg_jct_s"])
            if seed == seeds[0]:
                plot_jct_cdf(results, out / f"jct_cdf_{name}_legacy.png", title=f"JCT CDF — {name} (former setting)")
        summary[name] = {p: {"avg_jct_h": statistics.mean(v) / 3600,
                             "jct_ratio_vs_fcfs": statistics.mean(a / b for a, b in zip(v, runs["fcfs"]))}
                         for p, v in runs.items()}
        print(f"  former setting, {name}: " + ", ".join(
            f"{p} {summary[name][p]['jct_ratio_vs_fcfs']:.3f}" for p in runs))
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--acme-jobs", type=int, default=2000)
    ap.add_argument("--frenzy-jobs", type=int, default=60)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", default=None, help="where the JCT charts go (default runs/benchmarks; "
                    "with --smoke a temporary folder)")
    ap.add_argument("--smoke", action="store_true",
                    help="100 Acme-like and 10 Frenzy-like jobs, 1 seed: seconds, same sweeps and keys")
    args = ap.parse_args()
    if args.smoke:
        args.acme_jobs, args.frenzy_jobs, args.seeds = 100, 10, 1
    scratch = tempfile.TemporaryDirectory(prefix="simulate-policies-") if args.smoke and args.out is None else None
    out = Path(scratch.name if scratch else args.out or "runs/benchmarks")
    out.mkdir(parents=True, exist_ok=True)
    seeds = list(range(args.seeds))
    started = time.perf_counter()

    crius = load_cluster(CLUSTERS / "crius-sim.yaml")
    testbed = load_cluster(CLUSTERS / "frenzy-testbed.yaml")
    capacity = effective_capacity(crius)
    shares = trace_shares(generate_acme_trace(args.acme_jobs, cluster_gpus=round(capacity), seed=0))
    print(f"crius-sim: {crius.total_gpus} GPUs in {len(crius.nodes)} nodes, effective capacity {capacity:.0f} "
          f"A100-40G equivalents. Acme-like trace, {args.acme_jobs} jobs; shares of jobs / GPU time (seed 0): "
          + ", ".join(f"{c} {v['jobs']:.1%} / {v['gpu_time']:.1%}" for c, v in sorted(shares.items())))
    catalogue = JobCatalogue(crius)

    def acme_at(load: float):
        return lambda s: generate_acme_trace(args.acme_jobs, cluster_gpus=round(capacity), load=load, seed=s)

    points: dict[tuple[float, float], dict] = {}
    for load in LOADS:
        png = out / "jct_cdf_acme_fair.png" if load == HEADLINE_LOAD else None
        points[(load, HEADLINE_SIGMA)] = run_point(crius, catalogue, acme_at(load), seeds, HEADLINE_SIGMA, capacity, png)
        print_point(f"Acme-like on crius-sim, offered load {load}, runtime noise sigma {HEADLINE_SIGMA}",
                    points[(load, HEADLINE_SIGMA)])
    for sigma in SIGMAS:
        if (HEADLINE_LOAD, sigma) not in points:
            points[(HEADLINE_LOAD, sigma)] = run_point(crius, catalogue, acme_at(HEADLINE_LOAD), seeds, sigma, capacity)
            print_point(f"Acme-like on crius-sim, offered load {HEADLINE_LOAD}, runtime noise sigma {sigma}",
                        points[(HEADLINE_LOAD, sigma)])
    frenzy_fair = run_point(testbed, JobCatalogue(testbed), lambda s: generate_frenzy_queue(args.frenzy_jobs, seed=s),
                            seeds, HEADLINE_SIGMA, None, out / "jct_cdf_frenzy_fair.png")
    print_point(f"Frenzy-like queue ({args.frenzy_jobs} GPT-2/BERT jobs within an hour) on frenzy-testbed, "
                f"runtime noise sigma {HEADLINE_SIGMA}", frenzy_fair)

    head = points[(HEADLINE_LOAD, HEADLINE_SIGMA)]["policies"]
    best = min(OURS, key=lambda p: head[p]["vs_easy"]["mean"])
    print("\nSweeps (mean ratio over seeds; < 1 is better than the baseline):")
    swept = [(p, b) for p in OURS for b in BASELINES] + [("elastic", "fcfs"), ("elastic", "easy")]
    print(f"  {'load':>5s} {'sigma':>5s} " + " ".join(f"{p + '/' + b:>12s}" for p, b in swept))
    for (load, sigma), pt in sorted(points.items()):
        print(f"  {load:5.2f} {sigma:5.2f} " + " ".join(
            f"{pt['policies'][p]['vs_' + b]['mean']:12.3f}" for p, b in swept))
    has_fcfs = head["has"]["vs_fcfs"]
    verdict = ("reproduces" if has_fcfs["max"] <= 0.88 else
               "reproduces on average" if has_fcfs["mean"] <= 0.88 else "does NOT reproduce")
    print(f"\nFrenzy's claim (12-18 % lower average JCT than its baselines) {verdict} here: HAS / FCFS-opportunistic "
          f"= {fmt(has_fcfs)} at load {HEADLINE_LOAD}, sigma {HEADLINE_SIGMA}; HAS / EASY = {fmt(head['has']['vs_easy'])}; "
          f"on the Frenzy-like queue HAS / FCFS-opportunistic = {fmt(frenzy_fair['policies']['has']['vs_fcfs'])}.")
    print(f"best of ours against EASY: {POLICY_LABELS[best]} ({fmt(head[best]['vs_easy'])})")
    elastic = head["elastic"]
    goal_met = elastic["vs_fcfs"]["mean"] <= ELASTIC_GOAL
    print(f"elastic (resize cost {ELASTIC.resize_cost_s} s): / FCFS-opportunistic = {fmt(elastic['vs_fcfs'])} "
          f"(goal <= {ELASTIC_GOAL}: {'met' if goal_met else 'NOT met'}), / EASY = {fmt(elastic['vs_easy'])}, "
          f"{elastic['resizes_per_job']:.3f} resizes per job, GPU utilisation {elastic['utilisation']:.1%} "
          f"(FCFS-opportunistic {head['fcfs']['utilisation']:.1%})")

    print("\nFormer setting (clairvoyant, load over raw GPU count; old keys):")
    old = legacy(crius, testbed, args.acme_jobs, args.frenzy_jobs, seeds, out)
    acme, frenzy = old["acme"], old["frenzy"]

    def both(policy: str) -> float:
        return (acme[policy]["jct_ratio_vs_fcfs"] + frenzy[policy]["jct_ratio_vs_fcfs"]) / 2

    old_best = min(OURS, key=both)
    print(f"\nwall time {time.perf_counter() - started:.0f} s")
    r4 = lambda x: round(x, 4)  # noqa: E731
    if scratch is not None:
        scratch.cleanup()
    print(json.dumps(checked_headline({
        "offered_load": HEADLINE_LOAD,
        "offered_load_realised": r4(points[(HEADLINE_LOAD, HEADLINE_SIGMA)]["realised_load"]["mean"]),
        "runtime_noise_sigma": HEADLINE_SIGMA,
        "seeds": len(seeds),
        "jct_ratio_has_vs_fcfs_fair": r4(has_fcfs["mean"]),
        "jct_ratio_has_vs_fcfs_fair_sd": r4(has_fcfs["sd"]),
        "jct_ratio_has_vs_easy_backfill": r4(head["has"]["vs_easy"]["mean"]),
        "jct_ratio_has_vs_sjf": r4(head["has"]["vs_sjf"]["mean"]),
        "best_policy_fair": best,
        "jct_ratio_best_vs_easy_backfill": r4(head[best]["vs_easy"]["mean"]),
        "jct_ratio_best_vs_easy_backfill_sd": r4(head[best]["vs_easy"]["sd"]),
        "jct_ratio_best_vs_fcfs_fair": r4(head[best]["vs_fcfs"]["mean"]),
        "jct_ratio_best_vs_sjf": r4(head[best]["vs_sjf"]["mean"]),
        "frenzy_claim_reproduced": verdict != "does NOT reproduce",
        "frenzy_queue_jct_ratio_has_vs_fcfs_fair": r4(frenzy_fair["policies"]["has"]["vs_fcfs"]["mean"]),
        "frenzy_queue_jct_ratio_has_vs_easy_backfill": r4(frenzy_fair["policies"]["has"]["vs_easy"]["mean"]),
        "fair_avg_jct_h_by_category": {p: {c: round(v, 3) for c, v in row["by_category_h"].items()}
                                       for p, row in head.items()},
        "load_sweep_has_vs_fcfs": {str(l): r4(points[(l, HEADLINE_SIGMA)]["policies"]["has"]["vs_fcfs"]["mean"])
                                   for l in LOADS},
        "load_sweep_best_vs_easy": {str(l): r4(points[(l, HEADLINE_SIGMA)]["policies"][best]["vs_easy"]["mean"])
                                    for l in LOADS},
        "sigma_sweep_has_vs_fcfs": {str(s): r4(points[(HEADLINE_LOAD, s)]["policies"]["has"]["vs_fcfs"]["mean"])
                                    for s in SIGMAS},
        # old keys (former setting)
        "jct_ratio_has_vs_fcfs": r4(both("has")),
        "jct_ratio_best_vs_fcfs": r4(both(old_best)),
        "best_policy": old_best,
        "acme_jct_ratio_has_vs_fcfs": r4(acme["has"]["jct_ratio_vs_fcfs"]),
        "acme_jct_ratio_ect_vs_fcfs": r4(acme["ect"]["jct_ratio_vs_fcfs"]),
        "frenzy_jct_ratio_has_vs_fcfs": r4(frenzy["has"]["jct_ratio_vs_fcfs"]),
        "frenzy_jct_ratio_ect_vs_fcfs": r4(frenzy["ect"]["jct_ratio_vs_fcfs"]),
        "acme_avg_jct_h": {p: round(v["avg_jct_h"], 3) for p, v in acme.items()},
        "frenzy_avg_jct_h": {p: round(v["avg_jct_h"], 3) for p, v in frenzy.items()},
        # the elastic policy (scheduler.elastic), fair setting
        "jct_ratio_elastic_vs_fcfs_fair": r4(elastic["vs_fcfs"]["mean"]),
        "jct_ratio_elastic_vs_fcfs_fair_sd": r4(elastic["vs_fcfs"]["sd"]),
        "jct_ratio_elastic_vs_easy_backfill": r4(elastic["vs_easy"]["mean"]),
        "elastic_goal_met": goal_met,
        "resizes_per_job": r4(elastic["resizes_per_job"]),
        "gpu_utilisation_elastic": r4(elastic["utilisation"]),
        "gpu_utilisation_fcfs": r4(head["fcfs"]["utilisation"]),
        "resize_cost_s": ELASTIC.resize_cost_s,
        "load_sweep_elastic_vs_fcfs": {str(l): r4(points[(l, HEADLINE_SIGMA)]["policies"]["elastic"]["vs_fcfs"]["mean"])
                                       for l in LOADS},
    }, HEADLINE_KEYS)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
