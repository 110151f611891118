"""The plain-data form of a checkpoint's structure: JSON values only, never a pickle.

A rank's state (model, optimizer, RNG streams, trainer state) is nested dicts, lists and
tuples of tensors and plain values. `to_plain` turns that structure into a JSON value and
`from_plain` turns it back; neither ever creates an object of a type named by the data,
so reading a checkpoint cannot run code from storage (the format before this one, a
pickle, could: see checkpoint.legacy).

What is stored, and how it comes back:

    None, bool, int, float, str    as themselves (a subclass such as an IntEnum comes back
                                   as its base type)
    list                           a JSON array
    dict with str keys             a JSON object (a dict subclass comes back as a dict)
    any other dict                 {"$dict": [[key, value], ...]}  (e.g. int keys)
    tuple                          {"$tuple": [...]}   (random.getstate() is one)
    bytes                          {"$bytes": base64}
    numpy array / numpy scalar     {"$ndarray": {dtype, shape, data}} / {"$npscalar": ...}
                                   (numeric dtypes only: np.random.get_state() holds one)
    tensor                         {"$tensor": whatever the caller's codec makes of it}: an
                                   index into the shard's tensor data, or inline bytes

A str-keyed dict that has a key starting with "$" is stored as {"$dict": ...}, so a tag
is never mistaken for data. Anything else (a namedtuple, a class instance) is refused at
save time with `PlainDataError`, naming where it is in the state.
"""

from __future__ import annotations

import base64
from typing import Any, Callable

import numpy as np
import torch


class PlainDataError(TypeError):
    """A value that a checkpoint does not store (saving) or a malformed structure (loading)."""


_NUMERIC_KINDS = "biufc"  # bool, int, uint, float, complex: no object or void dtypes


def _array_to_plain(array: np.ndarray, where: str) -> dict[str, Any]:
    if array.dtype.kind not in _NUMERIC_KINDS:
        raise PlainDataError(f"checkpoint state at {where or '/'}: a numpy array of dtype {array.dtype} "
                             "is not stored (numeric dtypes only)")
    return {"dtype": array.dtype.str, "shape": list(array.shape),
            "data": base64.b64encode(np.ascontiguousarray(array).tobytes()).decode()}


def _array_from_plain(raw: Any) -> np.ndarray:
    try:
        dtype = np.dtype(raw["dtype"])
        if dtype.kind not in _NUMERIC_KINDS:
            raise PlainDataError(f"numpy dtype {raw['dtype']!r} is not a stored dtype")
        data = base64.b64decode(raw["data"], validate=True)
        return np.frombuffer(data, dtype=dtype).reshape(raw["shape"]).copy()
    except PlainDataError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise PlainDataError(f"malformed numpy array in checkpoint structure: {e}") from None


def to_plain(node: Any, tensor: Callable[[torch.Tensor], Any], where: str = "") -> Any:
    """The JSON value of `node`; each tensor becomes {"$tensor": tensor(t)}. Raises
    PlainDataError naming the first value that is not tensor, numpy or plain data."""
    if node is None or isinstance(node, bool):
        return node
    if isinstance(node, int):
        return int(node)
    if isinstance(node, float):
        return float(node)
    if isinstance(node, str):
        return str(node)
    if isinstance(node, torch.Tensor):
        return {"$tensor": tensor(node)}
    if isinstance(node, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in node):
            return {str(k): to_plain(v, tensor, f"{where}/{k}") for k, v in node.items()}
        return {"$dict": [[to_plain(k, tensor, f"{where}/<key>"), to_plain(v, tensor, f"{where}/{k}")]
                          for k, v in node.items()]}
    if isinstance(node, list):
        return [to_plain(v, tensor, f"{where}/{i}") for i, v in enumerate(node)]
    if isinstance(node, tuple) and not hasattr(node, "_fields"):
        return {"$tuple": [to_plain(v, tensor, f"{where}/{i}") for i, v in enumerate(node)]}
    if isinstance(node, bytes):
        return {"$bytes": base64.b64encode(node).decode()}
    if isinstance(node, np.ndarray):
        return {"$ndarray": _array_to_plain(node, where)}
    if isinstance(node, np.generic):
        return {"$npscalar": _array_to_plain(np.asarray(node), where)}
    kind = type(node)
    raise PlainDataError(
        f"checkpoint state at {where or '/'} holds a {kind.__module__}.{kind.__qualname__}; a "
        "checkpoint stores only tensors, numpy arrays and plain data (dict, list, tuple, str, int, "
        "float, bool, None, bytes): convert it (e.g. to a dict) before saving")


def from_plain(node: Any, tensor: Callable[[Any], torch.Tensor]) -> Any:
    """The structure `to_plain` stored; `tensor(x)` rebuilds each {"$tensor": x}. Raises
    PlainDataError on a tag it does not know or a malformed value."""
    if isinstance(node, list):
        return [from_plain(v, tensor) for v in node]
    if not isinstance(node, dict):
        return node
    if len(node) == 1:
        (tag, value), = node.items()
        if tag.startswith("$"):
            return _tagged(tag, value, tensor)
    return {k: from_plain(v, tensor) for k, v in node.items()}


def _tagged(tag: str, value: Any, tensor: Callable[[Any], torch.Tensor]) -> Any:
    try:
        if tag == "$tensor":
            return tensor(value)
        if tag == "$tuple":
            return tuple(from_plain(v, tensor) for v in value)
        if tag == "$dict":
            return {from_plain(k, tensor): from_plain(v, tensor) for k, v in value}
        if tag == "$bytes":
            return base64.b64decode(value, validate=True)
        if tag == "$ndarray":
            return _array_from_plain(value)
        if tag == "$npscalar":
            return _array_from_plain(value)[()]
    except PlainDataError:
        raise
    except (TypeError, ValueError) as e:
        raise PlainDataError(f"malformed {tag} in checkpoint structure: {e}") from None
    raise PlainDataError(f"unknown tag {tag!r} in checkpoint structure (written by a newer forgeflow?)")


def tensor_to_inline(t: torch.Tensor) -> dict[str, Any]:
    """A (small) tensor as JSON: dtype, shape and its bytes in base64 (the manifest's common state)."""
    t = t.detach().to("cpu").contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": base64.b64encode(data).decode()}


def tensor_from_inline(raw: Any) -> torch.Tensor:
    try:
        dtype = getattr(torch, raw["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise PlainDataError(f"unknown tensor dtype {raw['dtype']!r} in checkpoint structure")
        data = bytearray(base64.b64decode(raw["data"], validate=True))
        shape = [int(n) for n in raw["shape"]]
        if not data:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).view(shape).clone()
    except PlainDataError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise PlainDataError(f"malformed inline tensor in checkpoint structure: {e}") from None
