"""The Slurm launcher: each training attempt is one batch job.

Two modes (`SlurmSettings.mode`):

- **delegate** (the default; a site's Slurm, shared with people who never use forgeflow): Slurm
  decides where and when. The flow plans the layout (nodes x ranks per node, GPU type) and asks
  for it without naming nodes:

    sbatch --nodes=N --ntasks-per-node=1 [--gpus-per-node=[type:]G | --gres=gpu:[type:]G]
           --signal=B:TERM@<signal_s> [--exclude=<nodes a node check found faulty>]
           [--partition] [--account] [--qos] [--time]  job.sbatch

  Which layout: before each submission the flow asks Slurm when each of the job's options (GPU
  type, count, layout) would start, with `sbatch --test-only` and the options it would be
  submitted with, and submits the one it would finish first (start + predicted run time;
  infra.slurm_start).

  Inside the job each node's task builds its launch from Slurm's environment (node rank
  SLURM_NODEID, rendezvous on node rank 0 = the job's first node, the GPUs Slurm bound) and
  writes it to `launch/attempt-K/placement/`; the watcher's `SlurmJob` gathers them into
  `placement.json` and names Slurm's nodes from then on. While the job is PENDING,
  `SlurmJob.waiting()` says why ("waiting in Slurm: Priority"), and the watcher's start-up
  timeout starts only once it runs. `--signal` (and a preemption's SIGTERM) reaches the batch
  script's trap, which records it (`slurm-signalled`) and passes it on: the ranks commit.

- **pin** (a cluster forgeflow owns, where its orchestrator places): as before, the placement's
  nodes by `--nodelist`, and each node's task looks itself up in the placement by
  `SLURMD_NODENAME`.

      └─ srun (one task per node, output to logs/node-<node>.attempt-K.out)
           └─ python -m infra.slurm node request.json [--delegated]  (this module, on each node)
                └─ reaper → torchrun --node-rank=R --master-addr=<node 0> --master-port=<chosen on node 0>

Either way the rank map is static (as with every launcher). Node rank 0 chooses the rendezvous
port on itself (infra.launch.resolve_rendezvous). The task writes torchrun's exit code next to
the run's other launch files, so exit codes are known per node, also while the
job still runs; when a node never wrote one, Slurm's job state stands in for it
(CANCELLED → 143, NODE_FAIL/OUT_OF_MEMORY → 137, FAILED → the job's exit code).

The job is watched with `squeue` (then `scontrol show job`, then `sacct`, since a
finished job leaves squeue and sacct needs slurmdbd) at most every `poll_s`,
plus forgeflow's own heartbeats (infra.watch), and stopped with `scancel`: Slurm
sends SIGTERM to every step, the reaper stops torchrun's ranks, and Slurm sends
SIGKILL after its KillWait. A flow that dies cannot scancel: each node's reaper also
follows the attempt's lease file, which the flow renews while it polls the job, and stops
the ranks once it goes stale (infra.lease_guard).

Pinned, nodes drained or down in Slurm are refused before anything is submitted, and
`drain_node` is how a cordon reaches Slurm: forgeflow and Slurm never disagree
about which nodes may run work. Delegated, forgeflow is usually no Slurm operator:
`drain_node_if_allowed` drains where it may and otherwise returns the command an operator
should run, and `exclude_nodes` keeps the node out of the job's later attempts (`--exclude`).

Like the other launchers, this assumes the run directory is on storage every
node sees (NFS, Lustre) and that the Python environment has the same path on
every node. sbatch exports the environment it is given to the job, as it does by default:
the launcher gives it `infra.launch.worker_environment()`, what a rank needs, never the flow
worker's whole environment with its secrets.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from infra.atomic_write import atomic_write, atomic_write_json
from infra.lease_guard import FILE_LEASE_S, LeaseFileRenewer, lease_file_path
from infra.launch import (
    LaunchRequest,
    NodeLaunch,
    clear_rendezvous,
    exit_code_path,
    node_command,
    node_env,
    node_log_path,
    resolve_rendezvous,
    wait_for_exit,
    worker_environment,
)

CPU_DEVICE = "cpu"  # scheduler.gpus.CPU_DEVICE; infra does not import the scheduler
# Node states in which Slurm will not start new work (sinfo's long names, suffixes stripped).
UNSCHEDULABLE = ("drain", "drained", "draining", "down", "fail", "failing", "maint", "inval",
                 "future", "reboot", "power_down", "powered_down", "not_responding")
SLURM_ENDED = {"TIMEOUT", "PREEMPTED", "NODE_FAIL", "DEADLINE"}  # Slurm ended it, not the job's code
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED"}


class SlurmError(RuntimeError):
    """A Slurm command failed; the message has the command and what Slurm said."""


class SlurmNodeUnavailable(SlurmError):
    """A node of the placement is drained, down or unknown in Slurm."""


class SlurmSettings(BaseModel):
    """Where and how attempts are submitted: the `slurm:` section of a cluster file."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["delegate", "pin"] = Field(
        default="delegate", description="delegate: Slurm chooses the nodes (no --nodelist; the placement is "
        "read back from the job); pin: --nodelist=<forgeflow's placement>, for clusters forgeflow owns")
    partition: str | None = Field(default=None, description="sbatch --partition; None: the cluster's default")
    account: str | None = Field(default=None, description="sbatch --account")
    qos: str | None = Field(default=None, description="sbatch --qos")
    time_limit: str | None = Field(default=None, description="sbatch --time, e.g. '2-00:00:00'; None: partition's")
    gpu_request: Literal["gpus-per-node", "gres"] = Field(
        default="gpus-per-node", description="how GPUs are asked for: --gpus-per-node=G or --gres=gpu:G")
    gres_types: dict[str, str] = Field(
        default_factory=dict, description="forgeflow GPU type -> Slurm's GPU type name, for a typed request "
        "(--gpus-per-node=h100:8, --gres=gpu:h100:8); a type not listed is asked for untyped")
    signal_s: int = Field(
        default=120, ge=0, description="--signal=B:TERM@S: the ranks get SIGTERM S seconds before the time "
        "limit and commit their step; Slurm sends SIGTERM at a preemption too; 0: no early signal")
    cpus_per_gpu: int = Field(default=8, gt=0, description="CPUs asked per GPU rank (data loaders, checkpoint writer)")
    extra_sbatch_args: list[str] = Field(default_factory=list, description="e.g. ['--qos=high', '--mem=0']")
    slurm_conf: str | None = Field(default=None, description="SLURM_CONF for the clients; None: the environment's")
    poll_s: float = Field(default=2.0, gt=0, description="at most one squeue per this many seconds per job")
    drain_on_cordon: bool = Field(default=True, description="a forgeflow cordon drains the node in Slurm too")


def _env(settings: SlurmSettings, environ: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if environ is None else environ)
    if settings.slurm_conf:
        env["SLURM_CONF"] = settings.slurm_conf
    return env


def slurm_command(args: list[str], settings: SlurmSettings, check: bool = True, *,
                  environ: dict[str, str] | None = None, stdin_text: str | None = None) -> subprocess.CompletedProcess:
    """Run a Slurm client command in ``environ`` (default: this process's environment; sbatch
    passes its environment on to the job); `stdin_text`: its standard input (sbatch's script)."""
    try:
        result = subprocess.run(args, env=_env(settings, environ), capture_output=True, text=True, timeout=60,
                                **({"input": stdin_text} if stdin_text is not None else {}))
    except FileNotFoundError:
        raise SlurmError(f"`{args[0]}` is not installed here: the Slurm launcher needs Slurm's client "
                         "commands (Debian: apt-get install slurm-client)") from None
    if check and result.returncode != 0:
        raise SlurmError(f"`{shlex.join(args)}` failed ({result.returncode}): {result.stderr.strip() or result.stdout.strip()}")
    return result


# --- node states ------------------------------------------------------------


@dataclass(frozen=True)
class SlurmNode:
    name: str
    state: str  # sinfo's long state, lower case, e.g. "idle", "mixed", "drained", "down*"
    reason: str = ""

    @property
    def schedulable(self) -> bool:
        base = self.state.rstrip("*~#!%$@^-+").lower()
        return not self.state.endswith("*") and not any(base.startswith(s) for s in UNSCHEDULABLE)


def node_states(settings: SlurmSettings | None = None) -> dict[str, SlurmNode]:
    """Every node Slurm knows, with its state (one `sinfo` call)."""
    settings = settings or SlurmSettings()
    out = slurm_command(["sinfo", "-h", "-N", "-o", "%N|%T|%E"], settings).stdout
    nodes: dict[str, SlurmNode] = {}
    for line in out.splitlines():
        name, state, reason = (line.split("|", 2) + ["", ""])[:3]
        if name:  # a node in several partitions is listed once per partition
            nodes[name] = SlurmNode(name, state.strip().lower(), "" if reason == "none" else reason.strip())
    return nodes


def unschedulable_nodes(settings: SlurmSettings | None = None) -> dict[str, SlurmNode]:
    return {name: node for name, node in node_states(settings).items() if not node.schedulable}


def drain_node(name: str, reason: str, settings: SlurmSettings | None = None) -> None:
    """Drain a node in Slurm: running jobs finish, no new job starts on it."""
    slurm_command(["scontrol", "update", f"NodeName={name}", "State=DRAIN", f"Reason=forgeflow: {reason}"],
                  settings or SlurmSettings())


def drain_node_if_allowed(name: str, reason: str, settings: SlurmSettings | None = None) -> str | None:
    """Drain a node where this user may (Slurm operators and admins; root on a cluster it owns);
    else returns what an operator should run, and raises nothing: a flow must never fail for lack of
    Slurm privileges. None: drained."""
    try:
        drain_node(name, reason, settings)
        return None
    except SlurmError as e:
        said = str(e).rsplit("): ", 1)[-1]  # what scontrol said
        return (f"forgeflow may not drain {name} in Slurm ({said}); an operator should run: "
                f"scontrol update NodeName={name} State=DRAIN Reason={shlex.quote('forgeflow: ' + reason)}")


def excluded_nodes_path(run_dir: Path) -> Path:
    """Nodes this job's later attempts must not get (`--exclude`): a node check found them faulty."""
    return Path(run_dir) / "launch" / "slurm-exclude.json"


def excluded_nodes(run_dir: Path) -> list[str]:
    try:
        return sorted(json.loads(excluded_nodes_path(run_dir).read_text()))
    except (OSError, ValueError):
        return []


def exclude_nodes(run_dir: Path, nodes: list[str]) -> list[str]:
    """Add `nodes` to the job's exclusion list; returns the whole list."""
    now = sorted(set(excluded_nodes(run_dir)) | set(nodes))
    atomic_write_json(excluded_nodes_path(run_dir), now)
    return now


def resume_node(name: str, settings: SlurmSettings | None = None, timeout_s: float = 30.0) -> SlurmNode:
    """Undo a drain (the node takes work again); returns once Slurm has pinged it back
    (it reads `idle*`, not responding, for a moment after the resume)."""
    settings = settings or SlurmSettings()
    slurm_command(["scontrol", "update", f"NodeName={name}", "State=RESUME"], settings)
    deadline = time.monotonic() + timeout_s
    while True:
        node = node_states(settings)[name]
        if node.schedulable or time.monotonic() > deadline:
            return node
        time.sleep(0.5)


# --- the batch job ----------------------------------------------------------


def attempt_dir(request: LaunchRequest) -> Path:
    return request.run_dir / "launch" / f"attempt-{request.attempt}"


def batch_log_path(request: LaunchRequest) -> Path:
    """The batch script's own output (srun's messages: which task exited how, cancellations)."""
    return request.run_dir / "logs" / f"slurm-batch.attempt-{request.attempt}.out"


def sbatch_args(request: LaunchRequest, settings: SlurmSettings, gpu_type: str,
                exclude: list[str] | tuple[str, ...] = ()) -> list[str]:
    """sbatch's options for one attempt. Delegated (the default): N nodes of Slurm's choosing,
    never `--nodelist`, with `--signal=B:TERM@signal_s` so the ranks commit before a time limit;
    `exclude`: nodes this job must not get again (a node check found them faulty). Pinned: on
    the placement's nodes."""
    nodes = sorted(request.nodes, key=lambda n: n.node_rank)
    per_node = max(n.nproc_per_node for n in nodes)
    args = [f"--job-name=forgeflow-{request.job_name}-a{request.attempt}", f"--nodes={len(nodes)}"]
    if settings.mode == "pin":
        args.append(f"--nodelist={','.join(n.node for n in nodes)}")
    else:
        if exclude:
            args.append(f"--exclude={','.join(sorted(exclude))}")
        if settings.signal_s:
            args.append(f"--signal=B:TERM@{settings.signal_s}")  # the batch script's trap passes it on
    args += [
        "--ntasks-per-node=1",  # one torchrun per node; torchrun starts the ranks
        f"--output={batch_log_path(request)}",
        "--open-mode=append",
        f"--chdir={os.getcwd()}",
        "--no-requeue",  # a restart is the flow's decision, after diagnosis
        "--kill-on-invalid-dep=yes",
    ]
    if gpu_type == CPU_DEVICE:
        args.append(f"--cpus-per-task={per_node}")  # CPU ranks: one CPU each
    else:
        typed = f"{settings.gres_types[gpu_type]}:" if gpu_type in settings.gres_types else ""
        args.append(f"--gpus-per-node={typed}{per_node}" if settings.gpu_request == "gpus-per-node"
                    else f"--gres=gpu:{typed}{per_node}")
        args.append(f"--cpus-per-task={per_node * settings.cpus_per_gpu}")
    return args + site_args(settings)


def site_args(settings: SlurmSettings) -> list[str]:
    """The site's sbatch options every submission carries: partition, account, QOS, time, extra."""
    args = [f"--partition={settings.partition}"] if settings.partition else []
    if settings.account:
        args.append(f"--account={settings.account}")
    if settings.qos:
        args.append(f"--qos={settings.qos}")
    if settings.time_limit:
        args.append(f"--time={settings.time_limit}")
    return args + list(settings.extra_sbatch_args)


def signalled_path(request: LaunchRequest) -> Path:
    """Written by the batch script when Slurm signals the job (`--signal`: the time limit is near;
    a preemption): the ranks were told to commit and stop by Slurm, not by a fault."""
    return attempt_dir(request) / "slurm-signalled"


def batch_script(request: LaunchRequest, request_file: Path, grace_s: float, delegated: bool = False) -> str:
    """The script sbatch runs on the first node of the allocation: one srun step, one task per node.
    srun runs in the background so the script's trap can pass Slurm's SIGTERM (`--signal=B:TERM`)
    on to the step (srun forwards it to every node's task, whose reaper stops torchrun's ranks:
    they commit their step), and record that Slurm asked."""
    output = request.run_dir / "logs" / f"node-%N.attempt-{request.attempt}.out"
    step = [
        "srun", f"--nodes={len(request.nodes)}", f"--ntasks={len(request.nodes)}", "--ntasks-per-node=1",
        "--kill-on-bad-exit=0",  # the watcher gives the other nodes time to print their errors
        f"--output={output}", "--open-mode=append",
        sys.executable, "-m", "infra.slurm", "node", str(request_file), f"--grace={grace_s}",
        *(["--delegated"] if delegated else []),
    ]
    marker = shlex.quote(str(signalled_path(request)))
    return "\n".join([
        "#!/bin/bash",
        f"# forgeflow attempt {request.attempt} of {request.job_name}: one torchrun per node",
        'echo "forgeflow: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST (batch host $(hostname))"',
        shlex.join(step) + " &",
        "step=$!",
        f"trap 'echo \"forgeflow: Slurm signalled the job (time limit or preemption): the ranks commit and stop\"; "
        f"date +%s > {marker}; kill -TERM $step' TERM",
        "wait $step; code=$?",
        "while kill -0 $step 2>/dev/null; do wait $step; code=$?; done  # a trapped signal ends `wait` early",
        'echo "forgeflow: srun exited with $code"',
        "exit $code",
        "",
    ])


def exit_code_of_state(state: str, job_exit: int | None) -> int:
    """Stand-in for a node's exit code when its task never wrote one."""
    if state in ("CANCELLED", "TIMEOUT", "DEADLINE", "PREEMPTED", "REVOKED"):
        return 143
    if state in ("NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"):
        return 137
    if state == "COMPLETED":
        return 1  # the job ended yet this node's torchrun never reported: it did not run
    return job_exit or 1


@dataclass
class SlurmJob:
    """One attempt as one Slurm batch job."""

    request: LaunchRequest
    job_id: str
    settings: SlurmSettings
    _state: str = "PENDING"
    _reason: str = ""  # squeue's reason while PENDING (Priority, Resources, ...)
    _job_exit: int | None = None
    _placed: bool = False  # delegated: the request names the nodes Slurm gave
    _polled_at: float = field(default=-1e9)
    calls: int = 0  # Slurm commands issued (the watcher's load on slurmctld)
    lease: LeaseFileRenewer | None = None  # renewed on each poll: the nodes stop the ranks once it goes stale
    # The flow's own scancel (`terminate`) came before any signal of Slurm's: the batch script's
    # trap takes its SIGTERM as it takes a time limit's, so the mark it leaves is not Slurm's.
    _stopped_unsignalled: bool = False

    def state(self, fresh: bool = False) -> str:
        """The job's Slurm state, asking Slurm at most every `settings.poll_s` unless `fresh`."""
        if self._state in FINAL_STATES:
            return self._state
        if not fresh and time.monotonic() - self._polled_at < self.settings.poll_s:
            return self._state
        self._polled_at = time.monotonic()
        self.calls += 1
        out = slurm_command(["squeue", "-h", "-j", self.job_id, "-o", "%T|%r"], self.settings, check=False)
        state, _, reason = (out.stdout.strip() if out.returncode == 0 else "").partition("|")
        state = state.upper()
        if state and state not in FINAL_STATES:
            self._state, self._reason = state, reason.strip()
            return state
        self._state, self._job_exit = self._final_state()
        return self._state

    def _final_state(self) -> tuple[str, int | None]:
        """A job gone from squeue: `scontrol show job` while slurmctld remembers it, else sacct."""
        self.calls += 1
        out = slurm_command(["scontrol", "show", "job", "-o", self.job_id], self.settings, check=False)
        fields = dict(item.split("=", 1) for item in out.stdout.split() if "=" in item)
        if out.returncode == 0 and fields.get("JobState"):
            state = fields["JobState"]
            if state not in FINAL_STATES:  # COMPLETING and the like: not over yet
                return state, None
            return state, int(fields.get("ExitCode", "1:0").split(":")[0])
        self.calls += 1
        acct = slurm_command(["sacct", "-n", "-P", "-X", "-j", self.job_id, "-o", "State,ExitCode"],
                             self.settings, check=False)
        line = acct.stdout.strip().splitlines()[0] if acct.returncode == 0 and acct.stdout.strip() else ""
        if line:
            state, code = line.split("|")
            return state.split()[0], int(code.split(":")[0])
        return "UNKNOWN", None  # slurmctld forgot it and there is no accounting: treat as gone

    def waiting(self) -> str | None:
        """Why Slurm has not started the job yet ("waiting in Slurm: Priority"), None once it runs
        (or ended). The start-up timeout starts only when this turns None (`infra.launch.wait_until_started`).
        Renews the lease file: a job that waits in the queue must not start with a stale one."""
        if self.lease is not None:
            self.lease.renew()
        if self.state() != "PENDING":
            return None
        return f"waiting in Slurm: {self._reason or 'no reason given'} (job {self.job_id})"

    def ended_by_batch_system(self) -> str | None:
        """Why the job ended, when Slurm ended it rather than its code: it signalled the job (its
        time limit was near, or a preemption) and the ranks committed and stopped, or the job
        ended TIMEOUT, PREEMPTED, NODE_FAIL or DEADLINE. None otherwise (asks Slurm once more),
        and for a job the flow itself scancelled before any signal (a start-up timeout, a hang):
        that attempt failed, and its restarts count against the job's failures."""
        state = self.state(fresh=True)
        if state in SLURM_ENDED:
            return f"Slurm ended job {self.job_id}: {state}"
        preempted_at = self._preempt_time()
        if preempted_at:  # its state may read CANCELLED or COMPLETING: the flow's scancel came after
            return (f"Slurm ended job {self.job_id}: PREEMPTED at {preempted_at} (a job of a higher "
                    f"priority tier took its resources; the ranks committed and stopped)")
        if signalled_path(self.request).exists() and not self._stopped_unsignalled:
            return (f"Slurm signalled job {self.job_id} (its time limit was near, or a preemption): "
                    f"the ranks committed and stopped; it ended {state}")
        return None

    def _preempt_time(self) -> str | None:
        """When Slurm chose the job for preemption (`scontrol show job`'s PreemptTime), or None.
        A preemption's SIGTERM reaches the ranks (within the partition's GraceTime) but not the
        batch script's trap, and once the ranks have stopped the flow's scancel can end the job
        before Slurm writes PREEMPTED: the preemption time is what it keeps either way."""
        self.calls += 1
        out = slurm_command(["scontrol", "show", "job", "-o", self.job_id], self.settings, check=False)
        fields = dict(item.split("=", 1) for item in out.stdout.split() if "=" in item)
        found = fields.get("PreemptTime", "None") if out.returncode == 0 else "None"
        return None if found in ("None", "Unknown", "") else found

    def poll(self) -> dict[str, int | None]:
        if self.lease is not None:
            self.lease.renew()
        if self.settings.mode == "delegate":
            self._read_placement()
        codes: dict[str, int | None] = {}
        for spec in self.request.nodes:
            marker = exit_code_path(self.request, spec.node)
            try:
                codes[spec.node] = int(marker.read_text().strip())
            except (OSError, ValueError):
                codes[spec.node] = None
        if all(c is not None for c in codes.values()):
            return codes
        state = self.state()
        if state in FINAL_STATES or state == "UNKNOWN":
            # Final in Slurm: a node that said nothing will not say anything now.
            for node, code in codes.items():
                if code is None:
                    codes[node] = exit_code_of_state(state, self._job_exit)
        return codes

    def wait(self, timeout: float | None = None, any_exit: bool = False) -> dict[str, int | None]:
        return wait_for_exit(self.poll, timeout, any_exit, interval_s=0.5)

    def terminate(self, grace_s: float = 10.0) -> None:
        """scancel, then wait until Slurm says the job is over (every step's processes gone)."""
        if self.state(fresh=True) in FINAL_STATES:
            return
        if all(code is not None for code in self.poll().values()):
            # Every torchrun has exited: the batch script is finishing on its own, and a job
            # that finished must not read CANCELLED in Slurm's records.
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and self.state(fresh=True) not in FINAL_STATES:
                time.sleep(0.5)
            if self._state in FINAL_STATES:
                return
        if self.lease is not None:  # the nodes stop too should scancel not reach them
            self.lease.release("the flow stopped the attempt")
        self._stopped_unsignalled = not signalled_path(self.request).exists()
        slurm_command(["scancel", self.job_id], self.settings, check=False)
        deadline = time.monotonic() + grace_s + 60  # plus Slurm's KillWait
        while time.monotonic() < deadline:
            if self.state(fresh=True) in FINAL_STATES or self._state == "UNKNOWN":
                return
            time.sleep(0.5)
        raise SlurmError(f"Slurm job {self.job_id} ({self.request.job_name}) still {self._state} "
                         f"{grace_s + 60:.0f}s after scancel; check `scontrol show job {self.job_id}`")

    def _read_placement(self) -> None:
        """Once every node's task has said where it runs, the request names Slurm's nodes (exit
        codes and logs are found by them) and the placement is written for the flow and diagnosis."""
        if self._placed:
            return
        placed = read_node_placements(self.request)
        if placed is None:
            return
        self.request = replace(self.request, nodes=placed)
        atomic_write_json(placement_path(self.request), {
            "slurm_job_id": self.job_id, "master_addr": placed[0].address,
            "nodes": [{"node": n.node, "node_rank": n.node_rank, "nproc_per_node": n.nproc_per_node,
                       "gpus": n.cuda_visible_devices, "first_global_rank": n.first_global_rank} for n in placed]})
        self._placed = True

    def log_paths(self) -> dict[str, Path]:
        """Each node's console (its Slurm step output) and the batch script's output."""
        paths = {n.node: node_log_path(self.request, n.node) for n in self.request.nodes}
        paths["slurm-batch"] = batch_log_path(self.request)
        return paths


class SlurmLauncher:
    """Submit each attempt as one batch job; see the module docstring for its shape."""

    def __init__(self, settings: SlurmSettings | None = None, gpu_type: str = CPU_DEVICE, grace_s: float = 10.0,
                 lease_s: float = FILE_LEASE_S):
        self.settings = settings or SlurmSettings()
        self.gpu_type = gpu_type
        self.grace_s = grace_s
        self.lease_s = lease_s  # the nodes stop the ranks once the flow has not renewed the lease file this long
        # delegated: nodes this launcher's jobs must not get (--exclude), with the run's `exclude_nodes`
        self.exclude: list[str] = []

    def check_nodes(self, request: LaunchRequest) -> None:
        """Refuse a placement Slurm would not run: a node unknown, drained or down there."""
        known = node_states(self.settings)
        problems = []
        for spec in request.nodes:
            node = known.get(spec.node)
            if node is None:
                problems.append(f"{spec.node!r} is not a Slurm node (Slurm has {sorted(known)[:10]})")
            elif not node.schedulable:
                problems.append(f"{spec.node!r} is {node.state} in Slurm" + (f" ({node.reason})" if node.reason else ""))
        if problems:
            raise SlurmNodeUnavailable(
                f"not submitting {request.job_name} attempt {request.attempt}: " + "; ".join(problems)
                + ". Place the job on other nodes, or return a node to service with "
                "`scontrol update NodeName=NAME State=RESUME` once it is healthy.")

    def submit_args(self, request: LaunchRequest, gpu_type: str | None = None) -> list[str]:
        """sbatch's options for `request` (on `gpu_type`, default the launcher's): what `start` submits
        and what `infra.slurm_start` asks `sbatch --test-only` about. Delegated: with the nodes this
        launcher and the run must not get again (`--exclude`)."""
        delegated = self.settings.mode == "delegate"
        exclude = sorted(set(self.exclude) | set(excluded_nodes(request.run_dir))) if delegated else []
        return sbatch_args(request, self.settings, gpu_type or self.gpu_type, exclude)

    def start(self, request: LaunchRequest) -> SlurmJob:
        delegated = self.settings.mode == "delegate"
        if not delegated:  # Slurm chooses the nodes when delegated, and skips drained ones itself
            self.check_nodes(request)
        folder = attempt_dir(request)
        folder.mkdir(parents=True, exist_ok=True)
        (request.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        for spec in request.nodes:  # a resubmitted attempt must not read the last one's codes
            exit_code_path(request, spec.node).unlink(missing_ok=True)
        clear_rendezvous(request)
        lease = LeaseFileRenewer(lease_file_path(request.run_dir, request.attempt), self.lease_s)
        lease.renew()  # written before any node reads it
        request_file = folder / "request.json"
        request_file.write_text(json.dumps(request.to_dict(), indent=1))
        script = folder / "job.sbatch"
        shutil.rmtree(node_placements_dir(request), ignore_errors=True)
        placement_path(request).unlink(missing_ok=True)
        signalled_path(request).unlink(missing_ok=True)
        script.write_text(batch_script(request, request_file, self.grace_s, delegated=delegated))
        args = ["sbatch", "--parsable", *self.submit_args(request), str(script)]
        # sbatch exports its environment to the job: only what the ranks need
        job_id = slurm_command(args, self.settings, environ=worker_environment()).stdout.strip().split(";")[0]
        (folder / "slurm-job-id").write_text(job_id)
        return SlurmJob(request, job_id, self.settings, lease=lease)


# --- on each node: `python -m infra.slurm node request.json` ------------------------


def node_placements_dir(request: LaunchRequest) -> Path:
    return attempt_dir(request) / "placement"


def placement_path(request: LaunchRequest) -> Path:
    """Where a delegated attempt really ran (Slurm's nodes, node ranks, rendezvous host, GPUs),
    written once every node's task has reported: what the flow, the watcher and diagnosis read."""
    return attempt_dir(request) / "placement.json"


def placed_first_ranks(run_dir: Path, attempt: int) -> dict[str, int]:
    """node -> its first global rank where a delegated attempt really ran (`placement.json`);
    empty when the attempt was not delegated or its nodes never all reported."""
    try:
        placed = json.loads((Path(run_dir) / "launch" / f"attempt-{attempt}" / "placement.json").read_text())
        return {n["node"]: int(n["first_global_rank"]) for n in placed["nodes"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def slurm_gpus(environ: dict[str, str]) -> str | None:
    """The GPU indices Slurm bound to this step (its CUDA_VISIBLE_DEVICES under gres), or None."""
    if (environ.get("SLURM_STEP_GPUS") or environ.get("SLURM_JOB_GPUS")) and "CUDA_VISIBLE_DEVICES" in environ:
        return environ["CUDA_VISIBLE_DEVICES"]
    return None


def node_launch_from_slurm(request: LaunchRequest, environ: dict[str, str], name: str) -> NodeLaunch:
    """A delegated attempt's launch on this node, from Slurm's environment: node rank SLURM_NODEID
    (the allocation's order), the placement's layout for that rank, the rendezvous on node rank 0
    (the job's first node, which publishes itself: infra.launch.resolve_rendezvous), the GPUs
    Slurm bound."""
    slots = sorted(request.nodes, key=lambda n: n.node_rank)
    rank = int(environ["SLURM_NODEID"])
    if not 0 <= rank < len(slots):
        raise ValueError(f"SLURM_NODEID={rank}, but the attempt has {len(slots)} node(s)")
    slot = slots[rank]
    gpus = slurm_gpus(environ)
    return replace(slot, node=name, address=name, cuda_visible_devices=gpus if gpus is not None else "",
                   master_addr=name if rank == 0 else slot.master_addr)


def write_node_placement(request: LaunchRequest, spec: NodeLaunch) -> None:
    atomic_write_json(node_placements_dir(request) / f"node-{spec.node_rank}.json", asdict(spec))


def read_node_placements(request: LaunchRequest) -> list[NodeLaunch] | None:
    """Every node's launch as its task reported it (node rank order), or None until all have."""
    placed = []
    for rank in range(len(request.nodes)):
        try:
            placed.append(NodeLaunch(**json.loads((node_placements_dir(request) / f"node-{rank}.json").read_text())))
        except (OSError, ValueError, TypeError):
            return None
    return placed


def run_node(request_file: Path, grace_s: float, delegated: bool = False) -> int:
    """One node's task of the srun step: its torchrun (under the reaper) until it exits."""
    request = LaunchRequest.from_dict(json.loads(Path(request_file).read_text()))
    name = os.environ.get("SLURMD_NODENAME") or os.uname().nodename.split(".")[0]
    if delegated:
        spec = node_launch_from_slurm(request, dict(os.environ), name)
        write_node_placement(request, spec)  # before the rendezvous: where this rank really is
        request = replace(request, nodes=[spec if n.node_rank == spec.node_rank else n for n in request.nodes])
    else:
        try:
            spec = request.node(name)
        except KeyError as e:
            print(f"forgeflow: {e}; the job's --nodelist and the placement disagree", flush=True)
            return 2
    spec = resolve_rendezvous(spec, request)
    env = node_env(spec, request)
    if slurm_gpus(dict(os.environ)) is not None:
        # Slurm chose this step's GPUs (gres) and set their visibility: use those. The
        # placement's GPU count per node holds; its GPU indices only when Slurm agrees.
        env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
    print(f"forgeflow: node {name} node-rank {spec.node_rank}/{spec.nnodes}, {spec.nproc_per_node} process(es), "
          f"rendezvous {spec.master_addr}:{spec.master_port}", flush=True)
    proc = subprocess.Popen(node_command(spec, request, grace_s, lease_file_path(request.run_dir, request.attempt)),
                            env=env, stdin=subprocess.DEVNULL)

    stopped_by: list[int] = []

    def forward(signum, _frame):  # scancel: the reaper stops torchrun's ranks within grace_s
        stopped_by.append(signum)
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = proc.wait()
    if stopped_by and code == 0:  # torchrun exits 0 when told to stop; a stopped node did not finish
        code = 128 + stopped_by[0]
    marker = exit_code_path(request, name)
    atomic_write(marker, str(code))
    return code


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m infra.slurm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    node = sub.add_parser("node", help="run this node's share of an attempt (inside an srun step)")
    node.add_argument("request_file")
    node.add_argument("--grace", type=float, default=10.0)
    node.add_argument("--delegated", action="store_true", help="Slurm chose the nodes: build the launch "
                      "from Slurm's environment")
    args = parser.parse_args(argv)
    return run_node(Path(args.request_file), args.grace, args.delegated)


if __name__ == "__main__":
    sys.exit(main())
