"""`forgeflow diagnose` and `forgeflow rules list|add|approve|reject|test`.

A diagnosis rule the failure agent learns is proposed: it applies only to the job family that
learned it until an operator approves it (`rules approve NAME`, `--global` for every job) or
rejects it (`rules reject NAME`); `rules list --learned` shows each rule's review and owner.
On PostgreSQL the database decides who may (migration 0011): reviewing, and adding a rule by
hand, take the operator role; a refusal is one line, exit 2. SQLite is single-user.

Heavy imports (RE2, Hyperscan, the rule libraries) happen inside the command
functions so `forgeflow --help` stays fast.

`forgeflow diagnose` uses the failure agent when ``diagnosis.agents`` provides
``build_default_agent(state_dir, job_family) -> agent | None`` (None: no LLM or memory
configured); ``--no-agent`` uses the rules alone. ``--confirm [ROOT_CAUSE]`` stores the
failure, as diagnosed or as corrected, in the failure memory (``diagnosis.agents.remember_failure``):
the agent's retrieval then recognises similar logs, with or without an LLM.
"""

from __future__ import annotations

import argparse
import json

from infra.untrusted_text import printable


def register(subparsers: argparse._SubParsersAction) -> None:
    diagnose = subparsers.add_parser(
        "diagnose", help="diagnose a failed job's log (rules first, then the failure agent)",
        description="Compress LOGFILE with the job family's filter rules, name the root cause "
                    "with the diagnosis rules, and fall back to the failure agent.",
    )
    diagnose.add_argument("logfile", metavar="LOGFILE", nargs="+", help="the job's log (or several files of one job)")
    diagnose.add_argument("--job-family", default=None, help="rule set to use/learn (e.g. the job's config name)")
    diagnose.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    diagnose.add_argument("--state-dir", default=None, help="default: $FORGEFLOW_STATE_DIR or ~/.forgeflow/state")
    diagnose.add_argument("--hang", action="store_true", help="the heartbeat went stale (a hang is suspected)")
    diagnose.add_argument("--spike", action="store_true", help="the worker left its loss-spike marker")
    diagnose.add_argument("--no-agent", action="store_true", help="rules only, never call the failure agent")
    diagnose.add_argument("--engine", default=None, help="filter engine: re2 (default), hyperscan, python")
    diagnose.add_argument("--confirm", nargs="?", const="", default=None, metavar="ROOT_CAUSE",
                          help="remember this failure in the failure memory as diagnosed (no value) or as ROOT_CAUSE "
                               "(a correction), so the failure agent recognises it next time")
    diagnose.add_argument("--restart-helps", choices=("yes", "no"), default=None,
                          help="with --confirm: whether relaunching fixes it (required for a correction)")
    diagnose.add_argument("--mitigation", default=None, help="with --confirm: what to do about it (default: the diagnosis's own when it is "
                               "confirmed as it is; for a correction, only what was confirmed)")
    diagnose.set_defaults(func=_cmd_diagnose)

    rules = subparsers.add_parser("rules", help="list, add or test filter and diagnosis rules")
    rules_sub = rules.add_subparsers(dest="rules_command", metavar="ACTION", required=True)

    listing = rules_sub.add_parser("list", help="list the rules (seeds and learned)")
    listing.add_argument("--type", choices=("filter", "diagnosis"), default="diagnosis")
    listing.add_argument("--job-family", default=None)
    listing.add_argument("--state-dir", default=None)
    listing.add_argument("--learned", action="store_true", help="only learned rules")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=_cmd_rules_list)

    add = rules_sub.add_parser("add", help="add a learned rule (validated in the linear-time engine)")
    add.add_argument("--type", choices=("filter", "diagnosis"), required=True)
    add.add_argument("--pattern", required=True, help="regex (RE2 syntax)")
    add.add_argument("--name", default=None)
    add.add_argument("--job-family", default=None, help="filter rules: the family to add it to; diagnosis rules: "
                     "apply it to this family only (default: every job)")
    add.add_argument("--root-cause", default=None, help="diagnosis rules: the root cause it names")
    add.add_argument("--restart-helps", choices=("yes", "no"), default=None, help="diagnosis rules")
    add.add_argument("--mitigation", default="")
    add.add_argument("--state-dir", default=None)
    add.set_defaults(func=_cmd_rules_add)

    for action, verb in (("approve", "approve a proposed learned rule (for its job family, or --global for every job)"),
                         ("reject", "reject a learned rule: it applies to no job")):
        review = rules_sub.add_parser(action, help=verb, description=verb + ". The failure agent's rules are "
                                      "proposed: they apply only to the job family that learned them until approved.")
        review.add_argument("name", metavar="NAME", help="the rule's name (forgeflow rules list --learned)")
        if action == "approve":
            review.add_argument("--global", dest="scope", action="store_const", const="global", default=None,
                                help="apply it to every job, not only its family's")
        review.add_argument("--state-dir", default=None)
        review.add_argument("--json", action="store_true")
        review.set_defaults(func=_cmd_rules_review, review={"approve": "approved", "reject": "rejected"}[action])

    test = rules_sub.add_parser("test", help="show which rules match the lines of a log (or what one pattern would)")
    test.add_argument("logfile", metavar="LOGFILE")
    test.add_argument("--pattern", default=None, help="a candidate regex to try against the log")
    test.add_argument("--job-family", default=None)
    test.add_argument("--state-dir", default=None)
    test.add_argument("--limit", type=int, default=20)
    test.set_defaults(func=_cmd_rules_test)


def _fail(args: argparse.Namespace, message: str) -> int:
    from infra.yaml_config import report_error

    return report_error(message, bool(getattr(args, "json", False)))


def _default_agent(state_dir, job_family):
    try:
        from diagnosis import agents
    except ImportError:
        return None
    build = getattr(agents, "build_default_agent", None)
    return build(state_dir, job_family) if build else None


def _shown(diagnosis):
    """``diagnosis`` as shown: the texts a log or an LLM wrote (culprit lines, suspects,
    mitigation) without the escape sequences a terminal would act on."""
    from dataclasses import replace

    return replace(diagnosis, culprit_lines=[printable(line) for line in diagnosis.culprit_lines],
                   suspect_nodes=[printable(node) for node in diagnosis.suspect_nodes],
                   mitigation=printable(diagnosis.mitigation))


def _cmd_diagnose(args: argparse.Namespace) -> int:
    from diagnosis.api import confirmed_diagnosis, diagnose_log
    from diagnosis.multi_regex import DEFAULT_ENGINE, RegexError
    from diagnosis.vocabulary import kind_of

    if args.confirm is None and (args.restart_helps or args.mitigation is not None):
        return _fail(args, "--restart-helps and --mitigation go with --confirm (forgeflow diagnose LOG --confirm ROOT_CAUSE "
                     "--restart-helps yes|no)")
    if args.confirm:
        try:
            kind_of(args.confirm)  # before the work: a typo is one line, not a diagnosis then an error
        except ValueError as exc:
            return _fail(args, f"--confirm {args.confirm}: {exc}")
    agent = None if args.no_agent else _default_agent(args.state_dir, args.job_family)
    try:
        diagnosis = diagnose_log(
            args.logfile, job_family=args.job_family, state_dir=args.state_dir, agent=agent,
            hang_suspected=args.hang, spike_suspected=args.spike, engine=args.engine or DEFAULT_ENGINE,
        )
    except (FileNotFoundError, IsADirectoryError, PermissionError, ValueError, RegexError) as exc:
        return _fail(args, str(exc))
    remembered = None
    if args.confirm is not None:
        restart = None if args.restart_helps is None else args.restart_helps == "yes"
        try:
            confirmed = confirmed_diagnosis(diagnosis, args.confirm or None, restart, args.mitigation)
            from diagnosis.agents import remember_failure

            failure_id = remember_failure(args.logfile, confirmed, job_family=args.job_family, state_dir=args.state_dir)
        except (ValueError, RuntimeError) as exc:
            return _fail(args, str(exc))
        remembered = {"failure_id": failure_id, **_shown(confirmed).to_dict()}
    diagnosis = _shown(diagnosis)
    if args.json:
        print(json.dumps({**diagnosis.to_dict(), **({"confirmed": remembered} if remembered else {})}, indent=2))
        return 0
    print(f"root cause : {diagnosis.root_cause} ({diagnosis.kind})")
    print(f"restart    : {'helps' if diagnosis.restart_helps else 'will not help'}")
    print(f"confidence : {diagnosis.confidence:.2f} (source: {diagnosis.source}"
          + (f", rule {diagnosis.rule_name})" if diagnosis.rule_name else ")"))
    if diagnosis.suspect_nodes or diagnosis.suspect_ranks:
        print(f"suspects   : nodes {', '.join(diagnosis.suspect_nodes) or '-'}; "
              f"ranks {', '.join(map(str, diagnosis.suspect_ranks)) or '-'}")
    print(f"mitigation : {diagnosis.mitigation}")
    if diagnosis.culprit_lines:
        print("culprit lines:")
        for line in diagnosis.culprit_lines:
            print(f"  {line[:400]}")
    if remembered:
        print(f"remembered : {remembered['root_cause']} ({'restart helps' if remembered['restart_helps'] else 'no restart'}) "
              f"as failure {remembered['failure_id']}: the failure agent will recognise logs like this one")
    elif diagnosis.root_cause == "Unknown":
        print(f"once you know the cause, teach the failure agent to recognise it: forgeflow diagnose "
              f"{' '.join(args.logfile)} --confirm ROOT_CAUSE --restart-helps yes|no")
    return 0


def _cmd_rules_list(args: argparse.Namespace) -> int:
    try:
        if args.type == "filter":
            from diagnosis.filters import FilterRuleSet

            rules = [r.model_dump() for r in FilterRuleSet.load(args.job_family, args.state_dir).rules]
        else:
            from diagnosis.rules import DiagnosisLibrary, learned_rules

            # every learned rule with its review (--job-family: those that apply to that family), then the seeds
            library = DiagnosisLibrary.load(args.state_dir, job_family=args.job_family)
            learned = library.learned if args.job_family else learned_rules(args.state_dir)
            rules = [r.model_dump() for r in learned + ([] if args.learned else library.rules[len(library.learned):])]
    except ValueError as exc:
        return _fail(args, str(exc))
    if args.learned:
        rules = [r for r in rules if r["source"] != "seed"]
    if args.json:
        print(json.dumps(rules, indent=2))
        return 0
    for r in rules:
        target = f" -> {r['root_cause']}" if "root_cause" in r else ""
        review = ""
        if r.get("review") is not None and r["source"] != "seed":
            where = "every job" if r["scope"] == "global" and r["review"] == "approved" else \
                f"job family {r['job_family']}" if r["job_family"] else "diagnoses of no job family"
            review = f"  [{r['review']}: {'applies to ' + where if r['review'] != 'rejected' else 'applies to none'}; " \
                     f"by {r['owner']}]"
        # a learned rule's pattern may be an LLM's: shown without escape sequences
        print(printable(f"{r['source']:5} {r['name']:32}{target}{review}\n      {r['pattern']}"))
    print(f"{len(rules)} {args.type} rules")
    return 0


def _cmd_rules_review(args: argparse.Namespace) -> int:
    import getpass

    from diagnosis.state import LearnedRuleStore

    try:
        rule = LearnedRuleStore(args.state_dir).review(args.name, args.review, scope=getattr(args, "scope", None),
                                                       by=getpass.getuser())
    except ValueError as exc:
        return _fail(args, str(exc))
    if args.json:
        print(json.dumps(rule, indent=2))
        return 0
    where = "every job" if rule["scope"] == "global" else f"job family {rule['job_family']}"
    print(printable(f"rule {rule['name']!r} {rule['review']}" + (f": it applies to {where}" if rule["review"] == "approved"
                                                                  else ": it applies to no job")))
    return 0


def _cmd_rules_add(args: argparse.Namespace) -> int:
    from diagnosis.multi_regex import RegexError

    try:
        if args.type == "filter":
            from diagnosis.filters import FilterRuleSet

            rule_set = FilterRuleSet.load(args.job_family, args.state_dir)
            rule = rule_set.add_rule(args.pattern, name=args.name, source="user", description=args.mitigation)
            print(f"added filter rule {rule.name!r} to job family {rule_set.job_family!r}")
        else:
            from diagnosis.rules import DiagnosisLibrary

            if not args.root_cause or args.restart_helps is None:
                return _fail(args, "a diagnosis rule needs --root-cause and --restart-helps yes|no")
            import getpass

            library = DiagnosisLibrary.load(args.state_dir, job_family=args.job_family)
            rule = library.add_rule(
                args.pattern, args.root_cause, args.restart_helps == "yes",
                mitigation=args.mitigation, name=args.name, source="user", owner=getpass.getuser(),
            )
            where = f"job family {rule.job_family}" if rule.job_family else "every job"
            print(f"added diagnosis rule {rule.name!r} -> {rule.root_cause} (applies to {where})")
    except (RegexError, ValueError) as exc:
        return _fail(args, str(exc))
    return 0


def _cmd_rules_test(args: argparse.Namespace) -> int:
    from diagnosis.api import compress_log
    from diagnosis.multi_regex import RegexError, compile_linear
    from diagnosis.rules import match_entries
    from diagnosis.signals import has_error_keyword

    try:
        compressed, rules, library = compress_log(args.logfile, args.job_family, args.state_dir)
    except (FileNotFoundError, IsADirectoryError, ValueError) as exc:
        return _fail(args, str(exc))
    stats = compressed.stats
    print(f"{stats.lines_in} lines, {stats.bytes_in} bytes -> {len(compressed.entries)} entries "
          f"({stats.lines_signal} signal lines, {stats.lines_uncovered} uncovered), ratio {compressed.ratio:.0f}x")
    if args.pattern is None:
        for match in match_entries(compressed, library)[: args.limit]:
            tag = "symptom" if match.rule.symptom else "cause"
            print(f"[{match.rule.name} -> {match.rule.root_cause}, {tag}] {printable(match.entry.render())[:300]}")
        return 0
    try:
        regex = compile_linear(args.pattern)
    except RegexError as exc:
        return _fail(args, str(exc))
    hits = [e for e in compressed.entries if regex.search(e.text)]
    errors = [e for e in hits if e.signal or has_error_keyword(e.text)]
    print(f"pattern matches {len(hits)} kept entries, {len(errors)} of them carry an error signal")
    for entry in hits[: args.limit]:
        print(f"  {'ERR ' if entry in errors else '    '}{printable(entry.render())[:300]}")
    return 1 if errors else 0
