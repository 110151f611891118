"""Replacing a file in one step: whole new content or the old, never a part, no temp left."""

from __future__ import annotations

import json
import os
import stat

import pytest

from infra import atomic_write as aw


def test_writes_replaces_and_leaves_only_the_file(tmp_path):
    path = tmp_path / "deep" / "state.json"
    aw.atomic_write_json(path, {"a": 1}, indent=2)
    assert json.loads(path.read_text()) == {"a": 1} and path.read_text().endswith("\n")
    aw.atomic_write(path, b"\x00binary", durable=False)
    assert path.read_bytes() == b"\x00binary"
    assert os.listdir(path.parent) == ["state.json"]


def test_permissions_follow_the_umask_like_a_plain_write(tmp_path):
    plain = tmp_path / "plain"
    plain.write_text("x")
    atomic = aw.atomic_write(tmp_path / "atomic", "x")
    assert stat.S_IMODE(atomic.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)


def test_a_failed_replace_keeps_the_old_content_and_removes_the_temp(tmp_path, monkeypatch):
    path = tmp_path / "marker"
    aw.atomic_write(path, "old")

    def broken_replace(src, dst):
        raise OSError("disk went away")

    monkeypatch.setattr(aw.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk went away"):
        aw.atomic_write(path, "new")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["marker"]
