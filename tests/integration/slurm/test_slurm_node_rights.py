"""A node check that finds a faulty node on a Slurm site where forgeflow is no Slurm operator:
the real `scontrol` run as an unprivileged user (nobody) is refused, so the flow alerts with the
node and the command an operator should run, never fails, and `--exclude`s the node from the
job's later attempts; where it may drain (root here), it drains."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from infra.launch import CHOOSE_ON_NODE_0, LaunchRequest, NodeLaunch
from infra.notify import Notifier
from infra.slurm import SlurmError, SlurmLauncher, SlurmSettings, excluded_nodes, node_states, resume_node
from tasks.pretrain_tasks import slurm_faulty_nodes


@pytest.fixture
def unprivileged(slurm, monkeypatch):
    """Slurm settings whose `scontrol` is Slurm's own, run as the user nobody (no operator rights)."""
    shared = Path(tempfile.mkdtemp(prefix="forgeflow-slurm-user-"))
    shared.chmod(0o755)
    conf = shared / "slurm.conf"
    shutil.copy(slurm.conf, conf)  # the session's conf sits in a root-only temp dir
    conf.chmod(0o644)
    (shared / "bin").mkdir()
    wrapper = shared / "bin" / "scontrol"
    wrapper.write_text(f'#!/bin/sh\nexec runuser -u nobody -- {shutil.which("scontrol")} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shared / 'bin'}:{os.environ['PATH']}")
    yield SlurmSettings(slurm_conf=str(conf), poll_s=0.5)
    shutil.rmtree(shared, ignore_errors=True)


def _request(node: str, run_dir: Path) -> LaunchRequest:
    spec = NodeLaunch(node=node, address=node, node_rank=0, nnodes=1, nproc_per_node=1, cuda_visible_devices="",
                      master_addr=node, master_port=CHOOSE_ON_NODE_0, first_global_rank=0)
    return LaunchRequest("slurm-exclude", [spec], ["-c", "print('hi')"], run_dir)


def test_without_rights_the_flow_alerts_with_the_operators_command_and_excludes_the_node(
        prefect_api, slurm, unprivileged, tmp_path):
    notifier = Notifier("")  # the console: alerts printed and kept
    alerted = slurm_faulty_nodes([slurm.node], unprivileged, tmp_path / "run", "allgather failed twice",
                                 notifier=notifier)
    assert len(alerted) == 1 and f"scontrol update NodeName={slurm.node} State=DRAIN" in alerted[0]
    assert "forgeflow may not drain" in alerted[0]
    assert node_states()[slurm.node].schedulable  # Slurm refused nobody: the node was not drained
    [delivery] = notifier.sent
    assert delivery.alert.fields["node"] == slurm.node and delivery.alert.fields["operator"] == alerted[0]
    assert excluded_nodes(tmp_path / "run") == [slurm.node]
    # The job's next attempt asks Slurm not to use it: with the one node excluded nothing can run.
    with pytest.raises(SlurmError, match=f"--exclude={slurm.node}"):
        SlurmLauncher(SlurmSettings(slurm_conf=str(slurm.conf))).start(_request(slurm.node, tmp_path / "run"))


def test_with_rights_the_faulty_node_is_drained(prefect_api, slurm, tmp_path):
    notifier = Notifier("")
    try:
        assert slurm_faulty_nodes([slurm.node], SlurmSettings(slurm_conf=str(slurm.conf)), tmp_path / "run",
                                  "allgather failed twice", notifier=notifier) == []
        state = node_states()[slurm.node]
        assert not state.schedulable and "node check" in state.reason and not notifier.sent
    finally:
        resume_node(slurm.node)
