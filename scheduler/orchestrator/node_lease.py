"""A node's look at its job's lease in the state database (infra.lease_guard says why nodes look).

    lease = NodeLease(orchestrator.engine, lease_s, job_id, node, attempt)   # attempt: the admission it runs
    LeaseGuard(lease.look, look_every_s(lease_s), on_gone=...).start()

The job's lease on this node is gone when the orchestrator's own record says so:

- the job is no longer running (finished, failed, cancelled, or queued again after a reclaim);
- it was admitted again since the admission this node runs (`jobs.attempts` moved on);
- none of its GPUs on this node is still allocated to it (released or reclaimed);
- or its lease ran out under the orchestrator's expiry rule (scheduler/orchestrator/epoch.py,
  `reclaim_at`): expiry counts from max(last renewal, outage epoch). The node stops its ranks
  when the lease runs out, `grace_s` before the orchestrator may reclaim the GPUs, so the ranks
  are gone (their graceful stop takes the launcher's grace at most) before another job gets them.

A look that does not reach the database is unknown, never gone. Each look also records that
someone reached the database (`epoch.touch`, as every writer does): a node that is the first to
come back after an outage records the epoch, so it never mistakes the outage for an expiry, and
in a quiet cluster whose only writer was the dead holder no false gap delays the verdict.
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from infra.lease_guard import LeaseLook
from infra.statedb import write_transaction
from infra.statedb.clock import db_now
from infra.statedb.schema import allocations, jobs
from scheduler.orchestrator import epoch


@dataclass(frozen=True)
class LeaseReading:
    """What the state database says of one job on one node, at `now` (the database's clock)."""

    state: str | None  # the job's state (None: no such job)
    attempts: int  # the job's admissions so far
    live_gpus: int  # its GPUs on this node not released
    lease_expires_at: float | None  # the earliest lease of those
    epoch_at: float | None  # the control plane's last outage epoch
    now: float


def judge(reading: LeaseReading, attempt: int, node: str, lease_s: float) -> LeaseLook:
    """Whether admission `attempt` of the job still holds its GPUs on `node`."""
    if reading.state is None:
        return LeaseLook(False, "the job is gone from the state database")
    if reading.state != "running":
        return LeaseLook(False, f"the job is {reading.state}, it holds no GPUs")
    if reading.attempts != attempt:
        return LeaseLook(False, f"the job was admitted again (admission {reading.attempts}; this node runs "
                                f"admission {attempt}): its GPUs here may run another job")
    if reading.live_gpus == 0 or reading.lease_expires_at is None:
        return LeaseLook(False, f"its GPUs on {node} were released or reclaimed")
    expires = epoch.reclaim_at(reading.lease_expires_at, reading.epoch_at, lease_s, grace_s=0.0)
    if reading.now >= expires:
        return LeaseLook(False, f"its lease ran out {reading.now - expires:.0f} s ago and its holder (the "
                                "job's flow) did not renew it: the orchestrator gives the GPUs away after its grace")
    return LeaseLook(True, runs_out_in_s=expires - reading.now)


class NodeLease:
    """The lease of admission `attempt` of job `job_id` as node `node` sees it in the database
    (`engine`: the orchestrator's; `lease_s`: its lease period, for the outage epoch)."""

    def __init__(self, engine: Engine, lease_s: float, job_id: int, node: str, attempt: int):
        self.engine = engine
        self.lease_s = lease_s
        self.job_id = job_id
        self.node = node
        self.attempt = attempt

    def read(self) -> LeaseReading:
        with write_transaction(self.engine) as conn:
            epoch_at = epoch.touch(conn, self.lease_s, wait=False)
            job = conn.execute(sa.select(jobs.c.state, jobs.c.attempts, db_now()).where(
                jobs.c.id == self.job_id)).one_or_none()
            live, earliest = conn.execute(sa.select(sa.func.count(), sa.func.min(allocations.c.lease_expires_at)).where(
                allocations.c.job_id == self.job_id, allocations.c.node == self.node,
                allocations.c.released_at.is_(None))).one()
            now = job[2] if job is not None else conn.execute(sa.select(db_now())).scalar()
        return LeaseReading(job[0] if job else None, job[1] if job else 0, int(live), earliest, epoch_at, float(now))

    def look(self) -> LeaseLook:
        try:
            reading = self.read()
        except Exception as e:  # out of reach, failing over, refused: it confirms nothing
            return LeaseLook(None, f"the state database did not answer ({type(e).__name__}: {str(e)[:200]})")
        return judge(reading, self.attempt, self.node, self.lease_s)
