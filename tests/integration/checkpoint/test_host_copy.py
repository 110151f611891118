"""checkpoint.host_copy against a real S3 server (moto): a restart on the node that wrote a shard
reads its host copy, never a copy that the manifest does not vouch for, and the copies stay
bounded and go when the job has finished."""

from __future__ import annotations

import os
import time

import torch

from checkpoint.engine import CheckpointEngine
from checkpoint.host_copy import KEEP_STEPS, HostCopies, host_copies_for
from checkpoint.manifest import shard_key
from infra.storage import open_storage


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(1 << 16, generator=g), "trainer": {"step": step}}


def _shard_gets(engine) -> list[str]:
    """The shard downloads this engine makes from now on."""
    gets: list[str] = []

    def count(request, **_):
        if request.method == "GET" and request.url.split("?")[0].endswith(".bin"):
            gets.append(request.url)

    engine.storage.client.meta.events.register("before-send.s3", count)
    return gets


def test_a_restart_here_reads_the_host_copy_and_a_bad_copy_is_never_used(moto_s3, caplog):
    url = f"s3://{moto_s3.make_bucket()}/run"
    options = moto_s3.options()
    with CheckpointEngine(url, storage_options=options, writer="process", keep_last=5) as engine:
        for step in (10, 20, 30):
            engine.save(step, _state(step), blocking=True)
    copies = host_copies_for(open_storage(url, options))
    # the newest KEEP_STEPS steps of the shard are kept (the newest may not have committed)
    assert sorted(p.parent.name for p in copies.directory.glob("step-*/*.bin")) == \
        ["step-00000020", "step-00000030"][-KEEP_STEPS:]

    with CheckpointEngine(url, storage_options=options, writer="thread") as engine:
        gets = _shard_gets(engine)
        with caplog.at_level("INFO", logger="checkpoint.engine"):
            loaded = engine.load()
    assert loaded.step == 30 and torch.equal(loaded.state["w"], _state(30)["w"])
    assert gets == [] and "host copy" in caplog.text  # no shard downloaded

    # a copy that does not match the manifest (bit rot, a stale or foreign file) is not read
    path = copies.directory / shard_key(30, 0, 1)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with CheckpointEngine(url, storage_options=options, writer="thread") as engine:
        gets = _shard_gets(engine)
        loaded = engine.load()
    assert loaded.step == 30 and torch.equal(loaded.state["w"], _state(30)["w"])
    assert len(gets) == 1  # the shard came from S3

    # the job finished: this rank's copies go
    with CheckpointEngine(url, storage_options=options, writer="thread") as engine:
        engine.forget_host_copies()
    assert not copies.directory.exists()


def test_no_copy_without_room_off_or_for_a_local_directory(tmp_path, monkeypatch):
    copies = HostCopies(tmp_path / "copies")
    assert not copies.keep("step-00000010/rank-0-of-1.bin", [b"x"], size=1 << 50)  # never fills the tmpfs
    assert not copies.keep("../escape.bin", [b"x"], size=1)  # only shard keys
    assert copies.keep("step-00000010/rank-0-of-1.bin", [b"ab", b"c"], size=3)
    assert copies.read("step-00000010/rank-0-of-1.bin") == b"abc"
    assert host_copies_for(open_storage(str(tmp_path / "ckpt"))) is None  # on this host already

    class S3Like:
        scheme = "s3"

        @staticmethod
        def url():
            return "s3://bucket/run"

    monkeypatch.setenv("FORGEFLOW_HOST_CHECKPOINT_DIR", "off")
    assert host_copies_for(S3Like()) is None
    monkeypatch.setenv("FORGEFLOW_HOST_CHECKPOINT_DIR", str(tmp_path / "moved"))
    assert host_copies_for(S3Like()).directory.parent == tmp_path / "moved"


def test_copies_a_day_old_are_removed_whichever_job_left_them(tmp_path):
    left = HostCopies(tmp_path / "root" / "other-job")
    assert left.keep("step-00000010/rank-3-of-4.bin", [b"old"], size=3)
    fresh = HostCopies(tmp_path / "root" / "this-job")
    assert fresh.keep("step-00000010/rank-0-of-4.bin", [b"new"], size=3)
    day_old = time.time() - 25 * 3600
    os.utime(left.directory / "step-00000010" / "rank-3-of-4.bin", (day_old, day_old))
    fresh.remove_stale()
    assert not (left.directory / "step-00000010").exists()
    assert fresh.read("step-00000010/rank-0-of-4.bin") == b"new"
