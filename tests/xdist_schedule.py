"""How `make test` spreads the suite over its pytest-xdist workers (`-n 3 --dist loadgroup`).

A scheduler of our own (tests/conftest.py returns it from `pytest_xdist_make_scheduler`), not
xdist's loadgroup: that one groups tests by an `@group` suffix its workers write into each test's
node id, and with pytest 9.2 that write no longer takes effect (pytest-dev/pytest-xdist#1386,
open): every test was scheduled alone, so a file's module fixtures (a reference training run, a
Prefect server on PostgreSQL, three pipeline layouts) ran once on each worker, and so did the
local Slurm. Here a test's unit of work is derived from its node id's path on the controller:

- each integration test file is one unit (its module fixtures start once);
- the Slurm tests are one (one local slurmctld/slurmd per machine);
- the flow test files that use the folder's shared Prefect server (`prefect_server`,
  tests/integration/flows/conftest.py) are one, so the server starts once;
- each benchmark smoke (a subprocess of its own) and each unit test is a unit of one.

Units go out longest first (longest-processing-time first), so the short ones fill the end and
the workers finish together. A unit's length is the sum of its tests' durations in the last run
that recorded them (pytest's cache, DURATIONS_KEY; tests/conftest.py records them), else a
guess by kind (GUESS_S: a file that trains or runs flows counts as heavy).
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

DURATIONS_KEY = "forgeflow/test-durations"
# Seconds per test where no earlier run recorded one (a fresh checkout): a benchmark smoke starts
# whole flows and torchrun worlds; an integration test that trains or runs flows ("heavy": its
# file names one of HEAVY_MARKS) tens of seconds, another servers and processes; a unit test little.
GUESS_S = {"benchmark": 40.0, "heavy": 45.0, "integration": 10.0, "unit": 0.5}
HEAVY_MARKS = ("torch.distributed.run", "torchrun", "training.train", "pretrain(", "LocalLauncher",
               "run_deployment", "two_round_check", "prefect_server", "prefect_api")
SHARED_PREFECT_SERVER_GROUP = "tests/integration/flows (shared Prefect server)"


def kind(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    if path.startswith("tests/integration/benchmarks/"):
        return "benchmark"
    return "integration" if path.startswith("tests/integration/") else "unit"


@cache
def _source(root: Path, path: str) -> str:
    try:
        return (root / path).read_text()
    except OSError:
        return ""


def guess_kind(nodeid: str, root: Path) -> str:
    """kind(), with the integration tests whose file trains or runs flows told apart."""
    found = kind(nodeid)
    if found == "integration" and any(mark in _source(root, nodeid.split("::", 1)[0]) for mark in HEAVY_MARKS):
        return "heavy"
    return found


def uses_shared_prefect_server(root: Path, path: str) -> bool:
    """A flow test file whose tests take the folder's shared server (prefect_server or
    use_prefect_server, or test_prefect_deployments' `deployed`/`deployed_once`, which take it)
    and do not start their own (a module fixture named prefect_server, as on PostgreSQL), read
    from its source: the controller does not collect."""
    source = _source(root, path).replace("testing.prefect_server", "")  # the module of that name, not the fixture
    return (re.search(r"\b(use_)?prefect_server\b|\bdeployed(_once)?\s*[,)]|import deployed", source) is not None
            and "def prefect_server(" not in source)


def unit_of(nodeid: str, root: Path) -> str:
    """The unit of work a test belongs to (see the module docstring)."""
    path = nodeid.split("::", 1)[0]
    if kind(nodeid) != "integration":
        return nodeid
    if path.startswith("tests/integration/slurm/"):
        return "tests/integration/slurm"
    if path.startswith("tests/integration/flows/") and uses_shared_prefect_server(root, path):
        return SHARED_PREFECT_SERVER_GROUP
    return path


class GroupedScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with our units (unit_of), handed out longest first."""

    def __init__(self, config, log=None, durations: dict[str, float] | None = None):
        super().__init__(config, log)
        self.root = Path(config.rootpath)
        self.durations = durations or {}

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid, self.root)

    def estimate_s(self, nodeid: str) -> float:
        recorded = self.durations.get(nodeid)
        return recorded if recorded is not None else GUESS_S[guess_kind(nodeid, self.root)]

    def schedule(self) -> None:
        # LoadScopeScheduling.schedule fills self.workqueue in collection order and hands out
        # from its front; keys put in first keep their place when it fills them in, so this
        # sets the order and leaves the rest (checks, assignment) to it.
        if self.collection is None and self.registered_collections and self._check_nodes_have_same_collection():
            lengths: dict[str, float] = {}
            for nodeid in next(iter(self.registered_collections.values())):
                scope = self._split_scope(nodeid)
                lengths[scope] = lengths.get(scope, 0.0) + self.estimate_s(nodeid)
            for scope in sorted(lengths, key=lambda s: -lengths[s]):
                self.workqueue[scope] = {}
        super().schedule()
