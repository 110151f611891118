"""The checkpoint engine on a local directory: commit protocol, busy policy, fallback, retention."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil

import pytest
import torch

from checkpoint.engine import CheckpointEngine, CheckpointError
from checkpoint.sharded import GlobalPiece, PieceRequest, assign_savers
from checkpoint.manifest import (
    apply_retention,
    committed_steps,
    committed_checkpoints,
    manifest_key,
    read_latest,
    shard_key,
)
from infra.storage import (
    AccessDenied,
    InvalidCredentials,
    NoSuchBucket,
    StorageFull,
    classify_error,
    open_storage,
)


REPO = Path(__file__).resolve().parents[3]


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(128, 64, generator=g)}, "rng": torch.get_rng_state(),
            "trainer": {"step": step, "position": step * 8}}


@pytest.fixture(params=["thread", "process"])
def writer(request) -> str:
    return request.param


def test_async_saves_commit_in_order_and_load_newest(tmp_path, writer):
    url = str(tmp_path / "ckpt")
    with CheckpointEngine(url, writer=writer, keep_last=2) as engine:
        for step in (10, 20, 30):
            outcome = engine.save(step, _state(step))
            assert outcome.started and not outcome.skipped
        report = engine.wait()
        assert report.committed and report.step == 30, report
        assert [r.step for r in committed_checkpoints(url)] == [20, 30]  # keep_last=2
        assert read_latest(url).step == 30
        loaded = engine.load()
    assert loaded.step == 30
    assert torch.equal(loaded.state["model"]["w"], _state(30)["model"]["w"])
    assert loaded.state["trainer"] == {"step": 30, "position": 240}


def test_shards_without_manifest_are_not_checkpoints_and_get_cleaned(tmp_path):
    url = str(tmp_path / "ckpt")
    storage = open_storage(url)
    with CheckpointEngine(url, writer="thread") as engine:
        engine.save(10, _state(10), blocking=True)
        storage.put_bytes(shard_key(15, 0, 1), b"half a shard from a crashed persist")
        assert committed_steps(storage) == [10]
        assert engine.load().step == 10
        engine.save(20, _state(20), blocking=True)  # retention runs after this commit
    assert not storage.exists(shard_key(15, 0, 1))
    assert committed_steps(storage) == [10, 20]


def test_busy_skip_and_wait(tmp_path):
    gate = threading.Event()
    reached = threading.Event()

    def hold(step: int) -> None:  # keeps step 10's persist in flight until released
        if step == 10:
            reached.set()
            assert gate.wait(60)

    url = str(tmp_path / "ckpt")
    with CheckpointEngine(url, writer="thread", on_busy="skip", after_shard_written=hold) as engine:
        engine.save(10, _state(10))
        assert reached.wait(60) and engine.busy
        skipped = engine.save(20, _state(20))
        assert skipped.skipped and not skipped.started
        gate.set()
        assert engine.wait().committed
        assert engine.save(30, _state(30)).started
        engine.wait()
    assert committed_steps(open_storage(url)) == [10, 30]

    gate.clear()
    reached.clear()
    url = str(tmp_path / "ckpt-wait")
    with CheckpointEngine(url, writer="thread", on_busy="wait", after_shard_written=hold) as engine:
        engine.save(10, _state(10))
        assert reached.wait(60)
        threading.Timer(0.3, gate.set).start()
        waited = engine.save(20, _state(20))  # blocks until step 10 is committed
        assert waited.started and waited.wait_s > 0
        assert engine.reports[0].step == 10 and engine.reports[0].committed
        assert engine.wait().committed
    assert committed_steps(open_storage(url)) == [10, 20]


def test_corrupt_newest_falls_back_and_is_set_aside(tmp_path, caplog):
    url = str(tmp_path / "ckpt")
    with CheckpointEngine(url, writer="thread", keep_last=5) as engine:
        engine.save(10, _state(10), blocking=True)
        engine.save(20, _state(20), blocking=True)
    shard = tmp_path / "ckpt" / shard_key(20, 0, 1)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit in the tensor bytes
    shard.write_bytes(bytes(data))
    with CheckpointEngine(url, writer="thread") as engine:
        with caplog.at_level("WARNING"):
            loaded = engine.load()
        assert loaded.step == 10 and loaded.skipped_steps == [20]
        assert torch.equal(loaded.state["model"]["w"], _state(10)["model"]["w"])
        assert "checksum" in caplog.text and "falling back" in caplog.text
        assert committed_steps(engine.storage) == [10]  # step 20 no longer counts as committed
        assert read_latest(url).step == 10
        with pytest.raises(CheckpointError, match="not a committed checkpoint"):
            engine.load(step=20)


def test_retention_never_deletes_newest_protected_or_leased(tmp_path):
    storage = open_storage(str(tmp_path / "r"))
    for step in (10, 20, 30, 40):
        storage.put_bytes(shard_key(step, 0, 1), b"x")
        storage.put_bytes(manifest_key(step), b"{}")
    storage.put_bytes(shard_key(25, 0, 1), b"orphan")  # crashed persist, older than newest
    storage.put_bytes(shard_key(50, 0, 1), b"in flight")  # newer than newest: may be running
    storage.put_bytes("step-00000020/lease-abc.json", json.dumps({"holder": "eval"}).encode())
    result = apply_retention(storage, keep_last=1, protect={10})
    assert result.deleted_steps == [30]
    assert result.orphaned_steps == [25]
    assert committed_steps(storage) == [10, 20, 40]
    assert storage.exists(shard_key(50, 0, 1))


def test_errors_are_classified_into_clear_types():
    from botocore.exceptions import ClientError, EndpointConnectionError

    def client_error(code: str, status: int) -> ClientError:
        return ClientError({"Error": {"Code": code, "Message": code},
                            "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

    assert isinstance(classify_error(client_error("NoSuchBucket", 404), "s3://b"), NoSuchBucket)
    assert isinstance(classify_error(client_error("AccessDenied", 403), "s3://b"), AccessDenied)
    assert isinstance(classify_error(client_error("SignatureDoesNotMatch", 403), "s3://b"), InvalidCredentials)
    for transient in (client_error("SlowDown", 503), client_error("InternalError", 500),
                      client_error("Whatever", 502), EndpointConnectionError(endpoint_url="http://x"),
                      ConnectionResetError(errno.ECONNRESET, "reset")):
        assert classify_error(transient, "s3://b") is None, transient
    wrapped = PermissionError("denied")
    wrapped.__cause__ = client_error("InvalidAccessKeyId", 403)  # how s3fs re-raises
    assert isinstance(classify_error(wrapped, "s3://b"), InvalidCredentials)
    full = classify_error(OSError(errno.ENOSPC, "No space left on device"), "/ckpt")
    assert isinstance(full, StorageFull) and "keep_last" in str(full)


def test_pieces_load_onto_another_cut_and_mismatches_are_refused(tmp_path):
    url = str(tmp_path / "ckpt")
    whole = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
    # Saved as two row blocks (a TP=2 column-parallel layout) plus an object.
    pieces = [GlobalPiece("w", (8, 6), (0, 0), whole[:4]), GlobalPiece("w", (8, 6), (4, 0), whole[4:]),
              GlobalPiece("extra", (1,), (0,), {"note": 1}, is_object=True)]
    with CheckpointEngine(url, writer="thread", layout={"dp": 1, "tp": 2, "pp": 1}) as engine:
        engine.save(10, {"rng": 7}, pieces=pieces, common={"trainer": {"step": 10}}, blocking=True)
    with CheckpointEngine(url, writer="thread") as engine:  # another layout: a column cut
        loaded = engine.load(requests=[
            PieceRequest("w", (8, 6), (2, 3), (5, 3), torch.float64),
            PieceRequest("extra", (1,), (0,), is_object=True)])
        assert loaded.step == 10 and loaded.state is None and not loaded.same_layout
        assert torch.equal(loaded.pieces[0], whole[2:7, 3:6].double())
        assert loaded.pieces[1] == {"note": 1} and loaded.common == {"trainer": {"step": 10}}
        with pytest.raises(CheckpointError, match="w: the checkpoint holds global shape"):
            engine.load(requests=[PieceRequest("w", (8, 7), (0, 0), (8, 7))])
        with pytest.raises(CheckpointError, match="missing_key: not in the checkpoint"):
            engine.load(requests=[PieceRequest("missing_key", (2,), (0,), (2,))])
    storage = open_storage(url)
    manifest = json.loads(storage.get_bytes(manifest_key(10)))
    manifest["format"] = "forgeflow-checkpoint/1"
    storage.put_bytes(manifest_key(10), json.dumps(manifest).encode())
    with CheckpointEngine(url, writer="thread") as engine:
        with pytest.raises(CheckpointError, match="format 1 .* was retired"):
            engine.load()


def test_replicated_pieces_are_saved_once_and_spread_over_their_holders():
    big, small = (("w", (0,), (4,), False), 400), (("n", (0,), (1,), False), 100)
    own = [("a", (0,), (2,), False), 50]
    # Ranks 0 and 1 both hold w and n (data-parallel replicas); rank 1 also holds its own piece.
    everyone = [[big, small], [big, small, tuple(own)]]
    plans = [assign_savers(everyone, r) for r in (0, 1)]
    saved = sorted(everyone[r][i][0] for r in (0, 1) for i in plans[r].mine)
    assert saved == sorted([big[0], small[0], own[0]])  # each piece exactly once
    assert plans[0].bytes_by_rank == [400, 150]  # the big one on rank 0, the rest on rank 1


def test_process_writer_is_restarted_after_its_child_dies(tmp_path):
    url = str(tmp_path / "ckpt")
    with CheckpointEngine(url, writer="process") as engine:
        engine.save(10, _state(10))
        assert engine.wait().committed
        child = engine._writer._proc  # the writer process this engine started
        child.kill()
        child.wait()
        engine.save(20, _state(20))
        assert engine.wait().committed
        assert engine._writer._proc.pid != child.pid
        assert engine.load().step == 20
        # The new writer was started by the persist thread of step 20, which has ended: the writer
        # outlives it (a parent-death signal would have killed it with the thread, failing the
        # next checkpoint) and writes step 30.
        restarted = engine._writer._proc
        time.sleep(0.5)
        assert restarted.poll() is None, f"the restarted writer died with its thread ({restarted.returncode})"
        engine.save(30, _state(30))
        assert engine.wait().committed and engine._writer._proc is restarted


def test_process_writer_outlives_the_signals_that_stop_its_rank(tmp_path):
    """SIGTERM tells a rank to commit the step it is on and stop; torchrun sends it to the rank's
    process group and the reaper to every descendant. The writer, in a session of its own and
    ignoring SIGTERM, is there to write that last checkpoint."""
    url = str(tmp_path / "ckpt")
    with CheckpointEngine(url, writer="process") as engine:
        child = engine._writer._proc
        assert os.getsid(child.pid) == child.pid != os.getsid(0)   # not in the rank's group
        child.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert child.poll() is None
        engine.save(10, _state(10))
        assert engine.wait().committed and engine._writer._proc is child


def test_process_writer_ends_when_its_rank_is_killed(tmp_path):
    rank = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(REPO)!r})
        from checkpoint.engine import CheckpointEngine
        engine = CheckpointEngine({str(tmp_path / "ckpt")!r}, writer="process")
        print(engine._writer._proc.pid, flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    writer_pid = int(rank.stdout.readline())
    rank.kill()
    rank.wait()
    deadline = time.monotonic() + 30
    while psutil.pid_exists(writer_pid) and psutil.Process(writer_pid).status() != psutil.STATUS_ZOMBIE \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(writer_pid) or psutil.Process(writer_pid).status() == psutil.STATUS_ZOMBIE, \
        "the writer outlived its killed rank"


# --- a storage error while loading is not a damaged checkpoint -----------------------------------

@pytest.mark.parametrize("failing", ["shard", "manifest", "listing"])
def test_transient_storage_error_at_load_stops_and_keeps_the_checkpoint(tmp_path, monkeypatch, failing):
    """One read that fails after the storage layer's retries (503 SlowDown, a timeout) says
    nothing about the step's content: load() raises, nothing is set aside, and the next
    attempt resumes from the same step."""
    from checkpoint.engine import CheckpointStorageUnavailable
    from infra.storage import LocalStorage, StorageUnavailable

    url = str(tmp_path / "ckpt")
    with CheckpointEngine(url, writer="thread", keep_last=5) as engine:
        engine.save(10, _state(10), blocking=True)
        engine.save(20, _state(20), blocking=True)
    key = {"shard": shard_key(20, 0, 1), "manifest": manifest_key(20)}.get(failing)
    real_get, real_list = LocalStorage.get_bytes, LocalStorage.list

    def get_bytes(self, k):
        if k == key:
            raise StorageUnavailable("get_object kept failing for ~120s (503 SlowDown)", self.url(k))
        return real_get(self, k)

    def listing(self, prefix=""):
        if failing == "listing":
            raise StorageUnavailable("list kept failing for ~120s (ReadTimeoutError)", self.url(prefix))
        return real_list(self, prefix)

    with CheckpointEngine(url, writer="thread") as engine:
        monkeypatch.setattr(LocalStorage, "get_bytes", get_bytes)
        monkeypatch.setattr(LocalStorage, "list", listing)
        with pytest.raises(CheckpointStorageUnavailable, match="Nothing was set aside") as raised:
            engine.load()
        monkeypatch.undo()
    assert "503 SlowDown" in str(raised.value) or "ReadTimeoutError" in str(raised.value)
    storage = open_storage(url)
    assert committed_steps(storage) == [10, 20] and read_latest(url).step == 20
    assert not storage.exists("step-00000020/set-aside.json")
    with CheckpointEngine(url, writer="thread") as engine:
        loaded = engine.load()
    assert loaded.step == 20 and loaded.skipped_steps == []
    assert torch.equal(loaded.state["model"]["w"], _state(20)["model"]["w"])


def test_a_missing_shard_is_still_set_aside(tmp_path):
    """Content problems (here: a shard gone) still fall back, as before."""
    url = str(tmp_path / "ckpt")
    with CheckpointEngine(url, writer="thread", keep_last=5) as engine:
        engine.save(10, _state(10), blocking=True)
        engine.save(20, _state(20), blocking=True)
    (tmp_path / "ckpt" / shard_key(20, 0, 1)).unlink()
    with CheckpointEngine(url, writer="thread") as engine:
        loaded = engine.load()
    assert loaded.step == 10 and loaded.skipped_steps == [20]
    assert committed_steps(open_storage(url)) == [10]


# --- set aside: durable, idempotent, undone by a new commit ------------------------------------

def test_a_set_aside_note_counts_even_if_the_manifest_survived(tmp_path):
    """The note is the durable part (an fsynced write); a local unlink is not fsynced, so a
    crash may bring the manifest back: the step must still not count, nor be loaded, and
    retention collects it like any orphan once it is older than the newest commit."""
    from checkpoint.manifest import set_aside, set_aside_key

    url = str(tmp_path / "ckpt")
    storage = open_storage(url)
    with CheckpointEngine(url, writer="thread", keep_last=5) as engine:
        for step in (10, 20, 30):
            engine.save(step, _state(step), blocking=True)
    set_aside(storage, 20, "test")
    set_aside(storage, 20, "test again")  # idempotent
    storage.put_bytes(manifest_key(20), storage.get_bytes(manifest_key(30)))  # the unlink "lost"
    assert committed_steps(storage) == [10, 30]
    assert apply_retention(storage, keep_last=5).orphaned_steps == [20]
    assert not storage.list("step-00000020/")
    set_aside(storage, 30, "test")
    with CheckpointEngine(url, writer="thread", keep_last=5) as engine:
        assert engine.load().step == 10
        engine.save(30, _state(30), blocking=True)  # a new commit of the step clears its note
        assert not storage.exists(set_aside_key(30))
        assert committed_steps(storage) == [10, 30] and engine.load().step == 30
