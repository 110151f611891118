"""A rank's checkpoint shard: host snapshot buffers and the self-describing shard format.

Snapshot: a rank's state (nested dicts/lists/tuples of tensors, numpy arrays and plain
values: model, optimizer, RNG, data position) is split into its tensors and a small
"skeleton" (the structure as a JSON value, each tensor replaced by its index:
checkpoint.plain; never a pickle, so reading a shard runs no code from it). The
tensors are copied into `HostBuffers`: one flat host buffer per dtype, sized on
first use and reused by every later checkpoint, so host memory does not grow and
the copy is one pass of memcpy-speed copies (pinned memory on a GPU node, so the
device-to-host copies run asynchronously at full PCIe speed, on a side stream).

The copy can be deferred (`take_snapshot(..., defer_copy=True)`): the snapshot is
laid out (skeleton, header) at once and `Snapshot.copy()` fills the buffers later,
from the engine's persist thread, while the next step's forward and backward run.
Parameters and optimizer state change only at the optimizer step, so the copy is
still the state of the snapshot's step as long as the caller waits for it
(`Snapshot.wait_copied()`) before that step changes them.

Shard file (all integers little-endian):

    b"FFSHARD2" | u64 header length | header (JSON) | zero pad to 64
    | region of dtype 0 | pad to 64 | region of dtype 1 | pad ... | skeleton (JSON)

The JSON header lists each tensor (dtype, shape, byte offset in the data area),
each region, and the skeleton's offset, so a shard is readable on its own. The
format before it (b"FFSHARD1", a pickled skeleton) is read only by a process that
opted in to trusting it (checkpoint.legacy).
"""

from __future__ import annotations

import json
import struct
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from checkpoint import legacy
from checkpoint.plain import PlainDataError, from_plain, to_plain

SHARD_MAGIC = b"FFSHARD2"
SHARD_FORMAT = "forgeflow-shard/2"
_ALIGN = 64


class ShardFormatError(ValueError):
    """The bytes are not a readable forgeflow shard (truncated, corrupt or foreign)."""


def split_state(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """(skeleton, tensors): the structure as a JSON value (checkpoint.plain), each tensor
    replaced by its index in `tensors`. Raises PlainDataError for a value a checkpoint
    does not store."""
    tensors: list[torch.Tensor] = []
    index_of: dict[int, int] = {}  # a tensor reachable twice is stored once

    def tensor_index(t: torch.Tensor) -> int:
        if id(t) not in index_of:
            index_of[id(t)] = len(tensors)
            tensors.append(t.detach())
        return index_of[id(t)]

    return to_plain(state, tensor_index), tensors


def join_state(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    def tensor_at(index: Any) -> torch.Tensor:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(tensors):
            raise PlainDataError(f"tensor reference {index!r} is not one of the shard's {len(tensors)}")
        return tensors[index]

    return from_plain(skeleton, tensor_at)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ShardFormatError(f"unknown dtype {name!r} in shard header")
    return dtype


def _pad(n: int) -> int:
    return (-n) % _ALIGN


class HostBuffers:
    """One flat host byte buffer per dtype, allocated on first use and then reused.

    `shared=True` puts each buffer in POSIX shared memory so a writer *process* can read
    it without a copy; `pin=True` page-locks it for fast asynchronous device-to-host copies.
    A buffer is only reallocated when a later state needs more bytes of that dtype.
    """

    def __init__(self, *, shared: bool = False, pin: bool | None = None):
        self.shared = shared
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._bytes: dict[str, torch.Tensor] = {}  # dtype name -> uint8 tensor
        self._shm: dict[str, Any] = {}  # dtype name -> SharedMemory
        self.allocations = 0

    def ensure(self, nbytes_by_dtype: dict[str, int]) -> None:
        for name, nbytes in nbytes_by_dtype.items():
            have = self._bytes.get(name)
            if have is not None and have.numel() >= nbytes:
                continue
            self._release(name)
            self._bytes[name] = self._allocate(name, max(nbytes, 1))
            self.allocations += 1

    def _allocate(self, name: str, nbytes: int) -> torch.Tensor:
        if self.shared:
            from multiprocessing import shared_memory

            shm = shared_memory.SharedMemory(create=True, size=nbytes)
            self._shm[name] = shm
            buf = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)
            if self.pin:
                # Page-lock the shared pages so device-to-host copies into them are async.
                torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
            return buf
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def _release(self, name: str) -> None:
        buf = self._bytes.pop(name, None)
        shm = self._shm.pop(name, None)
        if shm is not None:
            if self.pin and buf is not None:
                torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
            del buf
            try:
                shm.close()
            except BufferError:
                pass  # a view is still alive somewhere; unlinking below still frees the name
            shm.unlink()

    def typed(self, name: str, numel: int) -> torch.Tensor:
        return self._bytes[name][: numel * _dtype(name).itemsize].view(_dtype(name))

    def view(self, name: str, nbytes: int) -> memoryview:
        if self.shared:
            return self._shm[name].buf[:nbytes]
        return memoryview(self._bytes[name][:nbytes].numpy())

    def shm_name(self, name: str) -> str:
        return self._shm[name].name

    def total_bytes(self) -> int:
        return sum(b.numel() for b in self._bytes.values())

    def close(self) -> None:
        for name in list(self._bytes):
            self._release(name)


class SnapshotCopyError(RuntimeError):
    """The tensors could not be copied into host memory; the snapshot holds no usable state."""


@dataclass
class Snapshot:
    """A state laid out as one shard file in host buffers; ready to persist once copied."""

    step: int
    header: bytes  # magic + length + JSON header + pad
    regions: list[tuple[str, int, int]]  # (dtype name, region bytes, pad after)
    skeleton: bytes
    buffers: HostBuffers
    tensor_bytes: int = 0
    layout_s: float = 0.0  # splitting the state, encoding the skeleton, the header
    copy_s: float = 0.0  # the tensor copies (in the background when deferred)
    extra: dict[str, Any] = field(default_factory=dict)
    # (host destination, source) pairs still to copy; empty once copy() has run
    pending: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list, repr=False)
    # on a GPU: recorded on the caller's stream at snapshot time, after the optimizer step
    state_ready: Any = field(default=None, repr=False)
    _copied: threading.Event = field(default_factory=threading.Event, repr=False)
    _copy_error: BaseException | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return len(self.header) + sum(n + p for _, n, p in self.regions) + len(self.skeleton)

    @property
    def copied(self) -> bool:
        return self._copied.is_set()

    def copy(self) -> None:
        """Copy the pending tensors into the host buffers; returns once all are in host memory.

        Runs once (later calls return at once). A failure leaves the snapshot unusable:
        it is raised here and by `wait_copied()`, and the source references are dropped
        either way so the caller's tensors are not kept alive by a checkpoint."""
        if self._copied.is_set():
            self._check_copied()
            return
        start = time.perf_counter()
        pending, self.pending = self.pending, []
        try:
            _copy_to_host(pending, self.state_ready)
        except BaseException as e:
            self._copy_error = e  # the buffers are half filled: never persist them
            if not isinstance(e, Exception):
                raise
            raise SnapshotCopyError(self._failure()) from e
        finally:
            del pending
            self.copy_s += time.perf_counter() - start
            self._copied.set()

    def wait_copied(self, timeout: float | None = None) -> float:
        """Block until `copy()` has ended (in whichever thread runs it); seconds blocked.

        Call before changing any tensor the snapshot was taken from. A failed copy is
        not raised here: the persist reports it and the step is simply not committed."""
        start = time.perf_counter()
        if not self._copied.wait(timeout):
            raise TimeoutError(f"the host copy of step {self.step} did not end in {timeout}s")
        return time.perf_counter() - start

    def chunks(self) -> list[memoryview | bytes]:
        """The shard's bytes in order, as views of the host buffers (no copy)."""
        self._check_copied()
        out: list[memoryview | bytes] = [self.header]
        for name, nbytes, pad in self.regions:
            if nbytes:
                out.append(self.buffers.view(name, nbytes))
            if pad:
                out.append(bytes(pad))
        out.append(self.skeleton)
        return out

    def pieces(self) -> list[dict[str, Any]]:
        """The same sequence for a writer process: inline bytes or shared-memory spans."""
        self._check_copied()
        out: list[dict[str, Any]] = [{"inline": self.header}]
        for name, nbytes, pad in self.regions:
            if nbytes:
                out.append({"shm": self.buffers.shm_name(name), "nbytes": nbytes})
            if pad:
                out.append({"inline": bytes(pad)})
        out.append({"inline": self.skeleton})
        return out

    def _check_copied(self) -> None:
        # The one guard against persisting half-filled buffers: no bytes leave before the copy.
        if not self._copied.is_set():
            raise SnapshotCopyError(f"step {self.step}: the host copy has not run; call copy() first")
        if self._copy_error is not None:
            raise SnapshotCopyError(self._failure()) from self._copy_error

    def _failure(self) -> str:
        return (f"step {self.step}: host copy failed: {type(self._copy_error).__name__}: "
                f"{self._copy_error}")


def _copy_to_host(pairs: list[tuple[torch.Tensor, torch.Tensor]], state_ready: Any) -> None:
    """dst.copy_(src) for each pair. Device tensors go on a side stream that first waits for
    `state_ready` (the optimizer step's kernels), so the caller's stream keeps running."""
    on_device = [(d, s) for d, s in pairs if s.device.type == "cuda"]
    for dst, src in pairs:
        if src.device.type != "cuda":
            dst.copy_(src)  # releases the GIL: the training thread keeps running
    if on_device:
        device = on_device[0][1].device  # a rank's state lives on its one device
        with torch.cuda.device(device):  # this may be a background thread: name the device
            stream = torch.cuda.Stream(device=device)
            if state_ready is not None:
                stream.wait_event(state_ready)
            with torch.cuda.stream(stream):
                for dst, src in on_device:
                    dst.copy_(src, non_blocking=True)  # pinned destination: asynchronous
            stream.synchronize()


def take_snapshot(step: int, state: Any, buffers: HostBuffers, *, defer_copy: bool = False) -> Snapshot:
    """Lay out `state` as a shard in `buffers` and copy its tensors there.

    Returns once every tensor is in host memory, so the caller may modify its state as
    soon as this returns; with `defer_copy` it returns before copying (the caller runs
    `snapshot.copy()`, e.g. in a background thread, and must not change the tensors
    until `snapshot.wait_copied()` returns).
    """
    start = time.perf_counter()
    skeleton, tensors = split_state(state)
    entries: list[dict[str, Any]] = []
    used: dict[str, int] = {}
    for t in tensors:
        name = _dtype_name(t.dtype)
        offset = used.get(name, 0)
        nbytes = t.numel() * t.element_size()
        entries.append({"dtype": name, "shape": list(t.shape), "region": name, "offset": offset,
                        "nbytes": nbytes})
        used[name] = offset + nbytes
    buffers.ensure(used)
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    for t, entry in zip(tensors, entries):
        if entry["nbytes"] == 0:
            continue
        dst = buffers.typed(entry["dtype"], (entry["offset"] + entry["nbytes"]) // t.element_size())
        pending.append((dst[entry["offset"] // t.element_size():].view(t.shape), t))
    state_ready = None
    if any(t.device.type == "cuda" for _, t in pending):
        state_ready = torch.cuda.Event()
        state_ready.record()  # on the caller's stream: after the step's update kernels
    skeleton_bytes = json.dumps(skeleton, separators=(",", ":")).encode()

    regions: list[tuple[str, int, int]] = []
    region_meta: list[dict[str, Any]] = []
    data_offset = 0
    for name in sorted(used):
        nbytes = used[name]
        regions.append((name, nbytes, _pad(nbytes)))
        region_meta.append({"dtype": name, "offset": data_offset, "nbytes": nbytes})
        data_offset += nbytes + _pad(nbytes)
    region_start = {r["dtype"]: r["offset"] for r in region_meta}
    for entry in entries:
        entry["offset"] += region_start[entry["region"]]
        del entry["region"]
    header_json = json.dumps({
        "format": SHARD_FORMAT, "step": step, "tensors": entries, "regions": region_meta,
        "skeleton": {"offset": data_offset, "nbytes": len(skeleton_bytes)},
    }, separators=(",", ":")).encode()
    prefix = SHARD_MAGIC + struct.pack("<Q", len(header_json)) + header_json
    header = prefix + bytes(_pad(len(prefix)))
    snapshot = Snapshot(step=step, header=header, regions=regions, skeleton=skeleton_bytes,
                        buffers=buffers, tensor_bytes=sum(used.values()), pending=pending,
                        state_ready=state_ready)
    snapshot.layout_s = time.perf_counter() - start
    if not defer_copy:
        snapshot.copy()
    return snapshot


def read_shard(data: bytes | bytearray | memoryview, map_location: str | torch.device = "cpu") -> tuple[
        int, Any]:
    """(step, state) from a shard's bytes. Raises ShardFormatError on anything malformed, and
    on a format-1 (pickled) shard unless this process opted in (checkpoint.legacy)."""
    view = memoryview(data)
    magic = bytes(view[:8])
    if len(view) < 16 or magic not in (SHARD_MAGIC, legacy.LEGACY_SHARD_MAGIC):
        raise ShardFormatError("not a forgeflow shard (bad magic)")
    is_legacy = magic == legacy.LEGACY_SHARD_MAGIC
    if is_legacy and not legacy.trusted():
        raise ShardFormatError(legacy.refusal("this shard"))
    (header_len,) = struct.unpack("<Q", view[8:16])
    if 16 + header_len > len(view):
        raise ShardFormatError("truncated shard header")
    try:
        header = json.loads(bytes(view[16:16 + header_len]))
    except ValueError as e:
        raise ShardFormatError(f"unreadable shard header: {e}") from None
    if header.get("format") != (legacy.LEGACY_SHARD_FORMAT if is_legacy else SHARD_FORMAT):
        raise ShardFormatError(f"unsupported shard format {header.get('format')!r}")
    start = 16 + header_len + _pad(16 + header_len)
    skel = header["skeleton"]
    if start + skel["offset"] + skel["nbytes"] != len(view):
        raise ShardFormatError(
            f"shard size {len(view)} does not match its header ({start + skel['offset'] + skel['nbytes']})")
    tensors: list[torch.Tensor] = []
    for entry in header["tensors"]:
        dtype = _dtype(entry["dtype"])
        count = entry["nbytes"] // dtype.itemsize
        if count == 0:
            t = torch.empty(entry["shape"], dtype=dtype)
        else:
            with warnings.catch_warnings():  # read-only bytes: fine, the tensor is cloned at once
                warnings.simplefilter("ignore", UserWarning)
                t = torch.frombuffer(view, dtype=dtype, count=count, offset=start + entry["offset"])
            t = t.view(entry["shape"]).clone()  # own the memory: `data` may be freed after this
        tensors.append(t.to(map_location) if str(map_location) != "cpu" else t)
    skeleton = view[start + skel["offset"]: start + skel["offset"] + skel["nbytes"]]
    if is_legacy:
        return int(header["step"]), legacy.read_skeleton(skeleton, tensors)
    try:
        return int(header["step"]), join_state(json.loads(bytes(skeleton)), tensors)
    except (ValueError, PlainDataError) as e:
        raise ShardFormatError(f"unreadable shard skeleton: {e}") from None
