"""The package's structure: no import cycle among its modules (typing-only imports count too:
a cycle there is a circle a reader walks)."""

from __future__ import annotations

import ast
import re
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
    assert (
        "aioloader._loader.scope" in graph
        and "aioloader._loader.plan" in graph["aioloader._loader.scope"]
    )
    assert cycles(graph) == []


def wing_of(module: str) -> str:
    """``aioloader._data.seeds`` → ``_data``; the facades and ``__main__`` are their own."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else module


def test_the_wings_depend_on_each_other_without_a_circle() -> None:
    """The folders form layers: base ← data, workers ← fan-in, device ← pipeline ← loader;
    serving and sources beside the loader. A wing importing one that imports it back would be
    a circle a reader walks between folders."""
    graph = imports()
    wings: dict[str, set[str]] = {wing_of(module): set() for module in graph}
    for module, targets in graph.items():
        for target in targets:
            if wing_of(target) != wing_of(module):
                wings[wing_of(module)].add(wing_of(target))
    wings.pop("aioloader", None)  # the facade re-exports every wing
    for deps in wings.values():
        deps.discard("aioloader")
    assert wings["_data"] >= {"_base"} and "_data" in wings["_fanin"]  # the checker sees
    assert cycles(wings) == []


def test_base_imports_no_other_wing() -> None:
    deps = {
        wing_of(t) for m, targets in imports().items() if wing_of(m) == "_base" for t in targets
    }
    assert deps <= {"_base"}, deps


def test_no_private_name_is_imported_from_outside_its_folder() -> None:
    """A ``_name`` is its folder's business: another folder imports only public names."""
    crossings = []
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        package = (
            name.removesuffix(".__init__")
            if path.name == "__init__.py"
            else name.rpartition(".")[0]
        )
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level):
                continue
            parts = package.split(".")[: len(package.split(".")) - node.level + 1]
            target = ".".join(parts + ([node.module] if node.module else []))
            folder = target if node.module is None else target.rpartition(".")[0]
            for alias in node.names:
                if alias.name.startswith("_") and folder != package:
                    crossings.append(f"{name} imports {target}.{alias.name}")
    assert crossings == []


# Files allowed past 400 lines, and why (each one a single concept that reads top to bottom).
LONG_FILES = {
    "aioloader/_loader/loader.py": "torch's DataLoader surface: signature, docstring, attributes",
    "aioloader/_serving/batcher.py": "DynamicBatcher's surface: arguments, their docs, its scope",
    # aioloader bench's workloads, moved whole from their scripts (each a workload's data, its
    # configurations, their checks and its own tables): the next candidates for splitting.
    "aioloader/_bench/cpu.py": "a workload: CPU-heavy transforms and the drop-in Dataset (main)",
    "aioloader/_bench/streams.py": "a workload: WebDataset shards over HTTP and S3 (main)",
    "aioloader/_bench/overhead.py": "a workload: the loader's own cost per sample",
}


def test_no_file_is_over_400_lines_without_a_reason() -> None:
    long = {
        str(path.relative_to(PACKAGE.parent)): len(path.read_text().splitlines())
        for path in PACKAGE.rglob("*.py")
        if len(path.read_text().splitlines()) > 400
    }
    assert set(long) <= set(LONG_FILES), long
    assert set(LONG_FILES) <= set(long), "no longer long: " + ", ".join(set(LONG_FILES) - set(long))


def test_no_file_is_over_450_lines() -> None:
    """Issue 27's bound, whatever the reason."""
    over = {
        str(path.relative_to(PACKAGE.parent)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 450
    }
    assert over == {}


def test_every_wing_says_what_it_owns_and_never_does() -> None:
    for init in PACKAGE.glob("_*/__init__.py"):
        text = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "Owns:" in text and "Never:" in text, init


def test_the_design_doc_lists_the_wings_as_they_import() -> None:
    """docs/design.md's list of what each wing imports matches the imports."""
    doc = (PACKAGE.parent / "docs" / "design.md").read_text()
    listed = doc.split("<!-- wings: begin -->")[1].split("<!-- wings: end -->")[0]
    said = {}
    for line in listed.strip().splitlines():
        wing, _, rest = line.removeprefix("- `").partition("` imports ")
        said[wing] = set(re.findall(r"`([\w]+)`", rest.split("(")[0]))
    actual: dict[str, set[str]] = {}
    for module, targets in imports().items():
        if wing_of(module) in said:
            deps = actual.setdefault(wing_of(module), set())
            deps |= {wing_of(t) for t in targets} - {wing_of(module), "aioloader"}
    assert said == actual


def epoch_counters(package: Path) -> list[str]:
    """Where a stream source keeps an epoch of its own: in ``sources/`` and ``_fanin/``, an
    attribute named like an epoch assigned (``self._next_epoch = ...``) in a class that opens
    epochs, or a ``_next_epoch``/``_epoch`` attribute assigned anywhere."""
    found = []
    for folder in ("sources", "_fanin"):
        for path in sorted((package / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
                opens = any("OpensEpochs" in ast.unparse(base) for base in cls.bases)
                for node in ast.walk(cls):
                    targets = (
                        node.targets
                        if isinstance(node, ast.Assign)
                        else [node.target]
                        if isinstance(node, ast.AugAssign | ast.AnnAssign)
                        else []
                    )
                    for target in targets:
                        for attr in ast.walk(target):
                            if not isinstance(attr, ast.Attribute):
                                continue
                            named = attr.attr in ("_next_epoch", "_epoch")
                            if named or (opens and "epoch" in attr.attr.lower()):
                                found.append(f"{path.name}: {cls.name} assigns .{attr.attr}")
    return found


def test_no_stream_source_keeps_its_own_epoch() -> None:
    """The loader owns a stream's epoch and passes it to ``open_epoch`` (issue 26, part 3):
    only ``OpensEpochs`` (``_data/epochs.py``) keeps the epoch of a dataset iterated directly."""
    assert epoch_counters(PACKAGE) == []


def test_one_module_reads_the_stdlib_fork_servers_private_state() -> None:
    """The one seam into another package's private names (docs/design.md): ``install`` and the
    readers in ``_workers/forkserver.py``; everything else asks them."""
    private = re.compile(r"_forkserver\._|_forkserver_pid|_forkserver_address|_preload_modules")
    readers = {
        str(path.relative_to(PACKAGE.parent))
        for path in PACKAGE.rglob("*.py")
        if private.search(path.read_text())
    }
    assert readers == {"aioloader/_workers/forkserver.py"}
