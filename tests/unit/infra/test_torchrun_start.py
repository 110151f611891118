"""Which torchrun command lines infra.torchrun starts by forking its ranks (infra/torchrun.py)."""

from __future__ import annotations

import pytest

from infra.torchrun import forks_ranks, rank_start

STATIC = ["--nnodes=2", "--node-rank=1", "--nproc-per-node=4", "--master-addr=10.0.0.1", "--master-port=29500"]


def _forks(argv: list[str], environ: dict[str, str] | None = None) -> bool:
    from torch.distributed.run import parse_args

    return forks_ranks(parse_args(argv), environ or {})


def test_a_launchers_world_forks_and_anything_else_runs_as_torchrun_does():
    assert _forks([*STATIC, "-m", "training.train", "job.yaml", "--set", "a=1"])  # infra.launch.torchrun_command's shape
    assert not _forks([*STATIC, "train.py", "job.yaml"])  # a script
    # torchrun's own rendezvous: --standalone (forgeflow train, the offload workers), c10d, one node
    assert _forks(["--standalone", "--nproc-per-node=2", "-m", "training.train", "job.yaml"])
    assert _forks(["--nnodes=1:2", "--nproc-per-node=4", "--rdzv-backend=c10d", "--rdzv-endpoint=h:29400",
                   "-m", "training.train"])
    assert _forks(["--nproc-per-node=2", "-m", "training.train"])  # one static node, no port: c10d on localhost
    assert not _forks(["--standalone", "--nproc-per-node=2", "train.py", "job.yaml"])
    assert not _forks(["--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=etcd", "--rdzv-endpoint=h:2379",
                       "-m", "training.train"])
    assert not _forks(["--nnodes=1", "--nproc-per-node=gpu", "--master-addr=h", "--master-port=1", "-m", "m"])
    assert not _forks([*STATIC, "--no-python", "--", "./worker"])
    assert not _forks([*STATIC, "-m", "training.train"], {"FORGEFLOW_RANK_START": "exec"})


def test_the_rank_start_is_fork_unless_the_machine_says_exec():
    assert rank_start({}) == "fork" and rank_start({"FORGEFLOW_RANK_START": " Exec "}) == "exec"
    with pytest.raises(ValueError, match=r"FORGEFLOW_RANK_START='spawn': give fork .* or exec"):
        rank_start({"FORGEFLOW_RANK_START": "spawn"})


def test_the_rendezvous_is_the_one_torchrun_would_set():
    from torch.distributed.run import parse_args

    from infra.torchrun import _rendezvous_as_torchrun_sets_it

    def rendezvous(argv):
        args = parse_args([*argv, "-m", "training.train"])
        _rendezvous_as_torchrun_sets_it(args)
        return args.rdzv_backend, args.rdzv_endpoint, args.master_port

    assert rendezvous(["--standalone", "--nproc-per-node=2"]) == ("c10d", "localhost:0", 29500)
    assert rendezvous(["--nproc-per-node=2"]) == ("c10d", "localhost:0", 29500)
    assert rendezvous(STATIC) == ("static", "", 29500)
    assert rendezvous(["--nnodes=2", "--nproc-per-node=1", "--master-addr=h"]) == ("static", "", 29500)
    standalone = parse_args(["--standalone", "--nproc-per-node=2", "-m", "m"])
    again = parse_args(["--standalone", "--nproc-per-node=2", "-m", "m"])
    _rendezvous_as_torchrun_sets_it(standalone)
    _rendezvous_as_torchrun_sets_it(again)
    assert standalone.rdzv_id != again.rdzv_id  # a fresh id per launch, as torchrun's uuid4
