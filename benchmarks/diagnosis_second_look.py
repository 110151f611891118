"""The agent's second look at generic answers, on real logs no rule had seen.

    .venv/bin/python benchmarks/diagnosis_second_look.py          # batches 5 and later (~30 s)
    .venv/bin/python benchmarks/diagnosis_second_look.py --recurrence-similarity 0.7

The seed rules ``runtime``, ``value``, ``os``, ``attribute``... name only a Python exception's
class (``RuntimeError: <anything>`` -> RuntimeError). ``benchmarks/diagnosis_blind.py`` found
such answers right 24 times in 37 on the blind batches, against 100 in 103 for the rules that
name a cause. Since then ``diagnose_log`` hands a generic answer to the agent for a second
look (``RuleOutcome.generic_only``), as it does a symptom-only one: a recurrence of a
failure diagnosed before (one a person confirmed, say; ``FailureAgentConfig.
recurrence_similarity``, no LLM) may name the cause; with no answer the class stands.

What this measures, blind: each batch of ``benchmarks/data/real_failure_logs`` (5 and later)
is diagnosed with the *seed rules of its own collection commit* (``batches.json``:
``collected_before``; today's rules were written from these logs, those were not) and the
product's agent without an LLM (the retrieval vote, similarity floor 0.7), whose failure
memory holds the template cases and the real logs of the earlier batches with their labels,
stored as ``forgeflow diagnose --confirm`` stores a confirmed failure. A batch's own logs enter
the memory only after it is scored. Each log is diagnosed twice, with everything else equal:

* ``without`` (the baseline: today's pipeline with the second look turned off, the behaviour
  before it) - a generic answer stands;
* ``with`` - a generic answer goes to the agent, whose answer, if any, replaces it.

Why this baseline is fair: same rules (those of the batch's time), same memory, same
compressor and agent, same logs; the only difference is the mechanism. What it does not
show: the compressor, filter seeds and agent are today's (only the diagnosis seeds are the
old ones), so ``without`` is close to but not the blind figure of ``diagnosis_blind.py``
(126 against 124 of 180 right); and the memory's failures are grouped into telling lines
and symptoms by today's seeds when stored, by the batch's when queried (8 of the 180 keys
differ). The second look never asks an LLM, so none is needed here.

Last line: JSON with ``second_look_batches``, ``second_look_logs``, ``generic_answers``
(logs the old rules answered with a generic rule), ``without_*`` and ``with_*`` root cause /
kind / restart accuracy pooled, ``second_look_changed``, ``second_look_fixes``,
``second_look_breaks`` (root cause) and ``second_look_sign_test_p`` (HEADLINE_KEYS). ``--smoke``
scores the first 2 logs of the latest batch (SMOKE_SCORED) with 1 template case and 1 real log of the batch before it
in the memory: seconds, the same code path and keys, not a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("ANONYMIZED_TELEMETRY", "False")

from benchmarks.headline import checked_headline  # noqa: E402

CORPUS = REPO / "benchmarks" / "data" / "real_failure_logs"
TEMPLATES = REPO / "tests" / "data" / "failures"
POOLED_FROM = 5  # as diagnosis_blind.py
SMOKE_SCORED = 2  # --smoke: logs of the latest batch scored
HEADLINE_KEYS = ("second_look_batches", "second_look_logs", "generic_answers", "recurrence_similarity",
                 "without_root_cause", "without_kind", "without_restart", "with_root_cause", "with_kind",
                 "with_restart", "second_look_changed", "second_look_fixes", "second_look_breaks",
                 "second_look_sign_test_p")


def old_seed_rules(commit: str) -> tuple:
    """``SEED_DIAGNOSIS_RULES`` as ``diagnosis/rule_seeds.py`` had them at ``commit``."""
    done = subprocess.run(["git", "show", f"{commit}:diagnosis/rule_seeds.py"], cwd=REPO,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: git cannot read commit {commit} ({done.stderr.strip()}); "
                         "this needs the full history: run it in a full clone (git fetch --unshallow)")
    namespace: dict = {"__name__": f"rule_seeds_at_{commit}"}
    exec(compile(done.stdout, f"{commit}:diagnosis/rule_seeds.py", "exec"), namespace)
    return namespace["SEED_DIAGNOSIS_RULES"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--from-batch", type=int, default=POOLED_FROM)
    parser.add_argument("--recurrence-similarity", type=float, default=None,
                        help="FailureAgentConfig.recurrence_similarity (default: the product's)")
    parser.add_argument("--limit", type=int, default=None,
                        help="at most this many template cases and real logs of each earlier batch in the memory")
    parser.add_argument("--smoke", action="store_true",
                        help=f"{SMOKE_SCORED} logs of the latest batch, 1 template and 1 log of the batch before in "
                             "the memory: seconds, same keys")
    args = parser.parse_args()

    import diagnosis.rules as rules_module
    from diagnosis_accuracy import sign_test  # this folder: the script's own path
    from diagnosis.agents import AgentsConfig, DiagnosisAgents
    from diagnosis.api import compress_log, diagnose_log
    from diagnosis.failure_agent import FailureAgentConfig
    from diagnosis.failure_memory import FailureMemory, MemoryConfig, shared_embedder
    from diagnosis.vocabulary import Diagnosis

    labels = json.loads((args.corpus / "labels.json").read_text())
    batches = json.loads((args.corpus / "batches.json").read_text())
    templates = json.loads((TEMPLATES / "labels.json").read_text())
    earliest = 1  # the first batch whose logs the memory holds
    scored = None  # logs scored per batch (None: all)
    if args.smoke:
        args.from_batch, args.limit = max(int(b) for b in batches), 1
        earliest, scored = args.from_batch - 1, SMOKE_SCORED
    today = rules_module.SEED_DIAGNOSIS_RULES
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ff-second-look-") as tmp:
        tmp = Path(tmp)
        # caches (compiled signal databases of each batch's patterns) stay in the temp dir
        os.environ["FORGEFLOW_STATE_DIR"] = str(tmp / "state")
        memory = FailureMemory(MemoryConfig(path=tmp / "memory"), shared_embedder())
        # no learning: each log is diagnosed against the same memory, with and without
        failure_config = FailureAgentConfig(learn_rules=False, remember=False)
        if args.recurrence_similarity is not None:
            failure_config = failure_config.model_copy(update={"recurrence_similarity": args.recurrence_similarity})
        agent = DiagnosisAgents(AgentsConfig(llm=None, failure_agent=failure_config), memory=memory)

        def confirm(path: Path, label: dict, state: Path) -> None:
            compressed, _, library = compress_log(path, state_dir=state)
            agent.remember(compressed, Diagnosis(label["root_cause"], label["kind"], label["restart_helps"]),
                           library=library)

        for name, label in sorted(templates.items())[:args.limit]:
            confirm(TEMPLATES / name, label, tmp / "templates")
        confirmed_of: dict[int, int] = {}
        for name, label in sorted(labels.items()):  # what was confirmed before the scored batches
            batch = label.get("batch", 1)
            if earliest <= batch < args.from_batch and confirmed_of.get(batch, 0) < (args.limit or len(labels)):
                confirmed_of[batch] = confirmed_of.get(batch, 0) + 1
                confirm(args.corpus / name, label, tmp / "early")
        templates_kept = min(len(templates), args.limit or len(templates))
        print(f"memory: {len(memory)} past failures ({templates_kept} templates, "
              f"{len(memory) - templates_kept} real logs of batches {earliest}-{args.from_batch - 1}) "
              f"in {time.perf_counter() - started:.0f} s")

        def without_second_look(context):
            return None if context.rule_outcome.generic_only else agent(context)

        right = {v: {"root_cause": 0, "kind": 0, "restart": 0} for v in ("without", "with")}
        fixes = breaks = changed = generic = logs = 0
        wanted = sorted(int(b) for b in batches if int(b) >= args.from_batch)
        print(f"{'batch':>5} {'logs':>4} {'rules of':>9}  generic   without (cause/kind/restart)   with")
        for batch in wanted:
            commit = batches[str(batch)]["collected_before"]
            names = sorted(n for n, label in labels.items() if label.get("batch", 1) == batch)[:scored]
            state = tmp / f"state-{batch}"
            per = {v: {"root_cause": 0, "kind": 0, "restart": 0} for v in ("without", "with")}
            batch_generic = 0
            rules_module.SEED_DIAGNOSIS_RULES = old_seed_rules(commit)
            try:
                found_by_log = {}
                for name in names:
                    path = args.corpus / name
                    found_by_log[name] = {"without": diagnose_log(path, state_dir=state, agent=without_second_look),
                                          "with": diagnose_log(path, state_dir=state, agent=agent)}
                generic_names = {r.name for r in rules_module.seed_rules() if r.generic}
            finally:
                rules_module.SEED_DIAGNOSIS_RULES = today
            for name in names:
                label, found = labels[name], found_by_log[name]
                batch_generic += found["without"].source == "rule" and found["without"].rule_name in generic_names
                for variant, d in found.items():
                    per[variant]["root_cause"] += d.root_cause == label["root_cause"]
                    per[variant]["kind"] += d.kind == label["kind"]
                    per[variant]["restart"] += d.restart_helps == label["restart_helps"]
                before, after = found["without"].root_cause, found["with"].root_cause
                if before != after:
                    changed += 1
                    fixes += after == label["root_cause"]
                    breaks += before == label["root_cause"]
                    print(f"{'':>6}changed  {name}: {before} -> {after} (label {label['root_cause']})")
            for name in names:  # confirmed once the batch is done
                confirm(args.corpus / name, labels[name], state)
            n = len(names)
            print(f"{batch:>5} {n:>4} {commit:>9}  {batch_generic:>7}   " + "   ".join(
                f"{per[v]['root_cause'] / n:.3f}/{per[v]['kind'] / n:.3f}/{per[v]['restart'] / n:.3f}"
                for v in ("without", "with")))
            for variant in per:
                for key in per[variant]:
                    right[variant][key] += per[variant][key]
            generic += batch_generic
            logs += n
    summary = {"second_look_batches": f"{wanted[0]}-{wanted[-1]}", "second_look_logs": logs,
               "generic_answers": generic, "recurrence_similarity": failure_config.recurrence_similarity}
    for variant in right:
        for key in right[variant]:
            summary[f"{variant}_{key}"] = round(right[variant][key] / logs, 4)
    summary.update(second_look_changed=changed, second_look_fixes=fixes, second_look_breaks=breaks,
                   second_look_sign_test_p=sign_test(fixes, breaks))
    print(f"pooled {logs} logs, {generic} generic answers by the rules of their time: root cause "
          f"{right['without']['root_cause']} -> {right['with']['root_cause']}, restart "
          f"{right['without']['restart']} -> {right['with']['restart']}; changed {changed}, fixes {fixes}, "
          f"breaks {breaks} ({time.perf_counter() - started:.0f} s)")
    print(json.dumps(checked_headline(summary, HEADLINE_KEYS)), flush=True)


if __name__ == "__main__":
    main()
