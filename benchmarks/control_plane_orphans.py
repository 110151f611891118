"""How long a job's ranks outlive its SIGKILLed flow on the Prefect node launcher (issue 28 item 7).

    .venv/bin/python benchmarks/control_plane_orphans.py [--smoke]

The drill (testing/orphan_drill.py): a holder process does what the pretrain flow does around a
launch on the Prefect launcher (a one-node cluster registered, the job queued and admitted, the
launch request recorded, the lease held by the flow's own HeldJob with the flows' lease,
scheduler.orchestrator.seat.FLOW_LEASE_S = 30 s, grace FLOW_GRACE_S), and the real `node-launch`
flow run (flows/node_launch.py, on Prefect's ephemeral API) starts the node's torchrun: two CPU
ranks of a tiny model. Once both have trained a few steps, the holder is SIGKILLed; the figure
is the time from that SIGKILL until no rank process is left. The node-launch run stops them
itself: its lease check (infra.lease_guard over scheduler.orchestrator.node_lease) sees the lease
run out in the state database, then the ranks' graceful stop (SIGTERM: they commit the step
they are on and exit; SIGKILL after 10 s). Goal: at most the lease period + 10 s.

Baseline: before the node-side check, nothing on the node looked at the lease, so the ranks of a
flow killed this way trained until the job's last step (the orchestrator gave their GPUs to the
next job lease + grace after the kill: both ran on them). Not run here: with this drill's
100,000-step job it does not end; the fair comparison is "never stopped" on the same drill.

When the last renewal before the kill fell decides most of the figure (the holder renews every
lease / 3, so the lease runs out 2/3 to 1 lease after the kill);
`orphan_stop_after_lease_s` is the part that is the node's: from the lease's expiry to the last
rank gone (the look, the SIGTERM, the step's commit, the exit). The worst case is about one lease
plus that.

Last line: {"orphan_ranks_stopped_s", "orphan_stop_after_lease_s", "orphan_lease_s", "orphan_goal_s",
"orphan_step_committed"} (HEADLINE_KEYS; `run(smoke)` returns the same dict for
benchmarks/control_plane_faults.py).
`--smoke`: the same drill with a 3 s lease and one rank (seconds, not the figure; the two-rank
drill's stop and commit are asserted by tests/integration/flows/test_orphan_ranks.py).

Measured here (2 shared CPU cores, 2026-11-28): orphan_ranks_stopped_s 25.05 (goal 40),
orphan_stop_after_lease_s 1.26, the stop's step committed; earlier runs 26.56 and, before the
worker skipped its last garbage collection at exit (training/train.py), 37.37.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.headline import checked_headline  # noqa: E402

HEADLINE_KEYS = ("orphan_ranks_stopped_s", "orphan_stop_after_lease_s", "orphan_lease_s", "orphan_goal_s",
                 "orphan_step_committed")
SMOKE_LEASE_S = 3.0
# tests/tiny_job.py's model shape (a step in tens of milliseconds), 1 MB of the corpus; the job is
# long enough never to end on its own, with no periodic checkpoint (the stop's commit is the only one)
JOB = {"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
                 "ffn_hidden_size": 128, "vocab_size": 512, "seq_length": 64},
       "training": {"global_batch_size": 8, "micro_batch_size": 2, "steps": 100000, "lr_decay_steps": 100000},
       "data": {"max_corpus_mb": 1}}


def _job(work: Path) -> Path:
    import yaml

    from training.config import load_job_spec
    from training.data import prepare_data

    overrides = {**JOB, "data": {**JOB["data"], "data_dir": str(work / "data")}}
    spec = load_job_spec(ROOT / "configs" / "tiny-cpu.yaml", overrides)
    prepare_data(spec, progress=False)
    job = spec.model_dump(mode="json", exclude_none=True)
    job.pop("base", None)
    job.update(name="orphaned", run_dir=str(work / "orphaned" / "run"))
    job["checkpoint"].update({"url": str(work / "orphaned" / "checkpoints"), "interval": 1000000})
    path = work / "orphaned.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def _start_temporary_server() -> threading.Thread | None:
    """Prefect's temporary server, the one node-launch's flow run would start on its first call,
    started in a thread now so that it comes up while the job's data is prepared (join the thread
    before the drill: a second start while the first waits for the server would return at once).
    None when a server is configured (PREFECT_API_URL)."""
    if os.environ.get("PREFECT_API_URL"):
        return None
    # imported here (node-launch's run imports it anyway): an import in the thread would hold the
    # interpreter's lock against the data preparation's imports; starting and waiting do not
    from prefect.server.api.server import SubprocessASGIServer

    thread = threading.Thread(target=SubprocessASGIServer().start, name="prefect-temporary-server", daemon=True)
    thread.start()
    return thread


def run(smoke: bool) -> dict:
    """The drill once, in a fresh state database and Prefect home; the headline values."""
    work = Path(tempfile.mkdtemp(prefix="forgeflow-orphans-"))
    os.environ.setdefault("PREFECT_HOME", str(work / "prefect-home"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    saved = {k: os.environ.get(k) for k in ("FORGEFLOW_STATE_DIR", "FORGEFLOW_DB_URL")}
    os.environ["FORGEFLOW_STATE_DIR"] = str(work / "state")  # this run's orchestrator only
    os.environ.pop("FORGEFLOW_DB_URL", None)
    try:
        from scheduler.orchestrator.seat import FLOW_GRACE_S, FLOW_LEASE_S
        from testing.orphan_drill import run_orphan_drill

        lease_s = SMOKE_LEASE_S if smoke else FLOW_LEASE_S
        server = _start_temporary_server()
        job = _job(work)
        if server is not None:
            server.join()
        drill = run_orphan_drill(job, lease_s=lease_s, grace_s=SMOKE_LEASE_S if smoke else FLOW_GRACE_S,
                                 nproc=1 if smoke else 2, cluster="orphans", timeout_s=600)
        print(f"holder SIGKILLed at step {drill.killed_step}; ranks {drill.ranks} gone after "
              f"{drill.gone_s} s; node-launch: {drill.stop_reason}; committed step {drill.stop_step}",
              file=sys.stderr, flush=True)
        if drill.gone_s is None:
            raise SystemExit(f"the ranks {drill.ranks} still ran 600 s after their flow was killed")
        after = None if drill.lease_ran_out_s is None else round(drill.gone_s - drill.lease_ran_out_s, 2)
        return {"orphan_ranks_stopped_s": round(drill.gone_s, 2), "orphan_stop_after_lease_s": after,
                "orphan_lease_s": lease_s,
                "orphan_goal_s": lease_s + 10.0,
                "orphan_step_committed": drill.stop_step is not None and drill.stop_step in drill.committed_steps}
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help=f"a {SMOKE_LEASE_S:g} s lease, one rank: seconds, not the figure")
    args = parser.parse_args()
    print(json.dumps(checked_headline(run(args.smoke), HEADLINE_KEYS)), flush=True)


if __name__ == "__main__":
    main()
