"""`forgeflow cluster register|status|queue|cordon|drain|uncordon|serve` and `forgeflow submit`.

Each prints a readable table, or one JSON object with `--json`. Bad input (an
unknown node or cluster, a job no GPU type can hold, an unreachable database, a
schema from a newer forgeflow) prints one error and exits 2; nothing is changed,
since every change is one transaction.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable


def register(subparsers: argparse._SubParsersAction) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--db", default=None, help="state database URL (default: $FORGEFLOW_DB_URL, else "
                                                   "SQLite in the forgeflow state dir)")
    common.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    named = argparse.ArgumentParser(add_help=False)
    named.add_argument("--cluster", default=None, help="cluster name (default: the only registered one)")

    cluster = subparsers.add_parser(
        "cluster", help="the shared cluster: register an inventory, status, queue, cordon/drain/uncordon",
        description="The orchestrator's view of the cluster, kept in the state database that every "
                    "flow and worker shares.")
    sub = cluster.add_subparsers(dest="cluster_command", metavar="ACTION")
    reg = sub.add_parser("register", parents=[common], help="add or update a cluster inventory (YAML)")
    reg.add_argument("inventory", help="cluster inventory YAML (e.g. configs/clusters/frenzy-testbed.yaml)")
    reg.set_defaults(func=_guard(_register))
    st = sub.add_parser("status", parents=[common, named], help="nodes, health and who holds each GPU")
    st.set_defaults(func=_guard(_status))
    qu = sub.add_parser("queue", parents=[common, named], help="queued jobs in order, and running jobs")
    qu.add_argument("--ended", type=int, default=0, help="also show the last N ended jobs")
    qu.set_defaults(func=_guard(_queue))
    for action, help_text in (("cordon", "take a faulty node out of scheduling (running work is not touched)"),
                              ("drain", "let a node finish its running work and admit nothing new"),
                              ("uncordon", "return a node to scheduling (admits waiting jobs)")):
        p = sub.add_parser(action, parents=[common, named], help=help_text)
        p.add_argument("node", help="node name (see `forgeflow cluster status`)")
        p.add_argument("--reason", default="", help="why (shown in status, kept with the node)")
        p.set_defaults(func=_guard(_health), action=action)
    sv = sub.add_parser(
        "serve", parents=[common, named],
        help="be the cluster's decider: make the policy passes for flows whose view is stale (until Ctrl-C)",
        description="Keep a current view of the cluster and make the policy passes: while this runs, a "
                    "flow that releases or submits with a stale view only writes its change (no ~20 ms "
                    "read-back under the scheduler lock); if it stops or dies, flows pass themselves again. "
                    "Run one per cluster (a second is harmless).")
    sv.add_argument("--seconds", type=float, default=None, help="stop after this long (default: until signalled)")
    sv.set_defaults(func=_guard(_serve))
    cluster.set_defaults(func=lambda args: (cluster.print_help(), 2)[1])

    submit = subparsers.add_parser(
        "submit", parents=[common, named], help="queue a job on the shared cluster (GPU type and count optional)",
        description="Size the job with MARP on every GPU type of the cluster (or only the type/count given) "
                    "and put it in the orchestrator's queue; it starts as soon as the policy admits it.")
    submit.add_argument("job", help="job spec YAML (e.g. configs/tiny-cpu.yaml)")
    submit.add_argument("--gpu-type", default=None, help="only this GPU type (default: any that holds the job)")
    submit.add_argument("--gpus", type=int, default=None, help="exactly this many GPUs (default: MARP sizes it)")
    submit.add_argument("--priority", type=int, default=0, help="higher runs first (default 0)")
    submit.set_defaults(func=_guard(_submit))


def _guard(command: Callable[[argparse.Namespace], Any]) -> Callable[[argparse.Namespace], int]:
    """Turn the typed errors of bad input into one message and exit status 2."""

    def run(args: argparse.Namespace) -> int:
        from infra.statedb import StateDbError
        from training.config import ConfigError

        try:
            return int(command(args) or 0)
        except (ConfigError, StateDbError) as e:  # ClusterError, OrchestratorError, InfeasibleJobError are ConfigErrors
            from infra.yaml_config import report_error  # imported on error only: --help stays fast

            alternatives = getattr(e, "alternatives", None)
            return report_error(e, args.json, **({"alternatives": alternatives} if alternatives else {}))

    return run


def _orchestrator(args: argparse.Namespace):
    from scheduler.orchestrator import Orchestrator

    return Orchestrator(args.db)


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    ago = time.time() - ts
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts))
    return f"{stamp} ({_ago(ago)} ago)"


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _register(args: argparse.Namespace) -> int:
    from scheduler.cluster import load_cluster

    cluster = load_cluster(args.inventory)  # validate before touching the database
    summary = _orchestrator(args).register(cluster, source=str(args.inventory))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"registered cluster {summary['cluster']!r}: {summary['nodes']} nodes, {summary['gpus']} GPUs "
              f"({summary['added']} nodes new, removed: {summary['removed'] or 'none'})")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import signal
    import threading

    orch = _orchestrator(args)
    name = orch.cluster(args.cluster).name  # an unknown or missing cluster is one error, before anything
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # stop cleanly: the heartbeat is cleared on the way out
        signal.signal(sig, lambda *_: stop.set())
    if args.seconds is not None:
        timer = threading.Timer(args.seconds, stop.set)
        timer.daemon = True
        timer.start()
    totals = {"passes": 0, "admitted": 0, "expired": 0}

    def on_pass(result) -> None:  # noqa: ANN001 - PassResult
        if not (result.admitted or result.expired_jobs):
            return
        totals["passes"] += 1
        totals["admitted"] += len(result.admitted)
        totals["expired"] += len(result.expired_jobs)
        if not args.json:
            print(f"{time.strftime('%H:%M:%S')} admitted {result.admitted or '-'}"
                  + (f", leases expired: {result.expired_jobs}" if result.expired_jobs else ""), flush=True)

    if not args.json:
        print(f"deciding for cluster {name!r} as {orch.actor}; Ctrl-C stops", flush=True)
    orch.serve(name, stop=stop, on_pass=on_pass)
    if args.json:
        print(json.dumps({"actor": orch.actor, **totals}, indent=2))
    else:
        print(f"stopped: {totals['admitted']} admitted, {totals['expired']} lease(s) reclaimed")
    return 0


def _status(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from scheduler.orchestrator.views import cluster_status

    status = cluster_status(_orchestrator(args).engine, args.cluster)
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    free = ", ".join(f"{t} {status['free_by_type'].get(t, 0)}/{n}" for t, n in status["gpus_by_type"].items())
    jobs = ", ".join(f"{k} {v}" for k, v in sorted(status["jobs_by_state"].items())) or "none"
    table = Table(title=f"cluster {status['cluster']} — free: {free} — jobs: {jobs}")
    for col in ("node", "GPU type", "state", "GPUs (index:job)", "reason", "by / when"):
        table.add_column(col)
    style = {"ready": "green", "cordoned": "red", "drained": "yellow", "draining": "yellow"}
    for n in status["nodes"]:
        gpus = " ".join(f"{g['index']}:{g['job'] or '·'}" for g in n["gpus"])
        who = f"{n['changed_by'] or '-'} {_when(n['changed_at'])}" if n["state"] != "ready" else ""
        table.add_row(n["node"], n["gpu_type"], f"[{style.get(n['state'], '')}]{n['state']}[/]", gpus,
                      n["reason"] or "", who)
    Console(width=200).print(table)
    return 0


def _queue(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from scheduler.orchestrator.views import queue_snapshot

    snap = queue_snapshot(_orchestrator(args).engine, args.cluster, include_done=args.ended)
    if args.json:
        print(json.dumps(snap, indent=2))
        return 0
    console = Console(width=200)
    table = Table(title=f"queue of {snap['cluster']}: {len(snap['queued'])} waiting, {len(snap['running'])} running")
    for col in ("#", "job id", "name", "state", "priority", "wants / holds", "since", "note"):
        table.add_column(col)
    for j in snap["queued"]:
        table.add_row(str(j["position"]), str(j["job_id"]), j["name"], "queued", str(j["priority"]),
                      j["wants"] or "", _when(j["submitted_at"]), j["reason"] or "")
    for j in snap["running"] + snap["ended"]:
        p = j.get("placement")
        holds = f"{p['world_size']}x {p['gpu_type']} on {', '.join(p['nodes'])}" if p else ""
        since = _when(j["admitted_at"] if j["state"] == "running" else j["finished_at"])
        table.add_row("", str(j["job_id"]), j["name"], j["state"], str(j["priority"]), holds, since, j["reason"] or "")
    console.print(table)
    return 0


def _health(args: argparse.Namespace) -> int:
    o = _orchestrator(args)
    result = getattr(o, args.action)(args.node, reason=args.reason, cluster=args.cluster)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{result['node']}: {result['previous']} -> {result['state']}"
          + (f" ({result['reason']})" if result["reason"] else ""))
    if result["running_jobs"] and args.action != "uncordon":
        print(f"  still running there (not touched): job(s) {', '.join(map(str, result['running_jobs']))}")
    if result["admitted"]:
        print(f"  admitted: job(s) {', '.join(map(str, result['admitted']))}")
    return 0


def _submit(args: argparse.Namespace) -> int:
    from scheduler.orchestrator import job_options
    from training.config import load_job_spec

    spec = load_job_spec(args.job)
    o = _orchestrator(args)
    cluster = o.cluster(args.cluster)
    options = job_options(spec, cluster, gpu_type=args.gpu_type, gpus=args.gpus)
    job_id = o.submit(spec.name, options, cluster=cluster.name, priority=args.priority,
                      spec=spec.model_dump(mode="json"))
    job = o.job(job_id)
    position, length = o.queue_position(job_id)
    out = {"job_id": job_id, "name": spec.name, "cluster": cluster.name, "state": job["state"],
           "position": position, "queue_length": length,
           "options": {p: [f"{x.num_gpus}x {x.gpu_type}" for x in opts] for p, opts in options.items()},
           "placement": job["placement"]}
    if args.json:
        print(json.dumps(out, indent=2))
    elif job["state"] == "running":
        p = job["placement"]
        nodes = ", ".join(f"{n['node']}[{','.join(map(str, n['gpus']))}]" for n in p["nodes"])
        print(f"job {job_id} ({spec.name}) admitted: {p['world_size']}x {p['gpu_type']} "
              f"(dp{p['dp']} tp{p['tp']} pp{p['pp']}) on {nodes}")
    else:
        print(f"job {job_id} ({spec.name}) queued: position {position} of {length}")
    return 0

