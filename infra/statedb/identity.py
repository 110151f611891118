"""Who a connection to the state database is: on PostgreSQL the database role it connects as
(`current_user`) and whether that role is an operator (its teams are read when needed:
`scheduler.orchestrator.identity.submit_team`).

The operator role's name comes from FORGEFLOW_OPERATOR_ROLE (default `forgeflow_operator`) when
the schema is created (migration 0008 creates the role, NOLOGIN, and the SQL function
`forgeflow_operator_role()` that the row-level security policies consult); an operator grants it
to the roles of the people who run the cluster. SQLite has no roles: it is single-user, every
process is trusted and nothing here applies (`connection_identity` returns None).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection

OPERATOR_ROLE_ENV = "FORGEFLOW_OPERATOR_ROLE"
DEFAULT_OPERATOR_ROLE = "forgeflow_operator"
# a plain PostgreSQL identifier: it is written into the migration's SQL
_ROLE_NAME = re.compile(r"^[a-z_][a-z0-9_$]{0,62}$")


def operator_role(environ=None) -> str:
    """The operator role's name (FORGEFLOW_OPERATOR_ROLE, default forgeflow_operator); ValueError
    for a name that is not a plain lower-case PostgreSQL identifier."""
    environ = os.environ if environ is None else environ
    name = environ.get(OPERATOR_ROLE_ENV) or DEFAULT_OPERATOR_ROLE
    if not _ROLE_NAME.match(name):
        raise ValueError(f"{OPERATOR_ROLE_ENV}={name!r} is not a plain PostgreSQL role name; use lower-case "
                         "letters, digits and '_' (at most 63), starting with a letter or '_'")
    return name


@dataclass(frozen=True)
class DatabaseIdentity:
    """A PostgreSQL connection's role and what the database lets it do."""

    role: str
    operator: bool  # a member of the operator role: sees and changes everything the policies guard
    bypasses_rls: bool  # a superuser or a BYPASSRLS role: row-level security does not apply to it

    @property
    def sees_everything(self) -> bool:
        """Whether every job is visible to it (what a policy pass over the whole queue needs)."""
        return self.operator or self.bypasses_rls


def connection_identity(conn: Connection) -> DatabaseIdentity | None:
    """The role `conn` acts as and its operator standing; None on SQLite (single user)."""
    if conn.dialect.name != "postgresql":
        return None
    role, operator, bypasses = conn.execute(sa.text(
        "SELECT current_user::text, forgeflow_is_operator(), r.rolsuper OR r.rolbypassrls "
        "FROM pg_roles r WHERE r.rolname = current_user")).one()
    return DatabaseIdentity(role, bool(operator), bool(bypasses))
