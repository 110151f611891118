"""Blind accuracy on the real failure logs, reproduced from git history.

    .venv/bin/python benchmarks/diagnosis_blind.py              # batches 5 and later
    .venv/bin/python benchmarks/diagnosis_blind.py --from-batch 1

Each batch of ``benchmarks/data/real_failure_logs`` was committed, labelled, before it was
first scored, and ``batches.json`` records the commit it was collected at
(``collected_before``): the diagnosis code of that commit had never seen the batch. This
script scores every batch with *that* code, not today's: it extracts the commit's tree
(``git archive``) into a temporary folder and runs ``diagnosis.api.diagnose_log`` from it, in
a subprocess, on today's copy of the batch's logs and labels (the labels may have been
corrected since, e.g. a kind the vocabulary fixes; the logs are never edited), rules only
(no agent: the path whose history the corpus README tabulates). It reports per batch and
pooled over batches 5 and later, each with 95 % Wilson intervals.

Why this is the honest figure: ``diagnosis_accuracy.py`` scores every batch with today's
rules, which were written from batches 1-14 after each was scored, so its ``real_*`` keys
say how well the rules fit logs they were written from. A batch scored with the code of its
own ``collected_before`` commit is what a team would have seen on failures nobody had
written a rule for yet. Until now those figures lived only in the README, added up by hand
(where two denominators had already slipped); here they come from the commits themselves.
The baseline a reviewer would compare with is the same code on its own older batches, i.e.
``real_batchN_rules_*`` of ``diagnosis_accuracy.py``: the gap between the two is how much of
today's score is fitted.

What a team can trust unattended: a rules answer other than ``Unknown`` drives the restart,
cordon and stop decisions by itself, while an ``Unknown`` goes to a person (the failure alert
asks for ``forgeflow diagnose --confirm``; the recovery table restarts it in place under the
circuit breaker). So next to plain accuracy the script reports, per batch and pooled, the
share of logs the rules answered (``answered``) and how often an answer was right
(``root_cause_when_answered``, ``restart_when_answered``): the precision of the decisions the
rules take alone, the figure to weigh against a person's time spent on the Unknowns. Answers
are also split by the kind of rule that gave them: one that names a cause (an NCCL timeout, an
ECC error...) or a generic seed that only names the Python exception's class (``RuntimeError:``
-> RuntimeError), whose answer is right only when the exception's class is the cause.

Needs the repository's history (a shallow clone cannot reproduce old commits: the script
says so and exits 2). Last line: JSON with ``blind_batches``, ``blind_logs``,
``blind_pooled_root_cause`` / ``_kind`` / ``_restart`` and their ``_ci95_low``/``_high``,
``blind_pooled_answered`` / ``_root_cause_when_answered`` (with CI) / ``_restart_when_answered``,
``blind_pooled_specific_rule_*`` / ``blind_pooled_generic_rule_*`` (answers and their root-cause
accuracy, by rules that name a cause and by those that only name an exception class),
``blind_latest_batch`` and its figures, and ``blind_batchN_*`` per batch (HEADLINE_KEYS: those
every run prints). ``--smoke`` scores the latest batch alone (one old tree): seconds, the same
code path and keys, not the pooled figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.headline import checked_headline  # noqa: E402

CORPUS = REPO / "benchmarks" / "data" / "real_failure_logs"
POOLED_FROM = 5  # as diagnosis_accuracy.py: the batches collected under the written protocol
# The seed rules that only name a Python exception's class ("RuntimeError: ..." -> RuntimeError),
# diagnosis.rules._GENERIC_SEEDS, the same set (and confidence 0.7 against 0.9) in every commit
# since batch 5's: their answers are reported apart from the rules that name a cause.
HEADLINE_KEYS = (
    "blind_batches", "blind_logs", "blind_pooled_root_cause", "blind_pooled_kind", "blind_pooled_restart",
    "blind_pooled_root_cause_ci95_low", "blind_pooled_root_cause_ci95_high", "blind_pooled_answered",
    "blind_pooled_root_cause_when_answered", "blind_pooled_restart_when_answered",
    "blind_pooled_specific_rule_answers", "blind_pooled_specific_rule_root_cause",
    "blind_pooled_generic_rule_answers", "blind_pooled_generic_rule_root_cause",
    "blind_latest_batch", "blind_latest_logs", "blind_latest_root_cause", "blind_latest_kind", "blind_latest_restart",
)
GENERIC_RULES = frozenset({"runtime", "value", "assertion", "attribute", "os", "type", "key", "index"})

# Runs inside the old tree (cwd = that tree): only the API every commit since the layout
# issue has, diagnose_log(path, state_dir=...) -> Diagnosis.
_SCORER = """
import json, sys
from diagnosis.api import diagnose_log
state, paths = sys.argv[1], sys.argv[2:]
out = {}
for path in paths:
    d = diagnose_log(path, state_dir=state)
    out[path] = [d.root_cause, d.kind, bool(d.restart_helps), d.rule_name]
print(json.dumps(out))
"""


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def extract(commit: str, into: Path) -> Path:
    """The tree of ``commit`` (code only: the corpus and tests are left out) in ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    archive = into / "tree.tar"
    with open(archive, "wb") as out:
        done = subprocess.run(["git", "archive", "--format=tar", commit], cwd=REPO, stdout=out, stderr=subprocess.PIPE)
    if done.returncode != 0:
        raise SystemExit(f"error: git cannot read commit {commit} ({done.stderr.decode().strip()}); "
                         "this needs the full history: run it in a full clone (git fetch --unshallow)")
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers()
                   if not m.name.startswith(("benchmarks/data/", "tests/", "configs/"))]
        tar.extractall(into, members=members, filter="data")
    archive.unlink()
    return into


def score_batch(commit: str, logs: list[Path], workdir: Path) -> dict[str, list]:
    tree = extract(commit, workdir / f"tree-{commit}")
    state = workdir / f"state-{commit}"  # learned rules, caches: nothing of the user's is read or written
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(tree), FORGEFLOW_STATE_DIR=str(state), HF_HUB_OFFLINE="1", FORGEFLOW_NATIVE="0")
    done = subprocess.run(
        [sys.executable, "-c", _SCORER, str(state), *map(str, logs)],
        cwd=tree, env=env, capture_output=True, text=True,
    )
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise SystemExit(f"error: the diagnosis code of {commit} failed on its batch: {tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--from-batch", type=int, default=POOLED_FROM, help="first batch scored (pooled from here)")
    parser.add_argument("--smoke", action="store_true", help="the latest batch alone: seconds, same keys")
    args = parser.parse_args()

    labels = json.loads((args.corpus / "labels.json").read_text())
    batches = json.loads((args.corpus / "batches.json").read_text())
    if args.smoke:
        args.from_batch = max(int(b) for b in batches)
    wanted = sorted(int(b) for b in batches if int(b) >= args.from_batch)
    headline: dict[str, object] = {}
    pooled = {"root_cause": 0, "kind": 0, "restart": 0, "logs": 0,
              "answered": 0, "root_cause_when_answered": 0, "restart_when_answered": 0,
              "specific_answers": 0, "specific_right": 0, "generic_answers": 0, "generic_right": 0}
    started = time.perf_counter()
    print(f"{'batch':>5} {'logs':>4} {'code at':>9}   root cause   kind   restart   (95% CI root cause)"
          f"   answered   right when answered")
    with tempfile.TemporaryDirectory(prefix="ff-blind-") as tmp:
        for batch in wanted:
            commit = batches[str(batch)]["collected_before"]
            names = sorted(n for n, label in labels.items() if label["batch"] == batch)
            found = score_batch(commit, [args.corpus / n for n in names], Path(tmp))
            right = {"root_cause": 0, "kind": 0, "restart": 0}
            answered = {"answered": 0, "root_cause_when_answered": 0, "restart_when_answered": 0,
                        "specific_answers": 0, "specific_right": 0, "generic_answers": 0, "generic_right": 0}
            misses = []
            for name in names:
                label = labels[name]
                cause, kind, restart, rule = found[str(args.corpus / name)]
                right["root_cause"] += cause == label["root_cause"]
                right["kind"] += kind == label["kind"]
                right["restart"] += restart == label["restart_helps"]
                if cause != "Unknown":  # an answer the recovery table acts on without a person
                    answered["answered"] += 1
                    answered["root_cause_when_answered"] += cause == label["root_cause"]
                    answered["restart_when_answered"] += restart == label["restart_helps"]
                    tier = "generic" if rule in GENERIC_RULES else "specific"
                    answered[f"{tier}_answers"] += 1
                    answered[f"{tier}_right"] += cause == label["root_cause"]
                if cause != label["root_cause"]:
                    misses.append(f"{name}: {cause} (label {label['root_cause']})")
            n = len(names)
            low, high = wilson(right["root_cause"], n)
            a = answered["answered"]
            print(f"{batch:>5} {n:>4} {commit:>9}   {right['root_cause'] / n:10.3f} {right['kind'] / n:6.3f} "
                  f"{right['restart'] / n:9.3f}   [{low:.2f}, {high:.2f}]          {a:>2}/{n:<3}   "
                  f"{answered['root_cause_when_answered']}/{a} cause, {answered['restart_when_answered']}/{a} restart")
            for miss in misses:
                print(f"{'':>24}miss  {miss}")
            headline[f"blind_batch{batch}_logs"] = n
            headline[f"blind_batch{batch}_code"] = commit
            for key in right:
                headline[f"blind_batch{batch}_{key}"] = round(right[key] / n, 4)
                pooled[key] += right[key]
            for key in answered:
                pooled[key] += answered[key]
            headline[f"blind_batch{batch}_answered_logs"] = a
            pooled["logs"] += n
    n = pooled["logs"]
    print(f"pooled batches {wanted[0]}-{wanted[-1]} ({n} logs): root cause {pooled['root_cause']}/{n}, "
          f"kind {pooled['kind']}/{n}, restart {pooled['restart']}/{n}  ({time.perf_counter() - started:.0f} s)")
    latest = wanted[-1]
    summary = {"blind_batches": f"{wanted[0]}-{latest}", "blind_logs": n}
    for key in ("root_cause", "kind", "restart"):
        summary[f"blind_pooled_{key}"] = round(pooled[key] / n, 4)
        low, high = wilson(pooled[key], n)
        summary[f"blind_pooled_{key}_ci95_low"] = round(low, 3)
        summary[f"blind_pooled_{key}_ci95_high"] = round(high, 3)
    a = pooled["answered"]
    summary["blind_pooled_answered"] = round(a / n, 4)
    for key in ("root_cause_when_answered", "restart_when_answered"):
        summary[f"blind_pooled_{key}"] = round(pooled[key] / max(a, 1), 4)
    low, high = wilson(pooled["root_cause_when_answered"], a)
    summary["blind_pooled_root_cause_when_answered_ci95_low"] = round(low, 3)
    summary["blind_pooled_root_cause_when_answered_ci95_high"] = round(high, 3)
    print(f"answered by the rules: {a}/{n}; right when answered: root cause {pooled['root_cause_when_answered']}/{a}, "
          f"restart {pooled['restart_when_answered']}/{a}")
    for tier in ("specific", "generic"):
        k, m = pooled[f"{tier}_right"], pooled[f"{tier}_answers"]
        low, high = wilson(k, m)
        print(f"  by a {tier} rule{' (an exception class only)' if tier == 'generic' else ' (names a cause)'}: "
              f"{m} answers, root cause right {k}/{m} [{low:.2f}, {high:.2f}]")
        summary[f"blind_pooled_{tier}_rule_answers"] = m
        summary[f"blind_pooled_{tier}_rule_root_cause"] = round(k / max(m, 1), 4)
        summary[f"blind_pooled_{tier}_rule_root_cause_ci95_low"] = round(low, 3)
        summary[f"blind_pooled_{tier}_rule_root_cause_ci95_high"] = round(high, 3)
    summary["blind_latest_batch"] = latest
    for key in ("logs", "root_cause", "kind", "restart"):
        summary[f"blind_latest_{key}"] = headline[f"blind_batch{latest}_{key}"]
    print(json.dumps(checked_headline({**summary, **headline}, HEADLINE_KEYS)), flush=True)


if __name__ == "__main__":
    main()
