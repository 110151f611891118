"""`forgeflow` commands: a config error is one line on stderr and exit code 2 for every
command (no traceback, not even from inside Prefect); `--json` prints one JSON object."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.cli import main

ROOT = Path(__file__).resolve().parents[3]
BAD_SPEC = "name: bad\nmodel:\n  layers: 2\ntraining:\n  global_batch_size: 8\n  steps: 5\n"


@pytest.fixture
def bad_spec(tmp_path) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD_SPEC)
    return path


def _argvs(spec: Path, tmp_path: Path) -> dict[str, list[str]]:
    return {
        "prepare": ["prepare", str(spec)],
        "train": ["train", str(spec)],
        "export": ["export", str(tmp_path / "ck"), str(tmp_path / "hf"), "--config", str(spec)],
        "pretrain": ["pretrain", str(spec)],
        "eval": ["eval", str(tmp_path / "hf"), "--suite", "arith-em", "--config", str(spec)],
        "plan": ["plan", str(spec)],
    }


@pytest.mark.parametrize("command", ["prepare", "train", "export", "pretrain", "eval", "plan"])
def test_a_bad_job_spec_is_one_line_naming_the_field_and_the_fix(command, bad_spec, tmp_path, capsys):
    assert main(_argvs(bad_spec, tmp_path)[command]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("error: ") and "model.layers" in err[0] and "fix:" in err[0]
    assert "did you mean 'num_layers'" in err[0]


@pytest.mark.parametrize("command", ["prepare", "train", "export", "pretrain", "eval", "plan"])
def test_json_errors_are_one_object_on_stdout(command, bad_spec, tmp_path, capsys):
    assert main(_argvs(bad_spec, tmp_path)[command] + ["--json"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["exit_code"] == 2 and "model.layers" in out["error"]


def test_a_bad_drill_or_cluster_file_stops_pretrain_before_prefect(tmp_path, capsys, repo_root):
    spec = str(repo_root / "configs" / "tiny-cpu.yaml")
    assert main(["pretrain", spec, "--drill", "cuda_error"]) == 2
    assert "expected kind@step[:rank]" in capsys.readouterr().err
    (tmp_path / "cluster.yaml").write_text("name: c\nnodes: [{name: n1, gpu: nope}]\n")
    assert main(["pretrain", spec, "--cluster", str(tmp_path / "cluster.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nodes[" in err[0], err


def test_pretrain_with_a_bad_spec_prints_no_traceback(bad_spec):
    """The installed entry point as a user runs it (before: a Prefect flow-run traceback)."""
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "pretrain", str(bad_spec)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith(f"error: {bad_spec}: invalid job spec")


def test_prepare_json_reports_the_prepared_data(tiny_data_dir, tmp_path, capsys):
    from tests.tiny_job import TINY_DATA, TINY_MODEL

    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "tiny-json", "model": TINY_MODEL, "data": {**TINY_DATA, "data_dir": str(tiny_data_dir)},
        "training": {"global_batch_size": 8, "micro_batch_size": 2, "steps": 1}}))
    assert main(["prepare", str(spec), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)  # nothing but the object on stdout
    assert out["reused"] is True and out["data_dir"] == str(tiny_data_dir)
    assert out["train_tokens"] > 0 and out["vocab_size"] >= out["tokenizer_vocab_size"] > 0


def test_pretrain_result_json_is_plain_json():
    from diagnosis.recovery import FailedAttempt
    from flows.commands import pretrain_result_json
    from flows.pretrain import PretrainResult

    failure = FailedAttempt(2, "failed", 60, "CUDAError", "infrastructure", "rule", "restart", "a restart helps",
                            3.2, 1.0, 2.0, 3.0)
    result = PretrainResult(job="tiny", finished=True, attempts=3, final_step=200, failures=[failure])
    payload = json.loads(json.dumps(pretrain_result_json(result)))
    assert payload["finished"] is True and payload["final_step"] == 200 and payload["attempts"] == 3
    assert payload["failures"][0]["root_cause"] == "CUDAError" and payload["failures"][0]["action"] == "restart"
