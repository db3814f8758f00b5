"""The repository's import graph: no cycle, and no module importing one of a higher layer.

Every ``.py`` module of the packages is parsed (never imported), and every import of a
first-party module counts: at module level, inside functions and under ``TYPE_CHECKING``, so
that an import moved into a function or behind a type-only guard cannot hide a cycle. An
import names the deepest module it reaches (``from cluster.config import experiment`` reaches
``cluster.config.experiment``, ``from cluster.config import ConfigError`` the package
``cluster.config``); importing a submodule is not counted as importing its package's
``__init__``.

One test imports: a fresh interpreter loads the run's start-up modules and must not load the
third-party modules that only some runs use and that take seconds to import.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("actors", "algorithms", "benchmarks", "cluster", "datasets", "models", "privacy")

# Third-party modules a run's start-up must not import (times from ``python -X importtime``):
# dp-accounting, which imports scipy.signal and scipy.stats (~2.7 s together), serves record-level
# accounting only (``privacy.record_level``, ``privacy.sample_level``, ``privacy.tuning``'s
# ``privacy.repeat_select``); scipy.stats alone (1.1-1.3 s) only ε against the server under
# client-placed noise (``privacy.participation``). scipy.special and scipy.fft stay: the
# client-level accountants (``privacy.rdp``, ``privacy.pld_numpy``) compute with them.
NOT_AT_START_UP = ("dp_accounting", "scipy.stats", "scipy.signal")
START_UP = ("cluster.runtime.experiment", "cluster.cli.run")

# Lowest first: a module may import its own layer and those below it, never one above. A
# module's layer is that of the longest prefix naming it. The run's data store (with the memory
# checks it uses) and its round records sit below the privacy claims and the tracking: a
# sample-level claim is computed from the store's client sizes, and the tracker writes the round
# records.
LAYERS = (
    ("models",),
    ("datasets",),
    ("algorithms",),
    ("actors", "privacy"),
    ("cluster.config", "cluster.redaction"),
    (
        "cluster.runtime.memory",
        "cluster.runtime.records",
        "cluster.runtime.store",
        "cluster.runtime.storage_checks",
    ),
    ("cluster.claims", "cluster.tracking"),
    ("cluster.runtime",),
    ("cluster.analysis",),
    ("cluster.cli",),
    ("cluster", "benchmarks"),
)


@dataclass(frozen=True)
class Import:
    """One import statement's edge: ``importer`` imports ``imported`` at ``path``:``line``."""

    importer: str
    imported: str
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.importer} imports {self.imported}"


def modules_under(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Every module of ``packages`` under ``root``, by dotted name (a package by its own)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def _deepest(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of the dotted ``name`` that is a module of ours, else None."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def _imported_names(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """The dotted names an import statement reaches: each module, or each ``module.name``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative: from the importing module's package, level - 1 steps up
        parts = package.split(".")
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join([*parts, *([node.module] if node.module else [])])
    else:
        base = node.module
    return [f"{base}.{alias.name}" for alias in node.names]


def imports_of(name: str, path: Path, modules: dict[str, Path], root: Path) -> list[Import]:
    """Every first-party import in the module ``name`` (all of them: see the module doc)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[Import, None] = {}  # in order, once per imported module and line
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        for dotted in _imported_names(node, package):
            imported = _deepest(dotted, modules)
            if imported is not None and imported != name:
                found[Import(name, imported, str(path.relative_to(root)), node.lineno)] = None
    return list(found)


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, list[Import]]:
    """Each module's first-party imports."""
    modules = modules_under(root, packages)
    return {name: imports_of(name, path, modules, root) for name, path in modules.items()}


def find_cycle(graph: dict[str, list[Import]]) -> list[Import] | None:
    """One cycle of the graph as its imports in order (the last one's ``imported`` is the
    first one's ``importer``), else None. Iterative depth-first search."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once finished
    for start in sorted(graph):
        if start in state:
            continue
        path: list[Import] = []
        stack = [(start, iter(graph[start]))]
        state[start] = "open"
        while stack:
            module, edges = stack[-1]
            edge = next(edges, None)
            if edge is None:
                state[module] = "done"
                stack.pop()
                if path:
                    path.pop()
                continue
            if state.get(edge.imported) == "open":
                opened = next(i for i, e in enumerate(path) if e.importer == edge.imported)
                return [*path[opened:], edge]
            if edge.imported not in state:
                state[edge.imported] = "open"
                path.append(edge)
                stack.append((edge.imported, iter(graph.get(edge.imported, []))))
    return None


def layer_of(module: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> int | None:
    """The index in ``layers`` of the longest prefix naming ``module``, else None."""
    best, best_length = None, -1
    for index, prefixes in enumerate(layers):
        for prefix in prefixes:
            named = module == prefix or module.startswith(prefix + ".")
            if named and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    return best


def upward_imports(
    graph: dict[str, list[Import]], layers: tuple[tuple[str, ...], ...] = LAYERS
) -> list[Import]:
    """Every import of a module of a higher layer than the importer's."""
    return [
        edge
        for edges in graph.values()
        for edge in edges
        if layer_of(edge.imported, layers) > layer_of(edge.importer, layers)
    ]


def _describe_cycle(cycle: list[Import]) -> str:
    names = " -> ".join([cycle[0].importer, *(edge.imported for edge in cycle)])
    return f"import cycle {names}:\n" + "\n".join(f"  {edge}" for edge in cycle)


@pytest.fixture(scope="module")
def graph() -> dict[str, list[Import]]:
    return import_graph(REPO, PACKAGES)


def test_no_import_cycle(graph):
    cycle = find_cycle(graph)
    assert cycle is None, _describe_cycle(cycle)


def test_every_module_has_a_layer(graph):
    assert [name for name in graph if layer_of(name) is None] == []


def test_no_module_imports_a_higher_layer(graph):
    upward = upward_imports(graph)
    assert upward == [], "imports of a higher layer:\n" + "\n".join(map(str, upward))


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_cycle_through_a_function_and_a_type_only_import_is_found(tmp_path):
    _write(
        tmp_path,
        {
            "low/__init__.py": "",
            "low/a.py": "def f():\n    from low.b import g\n",
            "low/b.py": "import typing\nif typing.TYPE_CHECKING:\n    from . import c\n",
            "low/c.py": "import low.a\n",
            "low/d.py": "from low.a import f\n",  # on no cycle
        },
    )
    cycle = find_cycle(import_graph(tmp_path, ("low",)))
    assert cycle is not None
    assert [edge.importer for edge in cycle] == ["low.a", "low.b", "low.c"]
    assert cycle[-1].imported == "low.a"
    assert str(cycle[1]) == "low/b.py:3: low.b imports low.c"
    _write(tmp_path, {"low/c.py": ""})
    assert find_cycle(import_graph(tmp_path, ("low",))) is None


def test_an_import_of_a_higher_layer_is_named_by_its_line(tmp_path):
    _write(
        tmp_path,
        {
            "low/__init__.py": "",
            "low/a.py": "import os\n\n\ndef f():\n    from high.b import g\n",
            "high/__init__.py": "",
            "high/b.py": "from low.a import f\n",
        },
    )
    graph = import_graph(tmp_path, ("low", "high"))
    upward = upward_imports(graph, (("low",), ("high",)))
    assert [str(edge) for edge in upward] == ["low/a.py:5: low.a imports high.b"]
    assert upward_imports(graph, (("low", "high"),)) == []


def test_start_up_imports_neither_dp_accounting_nor_scipy_stats():
    """A fresh interpreter, as ``python -m cluster run`` starts: the modules it loads."""
    code = f"import sys, {', '.join(START_UP)}; print(*sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    loaded = done.stdout.split()
    assert set(START_UP) <= set(loaded)  # the listing is read right
    heavy = [
        name
        for name in loaded
        if any(name == top or name.startswith(top + ".") for top in NOT_AT_START_UP)
    ]
    assert heavy == [], f"imported at start-up: {sorted(heavy)}"
