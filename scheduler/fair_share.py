"""Teams on one cluster: quotas with borrowing, fair-share order, decayed usage — pure functions.

What the operator sets (`TeamRules`): per (team, GPU type) a nominal quota and a borrowing
limit, per team a weight, and the half-life of past usage. What a pass sees (`Snapshot`): the
queue, the running jobs, the idle GPUs, what each team holds and its decayed usage. `decide`
is the whole admission decision over a snapshot: the queue put in fair-share order, then the
cluster's policy pass (`scheduler.policy.schedule_pass`) with the quota gate on every
placement. The live orchestrator and the simulator both call it.

Quotas (Kueue's ClusterQueue nominal quota and borrowingLimit, in a single cohort per GPU type):
- A team may hold up to its nominal quota of a type whatever others hold (the nominal quotas
  of a type never add up to more than the inventory: the operator's command refuses that).
- Above it, a team borrows idle quota of other teams, at most `borrowing_limit` GPUs
  (None: no limit). A (team, type) without a quota row has nominal 0 and no borrowing limit:
  a team without quota runs only on idle quota. A job without a team counts as team "".
- Borrowed GPUs come back without preemption: a borrower is admitted only if the GPUs that
  stay idle after it still cover the unused quota of every other team that has work of that
  type waiting. So an owner's waiting job is never blocked by a new borrower; it waits at most
  for running borrowers to end.
- Under a reserving policy (EASY), only a job within its team's nominal quota gets a
  reservation; it stays first of its class until it starts (`fair_order`'s head), and while it
  waits the rest of its team neither borrows nor takes the quota it needs, so its own team's
  later jobs cannot keep it over quota whenever its GPUs come free.
- Without any quota row on the cluster the gate is off (one team, or teams without quotas).

Fair share (Slurm's fair-share factor, Kueue's admission fair sharing): within a priority
class, jobs are ordered by their team's decayed usage over its weight (lowest first), then by
arrival. Usage is GPU-seconds, every GPU type counted alike, each second's weight halving every
`half_life_s` after it was used; a running job's GPUs count up to now.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from scheduler.policy import Busy, FreeGpus, Option, Waiting, schedule_pass

NO_TEAM = ""
DEFAULT_HALF_LIFE_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class Quota:
    nominal: int
    borrowing_limit: int | None = 0  # GPUs above nominal it may borrow; None: any idle quota


@dataclass(frozen=True)
class TeamRules:
    """What an operator set for one cluster."""

    quotas: Mapping[tuple[str, str], Quota] = field(default_factory=dict)  # (team, gpu type)
    weights: Mapping[str, float] = field(default_factory=dict)  # missing: 1
    half_life_s: float = DEFAULT_HALF_LIFE_S

    @property
    def enforced(self) -> bool:
        return bool(self.quotas)

    def quota(self, team: str, gpu_type: str) -> Quota:
        return self.quotas.get((team, gpu_type), Quota(0, None))

    def weight(self, team: str) -> float:
        return self.weights.get(team, 1.0)


def decayed_gpu_s(num_gpus: int, start_s: float, end_s: float, now: float, half_life_s: float) -> float:
    """GPU-seconds used on [start, end], each second weighted 2^-(now - t)/half_life."""
    if end_s <= start_s:
        return 0.0
    rate = math.log(2) / half_life_s
    return num_gpus * math.exp(-rate * (now - end_s)) * -math.expm1(-rate * (end_s - start_s)) / rate


class DecayedUsage:
    """Each team's decayed usage of ended allocations, kept as (value, as of when)."""

    def __init__(self, half_life_s: float = DEFAULT_HALF_LIFE_S):
        self.half_life_s = half_life_s
        self._value: dict[str, tuple[float, float]] = {}

    def add(self, team: str, num_gpus: int, start_s: float, end_s: float) -> None:
        """An allocation of `num_gpus` from `start_s` to `end_s` ended."""
        value, as_of = self._value.get(team, (0.0, end_s))
        at = max(as_of, end_s)
        value = value * 2 ** (-(at - as_of) / self.half_life_s)
        self._value[team] = (value + decayed_gpu_s(num_gpus, start_s, end_s, at, self.half_life_s), at)

    def at(self, team: str, now: float) -> float:
        value, as_of = self._value.get(team, (0.0, now))
        return value * 2 ** (-(now - as_of) / self.half_life_s)

    def teams(self) -> set[str]:
        return set(self._value)


@dataclass(frozen=True)
class RunningJob:
    """A running job as fair share sees it: its team, GPUs and since when it holds them."""

    team: str
    gpu_type: str
    num_gpus: int
    admitted_s: float


def team_usage(usage: DecayedUsage, running: Iterable[RunningJob], now: float) -> dict[str, float]:
    """Decayed GPU-seconds per team as of now: ended allocations plus running jobs up to now."""
    out = {team: usage.at(team, now) for team in usage.teams()}
    for r in running:
        out[r.team] = out.get(r.team, 0.0) + decayed_gpu_s(r.num_gpus, r.admitted_s, now, now, usage.half_life_s)
    return out


def holdings(running: Iterable[RunningJob]) -> dict[tuple[str, str], int]:
    """GPUs held per (team, GPU type)."""
    held: dict[tuple[str, str], int] = {}
    for r in running:
        held[(r.team, r.gpu_type)] = held.get((r.team, r.gpu_type), 0) + r.num_gpus
    return held


def fair_order(queue: Sequence[Waiting], team_of: Mapping[str, str], priority_of: Mapping[str, int],
               usage: Mapping[str, float], rules: TeamRules, head: str | None = None) -> list[Waiting]:
    """The queue by priority class (highest first), then team usage over weight (lowest first),
    then arrival. `queue` in arrival order within a class already: the sort is stable. `head`:
    the job an earlier pass reserved GPUs for stays first of its class until it starts, so
    usage moving on never lets later jobs overtake it past its predicted start."""
    return sorted(queue, key=_fair_key(team_of, priority_of, usage, rules, head))


def _fair_key(team_of: Mapping[str, str], priority_of: Mapping[str, int], usage: Mapping[str, float],
              rules: TeamRules, head: str | None):
    def key(job: Waiting) -> tuple:
        team = team_of.get(job.job_id, NO_TEAM)
        return (-priority_of.get(job.job_id, 0), job.job_id != head, usage.get(team, 0.0) / rules.weight(team))
    return key


def fair_rank(queue: Sequence[Waiting], team_of: Mapping[str, str], priority_of: Mapping[str, int],
              usage: Mapping[str, float], rules: TeamRules, head: str | None = None) -> dict[str, int]:
    """Each job's rank in fair-share order (equal for jobs of one team in one priority class):
    what a policy that orders by its own measure (ECT's response ratio) orders within."""
    key = _fair_key(team_of, priority_of, usage, rules, head)
    keys = {job.job_id: key(job) for job in queue}
    index = {k: i for i, k in enumerate(sorted(set(keys.values())))}
    return {job_id: index[k] for job_id, k in keys.items()}


def pass_order(queue: Sequence[Waiting], team_of: Mapping[str, str], priority_of: Mapping[str, int],
               usage: Mapping[str, float], rules: TeamRules, head: str | None = None) -> list[Waiting]:
    """The order an admission pass (`decide`) takes the queue in: fair-share order while jobs of
    more than one team wait or quotas are set, else the queue as given (priority, then arrival).
    What `forgeflow cluster queue` and a waiting job's position show."""
    if teams_matter(team_of, rules):
        return fair_order(queue, team_of, priority_of, usage, rules, head)
    return list(queue)


def teams_matter(team_of: Mapping[str, str], rules: TeamRules) -> bool:
    """Whether teams change a pass: jobs of more than one team wait, or quotas are set."""
    return len(set(team_of.values())) > 1 or rules.enforced


class QuotaGate:
    """The quota check of one pass (`FreeGpus.gate`): holdings move as jobs start."""

    def __init__(self, rules: TeamRules, held: Mapping[tuple[str, str], int], queue: Iterable[Waiting],
                 team_of: Mapping[str, str], free: FreeGpus, head: str | None = None):
        self.rules = rules
        self.held = dict(held)
        self.team_of = team_of
        self.free = free
        # the job reserved for (EASY's head) and its team: while it waits, the rest of its team
        # neither borrows nor takes the nominal quota it needs, or the team's own later jobs could
        # keep it over quota whenever its GPUs come free
        self.head = head
        self.head_team = None if head is None else team_of.get(head, NO_TEAM)
        self.options_of = {job.job_id: job.options for job in queue}
        # queued jobs per (team, type) they could run on: whose unused quota is claimed
        self.waiting: dict[tuple[str, str], int] = {}
        self.types_of: dict[str, set[str]] = {}
        for job in queue:
            self.types_of[job.job_id] = {o.gpu_type for o in job.options}
            team = team_of.get(job.job_id, NO_TEAM)
            for gpu_type in {o.gpu_type for o in job.options}:
                self.waiting[(team, gpu_type)] = self.waiting.get((team, gpu_type), 0) + 1

    def claimed(self, gpu_type: str, besides: str) -> int:
        """Unused quota of `gpu_type` that teams other than `besides` have work waiting for."""
        total = 0
        for (team, t), count in self.waiting.items():
            if t == gpu_type and team != besides and count > 0:
                total += max(0, self.rules.quota(team, t).nominal - self.held.get((team, t), 0))
        return total

    def allows(self, job_id: str, opt: Option) -> bool:
        if not self.rules.enforced:
            return True
        team = self.team_of.get(job_id, NO_TEAM)
        quota = self.rules.quota(team, opt.gpu_type)
        after = self.held.get((team, opt.gpu_type), 0) + opt.num_gpus
        if team == self.head_team and job_id != self.head:
            # while its head waits, the rest of the team neither borrows nor takes the quota it needs
            return after + self._head_need(opt.gpu_type) <= quota.nominal
        if after <= quota.nominal:
            return True
        if quota.borrowing_limit is not None and after - quota.nominal > quota.borrowing_limit:
            return False
        idle_after = self.free.by_type.get(opt.gpu_type, 0) - opt.num_gpus
        return idle_after >= self.claimed(opt.gpu_type, team)

    def _head_need(self, gpu_type: str) -> int:
        """GPUs of a type the waiting head needs of its team's nominal quota (0: none it could use)."""
        team = self.head_team or NO_TEAM
        need = [o.num_gpus for o in self.options_of.get(self.head, ()) if o.gpu_type == gpu_type
                and o.num_gpus <= self.rules.quota(team, gpu_type).nominal]
        return min(need, default=0)

    def may_reserve(self, job_id: str, opt: Option) -> bool:
        """Whether the option may hold a reservation: within the team's nominal quota."""
        if not self.rules.enforced:
            return True
        team = self.team_of.get(job_id, NO_TEAM)
        return self.held.get((team, opt.gpu_type), 0) + opt.num_gpus <= self.rules.quota(team, opt.gpu_type).nominal

    def reserve(self, job_id: str, opt: Option) -> None:
        """The job is the head now: its team keeps the quota it needs (`allows`)."""
        self.head, self.head_team = job_id, self.team_of.get(job_id, NO_TEAM)

    def took(self, job_id: str, opt: Option) -> None:
        team = self.team_of.get(job_id, NO_TEAM)
        key = (team, opt.gpu_type)
        self.held[key] = self.held.get(key, 0) + opt.num_gpus
        for gpu_type in self.types_of.get(job_id, ()):
            self.waiting[(team, gpu_type)] = self.waiting.get((team, gpu_type), 0) - 1


@dataclass
class Snapshot:
    """Everything one admission decision reads."""

    policy: str
    now: float
    queue: Sequence[Waiting]  # arrival order within each priority class
    running: Sequence[Busy]  # predicted ends, for the reserving policies
    free: FreeGpus
    rules: TeamRules = field(default_factory=TeamRules)
    team_of: Mapping[str, str] = field(default_factory=dict)  # job id -> team
    priority_of: Mapping[str, int] = field(default_factory=dict)  # job id -> class value
    held: Mapping[tuple[str, str], int] = field(default_factory=dict)
    usage: Mapping[str, float] = field(default_factory=dict)  # decayed GPU-seconds per team
    reservation_depth: int = 8
    head: str | None = None  # the job the last pass reserved GPUs for (`FreeGpus.reservation`)


def decide(snap: Snapshot):
    """(started jobs with option and placement, jobs considered): fair-share order, quota gate,
    then the policy pass. With one team and no quota this is the plain policy pass. The job it
    reserves GPUs for, if any, is `snap.free.reservation` afterwards: the next pass's `head`."""
    queue = pass_order(snap.queue, snap.team_of, snap.priority_of, snap.usage, snap.rules, snap.head)
    rank = (fair_rank(queue, snap.team_of, snap.priority_of, snap.usage, snap.rules, snap.head)
            if teams_matter(snap.team_of, snap.rules) else None)
    snap.free.reservation = None
    if snap.rules.enforced:
        snap.free.gate = QuotaGate(snap.rules, snap.held, queue, snap.team_of, snap.free, snap.head)
    try:
        return schedule_pass(snap.policy, snap.now, queue, snap.running, snap.free,
                             reservation_depth=snap.reservation_depth, rank=rank)
    finally:
        snap.free.gate = None
