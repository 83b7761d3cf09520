"""The import graph of Python packages, read from their source with ast (nothing is imported):
which module imports which at module level, and the circles in it. Used by test_packages.py.

An edge A -> B means that importing A runs ``import B`` (or ``from B import ...``) while A's body
executes: a statement at module level, in an ``if``/``try``/``with`` there or in a class body,
not in a function and not under ``if TYPE_CHECKING:``. ``from P import name`` is an edge to the
module ``P.name`` when that is a module, else to ``P``. Importing a module imports its parent
packages first: an edge to ``P.M`` is also one to each package above it, except the packages above
A (they are being imported already when A runs).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Optional


def modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Every module of ``packages`` (folders under ``root``) by its dotted name; a package by its
    name, its ``__init__.py`` the file."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_package(name: str, found: dict[str, Path]) -> bool:
    return name in found and found[name].name == "__init__.py"


def _resolve(module: str, node: ast.ImportFrom, found: dict[str, Path]) -> str:
    """The absolute module a ``from`` import in ``module`` names."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if _is_package(module, found) else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level(body: list) -> Iterator[ast.stmt]:
    """The import statements that run when a module's body runs."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        elif isinstance(node, ast.If):
            if not _type_checking(node.test):
                yield from _module_level(node.body)
            yield from _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            for part in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from _module_level(part)
        elif isinstance(node, (ast.With, ast.For, ast.While, ast.ClassDef)):
            yield from _module_level(node.body)
            yield from _module_level(getattr(node, "orelse", []))


def imports(module: str, path: Path, found: dict[str, Path], *, functions: bool = False) -> list[tuple[str, int]]:
    """The modules of ``found`` that ``module`` imports, each with the line of the import: at
    module level, or anywhere (``functions``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = (
        [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        if functions
        else list(_module_level(tree.body))
    )
    targets = []
    for node in nodes:
        if isinstance(node, ast.Import):
            targets += [(alias.name, node.lineno) for alias in node.names]
            continue
        base = _resolve(module, node, found)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            targets.append((sub if sub in found else base, node.lineno))
    own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
    out = []
    for target, line in targets:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name in found and name != module and (name == target or name not in own):
                out.append((name, line))
    return out


def graph(root: Path, packages: tuple[str, ...], *, functions: bool = False) -> dict[str, dict[str, int]]:
    """{module: {module it imports: line}} over every module of ``packages``."""
    found = modules(root, packages)
    out = {}
    for name, path in found.items():
        out[name] = {}
        for target, line in imports(name, path, found, functions=functions):
            out[name].setdefault(target, line)
    return out


def find_cycle(edges: dict[str, dict[str, int]]) -> Optional[list[str]]:
    """A circle of ``edges`` as the modules along it, the first again at the end; None when the
    graph is a DAG."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> Optional[list[str]]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def describe(cycle: list[str], edges: dict[str, dict[str, int]], found: dict[str, Path], root: Path) -> str:
    """A circle as text, each step with the file and line of its import."""
    steps = [f"{a} -> {b} ({found[a].relative_to(root)}:{edges[a][b]})" for a, b in zip(cycle, cycle[1:])]
    return "import circle:\n  " + "\n  ".join(steps)
