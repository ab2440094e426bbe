"""A bound on the bytes a source has in flight: requested and not yet handed to the loader.

Owns: first-come, first-served admission of byte counts under a limit. Never: measures bytes
itself (the source says how many a request will bring), or bounds what the loader holds after
a fetch (that is the loader's ``max_inflight_bytes``).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager

import anyio

from .._base.checks import check_int

__all__ = ["ByteGate", "holding"]


class _Waiter:
    __slots__ = ("event", "granted", "n")

    def __init__(self, n: int) -> None:
        self.n = n
        self.event = anyio.Event()
        self.granted = False


class ByteGate:
    """Admits byte counts while the bytes held stay within ``limit``.

    A request waits until what is held plus its own count fits, or until nothing is held (so a
    single object larger than the limit still goes, alone). Waiters are admitted in arrival
    order: a large request is not starved by a stream of small ones. No polling: a release
    wakes exactly the waiters that now fit.

    Attributes:
        limit: The bound, in bytes.
        held: Bytes admitted and not yet released.
        peak: The most ever held at once.
    """

    def __init__(self, limit: int) -> None:
        self.limit = check_int("max_bytes_in_flight", limit, minimum=1)
        self.held = 0
        self.peak = 0
        self._waiting: deque[_Waiter] = deque()

    def _fits(self, n: int) -> bool:
        return self.held == 0 or self.held + n <= self.limit

    def _admit(self, n: int) -> None:
        self.held += n
        self.peak = max(self.peak, self.held)

    async def acquire(self, n: int) -> None:
        """Wait until ``n`` more bytes may be in flight, then count them as held.

        Cancellation: a cancelled waiter leaves the queue; if it had just been admitted, its
        bytes are given back, so nothing stays held for it.
        """
        if not self._waiting and self._fits(n):
            self._admit(n)
            return
        waiter = _Waiter(n)
        self._waiting.append(waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.granted:
                self.release(n)
            else:
                self._waiting.remove(waiter)
                self._wake()  # it may have been blocking smaller requests behind it
            raise

    def release(self, n: int) -> None:
        """Give back ``n`` bytes, admitting the waiters that now fit, in order."""
        self.held -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiting and self._fits(self._waiting[0].n):
            waiter = self._waiting.popleft()
            waiter.granted = True
            self._admit(waiter.n)
            waiter.event.set()

    @contextlib.asynccontextmanager
    async def hold(self, n: int) -> AsyncIterator[None]:
        """Hold ``n`` bytes for the body of the ``async with`` block.

        Cancellation: as :meth:`acquire`; the bytes are released however the block ends.
        """
        await self.acquire(n)
        try:
            yield
        finally:
            self.release(n)


def holding(gate: ByteGate | None, n: int) -> AbstractAsyncContextManager[None]:
    """``gate.hold(n)``, or nothing to hold when a source has no byte bound."""
    return contextlib.nullcontext() if gate is None else gate.hold(n)
