"""The Kubernetes launcher: each training attempt is one indexed Job plus a headless Service.

    Service <job>-a<K>   (headless: clusterIP None) — gives pod <job>-a<K>-0 the DNS name
                          <job>-a<K>-0.<job>-a<K>, the rendezvous host of every node
    Job     <job>-a<K>   completionMode: Indexed, completions = parallelism = nodes,
                          backoffLimit 0 (a restart is the flow's decision, after diagnosis);
                          pod i runs torchrun --node-rank=$(JOB_COMPLETION_INDEX) under
                          infra.reaper, which also follows the attempt's lease file (the
                          flow renews it while it polls the pods; a dead flow cannot
                          delete the Job, so the pods stop themselves: infra.lease_guard)
                          with nvidia.com/gpu: G, a memory-backed /dev/shm, the run
                          directory on a shared volume and S3 credentials from a Secret

With the Kubeflow training operator installed, `pytorch_job_manifest` gives the
same attempt as one PyTorchJob (Master + Worker replicas; the operator sets
MASTER_ADDR/RANK itself). Evaluation trials get `evaluation_job_manifest`: one
GPU, the memory-backed /dev/shm the preload copies the exported checkpoint into.

A Job's nodeSelector pins the GPU type its placement was planned for (`gpu_type_label`, or
the node labels `gpu_node_labels` names for it), so what runs is what the flow recorded. With
a `kueue:` part in the settings the Jobs are queued in Kueue instead of starting at once
(infra/kueue.py): `KubernetesJob.waiting()` says why until Kueue admits the Workload, the
admitted flavors and their node labels are read back (`admission`, and the attempt's
`kueue-admission.json`), and an eviction (preempted, deactivated, ...) ends the attempt as
the batch system's doing (`ended_by_batch_system`), which run_attempt reports as "evicted",
as it does a Slurm preemption: the flow resumes from the newest committed checkpoint.

Every manifest here is validated against the Kubernetes API schema in the tests
(the `kubernetes` client's models: each object round-trips through its model
without losing a field). No Kubernetes cluster was available while this was
written: `KubernetesLauncher` (create, poll pod states per index, copy each pod's
log to the run directory, delete) runs in the tests against a small local HTTP server
that answers the API paths it uses in the API's JSON shapes, through the real
`kubernetes` client; it has not run against a real API server (see the README).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from infra.atomic_write import atomic_write_json
from infra.kueue import (JOB_UID_LABEL, KUEUE_GROUP, KUEUE_VERSION, Admission, KueueSettings, admission_of,
                         eviction_of, gpu_type_of, kueue_job, label_key_problem, label_value_problem,
                         pending_reason, workload_finished)
from infra.launch import TORCHRUN_MONITOR_INTERVAL_S, LaunchRequest, node_log_path, wait_for_exit
from infra.lease_guard import FILE_LEASE_S, LeaseFileRenewer, lease_file_path

RENDEZVOUS_PORT = 29500  # each pod has its own network namespace: a fixed port is free there
GPU_RESOURCE = "nvidia.com/gpu"


class KubernetesSettings(BaseModel):
    """Where and how attempts run on Kubernetes: the `kubernetes:` part of a deployment."""

    model_config = ConfigDict(extra="forbid")

    namespace: str = "forgeflow"
    image: str = Field(description="the forgeflow image (python with torch, megatron-core and this repo)")
    run_volume_claim: str = Field(description="a ReadWriteMany PVC holding run directories (heartbeats, logs)")
    run_mount: str = "/runs"
    s3_secret: str | None = Field(default="forgeflow-s3", description="Secret with AWS_ACCESS_KEY_ID/SECRET (envFrom)")
    shm_size: str = "64Gi"
    cpu_per_gpu: str = "8"
    memory_per_gpu: str = "64Gi"
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    service_account: str | None = None
    python: str = "python"
    kubeconfig: str | None = Field(
        default=None, description="kubeconfig file of the API server; None: the in-cluster service account "
        "when the flow runs in a pod, else $KUBECONFIG or ~/.kube/config")
    context: str | None = Field(default=None, description="kubeconfig context; None: its current context")
    gpu_type_label: str = Field(
        default="forgeflow.io/gpu-type", description="the node label whose value is a node's GPU type as the "
        "cluster file names it (H100-80G); a Job's nodeSelector pins the type its placement was planned for")
    gpu_node_labels: dict[str, dict[str, str]] = Field(
        default_factory=dict, description="per GPU type, the node labels that select its nodes instead "
        "(e.g. H100-80G: {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}); a type not listed: gpu_type_label")
    kueue: KueueSettings | None = Field(
        default=None, description="Kueue admits the Jobs: their LocalQueue, priority class, topology request; "
        "None: no Kueue, Jobs start at once and pin their GPU type by nodeSelector")

    @field_validator("gpu_type_label")
    @classmethod
    def _gpu_label(cls, value: str) -> str:
        if problem := label_key_problem(value):
            raise ValueError(problem)
        return value

    @field_validator("node_selector")
    @classmethod
    def _selector(cls, value: dict[str, str]) -> dict[str, str]:
        for key, val in value.items():
            if problem := label_key_problem(key) or label_value_problem(val):
                raise ValueError(problem)
        return value

    @field_validator("gpu_node_labels")
    @classmethod
    def _gpu_labels(cls, value: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
        for gpu_type, labels in value.items():
            if not labels:
                raise ValueError(f"gpu_node_labels[{gpu_type!r}] is empty: name the node labels of its nodes")
            for key, val in labels.items():
                if problem := label_key_problem(key) or label_value_problem(val):
                    raise ValueError(f"gpu_node_labels[{gpu_type!r}]: {problem}")
        return value

    @model_validator(mode="after")
    def _pins_agree(self) -> "KubernetesSettings":
        for gpu_type, labels in self.gpu_node_labels.items():
            clash = {k for k, v in labels.items() if k in self.node_selector and self.node_selector[k] != v}
            if clash:
                raise ValueError(f"gpu_node_labels[{gpu_type!r}] and node_selector disagree on {sorted(clash)}: "
                                 "no node could run that GPU type")
        return self


def object_name(request: LaunchRequest) -> str:
    """A DNS-1123 label naming the attempt's Job and Service (lowercase, <= 52 chars for pod names)."""
    base = re.sub(r"[^a-z0-9-]+", "-", request.job_name.lower()).strip("-") or "job"
    return f"{base[:40].rstrip('-')}-a{request.attempt}"


def _labels(request: LaunchRequest) -> dict[str, str]:
    return {"app.kubernetes.io/name": "forgeflow", "forgeflow/job": object_name(request).rsplit("-a", 1)[0],
            "forgeflow/attempt": str(request.attempt)}


def _volumes(settings: KubernetesSettings) -> tuple[list[dict], list[dict]]:
    volumes = [
        # /dev/shm: gloo/NCCL shared memory and the evaluation preload, in RAM not the node's disk.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": settings.shm_size}},
        {"name": "runs", "persistentVolumeClaim": {"claimName": settings.run_volume_claim}},
    ]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "runs", "mountPath": settings.run_mount}]
    return volumes, mounts


def _env(request: LaunchRequest, settings: KubernetesSettings) -> tuple[list[dict], list[dict]]:
    env = [{"name": k, "value": v} for k, v in sorted(request.env.items())]
    env += [{"name": "PYTHONUNBUFFERED", "value": "1"},
            {"name": "FORGEFLOW_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    env_from = [{"secretRef": {"name": settings.s3_secret}}] if settings.s3_secret else []
    return env, env_from


def _resources(gpus: int, settings: KubernetesSettings) -> dict:
    if gpus == 0:
        return {"requests": {"cpu": "1", "memory": "4Gi"}}
    cpu = str(int(settings.cpu_per_gpu) * gpus)
    mem_gi = int(settings.memory_per_gpu.removesuffix("Gi")) * gpus
    return {"requests": {"cpu": cpu, "memory": f"{mem_gi}Gi", GPU_RESOURCE: str(gpus)},
            "limits": {GPU_RESOURCE: str(gpus), "memory": f"{mem_gi}Gi"}}


def gpu_node_selector(gpu_type: str, settings: KubernetesSettings) -> dict[str, str]:
    """The node labels that pin `gpu_type` (none for "cpu"): its `gpu_node_labels`, else
    `gpu_type_label: <gpu_type>`."""
    if gpu_type == "cpu":
        return {}
    if gpu_type in settings.gpu_node_labels:
        return dict(settings.gpu_node_labels[gpu_type])
    if problem := label_value_problem(gpu_type):
        raise ValueError(f"GPU type {gpu_type!r} cannot be a node label value ({problem}); name its nodes' "
                         "labels under kubernetes.gpu_node_labels in the cluster file")
    return {settings.gpu_type_label: gpu_type}


def _node_selector(gpu_type: str, settings: KubernetesSettings) -> dict[str, str]:
    """What a Job's pods need of a node: the settings' node_selector and, unless Kueue is told to
    choose the flavor itself, the GPU type the placement was planned for."""
    chooses = settings.kueue is not None and not settings.kueue.pin_gpu_type
    pin = {} if chooses else gpu_node_selector(gpu_type, settings)
    clash = sorted(k for k, v in pin.items() if settings.node_selector.get(k, v) != v)
    if clash:
        raise ValueError(f"kubernetes.node_selector sets {clash} to other values than GPU type {gpu_type!r} needs")
    return {**settings.node_selector, **pin}


def headless_service_manifest(request: LaunchRequest, settings: KubernetesSettings) -> dict:
    name = object_name(request)
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": settings.namespace, "labels": _labels(request)},
        "spec": {"clusterIP": "None", "selector": {"job-name": name},
                 "publishNotReadyAddresses": True,  # rendezvous happens before any readiness
                 "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT}]},
    }


def torchrun_container_args(request: LaunchRequest, settings: KubernetesSettings) -> list[str]:
    name = object_name(request)
    nproc = max(n.nproc_per_node for n in request.nodes)
    log_dir = f"{settings.run_mount}/{name}/torchrun"
    return [settings.python, "-m", "infra.torchrun", f"--nnodes={len(request.nodes)}",
            "--node-rank=$(JOB_COMPLETION_INDEX)", f"--nproc-per-node={nproc}",
            f"--master-addr={name}-0.{name}", f"--master-port={RENDEZVOUS_PORT}",
            "--max-restarts=0", f"--monitor-interval={TORCHRUN_MONITOR_INTERVAL_S}", "--tee=3", f"--log-dir={log_dir}",
            *request.worker_args]


def training_job_manifest(request: LaunchRequest, settings: KubernetesSettings, gpu_type: str = "cpu",
                          grace_s: float = 10.0) -> dict:
    """One indexed Job: pod i is node rank i (hostname <name>-i under the headless Service); its
    torchrun runs under the reaper, which stops it once the attempt's lease file goes stale.
    Its nodeSelector pins `gpu_type`; with Kueue it is created suspended in its queue (infra.kueue)."""
    name = object_name(request)
    nodes = len(request.nodes)
    gpus = 0 if gpu_type == "cpu" else max(n.nproc_per_node for n in request.nodes)
    volumes, mounts = _volumes(settings)
    env, env_from = _env(request, settings)
    pod_spec: dict[str, Any] = {
        "subdomain": name, "restartPolicy": "Never",
        "containers": [{
            "name": "torchrun", "image": settings.image,
            "command": [settings.python, "-m", "infra.reaper", f"--grace={grace_s}",
                        f"--lease-file={lease_file_path(request.run_dir, request.attempt)}", "--",
                        *torchrun_container_args(request, settings)],
            "env": env, "envFrom": env_from, "resources": _resources(gpus, settings),
            "volumeMounts": mounts, "ports": [{"containerPort": RENDEZVOUS_PORT, "name": "rendezvous"}],
        }],
        "volumes": volumes,
        "terminationGracePeriodSeconds": 60,  # SIGTERM: ranks commit their checkpoint and exit
    }
    if selector := _node_selector(gpu_type, settings):
        pod_spec["nodeSelector"] = selector
    if settings.tolerations:
        pod_spec["tolerations"] = list(settings.tolerations)
    if settings.service_account:
        pod_spec["serviceAccountName"] = settings.service_account
    manifest = {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": settings.namespace, "labels": _labels(request)},
        "spec": {
            "completionMode": "Indexed", "completions": nodes, "parallelism": nodes,
            "backoffLimit": 0,
            "ttlSecondsAfterFinished": 7 * 24 * 3600,
            "template": {"metadata": {"labels": {**_labels(request), "job-name": name}}, "spec": pod_spec},
        },
    }
    return kueue_job(manifest, settings.kueue, pods=nodes) if settings.kueue is not None else manifest


def pytorch_job_manifest(request: LaunchRequest, settings: KubernetesSettings, gpu_type: str = "cpu") -> dict:
    """The same attempt as a Kubeflow PyTorchJob (training operator), one Master + N-1 Workers."""
    job = training_job_manifest(request, settings, gpu_type)
    template = job["spec"]["template"]
    run_policy: dict[str, Any] = {"backoffLimit": 0, "cleanPodPolicy": "Running"}
    if job["spec"].get("suspend"):  # queued in Kueue (its labels are in the metadata): admitted, it runs
        run_policy["suspend"] = True
    container = template["spec"]["containers"][0]
    nproc = max(n.nproc_per_node for n in request.nodes)
    # The operator sets MASTER_ADDR, MASTER_PORT, WORLD_SIZE (nodes) and RANK (node rank).
    container["name"] = "pytorch"
    container["command"] = [settings.python, "-m", "infra.torchrun", f"--nnodes={len(request.nodes)}",
                            "--node-rank=$(RANK)", f"--nproc-per-node={nproc}", "--master-addr=$(MASTER_ADDR)",
                            "--master-port=$(MASTER_PORT)", "--max-restarts=0", *request.worker_args]
    template["spec"].pop("subdomain")

    def replicas(count: int) -> dict:
        return {"replicas": count, "restartPolicy": "Never", "template": template}

    specs = {"Master": replicas(1)}
    if len(request.nodes) > 1:
        specs["Worker"] = replicas(len(request.nodes) - 1)
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": job["metadata"],
            "spec": {"runPolicy": run_policy, "pytorchReplicaSpecs": specs}}


def evaluation_job_manifest(name: str, command: list[str], settings: KubernetesSettings, gpus: int = 1,
                            env: dict[str, str] | None = None, gpu_type: str = "cpu") -> dict:
    """One evaluation trial: GPUs, the memory-backed /dev/shm it preloads the checkpoint into,
    S3 credentials to read the exported checkpoint, the run volume for generations. Pinned to
    `gpu_type` by nodeSelector when one is named; with Kueue, suspended in the evaluation queue."""
    request = LaunchRequest(name, [_single_node()], [], Path(settings.run_mount), env=env or {})
    volumes, mounts = _volumes(settings)
    env_list, env_from = _env(request, settings)
    label = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:52]
    pod_spec: dict[str, Any] = {"restartPolicy": "Never", "volumes": volumes, "containers": [{
        "name": "evaluate", "image": settings.image, "command": list(command), "env": env_list,
        "envFrom": env_from, "resources": _resources(gpus, settings), "volumeMounts": mounts}]}
    if selector := _node_selector(gpu_type, settings):
        pod_spec["nodeSelector"] = selector
    if settings.tolerations:
        pod_spec["tolerations"] = list(settings.tolerations)
    manifest = {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": label, "namespace": settings.namespace,
                     "labels": {"app.kubernetes.io/name": "forgeflow", "forgeflow/role": "evaluation"}},
        "spec": {"backoffLimit": 1, "ttlSecondsAfterFinished": 24 * 3600, "template": {
            "metadata": {"labels": {"app.kubernetes.io/name": "forgeflow", "forgeflow/role": "evaluation"}},
            "spec": pod_spec,
        }},
    }
    return kueue_job(manifest, settings.kueue, evaluation=True) if settings.kueue is not None else manifest


def _single_node():
    from infra.launch import NodeLaunch

    return NodeLaunch(node="pod", address="", node_rank=0, nnodes=1, nproc_per_node=1, cuda_visible_devices="",
                      master_addr="", master_port=0, first_global_rank=0)


# --- the launcher -------------------------------------------------------------------

CONTAINER = "torchrun"
INDEX_KEY = "batch.kubernetes.io/job-completion-index"  # label since 1.28, annotation before
EVICTED_EXIT_CODE = 143  # a node whose pod Kueue's eviction deleted before it said how it ended (SIGTERM)


def admission_path(request: LaunchRequest) -> Path:
    """Where Kueue admitted the attempt (flavors, their node labels, the GPU type they mean)."""
    return request.run_dir / "launch" / f"attempt-{request.attempt}" / "kueue-admission.json"


def api_client(settings: KubernetesSettings):
    """A client of the cluster's API server: the kubeconfig the settings name, else the pod's
    service account (the flow runs in the cluster), else $KUBECONFIG / ~/.kube/config."""
    from kubernetes import client, config

    if settings.kubeconfig is None:
        try:
            configuration = client.Configuration()
            config.load_incluster_config(client_configuration=configuration)
            return client.ApiClient(configuration)
        except config.ConfigException:
            pass
    try:
        return config.new_client_from_config(config_file=settings.kubeconfig, context=settings.context)
    except (config.ConfigException, OSError) as e:
        where = settings.kubeconfig or "$KUBECONFIG or ~/.kube/config"
        raise RuntimeError(f"cannot reach Kubernetes: no in-cluster service account and no usable kubeconfig "
                           f"({where}: {e}); set kubernetes.kubeconfig in the cluster file or run the flow "
                           f"in a pod of the cluster") from None


def pod_index(pod) -> int:
    """The node rank of an indexed Job's pod (-1 when it has none)."""
    meta = pod.metadata
    value = (meta.labels or {}).get(INDEX_KEY) or (meta.annotations or {}).get(INDEX_KEY)
    return int(value) if value is not None else -1


@dataclass
class KubernetesJob:
    """A running attempt: the indexed Job's pods, read with one list call per `poll_s`.

    Each pod's console (torchrun and every rank, `--tee`) is copied from the API server to
    the node's log file in the run directory (`infra.launch.node_log_path`, where the local
    and Slurm launchers write theirs) when its container ends, and for every pod before the
    Job is deleted, so diagnosis reads it even after the pods are gone."""

    request: LaunchRequest
    settings: KubernetesSettings
    name: str
    api: Any = None  # kubernetes.client.ApiClient
    poll_s: float = 2.0
    api_calls: int = 0
    lease: LeaseFileRenewer | None = None  # renewed on each poll: the pods stop the ranks once it goes stale
    uid: str | None = None  # the Job's, as the API server created it (Kueue labels its Workload with it)
    gpu_type: str = "cpu"  # the GPU type the placement was planned for
    admission: Admission | None = None  # with Kueue: where it admitted the attempt (`waiting`)
    evicted: str | None = None  # with Kueue: why it took the admission back (`ended_by_batch_system`)
    _exit: dict[int, int] = field(default_factory=dict)
    _captured: set[int] = field(default_factory=set)
    _read_at: float = -1e9
    _deleted: bool = False

    def _pods(self) -> list:
        from kubernetes import client

        self.api_calls += 1
        return client.CoreV1Api(self.api).list_namespaced_pod(
            self.settings.namespace, label_selector=f"job-name={self.name}").items

    def _node_of(self, index: int) -> str | None:
        return next((n.node for n in self.request.nodes if n.node_rank == index), None)

    def capture_log(self, pod, index: int) -> Path | None:
        """Copy one pod's container log to its node's log file (None if the pod has no log yet)."""
        from kubernetes import client

        node = self._node_of(index)
        if node is None:
            return None
        try:
            self.api_calls += 1
            text = client.CoreV1Api(self.api).read_namespaced_pod_log(
                pod.metadata.name, self.settings.namespace, container=CONTAINER)
        except client.ApiException as e:
            if e.status in (400, 404):  # container not started yet, or the pod is gone
                return None
            raise
        path = node_log_path(self.request, node)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".partial")
        tmp.write_text(text if text.endswith("\n") or not text else text + "\n")
        tmp.replace(path)
        return path

    # --- Kueue (infra.kueue) -------------------------------------------------------

    def _workload(self) -> dict | None:
        """The Kueue Workload of this attempt's Job (labelled with the Job's uid), None before Kueue made it."""
        from kubernetes import client

        self.api_calls += 1
        try:
            found = client.CustomObjectsApi(self.api).list_namespaced_custom_object(
                KUEUE_GROUP, KUEUE_VERSION, self.settings.namespace, "workloads",
                label_selector=f"{JOB_UID_LABEL}={self.uid}")
        except client.ApiException as e:
            if e.status == 404:
                raise RuntimeError(
                    f"the cluster file queues Jobs in Kueue (kubernetes.kueue), but the API server serves no "
                    f"{KUEUE_GROUP}/{KUEUE_VERSION} workloads: install Kueue, or remove the 'kueue:' part "
                    f"(Job {self.name} would stay suspended)") from None
            if e.status == 403:
                raise RuntimeError(
                    f"the flow's Kubernetes identity may not list workloads.{KUEUE_GROUP} in namespace "
                    f"{self.settings.namespace}: grant get/list/watch on them (README, Kubernetes)") from None
            raise
        items = [w for w in found.get("items") or []
                 if not (w.get("metadata") or {}).get("ownerReferences")
                 or any(o.get("uid") == self.uid for o in w["metadata"]["ownerReferences"])]
        return max(items, key=lambda w: w["metadata"].get("creationTimestamp") or "") if items else None

    def _node_labels(self, flavors: dict[str, str]) -> dict[str, str]:
        """The admitted flavors' node labels: each ResourceFlavor's spec.nodeLabels, else (not
        allowed to read ResourceFlavors) what Kueue put in the Job's pod template nodeSelector."""
        from kubernetes import client

        labels: dict[str, str] = {}
        try:
            for flavor in sorted(set(flavors.values())):
                self.api_calls += 1
                found = client.CustomObjectsApi(self.api).get_cluster_custom_object(
                    KUEUE_GROUP, KUEUE_VERSION, "resourceflavors", flavor)
                labels.update((found.get("spec") or {}).get("nodeLabels") or {})
            return labels
        except client.ApiException as e:
            if e.status not in (403, 404):
                raise
        self.api_calls += 1
        job = client.BatchV1Api(self.api).read_namespaced_job(self.name, self.settings.namespace)
        return dict(job.spec.template.spec.node_selector or {})

    def _admitted(self, admission: Admission) -> None:
        labels = self._node_labels(admission.flavors)
        gpu_type = gpu_type_of(labels, self.settings.gpu_node_labels, self.settings.gpu_type_label)
        self.admission = replace(admission, node_labels=labels, gpu_type=gpu_type)
        atomic_write_json(admission_path(self.request), self.admission.as_record(self.gpu_type))

    def waiting(self) -> str | None:
        """Why the attempt does not run yet: with Kueue, until its Workload is admitted (then the
        admitted flavors and the GPU type they mean are read back: `admission`, and written to the
        attempt's `kueue-admission.json`); None once it may run. Renews the lease file meanwhile."""
        if self.lease is not None:
            self.lease.renew()
        kueue = self.settings.kueue
        if kueue is None or self.admission is not None or self.evicted is not None:
            return None
        workload = self._workload()
        if workload is None:
            return (f"waiting in Kueue: no Workload for Job {self.name} yet (queue {kueue.queue_name}; Kueue "
                    "makes one for a Job whose namespace it manages)")
        admitted = admission_of(workload)
        if admitted is None:
            return (f"waiting in Kueue: {pending_reason(workload)} (workload {workload['metadata']['name']}, "
                    f"queue {kueue.queue_name})")
        self._admitted(admitted)
        return None

    def _check_eviction(self) -> None:
        """Kueue took the admission back (Evicted: preempted, deactivated, pods not ready in time...):
        it suspends the Job, whose pods get SIGTERM (the ranks commit) and are deleted."""
        if self.settings.kueue is None or self.admission is None or self.evicted is not None or self._deleted:
            return
        workload = self._workload()
        if workload is not None and workload_finished(workload):
            return
        admitted = admission_of(workload) if workload is not None else None
        if admitted is None or (admitted.workload, admitted.since) != (self.admission.workload, self.admission.since):
            self.evicted = eviction_of(workload, self.admission.workload)

    def ended_by_batch_system(self) -> str | None:
        """Why the attempt ended, when Kueue ended it (an eviction) rather than its code; else None."""
        self._check_eviction()
        return self.evicted

    def poll(self) -> dict[str, int | None]:
        """Exit code per node from its pod's container; its log is captured as it ends. After a
        Kueue eviction, a node whose pod is gone without an exit code reads EVICTED_EXIT_CODE (a
        pod still stopping reads None: its ranks are committing their checkpoint)."""
        if self.lease is not None:
            self.lease.renew()
        if time.monotonic() - self._read_at >= self.poll_s:
            self._check_eviction()  # before the pods: a pod stopped by the eviction is read as that
            present: set[int] = set()
            for pod in [] if self._deleted else self._pods():
                index = pod_index(pod)
                present.add(index)
                for status in (pod.status.container_statuses or []) if pod.status else []:
                    if status.name == CONTAINER and status.state and status.state.terminated is not None:
                        self._exit[index] = int(status.state.terminated.exit_code)
                if index in self._exit and index not in self._captured:
                    if self.capture_log(pod, index) is not None:
                        self._captured.add(index)
            if self.evicted is not None:
                for n in self.request.nodes:
                    if n.node_rank not in present:
                        self._exit.setdefault(n.node_rank, EVICTED_EXIT_CODE)
            self._read_at = time.monotonic()
        return {n.node: self._exit.get(n.node_rank) for n in self.request.nodes}

    def wait(self, timeout: float | None = None, any_exit: bool = False) -> dict[str, int | None]:
        return wait_for_exit(self.poll, timeout, any_exit, interval_s=1.0)

    def terminate(self, grace_s: float = 10.0) -> None:
        """Capture every pod's log not yet captured (a hang's diagnosis needs them), then
        delete the Job (its pods with it) and the Service; gone already is fine."""
        from kubernetes import client

        if self.lease is not None:  # the pods stop too should the deletion not reach them
            self.lease.release("the flow stopped the attempt")
        self._check_eviction()  # the Workload goes with the Job: read why it ended while it is there
        try:
            for pod in self._pods():
                index = pod_index(pod)
                if index not in self._captured and self.capture_log(pod, index) is not None and index in self._exit:
                    self._captured.add(index)
        except client.ApiException as e:
            if e.status != 404:
                raise
        body = client.V1DeleteOptions(propagation_policy="Foreground", grace_period_seconds=int(grace_s))
        for delete in (lambda: client.BatchV1Api(self.api).delete_namespaced_job(
                           self.name, self.settings.namespace, body=body),
                       lambda: client.CoreV1Api(self.api).delete_namespaced_service(
                           self.name, self.settings.namespace)):
            try:
                self.api_calls += 1
                delete()
            except client.ApiException as e:
                if e.status != 404:
                    raise
        self._deleted = True

    def log_paths(self) -> dict[str, Path]:
        return {n.node: node_log_path(self.request, n.node) for n in self.request.nodes}


class KubernetesLauncher:
    """Create the attempt's headless Service and indexed Job through the cluster's API server."""

    def __init__(self, settings: KubernetesSettings, gpu_type: str = "cpu", grace_s: float = 10.0,
                 lease_s: float = FILE_LEASE_S):
        self.settings = settings
        self.gpu_type = gpu_type
        self.grace_s = grace_s
        self.lease_s = lease_s  # the pods stop the ranks once the flow has not renewed the lease file this long

    def start(self, request: LaunchRequest) -> KubernetesJob:
        from kubernetes import client

        api = api_client(self.settings)
        lease = LeaseFileRenewer(lease_file_path(request.run_dir, request.attempt), self.lease_s)
        lease.renew()  # written before any pod reads it
        job = KubernetesJob(request, self.settings, object_name(request), api=api, lease=lease,
                            gpu_type=self.gpu_type)
        # a manifest the settings cannot make (a GPU type no label value can name) fails before any create
        manifest = training_job_manifest(request, self.settings, self.gpu_type, self.grace_s)
        client.CoreV1Api(api).create_namespaced_service(self.settings.namespace,
                                                        headless_service_manifest(request, self.settings))
        job.api_calls += 1
        try:
            created = client.BatchV1Api(api).create_namespaced_job(self.settings.namespace, manifest)
            job.api_calls += 1
            job.uid = created.metadata.uid
        except BaseException:
            job.terminate(grace_s=0)  # no Service left behind
            raise
        return job


# --- the Prefect work pool the flows themselves run in -----------------------------


def prefect_base_job_template(settings: KubernetesSettings | None = None) -> dict:
    """A base job template for a Prefect `kubernetes` work pool (prefect-kubernetes' format:
    `job_configuration` with `{{ variable }}` placeholders, `variables` as a JSON schema).

    Flow runs (pretrain, evaluate, diagnose) are light: they orchestrate, and the GPUs
    belong to the Jobs the launcher creates. The pod still gets the memory-backed
    /dev/shm (the evaluation preload on a node) and the S3 credentials Secret."""
    image = settings.image if settings else "forgeflow:latest"
    namespace = settings.namespace if settings else "forgeflow"
    secret = settings.s3_secret if settings else "forgeflow-s3"
    container: dict[str, Any] = {
        "name": "prefect-job", "image": "{{ image }}", "args": "{{ command }}", "env": "{{ env }}",
        "imagePullPolicy": "{{ image_pull_policy }}",
        "resources": {"requests": {"cpu": "{{ cpu }}", "memory": "{{ memory }}"}},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if secret:
        container["envFrom"] = [{"secretRef": {"name": secret}}]
    job_manifest = {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"generateName": "{{ name }}-", "namespace": "{{ namespace }}", "labels": "{{ labels }}"},
        "spec": {"backoffLimit": 0, "ttlSecondsAfterFinished": "{{ finished_job_ttl }}", "template": {"spec": {
            "restartPolicy": "Never", "serviceAccountName": "{{ service_account_name }}",
            "containers": [container],
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "{{ shm_size }}"}}],
        }}},
    }
    variables = {
        "image": {"type": "string", "default": image, "title": "Image", "description": "the forgeflow image"},
        "namespace": {"type": "string", "default": namespace, "title": "Namespace"},
        "service_account_name": {"type": "string", "default": "forgeflow", "title": "Service account",
                                 "description": "the launcher's rights: create/get/delete jobs, create/delete "
                                 "services, list pods, get pods/log; with Kueue also list workloads.kueue.x-k8s.io "
                                 "(README, Kubernetes)"},
        "image_pull_policy": {"type": "string", "default": "IfNotPresent", "enum": ["IfNotPresent", "Always", "Never"]},
        "cpu": {"type": "string", "default": "2"},
        "memory": {"type": "string", "default": "8Gi"},
        "shm_size": {"type": "string", "default": "16Gi", "title": "/dev/shm size (memory-backed)"},
        "finished_job_ttl": {"type": "integer", "default": 86400},
        "name": {"type": "string", "default": "forgeflow-flow"},
        "command": {"type": "array", "items": {"type": "string"}, "default": None},
        "env": {"type": "object", "additionalProperties": {"type": "string"}, "default": {}},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}, "default": {}},
    }
    return {
        "job_configuration": {
            "command": "{{ command }}", "env": "{{ env }}", "labels": "{{ labels }}", "name": "{{ name }}",
            "namespace": "{{ namespace }}", "job_manifest": job_manifest, "cluster_config": None,
            "job_watch_timeout_seconds": None, "pod_watch_timeout_seconds": 300, "stream_output": True,
        },
        "variables": {"type": "object", "properties": variables},
    }


def render_template(template: dict) -> dict:
    """The job manifest with every `{{ variable }}` replaced by its default (what a worker
    submits when a deployment overrides nothing); used to check the template's Job."""
    defaults = {k: v.get("default") for k, v in template["variables"]["properties"].items()}
    defaults["command"] = defaults["command"] or ["prefect", "flow-run", "execute"]

    def fill(value):
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        if isinstance(value, list):
            return [fill(v) for v in value]
        if isinstance(value, str):
            match = re.fullmatch(r"\{\{ (\w+) \}\}", value)
            if match:
                return defaults[match.group(1)]
            return re.sub(r"\{\{ (\w+) \}\}", lambda m: str(defaults[m.group(1)]), value)
        return value

    manifest = fill(template["job_configuration"]["job_manifest"])
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    container["env"] = [{"name": k, "value": v} for k, v in (container.get("env") or {}).items()]
    return manifest
