"""Delegated Slurm: reading `sbatch --test-only` (Slurm 22.05's own words) and choosing the option
that finishes first (no Slurm needed; the real one: tests/integration/slurm/test_slurm_delegated.py)."""

from __future__ import annotations

import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from infra.launch import CHOOSE_ON_NODE_0, LaunchRequest, NodeLaunch
from infra.slurm import SlurmLauncher, SlurmSettings, exclude_nodes
from infra.slurm_start import (SlurmStartRefused, StartCandidate, StartOption, choose_start, earliest_completion,
                               parse_test_only)

# What Slurm 22.05 (Debian's slurm-wlm) printed on the local test cluster, on stderr.
STARTS = "sbatch: Job 8 to start at 2026-11-29T07:54:09 using 1 processors on nodes vm in partition debug\n"
NO_NODES = "allocation failure: Requested node configuration is not available\n"
NO_PARTITION = "sbatch: error: invalid partition specified: nope\nallocation failure: Invalid partition name specified\n"
NO_GRES = "sbatch: error: Invalid generic resource (gres) specification\n"
T0 = datetime(2026, 11, 29, 8, 0, tzinfo=timezone.utc)


def test_a_start_is_read_as_utc_with_slurms_words():
    answer = parse_test_only(0, STARTS)
    assert answer.start == datetime(2026, 11, 29, 7, 54, 9, tzinfo=timezone.utc) and not answer.refused
    assert answer.said == "Job 8 to start at 2026-11-29T07:54:09 using 1 processors on nodes vm in partition debug"


@pytest.mark.parametrize("stderr, said", [
    (NO_NODES, "Requested node configuration is not available"),
    (NO_PARTITION, "invalid partition specified: nope; Invalid partition name specified"),
    (NO_GRES, "Invalid generic resource (gres) specification"),
    ("", "sbatch --test-only exited 1 and said nothing"),
])
def test_a_refusal_keeps_slurms_reason(stderr, said):
    answer = parse_test_only(1, stderr)
    assert answer.refused and answer.start is None and answer.said == said


def test_an_answer_without_a_start_is_no_start():
    answer = parse_test_only(0, "sbatch: something else entirely\n")
    assert answer.refused and "no start time" in answer.said and "something else entirely" in answer.said


def _option(label: str, start_in_s: float | None, run_s: float) -> StartOption:
    start = None if start_in_s is None else T0 + timedelta(seconds=start_in_s)
    return StartOption(label, run_s, start, None if start is None else start + timedelta(seconds=run_s),
                       "refused" if start is None else "starts", ())


def test_the_earliest_completion_wins_not_the_earliest_start():
    options = [_option("1 GPU now, 10 h", 0, 10 * 3600),        # starts first, finishes last
               _option("8 GPUs in 2 h, 3 h", 2 * 3600, 3 * 3600),  # finishes at 5 h: chosen
               _option("16 GPUs, refused", None, 3600),
               _option("4 GPUs in 1 h, 5 h", 3600, 5 * 3600)]       # 6 h
    assert earliest_completion(options) == 1


def test_a_tie_goes_to_the_planners_better_ranked_option():
    assert earliest_completion([_option("a", 0, 100), _option("b", 50, 50)]) == 0
    with pytest.raises(ValueError):
        earliest_completion([_option("a", None, 1)])


def _request(tmp_path: Path, nodes: int, nproc: int) -> LaunchRequest:
    specs = [NodeLaunch(node=f"plan-{i}", address=f"plan-{i}", node_rank=i, nnodes=nodes, nproc_per_node=nproc,
                        cuda_visible_devices="", master_addr="plan-0", master_port=CHOOSE_ON_NODE_0,
                        first_global_rank=i * nproc) for i in range(nodes)]
    return LaunchRequest("job-x", specs, [], tmp_path / "run", attempt=1)


def _fake_slurm(monkeypatch, answers: dict[str, tuple[int, str]]) -> list[list[str]]:
    """sbatch --test-only answering by the --nodes asked; returns the commands run."""
    asked: list[list[str]] = []

    def run(args, launcher, environ):
        asked.append(args)
        assert environ["TZ"] == "UTC"
        nodes = next(a for a in args if a.startswith("--nodes="))
        code, stderr = answers[nodes]
        return subprocess.CompletedProcess(args, code, "", stderr)

    monkeypatch.setattr("infra.slurm_start._run", run)
    return asked


def test_each_option_is_tested_with_the_options_it_would_be_submitted_with(tmp_path, monkeypatch):
    at = lambda t: f"sbatch: Job 9 to start at {t:%Y-%m-%dT%H:%M:%S} using 8 processors on nodes g1 in partition gpu\n"
    asked = _fake_slurm(monkeypatch, {"--nodes=1": (0, at(T0)), "--nodes=2": (0, at(T0 + timedelta(hours=2))),
                                      "--nodes=4": (1, NO_NODES)})
    settings = SlurmSettings(partition="gpu", account="llm", qos="normal", signal_s=90,
                             gres_types={"H100-80G": "h100"})
    launcher = SlurmLauncher(settings, gpu_type="H100-80G")
    exclude_nodes(tmp_path / "run", ["bad-1"])  # a node check found it faulty: --exclude, tested and submitted
    candidates = [StartCandidate("8x", _request(tmp_path, 1, 8), "H100-80G", 10 * 3600),
                  StartCandidate("16x", _request(tmp_path, 2, 8), "H100-80G", 3 * 3600),
                  StartCandidate("32x", _request(tmp_path, 4, 8), "H100-80G", 3600)]
    choice = choose_start(launcher, candidates)
    assert [a[:2] for a in asked] == [["sbatch", "--test-only"]] * 3
    for args, candidate, option in zip(asked, candidates, choice.options):
        assert args[2:] == launcher.submit_args(candidate.request, candidate.gpu_type) == list(option.args)
        assert not any(a.startswith(("--nodelist", "-w")) for a in args)
        assert {"--partition=gpu", "--account=llm", "--qos=normal", "--signal=B:TERM@90",
                "--gpus-per-node=h100:8", "--exclude=bad-1"} <= set(args)
    assert choice.chosen.label == "16x" and choice.chosen.completion == T0 + timedelta(hours=5)
    assert choice.options[0].start == T0 and choice.options[0].completion == T0 + timedelta(hours=10)
    assert choice.options[2].refused and choice.options[2].said == "Requested node configuration is not available"
    summary = choice.summary(T0).splitlines()
    assert summary[2].startswith("  ✓ 16x: starts 2026-11-29 10:00:00 UTC (in 2.0 h)")
    assert "8x: starts 2026-11-29 08:00:00 UTC (now)" in summary[1]
    assert "32x: refused by Slurm (Requested node configuration is not available)" in summary[3]


def test_every_option_refused_names_each_and_slurms_reason(tmp_path, monkeypatch):
    _fake_slurm(monkeypatch, {"--nodes=1": (1, NO_PARTITION), "--nodes=2": (1, NO_NODES)})
    launcher = SlurmLauncher(SlurmSettings(partition="nope"), gpu_type="cpu")
    with pytest.raises(SlurmStartRefused) as refused:
        choose_start(launcher, [StartCandidate("2x cpu", _request(tmp_path, 1, 2), "cpu", 60),
                                StartCandidate("4x cpu", _request(tmp_path, 2, 2), "cpu", 30)])
    message = str(refused.value)
    assert "none of the 2 option(s) of job-x" in message
    assert "2x cpu: invalid partition specified: nope; Invalid partition name specified" in message
    assert "4x cpu: Requested node configuration is not available" in message
    assert [o.refused for o in refused.value.options] == [True, True]


def test_the_flow_asks_about_each_gpu_type_and_count_once(tmp_path):
    """tasks.cluster_tasks.slurm_candidates: the best plan of each (type, count), the admitted one
    as admitted, the others laid out on the inventory; run time = steps left x step time."""
    from scheduler.cluster import parse_cluster
    from scheduler.orchestrator.options import options_from_plans
    from scheduler.placement import place_plans
    from scheduler.planner import PlannerConfig, plan_job
    from tasks.cluster_tasks import plans_table, slurm_candidates
    from training.config import load_job_spec

    inventory = parse_cluster({"name": "site", "nodes": [
        {"name": f"n{i}", "gpu_type": "cpu", "gpu_count": 2, "gpu_memory_gib": 4, "peak_tflops": 0.05}
        for i in range(2)], "slurm": {"partition": "debug"}})
    spec = load_job_spec("configs/tiny-cpu.yaml", {"run_dir": str(tmp_path / "run")})
    plans = plan_job(spec, inventory, PlannerConfig(gpu_counts=(1, 2, 4)))
    admitted = place_plans(plans[1:2], inventory, job="tiny")
    found = slurm_candidates(spec, plans, admitted, 3, inventory, steps_left=40)
    keys = [(p.gpu_type, p.num_gpus) for p, _, _ in found]
    assert keys == [(o.gpu_type, o.num_gpus) for o in options_from_plans(plans, spec.training.steps, ["cpu"])["has"]]
    assert len(set(keys)) == len(keys) >= 2
    for plan, laid, candidate in found:
        assert candidate.request.world_size == plan.num_gpus and candidate.request.attempt == 3
        assert candidate.run_s == pytest.approx(40 * laid.predicted_step_time_s)
        if (plan.gpu_type, plan.num_gpus) == (admitted.gpu_type, admitted.world_size):
            assert laid is admitted
    four = next(c for p, _, c in found if p.num_gpus == 4)
    assert len(four.request.nodes) == 2  # 2 nodes x 2: Slurm is asked for --nodes=2
    option = StartOption("x", 1.0, T0, T0 + timedelta(seconds=1), "Job 1 to start", ())
    refused = StartOption("y", 1.0, None, None, "Requested node configuration is not available", ())
    rows = plans_table(plans, found[0][0], starts={id(found[0][0]): option, id(found[1][0]): refused})
    assert rows[0]["slurm_start"] == "2026-11-29 08:00:00 UTC" and rows[0]["chosen"] == "✓"
    assert rows[0]["slurm_completes"] == "2026-11-29 08:00:01 UTC"
    by_plan = {r["rank"]: r for r in rows}
    assert by_plan[plans.index(found[1][0]) + 1]["slurm_start"].startswith("refused: Requested node")
    assert "slurm_start" not in plans_table(plans)[0]
