"""Slots as device sets: each trial in its own process sees only its slot's devices (the CPU twin
runs for real; the GPU path differs only in the device list and the backend), and the naive policy
holds a slot until its metrics are done."""

from __future__ import annotations

import os
import threading

import pytest

from evalsuite.coordinator import Policy
from evalsuite.errors import EvalConfigError, TrialError
from evalsuite.executor import LocalSubmitter, execute
from evalsuite.history import RuntimeHistory
from evalsuite.runner import build_plan
from evalsuite.sandbox import Sandbox
from evalsuite.suite import load_suite
from evalsuite.trials import ShardSpec, Trial, backend_options_for, trial_environment
from evalsuite.datasets import DatasetRef


def _trial(backend: str = "transformers", devices: list[str] | None = None, **options) -> Trial:
    shard = ShardSpec(dataset=DatasetRef(name="arith-em"), shard=0, start=0, stop=1)
    return Trial(trial_id="t", shards=[shard], backend=backend, backend_options=options, output_dir="/x",
                 devices=devices or [], isolation="process")


def test_a_gpu_slot_is_its_devices_and_vllm_tensor_parallel_is_their_count():
    env, seen = trial_environment(_trial("vllm", ["cuda:2", "cuda:3"]), base={"PATH": "/bin"})
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert seen.devices == ["cuda:0", "cuda:1"]                       # renumbered inside the process
    assert backend_options_for(seen) == {"device": "cuda", "tensor_parallel_size": 2}
    env, seen = trial_environment(_trial("transformers", ["cuda:5"]), base={})
    assert env["CUDA_VISIBLE_DEVICES"] == "5" and backend_options_for(seen) == {"device": "cuda"}
    # In a thread (no process of its own) a one-GPU slot names its GPU directly.
    assert backend_options_for(_trial("transformers", ["cuda:1"])) == {"device": "cuda:1"}
    env, seen = trial_environment(_trial("transformers", ["cpu:1"]), base={})
    assert env["CUDA_VISIBLE_DEVICES"] == "" and backend_options_for(seen) == {"device": "cpu"}
    with pytest.raises(TrialError, match="tensor_parallel_size 4 but its slot has 2 GPU"):
        backend_options_for(_trial("vllm", ["cuda:0", "cuda:1"], tensor_parallel_size=4))


def test_suite_device_sets_are_validated():
    suite = load_suite("arith-em", overrides={"slots": 2, "isolation": "process",
                                              "devices": ["cuda:0,1", ["cuda:2", "cuda:3"]]})
    assert suite.slot_devices() == [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]
    with pytest.raises(EvalConfigError, match="several GPUs .* set isolation: process"):
        load_suite("arith-em", overrides={"slots": 1, "devices": ["cuda:0,1"]})
    with pytest.raises(EvalConfigError, match="is not a device"):
        load_suite("arith-em", overrides={"slots": 1, "devices": ["gpu0"]})
    with pytest.raises(EvalConfigError, match="one per slot"):
        load_suite("arith-em", overrides={"slots": 2, "devices": ["cpu"]})


def _suite(tiny_model, limit: int = 4, **overrides):
    suite = load_suite("arith-em,capitals-mc", overrides={"backend_options": {"batch_size": 8}, **overrides})
    for entry in suite.datasets:
        entry.options["limit"] = limit
    return suite


@pytest.mark.slow  # ~17 s on 2 cores: two slots' processes, a trial each
def test_cpu_twin_two_slots_each_trial_in_its_own_pinned_process(tiny_model, tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    slot_cores = [cores[0], cores[-1]]
    # One trial per dataset (2 samples x 0.05 s predicted each, not over the 0.1 s target): one per slot.
    suite = _suite(tiny_model, limit=2, slots=2, isolation="process", devices=[f"cpu:{c}" for c in slot_cores],
                   target_trial_s=0.1)
    plan = build_plan(suite, model_path=str(tiny_model), output_dir=tmp_path / "out",
                      history=RuntimeHistory(tmp_path / "h.json"), preloaded_path=str(tiny_model))
    assert plan.devices == {"slot0": [f"cpu:{slot_cores[0]}"], "slot1": [f"cpu:{slot_cores[1]}"]}
    assert sorted(len(ids) for ids in plan.assignment.values()) == [1, 1]
    submitter = LocalSubmitter(slots=2, metric_workers=1, sandbox=Sandbox())
    try:
        report = execute(plan, submitter, history=RuntimeHistory(tmp_path / "h.json"))
    finally:
        submitter.close()
    assert not report.failed_datasets and set(report.results) == {"arith-em", "capitals-mc"}
    for outcome in report.outcomes:
        worker = outcome.result.worker
        assert worker["pid"] != str(os.getpid())                        # its own process
        assert worker["cpu_affinity"] == str(slot_cores[int(outcome.slot[-1])])   # its slot's core
        assert worker["cuda_visible_devices"] == ""                     # a CPU slot sees no GPU
    assert RuntimeHistory(tmp_path / "h.json").knows("arith-em", "transformers", plan.model_key)


def test_a_slots_process_runs_its_later_trials_with_the_same_engine(tiny_model, tmp_path):
    # Two trials (one per dataset) on one process-isolated slot: one worker process serves both.
    suite = _suite(tiny_model, limit=2, slots=1, isolation="process", devices=["cpu"], target_trial_s=0.05)
    plan = build_plan(suite, model_path=str(tiny_model), output_dir=tmp_path / "out",
                      history=RuntimeHistory(tmp_path / "h.json"), preloaded_path=str(tiny_model))
    assert len(plan.trials) == 2
    submitter = LocalSubmitter(slots=1, metric_workers=1, sandbox=Sandbox())
    try:
        report = execute(plan, submitter)
        worker = submitter.processes._all[0].proc
    finally:
        submitter.close()
    assert not report.failed_datasets and set(report.results) == {"arith-em", "capitals-mc"}
    first, second = (next(o for o in report.outcomes if o.trial_id == tid).result for tid in plan.assignment["slot0"])
    assert first.worker["pid"] == second.worker["pid"] == str(worker.pid) != str(os.getpid())
    assert not first.engine_reused and second.engine_reused         # loaded once for the slot
    assert worker.poll() is not None                                # closed with the executor


def test_naive_policy_holds_the_slot_until_its_metrics_are_done(tiny_model, tmp_path):
    suite = _suite(tiny_model, slots=1)
    plan = build_plan(suite, model_path=str(tiny_model), output_dir=tmp_path / "out",
                      history=RuntimeHistory(tmp_path / "h.json"), policy=Policy.naive(),
                      model_source=str(tiny_model))
    assert plan.metrics_in_slot and len(plan.trials) == 2
    events, lock = [], threading.Lock()

    def on_event(kind, info):
        with lock:
            events.append((kind, info.get("trial")))

    submitter = LocalSubmitter(slots=1, metric_workers=2, sandbox=Sandbox())
    try:
        report = execute(plan, submitter, on_event=on_event)
    finally:
        submitter.close()
    assert not report.failed_datasets
    first, second = (t.trial_id for t in plan.trials)
    assert events.index(("metric_done", first)) < events.index(("trial_started", second))


def test_vllm_takes_its_gpus_from_its_process_and_is_optional(tmp_path):
    import importlib.util

    from evalsuite.backends import load_backend
    from evalsuite.errors import BackendUnavailableError

    with pytest.raises(EvalConfigError, match="CUDA_VISIBLE_DEVICES"):
        load_backend("vllm", tmp_path, {"device": "cuda:3"})
    with pytest.raises(EvalConfigError, match="need isolation: process"):
        load_suite("arith-em", overrides={"backend": "vllm", "slots": 1, "devices": ["cuda:0"]})
    if importlib.util.find_spec("vllm") is None:     # the CPU environment: a clear error, no import at load
        with pytest.raises(BackendUnavailableError, match=r"forgeflow\[gpu\]"):
            load_backend("vllm", tmp_path, {"device": "cuda"})


def test_every_node_of_an_allocation_brings_the_suites_slots(tiny_model, tmp_path):
    # batches of 1: 4 samples can be cut 4 ways (batches of 8 would keep each dataset whole)
    suite = _suite(tiny_model, slots=2, isolation="process", devices=["cuda:0", "cuda:1,2"], target_trial_s=0.05,
                   backend_options={"batch_size": 1})
    plan = build_plan(suite, model_path=str(tiny_model), output_dir=tmp_path, history=RuntimeHistory(tmp_path / "h"),
                      nodes=["node-a", "node-b"])
    assert plan.slots == ["node-a/slot0", "node-a/slot1", "node-b/slot0", "node-b/slot1"]
    assert plan.devices["node-b/slot1"] == ["cuda:1", "cuda:2"]
    for slot, ids in plan.assignment.items():
        for tid in ids:
            assert plan.trial(tid).node == slot.split("/")[0]
            assert plan.trial(tid).devices == plan.devices[slot]
    assert {plan.trial(t).node for ids in plan.assignment.values() for t in ids} == {"node-a", "node-b"}

