"""Fault injection for recovery tests — off unless asked for.

Asked for by the environment variable `FORGEFLOW_FAULT=kind@step[:rank]` (wins) or
the job spec's `fault:` section (`kind`, `at_step`, `rank`). `step` counts completed
optimizer steps: a fault at step k fires after step k finished (its log line and
heartbeat are written) and before step k+1 starts. Each kind prints what the real
failure prints, because the diagnosis rules match on those lines:

    cuda_error           raises torch.AcceleratorError (a RuntimeError) with PyTorch's
                         exact CUDA error text; the uncaught traceback exits 1
    hang                 stops making progress without a word: no more heartbeats or log
                         lines (peers block in their next collective); a watcher kills it
    oom_kill             SIGKILLs itself, printing nothing — like the kernel OOM killer;
                         the launcher sees exit -9 (a shell reports 137) and torchrun
                         prints its "Signal 9 (SIGKILL)" summary
    loss_spike           from step k+1 on, the loss the spike detector and the log see is
                         multiplied by LOSS_SPIKE_FACTOR on every rank, so the detector
                         confirms a spike that does not recover; the worker writes the
                         spike marker and exits EXIT_LOSS_SPIKE (infra.runfiles)
    exit_mid_checkpoint  in the first checkpoint save at a step >= k, os._exit
                         (EXIT_FAULT_MID_CHECKPOINT) after this rank's shards are written and
                         before the checkpoint is committed: it stays `.partial`
    script_error         a KeyError from a missing batch field, as a user script bug shows
    sigterm              SIGTERM to this rank after step k, as a scheduler's preemption, a
                         cancellation or `kill` delivers it: the ranks stop gracefully (they
                         commit a checkpoint of the step they agree on and exit EXIT_STOPPED)
    slow_rank            from step k+1 on, the rank sleeps SLOW_RANK_SLEEP_S in every micro
                         batch's forward pass (inside its compute, as a throttled GPU or a
                         noisy neighbour is slow): it never fails, every rank's step slows
                         down to its pace, and only its compute time shows who it is

`rank` (default 0) is the global rank that fails; loss_spike applies to all ranks.

Fires once per flow run. Before firing, the failing rank records
`{run_dir}/markers/fault_fired.{kind}@{step}.rank{R}[.{scope}]`; a restarted worker that
finds the record does not fire again, so a restart (from a checkpoint before or after step
k) recovers, as it would after a transient real failure. A run resumed at a step
already past k never reaches the firing point either. `scope` is `FORGEFLOW_FAULT_SCOPE`
(the pretrain flow sets it to its flow run's id): a drill that fired in an earlier flow
run of the same job, in the same run directory, fires again in a new flow run. Without a
scope (a worker started by hand) the record holds for the run directory.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from infra import runfiles
from training.config import FaultConfig

ENV_VAR = "FORGEFLOW_FAULT"
SCOPE_ENV_VAR = "FORGEFLOW_FAULT_SCOPE"  # who the fire-once record belongs to (a flow run id)
KINDS = ("cuda_error", "hang", "oom_kill", "loss_spike", "exit_mid_checkpoint", "script_error",
         "slow_rank", "sigterm")
LOSS_SPIKE_FACTOR = 8.0
SLOW_RANK_SLEEP_S = 0.5

# PyTorch's text for an asynchronous CUDA fault (c10/cuda/CUDAException.cpp, torch 2.x).
CUDA_ILLEGAL_ACCESS_MESSAGE = (
    "CUDA error: an illegal memory access was encountered\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, "
    "so the stacktrace below might be incorrect.\n"
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)

_SPEC = re.compile(r"^(?P<kind>[a-z_]+)@(?P<step>\d+)(?::(?P<rank>\d+))?$")


class FaultSpecError(ValueError):
    """FORGEFLOW_FAULT (or the spec's fault section) is malformed."""


@dataclass(frozen=True)
class FaultPlan:
    kind: str
    at_step: int
    rank: int = 0


def parse_fault(text: str) -> FaultPlan:
    """Parse `kind@step[:rank]`, e.g. `cuda_error@12` or `hang@30:1`."""
    match = _SPEC.match(text.strip())
    if not match:
        raise FaultSpecError(
            f"{ENV_VAR}={text!r}: expected kind@step[:rank], e.g. cuda_error@12 or hang@30:1"
        )
    kind = match.group("kind")
    if kind not in KINDS:
        raise FaultSpecError(f"{ENV_VAR}={text!r}: unknown fault kind {kind!r}; use one of {', '.join(KINDS)}")
    return FaultPlan(kind, int(match.group("step")), int(match.group("rank") or 0))


def plan_from(fault_cfg: FaultConfig | None, environ: dict[str, str] | None = None) -> FaultPlan | None:
    """The fault to inject: FORGEFLOW_FAULT if set, else the spec's fault section, else None."""
    environ = os.environ if environ is None else environ
    text = environ.get(ENV_VAR, "").strip()
    if text:
        return parse_fault(text)
    if fault_cfg is not None and fault_cfg.kind is not None:
        return FaultPlan(fault_cfg.kind, fault_cfg.at_step, fault_cfg.rank)
    return None


class FaultInjector:
    """Hooks the training loop calls; every method is a no-op when no fault is planned."""

    def __init__(self, plan: FaultPlan | None, rank: int, run_dir: str | Path, scope: str | None = None):
        self.plan = plan
        self.rank = rank
        self.run_dir = Path(run_dir)
        scope = os.environ.get(SCOPE_ENV_VAR, "") if scope is None else scope
        # a file-name-safe form of the scope (a flow run id is a UUID; be strict anyway)
        self.scope = re.sub(r"[^A-Za-z0-9_-]", "-", scope.strip())
        self._spiking = False
        self._slow = False
        if plan is not None and (self._applies_here() and self._already_fired()):
            self.plan = None  # fired in an earlier attempt of this run: let the restart recover

    # --- hooks ----------------------------------------------------------------------------

    def after_step(self, completed_step: int) -> None:
        """Called after step `completed_step` is logged; fires step-triggered faults."""
        plan = self.plan
        if plan is None or completed_step != plan.at_step or not self._applies_here():
            return
        if plan.kind == "loss_spike":
            self._record_fired()
            self._spiking = True
        elif plan.kind == "slow_rank":
            self._record_fired()
            self._slow = True
        elif plan.kind == "sigterm":
            self._record_fired()
            os.kill(os.getpid(), signal.SIGTERM)
        elif plan.kind == "cuda_error":
            self._record_fired()
            _raise_cuda_illegal_memory_access()
        elif plan.kind == "hang":
            self._record_fired()
            _hang_forever()
        elif plan.kind == "oom_kill":
            self._record_fired()
            _sigkill_self()
        elif plan.kind == "script_error":
            self._record_fired()
            _read_attention_mask({"tokens": None, "labels": None})

    def observed_loss(self, loss: float) -> float:
        """The loss as the log and the spike detector see it (scaled during an injected spike)."""
        return loss * LOSS_SPIKE_FACTOR if self._spiking else loss

    def in_forward(self) -> None:
        """Called in every micro batch's forward pass: the slow_rank fault."""
        if self._slow:
            time.sleep(SLOW_RANK_SLEEP_S)

    def after_shards_written(self, step: int) -> None:
        """Checkpointer hook: the exit_mid_checkpoint fault."""
        plan = self.plan
        if (plan is None or plan.kind != "exit_mid_checkpoint" or step < plan.at_step
                or self.rank != plan.rank):
            return
        self._record_fired()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(runfiles.EXIT_FAULT_MID_CHECKPOINT)

    # --- bookkeeping ----------------------------------------------------------------------

    def _applies_here(self) -> bool:
        return self.plan is not None and (self.plan.kind == "loss_spike" or self.rank == self.plan.rank)

    def _marker(self) -> Path:
        p = self.plan
        name = f"fault_fired.{p.kind}@{p.at_step}.rank{self.rank}" + (f".{self.scope}" if self.scope else "")
        return self.run_dir / runfiles.MARKERS_DIR / name

    def _already_fired(self) -> bool:
        return self._marker().exists()

    def _record_fired(self) -> None:
        marker = self._marker()
        marker.parent.mkdir(parents=True, exist_ok=True)
        with open(marker, "w", encoding="utf-8") as f:
            json.dump({"kind": self.plan.kind, "at_step": self.plan.at_step, "rank": self.rank,
                       "scope": self.scope, "time": time.time(), "pid": os.getpid()}, f)
            f.flush()
            os.fsync(f.fileno())  # must survive the SIGKILL / os._exit that follows


# --- the faults themselves (module-level so tracebacks read like real code paths) -----------

def _raise_cuda_illegal_memory_access() -> None:
    import torch

    error_cls = getattr(torch, "AcceleratorError", RuntimeError)
    raise error_cls(CUDA_ILLEGAL_ACCESS_MESSAGE)


def _hang_forever() -> None:
    while True:
        time.sleep(3600)


def _sigkill_self() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _read_attention_mask(batch: dict) -> object:
    return batch["attention_mask"]
