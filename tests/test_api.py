"""The public facade: everything users need is importable from ``aioloader``, nothing private
leaks, and the package ships its type information."""

from __future__ import annotations

import ast
import functools
import importlib.resources
import inspect
import subprocess
import sys
import types
from pathlib import Path

import aioloader


def test_all_matches_the_public_names() -> None:
    public = {
        name
        for name, value in vars(aioloader).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert set(aioloader.__all__) == public
    assert aioloader.__all__ == sorted(aioloader.__all__)


@functools.cache
def top_level_definitions() -> dict[str, list[Path]]:
    """Each class or function name defined at the top level of one of the package's files, and
    those files (a function's ``@overload`` signatures are in its own file). Parsed once: once
    per public name it took 10 s of the suite."""
    found: dict[str, list[Path]] = {}
    for path in Path(aioloader.__file__).parent.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                files = found.setdefault(node.name, [])
                if path not in files:
                    files.append(path)
    return found


def defining_files(name: str) -> list[Path]:
    """The package's files that define ``name`` at their top level."""
    return top_level_definitions().get(name, [])


#: torch's DataPipes (deprecated with torchdata's) and a private name: not re-exported.
NOT_OURS = {
    "DFIterDataPipe",
    "DataChunk",
    "IterDataPipe",
    "MapDataPipe",
    "argument_validation",
    "functional_datapipe",
    "guaranteed_datapipes_determinism",
    "non_deterministic",
    "runtime_validation",
    "runtime_validation_disabled",
    "_DatasetKind",
}


def torchs_own() -> set[str]:
    """The public names that are torch's own objects, re-exported."""
    return {n for n in aioloader.__all__ if getattr(aioloader, n).__module__.startswith("torch.")}


def test_every_name_a_torch_user_imports_from_torch_utils_data_is_here() -> None:
    """Switching is changing the import line: ``from torch.utils.data import DataLoader,
    Dataset, random_split`` becomes ``from aioloader import ...``. Where the name is ours (the
    loader, its samplers, collation, ``get_worker_info``) it is a subclass of torch's class or
    a function of torch's signature; the rest are torch's objects themselves."""
    import torch.utils.data as tud

    wanted = set(tud.__all__) - NOT_OURS
    assert wanted <= set(aioloader.__all__), sorted(wanted - set(aioloader.__all__))
    own = torchs_own()
    assert own == wanted - {
        "BatchSampler",
        "DataLoader",
        "DistributedSampler",
        "RandomSampler",
        "SequentialSampler",
        "default_collate",
        "default_convert",
        "get_worker_info",
    }
    for name in wanted:
        ours, theirs = getattr(aioloader, name), getattr(tud, name)
        if name in own:
            assert ours is theirs, name
        elif inspect.isclass(theirs):
            assert issubclass(ours, theirs), name
        else:
            assert list(inspect.signature(ours).parameters) == list(
                inspect.signature(theirs).parameters
            ), name


def test_public_names_come_from_private_modules_and_say_aioloader() -> None:
    """Defined in a private wing (``aioloader/_wing/module.py``), re-exported by the facade;
    they report ``aioloader`` as their module (as anyio's and trio's do), so reprs and pickles
    name what users import. torch's own objects, re-exported, keep theirs."""
    for name in sorted(set(aioloader.__all__) - torchs_own()):
        obj = getattr(aioloader, name)
        defined = obj if inspect.isclass(obj) or inspect.isfunction(obj) else type(obj)
        sources = defining_files(defined.__name__)
        assert len(sources) == 1, (name, sources)
        wing = sources[0].parent
        assert wing.parent.name == "aioloader" and wing.name.startswith("_"), (name, sources)
        assert obj.__module__ == "aioloader", (name, obj.__module__)
    for name in aioloader.sources.__all__:
        obj = getattr(aioloader.sources, name)
        assert obj.__module__ == "aioloader.sources", (name, obj.__module__)
    assert repr(aioloader.DataLoader) == "<class 'aioloader.DataLoader'>"


def test_sources_subpackage_is_reachable_from_the_top() -> None:
    assert aioloader.sources.files is not None
    assert set(aioloader.sources.__all__) >= {"files", "objects", "urls"}


def test_ships_py_typed() -> None:
    assert importlib.resources.files("aioloader").joinpath("py.typed").is_file()


def test_importing_installs_no_event_loop_policy() -> None:
    code = (
        "import asyncio; before = type(asyncio.get_event_loop_policy());"
        "import aioloader; after = type(asyncio.get_event_loop_policy());"
        "assert before is after, (before, after)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
