"""Precursor job: copy an exported checkpoint from storage into node-local shared memory, once.

Remote loading collapses when many trials on a node pull the same weights at
once (Acme: beyond ~8 concurrent trials on a 25 Gb/s NIC). So one precursor per
node copies the Hugging Face folder from storage (`file://`, a bare path or
`s3://`, through `infra.storage`) into `/dev/shm/forgeflow-eval/<key>/` (or a
configured root); every trial on the node then loads it from memory. The
coordinator removes it when the node's trials are done — also after a failure:
`preloaded()` is a context manager whose `finally` deletes the copy.

Concurrent precursors on one node (two evaluations of the same checkpoint)
copy once: a file lock serialises them and a `.complete` marker, written after
the last file, tells the second one the copy is already there.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from evalsuite.errors import PreloadError

COMPLETE_MARKER = ".complete"


def default_preload_root() -> Path:
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(os.environ.get("TMPDIR", "/tmp"))
    return base / "forgeflow-eval"


def preload_key(source_url: str) -> str:
    return hashlib.sha256(source_url.rstrip("/").encode()).hexdigest()[:16]


def copy_from_storage(source_url: str, dest: Path) -> int:
    """Copy every object under `source_url` into `dest`; returns bytes copied."""
    from infra.storage import StorageError, open_storage

    try:
        storage = open_storage(source_url)
        try:
            objects = storage.list("")
            if not objects:
                raise PreloadError(f"{source_url}: no files there; is it an exported model folder?")
            total = 0
            for obj in objects:
                total += storage.get_file(obj.key, dest / obj.key)
            return total
        finally:
            storage.close()
    except StorageError as e:
        raise PreloadError(f"preload from {source_url} failed: {e}") from e


def preload(source_url: str, root: str | Path | None = None) -> Path:
    """The local copy of `source_url` under `root`, copying it if it is not there yet."""
    root = Path(root) if root else default_preload_root()
    root.mkdir(parents=True, exist_ok=True)
    dest = root / preload_key(source_url)
    with open(root / f"{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (dest / COMPLETE_MARKER).is_file():
            return dest
        partial = root / f"{dest.name}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        shutil.rmtree(dest, ignore_errors=True)  # an incomplete copy from a crashed precursor
        try:
            copied = copy_from_storage(source_url, partial)
            (partial / COMPLETE_MARKER).write_text(f"{copied} bytes from {source_url} at {time.time():.0f}\n")
            os.replace(partial, dest)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    return dest


def remove_preload(source_url: str, root: str | Path | None = None) -> None:
    root = Path(root) if root else default_preload_root()
    dest = root / preload_key(source_url)
    shutil.rmtree(dest, ignore_errors=True)
    (root / f"{dest.name}.lock").unlink(missing_ok=True)


@contextmanager
def preloaded(source_url: str, root: str | Path | None = None) -> Iterator[Path]:
    """Preload for the duration of a node's trials; removed afterwards, whatever happened."""
    try:
        yield preload(source_url, root)
    finally:
        remove_preload(source_url, root)
