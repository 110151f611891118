"""Start W offload workers on this machine under torchrun and collect their reports.

The workers get `infra.launch.worker_environment()`, what a rank needs (the allowlist the
other launchers use), never this process's whole environment: a Slack webhook, the state
database's URL or an API key stay here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from infra.launch import worker_environment
from training.offload.executor import OffloadRunConfig


class OffloadRunFailed(RuntimeError):
    """A worker exited non-zero; the message carries the tail of its log."""


def torchrun_command(run_file: str | Path, workers: int) -> list[str]:
    """forgeflow's torchrun (infra.torchrun): the workers forked from its agent, torch imported once."""
    return [sys.executable, "-m", "infra.torchrun", "--standalone", "--nproc-per-node", str(workers),
            "-m", "training.offload.worker", str(run_file)]


def run_local(cfg: OffloadRunConfig, workers: int, *, timeout_s: float = 1800.0,
              threads_per_worker: int | None = 1) -> list[dict]:
    """Run the fine-tuning on `workers` local processes; returns one report per worker, rank order."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    run_file = out / "run.json"
    run_file.write_text(cfg.model_dump_json(indent=1))
    env = worker_environment()
    if threads_per_worker:
        env["OMP_NUM_THREADS"] = str(threads_per_worker)  # W workers share this machine's cores
    log = out / "workers.log"
    with open(log, "w") as f:
        proc = subprocess.run(torchrun_command(run_file, workers), stdout=f, stderr=subprocess.STDOUT,
                              env=env, timeout=timeout_s)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise OffloadRunFailed(f"offload workers exited {proc.returncode} (log {log}):\n{tail}")
    return [json.loads((out / f"worker{r}.json").read_text()) for r in range(workers)]
