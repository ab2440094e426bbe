"""The package's structure: no import cycle among its modules (typing-only imports count too:
a cycle there is a circle a reader walks)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "aioloader"


def imports() -> dict[str, set[str]]:
    """Each module's imports of other modules of the package (relative imports resolved)."""
    modules: dict[str, Path] = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level):
                continue
            parts = package.split(".")[: len(package.split(".")) - node.level + 1]
            target = ".".join(parts + ([node.module] if node.module else []))
            for candidate in [target, *(f"{target}.{a.name}" for a in node.names)]:
                if candidate in graph and candidate != name:
                    graph[name].add(candidate)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every module that can reach itself (the facades, which re-export, left out)."""
    facades = {"aioloader", "aioloader.sources"}
    found = []
    for start in graph:
        if start in facades:
            continue
        todo, seen = [(start, [start])], {start}
        while todo:
            node, path = todo.pop()
            for nxt in graph[node] - facades:
                if nxt == start:
                    found.append(path)
                elif nxt not in seen:
                    seen.add(nxt)
                    todo.append((nxt, [*path, nxt]))
    return found


def test_the_checker_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"], ["b", "a"]]


def test_no_import_cycle_among_the_modules() -> None:
    graph = imports()
    assert "aioloader._scope" in graph and "aioloader._plan" in graph["aioloader._scope"]
    assert cycles(graph) == []
