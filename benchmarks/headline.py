"""The last line every benchmark prints: one JSON object holding its headline keys.

Not a benchmark: the scripts beside it import it. Each script names its headline keys
once, in a module-level `HEADLINE_KEYS` tuple, and prints its last line through
`print_headline`, in its full run and its `--smoke` run alike, so a run that lost a key
fails where it happens; tests/integration/benchmarks/test_benchmark_smoke.py reads the
same tuple to check each script's `--smoke` run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping


def print_headline(values: Mapping[str, object], keys: tuple[str, ...]) -> None:
    """Print `values` as one JSON line; exit with an error naming any of `keys` it lacks."""
    missing = [k for k in keys if k not in values]
    if missing:
        raise SystemExit(f"the headline lacks {missing}: the script's HEADLINE_KEYS name them, "
                         "so either compute them or drop them from HEADLINE_KEYS")
    print(json.dumps(dict(values)))
