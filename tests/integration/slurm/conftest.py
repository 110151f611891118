"""A real single-host Slurm (Debian's slurm-wlm + munge) for the session, and a tiny job.

Started once by `slurm` (testing.slurm_local.LocalSlurm: slurmctld + slurmd on this
machine's CPUs); tests that need it skip with the reason when Slurm cannot run here
(not root, packages missing: `make test` installs them as root).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

TINY_JOB = {
    "training": {"global_batch_size": 8, "micro_batch_size": 2, "steps": 12, "lr": 1.0e-3,
                 "min_lr": 1.0e-4, "warmup_steps": 2, "seed": 1234},
    "checkpoint": {"interval": 6, "keep_last": 4, "async_save": False},
}


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    from testing.slurm_local import LocalSlurm, SlurmUnavailable, missing_binaries

    if os.geteuid() != 0:
        pytest.skip("a local Slurm (SlurmUser=root, munged) needs root; run `make test` as root")
    if missing_binaries():
        pytest.skip(f"Slurm is not installed ({missing_binaries()} missing): "
                    "apt-get install -y slurm-wlm munge, or run `make test` as root")
    local = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        local.start()
    except SlurmUnavailable as e:
        pytest.fail(f"Slurm is installed but would not start: {e}")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(local.conf)  # every client this session starts finds it
    try:
        yield local
    finally:
        local.stop()
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


@pytest.fixture
def slurm_job(tiny_data_dir: Path, tmp_path: Path):
    """Write a tiny job spec (its own run dir and checkpoints) under tmp_path; returns its path."""
    from tests.tiny_job import write_tiny_job

    def make(name: str = "slurm-tiny", **sections) -> Path:
        return write_tiny_job(TINY_JOB, tiny_data_dir, tmp_path, name, **sections)

    return make


@pytest.fixture
def slurm_cluster(slurm, tmp_path: Path) -> Path:
    """A cluster file for the local Slurm: its one node (CPU 'devices' = its CPUs) and a slurm: section."""
    path = tmp_path / "cluster-slurm.yaml"
    path.write_text(yaml.safe_dump({
        "name": "local-slurm",
        "nodes": [{"name": slurm.node, "gpu_type": "cpu", "gpu_count": 2, "gpu_memory_gib": 4,
                   "peak_tflops": 0.05, "address": slurm.node}],
        "slurm": {"partition": "debug", "slurm_conf": str(slurm.conf), "poll_s": 1.0},
    }, sort_keys=False))
    return path
