"""Launchers: turn a placement into one `torchrun` per node and follow it.

The interface is deliberately small (`Launcher.start` → `LaunchedJob` with
`poll`, `wait`, `terminate`) so that Prefect, Kubernetes or Slurm launchers can
sit beside the local one without the flow changing.

`LocalLauncher` starts every node's torchrun as a subprocess of this machine
under `infra.reaper`, which guarantees that no rank outlives the launcher: not
on cancellation, not when the flow process crashes (see infra/reaper.py for
why torchrun alone does not guarantee that).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Mapping, Protocol

import psutil

from infra.atomic_write import atomic_write_json
from infra.reaper import stop_processes



@dataclass(frozen=True)
class NodeLaunch:
    """Everything one node's torchrun needs (static rendezvous keeps the rank map exact)."""

    node: str
    address: str
    node_rank: int
    nnodes: int
    nproc_per_node: int
    cuda_visible_devices: str
    master_addr: str
    master_port: int
    first_global_rank: int

    def torchrun_args(self) -> list[str]:
        return [
            f"--nnodes={self.nnodes}",
            f"--node-rank={self.node_rank}",
            f"--nproc-per-node={self.nproc_per_node}",
            f"--master-addr={self.master_addr}",
            f"--master-port={self.master_port}",
        ]

    def env(self) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": self.cuda_visible_devices} if self.cuda_visible_devices else {}


@dataclass
class LaunchRequest:
    """A job's launch: one `scheduler.placement.NodeLaunch` per node plus what every rank runs."""

    job_name: str
    nodes: list[NodeLaunch]
    worker_args: list[str]  # e.g. ["-m", "training.train", "job.yaml", "--set", "k=v"]
    run_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    attempt: int = 0  # names this attempt's log files; restarts never overwrite a failed attempt's

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ValueError("a launch needs at least one node")
        ranks = sorted(n.node_rank for n in self.nodes)
        if ranks != list(range(len(self.nodes))) or any(n.nnodes != len(self.nodes) for n in self.nodes):
            raise ValueError(f"node ranks must be 0..{len(self.nodes) - 1} with nnodes={len(self.nodes)}")
        self.run_dir = Path(self.run_dir)

    @property
    def world_size(self) -> int:
        return sum(n.nproc_per_node for n in self.nodes)

    def to_dict(self) -> dict:
        """Plain JSON (recorded with the job in the state database for its node-launch runs:
        `Orchestrator.record_launch`). `env` carries fault drills and settings, never credentials."""
        return {"job_name": self.job_name, "nodes": [asdict(n) for n in self.nodes],
                "worker_args": list(self.worker_args), "run_dir": str(self.run_dir),
                "env": dict(self.env), "attempt": self.attempt}

    @classmethod
    def from_dict(cls, data: dict) -> "LaunchRequest":
        return cls(job_name=data["job_name"], nodes=[NodeLaunch(**n) for n in data["nodes"]],
                   worker_args=list(data["worker_args"]), run_dir=Path(data["run_dir"]),
                   env=dict(data.get("env") or {}), attempt=int(data.get("attempt", 0)))

    def node(self, name: str) -> NodeLaunch:
        for spec in self.nodes:
            if spec.node == name:
                return spec
        raise KeyError(f"node {name!r} is not part of this launch (nodes: {[n.node for n in self.nodes]})")


# How often torchrun's agent checks its ranks: torchrun's own default, written out so that every
# launcher (and benchmarks/recovery.py's plain-torchrun baseline) uses the same. A rank that dies
# is seen by its agent within this, and by the flow's watcher when the agent exits (pidfd).
TORCHRUN_MONITOR_INTERVAL_S = 0.1


def torchrun_command(spec: NodeLaunch, request: LaunchRequest) -> list[str]:
    """The torchrun command line for one node.

    Static rendezvous (master address/port + node rank), not c10d: the placement
    fixes which global rank runs on which GPU (pipeline stages are cross-mapped
    over PCIe root complexes), and only a static node rank keeps that map; c10d
    hands out node ranks in arrival order. No in-torchrun restarts either: a
    restart is the flow's decision, made after diagnosis.
    """
    return [
        sys.executable, "-m", "infra.torchrun",  # torchrun, exiting as soon as its ranks have
        *spec.torchrun_args(),
        "--max-restarts=0",
        f"--monitor-interval={TORCHRUN_MONITOR_INTERVAL_S}",
        # Prefix each rank's console lines ("[default0]:...") so logs say who spoke.
        "--tee=3",
        f"--log-dir={request.run_dir / 'torchrun' / f'attempt-{request.attempt}' / spec.node}",
        *request.worker_args,
    ]


# What a rank (and the Slurm batch job around it) inherits from the launcher's environment:
# the names and prefixes below, nothing else, plus the request's own `env`. The launcher
# runs in a flow worker that holds secrets no rank needs (Slack's webhook, Prefect's API
# auth string, an LLM key, the state database's URL with its password), and a rank runs the
# job's code. Add here what a worker needs that is missing, with its reason.
WORKER_ENV_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "TERM", "TZ", "LANG", "LANGUAGE",
    "TMPDIR", "VIRTUAL_ENV", "CONDA_PREFIX", "LD_LIBRARY_PATH", "LD_PRELOAD",  # the interpreter and its libraries
    "XDG_CACHE_HOME",  # torch, Triton and Hugging Face caches
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",  # storage behind a private CA
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
    "TOKENIZERS_PARALLELISM",
})
WORKER_ENV_PREFIXES = (
    "LC_",
    "PYTHON",  # PYTHONPATH, PYTHONHASHSEED...
    "TORCH", "PYTORCH_", "NCCL_", "CUDA", "NVIDIA_", "NVTE_", "TRITON_", "GLOO_", "UCX_", "FI_",  # the engine and its transports
    "OMP_", "MKL_", "KMP_", "OPENBLAS_",  # CPU threads
    "MASTER_", "WORLD_", "RANK", "LOCAL_RANK", "GROUP_RANK",  # torchrun sets these; a launcher's own pass through
    "SLURM_", "SBATCH_", "SRUN_",  # Slurm's job and step, and its clients' settings
    "FORGEFLOW_",  # the run's own (fault drills, the node's name, FORGEFLOW_TRUST_LEGACY_CHECKPOINTS), less the below
    "AWS_",  # the checkpoint store's credentials, region and endpoint
    "HF_", "TRANSFORMERS_", "HUGGINGFACE_",  # tokenizers, datasets and exports
    "WANDB_", "MLFLOW_",  # the worker's metrics (training.metrics)
)
# Under FORGEFLOW_ but for the flows and the CLI, never a rank: the state database (its URL
# carries the password; ranks write run files, the flow writes the database), the failure
# agent's LLM and its memory.
WORKER_ENV_WITHHELD_PREFIXES = ("FORGEFLOW_DB_URL", "FORGEFLOW_LLM_", "FORGEFLOW_CHROMA_")


def worker_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The part of ``environ`` (default: this process's) a rank inherits: WORKER_ENV_NAMES and
    WORKER_ENV_PREFIXES, less WORKER_ENV_WITHHELD_PREFIXES."""
    environ = os.environ if environ is None else environ
    return {name: value for name, value in environ.items()
            if (name in WORKER_ENV_NAMES or name.startswith(WORKER_ENV_PREFIXES))
            and not name.startswith(WORKER_ENV_WITHHELD_PREFIXES)}


def node_env(spec: NodeLaunch, request: LaunchRequest) -> dict[str, str]:
    """One node's torchrun environment: `worker_environment()`, the request's `env`, the node's name
    and its GPUs."""
    env = worker_environment()
    env.update(request.env)
    env["PYTHONUNBUFFERED"] = "1"
    # Idle OpenMP threads sleep instead of spinning (unless the launcher's environment says
    # otherwise): a rank's spinning intra-op threads fight the other ranks, the checkpoint writer
    # and the node's agents for cores. On CPU nodes steps ran up to 10x slower on a busy machine
    # (`forgeflow train` sets the same); on GPU nodes the host threads are mostly idle anyway.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env["FORGEFLOW_NODE_NAME"] = spec.node
    if spec.cuda_visible_devices:  # empty: leave device visibility as the node has it
        env["CUDA_VISIBLE_DEVICES"] = spec.cuda_visible_devices
    return env


def local_node_launches(names: list[str], nproc_per_node: int, master_port: int) -> list[NodeLaunch]:
    """Launch specs for 'nodes' that are all this machine (tests, node checks, CPU runs)."""
    return [
        NodeLaunch(node=name, address="127.0.0.1", node_rank=i, nnodes=len(names),
                   nproc_per_node=nproc_per_node, cuda_visible_devices="", master_addr="127.0.0.1",
                   master_port=master_port, first_global_rank=i * nproc_per_node)
        for i, name in enumerate(names)
    ]


class LaunchedJob(Protocol):
    def poll(self) -> dict[str, int | None]:
        """Exit code per node; None while it runs."""

    def wait(self, timeout: float | None = None, any_exit: bool = False) -> dict[str, int | None]:
        """Until every node has exited (or the first one, with any_exit), or timeout."""

    def terminate(self, grace_s: float = 10.0) -> None:
        """Stop every rank on every node; returns when they are gone."""

    def log_paths(self) -> dict[str, Path]:
        """Where each node's console output (all its ranks, prefixed) is written."""


def wait_for_exit(poll, timeout: float | None, any_exit: bool, interval_s: float,
                  sleep=time.sleep) -> dict[str, int | None]:
    """`LaunchedJob.wait` for any job whose `poll` returns exit codes per node, polling every
    `interval_s` (never past the timeout); `sleep(seconds)` may return early when something
    exited (LocalJob: the reapers' pidfds)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    done = any if any_exit else all
    while True:
        codes = poll()
        if done(code is not None for code in codes.values()):
            return codes
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return codes
        sleep(interval_s if left is None else min(interval_s, left))


def wait_until_started(job, on_waiting: Callable[[str | None], None] | None = None,
                       stop_requested: Callable[[], str | None] | None = None, poll_s: float = 1.0) -> str | None:
    """Wait while the batch system keeps `job` queued (a job without `waiting()` has started).
    `on_waiting(reason)` at each new reason and `on_waiting(None)` once it runs, if it waited; a
    queued job is never a hang: the watcher (and its start-up timeout) begins after this returns.
    Returns the stop request that ended the wait (`forgeflow cancel`), else None."""
    waiting = getattr(job, "waiting", None)
    said = None
    while waiting is not None and (reason := waiting()):
        if reason != said and on_waiting is not None:
            on_waiting(reason)
        said = reason
        requested = stop_requested() if stop_requested is not None else None
        if requested:
            return requested
        time.sleep(poll_s)
    if said is not None and on_waiting is not None:
        on_waiting(None)
    return None


class Launcher(Protocol):
    def start(self, request: LaunchRequest) -> LaunchedJob: ...


def _since_boot() -> float:
    """Seconds since boot, the clock a process's start time is kept in (/proc/PID/stat)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def _started_since_boot(proc: psutil.Process) -> float:
    return proc.create_time() - psutil.boot_time()


# A process's start time is kept in clock ticks (10 ms): "started before" is only trusted with a
# margin of two.
START_TIME_SLACK_S = 0.02


@dataclass
class LocalJob:
    request: LaunchRequest
    processes: dict[str, subprocess.Popen]
    logs: dict[str, Path]
    # Per node, a time (seconds since boot) before its reaper was reaped: from then on its pid,
    # and so the number of its process group, may belong to another program (_tree).
    reaped_before: dict[str, float] = field(default_factory=dict)

    def _exit_code(self, node: str, wait_s: float | None = 0.0) -> int | None:
        """The node's reaper's exit code (None while it runs), waiting up to wait_s (None: for
        ever; 0: poll); notes when it was reaped."""
        proc = self.processes[node]
        if proc.returncode is None:
            before = _since_boot()
            try:
                proc.wait(timeout=wait_s) if wait_s != 0.0 else proc.poll()
            except subprocess.TimeoutExpired:
                pass
            if proc.returncode is not None:
                self.reaped_before.setdefault(node, before)
        else:  # reaped by a caller holding the Popen: the first time we see it is the bound we have
            self.reaped_before.setdefault(node, _since_boot())
        return proc.returncode

    def poll(self) -> dict[str, int | None]:
        """A node whose reaper was killed (SIGKILL: it could not stop its tree) has exited once
        nothing it left in its process group runs: its torchrun, told by its parent-death
        signal, is still stopping the ranks, which commit the step they are on. Reporting the
        exit before would let the caller kill them mid-commit (its grace for a failure is short)."""
        codes = {node: self._exit_code(node) for node in self.processes}
        killed = {node for node, code in codes.items() if code is not None and code < 0}
        if killed:
            groups = self._reaped_groups()
            for p in psutil.process_iter():
                try:
                    for node in killed:
                        if self._left_in_group(p, self.processes[node].pid, groups):
                            codes[node] = None
                except (psutil.NoSuchProcess, ProcessLookupError, PermissionError):
                    continue
        return codes

    def wait(self, timeout: float | None = None, any_exit: bool = False) -> dict[str, int | None]:
        """Woken the moment a running reaper exits (its pidfd), not at the next poll: a rank that
        dies is seen as soon as its torchrun and reaper are gone. A killed reaper's group left
        behind (poll) is polled every 0.2 s."""
        return wait_for_exit(self.poll, timeout, any_exit, interval_s=3600.0, sleep=self._sleep_until_a_reaper_exits)

    def _sleep_until_a_reaper_exits(self, seconds: float) -> None:
        if self.reaped_before:  # what a reaped reaper left in its group is only seen by polling
            seconds = min(seconds, 0.2)
        # Only reapers not reaped yet: their pids are still ours (a zombie at worst), so a pidfd
        # cannot name another program's process.
        fds = []
        try:
            for proc in self.processes.values():
                if proc.returncode is None:
                    try:
                        fds.append(os.pidfd_open(proc.pid))
                    except ProcessLookupError:  # reaped by someone else: poll() will say so
                        return
            if fds:  # poll, not select: a busy worker's descriptors may be numbered past select's 1024
                waiter = select.poll()
                for fd in fds:
                    waiter.register(fd, select.POLLIN)
                waiter.poll(seconds * 1000)
            else:
                time.sleep(seconds)
        finally:
            for fd in fds:
                os.close(fd)

    def _tree(self) -> list[psutil.Process]:
        """Every live process of this job, found even when its reaper is gone: each reaper leads
        its own process group (`start_node`), which torchrun shares, and the ranks are torchrun's
        children (in sessions of their own, so not in the group).

        A reaper that was reaped no longer holds its pid: the kernel keeps the number while any
        process is still in its group (torchrun, when the reaper was SIGKILLed), but once the group
        is empty it may hand the number to another program, which can lead a group of its own
        with it (a database server, the next job's reaper). So the group of a reaped reaper counts
        only its members that started before the reaper was reaped, never its leader."""
        live = {proc.pid for node, proc in self.processes.items() if self._exit_code(node) is None}
        gone = self._reaped_groups()
        roots: dict[int, psutil.Process] = {}
        for p in psutil.process_iter():
            try:
                if p.pid in live or os.getpgid(p.pid) in live or any(
                        self._left_in_group(p, group, gone) for group in gone):
                    roots[p.pid] = p
            except (psutil.NoSuchProcess, ProcessLookupError, PermissionError):
                continue
        found = dict(roots)
        for root in roots.values():
            try:
                found.update((c.pid, c) for c in root.children(recursive=True))
            except psutil.NoSuchProcess:
                continue
        reapers = {proc.pid for proc in self.processes.values()}
        return [p for pid, p in found.items() if pid not in reapers or pid in live]

    def _reaped_groups(self) -> dict[int, float]:
        """Process group (a reaped reaper's pid) -> a time before the reaper was reaped."""
        return {proc.pid: self.reaped_before[node] for node, proc in self.processes.items()
                if proc.returncode is not None and node in self.reaped_before}

    @staticmethod
    def _left_in_group(p: psutil.Process, group: int, reaped_before: dict[int, float]) -> bool:
        """p is a live member the reaper `group` left in its group: not the group's leader (that
        number is no longer the reaper's), started before the reaper was reaped, not a zombie
        (once re-parented, its new parent may never collect it)."""
        return (group in reaped_before and p.pid != group and os.getpgid(p.pid) == group
                and _started_since_boot(p) < reaped_before[group] - START_TIME_SLACK_S
                and p.status() != psutil.STATUS_ZOMBIE)

    def pids(self) -> set[int]:
        """Every live process of this job: reapers, torchruns and ranks."""
        return {p.pid for p in self._tree()}

    def terminate(self, grace_s: float = 10.0) -> None:
        if grace_s <= 0:
            # Nothing to wait for (a hang: no rank can commit without its peers): SIGKILL the whole
            # tree, reapers included, at once instead of asking the reapers first.
            stop_processes(self._tree(), 0.0)
            for node in self.processes:
                self._exit_code(node, wait_s=None)
            return
        for node, proc in self.processes.items():
            if self._exit_code(node) is None:
                try:
                    proc.send_signal(signal.SIGTERM)  # the reaper tears its tree down
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s + 5
        for node in self.processes:
            self._exit_code(node, wait_s=max(0.1, deadline - time.monotonic()))
        # What a reaper did not stop: one that hung, or one SIGKILLed, whose torchrun (told by
        # its parent-death signal, infra/reaper.py) may still be stopping its ranks.
        stop_processes(self._tree(), grace_s)
        for node in self.processes:
            self._exit_code(node, wait_s=None)

    def log_paths(self) -> dict[str, Path]:
        return dict(self.logs)


def node_log_path(request: LaunchRequest, node: str) -> Path:
    """Where one node's console output (all its ranks, prefixed) goes for this attempt."""
    return request.run_dir / "logs" / f"node-{node}.attempt-{request.attempt}.out"


def exit_code_path(request: LaunchRequest, node: str) -> Path:
    """The node's torchrun exit code, written on the node when it exits (by a node-launch
    run or a Slurm step): a failed flow run or batch job alone does not say whether
    torchrun exited 1 or was OOM-killed, nor on which node."""
    return request.run_dir / "launch" / f"attempt-{request.attempt}" / f"{node}.exit"


def node_runs_path(run_dir: Path, attempt: int) -> Path:
    """Where a launcher that runs each node as its own orchestrator run (the Prefect one) records
    node -> run id for attempt `attempt`, so its runs can be found again once its job is gone."""
    return Path(run_dir) / "launch" / f"attempt-{attempt}" / "node-runs.json"


def stopped_by_peer(nodes: Iterable[str], culprits: Iterable[str], cause: str = "") -> dict[str, str]:
    """node -> why, for the nodes of a failed attempt that stopped only because a peer failed.

    When one node fails, the others stop too: their ranks lose the peer and exit on their own,
    or the watcher stops them after `failure_grace_s` (infra.watch). Which node failed is
    known once the diagnosis names the suspect nodes (`culprits`, the launcher's node names):
    every other node of the attempt was stopped by that failure. Nothing when the culprits
    are none of the attempt's nodes (no node is cleared) or all of them."""
    nodes, culprits = list(dict.fromkeys(nodes)), set(culprits)
    named = [n for n in nodes if n in culprits]
    if not named or len(named) == len(nodes):
        return {}
    peers = ", ".join(named)
    why = f"stopped: peer {peers} failed" + (f" ({cause})" if cause else "")
    return {node: why for node in nodes if node not in named}


CHOOSE_ON_NODE_0 = 0
"""`NodeLaunch.master_port` meaning: node rank 0 picks a free port on itself when it starts."""


def rendezvous_path(request: LaunchRequest) -> Path:
    return request.run_dir / "launch" / f"attempt-{request.attempt}" / "rendezvous.json"


def clear_rendezvous(request: LaunchRequest) -> None:
    """Launchers call this before starting nodes, so no node reads an earlier launch's port."""
    rendezvous_path(request).unlink(missing_ok=True)


def port_free_here(port: int = 0) -> int:
    """Bind `port` (0: any) on every interface of this machine and return it: a port that is
    free here, where the rendezvous store will listen — not on the flow's machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", port))
        return s.getsockname()[1]


def resolve_rendezvous(spec: NodeLaunch, request: LaunchRequest, timeout_s: float = 300.0) -> NodeLaunch:
    """The node's launch with the rendezvous port fixed.

    With `master_port == CHOOSE_ON_NODE_0`, node rank 0 (which hosts torchrun's store)
    chooses a port free on itself and publishes it in the run directory, which every
    node sees; the other nodes wait for it. A port chosen anywhere else can be taken
    on node 0.
    """
    if spec.master_port != CHOOSE_ON_NODE_0:
        return spec
    path = rendezvous_path(request)
    if spec.node_rank == 0:
        port = port_free_here()
        # Readers see the whole file or none.
        atomic_write_json(path, {"master_addr": spec.master_addr, "master_port": port, "node": spec.node})
        return replace(spec, master_port=port)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            published = json.loads(path.read_text())
            return replace(spec, master_addr=published["master_addr"], master_port=int(published["master_port"]))
        except (OSError, ValueError, KeyError):
            time.sleep(0.2)
    raise TimeoutError(f"node {spec.node}: node rank 0 did not publish a rendezvous port in {path} within "
                       f"{timeout_s:.0f}s; did node 0 start? (see its log)")


def node_command(spec: NodeLaunch, request: LaunchRequest, grace_s: float = 10.0,
                 lease_file: Path | None = None, nice: int = 0) -> list[str]:
    """One node's torchrun under the reaper (so no rank outlives whoever started it); with
    `lease_file`, the reaper also stops it once the job's holder is gone (infra.lease_guard);
    with `nice`, it runs at that niceness (a standby world's: infra.standby)."""
    lease = [f"--lease-file={lease_file}"] if lease_file is not None else []
    niceness = [f"--nice={nice}"] if nice else []
    return [sys.executable, "-m", "infra.reaper", f"--grace={grace_s}", *lease, *niceness, "--",
            *torchrun_command(spec, request)]


def start_node(spec: NodeLaunch, request: LaunchRequest, grace_s: float = 10.0, nice: int = 0) -> subprocess.Popen:
    """Start one node's torchrun under the reaper, console to `node_log_path`.

    Every launcher ends here on the node itself: the local one for each node of
    this machine, the Prefect one inside the node-launch flow run on the node's
    worker (flows/node_launch.py). (The Slurm one runs `node_command` itself, its
    console going to the Slurm step's output file: infra/slurm.py.)
    """
    log_path = node_log_path(request, spec.node)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    spec = resolve_rendezvous(spec, request)
    command = node_command(spec, request, grace_s, nice=nice)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            command,
            env=node_env(spec, request),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=os.getcwd(),
            process_group=0,  # torchrun shares it: LocalJob finds it after a SIGKILLed reaper
        )


class LocalLauncher:
    """Every node of the placement runs on this machine (the embedded default and tests); `nice`:
    the niceness its processes start at (a standby world's, infra.standby)."""

    def __init__(self, grace_s: float = 10.0, nice: int = 0):
        self.grace_s, self.nice = grace_s, nice

    def start(self, request: LaunchRequest) -> LocalJob:
        processes: dict[str, subprocess.Popen] = {}
        logs: dict[str, Path] = {}
        clear_rendezvous(request)
        try:
            for spec in sorted(request.nodes, key=lambda n: n.node_rank):
                processes[spec.node] = start_node(spec, request, self.grace_s, self.nice)
                logs[spec.node] = node_log_path(request, spec.node)
        except BaseException:
            LocalJob(request, processes, logs).terminate(grace_s=1.0)
            raise
        return LocalJob(request, processes, logs)
