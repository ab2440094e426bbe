"""A configuration for the harness's memory test: holds ``MIB`` MiB of its own until told to
stop (its work), after importing what every row of a workload imports (aioloader, torch)."""

from __future__ import annotations

import multiprocessing.connection
from collections.abc import Callable
from typing import Any

import aioloader  # noqa: F401  (what a row's process holds)

MIB = 64


def prepare(job: int) -> Callable[[], dict[str, Any]]:
    def work() -> dict[str, Any]:
        held = bytearray(job * 2**20)
        held[::4096] = b"x" * len(held[::4096])  # every page touched
        import time

        time.sleep(0.6)  # long enough for a PSS sample (every 0.2 s)
        return {"held": len(held)}

    return work


def spawned(job: int, conn: multiprocessing.connection.Connection) -> None:
    """The same work in a spawned process: ready, wait for go, work, say done."""
    work = prepare(job)
    conn.send("ready")
    conn.recv()
    conn.send(work())
    conn.recv()
