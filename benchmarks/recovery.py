"""Recovery of the pretrain flow from several kinds of faults, against plain torchrun restarts.

    .venv/bin/python benchmarks/recovery.py [--config configs/tiny-cpu.yaml]
        [--kinds cuda_error,oom_kill,hang,oom_kill,node_loss] [--fault-every-s 20] [--interval 10]
        [--hang-timeout-s 300] [--baseline-hang] [--launcher local|slurm]

The job runs on a two-node cluster whose nodes are this machine (node-a and node-b, one CPU
"GPU" each: data parallel 2 across the nodes). Runs, one after the other, same job and data:

1. forgeflow, fault-free: wall time W0 of the `pretrain` flow for S steps;
2. forgeflow with faults: the same flow while the faults below fire;
3. the outside baseline, plain torchrun: `torchrun --nnodes=1:2 --rdzv-backend=c10d
   --max-restarts=N` on each node (elastic, so that it can go on without a lost node), the
   same job, checkpoint interval and faults at the same steps. torchrun restarts every worker
   after any failure and each worker resumes from the newest committed checkpoint: no
   diagnosis, no node check, no cordon, no decision. (One shim, `--torchrun-worker`: with
   torch 2.13 a worker torchrun restarts hangs in its first gloo group, reading the previous
   round's addresses from the agent's store; the shim gives each round a fresh store. Without
   it plain torchrun cannot restart this job at all; it costs milliseconds.)

The faults (`--kinds`, in order). Fault k fires when the job reaches step at_k =
resume_{k-1} + steps-per-fault (steps-per-fault from `--fault-every-s` and a calibration run,
put mid-interval so that a fault resumed from the last interval's checkpoint loses about half an
interval of steps; a fault whose surviving rank commits the step it reached before exiting
(training.checkpointing's save after a peer's failure, in the worker both sides run) loses none):
  cuda_error  the worker's drill on rank 0 (PyTorch's illegal-memory-access text, exit 1)
  oom_kill    SIGKILL of a training rank's process from outside, as the kernel's OOM killer
              does (rank 1 the first time, then rank 0); nothing is printed
  hang        SIGSTOP of rank 1's process: it stops without a word and its peer blocks in the
              next collective. forgeflow sees its peer wait in that collective while rank 1's
              where-samples stop (infra.watch.collective_stall: 10 s and five steps), whatever
              --hang-timeout-s (the heartbeat timeout, the flow's default 300 s), and names rank 1
              and its node (`hang_detect_s`, `hang_culprit_named`); plain torchrun only once a
              collective times out (the worker's process group: 600 s; megatron's data-parallel
              group: 30 min)
  node_loss   every process of node-b SIGKILLed, and node-b stays dead
              (testing.node_faults.NodeLoss). forgeflow's node check finds it, cordons it, and
              the orchestrator places the job on node-a alone (data parallel 1, same global
              batch, the checkpoint resharded on load); torchrun's elastic rendezvous goes on
              with one node after its last-call timeout (30 s by default)

Per fault, from rank 0's run log (UTC timestamps) and the time the fault fired:
  seconds_to_resume = first step after the resume - the last step logged before the fault
  lost steps        = last step before the fault - the checkpoint step resumed from
and for forgeflow its phases, from the flow's failure records: detect (the flow saw the
failure - the last step), diagnose, act (node check, cordon, re-placement, backoff; warm, the
node check runs in the standby's waiting ranks), restart (torchrun, imports, checkpoint load, up
to the first step).

Why the baseline is fair: the same job, data, checkpoint interval and faults at the same
steps; both sides' torchrun agents check their ranks as often (torchrun's default monitor
interval, infra.launch.TORCHRUN_MONITOR_INTERVAL_S); torchrun restarts in place (its agents stay
up: no new launch, no flow, no diagnosis, no node check) and resumes from the same committed
checkpoints, so it is the floor of
"restart without thinking". forgeflow restarts warm (`--warm-standby on`, the default here:
infra.standby keeps the next attempt's agents and ranks started, imports done, waiting at a
gate), as it does by default on a node with two cores per rank; this 2-core box has fewer, so
the flow's own rule (`--warm-standby auto`) would start every attempt cold. The standby's start
(imports of two ranks and two agents) runs while the job trains, on the same two cores: its
cost is in forgeflow's wall times and goodput, not hidden. torchrun's workers restart cold
in place (its agents stay up), which is what torchrun does. The hang is reported separately (`hang_*` keys): both sides'
figures are mostly a detection timeout, a setting. torchrun's hang is run only with
`--baseline-hang` (it waits for the collective timeout, 30 min with megatron's default); without
it, its hang figure is not measured and `torchrun_hang_detect_timeout_s` says what it would
wait. The headline `resume_ratio_vs_torchrun_restart` is forgeflow's median time to resume over
torchrun's, over the faults both ran except the hang. What forgeflow's extra seconds buy (a
node cordoned for every later job, a diagnosis alerted, a stop where a restart cannot help)
is not in the ratio.

Goodput (the old headline) = W0 / W_faults. Last line, one JSON object: the old keys
(`seconds_to_resume_p50` now over the non-hang faults, `lost_steps_max`,
`checkpoint_interval_steps`, `goodput_with_faults_over_fault_free`, `phases_p50_s`,
`fault_every_s`, `faults`, `launcher`) and `fault_kinds`, `resume_ratio_vs_torchrun_restart`,
`torchrun_seconds_to_resume_p50`, `node_loss_seconds_to_resume`, `node_loss_world_size`,
`torchrun_node_loss_seconds_to_resume`, `hang_seconds_to_resume`, `hang_timeout_s`,
`torchrun_hang_seconds_to_resume`, `per_fault`.

`--smoke` (not a figure; the same flows, baseline and keys): one oom_kill, checkpoints every 4
steps, no calibration run (`--calibrate-steps 0`: faults at the smallest spacing, 6 steps), a
2-layer 64-wide model on 1 MB of the corpus, and no fault-free run (the run with the fault runs
the same flow; the placement is its first attempt's, and the goodput key is null), so two runs
of 16 short steps: the flow with the fault and the torchrun baseline. The keys of the last
line: HEADLINE_KEYS.

With `--launcher slurm` every forgeflow attempt (and node check) is a Slurm batch job on the
cluster SLURM_CONF names, or on a single-host Slurm this script starts (root, Debian's
slurm-wlm + munge); the node_loss kind needs the two local nodes and is refused there.
After the faults it runs two Slurm drills (`--slurm-drills preempt,pending`; each a flow run of
its own on the same job config, about a minute or two each; with `--launcher local` they do not
run and their keys are null). They are made for the single-host Slurm (they create partitions
and block its one node with --exclusive jobs): on a shared cluster, `--slurm-drills none`.

  preempt     (preempt_drill) partitions "recovery-low" (PriorityTier 1, PreemptMode=REQUEUE,
              GraceTime 30 s) and "recovery-high" (tier 2) are created as in
              tests/integration/slurm/test_slurm_preemption.py; the job trains in low, and at
              mid-interval a high job (`sleep 10`, --exclusive, as another user's) preempts it.
              `preempt_to_resumed_s`: from Slurm's preemption signal to rank 0's first step after
              the resume. The signal's time is Slurm's PreemptTime for our job (`scontrol show
              job`; whole seconds, so the later of it and our sbatch of the preemptor), not the
              ranks' 'stopped' event: the commit the signal starts is part of what the
              preemption costs. It includes the seconds the preemptor holds the node (the
              table's "held": ~10 s of sleep plus its start; a higher tier's, not forgeflow's to
              shorten), the commit (signal -> 'stopped') and the restart (the preemptor's EndTime
              -> first step: the flow's resubmission, Slurm's start, torchrun, imports, load).
              `preempt_lost_steps`: the newest step rank 0 trained before the stop minus the
              step it resumed from (goal 0: the ranks commit the step they are on); it is the
              preempt row of the per-fault table, with the restarts it spent (goal 0: a
              preemption is an interruption, not a failure).
  pending     (pending_drill) another user's `sleep` (--exclusive) holds the node; the job is
              submitted behind it and stays PENDING 60 s, past the heartbeat timeout (40 s,
              the drill's hang_timeout_s) and the watcher's start-up timeout (40 s, set as
              tests/integration/slurm/test_slurm_delegated.py does: the flow's 600 s default is
              too long to wait out here). `pending_reported_as_hang`, read from the flow's result:
              attempts that failed as a hang, failed while the job was PENDING, or were replaced
              by a new attempt before it left PENDING (goal 0). With a watcher that counted the
              queue as start-up time this reads 1 (checked once by hand: the hang fires at the
              start-up timeout, a restart is spent), so the 0 is measured, not built in.

No baseline for either drill figure. Plain torchrun under Slurm has no flow: a job that is not
requeueable (`--no-requeue`, or a site's JobRequeue=0) ends at the preemption and never comes
back (no figure to compare); a requeueable one (Slurm's default) is put back in the queue by
Slurm and its script starts torchrun again, from the newest checkpoint the worker committed.
Its ranks are the same worker, whose SIGTERM handler commits the step it is on, so it would
lose 0 steps too; what differs is only who resubmits (Slurm's requeue, or the flow's new
attempt), and the wait for the preemptor dominates either, so the figure is not a ratio.
Torchrun has no notion of PENDING (it starts when the batch job does), so a hang verdict on a
queued job is a failure mode of a supervisor that watches from outside, forgeflow's alone.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.chdir(REPO)

from benchmarks.headline import checked_headline  # noqa: E402
from training.runlog import epoch_seconds  # noqa: E402

KINDS = ("cuda_error", "oom_kill", "hang", "node_loss")
HEADLINE_KEYS = (
    "launcher", "seconds_to_resume_p50", "lost_steps_max", "checkpoint_interval_steps",
    "goodput_with_faults_over_fault_free", "phases_p50_s", "fault_every_s", "faults", "fault_kinds",
    "resume_ratio_vs_torchrun_restart", "torchrun_seconds_to_resume_p50", "node_loss_seconds_to_resume",
    "node_loss_world_size", "torchrun_node_loss_seconds_to_resume", "hang_timeout_s", "hang_seconds_to_resume",
    "hang_detect_s", "hang_culprit_named",
    "torchrun_hang_seconds_to_resume", "torchrun_hang_detect_timeout_s", "per_kind_p50_s",
    "preempt_to_resumed_s", "preempt_lost_steps", "pending_reported_as_hang",
)
DRILLS = ("preempt", "pending")
TWO_NODES = {
    "name": "recovery-two-nodes",
    "inter_node_bandwidth_gbps": 10,
    "nodes": [{"name": name, "gpu_type": "cpu", "gpu_count": 1, "gpu_memory_gib": 8, "peak_tflops": 0.05,
               "address": "127.0.0.1"} for name in ("node-a", "node-b")],
}
# --smoke's job: tests/tiny_job.py's model shape (a step in tens of milliseconds), 1 MB of the corpus
SMOKE_JOB = {"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
                       "ffn_hidden_size": 128, "vocab_size": 512, "seq_length": 64},
             "training": {"global_batch_size": 8, "micro_batch_size": 2}, "data": {"max_corpus_mb": 1}}
WORKER_PG_TIMEOUT_S = 600.0  # training.model.init_distributed's process-group timeout
MEGATRON_GROUP_TIMEOUT_S = 1800.0  # megatron-core's initialize_model_parallel default (30 min)


def _lines(path: Path):
    from training.runlog import LogFormatError, parse_line

    for raw in path.read_text(errors="replace").splitlines():
        try:
            yield parse_line(raw)
        except LogFormatError:
            continue


def write_job(config: str, work: Path, name: str, steps: int, interval: int,
              overrides: dict | None = None) -> Path:
    import yaml

    from training.config import load_job_spec

    spec = load_job_spec(config, overrides)
    job = spec.model_dump(mode="json", exclude_none=True)
    job.pop("base", None)
    job["name"] = name
    job["run_dir"] = str(work / name / "run")
    job["checkpoint"].update({"url": str(work / name / "checkpoints"), "interval": interval,
                              "keep_last": 1000, "async_save": True})
    job["training"].update({"steps": steps, "lr_decay_steps": steps, "log_interval": 1})
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


LAUNCH = {"launcher": "local", "cluster": "local"}


def two_node_cluster_file(work: Path) -> Path:
    import yaml

    path = work / "cluster-two-nodes.yaml"
    path.write_text(yaml.safe_dump(TWO_NODES, sort_keys=False))
    return path


def slurm_cluster_file(work: Path) -> Path:
    """A cluster file for Slurm (`--launcher slurm`): the one of SLURM_CONF if set, else a
    single-host Slurm started here (testing.slurm_local; needs root and slurm-wlm + munge)."""
    import atexit

    import yaml

    from testing.slurm_local import LocalSlurm, node_name

    conf = os.environ.get("SLURM_CONF")
    if not conf:
        slurm = LocalSlurm(work / "slurm").start()
        atexit.register(slurm.stop)
        conf = str(slurm.conf)
        os.environ["SLURM_CONF"] = conf
    cpus = max(1, min(2, os.cpu_count() or 1))
    path = work / "cluster-slurm.yaml"
    path.write_text(yaml.safe_dump({
        "name": "recovery-slurm",
        "nodes": [{"name": node_name(), "gpu_type": "cpu", "gpu_count": cpus, "gpu_memory_gib": 8,
                   "peak_tflops": 0.05, "address": node_name()}],
        "slurm": {"slurm_conf": conf, "poll_s": 1.0},
    }, sort_keys=False))
    return path


def run_flow(job: Path, drills: list[str], hang_timeout_s: float, max_restarts: int,
             cluster: str | None = None) -> tuple[object, float]:
    from flows.pretrain import pretrain

    started = time.time()
    result = pretrain(str(job), cluster=cluster or LAUNCH["cluster"], launcher=LAUNCH["launcher"], backoff_s=1.0,
                      hang_timeout_s=hang_timeout_s, drill_faults=drills or None, max_restarts=max_restarts,
                      warm_standby=LAUNCH.get("warm_standby"))
    return result, time.time() - started


def step_times(log: Path) -> list[tuple[int, float]]:
    return [(int(l.fields["step"]), epoch_seconds(l.time)) for l in _lines(log) if "loss" in l.fields]


# --- the faults ---------------------------------------------------------------------------


@dataclass
class Fault:
    kind: str
    at_step: int
    rank: int = 1
    fired_at: float | None = None  # time.time()
    fired_step: int | None = None
    resume_from: int = 0  # the checkpoint step the job should resume from: the fault waits for its commit


def schedule(kinds: list[str], steps_per_fault: int, interval: int) -> tuple[list[Fault], int]:
    """Fault k at resume_{k-1} + steps_per_fault; returns the faults and the run's steps."""
    faults, resume, killed = [], 0, 0
    for kind in kinds:
        at = resume + steps_per_fault
        rank = 0 if kind == "cuda_error" else 1
        if kind == "oom_kill":
            rank = 1 if killed % 2 == 0 else 0
            killed += 1
        resume = at // interval * interval
        faults.append(Fault(kind, at, rank, resume_from=resume))
    return faults, resume + 2 * steps_per_fault


class FaultDriver(threading.Thread):
    """Fires the faults in order when the job reaches their step (heartbeats), from outside the
    job: SIGKILL (oom_kill), SIGSTOP (hang), the node's death (node_loss). The cuda_error drill
    fires inside the worker (FORGEFLOW_FAULT); its time comes from its fired record.

    A fault also waits for the commit of the checkpoint it is to resume from (`checkpoints`,
    the job's checkpoint root): the job checkpoints asynchronously, and on a loaded machine a
    kill two steps after a checkpoint could land before its commit, so the job would restart
    from the one before (seen with --smoke's 4-step interval: "never resumed")."""

    def __init__(self, run_dir: Path, faults: list[Fault], node_loss, skip: set[str] = frozenset(),
                 checkpoints: str | None = None):
        super().__init__(daemon=True, name="fault-driver")
        self.run_dir, self.faults, self.node_loss, self.skip = run_dir, faults, node_loss, skip
        self.checkpoints = checkpoints
        self.stop = threading.Event()

    def _committed(self, step: int) -> bool:
        from checkpoint.manifest import committed_checkpoints

        return step == 0 or self.checkpoints is None or any(
            r.step == step for r in committed_checkpoints(self.checkpoints))

    def _step_pids(self) -> tuple[int, dict[int, int]]:
        from infra import runfiles

        beats = runfiles.read_heartbeats(self.run_dir)
        return max((b.step for b in beats.values()), default=0), {r: b.pid for r, b in beats.items()}

    def run(self) -> None:
        import psutil

        from infra import runfiles

        for fault in self.faults:
            if fault.kind in self.skip:
                continue
            while not self.stop.is_set():
                if fault.kind == "cuda_error":
                    markers = list((self.run_dir / runfiles.MARKERS_DIR).glob(
                        f"fault_fired.cuda_error@{fault.at_step}.rank{fault.rank}*"))
                    if markers:
                        fired = json.loads(markers[0].read_text())
                        fault.fired_at, fault.fired_step = float(fired["time"]), fault.at_step
                        break
                else:
                    step, pids = self._step_pids()
                    if step >= fault.at_step and self._committed(fault.resume_from):
                        if fault.kind == "node_loss":
                            fault.fired_step, fault.fired_at = step, time.time()
                            self.node_loss.lost_now()
                            break
                        try:  # the rank's own process (not a reused pid)
                            proc = psutil.Process(pids[fault.rank])
                            command = " ".join(proc.cmdline())
                        except (KeyError, psutil.Error):
                            command = ""
                        if any(w in command for w in ("training.train", "training.standby", "--torchrun-worker")):
                            fault.fired_step, fault.fired_at = step, time.time()
                            proc.send_signal(signal.SIGKILL if fault.kind == "oom_kill" else signal.SIGSTOP)
                            break
                time.sleep(0.05)


def resume_times(log: Path, faults: list[Fault]) -> list[dict]:
    """Per fired fault: time to resume and lost steps, from rank 0's log."""
    lines = [(l, epoch_seconds(l.time)) for l in _lines(log)]
    steps = [(l, t) for l, t in lines if "loss" in l.fields]
    out = []
    for fault in faults:
        if fault.fired_at is None:
            continue
        # a line logged within the same millisecond as the fault is before it
        last, last_t = [(l, t) for l, t in steps if t <= fault.fired_at + 0.001][-1]
        resumed = [(l, t) for l, t in lines if l.event == "resumed" and t > fault.fired_at]
        if not resumed:
            print(f"!! {fault.kind}@{fault.fired_step}: never resumed")
            continue
        resumed, resumed_t = resumed[0]
        first_t = next(t for l, t in steps if t > resumed_t)
        out.append({
            "kind": fault.kind, "rank": fault.rank, "fault_step": int(last.fields["step"]),
            "resumed_from_step": int(resumed.fields["step"]),
            "lost_steps": int(last.fields["step"]) - int(resumed.fields["step"]),
            "world_size_after": int(resumed.fields.get("world_size", 0)) or None,
            "seconds_to_resume": round(first_t - last_t, 2),
            "last_step_at": last_t, "first_step_at": first_t,
        })
    return out


def add_phases(rows: list[dict], result) -> None:
    """forgeflow's phases per failure, from the flow's failure records and rank 0's log."""
    for row, failure in zip(rows, result.failures):
        relaunched = failure.relaunched_at or failure.decided_at
        row.update(root_cause=failure.root_cause, action=failure.action.split(" — ")[0],
                   detect_s=round(failure.detected_at - row["last_step_at"], 2),
                   diagnose_s=round(failure.diagnosed_at - failure.detected_at, 2),
                   act_s=round(relaunched - failure.diagnosed_at, 2),
                   restart_s=round(row["first_step_at"] - relaunched, 2),
                   culprit=failure.culprit, suspect_ranks=failure.suspect_ranks, suspect_nodes=failure.suspect_nodes)


# --- the Slurm drills (--launcher slurm): a preemption, a long PENDING ---------------------

DRILL_LOW, DRILL_HIGH = "recovery-low", "recovery-high"  # the preemption drill's partitions (created here)
PREEMPTOR_HOLD_S = 10  # the high-tier job holds the node this long (a sleep), then the flow's job may start again
PREEMPT_MARGIN_S = 10.0  # the preemption drill's job trains at least this long after the preemptor's sbatch
PENDING_HANG_TIMEOUT_S = 40.0  # the pending drill's flow: heartbeat timeout ...
PENDING_STARTUP_TIMEOUT_S = 40.0  # ... and the watcher's start-up timeout (infra.watch; 600 s by default)
PENDING_HOLD_S = 60.0  # the drill's job stays PENDING this long: past both timeouts


def _slurm(*args: str, check: bool = True) -> str:
    """A Slurm client command against SLURM_CONF's cluster (slurm_cluster_file set it)."""
    out = subprocess.run(list(args), capture_output=True, text=True)
    if check and out.returncode:
        raise SystemExit(f"{' '.join(args)} exited {out.returncode}: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip()


def _job_fields(job_id: str) -> dict[str, str]:
    out = _slurm("scontrol", "show", "job", "-o", job_id, check=False)
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


def _slurm_time(text: str | None) -> float | None:
    """One of `scontrol show job`'s times (whole seconds, the controller's local time), as time.time()."""
    if not text or text in ("None", "Unknown", "(null)"):
        return None
    return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))


def _until(what: str, check, timeout_s: float, alive=lambda: True):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        found = check()
        if found:
            return found
        time.sleep(0.2)
    raise SystemExit(f"timed out waiting for {what}" + ("" if alive() else " (the drill's flow ended)"))


def drill_partitions() -> tuple[str, str]:
    """Two partitions on every node, as tests/integration/slurm/test_slurm_preemption.py's: "low"
    (PriorityTier 1, PreemptMode=REQUEUE, 30 s GraceTime to commit) and "high" (tier 2); the
    cluster's PreemptType=preempt/partition_prio (testing.slurm_local's) lets high preempt low.
    Created unless there; needs a Slurm operator (root on the local Slurm); removed at exit."""
    import atexit

    existing = _slurm("scontrol", "show", "partition", "-o", check=False)
    for name, extra in ((DRILL_LOW, ["PriorityTier=1", "PreemptMode=REQUEUE", "GraceTime=30"]),
                        (DRILL_HIGH, ["PriorityTier=2"])):
        if f"PartitionName={name} " in existing:
            continue
        _slurm("scontrol", "create", f"PartitionName={name}", "Nodes=ALL", *extra, "State=UP")
        atexit.register(_slurm, "scontrol", "delete", f"PartitionName={name}", check=False)
    return DRILL_LOW, DRILL_HIGH


def drill_cluster_file(work: Path, partition: str) -> Path:
    """slurm_cluster_file's cluster with its jobs submitted to `partition` (a cluster of its own name)."""
    import yaml

    cluster = yaml.safe_load((work / "cluster-slurm.yaml").read_text())
    cluster["name"] = f"recovery-slurm-{partition}"
    cluster["slurm"]["partition"] = partition
    path = work / f"cluster-slurm-{partition}.yaml"
    path.write_text(yaml.safe_dump(cluster, sort_keys=False))
    return path


def _flow_thread(job: Path, hang_timeout_s: float, max_restarts: int, cluster: str | None) -> tuple:
    results: list = []

    def target() -> None:
        try:
            results.append(run_flow(job, [], hang_timeout_s, max_restarts, cluster=cluster))
        except BaseException as e:  # noqa: BLE001 - re-raised by the drill
            results.append(e)

    thread = threading.Thread(target=target, daemon=True, name=f"flow-{job.stem}")
    thread.start()
    return thread, results


def _flow_result(thread: threading.Thread, results: list, timeout_s: float, what: str):
    thread.join(timeout=timeout_s)
    if thread.is_alive():
        raise SystemExit(f"{what}: the flow did not end within {timeout_s:.0f} s")
    if isinstance(results[0], BaseException):
        raise results[0]
    return results[0]


def preempt_drill(config: str, work: Path, interval: int, overrides: dict | None, hang_timeout_s: float,
                  step_s: float) -> dict:
    """The forgeflow job trains in the low partition; at mid-interval (interval + interval/2, where a
    kill would lose interval/2 steps) a high-partition job (a `sleep`, as another user's would be)
    that needs every CPU of the node is submitted, and Slurm preempts ours: SIGTERM to its steps,
    the ranks commit the step they are on and stop, the flow records an interruption (no restart
    spent) and submits the job again; it stays PENDING until the preemptor's sleep ends. The job
    has PREEMPT_MARGIN_S of steps (at `step_s` a step, at least two intervals) after that step, so
    Slurm's signal (a second or two after the sbatch) lands while it trains, not after its last step.

    Measured from the preemption signal: Slurm's PreemptTime for our attempt's job (`scontrol show
    job`; the moment it chose the job and signalled it). It has whole seconds, so the later of it and
    our sbatch of the preemptor (the signal cannot come before that) is taken. Not the ranks'
    'stopped' event: that comes after the commit the signal starts, which is part of what a
    preemption costs. Up to rank 0's first step after the resume (its run log). Phases:
    commit (signal -> rank 0's 'stopped'), held (-> the preemptor's EndTime: the node is the
    higher tier's, nothing forgeflow can shorten; PREEMPTOR_HOLD_S of sleep plus its start-up),
    restart (-> the first step: the flow's resubmission, Slurm's start, torchrun, load)."""
    from infra import runfiles
    from training.config import load_job_spec
    from training.runlog import last_step

    low, high = drill_partitions()
    cluster = drill_cluster_file(work, low)
    at = interval + interval // 2
    margin = max(2 * interval, -(-int(PREEMPT_MARGIN_S / max(step_s, 1e-3)) // interval) * interval)
    job = write_job(config, work, "preempt-drill", at + margin, interval, overrides)
    run_dir = load_job_spec(job).resolved_run_dir
    log0 = runfiles.log_path(run_dir, 0)
    thread, results = _flow_thread(job, hang_timeout_s, 0, str(cluster))  # no restart to spend: none is needed

    def reached() -> bool:
        try:
            record = last_step(log0)
        except OSError:
            return False
        return record is not None and record.step >= at

    _until(f"the preemption drill's job to reach step {at}", reached, 600, thread.is_alive)
    ours = (run_dir / "launch" / "attempt-0" / "slurm-job-id").read_text().strip()
    submitted_at = time.time()
    preemptor = _slurm("sbatch", "--parsable", f"--partition={high}", "--exclusive", "--job-name=high-priority",
                       "--output=/dev/null", "--wrap", f"sleep {PREEMPTOR_HOLD_S}").split(";")[0]
    try:
        result, wall = _flow_result(thread, results, 600, "the preemption drill")
    finally:
        _slurm("scancel", preemptor, check=False)
    assert result.finished, result
    preempt_at = _slurm_time(_job_fields(ours).get("PreemptTime"))
    if preempt_at is None:
        raise SystemExit(f"the preemption drill: Slurm never preempted job {ours} (no PreemptTime); "
                         f"interruptions {result.interruptions}, failures {[f.root_cause for f in result.failures]}")
    signal_at = max(preempt_at, submitted_at)
    held = _job_fields(preemptor)
    held_until = _slurm_time(held.get("EndTime"))
    lines = [(l, epoch_seconds(l.time)) for l in _lines(log0)]
    stopped = next(((l, t) for l, t in lines if l.event == "stopped" and t >= signal_at - 1), None)
    resumed = next(((l, t) for l, t in lines if l.event == "resumed" and stopped and t > stopped[1]), None)
    if stopped is None or resumed is None:
        raise SystemExit(f"the preemption drill: rank 0's log has no 'stopped' then 'resumed' after the preemption "
                         f"at {signal_at:.0f} ({log0})")
    (stop_line, stop_t), (resume_line, resume_t) = stopped, resumed
    trained = [int(l.fields["step"]) for l, t in lines if "loss" in l.fields and t <= stop_t]
    first_t = next(t for l, t in lines if "loss" in l.fields and t > resume_t)
    resumed_step = int(resume_line.fields["step"])
    row = {
        "kind": "preempt", "rank": None, "fault_step": max(trained), "resumed_from_step": resumed_step,
        "lost_steps": max(trained) - resumed_step,
        "world_size_after": int(resume_line.fields.get("world_size", 0)) or None,
        "seconds_to_resume": round(first_t - signal_at, 2),
        "commit_s": round(stop_t - signal_at, 2),
        "held_s": round(held_until - stop_t, 2) if held_until else None,
        "restart_s": round(first_t - held_until, 2) if held_until else None,
        "stopped_step": int(stop_line.fields["step"]), "attempts": result.attempts,
        "restarts_spent": len(result.failures), "interruptions": list(result.interruptions),
        "slurm_jobs": {"ours": ours, "preemptor": preemptor}, "wall_s": round(wall, 1),
    }
    print(f"preemption drill: job {ours} preempted by {preemptor} at step {row['fault_step']}; "
          f"{result.attempts} attempts, {len(result.failures)} failures; interruptions: {result.interruptions}",
          flush=True)
    return row


def pending_drill(config: str, work: Path, interval: int, overrides: dict | None) -> dict:
    """Another user's job (a `sleep`, --exclusive) holds every CPU of the node; the forgeflow job is
    submitted behind it and stays PENDING for PENDING_HOLD_S, longer than the flow's heartbeat
    timeout (PENDING_HANG_TIMEOUT_S, passed as the flow's hang_timeout_s) and the watcher's
    start-up timeout (PENDING_STARTUP_TIMEOUT_S, set as tests/integration/slurm/test_slurm_delegated.py
    does; 600 s by default, too long for a benchmark); then the sleeper is cancelled and the job
    trains to its end. `pending_reported_as_hang` counts, from the flow's result, the attempts
    that failed as a hang, failed before the job left PENDING, or were replaced by a new attempt
    (a launch directory) before it left PENDING; 0 is the goal: a queued job is no hang and
    costs no restart. max_restarts=2, so that a wrong verdict is counted instead of ending the run."""
    import functools

    import tasks.pretrain_tasks as pretrain_tasks
    from infra.watch import watch
    from training.config import load_job_spec

    job = write_job(config, work, "pending-drill", interval, interval, overrides)
    run_dir = load_job_spec(job).resolved_run_dir
    sleeper = _slurm("sbatch", "--parsable", "--exclusive", "--job-name=someone-else", "--output=/dev/null",
                     "--wrap", "sleep 900").split(";")[0]
    pretrain_tasks.watch = functools.partial(watch, startup_timeout_s=PENDING_STARTUP_TIMEOUT_S)
    released_at = None
    try:
        _until("the other user's sleeper to run",
               lambda: _slurm("squeue", "-h", "-j", sleeper, "-o", "%T", check=False) == "RUNNING", 120)
        thread, results = _flow_thread(job, PENDING_HANG_TIMEOUT_S, 2, None)
        id_file = run_dir / "launch" / "attempt-0" / "slurm-job-id"
        ours = _until("the pending drill's batch job", lambda: id_file.exists() and id_file.read_text().strip(),
                      300, thread.is_alive)
        def pending_reason() -> str | None:
            out = _slurm("squeue", "-h", "-j", ours, "-o", "%T|%r", check=False)
            return out.split("|", 1)[1] if out.startswith("PENDING|") else None

        reason = _until("Slurm to hold it PENDING", pending_reason, 120, thread.is_alive)
        pending_since = time.time()
        while thread.is_alive() and time.time() - pending_since < PENDING_HOLD_S:
            time.sleep(0.5)
        _slurm("scancel", sleeper, check=False)
        released_at = time.time()
        result, wall = _flow_result(thread, results, 600, "the pending drill")
    finally:
        pretrain_tasks.watch = watch
        if released_at is None:
            _slurm("scancel", sleeper, check=False)
    wrong = {f.attempt for f in result.failures if f.status == "hang" or f.detected_at < released_at}
    wrong |= {k - 1 for k in range(1, result.attempts)
              if (run_dir / "launch" / f"attempt-{k}").exists()
              and (run_dir / "launch" / f"attempt-{k}").stat().st_mtime < released_at}
    row = {"slurm_job": ours, "sleeper": sleeper, "reason": reason, "pending_s": round(released_at - pending_since, 1),
           "hang_timeout_s": PENDING_HANG_TIMEOUT_S, "startup_timeout_s": PENDING_STARTUP_TIMEOUT_S,
           "finished": result.finished, "final_step": result.final_step, "attempts": result.attempts,
           "failures": [f"{f.status}: {f.root_cause}" for f in result.failures], "reported_as_hang": len(wrong),
           "wall_s": round(wall, 1)}
    print(f"pending drill: job {ours} PENDING ({reason}) for {row['pending_s']} s behind {sleeper} (hang timeout "
          f"{PENDING_HANG_TIMEOUT_S:.0f} s, start-up timeout {PENDING_STARTUP_TIMEOUT_S:.0f} s): "
          f"{result.attempts} attempt(s), failures {row['failures']}, reported as a hang or restarted while "
          f"pending: {len(wrong)}", flush=True)
    return row


# --- the baseline: plain torchrun --------------------------------------------------------


def torchrun_baseline(job: Path, faults: list[Fault], placement: dict, max_restarts: int,
                      skip: set[str], timeout_s: float) -> tuple[float, Path]:
    """Both 'nodes' as elastic torchrun agents (c10d rendezvous, 1 to 2 nodes), restarting in place."""
    from infra.launch import TORCHRUN_MONITOR_INTERVAL_S
    from testing.node_faults import NodeLoss
    from training.config import load_job_spec

    run_dir = load_job_spec(job).resolved_run_dir
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sets = [f"training.tensor_parallel={placement['tp']}", f"training.pipeline_parallel={placement['pp']}"]
    if placement.get("micro_batch_size"):
        sets.append(f"training.micro_batch_size={placement['micro_batch_size']}")
    worker = [str(REPO / "benchmarks" / "recovery.py"), "--torchrun-worker", str(job)] + [
        a for item in sets for a in ("--set", item)]
    cuda = next((f for f in faults if f.kind == "cuda_error"), None)
    procs: dict[str, subprocess.Popen] = {}
    logs = run_dir.parent / "torchrun-baseline"
    logs.mkdir(parents=True, exist_ok=True)
    with NodeLoss("node-b", trigger=lambda: False) as node_loss:
        driver = FaultDriver(run_dir, faults, node_loss, skip, load_job_spec(job).checkpoint.url)
        started = time.time()
        for node in ("node-a", "node-b"):  # node-a first: it hosts the rendezvous store
            env = dict(os.environ, FORGEFLOW_NODE_NAME=node, PYTHONUNBUFFERED="1")
            env.pop("FORGEFLOW_FAULT_SCOPE", None)
            if cuda is not None:
                env["FORGEFLOW_FAULT"] = f"cuda_error@{cuda.at_step}:{cuda.rank}"
            command = [sys.executable, "-m", "infra.reaper", "--grace=5", "--", sys.executable, "-m",
                       "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                       f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=recovery-baseline",
                       f"--max-restarts={max_restarts}", f"--monitor-interval={TORCHRUN_MONITOR_INTERVAL_S}", *worker]
            with open(logs / f"{node}.out", "ab") as out:
                procs[node] = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, cwd=REPO)
            if node == "node-a":
                _wait_listening(port, 120)
        driver.start()
        try:
            code = procs["node-a"].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"the torchrun baseline did not finish in {timeout_s:.0f} s (3x forgeflow's run with "
                             f"the same faults); stopped. See its agents' and ranks' output in {logs}") from None
        finally:
            driver.stop.set()
            for proc in procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
        wall = time.time() - started
    if code != 0:
        raise SystemExit(f"the torchrun baseline exited {code}; see {logs}")
    return wall, run_dir


def torchrun_worker(argv: list[str]) -> None:
    """What torchrun starts in the baseline: `training.train` (or `-m MODULE` / a script) behind a
    fresh rendezvous store per round.

    Why: with torch 2.13 a worker that torchrun restarts reuses the agent's store, which still
    holds the previous round's gloo addresses; the restarted ranks then connect to dead peers
    and hang in their first process group (seen here: "Connection refused" to the old ranks,
    for --standalone, static and c10d rendezvous alike). So every round, rank 0 hosts a new
    store on a free port (marked with a token of its own) and posts "PORT TOKEN" in the agent's
    store under the world size; the other ranks take the post once the store it names answers
    with that token. A post left by an earlier round names a store that died with its rank 0,
    so a round never joins another's, whatever rounds were cut short (a join counter per round
    did: one rank lost before counting put every later round's ranks in different rounds, each
    waiting for the other until the process group's timeout). Nothing else changes; it costs
    milliseconds, and a rank that finds no live store within BASELINE_ROUND_WAIT_S exits with
    an error naming what it read (torchrun then restarts the round).
    """
    import datetime
    import runpy

    from torch.distributed import TCPStore

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    host = os.environ["MASTER_ADDR"]
    wait = datetime.timedelta(seconds=BASELINE_ROUND_WAIT_S)
    agent = TCPStore(host, int(os.environ["MASTER_PORT"]), is_master=False, timeout=wait)
    post = f"forgeflow-baseline/store/{world}"
    if rank == 0:
        global _ROUND_STORE  # this round's store lives as long as rank 0's process
        _ROUND_STORE = TCPStore(host, 0, world, is_master=True, wait_for_workers=False, timeout=wait)
        token = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
        _ROUND_STORE.set(ROUND_TOKEN_KEY, token)
        port = _ROUND_STORE.port
        agent.set(post, f"{port} {token}")
    else:
        port = _live_round_store(agent, post, host, rank, world)
    # every rank, rank 0 too, is a client of the round's store (torch's agent-store mode)
    os.environ.update(MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    if argv[:1] == ["-m"]:
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv and argv[0].endswith(".py"):
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")
    else:
        sys.argv = ["training.train", *argv]
        runpy.run_module("training.train", run_name="__main__", alter_sys=True)


_ROUND_STORE = None  # rank 0's store of the current round (torchrun_worker)
ROUND_TOKEN_KEY = "forgeflow-baseline/token"
BASELINE_ROUND_WAIT_S = 180.0  # a rank waits this long for its round's rank 0 to post a live store


def _live_round_store(agent, post: str, host: str, rank: int, world: int) -> int:
    """The port of the store this round's rank 0 posted: the post whose store answers with the
    post's token (an earlier round's post names a dead store). SystemExit after BASELINE_ROUND_WAIT_S."""
    import datetime

    from torch.distributed import TCPStore

    deadline = time.monotonic() + BASELINE_ROUND_WAIT_S
    seen = None
    while time.monotonic() < deadline:
        if agent.check([post]):
            seen = agent.get(post).decode()
            port_text, token = seen.split(" ", 1)
            port = int(port_text)
            try:  # a plain connect first: a dead port refuses at once (TCPStore would retry and log)
                socket.create_connection((host, port), timeout=2).close()
                store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=10))
                if store.check([ROUND_TOKEN_KEY]) and store.get(ROUND_TOKEN_KEY).decode() == token:
                    return port
            except (OSError, RuntimeError):
                pass  # an earlier round's store, gone with its rank 0
        time.sleep(0.2)
    raise SystemExit(f"torchrun baseline: rank {rank} of {world} found no live store posted by this round's "
                     f"rank 0 within {BASELINE_ROUND_WAIT_S:.0f} s (last post read: {seen!r}, under {post!r} in "
                     "the agent's store); rank 0 did not start or died before posting: see its log")


def _wait_listening(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"torchrun's rendezvous store on port {port} did not come up in {timeout_s:.0f} s")


def _p50(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny-cpu.yaml")
    parser.add_argument("--kinds", default="cuda_error,oom_kill,hang,oom_kill,node_loss",
                        help=f"faults in order, comma-separated, from {', '.join(KINDS)}")
    parser.add_argument("--fault-every-s", type=float, default=20.0, help="seconds of training between faults")
    parser.add_argument("--interval", type=int, default=10, help="checkpoint interval in steps")
    parser.add_argument("--calibrate-steps", type=int, default=20,
                        help="steps of the calibration run (the step time, at least 7); 0: no calibration run, "
                             "a fault every interval + interval/2 steps")
    parser.add_argument("--hang-timeout-s", type=float, default=300.0,
                        help="forgeflow's hang detection (the flow's default: 300 s)")
    parser.add_argument("--baseline-hang", action="store_true",
                        help="run the hang in the torchrun baseline too (it waits for megatron's 30 min "
                             "collective timeout)")
    parser.add_argument("--warm-standby", choices=["on", "off", "auto"], default="on",
                        help="the flow's warm_standby (infra.standby): on (default: what a GPU node with cores "
                             "to spare gets), off (every restart cold), auto (the flow's rule on this machine)")
    parser.add_argument("--launcher", choices=["local", "slurm"], default="local",
                        help="slurm: every attempt is a Slurm batch job (SLURM_CONF's cluster, else a local one)")
    parser.add_argument("--slurm-drills", default=",".join(DRILLS),
                        help="with --launcher slurm: the Slurm drills to run after the faults, comma-separated, "
                             f"from {', '.join(DRILLS)} ('none': neither; their keys are then null)")
    parser.add_argument("--smoke", action="store_true",
                        help="one oom_kill, interval 4, no calibration run, a tiny model: same flows and keys")
    args = parser.parse_args()
    if args.smoke:
        args.kinds, args.interval, args.calibrate_steps, args.fault_every_s = "oom_kill", 4, 0, 1.0
    if 0 < args.calibrate_steps < 7:
        parser.error("--calibrate-steps: 0 (no calibration run) or at least 7 (the step time is a median "
                     "after 5 warm-up steps)")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        parser.error(f"--kinds: unknown {unknown}; use {', '.join(KINDS)}")
    if kinds.count("cuda_error") > 1:
        parser.error("--kinds: cuda_error at most once (the worker's drill is one per process environment)")
    if "node_loss" in kinds and kinds[-1] != "node_loss":
        parser.error("--kinds: node_loss must come last (the node stays dead)")
    if args.launcher == "slurm" and "node_loss" in kinds:
        parser.error("--kinds: node_loss needs the two local nodes; not with --launcher slurm")
    drills = [] if args.launcher != "slurm" else [d.strip() for d in args.slurm_drills.split(",")
                                                   if d.strip() and d.strip() != "none"]
    if set(drills) - set(DRILLS):
        parser.error(f"--slurm-drills: unknown {sorted(set(drills) - set(DRILLS))}; use {', '.join(DRILLS)} or none")

    work = Path(tempfile.mkdtemp(prefix="forgeflow-recovery-"))
    os.environ.setdefault("PREFECT_HOME", str(work / "prefect-home"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # A fresh home's migrations can outlast the ephemeral server's default 20 s on a busy machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # the orchestrator's database of this run only: the node-loss cordon must not outlive it
    os.environ["FORGEFLOW_STATE_DIR"] = str(work / "state")
    os.environ.pop("FORGEFLOW_DB_URL", None)
    os.environ.pop("SLACK_WEBHOOK_URL", None)
    LAUNCH["warm_standby"] = {"on": True, "off": False, "auto": None}[args.warm_standby]
    if args.launcher == "slurm":
        LAUNCH.update(launcher="slurm", cluster=str(slurm_cluster_file(work)))
    else:
        LAUNCH.update(cluster=str(two_node_cluster_file(work)))

    from infra import runfiles
    from testing.node_faults import NodeLoss
    from training.config import load_job_spec
    from training.data import prepare_data

    # --smoke: a tiny model on 1 MB of the corpus in the run's folder (the config's prepared data may not exist yet)
    overrides = {**SMOKE_JOB, "data": {**SMOKE_JOB["data"], "data_dir": str(work / "data")}} if args.smoke else None
    prepare_data(load_job_spec(args.config, overrides), progress=False)

    # mid-interval: every fault loses about half an interval
    spf = args.interval + args.interval // 2
    placement = None
    if args.calibrate_steps:
        # Calibrate: the step time under the flow (also warms Prefect's ephemeral API).
        calib = write_job(args.config, work, "calibrate", args.calibrate_steps, args.interval, overrides)
        result, _ = run_flow(calib, [], args.hang_timeout_s, 0)
        assert result.finished, result
        placement = result.placements[0]
        times = step_times(runfiles.log_path(load_job_spec(calib).resolved_run_dir, 0))
        step_s = statistics.median(b - a for (_, a), (_, b) in zip(times[5:], times[6:]))
        spf = max(spf, round(args.fault_every_s / step_s / args.interval) * args.interval + args.interval // 2)
        measured = f"step time {step_s:.3f} s on {placement['world_size']} ranks ({', '.join(placement['nodes'])})"
    else:
        measured = "no calibration run"
    faults, steps = schedule(kinds, spf, args.interval)
    print(f"{measured}: a fault every {spf} steps of training, {steps} steps in all; faults at "
          + ", ".join(f"{f.kind}@{f.at_step}:{f.rank}" for f in faults), flush=True)

    wall_free = None  # --smoke: no fault-free run (the run with faults runs the same flow), no goodput
    if not args.smoke:
        free_job = write_job(args.config, work, "fault-free", steps, args.interval, overrides)
        free, wall_free = run_flow(free_job, [], args.hang_timeout_s, 0)
        assert free.finished, free
        placement = placement or free.placements[0]  # the baseline's layout: the flow's own

    # forgeflow with the faults: the cuda_error drill rides on its attempt's environment
    fault_drills = ["cuda_error@%d:%d" % (f.at_step, f.rank) if f.kind == "cuda_error" else "" for f in faults]
    faulty_job = write_job(args.config, work, "with-faults", steps, args.interval, overrides)
    faulty_dir = load_job_spec(faulty_job).resolved_run_dir
    with NodeLoss("node-b", trigger=lambda: False) as node_loss:
        driver = FaultDriver(faulty_dir, faults, node_loss, checkpoints=load_job_spec(faulty_job).checkpoint.url)
        driver.start()
        try:
            faulty, wall_faults = run_flow(faulty_job, fault_drills, args.hang_timeout_s, len(faults) + 2)
        finally:
            driver.stop.set()
    assert faulty.finished, faulty
    placement = placement or faulty.placements[0]  # its first attempt's: the fault-free layout
    unfired = [f"{f.kind}@{f.at_step}" for f in faults if f.fired_at is None]
    if unfired:
        raise SystemExit(f"the faults {unfired} never fired: the job finished before the driver saw their step "
                         "in the heartbeats (a machine too loaded to poll them?); run again")
    ours = resume_times(runfiles.log_path(faulty_dir, 0), faults)
    add_phases(ours, faulty)

    # the baseline: the same faults at the same steps, plain torchrun restarting in place
    # (without --baseline-hang the hang is left out and the other faults keep their steps)
    base_faults = [Fault(f.kind, f.at_step, f.rank, resume_from=f.resume_from) for f in faults]
    skip = set() if args.baseline_hang else {"hang"}
    base_job = write_job(args.config, work, "torchrun-baseline", steps, args.interval, overrides)
    wall_torchrun, base_dir = torchrun_baseline(
        base_job, base_faults, placement, len(base_faults) + 2, skip,
        timeout_s=wall_faults * 3 + (MEGATRON_GROUP_TIMEOUT_S if args.baseline_hang else 0))
    theirs = resume_times(runfiles.log_path(base_dir, 0), base_faults)

    # the Slurm drills (--launcher slurm): a preemption by a higher tier, a long PENDING behind another job
    preempted = None
    if "preempt" in drills:
        times = step_times(runfiles.log_path(faulty_dir, 0))  # the step time under the flow (a restart's gap is one)
        step_s = statistics.median(b - a for (_, a), (_, b) in zip(times, times[1:]))
        preempted = preempt_drill(args.config, work, args.interval, overrides, args.hang_timeout_s, step_s)
    pending = pending_drill(args.config, work, args.interval, overrides) if "pending" in drills else None

    print(f"\n{'system':>9} {'kind':>10} {'step':>5} {'from':>5} {'lost':>5} {'world':>5} {'detect':>7} "
          f"{'diagnose':>8} {'act':>6} {'restart':>8} {'to resume':>9}")
    for who, rows in (("forgeflow", ours), ("torchrun", theirs)):
        for p in rows:
            print(f"{who:>9} {p['kind']:>10} {p['fault_step']:>5} {p['resumed_from_step']:>5} {p['lost_steps']:>5} "
                  f"{p['world_size_after'] or '-':>5} {p.get('detect_s', '-'):>7} {p.get('diagnose_s', '-'):>8} "
                  f"{p.get('act_s', '-'):>6} {p.get('restart_s', '-'):>8} {p['seconds_to_resume']:>9.2f}")
    if preempted:  # from Slurm's signal: its phases are commit, held (by the preemptor), restart
        p = preempted
        print(f"{'forgeflow':>9} {'preempt':>10} {p['fault_step']:>5} {p['resumed_from_step']:>5} {p['lost_steps']:>5} "
              f"{p['world_size_after'] or '-':>5} {'-':>7} {'-':>8} {'-':>6} {p['restart_s'] or '-':>8} "
              f"{p['seconds_to_resume']:>9.2f}   (signal -> stopped {p['commit_s']} s, held by the preemptor "
              f"{p['held_s']} s; restarts spent {p['restarts_spent']})")
    print(f"\nforgeflow fault-free: {'-' if wall_free is None else f'{wall_free:.1f} s'} wall for {steps} steps; "
          f"with {len(ours)} faults: "
          f"{wall_faults:.1f} s; plain torchrun with {len(theirs)} faults: {wall_torchrun:.1f} s")
    if not args.baseline_hang and "hang" in kinds:
        print(f"(torchrun's hang not run: it would wait for a collective timeout, {WORKER_PG_TIMEOUT_S:.0f} s for "
              f"the worker's process group, {MEGATRON_GROUP_TIMEOUT_S:.0f} s for megatron's groups)")

    def kind_of(rows, kind):
        return [p["seconds_to_resume"] for p in rows if p["kind"] == kind]

    ours_main = [p["seconds_to_resume"] for p in ours if p["kind"] != "hang"]
    theirs_main = [p["seconds_to_resume"] for p in theirs if p["kind"] != "hang"]
    node_loss_row = next((p for p in ours if p["kind"] == "node_loss"), None)
    hangs = [p for p in ours if p["kind"] == "hang"]
    for p in hangs:
        print(f"hang report: {p.get('culprit') or '-'}")
    headline = {
        "launcher": args.launcher,
        "seconds_to_resume_p50": _p50(ours_main),
        "lost_steps_max": max(p["lost_steps"] for p in ours),
        "checkpoint_interval_steps": args.interval,
        "goodput_with_faults_over_fault_free": round(wall_free / wall_faults, 3) if wall_free else None,
        "phases_p50_s": {k: _p50([p[k] for p in ours if p["kind"] != "hang" and k in p])
                         for k in ("detect_s", "diagnose_s", "act_s", "restart_s")},
        "fault_every_s": args.fault_every_s,
        "faults": len(ours),
        "fault_kinds": sorted(set(p["kind"] for p in ours)),
        "resume_ratio_vs_torchrun_restart": (round(statistics.median(ours_main) / statistics.median(theirs_main), 3)
                                             if ours_main and theirs_main else None),
        "torchrun_seconds_to_resume_p50": _p50(theirs_main),
        "node_loss_seconds_to_resume": node_loss_row["seconds_to_resume"] if node_loss_row else None,
        "node_loss_world_size": ([placement["world_size"], node_loss_row["world_size_after"]]
                                 if node_loss_row else None),
        "torchrun_node_loss_seconds_to_resume": _p50(kind_of(theirs, "node_loss")),
        "hang_timeout_s": args.hang_timeout_s,
        "hang_seconds_to_resume": _p50(kind_of(ours, "hang")),
        "hang_detect_s": _p50([p["detect_s"] for p in hangs if "detect_s" in p]),
        # the report names the stopped rank and its node first (placement's nodes: one rank each)
        "hang_culprit_named": (int(all(p.get("suspect_ranks", [])[:1] == [p["rank"]] and
                                       p.get("suspect_nodes", [])[:1] == [placement["nodes"][p["rank"]]]
                                       for p in hangs)) if hangs and placement else None),
        "torchrun_hang_seconds_to_resume": _p50(kind_of(theirs, "hang")),
        "torchrun_hang_detect_timeout_s": MEGATRON_GROUP_TIMEOUT_S,
        "per_kind_p50_s": {k: {"forgeflow": _p50(kind_of(ours, k)), "torchrun": _p50(kind_of(theirs, k))}
                           for k in sorted(set(kinds))},
        "preempt_to_resumed_s": preempted["seconds_to_resume"] if preempted else None,
        "preempt_lost_steps": preempted["lost_steps"] if preempted else None,
        "pending_reported_as_hang": pending["reported_as_hang"] if pending else None,
    }
    print(json.dumps(checked_headline(headline, HEADLINE_KEYS)), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--torchrun-worker"]:
        torchrun_worker(sys.argv[2:])
    else:
        main()
