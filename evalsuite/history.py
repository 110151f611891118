"""Runtime history: what each dataset cost per sample last time, per backend and model size.

Acme's observation: evaluation runtimes are known in advance because the same
datasets run on every checkpoint. The history keeps, per (dataset, backend,
model size), seconds of inference and of metric computation per sample, and per
(backend, model size) the model load time; it is a JSON file in the state dir
($FORGEFLOW_STATE_DIR, default ~/.forgeflow/state: the state database's folder, so
workers that share the state share the history), updated after every run (an
exponential moving average, so it follows a changing machine without being thrown
by one noisy run). With no history, a dataset's own cost factor × its sample count
stands in.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from evalsuite.datasets import EvalDataset
from infra.statedb.url import state_dir
from infra.atomic_write import atomic_write_json

SMOOTHING = 0.5  # weight of the newest run


def model_size_key(model_path: str | Path) -> str:
    """A coarse size class ("0.5M", "7B") from the safetensors headers: runtimes scale with it."""
    params = 0
    files = sorted(Path(model_path).glob("*.safetensors")) if Path(model_path).is_dir() else []
    if not files:
        return "unknown"
    for f in files:
        with f.open("rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(header_len))
        for name, meta in header.items():
            if name != "__metadata__":
                n = 1
                for d in meta["shape"]:
                    n *= d
                params += n
    if params >= 1e9:
        return f"{params / 1e9:.2g}B"
    return f"{params / 1e6:.2g}M"


class RuntimeHistory:
    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path else state_dir() / "eval-runtime-history.json"
        self._lock = threading.Lock()
        self.data: dict[str, dict[str, float]] = {}
        if self.path.is_file():
            try:
                self.data = json.loads(self.path.read_text())
            except json.JSONDecodeError:
                self.data = {}  # a corrupt history only costs one run of default estimates

    @staticmethod
    def key(dataset: str, backend: str, model_key: str) -> str:
        return f"{dataset}|{backend}|{model_key}"

    def gpu_s(self, dataset: EvalDataset, backend: str, model_key: str, samples: int) -> float:
        entry = self.data.get(self.key(dataset.name, backend, model_key))
        # An entry may hold only metric times (a resumed run skipped inference): default the rest.
        rate = entry["gpu_s_per_sample"] if entry and "gpu_s_per_sample" in entry else dataset.gpu_s_per_sample
        return rate * samples

    def metric_s(self, dataset: EvalDataset, backend: str, model_key: str, samples: int) -> float:
        entry = self.data.get(self.key(dataset.name, backend, model_key))
        rate = entry["metric_s_per_sample"] if entry and "metric_s_per_sample" in entry else dataset.metric_s_per_sample
        return rate * samples

    def load_s(self, backend: str, model_key: str, default: float = 5.0, source: str = "shm") -> float:
        """Model load seconds per trial: from the node's preload ("shm") or from storage."""
        return self.data.get(f"load|{backend}|{model_key}|{source}", {}).get("load_s", default)

    def knows(self, dataset: str, backend: str, model_key: str) -> bool:
        return "gpu_s_per_sample" in self.data.get(self.key(dataset, backend, model_key), {})

    def _blend(self, key: str, field: str, value: float) -> None:
        entry = self.data.setdefault(key, {})
        old = entry.get(field)
        entry[field] = value if old is None else SMOOTHING * value + (1 - SMOOTHING) * old
        entry["runs"] = entry.get("runs", 0) + (1 if field in ("gpu_s_per_sample", "load_s") else 0)

    def record_inference(self, dataset: str, backend: str, model_key: str, samples: int, seconds: float) -> None:
        if samples > 0:
            with self._lock:
                self._blend(self.key(dataset, backend, model_key), "gpu_s_per_sample", seconds / samples)

    def record_metric(self, dataset: str, backend: str, model_key: str, samples: int, seconds: float) -> None:
        if samples > 0:
            with self._lock:
                self._blend(self.key(dataset, backend, model_key), "metric_s_per_sample", seconds / samples)

    def record_load(self, backend: str, model_key: str, seconds: float, source: str = "shm") -> None:
        with self._lock:
            self._blend(f"load|{backend}|{model_key}|{source}", "load_s", seconds)

    def save(self) -> None:
        with self._lock:
            atomic_write_json(self.path, self.data, indent=1, sort_keys=True)
