"""Teams on the live orchestrator: quotas, priority classes, and what a pass needs of them.

- The operator's changes (`set_quota`, `add_class`, `set_cap`), each checked before anything is
  written: a quota larger than the cluster's GPUs of that type (alone, or with the other teams'
  nominal quotas), an unknown team, class or GPU type is an OrchestratorError naming the fix.
- `resolve_priority`: a submitted priority as a class name (or the plain integer while no class
  is defined), checked against the team's cap.
- `TeamState`: what a cached view of the cluster keeps for `scheduler.fair_share.decide` — the
  rules (read when the view is read back), the running jobs' teams and since when they hold
  their GPUs, and the decayed usage of ended allocations (read from the allocation history when
  the view is read back, then kept up to date as jobs end).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from infra.statedb.schema import allocations, clusters, gpus, jobs, priority_classes, quotas, team_class_caps, teams
from scheduler.fair_share import NO_TEAM, DecayedUsage, Quota, RunningJob, Snapshot, TeamRules, decide, holdings, team_usage
from scheduler.orchestrator.config import OrchestratorError


# ------------------------------------------------------------------ operator changes
def _team_exists(conn: Connection, team: str) -> None:
    known = [t for (t,) in conn.execute(sa.select(teams.c.name).order_by(teams.c.name))]
    if team not in known:
        raise OrchestratorError(f"no team named {team!r} (teams: {', '.join(known) or 'none'}); "
                                "add it first with `forgeflow cluster team add`")


def set_quota(conn: Connection, cluster: str, team: str, gpu_type: str, nominal: int,
              borrowing_limit: int | None) -> dict[str, Any]:
    """Set the team's nominal quota of a GPU type on the cluster (and its borrowing limit)."""
    if nominal < 0 or (borrowing_limit is not None and borrowing_limit < 0):
        raise OrchestratorError("a quota and a borrowing limit are whole numbers of GPUs, 0 or more")
    _team_exists(conn, team)
    inventory = dict(conn.execute(sa.select(gpus.c.gpu_type, sa.func.count()).where(
        gpus.c.cluster == cluster).group_by(gpus.c.gpu_type)).all())
    if gpu_type not in inventory:
        raise OrchestratorError(f"cluster {cluster!r} has no GPU type {gpu_type!r} "
                                f"(it has: {', '.join(sorted(inventory))})")
    others = conn.execute(sa.select(sa.func.coalesce(sa.func.sum(quotas.c.nominal), 0)).where(
        quotas.c.cluster == cluster, quotas.c.gpu_type == gpu_type, quotas.c.team != team)).scalar()
    have = inventory[gpu_type]
    if nominal > have:
        raise OrchestratorError(f"a quota of {nominal} {gpu_type} is larger than cluster {cluster!r}'s "
                                f"{have}; give at most {have}")
    if nominal + others > have:
        raise OrchestratorError(f"{nominal} {gpu_type} for {team!r} and the other teams' {others} add up to more "
                                f"than cluster {cluster!r}'s {have}; give at most {have - others} "
                                "(or lower another team's quota first)")
    conn.execute(sa.delete(quotas).where(quotas.c.cluster == cluster, quotas.c.team == team,
                                         quotas.c.gpu_type == gpu_type))
    conn.execute(sa.insert(quotas).values(cluster=cluster, team=team, gpu_type=gpu_type, nominal=nominal,
                                          borrowing_limit=borrowing_limit))
    return {"cluster": cluster, "team": team, "gpu_type": gpu_type, "nominal": nominal,
            "borrowing_limit": borrowing_limit}


def add_class(conn: Connection, name: str, value: int, description: str | None = None) -> dict[str, Any]:
    """Define (or change the value of) a priority class; higher values go first (the caller
    checks the value's range: `service.check_priority`)."""
    if not name or len(name) > 100 or not name.replace("-", "").replace("_", "").isalnum():
        raise OrchestratorError(f"a priority class name is letters, digits, '-' and '_' (got {name!r})")
    conn.execute(sa.delete(priority_classes).where(priority_classes.c.name == name))
    conn.execute(sa.insert(priority_classes).values(name=name, value=value, description=description))
    return {"class": name, "value": value}


def _classes(conn: Connection) -> dict[str, int]:
    return dict(conn.execute(sa.select(priority_classes.c.name, priority_classes.c.value)
                             .order_by(priority_classes.c.value.desc())).all())


def set_cap(conn: Connection, team: str, class_name: str) -> dict[str, Any]:
    """The highest priority class the team may submit at."""
    _team_exists(conn, team)
    classes = _classes(conn)
    if class_name not in classes:
        raise OrchestratorError(f"no priority class named {class_name!r} (classes: {', '.join(classes) or 'none'}); "
                                "define it with `forgeflow cluster class add NAME VALUE`")
    conn.execute(sa.delete(team_class_caps).where(team_class_caps.c.team == team))
    conn.execute(sa.insert(team_class_caps).values(team=team, priority_class=class_name))
    return {"team": team, "cap": class_name, "value": classes[class_name]}


def resolve_priority(conn: Connection, priority: int | str, team: str | None) -> int:
    """The job's priority value: a class name's value, or the plain integer while no class is
    defined (0, the default, is always allowed). Refused: an unknown class, a class above the
    team's cap, an integer other than 0 once classes exist."""
    classes = _classes(conn)
    if isinstance(priority, str) and not priority.lstrip("-").isdigit():
        if priority not in classes:
            raise OrchestratorError(f"no priority class named {priority!r} (classes: "
                                    f"{', '.join(classes) or 'none: give a whole number'})")
        value = classes[priority]
    else:
        value = int(priority)
        if classes and value != 0:
            raise OrchestratorError(f"priority {value}: this database defines priority classes; give one by "
                                    f"name ({', '.join(classes)})")
    if team:
        cap = conn.execute(sa.select(team_class_caps.c.priority_class).where(team_class_caps.c.team == team)).scalar()
        if cap is not None and value > classes.get(cap, value):
            allowed = [n for n, v in classes.items() if v <= classes[cap]]
            raise OrchestratorError(f"team {team!r} may submit at most at class {cap!r}; "
                                    f"give one of: {', '.join(allowed)}")
    return value


def list_rules(conn: Connection, cluster: str) -> dict[str, Any]:
    """What is set: quotas of the cluster, classes, caps (for `forgeflow cluster quota show`)."""
    return {"quotas": [dict(r._mapping) for r in conn.execute(sa.select(quotas).where(
                quotas.c.cluster == cluster).order_by(quotas.c.team, quotas.c.gpu_type))],
            "classes": _classes(conn),
            "caps": dict(conn.execute(sa.select(team_class_caps.c.team, team_class_caps.c.priority_class)).all())}


# ------------------------------------------------------------------ what a pass needs
def load_rules(conn: Connection, cluster: str) -> TeamRules | None:
    """The cluster's team rules, or None while no team is defined (a pass is the plain policy pass)."""
    weights = dict(conn.execute(sa.select(teams.c.name, teams.c.weight)).all())
    if not weights:
        return None
    half_life = conn.execute(sa.select(clusters.c.usage_half_life_s).where(clusters.c.name == cluster)).scalar()
    rows = conn.execute(sa.select(quotas.c.team, quotas.c.gpu_type, quotas.c.nominal, quotas.c.borrowing_limit)
                        .where(quotas.c.cluster == cluster)).all()
    return TeamRules({(t, g): Quota(n, b) for t, g, n, b in rows}, weights, float(half_life or 604800.0))


class TeamState:
    """The team side of one process's view of a cluster (`service._View.teams`)."""

    def __init__(self, rules: TeamRules, running: dict[int, RunningJob], usage: DecayedUsage):
        self.rules = rules
        self.running = running
        self.usage = usage
        self.team_of: dict[int, str] = {}  # queued and running jobs' teams ("" without one)
        self.unknown: set[int] = set()  # running jobs admitted by another process, team not read yet
        self.head: int | None = None  # the job the last pass reserved GPUs for (kept first until it starts)

    @classmethod
    def load(cls, conn: Connection, cluster: str) -> "TeamState | None":
        rules = load_rules(conn, cluster)
        if rules is None:
            return None
        running = {job_id: RunningJob(team or NO_TEAM, gpu_type, world_size, admitted)
                   for job_id, team, admitted, gpu_type, world_size in conn.execute(sa.select(
                       jobs.c.id, jobs.c.team, jobs.c.admitted_at, jobs.c.placement["gpu_type"].as_string(),
                       jobs.c.placement["world_size"].as_integer()).where(
                       jobs.c.cluster == cluster, jobs.c.state == "running"))}
        usage = DecayedUsage(rules.half_life_s)
        # ended allocations, one row per admission (its GPUs share their start and end)
        for team, start, end, count in conn.execute(sa.select(
                jobs.c.team, allocations.c.allocated_at, allocations.c.released_at, sa.func.count())
                .join(jobs, jobs.c.id == allocations.c.job_id)
                .where(allocations.c.cluster == cluster, allocations.c.released_at.is_not(None))
                .group_by(jobs.c.team, allocations.c.allocated_at, allocations.c.released_at)
                .order_by(allocations.c.released_at)):
            usage.add(team or NO_TEAM, count, start, end)
        state = cls(rules, running, usage)
        state.team_of.update({j: r.team for j, r in running.items()})
        return state

    def admitted(self, job_id: int, gpu_type: str, num_gpus: int, at: float) -> None:
        if job_id not in self.team_of:
            self.unknown.add(job_id)
        if self.head == job_id:
            self.head = None
        self.running[job_id] = RunningJob(self.team_of.get(job_id, NO_TEAM), gpu_type, num_gpus, at)

    def ended(self, job_id: int, at: float) -> None:
        self.team_of.pop(job_id, None)
        self.unknown.discard(job_id)
        if self.head == job_id:
            self.head = None
        job = self.running.pop(job_id, None)
        if job is not None:
            self.usage.add(job.team, job.num_gpus, job.admitted_s, max(at, job.admitted_s))

    def learn_teams(self, conn: Connection, job_ids: list[int]) -> None:
        """Read the teams of queued jobs this view has not seen yet (submitted by other processes)."""
        unknown = [j for j in job_ids if j not in self.team_of]
        for start in range(0, len(unknown), 500):
            chunk = unknown[start:start + 500]
            for job_id, team in conn.execute(sa.select(jobs.c.id, jobs.c.team).where(jobs.c.id.in_(chunk))):
                self.team_of[job_id] = team or NO_TEAM

    def decide(self, conn: Connection, policy: str, now: float, queue, keys, running, free, *,
               reservation_depth: int):
        """The pass with fair-share order and the quota gate (`scheduler.fair_share.decide`)."""
        return decide(self.snapshot(conn, policy, now, queue, keys, running, free,
                                    reservation_depth=reservation_depth))

    def snapshot(self, conn: Connection, policy: str, now: float, queue, keys, running, free, *,
                 reservation_depth: int) -> Snapshot:
        """What a pass (and `scheduler.preemption.plan`) decides over."""
        self.learn_teams(conn, [k[2] for k in keys] + sorted(self.unknown))
        for job_id in self.unknown:
            job = self.running[job_id]
            self.running[job_id] = RunningJob(self.team_of.get(job_id, NO_TEAM), job.gpu_type, job.num_gpus,
                                              job.admitted_s)
        self.unknown.clear()
        team_of = {str(k[2]): self.team_of.get(k[2], NO_TEAM) for k in keys}
        priority_of = {str(k[2]): -k[0] for k in keys}
        current = list(self.running.values())
        return Snapshot(policy, now, queue, running, free, self.rules, team_of, priority_of,
                        holdings(current), team_usage(self.usage, current, now), reservation_depth,
                        None if self.head is None else str(self.head))
