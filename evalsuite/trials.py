"""A trial: one model load, then inference over one or more dataset shards.

`Trial` is a plain, serialisable description (pydantic). `run_trial(trial)` runs
it in the current thread; `python -m evalsuite.trials < trial.json` runs the same
function in a fresh process. `execute_trial(trial)` picks between the two by the
trial's `isolation`, and is what every executor (threads for the CLI, Prefect
tasks for the flow) calls.

A trial runs on its slot's devices: a slot is a set of devices (`["cuda:2",
"cuda:3"]`, or `["cpu"]`). In its own process the trial sees only those GPUs
(`CUDA_VISIBLE_DEVICES`), so one engine per slot owns them; a vLLM engine's
tensor-parallel size is the slot's GPU count. A CPU slot may name cores
(`cpu:0,1`): the trial process is pinned to them, the CPU twin of a GPU set.
The local executor keeps one such process per slot (`SlotProcesses`): a slot's
later trials reuse its interpreter and engine.

A shard whose output file is already complete is skipped, so re-running a trial
after a crash redoes only the unfinished shards.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from evalsuite.datasets import DatasetRef, PromptCache
from evalsuite.errors import TrialError
from evalsuite.records import ShardWriter, read_completion, shard_output_path


class ShardSpec(BaseModel):
    dataset: DatasetRef
    shard: int
    start: int
    stop: int
    predicted_gpu_s: float = 0.0
    predicted_metric_s: float = 0.0

    @property
    def samples(self) -> int:
        return self.stop - self.start

    def output_path(self, output_dir: str | Path) -> Path:
        return shard_output_path(output_dir, self.dataset.name, self.shard)


class Trial(BaseModel):
    trial_id: str
    shards: list[ShardSpec]
    backend: str
    backend_options: dict = Field(default_factory=dict)
    model_path: str = ""           # a local folder (the node's preload), filled in at run time
    model_source: str = ""         # where it lives in storage: loaded from there when not preloaded
    output_dir: str
    prompt_cache_dir: str | None = None
    devices: list[str] = Field(default_factory=list)   # the slot's devices, e.g. ["cuda:2", "cuda:3"]; [] = auto
    isolation: Literal["thread", "process"] = "thread"  # in the executor's thread, or a fresh process
    node: str = ""                 # the node whose slot runs it ("" = where the executor runs)
    predicted_load_s: float = 0.0
    predicted_gpu_s: float = 0.0
    predicted_metric_s: float = 0.0

    @property
    def predicted_slot_s(self) -> float:
        return self.predicted_load_s + self.predicted_gpu_s


class ShardTiming(BaseModel):
    dataset: str
    shard: int
    samples: int
    seconds: float
    skipped: bool


class TrialResult(BaseModel):
    trial_id: str
    load_s: float
    shards: list[ShardTiming]
    total_s: float
    worker: dict[str, str] = Field(default_factory=dict)   # where it ran: host, pid, visible GPUs, cores
    engine_reused: bool = False    # its slot's engine already held the model: no load


def _worker_info() -> dict[str, str]:
    return {"host": socket.gethostname(), "pid": str(os.getpid()),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "(all)"),
            "cpu_affinity": ",".join(map(str, sorted(os.sched_getaffinity(0))))}


class EngineCache:
    """One inference engine per slot: a slot's next trial of the same model (same folder, backend
    and options) reuses the engine its last trial loaded instead of loading it again.

    Kept per executor thread (the local executor runs one trial per slot at a time on as many
    threads as slots); `close()` releases them all when the plan is done.
    """

    def __init__(self) -> None:
        self._local = threading.local()
        self._open: list = []
        self._lock = threading.Lock()

    @staticmethod
    def _key(backend: str, model_path: str, options: dict) -> tuple:
        return backend, model_path, json.dumps(options, sort_keys=True, default=str)

    def holds(self, backend: str, model_path: str, options: dict) -> bool:
        entry = getattr(self._local, "entry", None)
        return bool(entry) and entry[0] == self._key(backend, model_path, options)

    def get(self, backend: str, model_path: str, options: dict):
        from evalsuite.backends import load_backend

        key = self._key(backend, model_path, options)
        entry = getattr(self._local, "entry", None)
        if entry and entry[0] == key:
            return entry[1]
        self.drop()
        engine = load_backend(backend, model_path, options)
        self._local.entry = (key, engine)
        with self._lock:
            self._open.append(engine)
        return engine

    def drop(self) -> None:
        """Close this thread's engine (another model comes, or its trial failed)."""
        entry = getattr(self._local, "entry", None)
        self._local.entry = None
        if entry:
            with self._lock:
                self._open.remove(entry[1])
            entry[1].close()

    def close(self) -> None:
        with self._lock:
            engines, self._open = self._open, []
        for engine in engines:
            engine.close()


def run_trial(trial: Trial, on_progress: Callable[[str, int], None] | None = None,
              engines: EngineCache | None = None) -> TrialResult:
    """Run every shard of `trial`; complete shards are skipped (resume). With `engines`, the
    slot's engine is reused when it already holds this model."""
    from evalsuite.backends import load_backend

    started = time.perf_counter()
    todo = [s for s in trial.shards if read_completion(s.output_path(trial.output_dir)) is None]
    timings = [ShardTiming(dataset=s.dataset.name, shard=s.shard, samples=s.samples, seconds=0.0, skipped=True)
               for s in trial.shards if s not in todo]
    if not todo:
        return TrialResult(trial_id=trial.trial_id, load_s=0.0, shards=timings,
                           total_s=time.perf_counter() - started, worker=_worker_info())
    if not trial.model_path and not trial.model_source:
        raise TrialError(f"trial {trial.trial_id}: neither model_path (a local folder) nor model_source "
                         "(a storage URL) is set; build trials with evalsuite.runner.build_plan(model_source=...)")
    scratch = None
    model_path = trial.model_path
    if model_path and not Path(model_path).is_dir() and trial.model_source:
        # A worker on another node: its precursor has not run here yet. preload() copies
        # once per node (locked), so the node's later trials find it in place.
        from evalsuite.preload import preload

        model_path = str(preload(trial.model_source, Path(model_path).parent))
    if not model_path:
        # No preload on this node: fetch from storage for this trial alone (the naive way).
        from evalsuite.preload import copy_from_storage

        scratch = Path(tempfile.mkdtemp(prefix=f"trial-{trial.trial_id}-"))
        copy_from_storage(trial.model_source, scratch)
        model_path = str(scratch)
    try:
        options = backend_options_for(trial)
        reuse = engines is not None and scratch is None   # a per-trial scratch copy is never seen again
        reused = reuse and engines.holds(trial.backend, model_path, options)
        backend = engines.get(trial.backend, model_path, options) if reuse else \
            load_backend(trial.backend, model_path, options)
        load_s = time.perf_counter() - started
        cache = PromptCache(trial.prompt_cache_dir) if trial.prompt_cache_dir else PromptCache()
        try:
            for spec in todo:
                t0 = time.perf_counter()
                dataset = spec.dataset.resolve()
                tokenizer = getattr(backend, "tokenizer", None) or _tokenizer(model_path)
                requests = dataset.tokenized_requests(tokenizer, spec.start, spec.stop, cache)
                writer = ShardWriter(spec.output_path(trial.output_dir), dataset.name, spec.shard, trial.backend)
                try:
                    backend.run_shard(dataset, requests, writer,
                                      on_progress=(lambda n, t=trial.trial_id: on_progress(t, n)) if on_progress else None)
                finally:
                    writer.close()
                timings.append(ShardTiming(dataset=dataset.name, shard=spec.shard, samples=spec.samples,
                                           seconds=time.perf_counter() - t0, skipped=False))
        except BaseException:
            if reuse:
                engines.drop()          # a failed trial may leave its engine in a bad state
            raise
        finally:
            if not reuse:
                backend.close()
    except Exception as e:
        raise TrialError(f"trial {trial.trial_id} failed: {type(e).__name__}: {e}") from e
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    return TrialResult(trial_id=trial.trial_id, load_s=load_s, shards=timings,
                       total_s=time.perf_counter() - started, worker=_worker_info(), engine_reused=reused)


def _tokenizer(model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def cuda_indices(devices: list[str]) -> list[str]:
    """GPU indices of a slot's devices ("cuda:3" -> "3"); [] when it has none."""
    return [d.split(":", 1)[1] for d in devices if d.startswith("cuda:")]


def cpu_cores(devices: list[str]) -> set[int]:
    """Cores a CPU slot is pinned to ("cpu:0,1" -> {0, 1}); empty: no pinning."""
    cores: set[int] = set()
    for d in devices:
        if d.startswith("cpu:"):
            cores.update(int(c) for c in d.split(":", 1)[1].split(",") if c.strip())
    return cores


def backend_options_for(trial: Trial) -> dict:
    """The backend options of a trial on its slot: the device, and vLLM's tensor parallel size."""
    options = dict(trial.backend_options)
    gpus = [d for d in trial.devices if d.startswith("cuda")]
    if gpus and "device" not in options:
        # In its own process the slot's GPUs are renumbered from 0 (CUDA_VISIBLE_DEVICES).
        options["device"] = "cuda" if len(gpus) > 1 or gpus == ["cuda"] else gpus[0]
    elif trial.devices and all(d == "cpu" or d.startswith("cpu:") for d in trial.devices):
        options.setdefault("device", "cpu")
    if trial.backend == "vllm" and gpus:
        tp = options.get("tensor_parallel_size")
        if tp is not None and tp != len(gpus):
            raise TrialError(f"trial {trial.trial_id}: tensor_parallel_size {tp} but its slot has {len(gpus)} "
                             f"GPU(s) {gpus}; drop tensor_parallel_size (the slot decides) or change devices")
        options["tensor_parallel_size"] = len(gpus)
    return options


def trial_environment(trial: Trial, base: dict[str, str] | None = None) -> tuple[dict[str, str], Trial]:
    """The environment of a trial's own process, and the trial as that process sees its devices."""
    env = dict(os.environ if base is None else base)
    gpus = cuda_indices(trial.devices)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        trial = trial.model_copy(update={"devices": ["cuda"] if len(gpus) == 1 else
                                         [f"cuda:{i}" for i in range(len(gpus))]})
    elif trial.devices and all(d == "cpu" or d.startswith("cpu:") for d in trial.devices):
        env["CUDA_VISIBLE_DEVICES"] = ""   # a CPU slot never grabs a GPU
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    return env, trial


def run_trial_in_process(trial: Trial, timeout_s: float | None = None) -> TrialResult:
    """The same trial in a fresh interpreter that sees only its slot's devices."""
    env, trial = trial_environment(trial)
    proc = subprocess.run([sys.executable, "-m", "evalsuite.trials"], input=trial.model_dump_json(),
                          capture_output=True, text=True, env=env, timeout=timeout_s)
    if proc.returncode != 0:
        raise TrialError(f"trial {trial.trial_id} failed in its worker process (exit {proc.returncode}): "
                         f"{proc.stderr.strip()[-2000:]}")
    return TrialResult.model_validate_json(proc.stdout.strip().splitlines()[-1])


class _TrialProcess:
    """A long-lived interpreter that sees one slot's devices and runs that slot's trials one after
    another, keeping its engine between them (`python -m evalsuite.trials --serve`)."""

    def __init__(self, trial: Trial) -> None:
        env, _ = trial_environment(trial)
        self.devices = list(trial.devices)
        self.log = tempfile.TemporaryFile()   # stderr: library warnings and progress bars, read on failure
        self.proc = subprocess.Popen([sys.executable, "-m", "evalsuite.trials", "--serve"], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)

    def run(self, trial: Trial) -> TrialResult:
        _, seen = trial_environment(trial)
        try:
            self.proc.stdin.write(seen.model_dump_json() + "\n")
            self.proc.stdin.flush()
            while line := self.proc.stdout.readline():
                if line.startswith(_REPLY):
                    reply = json.loads(line[len(_REPLY):])
                    if "error" in reply:
                        raise TrialError(reply["error"])
                    return TrialResult.model_validate(reply["result"])
        except (BrokenPipeError, OSError):
            pass
        code = self.proc.wait()
        self.log.seek(0)
        tail = self.log.read().decode(errors="replace").strip()[-2000:]
        raise TrialError(f"trial {trial.trial_id}: its slot's worker process exited ({code}): {tail}")

    def stop(self) -> None:
        """End of input: the worker closes its engine and exits (`close` waits for it)."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def close(self) -> None:
        if self.proc.poll() is None:
            self.stop()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


_REPLY = "@@forgeflow-trial-result "


class SlotProcesses:
    """Process-isolated trials on long-lived worker processes: one per slot at a time, started for
    the slot's device set on its first trial and reused by the next trial with the same devices, so
    a slot pays the interpreter start, the imports and (for the same model) the load once. Separate
    processes also keep slots off each other's GIL (in-thread slots serialise a small model's
    Python-bound inference loop)."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, ...], list[_TrialProcess]] = {}
        self._all: list[_TrialProcess] = []
        self._lock = threading.Lock()

    def run(self, trial: Trial) -> TrialResult:
        key = tuple(trial.devices)
        with self._lock:
            worker = self._idle.get(key, []).pop() if self._idle.get(key) else None
        if worker is None:
            worker = _TrialProcess(trial)
            with self._lock:
                self._all.append(worker)
        try:
            result = worker.run(trial)
        except TrialError as e:
            if worker.proc.poll() is not None:   # the process died: never hand it out again
                with self._lock:
                    self._all.remove(worker)
                worker.close()
            else:
                with self._lock:
                    self._idle.setdefault(key, []).append(worker)
            raise e
        with self._lock:
            self._idle.setdefault(key, []).append(worker)
        return result

    def close(self) -> None:
        with self._lock:
            workers, self._all, self._idle = self._all, [], {}
        for worker in workers:   # all told first: they close their engines and exit side by side
            worker.stop()
        for worker in workers:
            worker.close()


def execute_trial(trial: Trial, on_progress: Callable[[str, int], None] | None = None,
                  engines: EngineCache | None = None, processes: SlotProcesses | None = None) -> TrialResult:
    """Run a trial the way its slot asks: in this thread, or in its own process with its devices
    (the slot's long-lived worker process when `processes` is given, else a fresh one)."""
    if trial.isolation == "process":
        return processes.run(trial) if processes is not None else run_trial_in_process(trial)
    return run_trial(trial, on_progress=on_progress, engines=engines)


def _pin(trial: Trial) -> None:
    cores = cpu_cores(trial.devices)
    if cores:
        os.sched_setaffinity(0, cores)


def _serve() -> int:
    """A slot's worker: one trial per input line, one result line each; the engine is kept."""
    engines = EngineCache()
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            trial = Trial.model_validate_json(line)
            _pin(trial)
            try:
                reply = {"result": run_trial(trial, engines=engines).model_dump(mode="json")}
            except Exception as e:
                reply = {"error": str(e) if isinstance(e, TrialError) else
                         f"trial {trial.trial_id} failed: {type(e).__name__}: {e}"}
            sys.stdout.write(_REPLY + json.dumps(reply) + "\n")
            sys.stdout.flush()
    finally:
        engines.close()
    # Every reply is written and the engine released: skip the interpreter's teardown (a second or
    # more with torch and transformers loaded), which the evaluation would otherwise wait for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _main() -> int:
    if sys.argv[1:] == ["--serve"]:
        return _serve()
    trial = Trial.model_validate_json(sys.stdin.read())
    _pin(trial)
    result = run_trial(trial)
    print(json.dumps(result.model_dump()))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
