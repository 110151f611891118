"""Find faulty and slow nodes with two rounds of pairwise collective tests (DLRover / Acme).

Round 1 splits the nodes into worlds of two neighbours (the last world has three
when the count is odd) and runs an allgather in every world at once. Nodes of a
world that fails (or is slow) become suspects. Round 2 pairs each suspect with
a node that passed round 1. A node is *faulty* only if it failed in both rounds,
and a *straggler* if its worlds took more than `straggler_factor` × the median
world time in both rounds: a single failing world cannot tell which of its two
members is to blame, the second pairing can. When every world of round 1 failed (two
nodes, one of them dead) there is no good partner: round 2 then runs each suspect alone,
and a node that fails even alone is faulty.

`two_round_check` is the algorithm over any `run_world(nodes) -> WorldResult`;
`LauncherWorldRunner` runs a world for real: one torchrun per node (through a
`Launcher`) executing `infra.nodecheck_worker`, which times allgathers.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from infra.launch import LaunchRequest, Launcher, local_node_launches, wait_until_started


@dataclass(frozen=True)
class WorldResult:
    nodes: tuple[str, ...]
    ok: bool
    seconds: float
    detail: str = ""


@dataclass
class NodeCheckReport:
    faulty: list[str] = field(default_factory=list)
    stragglers: list[str] = field(default_factory=list)
    healthy: list[str] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)  # suspects with no healthy partner
    rounds: list[list[WorldResult]] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"faulty={self.faulty or '-'} stragglers={self.stragglers or '-'} "
            f"unresolved={self.unresolved or '-'} healthy={len(self.healthy)}"
        )


def round_one_worlds(nodes: list[str]) -> list[tuple[str, ...]]:
    """Neighbouring pairs; with an odd count the last world holds three nodes."""
    if len(nodes) < 2:
        return [tuple(nodes)] if nodes else []
    worlds = [tuple(nodes[i : i + 2]) for i in range(0, len(nodes) - 1, 2)]
    if len(nodes) % 2:
        worlds[-1] = worlds[-1] + (nodes[-1],)
    return worlds


def _slow(results: list[WorldResult], factor: float) -> set[tuple[str, ...]]:
    times = [r.seconds for r in results if r.ok]
    if len(times) < 2:
        return set()
    median = statistics.median(times)
    return {r.nodes for r in results if r.ok and median > 0 and r.seconds > factor * median}


def two_round_check(
    nodes: list[str],
    run_world: Callable[[list[tuple[str, ...]]], list[WorldResult]],
    straggler_factor: float = 2.0,
) -> NodeCheckReport:
    """`run_world` runs a list of worlds concurrently and returns one result per world."""
    report = NodeCheckReport()
    if len(nodes) < 2:
        report.unresolved = list(nodes)
        return report
    first = run_world(round_one_worlds(nodes))
    report.rounds.append(first)
    failed1 = {n for r in first if not r.ok for n in r.nodes}
    slow1 = {n for w in _slow(first, straggler_factor) for n in w}
    healthy_partners = [n for n in nodes if n not in failed1 and n not in slow1]
    suspects = [n for n in nodes if n in failed1 or n in slow1]
    if not suspects:
        report.healthy = list(nodes)
        return report
    if not healthy_partners:
        return _check_alone(nodes, first, suspects, failed1, run_world, report)

    # Round 2: each suspect with a healthy node, spreading suspects over partners.
    worlds = [(s, healthy_partners[i % len(healthy_partners)]) for i, s in enumerate(suspects)]
    # A healthy node may appear in several worlds; run those worlds in separate waves
    # so that one node never joins two rendezvous at once.
    second: list[WorldResult] = []
    for wave in _waves(worlds):
        second.extend(run_world(wave))
    report.rounds.append(second)

    # Straggler reference: every successful world time seen, so a wave of one still compares.
    reference = [r for r in first + second if r.ok]
    times = [r.seconds for r in reference]
    median = statistics.median(times) if times else 0.0
    by_world = {r.nodes: r for r in second}
    for suspect, world in zip(suspects, worlds):
        result = by_world[world]
        if suspect in failed1 and not result.ok:
            report.faulty.append(suspect)
        elif suspect in slow1 and result.ok and median > 0 and result.seconds > straggler_factor * median:
            report.stragglers.append(suspect)
    bad = set(report.faulty) | set(report.stragglers)
    report.healthy = [n for n in nodes if n not in bad]
    return report


def _check_alone(nodes: list[str], first: list[WorldResult], suspects: list[str], failed: set[str],
                 run_world: Callable[[list[tuple[str, ...]]], list[WorldResult]],
                 report: NodeCheckReport) -> NodeCheckReport:
    """Round 2 when every world failed (e.g. a job on two nodes, one of them dead): no node is
    known good to pair a suspect with, so each suspect runs a world of its own (its GPUs, its
    host, its launcher). In a failed world, the members that fail alone are faulty and the ones
    that pass alone are cleared; a failed world whose members all pass alone points at the link
    between them, which names no node (unresolved). A slow world cannot be judged alone either."""
    second = run_world([(s,) for s in suspects])  # disjoint: all at once
    report.rounds.append(second)
    alone_ok = {r.nodes[0]: r.ok for r in second}
    unresolved: set[str] = set()
    for world in first:
        members = [n for n in world.nodes if n in alone_ok]
        if world.ok:  # slow, not failed
            unresolved.update(members)
            continue
        broken = [n for n in members if n in failed and not alone_ok[n]]
        report.faulty.extend(broken)
        if not broken:
            unresolved.update(members)
    report.unresolved = [n for n in nodes if n in unresolved]
    report.healthy = [n for n in nodes if n not in unresolved and n not in report.faulty]
    return report


def _waves(worlds: list[tuple[str, ...]]) -> list[list[tuple[str, ...]]]:
    waves: list[list[tuple[str, ...]]] = []
    for world in worlds:
        for wave in waves:
            if not any(set(world) & set(w) for w in wave):
                wave.append(world)
                break
        else:
            waves.append([world])
    return waves


class LauncherWorldRunner:
    """Runs each world as a real job: one torchrun per node running infra.nodecheck_worker."""

    def __init__(
        self,
        launcher: Launcher,
        run_dir: Path,
        rendezvous_host: Callable[[str], str] = lambda node: "127.0.0.1",
        free_port: Callable[[], int] | None = None,
        nproc_per_node: int = 1,
        timeout_s: float = 120.0,
        payload_mb: float = 4.0,
        iterations: int = 5,
        env: dict[str, str] | None = None,
    ):
        self.launcher = launcher
        self.run_dir = Path(run_dir)
        self.rendezvous_host = rendezvous_host
        self.free_port = free_port or _free_port
        self.nproc_per_node = nproc_per_node
        self.timeout_s = timeout_s
        self.payload_mb = payload_mb
        self.iterations = iterations
        self.env = env or {}
        self._count = 0

    def _launches(self, world: tuple[str, ...]):
        launches = local_node_launches(list(world), self.nproc_per_node, self.free_port())
        host = self.rendezvous_host(world[0])
        return [replace(l, address=self.rendezvous_host(l.node), master_addr=host) for l in launches]

    def __call__(self, worlds: list[tuple[str, ...]]) -> list[WorldResult]:
        jobs = []
        for world in worlds:
            self._count += 1
            world_dir = self.run_dir / f"world-{self._count:03d}-{'-'.join(world)}"
            result_path = world_dir / "result.json"
            request = LaunchRequest(
                job_name=f"nodecheck-{self._count}",
                nodes=self._launches(world),
                worker_args=[
                    "-m", "infra.nodecheck_worker",
                    f"--result={result_path}",
                    f"--payload-mb={self.payload_mb}",
                    f"--iterations={self.iterations}",
                    f"--timeout-s={self.timeout_s}",
                ],
                run_dir=world_dir,
                env=self.env,
            )
            jobs.append((world, result_path, time.monotonic(), self.launcher.start(request)))

        # A world queued by the batch system (Slurm PENDING, a Job suspended in Kueue) is not
        # slow: its deadline starts when it runs.
        for _, _, _, job in jobs:
            wait_until_started(job)
        # A world is decided as soon as one of its nodes fails: the others would only
        # sit in the rendezvous or the collective until their timeout.
        results: dict[int, WorldResult] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(results) < len(jobs):
            for index, (world, result_path, started, job) in enumerate(jobs):
                if index in results:
                    continue
                codes = job.poll()
                elapsed = time.monotonic() - started
                failed = any(code not in (None, 0) for code in codes.values())
                if failed or time.monotonic() >= deadline:
                    job.terminate(grace_s=2.0)
                    detail = f"exit codes {codes}" if failed else f"timed out after {self.timeout_s:.0f}s"
                    results[index] = WorldResult(world, False, elapsed, detail)
                elif all(code == 0 for code in codes.values()):
                    if result_path.exists():
                        measured = json.loads(result_path.read_text())
                        results[index] = WorldResult(world, True, float(measured["allgather_s"]), "ok")
                    else:
                        results[index] = WorldResult(world, False, elapsed, "no result written")
            time.sleep(0.2)
        return [results[i] for i in range(len(jobs))]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
