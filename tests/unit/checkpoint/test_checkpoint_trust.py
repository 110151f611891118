"""A checkpoint is data: loading one never runs code from storage.

Format 3 holds tensors and plain data only (checkpoint.plain). A format-2 checkpoint
(pickles) is refused with one error naming the opt-in, is not set aside, and loads as
before with FORGEFLOW_TRUST_LEGACY_CHECKPOINTS=1 (tests/data/checkpoints/legacy-v2 was
written by forgeflow's engine before the change). Hostile pickles planted in a shard or
in the common state must not run: each would create a marker file.
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import random
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpoint.engine import CheckpointEngine, CheckpointError, read_checkpoint
from checkpoint.legacy import TRUST_ENV
from checkpoint.manifest import committed_steps, manifest_key, read_manifest
from checkpoint.plain import PlainDataError
from checkpoint.sharded import GlobalPiece, PieceRequest
from checkpoint.writer import checksum_bytes
from infra.storage import open_storage

LEGACY = Path(__file__).resolve().parents[2] / "data" / "checkpoints" / "legacy-v2"
LEGACY_STEP = 4
REQUESTS = [PieceRequest("w", (4, 6), (0, 0), (4, 6), torch.float32),
            PieceRequest("b", (6,), (0,), (6,), torch.bfloat16)]


@pytest.fixture(autouse=True)
def _no_opt_in(monkeypatch):
    monkeypatch.delenv(TRUST_ENV, raising=False)


class _RunsShell:
    """Unpickling this runs a shell command (what a hostile checkpoint would do)."""

    def __init__(self, marker: Path):
        self.command = f"touch {marker}"

    def __reduce__(self):
        return (os.system, (self.command,))


def _legacy_copy(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(LEGACY, root)
    return root


def _rewrite_manifest(root: Path, **changes) -> None:
    path = root / manifest_key(LEGACY_STEP)
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def _legacy_shard(skeleton: bytes, step: int = LEGACY_STEP) -> bytes:
    """A format-1 shard (b"FFSHARD1", pickled skeleton) holding no tensors."""
    header = json.dumps({"format": "forgeflow-shard/1", "step": step, "tensors": [], "regions": [],
                         "skeleton": {"offset": 0, "nbytes": len(skeleton)}}).encode()
    prefix = b"FFSHARD1" + struct.pack("<Q", len(header)) + header
    return prefix + bytes((-len(prefix)) % 64) + skeleton


def _plant_shard(root: Path, shard: bytes) -> None:
    manifest = json.loads((root / manifest_key(LEGACY_STEP)).read_text())
    record = manifest["shards"][0]
    (root / record["key"]).write_bytes(shard)
    record.update(size=len(shard), checksum=checksum_bytes(shard), pieces=[])
    _rewrite_manifest(root, shards=[record])


def _load(root: Path):
    with CheckpointEngine(str(root), async_save=False, writer="thread") as engine:
        return engine.load(requests=REQUESTS)


def test_a_format2_checkpoint_is_refused_naming_the_opt_in_and_not_set_aside(tmp_path):
    root = _legacy_copy(tmp_path)
    with pytest.raises(CheckpointError) as refused:
        _load(root)
    message = str(refused.value)
    assert f"{TRUST_ENV}=1" in message and "pickle" in message and "\n" not in message
    assert committed_steps(open_storage(str(root))) == [LEGACY_STEP]  # refused, never set aside
    with pytest.raises(CheckpointError, match=TRUST_ENV):
        read_checkpoint(open_storage(str(root)), LEGACY_STEP, REQUESTS)


def test_with_the_opt_in_a_format2_checkpoint_loads_as_before(tmp_path, monkeypatch):
    monkeypatch.setenv(TRUST_ENV, "1")
    loaded = _load(_legacy_copy(tmp_path))
    # The values tests/data/checkpoints/legacy-v2 was written with (see its README).
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    w = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    assert loaded.step == LEGACY_STEP
    assert torch.equal(loaded.pieces[0], w)
    assert torch.equal(loaded.pieces[1], torch.arange(6, dtype=torch.bfloat16))
    rng = loaded.state["rng"]
    assert rng["python"] == random.getstate()
    assert np.array_equal(rng["numpy"][1], np.random.get_state()[1])
    assert torch.equal(rng["torch_cpu"], torch.get_rng_state())
    optimizer = loaded.common["megatron"]["optimizer"]
    assert torch.equal(optimizer["state"]["common_step"], torch.tensor(16.0))
    assert optimizer["param_groups"] == [{"lr": 0.0008, "betas": (0.9, 0.95), "foreach": None}]


def test_a_pickle_planted_in_a_format2_shard_does_not_run(tmp_path):
    root = _legacy_copy(tmp_path)
    marker = tmp_path / "MARKER"
    _plant_shard(root, _legacy_shard(pickle.dumps({"local": _RunsShell(marker), "pieces": []})))
    with pytest.raises(CheckpointError, match=TRUST_ENV):
        with CheckpointEngine(str(root), async_save=False, writer="thread") as engine:
            engine.load()
    assert not marker.exists(), "loading the checkpoint ran code from its shard"


def test_a_pickle_planted_in_the_common_state_does_not_run(tmp_path):
    root = _legacy_copy(tmp_path)
    marker = tmp_path / "MARKER"
    buf = io.BytesIO()
    torch.save({"trainer": _RunsShell(marker)}, buf)
    _rewrite_manifest(root, common=base64.b64encode(buf.getvalue()).decode())
    with pytest.raises(CheckpointError, match=TRUST_ENV):
        _load(root)
    assert not marker.exists(), "loading the checkpoint ran code from its manifest"


def test_a_pickled_shard_under_a_new_manifest_does_not_run(tmp_path):
    """Relabelling a hostile checkpoint as format 3 does not get its pickle read either."""
    root = _legacy_copy(tmp_path)
    marker = tmp_path / "MARKER"
    _plant_shard(root, _legacy_shard(pickle.dumps({"local": _RunsShell(marker), "pieces": []})))
    _rewrite_manifest(root, format="forgeflow-checkpoint/3", common=None)
    with CheckpointEngine(str(root), async_save=False, writer="thread") as engine:
        assert engine.load() is None  # its one step does not verify: set aside, nothing loaded
    assert not marker.exists(), "loading the checkpoint ran code from its shard"
    note = json.loads((root / "step-00000004" / "set-aside.json").read_text())
    assert "FFSHARD1" not in note["reason"] and TRUST_ENV in note["reason"]


def test_a_new_checkpoint_holds_no_pickle_and_round_trips_plain_state_exactly(tmp_path):
    random.seed(11)
    np.random.seed(11)
    local = {"rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                     "torch_cpu": torch.get_rng_state()},
             "ids": {0: np.int64(3), "$odd": b"\x00\xff"}}
    weight = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    common = {"megatron": {"optimizer": {"state": {"common_step": torch.tensor(16.0)},
                                         "param_groups": [{"betas": (0.9, 0.95), "eps": 1e-08}]}},
              "trainer": {"step": 4, "loss": float("inf"), "spike": {"baseline": [1.5], "pending": None}}}
    root = tmp_path / "ckpt"
    with CheckpointEngine(str(root), async_save=False, writer="thread") as engine:
        engine.save(4, local, pieces=[GlobalPiece("w", (4, 6), (0, 0), weight)], common=common)
        loaded = engine.load(requests=REQUESTS[:1])
    storage = open_storage(str(root))
    manifest = read_manifest(storage, 4)
    assert manifest.format == "forgeflow-checkpoint/3"
    shard = storage.get_bytes(manifest.shards[0].key)
    assert shard[:8] == b"FFSHARD2"
    json.loads(json.dumps(manifest.common))  # plain JSON, not a pickle
    assert torch.equal(loaded.pieces[0], weight)
    assert loaded.state["rng"]["python"] == local["rng"]["python"]
    back_np, saved_np = loaded.state["rng"]["numpy"], local["rng"]["numpy"]
    assert back_np[0] == saved_np[0] and back_np[2:] == saved_np[2:]
    assert back_np[1].dtype == saved_np[1].dtype and np.array_equal(back_np[1], saved_np[1])
    assert torch.equal(loaded.state["rng"]["torch_cpu"], local["rng"]["torch_cpu"])
    assert loaded.state["ids"] == {0: np.int64(3), "$odd": b"\x00\xff"}
    assert type(loaded.state["ids"][0]) is np.int64
    back = loaded.common["megatron"]["optimizer"]
    assert back["state"]["common_step"].dtype == torch.float32
    assert torch.equal(back["state"]["common_step"], torch.tensor(16.0))
    assert back["param_groups"] == [{"betas": (0.9, 0.95), "eps": 1e-08}]
    assert loaded.common["trainer"] == common["trainer"]


def test_a_value_a_checkpoint_does_not_store_is_refused_at_save_naming_where(tmp_path):
    class Opaque:
        pass

    with CheckpointEngine(str(tmp_path / "ckpt"), async_save=False, writer="thread") as engine:
        with pytest.raises(PlainDataError, match=r"at /trainer/detector holds a .*Opaque"):
            engine.save(1, {"w": torch.zeros(2)}, common={"trainer": {"detector": Opaque()}})
        with pytest.raises(PlainDataError, match=r"at /local/rng/0: a numpy array of dtype object"):
            engine.save(1, {"rng": [np.array([object()])]})
