"""A node's evaluation session: preload once, serve the trials it is handed on its slots (a failed
trial is reported, the session goes on), stop when told, end when the evaluator stops beating,
and remove the preload whatever happened."""

from __future__ import annotations

import os
import threading
import time

import pytest

from evalsuite.datasets import DatasetRef
from evalsuite.errors import TrialError
from evalsuite.node_session import SessionFolder, read_result, serve_node
from evalsuite.preload import preload_key
from evalsuite.trials import ShardSpec, Trial


def _trial(trial_id: str, dataset: str, model_path: str, out, isolation: str = "thread") -> Trial:
    shard = ShardSpec(dataset=DatasetRef(name=dataset, options={"limit": 2}), shard=0, start=0, stop=2)
    return Trial(trial_id=trial_id, shards=[shard], backend="transformers", model_path=model_path,
                 backend_options={"batch_size": 2, "device": "cpu"}, output_dir=str(out), isolation=isolation,
                 node="node-a")


def _wait_for(path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_a_session_preloads_serves_its_trials_and_removes_the_preload_when_told_to_stop(tiny_model, tmp_path):
    source, shm = f"file://{tiny_model}", tmp_path / "shm"
    folder = SessionFolder(tmp_path / "sessions", "node-a")
    folder.beat()
    outcome: list = []
    session = threading.Thread(target=lambda: outcome.append(
        serve_node(folder.root, "node-a", source, str(shm), slots=2, poll_s=0.05)))
    session.start()
    _wait_for(folder.ready)
    local = folder.ready.read_text()
    assert local == str(shm / preload_key(source)) and os.path.isdir(local)   # the precursor's copy
    # Two trials on its two slots, one of them in its slot's own process; a third that fails.
    sent = [folder.send(_trial("t-arith", "arith-em", local, tmp_path / "out", isolation="process")),
            folder.send(_trial("t-capitals", "capitals-mc", local, tmp_path / "out")),
            folder.send(_trial("t-broken", "arith-em", str(tmp_path / "no-model"), tmp_path / "out"))]
    (folder.inbox / "t-garbled.json").write_text("{not json")   # what no evaluator writes: one error
    for path in sent:
        _wait_for(path)
    arith, capitals = read_result(sent[0]), read_result(sent[1])
    assert arith.worker["node"] == capitals.worker["node"] == "node-a"
    assert arith.worker["pid"] != str(os.getpid()) == capitals.worker["pid"]   # process vs thread isolation
    assert [s.samples for s in arith.shards] == [2] and [s.samples for s in capitals.shards] == [2]
    with pytest.raises(TrialError, match="t-broken"):
        read_result(sent[2])
    _wait_for(folder.result_path("t-garbled"))
    with pytest.raises(TrialError, match="t-garbled.json on node-a is not a trial"):
        read_result(folder.result_path("t-garbled"))
    assert session.is_alive()                        # a failed trial does not end the session
    folder.tell_stop()
    session.join(timeout=60)
    assert not session.is_alive() and outcome == ["node node-a: 2 trial(s) served, 2 failed"]
    assert not (shm / preload_key(source)).exists(), "the session left its preload behind"


def test_a_session_whose_evaluator_stopped_beating_ends_and_removes_its_preload(tiny_model, tmp_path):
    source, shm = f"file://{tiny_model}", tmp_path / "shm"
    folder = SessionFolder(tmp_path / "sessions", "node-b")
    folder.beat()
    past = time.time() - 600
    os.utime(folder.heartbeat, (past, past))         # the evaluator's last beat was 10 minutes ago
    with pytest.raises(TrialError, match="heartbeat .* is older than 60 s"):
        serve_node(folder.root, "node-b", source, str(shm), slots=1, poll_s=0.05, evaluator_gone_s=60)
    assert folder.ready.exists()                     # it had preloaded...
    assert not (shm / preload_key(source)).exists()  # ...and removed it on the way out


class ThreadSessions:
    """The evaluator's SessionRuns with each node's session in a thread of this process running
    the real `serve_node` (the flow's are Prefect flow runs): no Prefect needed. Nodes left out of
    `started` get no thread, as a node whose queue no worker serves."""

    def __init__(self, sessions, source: str, preload_root: str, started: set[str] | None = None) -> None:
        self.nodes = sessions.nodes
        self.outcome: dict[str, object] = {}
        self.threads = {node: threading.Thread(target=self._serve, args=(sessions.session_dir, node, source,
                                                                         preload_root), daemon=True)
                        for node in self.nodes if started is None or node in started}
        self.cancelled: list[str] = []
        for thread in self.threads.values():
            thread.start()

    def _serve(self, session_dir, node, source, preload_root) -> None:
        try:
            self.outcome[node] = serve_node(session_dir, node, source, preload_root, slots=1, poll_s=0.05)
        except Exception as e:
            self.outcome[node] = e

    def refresh(self) -> None:
        pass   # a thread's state is always current

    def ended(self, node: str) -> str | None:
        thread = self.threads.get(node)
        return None if thread is None or thread.is_alive() else f"its thread ended: {self.outcome[node]}"

    def not_started_hint(self, node: str) -> str:
        return f"no thread serves {node}"

    def cancel_unstarted(self) -> None:
        self.cancelled = [node for node in self.nodes if node not in self.threads]

    def wait_all(self) -> None:
        for thread in self.threads.values():
            thread.join(timeout=120)
        errors = [o for o in self.outcome.values() if isinstance(o, Exception)]
        if errors:
            raise errors[0]


def test_the_evaluator_opens_a_session_per_node_hands_out_trials_and_closes_them(tiny_model, tmp_path):
    from evalsuite.node_session import open_sessions

    source, shm = f"file://{tiny_model}", tmp_path / "shm"
    started: list[ThreadSessions] = []

    def start(sessions):
        started.append(ThreadSessions(sessions, source, str(shm)))
        return started[0]

    with open_sessions(tmp_path / "sessions", ["node-a", "node-b"], start, ready_timeout_s=120, beat_s=0.2) as sessions:
        local = sessions.folder("node-a").ready.read_text()   # both ready: open_sessions waited
        assert sessions.folder("node-b").ready.exists()
        handles = [sessions.send(_trial(f"t-{node}", "arith-em", local, tmp_path / "out").model_copy(
            update={"node": node})) for node in ("node-a", "node-b")]
        deadline = time.monotonic() + 120
        while not all(h.done() for h in handles):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert [h.result().worker["node"] for h in handles] == ["node-a", "node-b"]
        with pytest.raises(ValueError, match="node-c.*node-a, node-b"):
            sessions.send(_trial("t-c", "arith-em", local, tmp_path / "out").model_copy(update={"node": "node-c"}))
    runs = started[0]
    assert not any(t.is_alive() for t in runs.threads.values())   # told to stop, and waited for
    assert runs.outcome == {"node-a": "node node-a: 1 trial(s) served, 0 failed",
                            "node-b": "node node-b: 1 trial(s) served, 0 failed"}
    assert not (shm / preload_key(source)).exists()              # each removed its preload


def test_a_session_that_ends_before_its_preload_is_in_place_is_the_error(tmp_path):
    from evalsuite.node_session import open_sessions

    with pytest.raises(TrialError, match="session on node-a ended before its preload was in place: its thread ended"):
        with open_sessions(tmp_path / "sessions", ["node-a"],
                           lambda s: ThreadSessions(s, "file:///nowhere/model", str(tmp_path / "shm")),
                           ready_timeout_s=60):
            pytest.fail("never handed to the evaluation")


def test_a_session_nothing_started_is_one_clear_error_and_is_cancelled(tmp_path):
    from evalsuite.node_session import open_sessions

    started: list[ThreadSessions] = []

    def start(sessions):
        started.append(ThreadSessions(sessions, "file:///unused", str(tmp_path / "shm"), started=set()))
        return started[0]

    with pytest.raises(TrialError, match=r"session\(s\) on node-a did not get the model preloaded within 1 s; "
                                         r"no thread serves node-a\?"):
        with open_sessions(tmp_path / "sessions", ["node-a"], start, ready_timeout_s=1):
            pytest.fail("never handed to the evaluation")
    assert started[0].cancelled == ["node-a"]
    assert (tmp_path / "sessions" / "node-a" / "stop").exists()   # told to stop all the same
