"""The whole pretrain flow run by an unprivileged user on a real two-node local Slurm (issue 32).

The test (root) creates a user, and that user runs the pretrain flow in a process of its own
(`runuser -u USER -- .venv/bin/python ...`): its own state database and run directory, the
session's Prefect test API, alerts to a Slack-compatible receiver, `launcher="slurm"` delegating
to a local Slurm of two nodes on this host (testing.slurm_local, `nodes=2`). So every Slurm
command (sbatch, squeue, scontrol, the node check's jobs) is that user's, and the ranks run as
that user on the nodes.

A CUDA error (a fault drill, on rank 1) points at hardware: the flow runs the node check on both
nodes, which finds one of them faulty (FORGEFLOW_NODECHECK_FAULT makes that node's check rank fail
as a broken interconnect does). The user may not drain it in Slurm: the flow does not crash, an alert
names the node and the `scontrol update NodeName=... State=DRAIN` an operator should run, the node
stays in service in Slurm, and the next attempt's batch job carries `--exclude=<node>`: Slurm runs
it on the other node and the job finishes there from its last checkpoint.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest
import yaml

from tests.integration.slurm.conftest import TINY_JOB

REPO = Path(__file__).resolve().parents[3]
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
PYTHON = VENV_PYTHON if VENV_PYTHON.exists() else Path(sys.executable)
STEPS, FAULT = TINY_JOB["training"]["steps"], "cuda_error@7:1"  # after the checkpoint of step 6

FLOW_SCRIPT = """
import json, sys
from dataclasses import asdict
from flows.pretrain import pretrain

args = json.loads(sys.argv[1])
result = pretrain(args["job"], cluster=args["cluster"], launcher="slurm", drill_faults=args["drills"],
                  backoff_s=0.5, hang_timeout_s=120)
with open(args["out"], "w") as f:
    json.dump(asdict(result), f, default=str)
"""


@pytest.fixture(scope="module")
def two_node_slurm():
    """A local Slurm of two nodes on this host, its files readable by every user (the flow's
    user reads the configuration; the daemons run as root)."""
    from testing.slurm_local import LocalSlurm, SlurmUnavailable, missing_binaries

    if os.geteuid() != 0:
        pytest.skip("a local Slurm (SlurmUser=root, munged) and a new user need root; run `make test` as root")
    if missing_binaries() or not shutil.which("useradd") or not shutil.which("runuser"):
        pytest.skip(f"Slurm or the user tools are not installed ({missing_binaries()} missing): "
                    "apt-get install -y slurm-wlm munge, or run `make test` as root")
    root = Path(tempfile.mkdtemp(prefix="forgeflow-slurm-2n-"))
    root.chmod(0o755)
    local = LocalSlurm(root, nodes=2)
    try:
        local.start()
    except SlurmUnavailable as e:
        shutil.rmtree(root, ignore_errors=True)
        pytest.fail(f"a two-node local Slurm would not start: {e}")
    local.conf.chmod(0o644)
    try:
        yield local
    finally:
        local.stop()
        shutil.rmtree(root, ignore_errors=True)


# --- traverse rights for the new user: the venv's interpreter may live under /root (pyenv) -----

_ACL = "system.posix_acl_access"
_UNDEFINED_ID = 0xFFFFFFFF


def _acl_with_traverse(mode: int, uid: int) -> bytes:
    """A POSIX access ACL (the kernel's xattr form) that keeps `mode` and lets `uid` traverse."""
    group = (mode >> 3) & 7
    entries = [(0x01, (mode >> 6) & 7, _UNDEFINED_ID), (0x02, 1, uid), (0x04, group, _UNDEFINED_ID),
               (0x10, group | 1, _UNDEFINED_ID), (0x20, mode & 7, _UNDEFINED_ID)]
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, ident) for tag, perm, ident in entries)


def _grant_traverse(paths: list[Path], uid: int) -> list[tuple[Path, int]]:
    """Let `uid` traverse every ancestor of `paths` that others may not (an ACL entry for that user
    alone); returns (dir, its mode) for each one changed, for `_revoke`. Skips the test where it
    cannot (no ACL support, or the directory has an ACL already)."""
    changed: list[tuple[Path, int]] = []
    dirs = {parent for path in paths for parent in Path(path).resolve().parents}
    for d in sorted(dirs, key=lambda p: len(p.parts)):
        mode = d.stat().st_mode & 0o7777
        if mode & 0o001:
            continue
        try:
            existing = os.getxattr(d, _ACL)
        except OSError:  # none (ENODATA), or no ACL support: setxattr says which
            existing = b""
        if existing:
            _revoke(changed)
            pytest.skip(f"the flow's user cannot traverse {d} (mode {mode:o}) to the venv's interpreter, "
                        "and it has an ACL already (not changed by a test)")
        try:
            os.setxattr(d, _ACL, _acl_with_traverse(mode, uid))
        except OSError as e:
            _revoke(changed)
            pytest.skip(f"the flow's user cannot traverse {d} (mode {mode:o}) to the venv's interpreter, "
                        f"and an ACL could not be set there: {e}")
        changed.append((d, mode))
    return changed


def _revoke(changed: list[tuple[Path, int]]) -> None:
    for d, mode in reversed(changed):
        try:
            os.removexattr(d, _ACL)
        except OSError:
            pass
        os.chmod(d, mode)  # an ACL's mask showed in the group bits


@pytest.fixture
def flow_user(two_node_slurm):
    """A new unprivileged user (no Slurm operator rights) with a home of its own; removed after,
    its jobs and processes with it."""
    name = f"ffh3-{uuid.uuid4().hex[:8]}"
    base = Path(tempfile.mkdtemp(prefix="forgeflow-user-"))
    base.chmod(0o755)
    home = base / name
    subprocess.run(["useradd", "--no-create-home", "--home-dir", str(home), "--shell", "/usr/sbin/nologin",
                    "--user-group", name], check=True, capture_output=True)
    user = pwd.getpwnam(name)
    changed: list[tuple[Path, int]] = []
    try:
        home.mkdir(mode=0o700)
        os.chown(home, user.pw_uid, user.pw_gid)
        changed = _grant_traverse([Path(os.path.realpath(PYTHON)), PYTHON, REPO], user.pw_uid)
        check = subprocess.run(["runuser", "-u", name, "--", str(PYTHON), "-c", "import flows.pretrain"],
                               cwd=REPO, capture_output=True, text=True, timeout=300, env=_user_env(user, home))
        assert check.returncode == 0, f"user {name} cannot run the venv's Python: {check.stderr[-2000:]}"
        yield user, home
    finally:
        env = {**os.environ, **two_node_slurm.env()}
        subprocess.run(["scancel", "--full", "-u", name], env=env, capture_output=True)
        for proc in psutil.process_iter(["uids"]):  # what the test's user left running (by its uid)
            if proc.info["uids"] and proc.info["uids"].real == user.pw_uid:
                try:
                    proc.kill()
                except psutil.Error:
                    pass
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(
                p.info["uids"] and p.info["uids"].real == user.pw_uid for p in psutil.process_iter(["uids"])):
            time.sleep(0.5)
        _revoke(changed)
        subprocess.run(["userdel", name], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def _user_env(user: pwd.struct_passwd, home: Path) -> dict[str, str]:
    """The test's environment less forgeflow's, Prefect's, Slurm's and Slack's settings (the test
    session's state and Prefect home are root's), with the user's home and temp dir."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("FORGEFLOW_", "PREFECT_", "SLURM_", "SLACK_"))}
    env.update({"HOME": str(home), "USER": user.pw_name, "LOGNAME": user.pw_name,
                "PREFECT_HOME": str(home / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
    return env


def _chown_tree(path: Path, uid: int, gid: int) -> None:
    os.chown(path, uid, gid)
    for folder, dirs, files in os.walk(path):
        for entry in dirs + files:
            os.chown(os.path.join(folder, entry), uid, gid, follow_symlinks=False)


def _scontrol_job(job_id: str, env: dict[str, str]) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True,
                         check=True).stdout
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


def test_an_unprivileged_users_flow_excludes_the_faulty_node_it_may_not_drain_and_finishes(
        prefect_api, two_node_slurm, flow_user, tiny_data_dir):
    from prefect.settings import PREFECT_API_URL

    from infra.runfiles import log_path
    from infra.slurm import SlurmSettings, excluded_nodes, node_states
    from tests.integration.flows.conftest import SlackReceiver
    from tests.tiny_job import write_tiny_job
    from training.runlog import event_steps

    user, home = flow_user
    good, bad = two_node_slurm.node_names  # the node check finds `bad` faulty
    slurm_env = {**os.environ, **two_node_slurm.env()}

    data = home / "data"
    shutil.copytree(tiny_data_dir, data)
    job = write_tiny_job(TINY_JOB, data, home, "slurm-unprivileged")
    run_dir = home / "slurm-unprivileged" / "run"
    cluster = home / "cluster-slurm-2n.yaml"
    cluster.write_text(yaml.safe_dump({
        "name": f"local-slurm-2n-{user.pw_name}",
        "inter_node_bandwidth_gbps": 10,
        "nodes": [{"name": n, "gpu_type": "cpu", "gpu_count": 1, "gpu_memory_gib": 4, "peak_tflops": 0.05,
                   "address": n} for n in two_node_slurm.node_names],
        "slurm": {"partition": "debug", "slurm_conf": str(two_node_slurm.conf), "poll_s": 1.0},
    }, sort_keys=False))
    script = home / "run_flow.py"
    script.write_text(FLOW_SCRIPT)
    result_file = home / "result.json"
    for sub in ("state", "tmp"):
        (home / sub).mkdir()
    _chown_tree(home, user.pw_uid, user.pw_gid)

    slack = SlackReceiver()
    env = _user_env(user, home)
    env.update({
        "TMPDIR": str(home / "tmp"), "PREFECT_API_URL": PREFECT_API_URL.value(),
        "FORGEFLOW_STATE_DIR": str(home / "state"),
        "FORGEFLOW_DB_URL": f"sqlite:///{home / 'state' / 'forgeflow.db'}",
        "SLURM_CONF": str(two_node_slurm.conf),
        "SLACK_WEBHOOK_URL": slack.url,
        # the node check's rank on `bad` fails as a broken interconnect does (infra.nodecheck_worker)
        "FORGEFLOW_NODECHECK_FAULT": f"{bad}=fail",
    })
    args = {"job": str(job), "cluster": str(cluster), "drills": [FAULT], "out": str(result_file)}
    try:
        flow = subprocess.run(["runuser", "-u", user.pw_name, "--", str(PYTHON), str(script), json.dumps(args)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    finally:
        slack.close()
    output = (flow.stdout + flow.stderr)[-6000:]

    # The flow did not crash: it returned, and the job finished on the node left.
    assert flow.returncode == 0 and result_file.exists(), output
    result = json.loads(result_file.read_text())
    assert result["finished"] and result["final_step"] == STEPS, (result, output)
    [failure] = result["failures"]
    assert failure["root_cause"] == "CUDAError" and set(failure["suspect_nodes"]) <= {good, bad}, failure
    assert "node check" in failure["action"] and f"cordoned ['{bad}']" in failure["action"], failure
    first, last = result["placements"][0], result["placements"][-1]
    assert sorted(first["nodes"]) == sorted([good, bad]) and last["nodes"] == [good], result["placements"]
    # on one node, from step 7: rank 0 had completed it when rank 1 failed, and committed it alone
    # before exiting (training.checkpointing: the save after a peer's failure), not the interval's 6
    assert event_steps(log_path(run_dir, 0), "resumed") == [7]

    # An alert names the node and the command an operator should run: the user may not drain it.
    sent = [json.dumps(message) for message in slack.messages]
    operator = [m for m in sent if f"scontrol update NodeName={bad} State=DRAIN" in m]
    assert operator, f"no alert with the operator's command among {len(sent)}: {sent}"
    assert f"forgeflow may not drain {bad}" in operator[0] and f"node {bad} failed the node check" in operator[0]
    # Slurm refused the drain: the node is still in service there.
    assert node_states(SlurmSettings(slurm_conf=str(two_node_slurm.conf)))[bad].schedulable
    assert excluded_nodes(run_dir) == [bad]

    # Each attempt was a batch job of the user's; the next attempt's asked Slurm to keep off the
    # faulty node (--exclude), and Slurm ran it on the other one.
    attempts = sorted((run_dir / "launch").glob("attempt-*/slurm-job-id"))
    assert len(attempts) == 2, attempts
    before, after = (_scontrol_job(p.read_text().strip(), slurm_env) for p in attempts)
    for slurm_job in (before, after):
        assert slurm_job["UserId"].startswith(f"{user.pw_name}("), slurm_job["UserId"]
    assert sorted(before["NodeList"].split(",")) == sorted([good, bad]), before  # ended FAILED or CANCELLED
    assert after["ExcNodeList"] == bad and after["NodeList"] == good and after["JobState"] == "COMPLETED", after
    # The node check's worlds were batch jobs of the user's too, pinned to the nodes they test
    # (--nodelist): the pair, then each node alone.
    checks = [_scontrol_job(p.read_text().strip(), slurm_env)
              for p in sorted((run_dir / "nodecheck").glob("attempt-0/**/slurm-job-id"))]
    assert sorted(c["ReqNodeList"] for c in checks) == sorted([",".join(sorted([good, bad])), good, bad]), checks
    assert all(c["UserId"].startswith(f"{user.pw_name}(") for c in checks), checks
    assert (run_dir / "launch" / "attempt-1" / f"{good}.exit").read_text().strip() == "0"
    assert os.stat(run_dir / "launch" / "attempt-1" / f"{good}.exit").st_uid == user.pw_uid
