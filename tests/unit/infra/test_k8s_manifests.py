"""Every Kubernetes object forgeflow generates is valid against the API schema: it
round-trips through the `kubernetes` client's model of its kind without losing or
changing a field (a misspelt or misplaced field would be dropped; a missing required
field or a wrong type raises). No cluster is needed, none was available."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.kubernetes import (
    GPU_RESOURCE,
    KubernetesSettings,
    evaluation_job_manifest,
    headless_service_manifest,
    object_name,
    pytorch_job_manifest,
    training_job_manifest,
)
from infra.launch import CHOOSE_ON_NODE_0, LaunchRequest, NodeLaunch

SETTINGS = KubernetesSettings(image="registry.example/forgeflow:1.0", run_volume_claim="forgeflow-runs",
                              node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                              tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}])


def validated(manifest: dict, model: str) -> object:
    from kubernetes.client import ApiClient

    api = ApiClient()
    obj = api._ApiClient__deserialize(manifest, model)
    assert api.sanitize_for_serialization(obj) == manifest, f"{model}: fields lost or changed in the round trip"
    return obj


def two_node_request(tmp_path: Path) -> LaunchRequest:
    nodes = [NodeLaunch(node=f"gpu-{i}", address=f"gpu-{i}", node_rank=i, nnodes=2, nproc_per_node=8,
                        cuda_visible_devices="0,1,2,3,4,5,6,7", master_addr="gpu-0", master_port=CHOOSE_ON_NODE_0,
                        first_global_rank=8 * i) for i in range(2)]
    return LaunchRequest("Llama 7B/pretrain", nodes, ["-m", "training.train", "/runs/job.yaml"], tmp_path,
                         env={"FORGEFLOW_FAULT": ""}, attempt=2)


def test_two_node_gpu_training_job_and_its_headless_service(tmp_path):
    request = two_node_request(tmp_path)
    name = object_name(request)
    assert name == "llama-7b-pretrain-a2"
    service = validated(headless_service_manifest(request, SETTINGS), "V1Service")
    assert service.spec.cluster_ip == "None" and service.spec.selector == {"job-name": name}

    job = validated(training_job_manifest(request, SETTINGS, gpu_type="H100-80G"), "V1Job")
    assert job.spec.completion_mode == "Indexed" and job.spec.completions == job.spec.parallelism == 2
    assert job.spec.backoff_limit == 0
    pod = job.spec.template.spec
    assert pod.subdomain == name and pod.restart_policy == "Never"
    container = pod.containers[0]
    assert container.resources.limits[GPU_RESOURCE] == "8" and container.resources.requests[GPU_RESOURCE] == "8"
    assert "--node-rank=$(JOB_COMPLETION_INDEX)" in container.command
    assert f"--master-addr={name}-0.{name}" in container.command  # pod 0 under the headless service
    shm = next(v for v in pod.volumes if v.name == "dshm")
    assert shm.empty_dir.medium == "Memory"
    assert any(m.mount_path == "/dev/shm" for m in container.volume_mounts)
    assert container.env_from[0].secret_ref.name == "forgeflow-s3"
    assert pod.tolerations[0].key == "nvidia.com/gpu" and pod.node_selector


def test_pytorchjob_pod_templates_are_valid(tmp_path):
    manifest = pytorch_job_manifest(two_node_request(tmp_path), SETTINGS, gpu_type="H100-80G")
    assert manifest["kind"] == "PyTorchJob" and manifest["apiVersion"] == "kubeflow.org/v1"
    replicas = manifest["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 1
    for spec in replicas.values():  # the CRD embeds core PodTemplateSpecs
        template = validated(spec["template"], "V1PodTemplateSpec")
        assert "--node-rank=$(RANK)" in template.spec.containers[0].command
    validated(manifest["metadata"], "V1ObjectMeta")


def test_evaluation_job_has_gpu_memory_backed_shm_and_s3_secret():
    job = validated(evaluation_job_manifest("eval step-00000100 humaneval", ["forgeflow", "eval", "run"],
                                            SETTINGS, gpus=1, env={"HF_HUB_OFFLINE": "1"}), "V1Job")
    pod = job.spec.template.spec
    assert pod.containers[0].resources.limits[GPU_RESOURCE] == "1"
    assert next(v for v in pod.volumes if v.name == "dshm").empty_dir.medium == "Memory"
    assert pod.containers[0].env_from[0].secret_ref.name == "forgeflow-s3"
    assert job.metadata.name == "eval-step-00000100-humaneval"


def test_a_broken_manifest_is_caught_by_the_check(tmp_path):
    manifest = training_job_manifest(two_node_request(tmp_path), SETTINGS, gpu_type="H100-80G")
    manifest["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []  # misspelt field
    with pytest.raises(AssertionError, match="lost or changed"):
        validated(manifest, "V1Job")
    del manifest["spec"]["template"]["spec"]["containers"][0]["volumeMount"]
    del manifest["spec"]["template"]["spec"]["containers"][0]["name"]  # required
    with pytest.raises(ValueError, match="name"):
        validated(manifest, "V1Job")


def test_prefect_kubernetes_pool_template_renders_a_valid_job():
    from infra.kubernetes import prefect_base_job_template, render_template

    template = prefect_base_job_template(SETTINGS)
    config = template["job_configuration"]
    assert {"command", "env", "labels", "name", "namespace", "job_manifest"} <= set(config)
    # Every placeholder names a variable (Prefect refuses a pool whose template does not).
    import json
    import re

    used = set(re.findall(r"\{\{ (\w+) \}\}", json.dumps(config)))
    assert used <= set(template["variables"]["properties"]), used - set(template["variables"]["properties"])
    job = validated(render_template(template), "V1Job")
    pod = job.spec.template.spec
    assert pod.containers[0].image == SETTINGS.image and job.metadata.namespace == "forgeflow"
    assert next(v for v in pod.volumes if v.name == "dshm").empty_dir.medium == "Memory"
    assert pod.containers[0].env_from[0].secret_ref.name == "forgeflow-s3"
