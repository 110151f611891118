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
