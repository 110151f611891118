"""Kueue on Kubernetes: the Jobs are queued (suspended, labelled with their LocalQueue and
priority class, a topology request where the cluster file asks), the launcher waits for
Kueue's admission, reads the admitted flavor back, and reports a Workload eviction the way
run_attempt turns a Slurm preemption into an "evicted" attempt: the flow then resumes from
the newest committed checkpoint in a new attempt (an interruption, not a failure). Without
Kueue, a Job pins the GPU type its placement was planned for by nodeSelector.

Every manifest goes through the `kubernetes` client's models; the launcher runs through the
real client over HTTP against tests/unit/infra/k8s_api_server.py, which plays Kueue's part
in its v1beta1 shapes (no cluster and no Kueue were available)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from infra.kubernetes import (
    EVICTED_EXIT_CODE,
    KubernetesLauncher,
    KubernetesSettings,
    admission_path,
    evaluation_job_manifest,
    object_name,
    pytorch_job_manifest,
    training_job_manifest,
)
from infra.kueue import PRIORITY_LABEL, QUEUE_LABEL, KueueSettings
from infra.launch import CHOOSE_ON_NODE_0, LaunchRequest, NodeLaunch, node_log_path
from infra.launch import wait_until_started
from infra.watch import watch
from scheduler.cluster import ClusterError, parse_cluster

from k8s_api_server import KubeApiServer
from test_k8s_manifests import validated

NODES = [{"name": "gpu", "replicas": 2, "gpu_type": "H100-80G", "gpu_count": 2, "gpu_memory_gib": 80,
          "peak_tflops": 989}]
SECTION = {"image": "registry.example/forgeflow:1.0", "run_volume_claim": "forgeflow-runs"}
H100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
KUEUE = {"queue_name": "training", "priority_class": "pretraining",
         "topology_level": "cloud.provider.com/topology-block"}


def request(run_dir: Path, attempt: int = 1) -> LaunchRequest:
    nodes = [NodeLaunch(node=f"gpu-{i}", address=f"gpu-{i}", node_rank=i, nnodes=2, nproc_per_node=2,
                        cuda_visible_devices="", master_addr="gpu-0", master_port=CHOOSE_ON_NODE_0,
                        first_global_rank=2 * i) for i in range(2)]
    return LaunchRequest("tiny/pretrain", nodes, ["-m", "training.train", "/runs/job.yaml"], run_dir, attempt=attempt)


# --- manifests ------------------------------------------------------------------------


def test_without_kueue_the_job_pins_the_planned_gpu_type_and_starts_at_once(tmp_path):
    settings = KubernetesSettings(**SECTION)
    job = validated(training_job_manifest(request(tmp_path), settings, gpu_type="H100-80G"), "V1Job")
    assert job.spec.template.spec.node_selector == {"forgeflow.io/gpu-type": "H100-80G"}
    assert not job.spec.suspend and QUEUE_LABEL not in job.metadata.labels
    mapped = KubernetesSettings(**SECTION, gpu_node_labels={"H100-80G": H100}, node_selector={"pool": "training"})
    job = validated(training_job_manifest(request(tmp_path), mapped, gpu_type="H100-80G"), "V1Job")
    assert job.spec.template.spec.node_selector == {**H100, "pool": "training"}
    evaluation = validated(evaluation_job_manifest("eval humaneval", ["forgeflow", "eval"], mapped,
                                                   gpu_type="H100-80G"), "V1Job")
    assert evaluation.spec.template.spec.node_selector == {**H100, "pool": "training"}
    cpu = validated(training_job_manifest(request(tmp_path), settings, gpu_type="cpu"), "V1Job")
    assert cpu.spec.template.spec.node_selector is None  # nothing to pin
    with pytest.raises(ValueError, match=r"GPU type 'H100 80G'.*kubernetes\.gpu_node_labels"):
        training_job_manifest(request(tmp_path), settings, gpu_type="H100 80G")


def test_with_kueue_the_jobs_are_queued_suspended_with_priority_and_topology(tmp_path):
    settings = KubernetesSettings(**SECTION, gpu_node_labels={"H100-80G": H100},
                                  kueue=KueueSettings(**KUEUE, evaluation_queue_name="evaluation",
                                                      evaluation_priority_class="evaluation"))
    job = validated(training_job_manifest(request(tmp_path), settings, gpu_type="H100-80G"), "V1Job")
    assert job.spec.suspend is True
    assert job.metadata.labels[QUEUE_LABEL] == "training" and job.metadata.labels[PRIORITY_LABEL] == "pretraining"
    assert job.spec.template.metadata.annotations == {
        "kueue.x-k8s.io/podset-required-topology": "cloud.provider.com/topology-block"}
    assert job.spec.template.spec.node_selector == H100  # pinned: Kueue admits it only into an H100 flavor

    evaluation = validated(evaluation_job_manifest("eval humaneval", ["forgeflow", "eval"], settings, gpus=1,
                                                   gpu_type="H100-80G"), "V1Job")
    assert evaluation.spec.suspend is True
    assert evaluation.metadata.labels[QUEUE_LABEL] == "evaluation"
    assert evaluation.metadata.labels[PRIORITY_LABEL] == "evaluation"
    assert not evaluation.spec.template.metadata.annotations  # one pod: no topology request

    manifest = pytorch_job_manifest(request(tmp_path), settings, gpu_type="H100-80G")
    assert manifest["spec"]["runPolicy"]["suspend"] is True
    assert manifest["metadata"]["labels"][QUEUE_LABEL] == "training"
    for spec in manifest["spec"]["pytorchReplicaSpecs"].values():
        template = validated(spec["template"], "V1PodTemplateSpec")
        assert template.metadata.annotations["kueue.x-k8s.io/podset-required-topology"]

    chooses = KubernetesSettings(**SECTION, gpu_node_labels={"H100-80G": H100},
                                 kueue=KueueSettings(queue_name="training", topology_level="rack",
                                                     topology="preferred", pin_gpu_type=False))
    job = validated(training_job_manifest(request(tmp_path), chooses, gpu_type="H100-80G"), "V1Job")
    assert job.spec.template.spec.node_selector is None  # Kueue chooses the flavor; it is read back
    assert PRIORITY_LABEL not in job.metadata.labels
    assert job.spec.template.metadata.annotations == {"kueue.x-k8s.io/podset-preferred-topology": "rack"}


@pytest.mark.parametrize("kueue, match", [
    ({"queue_name": "Training Queue"}, r"kubernetes\.kueue\.queue_name.*no LocalQueue name"),
    ({"queue_name": "q", "priority_class": "High_Priority"},
     r"kubernetes\.kueue\.priority_class.*no WorkloadPriorityClass name"),
    ({"queue_name": "q", "topology_level": "Cloud.Example/block"}, r"kubernetes\.kueue\.topology_level.*prefix"),
    ({"queue_name": "q", "topology_level": "a/b/"}, r"kubernetes\.kueue\.topology_level"),
    ({"queue_name": "q", "topology": "strict"}, r"kubernetes\.kueue\.topology"),
    ({"queue": "q"}, r"kubernetes\.kueue\.queue"),
    ({}, r"kubernetes\.kueue\.queue_name"),
])
def test_bad_kueue_settings_are_refused_with_the_key_and_the_rule(kueue, match):
    with pytest.raises(ClusterError, match=match):
        parse_cluster({"nodes": NODES, "kubernetes": {**SECTION, "kueue": kueue}})


def test_bad_gpu_pins_are_refused():
    with pytest.raises(ClusterError, match=r"gpu_node_labels.*H100-80G.*no label value"):
        parse_cluster({"nodes": NODES, "kubernetes": {**SECTION, "gpu_node_labels": {"H100-80G": {"gpu": "H 100"}}}})
    with pytest.raises(ClusterError, match=r"gpu_type_label"):
        parse_cluster({"nodes": NODES, "kubernetes": {**SECTION, "gpu_type_label": "gpu type"}})
    with pytest.raises(ClusterError, match=r"disagree on \['nvidia.com/gpu.product'\]"):
        parse_cluster({"nodes": NODES, "kubernetes": {**SECTION, "gpu_node_labels": {"H100-80G": H100},
                                                      "node_selector": {"nvidia.com/gpu.product": "A100"}}})
    cluster = parse_cluster({"nodes": NODES, "kubernetes": {**SECTION, "kueue": KUEUE}})
    assert cluster.kubernetes.kueue.queue_name == "training" and cluster.kubernetes.kueue.topology == "required"


# --- the launcher against Kueue -------------------------------------------------------


@pytest.fixture
def kube(tmp_path):
    with KubeApiServer() as server:
        server.add_flavor("h100-spot", {**H100, "cloud.example/capacity": "spot"})
        settings = KubernetesSettings(**SECTION, kubeconfig=server.kubeconfig(tmp_path / "kubeconfig"),
                                      gpu_node_labels={"H100-80G": H100}, kueue=KueueSettings(**KUEUE))
        yield server, settings


def run_until_evicted_or_done(job, req: LaunchRequest):
    """What run_attempt does with a started job: watch it, and an attempt the batch system
    ended is "evicted" (tasks/pretrain_tasks.py)."""
    outcome = watch(job, req.run_dir, req.world_size, poll_s=0.05, failure_grace_s=0.5, startup_timeout_s=5.0)
    ended_by = job.ended_by_batch_system() if outcome.status in ("failed", "hang") else None
    if ended_by:
        outcome = replace(outcome, status="evicted", evicted=ended_by, failed_nodes=[])
    return outcome


def test_the_launcher_waits_for_admission_reads_the_flavor_and_resumes_after_an_eviction(kube, tmp_path):
    server, settings = kube
    run_dir = tmp_path / "run"
    req = request(run_dir)
    job = KubernetesLauncher(settings, gpu_type="H100-80G").start(req)
    job.poll_s = 0.0
    name = object_name(req)
    assert server.jobs[("forgeflow", name)]["spec"]["suspend"] is True and not server.pods
    workload = server.workload_of(name)
    assert workload["spec"]["queueName"] == "training" and workload["spec"]["priorityClassName"] == "pretraining"
    assert workload["spec"]["podSets"][0]["topologyRequest"] == {"required": "cloud.provider.com/topology-block"}
    assert job.poll() == {"gpu-0": None, "gpu-1": None}  # queued: no pods, nothing ended

    said: list[str | None] = []

    def on_waiting(reason):  # Kueue admits the Workload once the launcher has said it waits
        said.append(reason)
        if reason is not None and len(said) == 1:
            server.admit(name, "h100-spot")

    assert wait_until_started(job, on_waiting=on_waiting, poll_s=0.01) is None
    assert said[-1] is None and len(said) == 2
    assert said[0].startswith("waiting in Kueue: couldn't assign flavors to pod set main: insufficient unused "
                              "quota for nvidia.com/gpu") and f"workload {workload['metadata']['name']}" in said[0]
    assert job.admission.flavors == {"cpu": "h100-spot", "memory": "h100-spot", "nvidia.com/gpu": "h100-spot"}
    assert job.admission.gpu_type == "H100-80G" and job.admission.cluster_queue == "cluster-queue"
    assert job.admission.node_labels == {**H100, "cloud.example/capacity": "spot"}
    assert job.admission.topology["levels"] == ["cloud.provider.com/topology-block"]
    record = json.loads(admission_path(req).read_text())
    assert record["gpu_type"] == record["planned_gpu_type"] == "H100-80G" and record["flavors"]["nvidia.com/gpu"]
    pod = server.pod_of(name, 0)
    assert pod["spec"]["nodeSelector"] == {**H100, "cloud.example/capacity": "spot"}  # what runs

    server.run_pod(name, 0, "step 40\n")
    server.run_pod(name, 1, "step 40\n")
    assert job.poll() == {"gpu-0": None, "gpu-1": None}
    # A higher-priority workload preempts this one: Kueue suspends the Job, whose pods get SIGTERM.
    server.evict(name, "Preempted", delete_pods=False)
    assert job.poll() == {"gpu-0": None, "gpu-1": None}  # still stopping: the ranks commit first
    server.finish_pod(name, 0, 143, "step 40\ncommitted step 40 on SIGTERM\n")
    assert job.poll() == {"gpu-0": 143, "gpu-1": None}
    server.delete_pods(name)  # pod 1 went without a word (its grace ran out)
    assert job.poll() == {"gpu-0": 143, "gpu-1": EVICTED_EXIT_CODE}
    try:
        outcome = run_until_evicted_or_done(job, req)
    finally:
        job.terminate(grace_s=1)
    assert outcome.status == "evicted" and outcome.failed_nodes == []
    assert outcome.evicted.startswith(f"Kueue preempted workload {workload['metadata']['name']} (Preempted): "
                                      "Preempted to accommodate a workload")
    assert "committed step 40" in node_log_path(req, "gpu-0").read_text()
    assert not server.jobs and not server.workloads and not server.pods  # the Workload went with the Job

    # The flow's next attempt (resume_from None: the newest committed checkpoint) queues again.
    again = request(run_dir, attempt=2)
    job = KubernetesLauncher(settings, gpu_type="H100-80G").start(again)
    job.poll_s = 0.0
    second = object_name(again)
    assert job.waiting().startswith("waiting in Kueue:")
    server.admit(second, "h100-spot")
    assert job.waiting() is None and job.admission.gpu_type == "H100-80G"
    assert "--node-rank=$(JOB_COMPLETION_INDEX)" in server.pod_of(second, 1)["spec"]["containers"][0]["command"]
    server.finish_pod(second, 0, 0, "resumed from step 40\ndone\n")
    server.finish_pod(second, 1, 0, "resumed from step 40\ndone\n")
    assert job.wait(timeout=30) == {"gpu-0": 0, "gpu-1": 0}
    assert job.ended_by_batch_system() is None  # finished, not evicted
    job.terminate(grace_s=1)
    assert not server.jobs and not server.workloads


def test_a_deactivated_workload_ends_the_attempt_and_flavors_are_read_from_the_job_without_that_right(tmp_path):
    with KubeApiServer(flavors_readable=False) as server:
        server.add_flavor("a100", {"forgeflow.io/gpu-type": "A100-80G"})
        settings = KubernetesSettings(**SECTION, kubeconfig=server.kubeconfig(tmp_path / "kubeconfig"),
                                      kueue=KueueSettings(queue_name="training", pin_gpu_type=False))
        req = request(tmp_path / "run")
        job = KubernetesLauncher(settings, gpu_type="H100-80G").start(req)
        job.poll_s = 0.0
        name = object_name(req)
        server.admit(name, "a100")
        assert job.waiting() is None
        # 403 on ResourceFlavors: the node labels Kueue put into the Job's pod template
        assert job.admission.node_labels == {"forgeflow.io/gpu-type": "A100-80G"}
        assert job.admission.gpu_type == "A100-80G"  # Kueue chose another type than planned: recorded
        assert json.loads(admission_path(req).read_text())["planned_gpu_type"] == "H100-80G"
        server.evict(name, "InactiveWorkload")
        try:
            outcome = run_until_evicted_or_done(job, req)
        finally:
            job.terminate(grace_s=1)
        assert outcome.status == "evicted"
        assert outcome.evicted.startswith("Kueue deactivated workload job-") and "(InactiveWorkload)" in outcome.evicted


def test_an_eviction_seen_only_when_the_attempt_is_stopped_still_counts(kube, tmp_path):
    server, settings = kube
    req = request(tmp_path / "run")
    job = KubernetesLauncher(settings, gpu_type="H100-80G").start(req)
    name = object_name(req)
    server.admit(name, "h100-spot")
    assert job.waiting() is None
    server.evict(name, "PodsReadyTimeout", "Exceeded the PodsReady timeout default/job", delete_pods=False)
    job.terminate(grace_s=1)  # the Workload is read before it goes with the Job
    assert job.ended_by_batch_system() == (f"Kueue evicted workload {job.admission.workload} (PodsReadyTimeout): "
                                    "Exceeded the PodsReady timeout default/job")


def test_without_kueue_installed_the_wait_fails_with_the_fix(tmp_path):
    with KubeApiServer(kueue=False) as server:
        settings = KubernetesSettings(**SECTION, kubeconfig=server.kubeconfig(tmp_path / "kubeconfig"),
                                      kueue=KueueSettings(queue_name="training"))
        job = KubernetesLauncher(settings, gpu_type="cpu").start(request(tmp_path / "run"))
        try:
            with pytest.raises(RuntimeError, match=r"no kueue\.x-k8s\.io/v1beta1 workloads: install Kueue"):
                job.waiting()
        finally:
            job.terminate(grace_s=1)
        # the same server without a queue label: the Job is not suspended and its pods start
        plain = KubernetesSettings(**SECTION, kubeconfig=server.kubeconfig(tmp_path / "kubeconfig"))
        job = KubernetesLauncher(plain, gpu_type="cpu").start(request(tmp_path / "run", attempt=2))
        assert job.waiting() is None and len(server.pods) == 2
        job.terminate(grace_s=1)
