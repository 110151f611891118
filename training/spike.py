"""Loss-spike detection: a sudden rise of the loss that does not recover.

The detector keeps the last `SpikeConfig.window` *healthy* losses as a baseline
and scores each new loss with a robust z-score against it::

    z = (loss - median(baseline)) / max(1.4826 * MAD(baseline), noise_floor)

(MAD = median absolute deviation; 1.4826 * MAD estimates the standard deviation
of normal noise without being pulled by outliers; `noise_floor` = 1% of the
median keeps a perfectly flat curve from turning every wobble into infinity.)

- Only upward deviations count: a falling loss is never a spike.
- Slow drift is not a spike: the median follows the curve, and on a steady ramp
  the newest loss sits about half a window above the median while the MAD is a
  quarter window of the same slope, so z stays near 1.35 whatever the slope.
- A loss with z > `z_threshold` opens a *pending* spike at that step (its
  onset). Losses of a pending spike never enter the baseline. A healthy loss
  (z <= threshold) before confirmation means the spike recovered: it is dropped.
- A spike is *confirmed* once `patience` consecutive updates (the onset
  included) were all above the threshold.
- NaN or inf is confirmed at once (onset = the pending onset if one is open).
- Detection starts after `min_history` healthy losses.

Updates are counted, not step numbers: if the worker logs every N steps,
`patience` and `window` are in logged updates.

When a spike is confirmed the worker calls `write_spike_marker(run_dir, event)`
(the flow's machine-readable signal), prints `format_spike_line(event)` — the
log line the diagnosis rules match::

    FORGEFLOW_LOSS_SPIKE onset_step=<int> last_healthy_step=<int> loss=<float> median=<float>

(`last_healthy_step` is -1 when no healthy step preceded the onset; floats are
`%.6g`, so non-finite values read `nan`, `inf`) — and exits with
`LOSS_SPIKE_EXIT_CODE`.
"""

from __future__ import annotations

import math
import re
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from infra import runfiles
from infra.atomic_write import atomic_write_json
from infra.runfiles import EXIT_LOSS_SPIKE as LOSS_SPIKE_EXIT_CODE  # the run-directory contract owns exit codes
from training.config import SpikeConfig

SPIKE_LINE_PREFIX = "FORGEFLOW_LOSS_SPIKE"
SPIKE_LINE_RE = re.compile(
    r"FORGEFLOW_LOSS_SPIKE onset_step=(?P<onset_step>-?\d+) "
    r"last_healthy_step=(?P<last_healthy_step>-?\d+) "
    r"loss=(?P<loss>\S+) median=(?P<median>\S+)"
)
_MAD_TO_STD = 1.4826
_NOISE_FLOOR = 0.01  # relative to the median


@dataclass(frozen=True)
class SpikeEvent:
    onset_step: int  # first step of the spike
    last_healthy_step: int  # last step before the onset whose loss was healthy; -1 if none
    detected_step: int  # step at which the spike was confirmed
    loss: float  # loss at the onset step (NaN/inf for a non-finite loss)
    median: float  # baseline median at the onset (NaN if no baseline yet)
    z: float  # robust z-score at the onset (inf for non-finite losses)
    reason: str  # "nonfinite" or "zscore"


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


class LossSpikeDetector:
    """Feed it `update(step, loss)` every logged step; it returns a SpikeEvent once."""

    def __init__(self, cfg: SpikeConfig):
        self.cfg = cfg
        self.baseline: deque[float] = deque(maxlen=cfg.window)
        self.last_healthy_step = -1
        self._pending: dict | None = None  # onset info + count of anomalous updates
        self.event: SpikeEvent | None = None

    def score(self, loss: float) -> tuple[float, float]:
        """(z, median) of `loss` against the current baseline."""
        values = np.fromiter(self.baseline, dtype=np.float64)
        median = float(np.median(values))
        scale = max(_MAD_TO_STD * float(np.median(np.abs(values - median))),
                    _NOISE_FLOOR * abs(median), 1e-12)
        return (loss - median) / scale, median

    def update(self, step: int, loss: float) -> SpikeEvent | None:
        """Record one loss; a SpikeEvent when a spike is confirmed at this step, else None."""
        if self.event is not None or not self.cfg.enabled:
            return None
        loss = float(loss)
        if not math.isfinite(loss):
            median = float(np.median(self.baseline)) if self.baseline else math.nan
            onset = self._pending or {"onset_step": step, "loss": loss, "median": median,
                                      "z": math.inf}
            return self._confirm(step, onset, "nonfinite")
        if len(self.baseline) < self.cfg.min_history:
            self._healthy(step, loss)
            return None
        z, median = self.score(loss)
        if z <= self.cfg.z_threshold:
            self._pending = None  # recovered (or never spiked)
            self._healthy(step, loss)
            return None
        if self._pending is None:
            self._pending = {"onset_step": step, "loss": loss, "median": median, "z": z, "count": 0}
        self._pending["count"] += 1
        if self._pending["count"] >= self.cfg.patience:
            return self._confirm(step, self._pending, "zscore")
        return None

    def _healthy(self, step: int, loss: float) -> None:
        self.baseline.append(loss)
        self.last_healthy_step = step

    def _confirm(self, step: int, onset: dict, reason: str) -> SpikeEvent:
        self.event = SpikeEvent(
            onset_step=int(onset["onset_step"]), last_healthy_step=self.last_healthy_step,
            detected_step=int(step), loss=float(onset["loss"]), median=float(onset["median"]),
            z=float(onset["z"]), reason=reason,
        )
        return self.event

    # Saved with a checkpoint so a resumed run judges spikes against the same baseline.
    def state_dict(self) -> dict:
        return {"baseline": list(self.baseline), "last_healthy_step": self.last_healthy_step,
                "pending": dict(self._pending) if self._pending else None}

    def load_state_dict(self, state: dict) -> None:
        self.baseline = deque(state.get("baseline", []), maxlen=self.cfg.window)
        self.last_healthy_step = int(state.get("last_healthy_step", -1))
        self._pending = dict(state["pending"]) if state.get("pending") else None
        self.event = None


def format_spike_line(event: SpikeEvent) -> str:
    """The one log line announcing a confirmed spike (format in the module doc)."""
    return (f"{SPIKE_LINE_PREFIX} onset_step={event.onset_step} "
            f"last_healthy_step={event.last_healthy_step} "
            f"loss={event.loss:.6g} median={event.median:.6g}")


def parse_spike_line(line: str) -> dict | None:
    """{onset_step, last_healthy_step, loss, median} from a log line, or None."""
    m = SPIKE_LINE_RE.search(line)
    if not m:
        return None
    return {"onset_step": int(m["onset_step"]), "last_healthy_step": int(m["last_healthy_step"]),
            "loss": float(m["loss"]), "median": float(m["median"])}


def write_spike_marker(run_dir: str | Path, event: SpikeEvent) -> Path:
    """Write `{run_dir}/markers/loss_spike.json` atomically (strict JSON: null for NaN/inf).

    Read it with `infra.runfiles.read_spike_marker` (the run-directory contract)."""
    payload = asdict(event)
    for key in ("loss", "median", "z"):
        payload[key] = _finite_or_none(payload[key])
    payload.update(kind="loss_spike", loss_repr=f"{event.loss:.6g}", time=time.time())
    return atomic_write_json(runfiles.spike_marker_path(run_dir), payload, indent=2, allow_nan=False)
