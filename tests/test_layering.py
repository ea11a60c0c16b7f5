"""Arrows point down only: every import in pagedllm/ (function-level and TYPE_CHECKING ones included) goes to
its own layer unit or to one below it, never sideways to a unit on the same line, and no modules or packages
import each other in a circle. The layer order is read from docs/architecture.md (the block under
`<!-- layers -->`), so the page and the test cannot drift apart."""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "pagedllm"

# Imports that break the order today, each with who removes it; an entry that no longer occurs fails
# test_known_exceptions_still_exist, so the list only shrinks.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}


def read_layers(doc: Path) -> list[list[str]]:
    """The declared units, top layer first; names on one line are peers that know nothing of each other."""
    text = doc.read_text()
    match = re.search(r"<!-- layers -->\s*```text\n(.*?)```", text, re.S)
    assert match, f"{doc} has no ```text block after <!-- layers -->"
    return [line.split("#")[0].split() for line in match.group(1).splitlines() if line.split("#")[0].strip()]


def module_files(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package's __init__)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def import_edges(root: Path, package: str) -> list[tuple[str, str, int]]:
    """(importer, imported module, line) for every import of a module of `package`, wherever it stands in
    the file. `from a.b import c` counts as importing a.b.c when that is a module, else a.b."""
    modules = module_files(root, package)

    def resolve(name: str) -> str | None:
        while name not in modules and "." in name:
            name = name.rpartition(".")[0]
        return name if name in modules else None

    edges = set()
    for importer, (path, is_package) in modules.items():
        here = importer if is_package else importer.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = here.split(".")[:len(here.split(".")) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                names = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                if name == package or name.startswith(package + "."):
                    imported = resolve(name)
                    if imported is not None and imported != importer:
                        edges.add((importer, imported, node.lineno))
    return sorted(edges)


def unit_of(module: str, units: list[str]) -> str | None:
    """The declared unit a module belongs to: the longest declared name that is it or a package above it."""
    matches = [unit for unit in units if module == unit or module.startswith(unit + ".")]
    return max(matches, key=len, default=None)


def layering_violations(edges, layers: list[list[str]], exceptions=()) -> list[str]:
    """Imports that reach a higher layer or a peer unit on the same line."""
    rank = {unit: index for index, line in enumerate(layers) for unit in line}   # 0: the top layer
    found = []
    for importer, imported, line in edges:
        if (importer, imported) in exceptions:
            continue
        source, target = unit_of(importer, list(rank)), unit_of(imported, list(rank))
        if source == target:
            continue
        if rank[target] < rank[source]:
            found.append(f"{importer}:{line} imports {imported}: {target} is above {source}")
        elif rank[target] == rank[source]:
            found.append(f"{importer}:{line} imports {imported}: {source} and {target} are peers on one line")
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = counter[0]
                    counter[0] += 1
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph.get(successor, ())))))
                    advanced = True
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def cycles(edges, units: list[str], exceptions=()) -> list[list[str]]:
    """Circles among modules, and among the packages and modules that sit side by side in one package of
    one unit (a.x -> a.y and a.y -> a.x through any of their modules)."""
    module_graph, sibling_graph = defaultdict(set), defaultdict(set)
    for importer, imported, _ in edges:
        if (importer, imported) in exceptions:
            continue
        module_graph[importer].add(imported)
        if unit_of(importer, units) != unit_of(imported, units):
            continue
        source, target = importer.split("."), imported.split(".")
        common = 0
        while common < min(len(source), len(target)) and source[common] == target[common]:
            common += 1
        if common < min(len(source), len(target)):   # neither is a package above the other
            sibling_graph[".".join(source[:common + 1])].add(".".join(target[:common + 1]))
    return _cycles(module_graph) + [c for c in _cycles(sibling_graph) if c not in _cycles(module_graph)]


@pytest.fixture(scope="module")
def layers() -> list[list[str]]:
    return read_layers(ROOT / "docs" / "architecture.md")


@pytest.fixture(scope="module")
def edges() -> list[tuple[str, str, int]]:
    return import_edges(ROOT, PACKAGE)


def test_every_module_belongs_to_a_declared_layer(layers):
    units = [unit for line in layers for unit in line]
    assert len(units) == len(set(units)), "a unit is declared twice"
    orphans = [module for module in module_files(ROOT, PACKAGE) if unit_of(module, units) is None]
    assert not orphans, f"declare these in docs/architecture.md's layers: {orphans}"


def test_imports_point_down_only(edges, layers):
    violations = layering_violations(edges, layers, KNOWN_EXCEPTIONS)
    assert not violations, "imports against the layer order:\n" + "\n".join(violations)


def test_no_circles_between_modules_or_packages(edges, layers):
    found = cycles(edges, [unit for line in layers for unit in line], KNOWN_EXCEPTIONS)
    assert not found, f"import circles: {found}"


def test_the_package_imports_nothing_from_the_source_tree():
    """benchmarks/ and tests/ sit above the package and are not installed with it: pagedllm never imports them."""
    found = []
    for module, (path, _) in module_files(ROOT, PACKAGE).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{module}:{node.lineno} imports {name}" for name in names
                      if name.partition(".")[0] in ("benchmarks", "tests")]
    assert not found, found


def test_known_exceptions_still_exist(edges):
    present = {(importer, imported) for importer, imported, _ in edges}
    stale = [pair for pair in KNOWN_EXCEPTIONS if pair not in present]
    assert not stale, f"fixed, so remove from KNOWN_EXCEPTIONS: {stale}"


def test_the_walk_sees_function_level_relative_and_type_checking_imports(tmp_path):
    """The checks on a small package: an upward import inside a function, a relative one under
    TYPE_CHECKING closing a circle, and a peer import, each found and named."""
    package = tmp_path / "toy"
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low" / "__init__.py").write_text("")
    (package / "low" / "a.py").write_text("def f():\n    from toy.high import g\n")
    (package / "low" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\n")
    (package / "low" / "c.py").write_text("import toy.low.b\n")
    (package / "high.py").write_text("from toy.low import a\nimport toy.peer\n")
    (package / "peer.py").write_text("")
    layers = [["toy"], ["toy.high", "toy.peer"], ["toy.low"]]
    toy_edges = import_edges(tmp_path, "toy")
    assert ("toy.low.a", "toy.high", 2) in toy_edges
    assert layering_violations(toy_edges, layers) == [
        "toy.high:2 imports toy.peer: toy.high and toy.peer are peers on one line",
        "toy.low.a:2 imports toy.high: toy.high is above toy.low"]
    assert cycles(toy_edges, ["toy", "toy.high", "toy.peer", "toy.low"]) == [["toy.high", "toy.low.a"],
                                                                            ["toy.low.b", "toy.low.c"]]
