"""Straggler detection while training runs: a genuinely slow rank, found by the watcher.

Two local "nodes" of one rank each (LocalLauncher: torchrun under the reaper, as the
pretrain flow launches), the slow_rank fault on rank 1 from step 2 on (it sleeps in
every micro batch's forward pass, inside its compute). Both ranks' step times slow down
together — the gradient all-reduce waits for rank 1 — so the heartbeat's per-rank
compute time is what names it. The report must come while the job still runs, and the
job must finish: a straggler is reported, not failed.
"""

from __future__ import annotations

import os

from infra.launch import LocalLauncher
from infra.watch import watch


def test_a_slow_rank_is_reported_with_its_node_while_training_goes_on(two_node_request):
    request = two_node_request("straggler", 16, "slow_rank@2:1")
    job = LocalLauncher().start(request)
    reported = []

    def on_straggler(straggler):
        reported.append((straggler, job.poll()))

    try:
        outcome = watch(job, request.run_dir, request.world_size, poll_s=0.1,
                        on_straggler=on_straggler)
    finally:
        job.terminate(grace_s=5.0)
    assert outcome.status == "finished", [p.read_text()[-3000:] for p in job.log_paths().values()]
    assert len(reported) == 1
    straggler, codes_then = reported[0]
    assert (straggler.rank, straggler.node) == (1, "node-b") and straggler.host == os.uname().nodename
    assert straggler.ratio > 2.0 and straggler.samples >= 3 and 2 < straggler.step < 16
    assert any(code is None for code in codes_then.values())  # reported while it was running
    assert [s.rank for s in outcome.stragglers] == [1]
