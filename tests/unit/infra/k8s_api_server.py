"""A small Kubernetes API server for the launcher's tests: real HTTP, the API's paths and JSON.

It answers exactly the calls `infra.kubernetes.KubernetesLauncher` makes, in the shapes the
real API server uses (objects with apiVersion/kind/metadata, `PodList`, `Status` bodies with
the real codes and reasons: 201 on create, 409 AlreadyExists, 404 NotFound, 400 while a
container is waiting, 422 Invalid), so the real `kubernetes` client talks to it unchanged:

    POST   /api/v1/namespaces/{ns}/services                 create a Service
    DELETE /api/v1/namespaces/{ns}/services/{name}
    POST   /apis/batch/v1/namespaces/{ns}/jobs              create a Job (+ its indexed pods)
    DELETE /apis/batch/v1/namespaces/{ns}/jobs/{name}       delete it and its pods
    GET    /apis/batch/v1/namespaces/{ns}/jobs/{name}
    GET    /apis/batch/v1/namespaces/{ns}/jobs?labelSelector=k=v   list Jobs (with their status)
    GET    /api/v1/namespaces/{ns}/pods?labelSelector=k=v   list pods (equality selectors)
    GET    /api/v1/namespaces/{ns}/pods/{name}/log?container=c
    GET    /apis/kueue.x-k8s.io/v1beta1/namespaces/{ns}/workloads?labelSelector=k=v
    GET    /apis/kueue.x-k8s.io/v1beta1/resourceflavors/{name}

Posted objects must deserialize into the client's model of their kind (as the API server
validates them), or the answer is 422. There are no kubelets: a test moves a pod's container
to running or terminated with `run_pod` / `finish_pod`, and sets what its log says.

Kueue's part (unless `kueue=False`: then its paths answer 404, as without its CRDs): a Job
labelled `kueue.x-k8s.io/queue-name` is kept suspended (its webhook's doing) and gets a
Workload in Kueue's v1beta1 shape (`job-<name>-<hash>`, labelled with the Job's uid, owned
by it, pending with a QuotaReserved=False message). A test plays Kueue's scheduler with
`admit` (admission with the flavor's resources, QuotaReserved/Admitted, the flavor's node
labels into the pod template, the Job unsuspended: its pods appear) and `evict` (Evicted
with a reason, admission gone, the Job suspended again: its pods deleted). `add_flavor`
makes a ResourceFlavor with `spec.nodeLabels`.

A Job's status follows its pods as the Job controller keeps it: `finish_pod` counts the pod
in `status.succeeded` / `status.failed` and adds the `Complete` condition once every
completion succeeded, or `Failed` (BackoffLimitExceeded) once more pods failed than
`backoffLimit` allows. A DELETE's options (propagationPolicy) are kept in `deletions`.
"""

from __future__ import annotations

import json
import threading
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
KUEUE = ["apis", "kueue.x-k8s.io", "v1beta1"]
TOPOLOGY = {"kueue.x-k8s.io/podset-required-topology": "required",
            "kueue.x-k8s.io/podset-preferred-topology": "preferred"}


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


def _selected(items, query: dict) -> list[dict]:
    """The objects an equality label selector (k=v,k2=v2) picks."""
    wanted = {}
    for term in (query.get("labelSelector") or [""])[0].split(","):
        if term:
            key, _, value = term.partition("=")
            wanted[key] = value
    return [o for o in items if all((o["metadata"].get("labels") or {}).get(k) == v for k, v in wanted.items())]


def _set_condition(obj: dict, kind: str, status: bool, reason: str, message: str) -> None:
    conditions = obj["status"].setdefault("conditions", [])
    old = next((c for c in conditions if c["type"] == kind), None)
    new = {"type": kind, "status": "True" if status else "False", "reason": reason, "message": message,
           "lastTransitionTime": _now(), "observedGeneration": 1}
    if old is None:
        conditions.append(new)
    else:
        old.update(new)


class KubeApiServer:
    def __init__(self, kueue: bool = True, flavors_readable: bool = True) -> None:
        self.kueue = kueue  # Kueue's CRDs installed
        self.flavors_readable = flavors_readable  # else 403 on ResourceFlavors (a namespaced Role only)
        self.services: dict[tuple[str, str], dict] = {}
        self.jobs: dict[tuple[str, str], dict] = {}
        self.pods: dict[tuple[str, str], dict] = {}
        self.logs: dict[tuple[str, str], str] = {}
        self.workloads: dict[tuple[str, str], dict] = {}
        self.flavors: dict[str, dict] = {}
        self.requests: list[tuple[str, str]] = []
        self.deletions: list[tuple[str, str, dict]] = []  # (kind, name, the DELETE's body: propagationPolicy)
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _send(self, code: int, body, content_type: str = "application/json") -> None:
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                url = urlparse(self.path)
                body = None
                if int(self.headers.get("Content-Length") or 0):
                    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append((method, url.path))
                    code, answer, ctype = server.route(method, url.path.strip("/").split("/"),
                                                       parse_qs(url.query), body)
                self._send(code, answer, ctype)

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

            def do_DELETE(self) -> None:
                self._handle("DELETE")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> "KubeApiServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def kubeconfig(self, path) -> str:
        """A kubeconfig file naming this server (what `kubectl config` would write)."""
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.url}}],
            "users": [{"name": "test", "user": {"token": "test-token"}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test", "namespace": "forgeflow"}}],
        }
        path.write_text(json.dumps(config))
        return str(path)

    # --- what a kubelet would do ----------------------------------------------------------

    def pod_of(self, job: str, index: int, namespace: str = "forgeflow") -> dict:
        return next(p for (ns, _), p in self.pods.items()
                    if ns == namespace and p["metadata"]["labels"].get("job-name") == job
                    and p["metadata"]["labels"].get(INDEX_LABEL) == str(index))

    def _set_state(self, pod: dict, state: dict, phase: str, log: str | None) -> None:
        container = pod["spec"]["containers"][0]
        pod["status"]["phase"] = phase
        pod["status"]["containerStatuses"] = [{
            "name": container["name"], "image": container["image"], "imageID": "sha256:" + "0" * 64,
            "ready": phase == "Running", "restartCount": 0, "started": phase == "Running", "state": state,
        }]
        if log is not None:
            self.logs[(pod["metadata"]["namespace"], pod["metadata"]["name"])] = log

    def run_pod(self, job: str, index: int, log: str = "") -> None:
        with self.lock:
            self._set_state(self.pod_of(job, index), {"running": {"startedAt": _now()}}, "Running", log)

    def finish_pod(self, job: str, index: int, exit_code: int, log: str) -> None:
        with self.lock:
            state = {"terminated": {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                                    "startedAt": _now(), "finishedAt": _now()}}
            pod = self.pod_of(job, index)
            self._set_state(pod, state, "Succeeded" if exit_code == 0 else "Failed", log)
            self._count_pod(pod["metadata"]["namespace"], job, exit_code == 0)

    def _count_pod(self, namespace: str, job: str, succeeded: bool) -> None:
        """The Job controller's status: a pod counted as succeeded or failed; Complete or Failed at the end."""
        obj = self.jobs.get((namespace, job))
        if obj is None:
            return
        status = obj.setdefault("status", {})
        key = "succeeded" if succeeded else "failed"
        status[key] = status.get(key, 0) + 1
        spec = obj["spec"]
        if status.get("succeeded", 0) >= spec.get("completions", 1):
            kind, reason, message = "Complete", "CompletionsReached", "Reached expected number of succeeded pods"
            status["completionTime"] = _now()
        elif status.get("failed", 0) > spec.get("backoffLimit", 6):
            kind, reason, message = "Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit"
        else:
            return
        status.setdefault("conditions", []).append({"type": kind, "status": "True", "reason": reason,
                                                    "message": message, "lastProbeTime": _now(),
                                                    "lastTransitionTime": _now()})

    # --- what Kueue would do ---------------------------------------------------------------

    def add_flavor(self, name: str, node_labels: dict[str, str]) -> None:
        with self.lock:
            self.flavors[name] = {"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "ResourceFlavor",
                                  "metadata": {"name": name, "uid": str(uuid.uuid4()), "creationTimestamp": _now()},
                                  "spec": {"nodeLabels": dict(node_labels)}}

    def workload_of(self, job: str, namespace: str = "forgeflow") -> dict:
        uid = self.jobs[(namespace, job)]["metadata"]["uid"]
        return next(w for (ns, _), w in self.workloads.items()
                    if ns == namespace and w["metadata"]["labels"][JOB_UID_LABEL] == uid)

    def admit(self, job: str, flavor: str, cluster_queue: str = "cluster-queue", namespace: str = "forgeflow") -> None:
        """Kueue's scheduler admits the Job's Workload into `flavor`, and its job controller
        unsuspends the Job with the flavor's node labels in the pod template."""
        with self.lock:
            workload = self.workload_of(job, namespace)
            (pod_set,) = workload["spec"]["podSets"]
            requests = pod_set["template"]["spec"]["containers"][0].get("resources", {}).get("requests", {})
            assignment = {"name": pod_set["name"], "flavors": {r: flavor for r in requests},
                          "resourceUsage": dict(requests), "count": pod_set["count"]}
            if "topologyRequest" in pod_set:
                level = next(iter(pod_set["topologyRequest"].values()))
                assignment["topologyAssignment"] = {"levels": [level],
                                                    "domains": [{"values": ["block-1"], "count": pod_set["count"]}]}
            workload["status"]["admission"] = {"clusterQueue": cluster_queue, "podSetAssignments": [assignment]}
            _set_condition(workload, "QuotaReserved", True, "QuotaReserved",
                           f"Quota reserved in ClusterQueue {cluster_queue}")
            _set_condition(workload, "Admitted", True, "Admitted", "The workload is admitted")
            if any(c["type"] == "Evicted" for c in workload["status"]["conditions"]):
                _set_condition(workload, "Evicted", False, "QuotaReserved", "Previously: evicted")
                _set_condition(workload, "Requeued", True, "QuotaReserved", "")
            obj = self.jobs[(namespace, job)]
            pod_spec = obj["spec"]["template"]["spec"]
            obj["_selector_before"] = dict(pod_spec.get("nodeSelector") or {})
            pod_spec["nodeSelector"] = {**obj["_selector_before"], **self.flavors[flavor]["spec"]["nodeLabels"]}
            obj["spec"]["suspend"] = False
            self._create_pods(namespace, obj)

    def evict(self, job: str, reason: str = "Preempted", message: str = "", delete_pods: bool = True,
              namespace: str = "forgeflow") -> None:
        """Kueue evicts the Job's Workload: Evicted (and Preempted) true, the admission released, the
        Job suspended (the Job controller then deletes its pods: `delete_pods`), the flavor's node
        labels taken out of the pod template again."""
        with self.lock:
            workload = self.workload_of(job, namespace)
            message = message or {"Preempted": "Preempted to accommodate a workload (UID: 7c0e) due to "
                                               "prioritization in the ClusterQueue",
                                  "InactiveWorkload": "The workload is deactivated"}.get(reason, reason)
            _set_condition(workload, "Evicted", True, reason, message)
            if reason == "Preempted":
                _set_condition(workload, "Preempted", True, "InClusterQueue", message)
            if reason == "InactiveWorkload":
                workload["spec"]["active"] = False
            workload["status"].pop("admission", None)
            _set_condition(workload, "QuotaReserved", False, "Pending", "couldn't assign flavors to pod set main: "
                           "insufficient unused quota for nvidia.com/gpu in flavor h100, 4 more needed")
            _set_condition(workload, "Admitted", False, "NoReservation", "The workload has no reservation")
            obj = self.jobs[(namespace, job)]
            obj["spec"]["suspend"] = True
            obj["spec"]["template"]["spec"]["nodeSelector"] = obj.pop("_selector_before", {})
            if delete_pods:
                self.delete_pods(job, namespace)

    def delete_pods(self, job: str, namespace: str = "forgeflow") -> None:
        """The Job controller deleting a suspended Job's pods (their grace period over)."""
        for key in [k for k, p in self.pods.items() if k[0] == namespace and
                    p["metadata"]["labels"].get("job-name") == job]:
            del self.pods[key]

    # --- the API --------------------------------------------------------------------------

    def route(self, method: str, parts: list[str], query: dict, body):
        if parts[:2] == ["api", "v1"] and len(parts) >= 5 and parts[2] == "namespaces":
            ns, kind, rest = parts[3], parts[4], parts[5:]
            if kind == "services":
                return self._crud(method, ns, rest, body, self.services, "Service", "V1Service", "v1")
            if kind == "pods" and method == "GET":
                if not rest:
                    return self._list_pods(ns, query)
                if len(rest) == 2 and rest[1] == "log":
                    return self._log(ns, rest[0], query)
        if parts[:3] == ["apis", "batch", "v1"] and len(parts) >= 6 and parts[3] == "namespaces" and parts[5] == "jobs":
            if method == "GET" and len(parts) == 6:
                items = _selected([{k: v for k, v in j.items() if not k.startswith("_")}
                                   for (ns, _), j in sorted(self.jobs.items()) if ns == parts[4]], query)
                return 200, {"kind": "JobList", "apiVersion": "batch/v1", "metadata": {"resourceVersion": "1"},
                             "items": items}, "application/json"
            return self._crud(method, parts[4], parts[6:], body, self.jobs, "Job", "V1Job", "batch/v1")
        if parts[:3] == KUEUE and self.kueue and method == "GET":
            if len(parts) == 6 and parts[3] == "namespaces" and parts[5] == "workloads":
                items = _selected([w for (ns, _), w in sorted(self.workloads.items()) if ns == parts[4]], query)
                return 200, {"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "WorkloadList",
                             "metadata": {"resourceVersion": "1"}, "items": items}, "application/json"
            if len(parts) == 5 and parts[3] == "resourceflavors":
                if not self.flavors_readable:
                    return 403, _status(403, "Forbidden", f'resourceflavors.kueue.x-k8s.io "{parts[4]}" is '
                                        "forbidden: cannot get resource at the cluster scope"), "application/json"
                if parts[4] in self.flavors:
                    return 200, self.flavors[parts[4]], "application/json"
                return 404, _status(404, "NotFound", f'resourceflavors "{parts[4]}" not found'), "application/json"
        return 404, _status(404, "NotFound", f"the server could not find the requested resource ({method} "
                                              f"/{'/'.join(parts)})"), "application/json"

    def _crud(self, method, ns, rest, body, store, kind, model, api_version):
        if method == "POST" and not rest:
            from kubernetes.client import ApiClient

            try:
                ApiClient()._ApiClient__deserialize(body, model)
            except (ValueError, TypeError) as e:
                return 422, _status(422, "Invalid", f"{kind} is invalid: {e}"), "application/json"
            if body.get("kind") != kind or body.get("apiVersion") != api_version:
                return 400, _status(400, "BadRequest", f"expected {api_version} {kind}"), "application/json"
            name = body["metadata"]["name"]
            if (ns, name) in store:
                return 409, _status(409, "AlreadyExists", f'{kind.lower()}s "{name}" already exists'), \
                    "application/json"
            obj = json.loads(json.dumps(body))
            obj["metadata"].update(namespace=ns, uid=str(uuid.uuid4()), resourceVersion="1",
                                   creationTimestamp=_now())
            store[(ns, name)] = obj
            if kind == "Job" and self.kueue and QUEUE_LABEL in (obj["metadata"].get("labels") or {}):
                obj["spec"]["suspend"] = True  # Kueue's webhook: a queued Job starts suspended
                self._create_workload(ns, obj)
            if kind == "Job" and not obj["spec"].get("suspend"):
                self._create_pods(ns, obj)
            return 201, obj, "application/json"
        if method == "GET" and len(rest) == 1:
            if (ns, rest[0]) not in store:
                return 404, _status(404, "NotFound", f'{kind.lower()}s "{rest[0]}" not found'), "application/json"
            return 200, {k: v for k, v in store[(ns, rest[0])].items() if not k.startswith("_")}, "application/json"
        if method == "DELETE" and len(rest) == 1:
            name = rest[0]
            self.deletions.append((kind, name, dict(body or {})))
            if (ns, name) not in store:
                return 404, _status(404, "NotFound", f'{kind.lower()}s "{name}" not found'), "application/json"
            gone = store.pop((ns, name))
            if kind == "Service":  # the API answers a Service's deletion with the object (OpenAPI: V1Service)
                return 200, gone, "application/json"
            if kind == "Job":  # foreground propagation: its pods and its Workload go with it
                self.delete_pods(name, ns)
                for key in [k for k, w in self.workloads.items() if k[0] == ns and
                            w["metadata"]["ownerReferences"][0]["uid"] == gone["metadata"]["uid"]]:
                    del self.workloads[key]
            return 200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                         "details": {"name": name, "kind": kind.lower() + "s"}}, "application/json"
        return 405, _status(405, "MethodNotAllowed", f"{method} not supported here"), "application/json"

    def _create_pods(self, ns: str, job: dict) -> None:
        """The Job controller's part: one pod per completion index, labelled as 1.28+ does."""
        name, template = job["metadata"]["name"], job["spec"]["template"]
        for index in range(job["spec"].get("completions", 1)):
            pod_name = f"{name}-{index}-{uuid.uuid4().hex[:5]}"
            labels = {**template["metadata"].get("labels", {}), "job-name": name, INDEX_LABEL: str(index)}
            spec = json.loads(json.dumps(template["spec"]))
            spec["hostname"] = f"{name}-{index}"
            self.pods[(ns, pod_name)] = {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod_name, "namespace": ns, "labels": labels, "uid": str(uuid.uuid4()),
                             "annotations": {INDEX_LABEL: str(index)}, "creationTimestamp": _now()},
                "spec": spec, "status": {"phase": "Pending"},
            }

    def _create_workload(self, ns: str, job: dict) -> None:
        """Kueue's job controller: the Job's Workload, pending until a test admits it."""
        meta, template = job["metadata"], job["spec"]["template"]
        pod_set = {"name": "main", "count": job["spec"].get("parallelism", 1),
                   "template": json.loads(json.dumps(template))}
        annotations = (template.get("metadata") or {}).get("annotations") or {}
        for key, mode in TOPOLOGY.items():
            if key in annotations:
                pod_set["topologyRequest"] = {mode: annotations[key]}
        name = f"job-{meta['name']}-{uuid.uuid4().hex[:5]}"
        spec = {"queueName": meta["labels"][QUEUE_LABEL], "podSets": [pod_set], "active": True, "priority": 0}
        if PRIORITY_LABEL in meta["labels"]:
            spec.update(priorityClassName=meta["labels"][PRIORITY_LABEL],
                        priorityClassSource="kueue.x-k8s.io/workloadpriorityclass")
        workload = {
            "apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "Workload",
            "metadata": {"name": name, "namespace": ns, "uid": str(uuid.uuid4()), "creationTimestamp": _now(),
                         "labels": {JOB_UID_LABEL: meta["uid"]},
                         "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"],
                                              "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}]},
            "spec": spec, "status": {"conditions": []},
        }
        _set_condition(workload, "QuotaReserved", False, "Pending",
                       f"couldn't assign flavors to pod set main: insufficient unused quota for nvidia.com/gpu "
                       f"in flavor h100, {pod_set['count'] * 4} more needed")
        self.workloads[(ns, name)] = workload

    def _list_pods(self, ns: str, query: dict):
        items = _selected([p for (pns, _), p in sorted(self.pods.items()) if pns == ns], query)
        return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"},
                     "items": items}, "application/json"

    def _log(self, ns: str, name: str, query: dict):
        pod = self.pods.get((ns, name))
        if pod is None:
            return 404, _status(404, "NotFound", f'pods "{name}" not found'), "application/json"
        container = (query.get("container") or [pod["spec"]["containers"][0]["name"]])[0]
        if container not in [c["name"] for c in pod["spec"]["containers"]]:
            return 400, _status(400, "BadRequest", f"container {container} is not valid for pod {name}"), \
                "application/json"
        if not pod["status"].get("containerStatuses"):
            return 400, _status(400, "BadRequest", f'container "{container}" in pod "{name}" is waiting to start: '
                                                   "ContainerCreating"), "application/json"
        return 200, self.logs.get((ns, name), ""), "text/plain"
