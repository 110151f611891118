"""The import direction of the project's packages (ARCHITECTURE.md), checked from source.

Parses every library module's imports (no import is executed) and fails on:
- a cycle between files (two modules that import each other, directly or around a loop),
- a cycle between top-level packages,
- an import of a package from a lower layer (the layers below),
- a Prefect import outside flows/ and tasks/,
- a package whose `__init__.py` module list (one line per module, indented four spaces:
  `name  what it holds`; `a / b` lists two; a subpackage may be written `name/`) misses one
  of its modules or names one that is not there.
Lazy imports inside functions count: a cycle hidden in a function is still a cycle.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Lowest first. A package may import only the packages listed before it.
# testing (the harness of tests and benchmarks: local S3, Slurm and Prefect servers, node
# faults, a tiny checkpoint) is last, so that no product package can import it.
LAYERS = ["infra", "checkpoint", "diagnosis", "training", "scheduler", "evalsuite", "tasks", "flows", "testing"]
PREFECT_ALLOWED = {"flows", "tasks"}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in LAYERS:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path) -> set[str]:
    """Absolute names imported by a module (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _project_edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imports(name, path):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        edges[name] = targets
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


@pytest.fixture(scope="module")
def edges() -> dict[str, set[str]]:
    return _project_edges(_modules())


def test_every_top_level_package_is_in_a_layer():
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(LAYERS), f"add new packages to LAYERS in {__file__}"


def test_no_import_cycle_between_files(edges):
    assert _cycles(edges) == []


def test_no_import_cycle_between_packages(edges):
    package_edges: dict[str, set[str]] = {}
    for source, targets in edges.items():
        package_edges.setdefault(source.split(".")[0], set()).update(
            t.split(".")[0] for t in targets if t.split(".")[0] != source.split(".")[0])
    assert _cycles(package_edges) == []


def test_packages_import_only_lower_layers(edges):
    rank = {pkg: i for i, pkg in enumerate(LAYERS)}
    upward = sorted(f"{source} -> {target}" for source, targets in edges.items() for target in targets
                    if rank[target.split(".")[0]] > rank[source.split(".")[0]])
    assert upward == [], f"layers, lowest first: {LAYERS}"


def test_prefect_is_imported_only_by_flows_and_tasks():
    offenders = sorted(name for name, path in _modules().items()
                       if name.split(".")[0] not in PREFECT_ALLOWED
                       and any(i == "prefect" or i.startswith("prefect.") or i.startswith("prefect_")
                               for i in _imports(name, path)))
    assert offenders == []


# a module-list entry: four spaces, then a name (or "a / b"), then a space or the end of the line
_LIST_ENTRY = re.compile(r" {4}([A-Za-z_]\w*(?:\.py|/)?(?: / [A-Za-z_]\w*(?:\.py|/)?)*)(?: |$)")


def _listed_modules(docstring: str) -> set[str]:
    listed = set()
    for line in docstring.splitlines():
        entry = _LIST_ENTRY.match(line)
        if entry:
            listed.update(name.removesuffix(".py").rstrip("/") for name in entry.group(1).split(" / "))
    return listed


def _package_modules(package: Path) -> set[str]:
    """The modules and subpackages (any folder holding Python files) of one package folder."""
    return ({p.stem for p in package.glob("*.py") if p.stem != "__init__"}
            | {p.name for p in package.iterdir() if p.is_dir() and any(p.rglob("*.py"))})


def test_every_package_lists_its_modules():
    wrong = []
    for pkg in LAYERS:
        for init in sorted((ROOT / pkg).rglob("__init__.py")):
            docstring = ast.get_docstring(ast.parse(init.read_text()), clean=False) or ""
            listed, present = _listed_modules(docstring), _package_modules(init.parent)
            where = init.relative_to(ROOT)
            wrong += [f"{where}: add a line for {name}" for name in sorted(present - listed)]
            wrong += [f"{where}: lists {name}, which is not there" for name in sorted(listed - present)]
    assert wrong == [], "each package's __init__ docstring lists its modules one per line:\n" + "\n".join(wrong)


def test_the_checker_reads_a_module_list():
    docstring = ("pkg — what it is.\n\n    alpha     the first\n              continued, not an entry\n"
                 "    beta.py the second\n    gamma / delta  two at once\n    sub/      a subpackage\n"
                 "An aside that mentions omega.\n")
    assert _listed_modules(docstring) == {"alpha", "beta", "gamma", "delta", "sub"}


def test_the_checker_sees_a_cycle_and_an_upward_import():
    # guards the guard: a two-file loop is a cycle, a chain is not
    assert _cycles({"a.x": {"a.y"}, "a.y": {"a.x"}, "a.z": set()}) == [["a.x", "a.y"]]
    assert _cycles({"a.x": {"a.y"}, "a.y": set()}) == []
