"""Coordinator properties: exact cover of samples, exactly-once execution, slot capacity, history."""

from __future__ import annotations

import random
import threading

import pytest

from evalsuite.coordinator import DatasetCost, Policy, assign, decompose
from evalsuite.executor import LocalSubmitter, execute
from evalsuite.datasets import DatasetRef
from evalsuite.history import RuntimeHistory, model_size_key
from evalsuite.runner import build_plan
from evalsuite.sandbox import Sandbox
from evalsuite.suite import load_suite


def _costs(rng: random.Random, n: int) -> list[DatasetCost]:
    out = []
    for i in range(n):
        samples = rng.randint(1, 2000)
        out.append(DatasetCost(DatasetRef(name=f"ds{i}"), samples, gpu_s=samples * rng.uniform(0.01, 2.0),
                               metric_s=samples * rng.choice([0.0, 0.001, 0.5])))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_decompose_covers_every_sample_exactly_once(seed):
    rng = random.Random(seed)
    costs = _costs(rng, rng.randint(1, 40))
    slots = rng.randint(1, 16)
    batch = rng.choice([1, 8])
    trials = decompose(costs, slots=slots, backend="transformers", output_dir="/x", load_s=5.0, batch_size=batch)
    covered: dict[str, list[tuple[int, int]]] = {}
    for t in trials:
        for s in t.shards:
            covered.setdefault(s.dataset.name, []).append((s.start, s.stop))
    assert set(covered) == {c.ref.name for c in costs}
    for c in costs:
        ranges = sorted(covered[c.ref.name])
        assert ranges[0][0] == 0 and ranges[-1][1] == c.samples
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))        # no gap, no overlap
        assert all(stop > start for start, stop in ranges)
        assert all(start % batch == 0 for start, _ in ranges)                 # cut at whole batches
    assert len({t.trial_id for t in trials}) == len(trials)
    # Batching: never more trials than shards, and short datasets share a model load.
    assert len(trials) <= sum(len(t.shards) for t in trials)

    plan = assign(trials, [f"s{i}" for i in range(slots)])
    assigned = [tid for ids in plan.assignment.values() for tid in ids]
    assert sorted(assigned) == sorted(t.trial_id for t in trials)             # each trial once
    for ids in plan.assignment.values():                                       # one at a time per slot
        spans = sorted((plan.predicted_start[i], plan.predicted_end[i]) for i in ids)
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:]))


def test_a_split_dataset_costs_no_more_batches_than_whole():
    # 32 samples in batches of 8 are 4 passes; 6 shards of 5-6 would be 6 passes.
    costs = [DatasetCost(DatasetRef(name="code"), 32, gpu_s=30.0, metric_s=6.0),
             DatasetCost(DatasetRef(name="mc"), 40, gpu_s=1.0, metric_s=0.0)]
    trials = decompose(costs, slots=2, backend="transformers", output_dir="/x", load_s=0.0, batch_size=8)
    code = [s for t in trials for s in t.shards if s.dataset.name == "code"]
    assert len(code) == 4 and all(s.samples == 8 for s in code)
    unaligned = decompose(costs, slots=2, backend="transformers", output_dir="/x", load_s=0.0)
    assert len([s for t in unaligned for s in t.shards if s.dataset.name == "code"]) > 4   # what it did before


def test_lpt_plan_beats_fifo_on_a_skewed_suite():
    rng = random.Random(0)
    costs = _costs(rng, 30)
    slots = [f"s{i}" for i in range(8)]
    trials = decompose(costs, slots=8, backend="b", output_dir="/x", load_s=5.0)
    lpt = assign(trials, slots, Policy())
    fifo = assign(trials, slots, Policy(order="fifo"))
    assert lpt.predicted_makespan <= fifo.predicted_makespan
    naive = assign(decompose(costs, slots=8, backend="b", output_dir="/x", load_s=5.0, policy=Policy.naive()),
                   slots, Policy.naive())
    assert len(naive.trials) == len(costs)                                    # one trial per dataset
    assert lpt.predicted_makespan < naive.predicted_makespan


def test_execute_runs_each_trial_once_within_slot_capacity_and_updates_history(tiny_model, tmp_path):
    suite = load_suite("arith-em,capitals-mc,perplexity", overrides={"slots": 2, "target_trial_s": 0.05})
    for entry in suite.datasets:
        entry.options.update({"limit": 6} if entry.name != "perplexity"
                             else {"data_dir": str(tiny_model / "data"), "max_windows": 6, "seq_len": 32})
    history = RuntimeHistory(tmp_path / "history.json")
    plan = build_plan(suite, model_path=str(tiny_model), output_dir=tmp_path / "out", history=history,
                      preloaded_path=str(tiny_model))
    assert len(plan.trials) >= 3      # the tiny target splits datasets into shards

    events: list[tuple[str, str, str]] = []
    running: dict[str, int] = {s: 0 for s in plan.slots}
    peak = {s: 0 for s in plan.slots}
    lock = threading.Lock()

    def on_event(kind, info):
        with lock:
            events.append((kind, info.get("trial", ""), info.get("slot", "")))
            if kind == "trial_started":
                running[info["slot"]] += 1
                peak[info["slot"]] = max(peak[info["slot"]], running[info["slot"]])
            elif kind == "trial_done":
                running[info["slot"]] -= 1

    assert plan.model_key == model_size_key(tiny_model) and plan.history_used == []
    submitter = LocalSubmitter(slots=2, metric_workers=2, sandbox=Sandbox())
    try:
        report = execute(plan, submitter, history=history, on_event=on_event)
    finally:
        submitter.close()
    started = [t for kind, t, _ in events if kind == "trial_started"]
    assert sorted(started) == sorted(t.trial_id for t in plan.trials)          # exactly once
    assert max(peak.values()) == 1                                             # never two per slot
    assert not report.failed_datasets
    assert set(report.results) == {"arith-em", "capitals-mc", "perplexity"}
    # One engine per slot: more trials than slots, so some trial found its slot's engine loaded.
    assert any(o.result.engine_reused for o in report.outcomes)
    assert 0.0 <= report.results["capitals-mc"]["accuracy"] <= 1.0
    # Every metric job ran after its trial's inference finished.
    for tid in started:
        done_at = events.index(("trial_done", tid, next(s for k, t, s in events if t == tid and k == "trial_started")))
        metric_at = [i for i, (k, t, _) in enumerate(events) if k == "metric_done" and t == tid]
        assert metric_at and min(metric_at) > done_at

    saved = RuntimeHistory(tmp_path / "history.json")
    key = model_size_key(tiny_model)
    for name in ("arith-em", "capitals-mc", "perplexity"):
        assert saved.knows(name, "transformers", key)
        entry = saved.data[RuntimeHistory.key(name, "transformers", key)]
        assert entry["gpu_s_per_sample"] > 0 and "metric_s_per_sample" in entry
    # The next plan's predictions come from the history, not the default factors.
    replanned = build_plan(suite, model_path=str(tiny_model), output_dir=tmp_path / "out2", history=saved)
    assert replanned.history_used == ["arith-em", "capitals-mc", "perplexity"]
    arith = next(s for t in replanned.trials for s in t.shards if s.dataset.name == "arith-em")
    per_sample = saved.data[RuntimeHistory.key("arith-em", "transformers", key)]["gpu_s_per_sample"]
    assert arith.predicted_gpu_s == pytest.approx(per_sample * arith.samples)
