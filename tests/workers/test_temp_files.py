"""Nothing left in the temporary folder: a worker hands each batch's shared-memory descriptor
over a socket that multiprocessing makes in a ``pymp-*`` folder (torch's reductions do), and a
worker leaves at once, without the interpreter's shutdown. Each case runs a script in a fresh
interpreter with ``TMPDIR`` a folder of the test's own, under each of the three fork servers."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.support.helpers import run_json_script

SCRIPT = """
import json, multiprocessing.util, os, signal, sys, threading
import torch, torch.utils.data
import aioloader

class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 16
    def __getitem__(self, i):
        if "kill" in sys.argv and i == 12:  # the worker has handed over batches already
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.full((4,), i)

if __name__ == "__main__":
    if "thread" in sys.argv:  # forking this process is not safe: the standby or the stdlib's
        threading.Thread(target=threading.Event().wait, daemon=True).start()
    loader = aioloader.DataLoader(Rows(), batch_size=4, num_workers=2, persistent_workers=False)
    listings, crashed = [], 0
    for epoch in range(2):
        try:
            assert sum(len(batch) for batch in loader) == 16
        except aioloader.WorkerCrashed:
            crashed += 1
        listings.append(sorted(os.listdir(multiprocessing.util.get_temp_dir())))
    print(json.dumps({
        "server": loader.statistics().workers.server, "listings": listings, "crashed": crashed,
    }))
"""


def run(tmp_path: Path, *modes: str, standby: bool = True) -> tuple[dict[str, Any], list[str]]:
    """Run the script; its result and what is left in its temporary folder once it exited.

    The folder is a short path of its own, not under ``tmp_path``: multiprocessing binds
    sockets in it, and a socket's path is limited to 107 bytes (pytest's own folder, its
    counter in the hundreds, with pytest-xdist's worker name, is long enough to reach it)."""
    temp = Path(tempfile.mkdtemp(prefix="aiol-"))
    try:
        env = {"TMPDIR": str(temp), "AIOLOADER_STANDBY": "1" if standby else "0"}
        return run_json_script(tmp_path, SCRIPT, *modes, env=env), sorted(os.listdir(temp))
    finally:
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.parametrize(
    ("modes", "standby", "server"),
    [
        ((), True, "forked"),
        (("thread",), True, "standby"),
        (("thread",), False, "interpreter"),
    ],
)
def test_workers_leave_nothing_in_the_temporary_folder(
    tmp_path: Path, modes: tuple[str, ...], standby: bool, server: str
) -> None:
    got, left = run(tmp_path, *modes, standby=standby)
    assert (got["server"], got["crashed"]) == (server, 0)
    # Every epoch starts two workers, and each hands batches over: no socket stays behind.
    first, *later = got["listings"]
    assert all(listing == first for listing in later)
    assert left == []


def test_a_killed_workers_socket_goes_with_the_main_processs_folder(tmp_path: Path) -> None:
    """A worker killed mid-epoch cannot tidy up: what it made is in the main process's folder,
    which goes when the main process exits (with the stdlib's server, whose workers had made
    folders of their own)."""
    got, left = run(tmp_path, "thread", "kill", standby=False)
    assert (got["server"], got["crashed"]) == ("interpreter", 2)
    assert left == []
