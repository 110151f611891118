"""The state database's password never appears in an error (they reach Prefect run logs)."""

from __future__ import annotations

import pytest

from infra.statedb.transactions import StateDbError, make_engine, redact

PASSWORD = "S3cret-pw"


@pytest.mark.parametrize("url", [
    f"postgresql+psycopg://forge:{PASSWORD}@db.example:54x/forgeflow",  # a port that is not a number
    f"postgresql+psycopg:/forge:{PASSWORD}@db.example/forgeflow",        # one slash: does not parse
    f"postgresql+psycopg://forge:{PASSWORD}@[::1/forgeflow",            # a broken IPv6 host
    f"postgresql+psycopg://forge:p@{PASSWORD}@db.example:54x/forgeflow",  # '@' in the password
])
def test_an_unparseable_url_is_one_error_without_its_password(url):
    with pytest.raises(StateDbError) as error:
        make_engine(url)
    message = str(error.value)
    assert PASSWORD not in message and "forge:***@db.example" in message.replace("[::1", "db.example")
    assert "is not a database URL" in message and "\n" not in message


def test_redact_keeps_a_parseable_url_readable():
    assert redact(f"postgresql+psycopg://forge:{PASSWORD}@db:5432/ff") == "postgresql+psycopg://forge:***@db:5432/ff"
    assert redact("sqlite:////var/lib/forgeflow/state.db") == "sqlite:////var/lib/forgeflow/state.db"


def test_an_invalid_learned_rule_names_the_database_without_its_password():
    from diagnosis.rules import _validated

    where = f"postgresql+psycopg://forge:{PASSWORD}@db:5432/forgeflow"
    with pytest.raises(ValueError) as error:
        _validated([{"name": "broken", "pattern": "(", "root_cause": "OOM", "restart_helps": False}], where)
    message = str(error.value)
    assert PASSWORD not in message
    assert message.startswith("postgresql+psycopg://forge:***@db:5432/forgeflow: learned rule 'broken' is invalid")
