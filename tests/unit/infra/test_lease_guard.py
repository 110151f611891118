"""The node-side lease guard (infra.lease_guard): only a confirmed "gone" stops the ranks, and
the lease file is judged on the node's own clock."""

from __future__ import annotations

import pytest

from infra.lease_guard import (HELD, LeaseFile, LeaseFileRenewer, LeaseGuard, LeaseLook, judge_lease_file,
                               lease_file_path)


def test_a_lease_file_is_gone_when_stale_or_released_and_unknown_when_unreadable():
    record = {"state": "held", "renewal": 4, "valid_s": 30.0, "holder": "flowhost:123"}
    assert judge_lease_file(record, unchanged_s=29.0) == LeaseLook(True, runs_out_in_s=1.0)
    stale = judge_lease_file(record, unchanged_s=30.0)
    assert stale.held is False and "stopped renewing" in stale.why and "flowhost:123" in stale.why
    released = judge_lease_file({**record, "state": "released", "why": "cancelled"}, unchanged_s=0.0)
    assert released.held is False and "cancelled" in released.why
    assert judge_lease_file(None, unchanged_s=1e9).held is None  # cannot tell: never a stop


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_staleness_is_timed_on_the_readers_clock_from_each_renewal_it_sees(tmp_path):
    path = lease_file_path(tmp_path / "run", 3)
    assert path == tmp_path / "run" / "launch" / "attempt-3" / "lease.json"
    renewer = LeaseFileRenewer(path, valid_s=10.0, every_s=0.0)
    clock = Clock()
    reader = LeaseFile(path, clock=clock)
    assert reader.look().held is None  # not written yet
    renewer.renew()
    clock.t += 9
    assert reader.look().held is True  # first seen now: a full period from here
    clock.t += 9
    assert reader.look().held is True
    renewer.renew()  # a renewal resets the count
    clock.t += 1
    assert reader.look().held is True
    clock.t += 9.5
    assert reader.look().held is True
    clock.t += 0.5
    assert reader.look().held is False  # 10 s without a renewal: the holder is gone
    path.write_text("{not json")  # unreadable: unknown, whatever the time
    clock.t += 100
    assert reader.look().held is None
    renewer.release("the flow stopped the attempt")
    assert reader.look().held is False


def test_the_renewer_writes_at_most_every_period(tmp_path):
    renewer = LeaseFileRenewer(tmp_path / "lease.json", valid_s=30.0, every_s=60.0)
    renewer.renew()
    renewer.renew()
    assert renewer.renewals == 1 and LeaseFile(tmp_path / "lease.json").read()["renewal"] == 1


@pytest.mark.parametrize("looks, stopped", [
    ([LeaseLook(None, "database down")] * 5, None),  # an outage never stops the ranks
    ([RuntimeError("connection refused")] * 3, None),  # nor does a look that raises
    ([HELD, LeaseLook(None, "down"), LeaseLook(False, "lease ran out"), LeaseLook(False, "again")], "lease ran out"),
])
def test_only_a_confirmed_gone_stops_and_only_once(looks, stopped):
    calls: list[str] = []
    pending = list(looks)

    def look():
        seen = pending.pop(0)
        if isinstance(seen, Exception):
            raise seen
        return seen

    guard = LeaseGuard(look, every_s=1.0, on_gone=calls.append)
    for _ in looks:
        guard.check_once()
    assert guard.gone_because == stopped and calls == ([stopped] if stopped else [])
    assert guard.unknown_looks == sum(1 for seen in looks if isinstance(seen, Exception) or seen.held is None)


def test_slurm_and_kubernetes_nodes_run_torchrun_under_the_reaper_with_the_attempts_lease_file(tmp_path):
    from infra.kubernetes import KubernetesSettings, training_job_manifest
    from infra.launch import LaunchRequest, local_node_launches, node_command

    request = LaunchRequest("job", local_node_launches(["n0"], 1, 0), ["-m", "training.train", "job.yaml"],
                            tmp_path / "run", attempt=2)
    lease = f"--lease-file={tmp_path / 'run' / 'launch' / 'attempt-2' / 'lease.json'}"
    command = node_command(request.nodes[0], request, 5.0, lease_file_path(request.run_dir, 2))  # infra.slurm.run_node's
    assert command[1:4] == ["-m", "infra.reaper", "--grace=5.0"] and lease in command
    assert command.index(lease) < command.index("--")  # the reaper's option, not torchrun's
    settings = KubernetesSettings(image="forgeflow:1", run_volume_claim="runs")
    (container,) = training_job_manifest(request, settings, grace_s=5.0)["spec"]["template"]["spec"]["containers"]
    assert container["command"][:3] == ["python", "-m", "infra.reaper"] and lease in container["command"]
    assert "infra.torchrun" in container["command"][container["command"].index("--"):]
