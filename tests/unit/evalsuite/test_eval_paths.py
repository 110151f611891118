"""Where an evaluation writes: its export, trials and results under the job's own run
directory, named by step and suite; the runtime history in the state directory
($FORGEFLOW_STATE_DIR, the state database's folder), never in the home directory when the
state directory is elsewhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from checkpoint.manifest import CheckpointRef
from training.config import parse_job_spec

MODEL = {"num_layers": 1, "hidden_size": 8, "num_attention_heads": 1, "vocab_size": 16, "seq_length": 4}


def _spec(name: str, tmp_path: Path):
    return parse_job_spec({"name": name, "model": MODEL, "training": {"global_batch_size": 1, "steps": 1},
                           "run_dir": str(tmp_path / "runs" / name),
                           "checkpoint": {"url": "s3://shared-bucket/checkpoints"}})


def test_evaluation_output_lives_under_the_jobs_run_directory_named_by_step_and_suite(tmp_path):
    from evalsuite.checkpoints import eval_output_dir

    a, b = _spec("job-a", tmp_path), _spec("job-b", tmp_path)
    ref = CheckpointRef("s3://shared-bucket/checkpoints", 40)
    assert eval_output_dir(ref, "quick", a) == tmp_path / "runs" / "job-a" / "eval" / "step-00000040-quick"
    # two jobs' checkpoints at one step never share a folder
    assert eval_output_dir(ref, "quick", a) != eval_output_dir(ref, "quick", b)
    assert eval_output_dir(ref, "full", a).name == "step-00000040-full"
    # an exported folder evaluated without a job spec: named by the folder
    assert eval_output_dir("s3://models/llama-hf/", "quick", None) == Path("runs/eval/llama-hf-quick")


def test_runtime_history_is_kept_in_the_state_directory(tmp_path, monkeypatch):
    from evalsuite.history import RuntimeHistory
    from infra.statedb.url import database_url

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("FORGEFLOW_STATE_DIR", str(tmp_path / "state"))
    history = RuntimeHistory()
    history.record_inference("arith-em", "transformers", "0.5M", samples=10, seconds=2.0)
    history.save()
    assert history.path == tmp_path / "state" / "eval-runtime-history.json"
    assert json.loads(history.path.read_text())["arith-em|transformers|0.5M"]["gpu_s_per_sample"] == 0.2
    assert not home.exists()   # nothing written to the home directory

    # Unset: the same folder as the state database (~/.forgeflow/state), not a second one.
    monkeypatch.delenv("FORGEFLOW_STATE_DIR")
    default = RuntimeHistory().path
    assert default == home / ".forgeflow" / "state" / "eval-runtime-history.json"
    assert database_url().endswith(str(default.parent / "forgeflow.db"))


@pytest.mark.parametrize("bad", [{"url": "s3://b/c"}, {"url": "s3://b/c", "step": "x"}])
def test_a_bad_checkpoint_reference_is_one_config_error(bad):
    from evalsuite.checkpoints import checkpoint_to_evaluate
    from evalsuite.errors import EvalConfigError

    with pytest.raises(EvalConfigError, match="checkpoint reference"):
        checkpoint_to_evaluate(bad, None)
