"""Where diagnosis keeps what it learns: filter rules per job family (JSON files) and the
learned diagnosis rules (the state database, `LearnedRuleStore`).

Default ``~/.forgeflow/state``; ``$FORGEFLOW_STATE_DIR`` or an explicit ``state_dir``
argument overrides it. Files are written atomically (temp file + rename) so a reader
never sees half a JSON document; rules in the database are added and removed one
transaction each, so processes learning at once all keep their rules.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from infra.atomic_write import atomic_write_json
from infra.statedb.url import state_dir  # noqa: F401 (one rule for every package's state)



_FAMILY_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


def safe_family_name(job_family: str) -> str:
    """Job family names become file names; refuse anything that could escape the dir."""
    if not _FAMILY_OK.match(job_family or ""):
        raise ValueError(
            f"job family {job_family!r} is not a valid name: use 1-200 letters, digits, "
            "'.', '_' or '-', starting with a letter or digit (e.g. the job's config name)"
        )
    return job_family


def write_json_atomic(path: Path, data: object) -> None:
    atomic_write_json(path, data, indent=2)


def read_json(path: Path) -> object | None:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path} is not valid JSON ({exc}); fix or delete it to start from the seeds"
        ) from None


# --------------------------------------------------------------------------- learned diagnosis rules
LEGACY_RULES_FILE = "diagnosis_rules.json"  # before the state database: one JSON file rewritten whole


class LearnedRuleStore:
    """Learned diagnosis rules in the state database (`infra.statedb`), one row per rule.

    Each add or remove is its own transaction, so processes learning at once keep
    every rule (the old JSON file was read once and rewritten whole: the last writer
    won). Rules come back newest first. The database of a state dir is the SQLite
    file in it unless FORGEFLOW_DB_URL names another; nothing is created until the
    first rule is written. A `diagnosis_rules.json` left by an older forgeflow is
    imported once (then renamed `*.imported`).
    """

    def __init__(self, state: str | os.PathLike | None = None, url: str | None = None):
        from infra.statedb.url import database_url

        self.state = state_dir(state)
        self.url = database_url(url, folder=state)
        self._engine = None

    def _exists(self) -> bool:
        if not self.url.startswith("sqlite:///"):
            return True
        return Path(self.url.removeprefix("sqlite:///")).exists()

    def _open(self):
        from infra.statedb import open_state_db

        if self._engine is None:
            self._engine = open_state_db(self.url)
            self._import_legacy()
        return self._engine

    def _import_legacy(self) -> None:
        legacy = self.state / LEGACY_RULES_FILE
        data = read_json(legacy)
        if not isinstance(data, dict):
            return
        with self.transaction() as conn:
            for raw in reversed(data.get("rules", [])):  # the file is newest first; ids grow with age
                self._insert(conn, raw, skip_existing=True)
        os.replace(legacy, legacy.with_name(legacy.name + ".imported"))

    @contextmanager
    def transaction(self) -> Iterator:
        import sqlalchemy as sa
        from infra.statedb import is_postgres, write_transaction

        with write_transaction(self._open()) as conn:
            if is_postgres(conn):  # rule writers one at a time (default names count the rules)
                conn.execute(sa.text("LOCK TABLE diagnosis_rules IN SHARE ROW EXCLUSIVE MODE"))
            yield conn

    @staticmethod
    def _insert(conn, raw: dict, skip_existing: bool = False) -> bool:
        import sqlalchemy as sa
        from infra.statedb.schema import diagnosis_rules as table

        clash = conn.execute(sa.select(table.c.name, table.c.pattern).where(
            sa.or_(table.c.pattern == raw["pattern"], table.c.name == raw["name"]))).first()
        if clash is not None:
            if skip_existing:
                return False
            what = "pattern" if clash.pattern == raw["pattern"] else "name"
            raise ValueError(f"a learned rule with this {what} exists already ({clash.name!r})")
        conn.execute(sa.insert(table).values(name=raw["name"], pattern=raw["pattern"], rule=raw))
        return True

    @staticmethod
    def rows(conn) -> list[dict]:
        import sqlalchemy as sa
        from infra.statedb.schema import diagnosis_rules as table

        return [r for (r,) in conn.execute(sa.select(table.c.rule).order_by(table.c.id.desc()))]

    @staticmethod
    def count(conn) -> int:
        import sqlalchemy as sa
        from infra.statedb.schema import diagnosis_rules as table

        return conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()

    def load(self) -> list[dict]:
        """Every learned rule as stored (newest first); [] when nothing was ever learned."""
        if not self._exists() and not (self.state / LEGACY_RULES_FILE).exists():
            return []
        from infra.statedb import read_transaction

        with read_transaction(self._open()) as conn:
            return self.rows(conn)

    def add(self, make_rule) -> tuple[dict, list[dict]]:
        """Insert `make_rule(learned_count)` (a dict) in one transaction; returns it and all rules after."""
        with self.transaction() as conn:
            raw = make_rule(self.count(conn))
            self._insert(conn, raw)
            return raw, self.rows(conn)
