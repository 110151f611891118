from __future__ import annotations

import json
from pathlib import Path

import pytest

from evalsuite.datasets import (PromptCache, available_datasets, get_dataset, register_dataset,
                                register_task_file, tokenizer_hash)
from evalsuite.errors import DuplicateDatasetError, EvalConfigError, UnknownDatasetError


def test_builtin_registry_and_unknown_name_error():
    assert {"humaneval", "perplexity", "arith-em", "capitals-mc"} <= set(available_datasets())
    with pytest.raises(UnknownDatasetError, match="unknown dataset 'no-such'.*task YAML"):
        get_dataset("no-such")


def test_duplicate_registration_is_refused():
    @register_dataset("dup-test-ds")
    def first(options):
        raise AssertionError

    with pytest.raises(DuplicateDatasetError, match="'dup-test-ds' is already registered"):
        @register_dataset("dup-test-ds")
        def second(options):
            raise AssertionError


def test_bad_options_name_the_field():
    with pytest.raises(EvalConfigError, match=r"(?s)dataset 'humaneval'.*limitt.*did you mean 'limit'"):
        get_dataset("humaneval", {"limitt": 3})


def _task(tmp_path: Path, name: str, rows: list[dict], **fields) -> Path:
    (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = {"name": name, "path": f"{name}.jsonl", "type": "multiple_choice", "prompt": "Q {q}", **fields}
    import yaml
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_user_task_file_registers_and_rejects_bad_samples(tmp_path):
    good = _task(tmp_path, "user-mc-ok", [{"q": "a", "choices": ["x", "y"], "answer": "y"}])
    assert register_task_file(good) == "user-mc-ok"
    assert register_task_file(good) == "user-mc-ok"   # same file again: a no-op
    ds = get_dataset("user-mc-ok")
    assert ds.num_samples() == 1 and ds.kind == "loglikelihood" and ds.metric == "multiple_choice"

    other_dir = tmp_path / "other"
    other_dir.mkdir()
    clash = _task(other_dir, "user-mc-ok", [{"q": "a", "choices": ["x", "y"], "answer": 0}])
    with pytest.raises(DuplicateDatasetError):
        register_task_file(clash)

    bad = _task(tmp_path, "user-mc-bad", [{"q": "a", "choices": ["x", "y"], "answer": "z"}])
    register_task_file(bad)
    with pytest.raises(EvalConfigError, match=r"user-mc-bad.jsonl:1: the answer must be"):
        get_dataset("user-mc-bad").num_samples()

    typo = tmp_path / "typo.yaml"
    typo.write_text("name: t\npath: user-mc-ok.jsonl\ntype: multiple_choice\nprompt: x\npromt: y\n")
    with pytest.raises(EvalConfigError, match="promt"):
        register_task_file(typo)


def test_prompts_are_cached_per_tokenizer(tiny_backend, tmp_path):
    ds = get_dataset("capitals-mc", {"limit": 3})
    cache = PromptCache(tmp_path / "cache")
    first = ds.tokenized_requests(tiny_backend.tokenizer, cache=cache)
    path = cache.path_for(ds, tokenizer_hash(tiny_backend.tokenizer))
    assert path.is_file() and path.parent.name == tokenizer_hash(tiny_backend.tokenizer)
    assert len(first) == 3 * 4   # one request per option
    # The cache is what a second call reads: change it on disk and the change shows.
    rows = json.loads(path.read_text())
    rows[0]["continuation_ids"] = [7, 7, 7]
    path.write_text(json.dumps(rows))
    again = ds.tokenized_requests(tiny_backend.tokenizer, cache=cache)
    assert again[0].continuation_ids == [7, 7, 7]
    # Context + continuation token ids re-encode to the original text.
    text = tiny_backend.tokenizer.decode(first[1].context_ids + first[1].continuation_ids)
    sample = ds.samples[0]
    assert text == f"The capital of {sample['country']} is {sample['choices'][1]}"
