"""Evaluation trials as Kubernetes Jobs: the executor's `KubernetesSubmitter`.

    Job eval-<trial>-<run>   (infra.kubernetes.evaluation_job_manifest: one pod, backoffLimit 0,
                              the slot's GPUs as nvidia.com/gpu, the planned GPU type's nodeSelector,
                              a memory-backed /dev/shm, the run volume; with `kubernetes.kueue`
                              created suspended in Kueue's evaluation queue with its priority class)
      └─ python -m evalsuite.trial_job run trial.json result.json   (the same in-job entry as Slurm's)
           └─ evalsuite.trials.run_trial → result.json (atomic), or a traceback in the pod's log

One Job per trial, so the cluster (or Kueue) decides where and when each trial runs; the
executor still starts a slot's next trial only when its last one ended. Metric jobs stay on
this machine's CPU workers, as with the local and Slurm submitters.

The Jobs are watched in one batch: one list call per poll for all of this evaluation's Jobs
(label `forgeflow/eval-run`), their status conditions (Complete, Failed) saying which ended.
While Kueue keeps a Job suspended the trial is waiting, never failed: its Workload's pending
reason is said once per change (`on_waiting`, by default a log line). An eviction by Kueue
(preempted, pods not ready in time) leaves the Job suspended and Kueue requeues it: the trial
waits for its re-admission once, and its new pod skips the shards the evicted one finished
(run_trial resumes); a second eviction, or a deactivated Workload (an operator, or Kueue's
requeue limit), ends the trial with a TrialError saying so, and its Job is deleted. A Job that
fails, or ends without a result file, is reported with its pod's log tail (also copied to
`<trial>.pod.log` in the work folder). `close()` deletes every Job not finished
(propagationPolicy Background: the garbage collector deletes its pods); the runner calls it on
every exit, so an interrupted or failed evaluation leaves no Job behind.

Like the Kubernetes launcher this assumes the work and output folders are on the run volume,
mounted at `kubernetes.run_mount` both here and in the pods (the same paths), and that the
image holds this repository. The model comes from `model_source` (s3://, or a folder on the run
volume); each pod preloads it into its own /dev/shm.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import re
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from evalsuite.errors import EvalConfigError, EvalError, TrialError
from evalsuite.metrics import MetricJob, run_metric_job
from evalsuite.sandbox import Sandbox
from evalsuite.slurm_trials import _future_done, job_trial
from evalsuite.trial_job import K8S_JOB_ENV
from evalsuite.trials import Trial, TrialResult, cuda_indices
from infra.kubernetes import KubernetesSettings, api_client, evaluation_job_manifest
from infra.kueue import (JOB_UID_LABEL, KUEUE_GROUP, KUEUE_VERSION, admission_of, eviction_of, label_value_problem,
                         pending_reason)

log = logging.getLogger(__name__)

OUTPUT_TAIL_CHARS = 3000   # of a failed trial's pod log, in its error
RUN_LABEL = "forgeflow/eval-run"   # every Job of one submitter: listed together, one call per poll
TRIAL_LABEL = "forgeflow/trial"
CONTAINER = "evaluate"             # evaluation_job_manifest's container
MAX_EVICTIONS = 1                  # Kueue requeues an evicted trial once; the next eviction fails it
FINAL = {"Complete", "Failed", "Gone", "Evicted", "Deactivated", "Deleted"}
POLL_S = 2.0   # at most one list of the trial Jobs per this many seconds


def job_name(trial_id: str, run_id: str) -> str:
    """A DNS-1123 name for the trial's Job, unique per evaluation (<= 52 chars: pod names stay <= 63)."""
    base = re.sub(r"[^a-z0-9-]+", "-", f"eval-{trial_id}".lower()).strip("-")
    return f"{base[:52 - len(run_id) - 1].rstrip('-')}-{run_id}"


def trial_gpus(trial: Trial) -> int:
    return len(cuda_indices(trial.devices) or [d for d in trial.devices if d == "cuda"])


def trial_job_manifest(trial: Trial, name: str, settings: KubernetesSettings, trial_file: Path, result_file: Path,
                       run_id: str, gpu_type: str = "cpu") -> dict:
    """The trial's Job: its slot's GPU count as the GPU request (a CPU slot asks for none and
    sees none), pinned to `gpu_type` when it has GPUs; no retry (a failed trial is reported)."""
    gpus = trial_gpus(trial)
    env = {K8S_JOB_ENV: name}
    if not gpus and trial.devices:
        env["CUDA_VISIBLE_DEVICES"] = ""   # a CPU slot never grabs a GPU
    command = [settings.python, "-m", "evalsuite.trial_job", "run", str(trial_file), str(result_file)]
    manifest = evaluation_job_manifest(name, command, settings, gpus=gpus, env=env,
                                       gpu_type=gpu_type if gpus else "cpu")
    manifest["spec"]["backoffLimit"] = 0   # a failed trial is reported to the executor, not silently rerun
    labels = {RUN_LABEL: run_id}
    trial_label = re.sub(r"[^A-Za-z0-9_.-]+", "-", trial.trial_id)[:63].strip("-_.")
    if trial_label and not label_value_problem(trial_label):
        labels[TRIAL_LABEL] = trial_label
    manifest["metadata"]["labels"].update(labels)
    manifest["spec"]["template"]["metadata"]["labels"].update(labels)
    return manifest


class KubernetesTrial:
    """A trial's Job; result() reads the result file the pod wrote."""

    def __init__(self, trial_id: str, name: str, result_path: Path, log_path: Path) -> None:
        self.trial_id, self.name = trial_id, name
        self.result_path, self.log_path = result_path, log_path
        self.uid: str | None = None
        self.state = "Pending"        # Pending, Waiting (suspended), Started, or one of FINAL
        self.why: str | None = None   # why it ended, when not by its pod's exit (Kueue, deleted)
        self.waiting: str | None = None
        self.evictions = 0
        self._admitted_seen = False
        self._eviction_seen: str | None = None

    def final(self) -> bool:
        return self.state in FINAL

    def result(self) -> TrialResult:
        if self.state == "Complete" and self.result_path.exists():
            return TrialResult.model_validate_json(self.result_path.read_text())
        try:
            tail = self.log_path.read_text(errors="replace")[-OUTPUT_TAIL_CHARS:].strip() or "(empty)"
        except OSError:
            tail = "(no pod log)"
        how = f"ended {self.state}" + (f" ({self.why})" if self.why else "")
        raise TrialError(f"trial {self.trial_id}: Kubernetes Job {self.name} {how} without a result; "
                         f"its pod's log ({self.log_path}):\n{tail}")


def _shared(path: str | Path, mount: str) -> bool:
    return Path(path).resolve().is_relative_to(Path(mount).resolve())


class KubernetesSubmitter:
    """Trials as Kubernetes Jobs (queued in Kueue when the settings say so), metric jobs on this
    machine's CPU workers. `on_waiting(trial_id, reason)` hears why a trial waits (None: it runs)."""

    def __init__(self, work_dir: str | Path, settings: KubernetesSettings, metric_workers: int,
                 sandbox: Sandbox | None, gpu_type: str = "cpu", poll_s: float | None = None,
                 on_waiting: Callable[[str, str | None], None] | None = None) -> None:
        self.settings, self.sandbox, self.gpu_type = settings, sandbox, gpu_type
        self.poll_s = POLL_S if poll_s is None else poll_s
        self.work_dir = Path(work_dir).resolve()
        self._check_shared(self.work_dir, "the trial work folder")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.on_waiting = on_waiting or _log_waiting
        try:
            self.api = api_client(settings)
        except RuntimeError as e:   # no kubeconfig, no in-cluster account: nothing can run
            raise EvalError(str(e)) from None
        self.run_id = secrets.token_hex(3)
        self._metrics = cf.ThreadPoolExecutor(max_workers=max(1, metric_workers), thread_name_prefix="metric")
        self.jobs: list[KubernetesTrial] = []
        self.api_calls = 0
        self._polled_at = -1e9

    def _check_shared(self, path: Path, what: str) -> None:
        if not _shared(path, self.settings.run_mount):
            raise EvalConfigError(f"{what} {path} is not under kubernetes.run_mount ({self.settings.run_mount}): the "
                                  "trial pods could not see it. Put the evaluation's output on the run volume "
                                  "(--output under the mount) or set run_mount to where this machine mounts it")

    def submit_trial(self, trial: Trial, on_progress: Callable[[str, int], None] | None) -> KubernetesTrial:
        from kubernetes import client

        self._check_shared(Path(trial.output_dir), f"trial {trial.trial_id}'s output folder")
        source = trial.model_source.removeprefix("file://")
        if source and "://" not in source and not _shared(source, self.settings.run_mount):
            raise EvalConfigError(f"model {trial.model_source} is not under kubernetes.run_mount "
                                  f"({self.settings.run_mount}) nor in object storage: the trial pods could not "
                                  "read it. Evaluate an s3:// copy, or one on the run volume")
        trial_file = self.work_dir / f"{trial.trial_id}.trial.json"
        result_file = self.work_dir / f"{trial.trial_id}.result.json"
        log_file = self.work_dir / f"{trial.trial_id}.pod.log"
        result_file.unlink(missing_ok=True)   # a rerun must not read the last run's result
        log_file.unlink(missing_ok=True)
        trial_file.write_text(job_trial(trial).model_dump_json(indent=1))
        name = job_name(trial.trial_id, self.run_id)
        manifest = trial_job_manifest(trial, name, self.settings, trial_file, result_file, self.run_id,
                                      self.gpu_type)
        try:
            self.api_calls += 1
            created = client.BatchV1Api(self.api).create_namespaced_job(self.settings.namespace, manifest)
        except client.ApiException as e:   # no rights, no namespace, a quota: the plan cannot run
            raise EvalError(f"trial {trial.trial_id}: Kubernetes refused Job {name} in namespace "
                            f"{self.settings.namespace} ({e.status} {e.reason}): {(e.body or '')[:500]}") from e
        (self.work_dir / f"{trial.trial_id}.k8s-job").write_text(name)
        handle = KubernetesTrial(trial.trial_id, name, result_file, log_file)
        handle.uid = created.metadata.uid
        self.jobs.append(handle)
        return handle

    def submit_metric(self, job: MetricJob) -> cf.Future:
        return self._metrics.submit(run_metric_job, job, self.sandbox)

    # --- watching -----------------------------------------------------------------------

    def _say(self, handle: KubernetesTrial, reason: str | None) -> None:
        if reason != handle.waiting:
            handle.waiting = reason
            self.on_waiting(handle.trial_id, reason)

    def refresh(self, force: bool = False) -> None:
        """Read this evaluation's Jobs (one list call), at most every poll_s; with Kueue, the
        Workloads of the suspended ones (one more list call) for why they wait."""
        from kubernetes import client

        pending = [j for j in self.jobs if not j.final()]
        if not pending or (not force and time.monotonic() - self._polled_at < self.poll_s):
            return
        self._polled_at = time.monotonic()
        self.api_calls += 1
        found = {j.metadata.name: j for j in client.BatchV1Api(self.api).list_namespaced_job(
            self.settings.namespace, label_selector=f"{RUN_LABEL}={self.run_id}").items}
        suspended = []
        for handle in pending:
            job = found.get(handle.name)
            if job is None:
                handle.state, handle.why = "Gone", "the Job was deleted outside this evaluation"
                continue
            done = {c.type: c for c in (job.status.conditions or []) if c.status == "True"} if job.status else {}
            if "Complete" in done:
                handle.state = "Complete"
            elif "Failed" in done:
                handle.state = "Failed"
                handle.why = f"{done['Failed'].reason}: {done['Failed'].message}" if done["Failed"].reason else None
            elif job.spec.suspend:
                handle.state = "Waiting"
                suspended.append(handle)
            else:
                handle.state, handle._admitted_seen = "Started", True
                self._say(handle, None)
        if suspended:
            self._why_suspended(suspended)
        for handle in pending:
            if handle.final():
                self._say(handle, None)
                if not (handle.state == "Complete" and handle.result_path.exists()):
                    self._capture_log(handle)

    def _workloads(self) -> list[dict]:
        from kubernetes import client

        self.api_calls += 1
        try:
            return client.CustomObjectsApi(self.api).list_namespaced_custom_object(
                KUEUE_GROUP, KUEUE_VERSION, self.settings.namespace, "workloads").get("items") or []
        except client.ApiException as e:
            if e.status == 404:
                raise EvalError(f"the cluster file queues Jobs in Kueue (kubernetes.kueue), but the API server serves "
                                f"no {KUEUE_GROUP}/{KUEUE_VERSION} workloads: install Kueue, or remove the 'kueue:' "
                                "part (the trial Jobs would stay suspended)") from None
            if e.status == 403:
                raise EvalError(f"this identity may not list workloads.{KUEUE_GROUP} in namespace "
                                f"{self.settings.namespace}: grant get/list on them (README, Kubernetes)") from None
            raise

    def _why_suspended(self, handles: list[KubernetesTrial]) -> None:
        kueue = self.settings.kueue
        if kueue is None:
            for h in handles:
                self._say(h, f"Job {h.name} is suspended (spec.suspend) and no Kueue is configured to admit it")
            return
        queue = kueue.evaluation_queue_name or kueue.queue_name
        by_uid: dict[str, dict] = {}
        for w in sorted(self._workloads(), key=lambda w: w["metadata"].get("creationTimestamp") or ""):
            by_uid[(w["metadata"].get("labels") or {}).get(JOB_UID_LABEL, "")] = w
        for h in handles:
            workload = by_uid.get(h.uid or "")
            if workload is None:
                self._say(h, f"waiting in Kueue: no Workload for Job {h.name} yet (queue {queue}; Kueue makes one "
                             "for a Job whose namespace it manages)")
                continue
            wname = workload["metadata"]["name"]
            evicted = next((c for c in (workload.get("status") or {}).get("conditions") or []
                            if c.get("type") == "Evicted" and c.get("status") == "True"), None)
            if evicted is not None and (h._admitted_seen or evicted.get("lastTransitionTime") != h._eviction_seen):
                h.evictions += 1   # a new eviction (seen admitted since the last one, or a new condition)
                h._admitted_seen, h._eviction_seen = False, evicted.get("lastTransitionTime")
                if h.evictions > MAX_EVICTIONS and (workload.get("spec") or {}).get("active") is not False:
                    h.state = "Evicted"
                    h.why = (f"{eviction_of(workload, wname)}; evicted {h.evictions} times, the trial is not "
                             "requeued again")
                    self._delete(h)
                    continue
            if (workload.get("spec") or {}).get("active") is False:
                h.state = "Deactivated"
                h.why = eviction_of(workload, wname) if evicted is not None else pending_reason(workload)
                self._delete(h)
                continue
            if admission_of(workload) is not None:
                self._say(h, f"admitted by Kueue (workload {wname}), starting")
            elif evicted is not None:
                self._say(h, f"{eviction_of(workload, wname)}; requeued, waiting for Kueue to admit it again: "
                             f"{pending_reason(workload)}")
            else:
                self._say(h, f"waiting in Kueue: {pending_reason(workload)} (workload {wname}, queue {queue})")

    def _capture_log(self, handle: KubernetesTrial) -> None:
        """Copy the newest pod's log of the Job to `<trial>.pod.log` (what a failed trial reports)."""
        from kubernetes import client

        core = client.CoreV1Api(self.api)
        try:
            self.api_calls += 1
            pods = core.list_namespaced_pod(self.settings.namespace, label_selector=f"job-name={handle.name}").items
            if not pods:
                text = "(no pod left to read a log from)"
            else:
                pod = max(pods, key=lambda p: p.metadata.creation_timestamp.timestamp()
                          if p.metadata.creation_timestamp else 0.0)
                self.api_calls += 1
                text = core.read_namespaced_pod_log(pod.metadata.name, self.settings.namespace, container=CONTAINER)
        except client.ApiException as e:
            text = f"(no pod log: {e.status} {e.reason})"
        handle.log_path.write_text(text or "")

    def wait_first(self, handles: list[Any]) -> Any:
        """The first handle done: a trial's Job (ended) or a metric job's future."""
        futures = [f for h in handles if isinstance(f := getattr(h, "wrapped_future", h), cf.Future)]
        while True:
            self.refresh()
            for h in handles:   # the plan's order among those done
                if h.final() if isinstance(h, KubernetesTrial) else _future_done(h):
                    return h
            wait_s = max(0.05, self.poll_s - (time.monotonic() - self._polled_at))
            if futures:
                cf.wait(futures, timeout=wait_s, return_when=cf.FIRST_COMPLETED)
            else:
                time.sleep(wait_s)

    # --- ending ---------------------------------------------------------------------------

    def _delete(self, handle: KubernetesTrial) -> None:
        from kubernetes import client

        body = client.V1DeleteOptions(propagation_policy="Background")   # the GC deletes its pods
        try:
            self.api_calls += 1
            client.BatchV1Api(self.api).delete_namespaced_job(handle.name, self.settings.namespace, body=body)
        except client.ApiException as e:
            if e.status != 404:
                raise

    def cancel(self) -> list[str]:
        """Delete every Job not yet ended (its pods with it); returns their names."""
        try:
            self.refresh(force=True)
        except Exception as e:   # cannot read them: delete every one not known to have ended
            log.warning("could not read the trial Jobs before deleting them: %s", e)
        live = [j for j in self.jobs if not j.final()]
        for handle in live:
            self._delete(handle)
            handle.state, handle.why = "Deleted", "the evaluation stopped"
        return [j.name for j in live]

    def close(self) -> None:
        try:
            self.cancel()   # nothing on a finished plan; everything outstanding on an interrupted one
        finally:
            self._metrics.shutdown(wait=True, cancel_futures=True)
            self.api.close()


def _log_waiting(trial_id: str, reason: str | None) -> None:
    if reason:
        log.info("trial %s: %s", trial_id, reason)


def pod_preload_path(model_source: str, suite: Any) -> Path:
    """Where a trial's pod copies the model with the policy's preload (its own /dev/shm: nothing
    is preloaded on the submitting machine for pods elsewhere): the suite's preload_root there."""
    from evalsuite.preload import preload_key

    return Path(suite.preload_root or "/dev/shm/forgeflow-eval") / preload_key(model_source)
