"""The offload launcher hands its torchrun workers what a worker needs, not its whole environment."""

from __future__ import annotations

from tests import env_probe
from tests.integration.finetune.test_offload_executor import make_tiny_llama
from training.offload.executor import OffloadRunConfig
from training.offload.launch import run_local

SECRETS = ("SLACK_WEBHOOK_URL", "FORGEFLOW_DB_URL", "PREFECT_API_AUTH_STRING", "OPENAI_API_KEY")


def test_workers_get_the_allowlist_and_none_of_the_secrets(tmp_path, monkeypatch):
    make_tiny_llama(tmp_path / "model", layers=2, hidden=64)
    for name in SECRETS:
        monkeypatch.setenv(name, "secret")
    monkeypatch.setenv("NCCL_DEBUG", "WARN")   # a worker's setting: it reaches them
    reports = env_probe.install(tmp_path / "probe", monkeypatch)
    # The probe reports at an interpreter's start: workers forked from torchrun's agent (the default,
    # infra.torchrun) start none and have the agent's environment plus torchrun's rank variables, so
    # here each worker is a new interpreter, as under PyTorch's torchrun, and reports its own.
    monkeypatch.setenv("FORGEFLOW_RANK_START", "exec")
    cfg = OffloadRunConfig(model_dir=str(tmp_path / "model"), stages=[(0, 2), (2, 4)], steps=1, seq_length=8,
                           out_dir=str(tmp_path / "run"), save_model=False)

    run_local(cfg, workers=2)

    processes = env_probe.seen(reports)
    assert len(processes) >= 3   # torchrun and its two workers
    for names in processes:
        assert not names & set(SECRETS), names & set(SECRETS)
        assert {"PATH", "NCCL_DEBUG", "OMP_NUM_THREADS"} <= names
