"""A blocking call that repeats, run where its recent times say: inline, or on a pool's threads.

Owns: :class:`PlacedCalls`, which carries out :class:`~aioloader._base.inline.Placement`'s
choice for calls on a ``ThreadPoolExecutor`` the caller owns (a dataset's reading threads): a
call timed alone waits for the calls on the threads to finish, and calls that come meanwhile
wait for it, so its time is its own. The lock belongs to the first event loop that calls
(until it closes); calls from another loop (a dataset shared by loaders on loops of their own)
go straight to the threads. Never: owns or shuts down the pool, or decides anything itself.

Cancellation (as ``offload.py``): a call not yet started is withdrawn; one running on a thread
is waited for, shielded, and its result dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import anyio

from .._base.inline import Placement
from .offload import timed, wait_thread_future

__all__ = ["PlacedCalls"]

R = TypeVar("R")


class PlacedCalls:
    """Calls placed by a :class:`Placement` (see the module).

    Args:
        placement: Decides where each call runs; this object adds the times of the calls it
            made inline or alone.
    """

    def __init__(self, placement: Placement) -> None:
        self.placement = placement
        # The lock and the count belong to one event loop (a dataset may be shared by loaders
        # on loops of their own): the first to call, until it closes.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._alone: anyio.Lock | None = None  # held while a call is timed alone
        self._on_threads = 0  # calls running on the threads now, not timed
        self._drained: anyio.Event | None = None  # set when the last of them returns

    async def run(self, pool: ThreadPoolExecutor, fn: Callable[..., R], *args: object) -> R:
        """``fn(*args)``, inline or on ``pool``'s threads.

        Raises:
            Exception: Whatever ``fn`` raises.

        Cancellation: see the module; a call waiting for its turn is simply withdrawn.
        """
        placement = self.placement
        measured = placement.recent.seconds is not None
        where = placement.where()
        if where == "inline":
            return placement.recent.call(fn, *args)
        lock = self._lock()
        if lock is None:  # another loop's calls are timed alone: this one goes to the threads
            return await wait_thread_future(pool.submit(fn, *args))
        if where == "threads":
            if lock.locked():  # a call is being timed alone: start none beside it
                async with lock:
                    pass
            return await self._beside(pool, fn, *args)
        async with lock:
            if placement.fast():  # the call timed alone before this one was fast
                return placement.recent.call(fn, *args)
            if measured or placement.recent.seconds is None:
                while self._on_threads:
                    self._drained = anyio.Event()
                    await self._drained.wait()
                result, took = await wait_thread_future(pool.submit(timed, fn, *args))
                placement.alone_took(took)
                return result
        # Sent to be the first timed, and another was timed slow meanwhile: to the threads.
        return await self._beside(pool, fn, *args)

    def _lock(self) -> anyio.Lock | None:
        """The lock of the calling loop, or None on a loop other than the one that owns it."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed():
                return None
            self._loop, self._alone, self._on_threads, self._drained = loop, anyio.Lock(), 0, None
        return self._alone

    async def _beside(self, pool: ThreadPoolExecutor, fn: Callable[..., R], *args: object) -> R:
        self._on_threads += 1
        try:
            return await wait_thread_future(pool.submit(fn, *args))  # not timed: not alone
        finally:
            self._on_threads -= 1
            if not self._on_threads and self._drained is not None:
                self._drained.set()
