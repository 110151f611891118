"""Warm restarts: the next attempt's world, started ahead and waiting at a gate.

A cold restart starts a torchrun agent per node (it imports torch: 1.7 s here), which starts the
ranks, each importing torch, megatron and the trainer (2.4 s), and then rendezvous. None of that
depends on the attempt: only the worker's arguments (the attempt's spec file, the step to resume
from, a drill) do. So once an attempt trains, the flow starts the *next* attempt's world on the
same nodes (`Standby.start`): the same reaper, agent and ranks a launch would start, with
`-m training.standby GATE` for the worker; its ranks import everything and wait for the gate
file. When that attempt is launched on the same placement, `Standby.open` writes the gate (the
worker's arguments and the attempt's environment) and the ranks run `training.train` at once: a
restart is a rendezvous of processes that are already up, a checkpoint load and a step. A launch
the standby does not match (another placement: a node was cordoned; another agent setting) is
started cold and the standby is stopped; so is a standby that is no longer needed (the job ended).

What it costs: one idle interpreter per rank with torch and megatron imported (host memory, no
GPU memory: CUDA is initialised after the gate) and one agent per node, and the CPU of their
imports (about 8 CPU-seconds for two ranks and two agents). `wanted()` turns it on where a node
has the cores to spare (at least two per rank: GPU servers have 8-28), not on a box whose every
core already runs a rank; WARM_ENV sets a machine's default otherwise (off where other work
shares the cores: the test suite's), and the pretrain flow's `warm_standby` parameter overrides
both. Where the flow may raise their priority back (as root, or with an RLIMIT_NICE of
20: `can_renice`), a standby's processes start at niceness STANDBY_NICE (or NICE_ENV's), so their
imports take only the CPU the training ranks leave (measured on 2 cores: a standby started at
normal priority slowed the running attempt's steps by a third for about 15 s, at every
restart), and `open` puts the whole tree back to a cold launch's priority before the gate
opens. Where it may not, they start at normal priority: a rank left at a lower priority for a
whole attempt would lose the CPU to any other job's processes on its node.

A node check after a failure (infra.nodecheck) runs in the standby's ranks when the standby is up
on exactly the nodes to check (`StandbyNodeCheck`, through `WarmRestarts.node_check_runner`):
local rank 0 of each node joins its world's process group in the standby's torchrun store and
times the allgathers infra.nodecheck_worker times, then waits at its gate again. A world that
fails there stops the standby (its ranks' state after a failed collective is not trusted to
train) and the rest of the check runs cold, through the launcher, as it always did.

Only the local launcher (every node's torchrun under this process, `infra.launch.LocalLauncher`)
keeps a standby: Slurm's would be a second allocation, Kubernetes' a second Job.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from infra.atomic_write import atomic_write_json
from infra.autogroup import autogroup, set_autogroup_nice
from infra.launch import CHOOSE_ON_NODE_0, LaunchRequest, LocalJob, LocalLauncher
from infra.nodecheck import LauncherWorldRunner, WorldResult

WORKER_MODULE = "training.train"  # what a launch runs on every rank: ["-m", WORKER_MODULE, *args]
STANDBY_MODULE = "training.standby"  # what a standby's ranks run until their gate opens
# What torchrun's agent reads from its environment: a launch that sets them otherwise than the
# standby's agent was started with is started cold (the ranks' variables travel through the gate).
AGENT_ENV_PREFIXES = ("TORCH_ELASTIC", "TORCHELASTIC")
STANDBY_NICE = 19  # a standby world's niceness until its gate opens (where `can_renice`)
NICE_ENV = "FORGEFLOW_STANDBY_NICE"  # another niceness (0-19; 0: none)
# The machine's default where the flow's `warm_standby` is unset: on, off, or auto (`wanted`). A
# machine whose cores other work shares (a CI runner, several flows' tests at once) has none to
# spare whatever its count: there the standby's imports only slow what runs.
WARM_ENV = "FORGEFLOW_WARM_STANDBY"
# How long `open` retries setting a rank's autogroup back against the kernel's rate limit (one
# write per 100 ms machine-wide without CAP_SYS_ADMIN, infra.autogroup): enough for 8 ranks a node
OPEN_PATIENCE_S = 2.0


def standby_nice() -> int:
    """The niceness a standby world starts at: NICE_ENV's, else STANDBY_NICE."""
    text = os.environ.get(NICE_ENV, str(STANDBY_NICE))
    try:
        nice = int(text)
    except ValueError:
        nice = -1
    if not 0 <= nice <= 19:
        raise ValueError(f"{NICE_ENV}={text!r}: give a niceness from 0 (none) to 19 (the default)")
    return nice


def can_renice() -> bool:
    """Whether this process may set a niceness it raised back to 0 (setpriority): as root, or
    with an RLIMIT_NICE of 20 (limits.conf's `nice` item)."""
    import resource

    return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20


def _give_priority_back(pids: set[int]) -> None:
    """What a cold launch's processes would have: every thread of every process in `pids` at this
    process's niceness (Linux keeps one per thread; a launch's processes inherit the flow's), and
    the autogroup of each session other than this process's at 0, a new session's (a standby
    rank's, which training.standby set: torchrun starts each rank in a session of its own). The
    threads first: a rank that sees its niceness change no longer sets its group behind."""
    niceness = os.getpriority(os.PRIO_PROCESS, 0)
    for pid in pids:
        try:
            threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:  # gone meanwhile
            continue
        for tid in threads:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
            except ProcessLookupError:
                pass
    own = autogroup()  # (None: the root group, which the kernel gives no niceness to set)
    leave = {own[0]} if own is not None else set()  # (the flow's own group, then those set)
    for pid in pids:
        group = autogroup(pid)
        if group is not None and group[0] not in leave and group[1] != 0:
            set_autogroup_nice(pid, 0, patience_s=OPEN_PATIENCE_S)
            leave.add(group[0])


def gate_path(request: LaunchRequest) -> Path:
    """The file a standby's ranks wait for: the attempt's worker arguments and environment."""
    return request.run_dir / "launch" / f"attempt-{request.attempt}" / "standby-gate.json"


def check_path(request: LaunchRequest) -> Path:
    """The file a standby's ranks read node-check rounds from, next to their gate
    (training.standby.CHECK_FILE)."""
    return gate_path(request).with_name("standby-nodecheck.json")


def wanted(launcher: str, world_size: int, asked: bool | None = None, cores: int | None = None) -> bool:
    """Whether a job of `world_size` ranks keeps a standby world: only on the local launcher
    (whatever was `asked`); there as `asked`, else as WARM_ENV says (the machine's default), else
    where this machine has two cores per rank (`cores`: this process's, os.sched_getaffinity)."""
    if launcher != "local":
        return False
    if asked is not None:
        return asked
    default = os.environ.get(WARM_ENV, "auto")
    if default not in ("on", "off", "auto"):
        raise ValueError(f"{WARM_ENV}={default!r}: give on, off or auto (two cores per rank)")
    if default != "auto":
        return default == "on"
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    return cores >= 2 * world_size


def _agent_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(AGENT_ENV_PREFIXES)}


@dataclass
class Standby:
    """The next attempt's world on `request`'s nodes, waiting at its gate (`gate_path`)."""

    request: LaunchRequest  # the standby's own: attempt N, worker = training.standby GATE
    job: LocalJob
    nice: int = 0  # the niceness its processes started at; `open` gives them a cold launch's back

    @classmethod
    def start(cls, launching: LaunchRequest, grace_s: float = 10.0) -> "Standby":
        """Start the world for the attempt after `launching`, on its nodes, with its agent settings."""
        attempt = launching.attempt + 1
        request = replace(launching, attempt=attempt, env=_agent_env(launching.env),
                          nodes=[replace(n, master_port=CHOOSE_ON_NODE_0) for n in launching.nodes])
        request.worker_args = ["-m", STANDBY_MODULE, str(gate_path(request))]
        gate_path(request).unlink(missing_ok=True)
        nice = standby_nice() if can_renice() else 0
        return cls(request, LocalLauncher(grace_s, nice=nice).start(request), nice)

    def matches(self, request: LaunchRequest) -> str | None:
        """None when `request` can run in this standby, else why not."""
        def layout(r: LaunchRequest):
            return [replace(n, master_port=CHOOSE_ON_NODE_0, master_addr="") for n in r.nodes]

        if request.attempt != self.request.attempt:
            return f"started for attempt {self.request.attempt}, not {request.attempt}"
        if request.run_dir != self.request.run_dir:
            return "another run directory"
        if layout(request) != layout(self.request):
            return "another placement"
        if _agent_env(request.env) != self.request.env:
            return "other agent settings"
        if request.worker_args[:2] != ["-m", WORKER_MODULE]:
            return f"another worker ({' '.join(request.worker_args[:2])})"
        if any(code is not None for code in self.job.poll().values()):
            return "its world exited"
        return None

    def open(self, request: LaunchRequest) -> LocalJob:
        """Run `request` (which `matches`) in this world: its ranks start training now. The job is
        the standby's processes, named after `request` (its log paths are the same)."""
        why = self.matches(request)
        if why is not None:
            raise ValueError(f"the standby world cannot run attempt {request.attempt}: {why}")
        if self.nice:  # from now on it is the attempt: normal priority before the gate opens
            _give_priority_back(self.job.pids())
            self.nice = 0
        atomic_write_json(gate_path(self.request), {"argv": list(request.worker_args[2:]),
                                                    "env": dict(request.env)})
        self.job.request = request
        return self.job

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop the standby's processes (they only wait: nothing to commit) and drop their console
        logs: an attempt started cold after it writes the same files, and its diagnosis must not
        read the standby's shutdown there."""
        self.job.terminate(grace_s=grace_s)
        if self.job.request is self.request:  # never opened: nothing of an attempt's is in them
            for log in self.job.log_paths().values():
                log.unlink(missing_ok=True)


@dataclass
class StandbyNodeCheck:
    """Runs node-check worlds in a standby's waiting ranks (training.standby.run_check): the check
    `LauncherWorldRunner` runs (same worker, payload, iterations and timeout), without starting a
    torchrun world for it. Results go under `run_dir`."""

    standby: Standby
    run_dir: Path
    timeout_s: float = 60.0
    payload_mb: float = 4.0
    iterations: int = 5
    poll_s: float = 0.02
    rounds: int = 0

    def run(self, worlds: list[tuple[str, ...]]) -> list[WorldResult | None]:
        """One result per world, all at once as a launcher runs them; None for a world left
        undecided because the standby exited (that is no verdict on its nodes)."""
        self.rounds += 1
        results_dir = self.run_dir / f"standby-round-{self.rounds}"
        atomic_write_json(check_path(self.standby.request), {
            "round": self.rounds, "worlds": [list(w) for w in worlds], "results": str(results_dir),
            "timeout_s": self.timeout_s, "payload_mb": self.payload_mb, "iterations": self.iterations,
        }, durable=False)
        started = time.monotonic()
        results: dict[int, WorldResult | None] = {}
        while len(results) < len(worlds):
            elapsed = time.monotonic() - started
            exited = any(code is not None for code in self.standby.job.poll().values())
            for index, world in enumerate(worlds):
                if index in results:
                    continue
                ranks = [_read_json(results_dir / f"world-{index}" / f"rank-{r}.json") for r in range(len(world))]
                failed = [r["detail"] for r in ranks if r is not None and not r["ok"]]
                if failed:  # decided by its first failing member, as a launched world's first exit
                    results[index] = WorldResult(world, False, elapsed, failed[0])
                elif all(r is not None for r in ranks):
                    results[index] = WorldResult(world, True, float(ranks[0]["allgather_s"]),
                                                 "ok (in the standby world)")
                elif exited:
                    results[index] = None
                elif elapsed >= self.timeout_s:
                    results[index] = WorldResult(world, False, elapsed, f"timed out after {self.timeout_s:.0f}s")
            time.sleep(self.poll_s)
        return [results[i] for i in range(len(worlds))]


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())  # written whole (atomic rename) or not at all
    except FileNotFoundError:
        return None


class WarmRestarts:
    """A flow's standby world across its attempts: `launch` runs an attempt in the standby when it
    matches, else cold; `prepare_next` starts the standby for the attempt after (once the current
    one trains); `close` stops what is left. Off (`enabled` False): every launch is cold."""

    def __init__(self, enabled: bool, grace_s: float = 10.0, log=None):
        self.enabled, self.grace_s = enabled, grace_s
        self.standby: Standby | None = None
        self._log = log or (lambda message: None)

    def launch(self, request: LaunchRequest, start_cold) -> tuple[object, bool]:
        """(the attempt's job, whether it started warm); `start_cold(request)` launches it otherwise."""
        standby, self.standby = self.standby, None
        if standby is not None:
            why = standby.matches(request)
            if why is None:
                return standby.open(request), True
            self._log(f"attempt {request.attempt} starts cold: the standby world does not fit ({why})")
            standby.stop()
        return start_cold(request), False

    def prepare_next(self, request: LaunchRequest) -> None:
        """Start the world for the attempt after `request` (on its nodes), unless off or started.
        A standby that cannot start (no free port, no process slot) costs the running attempt
        nothing: it is said once, and the next attempt starts cold."""
        if self.enabled and self.standby is None:
            try:
                self.standby = Standby.start(request, self.grace_s)
            except (OSError, TimeoutError) as e:
                self.enabled = False
                self._log(f"no standby world for attempt {request.attempt + 1} ({type(e).__name__}: {e}); "
                          "restarts start cold")

    def node_check_runner(self, nodes: list[str],
                          cold: LauncherWorldRunner) -> Callable[[list[tuple[str, ...]]], list[WorldResult]]:
        """infra.nodecheck's `run_world` for checking `nodes`: each round runs in the standby world
        while it is up on exactly those nodes (`StandbyNodeCheck`, `cold`'s settings), else
        through `cold`. A world that fails in the standby stops it: its ranks' state after a
        failed collective is not trusted to train, and the next attempt starts cold."""
        warm = None

        def run_world(worlds: list[tuple[str, ...]]) -> list[WorldResult]:
            nonlocal warm
            standby = self.standby
            if (standby is None or sorted(n.node for n in standby.request.nodes) != sorted(nodes)
                    or any(code is not None for code in standby.job.poll().values())):
                return cold(worlds)
            if warm is None or warm.standby is not standby:
                warm = StandbyNodeCheck(standby, cold.run_dir, cold.timeout_s, cold.payload_mb, cold.iterations)
            results = warm.run(worlds)
            undecided = [w for w, r in zip(worlds, results) if r is None]  # the standby exited meanwhile
            decided_cold = iter(cold(undecided) if undecided else [])
            results = [r if r is not None else next(decided_cold) for r in results]
            if undecided or not all(r.ok for r in results):
                what = "exited during the node check" if undecided else "had a world fail the node check"
                self._log(f"the standby world of attempt {standby.request.attempt} {what}: it is stopped "
                          "(that attempt starts cold)")
                self.close()
            return results

        return run_world

    def close(self) -> None:
        standby, self.standby = self.standby, None
        if standby is not None:
            standby.stop()

    def __enter__(self) -> "WarmRestarts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
