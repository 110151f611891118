"""Evaluation trials as Kubernetes Jobs (evalsuite.kubernetes_trials), through the real `kubernetes`
client over HTTP against tests/unit/infra/k8s_api_server.py (no cluster, no Kueue available).

There are no kubelets: `Kubelet` below plays one, running each pod's container command here for
real (the trial job's `python -m evalsuite.trial_job run ...` on a tiny local model) and ending
the pod with its exit code and output as its log. The same suite scores the same through Jobs as
with the local executor; with Kueue the Job waits suspended in the evaluation queue until
admitted (waiting, never failed), and an eviction is requeued once; a failed pod is reported
with its log; close() deletes the Jobs not finished. Every manifest is validated by the server
through the client's models (422 otherwise)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from evalsuite.coordinator import Policy
from evalsuite.datasets import DatasetRef
from evalsuite.errors import EvalConfigError, TrialError
from evalsuite.kubernetes_trials import RUN_LABEL, KubernetesSubmitter, trial_job_manifest
from evalsuite.sandbox import Sandbox, SandboxLimits
from evalsuite.trials import ShardSpec, Trial
from infra.kubernetes import KubernetesSettings
from infra.kueue import PRIORITY_LABEL, QUEUE_LABEL, KueueSettings

from k8s_api_server import KubeApiServer
from test_k8s_manifests import validated
from tests.tiny_suite import write_tiny_suite

ROOT = Path(__file__).resolve().parents[3]
H100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
JOBS = ("GET", "/apis/batch/v1/namespaces/forgeflow/jobs")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from testing.tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("k8s-eval-model") / "hf")


@pytest.fixture
def kube(tmp_path, tmp_path_factory):
    """The fake API server and settings whose run volume is this session's temporary folder
    (mounted at the same path here and in the 'pods', as the submitter requires)."""
    with KubeApiServer() as server:
        settings = KubernetesSettings(image="registry.example/forgeflow:1.0", run_volume_claim="forgeflow-runs",
                                      run_mount=str(tmp_path_factory.getbasetemp()), python=sys.executable,
                                      kubeconfig=server.kubeconfig(tmp_path / "kubeconfig"),
                                      node_selector={"pool": "eval"}, gpu_node_labels={"H100-80G": H100})
        yield server, settings


def run_container(server: KubeApiServer, job: str) -> int:
    """What the kubelet does with the Job's pod: run its container's command, log its output."""
    with server.lock:
        pod = server.pod_of(job, 0)
        container = pod["spec"]["containers"][0]
    server.run_pod(job, 0)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOSTNAME": pod["metadata"]["name"],
           "FORGEFLOW_NODE_NAME": "node-1",   # the downward API's spec.nodeName
           **{e["name"]: e["value"] for e in container.get("env", []) if "value" in e}}
    proc = subprocess.run(container["command"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    try:
        server.finish_pod(job, 0, proc.returncode, proc.stdout + proc.stderr)
    except StopIteration:   # the pod was deleted meanwhile
        pass
    return proc.returncode


class Kubelet:
    """Runs every new pod of the server's Jobs (each in its own thread) until stopped."""

    def __init__(self, server: KubeApiServer) -> None:
        self.server, self.seen, self.stopped = server, set(), threading.Event()
        self.threads: list[threading.Thread] = []
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stopped.is_set():
            with self.server.lock:
                new = [(key, p["metadata"]["labels"]["job-name"]) for key, p in self.server.pods.items()
                       if key not in self.seen and p["status"]["phase"] == "Pending"]
                self.seen.update(key for key, _ in new)
            for _, job in new:
                t = threading.Thread(target=run_container, args=(self.server, job), daemon=True)
                t.start()
                self.threads.append(t)
            self.stopped.wait(0.05)

    def __enter__(self) -> "Kubelet":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join()
        for t in self.threads:
            t.join(timeout=300)


def _suite(tiny_model: Path, tmp_path: Path):
    from evalsuite.suite import load_suite

    return load_suite(str(write_tiny_suite(tmp_path / "suite.yaml", tiny_model, "k8s-eval", devices=["cpu", "cpu"])))


def _trial(tiny_model: Path, out: Path, trial_id: str = "t001-capitals-mc", devices=("cpu",)) -> Trial:
    return Trial(trial_id=trial_id, backend="transformers", model_source=str(tiny_model), output_dir=str(out),
                 devices=list(devices), backend_options={"batch_size": 8, "device": "cpu"},
                 shards=[ShardSpec(dataset=DatasetRef(name="capitals-mc", options={"limit": 2}),
                                   shard=0, start=0, stop=2)])


@pytest.mark.slow  # ~30 s on 2 cores: trials scored in Job pods' real commands
def test_trials_run_as_jobs_and_score_like_the_local_executor(kube, tiny_model, tmp_path, monkeypatch):
    from evalsuite.history import RuntimeHistory
    from evalsuite.runner import evaluate

    monkeypatch.setattr("evalsuite.kubernetes_trials.POLL_S", 0.05)

    server, settings = kube
    suite = _suite(tiny_model, tmp_path)
    policy = Policy(preload=False, batch_small=False)   # one trial per dataset: two Jobs
    local = evaluate(str(tiny_model), suite, tmp_path / "local", policy=policy, echo=lambda _: None,
                     history=RuntimeHistory(tmp_path / "local-history.json"))
    with Kubelet(server):
        through = evaluate(str(tiny_model), suite, tmp_path / "k8s", submitter="kubernetes", kubernetes=settings,
                           gpu_type="H100-80G", policy=policy, history=RuntimeHistory(tmp_path / "k8s-history.json"),
                           echo=lambda _: None)

    assert local.failed_datasets == {} and through.failed_datasets == {}
    assert set(through.results) == {"capitals-mc", "perplexity"}
    for name, metrics in local.results.items():
        assert through.results[name] == pytest.approx(metrics, rel=1e-6), name
    work = tmp_path / "k8s" / "kubernetes"
    assert len(through.outcomes) == 2 and len(server.jobs) == 2
    for outcome in through.outcomes:
        name = (work / f"{outcome.trial_id}.k8s-job").read_text()
        assert outcome.result.worker["k8s_job"] == name   # written from inside the 'pod'
        assert outcome.result.worker["k8s_node"] == "node-1"
        job = server.jobs[("forgeflow", name)]
        container = job["spec"]["template"]["spec"]["containers"][0]
        assert container["command"] == [sys.executable, "-m", "evalsuite.trial_job", "run",
                                        str(work / f"{outcome.trial_id}.trial.json"),
                                        str(work / f"{outcome.trial_id}.result.json")]
        assert "nvidia.com/gpu" not in container["resources"]["requests"]   # a CPU slot asks for no GPU...
        assert {"name": "CUDA_VISIBLE_DEVICES", "value": ""} in container["env"]   # ...and sees none
        assert job["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "eval"}   # no GPU type to pin
        assert job["spec"]["backoffLimit"] == 0 and not job["spec"].get("suspend")
        assert job["metadata"]["labels"][RUN_LABEL] == job["spec"]["template"]["metadata"]["labels"][RUN_LABEL]
        assert [c["type"] for c in job["status"]["conditions"]] == ["Complete"]   # finished Jobs are kept
    # All Jobs are read with one list call per poll, never one GET per Job.
    assert server.requests.count(JOBS) >= 2
    assert not [r for r in server.requests if r[0] == "GET" and r[1].startswith(JOBS[1] + "/")]


@pytest.mark.slow  # ~20 s on 2 cores: a trial scored in a Job pod's real command
def test_with_kueue_a_trial_waits_suspended_in_the_evaluation_queue_until_admitted(kube, tiny_model, tmp_path):
    server, settings = kube
    server.add_flavor("cpu-nodes", {"pool": "eval", "cloud.example/capacity": "spot"})
    settings = settings.model_copy(update={"kueue": KueueSettings(
        queue_name="training", priority_class="pretraining", evaluation_queue_name="evaluation",
        evaluation_priority_class="evaluation")})
    said: list[tuple[str, str | None]] = []
    handles = []

    def on_waiting(trial_id: str, why: str | None) -> None:   # Kueue admits once the trial said it waits
        said.append((trial_id, why))
        if why and why.startswith("waiting in Kueue") and len(said) == 1:
            server.admit(handles[0].name, "cpu-nodes")

    submitter = KubernetesSubmitter(tmp_path / "jobs", settings, 1, Sandbox(SandboxLimits()), poll_s=0.05,
                                    on_waiting=on_waiting)
    try:
        with Kubelet(server):
            handles.append(submitter.submit_trial(_trial(tiny_model, tmp_path / "out"), None))
            job = server.jobs[("forgeflow", handles[0].name)]
            assert job["spec"]["suspend"] is True and not server.pods   # queued: no pod runs yet
            assert job["metadata"]["labels"][QUEUE_LABEL] == "evaluation"
            assert job["metadata"]["labels"][PRIORITY_LABEL] == "evaluation"
            workload = server.workload_of(handles[0].name)
            assert workload["spec"]["queueName"] == "evaluation"
            assert workload["spec"]["priorityClassName"] == "evaluation"
            assert submitter.wait_first(handles) is handles[0]
            result = handles[0].result()   # no failure while it waited: it ran once admitted
    finally:
        submitter.close()
    assert result.trial_id == "t001-capitals-mc" and result.worker["k8s_job"] == handles[0].name
    trial_id, why = said[0]
    assert trial_id == "t001-capitals-mc"
    assert why.startswith("waiting in Kueue: couldn't assign flavors to pod set main: insufficient unused quota")
    assert f"workload {workload['metadata']['name']}, queue evaluation" in why
    assert said[-1] == ("t001-capitals-mc", None)   # running, then done: no longer waiting
    assert not server.deletions   # a finished Job is left to its TTL


@pytest.mark.slow  # ~35 s on 2 cores: trials scored in Job pods' real commands
def test_an_evicted_trial_is_requeued_once_and_a_second_eviction_fails_it(kube, tiny_model, tmp_path):
    server, settings = kube
    server.add_flavor("cpu-nodes", {"pool": "eval"})
    settings = settings.model_copy(update={"kueue": KueueSettings(queue_name="evaluation")})
    said: list[str | None] = []
    submitter = KubernetesSubmitter(tmp_path / "jobs", settings, 1, None, poll_s=0.0,
                                    on_waiting=lambda _, why: said.append(why))
    try:
        first = submitter.submit_trial(_trial(tiny_model, tmp_path / "out"), None)
        server.admit(first.name, "cpu-nodes")
        server.run_pod(first.name, 0, "loading\n")
        submitter.refresh(force=True)
        assert first.state == "Started"
        server.evict(first.name, "Preempted")   # Kueue suspends the Job; its pod is deleted
        submitter.refresh(force=True)
        assert not first.final() and first.evictions == 1
        assert said[-1].startswith(f"Kueue preempted workload {server.workload_of(first.name)['metadata']['name']} "
                                   "(Preempted): Preempted to accommodate a workload")
        assert "requeued, waiting for Kueue to admit it again" in said[-1]
        server.admit(first.name, "cpu-nodes")   # re-admitted: a new pod runs the trial
        assert run_container(server, first.name) == 0
        assert submitter.wait_first([first]) is first and first.result().trial_id == "t001-capitals-mc"

        second = submitter.submit_trial(_trial(tiny_model, tmp_path / "out2", trial_id="t002-capitals-mc"), None)
        for _ in range(2):
            server.admit(second.name, "cpu-nodes")
            submitter.refresh(force=True)
            assert second.state == "Started"
            server.evict(second.name, "Preempted")
            submitter.refresh(force=True)
        assert second.final() and second.evictions == 2
        with pytest.raises(TrialError, match=rf"Kubernetes Job {second.name} ended Evicted \(Kueue preempted "
                                             r"workload .*evicted 2 times, the trial is not requeued again"):
            second.result()
        assert ("forgeflow", second.name) not in server.jobs   # Kueue cannot run it behind our back
    finally:
        submitter.close()


def test_a_failed_pod_is_a_trial_error_naming_the_job_and_its_log_tail(kube, tmp_path):
    server, settings = kube
    submitter = KubernetesSubmitter(tmp_path / "jobs", settings, 1, None, poll_s=0.0)
    try:
        handle = submitter.submit_trial(_trial(tmp_path / "no-such-model", tmp_path / "out"), None)
        server.run_pod(handle.name, 0)
        submitter.refresh(force=True)
        assert not handle.final()
        log = "loading\n" * 2000 + "Traceback (most recent call last):\nOSError: no-such-model is no folder\n"
        server.finish_pod(handle.name, 0, 1, log)
        assert submitter.wait_first([handle]) is handle
        with pytest.raises(TrialError) as failed:
            handle.result()
    finally:
        submitter.close()
    message = str(failed.value)
    assert f"Kubernetes Job {handle.name} ended Failed (BackoffLimitExceeded" in message
    assert message.endswith("Traceback (most recent call last):\nOSError: no-such-model is no folder")
    assert len(message) < 3500   # the log's tail, not all of it
    assert handle.log_path.read_text() == log   # the whole log is kept beside the trial
    assert ("forgeflow", handle.name) in server.jobs   # ended: not deleted, left to its TTL


def test_close_deletes_the_jobs_not_finished_and_a_gpu_trial_asks_for_its_gpus(kube, tmp_path):
    server, settings = kube
    submitter = KubernetesSubmitter(tmp_path / "jobs", settings, 1, None, gpu_type="H100-80G", poll_s=0.0)
    done = submitter.submit_trial(_trial(tmp_path / "model", tmp_path / "out", "t001-a"), None)
    gpu = submitter.submit_trial(_trial(tmp_path / "model", tmp_path / "out", "t002-b", ["cuda:2", "cuda:3"]), None)
    cpu = submitter.submit_trial(_trial(tmp_path / "model", tmp_path / "out", "t003-c"), None)
    job = server.jobs[("forgeflow", gpu.name)]
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "2"
    assert job["spec"]["template"]["spec"]["nodeSelector"] == {**H100, "pool": "eval"}   # the planned type
    assert not [e for e in container["env"] if e["name"] == "CUDA_VISIBLE_DEVICES"]   # the device plugin's
    trial_file = Path(container["command"][-2])
    assert Trial.model_validate_json(trial_file.read_text()).devices == ["cuda:0", "cuda:1"]   # as the pod sees them
    server.run_pod(gpu.name, 0)
    server.finish_pod(done.name, 0, 0, "done\n")
    try:
        submitter.refresh(force=True)
        assert done.final() and not gpu.final() and not cpu.final()
    finally:
        deleted = submitter.cancel()
        submitter.close()
    assert sorted(deleted) == sorted([gpu.name, cpu.name])
    assert sorted(n for kind, n, _ in server.deletions if kind == "Job") == sorted([gpu.name, cpu.name])
    assert all(body.get("propagationPolicy") == "Background" for _, _, body in server.deletions)
    assert list(server.jobs) == [("forgeflow", done.name)]   # the finished one stays for its TTL
    assert all(p["metadata"]["labels"]["job-name"] == done.name for p in server.pods.values())
    # the same Job, straight from the manifest function, round-trips through the client's model
    manifest = trial_job_manifest(_trial(tmp_path / "model", tmp_path / "out", "t002-b", ["cuda:2", "cuda:3"]),
                                  gpu.name, settings, trial_file, trial_file.with_name("r.json"), "abc123", "H100-80G")
    assert validated(manifest, "V1Job").spec.template.spec.containers[0].resources.limits["nvidia.com/gpu"] == "2"


def test_paths_the_pods_cannot_see_and_a_missing_cluster_file_are_refused(kube, tmp_path):
    from evalsuite.cli import _kubernetes_settings

    server, settings = kube
    elsewhere = settings.model_copy(update={"run_mount": "/runs"})
    with pytest.raises(EvalConfigError, match=r"trial work folder .* is not under kubernetes.run_mount \(/runs\)"):
        KubernetesSubmitter(tmp_path / "jobs", elsewhere, 1, None)
    submitter = KubernetesSubmitter(tmp_path / "jobs", settings, 1, None)
    try:
        with pytest.raises(EvalConfigError, match=r"model /models/x is not under kubernetes.run_mount"):
            submitter.submit_trial(_trial(Path("/models/x"), tmp_path / "out"), None)
    finally:
        submitter.close()
    assert not server.jobs
    with pytest.raises(EvalConfigError, match=r"--submitter kubernetes needs --cluster FILE"):
        _kubernetes_settings(None)
