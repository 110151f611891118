"""Who the caller is to the orchestrator, and the database's refusals as one clear line.

On PostgreSQL the caller is the database role it connects as (`infra.statedb.identity`): a job's
`submitted_by` is that role and its `team` one of the role's teams; the row-level security of
migration 0008 decides what the role may see and change, and a refusal is the database's
(SQLSTATE 42501: "permission denied", "new row violates row-level security policy"), raised here
as `AccessRefused` (an OrchestratorError: the CLI prints one line and exits 2). A row the
policies hide is simply not there for the role: cancelling another team's job finds no job.

On SQLite (single user) the caller is `user@host`, self-declared, and nothing is enforced.
"""

from __future__ import annotations

import getpass
import os
import re
import socket
import weakref

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from infra.statedb import read_transaction
from infra.statedb.identity import DatabaseIdentity, connection_identity, operator_role
from infra.statedb.schema import team_members, teams
from scheduler.orchestrator.config import OrchestratorError

INSUFFICIENT_PRIVILEGE = "42501"
TEAM_ENV = "FORGEFLOW_TEAM"  # `forgeflow submit --team` (its runner inherits it)


class AccessRefused(OrchestratorError):
    """The state database refused the caller's role (its privileges or row-level security)."""


def local_actor() -> str:
    """`user@host`: who a process says it is on SQLite (single user, not checked)."""
    try:
        user = getpass.getuser()
    except Exception:  # no passwd entry in some containers
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


_IDENTITIES: "weakref.WeakKeyDictionary[Engine, DatabaseIdentity | None]" = weakref.WeakKeyDictionary()


def engine_identity(engine: Engine) -> DatabaseIdentity | None:
    """The role an engine connects as (None on SQLite), read once per engine; the engine's
    privilege refusals are raised as AccessRefused from then on."""
    if engine in _IDENTITIES:
        return _IDENTITIES[engine]
    identity = None
    if engine.dialect.name == "postgresql":
        with read_transaction(engine) as conn:
            identity = connection_identity(conn)
        sa.event.listen(engine, "handle_error", _translate_refusal)
    _IDENTITIES[engine] = identity
    return identity


def _translate_refusal(context) -> None:  # noqa: ANN001 - sqlalchemy ExceptionContext
    refusal = refusal_of(context.original_exception)
    if refusal is not None:
        raise refusal from context.sqlalchemy_exception


_TABLE = re.compile(r'(?:for table|policy for table) "?([a-z_]+)"?')
_HINTS = {
    "jobs": "a role submits only as itself for a team it belongs to, and changes only its own jobs or, "
            "as a team admin, its team's (an operator any)",
    "allocations": "GPUs are admitted by the decider (`forgeflow cluster serve` run as an operator); a job's "
                   "lease is renewed or released only by whoever may change the job",
    "nodes": "changing nodes takes the operator role; a flow may only cordon a node its own job holds",
    "gpus": "registering an inventory takes the operator role",
    "clusters": "registering an inventory takes the operator role",
    "teams": "managing teams takes the operator role",
    "team_members": "managing teams takes the operator role",
    "job_launches": "only whoever may change the job records or reads what its nodes run",
}


def refusal_of(exc: BaseException | None) -> AccessRefused | None:
    """AccessRefused for a PostgreSQL privilege refusal (SQLSTATE 42501), else None."""
    orig = getattr(exc, "orig", exc)
    if getattr(orig, "sqlstate", None) != INSUFFICIENT_PRIVILEGE:
        return None
    said = str(orig).strip().splitlines()[0]
    match = _TABLE.search(said)
    hint = _HINTS.get(match.group(1) if match else "", "")
    return AccessRefused(f"the state database refused this: {said}" + (f" ({hint}; the operator role is "
                                                                       f"{operator_role()!r})" if hint else ""))


def submit_team(conn: Connection, identity: DatabaseIdentity | None, requested: str | None) -> str | None:
    """The team a new job is submitted for: `requested` (--team, else FORGEFLOW_TEAM), else the
    role's only team; None while no team is defined (and on SQLite without --team).
    OrchestratorError, before anything is written, for an unknown team, a team the role is not in,
    a role in several teams without --team, or a role in no team once teams exist."""
    requested = requested or os.environ.get(TEAM_ENV) or None
    if identity is None and requested is None:
        return None  # SQLite: single user, no team unless one is named
    known = [t for (t,) in conn.execute(sa.select(teams.c.name).order_by(teams.c.name))]
    if requested is not None and requested not in known:
        listed = ", ".join(known) if known else "none yet"
        raise OrchestratorError(f"unknown team {requested!r} (teams: {listed}); an operator adds it with "
                                f"`forgeflow cluster team add {requested}`")
    if identity is None:  # SQLite: single user, the team is recorded as given
        return requested
    mine = sorted(t for (t,) in conn.execute(sa.select(team_members.c.team).where(
        team_members.c.member == identity.role)))
    if requested is not None:
        if requested not in mine and not identity.sees_everything:
            raise OrchestratorError(f"role {identity.role!r} is not a member of team {requested!r} (its teams: "
                                    f"{', '.join(mine) or 'none'}); an operator adds it with "
                                    f"`forgeflow cluster team member add {requested} {identity.role}`")
        return requested
    if len(mine) == 1:
        return mine[0]
    if len(mine) > 1:
        raise OrchestratorError(f"role {identity.role!r} is in teams {', '.join(mine)}; say which with --team")
    if known and not identity.sees_everything:
        raise OrchestratorError(f"role {identity.role!r} is in no team, so it may not submit; an operator adds it "
                                f"with `forgeflow cluster team member add TEAM {identity.role}` (teams: "
                                f"{', '.join(known)})")
    return None


def acting(actor: str, identity: DatabaseIdentity | None, by: str | None) -> str:
    """Who a change is recorded as made by: on PostgreSQL always the role (a label such as
    "pretrain flow" is kept beside it, never instead of it); on SQLite the label, else user@host."""
    if identity is None:
        return by or actor
    return actor if not by or by == actor else f"{actor} ({by})"


def no_such_job(job_id: int, identity: DatabaseIdentity | None) -> OrchestratorError:
    """The error for a job id the caller cannot see: none exists, or (row-level security) it is
    another team's."""
    if identity is None or identity.sees_everything:
        return OrchestratorError(f"no job with id {job_id}; `forgeflow jobs --all` lists the jobs")
    return OrchestratorError(f"no job with id {job_id} that role {identity.role!r} may see (the state database "
                             "shows a role its own jobs and its teams'); `forgeflow jobs --all` lists them")


def team_for_submit(engine: Engine, identity: DatabaseIdentity | None, requested: str | None) -> str | None:
    """`submit_team` in its own read (none on SQLite when no team is named: single user)."""
    if identity is None and not (requested or os.environ.get(TEAM_ENV)):
        return None
    with read_transaction(engine) as conn:
        return submit_team(conn, identity, requested)
