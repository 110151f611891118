"""The evaluate-checkpoint and catch-up flows on a real (ephemeral) Prefect API."""

from __future__ import annotations

import json
import os
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
def prefect_api(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-home")
    old = os.environ.get("PREFECT_HOME")
    os.environ["PREFECT_HOME"] = str(home)
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
    if old is not None:
        os.environ["PREFECT_HOME"] = old


@pytest.fixture
def checkpoints(tmp_path, tiny_model):
    # Two "checkpoints" under one root, each an exported HF folder (what export produces).
    import shutil

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
    assert Path(result["plot"]).is_file() and Path(result["plot"]).read_bytes()[:4] == b"\x89PNG"


def test_evaluate_checkpoint_flow_threads_and_dask(prefect_api, checkpoints, tmp_path):
    from prefect.artifacts import Artifact
    from prefect_dask import DaskTaskRunner

    from evalsuite.reporting import has_results, load_all_results
    from flows.evaluate import evaluate_checkpoint, pending_checkpoints

    root, suite = checkpoints
    shm = tmp_path / "shm"
    first = evaluate_checkpoint(str(root / "step-00000010"), suite=str(suite), output_dir=str(tmp_path / "o1"),
                                preload_root=str(shm))
    _check_published(root, "step-00000010", first)
    assert not any(p for p in shm.iterdir() if not p.name.endswith(".lock")), "preload not removed"
    artifact = Artifact.get("eval-step-00000010-flowtest")
    assert artifact is not None and "capitals-mc" in str(artifact.data)

    all_ckpts = [str(root / "step-00000010"), str(root / "step-00000020")]
    assert pending_checkpoints(all_ckpts, "flowtest") == [all_ckpts[1]]

    # The same flow code on Dask worker processes (what many nodes use).
    dask_flow = evaluate_checkpoint.with_options(task_runner=DaskTaskRunner(
        cluster_kwargs={"n_workers": 2, "threads_per_worker": 2, "processes": True, "dashboard_address": None}))
    second = dask_flow(all_ckpts[1], suite=str(suite), output_dir=str(tmp_path / "o2"), preload_root=str(shm))
    _check_published(root, "step-00000020", second)
    assert has_results(all_ckpts[1], "flowtest")
    # Same model weights, same greedy outputs: both runtimes give the same scores.
    assert second["results"] == first["results"]
    assert [r["step"] for r in load_all_results(str(root), "flowtest")] == [10, 20]
