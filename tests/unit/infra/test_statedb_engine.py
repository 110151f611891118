"""The engine's connection budget and PgBouncer-safe settings, multi-host URLs, the outage policy's knobs."""

from __future__ import annotations

import pytest

from infra.statedb.retry import ALERT_AFTER_ENV, OutagePolicy
from infra.statedb.transactions import POOL_OVERFLOW, POOL_SIZE, make_engine


def test_one_small_pool_per_process_without_server_side_prepared_statements():
    engine = make_engine("postgresql+psycopg://forge@db.example:5432/forgeflow")
    assert (engine.pool.size(), engine.pool._max_overflow) == (POOL_SIZE, POOL_OVERFLOW) == (2, 2)
    # what create_engine hands psycopg.connect besides the URL's own parameters
    seen: dict = {}
    engine.dialect.connect = lambda *a, **kw: seen.update(kw)  # record instead of connecting
    engine.pool._creator()
    assert seen["prepare_threshold"] is None  # PgBouncer's transaction pooling needs this
    assert seen["connect_timeout"] == 10


def test_a_multi_host_url_gives_libpq_its_host_and_port_lists():
    for url in ("postgresql+psycopg://forge@/ff?host=a:5432,b:5433&target_session_attrs=read-write",
                "postgresql+psycopg://forge@/ff?host=a:5432&host=b:5433&target_session_attrs=read-write"):
        engine = make_engine(url)
        _, kwargs = engine.dialect.create_connect_args(engine.url)
        assert (kwargs["host"], kwargs["port"], kwargs["target_session_attrs"]) == ("a,b", "5432,5433", "read-write")
    engine = make_engine("postgresql+psycopg://forge@/ff?host=/run/postgresql")  # one socket folder: as given
    assert engine.dialect.create_connect_args(engine.url)[1]["host"] == "/run/postgresql"


def test_the_outage_policy_backs_off_and_reads_its_alert_threshold_from_the_environment():
    policy = OutagePolicy(first_wait_s=1, max_wait_s=8, jitter=0)
    assert [policy.wait_s(n) for n in range(1, 6)] == [1, 2, 4, 8, 8]
    assert OutagePolicy.from_environ({}).alert_after_s == 60
    assert OutagePolicy.from_environ({ALERT_AFTER_ENV: "5"}).alert_after_s == 5
    with pytest.raises(ValueError, match=f"{ALERT_AFTER_ENV}='soon' is not a number of seconds"):
        OutagePolicy.from_environ({ALERT_AFTER_ENV: "soon"})
    with pytest.raises(ValueError, match="first_wait_s"):
        OutagePolicy(first_wait_s=0)
