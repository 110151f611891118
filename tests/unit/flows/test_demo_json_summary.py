"""`forgeflow demo --json`: the summary object's schema, built from a real PretrainResult and a
real results file (the demo itself takes minutes, so it is run by hand, not here)."""

from __future__ import annotations

import json

from diagnosis.recovery import FailedAttempt
from flows.cli import build_parser
from flows.commands import demo_summary_json, evaluation_entry
from flows.pretrain import PretrainResult


def test_demo_accepts_json():
    args = build_parser().parse_args(["demo", "--json", "--no-eval"])
    assert args.json and args.no_eval
    assert build_parser().parse_args(["demo"]).json is False


def test_demo_summary_holds_the_pretrain_result_evaluations_and_where_to_look(tmp_path):
    failure = FailedAttempt(0, "failed", 60, "CUDA error on rank 1", "infra", "rule", "relaunch from step 50",
                            "restart helps", 3.5, 100.0, 101.0, 101.5, 104.0)
    result = PretrainResult("tiny-cpu", True, 3, 200, [failure])
    step = tmp_path / "ckpt" / "step-00000200"
    (tmp_path / "ckpt" / "eval" / "step-00000200").mkdir(parents=True)
    (tmp_path / "ckpt" / "eval" / "step-00000200" / "demo.json").write_text(
        json.dumps({"results": {"arith": {"em": 0.25}}, "failed": {}}))

    entry = evaluation_entry(str(step), "demo")
    summary = json.loads(json.dumps(demo_summary_json(
        result, [entry], seconds=12.34, checkpoints=str(tmp_path / "ckpt"), run_dir="/runs/tiny-cpu",
        prefect_home="/home/.prefect")))

    assert summary["pretrain"]["finished"] is True and summary["pretrain"]["final_step"] == 200
    assert summary["pretrain"]["attempts"] == 3
    attempt = summary["pretrain"]["failures"][0]
    assert (attempt["root_cause"], attempt["source"], attempt["action"]) == \
        ("CUDA error on rank 1", "rule", "relaunch from step 50")
    assert summary["evaluations"] == [{"checkpoint": str(step), "results": {"arith": {"em": 0.25}}, "failed": {},
                                       "results_path": entry["results_path"]}]
    assert entry["results_path"].endswith("eval/step-00000200/demo.json")
    assert summary["seconds"] == 12.3
    assert summary["where"] == {"checkpoints": str(tmp_path / "ckpt"), "run_dir": "/runs/tiny-cpu",
                                "loss_curve": "/runs/tiny-cpu/loss_curve.png",
                                "tensorboard": "/runs/tiny-cpu/tensorboard", "prefect_home": "/home/.prefect"}
