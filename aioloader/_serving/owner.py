"""Where a dynamic batcher's scope lives: the event loop and the task that opened it.

Owns: :class:`Owner`, what a scope was opened on, and the refusals of calls that would break
it, each a :class:`~aioloader.LoaderStateError` that names the remedy. Never: opens or closes
the scope (:mod:`aioloader._serving.batcher`).

Why refuse rather than serve: a request's future, its timer and the wake-up of the runner that
collects it belong to one loop. Submitted from another loop (another thread's ``asyncio.run``),
the future was resolved from the batcher's thread, which never wakes the caller's loop: the
caller hung, or got its result only when its own loop woke for another reason (found by review).
And an anyio task group must be left by the task that entered it: a scope opened in a startup
hook and closed in a shutdown hook running as another task failed with anyio's own message.
"""

from __future__ import annotations

import asyncio
import threading

from .._base.exceptions import LoaderStateError

__all__ = ["Owner"]


class Owner:
    """The loop, thread and task that opened a batcher's scope (``__aenter__``)."""

    __slots__ = ("loop", "task", "thread")

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.thread = threading.current_thread().name

    def check_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Raise unless ``loop``, the caller's, is the scope's.

        Raises:
            LoaderStateError: Called on another loop; the message names the remedy.
        """
        if loop is not self.loop:
            raise LoaderStateError(
                "DynamicBatcher.submit() was called on another event loop than the one its "
                f"scope was opened on (in thread {self.thread!r}); a batcher serves one loop: "
                "submit from that loop, or from another thread hand the call over with "
                "asyncio.run_coroutine_threadsafe(batcher.submit(item), loop)"
            )

    def check_exit(self) -> None:
        """Raise unless called from the task that opened the scope.

        Raises:
            LoaderStateError: Another task closes it; the scope stays open.
        """
        if asyncio.current_task() is not self.task:
            raise LoaderStateError(
                "a DynamicBatcher's scope must be closed by the task that opened it (its tasks "
                "belong to that task's task group); it stays open. Open and close it in one "
                "task: `async with batcher:` around the serving, an aiohttp cleanup_ctx or a "
                "lifespan context manager, not separate startup and shutdown hooks"
            )
