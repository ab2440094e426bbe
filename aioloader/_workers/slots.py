"""A pool's workers by slot, and which of them are idle: the part of a pool of processes or Ray
actors that does not depend on what a worker is.

Owns: :class:`Slots`: the worker now in each slot (a replacement takes its dead one's place),
the stream of idle ones, handing one job to an idle worker (:meth:`Slots.run`) or every worker
to one owner that picks the worker of each job (:meth:`Slots.reserved`). Never: talks to a
worker: the pool's ``exchange`` does, and replaces a dead one.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Generic, Protocol, TypeVar

import anyio

__all__ = ["Slots"]

R = TypeVar("R")


class _Slotted(Protocol):
    id: int


W = TypeVar("W", bound=_Slotted)

# ``exchange(worker, fn, args, seed, replace=...)``: one job on that worker (or its replacement).
Exchange = Callable[..., Awaitable[Any]]


class Slots(Generic[W]):
    """``n`` slots. ``now`` is the worker in each, by id; :meth:`all_idle` makes them all idle
    once they are ready."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.now: list[W] = []
        self._idle_send, self._idle_recv = anyio.create_memory_object_stream[W](n)

    def all_idle(self) -> None:
        for worker in self.now:
            self._idle_send.send_nowait(worker)

    def close(self) -> None:
        self._idle_send.close()
        self._idle_recv.close()

    async def run(
        self, exchange: Exchange, fn: Callable[..., R], args: tuple[Any, ...], seed: int | None
    ) -> R:
        """``exchange`` the job with an idle worker; the slot's worker (the same, or its
        replacement) is idle again after, whatever happened.

        Cancellation: waiting for an idle worker is withdrawn; a job under way, as ``exchange``
        handles it."""
        worker = await self._idle_recv.receive()
        try:
            result: R = await exchange(worker, fn, args, seed)
            return result
        finally:
            self._idle_send.send_nowait(self.now[worker.id])

    @contextlib.asynccontextmanager
    async def reserved(self, exchange: Exchange) -> AsyncIterator[Callable[..., Any]]:
        """Every worker for one owner: yields ``run_on(worker_id, fn, *args, seed=None,
        replace=True)``, which exchanges the job with the worker now in that slot. The workers
        are idle again on exit.

        Cancellation: waiting for the workers can be cancelled; the ones taken go back."""
        taken: list[W] = []
        try:
            for _ in range(self.n):
                taken.append(await self._idle_recv.receive())

            async def run_on(
                worker_id: int,
                fn: Callable[..., R],
                *args: Any,
                seed: int | None = None,
                replace: bool = True,
            ) -> R:
                result: R = await exchange(self.now[worker_id], fn, args, seed, replace=replace)
                return result

            yield run_on
        finally:
            for worker in taken:
                self._idle_send.send_nowait(self.now[worker.id])
