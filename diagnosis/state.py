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
# A rule's owner and review, kept in their own columns (migration 0010), not in its JSON.
REVIEW_FIELDS = ("owner", "job_family", "review", "scope", "reviewed_by", "reviewed_at")


class RuleRightsError(ValueError):
    """The state database refused the caller's role a change to the learned rules (PostgreSQL's
    row-level security of migration 0011: reviewing, editing, deleting and adding a rule by hand
    are the operator role's; another role may only propose a rule for a family of its own job)."""


def _refused(what: str) -> RuleRightsError:
    from infra.statedb.identity import operator_role

    return RuleRightsError(f"the state database refused this role {what}: approving, rejecting, editing or deleting "
                           f"a learned rule and adding one by hand take the operator role ({operator_role()!r}); "
                           "another role may only propose a rule for a job family of its own job")


def _privilege_refusal(exc: BaseException) -> bool:
    return getattr(getattr(exc, "orig", exc), "sqlstate", None) == "42501"   # PostgreSQL: insufficient privilege


def legacy_review(raw: dict) -> dict:
    """The owner and review of a rule stored before rules had them (as migration 0010 sets them):
    a person's applied everywhere and still does; the agent's is proposed, for no family."""
    if isinstance(raw, dict) and raw.get("source") == "user":
        return {"owner": "user (before review states)", "review": "approved", "scope": "global"}
    return {"owner": "agent", "review": "proposed", "scope": "family"}


class LearnedRuleStore:
    """Learned diagnosis rules in the state database (`infra.statedb`), one row per rule.

    Each add or remove is its own transaction, so processes learning at once keep
    every rule (the old JSON file was read once and rewritten whole: the last writer
    won). Rules come back newest first, each with its owner, the job family that learned
    it and its review (`review`: an operator approves or rejects a proposed rule). On
    PostgreSQL the database decides who may (migration 0011; refusals are `RuleRightsError`);
    SQLite is single-user: every process may. The database of a state dir is the SQLite
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
                self._insert(conn, {**raw, **legacy_review(raw)}, skip_existing=True)
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
        review = {k: raw[k] for k in REVIEW_FIELDS if raw.get(k) is not None}
        rule = {k: v for k, v in raw.items() if k not in REVIEW_FIELDS}
        try:
            conn.execute(sa.insert(table).values(name=raw["name"], pattern=raw["pattern"], rule=rule, **review))
        except sa.exc.DBAPIError as exc:
            if _privilege_refusal(exc):
                where = f"job family {raw.get('job_family')}" if raw.get("job_family") else "every job"
                review = raw.get("review", "proposed")
                raise _refused(f"{'an' if review == 'approved' else 'a'} {review} rule for {where}") from None
            raise
        return True

    @staticmethod
    def rows(conn) -> list[dict]:
        """Every rule, newest first, with its owner, family and review (the columns of migration 0010)."""
        import sqlalchemy as sa
        from infra.statedb.schema import diagnosis_rules as table

        columns = [table.c[k] for k in REVIEW_FIELDS]
        return [{**rule, **dict(zip(REVIEW_FIELDS, review))}
                for rule, *review in conn.execute(sa.select(table.c.rule, *columns).order_by(table.c.id.desc()))]

    def review(self, name: str, review: str, *, scope: str | None, by: str) -> dict:
        """Set a learned rule's review (approved | rejected) and, for an approval, its scope
        (family | global; None: as it is, global for a rule of no family); the rule after.
        ValueError naming the rules there are when there is no rule `name`."""
        import time

        import sqlalchemy as sa
        from infra.statedb.schema import diagnosis_rules as table

        if not self._exists():
            raise ValueError(f"no learned rule {name!r}: nothing was learned yet in {self.state}")
        with self.transaction() as conn:
            row = conn.execute(sa.select(table.c.id, table.c.job_family, table.c.scope)
                               .where(table.c.name == name)).first()
            if row is None:
                names = [r["name"] for r in self.rows(conn)]
                raise ValueError(f"no learned rule {name!r}; learned rules: {', '.join(names) or 'none'} "
                                 "(forgeflow rules list --learned)")
            if scope == "family" and row.job_family is None:
                raise ValueError(f"rule {name!r} was learned for no job family: approve it with --global or reject it")
            if conn.dialect.name == "postgresql":   # who reviewed it: the role the database knows
                by = conn.execute(sa.text("SELECT current_user::text")).scalar_one()
            values = {"review": review, "reviewed_by": by, "reviewed_at": time.time()}
            if review == "approved":
                values["scope"] = scope or ("global" if row.job_family is None else row.scope)
            changed = conn.execute(sa.update(table).where(table.c.id == row.id).values(**values)).rowcount
            if changed != 1:   # PostgreSQL's row-level security: the row is not this role's to change
                raise _refused(f"{'an approval' if review == 'approved' else 'a rejection'} of rule {name!r}")
            return next(r for r in self.rows(conn) if r["name"] == name)

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
