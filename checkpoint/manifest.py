"""The commit protocol's objects: shard keys, manifests, the `latest` pointer, retention.

Layout under a checkpoint root URL:

    step-00000040/rank-0-of-2.bin     shards, written first by each rank (checkpoint.shard)
    step-00000040/rank-1-of-2.bin
    step-00000040/manifest.json       written LAST, as one object, by rank 0 after every
                                      rank reported its shard persisted: the commit point.
                                      It indexes every shard's global pieces (key, global
                                      shape, offset: checkpoint.sharded), so a loader on any
                                      layout knows which shards to read
    step-00000040/lease-<id>.json     a reader's claim: retention leaves the step alone
    step-00000040/set-aside.json      a note that the step no longer counts (damaged, or on a
                                      timeline a spike rollback abandoned) and why
    latest.json                       pointer to the newest commit, written after its manifest

A checkpoint exists only once its manifest does and while no set-aside note does.
`committed_checkpoints` is THE listing: the pretrain flow, the commit announcer,
evaluation and rollback all use it; `read_latest` is its one-read shortcut for the newest.

A committed checkpoint travels between processes as a `CheckpointRef` (root URL, step,
format; `to_dict`/`from_dict` for event payloads and flow parameters). `locate` turns what a
person types (a step folder, or a root: its newest commit) into one, with one listing and
no manifest read; the reader then reads that step's manifest once.

Setting a step aside (`set_aside`, `set_aside_after`) writes the note first, then deletes
the manifest; shards are never deleted there (retention collects them later as orphans),
so nothing a writer could still be writing goes. The note is what counts: it is written
durably (an fsynced rename on a local disk, one PUT on S3), while a local unlink is not
fsynced, so a manifest whose deletion a crash undid still does not count. Whoever
commits the step again (`write_commit`) removes the note before the new manifest lands.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

from checkpoint.legacy import LEGACY_MANIFEST_FORMAT
from infra.storage import ObjectNotFound, Storage, StorageOptions, open_storage

log = logging.getLogger(__name__)

# "sharded" (spec: checkpoint.format) on storage. Format 1 (per-rank state dicts, loadable only
# on the layout that wrote it) was retired with the reshardable format; its manifests are
# refused with a message saying so. Format 2 is format 3 with pickles (shard skeletons, the
# common state): listed like any commit, its pickles read only with checkpoint.legacy's opt-in.
MANIFEST_FORMAT = "forgeflow-checkpoint/3"
FORMAT_NAMES = {"sharded": MANIFEST_FORMAT}
MANIFEST_NAME = "manifest.json"
SET_ASIDE_NAME = "set-aside.json"
LATEST_KEY = "latest.json"
_STEP_DIR = re.compile(r"^step-(\d{8,})/")
LEASE_TTL_S = 3600.0


def step_dir(step: int) -> str:
    """The one step-folder spelling: step-00000040."""
    return f"step-{step:08d}"


def parse_step_dir(name: str) -> int | None:
    """The step a folder name like step-00000040 names; None for any other name."""
    m = _STEP_DIR.match(name.rstrip("/") + "/")
    return int(m.group(1)) if m else None


def shard_key(step: int, rank: int, world_size: int) -> str:
    return f"{step_dir(step)}/rank-{rank}-of-{world_size}.bin"


def manifest_key(step: int) -> str:
    return f"{step_dir(step)}/{MANIFEST_NAME}"


def set_aside_key(step: int) -> str:
    return f"{step_dir(step)}/{SET_ASIDE_NAME}"


def _counts_as_committed(step: int, keys: list[str]) -> bool:
    """The commit rule, for one step's keys from a listing: a manifest and no set-aside note."""
    return manifest_key(step) in keys and set_aside_key(step) not in keys


@dataclass(frozen=True)
class ShardRecord:
    rank: int
    key: str
    size: int
    checksum: str  # "crc32:<8 hex digits>"
    pieces: list[dict[str, Any]] = field(default_factory=list)  # GlobalPiece.descriptor()s


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    layout: dict[str, int]  # dp / tp / pp degrees
    shards: list[ShardRecord]
    config_hash: str = ""
    time: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    # the state every rank shares (from rank 0), as checkpoint.plain's JSON value with inline
    # tensors; in a format-2 manifest, base64 of a torch pickle (checkpoint.legacy)
    common: Any = None
    format: str = MANIFEST_FORMAT

    @property
    def legacy_pickle(self) -> bool:
        """Written in format 2: its common state and shards are pickles (checkpoint.legacy)."""
        return self.format == LEGACY_MANIFEST_FORMAT

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Manifest":
        raw = json.loads(data)
        if raw.get("format") not in (MANIFEST_FORMAT, LEGACY_MANIFEST_FORMAT):
            old = raw.get("format") == "forgeflow-checkpoint/1"
            raise ValueError(
                f"unsupported manifest format {raw.get('format')!r}"
                + ("; format 1 (per-rank, not reshardable) was retired: resume it with a forgeflow "
                   "older than the sharded format or start the job afresh" if old else ""))
        raw["shards"] = [ShardRecord(**s) for s in raw["shards"]]
        return cls(**raw)


@dataclass(frozen=True)
class CheckpointRef:
    """One committed checkpoint, as it travels: the root URL its job writes checkpoints
    under, its step, and its on-storage format (a key of FORMAT_NAMES: "sharded").

    What the commit announcer emits, the evaluation flow receives, export takes and the
    reader opens. A local root is an absolute path (a relative one means nothing to
    another process); an S3 root is its s3:// URL.
    """

    url: str
    step: int
    format: str = "sharded"

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url:
            raise ValueError(f"checkpoint reference: url must be the checkpoint root URL, got {self.url!r}")
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"checkpoint reference: step must be a whole number >= 0, got {self.step!r}")
        if self.format not in FORMAT_NAMES:
            raise ValueError(f"checkpoint reference: format {self.format!r} is not one this forgeflow "
                             f"reads; use one of {', '.join(FORMAT_NAMES)}")

    @property
    def step_url(self) -> str:
        """The step's own folder, e.g. s3://bucket/job/checkpoints/step-00000040."""
        return f"{self.url.rstrip('/')}/{step_dir(self.step)}"

    @property
    def name(self) -> str:
        """The step folder's name, e.g. step-00000040."""
        return step_dir(self.step)

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "step": self.step, "format": self.format}

    @classmethod
    def from_dict(cls, raw: Any) -> "CheckpointRef":
        """The reference a payload or parameter holds; ValueError naming what is wrong."""
        if isinstance(raw, cls):
            return raw
        if not isinstance(raw, dict) or not {"url", "step"} <= set(raw) or set(raw) - {"url", "step", "format"}:
            raise ValueError(f"checkpoint reference {raw!r}: expected an object with url, step and "
                             "(optionally) format, as CheckpointRef.to_dict() writes it")
        return cls(**raw)


@dataclass(frozen=True)
class CommitRecord:
    """One committed checkpoint, as flows see it."""

    step: int
    url: str  # the step's directory URL
    manifest_url: str
    time: float
    world_size: int
    layout: dict[str, int]
    config_hash: str
    total_bytes: int

    @property
    def ref(self) -> CheckpointRef:
        return CheckpointRef(self.url.rstrip("/").rsplit("/", 1)[0], self.step)


def _root_url(storage: Storage) -> str:
    """The root as another process opens it: a local root as an absolute path."""
    local_root = getattr(storage, "root", None) if storage.scheme == "file" else None
    return str(local_root) if local_root is not None else storage.url()


def _record(storage: Storage, manifest: Manifest) -> CommitRecord:
    root = _root_url(storage)
    return CommitRecord(
        step=manifest.step, url=f"{root}/{step_dir(manifest.step)}",
        manifest_url=f"{root}/{manifest_key(manifest.step)}", time=manifest.time,
        world_size=manifest.world_size, layout=dict(manifest.layout),
        config_hash=manifest.config_hash, total_bytes=sum(s.size for s in manifest.shards))


def read_manifest(storage: Storage, step: int) -> Manifest:
    return Manifest.from_json(storage.get_bytes(manifest_key(step)))


def write_commit(storage: Storage, manifest: Manifest) -> CommitRecord:
    """The commit: the manifest as one object, then the `latest` pointer after it.

    A step set aside before (a rollback timeline writing a step the abandoned one had
    written too) loses its note first; a crash in between leaves neither, i.e. no commit.
    Locally the manifest's folder fsync makes the note's removal durable with it."""
    storage.delete([set_aside_key(manifest.step)])
    storage.put_bytes(manifest_key(manifest.step), manifest.to_json())
    return write_latest(storage, manifest)


def write_latest(storage: Storage, manifest: Manifest) -> CommitRecord:
    """Point `latest` at a committed step (the commit's last write; alone, to repoint it)."""
    record = _record(storage, manifest)
    storage.put_bytes(LATEST_KEY, json.dumps(asdict(record), sort_keys=True).encode())
    return record


def steps_in_listing(storage: Storage) -> dict[int, list[str]]:
    """step -> the keys under its directory, from one listing of the root."""
    out: dict[int, list[str]] = {}
    for obj in storage.list("step-"):
        m = _STEP_DIR.match(obj.key)
        if m:
            out.setdefault(int(m.group(1)), []).append(obj.key)
    return out


def committed_steps(storage: Storage) -> list[int]:
    return sorted(s for s, keys in steps_in_listing(storage).items() if _counts_as_committed(s, keys))


def set_aside(storage: Storage, step: int, reason: str) -> None:
    """Make `step` stop counting as a checkpoint, for good; its files stay (see the module doc).

    Idempotent: setting aside a step already set aside (or with no manifest) rewrites the note."""
    storage.put_bytes(set_aside_key(step), json.dumps({"reason": reason, "time": time.time()}).encode())
    storage.delete([manifest_key(step)])


def set_aside_after(where: Any, step: int, reason: str, options: StorageOptions | None = None) -> list[int]:
    """Set aside every committed step after `step` and point `latest` at the newest one left.

    For a spike rollback that resumes from `step`: the steps committed after it belong to
    the abandoned timeline, and "the newest committed checkpoint" (what a plain restart
    resumes from) must be the rollback's from now on. Idempotent (a second call, e.g. after
    a crash half way, finishes the job); returns the steps set aside by this call. Raises
    StorageError when the storage cannot do it.
    """
    storage = _as_storage(where, options)
    try:
        later = [s for s in committed_steps(storage) if s > step]
        for s in later:
            set_aside(storage, s, reason)
        latest = read_latest(storage)
        if latest is not None and latest.step > step:
            left = committed_steps(storage)
            if left:
                write_latest(storage, read_manifest(storage, left[-1]))
            else:
                storage.delete([LATEST_KEY])
        if later:
            log.warning("checkpoint: steps %s set aside: %s", later, reason)
        return later
    finally:
        if storage is not where:
            storage.close()


def _as_storage(where: Any, options: StorageOptions | None) -> Storage:
    if isinstance(where, Storage):
        return where
    if not isinstance(where, str):  # a job spec's checkpoint section: its URL and S3 settings
        from infra.storage import storage_options_from_config

        options = options or storage_options_from_config(where)
        where = where.url
    return open_storage(where, options)


def committed_checkpoints(where: Any, options: StorageOptions | None = None) -> list[CommitRecord]:
    """Every committed checkpoint under a root, oldest first.

    `where`: a root URL or path, an open Storage, or a job spec's `checkpoint` section.
    """
    storage = _as_storage(where, options)
    out = []
    for step in committed_steps(storage):
        try:
            out.append(_record(storage, read_manifest(storage, step)))
        except ObjectNotFound:
            continue  # deleted by retention between listing and reading
        except ValueError as e:
            log.warning("checkpoint: unreadable manifest at step %d skipped: %s", step, e)
    return out


def locate(where: str, options: StorageOptions | None = None) -> CheckpointRef | None:
    """The committed checkpoint `where` names, with one listing and no manifest read: a step
    folder (ROOT/step-00000040) that counts as committed, or the newest commit under a root.
    None when it names neither; a StorageError when the storage cannot be listed."""
    where = where.rstrip("/")
    parent, _, name = where.rpartition("/")
    step = parse_step_dir(name)
    if step is not None and parent:
        storage = open_storage(parent, options)
        try:
            keys = [o.key for o in storage.list(step_dir(step) + "/")]
            return CheckpointRef(_root_url(storage), step) if _counts_as_committed(step, keys) else None
        finally:
            storage.close()
    storage = open_storage(where, options)
    try:
        steps = committed_steps(storage)
        return CheckpointRef(_root_url(storage), steps[-1]) if steps else None
    finally:
        storage.close()


def read_latest(where: Any, options: StorageOptions | None = None) -> CommitRecord | None:
    """The newest commit from the `latest` pointer (one small read); None before the first."""
    storage = _as_storage(where, options)
    try:
        raw = json.loads(storage.get_bytes(LATEST_KEY))
    except ObjectNotFound:
        return None
    return CommitRecord(**raw)


@contextmanager
def lease(storage: Storage, step: int, holder: str = "reader") -> Iterator[None]:
    """Hold a step against retention while reading it (a crashed holder expires after a TTL)."""
    key = f"{step_dir(step)}/lease-{uuid.uuid4().hex[:12]}.json"
    storage.put_bytes(key, json.dumps({"holder": holder, "time": time.time()}).encode())
    try:
        yield
    finally:
        try:
            storage.delete([key])
        except Exception as e:  # noqa: BLE001 - an orphan lease only delays retention by the TTL
            log.warning("checkpoint: could not drop lease %s: %s", key, e)


@dataclass
class RetentionResult:
    deleted_steps: list[int]
    orphaned_steps: list[int]
    kept_steps: list[int]


def apply_retention(storage: Storage, keep_last: int, protect: set[int] = frozenset(),
                    now: float | None = None) -> RetentionResult:
    """Keep the newest `keep_last` commits; drop older ones and orphaned shards.

    Never deleted: the newest commit, any step in `protect` (being loaded or in flight)
    and any step holding a lease younger than LEASE_TTL_S. Orphans are step directories
    without a manifest that are older than the newest commit: shards of a persist that
    crashed or was abandoned (a newer one may still be in flight, so those stay).
    """
    keep_last = max(1, keep_last)
    now = time.time() if now is None else now
    listing = {o.key: o for o in storage.list("step-")}
    by_step: dict[int, list[str]] = {}
    for key in listing:
        m = _STEP_DIR.match(key)
        if m:
            by_step.setdefault(int(m.group(1)), []).append(key)
    committed = sorted(s for s, keys in by_step.items() if _counts_as_committed(s, keys))
    if not committed:
        return RetentionResult([], [], [])
    newest = committed[-1]

    def leased(step: int) -> bool:
        return any("/lease-" in k and now - listing[k].mtime < LEASE_TTL_S for k in by_step[step])

    keep = set(committed[-keep_last:]) | {newest} | (set(protect) & set(by_step))
    deleted, orphaned, doomed = [], [], []
    for step, keys in sorted(by_step.items()):
        if step in keep or leased(step):
            continue
        if step in committed:
            # Manifest first: the step stops being a checkpoint before its shards go.
            doomed.append([manifest_key(step)] + [k for k in keys if k != manifest_key(step)])
            deleted.append(step)
        elif step < newest:
            doomed.append(keys)
            orphaned.append(step)
    for keys in doomed:
        storage.delete(keys[:1])
        storage.delete(keys[1:])
    if deleted or orphaned:
        log.info("checkpoint retention: deleted steps %s, orphaned shards of steps %s", deleted, orphaned)
    return RetentionResult(deleted, orphaned, sorted(keep & set(committed)))
