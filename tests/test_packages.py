"""Two packages in one repository: the library (pyexpcache) never imports the benchmark suite
(expcache_bench), and the imports of both form no circle."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import import_graph

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("pyexpcache", "expcache_bench")


def _loaded_after(statement: str) -> list[str]:
    """The modules a fresh interpreter (this tree first on its path) holds after ``statement``."""
    code = f"import json, sys; {statement}; print(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO, env=_env()
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _suite(loaded: list[str]) -> list[str]:
    return [m for m in loaded if m == "expcache_bench" or m.startswith("expcache_bench.")]


def test_import_pyexpcache_loads_nothing_of_the_suite():
    loaded = _loaded_after("import pyexpcache")
    assert "pyexpcache" in loaded
    assert _suite(loaded) == []


def test_import_pyexpcache_hf_loads_nothing_of_the_suite():
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"pyexpcache.hf needs {' and '.join(missing)} (pip install expcache[hf])")
    loaded = _loaded_after("import pyexpcache.hf")
    assert "pyexpcache.hf._offload" in loaded and "pyexpcache.routing" in loaded
    assert _suite(loaded) == []


def test_the_suite_is_what_loads_it():
    # The check above can see the suite: importing it shows in the same list.
    assert "expcache_bench.cli" in _suite(_loaded_after("import expcache_bench.cli"))


def test_no_library_file_imports_the_suite():
    """Anywhere in a file, function bodies included; only `python3 -m pyexpcache` (deprecated)
    forwards to the suite's command line."""
    allowed = {REPO / "pyexpcache" / "__main__.py"}
    found = []
    for path in sorted((REPO / "pyexpcache").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            if any(n == "expcache_bench" or n.startswith("expcache_bench.") for n in names):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert [f for f in found if REPO / f.split(":")[0] not in allowed] == []
    assert found, "pyexpcache/__main__.py forwards to expcache_bench: the scan should see it"


@pytest.mark.parametrize("functions", [False, True], ids=["module level", "function bodies too"])
def test_no_import_circle(functions):
    """Module-level imports form a DAG; and no import in a function closes a circle either (one
    there keeps a command's --help fast, it does not hide a circle)."""
    edges = import_graph.graph(REPO, PACKAGES, functions=functions)
    assert "expcache_bench.modes" in edges["expcache_bench.cli"]  # the graph has the edges it should
    assert "pyexpcache.routing" in edges["pyexpcache.hf._record"]
    cycle = import_graph.find_cycle(edges)
    assert cycle is None, import_graph.describe(cycle, edges, import_graph.modules(REPO, PACKAGES), REPO)


def test_the_circle_finder_finds_a_circle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("from .sub import b\nA = 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import C\n")
    (pkg / "c.py").write_text("import json\nfrom pkg import a\nC = 2\n")
    edges = import_graph.graph(tmp_path, ("pkg",))
    assert import_graph.find_cycle(edges) is None  # b imports c in a function only
    cycle = import_graph.find_cycle(import_graph.graph(tmp_path, ("pkg",), functions=True))
    assert cycle is not None and set(cycle) == {"pkg.a", "pkg.sub.b", "pkg.c"}, cycle
    (pkg / "sub" / "b.py").write_text("from ..c import C\n")
    edges = import_graph.graph(tmp_path, ("pkg",))
    cycle = import_graph.find_cycle(edges)
    text = import_graph.describe(cycle, edges, import_graph.modules(tmp_path, ("pkg",)), tmp_path)
    assert "pkg.sub.b -> pkg.c (pkg/sub/b.py:1)" in text, text
