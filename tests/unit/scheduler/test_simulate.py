"""The trace simulator's accounting, duration scaling, traces, plots and the CLI's JSON output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.cli import main as forgeflow
from scheduler.cluster import load_cluster, parse_cluster
from scheduler.placement import first_fit_select, placed_step_time
from scheduler.simulate import POLICIES, Simulator, SimulationError, plot_jct_cdf, simulate
from scheduler.traces import (
    TraceError,
    TraceJob,
    generate_acme_trace,
    generate_frenzy_queue,
    read_trace_csv,
    trace_shares,
    write_trace_csv,
)

REPO = Path(__file__).resolve().parents[3]
CLUSTERS = REPO / "configs" / "clusters"


@pytest.fixture(scope="module")
def frenzy():
    return load_cluster(CLUSTERS / "frenzy-testbed.yaml")


@pytest.fixture(scope="module")
def mixed_trace():
    """Training jobs (GPT-2/BERT) and demand-only jobs that contend for the 11-GPU testbed."""
    jobs = generate_frenzy_queue(24, seed=3, span_s=1200)
    jobs += [
        TraceJob(job_id=f"eval-{i}", arrival_s=60.0 * i, num_gpus=1 + (i % 3), category="evaluation",
                 duration_s=300.0 + 40 * i)
        for i in range(12)
    ]
    return jobs


@pytest.fixture(scope="module")
def results(frenzy, mixed_trace):
    return simulate(frenzy, mixed_trace, POLICIES)


def test_every_job_finishes_exactly_once(results, mixed_trace):
    ids = sorted(j.job_id for j in mixed_trace)
    for policy, result in results.items():
        assert sorted(r.job_id for r in result.records) == ids, policy
        for r in result.records:
            assert r.rejected is None
            assert r.arrival_s <= r.start_s < r.end_s, (policy, r)
            assert len(r.gpus) == r.num_gpus > 0


def test_gpu_seconds_are_conserved(results):
    for policy, result in results.items():
        held = sum(r.num_gpus * (r.end_s - r.start_s) for r in result.records)
        assert held == pytest.approx(result.busy_gpu_seconds, rel=1e-9), policy
        summary = result.summary()
        assert 0 < summary["utilisation"] <= 1
        assert summary["finished"] == summary["jobs"]


def test_no_gpu_is_ever_held_by_two_jobs_and_never_more_than_the_cluster(results, frenzy):
    total = frenzy.total_gpus
    for policy, result in results.items():
        assert all(0 <= busy <= total for _, busy in result.timeline)
        assert result.timeline[-1][1] == 0  # everything released at the end
        recs = sorted(result.records, key=lambda r: r.start_s)
        for i, a in enumerate(recs):
            for b in recs[i + 1:]:
                if b.start_s >= a.end_s:
                    continue
                assert not set(a.gpus) & set(b.gpus), (policy, a.job_id, b.job_id)


def test_baseline_uses_exactly_the_requested_gpus(results, mixed_trace):
    requested = {j.job_id: j.num_gpus for j in mixed_trace}
    assert all(r.num_gpus == requested[r.job_id] for r in results["fcfs"].records)


def test_demand_only_duration_scales_with_gpu_tflops():
    cluster = parse_cluster({"name": "a40", "nodes": [{"name": "n", "gpu_type": "A40", "gpu_count": 4}]})
    job = TraceJob(job_id="e", arrival_s=0.0, num_gpus=2, duration_s=1000.0, reference_gpu="A100-40G")
    record = Simulator(cluster, [job], "has").run().records[0]
    assert record.end_s - record.start_s == pytest.approx(1000.0 * 312 / 149.7)


def test_training_job_runs_steps_times_the_step_time_of_its_placement(frenzy):
    job = TraceJob(job_id="t", arrival_s=0.0, num_gpus=2, model_name="gpt2-350m", global_batch=32, steps=500)
    sim = Simulator(frenzy, [job], "fcfs")
    record = sim.run().records[0]
    opt = sim.options["t"]["fcfs"][0]
    assert record.gpu_type == opt.gpu_type and record.num_gpus == 2
    # Rebuild the placement it got and price it independently.
    from scheduler.placement import build_placement

    by_node: dict[str, int] = {}
    for node_name, _ in record.gpus:
        by_node[node_name] = by_node.get(node_name, 0) + 1
    placement = build_placement(frenzy, by_node, job="t", gpu_type=opt.gpu_type, dp=opt.dp, tp=opt.tp, pp=opt.pp)
    assert record.end_s - record.start_s == pytest.approx(500 * placed_step_time(opt.plan, placement, frenzy))


def test_jobs_no_gpu_type_can_hold_are_rejected_not_lost(frenzy):
    jobs = [
        TraceJob(job_id="ok", arrival_s=0.0, num_gpus=1, duration_s=60.0),
        TraceJob(job_id="huge", arrival_s=1.0, num_gpus=64, duration_s=60.0),
    ]
    result = Simulator(frenzy, jobs, "ect").run()
    by_id = {r.job_id: r for r in result.records}
    assert by_id["huge"].rejected and by_id["huge"].end_s is None
    assert by_id["ok"].end_s is not None
    assert result.summary()["rejected"] == 1


def test_unknown_policy_is_a_clear_error(frenzy):
    with pytest.raises(SimulationError, match="unknown policy 'lottery'"):
        simulate(frenzy, generate_frenzy_queue(2), ["lottery"])


def test_acme_generator_follows_the_published_job_and_gpu_time_shares():
    jobs = generate_acme_trace(4000, cluster_gpus=1280, seed=1)
    shares = trace_shares(jobs)
    assert 0.91 <= shares["evaluation"]["jobs"] <= 0.95
    assert 0.02 <= shares["pretrain"]["jobs"] <= 0.04
    assert shares["pretrain"]["gpu_time"] >= 0.85
    assert shares["evaluation"]["gpu_time"] <= 0.03
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(jobs, jobs[1:]))
    trained = {j.model_name for j in jobs if j.is_training}
    assert {"llama-7b", "mistral-large-123b"} <= trained


def test_helios_style_csv_is_read_and_bad_files_are_named(tmp_path):
    csv_path = tmp_path / "helios.csv"
    csv_path.write_text(
        "job_id,user,vc,gpu_num,cpu_num,state,submit_time,start_time,end_time\n"
        "j1,u,vc1,8,64,COMPLETED,2020-04-01 10:00:00,2020-04-01 10:05:00,2020-04-01 11:05:00\n"
        "j0,u,vc1,0,4,COMPLETED,2020-04-01 09:00:00,2020-04-01 09:00:00,2020-04-01 09:10:00\n"
        "j2,u,vc2,2,16,FAILED,2020-04-01 10:30:00,2020-04-01 10:30:00,2020-04-01 10:40:00\n"
    )
    jobs = read_trace_csv(csv_path)
    assert [j.job_id for j in jobs] == ["j1", "j2"]  # the CPU-only job is skipped
    assert jobs[0].arrival_s == 0 and jobs[1].arrival_s == 1800
    assert jobs[0].duration_s == 3600 and jobs[0].num_gpus == 8
    assert [j.job_id for j in read_trace_csv(csv_path, keep_states=("COMPLETED",))] == ["j1"]

    round_trip = read_trace_csv(write_trace_csv(generate_frenzy_queue(5, seed=2), tmp_path / "own.csv"))
    assert len(round_trip) == 5 and all(j.is_training for j in round_trip)

    sia = tmp_path / "sia.csv"
    sia.write_text("name,time,application,num_gpus,duration\nj0,0,resnet50,4,600\nj1,30,llama-7b,64,7200\n")
    sia_jobs = read_trace_csv(sia)
    assert [j.is_training for j in sia_jobs] == [False, False]  # no global_batch: demand-only
    assert sia_jobs[1].num_gpus == 64 and sia_jobs[1].arrival_s == 30

    bad = tmp_path / "bad.csv"
    bad.write_text("id,submit_time\n1,0\n")
    with pytest.raises(TraceError, match="missing column"):
        read_trace_csv(bad)


def test_jct_cdf_png_is_written(results, tmp_path):
    png = plot_jct_cdf(results, tmp_path / "cdf.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_plan_json(capsys):
    code = forgeflow(["plan", str(REPO / "configs" / "tiny-cpu.yaml"), "--cluster",
                      str(CLUSTERS / "frenzy-testbed.yaml"), "--json", "--top", "3"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert len(out["plans"]) == 3 and out["feasible_plans"] >= 3
    placement = out["placement"]
    assert placement["world_size"] == out["chosen"]["num_gpus"]
    assert sum(n["nproc_per_node"] for n in placement["launch"]) == placement["world_size"]
    assert set(out["chosen"]["memory"]) >= {"weights", "gradients", "optimizer_states", "activations"}


def test_cli_plan_json_reports_an_infeasible_job(tmp_path, capsys):
    job = tmp_path / "huge.yaml"
    job.write_text(
        "name: huge\nmodel: {num_layers: 88, hidden_size: 12288, num_attention_heads: 96, num_query_groups: 8,\n"
        "  ffn_hidden_size: 28672, vocab_size: 32768, seq_length: 4096}\n"
        "training: {global_batch_size: 64, steps: 10, precision: bf16}\n"
    )
    # What-if beyond today's worker (one pipeline stage): alternatives exist only with more stages.
    code = forgeflow(["plan", str(job), "--cluster", str(CLUSTERS / "frenzy-testbed.yaml"), "--json", "--max-pp", "16"])
    out = json.loads(capsys.readouterr().out)
    assert code == 2 and "fits on no GPU type" in out["error"] and out["alternatives"]


def test_cli_simulate_json(tmp_path, capsys):
    code = forgeflow(["simulate", "--generate", "frenzy", "--jobs", "12", "--out", str(tmp_path), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["jobs"] == 12
    assert set(out["policies"]) == {"fcfs", "has", "ect"}
    # The CLI reports what the simulator computes on the same trace (seed 0), ratios included.
    direct = simulate(load_cluster(CLUSTERS / "frenzy-testbed.yaml"), generate_frenzy_queue(12, seed=0),
                      ["fcfs", "has", "ect"])
    for policy, result in direct.items():
        got = out["policies"][policy]
        assert got["avg_jct_s"] == pytest.approx(result.summary()["avg_jct_s"])
        assert got["jct_ratio_vs_fcfs"] == pytest.approx(
            result.summary()["avg_jct_s"] / direct["fcfs"].summary()["avg_jct_s"])
    assert Path(out["png"]).is_file()


def test_ect_reservations_keep_a_big_job_from_starving_behind_a_stream_of_small_ones():
    """Small 2-GPU jobs keep at least one running at all times on a 4-GPU node, so the
    opportunistic baseline never sees 4 free GPUs until the stream ends; ECT's HRRN order
    and reservation start the big job while the stream still runs."""
    cluster = parse_cluster({"name": "one", "nodes": [{"name": "n", "gpu_type": "A100-40G", "gpu_count": 4}]})
    jobs = [TraceJob(job_id="first", arrival_s=0.0, num_gpus=2, duration_s=100.0),
            TraceJob(job_id="big", arrival_s=1.0, num_gpus=4, duration_s=1000.0)]
    jobs += [TraceJob(job_id=f"small-{i}", arrival_s=5.0 + 30 * i, num_gpus=2, duration_s=50.0) for i in range(100)]
    last_small_arrival = jobs[-1].arrival_s
    results = simulate(cluster, jobs, ["fcfs", "ect"])
    start = {p: next(r.start_s for r in res.records if r.job_id == "big") for p, res in results.items()}
    assert start["fcfs"] > last_small_arrival
    assert start["ect"] < last_small_arrival / 2


# --- Slurm-style baselines and run-time noise -----------------------------------------------


def _one_node(gpus: int = 4):
    return parse_cluster({"name": "one", "nodes": [{"name": "n", "gpu_type": "A100-40G", "gpu_count": gpus}]})


def _golden_trace() -> list[TraceJob]:
    """A holds 2 of 4 GPUs until 100; B (4 GPUs) is the head from t=1; C (2 GPUs, 200 s)
    would push B back; D (2 GPUs, 50 s) ends before B could start anyway."""
    return [TraceJob(job_id="A", arrival_s=0.0, num_gpus=2, duration_s=100.0),
            TraceJob(job_id="B", arrival_s=1.0, num_gpus=4, duration_s=100.0),
            TraceJob(job_id="C", arrival_s=2.0, num_gpus=2, duration_s=200.0),
            TraceJob(job_id="D", arrival_s=3.0, num_gpus=2, duration_s=50.0)]


def test_baselines_golden_start_times_on_a_tiny_trace():
    results = simulate(_one_node(), _golden_trace(), ["fcfs", "easy", "sjf"])
    starts = {p: {r.job_id: r.start_s for r in res.records} for p, res in results.items()}
    # EASY: C would delay the head's reservation (t=100) and waits; D backfills.
    assert starts["easy"] == {"A": 0.0, "B": 100.0, "C": 200.0, "D": 3.0}
    # Opportunistic FCFS starts C at once and delays B until C ends.
    assert starts["fcfs"] == {"A": 0.0, "B": 202.0, "C": 2.0, "D": 100.0}
    # SJF: at t=100 the shorter D goes before B; B waits for C.
    assert starts["sjf"] == {"A": 0.0, "B": 202.0, "C": 2.0, "D": 100.0}


def test_easy_reservation_is_set_from_predicted_ends_not_actual_ones():
    """A runs twice as long as predicted: at t=3 EASY believes the head starts at 100, so D
    (50 s) backfills; C, which would overlap that predicted reservation, still waits."""
    jobs = _golden_trace()
    jobs[0] = TraceJob(job_id="A", arrival_s=0.0, num_gpus=2, duration_s=100.0, runtime_factor=2.0)
    result = Simulator(_one_node(), jobs, "easy").run()
    by_id = {r.job_id: r for r in result.records}
    assert by_id["A"].end_s == 200.0  # the actual run time is prediction x factor
    assert by_id["D"].start_s == 3.0 and by_id["B"].start_s == 200.0 and by_id["C"].start_s == 300.0


def test_easy_pass_never_delays_the_head_jobs_reservation():
    """Random states of one 8x4-GPU type: whatever EASY backfills, the head job's GPUs are still
    predicted free at the shadow time computed from the running jobs before the pass."""
    import random

    from scheduler.policy import Busy, FreeGpus, Option, QueuedJob, schedule_pass

    backfilled_somewhere = 0
    for seed in range(20):
        rng = random.Random(seed)
        cluster = parse_cluster({"name": "c", "nodes": [{"name": "n", "replicas": 8, "gpu_type": "A100-40G",
                                                         "gpu_count": 4}]})
        now, running = 1000.0, []
        free = FreeGpus(cluster)
        for i in range(rng.randint(4, 9)):  # running jobs hold GPUs on the real cluster object
            opt = Option(gpu_type="A100-40G", num_gpus=rng.choice([2, 4, 8]), unit=1, min_memory_bytes=0, run_s=1.0)
            if free.try_place(f"r{i}", opt, first_fit_select) is not None:
                running.append(Busy("A100-40G", opt.num_gpus, now + rng.uniform(10, 500)))
        queue = [QueuedJob(f"q{i}", 0.0, [Option(gpu_type="A100-40G", num_gpus=rng.choice([1, 2, 4, 8, 16, 24]),
                                                 unit=1, min_memory_bytes=0, run_s=rng.uniform(5, 800))])
                 for i in range(12)]
        free_before = free.by_type["A100-40G"]
        started, _ = schedule_pass("easy", now, queue, running, free)
        started_ids = {q.job_id for q, _, _ in started}
        head = next((q for q in queue if q.job_id not in started_ids), None)
        if head is None:
            continue
        in_order = queue[:queue.index(head)]
        assert all(q.job_id in started_ids for q in in_order)  # FCFS up to the head
        need = head.options[0].num_gpus
        # The shadow time from the state the head saw: running jobs plus the in-order starts.
        first = [o for q, o, _ in started if q in in_order]
        releases = sorted([(b.end_s, b.num_gpus) for b in running] + [(now + o.run_s, o.num_gpus) for o in first])
        free_then = free_before - sum(o.num_gpus for o in first)
        avail, shadow = free_then, now
        for end, n in releases:
            if avail >= need:
                break
            avail, shadow = avail + n, end
        # Backfilled jobs still running at the shadow time must leave the head its GPUs.
        backfilled = [o for q, o, _ in started if q not in in_order]
        backfilled_somewhere += bool(backfilled)
        still_held = sum(o.num_gpus for o in backfilled if now + o.run_s > shadow)
        free_at_shadow = free_then + sum(n for end, n in releases if end <= shadow)
        assert free_at_shadow - still_held >= need, (seed, shadow, sorted(started_ids))
    assert backfilled_somewhere >= 3  # the states do exercise backfilling


def test_runtime_noise_is_log_normal_around_the_prediction_and_seeded():
    import math
    import statistics

    from scheduler.traces import apply_runtime_noise

    jobs = [TraceJob(job_id=f"j{i}", arrival_s=float(i), num_gpus=1, duration_s=60.0) for i in range(3000)]
    assert all(j.runtime_factor == 1.0 for j in apply_runtime_noise(jobs, 0.0))
    noisy = apply_runtime_noise(jobs, 0.5, seed=7)
    logs = [math.log(j.runtime_factor) for j in noisy]
    assert abs(statistics.mean(logs)) < 0.05 and 0.45 < statistics.stdev(logs) < 0.55
    assert [j.runtime_factor for j in apply_runtime_noise(jobs, 0.5, seed=7)] == [j.runtime_factor for j in noisy]
    assert jobs[0].runtime_factor == 1.0  # copies: the input trace is untouched
    with pytest.raises(TraceError, match="sigma"):
        apply_runtime_noise(jobs, -0.1)


def test_offered_load_uses_the_clusters_effective_capacity():
    from scheduler.simulate import effective_capacity, offered_load

    crius = load_cluster(CLUSTERS / "crius-sim.yaml")
    # 320 GPUs of each type, worth their peak TFLOP/s over the A100's 312.
    by_hand = 320 * (312 + 149.7 + 125 + 125) / 312
    assert effective_capacity(crius) == pytest.approx(by_hand, rel=1e-6) and effective_capacity(crius) < 1280
    jobs = [TraceJob(job_id="a", arrival_s=0.0, num_gpus=2, duration_s=100.0),
            TraceJob(job_id="b", arrival_s=100.0, num_gpus=1, duration_s=100.0)]
    assert offered_load(jobs, capacity=4.0) == pytest.approx(300 / (4 * 100))
