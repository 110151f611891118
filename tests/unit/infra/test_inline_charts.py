"""Charts that render in the Prefect UI: each artifact's markdown carries its picture as an
inline PNG data URI (a browser never loads file:// images), and the PNG decodes.
(The real-browser check is tests/ui_check.py, run by hand.)"""

from __future__ import annotations

import io

import pytest

from infra.charts import inline_pngs, markdown_image, png_data_uri
from training.runlog import format_event_line, format_step_line


def _decoded_size(png: bytes) -> tuple[int, int]:
    from PIL import Image

    with Image.open(io.BytesIO(png)) as image:
        image.load()  # decodes every pixel: a truncated or corrupt PNG raises
        return image.size


def _one_inline_png(markdown: str) -> bytes:
    pngs = inline_pngs(markdown)
    assert len(pngs) == 1, markdown[:300]
    width, height = _decoded_size(pngs[0])
    assert width > 200 and height > 100
    return pngs[0]


def test_a_non_png_is_refused():
    with pytest.raises(ValueError, match="not a PNG"):
        png_data_uri(b"GIF89a...")
    assert inline_pngs("![x](file:///tmp/x.png)") == []


def _write_log(path, lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def _steps(first, last, loss=3.0, spike_from=None):
    return [format_step_line(0, s, loss * (8 if spike_from and s >= spike_from else 1) - 0.01 * s, 1e-4, 0.5,
                             1000.0, float(s)) for s in range(first, last + 1)]


def test_loss_curve_marks_attempts_failures_and_rollbacks(tmp_path):
    from training.loss_chart import attempts_from_log, loss_curve_report

    log = tmp_path / "logs" / "rank0.log"
    _write_log(log, [
        *_steps(1, 4), format_event_line(0, "checkpoint_saved", step=4), *_steps(5, 6),    # fails at 6
        format_event_line(0, "resumed", step=4), *_steps(5, 8), format_event_line(0, "checkpoint_saved", step=8),
        *_steps(9, 10, spike_from=9), format_event_line(0, "loss_spike", onset_step=9),    # spikes
        format_event_line(0, "resumed", step=8, skipped_batches=2), *_steps(9, 12),
        format_event_line(0, "finished", step=12),
        "torchrun noise that is not a run-log line",
    ])
    attempts = attempts_from_log(log)
    assert [(a.resumed_from, a.records[0].step, a.last_step, a.ended) for a in attempts] == [
        (None, 1, 6, ""), (4, 5, 10, ""), (8, 9, 12, "finished")]
    assert [a.rollback_from for a in attempts] == [None, None, 10]  # after the spike: rolled back
    assert attempts[1].spike_onset == 9 and attempts[1].checkpoints == [8]

    report = loss_curve_report(log, "tiny", ["CudaError: restart in place", "LossSpike: roll back"],
                               png_path=tmp_path / "loss_curve.png")
    png = _one_inline_png(report.markdown)
    assert (tmp_path / "loss_curve.png").read_bytes() == png
    assert "file://" not in report.markdown
    assert "| 2 | checkpoint 8 (rollback from step 10) | 9–12 | finished |" in report.markdown
    assert "3 attempt(s), 2 failed" in report.summary


def test_a_restart_before_any_checkpoint_is_a_new_attempt(tmp_path):
    from training.loss_chart import attempts_from_log, loss_curve_report

    log = tmp_path / "rank0.log"
    _write_log(log, [*_steps(1, 3), *_steps(1, 5), format_event_line(0, "finished", step=5)])
    assert [(a.resumed_from, a.last_step) for a in attempts_from_log(log)] == [(None, 3), (None, 5)]
    empty = tmp_path / "empty.log"
    empty.write_text("no steps yet\n")
    assert loss_curve_report(empty, "tiny") is None


def test_placement_picture_is_inline(tmp_path):
    from scheduler.cluster import Cluster
    from scheduler.placement import build_placement
    from scheduler.placement_chart import placement_markdown

    cluster = Cluster.model_validate({"name": "c", "nodes": [
        {"name": "n0", "gpu_type": "A100-40G", "gpu_count": 4, "pcie_root_complex": [0, 0, 1, 1]},
        {"name": "n1", "gpu_type": "A100-40G", "gpu_count": 4, "free_gpus": [0, 1]},
        {"name": "n2", "gpu_type": "A100-40G", "gpu_count": 4, "cordoned": True}]})
    placement = build_placement(cluster, {"n0": 4, "n1": 2}, job="j", gpu_type="A100-40G", dp=1, tp=2, pp=3)
    markdown = placement_markdown(placement, cluster)
    _one_inline_png(markdown)
    assert "| n1 | 0, 1 | 4, 5 | 2, 2 |" in markdown and '"world_size": 6' in markdown


def test_evaluation_trend_is_inline():
    from evalsuite.reporting import trend_markdown

    rows = [{"step": s, "dataset": "arith", "metric": "em", "value": v} for s, v in ((10, 0.1), (20, 0.3))]
    markdown = trend_markdown(rows, "job: quick scores")
    png = _one_inline_png(markdown)
    assert markdown_image("score vs step", png) in markdown
