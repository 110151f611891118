"""Corpus gathering and the train/validation split (no tokenizer involved)."""

from __future__ import annotations

import pytest

from training.corpus import (
    DataError,
    Document,
    corpus_fingerprint,
    gather_corpus,
    stdlib_files,
    stdlib_root,
)
from training.data import split_documents, token_dtype


def test_stdlib_corpus_is_sorted_sources_without_tests():
    files = stdlib_files()
    assert files == sorted(files) and len(files) > 300
    assert (stdlib_root() / "argparse.py") in files
    parts = {p for f in files for p in f.relative_to(stdlib_root()).parts[:-1]}
    assert not parts & {"test", "tests", "site-packages", "idle_test"}


def test_cap_keeps_a_deterministic_prefix():
    capped = gather_corpus(["stdlib"], max_mb=0.5)
    assert sum(len(d.text.encode()) for d in capped) <= 0.5 * 1024 * 1024
    assert [d.name for d in capped] == [str(p) for p in stdlib_files()[: len(capped)]]
    assert corpus_fingerprint(capped) == corpus_fingerprint(gather_corpus(["stdlib"], max_mb=0.5))
    assert corpus_fingerprint(capped) != corpus_fingerprint(gather_corpus(["stdlib"], max_mb=0.4))


def test_one_document_bigger_than_the_cap_keeps_its_head(tmp_path):
    big = tmp_path / "big.txt"
    big.write_text("é" * 400_000)  # 800 kB of UTF-8
    (doc,) = gather_corpus([str(big)], max_mb=0.1)
    assert len(doc.text.encode()) <= 0.1 * 1024 * 1024 and set(doc.text) == {"é"}


def test_relative_paths_and_jsonl_records(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n\n{"text": ""}\n{"text": "two"}\n')
    docs = gather_corpus(["a.jsonl"], base_dir=tmp_path)
    assert [d.text for d in docs] == ["one", "two"]
    (tmp_path / "b.jsonl").write_text('{"text": 3}\n')
    with pytest.raises(DataError, match="b.jsonl:1: 'text' is int"):
        gather_corpus([str(tmp_path / "b.jsonl")])
    (tmp_path / "c.jsonl").write_text("not json\n")
    with pytest.raises(DataError, match="c.jsonl:1: not valid JSON"):
        gather_corpus([str(tmp_path / "c.jsonl")])


def test_split_is_by_document_deterministic_and_sized_by_bytes():
    docs = [Document(f"d{i}", "x" * (100 + 10 * i)) for i in range(100)]
    train, val = split_documents(docs, 0.1)
    assert (train, val) == split_documents(docs, 0.1)
    assert len(train) + len(val) == 100 and not {d.name for d in train} & {d.name for d in val}
    share = sum(len(d.text) for d in val) / sum(len(d.text) for d in docs)
    assert 0.1 <= share < 0.14
    assert [d.name for d in train] == sorted((d.name for d in train), key=lambda n: int(n[1:]))


def test_split_keeps_a_document_on_each_side():
    train, val = split_documents([Document("a", "a" * 10), Document("b", "b" * 1000)], 0.01)
    assert len(train) == len(val) == 1
    # A single document is cut at a line boundary instead.
    text = "".join(f"line {i}\n" for i in range(100))
    train, val = split_documents([Document("only", text)], 0.2)
    assert train[0].text + val[0].text == text and val[0].text.startswith("line ")
    with pytest.raises(DataError, match="too short to split"):
        split_documents([Document("tiny", "x")], 0.2)


def test_token_dtype_by_vocab():
    assert token_dtype(65535) == "uint16" and token_dtype(65536) == "uint32"
