"""forgeflow: diagnosis — from a failed job's log to a root cause, rules first.

    vocabulary     root causes, their kinds, and the Diagnosis record
    signals        what counts as an error signal; line normalisation for collapsing
    multi_regex    linear-time multi-pattern matching (Hyperscan, RE2 fallback)
    filter_seeds   routine-line rules every job family starts with
    compressed     what compression produces: kept entries and stats
    filters        filter rules per job family and the streaming log compressor
    native/        the compressor's C line pass (pure-Python scan when it is not built)
    rule_seeds     seeded diagnosis rules, in match order
    rules          the rule library (learned rules persisted) and root-cause choice
    state          where diagnosis keeps what it learns
    proposals      vetting of LLM-proposed regexes before adoption
    llm            a small OpenAI-compatible chat client
    log_agent      LLM proposes filter regexes for uncovered lines
    failure_memory past diagnosed failures embedded in Chroma
    failure_agent  diagnoses what no rule knows (retrieval + LLM), then writes a rule
    agents         the agents wired into `diagnose_log`'s hook
    api            `diagnose_log(path) -> Diagnosis`, the call flows make
    recovery       the decision table: what to do after a failed attempt
    slack_format   the alert for a diagnosis (Slack, or printed)
    report         the failure artifact a person reads in the Prefect UI
    cli            `forgeflow diagnose`, `forgeflow rules ...`
"""
