"""A hang found from the ranks' collectives, with its culprit named (issue 33).

Two local "nodes" of one rank each (LocalLauncher: torchrun under the reaper, as the pretrain
flow launches), the hang fault on rank 1 after step 3: rank 1 stops in its own code, rank 0 goes
on into the next step's collective and waits there. The heartbeats of both stop alike; the
where-samples (training.collective_watch) do not: rank 0 is in a collective, rank 1 is not. With
a heartbeat timeout of 300 s (the default) the watcher still calls the hang within its
collective-stall threshold, and the outcome names rank 1 on node-b and the collective rank 0
waits in.
"""

from __future__ import annotations

from infra.launch import LocalLauncher
from infra.watch import watch


def test_a_hung_rank_is_named_with_its_node_and_the_collective_its_peer_waits_in(two_node_request):
    request = two_node_request("hang-culprit", 1000, "hang@3:1")
    job = LocalLauncher(grace_s=2).start(request)
    try:
        outcome = watch(job, request.run_dir, world_size=2, hang_timeout_s=300.0, startup_timeout_s=600.0,
                        collective_stall_s=3.0)
    finally:
        job.terminate(grace_s=2)
    assert outcome.status == "hang", outcome
    stall = outcome.stall
    assert stall is not None, "the hang was found by the heartbeat timeout, not from the collectives"
    assert stall.absent == [1] and stall.nodes == ["node-b"] and stall.waiting == [0], stall
    assert stall.step == 3 and stall.collective, stall
    assert outcome.stale_ranks == [1]
    text = stall.describe()
    assert "rank 1 on node-b" in text and stall.collective in text and "after step 3" in text
