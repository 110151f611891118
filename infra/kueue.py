"""Kueue on Kubernetes: queue the attempt's Job, read where Kueue admitted it, see its eviction.

With a `kueue:` part in the cluster file's `kubernetes:` section, the training Job and the
evaluation Jobs are created suspended (`spec.suspend: true`) with

    label      kueue.x-k8s.io/queue-name      the LocalQueue of the namespace (`queue_name`)
    label      kueue.x-k8s.io/priority-class  a WorkloadPriorityClass (`priority_class`), if set
    annotation kueue.x-k8s.io/podset-required-topology  (or -preferred-) on the pod template:
               every pod of the attempt in one domain of that Topology level (`topology_level`)

Kueue makes a Workload of the Job (labelled `kueue.x-k8s.io/job-uid=<the Job's uid>`),
admits it when its ClusterQueue has quota (conditions QuotaReserved and Admitted), writes
the flavors it assigned (`status.admission.podSetAssignments[].flavors`: resource -> a
ResourceFlavor) and unsuspends the Job with the flavor's `spec.nodeLabels` added to the pod
template's nodeSelector. The launcher waits for that (`KubernetesJob.waiting`: the queue is
no hang), reads the flavors and their node labels back (the GPU type that runs), and treats
a later `Evicted` condition (reason Preempted, InactiveWorkload, PodsReadyTimeout, ...) as
the batch system ending the attempt, as a Slurm preemption is: the flow resumes from the
newest committed checkpoint in a new attempt, counted as an interruption, not a failure.

Kueue's API here is `kueue.x-k8s.io/v1beta1` (served by every Kueue release since 0.3).
No Kueue was available while this was written: the tests run the launcher through the real
`kubernetes` client against a local server that answers these objects in Kueue's shapes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSION = "v1beta1"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
TOPOLOGY_ANNOTATION = {"required": "kueue.x-k8s.io/podset-required-topology",
                       "preferred": "kueue.x-k8s.io/podset-preferred-topology"}

# A label value (and the names above: LocalQueue and WorkloadPriorityClass names are label values too).
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
_OBJECT_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def label_key_problem(key: str) -> str | None:
    """Why `key` is no valid label key ([prefix/]name), or None."""
    prefix, _, name = key.rpartition("/")
    if not name or len(name) > 63 or not _LABEL_NAME.match(name):
        return (f"{key!r} is no label key: its name part must be 1-63 letters, digits, '-', '_' or '.', "
                "beginning and ending with a letter or digit")
    if "/" in key and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return f"{key!r} is no label key: its prefix {prefix!r} must be a lowercase DNS subdomain (example.com)"
    return None


def label_value_problem(value: str) -> str | None:
    if len(value) > 63 or not _LABEL_VALUE.match(value):
        return (f"{value!r} is no label value: at most 63 letters, digits, '-', '_' or '.', beginning and "
                "ending with a letter or digit")
    return None


def _object_name(value: str | None, what: str) -> str | None:
    if value is not None and (len(value) > 63 or not _OBJECT_NAME.match(value)):
        raise ValueError(f"{value!r} is no {what} name: at most 63 lowercase letters, digits, '-' or '.', "
                         "beginning and ending with a letter or digit (`kubectl get "
                         f"{'localqueues' if 'queue' in what else 'workloadpriorityclasses'}` lists them)")
    return value


class KueueSettings(BaseModel):
    """The `kueue:` part of a cluster file's `kubernetes:` section: Kueue admits the attempts."""

    model_config = ConfigDict(extra="forbid")

    queue_name: str = Field(description="the LocalQueue (in the namespace) training Jobs are submitted to")
    priority_class: str | None = Field(
        default=None, description="a WorkloadPriorityClass for training Jobs (kueue.x-k8s.io/priority-class); "
        "None: the queue's default priority")
    evaluation_queue_name: str | None = Field(default=None,
                                              description="LocalQueue of evaluation Jobs; None: queue_name")
    evaluation_priority_class: str | None = Field(
        default=None, description="WorkloadPriorityClass of evaluation Jobs; None: priority_class")
    topology_level: str | None = Field(
        default=None, description="a node label of a Kueue Topology level (e.g. cloud.provider.com/topology-block): "
        "all pods of an attempt in one domain of it; None: no topology request")
    topology: Literal["required", "preferred"] = Field(
        default="required", description="required: admitted only into one domain of topology_level; preferred: "
        "one if it can, else the fewest")
    pin_gpu_type: bool = Field(
        default=True, description="the Job's nodeSelector names the GPU type the job was planned for, so Kueue "
        "admits it only into a flavor of that type; false: any flavor of the queue (the admitted type is recorded)")

    @field_validator("queue_name", "evaluation_queue_name")
    @classmethod
    def _queue(cls, value: str | None) -> str | None:
        return _object_name(value, "LocalQueue")

    @field_validator("priority_class", "evaluation_priority_class")
    @classmethod
    def _priority(cls, value: str | None) -> str | None:
        return _object_name(value, "WorkloadPriorityClass")

    @field_validator("topology_level")
    @classmethod
    def _level(cls, value: str | None) -> str | None:
        if value is not None and (problem := label_key_problem(value)):
            raise ValueError(f"topology_level names the node label of a Topology level: {problem}")
        return value


def kueue_job(manifest: dict, kueue: KueueSettings, evaluation: bool = False, pods: int = 1) -> dict:
    """`manifest` (a batch/v1 Job) queued in Kueue: suspended, labelled with its LocalQueue and
    priority class, and (for more than one pod, where the settings ask) its topology request."""
    queue = (kueue.evaluation_queue_name or kueue.queue_name) if evaluation else kueue.queue_name
    priority = (kueue.evaluation_priority_class or kueue.priority_class) if evaluation else kueue.priority_class
    labels = manifest["metadata"].setdefault("labels", {})
    labels[QUEUE_LABEL] = queue
    if priority:
        labels[PRIORITY_LABEL] = priority
    manifest["spec"]["suspend"] = True  # Kueue unsuspends it on admission
    if kueue.topology_level and pods > 1:
        template_meta = manifest["spec"]["template"].setdefault("metadata", {})
        template_meta.setdefault("annotations", {})[TOPOLOGY_ANNOTATION[kueue.topology]] = kueue.topology_level
    return manifest


# --- reading a Workload -------------------------------------------------------------


def _condition(workload: dict, kind: str) -> dict | None:
    return next((c for c in (workload.get("status") or {}).get("conditions") or [] if c.get("type") == kind), None)


def _is_true(workload: dict, kind: str) -> bool:
    found = _condition(workload, kind)
    return found is not None and found.get("status") == "True"


@dataclass(frozen=True)
class Admission:
    """Where Kueue admitted an attempt: its ClusterQueue, each resource's ResourceFlavor, and the
    node labels of those flavors (what the pods' nodeSelector gets), with the GPU type they mean."""

    workload: str
    cluster_queue: str
    flavors: dict[str, str]  # resource -> ResourceFlavor (the first pod set's; an attempt has one)
    node_labels: dict[str, str] = field(default_factory=dict)
    gpu_type: str | None = None  # None: the labels name no GPU type the settings know
    topology: dict | None = None  # status.admission.podSetAssignments[0].topologyAssignment, if any
    since: str | None = None  # the Admitted condition's lastTransitionTime: another one is a new admission

    def as_record(self, planned_gpu_type: str) -> dict:
        return {"workload": self.workload, "cluster_queue": self.cluster_queue, "flavors": dict(self.flavors),
                "node_labels": dict(self.node_labels), "gpu_type": self.gpu_type,
                "planned_gpu_type": planned_gpu_type, "topology": self.topology}


def admission_of(workload: dict) -> Admission | None:
    """The Workload's admission (QuotaReserved and Admitted both true, no Evicted), or None."""
    status = workload.get("status") or {}
    admission = status.get("admission")
    if not admission or not _is_true(workload, "Admitted") or _is_true(workload, "Evicted"):
        return None
    assignments = admission.get("podSetAssignments") or [{}]
    return Admission(workload=workload["metadata"]["name"], cluster_queue=admission.get("clusterQueue", ""),
                     flavors=dict(assignments[0].get("flavors") or {}),
                     topology=assignments[0].get("topologyAssignment"),
                     since=(_condition(workload, "Admitted") or {}).get("lastTransitionTime"))


def pending_reason(workload: dict) -> str:
    """Why Kueue has not admitted the Workload yet, in its own words."""
    if (workload.get("spec") or {}).get("active") is False:
        return "its Workload is deactivated (spec.active false): an operator or Kueue's requeue limit stopped it"
    for kind in ("QuotaReserved", "Admitted"):
        found = _condition(workload, kind)
        if found is not None and found.get("status") != "True" and found.get("message"):
            return found["message"]
    if _is_true(workload, "QuotaReserved"):
        return "quota reserved, waiting for its admission checks"
    return "pending"


def eviction_of(workload: dict | None, name: str) -> str:
    """Why an admitted attempt lost its admission, from the Workload's Evicted condition."""
    if workload is None:
        return f"Kueue's Workload {name} is gone: the Job lost its admission"
    found = _condition(workload, "Evicted")
    if found is not None and found.get("status") == "True":
        reason = found.get("reason") or "Evicted"
        what = {"Preempted": "preempted", "InactiveWorkload": "deactivated"}.get(reason, "evicted")
        return f"Kueue {what} workload {name} ({reason}): {found.get('message') or 'no message'}"
    if admission_of(workload) is not None:  # evicted and admitted again between two looks: new pods
        return f"Kueue evicted workload {name} and admitted it again: its pods were replaced"
    return f"Kueue took back the admission of workload {name}: {pending_reason(workload)}"


def gpu_type_of(node_labels: dict[str, str], gpu_node_labels: dict[str, dict[str, str]],
                gpu_type_label: str) -> str | None:
    """The GPU type node labels mean: the type whose `gpu_node_labels` they all carry, else the
    value of `gpu_type_label`, else None."""
    for gpu_type, wanted in sorted(gpu_node_labels.items()):
        if wanted and all(node_labels.get(k) == v for k, v in wanted.items()):
            return gpu_type
    return node_labels.get(gpu_type_label)


def workload_finished(workload: dict) -> bool:
    """The Job ended (Kueue's Finished condition): its admission ending then is no eviction."""
    return _is_true(workload, "Finished")
