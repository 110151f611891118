"""A job's logs, found from its row in the state database: what `forgeflow logs` reads.

Where the launcher and the runner put them (`infra.launch.node_log_path`, `infra.runfiles`):

    <run_dir>/logs/node-<node>.attempt-<N>.out   each node's console in attempt N (all its
                                                  ranks, each line prefixed by torchrun)
    <run_dir>/logs/rank<R>.log                   rank R's run log: steps and events, every attempt
    jobs.runner["log"]                           the detached runner of `forgeflow submit`: what
                                                  the job's flow printed, from "waiting for GPUs"
                                                  to its end

`run_dir` is the job spec's (`jobs.spec["run_dir"]`); a relative one is read from the runner's
working directory (`jobs.runner["cwd"]`) when it recorded one, else from the current one.
`log_sources` picks the files; `LogTail` reads what was appended since it last looked; `follow`
tails them until the job ends. `owning_job` says which job's run directory holds a file (a flow
that reads a file named in a parameter reads only job files).
"""

from __future__ import annotations

import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from infra import runfiles
from scheduler.orchestrator.config import OrchestratorError
from scheduler.orchestrator.service import DONE

# infra.launch.node_log_path's file name, read back
_NODE_LOG = re.compile(r"^node-(?P<node>.+)\.attempt-(?P<attempt>\d+)\.out$")


@dataclass(frozen=True)
class LogSource:
    """One file to print, with the prefix each of its lines gets ("" for none)."""

    path: Path
    prefix: str = ""


@dataclass(frozen=True)
class LogSelection:
    """What `forgeflow logs` shows for a job now: a title and its files (none yet: `missing` says why)."""

    title: str
    sources: tuple[LogSource, ...]
    missing: str = ""


def run_dir(job: dict[str, Any]) -> Path | None:
    """The job's run directory (None: it has no job spec, e.g. a plain GPU demand)."""
    spec = job.get("spec") or {}
    template = spec.get("run_dir")
    if not template:
        return None
    path = Path(str(template).replace("{name}", job["name"]).replace("{job}", str(job["id"])))
    cwd = (job.get("runner") or {}).get("cwd")
    return Path(cwd) / path if cwd and not path.is_absolute() else path


def node_logs(directory: Path | None) -> dict[int, dict[str, Path]]:
    """{attempt: {node: console log}} of every attempt launched so far."""
    out: dict[int, dict[str, Path]] = {}
    logs = None if directory is None else directory / runfiles.LOGS_DIR
    if logs is None or not logs.is_dir():
        return out
    for path in sorted(logs.iterdir()):
        match = _NODE_LOG.match(path.name)
        if match:
            out.setdefault(int(match["attempt"]), {})[match["node"]] = path
    return out


def log_sources(job: dict[str, Any], *, rank: int | None = None, attempt: int | None = None) -> LogSelection:
    """The files to show: rank `rank`'s run log; the node consoles of `attempt` (default: the
    newest); before anything was launched, the runner's log. OrchestratorError for a rank or an
    attempt the job does not have."""
    label = f"job {job['id']} ({job['name']})"
    directory = run_dir(job)
    if rank is not None:
        if attempt is not None:
            raise OrchestratorError("--attempt picks the node consoles of one attempt, and a rank log holds every "
                                    "attempt: give --rank or --attempt, not both")
        world = (job.get("placement") or {}).get("world_size")
        if rank < 0 or (world is not None and rank >= world):
            raise OrchestratorError(f"{label} has no rank {rank}"
                                    + (f": it runs ranks 0-{world - 1}" if world else "") + "; drop --rank or pick one")
        if directory is None:
            raise OrchestratorError(f"{label} has no run directory (it has no job spec), so no rank logs")
        path = runfiles.log_path(directory, rank)
        return LogSelection(f"{label}, rank {rank}: {path}", (LogSource(path),),
                            "" if path.exists() else f"{label} has no rank {rank} log yet ({path})")
    attempts = node_logs(directory)
    if attempt is not None and attempt not in attempts:
        have = ", ".join(map(str, sorted(attempts))) or "none yet"
        raise OrchestratorError(f"{label} has no node logs of attempt {attempt} (attempts with logs: {have}); "
                                "drop --attempt for the newest")
    if attempts:
        chosen = attempt if attempt is not None else max(attempts)
        nodes = attempts[chosen]
        return LogSelection(f"{label}, attempt {chosen}: {', '.join(nodes)}",
                            tuple(LogSource(path, f"[{node}] ") for node, path in nodes.items()))
    runner = job.get("runner") or {}
    log = runner.get("log")
    if log and Path(log).exists():
        return LogSelection(f"{label}, its runner (nothing launched yet): {log}", (LogSource(Path(log)),))
    return LogSelection(label, (), _nothing_yet(label, job, runner, directory))


def _nothing_yet(label: str, job: dict[str, Any], runner: dict[str, Any], directory: Path | None) -> str:
    where = []
    if runner.get("log") and runner.get("host") not in (None, socket.gethostname()):
        where.append(f"its runner's log is on host {runner['host']}: {runner['log']}")
    if runner.get("url"):
        where.append(f"its flow run's logs: {runner['url']}")
    if directory is not None:
        where.append(f"node logs will be in {directory / runfiles.LOGS_DIR}")
    return f"{label} is {job['state']}: no logs yet" + (f" ({'; '.join(where)})" if where else "")


class LogTail:
    """Reads each file from where it stopped last time: whole lines only (a line still being
    written waits for its end, unless `final`), each with its source's prefix."""

    def __init__(self) -> None:
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}

    def read(self, sources: tuple[LogSource, ...], *, final: bool = False) -> list[str]:
        lines: list[str] = []
        for source in sources:
            try:
                with open(source.path, "rb") as f:
                    f.seek(self._offsets.get(source.path, 0))
                    chunk = f.read()
                    self._offsets[source.path] = f.tell()
            except FileNotFoundError:
                continue
            data = self._partial.pop(source.path, b"") + chunk
            complete, _, rest = data.rpartition(b"\n")
            if complete or data.endswith(b"\n"):
                lines.extend(source.prefix + line for line in complete.decode("utf-8", "replace").split("\n"))
            else:
                rest = data
            if rest and final:
                lines.append(source.prefix + rest.decode("utf-8", "replace"))
            elif rest:
                self._partial[source.path] = rest
        return lines


def follow(read_job: Callable[[], dict[str, Any]], choose: Callable[[dict[str, Any]], LogSelection],
           emit: Callable[[str], None], note: Callable[[str], None], *, poll_s: float = 0.5,
           state_every_s: float = 2.0) -> dict[str, Any]:
    """Emit each line the job's logs gain until the job ends (its row is read every
    `state_every_s`); `choose` picks the files from the row, so a follow moves on from the
    runner's log to attempt 0's consoles, and to attempt 1's after a restart (`note` says so).
    Returns the job's last row."""
    tail = LogTail()
    shown: LogSelection | None = None
    job, checked = read_job(), time.monotonic()
    while True:
        ended = job["state"] in DONE
        selection = choose(job)
        if shown is None or selection.sources != shown.sources:
            note(f"==> {selection.title} <==" if selection.sources else selection.missing)
            shown = selection
        for line in tail.read(selection.sources, final=ended):
            emit(line)
        if ended:
            return job
        time.sleep(poll_s)
        if time.monotonic() - checked >= state_every_s:
            job, checked = read_job(), time.monotonic()


def owning_job(engine, path: str | Path) -> int | None:
    """The id of the job whose run directory holds `path` (symlinks resolved), or None. What a
    flow run's parameter may name: a file of some job, never any file the worker can read."""
    import sqlalchemy as sa

    from infra.statedb import read_transaction
    from infra.statedb.schema import jobs

    target = Path(path).resolve()
    with read_transaction(engine) as conn:
        rows = conn.execute(sa.select(jobs.c.id, jobs.c.name, jobs.c.spec, jobs.c.runner)).all()
    for row in rows:
        folder = run_dir({"id": row.id, "name": row.name, "spec": row.spec, "runner": row.runner})
        if folder is not None and target.is_relative_to(folder.resolve()):
            return row.id
    return None
