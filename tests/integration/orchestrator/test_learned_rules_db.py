"""Learned diagnosis rules in the state database: processes learning at once keep every rule."""

from __future__ import annotations

import json
import multiprocessing
import os
import traceback

from diagnosis.rules import DiagnosisLibrary
from infra.statedb import forget_engines

_fork = multiprocessing.get_context("fork")
RULES_EACH = 12


def _learn(url: str, who: str, start) -> None:
    code = 1
    try:
        library = DiagnosisLibrary.load(db_url=url)  # loaded once, like a long-running flow
        start.wait()
        for i in range(RULES_EACH):
            line = f"{who} fault number {i} in module frobnicator"
            library.add_rule(rf"{who} fault number {i} in module", "NVLinkError", True, must_match=[line])
        code = 0
    except BaseException:
        traceback.print_exc()  # the child's reason reaches the test's captured output
    finally:
        os._exit(code)


def test_two_processes_learning_at_once_both_keep_their_rules(state_db_url):
    forget_engines()
    start = _fork.Event()
    procs = [_fork.Process(target=_learn, args=(state_db_url, who, start)) for who in ("alpha", "beta")]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    learned = DiagnosisLibrary.load(db_url=state_db_url).learned
    assert len(learned) == 2 * RULES_EACH and len({r.name for r in learned}) == 2 * RULES_EACH
    assert {r.pattern.split()[0] for r in learned} == {"alpha", "beta"}
    d = DiagnosisLibrary.load(db_url=state_db_url).first_match("beta fault number 3 in module frobnicator")
    assert d is not None and d.root_cause == "NVLinkError"


def test_rules_of_an_older_forgeflow_json_file_are_imported_once(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    old = {"rules": [{"name": "user-ECCError-1", "pattern": "uncorrectable ECC on bank \\d+", "root_cause": "ECCError",
                      "restart_helps": False, "source": "user", "added_at": 1.0}]}
    (state / "diagnosis_rules.json").write_text(json.dumps(old))
    library = DiagnosisLibrary.load(state)
    assert [r.name for r in library.learned] == ["user-ECCError-1"]
    library.add_rule("flux capacitor on bank", "NVLinkError", True)
    assert not (state / "diagnosis_rules.json").exists() and (state / "diagnosis_rules.json.imported").exists()
    assert [r.root_cause for r in DiagnosisLibrary.load(state).learned] == ["NVLinkError", "ECCError"]
