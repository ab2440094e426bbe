"""The loader in a Jupyter kernel (ipykernel, started and driven by jupyter_client as a notebook
front end does), cell by cell as a notebook user runs it: a dataset class defined in a cell
(no module to import it from), worker processes, a plain ``for`` interrupted mid-epoch (the
kernel's interrupt is SIGINT, a ``KeyboardInterrupt`` in the cell) and run again, and
``async with``/``async for`` at a cell's top level, on the kernel's own event loop.

A kernel runs threads of its own (its heartbeat, I/O and control channels) before any cell
imports aioloader, so neither a fork of it nor a standby forked at import is safe: its workers
come from a fresh interpreter started in reserve as aioloader is imported, so that its imports
run while the user goes on to the next cells (before, the stdlib's, started as the loader was
built)."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.manager import KernelManager, start_new_kernel

pytestmark = pytest.mark.timeout(180)

N = 64


@pytest.fixture
def kernel() -> Iterator[BlockingKernelClient]:
    manager: KernelManager
    manager, client = start_new_kernel(kernel_name="python3", startup_timeout=60)
    try:
        yield client
    finally:
        client.stop_channels()
        manager.shutdown_kernel()  # a shutdown request first: the kernel's exit hooks run


def run_cell(client: BlockingKernelClient, code: str) -> tuple[dict[str, Any], str]:
    """Run one cell: its reply's content and what it printed."""
    printed: list[str] = []

    def output(message: dict[str, Any]) -> None:
        if message["msg_type"] == "stream":
            printed.append(message["content"]["text"])

    reply = client.execute_interactive(
        textwrap.dedent(code), timeout=90, output_hook=output, allow_stdin=False
    )
    return reply["content"], "".join(printed)


def last_json(printed: str) -> Any:
    return json.loads(printed.strip().splitlines()[-1])


BUILD = f"""
import json, multiprocessing.forkserver, os, signal, threading, time
import torch
import aioloader

class Numbered(torch.utils.data.Dataset):  # the notebook's own class: it goes by value
    def __len__(self):
        return {N}

    def __getitem__(self, index):
        time.sleep(0.005)
        return torch.tensor([index, os.getpid()])

loader = aioloader.DataLoader(Numbered(), batch_size=4, num_workers=2, shuffle=True)
print(json.dumps({{
    "threads": threading.active_count(),
    "server_at_build": multiprocessing.forkserver._forkserver._forkserver_pid,
}}))
"""

INTERRUPTED = """
seen, first_workers = [], set()
for batch in loader:
    seen += batch[:, 0].tolist()
    first_workers |= set(batch[:, 1].tolist())
    if len(seen) == 8:  # the user interrupts the kernel while the loop waits for a batch
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
"""

AGAIN = """
def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False

samples, workers = [], set()
for batch in loader:
    samples += batch[:, 0].tolist()
    workers |= set(batch[:, 1].tolist())
stats = loader.statistics().workers
print(json.dumps({
    "taken_before": len(seen),
    "samples": sorted(samples),
    "workers": len(workers),
    "first_workers_alive": [pid for pid in first_workers if alive(pid)],
    "workers_alive": [pid for pid in workers if alive(pid)],
    "server": stats.server,
    "server_why": stats.server_why,
    "server_now": multiprocessing.forkserver._forkserver._forkserver_pid,
}))
"""

AWAITED = """
async with loader:
    awaited = [index for batch in [b async for b in loader] for index in batch[:, 0].tolist()]
print(json.dumps(sorted(awaited)))
"""


def test_a_notebook_interrupts_an_epoch_runs_it_again_and_awaits_one(
    kernel: BlockingKernelClient,
) -> None:
    reply, printed = run_cell(kernel, BUILD)
    assert reply["status"] == "ok", reply
    built = last_json(printed)
    assert built["threads"] > 1  # the premise: the kernel's own threads ran before the import
    assert built["server_at_build"] is not None  # started as the loader was built

    reply, _ = run_cell(kernel, INTERRUPTED)
    assert (reply["status"], reply.get("ename")) == ("error", "KeyboardInterrupt"), reply

    reply, printed = run_cell(kernel, AGAIN)
    assert reply["status"] == "ok", reply
    got = last_json(printed)
    assert 8 <= got["taken_before"] < N  # the interrupt stopped the epoch part way
    assert got["samples"] == list(range(N))  # the next epoch whole: nothing lost or doubled
    assert got["workers"] == 2
    # The interrupted epoch's workers were stopped (the traceback the kernel keeps holds its
    # iterator), and this epoch's too, with it (no persistent_workers).
    assert got["first_workers_alive"] == [] and got["workers_alive"] == []
    assert got["server"] == "fresh standby"
    assert "when aioloader was imported, this process had" in got["server_why"]
    assert got["server_now"] == built["server_at_build"]  # one server for every epoch

    reply, printed = run_cell(kernel, AWAITED)
    assert reply["status"] == "ok", reply
    assert last_json(printed) == list(range(N))  # on the kernel's own loop


EXIT_MARKED = """
import atexit, os, torch
import aioloader
atexit.register(lambda: open({marker!r}, "w").close())  # the kernel's exit hooks ran

class Pids(torch.utils.data.Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return os.getpid()

if {woken}:  # workers alive as the kernel shuts down, in its process group (its interrupt)
    loader = aioloader.DataLoader(Pids(), batch_size=2, num_workers=2, persistent_workers=True)
    pids = {{pid for batch in loader for pid in batch.tolist()}}
    assert len(pids) == 2 and {{os.getpgid(pid) for pid in pids}} == {{os.getpgrp()}}, pids
"""


@pytest.mark.parametrize("woken", [False, True], ids=["imported", "woken"])
def test_a_kernel_that_imported_aioloader_shuts_down_cleanly(tmp_path: Path, woken: bool) -> None:
    """Found by review: a kernel shutting down sends SIGTERM to the processes of its group and
    waits until they are gone; the fresh standby (or the stdlib's server), and the resource
    tracker, died there unreaped, so the kernel was killed 2.5 s later (exit code -15) and its
    exit hooks never ran. Both are process groups of their own now; the workers the standby
    forks are in the kernel's (they get its interrupt), and it reaps them."""
    marker = tmp_path / "exited"
    manager, client = start_new_kernel(kernel_name="python3", startup_timeout=60)
    try:
        code = EXIT_MARKED.format(marker=str(marker), woken=woken)
        reply, _ = run_cell(client, code)
        assert reply["status"] == "ok", reply
    finally:
        client.stop_channels()
        process = manager.provisioner.process  # type: ignore[union-attr]
        manager.shutdown_kernel()
    assert process.returncode == 0
    assert marker.exists()
