"""Suspects of a multi-node failure: each node's log diagnosed as that node's names the node
as the launcher did (not the hostname a log prints), and the rank as the global one."""

from __future__ import annotations

from pathlib import Path

import pytest

from diagnosis.api import diagnose_log
from diagnosis.compressed import LogOrigin
from diagnosis.signals import line_facts

# What torchrun (--tee=3) writes on two one-process nodes when node-b's rank 1 dies of a
# CUDA error (from a real two-node run): node-a's rank 0 then loses its peer.
SUMMARY = """\
Root Cause (first observed failure):
[0]:
  time      : 2026-11-28_19:02:58
  host      : localhost
  rank      : {rank} (local_rank: 0)
  exitcode  : 1 (pid: 7886)
============================================================
"""
NODE_A = """\
[default0]:step=3 loss=6.9012 lr=1.0e-03
[default0]:[rank0]: Traceback (most recent call last):
[default0]:[rank0]:     work.wait()
[default0]:[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] \
Connection closed by peer [127.0.0.1]:27551. This is typically caused by a remote worker crashing.
""" + SUMMARY.format(rank=0)
NODE_B = """\
[default0]:step=3 loss=6.9011 lr=1.0e-03
[default0]:[rank1]: Traceback (most recent call last):
[default0]:[rank1]:     raise error_cls(CUDA_ILLEGAL_ACCESS_MESSAGE)
[default0]:[rank1]: torch.AcceleratorError: CUDA error: an illegal memory access was encountered
""" + SUMMARY.format(rank=1)
# node-b's rank 1 SIGKILLed (the host's OOM killer; benchmarks/recovery.py's oom_kill): no error of
# its own, only torchrun's record of the signal, while node-a's rank 0 loses its peer.
NODE_B_KILLED = """\
[default0]:step=3 loss=6.9011 lr=1.0e-03
[E1128 19:02:58.000000 7880 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: -9) \
local_rank: 0 (pid: 7886) of binary: /usr/bin/python3
Root Cause (first observed failure):
[0]:
  time      : 2026-11-28_19:02:58
  host      : localhost
  rank      : 1 (local_rank: 0)
  exitcode  : -9 (pid: 7886)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 7886
============================================================
"""
# The same failure printed without PyTorch's "[rankN]:" (a worker's own print): only
# torchrun's "[default1]:", the local rank on node-b (whose ranks are 2 and 3).
NODE_B_LOCAL_ONLY = """\
[default0]:step=3 loss=6.9011 lr=1.0e-03
[default1]:RuntimeError: CUDA error: an illegal memory access was encountered
"""


@pytest.fixture
def logs(tmp_path: Path):
    def write(**texts: str) -> list[Path]:
        paths = []
        for node, text in texts.items():
            path = tmp_path / f"node-{node}.attempt-0.out"
            path.write_text(text)
            paths.append(path)
        return paths

    return write


def test_the_suspect_is_the_node_whose_log_holds_the_cause_by_its_inventory_name(logs, tmp_path):
    paths = logs(a=NODE_A, b=NODE_B)
    found = diagnose_log(paths, state_dir=tmp_path / "state",
                         origins=[LogOrigin("node-a", 0), LogOrigin("node-b", 1)])
    assert found.root_cause == "CUDAError"
    assert found.suspect_nodes == ["node-b"]  # not "localhost", the host torchrun's summary prints
    assert found.suspect_ranks == [1]  # PyTorch's [rank1], not torchrun's [default0]
    # Without origins only the hostnames the log prints are known.
    assert diagnose_log(paths, state_dir=tmp_path / "state").suspect_nodes == ["localhost"]


def test_a_killed_rank_explains_its_peers_broken_connections(logs, tmp_path):
    """The peer's "connection closed" is the kill seen from the other side: no interconnect fault
    on node-a, so no node check; a restart in place, the suspect where the kill was logged."""
    from diagnosis.recovery import RecoveryHistory, RecoveryPolicy, FailureRecord, next_attempt

    found = diagnose_log(logs(a=NODE_A, b=NODE_B_KILLED), state_dir=tmp_path / "state",
                         origins=[LogOrigin("node-a", 0), LogOrigin("node-b", 1)])
    assert (found.root_cause, found.rule_name) == ("Unknown", "signal-kill")
    assert found.suspect_nodes == ["node-b"]  # not node-a, whose log holds the broken connection
    assert any("Signal 9 (SIGKILL)" in line or "exitcode" in line for line in found.culprit_lines)
    history = RecoveryHistory(failures=[FailureRecord(found.root_cause, 3)])
    decided = next_attempt(found, 3, history, RecoveryPolicy())
    assert decided.action.value == "restart in place" and not decided.checks_nodes and decided.backoff_s == 0
    # Without the kill the peer's error is all there is: a remote error, the interconnect checked.
    alone = diagnose_log(logs(a=NODE_A), state_dir=tmp_path / "state", origins=[LogOrigin("node-a", 0)])
    assert alone.root_cause == "NCCLRemoteError"
    # An error of its own on the killed node is still the cause (the kill came after it).
    crashed = diagnose_log(logs(a=NODE_A, b=NODE_B + NODE_B_KILLED), state_dir=tmp_path / "state",
                           origins=[LogOrigin("node-a", 0), LogOrigin("node-b", 1)])
    assert crashed.root_cause == "CUDAError"


def test_a_local_rank_becomes_global_through_its_nodes_first_rank(logs, tmp_path):
    paths = logs(a=NODE_A, b=NODE_B_LOCAL_ONLY)
    placed = diagnose_log(paths, state_dir=tmp_path / "state",
                          origins=[LogOrigin("node-a", 0), LogOrigin("node-b", 2)])
    assert placed.suspect_nodes == ["node-b"] and placed.suspect_ranks == [3] and not placed.suspect_local_ranks
    unplaced = diagnose_log(paths, state_dir=tmp_path / "state", origins=[LogOrigin("node-a"), LogOrigin("node-b")])
    assert unplaced.suspect_ranks == [] and unplaced.suspect_local_ranks == {"node-b": [1]}
    # One node's log on its own: its local rank is the rank (a single-node job).
    alone = diagnose_log(paths[1], state_dir=tmp_path / "state")
    assert alone.suspect_ranks == [1] and alone.suspect_local_ranks == {}


def test_a_log_of_no_node_keeps_the_hosts_its_lines_name(logs, tmp_path):
    """A Slurm batch script's output is no node's: its lines name Slurm's nodes themselves."""
    paths = logs(a="[default0]:step=3 loss=6.9 lr=1e-3\n",
                 batch="srun: error: node-c07: task 1: Exited with exit code 1\n"
                       "srun: error: Node failure on node-c07\n")
    found = diagnose_log(paths, state_dir=tmp_path / "state", origins=[LogOrigin("node-a", 0), None])
    assert found.root_cause == "NodeFailure" and found.suspect_nodes == ["node-c07"]


def test_origins_must_match_the_files(logs, tmp_path):
    with pytest.raises(ValueError, match="1 log origin.*2 log file"):
        diagnose_log(logs(a=NODE_A, b=NODE_B), state_dir=tmp_path / "state", origins=[LogOrigin("node-a")])


def test_line_facts_prefer_the_global_rank_after_torchruns_local_one():
    facts = line_facts("[default0]:[rank12]:[E817 17:40:34.227531918 ProcessGroupNCCL.cpp:1515] watchdog")
    assert facts.rank == 12 and facts.local_rank is None
    assert line_facts("[default3]:RuntimeError: boom").rank is None
    assert line_facts("[default3]:RuntimeError: boom").local_rank == 3
    assert line_facts("[rank5]: RuntimeError: boom").rank == 5
    assert line_facts("7: RuntimeError: boom").rank == 7
    # the template is the same as before: only torchrun's prefix is dropped from it
    assert line_facts("[default0]:[rank1]: x 3").template == line_facts("[default2]:[rank4]: x 5").template
