"""`forgeflow finetune` end to end on CPU, from a tiny checkpoint the project exports (megatron model ->
training.export's HF folder): plan, profile, partition, map, run 2 workers, checkpoint, result file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.slow
def test_forgeflow_finetune_end_to_end_on_cpu(tmp_path, repo_root):
    subprocess.run([sys.executable, str(HERE / "export_tiny.py"), str(tmp_path / "export")], check=True,
                   cwd=repo_root, capture_output=True, timeout=600)
    model_dir = tmp_path / "export" / "hf"
    assert json.loads((model_dir / "forgeflow.json").read_text())["job"] == "tiny-offload-test"
    spec = tmp_path / "ft.yaml"
    spec.write_text(f"""name: ft-tiny
model_dir: {model_dir}
training: {{steps: 5, micro_batch_size: 1, microbatches: 4, seq_length: 32, lr: 1.0e-3}}
offload: {{workers: 2, device_budget_mib: 0.8, time_limit_s: 5}}
data: {{kind: random, distinct_batches: 1}}
run_dir: {tmp_path / 'run'}
""")
    env = dict(os.environ, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="300")
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "finetune", str(spec), "--no-eval"], cwd=repo_root,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "run" / "finetune.json").read_text())
    budget = result["device_budget_bytes"]
    assert budget < result["model_bytes"]  # the model does not fit one "device"
    assert all(0 < p <= budget for p in result["device_peak_bytes"])
    assert result["partition"]["num_stages"] >= 2
    assert len(result["losses"]) == 5 and result["losses"][-1] < result["losses"][0]
    from checkpoint.manifest import committed_checkpoints

    assert [c.step for c in committed_checkpoints(result["checkpoint_url"])] == [5]
    from transformers import LlamaForCausalLM

    assert LlamaForCausalLM.from_pretrained(result["finetuned_model"]).config.num_hidden_layers == 6


def test_a_bad_finetune_spec_is_one_clear_error(tmp_path, repo_root):
    spec = tmp_path / "bad.yaml"
    spec.write_text(f"name: x\nmodel_dir: {tmp_path / 'nowhere'}\ntraining: {{steps: 1, seq_length: 8}}\n")
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "finetune", str(spec)], cwd=repo_root,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "not a Hugging Face model folder" in proc.stderr and "Traceback" not in proc.stderr
