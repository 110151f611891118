"""Training metrics where ML teams look: TensorBoard event files by default, MLflow and
Weights & Biases when configured. The run log (training.runlog) stays the source of truth
the flow and diagnosis read; this is a copy for people.

    {run_dir}/tensorboard/train/   loss, lr, grad_norm, tokens_per_s, memory, checkpoint stall
    {run_dir}/tensorboard/eval/    evaluation scores per training step (written by the evaluation)

    tensorboard --logdir runs/JOB/tensorboard

Only global rank 0 writes (every rank logs the same data-parallel mean loss). A restarted
attempt opens its writer with `purge_step` = the first step it trains, so TensorBoard drops
the failed attempt's steps from that point on (a rollback's replayed steps show once).

MLflow (`metrics.mlflow_tracking_uri`, or the standard MLFLOW_TRACKING_URI) and W&B
(`metrics.wandb_project`, or WANDB_PROJECT) come with the `tracking` extra and are imported
only when configured; neither needs a server (a `sqlite:///PATH` or `file:` tracking URI;
WANDB_MODE=offline, files under {run_dir}/wandb). Each keeps one run per job and part
(`{job}-train`, `{job}-eval`) that restarts and later evaluations continue; the metric names
are TensorBoard's (`train/loss`, `eval/{dataset}/{metric}`). A sink that cannot start or
write is reported once on stderr and dropped: metrics never stop training.
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path
from typing import Any, Protocol

from training.config import JobSpec

TENSORBOARD_DIR = "tensorboard"


def tensorboard_dir(spec: JobSpec, part: str = "train") -> Path:
    return spec.resolved_run_dir / TENSORBOARD_DIR / part


class _Sink(Protocol):
    name: str

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class _TensorBoard:
    """TensorBoard's event-file format, written with tensorboard's own protobuf messages.

    Not torch.utils.tensorboard.SummaryWriter: importing it pulls tensorboard.summary, whose
    TensorFlow stub imports boto3 (about a second of CPU at every rank 0 start, in every test
    and every attempt); this needs only the Event/Summary messages and the record framing
    (length, masked CRC-32C of it, data, masked CRC-32C of the data). Read back by TensorBoard
    and its EventAccumulator (tests/unit/training/test_metrics_sinks.py)."""

    name = "tensorboard"

    def __init__(self, log_dir: Path, purge_step: int | None) -> None:
        import socket
        import time

        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._event, self._summary = Event, Summary
        log_dir.mkdir(parents=True, exist_ok=True)
        path = log_dir / f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.0"
        self._file = open(path, "ab")
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step is not None:  # TensorBoard drops earlier files' events from this step on
            self._write(Event(wall_time=time.time(), step=purge_step,
                              session_log=SessionLog(status=SessionLog.START)))

    def _write(self, event: Any) -> None:
        import struct

        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        self._file.write(header + struct.pack("<I", masked_crc32c(header)) + data
                         + struct.pack("<I", masked_crc32c(data)))

    def log(self, scalars: dict[str, float], step: int) -> None:
        import time

        values = [self._summary.Value(tag=tag, simple_value=float(v)) for tag, v in scalars.items()]
        self._write(self._event(wall_time=time.time(), step=step, summary=self._summary(value=values)))
        self._file.flush()  # small and cheap; a crash loses nothing already logged

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli, reflected
        table.append(crc)
    return table


_CRC32C = _crc32c_table()


def masked_crc32c(data: bytes) -> int:
    """The TFRecord checksum: CRC-32C of `data`, rotated and offset ("masked")."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


class _MLflow:
    """One MLflow run per job and part (`{job}-train`, `{job}-eval`), like W&B's: a restarted
    attempt and every later evaluation continue it. Through MlflowClient, not the fluent API,
    so nothing process-global (tracking URI, active run) is touched and the train and eval
    parts can be open in one process."""

    name = "mlflow"

    def __init__(self, tracking_uri: str, experiment: str, run_name: str) -> None:
        if _is_file_store(tracking_uri):
            # MLflow 3 refuses its file store ("maintenance mode") unless this opts in; the job
            # named that store, so use it (sqlite:///PATH is MLflow's own recommendation)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        elif tracking_uri.startswith("sqlite:///"):  # sqlite creates the file, not its folder
            Path(tracking_uri.removeprefix("sqlite:///").split("?")[0]).parent.mkdir(parents=True, exist_ok=True)
        from mlflow.entities import Metric
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        self.client = client = MlflowClient(tracking_uri)
        found = client.get_experiment_by_name(experiment)
        if found is None:
            try:
                experiment_id = client.create_experiment(experiment)
            except MlflowException:  # the other part created it meanwhile
                experiment_id = client.get_experiment_by_name(experiment).experiment_id
        else:
            experiment_id = found.experiment_id
        runs = client.search_runs([experiment_id], filter_string=f"tags.`mlflow.runName` = '{run_name}'",
                                  order_by=["attributes.start_time DESC"], max_results=1)
        if runs:
            self.run_id = runs[0].info.run_id
            client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = client.create_run(experiment_id, run_name=run_name).info.run_id

    def log(self, scalars: dict[str, float], step: int) -> None:
        import time

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self._metric(key, float(value), now, step)
                                                    for key, value in scalars.items()])

    def flush(self) -> None:
        pass  # log_batch is synchronous

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class _WandB:
    name = "wandb"

    def __init__(self, project: str, run_name: str, run_dir: Path | None) -> None:
        import wandb

        if run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
        # one W&B run per job and part: restarts and later evaluations resume it (the id is
        # `{job}-{part}`); W&B writes under `dir`/wandb (WANDB_DIR, when set, wins).
        # create_new: by default a second init in a process returns the run already open
        # there, which would put the eval part's scores into the train part's run
        self.run = wandb.init(project=project, name=run_name, id=run_name, resume="allow",
                              dir=None if run_dir is None else str(run_dir), reinit="create_new")
        # the training step is a metric of its own, every chart's x-axis: W&B drops a `step=`
        # lower than the run's last one, which a resumed attempt's replayed steps and an
        # evaluation that finishes after a later checkpoint's both are
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log({**scalars, "step": step})

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


def _is_file_store(uri: str) -> bool:
    return uri.startswith("file:") or "://" not in uri and not uri.startswith(("databricks", "sqlite:"))


def _warn(what: str, error: BaseException) -> None:
    print(f"forgeflow metrics: {what} disabled ({type(error).__name__}: {error})", file=sys.stderr, flush=True)


def open_sinks(spec: JobSpec, part: str, purge_step: int | None = None,
               environ: dict[str, str] | None = None) -> list[_Sink]:
    """The configured sinks for `part` ("train" or "eval"); one that cannot start is skipped."""
    environ = os.environ if environ is None else environ
    cfg = spec.metrics
    sinks: list[_Sink] = []
    wanted: list[tuple[str, Any]] = []
    if cfg.tensorboard:
        wanted.append(("tensorboard", lambda: _TensorBoard(tensorboard_dir(spec, part), purge_step)))
    mlflow_uri = cfg.mlflow_tracking_uri or environ.get("MLFLOW_TRACKING_URI")
    if mlflow_uri:
        wanted.append(("mlflow", lambda: _MLflow(mlflow_uri, cfg.mlflow_experiment or spec.name, f"{spec.name}-{part}")))
    wandb_project = cfg.wandb_project or environ.get("WANDB_PROJECT")
    if wandb_project:
        wandb_dir = None if environ.get("WANDB_DIR") else spec.resolved_run_dir
        wanted.append(("wandb", lambda: _WandB(wandb_project, f"{spec.name}-{part}", wandb_dir)))
    for name, make in wanted:
        try:
            sinks.append(make())
        except Exception as e:  # not installed, unreachable, misconfigured: training goes on
            _warn(name, e)
    return sinks


class MetricsLogger:
    """The training loop's metrics: call `step` when a step is logged, `checkpoint` after a save,
    `close` at the end (also run at interpreter exit, so a crashing rank 0 keeps what it logged)."""

    def __init__(self, sinks: list[_Sink]) -> None:
        self.sinks = sinks
        if sinks:
            atexit.register(self.close)

    @classmethod
    def open(cls, spec: JobSpec, rank: int, first_step: int | None = None) -> "MetricsLogger":
        """Rank 0's sinks (none elsewhere); `first_step`: the first step this attempt trains, when it
        resumed (TensorBoard then drops the earlier attempts' events from that step on)."""
        return cls(open_sinks(spec, "train", purge_step=first_step) if rank == 0 else [])

    def _log(self, scalars: dict[str, float], step: int) -> None:
        for sink in list(self.sinks):
            try:
                sink.log(scalars, step)
            except Exception as e:
                _warn(sink.name, e)
                self.sinks.remove(sink)

    def step(self, step: int, *, loss: float, lr: float, grad_norm: float | None, tokens_per_s: float) -> None:
        if not self.sinks:
            return
        scalars = {"train/loss": loss, "train/lr": lr, "train/tokens_per_s": tokens_per_s}
        if grad_norm is not None:
            scalars["train/grad_norm"] = float(grad_norm)
        scalars.update(memory_scalars())
        self._log(scalars, step)

    def checkpoint(self, step: int, save_info: dict[str, Any] | None) -> None:
        """The save's stall (the time training waited for it), from the checkpointer's report."""
        info = save_info or {}
        scalars = {f"checkpoint/{key}": float(info[key]) for key in ("stall_s", "wait_s") if key in info}
        if scalars:
            self._log(scalars, step)
        for sink in self.sinks:
            sink.flush()  # a checkpoint is a good moment: what is on disk matches what resumes

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            try:
                sink.close()
            except Exception as e:
                _warn(sink.name, e)


def memory_scalars() -> dict[str, float]:
    """This process's memory: peak allocated on the GPU, else resident memory on the host."""
    import torch

    if torch.cuda.is_available():
        return {"memory/gpu_max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                "memory/gpu_max_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
    import psutil

    return {"memory/host_rss_gib": psutil.Process().memory_info().rss / 2**30}


def log_eval_scores(spec: JobSpec, step: int, results: dict[str, dict[str, float]]) -> list[str]:
    """One checkpoint's evaluation scores as `eval/{dataset}/{metric}` at its training step, in
    the job's `tensorboard/eval` run (and MLflow / W&B when configured); returns the sinks used."""
    sinks = open_sinks(spec, "eval")
    scalars = {f"eval/{dataset}/{metric}": float(value)
               for dataset, metrics in sorted(results.items()) for metric, value in sorted(metrics.items())}
    logger = MetricsLogger(sinks)
    logger._log(scalars, step)
    names = [s.name for s in logger.sinks]
    logger.close()
    return names
