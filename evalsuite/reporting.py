"""Results next to the checkpoint, and a model's progress across checkpoints.

For a checkpoint at `ROOT/NAME` (a step directory, or an exported folder) the
results of suite S go to `ROOT/eval/NAME/S.json` through `infra.storage`
(file:// or s3://) — beside the checkpoint rather than inside it, so checkpoint
retention and verification never see foreign files. The catch-up flow treats a
checkpoint as evaluated once that file exists.

Results over time: `write_score_history` keeps `ROOT/eval/scores-S.jsonl`, one
line per (step, dataset, metric), rebuilt from the per-checkpoint files after
each one is written (so two evaluations finishing together cannot lose a line
for good: the next rebuild restores it). `trend_chart_png` draws score against
step per dataset; `trend_markdown` puts that chart inline (a base64 PNG data
URI through infra.charts: the Prefect UI renders it, where it would not load a
file:// image) above a step-by-metric table per dataset, for a Prefect markdown artifact.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

_STEP = re.compile(r"step[-_]?0*(\d+)$")


def split_checkpoint_url(checkpoint: str) -> tuple[str, str]:
    """(root URL, checkpoint name) of a checkpoint URL or path."""
    url = checkpoint.rstrip("/")
    root, _, name = url.rpartition("/")
    return (root or "."), name


def step_of(name: str) -> int | None:
    m = _STEP.search(name)
    return int(m.group(1)) if m else None


def results_key(checkpoint_name: str, suite: str) -> str:
    return f"eval/{checkpoint_name}/{suite}.json"


def write_results_next_to(checkpoint: str, suite: str, payload: dict[str, Any]) -> str:
    from infra.storage import open_storage

    root, name = split_checkpoint_url(checkpoint)
    payload = dict(payload, checkpoint=checkpoint, checkpoint_name=name, step=payload.get("step", step_of(name)))
    storage = open_storage(root)
    try:
        storage.put_bytes(results_key(name, suite), json.dumps(payload, indent=2, sort_keys=True).encode())
        return storage.url(results_key(name, suite))
    finally:
        storage.close()


def has_results(checkpoint: str, suite: str) -> bool:
    from infra.storage import open_storage

    root, name = split_checkpoint_url(checkpoint)
    storage = open_storage(root)
    try:
        return storage.exists(results_key(name, suite))
    finally:
        storage.close()


def load_all_results(root: str, suite: str) -> list[dict[str, Any]]:
    """Every results file of `suite` under `root/eval/`, ordered by training step."""
    from infra.storage import open_storage

    storage = open_storage(root)
    try:
        rows = [json.loads(storage.get_bytes(o.key)) for o in storage.list("eval/") if o.key.endswith(f"/{suite}.json")]
    finally:
        storage.close()
    return sorted(rows, key=lambda r: (r.get("step") is None, r.get("step") or 0, r.get("checkpoint_name", "")))


def scores_key(suite: str) -> str:
    return f"eval/scores-{suite}.jsonl"


def score_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (step, dataset, metric) from per-checkpoint results (load_all_results)."""
    rows = []
    for i, r in enumerate(results):
        step = r.get("step") if r.get("step") is not None else i
        for ds, metrics in sorted(r.get("results", {}).items()):
            for metric, value in sorted(metrics.items()):
                rows.append({"step": step, "checkpoint": r.get("checkpoint", ""), "dataset": ds, "metric": metric,
                             "value": value, "time": r.get("time")})
    return rows


def write_score_history(root: str, suite: str) -> tuple[str, list[dict[str, Any]]]:
    """Rebuild `ROOT/eval/scores-SUITE.jsonl` from every checkpoint's results; (URL, rows)."""
    from infra.storage import open_storage

    rows = score_rows(load_all_results(root, suite))
    storage = open_storage(root)
    try:
        storage.put_bytes(scores_key(suite), "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode())
        return storage.url(scores_key(suite)), rows
    finally:
        storage.close()


def read_score_history(root: str, suite: str) -> list[dict[str, Any]]:
    from infra.storage import open_storage

    storage = open_storage(root)
    try:
        if not storage.exists(scores_key(suite)):
            return []
        return [json.loads(line) for line in storage.get_bytes(scores_key(suite)).decode().splitlines() if line]
    finally:
        storage.close()


# Counts, not scores: they would dwarf the scores on a shared axis.
_NOT_SCORES = {"tokens"}


def trend_chart_png(rows: list[dict[str, Any]], title: str = "") -> bytes | None:
    """Score against training step, one panel per dataset (a line per metric); PNG bytes."""
    panels: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for r in rows:
        if r["metric"] not in _NOT_SCORES:
            panels.setdefault(r["dataset"], {}).setdefault(r["metric"], []).append((r["step"], r["value"]))
    if not panels:
        return None
    from matplotlib.ticker import MaxNLocator

    from infra.charts import figure_png, new_figure

    n = len(panels)
    cols = min(3, n)
    rows_n = (n + cols - 1) // cols
    fig, axes = new_figure((4.0 * cols, 2.8 * rows_n), rows_n, cols, squeeze=False)
    for ax, (dataset, metrics) in zip(axes.flat, sorted(panels.items())):
        for metric, points in sorted(metrics.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=metric)
        ax.set_title(dataset, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # steps are whole numbers
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return figure_png(fig, dpi=90)


def trend_markdown(rows: list[dict[str, Any]], title: str) -> str:
    """Markdown for a Prefect artifact: the trend chart inline, then score by step, one
    table per dataset (step x its metrics): one table of every dataset's metrics grows
    wider than the artifact and its last columns are cut off."""
    from infra.charts import markdown_image

    lines = [f"## {title}", ""]
    png = trend_chart_png(rows, title)
    if png:
        lines += [markdown_image("score vs step", png), ""]
    by_dataset: dict[str, dict[Any, dict[str, float]]] = {}
    for r in rows:
        if r["metric"] not in _NOT_SCORES:
            by_dataset.setdefault(r["dataset"], {}).setdefault(r["step"], {})[r["metric"]] = r["value"]
    for dataset, by_step in sorted(by_dataset.items()):
        metrics = sorted({m for values in by_step.values() for m in values})
        lines += [f"**{dataset}**", "", "| step | " + " | ".join(metrics) + " |", "|---:|" + "---:|" * len(metrics)]
        for step in sorted(by_step):
            cells = [f"{by_step[step][m]:.4g}" if m in by_step[step] else "" for m in metrics]
            lines.append(f"| {step} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def results_table(results: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    return [{"dataset": ds, "metric": m, "value": round(v, 6)}
            for ds, metrics in sorted(results.items()) for m, v in sorted(metrics.items())]
