"""A node's copy of its ranks' newest checkpoint shards in host memory, read before the storage.

A restart on the same nodes (infra.standby: most restarts) loads the checkpoint its own ranks
wrote minutes ago. From S3 that is a download of every shard; the node still has the bytes. So
when a shard is written to object storage (`checkpoint.writer.write_chunks`, both writers), the
writer also keeps the same bytes in a host-memory directory (tmpfs, `/dev/shm` by default), and
`checkpoint.engine` reads a shard from there when the copy has the manifest's size and
checksum, from the storage otherwise. A copy only ever stands in for a shard of a *committed*
step whose manifest vouches for it (size and crc32): a stale, partial or foreign file fails
that check and the storage is read, so the host copy can make a load faster, never different.

What it keeps: the newest `KEEP_STEPS` steps of each rank's shard (the newest may not commit),
only while the directory's file system keeps twice the shard's size free after it (a host
copy never takes the memory training needs); each rank removes its own copies when the job
finishes, and anything a copy directory holds that is a day old is removed when an engine opens
on the node (a job stopped and never resumed).

Off for a storage that is a local directory (the checkpoint is on this host already) and with
FORGEFLOW_HOST_CHECKPOINT_DIR=off; that variable also moves the directory (a node-local NVMe).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Sequence

ROOT_ENV = "FORGEFLOW_HOST_CHECKPOINT_DIR"
DEFAULT_ROOT = Path("/dev/shm/forgeflow-checkpoints")
KEEP_STEPS = 2
FREE_AFTER = 2.0  # the file system keeps this many times the shard's size free after a copy
STALE_S = 24 * 3600.0

log = logging.getLogger(__name__)

_SHARD = re.compile(r"^(step-\d+)/(rank-\d+-of-\d+\.bin)$")


def host_copies_for(storage) -> "HostCopies | None":
    """The host copies of `storage`'s shards on this node, or None where they are off."""
    if getattr(storage, "scheme", "") != "s3":
        return None
    setting = os.environ.get(ROOT_ENV, "").strip()
    if setting.lower() == "off":
        return None
    root = Path(setting) if setting else DEFAULT_ROOT
    if not setting and not root.parent.is_dir():  # no /dev/shm: no default place
        return None
    return HostCopies(root / hashlib.sha256(storage.url().encode()).hexdigest()[:16])


class HostCopies:
    """Shard copies of one checkpoint root, under `directory`, named as their storage keys."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)

    def _path(self, key: str) -> Path | None:
        return self.directory / key if _SHARD.match(key) else None

    def keep(self, key: str, chunks: Sequence[memoryview | bytes], size: int) -> bool:
        """Keep a copy of the shard `key` just written; False when there is no room (or no place)."""
        path = self._path(key)
        if path is None:
            return False
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if shutil.disk_usage(path.parent).free < size * (1 + FREE_AFTER):
                return False
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
            os.replace(tmp, path)  # a reader sees the whole copy or none
        except OSError as e:
            log.warning("checkpoint: no host copy of %s (%s); loads read the storage", key, e)
            return False
        self._prune(path.name)
        return True

    def _prune(self, name: str) -> None:
        """Only the newest KEEP_STEPS copies of this rank's shard stay."""
        for old in sorted(self.directory.glob(f"step-*/{name}"))[:-KEEP_STEPS]:
            old.unlink(missing_ok=True)
            try:
                old.parent.rmdir()
            except OSError:
                pass  # another rank's copy of that step is still there

    def read(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            return path.read_bytes() if path is not None else None
        except OSError:
            return None

    def remove_rank(self, rank: int, world_size: int) -> None:
        """A finished job's copies of this rank's shards (each rank removes its own)."""
        for path in self.directory.glob(f"step-*/rank-{rank}-of-{world_size}.bin"):
            path.unlink(missing_ok=True)
            try:
                path.parent.rmdir()
            except OSError:
                pass
        try:
            self.directory.rmdir()
        except OSError:
            pass

    def remove_stale(self, older_than_s: float = STALE_S) -> None:
        """Copies (and half-written ones) a day old on this node, of any checkpoint root: a job
        stopped and never resumed here."""
        cutoff = time.time() - older_than_s
        for path in list(self.directory.parent.glob("*/step-*/*")):
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    path.parent.rmdir()
            except OSError:
                pass
