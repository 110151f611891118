"""Riding out a state database outage: wait, retry with backoff, log each wait, alert once it lasts.

A flow's decisions go through the state database: joining the cluster, waiting to be admitted,
being placed again after a node check, recording progress, releasing its GPUs. When the
database does not answer (`StateDbUnreachable`: stopped, restarting, failing over to a standby,
out of connections) the call waits and is made again, with exponential backoff (jittered,
capped at `max_wait_s`), each wait logged; once the outage has lasted `alert_after_s`, one
alert goes out through the flow's notifier (`infra.notify`: Slack, else printed), and one
more when the database answers again. A call that must not hold its caller forever (the
release at a flow's end: a lease nobody renews expires anyway) gives up after
`give_up_after_s` and raises the last error.

Only outages are retried: a bad URL, a schema from a newer forgeflow, an `OrchestratorError`
(the job was cancelled) reach the caller at once. Calls retried must be safe to make again:
reads, waits, and writes that are idempotent (release, renew, cordon) or whose failed
transaction was rolled back.

    db = StateDbRetry(notify=notifier.send, logger=logger, subject="tiny-cpu (job 7)")
    placement = db.call(lambda: admitted_placement(orch, job_id, plans), "waiting for GPUs")
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

import sqlalchemy as sa

from infra.notify import Alert
from infra.statedb.transactions import StateDbUnreachable

T = TypeVar("T")
log = logging.getLogger(__name__)
ALERT_AFTER_ENV = "FORGEFLOW_DB_ALERT_AFTER_S"  # an operator's threshold for the outage alert

# what a call made outside `read_transaction` / `write_transaction` may raise when the database is gone
OUTAGE_ERRORS = (StateDbUnreachable, sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.DisconnectionError)


@dataclass(frozen=True, kw_only=True)
class OutagePolicy:
    """How a call waits out the database: the first wait, doubling up to `max_wait_s` (each
    +-`jitter` so a cluster's flows do not come back in step); an alert once the outage lasts
    `alert_after_s` (a flow's lease period: the point where its GPUs would be at risk were the
    leases not counted from the database's return); give up after `give_up_after_s` (None: never)."""

    first_wait_s: float = 1.0
    max_wait_s: float = 30.0
    jitter: float = 0.2
    alert_after_s: float = 60.0
    give_up_after_s: float | None = None

    def __post_init__(self) -> None:
        if not (0 < self.first_wait_s <= self.max_wait_s):
            raise ValueError(f"first_wait_s ({self.first_wait_s}) must be > 0 and <= max_wait_s ({self.max_wait_s})")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1) (got {self.jitter})")

    @classmethod
    def from_environ(cls, environ: "os._Environ[str] | dict[str, str] | None" = None) -> "OutagePolicy":
        """The default policy, its alert threshold from $FORGEFLOW_DB_ALERT_AFTER_S when set."""
        value = (os.environ if environ is None else environ).get(ALERT_AFTER_ENV)
        if not value:
            return cls()
        try:
            return cls(alert_after_s=float(value), first_wait_s=min(1.0, float(value) or 1.0))
        except ValueError:
            raise ValueError(f"{ALERT_AFTER_ENV}={value!r} is not a number of seconds; e.g. {ALERT_AFTER_ENV}=60") from None

    def wait_s(self, failures: int) -> float:
        """The wait after the `failures`-th failed call in a row (1-based)."""
        base = min(self.max_wait_s, self.first_wait_s * 2 ** (failures - 1))
        return base * (1 + random.uniform(-self.jitter, self.jitter))


class StateDbRetry:
    """Calls made again while the state database is unreachable (see the module docstring).

    One object per flow (or process): its calls share one outage, so a flow whose main thread
    waits for admission and whose lease thread renews alerts once, not once per thread.
    `notify` takes an `Alert` (e.g. `Notifier.send`); None: the outage is only logged."""

    def __init__(self, policy: OutagePolicy | None = None, *, notify: Callable[[Alert], object] | None = None,
                 logger: logging.Logger | logging.LoggerAdapter | None = None, subject: str = "forgeflow",
                 link: str | None = None, sleep: Callable[[float], object] = time.sleep):
        self.policy = policy or OutagePolicy()
        self.notify, self.log, self.subject, self.link, self._sleep = notify, logger or log, subject, link, sleep
        self._lock = threading.Lock()
        self._down_since: float | None = None  # monotonic time of the first failure of this outage
        self._last_error = ""
        self._alerted = False
        self.alerts = 0  # alerts sent (outage + recovery), for tests and reports

    @property
    def down_s(self) -> float:
        """How long the current outage has lasted (0 while the database answers)."""
        with self._lock:
            return 0.0 if self._down_since is None else time.monotonic() - self._down_since

    def call(self, fn: Callable[[], T], what: str, *, give_up_after_s: float | None = None) -> T:
        """`fn()`, made again after each outage error until it answers; `what` names the call in
        the log and the alert ("waiting for GPUs"). `give_up_after_s` overrides the policy's."""
        limit = self.policy.give_up_after_s if give_up_after_s is None else give_up_after_s
        started = time.monotonic()
        failures = 0
        while True:
            try:
                result = fn()
            except OUTAGE_ERRORS as e:
                failures += 1
                waited = time.monotonic() - started
                self.failed(e, what)
                if limit is not None and waited >= limit:
                    self.log.error("state database: %s gave up after %.0f s: %s", what, waited, _one_line(e))
                    raise
                wait = self.policy.wait_s(failures)
                if limit is not None:
                    wait = max(0.0, min(wait, limit - waited))
                self.log.warning("state database unreachable (%s); %s waits %.1f s and retries (attempt %d, "
                                 "down %.0f s)", _one_line(e), what, wait, failures + 1, self.down_s)
                self._sleep(wait)
                continue
            self.answered(what)
            return result

    def failed(self, e: BaseException | str, what: str) -> None:
        """Count one failed call towards the outage (and alert once it lasts): what `call` does
        after each outage error, and what a loop that retries by itself reports through
        (`Orchestrator.wait_admitted`'s `on_unreachable`)."""
        with self._lock:
            now = time.monotonic()
            if self._down_since is None:
                self._down_since = now
            self._last_error = _one_line(e)
            due = not self._alerted and now - self._down_since >= self.policy.alert_after_s
            if due:
                self._alerted = True
            down = now - self._down_since
        if due:
            self._send(Alert(f"{self.subject}: the state database has been unreachable for {down:.0f} s",
                             "error", {"waiting": what, "error": self._last_error[:300],
                                       "what happens": "the flow waits and retries; its jobs keep training"},
                             link=self.link))

    def answered(self, what: str) -> None:
        """The database answered: an outage, if one was counted, is over (said, and alerted if it was)."""
        with self._lock:
            if self._down_since is None:
                return
            down, alerted = time.monotonic() - self._down_since, self._alerted
            self._down_since, self._alerted = None, False
        self.log.warning("state database answers again after %.0f s; %s goes on", down, what)
        if alerted:
            self._send(Alert(f"{self.subject}: the state database answers again after {down:.0f} s",
                             "success", {"resumed": what}, link=self.link))

    def _send(self, alert: Alert) -> None:
        self.alerts += 1
        self.log.error(alert.title) if alert.severity == "error" else self.log.warning(alert.title)
        if self.notify is not None:
            try:
                self.notify(alert)
            except Exception as e:  # noqa: BLE001 - an alert is never worth failing the call for
                self.log.warning("could not send the state database alert: %s", e)


def _one_line(e: BaseException | str) -> str:
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    return first if isinstance(e, str) else f"{type(e).__name__}: {first}"
