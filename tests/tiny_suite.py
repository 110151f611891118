"""One tiny evaluation suite shared by the evaluation tests that run trials for real (local CLI,
Slurm jobs, Kubernetes Jobs): two datasets on the tiny model (`testing.tiny_checkpoint`)."""

from __future__ import annotations

from pathlib import Path

import yaml


def write_tiny_suite(path: Path, tiny_model: Path, name: str, **top) -> Path:
    """Write the suite to `path` (preloads under `path`'s folder/shm); `top` adds top-level
    settings (e.g. isolation, devices)."""
    suite = {"name": name, "slots": 2, **top, "backend_options": {"batch_size": 8, "device": "cpu"},
             "preload_root": str(path.parent / "shm"),
             "datasets": [{"name": "capitals-mc", "options": {"limit": 4}},
                          {"name": "perplexity", "options": {"data_dir": str(tiny_model / "data"),
                                                            "max_windows": 4, "seq_len": 32}}]}
    path.write_text(yaml.safe_dump(suite, sort_keys=False))
    return path
