"""The MLflow and W&B sinks against the real packages (the `tracking` extra), on a real run.

One training run (a world of one, `python -m training.train`, 6 steps, checkpoints at 3 and 6)
is configured with both: MLflow on a sqlite store in tmp_path, W&B with WANDB_MODE=offline.
Two evaluations then publish their scores in this process, the later checkpoint's first (as a
load-balanced evaluation may finish). What each store holds is read back with the store's own
reader (MlflowClient; W&B's record protobufs from the offline `.wandb` file) and compared with
the run log, step for step. No server, no network.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra import runfiles
from training.runlog import read_steps
from tests.integration.training.test_worker import REPO, TIMEOUT_S, explain, write_spec

pytest.importorskip("mlflow", reason="the tracking extra is not installed")
pytest.importorskip("wandb", reason="the tracking extra is not installed")

PROJECT = "forgeflow-test"
EVAL_SCORES = {6: {"arith": {"em": 0.5}, "capitals": {"acc": 0.75}}, 3: {"arith": {"em": 0.25}}}


def _offline_wandb_env(home: Path) -> dict[str, str]:
    """W&B offline and quiet, its config/cache under `home`; nothing from the caller's tracking setup."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("WANDB_", "MLFLOW_"))}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_CONFIG_DIR=str(home / "config"),
               WANDB_CACHE_DIR=str(home / "cache"), WANDB_DATA_DIR=str(home / "data"))
    return env


@pytest.fixture(scope="module")
def tracked_run(tiny_job_dict, tiny_prepared, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tracked")
    uri = f"sqlite:///{tmp / 'mlflow' / 'mlflow.db'}"  # its folder does not exist yet: the sink makes it
    spec_path = write_spec(tiny_job_dict, tmp, "tracked", training={"steps": 6}, checkpoint={"interval": 3},
                           metrics={"mlflow_tracking_uri": uri, "wandb_project": PROJECT})
    env = _offline_wandb_env(tmp / "wandb-home")
    proc = subprocess.run([sys.executable, "-m", "training.train", str(spec_path)], cwd=REPO,
                          env={**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, explain(proc)
    assert "forgeflow metrics:" not in proc.stderr, explain(proc)  # no sink was dropped
    assert "Traceback" not in proc.stderr, explain(proc)

    # the evaluation's path (tasks.eval_tasks.publish_results), here in-process
    import yaml

    from training.config import parse_job_spec
    from training.metrics import log_eval_scores

    spec = parse_job_spec(yaml.safe_load(spec_path.read_text()))
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith(("WANDB_", "MLFLOW_"))]:
            mp.delenv(key)
        for key, value in env.items():
            if key.startswith("WANDB_"):
                mp.setenv(key, value)
        mp.setenv("WANDB_CONSOLE", "off")  # leave pytest's capture of this process alone
        for step, results in EVAL_SCORES.items():
            assert log_eval_scores(spec, step, results) == ["tensorboard", "mlflow", "wandb"]
    logged = read_steps(runfiles.log_path(spec.resolved_run_dir, 0))
    assert [r.step for r in logged] == list(range(1, 7))
    return {"uri": uri, "experiment": spec.name, "run_dir": spec.resolved_run_dir, "logged": logged}


def test_mlflow_holds_the_runs_metrics_step_for_step(tracked_run):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracked_run["uri"])
    experiment = client.get_experiment_by_name(tracked_run["experiment"])
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert sorted(runs) == ["tracked-eval", "tracked-train"]  # one run per part: both evaluations in one
    train = runs["tracked-train"]
    assert train.info.status == "FINISHED"

    def history(run, key):
        return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))

    logged = tracked_run["logged"]
    loss = history(train, "train/loss")
    assert [s for s, _ in loss] == [r.step for r in logged]
    assert [v for _, v in loss] == pytest.approx([r.loss for r in logged], rel=1e-7)
    assert [v for _, v in history(train, "train/lr")] == pytest.approx([r.lr for r in logged], rel=1e-3)
    for key in ("train/grad_norm", "train/tokens_per_s", "memory/host_rss_gib"):
        values = history(train, key)
        assert len(values) == 6 and all(v > 0 for _, v in values), key
    assert [s for s, _ in history(train, "checkpoint/stall_s")] == [3, 6]

    evals = runs["tracked-eval"]
    assert history(evals, "eval/arith/em") == [(3, 0.25), (6, 0.5)]
    assert history(evals, "eval/capitals/acc") == [(6, 0.75)]


def _wandb_records(path: Path):
    """The records of a `.wandb` file, parsed with wandb's own protobufs. The framing is LevelDB's
    log format behind W&B's 7-byte header (":W&B", magic 0xBEE1, version 0): 32 KiB blocks of
    chunks, each a 7-byte header (CRC-32C, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), data[:7]
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # a block's zero-filled tail
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _wandb_history(run_dir: Path, run_id: str) -> tuple[list[dict], list[str]]:
    """Every history row of the offline runs with this id (oldest first), and their projects."""
    rows, projects = [], []
    files = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb"),
                   key=lambda p: p.stat().st_mtime_ns)  # a resume in the same second: `{id}-1`
    assert files, sorted(p.name for p in (run_dir / "wandb").iterdir())
    for path in files:
        # W&B's service writes the file behind run.finish(): seen in CI, finish() returned before the
        # train run's history rows were on disk (they were there a minute later). Its last record
        # is the run's exit record: read the file once that is there.
        deadline = time.monotonic() + 60
        while not any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(path)):
            assert time.monotonic() < deadline, f"{path} has no exit record 60 s after run.finish()"
            time.sleep(0.2)
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                assert record.run.run_id == run_id
                projects.append(record.run.project)
            elif kind == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows, projects


def test_wandb_offline_run_holds_the_runs_metrics_step_for_step(tracked_run):
    run_dir, logged = tracked_run["run_dir"], tracked_run["logged"]
    rows, projects = _wandb_history(run_dir, "tracked-train")  # under RUN_DIR/wandb, one run per job
    assert projects == [PROJECT]

    def series(key):
        return [(row["step"], row[key]) for row in rows if key in row]

    loss = series("train/loss")
    assert [s for s, _ in loss] == [r.step for r in logged]
    assert [v for _, v in loss] == pytest.approx([r.loss for r in logged], rel=1e-7)
    assert [v for _, v in series("train/lr")] == pytest.approx([r.lr for r in logged], rel=1e-3)
    for key in ("train/grad_norm", "train/tokens_per_s", "memory/host_rss_gib"):
        values = series(key)
        assert len(values) == 6 and all(v > 0 for _, v in values), key
    assert [s for s, _ in series("checkpoint/stall_s")] == [3, 6]

    # both evaluations, the later checkpoint's first: neither is dropped for its step
    rows, _ = _wandb_history(run_dir, "tracked-eval")
    assert [(row["step"], row["eval/arith/em"]) for row in rows] == [(6, 0.5), (3, 0.25)]
    assert [row.get("eval/capitals/acc") for row in rows] == [0.75, None]


def test_wandb_eval_scores_go_to_their_own_run_while_training_is_open_in_the_process(tmp_path, monkeypatch):
    """wandb.init, by default, hands a process's open run back to a second init: the eval part
    would log into the train part's run."""
    from training.config import parse_job_spec
    from training.metrics import MetricsLogger, log_eval_scores

    for key in [k for k in os.environ if k.startswith(("WANDB_", "MLFLOW_"))]:
        monkeypatch.delenv(key)
    for key, value in _offline_wandb_env(tmp_path / "wandb-home").items():
        if key.startswith("WANDB_"):
            monkeypatch.setenv(key, value)
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    spec = parse_job_spec({"name": "inproc", "run_dir": str(tmp_path / "run"),
                           "metrics": {"tensorboard": False, "wandb_project": PROJECT},
                           "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                     "ffn_hidden_size": 128, "vocab_size": 512, "seq_length": 64},
                           "training": {"global_batch_size": 8, "micro_batch_size": 2, "steps": 4}})
    train = MetricsLogger.open(spec, rank=0)
    train.step(1, loss=9.0, lr=1e-3, grad_norm=0.5, tokens_per_s=100.0)
    assert log_eval_scores(spec, 1, {"arith": {"em": 0.25}}) == ["wandb"]
    train.step(2, loss=8.0, lr=1e-3, grad_norm=0.5, tokens_per_s=100.0)
    train.close()

    rows, _ = _wandb_history(spec.resolved_run_dir, "inproc-train")
    assert [(row["step"], row["train/loss"]) for row in rows] == [(1, 9.0), (2, 8.0)]
    assert not any(key.startswith("eval/") for row in rows for key in row)
    rows, _ = _wandb_history(spec.resolved_run_dir, "inproc-eval")
    assert [(row["step"], row["eval/arith/em"]) for row in rows] == [(1, 0.25)]
