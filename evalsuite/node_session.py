"""A node's part of a multi-node evaluation as one long-lived session.

The evaluating flow starts one session per node (a run of the node-work deployment on that
node's work queue). The session

1. preloads the model into the node's shared memory (the precursor) and says it is ready;
2. runs the trials the evaluator hands it, up to `slots` at a time, each on its slot's
   long-lived worker process (`SlotProcesses`: one per device set, the engine kept between
   the slot's trials), and writes each trial's result;
3. stops when told to, or when the evaluator stops beating (it died: nobody will read the
   results), and removes the preload whatever happened.

One dispatch per node instead of one per trial: a flow run per trial costs seconds (the run
created, picked up by the worker, its process started, torch and the backend imported, the
model loaded) each time, which on a node with short trials is of the order of the trials.

The evaluator and the nodes share a directory (the evaluation's output folder, as the
per-trial results did before), one folder per node:

    <session>/<node>/inbox/<trial>.json    a trial for the node (written whole: atomic rename)
    <session>/<node>/outbox/<trial>.json   {"result": TrialResult} or {"error": "..."}
    <session>/<node>/ready                 the preload's local path, once it is in place
    <session>/<node>/stop                  the evaluator is done: finish and clean up
    <session>/heartbeat                    touched by the evaluator while it runs

Both halves of the protocol are here: `serve_node` is a node's, `open_sessions` /
`NodeSessions` the evaluator's (beat, wait until every node is ready, hand out trials,
tell them to stop). How a session is started and watched is the caller's `SessionRuns`
(the flow's: Prefect flow runs on the nodes' work queues, `tasks.eval_tasks`).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from evalsuite.errors import TrialError
from evalsuite.preload import preload, remove_preload
from evalsuite.trials import EngineCache, SlotProcesses, Trial, TrialResult, execute_trial
from infra.atomic_write import atomic_write

EVALUATOR_GONE_S = 300.0   # no heartbeat for this long: the evaluator died, the session ends


class SessionFolder:
    """The files one node's session and the evaluator exchange."""

    def __init__(self, session_dir: str | Path, node: str) -> None:
        self.root = Path(session_dir)
        self.node_dir = self.root / node
        self.inbox, self.outbox = self.node_dir / "inbox", self.node_dir / "outbox"
        self.ready, self.stop = self.node_dir / "ready", self.node_dir / "stop"
        self.heartbeat = self.root / "heartbeat"

    def create(self) -> None:
        self.inbox.mkdir(parents=True, exist_ok=True)
        self.outbox.mkdir(parents=True, exist_ok=True)

    # --- the evaluator's side
    def send(self, trial: Trial) -> Path:
        self.create()
        self.result_path(trial.trial_id).unlink(missing_ok=True)
        atomic_write(self.inbox / f"{trial.trial_id}.json", trial.model_dump_json())
        return self.result_path(trial.trial_id)

    def result_path(self, trial_id: str) -> Path:
        return self.outbox / f"{trial_id}.json"

    def beat(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.heartbeat.touch()

    def tell_stop(self) -> None:
        self.create()
        self.stop.touch()


def read_result(path: str | Path) -> TrialResult:
    """A trial's result from its outbox file; a failed trial raises its error."""
    reply = json.loads(Path(path).read_text())
    if "error" in reply:
        raise TrialError(reply["error"])
    return TrialResult.model_validate(reply["result"])


def serve_node(session_dir: str | Path, node: str, source: str, preload_root: str | None, slots: int,
               poll_s: float = 0.2, evaluator_gone_s: float = EVALUATOR_GONE_S) -> str:
    """Run this node's session until told to stop (see the module's docstring); returns a summary."""
    folder = SessionFolder(session_dir, node)
    folder.create()
    processes = SlotProcesses()   # isolation: process: one long-lived worker per slot's device set
    engines = EngineCache()       # isolation: thread: one engine per slot thread
    pool = cf.ThreadPoolExecutor(max_workers=max(1, slots), thread_name_prefix=f"{node}-slot")
    running: dict[cf.Future, str] = {}
    seen: set[str] = set()
    imported: set[str] = set()
    served = failed = 0
    started = time.time()
    try:
        local = preload(source, preload_root)
        atomic_write(folder.ready, str(local))
        while True:
            for path in sorted(folder.inbox.glob("*.json")):
                if path.name not in seen:
                    seen.add(path.name)
                    try:
                        trial = Trial.model_validate_json(path.read_text())
                    except ValueError as e:   # not a trial: say so in its result, serve the others
                        atomic_write(folder.result_path(path.stem), json.dumps(
                            {"error": f"{path} on {node} is not a trial: {e}"}))
                        failed += 1
                        continue
                    if trial.isolation == "thread" and trial.backend not in imported:
                        _import_backend(trial.backend)   # before slot threads do it at once
                        imported.add(trial.backend)
                    running[pool.submit(execute_trial, trial, None, engines, processes)] = trial.trial_id
            done, _ = cf.wait(running, timeout=poll_s, return_when=cf.FIRST_COMPLETED) if running else \
                (set(), None)
            for future in done:
                trial_id = running.pop(future)
                try:
                    result = future.result()
                    result.worker["node"] = node
                    reply = {"result": result.model_dump(mode="json")}
                    served += 1
                except Exception as e:
                    reply = {"error": str(e) if isinstance(e, TrialError) else
                             f"trial {trial_id} failed on {node}: {type(e).__name__}: {e}"}
                    failed += 1
                atomic_write(folder.result_path(trial_id), json.dumps(reply))
            if not running and folder.stop.exists() and \
                    all(p.name in seen for p in folder.inbox.glob("*.json")):
                break
            if _evaluator_gone(folder, started, evaluator_gone_s):
                raise TrialError(f"node {node}: the evaluator's heartbeat ({folder.heartbeat}) is older than "
                                 f"{evaluator_gone_s:.0f} s: it stopped; the session ends and removes its preload")
            if not running:
                time.sleep(poll_s)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        processes.close()
        engines.close()
        remove_preload(source, preload_root)
    return f"node {node}: {served} trial(s) served, {failed} failed"


def _import_backend(name: str) -> None:
    """An in-thread backend's heavy modules, imported from this thread first: transformers' lazy
    module is not safe to import from two slot threads at once (what `executor.prepare` does)."""
    from evalsuite.backends import backend_class
    from evalsuite.errors import EvalError

    try:
        backend_class(name).import_dependencies()
    except (ImportError, EvalError):
        pass   # reported by the trial, where it fails


def _evaluator_gone(folder: SessionFolder, started: float, gone_s: float) -> bool:
    try:
        last = os.stat(folder.heartbeat).st_mtime
    except FileNotFoundError:
        last = started   # no beat yet: counted from the session's start
    return time.time() - last > gone_s


# --- the evaluator's side


class SessionRuns(Protocol):
    """The node sessions' runs as the evaluator sees them (started by the caller of `open_sessions`)."""

    def refresh(self) -> None:
        """Read the runs' states again (`ended` answers from the last read)."""

    def ended(self, node: str) -> str | None:
        """None while the node's session runs or waits to start; else how it ended (for errors)."""

    def not_started_hint(self, node: str) -> str:
        """What to check when the node's session never started (e.g. the worker on its queue)."""

    def cancel_unstarted(self) -> None:
        """Cancel the sessions nothing has started: nothing would ever end them."""

    def wait_all(self) -> None:
        """Until every session ended; raise the first failure after all ended (none left running)."""


class NodeSessions:
    """The evaluator's side of the node sessions: their folders, their runs, its heartbeat."""

    def __init__(self, session_dir: str | Path, nodes: list[str], beat_s: float = 10.0) -> None:
        self.session_dir, self.nodes, self.beat_s = Path(session_dir), list(nodes), beat_s
        self.folders = {node: SessionFolder(session_dir, node) for node in nodes}
        self.runs: SessionRuns | None = None
        self._stop = threading.Event()
        self._beater: threading.Thread | None = None

    def folder(self, node: str) -> SessionFolder:
        if node not in self.folders:
            raise ValueError(f"trial for node {node!r}, but the sessions are on {', '.join(self.nodes)}")
        return self.folders[node]

    def send(self, trial: Trial) -> "SessionTrial":
        """Hand `trial` to its node's session."""
        return SessionTrial(trial, self.folder(trial.node).send(trial), self)

    def ended(self, node: str) -> str | None:
        return self.runs.ended(node) if self.runs is not None else None

    def start_beating(self) -> None:
        self.folders[self.nodes[0]].beat()

        def beat() -> None:
            while not self._stop.wait(self.beat_s):
                self.folders[self.nodes[0]].beat()

        self._beater = threading.Thread(target=beat, name="eval-session-heartbeat", daemon=True)
        self._beater.start()

    def stop_beating(self) -> None:
        self._stop.set()

    def wait_ready(self, timeout_s: float = 900.0, poll_s: float = 0.5) -> None:
        """Until every session has its preload in place; a session that ended first, or one that
        nothing started within `timeout_s`, is the error."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.runs.refresh()
            waiting = []
            for node in self.nodes:
                if self.folders[node].ready.exists():
                    continue
                how = self.runs.ended(node)
                if how is not None:
                    raise TrialError(f"the evaluation session on {node} ended before its preload was in place: {how}")
                waiting.append(node)
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise TrialError(f"the evaluation session(s) on {', '.join(waiting)} did not get the model preloaded "
                                 f"within {timeout_s:.0f} s; {self.runs.not_started_hint(waiting[0])}? Sessions "
                                 "nothing started are cancelled")
            time.sleep(poll_s)

    def end(self, failed: bool) -> None:
        """Tell every session to stop, cancel those never started, wait for the others (each removes
        its preload); their failures are raised unless the evaluation is already failing."""
        try:
            for folder in self.folders.values():
                folder.tell_stop()
            if self.runs is not None:
                self.runs.cancel_unstarted()
                try:
                    self.runs.wait_all()
                except Exception:
                    if not failed:
                        raise
        finally:
            self.stop_beating()


class SessionTrial:
    """A trial handed to its node's session: done when its result file is there or the session ended."""

    def __init__(self, trial: Trial, result_path: Path, sessions: NodeSessions) -> None:
        self.trial, self.result_path, self.sessions = trial, result_path, sessions

    def done(self) -> bool:
        return self.result_path.exists() or self.sessions.ended(self.trial.node) is not None

    def result(self) -> TrialResult:
        if self.result_path.exists():
            return read_result(self.result_path)
        raise TrialError(f"trial {self.trial.trial_id}: the session on {self.trial.node} ended before it "
                         f"finished: {self.sessions.ended(self.trial.node)}")


@contextmanager
def open_sessions(session_dir: str | Path, nodes: list[str], start: Callable[[NodeSessions], SessionRuns],
                  ready_timeout_s: float = 900.0, beat_s: float = 10.0) -> Iterator[NodeSessions]:
    """One session per node for the evaluation's lifetime: `start` starts them (its SessionRuns
    watches them), then this waits until each has preloaded the model; at the end they are told
    to stop and waited for (each removes its preload). While it lasts the evaluator beats, so a
    session whose evaluator died ends on its own (EVALUATOR_GONE_S)."""
    sessions = NodeSessions(session_dir, nodes, beat_s=beat_s)
    sessions.start_beating()
    try:
        sessions.runs = start(sessions)
        sessions.wait_ready(ready_timeout_s)
        yield sessions
    except BaseException:
        sessions.end(failed=True)   # the error that ended the evaluation is the one raised
        raise
    else:
        sessions.end(failed=False)  # a session that failed at the end is an error too
