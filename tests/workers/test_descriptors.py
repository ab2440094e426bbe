"""A script that keeps its batches runs out of open files (each batch from a worker arrives as
a shared-memory descriptor, torch's default sharing strategy): the error says so in torch's
words (its ``test_fd_limit_exceeded`` matches them), and the remedy it names works, with the
strategy set after ``import aioloader`` (its standby fork server started before that)."""

from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Any

import pytest

import aioloader
from aioloader._workers.descriptors import out_of_descriptors
from tests.support import worker_fns
from tests.support.helpers import run_json_script

SCRIPT = """
import json, resource, sys, threading
import torch, torch.multiprocessing, torch.utils.data
import aioloader

class Randoms(torch.utils.data.IterableDataset):
    def __iter__(self):
        return (torch.randn(2, 2) for _ in range(200))

if __name__ == "__main__":
    if "file_system" in sys.argv:  # after aioloader's import, as a script's first lines do
        torch.multiprocessing.set_sharing_strategy("file_system")
    if "thread" in sys.argv:  # forking this process is not safe: the standby serves
        threading.Thread(target=threading.Event().wait, daemon=True).start()
    resource.setrlimit(resource.RLIMIT_NOFILE, (100, 100))
    kept, error = [], None
    loader = aioloader.DataLoader(Randoms(), num_workers=1)
    try:
        for batch in loader:
            kept.append(batch)
    except RuntimeError as exc:
        error = {"text": str(exc), "notes": getattr(exc, "__notes__", []),
                 "cause": type(exc.__cause__).__name__}
    print(json.dumps({"kept": len(kept), "error": error,
                      "server": loader.statistics().workers.server}))
"""


def run(tmp_path: Path, *modes: str) -> dict[str, Any]:
    # TMPDIR: file_system's segments outlive a process that dies holding them
    return run_json_script(tmp_path, SCRIPT, *modes, env={"TMPDIR": str(tmp_path)})


def test_out_of_descriptors_the_error_says_so_in_torchs_words(tmp_path: Path) -> None:
    got = run(tmp_path, "thread")
    assert got["server"] == "standby" and 50 < got["kept"] < 100
    error = got["error"]
    assert error is not None, got
    assert error["text"].startswith("Too many open files. Communication with the workers")
    assert "ulimit -n" in error["text"] and "set_sharing_strategy" in error["text"]
    assert "this process's limit is 100 open files" in error["text"]
    assert any(f"batch {got['kept']}" in note for note in error["notes"]), error["notes"]
    assert error["cause"] != "NoneType"  # multiprocessing's own failure stays chained


def test_the_file_system_strategy_set_after_the_import_reaches_the_workers(
    tmp_path: Path,
) -> None:
    """The standby was forked as aioloader was imported, before the strategy was set (a fork
    server forked later would inherit it anyway)."""
    got = run(tmp_path, "file_system", "thread")
    assert got["server"] == "standby"
    assert (got["kept"], got["error"]) == (200, None)


def test_with_descriptors_to_spare_a_failed_reply_keeps_its_own_error() -> None:
    assert not out_of_descriptors()
    loader = aioloader.DataLoader(worker_fns.Unloadable(4), batch_size=None, num_workers=1)
    with pytest.raises(ValueError, match="this value does not load here"):
        list(loader)


def test_out_of_descriptors_is_told_by_trying_to_open_some() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    opened = {int(fd) for fd in os.listdir("/proc/self/fd")}
    # The limit bounds a descriptor's number: the one under which 5 numbers are free (a long
    # run's descriptors leave gaps below its highest).
    limit = [n for n in range(soft) if n not in opened][4] + 1
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        assert out_of_descriptors()  # 10 more cannot be opened
        assert {int(fd) for fd in os.listdir("/proc/self/fd")} <= opened  # none stays open
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert not out_of_descriptors()
