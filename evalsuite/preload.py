"""Precursor job: copy an exported checkpoint from storage into node-local shared memory, once.

Remote loading collapses when many trials on a node pull the same weights at
once (Acme: beyond ~8 concurrent trials on a 25 Gb/s NIC). So one precursor per
node copies the Hugging Face folder from storage (`file://`, a bare path or
`s3://`, through `infra.storage`) into `/dev/shm/forgeflow-eval-<uid>/<key>/` (or a
configured root); every trial on the node then loads it from memory. The
coordinator removes it when the node's trials are done — also after a failure:
`preloaded()` is a context manager whose `finally` deletes the copy.

Concurrent precursors on one node (two evaluations of the same checkpoint)
copy once: a file lock serialises them and a `.complete` marker, written after
the last file, tells the second one the copy is already there.

The root is private to the user running the evaluation, because whoever can write in it
could swap the model the trials load (`/dev/shm` is writable by every user): it is created
with mode 0700, and a root that is a symlink, belongs to another user or is writable by
group or others is refused (`private_root`), e.g. one another user created first at the
default path. Its name is per user but known, so that every process of the evaluation on a
node (the flow, the node session, its trials) finds the same copy; what makes it safe is
that nobody else can enter it. Object keys become paths below the copy only when they
stay there: a key that is absolute or has an empty, `.` or `..` part (`prefix//abs`,
`prefix/../x`) is refused before anything is copied.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from evalsuite.errors import PreloadError

COMPLETE_MARKER = ".complete"


def default_preload_root() -> Path:
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(os.environ.get("TMPDIR", "/tmp"))
    return base / f"forgeflow-eval-{os.getuid()}"


def private_root(root: Path) -> Path:
    """`root`, created with mode 0700 if missing; PreloadError unless only this user can write
    in it (a real directory, not a symlink, owned by this user, no group or other write)."""
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        root.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise PreloadError(f"preload root {root}: cannot create it: {e}") from e
    info = os.lstat(root)
    problem = None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory (a symlink or a file)"
    elif info.st_uid != os.getuid():
        problem = f"belongs to uid {info.st_uid}, not to this user ({os.getuid()})"
    elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = f"is writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
    if problem:
        raise PreloadError(f"preload root {root} {problem}: whoever can write there could replace the "
                           "model the trials load. Remove it, or set the suite's preload_root to a folder "
                           "only you can write")
    return root


def _local_path(dest: Path, key: str) -> Path:
    """Where object `key` goes below `dest`; PreloadError for a key that would leave it."""
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise PreloadError(f"object key {key!r} would be written outside the preload folder (it is "
                           "absolute or has an empty, '.' or '..' part); nothing was copied. Rename or "
                           "remove that object in the exported model folder")
    return dest.joinpath(*parts)


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
            try:
                targets = [(obj.key, _local_path(dest, obj.key)) for obj in objects]
            except PreloadError as e:
                raise PreloadError(f"{source_url}: {e}") from None
            total = 0
            for key, target in targets:
                total += storage.get_file(key, target)
            return total
        finally:
            storage.close()
    except StorageError as e:
        raise PreloadError(f"preload from {source_url} failed: {e}") from e


def preload(source_url: str, root: str | Path | None = None) -> Path:
    """The local copy of `source_url` under `root`, copying it if it is not there yet."""
    root = private_root(Path(root) if root else default_preload_root())
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
