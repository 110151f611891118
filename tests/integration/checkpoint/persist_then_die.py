"""A process that commits one checkpoint, starts a second and dies (os._exit) mid-persist.

    python persist_then_die.py URL ENDPOINT KEY SECRET WRITER WHEN

WHEN = "after_shard": exit once this rank's shard is uploaded, before the manifest;
WHEN = "during_upload": exit right after save() returns, while the upload is running;
WHEN = "during_copy": save step 20 with overlap=True (the host copy runs in the background)
and exit while that copy is still running; prints "died while copying" first.
"""

from __future__ import annotations

import os
import sys

import torch


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    # ~12 MB: a multipart upload (3 parts) at the 5 MiB part size used below.
    return {"model": {"w": torch.randn(3 * 1024 * 1024, generator=g)}, "trainer": {"step": step}}


def main() -> None:
    from checkpoint.engine import CheckpointEngine
    from infra.storage import StorageOptions

    url, endpoint, key, secret, writer, when = sys.argv[1:7]
    options = StorageOptions(endpoint_url=endpoint, access_key=key, secret_key=secret,
                             region="us-east-1", part_size=5 << 20, max_concurrency=2)

    def die(step: int) -> None:
        if step == 20 and when == "after_shard":
            os._exit(44)

    engine = CheckpointEngine(url, writer=writer, storage_options=options, after_shard_written=die)
    engine.save(10, state(10))
    report = engine.wait()
    assert report.committed, report
    if when == "during_copy":
        big = {"model": {"w": torch.full((64 << 20,), 2.0)}, "trainer": {"step": 20}}  # 256 MB
        engine.save(20, big, overlap=True)
        if engine.copying:  # a 256 MB memcpy has barely begun when save() returns
            print("died while copying", flush=True)
        os._exit(46)
    engine.save(20, state(20))
    if when == "during_upload":
        os._exit(45)
    engine.wait()
    os._exit(3)  # not reached when the fault fires


if __name__ == "__main__":
    main()
