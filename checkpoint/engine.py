"""Asynchronous checkpoint engine: snapshot to host memory, persist in the background.

At a checkpoint step every rank calls `CheckpointEngine.save(step, state)`. The call
copies the rank's state into reused host buffers (`checkpoint.shard.take_snapshot`)
and returns; training continues while a background writer (a child process by
default, or a thread) serialises the shard and uploads it. When every rank's shard
is persisted, rank 0 writes the step's manifest — the commit point — then the
`latest` pointer, then applies retention (see `checkpoint.manifest`).

With `save(..., overlap=True)` even the copy leaves the loop: save() lays the shard
out and returns, the persist thread copies the tensors into the host buffers while
the next step's forward and backward run, and the loop calls `wait_snapshot()`
before its next optimizer step (the only thing that changes parameters and
optimizer state), blocking only if the copy has not finished by then. The shard
holds exactly the state of the saved step; nothing is uploaded before the copy
has ended, and a copy that fails (or a rank that dies while copying) leaves the
step without a manifest, i.e. not a checkpoint.

Rules the engine keeps:
- at most one persist in flight per rank; a checkpoint step that finds the previous
  persist still running waits for it (the stall is reported) or is skipped by every
  rank together (`on_busy`);
- the writer's collectives run on their own gloo process groups with their own
  timeout, never on the training group, so a slow upload never sits inside a
  training collective;
- `load()` takes the newest step whose manifest exists and whose shards all verify
  (size + checksum, `read_verified_shard`: the one verification) on every rank; a
  corrupt or partial newest checkpoint is set aside with a warning and the previous
  one is used. A storage error while reading (unavailable, throttled, timed out after
  the storage layer's retries) says nothing about the checkpoint: every rank raises
  `CheckpointStorageUnavailable` and the step stays as it is for the next attempt;
- at open, rank 0 removes what killed writers left under the root once it is a day old
  (temporary shard files, incomplete multipart uploads: `Storage.remove_stale_uploads`);
- a process that only reads a located step (export, evaluation) calls
  `read_checkpoint(storage, step, requests)`: one manifest read, the shards it needs,
  and no engine, so no writer, host buffers or thread is started for it.

What a rank saves (the "sharded" format, checkpoint.sharded): its *global pieces*
(tensors with key, global shape and offset, each replicated piece saved by one
rank only, balanced), the job-wide *common* state (rank 0's, kept in the manifest)
and its *local* state (e.g. RNG streams: restored only on the layout that wrote
them). `load(requests=...)` assembles the pieces the loading layout needs from
whichever shards hold them, so a checkpoint loads onto any TP/PP/DP layout.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Literal

from checkpoint import legacy
from checkpoint.host_copy import host_copies_for
from checkpoint.manifest import (
    LATEST_KEY,
    CommitRecord,
    Manifest,
    ShardRecord,
    apply_retention,
    committed_steps,
    lease,
    committed_checkpoints,
    manifest_key,
    read_latest,
    read_manifest,
    set_aside,
    shard_key,
    step_dir,
    write_commit,
    write_latest,
)
from checkpoint.plain import from_plain, tensor_from_inline, tensor_to_inline, to_plain
from checkpoint.shard import HostBuffers, ShardFormatError, SnapshotCopyError, read_shard, take_snapshot
from checkpoint.sharded import GlobalPiece, PieceMismatch, PieceRequest, SavePlan, assign_savers, fill, overlaps
from checkpoint.writer import ProcessWriter, ThreadWriter, checksum_bytes, lower_thread_priority
from infra.storage import (
    ObjectNotFound,
    StorageError,
    StorageOptions,
    open_storage,
)

log = logging.getLogger(__name__)

WriterKind = Literal["process", "thread"]
# Measured by benchmarks/checkpoint_overhead.py: the child process leaves the training
# interpreter's GIL alone and slows concurrent steps less than the thread writer.
DEFAULT_WRITER: WriterKind = "process"

__all__ = [
    "CheckpointEngine", "CheckpointError", "CheckpointStorageUnavailable", "CommitRecord",
    "LoadedCheckpoint", "PersistReport", "SaveOutcome", "committed_checkpoints", "read_checkpoint",
    "read_latest",
]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used as asked (layout mismatch, no such step, bad setup)."""


class CheckpointStorageUnavailable(RuntimeError):
    """The storage failed while checkpoints were being listed or read at load time.

    Transient as far as the checkpoint is concerned: nothing was set aside, and a later
    attempt (after a backoff) loads the same step. Deliberately not a CheckpointError or
    StorageError, which readers turn into "this checkpoint does not fit / is damaged"."""


@dataclass
class SaveOutcome:
    """What `save()` cost the training loop."""

    step: int
    started: bool
    skipped: bool = False
    wait_s: float = 0.0  # blocked on the previous persist (on_busy="wait")
    snapshot_s: float = 0.0  # copying state into host buffers inside save() (0 with overlap)
    stall_s: float = 0.0  # everything save() blocked for
    bytes: int = 0
    overlap: bool = False  # the copy runs in the background (save(overlap=True))
    copy_wait_s: float = 0.0  # with overlap: what wait_snapshot() later blocked for

    @property
    def total_stall_s(self) -> float:
        """What this checkpoint cost the loop: save() plus the wait before the next update."""
        return self.stall_s + self.copy_wait_s


@dataclass
class PersistReport:
    """How a background persist ended; `committed` only once the manifest is written."""

    step: int
    committed: bool
    error: str | None = None
    bytes: int = 0
    persist_s: float = 0.0
    record: CommitRecord | None = None


@dataclass
class LoadedCheckpoint:
    step: int
    state: Any  # this rank's local state; None when another layout wrote the checkpoint
    manifest: Manifest
    skipped_steps: list[int] = field(default_factory=list)  # newer ones that failed to verify
    pieces: list[Any] = field(default_factory=list)  # one value per request, in request order
    common: Any = None

    @property
    def same_layout(self) -> bool:
        return self.state is not None


def _host_copy(storage: Any, record: ShardRecord) -> bytes | None:
    """This node's copy of the shard (checkpoint.host_copy) when it has the manifest's size and
    checksum; None otherwise (then the storage is read)."""
    copies = host_copies_for(storage)
    data = copies.read(record.key) if copies is not None else None
    if data is None or len(data) != record.size or checksum_bytes(data) != record.checksum:
        return None
    return data


def read_verified_shard(storage: Any, record: ShardRecord, step: int) -> tuple[Any, str | None]:
    """(state, None) for a shard that exists, has the manifest's size and checksum and parses;
    (None, what is wrong) otherwise. The caller holds a lease on the step. Read from this node's
    host copy when it has one that verifies, else from the storage."""
    data = _host_copy(storage, record)  # verified against the manifest, or None
    if data is not None:
        log.info("checkpoint: shard %s read from this node's host copy", record.key)
    else:
        try:
            data = storage.get_bytes(record.key)
        except ObjectNotFound:
            return None, f"shard {record.key} is missing"
        if len(data) != record.size:
            return None, f"shard {record.key} has {len(data)} bytes, manifest says {record.size}"
        checksum = checksum_bytes(data)
        if checksum != record.checksum:
            return None, f"shard {record.key} checksum {checksum} != manifest {record.checksum}"
    try:
        shard_step, state = read_shard(data)
    except ShardFormatError as e:
        return None, f"shard {record.key} unreadable: {e}"
    if shard_step != step:
        return None, f"shard {record.key} holds step {shard_step}"
    return state, None


def _pack_common(common: Any) -> Any:
    """The common state as the manifest keeps it: plain JSON, tensors inline (checkpoint.plain)."""
    return None if common is None else to_plain(common, tensor_to_inline)


def _unpack_common(manifest: Manifest) -> Any:
    if manifest.legacy_pickle:
        return legacy.read_common(manifest.common)
    return None if manifest.common is None else from_plain(manifest.common, tensor_from_inline)


# Load outcomes agreed across ranks (max wins): a step verifies, could not be read because
# the storage failed (stop; keep the step for the next attempt), fails verification (set it
# aside, fall back to the previous one), or does not fit this job at all (stop with the
# reason). A content problem found by one rank outranks another rank's storage error: the
# step is damaged whatever the storage does next.
_OK, _UNAVAILABLE, _UNVERIFIED, _MISMATCH = 0, 1, 2, 3

# A loader's check of a step before its shards are read: (manifest, its common state) -> the
# reason the step does not fit this job (e.g. a model of another shape), or None.
AcceptCheck = Callable[[Manifest, Any], "str | None"]


def _unavailable_message(storage: Any, what: str, problems: list[str]) -> str:
    # "S3 ... failed" is how the diagnosis rules (rule_seeds: s3-botocore) recognise a
    # transient object-storage failure, whose recovery is a restart after a backoff.
    where = "S3" if getattr(storage, "scheme", "") == "s3" else "checkpoint storage"
    return (f"{storage.url()}: {where} read failed while {what} ({'; '.join(problems)}). "
            "Nothing was set aside: a storage error says nothing about a checkpoint's content, "
            "and a restart after a backoff resumes from the same checkpoint once the storage "
            "answers again (every rank stops here, so no rank trains from another step).")


def _read_step(storage: Any, step: int, requests: list[PieceRequest], map_location: Any, *, rank: int,
               world_size: int, layout: dict[str, int] | None, accept: AcceptCheck | None
               ) -> tuple[LoadedCheckpoint | None, str | None, int]:
    """(loaded, problem, outcome) for one step on one rank: the manifest read once, then only
    the shards this rank needs. `layout`: the loading job's, whose rank gets its own local
    state back when the same layout wrote the step (None: a reader, never). `accept(manifest,
    common)` may refuse the step before any shard is read (its problem: the step does not fit)."""
    try:
        manifest = read_manifest(storage, step)
    except ObjectNotFound as e:
        return None, f"manifest unreadable: {e}", _UNVERIFIED
    except StorageError as e:
        return None, f"manifest of step {step}: {type(e).__name__}: {e}", _UNAVAILABLE
    except ValueError as e:
        return None, f"manifest unreadable: {e}", (
            _MISMATCH if "unsupported manifest format" in str(e) else _UNVERIFIED)
    if manifest.legacy_pickle and not legacy.trusted():
        # Not damaged, just not trusted: refused on every rank, never set aside.
        return None, legacy.refusal(f"step {step}"), _MISMATCH
    try:
        common = _unpack_common(manifest)
    except Exception as e:  # noqa: BLE001 - a damaged manifest: treat like a damaged shard
        return None, f"manifest common state unreadable: {e}", _UNVERIFIED
    refused = accept(manifest, common) if accept is not None else None
    if refused:
        return None, refused, _MISMATCH
    same_layout = layout is not None and manifest.world_size == world_size and manifest.layout == layout
    by_key: dict[str, list[PieceRequest]] = {}
    for r in requests:
        by_key.setdefault(r.key, []).append(r)
    needed: list[ShardRecord] = []
    for record in manifest.shards:
        mine = same_layout and record.rank == rank
        if mine or any(overlaps(r, d) for d in record.pieces for r in by_key.get(d["key"], ())):
            needed.append(record)
    if same_layout and not any(r.rank == rank for r in needed):
        return None, f"manifest of step {step} has no shard for rank {rank}", _UNVERIFIED
    saved: dict[str, list[GlobalPiece]] = {}
    local = None
    try:
        with lease(storage, step, holder=f"rank-{rank}"):
            for record in needed:
                state, problem = read_verified_shard(storage, record, step)
                if problem is not None:
                    return None, problem, _UNVERIFIED
                if same_layout and record.rank == rank:
                    local = state["local"]
                for p in state["pieces"]:
                    saved.setdefault(p["key"], []).append(GlobalPiece(
                        p["key"], p["global_shape"], p["global_offset"], p["data"], p["object"]))
    except StorageError as e:  # not ObjectNotFound: read_verified_shard reports a missing shard
        return None, f"{type(e).__name__}: {e}", _UNAVAILABLE
    try:
        values = [fill(r, saved.get(r.key, [])) for r in requests]
    except PieceMismatch as e:
        return None, str(e), _MISMATCH
    if str(map_location) != "cpu":
        values = [v.to(map_location) if hasattr(v, "to") else v for v in values]
    return LoadedCheckpoint(step, local, manifest, pieces=values, common=common), None, _OK


def read_checkpoint(storage: Any, step: int, requests: list[PieceRequest] | None = None, *,
                    accept: AcceptCheck | None = None, map_location: Any = "cpu") -> LoadedCheckpoint:
    """One committed step, read by one process that writes nothing but its lease: the
    reader's path (export, evaluation), with no engine, writer, host buffers or thread.

    The caller located the step (checkpoint.manifest.locate): no listing here, one manifest
    read. Requests come back in `pieces`, in order; `local` state is never restored (a
    reader is not the layout that wrote it). Raises CheckpointStorageUnavailable when the
    storage fails, CheckpointError when the step is damaged or does not fit (`accept`'s
    problem, or pieces of another shape); nothing is set aside."""
    loaded, problem, outcome = _read_step(storage, step, list(requests or []), map_location, rank=0,
                                          world_size=1, layout=None, accept=accept)
    if outcome == _OK:
        return loaded
    if outcome == _UNAVAILABLE:
        raise CheckpointStorageUnavailable(
            _unavailable_message(storage, f"reading checkpoint step {step}", [problem]))
    what = "cannot be loaded as asked" if outcome == _MISMATCH else "is damaged (failed verification)"
    raise CheckpointError(f"{storage.url(step_dir(step))}: {what}: {problem}")


class CheckpointEngine:
    def __init__(
        self,
        url: str,
        *,
        rank: int = 0,
        world_size: int = 1,
        layout: dict[str, int] | None = None,
        config_hash: str = "",
        keep_last: int = 3,
        on_busy: Literal["wait", "skip"] = "wait",
        async_save: bool = True,
        writer: WriterKind | None = None,
        storage_options: StorageOptions | None = None,
        group_timeout_s: float = 600.0,
        on_commit: Callable[[CommitRecord], None] | None = None,
        after_shard_written: Callable[[int], None] | None = None,
        preflight: bool = True,
    ):
        if on_busy not in ("wait", "skip"):
            raise CheckpointError(f"on_busy must be 'wait' or 'skip', got {on_busy!r}")
        self.url = url
        self.rank, self.world_size = rank, world_size
        self.layout = dict(layout or {"dp": world_size, "tp": 1, "pp": 1})
        self.config_hash = config_hash
        self.keep_last, self.on_busy, self.async_save = keep_last, on_busy, async_save
        self.on_commit = on_commit
        # Fault-injection hook (tests): runs in the persist thread once this rank's shard is
        # persisted and before the commit, i.e. while the checkpoint is still uncommitted.
        self.after_shard_written = after_shard_written
        self.options = storage_options or StorageOptions()
        self.storage = open_storage(url, self.options)
        if preflight:
            # Wrong credentials, a missing bucket or an unwritable directory fail here, once,
            # before the first training step instead of at the first checkpoint.
            self.storage.check_writable()
        if rank == 0:
            self._remove_stale_uploads()
        self.host_copies = host_copies_for(self.storage)  # this node's copies of shards (None: off)
        if self.host_copies is not None:
            self.host_copies.remove_stale()
        self.writer_kind: WriterKind = writer or DEFAULT_WRITER
        if self.writer_kind not in ("process", "thread"):
            raise CheckpointError(f"writer must be 'process' or 'thread', got {self.writer_kind!r}")
        self._writer = (ProcessWriter(url, self.options) if self.writer_kind == "process"
                        else ThreadWriter(url, self.options))
        self._buffers = HostBuffers(shared=self.writer_kind == "process")
        self._commit_group = self._control_group = None
        if world_size > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise CheckpointError("world_size > 1 needs torch.distributed initialised before "
                                      "the checkpoint engine is created")
            timeout = timedelta(seconds=group_timeout_s)
            # Created collectively by every rank, in this order. Commit: the writer's gathers
            # (background thread). Control: the skip agreement and load-time agreement (caller).
            self._commit_group = dist.new_group(backend="gloo", timeout=timeout)
            self._control_group = dist.new_group(backend="gloo", timeout=timeout)
        self._inflight: threading.Thread | None = None
        self._inflight_step: int | None = None
        self._copying: tuple[Any, SaveOutcome] | None = None  # (snapshot, outcome) with overlap
        self._loaded_step: int | None = None
        self._lock = threading.Lock()
        self.reports: list[PersistReport] = []
        self.outcomes: list[SaveOutcome] = []

    def _remove_stale_uploads(self) -> None:
        # What a killed writer left (temporary shard files, incomplete multipart uploads whose
        # parts the store keeps and bills) is collected by the next engine on this root.
        try:
            removed = self.storage.remove_stale_uploads()
        except StorageError as e:  # housekeeping: never stops a job
            log.warning("checkpoint: could not look for uploads left by killed writers: %s", e)
            return
        if removed:
            log.info("checkpoint: removed %d upload(s) left by killed writers under %s: %s",
                     len(removed), self.storage.url(), ", ".join(removed[:5]))

    # ----------------------------------------------------------------- saving

    @property
    def busy(self) -> bool:
        return self._inflight is not None and self._inflight.is_alive()

    def save(self, step: int, state: Any, *, pieces: list[GlobalPiece] | None = None,
             common: Any = None, blocking: bool | None = None, overlap: bool = False) -> SaveOutcome:
        """Snapshot `step` and persist it (in the background unless blocking).

        `state`: this rank's local state; `pieces`: its global pieces (every rank passes
        all it holds; replicas are saved once, see checkpoint.sharded); `common`: state
        every rank shares, taken from rank 0. Every rank calls this together.
        `overlap` (async saves only): copy the tensors in the background too; the caller
        must call `wait_snapshot()` before it next changes any of them in place. Plain
        objects and `common` are serialised here, so they may change right away.
        """
        start = time.perf_counter()
        busy = self.busy
        if self.on_busy == "skip" and self.world_size > 1:
            busy = self._any_rank(busy)  # all ranks skip together or none does
        wait_s = 0.0
        if busy and self.on_busy == "skip":
            log.warning("checkpoint: step %d skipped: the persist of step %s is still running",
                        step, self._inflight_step)
            outcome = SaveOutcome(step, started=False, skipped=True,
                                  stall_s=time.perf_counter() - start)
            self.reports.append(PersistReport(step, committed=False, error="skipped: previous persist busy"))
            self.outcomes.append(outcome)
            return outcome
        if self._inflight is not None:
            self._inflight.join()  # reused buffers: the previous persist must be done reading them
            wait_s = time.perf_counter() - start
            if busy:
                log.warning("checkpoint: step %d waited %.2fs for the persist of step %s "
                            "(raise checkpoint.interval or set on_busy: skip)",
                            step, wait_s, self._inflight_step)
        pieces = list(pieces or [])
        plan = self._save_plan(pieces)
        saved = [pieces[i] for i in plan.mine]
        shard_state = {"local": state, "pieces": [
            {"key": p.key, "global_shape": tuple(p.global_shape), "global_offset": tuple(p.global_offset),
             "data": p.data, "object": p.is_object} for p in saved]}
        blocking = (not self.async_save) if blocking is None else blocking
        overlap = overlap and not blocking
        snapshot = take_snapshot(step, shard_state, self._buffers, defer_copy=overlap)
        snapshot.extra["pieces"] = [p.descriptor() for p in saved]
        snapshot.extra["common"] = _pack_common(common) if self.rank == 0 else None
        outcome = SaveOutcome(step, started=True, wait_s=wait_s, overlap=overlap,
                              bytes=snapshot.nbytes)
        if blocking:
            self._persist(snapshot)
        else:
            self._inflight_step = step
            self._copying = (snapshot, outcome) if overlap else None
            self._inflight = threading.Thread(target=self._persist_in_background, args=(snapshot,),
                                              name=f"ckpt-persist-{step}", daemon=True)
            self._inflight.start()
        outcome.snapshot_s = 0.0 if overlap else snapshot.copy_s
        outcome.stall_s = time.perf_counter() - start
        self.outcomes.append(outcome)
        return outcome

    @property
    def copying(self) -> bool:
        """An overlapped host copy is still running (wait_snapshot() would block)."""
        return self._copying is not None and not self._copying[0].copied

    def wait_snapshot(self) -> float:
        """Block until the overlapped host copy of the last save (if any) has ended; seconds.

        The training loop calls this right before its optimizer step (and before anything
        else that changes parameters or optimizer state in place); it returns at once when
        the copy finished during the forward and backward. What it blocked for is added
        to that save's `SaveOutcome.copy_wait_s`."""
        if self._copying is None:
            return 0.0
        snapshot, outcome = self._copying
        self._copying = None
        waited = snapshot.wait_copied()
        outcome.copy_wait_s += waited
        return waited

    def _save_plan(self, pieces: list[GlobalPiece]) -> SavePlan:
        """Which pieces this rank saves; gathered once per layout (the pieces do not change)."""
        mine = [(p.identity(), p.nbytes()) for p in pieces]
        signature = hash(tuple(mine))
        if self.world_size == 1:
            return SavePlan(list(range(len(pieces))), [sum(n for _, n in mine)])
        changed = self._any_rank(signature != getattr(self, "_plan_signature", None))
        if changed:
            import torch.distributed as dist

            everyone: list[Any] = [None] * self.world_size
            dist.all_gather_object(everyone, mine, group=self._control_group)
            self._plan = assign_savers(everyone, self.rank)
            self._plan_signature = signature
        return self._plan

    def wait(self) -> PersistReport | None:
        """Block until the in-flight persist (if any) has ended; its report."""
        if self._inflight is not None:
            self._inflight.join()
        return self.reports[-1] if self.reports else None

    def _persist_in_background(self, snapshot: Any) -> None:
        try:
            snapshot.copy()  # overlap: at the trainer's priority, since the next update waits for it
        except SnapshotCopyError:
            pass  # _persist reports it: the step is not committed
        lower_thread_priority()  # the upload (and the thread writer's part threads) yield to training
        self._persist(snapshot)

    def _persist(self, snapshot: Any) -> None:
        step = snapshot.step
        start = time.perf_counter()
        mine: dict[str, Any] = {"rank": self.rank}
        try:
            snapshot.copy()  # a failed or unfinished copy raises: nothing half-copied is written
            written = self._writer.write(snapshot, shard_key(step, self.rank, self.world_size))
            mine.update(ok=True, key=written.key, size=written.size, checksum=written.checksum,
                        pieces=snapshot.extra["pieces"], common=snapshot.extra["common"])
            if self.after_shard_written is not None:
                self.after_shard_written(step)
        except Exception as e:  # noqa: BLE001 - reported; the step is simply not committed
            mine.update(ok=False, error=f"{type(e).__name__}: {e}")
        report = PersistReport(step, committed=False, bytes=snapshot.nbytes)
        try:
            results = self._gather(mine)
            failed = [r for r in results if not r.get("ok")]
            record = None
            if failed:
                report.error = "; ".join(f"rank {r['rank']}: {r['error']}" for r in failed)
            elif self.rank == 0:
                manifest = Manifest(
                    step=step, world_size=self.world_size, layout=self.layout,
                    shards=[ShardRecord(r["rank"], r["key"], r["size"], r["checksum"], r["pieces"])
                            for r in sorted(results, key=lambda r: r["rank"])],
                    config_hash=self.config_hash, time=time.time(), common=mine["common"])
                try:
                    record = write_commit(self.storage, manifest)
                except Exception as e:  # noqa: BLE001
                    report.error = f"rank 0: manifest not written: {type(e).__name__}: {e}"
            committed = self._from_rank0(report.error is None)
            if report.error is None and not committed:
                report.error = "rank 0 could not write the manifest"
            report.committed = committed
            report.record = record
            if committed and self.rank == 0:
                self._after_commit(record)
        except Exception as e:  # noqa: BLE001 - e.g. a peer died and the gloo group timed out
            report.error = f"commit coordination failed: {type(e).__name__}: {e}"
        report.persist_s = time.perf_counter() - start
        if report.error:
            log.error("checkpoint: step %d NOT committed (abandoned; the previous checkpoint stays "
                      "current): %s", step, report.error)
        else:
            log.info("checkpoint: step %d committed (%.1f MB in %.2fs)", step, report.bytes / 1e6,
                     report.persist_s)
        with self._lock:
            self.reports.append(report)

    def _after_commit(self, record: CommitRecord | None) -> None:
        try:
            # Readers (a resume in progress, an evaluation) hold leases that retention honours.
            apply_retention(self.storage, self.keep_last)
        except Exception as e:  # noqa: BLE001 - retention is housekeeping; never fail a commit
            log.warning("checkpoint: retention failed (will retry after the next commit): %s", e)
        if self.on_commit is not None and record is not None:
            try:
                self.on_commit(record)
            except Exception as e:  # noqa: BLE001
                log.warning("checkpoint: on_commit callback failed: %s", e)

    # ----------------------------------------------------------------- collectives

    def _gather(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._commit_group)
        return out

    def _from_rank0(self, value: bool) -> bool:
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._commit_group)
        return bool(box[0])

    def _reduce_flag(self, flag: bool, op_name: str) -> bool:
        import torch
        import torch.distributed as dist

        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op_name), group=self._control_group)
        return bool(t.item())

    def _reduce_int(self, value: int, op_name: str) -> int:
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int32)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op_name), group=self._control_group)
        return int(t.item())

    def _gather_control(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, on the control group (the caller's thread, never the writer's)."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._control_group)
        return out

    def _any_rank(self, flag: bool) -> bool:
        return self._reduce_flag(flag, "MAX")

    def _broadcast(self, value: Any) -> Any:
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._control_group)
        return box[0]

    # ----------------------------------------------------------------- loading

    def committed_steps(self) -> list[int]:
        """Committed steps as rank 0 lists them (collective: every rank gets the same list).

        A listing that fails raises CheckpointStorageUnavailable on every rank (a failure on
        rank 0 alone would leave the others waiting in the broadcast)."""
        listed: Any = None
        if self.rank == 0:
            try:
                listed = committed_steps(self.storage)
            except StorageError as e:
                listed = f"rank 0: {type(e).__name__}: {e}"
        listed = self._broadcast(listed)
        if isinstance(listed, str):
            raise CheckpointStorageUnavailable(
                _unavailable_message(self.storage, "listing the committed checkpoints", [listed]))
        return listed

    def committed(self) -> list[CommitRecord]:
        return committed_checkpoints(self.storage)

    def latest(self) -> CommitRecord | None:
        return read_latest(self.storage)

    def load(self, step: int | None = None, map_location: Any = "cpu", *,
             requests: list[PieceRequest] | None = None, accept: AcceptCheck | None = None
             ) -> LoadedCheckpoint | None:
        """The newest (or the given) committed step that verifies on every rank; None if none.

        `requests`: the global pieces this rank needs (any layout); they come back in
        `LoadedCheckpoint.pieces`, in order. Every rank must call this together. A step
        that fails verification anywhere is skipped by all ranks (they always resume from
        the same step) and set aside by rank 0 so the next start does not try it again;
        a step that does not hold what the job needs raises CheckpointError on every rank;
        a step some rank could not read because the storage failed (not its content)
        raises CheckpointStorageUnavailable on every rank and is left as it is.
        `accept(manifest, common)` is the job's own check before any shard is read: its
        problem raises CheckpointError on every rank, naming it. A process that only reads
        (export) uses `read_checkpoint` instead: no engine, no writer.
        """
        if self.busy:
            self.wait()
        requests = list(requests or [])
        steps = self.committed_steps()
        if step is not None:
            if step not in steps:
                raise CheckpointError(f"{self.url}: step {step} is not a committed checkpoint "
                                      f"(committed: {steps or 'none'})")
            steps = [step]
        skipped: list[int] = []
        for candidate in reversed(steps):
            loaded, problem, outcome = _read_step(self.storage, candidate, requests, map_location,
                                                  rank=self.rank, world_size=self.world_size,
                                                  layout=self.layout, accept=accept)
            agreed = outcome if self.world_size == 1 else self._reduce_int(outcome, "MAX")
            if agreed == _OK:
                self._loaded_step = candidate
                if skipped and self.rank == 0:
                    self._repoint_latest(loaded.manifest)
                loaded.skipped_steps = skipped
                return loaded
            if agreed == _MISMATCH:
                raise CheckpointError(
                    f"{self.storage.url(step_dir(candidate))}: cannot be loaded by this job: "
                    f"{problem if outcome == _MISMATCH else 'see the error on another rank'}")
            if agreed == _UNAVAILABLE:
                mine = f"rank {self.rank}: {problem}" if outcome == _UNAVAILABLE else None
                failed = [p for p in self._gather_control(mine) if p is not None]
                raise CheckpointStorageUnavailable(
                    _unavailable_message(self.storage, f"reading checkpoint step {candidate}", failed))
            if outcome != _UNVERIFIED:  # this rank read it (or hit a storage error): not its finding
                problem = None
            log.warning("checkpoint: step %d failed verification (%s); falling back to the previous "
                        "committed checkpoint", candidate, problem or "on another rank")
            skipped.append(candidate)
            if self.rank == 0:
                self._set_aside(candidate, problem or "failed verification on another rank")
        return None

    def _set_aside(self, step: int, reason: str) -> None:
        # The step stops being a checkpoint (checkpoint.manifest.set_aside: a note saying why,
        # then the manifest goes); its shards become orphans for retention.
        try:
            set_aside(self.storage, step, reason)
        except StorageError as e:
            log.warning("checkpoint: could not set aside step %d: %s", step, e)

    def _repoint_latest(self, manifest: Manifest | None) -> None:
        if manifest is None:
            return
        try:
            if not self.storage.exists(manifest_key(manifest.step)):
                return
            write_latest(self.storage, manifest)  # the pointer only: the manifest is there already
        except StorageError as e:
            log.warning("checkpoint: could not repoint %s: %s", LATEST_KEY, e)

    # ----------------------------------------------------------------- teardown

    def close(self) -> None:
        """Finish the in-flight persist, stop the writer and free the host buffers."""
        if self._inflight is not None:
            self._inflight.join()
            self._inflight = None
        self._copying = None
        self._writer.close()
        self._buffers.close()
        self.storage.close()
        if self._commit_group is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                for group in (self._commit_group, self._control_group):
                    try:
                        dist.destroy_process_group(group)
                    except Exception:  # noqa: BLE001 - teardown is best effort
                        pass
            self._commit_group = self._control_group = None

    def forget_host_copies(self) -> None:
        """Remove this rank's host copies (checkpoint.host_copy): the job finished, no restart
        will read them."""
        if self.host_copies is not None:
            self.host_copies.remove_rank(self.rank, self.world_size)

    def __enter__(self) -> "CheckpointEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
