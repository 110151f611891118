"""Diagnosis accuracy on the labelled corpus (tests/data/failures/) along three paths.

    .venv/bin/python benchmarks/diagnosis_accuracy.py

Paths, each through `diagnosis.api.diagnose_log` (the agent hook runs only when no
rule names a root cause):

* rules            — the diagnosis rule library alone;
* rules+retrieval  — plus the failure agent without an LLM: a similarity-weighted
                     vote over the nearest past failures (real Chroma, real
                     all-MiniLM-L6-v2). Leave-one-out: the memory holds every other
                     case's compressed excerpt and labelled diagnosis, never the case's own;
* rules+retrieval+agent — plus an LLM: the scripted OpenAI-compatible server from
                     tests/integration/diagnosis, answering like a careful model from
                     what the prompt shows (see `reasonable_llm`): it reads the log's
                     error lines and the retrieved past failures, never the label.

Two settings:

* full      — the rule library as shipped (the headline);
* held-out  — for each case, every seed rule naming the case's root cause is removed,
              so the failure type is new to the rules (what the agents exist for).
              Prefixed `heldout_` in the JSON.

The last line is the JSON headline: `cases`, `root_cause_accuracy`, `kind_accuracy`,
`restart_accuracy` of the best full-setting path (ties go to the simpler path), then
the same per path (`rules_…`, `retrieval_…`, `agent_…`) and per held-out path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "integration" / "diagnosis"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("ANONYMIZED_TELEMETRY", "False")

CORPUS = REPO / "tests" / "data" / "failures"
PATHS = ("rules", "retrieval", "agent")


# --------------------------------------------------------------------- scripted LLM

_WORD = re.compile(r"[A-Za-z_][A-Za-z_.]{3,}")
_CONTEXT = re.compile(r"Past failures with their diagnoses, most similar first:\n-+\n(.*?)\n-+\n", re.S)


def _tokens(text: str) -> set[str]:
    return {w.lower().strip("._") for w in _WORD.findall(text)}


def _parse_context(context: str) -> list[dict]:
    """The retrieved past failures as llama-index renders them (metadata, blank line, text)."""
    nodes: list[dict] = []
    for line in context.splitlines():
        if line.startswith("root_cause: "):
            nodes.append({"root_cause": line.split(": ", 1)[1], "lines": []})
        elif nodes and line.startswith("kind: "):
            nodes[-1]["kind"] = line.split(": ", 1)[1]
        elif nodes and line.startswith("restart_helps: "):
            nodes[-1]["restart_helps"] = line.split(": ", 1)[1].strip() == "True"
        elif nodes and line.startswith("mitigation: "):
            nodes[-1]["mitigation"] = line.split(": ", 1)[1]
        elif nodes and line.strip():
            nodes[-1]["lines"].append(line)
    return nodes


def reasonable_llm(request) -> str:
    """Answer a failure-agent prompt the way a careful model would, from the prompt alone.

    1. If an error line (error keywords) names an exception from the vocabulary
       (`KeyError: ...`), not a generic RuntimeError and not a collective-timeout
       symptom, it reports that one, earliest first; restart helps only for
       infrastructure causes.
    2. Otherwise it reasons by analogy over every line it was shown: the past
       failure in the context sharing the most distinctive words (rare across the
       shown failures) with one line gives the root cause and restart policy; that
       line is the culprit.
    3. With no such line it says Unknown.
    """
    from diagnosis.signals import has_error_keyword
    from diagnosis.vocabulary import ROOT_CAUSES, kind_of

    text = request.text
    if "You maintain filter rules" in text:
        return json.dumps({"filters": [], "error_lines": []})
    if "Write one regular expression" in text:
        return json.dumps({"regex": "", "name": ""})
    match = _CONTEXT.search(text)
    past = _parse_context(match.group(1)) if match else []
    log = text.split("Compressed log of the failed job (error-signal lines):", 1)[-1]
    lines = [line for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if has_error_keyword(line)] or lines

    symptoms = re.compile(r"watchdog|timed? ?out|SIGABRT|ChildFailedError|Signal 6|exitcode|terminate called", re.I)
    named = [
        (line, name)
        for line in errors
        if not symptoms.search(line)
        for name in re.findall(r"\b([A-Z][A-Za-z]+(?:Error|Exception))\b", line)
        if name in ROOT_CAUSES and name not in ("RuntimeError", "ConnectionError")
    ]
    if named:
        line, cause = named[0]
        return _answer(cause, kind_of(cause), kind_of(cause) == "infrastructure", line, 0.7)

    if past:
        documents = [_tokens(" ".join(p["lines"])) for p in past]
        frequency = Counter(t for doc in documents for t in doc)
        idf = {t: math.log((1 + len(documents)) / (1 + n)) for t, n in frequency.items()}
        best = (0.0, None, None)
        for line in lines:
            words = _tokens(line)
            for node, doc in zip(past, documents):
                score = sum(idf[t] for t in words & doc)
                if score > best[0]:
                    best = (score, node, line)
        score, node, line = best
        if node is not None and score > 0.5:
            return _answer(node["root_cause"], node["kind"], node["restart_helps"], line, 0.6)
    return _answer("Unknown", "unknown", False, errors[0] if errors else "", 0.2)


def _answer(cause: str, kind: str, restart: bool, line: str, confidence: float) -> str:
    culprit = re.sub(r"^\[x\d+[^\]]*\] ", "", line)  # a model copies the message, not our count
    return "```json\n" + json.dumps({
        "root_cause": cause, "kind": kind, "restart_helps": restart,
        "culprit_lines": [culprit] if culprit else [], "mitigation": "", "confidence": confidence,
    }) + "\n```"


# --------------------------------------------------------------------- evaluation


@contextlib.contextmanager
def seeds_without(root_cause: str | None):
    """Temporarily drop every seed rule that names `root_cause` (held-out setting)."""
    import diagnosis.rules as rules

    original = rules.seed_rules
    if root_cause is not None:
        rules.seed_rules = lambda: [r for r in original() if r.root_cause != root_cause]
    try:
        yield
    finally:
        rules.seed_rules = original


def score(results: list[tuple[dict, object]]) -> dict[str, float]:
    n = len(results)
    return {
        "root_cause_accuracy": round(sum(d.root_cause == l["root_cause"] for l, d in results) / n, 4),
        "kind_accuracy": round(sum(d.kind == l["kind"] for l, d in results) / n, 4),
        "restart_accuracy": round(sum(d.restart_helps == l["restart_helps"] for l, d in results) / n, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--skip-heldout", action="store_true")
    args = parser.parse_args()

    from diagnosis.agents import AgentsConfig, DiagnosisAgents, failure_lines
    from diagnosis.api import compress_log, diagnose_log
    from diagnosis.failure_agent import FailureAgentConfig
    from diagnosis.llm import LLMConfig
    from diagnosis.memory import FailureMemory, MemoryConfig, make_excerpt, make_key, shared_embedder
    from diagnosis.vocabulary import Diagnosis
    from scripted_llm_server import MODEL_ID, ScriptedLLMServer

    labels = json.loads((args.corpus / "labels.json").read_text())
    cases = sorted(labels)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="diag-acc-") as tmp, ScriptedLLMServer() as server:
        tmp = Path(tmp)
        server.respond_with(reasonable_llm)
        embedder = shared_embedder()
        memory = FailureMemory(MemoryConfig(path=tmp / "memory"), embedder)
        # Every case remembered as a diagnosed past failure (compressed with the full rules).
        excerpts, keys = {}, {}
        for name in cases:
            compressed, _, library = compress_log(args.corpus / name, state_dir=tmp / "compress-state")
            grouped = failure_lines(compressed, library)
            excerpts[name], keys[name] = make_excerpt(grouped.ordered), make_key(grouped.key_lines)
        embedder.embed(list(keys.values()))

        def remember(name: str) -> None:
            label = labels[name]
            diagnosis = Diagnosis(label["root_cause"], label["kind"], label["restart_helps"])
            memory.add(excerpts[name], diagnosis, failure_id=name, key=keys[name])

        for name in cases:
            remember(name)
        print(f"memory: {len(memory)} past failures embedded in {time.perf_counter() - started:.1f} s")

        no_learning = FailureAgentConfig(learn_rules=False, remember=False)  # keeps cases independent
        llm = LLMConfig(model=MODEL_ID, base_url=server.base_url, api_key="bench", timeout_s=30, max_retries=1)
        agents = {
            "rules": None,
            "retrieval": DiagnosisAgents(AgentsConfig(llm=None, failure_agent=no_learning), memory=memory),
            "agent": DiagnosisAgents(AgentsConfig(llm=llm, failure_agent=no_learning, max_segments=0), memory=memory),
        }

        settings = [("full", False)] + ([] if args.skip_heldout else [("heldout", True)])
        table: dict[str, dict[str, dict[str, float]]] = {}
        for setting, held_out in settings:
            results: dict[str, list] = {p: [] for p in PATHS}
            sources: dict[str, Counter] = {p: Counter() for p in PATHS}
            for name in cases:
                label = labels[name]
                # leave-one-out: the case itself is not in memory while it is diagnosed
                memory.remove(name)
                with seeds_without(label["root_cause"] if held_out else None):
                    for path in PATHS:
                        state = tmp / f"state-{setting}-{path}-{name}"
                        diagnosis = diagnose_log(args.corpus / name, state_dir=state, agent=agents[path])
                        results[path].append((label, diagnosis))
                        sources[path][diagnosis.source] += 1
                remember(name)
            table[setting] = {path: score(results[path]) for path in PATHS}
            print(f"\n{setting} rule library ({len(cases)} cases)")
            print(f"{'path':24} {'root cause':>10} {'kind':>8} {'restart':>8}   answered by")
            for path in PATHS:
                s = table[setting][path]
                label = {"rules": "rules", "retrieval": "rules+retrieval", "agent": "rules+retrieval+agent"}[path]
                print(f"{label:24} {s['root_cause_accuracy']:10.3f} {s['kind_accuracy']:8.3f} {s['restart_accuracy']:8.3f}   "
                      + ", ".join(f"{k}={v}" for k, v in sorted(sources[path].items())))
            hooked = [i for i, name in enumerate(cases) if results["retrieval"][i][1].source != "rule" or results["agent"][i][1].source != "rule"]
            print(f"cases where the agent hook answered ({len(hooked)}): label | rules | retrieval | agent")
            for i in hooked:
                label = labels[cases[i]]["root_cause"]
                answers = " | ".join(
                    f"{results[p][i][1].root_cause}{'' if results[p][i][1].root_cause == label else ' x'}" for p in PATHS
                )
                print(f"  {cases[i]:34} {label:18} | {answers}")
        print(f"\nLLM requests: {len(server.requests)}; total {time.perf_counter() - started:.1f} s")

    full = table["full"]
    order = {path: i for i, path in enumerate(PATHS)}
    best = max(PATHS, key=lambda p: (full[p]["root_cause_accuracy"], full[p]["kind_accuracy"], full[p]["restart_accuracy"], -order[p]))
    headline: dict[str, object] = {"cases": len(cases), "best_path": best, **full[best]}
    for setting, prefix in (("full", ""), ("heldout", "heldout_")):
        for path in PATHS:
            for key, value in table.get(setting, {}).get(path, {}).items():
                headline[f"{prefix}{path}_{key}"] = value
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
