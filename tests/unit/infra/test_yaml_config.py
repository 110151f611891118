"""One YAML loader for every config kind: `base:` inheritance and uniform, field-naming errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evalsuite.datasets import register_task_file
from evalsuite.errors import EvalConfigError
from evalsuite.suite import load_suite
from infra.yaml_config import ConfigFileError, load_yaml_mapping, merge, report_error
from scheduler.cluster import ClusterError, load_cluster
from training.config import ConfigError, load_job_spec

REPO = Path(__file__).resolve().parents[3]
NODE = "  - {name: a, gpu_type: A10, gpu_count: 2}\n"
TASK = "name: {name}\npath: rows.jsonl\ntype: exact_match\nprompt: 'Q: {{q}}'\n"

# kind -> (loader, its error class, a good file, the same with a misspelt key, the key, its fix)
KINDS = {
    "job spec": (load_job_spec, ConfigError, f"base: {REPO}/configs/tiny-cpu.yaml\n",
                 f"base: {REPO}/configs/tiny-cpu.yaml\ntraining: {{warmup_step: 2}}\n",
                 "training.warmup_step", "did you mean 'warmup_steps'?"),
    "cluster inventory": (load_cluster, ClusterError, f"name: c\nnodes:\n{NODE}",
                          "name: c\nnodes:\n  - {name: a, gpu_type: A10, gpu_count: 2, gpu_cuont: 2}\n",
                          "nodes['a'].gpu_cuont", "did you mean 'gpu_count'?"),
    "suite": (load_suite, EvalConfigError, "name: s\ndatasets: [{name: arith-em}]\n",
              "name: s\ndatasets: [{name: arith-em, optoins: {}}]\n",
              "datasets['arith-em'].optoins", "did you mean 'options'?"),
    "task file": (register_task_file, EvalConfigError, TASK.format(name="yaml-cfg-task"),
                  TASK.format(name="yaml-cfg-task") + "promt: x\n", "promt", "did you mean 'prompt'?"),
}


@pytest.fixture
def folder(tmp_path) -> Path:
    (tmp_path / "rows.jsonl").write_text('{"q": "1+1", "answer": "2"}\n')
    return tmp_path


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_names_the_misspelt_field_and_the_fix(folder, kind):
    load, error, good, bad, field, fix = KINDS[kind]
    (folder / "good.yaml").write_text(good)
    load(str(folder / "good.yaml"))
    (folder / "bad.yaml").write_text(bad)
    with pytest.raises(error) as info:
        load(str(folder / "bad.yaml"))
    message = str(info.value)
    assert message.startswith(f"{folder / 'bad.yaml'}: invalid {kind} (1 problem(s))"), message
    assert f"  - {field}: " in message and f"fix: remove it or check its spelling ({fix})" in message


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_reports_yaml_syntax_with_its_line(folder, kind):
    load, error, *_ = KINDS[kind]
    (folder / "broken.yaml").write_text("name: x\nnodes: [1, 2\nother: {}\n")
    with pytest.raises(error, match=r"broken.yaml: not valid YAML at line \d+, column \d+"):
        load(str(folder / "broken.yaml"))


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_refuses_a_key_given_twice(folder, kind):
    """PyYAML keeps the last of two equal keys without a word: a second `nodes:` would drop the
    first node list, a repeated setting would override the one a reader sees first."""
    load, error, good, *_ = KINDS[kind]
    first = good.splitlines()[0]
    (folder / "twice.yaml").write_text(good + first + "\n")
    with pytest.raises(error, match=rf"twice.yaml: not valid YAML at line {len(good.splitlines()) + 1}, "
                                    rf"column 1: key '{first.split(':')[0]}' is given twice in one mapping "
                                    r"\(first at line 1\); keep one"):
        load(str(folder / "twice.yaml"))


def test_yaml_merge_keys_still_override_what_they_merge(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("defaults: &d {gpu_type: A10, gpu_count: 2}\nname: c\nnodes:\n"
                    "  - {<<: *d, name: a}\n  - {<<: *d, name: b, gpu_count: 4}\n")
    nodes = load_yaml_mapping(path, kind="cluster inventory", needs="nodes")["nodes"]
    assert [(n["name"], n["gpu_count"]) for n in nodes] == [("a", 2), ("b", 4)]


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_derives_from_a_base_file(folder, kind):
    load, *_ = KINDS[kind]
    bases = {
        "job spec": ("", "training: {steps: 7}\n"),
        "cluster inventory": ("name: base-cluster\ninter_node_bandwidth_gbps: 50\nnodes:\n" + NODE,
                              "name: derived\n"),
        "suite": ("name: base-suite\nslots: 3\ndatasets: [{name: arith-em}]\n", "name: derived\n"),
        "task file": (TASK.format(name="yaml-cfg-base") + "ignore_case: true\n", "name: yaml-cfg-derived\n"),
    }
    base, override = bases[kind]
    if kind == "job spec":
        base = KINDS[kind][2]
    (folder / "base.yaml").write_text(base)
    (folder / "derived.yaml").write_text("base: base.yaml\n" + override)
    loaded = load(str(folder / "derived.yaml"))
    if kind == "job spec":
        assert (loaded.training.steps, loaded.name) == (7, "tiny-cpu")  # override + inherited
    elif kind == "cluster inventory":
        assert (loaded.name, loaded.inter_node_bandwidth_gbps, loaded.total_gpus) == ("derived", 50, 2)
    elif kind == "suite":
        assert (loaded.name, loaded.slots, [d.name for d in loaded.datasets]) == ("derived", 3, ["arith-em"])
    else:
        from evalsuite.datasets import get_dataset

        assert loaded == "yaml-cfg-derived" and get_dataset(loaded).spec.ignore_case


def test_base_chains_merge_mappings_and_replace_the_rest(tmp_path):
    (tmp_path / "a.yaml").write_text("x: {p: 1, q: 2}\nitems: [1, 2]\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\nx: {q: 3}\nitems: [9]\n")
    (tmp_path / "c.yaml").write_text("base: b.yaml\nx: {r: 4}\n")
    assert load_yaml_mapping(tmp_path / "c.yaml", kind="thing", needs="x") == {
        "x": {"p": 1, "q": 3, "r": 4}, "items": [9]}
    assert merge({"a": {"b": 1}}, {"a": 2}) == {"a": 2}


@pytest.mark.parametrize("text,needle", [
    ("", "the file is empty; a thing needs x and y"),
    ("[1, 2]\n", "a thing must be a YAML mapping, got list"),
    ("base: missing.yaml\n", "missing.yaml: no such thing file (named by 'base:' in"),
    ("base: me.yaml\n", "'base:' chain loops back to itself"),
])
def test_file_level_problems(tmp_path, text, needle):
    (tmp_path / "me.yaml").write_text(text)
    with pytest.raises(ConfigFileError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        load_yaml_mapping(tmp_path / "me.yaml", kind="thing", needs="x and y")


def test_a_cluster_inventory_file_must_name_its_cluster(tmp_path):
    """The orchestrator keys a cluster's state by its name: a file without one would register as
    the default name and share the queue and cordons of every other nameless inventory."""
    (tmp_path / "rack7.yaml").write_text(f"nodes:\n{NODE}")
    with pytest.raises(ClusterError, match=r"rack7.yaml: the inventory names no cluster; add a line `name: rack7`"):
        load_cluster(tmp_path / "rack7.yaml")


def test_every_command_reports_an_error_one_way(capsys):
    err = ConfigFileError("job.yaml: invalid job spec (2 problem(s))\n  - model.layers: unknown field; fix: num_layers\n"
                          "  - steps: must be > 0")
    assert report_error(err) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == ("error: job.yaml: invalid job spec (2 problem(s)): model.layers: unknown field; "
                                         "fix: num_layers | steps: must be > 0\n")
    assert report_error("--nproc 3 is not a multiple of 2", as_json=True, job="j", alternatives=["more GPUs"]) == 2
    out = capsys.readouterr()
    assert out.err.splitlines() == ["error: --nproc 3 is not a multiple of 2"]
    assert json.loads(out.out) == {"error": "--nproc 3 is not a multiple of 2", "exit_code": 2, "job": "j",
                                   "alternatives": ["more GPUs"]}
