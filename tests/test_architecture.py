"""The house's shape, checked on the code itself: the import graph of ``fxpar/``, ``passes/``, ``schedules/`` and
``backends/`` (read with ``ast``, imports inside functions included, type-only ``TYPE_CHECKING`` imports not)."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"fxpar": ROOT / "fxpar", "fxpar.passes": ROOT / "passes", "fxpar.schedules": ROOT / "schedules",
            "fxpar.backends": ROOT / "backends"}
LOWERING_OUTSIDE_THE_PACKAGE = {"fxpar.rank_step", "fxpar.executor", "fxpar.runtime", "fxpar.compiled"}


def _module_name(path: Path) -> str:
    for package, folder in sorted(PACKAGES.items(), key=lambda kv: -len(kv[0])):
        if path.is_relative_to(folder) and (package != "fxpar" or not path.is_relative_to(ROOT / "fxpar" / "testing")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            return ".".join([package, *(parts[:-1] if parts[-1] == "__init__" else parts)])
    raise AssertionError(path)


def _imported(tree: ast.Module, known: set[str]) -> set[str]:
    """The project modules a module imports anywhere (``from pkg import sub`` counts as importing ``pkg.sub``)."""
    for guard in (n for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)):
        guard.body = []
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                    for a in node.names}
    return out & known


@pytest.fixture(scope="module")
def imports() -> nx.DiGraph:
    paths = {_module_name(p): p for folder in PACKAGES.values() for p in folder.rglob("*.py")
             if not p.is_relative_to(ROOT / "fxpar" / "testing")}  # test helpers import the public API
    graph = nx.DiGraph()
    graph.add_nodes_from(paths)
    for name, path in paths.items():
        graph.add_edges_from((name, dep) for dep in _imported(ast.parse(path.read_text()), set(paths)) if dep != name)
    return graph


def test_the_graph_reads_every_package(imports: nx.DiGraph) -> None:
    assert {"fxpar.lower", "fxpar.passes.propagate", "fxpar.schedules.schedule", "fxpar.backends.comm"} <= set(imports)
    assert imports.has_edge("fxpar.pipeline", "fxpar.passes.propagate")


def test_no_import_cycle(imports: nx.DiGraph) -> None:
    cycles = [c for c in nx.strongly_connected_components(imports) if len(c) > 1]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(nx.find_cycle(imports.subgraph(c))[0]) for c in cycles)


def test_schedules_import_nothing_else(imports: nx.DiGraph) -> None:
    outside = {(a, b) for a, b in imports.edges
               if a.startswith("fxpar.schedules") and not b.startswith("fxpar.schedules")}
    assert not outside


def test_passes_do_not_reach_lowering(imports: nx.DiGraph) -> None:
    for name in (n for n in imports if n.startswith("fxpar.passes.")):
        reached = {m for m in nx.descendants(imports, name)
                   if m == "fxpar.lower" or m.startswith("fxpar.lower.") or m in LOWERING_OUTSIDE_THE_PACKAGE}
        assert not reached, f"{name} imports lowering ({sorted(reached)})"
