"""Job spec files: good ones load, each bad one gives one ConfigError naming the field and fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from training.config import ConfigError, JobSpec, as_job_spec, dotted_overrides, load_job_spec

REPO = Path(__file__).resolve().parents[3]

GOOD = """\
name: ok
model: {num_layers: 2, hidden_size: 64, num_attention_heads: 4, vocab_size: 512, seq_length: 64}
training: {global_batch_size: 8, steps: 10}
"""


@pytest.fixture
def spec_dir(tmp_path: Path) -> Path:
    (tmp_path / "ok.yaml").write_text(GOOD)
    return tmp_path


def _error(spec_dir: Path, text: str, name: str = "bad.yaml") -> str:
    path = spec_dir / name
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_job_spec(path)
    message = str(info.value)
    assert name in message  # always names the file
    return message


def test_shipped_configs_load():
    spec = load_job_spec(REPO / "configs" / "tiny-cpu.yaml")
    assert isinstance(spec, JobSpec) and spec.name == "tiny-cpu"
    assert spec.training.lr == 1.0e-3 and spec.training.weight_decay == 0.1  # base.yaml merged
    assert spec.model.kv_heads == 4 and spec.data.corpus == ["stdlib"]


def test_good_file_and_defaults(spec_dir):
    spec = load_job_spec(spec_dir / "ok.yaml")
    assert spec.model.kv_heads == 4 and spec.model.ffn_size == 192
    # not submitted: the job is "local"; each job's paths are its own (for_job)
    assert spec.job == "local" and spec.resolved_run_dir == Path("runs/ok/local")
    assert spec.checkpoint.url == "runs/ok/local/checkpoints"


def test_each_job_of_one_spec_gets_its_own_run_dir_and_checkpoints(spec_dir):
    spec = load_job_spec(spec_dir / "ok.yaml")
    seven, eight = spec.for_job(7), spec.for_job(8)
    assert (seven.run_dir, seven.checkpoint.url) == ("runs/ok/7", "runs/ok/7/checkpoints")
    assert (eight.run_dir, eight.checkpoint.url) == ("runs/ok/8", "runs/ok/8/checkpoints")
    assert seven.config_hash() == eight.config_hash() == spec.config_hash()  # same weights
    # the content a flow receives: an unsubmitted spec keeps its placeholders, a job's is final
    assert spec.model_dump()["run_dir"] == "runs/{name}/{job}"
    again = as_job_spec(seven.model_dump(mode="json"))
    assert (again.job, again.run_dir, again.checkpoint.url) == ("7", "runs/ok/7", "runs/ok/7/checkpoints")
    assert as_job_spec(spec.model_dump(mode="json")).for_job(9).run_dir == "runs/ok/9"
    with pytest.raises(ConfigError, match="already belongs to job 7"):
        again.for_job(8)


def test_fixed_paths_and_s3_prefixes(spec_dir):
    spec = load_job_spec(spec_dir / "ok.yaml", {"run_dir": "/data/{name}-{job}",
                                                "checkpoint": {"url": "s3://ckpt/{name}/{job}"}})
    job = spec.for_job(12)
    assert (job.run_dir, job.checkpoint.url) == ("/data/ok-12", "s3://ckpt/ok/12")
    fixed = load_job_spec(spec_dir / "ok.yaml", {"checkpoint": {"url": "/shared/ckpt"}}).for_job(3)
    assert fixed.checkpoint.url == "/shared/ckpt"  # the user's choice (submit refuses a second active one)


def test_unknown_placeholder_is_one_error(spec_dir):
    with pytest.raises(ConfigError, match=r"checkpoint.url .*unknown placeholder 'user'.*\{name\}"):
        load_job_spec(spec_dir / "ok.yaml", {"checkpoint": {"url": "runs/{user}/ckpt"}})


@pytest.mark.parametrize("text,field,fix", [
    # missing field
    ("name: x\nmodel: {num_layers: 2, hidden_size: 64, num_attention_heads: 4, vocab_size: 512,"
     " seq_length: 64}\n", "training", "add it"),
    ("base: ok.yaml\nmodel: {hidden_size: 64, num_layers: null}\n", "model.num_layers", "whole number"),
    # typo'd key
    ("base: ok.yaml\ntraining: {lerning_rate: 0.1}\n", "training.lerning_rate", "check its spelling"),
    ("base: ok.yaml\nmodle: {num_layers: 2}\n", "modle", "did you mean 'model'?"),
    ("base: ok.yaml\ntraining: {warmup_step: 2}\n", "training.warmup_step", "'warmup_steps'"),
    # wrong types
    ("base: ok.yaml\ntraining: {steps: many}\n", "training.steps", "whole number"),
    ("base: ok.yaml\nmodel: {num_layers: 2.5}\n", "model.num_layers", "whole number"),
    ("base: ok.yaml\ntraining: {precision: fp64}\n", "training.precision", "allowed values"),
    ("base: ok.yaml\nmodel: 7\n", "model", "mapping"),
    ("base: ok.yaml\ntraining: {steps: -3}\n", "training.steps", "larger value"),
    ("base: ok.yaml\nname: 'has spaces'\n", "name", "letters, digits"),
    # cross-field checks
    ("base: ok.yaml\nmodel: {num_attention_heads: 5}\n", "num_attention_heads (5)", "pick heads"),
    ("base: ok.yaml\nmodel: {num_query_groups: 3}\n", "num_query_groups (3)", "divides it"),
    ("base: ok.yaml\ntraining: {lr: 1.0e-4, min_lr: 1.0e-3}\n", "min_lr (0.001)", "lower min_lr"),
    ("base: ok.yaml\ntraining: {global_batch_size: 9, micro_batch_size: 2}\n",
     "micro_batch_size (2)", "multiple"),
])
def test_bad_field_is_named_with_a_fix(spec_dir, text, field, fix):
    message = _error(spec_dir, text)
    assert "(1 problem(s))" in message  # one clear error, not a cascade
    assert field in message and fix in message
    assert "Traceback" not in message and "{'" not in message  # no echoed section dicts


def test_bad_yaml_syntax_gives_the_line(spec_dir):
    message = _error(spec_dir, "name: x\nmodel: [1, 2\ntraining: {}\n")
    assert "not valid YAML at line" in message


@pytest.mark.parametrize("text,needle", [
    ("", "the file is empty"),
    ("# only a comment\n", "the file is empty"),
    ("- a\n- b\n", "must be a YAML mapping, got list"),
])
def test_empty_or_non_mapping_file(spec_dir, text, needle):
    assert needle in _error(spec_dir, text)


def test_base_loop_and_missing_base(spec_dir):
    (spec_dir / "a.yaml").write_text("base: b.yaml\n")
    (spec_dir / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="'base:' chain loops back to itself .*remove one"):
        load_job_spec(spec_dir / "a.yaml")
    message = _error(spec_dir, "base: nothere.yaml\n")
    assert "nothere.yaml: no such job spec file (named by 'base:' in" in message


def test_missing_file_and_bad_override(spec_dir):
    with pytest.raises(ConfigError, match="no such job spec file; check the path"):
        load_job_spec(spec_dir / "absent.yaml")
    with pytest.raises(ConfigError, match="must look like section.field=value"):
        dotted_overrides(["training.steps"])
    spec = load_job_spec(spec_dir / "ok.yaml", dotted_overrides(["training.steps=3"]))
    assert spec.training.steps == 3
    with pytest.raises(ConfigError, match="training.stpes"):
        load_job_spec(spec_dir / "ok.yaml", dotted_overrides(["training.stpes=3"]))


@pytest.mark.parametrize("training, needle", [
    ("pipeline_parallel: 2, pipeline_stage_layers: [2, 2]",
     "add up to 4 layers but model.num_layers is 2"),
    ("pipeline_parallel: 2, pipeline_stage_layers: [2]", "must list 2 positive layer counts"),
    ("pipeline_parallel: 2, virtual_pipeline_stages: 2", "4 model chunks but model.num_layers is 2"),
    ("virtual_pipeline_stages: 2", "needs pipeline_parallel > 1"),
])
def test_pipeline_cuts_that_cannot_run_are_refused(spec_dir, training, needle):
    text = GOOD.replace("steps: 10}", f"steps: 10, {training}}}")
    assert needle in _error(spec_dir, text)


def test_uneven_pipeline_cut_is_accepted(spec_dir):
    path = spec_dir / "pp.yaml"
    path.write_text(GOOD.replace("num_layers: 2", "num_layers: 3")
                    .replace("steps: 10}", "steps: 10, pipeline_parallel: 2, pipeline_stage_layers: [1, 2]}"))
    assert load_job_spec(path).training.pipeline_stage_layers == [1, 2]


def test_set_values_are_yaml_except_path_placeholders():
    assert dotted_overrides(["checkpoint.url={run_dir}/checkpoints", "run_dir={name}", "training.steps=5",
                             "eval.suite=[a, b]", "x.y={k: 1}"]) == {
        "checkpoint": {"url": "{run_dir}/checkpoints"}, "run_dir": "{name}", "training": {"steps": 5},
        "eval": {"suite": ["a", "b"]}, "x": {"y": {"k": 1}}}
