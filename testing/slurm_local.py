"""A real single-host Slurm (slurmctld + slurmd + munge) for tests and benchmarks.

Slurm comes from Debian's `slurm-wlm` and `munge` packages (`make test` installs
them when it runs as root and they are missing). This module writes a minimal
`slurm.conf` for this machine — one node with its CPUs as `slurmd -C` reports
them, one partition, free ports chosen at start — and starts the two daemons.
Every client (`sbatch`, `squeue`, `scontrol`, ...) needs `SLURM_CONF` pointing at
that file, or it tries DNS SRV look-ups and fails: `LocalSlurm.env()` has it.

`LocalSlurm(root, nodes=2)`: two Slurm nodes on this one host, one slurmd each (`slurmd -N NAME`,
a port and a spool directory of its own; Debian's build runs several this way). Their names are
ones this host resolves to itself (its own name, then `localhost`): a job's node rank 0 is the
rendezvous host, reached by its Slurm node name. Each node claims the machine's CPUs.

munged is shared by every Slurm on the machine and is started once and left
running (it is a system daemon, not part of one cluster).

    python -m testing.slurm_local DIR     # start one, print `export SLURM_CONF=...`, Ctrl-C stops it
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from testing.local_s3 import free_ports

PARTITION = "debug"
MUNGE_SOCKET = Path("/run/munge/munge.socket.2")


class SlurmUnavailable(RuntimeError):
    """Slurm's daemons or munge are not installed, or cannot be started here."""


def missing_binaries() -> list[str]:
    return [b for b in ("slurmctld", "slurmd", "sbatch", "munged") if not _which(b)]


def _which(name: str) -> str | None:
    return shutil.which(name) or next((str(p) for p in (Path("/usr/sbin") / name, Path("/sbin") / name)
                                       if p.exists()), None)


def ensure_munge() -> None:
    """Start munged (as the munge user) unless it already answers; it refuses to start
    unless its directories exist and belong to `munge`."""
    if MUNGE_SOCKET.exists() and subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
        return
    munged = _which("munged")
    if not munged:
        raise SlurmUnavailable("munged is not installed: apt-get install -y munge slurm-wlm")
    for d in ("/run/munge", "/var/log/munge", "/var/lib/munge", "/etc/munge"):
        Path(d).mkdir(parents=True, exist_ok=True)
        shutil.chown(d, "munge", "munge")
    if not Path("/etc/munge/munge.key").exists():
        subprocess.run(["runuser", "-u", "munge", "--", "mungekey", "--create"], check=True)
    result = subprocess.run(["runuser", "-u", "munge", "--", munged], capture_output=True, text=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if MUNGE_SOCKET.exists() and subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
            return
        time.sleep(0.1)
    raise SlurmUnavailable(f"munged did not start: {result.stdout}{result.stderr}")


def node_line() -> str:
    """This machine as a Slurm node (`slurmd -C`: CPUs, sockets, cores, memory)."""
    out = subprocess.run([_which("slurmd") or "slurmd", "-C"], capture_output=True, text=True, check=True).stdout
    line = next(l for l in out.splitlines() if l.startswith("NodeName="))
    return line + " State=UNKNOWN"


def node_name() -> str:
    return node_line().split()[0].split("=", 1)[1]


# The names of the nodes of a several-node local Slurm: each must resolve to this host.
EXTRA_NODE_NAMES = ("localhost",)


def node_names(count: int) -> list[str]:
    """The Slurm node names of a local Slurm of `count` nodes: this host's name, then EXTRA_NODE_NAMES.
    In that order: slurmctld takes a first NodeName=localhost for this host itself, and then refuses
    this host's own name ("Duplicated NodeHostName")."""
    names = [node_name(), *[n for n in EXTRA_NODE_NAMES if n != node_name()]]
    if not 1 <= count <= len(names):
        raise SlurmUnavailable(f"a local Slurm has 1 to {len(names)} nodes on one host, not {count}")
    return names[:count]


@dataclass
class LocalSlurm:
    """One controller and `nodes` node daemons (one by default) on this machine, configured under `root`."""

    root: Path
    nodes: int = 1
    conf: Path = field(init=False)
    processes: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.root = Path(self.root).resolve()
        self.conf = self.root / "slurm.conf"

    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    @property
    def node(self) -> str:
        return node_name()

    @property
    def node_names(self) -> list[str]:
        """Every node's Slurm name, in the configuration's order."""
        return node_names(self.nodes)

    def _node_lines(self, ports: list[int]) -> list[str]:
        """One node: this machine as `slurmd -C` reports it. Several: the same hardware under each
        name, each node's slurmd on its own port (NodeAddr: this host)."""
        if self.nodes == 1:
            return [node_line()]
        hardware = " ".join(node_line().split()[1:])  # CPUs=.. RealMemory=.. State=UNKNOWN
        return [f"NodeName={name} NodeHostname={name} NodeAddr=127.0.0.1 Port={port} {hardware}"
                for name, port in zip(self.node_names, ports)]

    def write_conf(self) -> Path:
        ctld_port, slurmd_port, *node_ports = free_ports(2 + (self.nodes if self.nodes > 1 else 0))
        several = self.nodes > 1
        for sub in ("state", *([f"spool-{n}" for n in self.node_names] if several else ["spool"])):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        host = node_name()
        # several slurmd on one host: `%n` is each one's node name
        per_node = "-%n" if several else ""
        self.conf.write_text("\n".join([
            "ClusterName=forgeflow",
            f"SlurmctldHost={host}",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / ('spool' + per_node)}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / f'slurmd{per_node}.pid'}",
            f"SlurmctldLogFile={self.root / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / f'slurmd{per_node}.log'}",
            # linuxproc: no cgroups in containers; it still kills a step's whole process tree.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "ReturnToService=2",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            # SIGTERM to SIGKILL on scancel: the reaper needs a moment to stop torchrun's ranks.
            "KillWait=10",
            "MinJobAge=600",  # finished jobs stay visible to `scontrol show job` (no slurmdbd here)
            "SlurmdTimeout=60",
            "InactiveLimit=0",
            # A partition of a higher PriorityTier preempts jobs of a lower one (the tests' "high"
            # and "low" partitions; the default partitions share one tier: no preemption there).
            # REQUEUE: a preempted job that asked for no requeue (forgeflow's) ends PREEMPTED.
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
            *self._node_lines(node_ports),
            f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
            "",
        ]))
        return self.conf

    def start(self, timeout_s: float = 60.0) -> "LocalSlurm":
        missing = missing_binaries()
        if missing:
            raise SlurmUnavailable(f"missing {missing}: apt-get install -y slurm-wlm munge (as root)")
        if os.geteuid() != 0:
            raise SlurmUnavailable("a local Slurm with SlurmUser=root needs root")
        ensure_munge()
        self.write_conf()
        env = dict(os.environ, **self.env())
        daemons = [("slurmctld", ["-i"])] + ([("slurmd", [])] if self.nodes == 1
                                             else [(f"slurmd-{n}", ["-N", n]) for n in self.node_names])
        for daemon, extra in daemons:
            log = open(self.root / f"{daemon}.console", "ab")
            # -D: stay in the foreground so this object owns the process; -i: ignore stale state.
            args = [_which(daemon.split("-", 1)[0]), "-D", "-f", str(self.conf), *extra]
            self.processes.append(subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL, start_new_session=True))
        try:
            self._wait_idle(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_idle(self, timeout_s: float) -> None:
        env = dict(os.environ, **self.env())
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            for proc in self.processes:
                if proc.poll() is not None:
                    raise SlurmUnavailable(f"{proc.args[0]} exited ({proc.returncode}): "
                                           f"{self.log_tail()}")
            result = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True)
            state = result.stdout.strip()
            states = state.split()
            if result.returncode == 0 and len(states) == self.nodes and all(s.startswith("idle") for s in states):
                return
            time.sleep(0.5)
        raise SlurmUnavailable(f"the Slurm node(s) not idle after {timeout_s:.0f}s (state {state!r}): "
                               f"{self.log_tail()}")

    def log_tail(self) -> str:
        parts = []
        names = ["slurmctld.log", "slurmctld.console"] + (
            ["slurmd.log", "slurmd.console"] if self.nodes == 1
            else [f for n in self.node_names for f in (f"slurmd-{n}.log", f"slurmd-{n}.console")])
        for name in names:
            path = self.root / name
            if path.exists():
                parts.append(f"--- {name}\n" + path.read_text(errors="replace")[-1500:])
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel what is still queued (every user's jobs), then stop the daemons (steps die with
        slurmd's kill)."""
        if self.conf.exists():
            env = dict(os.environ, **self.env())
            queued = subprocess.run(["squeue", "-h", "-o", "%A"], env=env, capture_output=True, text=True)
            jobs = queued.stdout.split() if queued.returncode == 0 else []
            if jobs:
                subprocess.run(["scancel", "--full", *jobs], env=env, capture_output=True)
        for proc in reversed(self.processes):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, 15)
                    proc.wait(timeout=15)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    try:
                        os.killpg(proc.pid, 9)
                    except ProcessLookupError:
                        pass
                    proc.wait()
        self.processes.clear()

    def __enter__(self) -> "LocalSlurm":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = Path(argv[0] if argv else "/tmp/forgeflow-slurm")
    with LocalSlurm(root) as slurm:
        print(f"export SLURM_CONF={slurm.conf}   # node {slurm.node}, partition {PARTITION}", flush=True)
        try:
            while all(p.poll() is None for p in slurm.processes):
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
