"""`forgeflow cluster register|status|queue|cordon|drain|uncordon|serve`, an operator's
`forgeflow cluster team add|list` and `cluster team member add`, and a job's `forgeflow jobs`,
`forgeflow cancel` and `forgeflow logs`.

Each prints a readable table, or one JSON object with `--json`. Bad input (an
unknown node, cluster, team or job, a job no GPU type can hold, cancelling a job that
ended, an unreachable database, a schema from a newer forgeflow) and what the state database
refuses the caller's role (PostgreSQL's row-level security and privileges) print one error
and exit 2; nothing is changed, since every change is one transaction.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
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
    sv.add_argument("--preempt-stop-s", type=float, default=None, metavar="SECONDS",
                    help="also preempt for waiting jobs of a higher priority class, or on their team's own quota: "
                         "the running jobs that lose the least work since their last checkpoint are asked to "
                         "stop (they commit the step they are on) and are queued again at their submit time; one "
                         "that has not stopped after SECONDS is force-released (default: no preemption)")
    sv.set_defaults(func=_guard(_serve))
    _register_team_commands(sub, common)
    cluster.set_defaults(func=lambda args: (cluster.print_help(), 2)[1])

    jobs = subparsers.add_parser(
        "jobs", parents=[common], help="jobs on the shared clusters: state, GPUs, step and loss; when a queued "
                                       "one starts and why it waits",
        description="Queued and running jobs, and those that ended in the last hour (--all: every job), with "
                    "owner and team. On PostgreSQL a role sees its own jobs and its teams' (an operator every "
                    "job): the database's row-level security decides. A queued "
                    "job shows its place in the queue, why it waits and when it is expected to start: the "
                    "cluster's policy run forward over the running jobs' expected ends (their measured step "
                    "time when they report one, else the cost model's prediction).")
    jobs.add_argument("--cluster", default=None, help="only this cluster's jobs (default: every cluster)")
    jobs.add_argument("--mine", action="store_true", help="only jobs I submitted (PostgreSQL: my database role; "
                                                           "SQLite: my user name, on any host)")
    jobs.add_argument("--all", action="store_true", help="every ended job too, not only the last hour's")
    jobs.set_defaults(func=_guard(_jobs))

    cancel = subparsers.add_parser(
        "cancel", parents=[common], help="stop a job: a queued one leaves the queue, a running one stops gracefully",
        description="A queued job is cancelled at once. A running job's flow sees the request within "
                    "about 2 s: its ranks get SIGTERM, commit the step they are on and exit, "
                    "and the job ends as cancelled, its GPUs released. Who cancelled and why is recorded.")
    cancel.add_argument("job_id", type=int, metavar="ID", help="job id (see `forgeflow jobs`)")
    cancel.add_argument("--reason", default="cancelled with forgeflow cancel", help="why (kept with the job)")
    cancel.set_defaults(func=_guard(_cancel))

    logs = subparsers.add_parser(
        "logs", parents=[common], help="print a job's logs (node consoles, a rank's run log, or its runner's)",
        description="The newest attempt's node consoles, each line prefixed with its node (--attempt N: "
                    "attempt N's); --rank R: rank R's run log (steps and events of every attempt). Before "
                    "anything was launched, the runner's own log (a queued job's 'waiting for GPUs').")
    logs.add_argument("job_id", type=int, metavar="ID", help="job id (see `forgeflow jobs`)")
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing new lines until the job ends")
    logs.add_argument("--rank", type=int, default=None, help="rank R's run log instead of the node consoles")
    logs.add_argument("--attempt", type=int, default=None, help="attempt N's node consoles (default: the newest)")
    logs.set_defaults(func=_guard(_logs))
    _register_team_rules(sub, common, named)


# ---------------------------------------------------------------- quotas, classes, caps, usage
def _register_team_rules(sub: argparse._SubParsersAction, common: argparse.ArgumentParser,
                         named: argparse.ArgumentParser) -> None:
    """`cluster quota set`, `cluster class add`, `cluster team cap`, `cluster usage` (issue 30).
    `cluster team` may already exist (team add / member add): cap joins it."""
    quota = sub.add_parser("quota", help="a team's GPU quota per type, and how much idle quota it may borrow")
    quota_sub = quota.add_subparsers(dest="quota_command", metavar="ACTION")
    qs = quota_sub.add_parser("set", parents=[common, named], help="set TEAM's nominal quota of GPU_TYPE")
    qs.add_argument("team")
    qs.add_argument("gpu_type")
    qs.add_argument("nominal", type=int, help="GPUs of the type the team may always use")
    qs.add_argument("--borrow", default="0", help="GPUs above it the team may borrow from other teams' idle "
                                                  "quota (a number, or 'any'; default 0)")
    qs.set_defaults(func=_guard(_quota_set))
    quota.set_defaults(func=lambda args: (quota.print_help(), 2)[1])

    classes = sub.add_parser("class", help="named priority classes (higher value goes first)")
    class_sub = classes.add_subparsers(dest="class_command", metavar="ACTION")
    ca = class_sub.add_parser("add", parents=[common], help="define a priority class, or change its value")
    ca.add_argument("name")
    ca.add_argument("value", type=int, help="whole number from -1000 to 1000; higher goes first")
    ca.add_argument("--description", default=None)
    ca.set_defaults(func=_guard(_class_add))
    classes.set_defaults(func=lambda args: (classes.print_help(), 2)[1])

    team = sub.choices.get("team")
    if team is None:
        team = sub.add_parser("team", help="teams: members, the highest priority class a team may use")
        team_sub = team.add_subparsers(dest="team_command", metavar="ACTION")
        team.set_defaults(func=lambda args: (team.print_help(), 2)[1])
    else:
        team_sub = next(a for a in team._actions if isinstance(a, argparse._SubParsersAction))
    cap = team_sub.add_parser("cap", parents=[common], help="the highest priority class TEAM may submit at")
    cap.add_argument("team")
    cap.add_argument("priority_class", metavar="CLASS")
    cap.set_defaults(func=_guard(_team_cap))

    use = sub.add_parser("usage", parents=[common, named],
                         help="GPU-hours by GPU type, queue time and preemptions per team or user",
                         description="A direct sum over the allocation history: every GPU's allocations clipped "
                                     "to the window; queue time of the jobs admitted in it; preemptions that "
                                     "ended in it, suffered (the victim's) and caused (the preempting job's).")
    use.add_argument("--since", default="7d", help="window: 7d, 12h, 30m, 2w (default 7d)")
    use.add_argument("--by", choices=("team", "user"), default="team")
    use.set_defaults(func=_guard(_usage))


def _quota_set(args: argparse.Namespace) -> int:
    from scheduler.orchestrator.config import OrchestratorError

    borrow = None if args.borrow == "any" else int(args.borrow) if args.borrow.isdigit() else -1
    if borrow == -1:
        raise OrchestratorError(f"--borrow {args.borrow!r}: give a whole number of GPUs or 'any'")
    result = _orchestrator(args).set_quota(args.team, args.gpu_type, args.nominal, borrow, cluster=args.cluster)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        limit = "any idle quota" if borrow is None else f"up to {borrow} more"
        print(f"team {result['team']!r} on {result['cluster']!r}: {result['nominal']} {result['gpu_type']}, "
              f"borrowing {limit}")
    return 0


def _rules_write(args: argparse.Namespace, change: Callable) -> dict[str, Any]:
    from infra.statedb import write_transaction

    with write_transaction(_orchestrator(args).engine) as conn:
        return change(conn)


def _class_add(args: argparse.Namespace) -> int:
    from scheduler.orchestrator.quotas import add_class
    from scheduler.orchestrator.service import check_priority

    check_priority(args.value)
    result = _rules_write(args, lambda conn: add_class(conn, args.name, args.value, args.description))
    print(json.dumps(result, indent=2) if args.json else f"priority class {result['class']!r} = {result['value']}")
    return 0


def _team_cap(args: argparse.Namespace) -> int:
    from scheduler.orchestrator.quotas import set_cap

    result = _rules_write(args, lambda conn: set_cap(conn, args.team, args.priority_class))
    print(json.dumps(result, indent=2) if args.json
          else f"team {result['team']!r} may submit up to class {result['cap']!r} ({result['value']})")
    return 0


def _usage(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from scheduler.orchestrator.usage import parse_since, usage

    report = usage(_orchestrator(args).engine, args.cluster, since_s=parse_since(args.since), by=args.by)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    table = Table(title=_plain(f"{report['cluster']}: usage over the last {args.since}"))
    for col in (args.by, "GPU-hours", "by GPU type", "admissions", "mean queue", "preempted", "preempted others"):
        table.add_column(col)
    for r in report["rows"]:
        types = ", ".join(f"{t} {h:.2f}" for t, h in sorted(r["gpu_hours"].items()))
        mean = "-" if r["queue_s_mean"] is None else _ago(r["queue_s_mean"])
        table.add_row(*map(_plain, (r[args.by] or "(none)", f"{r['gpu_hours_total']:.2f}", types or "-",
                                    str(r["admissions"]), mean, str(r["preemptions_suffered"]),
                                    str(r["preemptions_caused"]))))
    Console().print(table)
    return 0


def _register_team_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    team = sub.add_parser(
        "team", help="teams (an operator's): add a team with its weight, put database roles in it, list them",
        description="Teams share the cluster. On PostgreSQL a member is a database role (the role a person or "
                    "a team's flow worker connects as); a team admin may change every job of the team. Only the "
                    "operator role may change teams. SQLite is single-user: teams are recorded, no identity "
                    "is checked.")
    team_sub = team.add_subparsers(dest="team_command", metavar="ACTION")
    add = team_sub.add_parser("add", parents=[common], help="add a team, or set an existing team's weight")
    add.add_argument("name", help="team name (letters, digits, '.', '_', '-')")
    add.add_argument("--weight", type=float, default=1.0, help="fair-share weight (default 1)")
    add.set_defaults(func=_guard(_team_add))
    listed = team_sub.add_parser("list", parents=[common], help="teams, weights and members")
    listed.set_defaults(func=_guard(_team_list))
    member = team_sub.add_parser("member", help="team membership").add_subparsers(
        dest="member_command", metavar="ACTION")
    madd = member.add_parser("add", parents=[common], help="put a database role in a team")
    madd.add_argument("team", help="team name (see `forgeflow cluster team list`)")
    madd.add_argument("role", help="the database role (PostgreSQL: it must exist)")
    madd.add_argument("--admin", action="store_true", help="may change every job of the team")
    madd.set_defaults(func=_guard(_member_add))
    team.set_defaults(func=lambda args: (team.print_help(), 2)[1])


def _guard(command: Callable[[argparse.Namespace], Any]) -> Callable[[argparse.Namespace], int]:
    """Turn the typed errors of bad input, and the database's refusals of the caller's role,
    into one message and exit status 2."""

    def run(args: argparse.Namespace) -> int:
        import sqlalchemy as sa

        from infra.statedb import StateDbError
        from training.config import ConfigError

        try:
            return int(command(args) or 0)
        except (ConfigError, StateDbError) as e:  # ClusterError, OrchestratorError, InfeasibleJobError are ConfigErrors
            return _report(e, args)
        except sa.exc.DBAPIError as e:  # a refusal sent in a statement batch (the engine's translation misses it)
            from scheduler.orchestrator.identity import refusal_of

            refusal = refusal_of(e)
            if refusal is None:
                raise
            return _report(refusal, args)

    return run


def _report(e: Exception, args: argparse.Namespace) -> int:
    from infra.yaml_config import report_error  # imported on error only: --help stays fast

    alternatives = getattr(e, "alternatives", None)
    return report_error(e, args.json, **({"alternatives": alternatives} if alternatives else {}))


def _orchestrator(args: argparse.Namespace):
    from scheduler.orchestrator import Orchestrator

    return Orchestrator(args.db)


def _single_user_note(orch) -> str:  # noqa: ANN001 - Orchestrator
    return ("" if orch.identity is not None else
            "\n  (SQLite is single-user: teams are recorded for quotas and fair share, nobody's identity is "
            "checked; use PostgreSQL for roles and row-level security)")


def _team_add(args: argparse.Namespace) -> int:
    from scheduler.orchestrator.teams import add_team

    orch = _orchestrator(args)
    out = add_team(orch.engine, args.name, args.weight)
    orch.rules_changed()  # every cached view reads the new team or weight back (fair share)
    if args.json:
        print(json.dumps(out, indent=2))
    elif out["previous_weight"] is None:
        print(f"team {out['team']!r} added, weight {out['weight']:g}" + _single_user_note(orch))
    else:
        print(f"team {out['team']!r}: weight {out['previous_weight']:g} -> {out['weight']:g}")
    return 0


def _member_add(args: argparse.Namespace) -> int:
    from scheduler.orchestrator.teams import add_member

    orch = _orchestrator(args)
    out = add_member(orch.engine, args.team, args.role, admin=args.admin)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"role {out['member']!r} {'is now' if out['was_member'] else 'added to'} team {out['team']!r}"
              + (" as its admin" if out["admin"] else "") + _single_user_note(orch))
    return 0


def _team_list(args: argparse.Namespace) -> int:
    from scheduler.orchestrator.teams import list_teams

    out = list_teams(_orchestrator(args).engine)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    if not out["teams"]:
        print("no teams; an operator adds one with `forgeflow cluster team add NAME`")
    for t in out["teams"]:
        members = ", ".join(m["member"] + (" (admin)" if m["admin"] else "") for m in t["members"]) or "no members"
        print(f"{t['team']} (weight {t['weight']:g}): {members}")
    return 0


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
    # the file's absolute path: `forgeflow submit` with no --cluster places on it (default_cluster_source)
    summary = _orchestrator(args).register(cluster, source=str(Path(args.inventory).resolve()))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"registered cluster {summary['cluster']!r}: {summary['nodes']} nodes, {summary['gpus']} GPUs "
              f"({summary['added']} nodes new, removed: {summary['removed'] or 'none'})")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import signal

    from infra.stop_signal import stop_on_signals

    from scheduler.orchestrator import Orchestrator, OrchestratorConfig, OrchestratorError

    if args.preempt_stop_s is not None and not args.preempt_stop_s > 0:
        raise OrchestratorError(f"--preempt-stop-s is the seconds a preempted job has to stop: give a number "
                                f"above 0 (got {args.preempt_stop_s:g})")
    orch = Orchestrator(args.db, OrchestratorConfig(preempt_stop_s=args.preempt_stop_s))
    name = orch.cluster(args.cluster).name  # an unknown or missing cluster is one error, before anything
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

    # Ctrl-C, SIGTERM (systemd, a supervisor) and --seconds (an alarm) only flag the stop and wake the
    # loop's wait; it ends after the pass or read in progress and clears its heartbeat (infra.stop_signal)
    with stop_on_signals(signal.SIGINT, signal.SIGTERM, signal.SIGALRM) as stop:
        if not args.json:
            print(f"deciding for cluster {name!r} as {orch.actor}; Ctrl-C stops", flush=True)
        if args.seconds is not None:
            signal.setitimer(signal.ITIMER_REAL, max(args.seconds, 1e-6))
        try:
            orch.serve(name, stop=stop, on_pass=on_pass)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if args.json:  # still inside: a second SIGTERM now is flagged, not a kill mid-summary
            print(json.dumps({"actor": orch.actor, **totals}, indent=2))
        else:
            print(f"stopped: {totals['admitted']} admitted, {totals['expired']} lease(s) reclaimed")
    return 0


def _plain(text: str, style: str = ""):
    """A table cell or title as plain text: names, reasons and notes are people's text, so
    rich markup in them (`[/oops]`) is shown, not parsed, and terminal escapes are dropped."""
    from rich.text import Text

    from infra.untrusted_text import printable

    return Text(printable(text), style=style)


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
    table = Table(title=_plain(f"cluster {status['cluster']} — free: {free} — jobs: {jobs}"))
    for col in ("node", "GPU type", "state", "GPUs (index:job)", "reason", "by / when"):
        table.add_column(col)
    style = {"ready": "green", "cordoned": "red", "drained": "yellow", "draining": "yellow"}
    for n in status["nodes"]:
        gpus = " ".join(f"{g['index']}:{g['job'] or '·'}" for g in n["gpus"])
        who = f"{n['changed_by'] or '-'} {_when(n['changed_at'])}" if n["state"] != "ready" else ""
        table.add_row(_plain(n["node"]), _plain(n["gpu_type"]), _plain(n["state"], style.get(n["state"], "")),
                      _plain(gpus), _plain(n["reason"] or ""), _plain(who))
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
    delegated = snap.get("delegated", [])
    table = Table(title=_plain(f"queue of {snap['cluster']}: {len(snap['queued'])} waiting, "
                               f"{len(snap['running'])} running"
                               + (f", {len(delegated)} in the batch system (they hold no GPUs here)"
                                  if delegated else "")))
    for col in ("#", "job id", "name", "team", "state", "priority", "wants / holds", "since", "note"):
        table.add_column(col)
    for j in snap["queued"]:
        table.add_row(*map(_plain, (str(j["position"]), str(j["job_id"]), j["name"], j["team"] or "", "queued",
                                    str(j["priority"]), j["wants"] or "", _when(j["submitted_at"]), j["reason"] or "")))
    for j in delegated:  # the site's batch system (Slurm) decides where and when: what it says
        table.add_row(*map(_plain, ("", str(j["job_id"]), j["name"], j["team"] or "", "delegated", str(j["priority"]),
                                    j["batch_text"] or "", _when(j["submitted_at"]), j["reason"] or "")))
    for j in snap["running"] + snap["ended"]:
        p = j.get("placement")
        holds = f"{p['world_size']}x {p['gpu_type']} on {', '.join(p['nodes'])}" if p else ""
        since = _when(j["admitted_at"] if j["state"] == "running" else j["finished_at"])
        table.add_row(*map(_plain, ("", str(j["job_id"]), j["name"], j["team"] or "", j["state"], str(j["priority"]),
                                    holds, since, j["reason"] or "")))
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


def _jobs(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from scheduler.orchestrator.start_estimates import in_words
    from scheduler.orchestrator.views import RECENT_S, job_list

    orch = _orchestrator(args)
    # PostgreSQL: the database role, exactly (the rows another role may not see never arrive);
    # SQLite: the user name of user@host, on any host
    user = (orch.actor if orch.identity is not None else orch.actor.split("@")[0]) if args.mine else None
    listing = job_list(orch.engine, cluster=args.cluster, user=user, include_all=args.all,
                       exact_owner=orch.identity is not None)
    if args.json:
        print(json.dumps(listing, indent=2))
        return 0
    shown = "every job" if args.all else f"active and ended in the last {RECENT_S / 3600:g} h"
    table = Table(title=_plain(f"jobs{' of ' + user if user else ''} ({shown}): {len(listing['jobs'])}"))
    for col in ("id", "name", "owner", "team", "state", "GPUs", "step", "loss", "queue / start",
                "why / last diagnosis"):
        table.add_column(col)
    style = {"running": "green", "finished": "blue", "failed": "red", "cancelled": "yellow",
             "recovering": "magenta", "preempted": "magenta", "waiting": "yellow", "delegated": "yellow"}
    for j in listing["jobs"]:
        step = f"{j['step']}/{j['steps']}" if j["step"] is not None else ""
        loss = f"{j['loss']:.4f}" if isinstance(j["loss"], (int, float)) else ""
        if "position" in j:
            start = j["estimated_start"]
            when = (f"#{j['position']}, " + (f"{time.strftime('%H:%M', time.gmtime(start))} UTC "
                                            f"({in_words(j['estimated_start_in_s'])})" if start is not None else "not yet"))
            note = j["why"]
            if j["state"] == "preempted" and (j["reason"] or "").startswith(("preempted by job", "resized to")):
                note = f"{j['reason']}; {note}" if note else j["reason"]
        else:
            when = _when(j["finished_at"] if j["finished_at"] else j["admitted_at"])
            note = j.get("waiting") or j["diagnosis"] or ""  # waiting: "waiting in Slurm: Priority (job N)"
            if j.get("batch"):  # a delegated job: what Slurm says ("slurm 123: RUNNING on n1")
                note = j["batch"] + (f"; {note}" if note and not note.startswith("waiting in ") else "")
            if j["stop_requested"] and j["state"] in ("running", "recovering", "waiting", "delegated"):
                asked = (f"{j['stop_requested']['reason']}: stopping" if j["stop_requested"].get("preempted_by")
                         else f"cancel requested by {j['stop_requested']['by']}")
                note = asked + (f"; {note}" if note else "")
            elif j["state"] in ("finished", "failed", "cancelled") and j["reason"]:
                note = j["reason"] + (f" (last diagnosis: {note})" if note else "")
        if j.get("runner_alive") is False:
            note = (f"its runner (pid {j['runner']['pid']}) is gone, nothing runs it: "
                    f"`forgeflow cancel {j['job_id']}` and submit it again") + (f"; {note}" if note else "")
        cells = (str(j["job_id"]), j["name"], (j["owner"] or "").split("@")[0], j["team"] or "", j["state"],
                 j["gpus"] or "", step, loss, when, note)
        table.add_row(*(_plain(c, style.get(c, "") if i == 4 else "") for i, c in enumerate(cells)))
    Console(width=220).print(table)
    return 0


def _cancel(args: argparse.Namespace) -> int:
    orch = _orchestrator(args)
    previous = orch.request_stop(args.job_id, args.reason)
    job = orch.job(args.job_id)
    label = f"job {args.job_id} ({job['name']})"
    if previous == "queued":
        said = f"{label} was queued: cancelled, it left the queue"
    elif previous == "delegated":
        from scheduler.orchestrator.lease import STOP_CHECK_S  # its flow reads the request this often

        said = (f"{label} is in the batch system: asked to stop; within about {STOP_CHECK_S:.0f} s its flow "
                "cancels its batch job (a running one's ranks commit the step they are on first) "
                "(`forgeflow jobs` shows it cancelled)")
    else:
        from scheduler.orchestrator.seat import FLOW_LEASE_S  # a flow reads the request at each renewal

        step = (job["progress"] or {}).get("step")
        last = f" (last reported: step {step})" if isinstance(step, int) else ""
        said = (f"{label} is running: asked to stop; within about {FLOW_LEASE_S / 3:.0f} s its ranks commit the "
                f"step they are on{last} and exit (`forgeflow jobs` shows it cancelled)")
    if args.json:
        print(json.dumps({"job_id": args.job_id, "name": job["name"], "previous_state": previous,
                          "state": job["state"], "stop_requested": job["stop_requested"], "message": said}, indent=2))
    else:
        print(said)
    return 0


def _logs(args: argparse.Namespace) -> int:
    import sys

    from scheduler.orchestrator.job_logs import LogTail, follow, log_sources

    orch = _orchestrator(args)
    job = orch.job(args.job_id)  # an unknown id: one error, exit 2

    def choose(row: dict) -> Any:
        return log_sources(row, rank=args.rank, attempt=args.attempt)

    def note(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    selection = choose(job)  # a rank or attempt the job does not have: one error, before any output
    if args.follow:
        follow(lambda: orch.job(args.job_id), choose, lambda line: print(line, flush=True), note)
        return 0
    note(f"==> {selection.title} <==" if selection.sources else selection.missing)
    for line in LogTail().read(selection.sources, final=True):
        print(line)
    return 0
