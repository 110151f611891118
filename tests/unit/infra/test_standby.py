"""infra.standby: when a standby world is kept, and which launches it can run."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

import infra.standby
from infra.autogroup import autogroup, set_autogroup_nice
from infra.launch import CHOOSE_ON_NODE_0, LaunchRequest, local_node_launches
from infra.standby import WARM_ENV, Standby, can_renice, gate_path, wanted


class _Running:
    """A standby's job whose processes all run (poll: no exit code yet)."""

    def __init__(self, nodes):
        self.nodes, self.request = nodes, None

    def poll(self):
        return {node: None for node in self.nodes}


def _launch(tmp_path: Path, attempt: int = 1, nproc: int = 1, env=None, worker="training.train") -> LaunchRequest:
    nodes = local_node_launches(["node-a", "node-b"], nproc, CHOOSE_ON_NODE_0)
    return LaunchRequest("job", nodes, ["-m", worker, "spec/attempt-%d.json" % attempt, "--config-hash", "abc"],
                         tmp_path, env=dict(env or {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "35"}), attempt=attempt)


def _standby_for(launching: LaunchRequest) -> Standby:
    request = replace(launching, attempt=launching.attempt + 1,
                      env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": launching.env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]})
    request.worker_args = ["-m", "training.standby", str(gate_path(request))]
    return Standby(request, _Running([n.node for n in request.nodes]))


def test_kept_on_the_local_launcher_where_there_are_two_cores_per_rank_unless_asked(monkeypatch):
    monkeypatch.delenv(WARM_ENV, raising=False)  # (tests/conftest.py sets it off for the suite)
    assert wanted("local", world_size=4, cores=8) and not wanted("local", world_size=4, cores=7)
    assert wanted("local", world_size=4, cores=2, asked=True)
    assert not wanted("local", world_size=1, cores=64, asked=False)
    assert not wanted("slurm", world_size=1, cores=64) and not wanted("prefect", world_size=1, cores=64, asked=True)


def test_the_machines_default_decides_where_the_flow_did_not_ask(monkeypatch):
    monkeypatch.setenv(WARM_ENV, "off")
    assert not wanted("local", world_size=1, cores=64) and wanted("local", world_size=1, cores=64, asked=True)
    monkeypatch.setenv(WARM_ENV, "on")
    assert wanted("local", world_size=4, cores=2) and not wanted("local", world_size=4, cores=2, asked=False)
    assert not wanted("slurm", world_size=1, cores=64)  # only the local launcher keeps one
    monkeypatch.setenv(WARM_ENV, "auto")
    assert wanted("local", world_size=1, cores=2) and not wanted("local", world_size=2, cores=3)
    monkeypatch.setenv(WARM_ENV, "yes")
    with pytest.raises(ValueError, match="FORGEFLOW_WARM_STANDBY='yes': give on, off or auto"):
        wanted("local", world_size=1, cores=64)


def test_the_next_attempt_on_the_same_nodes_runs_in_it_with_its_own_arguments_and_drills(tmp_path):
    standby = _standby_for(_launch(tmp_path, attempt=0))
    # the next attempt: another spec file, a drill and the flow run's scope for the ranks
    launch = _launch(tmp_path, attempt=1, env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "35", "FORGEFLOW_FAULT": "oom_kill@9",
                                               "FORGEFLOW_FAULT_SCOPE": "run-1"})
    assert standby.matches(launch) is None
    job = standby.open(launch)
    assert job.request is launch
    gate = json.loads(gate_path(standby.request).read_text())
    assert gate == {"argv": ["spec/attempt-1.json", "--config-hash", "abc"],
                    "env": {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "35", "FORGEFLOW_FAULT": "oom_kill@9",
                            "FORGEFLOW_FAULT_SCOPE": "run-1"}}


def test_a_launch_it_does_not_fit_says_why(tmp_path):
    standby = _standby_for(_launch(tmp_path, attempt=0))
    assert "attempt 1, not 2" in standby.matches(_launch(tmp_path, attempt=2))
    assert standby.matches(_launch(tmp_path, nproc=2)) == "another placement"
    one_node = _launch(tmp_path)
    one_node.nodes = one_node.nodes[:1]
    one_node.nodes[0] = replace(one_node.nodes[0], nnodes=1)
    assert standby.matches(one_node) == "another placement"
    assert standby.matches(_launch(tmp_path, env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "65"})) == "other agent settings"
    assert "another worker" in standby.matches(_launch(tmp_path, worker="evalsuite.trial"))
    assert standby.matches(replace(_launch(tmp_path), run_dir=tmp_path / "other")) == "another run directory"


def test_a_standby_that_cannot_start_costs_the_running_attempt_nothing(tmp_path, monkeypatch):
    from infra.standby import WarmRestarts

    def no_port(*args, **kwargs):
        raise OSError(98, "Address already in use")

    monkeypatch.setattr("infra.standby.LocalLauncher.start", no_port)
    said = []
    warm = WarmRestarts(enabled=True, log=said.append)
    warm.prepare_next(_launch(tmp_path, attempt=0))  # from the watcher's step callback: must not raise
    assert warm.standby is None and not warm.enabled
    assert len(said) == 1 and "Address already in use" in said[0] and "start cold" in said[0]
    warm.prepare_next(_launch(tmp_path, attempt=0))  # said once
    assert len(said) == 1
    started = []
    job, started_warm = warm.launch(_launch(tmp_path, attempt=1), start_cold=lambda r: started.append(r) or "cold")
    assert (job, started_warm) == ("cold", False) and started


def test_the_standby_niceness_is_19_unless_the_environment_gives_another_and_a_bad_one_is_named(monkeypatch):
    from infra.standby import NICE_ENV, standby_nice

    monkeypatch.delenv(NICE_ENV, raising=False)
    assert standby_nice() == 19
    monkeypatch.setenv(NICE_ENV, "0")
    assert standby_nice() == 0
    for bad in ("20", "-1", "low"):
        monkeypatch.setenv(NICE_ENV, bad)
        with pytest.raises(ValueError, match=f"FORGEFLOW_STANDBY_NICE='{bad}': give a niceness from 0"):
            standby_nice()


@pytest.mark.parametrize("flow_group", ["root", "the rank's"])
def test_opening_sets_a_ranks_session_group_back_unless_it_is_the_flows_own(flow_group, monkeypatch):
    # A flow whose session is in the root autogroup (CI's container: its pytest never started a
    # session, and the kernel shows that group as nothing) sets its ranks' groups back too.
    if not can_renice():
        pytest.skip("setting a group back to niceness 0 needs root or an RLIMIT_NICE of 20")
    rank = subprocess.Popen(["sleep", "60"], start_new_session=True)  # as torchrun starts a rank
    try:
        if autogroup(rank.pid) is None:
            pytest.skip("this kernel has no autogroups")
        assert set_autogroup_nice(rank.pid, 19, patience_s=5.0)  # as training.standby sets it
        own = None if flow_group == "root" else autogroup(rank.pid)
        monkeypatch.setattr(infra.standby, "autogroup", lambda pid="self": own if pid == "self" else autogroup(pid))
        infra.standby._give_priority_back({rank.pid})
        assert autogroup(rank.pid)[1] == (0 if flow_group == "root" else 19)
    finally:
        rank.kill()
        rank.wait()
