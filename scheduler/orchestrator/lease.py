"""Holding an admitted job's GPUs: renew the lease in the background, release on every exit.

    with HeldJob(orchestrator, job_id) as held:   # renews every lease_s / 3 (and refreshes the view)
        ...run attempts...                         # held.lost is set if the lease was lost
    # released: finished on a normal exit, failed on an exception, cancelled on
    # KeyboardInterrupt / a cancellation (BaseException that is not an Exception)
    # held.stop_requested: `forgeflow cancel` or a preemption asked the job to stop (read every
    # STOP_CHECK_S)

A process that dies without reaching the `finally` stops renewing; the lease then
expires and the GPUs go back to the pool (see `Orchestrator._expire`).

While the state database cannot be reached the holder keeps its work running and retries
every RETRY_S (at most every lease_s / 3): a renewal that fails is never a reason to stop. Each
failed renewal counts towards the flow's outage (`db`, a StateDbRetry): a job that only trains
alerts once the outage lasts, as a waiting one does. When
the database comes back after an outage longer than a lease, its first writer records an
epoch and no lease is reclaimed until every holder has had a full lease period to renew
(`scheduler.orchestrator.epoch`), so the holder's next retry keeps its GPUs.

The holder renews and releases the admission it entered with (`Admission.attempt`), not
whatever the job id holds now: a holder that stalled past its lease (a long GC pause, a
network partition) finds `lost` set on waking, even where the job was re-queued and
admitted again meanwhile, and its release leaves that newer admission alone. The
pretrain flow's watcher stops the ranks as soon as `lost` is set (the GPUs may already
run another job).
"""

from __future__ import annotations

import logging
import threading
import time

from infra.statedb.retry import OUTAGE_ERRORS, StateDbRetry
from scheduler.orchestrator.config import LeaseLostError
from scheduler.orchestrator.service import Orchestrator

log = logging.getLogger(__name__)

RETRY_S = 2.0  # how soon a holder retries a renewal the database did not take
# How soon a holder sees a stop request (`forgeflow cancel`, a preemption) between renewals: one
# read of the job's row by its primary key, so a preempting job waits seconds, not a renewal period.
STOP_CHECK_S = 2.0


class HeldJob:
    def __init__(self, orchestrator: Orchestrator, job_id: int, *, every_s: float | None = None,
                 db: StateDbRetry | None = None):
        self.orchestrator = orchestrator
        self.db = db or StateDbRetry()  # entering and releasing wait out a database outage
        self.job_id = job_id
        self.every_s = every_s or orchestrator.config.lease_s / 3
        self.attempt: int | None = None  # the admission held (read on entering)
        self.lost: LeaseLostError | None = None
        # `forgeflow cancel`'s request ({"by", "reason", "at"}), read every STOP_CHECK_S: the holder
        # stops its work gracefully and ends the job as cancelled
        self.stop_requested: dict | None = None
        self.outcome: str | None = None  # set to override what the exit decides
        self.reason: str | None = None  # and why, recorded with the job (default: the exception)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _renew_loop(self) -> None:
        wait, failing = self.every_s, 0
        renew_at = time.monotonic() + wait
        while not self._stop.wait(max(0.0, min(renew_at - time.monotonic(), STOP_CHECK_S))):
            if time.monotonic() < renew_at:  # between renewals: only look for a stop request
                try:
                    self.stop_requested = self.orchestrator.stop_request(self.job_id)
                except Exception as e:  # noqa: BLE001 - the renewal that follows handles an outage
                    log.debug("job %s: stop request not read: %s", self.job_id, e)
                continue
            try:
                self._renew()
                if failing:
                    log.warning("lease of job %s renewed again after %d failed tries", self.job_id, failing)
                    self.db.answered(f"job {self.job_id}'s lease renewal")
                wait, failing = self.every_s, 0
                renew_at = time.monotonic() + wait
                self.stop_requested = self.orchestrator.stop_request(self.job_id)
                self._renewed()
            except LeaseLostError as e:
                self._lost(e)
                return
            except Exception as e:  # the database is out of reach: the work goes on, retry soon
                failing += 1
                wait = min(self.every_s, RETRY_S)
                renew_at = time.monotonic() + wait
                if isinstance(e, OUTAGE_ERRORS):  # the flow's one outage: alerted once it lasts
                    self.db.failed(e, f"job {self.job_id}'s lease renewal (its work goes on)")
                if failing == 1 or failing % 10 == 0:
                    log.warning("lease renewal of job %s failed (%d tries so far), its work goes on; "
                                "retrying every %.0f s: %s", self.job_id, failing, wait, e)

    def _renew(self) -> None:
        """One renewal (LeaseLostError when there is nothing left to renew)."""
        self.orchestrator.renew(self.job_id, self.attempt)

    def _renewed(self) -> None:
        # keep this process's view of the cluster near current, so the release at the end
        # replays the last changes instead of reading the whole cluster and queue back
        self.orchestrator.refresh()

    def _lost(self, e: LeaseLostError) -> None:
        self.lost = e
        log.error("job %s lost its GPUs: %s", self.job_id, e)

    def __enter__(self) -> "HeldJob":
        return self.db.call(self._enter, f"job {self.job_id} taking hold of its GPUs")

    def _enter(self) -> "HeldJob":
        admission = self.orchestrator.admission(self.job_id)
        if admission is None:
            raise LeaseLostError(f"job {self.job_id} is queued, not admitted: it holds no GPUs to hold")
        self.attempt, self.lost = admission.attempt, None
        self.orchestrator.renew(self.job_id, self.attempt)
        self.stop_requested = self.orchestrator.stop_request(self.job_id)
        self._thread = threading.Thread(target=self._renew_loop, name=f"lease-{self.job_id}", daemon=True)
        self._thread.start()
        return self

    def pause(self) -> None:
        """Stop renewing (the caller releases or re-queues the job itself)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def hand_back(self) -> None:
        """Stop renewing before the job is placed again (re-queued after a node check, or
        waiting for its re-admission after the lease was lost): the job's next admission is
        this holder's too, so from now until `resume` the exit ends whichever admission the
        job has (a flow that dies while waiting, or just after it was admitted again, leaves
        nothing held by nobody)."""
        self.pause()
        self.attempt = None

    def resume(self, job_id: int | None = None) -> None:
        if job_id is not None:
            self.job_id = job_id
        self._stop = threading.Event()
        self.__enter__()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.pause()
        outcome = self.outcome or ("finished" if exc_type is None else
                                   "failed" if issubclass(exc_type, Exception) else "cancelled")
        why = self.reason if exc is None else f"{type(exc).__name__}: {exc}"[:500]
        try:  # idempotent, so made again through an outage; given up after a lease (it expires then)
            self.db.call(lambda: self.orchestrator.release(self.job_id, outcome=outcome, attempt=self.attempt, reason=why),
                         f"releasing job {self.job_id}", give_up_after_s=self.orchestrator.config.lease_s)
        except Exception as e:  # an outage past that, or the job is gone: never mask the holder's own outcome
            log.warning("releasing job %s: %s", self.job_id, e)


class DelegatedJob(HeldJob):
    """`HeldJob`'s stand-in for a delegated job (`service.DELEGATED`: a site's batch system places
    it): it holds no GPUs here, so there is no GPU lease to lose (`lost` stays None), but its flow
    is alive only while it says so: entering and then every lease_s / 3 it renews the job's
    liveness deadline (`Orchestrator.renew_delegated`: lease_s from now on the database's clock,
    in `jobs.batch`), through an outage as `HeldJob` renews a lease (retried every RETRY_S, the
    outage counted in `db`, the work goes on). A flow that dies stops renewing, and the policy
    pass that reclaims expired leases ends its job once the deadline is grace_s past
    (`Orchestrator._expire`): failed, with why, so `forgeflow jobs` shows no ghost and its run
    directory and checkpoint URL are free again. Between renewals the thread reads the job's stop
    request every STOP_CHECK_S (`forgeflow cancel` reaches the flow through the database, as for a
    held job), and the exit ends the job finished / failed / cancelled as `HeldJob`'s does.

    A flow that only stalled past its deadline (a partition) finds its job ended at its next
    renewal: that reaches it as a stop request (`stop_requested`, "by the orchestrator", which no
    later read of the database's request clears), so it stops the ranks gracefully and launches
    nothing more; its exit then changes nothing (the job already ended)."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - HeldJob's
        self._ended: dict | None = None  # the stop this holder's ended job asks of its flow
        super().__init__(*args, **kwargs)

    @property
    def stop_requested(self) -> dict | None:  # type: ignore[override]
        return self._ended or self._requested

    @stop_requested.setter
    def stop_requested(self, request: dict | None) -> None:
        self._requested = request

    def _enter(self) -> "DelegatedJob":
        self.attempt, self.lost, self._ended = None, None, None
        self._renew()  # OrchestratorError (LeaseLostError) unless the job is delegated
        self.stop_requested = self.orchestrator.stop_request(self.job_id)
        self._thread = threading.Thread(target=self._renew_loop, name=f"delegated-{self.job_id}", daemon=True)
        self._thread.start()
        return self

    def _renew(self) -> None:
        self.orchestrator.renew_delegated(self.job_id)

    def _renewed(self) -> None:  # no view of the cluster to keep: the job is in none
        pass

    def _lost(self, e: LeaseLostError) -> None:
        self._ended = {"by": "the orchestrator", "reason": str(e), "at": time.time()}
        log.error("job %s: %s; stopping its work", self.job_id, e)
