"""Watch a launched training job until it finishes, fails, hangs or spikes.

What is watched (the worker's side of the contract is infra/runfiles.py):

- exit codes of every node's torchrun: the first non-zero one is a failure; the
  other nodes get `failure_grace_s` to print their own errors (often the real
  root cause is on another rank) before they are stopped;
- heartbeats (`heartbeat/rank{R}.json`): if some rank has not advanced for
  `hang_timeout_s` the job is a Hang and is killed. Before a rank's first
  heartbeat of this attempt, `startup_timeout_s` applies instead: start-up
  (imports, building the model, loading a checkpoint) is slow and silent;
- where each rank's main thread is (`heartbeat/where/rank{R}.json`, sampled every second by
  the rank itself): ranks that have waited in a collective for `collective_stall_s` (and five
  typical steps) while another rank is not in one, or froze, are a Hang seen in seconds, whatever
  `hang_timeout_s`; the outcome's `stall` names the ranks and nodes that did not join and the
  collective the others wait in (`collective_stall`);
- the loss-spike marker, written before the worker exits with EXIT_LOSS_SPIKE;
- the stop marker: after a SIGTERM the ranks commit a checkpoint, rank 0 writes
  markers/stopped.json and they exit EXIT_STOPPED, which torchrun turns into a plain
  non-zero exit. Who sent the SIGTERM decides what it was (`exit_verdict`): a stop counts
  as requested only when it was recorded before it happened — this watcher's own stop on
  `stop_requested()` or `stop_when()` below, or a lost lease (the orchestrator's record
  that the node-side guard acts on). Any other stop (torchrun's agent or the reaper killed
  and the ranks stopped on the way out, a node shutting down, a stray `kill`) is a
  failure, to diagnose and recover from its committed step (`AttemptOutcome.unrequested_stop`).

- a reason to stop from outside (`stop_when()`: the job's GPU lease was reclaimed while
  its flow stalled), checked while every rank runs: the GPUs may already run another job,
  so the ranks get SIGTERM and only `failure_grace_s` before SIGKILL (the job resumes from
  its last committed checkpoint), and the outcome is "evicted" with that reason — not a
  failure of the job.

- a request to stop (`stop_requested()`: `forgeflow cancel` on the job), checked while every
  rank runs: the job still holds its GPUs, so the ranks get SIGTERM and `stop_grace_s` to commit
  the step they are on; the outcome is "stopped" with that request.

- stragglers: each heartbeat carries the rank's compute time in its last step
  (`compute_s`); a rank whose compute stays above `straggler_factor` x the median of
  the others for `straggler_patience` consecutive samples is reported through
  `on_straggler` (node and rank) while the job keeps running — before a timeout or a
  failure makes it anyone's problem — and listed in the outcome.

The result carries the console logs of every node for the diagnosis.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

from infra.launch import LaunchedJob
from infra import runfiles

Status = Literal["finished", "failed", "hang", "spike", "stopped", "evicted"]


@dataclass
class AttemptOutcome:
    status: Status
    exit_codes: dict[str, int | None]
    last_step: int  # newest step any rank reported in this attempt (0 if none)
    seconds: float  # launch to detection
    log_paths: dict[str, Path] = field(default_factory=dict)
    failed_nodes: list[str] = field(default_factory=list)
    stale_ranks: list[int] = field(default_factory=list)
    spike: runfiles.SpikeMarker | None = None  # this attempt's loss-spike marker
    stop: runfiles.StopMarker | None = None  # this attempt's graceful-stop marker
    stragglers: list["Straggler"] = field(default_factory=list)  # reported while it ran
    evicted: str | None = None  # why the attempt was stopped from outside (`stop_when`)
    requested_stop: str | None = None  # who asked the job to stop, and why (`stop_requested`)
    stall: "CollectiveStall | None" = None  # a hang seen from the ranks' collectives: who did not join

    @property
    def ok(self) -> bool:
        return self.status == "finished"

    @property
    def unrequested_stop(self) -> str | None:
        """What the ranks did when they stopped on a signal nobody recorded asking for (a failure:
        `exit_verdict`), or None."""
        if self.status != "failed" or self.stop is None:
            return None
        return (f"the ranks were stopped by {self.stop.signal or 'a signal'} after step {self.stop.step} "
                f"(checkpoint {self.stop.checkpoint_step} committed), and neither the flow nor `forgeflow "
                f"cancel` asked for it: a process of the job's tree or its node stopped them")


@dataclass(frozen=True)
class Straggler:
    """A rank persistently slower than the others (what the alert says)."""

    rank: int
    node: str  # the launch's node name, or the heartbeat's host
    host: str
    step: int  # the step at which it was confirmed
    compute_s: float  # its compute time in that step
    others_median_s: float  # the other ranks' median compute time in the same sample
    samples: int  # consecutive slow samples

    @property
    def ratio(self) -> float:
        return self.compute_s / self.others_median_s if self.others_median_s > 0 else float("inf")

    def summary(self) -> str:
        return (f"rank {self.rank} on {self.node} is {self.ratio:.1f}x slower than the others "
                f"({self.compute_s:.3f} s vs median {self.others_median_s:.3f} s of compute per "
                f"step, {self.samples} samples in a row, at step {self.step})")


class StragglerDetector:
    """Finds ranks whose per-step compute time stays above `factor` x the others' median.

    Compute time, not step time: the step's wall time is the same on every rank (the
    gradient all-reduce waits for the slowest), while the compute time of a slow rank
    alone is high. A sample is taken whenever every rank has reported a newer step than
    in the last sample; a rank is slow in a sample if its compute exceeds `factor` x the
    median of the other ranks' (and at least `min_compute_s`, so microsecond noise on an
    idle stage never counts). `patience` slow samples in a row confirm it; each rank is
    reported once per detector."""

    def __init__(self, world_size: int, factor: float = 2.0, patience: int = 3,
                 min_compute_s: float = 0.001, rank_nodes: dict[int, str] | None = None):
        self.world_size = world_size
        self.factor = factor
        self.patience = patience
        self.min_compute_s = min_compute_s
        self.rank_nodes = rank_nodes or {}
        self.strikes: dict[int, int] = {}
        self.reported: dict[int, Straggler] = {}
        self._sampled_step = -1

    def update(self, beats: dict[int, runfiles.HeartbeatRecord]) -> list[Straggler]:
        """Feed the latest heartbeats; returns the stragglers confirmed by this sample."""
        timed = {r: b for r, b in beats.items() if b.compute_s is not None}
        if self.world_size < 2 or len(timed) < self.world_size:
            return []
        oldest = min(b.step for b in timed.values())
        if oldest <= self._sampled_step:
            return []
        self._sampled_step = max(b.step for b in timed.values())
        found = []
        for rank, beat in timed.items():
            others = sorted(b.compute_s for r, b in timed.items() if r != rank)
            median = others[len(others) // 2] if len(others) % 2 else (
                others[len(others) // 2 - 1] + others[len(others) // 2]) / 2
            slow = beat.compute_s >= self.min_compute_s and beat.compute_s > self.factor * median
            self.strikes[rank] = self.strikes.get(rank, 0) + 1 if slow else 0
            if self.strikes[rank] >= self.patience and rank not in self.reported:
                straggler = Straggler(rank=rank, node=self.rank_nodes.get(rank, beat.host),
                                      host=beat.host, step=beat.step, compute_s=beat.compute_s,
                                      others_median_s=median, samples=self.strikes[rank])
                self.reported[rank] = straggler
                found.append(straggler)
        return found


# A collective stall counts once the waiting ranks have been in it this long, and at least this
# many typical steps (the heartbeats' step time): a rank that is merely slow is not hung.
COLLECTIVE_STALL_S = 10.0
STALL_STEPS = 5.0
# A where-sample this old means its rank's process no longer runs Python (frozen, D-state).
WHERE_STALE_S = 5.0
# Phases in which one rank may legitimately keep the others waiting (a save, a graceful stop).
BUSY_PHASES = ("start", "checkpoint", "stopping")


@dataclass(frozen=True)
class CollectiveStall:
    """Ranks waiting in a collective that other ranks did not join (`collective_stall`)."""

    collective: str
    waiting: list[int]  # ranks in a collective, the longest for `waited_s`
    absent: list[int]  # ranks not in one (elsewhere, or frozen: no fresh sample)
    nodes: list[str]  # the absent ranks' nodes
    waited_s: float
    step: int  # the step the waiting ranks finished last
    where: dict[int, str]  # absent rank -> what it is doing instead, in words

    def describe(self) -> str:
        who = ", ".join(f"rank {r} on {n} ({self.where.get(r, '?')})" for r, n in zip(self.absent, self.nodes))
        ranks = ", ".join(map(str, self.waiting[:8])) + (" ..." if len(self.waiting) > 8 else "")
        return (f"hang after step {self.step}: {who} did not join {self.collective}, in which rank(s) {ranks} "
                f"have waited {self.waited_s:.0f} s")


def collective_stall(wheres: dict[int, runfiles.WhereRecord], beats: dict[int, runfiles.HeartbeatRecord],
                     world_size: int, now: float, *, stall_s: float = COLLECTIVE_STALL_S,
                     rank_nodes: dict[int, str] | None = None) -> CollectiveStall | None:
    """A hang, seen from where the ranks are: some ranks have waited in a collective for
    `stall_s` and STALL_STEPS typical steps while others are not in one (or froze). None while
    every rank of this attempt has not finished a step (start-up, loading), while a rank is in a
    phase that may keep the others waiting (BUSY_PHASES), or while all ranks wait alike (a
    collective that is merely long, or an interconnect fault the heartbeat timeout catches).
    `wheres` and `beats`: this attempt's records only."""
    if world_size < 2 or len(wheres) < world_size or len(beats) < world_size:
        return None
    if any(b.step_time_s is None or b.phase in BUSY_PHASES for b in beats.values()):
        return None
    times = sorted(b.step_time_s for b in beats.values())
    threshold = max(stall_s, STALL_STEPS * times[len(times) // 2])
    waiting, absent = {}, {}
    for rank in range(world_size):
        w = wheres.get(rank)
        if w is None or now - w.time > WHERE_STALE_S:
            absent[rank] = "no sample for " + ("ever" if w is None else f"{now - w.time:.0f} s: frozen?")
        elif w.collective is None:
            absent[rank] = f"not in a collective for {now - w.since:.0f} s"
        else:
            waiting[rank] = w
    if not waiting or not absent:
        return None
    longest = min(w.since for w in waiting.values())
    if now - longest < threshold or any(now - w.since < threshold for w in waiting.values()):
        return None
    names = [w.collective for w in waiting.values()]
    nodes = rank_nodes or {}
    absent_ranks = sorted(absent)
    return CollectiveStall(max(set(names), key=names.count), sorted(waiting), absent_ranks,
                           [nodes.get(r) or (beats[r].host if r in beats else "?") for r in absent_ranks],
                           now - longest, max(w.step for w in waiting.values()), absent)


def exit_verdict(spike: runfiles.SpikeMarker | None, stop: runfiles.StopMarker | None,
                 lease_lost: str | None) -> Status:
    """What an attempt that some node left with a non-zero exit was, unless the watcher had stopped it
    itself (then it is "stopped" or "evicted" and this is not asked).

    | what the ranks left              | recorded before the stop                      | verdict |
    |----------------------------------|-----------------------------------------------|---------|
    | the loss-spike marker            | -                                             | spike   |
    | the stop marker (a graceful stop)| the job's lease was lost (the node-side guard | evicted |
    |                                  | stops the ranks once the orchestrator says so)|         |
    | the stop marker                  | nothing                                       | failed  |
    | neither                          | -                                             | failed  |

    A `forgeflow cancel` stops ranks only through the watcher (its own "stopped" verdict), so a
    cancel recorded while the ranks stopped on their own did not cause it: the stop is a failure
    (the flow still ends the job as cancelled before it relaunches anything)."""
    if spike is not None:
        return "spike"
    if stop is not None and lease_lost:
        return "evicted"
    return "failed"


def _rank_nodes(job) -> dict[int, str]:
    """global rank -> node name, from the launch request when the job carries one."""
    request = getattr(job, "request", None)
    out: dict[int, str] = {}
    for node in getattr(request, "nodes", None) or []:
        for local in range(node.nproc_per_node):
            out[node.first_global_rank + local] = node.node
    return out


def watch(
    job: LaunchedJob,
    run_dir: Path,
    world_size: int,
    hang_timeout_s: float = 300.0,
    startup_timeout_s: float = 600.0,
    failure_grace_s: float = 5.0,
    stop_grace_s: float = 120.0,
    poll_s: float = 0.5,
    on_progress: Callable[[int], None] | None = None,
    straggler_factor: float = 2.0,
    straggler_patience: int = 3,
    on_straggler: Callable[[Straggler], None] | None = None,
    stop_when: Callable[[], str | None] | None = None,
    stop_requested: Callable[[], str | None] | None = None,
    collective_stall_s: float = COLLECTIVE_STALL_S,
) -> AttemptOutcome:
    run_dir = Path(run_dir)
    rank_nodes = _rank_nodes(job)
    stragglers = StragglerDetector(world_size, straggler_factor, straggler_patience, rank_nodes=rank_nodes)
    wheres_read = 0.0
    started_wall = time.time()
    started = time.monotonic()
    last_reported = -1
    last_step = 0
    while True:
        codes = job.poll()
        beats = runfiles.read_heartbeats(run_dir)
        current = {r: b for r, b in beats.items() if b.time >= started_wall}  # this attempt's
        if current:
            last_step = max(last_step, max(b.step for b in current.values()))
            if on_progress and last_step != last_reported:
                on_progress(last_step)
                last_reported = last_step
            for straggler in stragglers.update(current):
                if on_straggler:
                    on_straggler(straggler)

        failed = [node for node, code in codes.items() if code not in (None, 0)]
        if failed:
            # Let the other ranks print their errors — or, when ranks are stopping gracefully
            # (heartbeat phase "stopping"), finish committing their checkpoint: give them the
            # job's checkpoint.stop_deadline_s before anything is killed.
            stopping = any(b.phase == "stopping" for b in current.values())
            job.wait(timeout=stop_grace_s if stopping else failure_grace_s)
            job.terminate(grace_s=5.0)
            codes = job.poll()
            spike = runfiles.read_spike_marker(run_dir, since=started_wall)
            stop = runfiles.read_stop_marker(run_dir, since=started_wall)
            lease_lost = stop_when() if stop is not None and stop_when is not None else None
            status = exit_verdict(spike, stop, lease_lost)
            return AttemptOutcome(
                status=status,
                exit_codes=codes,
                last_step=max(last_step, stop.step if stop else 0),
                seconds=time.monotonic() - started,
                log_paths=job.log_paths(),
                failed_nodes=[] if status == "evicted" else failed,
                spike=spike,
                stop=stop,
                stragglers=list(stragglers.reported.values()),
                evicted=lease_lost if status == "evicted" else None,
            )
        if codes and all(code == 0 for code in codes.values()):
            finished = runfiles.finished_marker_path(run_dir)
            status: Status = "finished" if finished.exists() and finished.stat().st_mtime >= started_wall else "failed"
            return AttemptOutcome(status, codes, last_step, time.monotonic() - started, job.log_paths(),
                                  stragglers=list(stragglers.reported.values()))

        # Checked only while every rank runs (an exit above is reported as what it is).
        evicted = stop_when() if stop_when is not None and not any(c is not None for c in codes.values()) \
            else None
        if evicted:
            # The GPUs may already run another job: SIGTERM (a rank that commits within the
            # failure grace does), then SIGKILL; no waiting out stop_grace_s for a commit.
            job.terminate(grace_s=failure_grace_s)
            return AttemptOutcome("evicted", job.poll(), last_step, time.monotonic() - started, job.log_paths(),
                                  stop=runfiles.read_stop_marker(run_dir, since=started_wall),
                                  stragglers=list(stragglers.reported.values()), evicted=evicted)

        requested = stop_requested() if stop_requested is not None and not any(
            c is not None for c in codes.values()) else None
        if requested:
            # `forgeflow cancel`: the job still holds its GPUs, so the ranks get SIGTERM and the
            # job's stop deadline to commit the step they are on (the stop marker says which).
            job.terminate(grace_s=stop_grace_s)
            return AttemptOutcome("stopped", job.poll(), last_step, time.monotonic() - started, job.log_paths(),
                                  stop=runfiles.read_stop_marker(run_dir, since=started_wall),
                                  stragglers=list(stragglers.reported.values()), requested_stop=requested)

        now = time.time()
        if now - wheres_read >= 1.0:  # the ranks sample once a second: no need to read more often
            wheres_read = now
            stall = collective_stall({r: w for r, w in runfiles.read_wheres(run_dir).items() if w.time >= started_wall},
                                     current, world_size, now, stall_s=collective_stall_s, rank_nodes=rank_nodes)
            if stall is not None:
                job.terminate(grace_s=0)  # hung ranks cannot commit a stop: no grace to wait out
                return AttemptOutcome("hang", job.poll(), last_step, time.monotonic() - started, job.log_paths(),
                                      stale_ranks=stall.absent, stragglers=list(stragglers.reported.values()),
                                      stall=stall)
        stale = []
        for rank in range(world_size):
            beat_time = beats[rank].time if rank in beats else 0.0
            if beat_time >= started_wall:
                if now - beat_time > hang_timeout_s:
                    stale.append(rank)
            elif now - started_wall > startup_timeout_s:
                stale.append(rank)
        if stale:
            job.terminate(grace_s=0)  # hung ranks cannot commit a stop: no grace to wait out
            return AttemptOutcome(
                status="hang",
                exit_codes=job.poll(),
                last_step=last_step,
                seconds=time.monotonic() - started,
                log_paths=job.log_paths(),
                stale_ranks=stale,
                stragglers=list(stragglers.reported.values()),
            )
        if any(code is not None for code in codes.values()):  # a node ended well; the others run
            time.sleep(poll_s)
        else:  # a node that exits wakes the watcher at once (LocalJob: the reapers' pidfds)
            job.wait(timeout=poll_s, any_exit=True)
