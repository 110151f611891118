"""Which state database: the URL alone, without importing SQLAlchemy.

Kept apart from `transactions` because callers that only need the path (the diagnose CLI works
out where the learned rules live at start-up) should not pay SQLAlchemy + Alembic's import
time; the engine is built only when the database is really opened.
"""

from __future__ import annotations

import os
from pathlib import Path

DB_URL_ENV = "FORGEFLOW_DB_URL"
DB_FILE = "forgeflow.db"


def state_dir(explicit: str | os.PathLike | None = None) -> Path:
    """forgeflow's state directory (learned rules, the SQLite state database, evaluation runtime
    history): `explicit`, else $FORGEFLOW_STATE_DIR, else ~/.forgeflow/state."""
    if explicit is not None:
        return Path(explicit).expanduser()
    env = os.environ.get("FORGEFLOW_STATE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".forgeflow" / "state"


def database_url(explicit: str | None = None, *, folder: str | os.PathLike | None = None) -> str:
    """The state database URL: `explicit`, else $FORGEFLOW_DB_URL, else SQLite in the state dir.

    An explicit `folder` (a state dir) means "the database of that state dir" and wins over the environment
    (the learned rules of a given state dir live there).
    """
    if explicit:
        return explicit
    if folder is None and os.environ.get(DB_URL_ENV):
        return os.environ[DB_URL_ENV]
    return f"sqlite:///{state_dir(folder) / DB_FILE}"
