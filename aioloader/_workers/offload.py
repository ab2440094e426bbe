"""Running blocking calls off the event loop, on threads the loader owns.

Owns: a thread pool with a lifetime (created when the loader's scope opens, joined when it
closes) and the one awaitable way into it. Never: uses the event loop's default executor or
anyio's global worker threads, whose idle threads outlive the loader.

Cancellation policy: a call that has not started is withdrawn; a call that is running cannot be
interrupted (Python threads can't be), so the cancelled caller waits for it, shielded, before
the cancellation goes on. That keeps the guarantee that when the loader's scope exits, no thread
of ours is still running user code. The wait is bounded by one call of the user's function.

Fast calls inline (``inline_below``): a thread hop costs tens of microseconds, more than reading
a row from memory or collating a few small tensors. A pool made with ``inline_below=s`` times
every call; while the recent ones (a moving average) took under ``s`` seconds and none of its
calls is running on a thread, the next call runs on the calling (event loop) thread instead. A
call that takes longer raises the average, and the calls after it go back to the threads. So
the loop is never blocked for long by calls known to be slow, and calls known to be fast cost
what the call costs. A function run this way must not care which thread calls it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import anyio

from .._base.exceptions import stray_cancellation
from .._base.inline import Recent

__all__ = ["ThreadOffload", "timed", "wait_thread_future"]

R = TypeVar("R")


async def wait_thread_future(future: Future[R]) -> R:
    """Await a thread pool's future, with this module's cancellation policy.

    Raises:
        Exception: Whatever the call raised.
        StrayCancellation: The call raised ``concurrent.futures.CancelledError``, which
            asyncio's wrapper turns into its own ``CancelledError``: the call's failure, not
            this task's cancellation.

    Cancellation: a call not yet started is withdrawn; a running one is waited for (shielded)
    and its result dropped; then ``CancelledError`` goes on.
    """
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError as exc:
        stray = stray_cancellation(exc, "a function run on a thread")
        if stray is not None:  # the call's own (or its future withdrawn by someone else)
            raise stray from (None if future.cancelled() else future.exception())
        if not future.cancel():
            waiter = asyncio.wrap_future(future)
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await waiter
        raise


def timed(fn: Callable[..., R], *args: object) -> tuple[R, float]:
    """``fn(*args)`` and how long it took (on a pool thread)."""
    started = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - started


class ThreadOffload:
    """A bounded pool of named threads for blocking work.

    Args:
        threads: Number of threads (they start lazily, on first use).
        name: Prefix of the threads' names (``aioloader-<name>_<n>``).
        worker_init_fn: Called once in each thread as it starts, with the thread's 0-based id.
        inline_below: Run a call on the calling thread while recent calls took under this many
            seconds (see the module); None: always on the pool's threads. Only for a pool of
            one thread: its calls run one at a time, inline or not.

    Raises:
        ValueError: ``threads`` is less than 1, or over 1 with ``inline_below``.
    """

    def __init__(
        self,
        threads: int,
        name: str,
        *,
        worker_init_fn: Callable[[int], object] | None = None,
        inline_below: float | None = None,
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if inline_below is not None and threads != 1:
            raise ValueError(f"inline_below needs threads=1, got threads={threads}")
        self.concurrency = threads
        self.inlines = inline_below is not None
        self._inline_below = inline_below
        self._recent = Recent()  # how long calls have been taking
        self._one_at_a_time: asyncio.Semaphore | None = None  # made on the loop, when needed
        self._queued = 0  # calls waiting for or running on the thread
        ids = itertools.count()  # next() on a count is atomic under the GIL

        def init() -> None:
            if worker_init_fn is not None:
                worker_init_fn(next(ids))

        self._pool = ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix=f"aioloader-{name}", initializer=init
        )

    async def run(
        self, fn: Callable[..., R], *args: object, seed: int | None = None, inline: bool = True
    ) -> R:
        """Run ``fn(*args)`` on a pool thread (or inline, see the module) and return its result.

        ``inline=False`` keeps this call on the pool's threads whatever its speed (a
        generator's ``finally`` blocks, which may release what was opened there).

        ``seed`` is accepted for symmetry with the process pool and ignored: the global random
        generators belong to the application, and threads share them.

        Raises:
            Exception: Whatever ``fn`` raises, with its original type and traceback.

        Cancellation: a call not yet started is withdrawn; a running one is waited for
        (shielded) and its result dropped; then ``CancelledError`` goes on. A call run inline
        is not a waiting point.
        """
        if self._inline_below is None:
            return await wait_thread_future(self._pool.submit(fn, *args))
        limit = self._inline_below if inline else None
        if limit is not None and not self._queued and self._recent.under(limit):
            return self._recent.call(fn, *args)  # nothing on the thread: no semaphore to take
        if self._one_at_a_time is None:
            self._one_at_a_time = asyncio.Semaphore(1)
        self._queued += 1  # no call runs inline while this one waits or runs on the thread
        try:
            async with self._one_at_a_time:
                if limit is not None and self._recent.under(limit):
                    return self._recent.call(fn, *args)
                result, took = await wait_thread_future(self._pool.submit(timed, fn, *args))
        finally:
            self._queued -= 1
        self._recent.add(took)
        return result

    @property
    def inline_now(self) -> bool:
        """Whether the next call would run inline (recent calls were fast)."""
        limit = self._inline_below
        return limit is not None and self._recent.under(limit)

    @property
    def can_inline(self) -> bool:
        """Whether a call may run on the caller's thread now, however long calls take: the pool
        inlines, and nothing of its runs on (or waits for) its thread."""
        return self._inline_below is not None and not self._queued

    @property
    def may_call_now(self) -> bool:
        """:attr:`can_inline`, and the recent calls were fast (or none was timed yet)."""
        limit = self._inline_below
        return limit is not None and not self._queued and self._recent.not_over(limit)

    @property
    def inline_limit(self) -> float | None:
        """The time under which calls run inline (None: this pool never inlines)."""
        return self._inline_below

    @property
    def idle(self) -> bool:
        """Whether nothing of this pool's runs on (or waits for) its thread."""
        return not self._queued

    def took_inline(self, seconds: float) -> None:
        """A call of this pool's made on the caller's own thread took ``seconds`` (a batch
        made on the consumer's thread: see ``_pipeline/demand.py``): it counts towards where
        the next calls run, as an inline call does."""
        self._recent.add(seconds)

    #: Threads share one copy of everything: no worker is distinct (see ``_pool.WorkerPool``).
    per_worker = False
    depth = 1

    async def start(self) -> None:
        """Nothing to start: threads are made as calls come."""

    async def aclose(self) -> None:
        """As :meth:`close`."""
        self.close()

    @contextlib.asynccontextmanager
    async def reserved(self) -> AsyncIterator[Callable[..., Any]]:
        """``run_on(worker_id, fn, *args, seed=None, replace=True)``: on any thread (threads
        are not distinct workers)."""

        async def run_on(
            worker_id: int,
            fn: Callable[..., R],
            *args: Any,
            seed: int | None = None,
            replace: bool = True,
        ) -> R:
            return await self.run(fn, *args, seed=seed)

        yield run_on

    def close(self) -> None:
        """Join the pool's threads. Calls still queued are cancelled; none should be running,
        since every caller waits for its own call (see the module's cancellation policy)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
