"""What every rank must decide together after a step: stop now? checkpoint now?

    control = StepControl(env, spec.checkpoint)   # installs the SIGTERM handler
    ...after each step:
    decision = control.after_step()               # collective: the same answer on every rank

Graceful stop. SIGTERM (Prefect cancellation, a scheduler's preemption, `kill`; the
launcher's reaper and torchrun both forward it to every rank) only sets a flag, so the
step in progress finishes normally. After the step all ranks combine their flags (MAX
all-reduce): if any rank was asked to stop, every rank stops after this same step,
saves its checkpoint, waits for the commit and exits EXIT_STOPPED (infra.runfiles),
rank 0 writing markers/stopped.json first. `begin_stop` arms a watchdog: if the commit
is not done `checkpoint.stop_deadline_s` after the signal the process exits
EXIT_EXCEPTION instead (the flow then restarts from the previous committed checkpoint).

Checkpoint by time. With `checkpoint.interval_s` set, rank 0's clock decides that a
checkpoint is due (time since the last save) and the same all-reduce carries that
decision to every rank, so all ranks save at the same step whatever their clocks say.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import torch

from infra import runfiles


@dataclass(frozen=True)
class StepDecision:
    stop: bool  # some rank was asked to stop: every rank stops after this step
    checkpoint_due: bool  # checkpoint.interval_s has passed since the last save


class StepControl:
    def __init__(self, env, checkpoint_cfg, install_handler: bool = True, clock=time.monotonic):
        self.env = env
        self.clock = clock
        self.interval_s = checkpoint_cfg.interval_s
        self.deadline_s = checkpoint_cfg.stop_deadline_s
        self.signal_name: str | None = None
        self.signal_time: float | None = None
        self.last_save = clock()
        self._watchdog: threading.Timer | None = None
        # signal handlers can only be installed from the main thread (the worker's, under
        # torchrun); elsewhere (an in-process caller's thread) SIGTERM keeps its default.
        self._handler_installed = install_handler and threading.current_thread() is threading.main_thread()
        if self._handler_installed:
            signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        if self.signal_name is None:  # torchrun forwards the reaper's SIGTERM: one is enough
            self.signal_name = signal.Signals(signum).name
            self.signal_time = self.clock()

    def after_step(self) -> StepDecision:
        """Collective over all ranks (world group): call once per step on every rank."""
        due = (self.env.rank == 0 and self.interval_s is not None
               and self.clock() - self.last_save >= self.interval_s)
        flags = torch.tensor([self.signal_name is not None, due], dtype=torch.int32,
                             device=self.env.device)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        stop, due = (bool(x) for x in flags.tolist())
        return StepDecision(stop=stop, checkpoint_due=due)

    def saved(self) -> None:
        self.last_save = self.clock()

    def begin_stop(self, step: int) -> None:
        """Arm the deadline watchdog (from the signal, or from now on a rank that got none)."""
        started = self.signal_time if self.signal_time is not None else self.clock()
        remaining = max(0.0, self.deadline_s - (self.clock() - started))
        print(f"forgeflow: stop requested ({self.signal_name or 'by another rank'}); "
              f"checkpointing step {step} within {remaining:.0f} s", file=sys.stderr, flush=True)
        self._watchdog = threading.Timer(remaining, self._deadline_passed, args=(step,))
        self._watchdog.daemon = True
        self._watchdog.start()

    def _deadline_passed(self, step: int) -> None:
        print(f"forgeflow: graceful stop failed: the checkpoint of step {step} was not committed "
              f"within checkpoint.stop_deadline_s={self.deadline_s:g} s; exiting without it",
              file=sys.stderr, flush=True)
        os._exit(runfiles.EXIT_EXCEPTION)

    def finish_stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        # The stop is committed; this rank only writes its marker and exits EXIT_STOPPED. A
        # SIGTERM now (torchrun terminates the other ranks as soon as the first one exits) must
        # not turn "stopped" into a kill: CPython restores the default handler during shutdown,
        # so one arriving then ended the rank with -15 (seen in CI). Ignored signals stay ignored;
        # a rank that hangs on the way out is still ended by torchrun's or the reaper's SIGKILL.
        if self._handler_installed:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)


def write_stop_marker(run_dir, step: int, signal_name: str | None) -> None:
    """markers/stopped.json (infra.runfiles.read_stop_marker reads it); rank 0 only."""
    from infra.atomic_write import atomic_write_json

    path = runfiles.stop_marker_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"step": step, "checkpoint_step": step,
                             "signal": signal_name or "SIGTERM", "time": time.time()})
