"""The "device" side of offloaded fine-tuning: a memory budget and a prefetcher.

`DeviceMemory` accounts every byte the executor puts on the device (stage
weights, their prefetch, gradients, activations, boundary tensors) against a
budget and refuses an allocation that would exceed it, as a GPU would with an
out-of-memory error. On CPU this budget *is* the device: tests and the planner
check schedules, prefetch order and peak memory without a GPU. On CUDA the
same accounting runs and, in addition, the process is capped with
`torch.cuda.set_per_process_memory_fraction` so the real allocator enforces it,
and the real peak (`torch.cuda.max_memory_allocated`) is reported next to the
accounted one.

`Prefetcher` copies a stage's host tensors to the device in the background:
on CUDA on side streams created with priorities (the stage that executes first
gets the higher-priority stream, Mobius's rule for colliding prefetches), from
pinned host memory with non_blocking copies; on CPU in a worker thread that
makes the device copies (clones), so the copy overlaps the current stage's
compute exactly where it would on a GPU.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch


class DeviceBudgetExceeded(MemoryError):
    """An allocation would take the device past its budget."""


@dataclass
class DeviceMemory:
    budget_bytes: int
    device: torch.device
    used_bytes: int = 0
    peak_bytes: int = 0
    live: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            # The allocator itself refuses beyond the budget (plus what the context holds).
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.budget_bytes / total), self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def alloc(self, key: str, nbytes: int) -> None:
        with self._lock:
            if key in self.live:
                raise RuntimeError(f"device buffer {key!r} allocated twice")
            if self.used_bytes + nbytes > self.budget_bytes:
                raise DeviceBudgetExceeded(
                    f"device budget exceeded: {key} needs {nbytes / 2**20:.2f} MiB with "
                    f"{self.used_bytes / 2**20:.2f} MiB in use of {self.budget_bytes / 2**20:.2f} MiB "
                    f"(live: {', '.join(sorted(self.live))}); re-plan the partition for this budget"
                )
            self.live[key] = nbytes
            self.used_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def free(self, key: str) -> None:
        with self._lock:
            self.used_bytes -= self.live.pop(key)

    def allocator_peak_bytes(self) -> int | None:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return None


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Prefetcher:
    """Background host->device copies of named tensor sets."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            lo, hi = torch.cuda.Stream.priority_range()  # (lowest, highest) priority numbers
            self.streams = {"high": torch.cuda.Stream(device, priority=hi), "low": torch.cuda.Stream(device, priority=lo)}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self.order: list[int] = []  # stages in the order their prefetch started (tests check it)

    def _copy(self, host: dict[str, torch.Tensor], stream) -> dict[str, torch.Tensor]:
        if stream is None:
            return {k: v.detach().clone() for k, v in host.items()}
        with torch.cuda.stream(stream):
            out = {k: v.detach().to(self.device, non_blocking=True) for k, v in host.items()}
        event = torch.cuda.Event()
        event.record(stream)
        event.synchronize()
        return out

    def fetch(self, stage: int, host: dict[str, torch.Tensor], *, urgent: bool) -> Future:
        """Start copying; `urgent` = this stage executes before any other prefetch in flight."""
        self.order.append(stage)
        stream = None if self.device.type != "cuda" else self.streams["high" if urgent else "low"]
        return self.pool.submit(self._copy, host, stream)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def pin(tensor: torch.Tensor) -> torch.Tensor:
    """Page-locked host memory when a GPU will read it (async copies need it)."""
    return tensor.pin_memory() if torch.cuda.is_available() else tensor
