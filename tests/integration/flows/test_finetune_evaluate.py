"""The finetune flow's last step: the fine-tuned folder goes through the evaluation flow.

Lean on purpose (one worker, one step, one tiny dataset): the end-to-end CLI test in
tests/integration/finetune/ covers the offloaded run itself with `--no-eval`. It lives
here to share this folder's session Prefect API instead of starting another server."""

from __future__ import annotations

import json

SUITE = """
name: ft-eval
slots: 1
backend_options: {batch_size: 8, device: cpu, torch_threads: 1}
datasets:
  - name: arith-em
    options: {limit: 3}
"""


def test_finetune_evaluates_the_finetuned_model_through_the_evaluation_flow(prefect_api, tmp_path):
    from testing.tiny_checkpoint import make_tiny_checkpoint
    from flows.finetune import finetune

    model_dir = make_tiny_checkpoint(tmp_path / "hf", vocab_size=320, hidden=32, layers=2, val_tokens=512)
    (tmp_path / "suite.yaml").write_text(SUITE)
    spec = tmp_path / "ft.yaml"
    spec.write_text(f"""name: ft-eval
model_dir: {model_dir}
training: {{steps: 1, micro_batch_size: 1, microbatches: 2, seq_length: 16, lr: 1.0e-3}}
offload: {{workers: 1, device_budget_mib: 4, time_limit_s: 5}}
data: {{kind: random, distinct_batches: 1}}
eval_suite: {tmp_path / 'suite.yaml'}
run_dir: {tmp_path / 'run'}
""")
    result = finetune(str(spec))
    tuned = tmp_path / "run" / "offload" / "model"
    assert result["finetuned_model"] == str(tuned)
    evaluation = result["evaluation"]
    # the evaluation flow ran on the fine-tuned folder (not the starting one) and scored every item
    assert evaluation["model"] == str(tuned), evaluation.get("model")
    assert evaluation["failed"] == {} and set(evaluation["results"]) == {"arith-em"}
    assert 0.0 <= evaluation["results"]["arith-em"]["exact_match"] <= 1.0
    scored = [s for f in (tmp_path / "run" / "eval" / "scores" / "arith-em").glob("shard-*.json")
              for s in json.loads(f.read_text())["per_sample"]]
    assert sorted(s["index"] for s in scored) == [0, 1, 2]
    stored = json.loads((tmp_path / "run" / "finetune.json").read_text())
    assert stored["evaluation"]["results"] == evaluation["results"]
