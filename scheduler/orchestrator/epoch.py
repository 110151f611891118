"""The outage epoch: after the state database was out of reach, every lease holder gets a full
lease period to renew before any lease is reclaimed.

Holders keep training while the database is down (they cannot renew), so when it comes back
every lease looks expired. The control plane therefore records its own liveness in the
one-row `control_plane` table (migration 0007), on the database's clock: `seen_at` is the last
time a writer reached the database (renewals, the decider's beat, a reclaiming pass, a waiting
job's poll when nobody else wrote lately), refreshed at most every `touch_every_s`. A writer
that finds `seen_at` older than `gap_s` is the first after a gap: it records `epoch_at` (now)
and `gap_s` (how long the gap was). A lease is then reclaimed only once

    max(lease_expires_at, epoch_at + lease_s) + grace_s < now

i.e. expiry counts from max(last renewal, epoch). A gap is a fraction of a lease (a healthy
holder renews every lease_s / 3), so an outage long enough to have cost a holder its lease is
always seen; a gap in a quiet cluster (nobody writing, nobody waiting) delays the reclaim of a
lease whose holder died during it by at most one lease period.

An epoch is logged as a warning only where a job held GPUs (running, or delegated to a batch
system) when it was recorded: their holders could not renew. A gap in a quiet cluster is no
outage anyone felt, and the first `forgeflow submit` after an idle night must not tell its user
that the database was out of reach: that one is logged at info.
"""

from __future__ import annotations

import logging

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from infra.statedb.clock import db_now
from infra.statedb.schema import control_plane, jobs

log = logging.getLogger(__name__)


def gap_s(lease_s: float) -> float:
    """No writer for this long is a gap (an outage): the next writer records an epoch."""
    return lease_s / 2


def touch_every_s(lease_s: float) -> float:
    """`seen_at` is refreshed at most this often (one row every writer touches)."""
    return min(1.0, lease_s / 8)


def keepalive_after_s(lease_s: float) -> float:
    """A waiting job's poll writes `seen_at` itself once nobody else did for this long."""
    return lease_s / 4


def reclaim_at(lease_expires_at: float, epoch_at: float | None, lease_s: float, grace_s: float) -> float:
    """When a lease that runs out at `lease_expires_at` may be reclaimed, given the last epoch."""
    start = lease_expires_at if epoch_at is None else max(lease_expires_at, epoch_at + lease_s)
    return start + grace_s


_ROW = control_plane.c.id == 1
_STALE = sa.or_(control_plane.c.seen_at.is_(None), control_plane.c.seen_at < db_now() - sa.bindparam("every"))
# (a database nobody wrote to yet has no gap: a fresh one holds no leases)
_IS_GAP = sa.and_(control_plane.c.seen_at.isnot(None), db_now() - control_plane.c.seen_at > sa.bindparam("gap"))
_TOUCHED = dict(epoch_at=sa.case((_IS_GAP, db_now()), else_=control_plane.c.epoch_at),
                gap_s=sa.case((_IS_GAP, db_now() - control_plane.c.seen_at), else_=control_plane.c.gap_s),
                seen_at=db_now())
_RETURNED = (control_plane.c.seen_at, control_plane.c.epoch_at, control_plane.c.gap_s)
# A reclaimer waits for the row (it must see an epoch another writer is recording right now).
TOUCH = sa.update(control_plane).where(_ROW, _STALE).values(**_TOUCHED).returning(*_RETURNED)
# A renewal does not: whoever holds the row is recording the same liveness (FOR UPDATE SKIP
# LOCKED on PostgreSQL; SQLite's single writer never finds it locked).
TOUCH_UNLESS_BUSY = sa.update(control_plane).where(control_plane.c.id.in_(
    sa.select(control_plane.c.id).where(_ROW, _STALE).with_for_update(skip_locked=True))
).values(**_TOUCHED).returning(*_RETURNED)
STATE = sa.select(db_now(), *_RETURNED).where(_ROW)
# Whether any job holds GPUs (a lease, or a batch system's allocation its flow renews for)
HELD = sa.select(jobs.c.id).where(jobs.c.state.in_(("running", "delegated"))).limit(1)


def touch_params(lease_s: float) -> dict[str, float]:
    return {"every": touch_every_s(lease_s), "gap": gap_s(lease_s)}


def noted(rows: list[tuple], conn: Connection | None = None) -> None:
    """Log an epoch a touch (its RETURNING rows) just recorded: a warning where a job holds GPUs
    (asked on `conn`; without one, the writer is a holder renewing), else at info."""
    for seen_at, epoch_at, gap in rows:
        if epoch_at is not None and epoch_at == seen_at and gap is not None:
            if conn is None or conn.execute(HELD).first() is not None:
                log.warning("the state database was out of reach for %.0f s: no lease is reclaimed until "
                            "every holder has had a full lease period to renew (epoch %.3f)", gap, epoch_at)
            else:
                log.info("no writer reached the state database for %.0f s, and no job holds GPUs: a quiet "
                         "cluster (epoch %.3f)", gap, epoch_at)


def touch(conn: Connection, lease_s: float, *, wait: bool = True) -> float | None:
    """Record that a writer reached the database (and an epoch after a gap); the current epoch."""
    rows = conn.execute(TOUCH if wait else TOUCH_UNLESS_BUSY, touch_params(lease_s)).all()
    noted(rows, conn)
    if rows:
        return rows[0][1]
    return conn.execute(sa.select(control_plane.c.epoch_at).where(_ROW)).scalar()
