"""The loss curve of a run, attempt by attempt, read from rank 0's run log.

Everything is in the log (training.runlog): step lines, and the events `resumed step=R`,
`checkpoint_saved step=C`, `loss_spike onset_step=O`, `stopped`, `finished`. A restart
appends to the same log, so the log splits into attempts: a new attempt starts at a
`resumed` event, or where the step count falls back (a restart with no checkpoint yet).
An attempt that ends without `finished` or `stopped` failed. It resumed by *rollback*
when the attempt before it spiked (back to a healthy checkpoint, past the spike's
batches) or when it started before the newest checkpoint saved so far.

The picture: one line per attempt (replayed steps overlap the failed attempt's),
failures as red crosses labelled with what the flow diagnosed, rollbacks as arrows back
to the checkpoint resumed from, checkpoints as ticks on the step axis.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from training.runlog import LogFormatError, StepRecord, parse_line, parse_step_line


@dataclass
class AttemptLog:
    """One attempt's part of the rank log."""

    index: int
    resumed_from: int | None  # the checkpoint step it resumed from (None: from scratch)
    records: list[StepRecord] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)
    spike_onset: int | None = None
    ended: str = ""  # "finished", "stopped", or "" (failed, or still running)
    rollback_from: int | None = None  # the failed step it rolled back from (after a spike, or to a
    #                                   checkpoint older than the newest saved)

    @property
    def last_step(self) -> int | None:
        return self.records[-1].step if self.records else None


def attempts_from_log(path: str | Path) -> list[AttemptLog]:
    """Split a rank log into attempts (see the module docstring); lines that are not run-log
    lines are skipped. Attempts that logged nothing at all are left out."""
    attempts: list[AttemptLog] = []
    current: AttemptLog | None = None

    def start(resumed_from: int | None) -> AttemptLog:
        nonlocal current
        if current is not None and (current.records or current.ended):
            attempts.append(current)
        current = AttemptLog(len(attempts), resumed_from)
        return current

    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            parsed = parse_line(line)
            record = parse_step_line(line)
        except (LogFormatError, ValueError):
            continue
        event = parsed.event
        if event == "resumed":
            start(int(parsed.fields.get("step", 0)))
        elif record is not None:
            if current is None or current.ended or (current.records and record.step <= current.records[-1].step):
                start(None)
            current.records.append(record)
        elif current is None:
            continue
        elif event == "checkpoint_saved" and "step" in parsed.fields:
            current.checkpoints.append(int(parsed.fields["step"]))
        elif event == "loss_spike":
            current.spike_onset = int(parsed.fields.get("onset_step", 0)) or None
        elif event in ("finished", "stopped"):
            current.ended = event
    if current is not None and (current.records or current.ended):
        attempts.append(current)
    saved: list[int] = []
    for prev, attempt in zip([None] + attempts, attempts):
        newest = max(saved, default=None)
        if attempt.resumed_from is not None and prev is not None and prev.last_step is not None and (
                prev.spike_onset is not None or (newest is not None and attempt.resumed_from < newest)):
            attempt.rollback_from = prev.last_step
        saved += attempt.checkpoints
    return attempts


def loss_curve_png(attempts: list[AttemptLog], title: str = "", failure_labels: list[str] | None = None) -> bytes | None:
    """The loss curve as PNG bytes (None when no step was logged).

    `failure_labels` (the flow's diagnoses, oldest first) label the last failed attempts,
    newest with newest: earlier failed attempts in the log (an earlier flow run) stay unlabelled."""
    if not any(a.records for a in attempts):
        return None
    from infra.charts import figure_png, new_figure

    fig, ax = new_figure((9.0, 3.8))
    colors = ["#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#bcbd22"]
    failed = [a for a in attempts if not a.ended]  # drawn after the run: the last one ended too
    labels = dict(zip(reversed([a.index for a in failed]), reversed(failure_labels or [])))
    last = max(a.last_step or 0 for a in attempts)
    for a in attempts:
        if not a.records:
            continue
        steps, losses = [r.step for r in a.records], [r.loss for r in a.records]
        start = f"from step {a.resumed_from}" if a.resumed_from is not None else "from scratch"
        ax.plot(steps, losses, lw=1.3, color=colors[a.index % len(colors)],
                label=f"attempt {a.index} ({start})")
        if a in failed:
            ax.plot(steps[-1], losses[-1], "x", color="#d62728", ms=10, mew=2.5, zorder=5)
            text = labels.get(a.index, "failed")
            text = text if len(text) <= 48 else text[:47] + "…"
            right = steps[-1] > 0.6 * last  # keep the label inside the axes
            ax.annotate(text, (steps[-1], losses[-1]), xytext=(-6 if right else 6, 8), textcoords="offset points",
                        fontsize=8, color="#d62728", ha="right" if right else "left")
        if a.spike_onset is not None:
            ax.axvline(a.spike_onset, color="#ff7f0e", ls=":", lw=1)
    for prev, a in zip(attempts, attempts[1:]):
        if a.rollback_from is not None and prev.records and a.resumed_from is not None:
            y = prev.records[-1].loss
            ax.annotate("", xy=(a.resumed_from, y), xytext=(prev.records[-1].step, y),
                        arrowprops=dict(arrowstyle="->", color="#ff7f0e", lw=1.5, ls="--"))
            ax.annotate(f"rollback to {a.resumed_from}", (a.resumed_from, y), xytext=(2, -12),
                        textcoords="offset points", fontsize=8, color="#ff7f0e", ha="left")
    checkpoints = sorted({c for a in attempts for c in a.checkpoints})
    if checkpoints:
        ax.plot(checkpoints, [0.0] * len(checkpoints), "^", color="grey", ms=6, clip_on=False,
                transform=ax.get_xaxis_transform(), label="checkpoint saved")
    ax.margins(y=0.18)  # head room for the labels of failures at the top (a spike)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if title:
        ax.set_title(title, fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # beside, never over
    fig.tight_layout()
    return figure_png(fig)


@dataclass(frozen=True)
class LossCurveReport:
    markdown: str  # the chart inline (a PNG data URI), then a table of the attempts
    png: bytes
    summary: str  # one line, e.g. for an artifact's description


def loss_curve_report(log: str | Path, job: str, failure_labels: list[str] | None = None,
                      png_path: str | Path | None = None) -> LossCurveReport | None:
    """The loss curve of rank log `log` as markdown for a Prefect artifact (the picture inline,
    so the UI renders it), also written to `png_path` if given; None when no step was logged."""
    from infra.charts import markdown_image

    attempts = attempts_from_log(log)
    png = loss_curve_png(attempts, f"{job}: training loss", failure_labels)
    if png is None:
        return None
    if png_path is not None:
        Path(png_path).write_bytes(png)
    last = next(a.records[-1] for a in reversed(attempts) if a.records)
    rows = []
    for a in attempts:
        start = "scratch" if a.resumed_from is None else f"checkpoint {a.resumed_from}"
        if a.rollback_from is not None:
            start += f" (rollback from step {a.rollback_from})"
        logged = f"{a.records[0].step}–{a.last_step}" if a.records else ""
        rows.append(f"| {a.index} | {start} | {logged} | {a.ended or 'failed'} |")
    markdown = (f"## {job}: loss curve\n\n{markdown_image('loss curve', png)}\n\n"
                f"Last logged step {last.step}: loss {last.loss:.4f}\n\n"
                "| attempt | started from | steps logged | ended |\n|---:|---|---|---|\n" + "\n".join(rows)
                + (f"\n\nFile: `{Path(png_path).resolve()}`" if png_path is not None else ""))
    failed = sum(1 for a in attempts if not a.ended)
    return LossCurveReport(markdown, png, f"Loss curve of {job}: {len(attempts)} attempt(s), {failed} failed, "
                                          f"last step {last.step} loss {last.loss:.4f}")
