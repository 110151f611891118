"""The last line every benchmark prints: one JSON object holding its headline keys.

Not a benchmark: the scripts beside it import it. Each script names its headline keys
once, in a module-level `HEADLINE_KEYS` tuple, and ends its output, full run and `--smoke`
alike, with `print(json.dumps(checked_headline(values, HEADLINE_KEYS)), flush=True)`, so a
run that lost a key fails where it happens; tests/integration/benchmarks/test_benchmark_smoke.py
reads the same tuple to check each script's `--smoke` run.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping


def checked_headline(values: Mapping[str, object], keys: tuple[str, ...]) -> dict[str, object]:
    """`values` as a dict, once it holds every one of `keys`; exit with an error naming those it
    lacks. Standard error is flushed first, so the JSON line is the output's last line."""
    missing = [k for k in keys if k not in values]
    if missing:
        raise SystemExit(f"the headline lacks {missing}: the script's HEADLINE_KEYS name them, "
                         "so either compute them or drop them from HEADLINE_KEYS")
    sys.stderr.flush()
    return dict(values)
