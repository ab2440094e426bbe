"""Native threads a library starts as it is imported, and whether the fork server may still be
forked from the script: a named one keeps it from being forked (tokio's runtime, behind
obstore, holds locks a fork would copy held), but jemalloc's background thread, which pyarrow
starts as it loads (pandas and Hugging Face datasets import pyarrow), does not: jemalloc takes
every lock of its allocator around a fork. Before, a script that imported pandas before
aioloader got neither a forked server nor a standby: every worker start in it paid a fresh
interpreter's import of torch."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

NAMED_THREAD = """
import _thread, json, os, sys, threading

def named(name, started):
    # A thread the threading module does not know of (as a native library's), named.
    with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as comm:
        comm.write(name)
    started.release()
    threading.Event().wait()

if len(sys.argv) > 1:  # started before aioloader's import, as a library's at its import
    started = _thread.allocate_lock()
    started.acquire()
    _thread.start_new_thread(named, (sys.argv[1], started))
    started.acquire()
import torch.utils.data
import aioloader

class Sums(torch.utils.data.Dataset):
    def __len__(self):
        return 32
    def __getitem__(self, index):
        return sum([index] * 1000) // 1000

if __name__ == "__main__":
    tasks = os.listdir("/proc/self/task")
    names = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks)
    loader = aioloader.DataLoader(Sums(), batch_size=4, num_workers=2, shuffle=True)
    samples = [x for _ in range(2) for b in loader for x in b.tolist()]
    stats = loader.statistics().workers
    print(json.dumps({
        "threads": threading.active_count(),
        "names": names,
        "samples": sorted(samples),
        "server": stats.server,
        "why": stats.server_why,
    }))
"""


def probe(folder: Path, *args: str) -> dict[str, Any]:
    (folder / "job.py").write_text(textwrap.dedent(NAMED_THREAD))
    done = subprocess.run(
        [sys.executable, "job.py", *args],
        capture_output=True, text=True, timeout=90, check=False, cwd=folder,
    )  # fmt: skip
    assert (done.returncode, done.stderr) == (0, ""), done.stderr[-3000:]
    got: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return got


SUMS = sorted(2 * list(range(32)))


def test_jemallocs_background_thread_leaves_the_server_forked(tmp_path: Path) -> None:
    """The thread as pyarrow's allocator names it (the fork itself was run with pyarrow's own
    thread and its allocator in use in the workers, by hand: pyarrow in the test tools would
    slow every Ray worker, which imports it where it is installed)."""
    got = probe(tmp_path, "jemalloc_bg_thd")
    assert "jemalloc_bg_thd" in got["names"] and got["threads"] == 1  # the premise
    assert (got["server"], got["why"]) == ("forked", "")
    assert got["samples"] == SUMS


@pytest.mark.parametrize("name", ["tokio-runtime-w"])
def test_another_named_native_thread_keeps_it_from_being_forked(tmp_path: Path, name: str) -> None:
    got = probe(tmp_path, name)
    assert name in got["names"] and got["threads"] == 1  # the threading module knows none
    assert got["server"] == "interpreter"
    assert got["why"].startswith(f"this process had native threads ({name})")
    assert got["samples"] == SUMS
