"""Background shard writers: serialise a host snapshot and upload it.

Two implementations behind one `write(snapshot, key) -> ShardWritten`:

- `ThreadWriter` runs in the engine's background thread of the training process.
  Checksumming (zlib) and socket/file I/O release the GIL, but botocore/aiohttp
  request handling is Python and competes with the training loop for the GIL.
- `ProcessWriter` hands the snapshot to a long-lived child process
  (`python -m checkpoint.writer`) through shared memory: only a few hundred
  bytes of description cross the pipe, the child maps the same pages and uploads
  them, and the training process's interpreter is left alone. The child ends when
  its rank is gone (it watches its parent pid), so a killed rank never leaves an
  uploader behind; it runs in a session of its own and ignores SIGTERM/SIGINT, so
  the signals that tell its rank to stop (torchrun's to the rank's process group,
  the reaper's to every descendant) do not kill it before the rank's last
  checkpoint is written: it ends when the rank closes its pipe.

Both run below the trainer's CPU priority (`WRITER_NICENESS`, `lower_thread_priority`):
on a node whose cores are busy the upload yields to training, which is what the
background persist is for. benchmarks/checkpoint_overhead.py measures both; the
engine defaults to the one that slows training less (the process writer on this
machine).
"""

from __future__ import annotations

import base64
import json
import mmap
import os
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from checkpoint.host_copy import host_copies_for
from infra import storage as storage_mod
from infra.storage import Storage, StorageError, StorageOptions, open_storage


# How far below the trainer the writer runs (Linux nice levels: each step is about 1.25x
# less CPU share under contention). A persist only has to end before the next checkpoint,
# so an upload that yields costs nothing, while a step it slows costs every rank.
WRITER_NICENESS = 10


def lower_thread_priority(niceness: int = WRITER_NICENESS) -> None:
    """Lower the calling thread's CPU priority (and that of threads it starts later).

    On Linux the nice value is per thread, so the training threads keep theirs. Only
    for background threads and the writer process: it cannot be raised again."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(
            19, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + niceness))
    except (OSError, AttributeError):
        pass  # not permitted or not Linux: the writer just keeps the default priority


@dataclass(frozen=True)
class ShardWritten:
    key: str
    size: int
    checksum: str
    seconds: float


def crc32_of(chunks: Sequence[memoryview | bytes]) -> str:
    crc = 0
    for chunk in chunks:
        crc = zlib.crc32(chunk, crc)  # releases the GIL on large buffers
    return f"crc32:{crc:08x}"


def checksum_bytes(data: bytes | memoryview) -> str:
    return crc32_of([data])


def write_chunks(storage: Storage, key: str, chunks: Sequence[memoryview | bytes]) -> ShardWritten:
    """Write one shard; for object storage, keep a copy in this node's host memory too
    (checkpoint.host_copy: a restart here reads it instead of downloading it)."""
    start = time.perf_counter()
    checksum = crc32_of(chunks)
    size = storage.put_chunks(key, chunks)
    copies = host_copies_for(storage)
    if copies is not None:
        copies.keep(key, chunks, size)
    return ShardWritten(key, size, checksum, time.perf_counter() - start)


class ThreadWriter:
    kind = "thread"

    def __init__(self, url: str, options: StorageOptions):
        self.storage = open_storage(url, options)

    def write(self, snapshot: Any, key: str) -> ShardWritten:
        return write_chunks(self.storage, key, snapshot.chunks())

    def close(self) -> None:
        self.storage.close()


def _error_from_reply(reply: dict[str, Any]) -> StorageError:
    cls = getattr(storage_mod, reply.get("error_type", ""), None)
    if not (isinstance(cls, type) and issubclass(cls, StorageError)):
        cls = StorageError
    return cls(reply.get("message", "writer process failed"), reply.get("url", ""))


class ProcessWriter:
    kind = "process"

    def __init__(self, url: str, options: StorageOptions):
        self._url, self._options = url, options
        self._lock = threading.Lock()
        self._start()

    def _start(self) -> None:
        env = dict(os.environ)
        # One core is the writer's; stop BLAS/OpenMP pools from spreading onto the trainer's.
        env.setdefault("OMP_NUM_THREADS", "1")
        repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = repo_root + os.pathsep + env.get("PYTHONPATH", "")
        env[PARENT_ENV] = str(os.getpid())
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "checkpoint.writer"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env, text=True, bufsize=1, start_new_session=True)
        self._send({"url": self._url, "options": self._options.to_dict()})
        reply = self._recv()
        if not reply.get("ok"):
            self.close()
            raise _error_from_reply(reply)

    def _send(self, message: dict[str, Any]) -> None:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps(message) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            raise StorageError(f"checkpoint writer process exited (code {self._proc.poll()})") from None

    def _recv(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()  # blocks without the GIL
        if not line:
            raise StorageError(f"checkpoint writer process exited (code {self._proc.wait()})")
        return json.loads(line)

    def write(self, snapshot: Any, key: str) -> ShardWritten:
        pieces = []
        for piece in snapshot.pieces():
            if "inline" in piece:
                pieces.append({"inline": base64.b64encode(piece["inline"]).decode()})
            else:
                pieces.append(piece)
        with self._lock:
            if self._proc.poll() is not None:
                # The child died (e.g. killed for memory) during an earlier persist, which was
                # reported then; start a fresh one rather than failing every later checkpoint.
                self._start()
            self._send({"key": key, "pieces": pieces})
            reply = self._recv()
        if not reply.get("ok"):
            raise _error_from_reply(reply)
        return ShardWritten(reply["key"], reply["size"], reply["checksum"], reply["seconds"])

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.close()  # EOF: the child finishes and exits
                self._proc.wait(timeout=30)
            except Exception:  # noqa: BLE001
                self._proc.kill()
                self._proc.wait()


# ---------------------------------------------------------------- the child process


PARENT_ENV = "FORGEFLOW_CHECKPOINT_WRITER_PARENT"
PARENT_WATCH_S = 0.2


def _end_with_parent() -> None:
    """Exit as soon as the rank that started this writer is gone, and only then.

    Not PR_SET_PDEATHSIG: the kernel sends that when the *thread* that started the child exits,
    and a writer restarted from a persist thread (ProcessWriter.write) was killed as soon as that
    thread ended, so the next checkpoint failed with "writer process exited (code -9)" (seen
    when a stop's SIGTERM had killed the first writer). SIGTERM and SIGINT are ignored: they
    are for the rank, which finishes its checkpoint through this writer and then closes the
    pipe (EOF ends the loop in _serve)."""
    import signal

    parent = int(os.environ.get(PARENT_ENV) or os.getppid())
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_WATCH_S)
        os._exit(0)

    if os.getppid() != parent:
        os._exit(0)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class _SharedMaps:
    """Read-only maps of the parent's shared-memory buffers, reused across checkpoints."""

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}

    def view(self, name: str, nbytes: int) -> memoryview:
        m = self._maps.get(name)
        if m is None:
            fd = os.open(f"/dev/shm/{name.lstrip('/')}", os.O_RDONLY)
            try:
                m = self._maps[name] = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)
        return memoryview(m)[:nbytes]

    def keep_only(self, names: set[str]) -> None:
        for name in list(self._maps):
            if name not in names:
                try:
                    self._maps.pop(name).close()
                except BufferError:
                    pass


def _serve() -> int:
    _end_with_parent()
    lower_thread_priority()  # before any upload thread starts: they inherit it
    # The pipe to the parent is for replies only: move it aside so stray prints from
    # libraries land on stderr instead of corrupting the protocol.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    storage: Storage | None = None
    maps = _SharedMaps()

    def reply(message: dict[str, Any]) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    for line in sys.stdin:
        message = json.loads(line)
        try:
            if storage is None:
                storage = open_storage(message["url"], StorageOptions(**message["options"]))
                reply({"ok": True})
                continue
            chunks: list[memoryview | bytes] = []
            names = set()
            for piece in message["pieces"]:
                if "inline" in piece:
                    chunks.append(base64.b64decode(piece["inline"]))
                else:
                    names.add(piece["shm"])
                    chunks.append(maps.view(piece["shm"], piece["nbytes"]))
            maps.keep_only(names)
            written = write_chunks(storage, message["key"], chunks)
            del chunks
            reply({"ok": True, **asdict(written)})
        except Exception as e:  # noqa: BLE001 - reported to the parent, which decides
            reply({"ok": False, "error_type": type(e).__name__, "message": str(e),
                   "url": getattr(e, "url", "")})
    if storage is not None:
        storage.close()
    return 0


if __name__ == "__main__":
    sys.exit(_serve())
