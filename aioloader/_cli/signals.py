"""Stopping a command cleanly on a signal.

Owns: :func:`run_until_signal` (run a coroutine on uvloop, or asyncio, with SIGTERM cancelling
it the way Ctrl-C does, so its ``finally`` blocks and ``async with`` exits run: workers stopped,
temporary files removed) and :class:`Terminated`. Never: handles a signal in a library call (a
loader never installs signal handlers; only the command line does).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["Terminated", "run_until_signal"]

T = TypeVar("T")


class Terminated(Exception):
    """The command was stopped by SIGTERM (after cleaning up)."""


async def _main(work: Coroutine[Any, Any, T]) -> T:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    stopped: list[int] = []

    def stop(signum: int) -> None:
        if stopped:
            return  # already cleaning up: a second Ctrl-C must not cut the cleanup short
        stopped.append(signum)
        if task is not None:
            task.cancel()

    for signum in _STOPPING:
        loop.add_signal_handler(signum, stop, signum)
    try:
        return await work
    except asyncio.CancelledError:
        if not stopped:
            raise
        if stopped[0] == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise Terminated from None
    finally:
        for signum in _STOPPING:
            loop.remove_signal_handler(signum)
            if stopped:  # leaving: a later Ctrl-C or SIGTERM must not cut the exit short
                signal.signal(signum, signal.SIG_IGN)


_STOPPING = (signal.SIGINT, signal.SIGTERM)


def run_until_signal(work: Coroutine[Any, Any, T]) -> T:
    """Run ``work`` to its end on uvloop (asyncio without it).

    Raises:
        KeyboardInterrupt: Ctrl-C (the runner cancels ``work`` first, so it cleans up).
        Terminated: SIGTERM (``work`` was cancelled and cleaned up).
        Exception: What ``work`` raised.
    """
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where it builds
        run: Any = asyncio.run
    else:
        run = uvloop.run
    try:
        return run(_main(work))  # type: ignore[no-any-return]
    except (KeyboardInterrupt, Terminated):
        for signum in _STOPPING:  # the runner put its own back: the exit ignores more
            signal.signal(signum, signal.SIG_IGN)
        raise
