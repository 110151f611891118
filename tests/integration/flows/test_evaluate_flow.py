"""The evaluate-checkpoint and catch-up flows on a real (ephemeral) Prefect API.

The flow runs its plan through evalsuite's one executor with Prefect tasks as the
submitter: it records runtime history (the next plan balances on it), publishes
results per checkpoint, and the catch-up finds every job registered for evaluation.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

SUITE = """
name: flowtest
slots: 2
backend_options: {batch_size: 8, device: cpu}
datasets:
  - name: arith-em
    options: {limit: 4}
  - name: capitals-mc
    options: {limit: 3}
  - name: humaneval
    options: {limit: 2, max_new_tokens: 16}
"""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from testing.tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model") / "hf")


@pytest.fixture
def checkpoints(tmp_path, tiny_model):
    # Two "checkpoints" under one root, each an exported HF folder (what export produces).
    root = tmp_path / "ckpts"
    for step in (10, 20):
        shutil.copytree(tiny_model, root / f"step-{step:08d}", ignore=shutil.ignore_patterns("data"))
    suite = tmp_path / "suite.yaml"
    suite.write_text(SUITE)
    return root, suite


def _check_published(root: Path, name: str, result: dict) -> None:
    stored = json.loads((root / "eval" / name / "flowtest.json").read_text())
    assert set(stored["results"]) == {"arith-em", "capitals-mc", "humaneval"}
    assert stored["step"] == int(name.split("-")[1]) and stored["failed"] == {}


def test_evaluate_checkpoint_flow_records_history_and_runs_on_dask(prefect_api, checkpoints, tmp_path):
    from prefect.artifacts import Artifact
    from prefect_dask import DaskTaskRunner

    from evalsuite.history import RuntimeHistory, model_size_key
    from evalsuite.reporting import has_results, load_all_results, read_score_history
    from flows.evaluate import evaluate_checkpoint, pending_checkpoints

    root, suite = checkpoints
    shm = tmp_path / "shm"
    history = tmp_path / "history.json"
    first = evaluate_checkpoint(str(root / "step-00000010"), suite=str(suite), output_dir=str(tmp_path / "o1"),
                                preload_root=str(shm), history_path=str(history))
    _check_published(root, "step-00000010", first)
    assert not any(p for p in shm.iterdir() if not p.name.endswith(".lock")), "preload not removed"
    artifact = Artifact.get("eval-step-00000010-flowtest")
    assert artifact is not None and "capitals-mc" in str(artifact.data)
    progress = Artifact.get("eval-progress-step-00000010-flowtest")
    assert progress is not None and progress.type == "progress" and float(progress.data) == 100.0
    # The flow's run measured its runtimes: the first plan had no history, the store has it now.
    assert first["history_used"] == []
    recorded, key = RuntimeHistory(history), model_size_key(root / "step-00000010")
    assert all(recorded.knows(name, "transformers", key) for name in ("arith-em", "capitals-mc", "humaneval"))

    all_ckpts = [str(root / "step-00000010"), str(root / "step-00000020")]
    assert pending_checkpoints(all_ckpts, "flowtest") == [all_ckpts[1]]

    # The same flow code on Dask worker processes (what many nodes use); its plan uses the history.
    dask_flow = evaluate_checkpoint.with_options(task_runner=DaskTaskRunner(
        cluster_kwargs={"n_workers": 2, "threads_per_worker": 2, "processes": True, "dashboard_address": None}))
    second = dask_flow(all_ckpts[1], suite=str(suite), output_dir=str(tmp_path / "o2"), preload_root=str(shm),
                       history_path=str(history))
    _check_published(root, "step-00000020", second)
    assert second["history_used"] == ["arith-em", "capitals-mc", "humaneval"]
    assert has_results(all_ckpts[1], "flowtest")
    # Same model weights, same greedy outputs: both runtimes give the same scores.
    assert second["results"] == first["results"]
    assert [r["step"] for r in load_all_results(str(root), "flowtest")] == [10, 20]

    # Results over time: one JSONL line per (step, dataset, metric) beside the checkpoints,
    # and the job's trend artifact: the chart inline (a data URI the UI can show) and a table.
    rows = read_score_history(str(root), "flowtest")
    assert {r["step"] for r in rows} == {10, 20}
    assert {(r["dataset"], r["metric"]) for r in rows if r["step"] == 20} >= {("capitals-mc", "accuracy"),
                                                                              ("arith-em", "exact_match")}
    assert Path(second["scores_url"].removeprefix("file://")).is_file()
    trend = Artifact.get("eval-trend-ckpts-flowtest")
    assert trend is not None and trend.type == "markdown"
    assert "](data:image/png;base64,iVBORw0KGgo" in trend.data            # a PNG, inline
    assert "| 10 |" in trend.data and "| 20 |" in trend.data
    assert Path(second["plot"]).read_bytes()[:4] == b"\x89PNG"


SMALL_SUITE = """
name: catchup
slots: 1
backend_options: {batch_size: 8, device: cpu}
datasets:
  - name: arith-em
    options: {limit: 2}
"""


def _committed_job(tmp_path: Path, tiny_model: Path, name: str, steps: list[int]):
    """A job whose checkpoint root holds committed steps (manifest written last), each an HF folder."""
    import time

    from checkpoint.manifest import Manifest, write_commit
    from infra.storage import open_storage
    from training.config import load_job_spec

    root = tmp_path / name / "checkpoints"
    storage = open_storage(str(root))
    for step in steps:
        shutil.copytree(tiny_model, root / f"step-{step:08d}", ignore=shutil.ignore_patterns("data"))
        write_commit(storage, Manifest(step=step, world_size=1, layout={"dp": 1, "tp": 1, "pp": 1}, shards=[],
                                       time=time.time()))
    storage.close()
    spec = load_job_spec(ROOT / "configs" / "tiny-cpu.yaml", {"name": name, "checkpoint": {"url": str(root)}})
    return spec, [str(root / f"step-{s:08d}") for s in steps]


ROOT = Path(__file__).resolve().parents[3]


def test_catch_up_evaluates_every_job_registered_for_evaluation(prefect_api, tiny_model, tmp_path, monkeypatch):
    from prefect.variables import Variable

    from evalsuite.reporting import has_results
    from flows.evaluate import evaluate_catch_up
    from tasks.eval_tasks import EVAL_JOBS_VARIABLE, jobs_for_evaluation, register_for_evaluation

    monkeypatch.chdir(tmp_path)                            # the jobs' run directories: runs/NAME/...
    monkeypatch.setenv("FORGEFLOW_STATE_DIR", str(tmp_path / "state"))   # its runtime history
    monkeypatch.setenv("HOME", str(tmp_path / "home"))     # where forgeflow must write nothing
    Variable.set(EVAL_JOBS_VARIABLE, {}, overwrite=True)
    suite = tmp_path / "catchup.yaml"
    suite.write_text(SMALL_SUITE)
    spec_a, ckpts_a = _committed_job(tmp_path, tiny_model, "job-a", [10])
    spec_b, ckpts_b = _committed_job(tmp_path, tiny_model, "job-b", [5, 15])
    register_for_evaluation(spec_a, str(suite))
    register_for_evaluation(spec_b, str(suite))
    register_for_evaluation(spec_b, str(suite))            # idempotent
    # A registration someone broke by hand is reported and skipped; the others still run.
    Variable.set(EVAL_JOBS_VARIABLE, {**Variable.get(EVAL_JOBS_VARIABLE), "broken": {"spec": {"name": "x"}}},
                 overwrite=True)
    jobs, bad = jobs_for_evaluation()
    assert [spec.name for spec, _ in jobs] == ["job-a", "job-b"] and list(bad) == ["broken"]

    done = evaluate_catch_up()
    assert sorted(done) == sorted(ckpts_a + ckpts_b)
    assert all(has_results(c, "catchup") for c in ckpts_a + ckpts_b)
    assert evaluate_catch_up() == []                        # nothing left to catch up on
    # Each evaluation's folder is under its own job's run directory, named by step and suite;
    # the runtime history is in the state directory, nothing in the home directory.
    for spec, steps in ((spec_a, [10]), (spec_b, [5, 15])):
        assert sorted(p.name for p in (spec.resolved_run_dir / "eval").iterdir()) == [
            f"step-{s:08d}-catchup" for s in steps]
    assert (tmp_path / "state" / "eval-runtime-history.json").is_file()
    assert not (tmp_path / "home" / ".forgeflow").exists() and not (tmp_path / "runs" / "eval").exists()
    # each job's scores at their training steps, in its TensorBoard beside the training metrics
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(spec_b.resolved_run_dir.resolve() / "tensorboard" / "eval"))
    board.Reload()
    tags = board.Tags()["scalars"]
    assert tags and all(t.startswith("eval/") for t in tags)
    assert sorted(e.step for e in board.Scalars(tags[0])) == [5, 15]


PROCESS_SUITE = """
name: procslot
slots: 1
isolation: process
target_trial_s: 0.01
backend_options: {batch_size: 8, device: cpu, torch_threads: 1}
datasets:
  - name: arith-em
    options: {limit: 2}
  - name: capitals-mc
    options: {limit: 2}
"""


def test_flow_runs_a_slots_process_isolated_trials_on_one_worker_process(prefect_api, tiny_model, tmp_path,
                                                                          monkeypatch):
    """Under the flow (thread task runner) as in the CLI: a slot's trials share its worker process
    and engine, instead of a fresh interpreter and model load per trial; closed when the plan ends."""
    import tasks.eval_tasks as eval_tasks
    from evalsuite.trials import SlotProcesses
    from flows.evaluate import evaluate_checkpoint

    seen: list = []

    class Spy(SlotProcesses):   # the real worker processes; only records who ran what
        def run(self, trial):
            result = super().run(trial)
            seen.append((trial.trial_id, result.worker["pid"], result.engine_reused))
            return result

        def close(self):
            seen.append(("closed", [w.proc.pid for w in self._all], None))
            super().close()

    monkeypatch.setattr(eval_tasks, "SlotProcesses", Spy)
    suite = tmp_path / "suite.yaml"
    suite.write_text(PROCESS_SUITE)
    ckpt = tmp_path / "ckpts" / "step-00000005"
    shutil.copytree(tiny_model, ckpt, ignore=shutil.ignore_patterns("data"))
    result = evaluate_checkpoint(str(ckpt), suite=str(suite), output_dir=str(tmp_path / "out"),
                                 preload_root=str(tmp_path / "shm"))
    assert result["failed"] == {} and set(result["results"]) == {"arith-em", "capitals-mc"}
    (first, pid1, reused1), (second, pid2, reused2), (closed, pids, _) = seen
    assert first != second and closed == "closed"
    assert pid1 == pid2 == str(pids[0]) and len(pids) == 1      # one process for the slot
    assert not reused1 and reused2                              # the engine loaded once
    assert eval_tasks._slot_processes == {}                    # nothing left behind
