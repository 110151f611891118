"""Metrics for people: TensorBoard event files under the run directory (read back with
TensorBoard's own EventAccumulator), MLflow / W&B only when configured and never fatal."""

from __future__ import annotations

import pytest

from training.config import parse_job_spec
from training.metrics import MetricsLogger, log_eval_scores, open_sinks, tensorboard_dir


def _spec(tmp_path, **metrics):
    return parse_job_spec({"name": "m", "run_dir": str(tmp_path / "run"), "metrics": metrics,
                           "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                     "ffn_hidden_size": 128, "vocab_size": 512, "seq_length": 64},
                           "training": {"global_batch_size": 8, "micro_batch_size": 2, "steps": 10}})


def _scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_rank0_writes_tensorboard_and_a_resume_replaces_the_failed_attempts_steps(tmp_path):
    spec = _spec(tmp_path)
    assert MetricsLogger.open(spec, rank=1).sinks == []  # only rank 0 writes
    first = MetricsLogger.open(spec, rank=0)
    for step in range(1, 7):
        first.step(step, loss=10.0 - step, lr=1e-3, grad_norm=0.5, tokens_per_s=100.0)
    first.checkpoint(4, {"stall_s": 0.25, "wait_s": 0.0, "async": True})
    first.close()
    resumed = MetricsLogger.open(spec, rank=0, first_step=5)  # failed after 6, resumed from 4
    for step in range(5, 9):
        resumed.step(step, loss=100.0 + step, lr=1e-3, grad_norm=None, tokens_per_s=100.0)
    resumed.close()

    scalars = _scalars(tensorboard_dir(spec))
    assert scalars["train/loss"] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (5, 105.0), (6, 106.0),
                                     (7, 107.0), (8, 108.0)]  # steps 5, 6 of the failed attempt purged
    assert [s for s, _ in scalars["train/grad_norm"]] == [1, 2, 3, 4]  # None is not logged
    assert scalars["checkpoint/stall_s"] == [(4, 0.25)]
    assert all(v > 0 for _, v in scalars["memory/host_rss_gib"]) and len(scalars["memory/host_rss_gib"]) == 8
    assert {t for t in scalars} >= {"train/lr", "train/tokens_per_s"}


def test_evaluation_scores_go_to_their_own_run_at_the_training_step(tmp_path):
    spec = _spec(tmp_path)
    assert log_eval_scores(spec, 20, {"arith": {"em": 0.25}, "capitals": {"acc": 0.5}}) == ["tensorboard"]
    log_eval_scores(spec, 40, {"arith": {"em": 0.5}})
    scalars = _scalars(tensorboard_dir(spec, "eval"))
    assert scalars["eval/arith/em"] == [(20, 0.25), (40, 0.5)]
    assert scalars["eval/capitals/acc"] == [(20, 0.5)]


def test_mlflow_and_wandb_only_when_configured_and_never_fatal(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    assert open_sinks(_spec(tmp_path, tensorboard=False), "train") == []  # nothing configured, nothing imported
    # configured (in the spec; by the standard variable), but not installed (a node without the
    # tracking extra; None in sys.modules fails the import): warned, skipped, training goes on
    for name in [m for m in sys.modules if m.split(".")[0] in ("mlflow", "wandb")] + ["mlflow", "wandb"]:
        monkeypatch.setitem(sys.modules, name, None)  # also what an earlier test imported
    spec = _spec(tmp_path, tensorboard=False, mlflow_tracking_uri=f"file:{tmp_path / 'mlruns'}")
    assert open_sinks(spec, "train", environ={"WANDB_PROJECT": "p"}) == []
    err = capsys.readouterr().err
    assert "forgeflow metrics: mlflow disabled (ModuleNotFoundError" in err
    assert "forgeflow metrics: wandb disabled (ModuleNotFoundError" in err


def test_mlflow_file_store_one_run_per_part_continued_by_a_restart(tmp_path, monkeypatch):
    """The real MLflow (the tracking extra) on a `file:` store, which MLflow 3 refuses unless opted
    in: a restarted attempt continues the train part's run, and evaluation scores logged while
    that run is open go to the eval part's own run. (A real training run against MLflow and W&B:
    tests/integration/training/test_tracking_sinks.py.)"""
    pytest.importorskip("mlflow", reason="the tracking extra is not installed")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")  # recorded, so the sink's opt-in is undone after
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    uri = f"file:{tmp_path / 'mlruns'}"
    spec = _spec(tmp_path, tensorboard=False, mlflow_tracking_uri=uri, mlflow_experiment="team")
    first = MetricsLogger.open(spec, rank=0)
    assert [s.name for s in first.sinks] == ["mlflow"]
    for step in (1, 2, 3):
        first.step(step, loss=10.0 - step, lr=1e-3, grad_norm=0.5, tokens_per_s=100.0)
    assert log_eval_scores(spec, 2, {"arith": {"em": 0.25}}) == ["mlflow"]
    first.close()
    resumed = MetricsLogger.open(spec, rank=0, first_step=3)
    resumed.step(3, loss=70.0, lr=1e-3, grad_norm=None, tokens_per_s=100.0)
    resumed.close()

    client = MlflowClient(uri)
    runs = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("team").experiment_id])}
    assert sorted(runs) == ["m-eval", "m-train"]
    assert runs["m-train"].info.status == "FINISHED"
    history = [(m.step, m.value) for m in client.get_metric_history(runs["m-train"].info.run_id, "train/loss")]
    # MLflow's history is append-only: a resumed attempt's replayed step shows both values
    assert sorted(history) == [(1, 9.0), (2, 8.0), (3, 7.0), (3, 70.0)]
    assert [(m.step, m.value) for m in client.get_metric_history(runs["m-eval"].info.run_id, "eval/arith/em")] \
        == [(2, 0.25)]


def test_the_record_checksum_is_tensorboards():
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as reference

    from training.metrics import masked_crc32c

    for data in (b"", b"a", b"123456789", bytes(range(256)) * 3):
        assert masked_crc32c(data) == reference(data)
