"""Reading format-2 checkpoints (pickled), only for a process that says it trusts them.

Checkpoints written before the plain-data format (manifest "forgeflow-checkpoint/2",
shards "forgeflow-shard/1") keep their structure as Python pickles: the shard's
skeleton (`pickle`) and the manifest's common state (`torch.save`, read with
`weights_only=False`). Unpickling runs whatever code the bytes name, so whoever can
write to the checkpoint storage could run code as the job that loads them.

Such a checkpoint is refused with one error naming the opt-in below, unless the loading
process runs with

    FORGEFLOW_TRUST_LEGACY_CHECKPOINTS=1

which says: "I trust everyone who could have written to the checkpoint storage this
process reads (its bucket or prefix, its folder) to run code as this process". Set it on
every process that loads one (each rank, the export, the evaluation worker) for the one
resume that moves a job off format 2; its next checkpoint is written in the plain format,
and the variable can go.
"""

from __future__ import annotations

import base64
import io
import os
import pickle
from typing import Any

TRUST_ENV = "FORGEFLOW_TRUST_LEGACY_CHECKPOINTS"
LEGACY_MANIFEST_FORMAT = "forgeflow-checkpoint/2"
LEGACY_SHARD_MAGIC = b"FFSHARD1"
LEGACY_SHARD_FORMAT = "forgeflow-shard/1"


def trusted() -> bool:
    """This process opted in to unpickling format-2 checkpoints (see the module doc)."""
    return os.environ.get(TRUST_ENV, "").strip().lower() in ("1", "true", "yes")


def refusal(what: str) -> str:
    """The one error line for a format-2 part read without the opt-in."""
    return (f"{what} is in forgeflow's old checkpoint format ({LEGACY_MANIFEST_FORMAT}), whose "
            "structure is a Python pickle that runs code when loaded, so it is not read. If you "
            "trust everyone who can write to this checkpoint storage, set "
            f"{TRUST_ENV}=1 for the processes that load it (every rank) and load it once; the "
            "next checkpoint is written in the plain-data format")


class _TensorRef:
    """What format 2's skeleton pickles named `checkpoint.shard._TensorRef`."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("checkpoint.shard", "_TensorRef"):
            return _TensorRef
        return super().find_class(module, name)  # trusted: anything, as format 2 always did


def read_skeleton(data: bytes | memoryview, tensors: list[Any]) -> Any:
    """A format-2 shard's skeleton with its tensors put back. Only with the opt-in."""
    if not trusted():
        raise PermissionError(refusal("this shard"))
    skeleton = _Unpickler(io.BytesIO(bytes(data))).load()

    def walk(node: Any) -> Any:
        if isinstance(node, _TensorRef):
            return tensors[node.index]
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()} if type(node) is dict else type(node)(
                (k, walk(v)) for k, v in node.items())
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, tuple) and not hasattr(node, "_fields"):
            return tuple(walk(v) for v in node)
        return node

    return walk(skeleton)


def read_common(text: str) -> Any:
    """A format-2 manifest's common state (torch-pickled, base64). Only with the opt-in."""
    if not trusted():
        raise PermissionError(refusal("this manifest's common state"))
    if not text:
        return None
    import torch

    return torch.load(io.BytesIO(base64.b64decode(text)), map_location="cpu", weights_only=False)
