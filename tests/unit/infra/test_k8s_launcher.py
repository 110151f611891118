"""The Kubernetes launcher: chosen by name with the cluster file's `kubernetes:` section, and
driven through the real `kubernetes` client over real HTTP against a small server that
answers the API paths it uses in the API's shapes (tests/unit/infra/k8s_api_server.py; no
cluster is available). Each pod's log lands in the run directory, where diagnosis reads it."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.kubernetes import KubernetesLauncher, KubernetesSettings, object_name
from infra.launch import CHOOSE_ON_NODE_0, LaunchRequest, NodeLaunch, node_log_path
from scheduler.cluster import ClusterError, parse_cluster
from tasks.launchers import make_launcher

from k8s_api_server import KubeApiServer

NODES = [{"name": "gpu", "replicas": 2, "gpu_type": "cpu", "gpu_count": 2, "gpu_memory_gib": 4, "peak_tflops": 0.05}]
SECTION = {"image": "registry.example/forgeflow:1.0", "run_volume_claim": "forgeflow-runs"}
CORPUS = Path(__file__).resolve().parents[2] / "data" / "failures"


def request(run_dir: Path, attempt: int = 1) -> LaunchRequest:
    nodes = [NodeLaunch(node=f"gpu-{i}", address=f"gpu-{i}", node_rank=i, nnodes=2, nproc_per_node=2,
                        cuda_visible_devices="", master_addr="gpu-0", master_port=CHOOSE_ON_NODE_0,
                        first_global_rank=2 * i) for i in range(2)]
    return LaunchRequest("tiny/pretrain", nodes, ["-m", "training.train", "/runs/job.yaml"], run_dir, attempt=attempt)


def test_the_kubernetes_launcher_is_chosen_by_name_from_the_cluster_section():
    cluster = parse_cluster({"nodes": NODES, "kubernetes": {**SECTION, "namespace": "ml"}})
    launcher = make_launcher("kubernetes", grace_s=7.0, cluster=cluster, gpu_type="H100-80G")
    assert isinstance(launcher, KubernetesLauncher)
    assert launcher.settings.namespace == "ml" and launcher.gpu_type == "H100-80G" and launcher.grace_s == 7.0


def test_kubernetes_config_errors_name_the_section_and_the_fix():
    with pytest.raises(ValueError, match=r"'kubernetes:' section.*'image'.*'run_volume_claim'"):
        make_launcher("kubernetes", cluster=parse_cluster({"nodes": NODES}))
    with pytest.raises(ValueError, match="no cluster file given"):
        make_launcher("kubernetes")
    with pytest.raises(ClusterError, match=r"kubernetes\.run_volume_claim"):
        parse_cluster({"nodes": NODES, "kubernetes": {"image": "forgeflow:1"}})
    with pytest.raises(ClusterError, match=r"kubernetes\.imag"):  # did-you-mean names the misspelt key
        parse_cluster({"nodes": NODES, "kubernetes": {**SECTION, "imag": "x"}})
    with pytest.raises(ClusterError, match="both a 'slurm' and a 'kubernetes' section"):
        parse_cluster({"nodes": NODES, "kubernetes": SECTION, "slurm": {"partition": "debug"}})
    with pytest.raises(RuntimeError, match="no usable kubeconfig"):
        settings = KubernetesSettings(**SECTION, kubeconfig="/nonexistent/kubeconfig")
        KubernetesLauncher(settings).start(request(Path("/tmp/unused")))


@pytest.fixture
def kube(tmp_path):
    with KubeApiServer() as server:
        settings = KubernetesSettings(**SECTION, kubeconfig=server.kubeconfig(tmp_path / "kubeconfig"))
        yield server, settings


def test_an_attempt_runs_as_an_indexed_job_and_each_pods_log_reaches_diagnosis(kube, tmp_path):
    from diagnosis.api import diagnose_log

    server, settings = kube
    req = request(tmp_path / "run")
    job = KubernetesLauncher(settings, gpu_type="cpu").start(req)
    job.poll_s = 0.0
    name = object_name(req)
    assert ("forgeflow", name) in server.services and ("forgeflow", name) in server.jobs
    assert job.poll() == {"gpu-0": None, "gpu-1": None}  # pods created, nothing ran yet

    server.run_pod(name, 0, "rank 0 starting\n")
    assert job.poll() == {"gpu-0": None, "gpu-1": None}
    oom = (CORPUS / "oom_plain.log").read_text()
    server.finish_pod(name, 1, 1, oom)
    server.finish_pod(name, 0, 0, "rank 0 starting\nrank 0 done\n")
    assert job.wait(timeout=30) == {"gpu-0": 0, "gpu-1": 1}
    paths = job.log_paths()
    assert paths == {n: node_log_path(req, n) for n in ("gpu-0", "gpu-1")}
    assert paths["gpu-1"].read_text() == oom and "rank 0 done" in paths["gpu-0"].read_text()
    # what diagnose_attempt does with an outcome's log_paths
    found = diagnose_log([paths["gpu-0"], paths["gpu-1"]], state_dir=tmp_path / "state")
    assert found.root_cause == "OutOfMemoryError"

    calls = len(server.requests)
    job.poll()
    assert len(server.requests) == calls + 1  # one list per poll; logs are read once per pod
    job.terminate(grace_s=1)
    assert not server.jobs and not server.services and not server.pods
    job.terminate(grace_s=1)  # already gone: nothing to do, no error


def test_terminating_a_running_attempt_keeps_its_pods_logs(kube, tmp_path):
    server, settings = kube
    req = request(tmp_path / "run", attempt=3)
    job = KubernetesLauncher(settings).start(req)
    name = object_name(req)
    server.run_pod(name, 0, "step 41\nstep 42\n")  # pod 1 still waiting for its container: no log yet
    job.terminate(grace_s=1)
    assert node_log_path(req, "gpu-0").read_text() == "step 41\nstep 42\n"
    assert not node_log_path(req, "gpu-1").exists()
    assert not server.jobs and not server.pods and not server.services


def test_a_second_start_of_the_same_attempt_is_refused_and_leaves_the_first_intact(kube, tmp_path):
    from kubernetes.client import ApiException

    server, settings = kube
    req = request(tmp_path / "run")
    KubernetesLauncher(settings).start(req)
    with pytest.raises(ApiException) as e:
        KubernetesLauncher(settings).start(req)
    assert e.value.status == 409
    # The failed start cleaned up only what it had created... which was nothing: the Service
    # create failed first. The first attempt's objects are still there.
    assert ("forgeflow", object_name(req)) in server.jobs
