"""An operator's team commands: `forgeflow cluster team add|list` and `team member add`.

A team has a name and a fair-share weight; its members are database roles, an admin of a team
may change every job of the team (its flows' worker role is one). On PostgreSQL only the operator
role may write these tables (the database refuses anyone else), and a member must be an existing
role. SQLite is single-user: teams are recorded (quotas and fair share use them) but no identity
is checked there.
"""

from __future__ import annotations

import math
import re
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from infra.statedb import write_transaction, read_transaction
from infra.statedb.schema import team_members, teams
from scheduler.orchestrator.config import OrchestratorError

# like a cluster's or a node's name: letters, digits, '.', '_', '-', starting with a letter or digit
_TEAM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
MAX_WEIGHT = 1e6


def check_team_name(name: str) -> None:
    if not _TEAM_NAME.match(name):
        raise OrchestratorError(f"team name {name!r} is not allowed; use letters, digits, '.', '_' or '-' "
                                "(at most 100), starting with a letter or digit")


def add_team(engine: Engine, name: str, weight: float = 1.0) -> dict[str, Any]:
    """Add a team, or set an existing team's weight. Returns {team, weight, previous_weight}."""
    check_team_name(name)
    if not (math.isfinite(weight) and 0 < weight <= MAX_WEIGHT):
        raise OrchestratorError(f"--weight {weight} is not allowed; give a number above 0 and at most "
                                f"{MAX_WEIGHT:g} (a team's share of the cluster is its weight over the sum)")
    with write_transaction(engine) as conn:
        previous = conn.execute(sa.select(teams.c.weight).where(teams.c.name == name)).scalar()
        if previous is None:
            conn.execute(sa.insert(teams).values(name=name, weight=weight))
        else:
            conn.execute(sa.update(teams).where(teams.c.name == name).values(weight=weight))
    return {"team": name, "weight": weight, "previous_weight": previous}


def add_member(engine: Engine, team: str, role: str, *, admin: bool = False) -> dict[str, Any]:
    """Put a database role in a team (or change whether it is the team's admin)."""
    with write_transaction(engine) as conn:
        known = [t for (t,) in conn.execute(sa.select(teams.c.name).order_by(teams.c.name))]
        if team not in known:
            raise OrchestratorError(f"no team named {team!r} (teams: {', '.join(known) or 'none'}); add it first "
                                    f"with `forgeflow cluster team add {team}`")
        if conn.dialect.name == "postgresql" and not conn.execute(
                sa.text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": role}).first():
            raise OrchestratorError(f"no database role named {role!r}; create it first (CREATE ROLE {role} LOGIN "
                                    "PASSWORD '...'), then add it to the team")
        was = conn.execute(sa.select(team_members.c.is_admin).where(
            team_members.c.team == team, team_members.c.member == role)).scalar()
        if was is None:
            conn.execute(sa.insert(team_members).values(team=team, member=role, is_admin=admin))
        else:
            conn.execute(sa.update(team_members).where(team_members.c.team == team, team_members.c.member == role)
                         .values(is_admin=admin))
    return {"team": team, "member": role, "admin": admin, "was_member": was is not None}


def list_teams(engine: Engine) -> dict[str, Any]:
    """Every team with its weight and members (role, admin)."""
    with read_transaction(engine) as conn:
        rows = conn.execute(sa.select(teams.c.name, teams.c.weight).order_by(teams.c.name)).all()
        members = conn.execute(sa.select(team_members.c.team, team_members.c.member, team_members.c.is_admin)
                               .order_by(team_members.c.team, team_members.c.member)).all()
    return {"teams": [{"team": name, "weight": weight,
                       "members": [{"member": m, "admin": a} for t, m, a in members if t == name]}
                      for name, weight in rows]}
