"""`prepare_data` for real: BPE training, HF tokenizer files, packed token files, idempotence."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import numpy as np
import pytest

from training import data as data_module
from training.config import parse_job_spec
from training.corpus import DataError, gather_corpus, stdlib_files, stdlib_root
from training.data import EOT_TOKEN, load_prepared, prepare_data


def _spec(job: dict, **data):
    job = copy.deepcopy(job)
    job["data"].update(data)
    return parse_job_spec(job)


def test_tokenizer_loads_offline_in_transformers_and_round_trips(tiny_prepared):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    assert os.environ["HF_HUB_OFFLINE"] == "1"
    tok = AutoTokenizer.from_pretrained(tiny_prepared.tokenizer_dir)
    assert isinstance(tok, PreTrainedTokenizerFast) and len(tok) == 512
    assert tok.eos_token == EOT_TOKEN and tok.eos_token_id == tiny_prepared.eot_token_id == 0
    assert tok.pad_token_id == tiny_prepared.pad_token_id == 1
    for text in (stdlib_files()[0].read_text(encoding="utf-8"),
                 "def f(x):\n\treturn x ** 2  # ünïcödé ✓ 日本語\r\n", "  leading spaces"):
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
    # Learned merges compress source code well below one token per byte.
    sample = (stdlib_root() / "argparse.py").read_text(encoding="utf-8")
    assert len(tok(sample)["input_ids"]) < 0.6 * len(sample.encode())


def test_packed_files_hold_the_documents_separated_by_eot(tiny_prepared, tiny_job_dict):
    from tokenizers import Tokenizer

    meta = json.loads(tiny_prepared.meta_path.read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 512
    train = np.memmap(tiny_prepared.train_path, dtype=meta["dtype"], mode="r")
    val = np.memmap(tiny_prepared.val_path, dtype=meta["dtype"], mode="r")
    assert len(train) == meta["train_tokens"] > len(val) == meta["val_tokens"]
    assert (train == 0).sum() == meta["train_documents"] and train[-1] == 0
    assert (val == 0).sum() == meta["val_documents"] >= 1
    assert meta["val_tokens"] / (meta["train_tokens"] + meta["val_tokens"]) == pytest.approx(0.05, abs=0.04)

    # Decoding train.bin up to the first separator gives back the first training document.
    spec = _spec(tiny_job_dict)
    documents = gather_corpus(spec.data.corpus, max_mb=spec.data.max_corpus_mb)
    train_docs, val_docs = data_module.split_documents(documents, spec.data.val_fraction)
    tok = Tokenizer.from_file(str(tiny_prepared.tokenizer_dir / "tokenizer.json"))
    first_end = int(np.argmax(train == 0))
    assert tok.decode(train[:first_end].tolist()) == train_docs[0].text
    assert not {d.name for d in train_docs} & {d.name for d in val_docs}


def test_second_prepare_reuses_the_files(tiny_prepared, tiny_job_dict):
    before = {p: p.stat().st_mtime_ns for p in (tiny_prepared.train_path, tiny_prepared.meta_path)}
    again = prepare_data(_spec(tiny_job_dict), progress=False)
    assert again.reused and again.corpus_fingerprint == tiny_prepared.corpus_fingerprint
    assert {p: p.stat().st_mtime_ns for p in before} == before
    assert load_prepared(tiny_prepared.data_dir).train_tokens == tiny_prepared.train_tokens


def _small_corpus(tmp_path: Path) -> Path:
    corpus = tmp_path / "corpus"
    (corpus / "nested").mkdir(parents=True)
    for i, src in enumerate(stdlib_files()[:12]):
        target = corpus / ("nested" if i % 2 else ".") / f"doc{i}.txt"
        target.write_text(src.read_text(encoding="utf-8"))
    (corpus / "image.png").write_bytes(b"\x89PNG not text")  # skipped: not a text suffix
    return corpus


def test_user_text_jsonl_and_directory_corpora(tiny_job_dict, tmp_path):
    corpus = _small_corpus(tmp_path)
    jsonl = tmp_path / "extra.jsonl"
    jsonl.write_text("\n".join(json.dumps({"body": t}) for t in ("first record", "second record"))
                     + "\n\n")
    job = copy.deepcopy(tiny_job_dict)
    job["model"].update(vocab_size=300, seq_length=32)
    job["data"] = {"corpus": [str(corpus), str(jsonl)], "jsonl_text_key": "body",
                   "data_dir": str(tmp_path / "data"), "val_fraction": 0.2}
    prepared = prepare_data(parse_job_spec(job), progress=False)
    assert prepared.train_documents + prepared.val_documents == 12 + 2
    assert prepared.tokenizer_vocab_size == 300 and not prepared.reused

    # A changed corpus changes the fingerprint: the data is prepared again, atomically.
    (corpus / "doc0.txt").write_text("changed\n" * 500)
    redone = prepare_data(parse_job_spec(job), progress=False)
    assert not redone.reused and redone.corpus_fingerprint != prepared.corpus_fingerprint


def test_an_interrupted_prepare_never_looks_complete(tiny_job_dict, tmp_path, monkeypatch):
    job = copy.deepcopy(tiny_job_dict)
    job["model"].update(vocab_size=300, seq_length=32)
    job["data"] = {"corpus": [str(_small_corpus(tmp_path))], "data_dir": str(tmp_path / "data")}
    spec = parse_job_spec(job)
    prepare_data(spec, progress=False)
    (tmp_path / "corpus" / "doc0.txt").write_text("new text\n" * 400)  # forces a redo

    real_encode = data_module._encode_to_file

    def crash_after_train(tokenizer, documents, path, *args):
        if path.name.startswith("val"):
            raise KeyboardInterrupt("killed mid-prepare")
        return real_encode(tokenizer, documents, path, *args)

    monkeypatch.setattr(data_module, "_encode_to_file", crash_after_train)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(spec, progress=False)
    data_dir = tmp_path / "data"
    assert not (data_dir / "meta.json").exists()  # no "complete" mark
    with pytest.raises(DataError, match="forgeflow prepare"):
        load_prepared(data_dir)
    monkeypatch.undo()
    prepared = prepare_data(spec, progress=False)
    assert not prepared.reused and not list(data_dir.glob("*.tmp-*"))  # leftovers cleaned


@pytest.mark.parametrize("corpus,needle", [
    (["does/not/exist.txt"], "does not exist"),
    (["EMPTY_DIR"], "holds no text or JSONL files"),
    (["EMPTY_FILE"], "holds no text"),
    ([], "data.corpus is empty"),
])
def test_missing_or_empty_corpus_is_a_clear_error(tiny_job_dict, tmp_path, corpus, needle):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty.txt").write_text("")
    sub = {"EMPTY_DIR": str(tmp_path / "empty"), "EMPTY_FILE": str(tmp_path / "empty.txt")}
    spec = _spec(tiny_job_dict, corpus=[sub.get(c, c) for c in corpus], data_dir=str(tmp_path / "d"))
    with pytest.raises(DataError, match=needle):
        prepare_data(spec, progress=False)


def test_bad_jsonl_names_the_line(tiny_job_dict, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"content": "no text key"}\n')
    spec = _spec(tiny_job_dict, corpus=[str(bad)], data_dir=str(tmp_path / "d"))
    with pytest.raises(DataError, match=r"bad.jsonl:2: no 'text' key; set data.jsonl_text_key"):
        prepare_data(spec, progress=False)


def test_corpus_too_small_for_vocab_or_sequence(tiny_job_dict, tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("print('hello world')\n" * 40 + "x = 1\n" * 40)
    job = copy.deepcopy(tiny_job_dict)
    job["data"] = {"corpus": [str(small)], "data_dir": str(tmp_path / "d")}
    with pytest.raises(DataError, match="too small for model.vocab_size 512.*lower model.vocab_size"):
        prepare_data(parse_job_spec(job), progress=False)

    job["model"].update(vocab_size=258, seq_length=4096)
    with pytest.raises(DataError, match="fewer than one sample of model.seq_length 4096"):
        prepare_data(parse_job_spec(job), progress=False)


def test_forgeflow_prepare_command(tiny_job_file, tmp_path, capsys, monkeypatch):
    from flows.cli import main  # the real entry point: it turns config errors into one line

    # main() sets these defaults for a temporary Prefect server; keep them out of other tests
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    assert main(["prepare", str(tiny_job_file)]) == 0
    assert "reused" in capsys.readouterr().out  # the session's data, found complete

    code = main(["prepare", str(tiny_job_file), "--set", f"data.corpus=[{tmp_path}/nope.txt]"])
    err = capsys.readouterr().err
    assert code == 2 and "nope.txt' does not exist" in err and "Traceback" not in err


def test_prepare_is_deterministic_across_processes(tiny_prepared, tiny_job_dict, tmp_path, repo_root):
    """Same corpus and settings in a fresh interpreter (new hash seeds) -> identical bytes."""
    import subprocess
    import sys

    import yaml

    job = copy.deepcopy(tiny_job_dict)
    job["data"]["data_dir"] = str(tmp_path / "again")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    code = ("import sys; from training.config import load_job_spec; from training.data import "
            "prepare_data; prepare_data(load_job_spec(sys.argv[1]), progress=False)")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "job.yaml")], cwd=repo_root,
                   check=True, timeout=300, env={**os.environ, "PYTHONHASHSEED": "12345"})
    for name in ("tokenizer/tokenizer.json", "train.bin", "val.bin"):
        assert (tmp_path / "again" / name).read_bytes() == (tiny_prepared.data_dir / name).read_bytes(), name
