"""Makespan of the trial coordinator vs an OpenCompass-style splitting baseline (and the naive one).

Measurements (figures printed, the last line one JSON object):

1. Simulated: a 7B model over 63 datasets with Acme-like runtime shapes (many
   short log-likelihood datasets, some medium generation ones, a few long ones,
   and code/judge datasets whose CPU metric phase is long), on 1 and 4 nodes x
   8 GPUs. The coordinator's own `decompose` and `assign` build its plan from
   predicted runtimes (the history); actual runtimes differ from the predictions
   by ~10% noise (the same draw for every policy).

   Headline baseline (`speedup_vs_splitting_*`): OpenCompass's SizePartitioner.
   A dataset's size is its sample count (x gen_task_coef for generation sets);
   datasets over max_task_size are split into chunks, smaller ones packed into
   tasks, and tasks run first in first out on every free GPU, each loading the
   model from storage. Why it is fair (it is given everything the coordinator
   has except runtime priors and the preload):
   - the same prompt cache (2 s per dataset piece for every policy);
   - the same storage model: every reader, a baseline task's load or the
     coordinator's one-stream preload, is capped at the same per-reader rate,
     and a node's concurrent readers share its storage bandwidth;
   - its metrics go to the node's CPU pool as soon as a task's inference ends
     (OpenCompass itself runs the eval stage after the whole inference stage;
     that variant is printed as a reference);
   - its two knobs (max_task_size, gen_task_coef) are tuned per scenario over a
     grid, keeping its best makespan (an oracle tuning).
   Headline point: Acme's storage NIC (25 Gb/s, 3.1 GB/s per node), 0.25 GB/s
   per reader, the Acme-like tail. Swept: storage 1.25 / 3.1 / 6.25 GB/s per
   node, 0.25 / 1.0 GB/s per reader, the long tail x0.5 / x1 / x2 (the long
   generation sets' inference, the code/judge sets' metric phase); the minimum
   over the sweep is reported too (`*_min_sweep`).

   Secondary (`speedup_1node`, `speedup_4node`, kept): the naive baseline, one
   trial per dataset, metrics in the GPU slot, FIFO, now under the same cache
   and storage model. Its old handicaps (no prompt cache, 20 s vs 2 s; loads at
   0.25 GB/s while the preload got the full node rate) are printed once as "old
   handicapped comparison". At 4 nodes it is bounded below by the longest
   unsplit dataset, which is why it is not the headline.
2. Real, on this machine: a small random-init Llama, a suite of a HumanEval
   subset, perplexity and two JSONL tasks, 2 inference slots and CPU metric
   workers; both policies through `evalsuite.runner.evaluate`, both with
   `isolation: process` (each slot a long-lived worker process: slots as
   threads of one process share its GIL, which serialises a small model's
   Python-bound generation loop, for either policy). The runtime history is
   warmed by one untimed coordinator run first (the coordinator is prior-based:
   runtimes are known from earlier checkpoints). The two policies alternate and
   medians are taken (`--repeats`, default 5): the machine is shared.
3. Model load time of a ~25M-parameter model from S3 storage (a moto S3 server
   on 127.0.0.1) vs from its /dev/shm preload.
4. `history_used_in_flow`: the evaluate-checkpoint Prefect flow (ephemeral API)
   run twice on the tiny model with a fresh runtime history: 1 when the second
   run's plan predicted every dataset from the runtimes the first run recorded
   (the flow and the CLI share one executor, which records them).
5. `speedup_2node_real` (`--nodes-only`, also in the full run): the evaluate-checkpoint flow
   across two local worker "nodes" vs one, on a real Prefect server (see `two_node_real`): each
   node a process worker on its own work queue, pinned with every flow run it starts to its own
   half of the cores (one slot per core), so the two-node run has twice the node hardware of the
   one-node run, as two machines would. The evaluating flow and its metric jobs run on node A in
   both runs (only the Prefect server is unpinned). Each node runs one session (a run of the
   node-work deployment: preload, its trials on long-lived slot processes, removal), so a node's
   fixed cost is one dispatch, one slot process start and one model load. The suite is
   NODE_SUITE (full-size HumanEval and perplexity: inference outweighs that fixed cost, as on
   GPU nodes); `--node-suite real` runs REAL_SUITE, which on one core per node is start-up-bound.

Run:  .venv/bin/python benchmarks/eval_makespan.py [--skip-real | --flow-only | --real-only | --nodes-only]
      [--repeats N] [--node-repeats N]
      .venv/bin/python benchmarks/eval_makespan.py --smoke

`--smoke` (seconds, the same keys, not a figure): the simulation at the headline point only (no
sweep: the `*_min_sweep` keys are then that point's), one real run of each policy on a cut-down
suite (SMOKE_SUITE, on one slot process instead of two) with a 64-wide 2-layer model and no warm-up run (the naive run, first, fills
the runtime history the coordinator's run plans with) and one load each way of a 128-wide 2-layer
model. It leaves out 4 and 5:
each starts Prefect (an ephemeral API; a server, two workers and a deployment), which costs more
than the whole smoke budget; their keys stay null as with --skip-real, and tests/integration/flows/test_evaluate_flow.py
and test_evaluate_nodes.py run those flows. The last line's keys: HEADLINE_KEYS.
"""

from __future__ import annotations

import json
import argparse
import heapq
import math
import os
import random
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.headline import checked_headline  # noqa: E402
from evalsuite.coordinator import DatasetCost, Policy, Trial, assign, decompose  # noqa: E402
from evalsuite.datasets import DatasetRef  # noqa: E402


# ----------------------------------------------------------------------------- simulation

@dataclass(frozen=True)
class SimParams:
    """A 7B model on A100 nodes, storage as in Acme (loading collapses with many concurrent trials).

    Every policy gets the same storage model: each reader (a baseline task's load, or one stream
    of the coordinator's preload) is capped at `stream_gb_s`, and a node's concurrent readers share
    `node_storage_gb_s`. Every policy gets the same per-tokenizer prompt cache (`prep_cached_s` per
    dataset piece); `prep_s` (no cache) is kept only to reproduce the old, handicapped figures."""

    model_gb: float = 14.0             # bf16 weights
    stream_gb_s: float = 0.25          # one reader's throughput from remote storage
    node_storage_gb_s: float = 3.1     # what a node's NIC/storage path sustains (Acme: 25 Gb/s)
    preload_streams: int = 1           # the preload is one reader, like a baseline task's load
    shm_load_s: float = 8.0            # from /dev/shm over PCIe, plus deserialisation
    engine_init_s: float = 30.0        # inference engine start (CUDA graphs, KV cache) per trial
    prep_s: float = 20.0               # dataset load + tokenisation per trial without a cache
    prep_cached_s: float = 2.0         # with the per-tokenizer prompt cache
    gpus_per_node: int = 8
    cpu_workers_per_node: int = 32
    noise: float = 0.10                # actual/predicted runtime spread (log-normal sigma)
    legacy: bool = False               # the old handicaps: naive without the cache, preload at node rate

    @property
    def preload_s(self) -> float:
        rate = self.node_storage_gb_s if self.legacy else min(self.node_storage_gb_s,
                                                                self.preload_streams * self.stream_gb_s)
        return self.model_gb / rate


@dataclass(frozen=True)
class SimDataset:
    name: str
    samples: int
    infer_s: float      # GPU inference seconds on one GPU, all samples
    metric_s: float     # CPU metric seconds, all samples


HEADLINE_KEYS = ("speedup_1node", "speedup_4node", "ratio_to_lower_bound_4node", "speedup_vs_splitting_1node",
                 "speedup_vs_splitting_4node", "speedup_vs_splitting_1node_min_sweep",
                 "speedup_vs_splitting_4node_min_sweep", "storage_gb_s_per_node", "speedup_real_cpu",
                 "load_s_storage", "load_s_shm", "speedup_2node_real", "history_used_in_flow")
GENERATION_PREFIXES = ("gen-", "long-", "humaneval", "mbpp", "judge")


def acme_like_suite(seed: int = 7, tail: float = 1.0) -> list[SimDataset]:
    """63 datasets: runtimes long-tailed as in Acme's evaluation workload. `tail` scales the
    long tail (the long generation sets' inference, the code/judge sets' metric phase)."""
    rng = random.Random(seed)
    out = []
    for i in range(40):   # short multiple-choice / log-likelihood sets
        out.append(SimDataset(f"mc-{i:02d}", rng.randint(200, 3000), rng.uniform(30, 240), rng.uniform(0.5, 5)))
    for i in range(15):   # generation sets of medium length
        out.append(SimDataset(f"gen-{i:02d}", rng.randint(500, 5000), rng.uniform(300, 900), rng.uniform(5, 60)))
    for i in range(5):    # long generation sets (e.g. maths with long chains, big QA sets)
        out.append(SimDataset(f"long-{i}", rng.randint(5000, 15000), tail * rng.uniform(1800, 5400),
                              rng.uniform(30, 120)))
    # Code and judged sets: the CPU metric phase is long (program tests; an LLM judge up to 30 min).
    out.append(SimDataset("humaneval", 164, 600.0, tail * 600.0))
    out.append(SimDataset("mbpp", 500, 900.0, tail * 900.0))
    out.append(SimDataset("judge", 800, 300.0, tail * 1800.0))
    rng.shuffle(out)      # a suite file lists datasets in no particular order
    return out


def _actual(rng: random.Random, p: SimParams, predicted: float) -> float:
    return predicted * math.exp(rng.gauss(0.0, p.noise))


@dataclass
class _Slot:
    node: int
    name: str
    queue: list = field(default_factory=list)


def _simulate(slots: list[_Slot], pull: callable, p: SimParams, preload: bool, metrics_inline: bool,
              start_at: dict[int, float], trial_cost: callable, metric_jobs: callable = None) -> float:
    """Event simulation: per-slot trials; remote loads share the node's storage bandwidth."""
    nodes = {s.node for s in slots}
    free_cpu = {n: [start_at.get(n, 0.0)] * p.cpu_workers_per_node for n in nodes}
    for heap in free_cpu.values():
        heapq.heapify(heap)
    now = 0.0
    loading: dict[str, list] = {}     # slot -> [remaining GB, trial]
    running: dict[str, float] = {}    # slot -> end time
    current: dict[str, object] = {}
    makespan = 0.0

    def start(slot: _Slot, t: float) -> None:
        trial = pull(slot)
        if trial is None:
            return
        current[slot.name] = trial
        if preload:
            running[slot.name] = t + p.shm_load_s + trial_cost(trial, inline=metrics_inline)
        else:
            loading[slot.name] = [p.model_gb, trial]

    for s in slots:
        start(s, start_at.get(s.node, 0.0)) if not preload else None
    if preload:
        for s in slots:
            trial = pull(s)
            if trial is not None:
                current[s.name] = trial
                running[s.name] = start_at[s.node] + p.shm_load_s + trial_cost(trial, inline=metrics_inline)
    by_name = {s.name: s for s in slots}
    while loading or running:
        # Rates under processor sharing of each node's storage bandwidth.
        per_node = {}
        for name in loading:
            per_node[by_name[name].node] = per_node.get(by_name[name].node, 0) + 1
        rate = {name: min(p.stream_gb_s, p.node_storage_gb_s / per_node[by_name[name].node]) for name in loading}
        next_load = min(((loading[n][0] / rate[n], n) for n in loading), default=(math.inf, None))
        next_run = min(((end - now, n) for n, end in running.items()), default=(math.inf, None))
        dt = min(next_load[0], next_run[0])
        now += dt
        for n in list(loading):
            loading[n][0] -= rate[n] * dt
        if next_load[0] <= next_run[0]:
            name = next_load[1]
            _, trial = loading.pop(name)
            running[name] = now + trial_cost(trial, inline=metrics_inline)
            continue
        name = next_run[1]
        running.pop(name)
        trial = current.pop(name)
        makespan = max(makespan, now)
        if not metrics_inline:
            heap = free_cpu[by_name[name].node]
            for metric_s in (metric_jobs or trial_metric_jobs)(trial):
                begin = max(now, heapq.heappop(heap))
                heapq.heappush(heap, begin + metric_s)
                makespan = max(makespan, begin + metric_s)
        start(by_name[name], now)
    return makespan


def trial_metric_jobs(trial) -> list[float]:
    return [s.actual_metric_s for s in trial.shards]


@dataclass
class _SimShard:
    actual_infer_s: float
    actual_metric_s: float


@dataclass
class _SimTrial:
    shards: list[_SimShard]
    naive: bool


def size_partition(datasets: list[SimDataset], max_task_size: int, gen_task_coef: float = 20) -> list[list[tuple]]:
    """OpenCompass's SizePartitioner: a dataset's size is its sample count (x `gen_task_coef` for
    generation sets); datasets over `max_task_size` are split into chunks of at most that size,
    the others packed, largest first, into tasks of at most that size. Tasks are lists of
    (dataset, start fraction, stop fraction)."""
    def size(d: SimDataset) -> int:
        return d.samples * (gen_task_coef if d.name.startswith(GENERATION_PREFIXES) else 1)

    tasks, current, current_size = [], [], 0
    for d in sorted(datasets, key=lambda d: -size(d)):
        if size(d) > max_task_size:
            k = math.ceil(size(d) / max_task_size)
            tasks.extend([[(d, i / k, (i + 1) / k)] for i in range(k)])
            continue
        if current and current_size + size(d) > max_task_size:
            tasks.append(current)
            current, current_size = [], 0
        current.append((d, 0.0, 1.0))
        current_size += size(d)
    if current:
        tasks.append(current)
    return tasks


def simulate_suite(datasets: list[SimDataset], nodes: int, p: SimParams, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    # Predicted = the history; actual = what happens this time (the same draw for every policy).
    factor = {d.name: math.exp(rng.gauss(0.0, p.noise)) for d in datasets}
    costs = [DatasetCost(DatasetRef(name=d.name), d.samples, d.infer_s, d.metric_s) for d in datasets]
    slot_names = [f"n{n}g{g}" for n in range(nodes) for g in range(p.gpus_per_node)]

    def new_slots(queues: dict[str, list] | None = None) -> list[_Slot]:
        return [_Slot(int(n[1:].split("g")[0]), n, list((queues or {}).get(n, []))) for n in slot_names]

    def to_sim(trial: Trial, naive: bool) -> _SimTrial:
        return _SimTrial([_SimShard(s.predicted_gpu_s * factor[s.dataset.name],
                                    s.predicted_metric_s * factor[s.dataset.name]) for s in trial.shards], naive)

    def cost(trial: _SimTrial, inline: bool) -> float:
        infer = sum(s.actual_infer_s for s in trial.shards)
        prep = p.prep_s if (trial.naive and p.legacy) else p.prep_cached_s * len(trial.shards)
        metric = sum(s.actual_metric_s for s in trial.shards) if inline else 0.0
        return p.engine_init_s + prep + infer + metric

    def fifo_run(trials: list[_SimTrial], metrics_inline: bool, metric_jobs: callable = None) -> float:
        queue = list(trials)
        return _simulate(new_slots(), lambda s: queue.pop(0) if queue else None, p, preload=False,
                         metrics_inline=metrics_inline, start_at={}, trial_cost=cost, metric_jobs=metric_jobs)

    # Naive: one trial per dataset, FIFO from one shared queue, remote load per trial, metrics inline.
    naive_trials = decompose(costs, slots=len(slot_names), backend="vllm", output_dir="-", load_s=0.0,
                             policy=Policy.naive())
    naive_makespan = fifo_run([to_sim(t, True) for t in naive_trials], metrics_inline=True)

    # Old reference: the coordinator's own split (by predicted runtime), remote load per trial, metrics inline.
    split_trials = decompose(costs, slots=len(slot_names), backend="vllm", output_dir="-", load_s=0.0,
                             policy=Policy(batch_small=False, split_large=True, preload=False,
                                           metrics_in_slot=True, order="fifo"))
    split_makespan = fifo_run([to_sim(t, True) for t in split_trials], metrics_inline=True)

    # OpenCompass-style splitting baseline (the headline's): size partitioner, FIFO over every
    # GPU, the model loaded from storage per task (same per-stream cap and node sharing), the same
    # prompt cache, and - more than OpenCompass does - each task's metrics on the node's CPU pool
    # as soon as its inference ends. Its two knobs (max_task_size, gen_task_coef) are tuned per
    # scenario by trying a grid and keeping its best makespan: an oracle tuning in its favour.
    def size_trials(max_task_size: int, coef: float) -> list[_SimTrial]:
        return [_SimTrial([_SimShard(d.infer_s * factor[d.name] * (b - a), d.metric_s * factor[d.name] * (b - a))
                           for d, a, b in task], False) for task in size_partition(datasets, max_task_size, coef)]

    tuned = []
    for coef in (1, 3, 10, 20):   # OpenCompass's default gen_task_coef is 20
        total_size = sum(d.samples * (coef if d.name.startswith(GENERATION_PREFIXES) else 1) for d in datasets)
        # OpenCompass's default max_task_size 40000, and a geometric grid from 1 to 16 tasks per GPU.
        for m in sorted({40000, *(math.ceil(total_size / (len(slot_names) * 2 ** (i / 2))) for i in range(9))}):
            tuned.append((fifo_run(size_trials(m, coef), metrics_inline=False), m, coef))
    splitting_makespan, max_task_size, gen_coef = min(tuned)
    best = size_trials(max_task_size, gen_coef)
    # OpenCompass as it runs: the eval stage (one metric job per dataset, on CPU workers) starts
    # after the whole inference stage.
    infer_stage = fifo_run(best, metrics_inline=False, metric_jobs=lambda t: [])
    workers = [infer_stage] * (p.cpu_workers_per_node * nodes)
    for d in datasets:
        heapq.heappush(workers, heapq.heappop(workers) + d.metric_s * factor[d.name])
    staged_makespan = max(workers)

    # Coordinator: preload once per node, plan from predictions, metrics on the CPU pool.
    per_trial_overhead = p.shm_load_s + p.engine_init_s + p.prep_cached_s
    trials = decompose(costs, slots=len(slot_names), backend="vllm", output_dir="-", load_s=per_trial_overhead)
    plan = assign(trials, slot_names, Policy())
    slots = new_slots({n: [to_sim(plan.trial(t), False) for t in plan.assignment[n]] for n in slot_names})
    preload_done = {n: p.preload_s for n in range(nodes)}   # one copy per node
    coord_makespan = _simulate(slots, lambda s: s.queue.pop(0) if s.queue else None, p, preload=True,
                               metrics_inline=False, start_at=preload_done, trial_cost=cost)

    total_gpu_work = sum(d.infer_s * factor[d.name] for d in datasets)
    lower_bound = total_gpu_work / len(slot_names)
    return {"naive_s": naive_makespan, "coordinator_s": coord_makespan, "speedup": naive_makespan / coord_makespan,
            "lower_bound_s": lower_bound, "ratio_to_lower_bound": coord_makespan / lower_bound,
            "trials": len(trials), "naive_trials": len(naive_trials), "split_baseline_s": split_makespan,
            "speedup_vs_split_baseline": split_makespan / coord_makespan, "split_trials": len(split_trials),
            "splitting_s": splitting_makespan, "splitting_tasks": len(best), "max_task_size": max_task_size,
            "gen_task_coef": gen_coef,
            "speedup_vs_splitting": splitting_makespan / coord_makespan,
            "splitting_staged_s": staged_makespan, "speedup_vs_splitting_staged": staged_makespan / coord_makespan}


# ----------------------------------------------------------------------------- real run

REAL_SUITE = """
name: bench
backend: transformers
backend_options: {batch_size: 8, torch_threads: 1, device: cpu}
slots: 2
isolation: process
metric_workers: 2
sandbox: {timeout_s: 3.0}
datasets:
  - name: humaneval
    options: {limit: 32, max_new_tokens: 128}
  - name: perplexity
    options: {data_dir: DATA, max_windows: 64, seq_len: 256}
  - name: arith-em
  - name: capitals-mc
"""


# --smoke: REAL_SUITE's datasets, a few samples each, on one slot process (each slot process's start,
# its imports and model load, is most of a run's seconds on a small machine)
SMOKE_SUITE = REAL_SUITE.replace("slots: 2\n", "slots: 1\n") \
    .replace("options: {limit: 32, max_new_tokens: 128}", "options: {limit: 2, max_new_tokens: 16}") \
    .replace("max_windows: 64", "max_windows: 4") \
    .replace("- name: arith-em\n", "- name: arith-em\n    options: {limit: 4}\n") \
    .replace("- name: capitals-mc\n", "- name: capitals-mc\n    options: {limit: 4}\n")


def real_run(work: Path, repeats: int = 5, suite_text: str = REAL_SUITE, hidden: int = 256, layers: int = 4,
             warmup: bool = True) -> dict[str, float]:
    """`warmup=False` (--smoke): no untimed run first; the first naive run fills the history the
    coordinator's run then plans with (every policy's run records its runtimes)."""
    from evalsuite.coordinator import Policy
    from testing.tiny_checkpoint import make_tiny_checkpoint
    from evalsuite.history import RuntimeHistory
    from evalsuite.runner import evaluate
    from evalsuite.suite import load_suite

    model = make_tiny_checkpoint(work / "storage" / "step-00000100", hidden=hidden, layers=layers)
    suite_file = work / "suite.yaml"
    suite_file.write_text(suite_text.replace("DATA", str(model / "data")))
    suite = load_suite(str(suite_file), overrides={"preload_root": str(work / "shm")})
    history = RuntimeHistory(work / "history.json")
    quiet = lambda text: None  # noqa: E731
    if warmup:
        evaluate(f"file://{model}", suite, work / "warmup", history=history, echo=quiet)   # fills the history
    naive_s, coord_s = [], []
    for _ in range(repeats):  # alternate the two, take medians: the machine is shared and noisy
        t0 = time.perf_counter()
        naive = evaluate(f"file://{model}", suite, work / "naive", history=history, policy=Policy.naive(),
                         echo=print)
        naive_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        coord = evaluate(f"file://{model}", suite, work / "coordinator", history=history, echo=print)
        coord_s.append(time.perf_counter() - t0)
        shutil.rmtree(work / "naive")
        shutil.rmtree(work / "coordinator")   # resume would otherwise skip every shard next time
    assert naive.results.keys() == coord.results.keys() and not naive.failed_datasets and not coord.failed_datasets
    naive_med, coord_med = sorted(naive_s)[repeats // 2], sorted(coord_s)[repeats // 2]
    return {"naive_s": naive_med, "coordinator_s": coord_med, "speedup": naive_med / coord_med,
            "same_scores": naive.results == coord.results}


def _restore_env(saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_times(work: Path, repeats: int = 3, hidden: int = 512, layers: int = 8) -> dict[str, float]:
    """Load a model (by default ~25M parameters): S3 (moto on 127.0.0.1) -> local -> from_pretrained,
    vs /dev/shm."""
    from moto.server import ThreadedMotoServer

    from evalsuite.backends import load_backend
    from testing.tiny_checkpoint import make_tiny_checkpoint
    from evalsuite.preload import copy_from_storage, preload, remove_preload
    from infra.storage import open_storage

    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request log lines
    model = make_tiny_checkpoint(work / "big", hidden=hidden, layers=layers, vocab_size=2048)
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        import boto3

        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"]).create_bucket(Bucket="models")
        url = "s3://models/big"
        storage = open_storage(url)
        for f in model.rglob("*"):
            if f.is_file() and "data" not in f.parts:
                # put_bytes, not put_file: put_file's mmap sometimes fails to close while botocore
                # still holds a view of it (BufferError; reported to infra/storage's owner).
                storage.put_bytes(f.relative_to(model).as_posix(), f.read_bytes())
        size_mb = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 1e6
        storage_s, shm_s = [], []
        for _ in range(repeats):
            scratch = Path(tempfile.mkdtemp(dir=work))
            t0 = time.perf_counter()
            copy_from_storage(url, scratch)          # what a trial without a preload does
            load_backend("transformers", scratch, {"device": "cpu"}).close()
            storage_s.append(time.perf_counter() - t0)
            shutil.rmtree(scratch)
        local = preload(url, work / "shm-bench")
        for _ in range(repeats):
            t0 = time.perf_counter()
            load_backend("transformers", local, {"device": "cpu"}).close()
            shm_s.append(time.perf_counter() - t0)
        remove_preload(url, work / "shm-bench")
    finally:
        server.stop()
        _restore_env(saved)
    return {"model_mb": size_mb, "load_s_storage": sorted(storage_s)[len(storage_s) // 2],
            "load_s_shm": sorted(shm_s)[len(shm_s) // 2]}


FLOW_SUITE = """
name: flowbench
backend: transformers
backend_options: {batch_size: 8, torch_threads: 1, device: cpu}
slots: 2
metric_workers: 1
datasets:
  - name: arith-em
  - name: capitals-mc
  - name: humaneval
    options: {limit: 4, max_new_tokens: 32}
"""


def history_in_flow(work: Path) -> dict[str, object]:
    """Run the evaluate-checkpoint flow twice; did the second plan use the first run's runtimes?"""
    os.environ.setdefault("PREFECT_HOME", str(work / "prefect-home"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")  # a fresh home migrates first
    from testing.tiny_checkpoint import make_tiny_checkpoint
    from flows.evaluate import evaluate_checkpoint

    ckpt = make_tiny_checkpoint(work / "flow-ckpts" / "step-00000010")
    shutil.rmtree(ckpt / "data")
    suite = work / "flow-suite.yaml"
    suite.write_text(FLOW_SUITE)
    history = str(work / "flow-history.json")
    runs = [evaluate_checkpoint(str(ckpt), suite=str(suite), output_dir=str(work / f"flow-{i}"),
                                preload_root=str(work / "shm"), history_path=history) for i in range(2)]
    datasets = set(runs[1]["results"])
    return {"first": runs[0]["history_used"], "second": runs[1]["history_used"],
            "used": int(not runs[0]["history_used"] and set(runs[1]["history_used"]) == datasets)}


NODE_POOL = "forgeflow-eval-bench-nodes"
# The node figure's suite: REAL_SUITE's datasets at the size where inference, not a node's fixed
# start-up (its session's flow run, its slot process importing torch and the backend, the model
# load: ~10 s on one core here), is most of a node's work, as on GPU nodes whose trials run for
# minutes: all 164 HumanEval problems and 256 perplexity windows. `--node-suite real` runs
# REAL_SUITE itself (start-up-bound on this box).
NODE_SUITE = REAL_SUITE.replace("options: {limit: 32, max_new_tokens: 128}", "options: {limit: 164, max_new_tokens: 128}") \
    .replace("max_windows: 64", "max_windows: 256")


def two_node_real(work: Path, repeats: int = 2, suite_text: str = NODE_SUITE) -> dict[str, float] | None:
    """The evaluate-checkpoint flow on two local worker "nodes" vs one, on a real Prefect server.

    Each node is a Prefect process worker on its own work queue, pinned (with every flow run it
    starts: the precursor preload, the trials, the removal) to its own half of this machine's
    cores; the one-node run uses node A alone, so both runs have the same per-node hardware and
    the two-node run has twice the nodes, as two machines would; a node has one slot per core it
    has. The evaluating flow with its CPU metric jobs runs on node A in both runs (a head node
    that also has slots), so node B is all that the two-node run adds; only the Prefect server
    is not pinned. Same suite, same runtime history (warmed by one untimed two-node
    run), alternated, medians of the flow's wall time (export, preloads on the nodes, trials,
    metric jobs, removal)."""
    import statistics
    import subprocess

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from testing.tiny_checkpoint import make_tiny_checkpoint
    from flows.deploy import ROOT, ensure_work_pool
    from testing.prefect_server import LocalPrefectServer

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        print("two nodes vs one: skipped, this machine lends one core (each node needs its own)")
        return None
    half = len(cores) // 2
    node_cores = {"node-a": set(cores[:half]), "node-b": set(cores[half:2 * half])}
    server = LocalPrefectServer(work / "prefect-nodes", ROOT)
    saved = {k: os.environ.get(k) for k in ("PREFECT_API_URL", "FORGEFLOW_ROOT")}
    os.environ.update(PREFECT_API_URL=server.url, FORGEFLOW_ROOT=str(ROOT))
    try:
        with temporary_settings(updates={PREFECT_API_URL: server.url}):
            from flows.evaluate import evaluate_checkpoint

            ensure_work_pool(NODE_POOL)
            for node, node_set in node_cores.items():
                server.start_worker(NODE_POOL, node, cpus=node_set)
            deployed = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--name",
                                       "eval-node-work", "--prefect-file", str(ROOT / "prefect.yaml")],
                                      cwd=ROOT, capture_output=True, text=True,
                                      env=dict(server.env, FORGEFLOW_POOL=NODE_POOL))
            if deployed.returncode != 0:
                raise RuntimeError(f"prefect deploy eval-node-work failed: {deployed.stdout[-2000:]}"
                                   f"{deployed.stderr[-2000:]}")
            ckpt = make_tiny_checkpoint(work / "node-ckpts" / "step-00000100", hidden=256, layers=4)
            suite_file = work / "node-suite.yaml"
            # A CPU node runs one slot per core it has (two slots on one core would share it).
            suite_file.write_text(suite_text.replace("DATA", str(ckpt / "data")).replace("slots: 2", f"slots: {half}"))
            history = str(work / "node-history.json")
            runs = iter(range(10 ** 6))

            def run(nodes: list[str]) -> tuple[float, dict]:
                t0 = time.perf_counter()
                out = evaluate_checkpoint(str(ckpt), suite=str(suite_file), output_dir=str(work / f"nodes-{next(runs)}"),
                                          preload_root=str(work / "node-shm"), history_path=history, nodes=nodes)
                assert not out["failed"], out["failed"]
                return time.perf_counter() - t0, out

            # The evaluating flow (and its metric jobs, its sandboxed programs) runs on node A, as on a
            # head node that also has slots: in both runs, so node B is all the two-node run adds.
            # Threads and processes started from here on inherit it.
            os.sched_setaffinity(0, node_cores["node-a"])
            run(["node-a", "node-b"])   # fills the runtime history
            one, two, results = [], [], []
            for _ in range(repeats):    # alternate: the machine is shared and noisy
                for nodes, times in ((["node-a"], one), (["node-a", "node-b"], two)):
                    seconds, out = run(nodes)
                    times.append(seconds)
                    results.append(out["results"])
                    print(f"  {len(nodes)} node(s): {seconds:.1f}s wall (executor makespan {out['makespan_s']:.1f}s)")
    finally:
        os.sched_setaffinity(0, cores)
        server.stop()
        _restore_env(saved)
    one_s, two_s = statistics.median(one), statistics.median(two)
    return {"one_node_s": one_s, "two_node_s": two_s, "speedup": one_s / two_s,
            "cores_per_node": half, "same_scores": all(r == results[0] for r in results)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-real", action="store_true", help="simulation only")
    parser.add_argument("--real-only", action="store_true", help="only the real CPU run (speedup_real_cpu)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats of the real run")
    parser.add_argument("--flow-only", action="store_true", help="simulation + the Prefect flow's history check")
    parser.add_argument("--nodes-only", action="store_true",
                        help="simulation + two local worker nodes vs one on a Prefect server (speedup_2node_real)")
    parser.add_argument("--node-repeats", type=int, default=2, help="interleaved repeats of the node runs")
    parser.add_argument("--node-suite", choices=["full", "real"], default="full",
                        help="the node figure's suite: full-size datasets (default) or REAL_SUITE's")
    parser.add_argument("--smoke", action="store_true",
                        help="headline simulation point, one cut-down real run, one load each way of a small "
                             "model, no Prefect: seconds, same keys")
    args = parser.parse_args()
    if args.smoke:
        args.repeats = 1

    params = SimParams()
    suite = acme_like_suite()
    print(f"simulated suite: {len(suite)} datasets, {sum(d.infer_s for d in suite) / 3600:.1f} GPU-hours of "
          f"inference, {sum(d.metric_s for d in suite) / 3600:.1f} CPU-hours of metrics; storage "
          f"{params.node_storage_gb_s} GB/s per node, {params.stream_gb_s} GB/s per reader")
    sim = {}
    for nodes in (1, 4):
        sim[nodes] = simulate_suite(suite, nodes, params)
        r = sim[nodes]
        print(f"  {nodes} node(s) x {params.gpus_per_node} GPUs: coordinator {r['coordinator_s'] / 60:6.1f} min "
              f"({r['trials']} trials; lower bound {r['lower_bound_s'] / 60:.1f} min, at "
              f"{r['ratio_to_lower_bound']:.2f}x of it)")
        print(f"      OpenCompass-style splitting (size partitioner, tuned: max_task_size {r['max_task_size']}, "
              f"gen_task_coef {r['gen_task_coef']}; {r['splitting_tasks']} tasks) {r['splitting_s'] / 60:6.1f} min "
              f"-> {r['speedup_vs_splitting']:.2f}x; as OpenCompass stages it (eval after inference) "
              f"{r['splitting_staged_s'] / 60:.1f} min -> {r['speedup_vs_splitting_staged']:.2f}x")
        print(f"      naive (one trial per dataset, metrics in the slot) {r['naive_s'] / 60:6.1f} min "
              f"-> {r['speedup']:.2f}x")
    legacy = {n: simulate_suite(suite, n, SimParams(node_storage_gb_s=1.25, legacy=True)) for n in (1, 4)}
    print(f"  old handicapped comparison (naive without the prompt cache, preload at the node rate, 1.25 GB/s): "
          f"{legacy[1]['speedup']:.2f}x / {legacy[4]['speedup']:.2f}x (1 / 4 nodes)")
    print("  sweep: speedup vs splitting (vs naive), 1 node / 4 nodes")
    sweep = []
    tails, node_rates, streams = ((1.0,), (params.node_storage_gb_s,), (params.stream_gb_s,)) if args.smoke else \
        ((0.5, 1.0, 2.0), (1.25, 3.1, 6.25), (0.25, 1.0))
    for tail in tails:
        for node_gb_s in node_rates:
            for stream in streams:
                p = SimParams(node_storage_gb_s=node_gb_s, stream_gb_s=stream)
                r1, r4 = (simulate_suite(acme_like_suite(tail=tail), n, p) for n in (1, 4))
                sweep.append((r1["speedup_vs_splitting"], r4["speedup_vs_splitting"]))
                print(f"    tail x{tail:<4} storage {node_gb_s:5.2f} GB/s/node {stream:4.2f} GB/s/reader: "
                      f"{r1['speedup_vs_splitting']:.2f}x ({r1['speedup']:.2f}x) / "
                      f"{r4['speedup_vs_splitting']:.2f}x ({r4['speedup']:.2f}x)")
    headline = {"speedup_1node": round(sim[1]["speedup"], 3), "speedup_4node": round(sim[4]["speedup"], 3),
                "ratio_to_lower_bound_4node": round(sim[4]["ratio_to_lower_bound"], 3),
                "speedup_vs_splitting_1node": round(sim[1]["speedup_vs_splitting"], 3),
                "speedup_vs_splitting_4node": round(sim[4]["speedup_vs_splitting"], 3),
                "speedup_vs_splitting_1node_min_sweep": round(min(a for a, _ in sweep), 3),
                "speedup_vs_splitting_4node_min_sweep": round(min(b for _, b in sweep), 3),
                "storage_gb_s_per_node": params.node_storage_gb_s,
                "speedup_real_cpu": None, "load_s_storage": None, "load_s_shm": None,
                "speedup_2node_real": None, "history_used_in_flow": None}
    def nodes_figure(work: Path) -> None:
        nodes = two_node_real(work, repeats=args.node_repeats,
                              suite_text=NODE_SUITE if args.node_suite == "full" else REAL_SUITE)
        if nodes:
            print(f"two local nodes ({nodes['cores_per_node']} core(s) each, {args.node_suite} suite) vs one, "
                  f"evaluate-checkpoint flow on a "
                  f"Prefect server, median of {args.node_repeats}: one node {nodes['one_node_s']:.1f}s, two nodes "
                  f"{nodes['two_node_s']:.1f}s, speedup {nodes['speedup']:.2f}x, same scores: {nodes['same_scores']}")
            headline.update(speedup_2node_real=round(nodes["speedup"], 3))

    if args.nodes_only:
        work = Path(tempfile.mkdtemp(prefix="eval-bench-"))
        os.environ.setdefault("FORGEFLOW_STATE_DIR", str(work / "state"))
        try:
            nodes_figure(work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    elif args.flow_only:
        work = Path(tempfile.mkdtemp(prefix="eval-bench-"))
        os.environ.setdefault("FORGEFLOW_STATE_DIR", str(work / "state"))
        try:
            flow = history_in_flow(work)
            print(f"Prefect flow, two runs: datasets predicted from history: first {flow['first']}, "
                  f"second {flow['second']}")
            headline.update(history_used_in_flow=flow["used"])
        finally:
            shutil.rmtree(work, ignore_errors=True)
    elif not args.skip_real:
        work = Path(tempfile.mkdtemp(prefix="eval-bench-"))
        os.environ.setdefault("FORGEFLOW_STATE_DIR", str(work / "state"))
        try:
            real = (real_run(work, repeats=1, suite_text=SMOKE_SUITE, hidden=64, layers=2, warmup=False)
                    if args.smoke else real_run(work, repeats=args.repeats))
            print(f"real (this machine, {1 if args.smoke else 2} slot(s), median of {args.repeats}, interleaved): naive {real['naive_s']:.1f}s, coordinator "
                  f"{real['coordinator_s']:.1f}s, speedup {real['speedup']:.2f}x, same scores: {real['same_scores']}")
            if args.real_only:
                headline.update(speedup_real_cpu=round(real["speedup"], 3))
                print(json.dumps(checked_headline(headline, HEADLINE_KEYS)), flush=True)
                return 0
            loads = load_times(work, repeats=1, hidden=128, layers=2) if args.smoke else load_times(work)
            print(f"model load ({loads['model_mb']:.0f} MB of weights): from S3 storage "
                  f"{loads['load_s_storage']:.2f}s, from /dev/shm {loads['load_s_shm']:.2f}s")
            headline.update(speedup_real_cpu=round(real["speedup"], 3),
                            load_s_storage=round(loads["load_s_storage"], 3), load_s_shm=round(loads["load_s_shm"], 3))
            if args.smoke:
                print(json.dumps(checked_headline(headline, HEADLINE_KEYS)), flush=True)
                return 0
            flow = history_in_flow(work)
            print(f"Prefect flow, two runs: datasets predicted from history: first {flow['first']}, "
                  f"second {flow['second']}")
            headline.update(history_used_in_flow=flow["used"])
            nodes_figure(work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(checked_headline(headline, HEADLINE_KEYS)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
