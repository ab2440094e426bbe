"""The public facade: everything users need is importable from ``aioloader``, nothing private
leaks, and the package ships its type information."""

from __future__ import annotations

import importlib.resources
import subprocess
import sys
import types

import pytest
import torch

import aioloader


def test_all_matches_the_public_names() -> None:
    public = {
        name
        for name, value in vars(aioloader).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert set(aioloader.__all__) == public
    assert aioloader.__all__ == sorted(aioloader.__all__)


def test_public_names_come_from_private_modules() -> None:
    for name in aioloader.__all__:
        module = getattr(getattr(aioloader, name), "__module__", "")
        assert module.startswith("aioloader._"), (name, module)


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


def test_demo_trains_and_prints_statistics() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "aioloader", "demo", "--samples", "512", "--epochs", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "samples/s" in result.stdout
    assert "LoaderStatistics: 16 batches, 1024 samples" in result.stdout
    assert "epoch 2/2" in result.stdout


def test_demo_device_flag() -> None:
    from aioloader import _demo

    assert _demo.main(["--samples", "256", "--epochs", "1", "--device", "cpu"]) == 0
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as info:  # argparse's error: a message and status 2
            _demo.main(["--device", "cuda"])
        assert info.value.code == 2


def test_cli_rejects_unknown_commands() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "aioloader", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2 and "unknown command" in result.stderr
