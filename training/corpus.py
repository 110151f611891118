"""Gathering the text a job trains on: which documents, in which order.

A corpus is a list of sources from `DataConfig.corpus`:

- ``stdlib`` — the running interpreter's own standard library ``.py`` sources
  (real text on every machine, no download). Test suites and ``site-packages``
  are left out: tests are mostly fixtures, site-packages differs per machine.
- a text file — one document;
- a ``.jsonl`` / ``.ndjson`` file — one document per line, text under
  ``DataConfig.jsonl_text_key``;
- a directory — every text/JSONL file below it, recursively.

Documents come out in a deterministic order (sources in the order given, files
sorted by path), so the same corpus always gives the same token files.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from training.config import ConfigError

STDLIB = "stdlib"
JSONL_SUFFIXES = (".jsonl", ".ndjson")
# Files a directory source reads; anything else (images, archives, bytecode) is skipped.
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".json", ".yaml", ".yml", ".toml", ".c", ".h",
                 ".js", ".ts", ".go", ".rs", ".java", ".sh", ".html", ".css", ".csv", ".tex")
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


class DataError(ConfigError):
    """The corpus (or the data it gives) cannot make the prepared data the job asks for.

    A subclass of ConfigError because the fix is always in the job spec's `data:`
    section (or in the files it names), so callers that report config errors
    report these the same way.
    """


@dataclass(frozen=True)
class Document:
    name: str  # where it came from: a path, or path:line for JSONL
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The standard library's .py files, sorted; skipped folders are never walked into
    (site-packages can hold far more files than the stdlib itself)."""
    files = []
    for folder, subdirs, names in os.walk(stdlib_root()):
        subdirs[:] = [d for d in subdirs if d not in _STDLIB_SKIP_DIRS]
        files.extend(Path(folder, n) for n in names if n.endswith(".py"))
    return sorted(files)


def _read_text(path: Path) -> str:
    # Source files in the wild hold the odd invalid byte; keep the rest of the file.
    return path.read_text(encoding="utf-8", errors="replace")


def _jsonl_documents(path: Path, text_key: str) -> Iterator[Document]:
    with path.open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg}); "
                                "each line of a JSONL corpus file must be one JSON object") from None
            if not isinstance(record, dict) or text_key not in record:
                raise DataError(f"{path}:{lineno}: no {text_key!r} key; set data.jsonl_text_key "
                                "to the key that holds the text")
            text = record[text_key]
            if not isinstance(text, str):
                raise DataError(f"{path}:{lineno}: {text_key!r} is {type(text).__name__}, "
                                "expected a string")
            if text:
                yield Document(f"{path}:{lineno}", text)


def _file_documents(path: Path, text_key: str) -> Iterator[Document]:
    if path.suffix.lower() in JSONL_SUFFIXES:
        yield from _jsonl_documents(path, text_key)
    else:
        text = _read_text(path)
        if text:
            yield Document(str(path), text)


def _source_files(source: str, base_dir: Path | None) -> list[Path]:
    if source == STDLIB:
        return stdlib_files()
    path = Path(source).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if not path.exists():
        raise DataError(f"data.corpus: {source!r} does not exist; give an existing text/JSONL "
                        f"file or directory, or 'stdlib'")
    if path.is_file():
        return [path]
    files = sorted(
        p for p in path.rglob("*")
        if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES + JSONL_SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not files:
        raise DataError(f"data.corpus: directory {str(path)!r} holds no text or JSONL files "
                        f"(looked for {', '.join(TEXT_SUFFIXES + JSONL_SUFFIXES)})")
    return files


def iter_documents(sources: list[str], text_key: str = "text",
                   base_dir: Path | None = None) -> Iterator[Document]:
    """Every document of the corpus, in a deterministic order."""
    if not sources:
        raise DataError("data.corpus is empty; name 'stdlib' or at least one text/JSONL file")
    for source in sources:
        for path in _source_files(source, base_dir):
            yield from _file_documents(path, text_key)


def gather_corpus(sources: list[str], text_key: str = "text", max_mb: float | None = None,
                  base_dir: Path | None = None) -> list[Document]:
    """The corpus documents, stopping before the one that would pass `max_mb` of UTF-8."""
    limit = None if max_mb is None else int(max_mb * 1024 * 1024)
    documents, total = [], 0
    for doc in iter_documents(sources, text_key, base_dir):
        size = len(doc.text.encode("utf-8"))
        if limit is not None and total + size > limit:
            if documents:
                break
            # One document bigger than the whole cap: keep its head rather than nothing.
            doc = Document(doc.name, doc.text.encode("utf-8")[:limit].decode("utf-8", "ignore"))
            size = limit
        documents.append(doc)
        total += size
    if not documents or not any(d.text.strip() for d in documents):
        raise DataError(f"data.corpus {sources!r} holds no text; add non-empty files")
    return documents


def corpus_fingerprint(documents: list[Document]) -> str:
    """A hash of the corpus content and order (not of where the files live)."""
    h = hashlib.sha256()
    for doc in documents:
        data = doc.text.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:32]
