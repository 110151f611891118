"""`forgeflow plan` and `forgeflow simulate`.

Heavy imports stay inside the command functions so `forgeflow --help` is fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

CLUSTER_DIR = Path(__file__).resolve().parents[1] / "configs" / "clusters"


def register(subparsers: argparse._SubParsersAction) -> None:
    plan = subparsers.add_parser(
        "plan",
        help="size a job: memory breakdown, ranked parallel plans and the chosen placement",
        description="Enumerate (GPU type, count, dp/tp/pp, micro batch, recompute) plans whose predicted "
                    "per-GPU memory fits, rank them by predicted step time and place the best one that "
                    "the free GPUs satisfy (HAS best fit, cross-mapped pipeline stages).",
    )
    plan.add_argument("job", help="job spec YAML (e.g. configs/tiny-cpu.yaml)")
    plan.add_argument("--cluster", default="local",
                      help="cluster inventory YAML, or 'local' to detect this machine (default)")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    plan.add_argument("--top", type=int, default=10, help="how many ranked plans to show (default 10)")
    plan.add_argument("--max-gpus", type=int, default=None, help="never plan more GPUs than this")
    plan.add_argument("--gpu-type", action="append", default=None, help="only plan these GPU types (repeatable)")
    plan.add_argument("--margin", type=float, default=0.10, help="GPU memory kept free, fraction (default 0.10)")
    plan.add_argument("--max-pp", type=int, default=None,
                      help="most pipeline stages to consider (default: what the training worker runs, "
                           "training/capabilities.py; more is a what-if the worker cannot run yet)")
    plan.add_argument("--rank-by", choices=("step_time", "gpu_seconds"), default="step_time")
    plan.set_defaults(func=_plan_command)

    sim = subparsers.add_parser(
        "simulate",
        help="replay a job trace under scheduling policies and plot JCT CDFs",
        description="Event-driven replay of a trace (a CSV, or a generated Acme-like or Frenzy-like "
                    "workload) on a cluster inventory under FCFS-opportunistic, HAS+MARP and ECT.",
    )
    src = sim.add_mutually_exclusive_group()
    src.add_argument("--trace", help="Philly/Helios-style CSV (job id, GPUs, submit time, duration)")
    src.add_argument("--generate", choices=("acme", "frenzy"), default=None,
                     help="generate a trace instead (default: acme)")
    sim.add_argument("--jobs", type=int, default=None, help="jobs to generate (acme: 500, frenzy: 60)")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--load", type=float, default=0.8,
                     help="acme: offered load over the cluster's effective capacity in A100 equivalents (default 0.8)")
    sim.add_argument("--noise", type=float, default=0.0, metavar="SIGMA",
                     help="actual run time = prediction x log-normal(0, SIGMA); policies see predictions (default 0)")
    sim.add_argument("--cluster", default=None,
                     help="cluster YAML (default: crius-sim for acme/CSV, frenzy-testbed for frenzy)")
    sim.add_argument("--policies", default="fcfs,has,ect", help="comma-separated: fcfs, has, ect, easy, sjf, elastic")
    sim.add_argument("--out", default="runs/simulate", help="directory for the JCT CDF PNG and results JSON")
    sim.add_argument("--json", action="store_true", help="print the summaries as one JSON object")
    sim.set_defaults(func=_simulate_command)


# --- plan -------------------------------------------------------------------------


def _load_cluster(arg: str | None, default_name: str | None = None):
    from scheduler.cluster import detect_local_cluster, load_cluster

    if arg == "local" or (arg is None and default_name is None):
        return detect_local_cluster()
    if arg is None:
        return load_cluster(CLUSTER_DIR / default_name)
    path = Path(arg)
    if not path.exists() and (CLUSTER_DIR / arg).exists():
        path = CLUSTER_DIR / arg  # `--cluster crius-sim.yaml` works from anywhere
    return load_cluster(path)


def _plan_command(args: argparse.Namespace) -> int:
    from scheduler.cluster import ClusterError
    from scheduler.placement import place_plans
    from scheduler.planner import InfeasibleJobError, plan_job, worker_planner_config
    from training.capabilities import WORKER
    from training.config import ConfigError, load_job_spec

    try:
        job = load_job_spec(args.job)
        cluster = _load_cluster(args.cluster)
        what_if = {} if args.max_pp is None else {"max_pipeline_stages": args.max_pp}
        if args.max_pp is not None and args.max_pp > WORKER.max_pipeline_stages:
            print(f"note: plans with more than {WORKER.max_pipeline_stages} pipeline stage(s) are a what-if: "
                  "the training worker cannot run them yet", file=sys.stderr)
        config = worker_planner_config(
            cluster, memory_margin=args.margin, max_gpus=args.max_gpus,
            gpu_types=tuple(args.gpu_type) if args.gpu_type else None, rank_by=args.rank_by, **what_if,
        )
        plans = plan_job(job, cluster, config)
    except InfeasibleJobError as e:
        from infra.yaml_config import report_error

        return report_error(e, args.json, job=args.job, alternatives=e.alternatives)
    except (ConfigError, ClusterError, ValueError) as e:
        from infra.yaml_config import report_error

        return report_error(e, args.json, job=args.job)

    placement = place_plans(plans, cluster, job=job.name)
    chosen = placement.plan if placement is not None else plans[0]
    top = plans[: max(1, args.top)]
    if args.json:
        print(json.dumps({
            "job": job.name,
            "cluster": cluster.name,
            "feasible_plans": len(plans),
            "plans": [p.to_dict() for p in top],
            "chosen": chosen.to_dict(),
            "placement": placement.to_dict() if placement is not None else None,
        }, indent=2))
        return 0
    _print_plan_tables(job, cluster, plans, top, chosen, placement)
    return 0


def _print_plan_tables(job, cluster, plans, top, chosen, placement) -> None:
    from rich.console import Console
    from rich.table import Table

    from scheduler.cluster import GIB
    from scheduler.planner import memory_breakdown_dict

    console = Console()
    params = job.model.num_parameters()
    console.print(f"[bold]{job.name}[/]: {params / 1e9:.3f}B parameters, seq {job.model.seq_length}, "
                  f"global batch {job.training.global_batch_size}, {job.training.precision} — "
                  f"{len(plans)} feasible plan(s) on cluster [bold]{cluster.name}[/]")

    from scheduler.memory_model import profile_for_device

    # the attention kernel the worker builds on that GPU decides the s x s terms (training.attention)
    profile = profile_for_device(chosen.gpu_type, job.training.precision, job.training.attention)
    mem = Table(title=f"Per-GPU peak memory of the chosen plan ({chosen.num_gpus}x {chosen.gpu_type}, "
                      f"{chosen.layout}; sized as {profile.name})")
    mem.add_column("part")
    mem.add_column("GiB", justify="right")
    for part, gib in memory_breakdown_dict(chosen.memory).items():
        mem.add_row(part, f"{gib:.3f}")
    mem.add_row("[bold]peak[/]", f"[bold]{chosen.peak_memory_bytes / GIB:.3f}[/]")
    mem.add_row("GPU memory", f"{chosen.gpu_memory_bytes / GIB:.3f}")
    console.print(mem)

    table = Table(title=f"Ranked plans (top {len(top)} of {len(plans)})")
    for col, justify in (("#", "right"), ("GPU type", "left"), ("GPUs", "right"), ("layout", "left"),
                         ("peak / GPU GiB", "right"), ("step", "right"), ("compute / bubble / tp / dp", "right"),
                         ("tokens/s", "right")):
        table.add_column(col, justify=justify)
    for i, p in enumerate(top, start=1):
        s = p.step
        mark = " *" if p is chosen else ""
        table.add_row(
            f"{i}{mark}", p.gpu_type, str(p.num_gpus), p.layout,
            f"{p.peak_memory_bytes / GIB:.2f} / {p.gpu_memory_bytes / GIB:.0f}",
            _secs(p.predicted_step_time_s),
            " / ".join(_secs(x) for x in (s.compute_s, s.bubble_s, s.tp_comm_s, s.dp_comm_s)),
            f"{p.tokens_per_s:,.0f}",
        )
    console.print(table)

    if placement is None:
        console.print("[yellow]No plan fits the free GPUs right now: the job would wait in the queue.[/]")
        return
    pt = Table(title=f"Placement (HAS best fit{', cross-mapped stages' if placement.cross_mapped else ''}); "
                     f"master {placement.master_addr}:{placement.master_port}")
    for col in ("node rank", "node", "GPU indices", "global ranks", "stages", "root complexes"):
        pt.add_column(col)
    specs = placement.launch_specs()
    for spec, a in zip(specs, placement.assignments):
        pt.add_row(
            str(spec.node_rank), a.node, spec.cuda_visible_devices,
            _ranges(a.ranks), _ranges(a.stages), ",".join("-" if rc is None else str(rc) for rc in a.root_complexes),
        )
    console.print(pt)
    if placement.predicted_step_time_s is not None:
        console.print(f"predicted step time as placed: {_secs(placement.predicted_step_time_s)}")
    for spec in specs:
        env = " ".join(f"{k}={v}" for k, v in spec.env().items())
        console.print(f"[dim]{spec.node}:[/] {env + ' ' if env else ''}torchrun " + " ".join(spec.torchrun_args()),
                      soft_wrap=True)


def _secs(value: float) -> str:
    if value >= 1:
        return f"{value:.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.1f} ms"
    return f"{value * 1e6:.0f} µs"


def _ranges(values) -> str:
    values = list(values)
    if values and values == list(range(values[0], values[-1] + 1)) and len(values) > 2:
        return f"{values[0]}-{values[-1]}"
    return ",".join(str(v) for v in values)


# --- simulate ---------------------------------------------------------------------


def _simulate_command(args: argparse.Namespace) -> int:
    from scheduler.cluster import ClusterError
    from scheduler.simulate import POLICY_LABELS, SimulationError, effective_capacity, plot_jct_cdf, simulate
    from scheduler.traces import (
        TraceError,
        apply_runtime_noise,
        generate_acme_trace,
        generate_frenzy_queue,
        read_trace_csv,
    )

    kind = "csv" if args.trace else (args.generate or "acme")
    try:
        cluster = _load_cluster(args.cluster, "frenzy-testbed.yaml" if kind == "frenzy" else "crius-sim.yaml")
        if kind == "csv":
            jobs = read_trace_csv(args.trace, limit=args.jobs)
        elif kind == "frenzy":
            jobs = generate_frenzy_queue(args.jobs or 60, seed=args.seed)
        else:
            jobs = generate_acme_trace(args.jobs or 500, cluster_gpus=max(1, round(effective_capacity(cluster))),
                                       load=args.load, seed=args.seed)
        jobs = apply_runtime_noise(jobs, args.noise, seed=args.seed)
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        results = simulate(cluster, jobs, policies)
    except (ClusterError, TraceError, SimulationError, ValueError) as e:
        from infra.yaml_config import report_error

        return report_error(e, args.json)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    png = plot_jct_cdf(results, out / f"jct_cdf_{kind}.png", title=f"JCT CDF — {kind} trace on {cluster.name}")
    summaries = {p: r.summary() for p, r in results.items()}
    base = summaries.get("fcfs")
    for s in summaries.values():
        s["jct_ratio_vs_fcfs"] = s["avg_jct_s"] / base["avg_jct_s"] if base and base["avg_jct_s"] else None
    (out / f"summary_{kind}.json").write_text(json.dumps(summaries, indent=2))
    if args.json:
        print(json.dumps({"trace": kind, "cluster": cluster.name, "jobs": len(jobs), "png": str(png),
                          "policies": summaries}, indent=2))
        return 0

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{kind} trace, {len(jobs)} jobs on {cluster.name} ({cluster.total_gpus} GPUs)")
    for col in ("policy", "avg JCT h", "vs FCFS", "avg queue h", "makespan h", "utilisation", "µs/decision"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for p, s in summaries.items():
        ratio = s["jct_ratio_vs_fcfs"]
        table.add_row(POLICY_LABELS.get(p, p), f"{s['avg_jct_s'] / 3600:.3f}", "-" if ratio is None else f"{ratio:.3f}",
                      f"{s['avg_queue_s'] / 3600:.3f}", f"{s['makespan_s'] / 3600:.2f}", f"{s['utilisation']:.1%}",
                      f"{s['us_per_decision']:.0f}")
    Console().print(table)
    print(f"JCT CDF: {png}")
    return 0

