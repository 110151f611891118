"""Write a file so that a reader sees the old content or all of the new, never a part.

Markers, heartbeats, caches and state files are read by other processes while they
are being rewritten (the watcher polls heartbeats; two evaluation slots share a
cache). The recipe: write a temporary file in the same folder (os.replace is atomic
only within one file system), optionally fsync it, rename it over the target, and
optionally fsync the folder so the rename itself survives a crash.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path
from typing import Any, Iterable


def atomic_write(path: str | Path, data: bytes | str, *, durable: bool = True) -> Path:
    """Replace `path` with `data` (str is written as UTF-8) in one step.

    `durable=False` skips both fsyncs: for files rewritten so often that the next
    write replaces a lost one anyway (heartbeats), where an fsync per write would
    cost more than the file is worth."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    atomic_write_chunks(path, [payload], durable=durable)
    return Path(path)


# `.NAME.PID.HEX8.tmp`: the temporary files atomic_write_chunks makes (and, killed, leaves)
_TEMP_NAME = re.compile(r"^\..+\.\d+\.[0-9a-f]{8}\.tmp$")


def is_temp_name(name: str) -> bool:
    """`name` is one atomic_write_chunks gives its temporary files: never a file a reader
    should see, and one left behind only by a killed writer (Storage.remove_stale_uploads)."""
    return bool(_TEMP_NAME.match(name))


def atomic_write_chunks(path: str | Path, chunks: Iterable[bytes | memoryview], *, durable: bool = True) -> int:
    """`atomic_write` of a sequence of buffers (e.g. a checkpoint shard's pinned host
    tensors, written without joining them first); returns the bytes written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A name of its own per writer: two processes replacing the same file never share a temp.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    size = 0
    try:
        with open(tmp, "xb") as f:  # created with the umask's permissions, like a plain write
            for chunk in chunks:
                size += f.write(memoryview(chunk).cast("B"))
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        _fsync_dir(path.parent)
    return size


def atomic_write_json(path: str | Path, payload: Any, *, durable: bool = True, **dumps: Any) -> Path:
    """`atomic_write` of `json.dumps(payload, **dumps)` plus a final newline."""
    return atomic_write(path, json.dumps(payload, **dumps) + "\n", durable=durable)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # not every platform or file system lets a folder be opened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
