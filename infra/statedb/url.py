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


def _state_dir(explicit: str | os.PathLike | None = None) -> Path:
    # The same rule as diagnosis.state.state_dir (which sits above infra and cannot be imported here).
    if explicit is not None:
        return Path(explicit).expanduser()
    env = os.environ.get("FORGEFLOW_STATE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".forgeflow" / "state"


def database_url(explicit: str | None = None, *, state_dir: str | os.PathLike | None = None) -> str:
    """The state database URL: `explicit`, else $FORGEFLOW_DB_URL, else SQLite in the state dir.

    An explicit `state_dir` means "the database of that state dir" and wins over the environment
    (the learned rules of a given state dir live there).
    """
    if explicit:
        return explicit
    if state_dir is None and os.environ.get(DB_URL_ENV):
        return os.environ[DB_URL_ENV]
    return f"sqlite:///{_state_dir(state_dir) / DB_FILE}"
