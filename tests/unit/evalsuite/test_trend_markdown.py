"""The trend artifact's tables stay narrow: one per dataset, step by that dataset's metrics."""

from __future__ import annotations

from evalsuite.reporting import trend_markdown

METRICS = {"arith-em": ["exact_match"], "capitals-mc": ["accuracy", "accuracy_norm"],
           "python-keywords-mc": ["accuracy", "accuracy_norm"]}


def _rows() -> list[dict]:
    return [{"step": step, "dataset": ds, "metric": m, "value": 0.1 * i + step / 100}
            for step in (10, 20, 30) for ds, metrics in METRICS.items() for i, m in enumerate(metrics + ["tokens"])]


def test_one_table_per_dataset_with_every_step_and_no_counts():
    markdown = trend_markdown(_rows(), "job: quick scores")
    tables = [block for block in markdown.split("\n\n") if block.startswith("| step |")]
    assert len(tables) == len(METRICS)
    for (dataset, metrics), table in zip(sorted(METRICS.items()), tables):
        header, rule, *body = table.splitlines()
        assert header == "| step | " + " | ".join(metrics) + " |"  # no "tokens": a count, not a score
        assert [row.split(" | ")[0] for row in body] == ["| 10", "| 20", "| 30"]
        assert all(row.count("|") == len(metrics) + 2 for row in body)  # every metric's cell, the last too
        assert f"**{dataset}**" in markdown
    assert "| 30 | 0.3 | 0.4 |" in markdown  # capitals-mc at step 30: accuracy, accuracy_norm
