from __future__ import annotations

import threading
from pathlib import Path

import pytest

from evalsuite import preload as preload_mod
from evalsuite.errors import PreloadError
from evalsuite.preload import COMPLETE_MARKER, preload, preloaded, preload_key


def _source(tmp_path: Path) -> Path:
    src = tmp_path / "exported"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "sub" / "weights.bin").write_bytes(b"\x01" * 4096)
    return src


def test_preload_copies_once_and_is_removed_after_a_failure(tmp_path, monkeypatch):
    src, root = _source(tmp_path), tmp_path / "shm"
    copies = []
    real_copy = preload_mod.copy_from_storage
    monkeypatch.setattr(preload_mod, "copy_from_storage",
                        lambda url, dest: copies.append(url) or real_copy(url, dest))
    results = []
    threads = [threading.Thread(target=lambda: results.append(preload(f"file://{src}", root))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(copies) == 1 and len(set(results)) == 1               # four trials, one copy
    local = results[0]
    assert (local / "sub" / "weights.bin").read_bytes() == b"\x01" * 4096
    assert (local / COMPLETE_MARKER).is_file()

    with pytest.raises(RuntimeError, match="trial blew up"):
        with preloaded(f"file://{src}", root) as path:
            assert path == local
            raise RuntimeError("trial blew up")
    assert not local.exists()                                          # removed anyway
    assert not list(root.glob(f"{preload_key(f'file://{src}')}*"))


def test_preload_of_an_empty_source_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(PreloadError, match="no files there"):
        preload(str(tmp_path / "empty"), tmp_path / "shm")
    assert not [p for p in (tmp_path / "shm").iterdir() if not p.name.endswith(".lock")]


def test_a_trial_on_a_node_without_the_preload_makes_it_there(tiny_model, tmp_path):
    from evalsuite.datasets import DatasetRef
    from evalsuite.preload import preload_key
    from evalsuite.records import read_completion
    from evalsuite.trials import ShardSpec, Trial, run_trial

    source = f"file://{tiny_model}"
    root = tmp_path / "other-node-shm"
    trial = Trial(trial_id="remote", backend="transformers", backend_options={"device": "cpu"},
                  shards=[ShardSpec(dataset=DatasetRef(name="arith-em", options={"limit": 2}), shard=0,
                                    start=0, stop=2)],
                  model_path=str(root / preload_key(source)), model_source=source,
                  output_dir=str(tmp_path / "out"))
    run_trial(trial)
    assert (root / preload_key(source) / "config.json").is_file()
    assert read_completion(trial.shards[0].output_path(trial.output_dir)).records == 2


# --- the preload root is private to its user ------------------------------------------------------

def test_the_default_root_is_per_user_and_created_private(tmp_path, monkeypatch):
    import os
    import stat

    from evalsuite.preload import default_preload_root, private_root

    assert default_preload_root().name == f"forgeflow-eval-{os.getuid()}"
    root = private_root(tmp_path / "shm" / "forgeflow-eval")
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


@pytest.mark.parametrize("squat", ["symlink", "group-writable", "other-user"])
def test_a_root_someone_else_could_write_in_is_refused(tmp_path, squat):
    import os

    src = _source(tmp_path)
    root = tmp_path / "shm"
    if squat == "symlink":  # e.g. another user's link from the known name to their own folder
        (tmp_path / "theirs").mkdir()
        root.symlink_to(tmp_path / "theirs")
    else:
        root.mkdir(mode=0o700)
        if squat == "group-writable":
            root.chmod(0o777)
        elif os.getuid() == 0:
            os.chown(root, 4242, -1)
        else:
            pytest.skip("making a folder another user's needs root")
    with pytest.raises(PreloadError, match=f"preload root {root} .*could replace the model"):
        preload(f"file://{src}", root)
    if squat == "symlink":
        assert not list((tmp_path / "theirs").iterdir())  # nothing copied into their folder
