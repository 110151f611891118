"""Config files: one YAML loader with `base:` inheritance, one way to report a bad field.

Every config kind (job spec, cluster inventory, evaluation suite, task file) is read
with `load_yaml_mapping` and checked with `validate`, so each of them

- may name a `base:` file (relative to itself) whose values it overrides key by key
  (mappings merge, anything else is replaced), so configs derive instead of copying;
- fails with one error that names the file, every bad field and how to fix it
  (`did you mean 'model'?` for a misspelt key), never a traceback from inside.

Each kind raises its own error class (the `error` argument), so its callers catch
what they already know. `report_error` is how every command prints the error it stops
on (a bad config or any other): one line on stderr, and with --json one JSON object. This module sits in the lowest layer (infra) so that every
package may use it.
"""

from __future__ import annotations

import difflib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class ConfigFileError(ValueError):
    """A config file is missing, malformed or invalid (the default error class)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.safe_load`, except that a key given twice in one mapping is an error: PyYAML
    keeps the last one silently, so a node listed twice or a setting repeated further down
    would change what the file means without a word."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    first_line: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: *defaults` merges: the keys written here override them, as YAML says
        key = loader.construct_object(key_node, deep=True)
        try:
            line = first_line.setdefault(key, key_node.start_mark.line)
        except TypeError:  # an unhashable key: construct_mapping reports it
            continue
        if line != key_node.start_mark.line:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice in one mapping (first at line {line + 1}); keep one",
                key_node.start_mark)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


FIX_HINTS = {
    "missing": "add it",
    "extra_forbidden": "remove it or check its spelling",
    "int_parsing": "use a whole number",
    "int_type": "use a whole number",
    "int_from_float": "use a whole number",
    "float_parsing": "use a number",
    "float_type": "use a number",
    "bool_parsing": "use true or false",
    "bool_type": "use true or false",
    "string_type": "use text (quote it)",
    "string_pattern_mismatch": "use letters, digits, '.', '_' or '-'",
    "string_too_short": "give a non-empty value",
    "greater_than": "use a larger value",
    "greater_than_equal": "use a larger value",
    "less_than": "use a smaller value",
    "less_than_equal": "use a smaller value",
    "literal_error": "use one of the allowed values",
    "enum": "use one of the allowed values",
    "model_type": "write it as a mapping (indented `key: value` lines)",
    "model_attributes_type": "write it as a mapping (indented `key: value` lines)",
    "dict_type": "write it as a mapping (indented `key: value` lines)",
    "list_type": "write it as a list (`[a, b]` or `- item` lines)",
    "tuple_type": "write it as a list (`[a, b]` or `- item` lines)",
}


def merge(base: dict, override: dict) -> dict:
    """`override` on top of `base`: nested mappings merge, other values replace."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def load_yaml_mapping(
    path: str | Path,
    *,
    kind: str,
    needs: str,
    error: type[Exception] = ConfigFileError,
    missing_hint: str = "check the path",
    _seen: tuple[Path, ...] = (),
) -> dict[str, Any]:
    """The mapping in a YAML file, its `base:` chain merged underneath.

    `kind` names the config in messages ("job spec"), `needs` what a file of that kind
    must hold ("name, model and training"); every problem raises `error`."""
    path = Path(path)
    if not path.is_file():
        named_by = f" (named by 'base:' in {_seen[-1]})" if _seen else ""
        raise error(f"{path}: no such {kind} file{named_by}; {missing_hint}")
    if path.resolve() in _seen:
        chain = " -> ".join(str(p) for p in _seen + (path.resolve(),))
        raise error(f"{path}: 'base:' chain loops back to itself ({chain}); remove one of the 'base:' lines")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)  # a SafeLoader
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise error(f"{path}: not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    except UnicodeDecodeError:
        raise error(f"{path}: not a UTF-8 text file") from None
    if data is None:
        raise error(f"{path}: the file is empty; a {kind} needs {needs}")
    if not isinstance(data, dict):
        raise error(f"{path}: a {kind} must be a YAML mapping, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is not None:
        parent = load_yaml_mapping(path.parent / str(base), kind=kind, needs=needs, error=error,
                                   missing_hint=missing_hint, _seen=_seen + (path.resolve(),))
        data = merge(parent, data)
    return data


def validate(model: type[M], data: Any, *, source: str, kind: str,
             error: type[Exception] = ConfigFileError) -> M:
    """`model` validated from `data`; a failure raises `error` with `format_validation_error`."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise error(format_validation_error(source, kind, e, model, data)) from None


def format_validation_error(source: str, kind: str, err: ValidationError, model: type[BaseModel],
                            data: Any = None) -> str:
    """One line per problem: where (list items by their `name`), what, what was given, the fix."""
    lines = [f"{source}: invalid {kind} ({err.error_count()} problem(s))"]
    for e in err.errors():
        loc = tuple(e["loc"])
        hint = FIX_HINTS.get(e["type"], "")
        if e["type"] == "extra_forbidden" and loc:
            close = difflib.get_close_matches(str(loc[-1]), _sibling_fields(model, loc), n=1)
            if close:
                hint += f" (did you mean {close[0]!r}?)"
        msg = e["msg"].removeprefix("Value error, ")
        # A cross-field check names its fields in its message, and a misspelt section is
        # named by its key: echoing a whole mapping or list back would bury the point.
        quiet = e["type"] == "missing" or isinstance(e.get("input"), (dict, list))
        got = "" if quiet else f" (got {e.get('input')!r})"
        lines.append(f"  - {_where(loc, data)}: {msg}{got}" + (f"; fix: {hint}" if hint else ""))
    return "\n".join(lines)


def one_line(exc: BaseException) -> str:
    """A config error's message on one line, as the command line prints it.

    `format_validation_error` lists one problem a line ("  - field: what; fix: how");
    joined with " | " they stay readable and a log line keeps them together.
    """
    lines = [line.strip().removeprefix("- ") for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return repr(exc)
    return lines[0] + (": " + " | ".join(lines[1:]) if len(lines) > 1 else "")


def report_error(error: BaseException | str, as_json: bool = False, exit_code: int = 2, **fields: Any) -> int:
    """Print the error a command stops on and return its exit code (2: the input is wrong).

    One line on stderr, `error: ...` (an exception through `one_line`); with `as_json` (the
    command's --json) also one object on stdout, `{"error": ..., "exit_code": ...}` plus
    `fields` (the planner's alternatives, say), so a script always reads one JSON object."""
    import json
    import sys

    message = error if isinstance(error, str) else one_line(error)
    print(f"error: {message}", file=sys.stderr)
    if as_json:
        print(json.dumps({"error": message, "exit_code": exit_code, **fields}))
    return exit_code


def _where(loc: tuple, data: Any) -> str:
    """`nodes['gpu-a']` rather than `nodes.3` when the list item has a name."""
    out: list[str] = []
    node = data
    for part in loc:
        if isinstance(part, int):
            item = node[part] if isinstance(node, list) and part < len(node) else None
            name = item.get("name") if isinstance(item, dict) else None
            out.append(f"[{name!r}]" if name else f"[{part}]")
            node = item
        else:
            out.append(("." if out else "") + str(part))
            node = node.get(part) if isinstance(node, dict) else None
    return "".join(out) or "(top level)"


def _sibling_fields(model: type[BaseModel], loc: tuple) -> list[str]:
    """The field names allowed next to the one at `loc` (for "did you mean" hints)."""
    for part in loc[:-1]:
        if isinstance(part, int):
            continue  # an item of a list field: its model was found from the field
        field = model.model_fields.get(str(part))
        inner = _model_in(field.annotation) if field else None
        if inner is None:
            return []
        model = inner
    return list(model.model_fields)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds: itself, or inside list[...] / X | None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (list, tuple, typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None
