"""Results next to the checkpoint, and a model's progress across checkpoints.

For a checkpoint at `ROOT/NAME` (a step directory, or an exported folder) the
results of suite S go to `ROOT/eval/NAME/S.json` through `infra.storage`
(file:// or s3://) — beside the checkpoint rather than inside it, so checkpoint
retention and verification never see foreign files. The catch-up flow treats a
checkpoint as evaluated once that file exists; `plot_progress` reads them all
and draws each metric against the training step.
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


def results_table(results: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    return [{"dataset": ds, "metric": m, "value": round(v, 6)}
            for ds, metrics in sorted(results.items()) for m, v in sorted(metrics.items())]


def plot_progress(rows: list[dict[str, Any]], out_png: str | Path) -> Path | None:
    """One panel per (dataset, metric): value against step (or checkpoint order)."""
    series: dict[str, list[tuple[float, float]]] = {}
    for i, row in enumerate(rows):
        x = row.get("step") if row.get("step") is not None else i
        for ds, metrics in row.get("results", {}).items():
            for metric, value in metrics.items():
                if metric != "tokens":
                    series.setdefault(f"{ds} · {metric}", []).append((x, value))
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(series)
    cols = min(3, n)
    rows_n = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.0 * rows_n), squeeze=False)
    for ax, (name, points) in zip(axes.flat, sorted(series.items())):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return out_png
