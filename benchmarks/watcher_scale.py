"""Prefect API load of the watcher for a 64-node job on the Prefect launcher.

    .venv/bin/python benchmarks/watcher_scale.py [--nodes 64] [--ranks-per-node 8] [--seconds 15]
        [--prefect-home DIR]

A real `prefect server start` (SQLite, its own home: a fresh one, or `--prefect-home`'s, where
the benchmark smoke test passes its session's so that the server skips the database migrations an
earlier smoke ran) holds one RUNNING flow run
per simulated node, as the Prefect launcher's node-launch runs would be; a
thread refreshes a heartbeat file for every rank (64 × 8 = 512), as training
does. `infra.watch.watch` then follows the job exactly as the pretrain flow
does (poll every 0.5 s) for `--seconds`, after which every node "exits 0" and
the job finishes. Every HTTP request the job object sends to the server is
counted (at the client's transport, so nothing is estimated).

Baseline, on the same server, runs and watcher: the reads forgeflow made before
(one `read_flow_run` per node per watcher poll, `PerNodeReads` below, the code
as it was). Fair: same poll interval, same nodes, same window; only how run
states are read differs.

Last line: {"watcher_api_calls_per_s_64_nodes", "watcher_api_calls_per_s_64_nodes_per_node_reads",
"nodes", "ranks", "seconds"} (HEADLINE_KEYS; goal: at most 2 calls/s at 64 nodes). `--smoke`: 4 nodes x
2 ranks watched 1 s each way (the beats given 0.5 s instead of 1.5 s before each watch), on the same
server: seconds, the same keys, not the 64-node figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.headline import checked_headline  # noqa: E402
from testing.prefect_server import LocalPrefectServer, free_port  # noqa: E402

HEADLINE_KEYS = ("watcher_api_calls_per_s_64_nodes", "watcher_api_calls_per_s_64_nodes_per_node_reads",
                 "nodes", "ranks", "seconds")


class Heartbeats(threading.Thread):
    """Every rank beats once a second (what training.runlog.Heartbeat writes)."""

    def __init__(self, run_dir: Path, ranks: int):
        super().__init__(daemon=True)
        self.dir = run_dir / "heartbeat"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ranks = ranks
        self.stop = threading.Event()
        self.step = 0

    def run(self) -> None:
        while not self.stop.is_set():
            self.step += 1
            for rank in range(self.ranks):
                tmp = self.dir / f".rank{rank}.tmp"
                tmp.write_text(json.dumps({"rank": rank, "step": self.step, "time": time.time(), "pid": 0,
                                           "host": "sim", "phase": "train"}))
                os.replace(tmp, self.dir / f"rank{rank}.json")
            self.stop.wait(1.0)


def count_requests():
    """Count every request Prefect's sync HTTP client sends (the watcher's client)."""
    from prefect.client.base import PrefectHttpxSyncClient

    counter = {"n": 0}
    watcher_thread = threading.main_thread()  # the watcher runs here; the finisher thread is not counted
    original = PrefectHttpxSyncClient.send

    def send(self, request, *args, **kwargs):
        if threading.current_thread() is watcher_thread and not str(request.url).endswith(("/health", "/csrf-token")):
            counter["n"] += 1
        return original(self, request, *args, **kwargs)

    PrefectHttpxSyncClient.send = send
    return counter


def measure(job_cls, nodes: int, ranks_per_node: int, seconds: float, workdir: Path, counter,
            settle_s: float = 1.5) -> float:
    from prefect import flow, get_client
    from prefect.states import Completed, Running

    from infra import runfiles
    from infra.launch import LaunchRequest, exit_code_path, local_node_launches
    from infra.watch import watch

    @flow(name="node-launch-sim")
    def node_launch_sim() -> None:  # never run: its runs stand for node-launch runs
        pass

    run_dir = workdir / job_cls.__name__
    names = [f"node-{i:03d}" for i in range(nodes)]
    request = LaunchRequest("watch-sim", local_node_launches(names, ranks_per_node, 29500), ["-c", "pass"], run_dir)
    with get_client(sync_client=True) as client:
        ids = {}
        for name in names:
            run = client.create_flow_run(node_launch_sim, name=f"sim-{name}")
            client.set_flow_run_state(run.id, Running(), force=True)
            ids[name] = run.id
    beats = Heartbeats(run_dir, nodes * ranks_per_node)
    beats.start()
    job = job_cls(request, ids)

    def finish_later() -> None:
        time.sleep(seconds)
        marker = runfiles.finished_marker_path(run_dir)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("{}")  # rank 0 writes it before exiting
        with get_client(sync_client=True) as client:
            for name, run_id in ids.items():
                marker = exit_code_path(request, name)
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.write_text("0")
                client.set_flow_run_state(run_id, Completed(), force=True)

    finisher = threading.Thread(target=finish_later, daemon=True)
    time.sleep(settle_s)  # beats exist before the watch starts
    before = counter["n"]
    started = time.monotonic()
    finisher.start()
    outcome = watch(job, run_dir, nodes * ranks_per_node, hang_timeout_s=120, startup_timeout_s=120, poll_s=0.5)
    elapsed = time.monotonic() - started
    beats.stop.set()
    finisher.join()
    calls = counter["n"] - before  # HTTP requests the watcher's thread sent, including terminate's
    if outcome.status != "finished":
        raise RuntimeError(f"simulated job did not finish cleanly: {outcome.status}, failed {outcome.failed_nodes}, "
                           f"stale ranks {outcome.stale_ranks[:10]}")
    return calls / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--prefect-home", default=None,
                        help="the server's Prefect home (default: a fresh one, whose database it migrates first)")
    parser.add_argument("--smoke", action="store_true", help="4 nodes x 2 ranks for 1 s: seconds, same keys")
    args = parser.parse_args()
    settle_s = 1.5
    if args.smoke:
        args.nodes, args.ranks_per_node, args.seconds, settle_s = 4, 2, 1.0, 0.5

    workdir = Path(tempfile.mkdtemp(prefix="forgeflow-watch-bench-"))
    home = Path(args.prefect_home) if args.prefect_home else workdir / "prefect-home"
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()  # known before the server answers: Prefect reads its settings when first imported
    os.environ.update(PREFECT_API_URL=f"http://127.0.0.1:{port}/api", PREFECT_HOME=str(home),
                      PREFECT_LOGGING_LEVEL="WARNING")
    with ThreadPoolExecutor(1) as starting:  # the server (its own process) comes up while this one imports
        coming_up = starting.submit(LocalPrefectServer, home, ROOT, port)
        try:
            import prefect.client.base  # noqa: F401 - what the watch and count_requests import, meanwhile
            import infra.watch  # noqa: F401
            import tasks.launchers  # noqa: F401
        except BaseException:
            coming_up.result().stop()
            raise
        server = coming_up.result()
    try:
        from tasks.launchers import PrefectJob

        class PerNodeReads(PrefectJob):
            """The watcher's reads before issue 15: one read_flow_run per node, every poll."""

            def _states(self, fresh: bool = False):
                from prefect import get_client

                with get_client(sync_client=True) as client:
                    states = {}
                    for node, run_id in self.flow_run_ids.items():
                        states[node] = client.read_flow_run(run_id).state
                        self.api_calls += 1
                    return states

        counter = count_requests()
        batched = measure(PrefectJob, args.nodes, args.ranks_per_node, args.seconds, workdir, counter, settle_s)
        per_node = measure(PerNodeReads, args.nodes, args.ranks_per_node, args.seconds, workdir, counter, settle_s)
    finally:
        server.stop()
    print(f"{args.nodes} nodes x {args.ranks_per_node} ranks, watched {args.seconds:.0f}s at 0.5 s polls:")
    print(f"  batched reads (now):        {batched:7.2f} Prefect API calls/s")
    print(f"  one read per node (before): {per_node:7.2f} Prefect API calls/s")
    print(json.dumps(checked_headline({
        "watcher_api_calls_per_s_64_nodes": round(batched, 2),
        "watcher_api_calls_per_s_64_nodes_per_node_reads": round(per_node, 2),
        "nodes": args.nodes, "ranks": args.nodes * args.ranks_per_node, "seconds": args.seconds,
    }, HEADLINE_KEYS)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
