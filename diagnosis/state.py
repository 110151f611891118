"""Where diagnosis keeps what it learns (filter rules per job family, diagnosis rules).

Default ``~/.forgeflow/state``; ``$FORGEFLOW_STATE_DIR`` or an explicit ``state_dir``
argument overrides it. Files are written atomically (temp file + rename) so a reader
never sees half a JSON document, even with several processes learning at once.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path


def state_dir(explicit: str | os.PathLike | None = None) -> Path:
    if explicit is not None:
        return Path(explicit).expanduser()
    env = os.environ.get("FORGEFLOW_STATE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".forgeflow" / "state"


_FAMILY_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


def safe_family_name(job_family: str) -> str:
    """Job family names become file names; refuse anything that could escape the dir."""
    if not _FAMILY_OK.match(job_family or ""):
        raise ValueError(
            f"job family {job_family!r} is not a valid name: use 1-200 letters, digits, "
            "'.', '_' or '-', starting with a letter or digit (e.g. the job's config name)"
        )
    return job_family


def write_json_atomic(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2, sort_keys=False)
            handle.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: Path) -> object | None:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path} is not valid JSON ({exc}); fix or delete it to start from the seeds"
        ) from None
