"""Many parts of a stream (shards, files, key ranges) read at once, their items handed out in
the order :class:`~aioloader._interleave.Interleave` gives.

Owns: one reader task per open part, each filling a bounded buffer of its own, parts opened in
plan order up to ``width + ahead`` at once (so the part after one that ends is already being
read), and the consumer's side that takes items in the interleave's order. Never: decides the
order (``_interleave.py``), or knows what a part is (``read(part)`` opens it).

Memory: a part's buffer holds at most ``part_limit`` units (``size(item)``, e.g. bytes; an
item larger than that is still admitted alone), so what is held read ahead is bounded by
``(width + ahead) * part_limit`` plus what each open ``read(part)`` holds itself (a chunk being
parsed). A slow consumer stops the readers: a full buffer waits for the consumer.

Errors: a part's error is raised when the consumer reaches it in the order (after the items
before it), with a note naming the part; leaving the ``async with`` then closes every other
part. An error while listing the parts is raised where the consumer needs the part that could
not be listed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from abc import abstractmethod
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable, Iterable
from contextlib import aclosing
from typing import Any, Generic, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ._dataset import AsyncIterableDataset
from ._interleave import Interleave

__all__ = ["EpochIterator", "OpensEpochs", "interleaved"]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
P = TypeVar("P")

_END: Any = object()


class _Lane(Generic[T]):
    """One part's read-ahead buffer: one producer (its reader task), one consumer. At most one
    side waits at a time (the buffer cannot be both empty and full), so one wake-up slot does."""

    __slots__ = ("_items", "_waiter", "error", "finished", "held", "limit", "name")

    def __init__(self, name: str, limit: int) -> None:
        self.name = name
        self.limit = limit
        self.held = 0
        self.finished = False
        self.error: BaseException | None = None
        self._items: deque[tuple[T, int]] = deque()
        self._waiter: anyio.Event | None = None

    def _wake(self) -> None:
        if self._waiter is not None:
            self._waiter.set()
            self._waiter = None

    async def _wait(self) -> None:
        self._waiter = event = anyio.Event()
        await event.wait()

    async def put(self, item: T, size: int) -> None:
        while self._items and self.held + size > self.limit:
            await self._wait()
        self._items.append((item, size))
        self.held += size
        self._wake()

    def close(self, error: BaseException | None = None) -> None:
        self.finished = True
        self.error = error
        self._wake()

    async def get(self) -> T:
        """The next item, or ``_END``; raises the part's error after its last item."""
        while not self._items:
            if self.finished:
                if self.error is not None:
                    raise self.error
                return _END  # type: ignore[no-any-return]
            await self._wait()
        item, size = self._items.popleft()
        self.held -= size
        self._wake()
        return item


class _Parts(Generic[P, T]):
    """The parts opened so far, in plan order, and the room for more."""

    def __init__(self, room: int) -> None:
        self.lanes: list[_Lane[T] | None] = []
        self.done = False
        self.error: BaseException | None = None
        self.room = anyio.Semaphore(room)
        self._changed = anyio.Event()

    def add(self, lane: _Lane[T]) -> None:
        self.lanes.append(lane)
        self._changed.set()
        self._changed = anyio.Event()

    def close(self, error: BaseException | None = None) -> None:
        self.done = True
        self.error = error
        self._changed.set()

    async def lane(self, index: int) -> _Lane[T] | None:
        """Part ``index``'s lane once it is open; None when the plan has no such part."""
        while index >= len(self.lanes):
            if self.done:
                if self.error is not None:
                    raise self.error
                return None
            await self._changed.wait()
        lane = self.lanes[index]
        assert lane is not None, "a finished part was asked for again"
        return lane


@contextlib.asynccontextmanager
async def interleaved(
    parts: Iterable[P] | AsyncIterable[P],
    read: Callable[[P], AsyncIterator[T]],
    *,
    width: int,
    ahead: int,
    part_limit: int,
    size: Callable[[T], int] | None = None,
    rng: random.Random | None = None,
    name: Callable[[P], str] = str,
) -> AsyncIterator[AsyncIterator[T]]:
    """Read ``parts`` with up to ``width + ahead`` open at once; give their items interleaved.

    Args:
        parts: The plan, in order (a sequence, or an async iterable such as a listing).
        read: Opens a part: an async iterator of its items (closed with ``aclose`` if it has one).
        width: Parts drawn from at once (the interleave's slots).
        ahead: Parts opened beyond those, in plan order, to have items ready when a part ends.
        part_limit: What one part's buffer holds at most, in ``size`` units.
        size: An item's size (default: 1 per item).
        rng: Draws each round's slot order; None visits slots in order.
        name: A part's name for error notes.

    Yields:
        An async iterator over the items (valid inside the ``async with`` only).

    Raises:
        Exception: A part's error (with a note naming it), or the listing's error, when the
            consumer reaches it; every other part is closed on leaving the block.

    Cancellation: leaving the block (by an error, a ``break`` or cancellation) cancels every
    reader and closes its part before the block is left.
    """
    shelf: _Parts[P, T] = _Parts(width + ahead)
    measure = size if size is not None else (lambda _item: 1)

    async def fill(part: P, lane: _Lane[T]) -> None:
        try:
            items = read(part)
            try:
                async for item in items:
                    await lane.put(item, measure(item))
            finally:
                aclose = getattr(items, "aclose", None)
                if aclose is not None:  # its files and connections close, even when cancelled
                    with anyio.CancelScope(shield=True):
                        await aclose()
        except Exception as exc:
            lane.close(exc)
        else:
            lane.close()

    async def plan(tg: anyio.abc.TaskGroup) -> None:
        try:
            async with aclosing(_as_async(parts)) as listing:
                async for part in listing:
                    await shelf.room.acquire()
                    lane: _Lane[T] = _Lane(name(part), part_limit)
                    shelf.add(lane)
                    tg.start_soon(fill, part, lane)
        except Exception as exc:
            shelf.close(exc)
        else:
            shelf.close()

    async def items() -> AsyncGenerator[T, None]:
        order = Interleave(width, rng)
        while not order.done:
            index = order.turn()
            try:
                lane = await shelf.lane(index)
            except Exception as exc:
                exc.add_note(f"aioloader: listing part {index} of the stream")
                raise
            if lane is None:
                order.missing()
                continue
            try:
                item = await lane.get()
            except Exception as exc:
                exc.add_note(f"aioloader: reading part {index} ({lane.name})")
                raise
            if item is _END:
                order.ended()
                shelf.lanes[index] = None  # its reader is done: let it go
                shelf.room.release()
                continue
            order.drew()
            yield item

    failure: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(plan, tg)
        try:
            async with aclosing(items()) as it:
                yield it
        except Exception as exc:  # raised as itself below, not in a group with no one else
            failure = exc
        finally:
            tg.cancel_scope.cancel()
    if failure is not None:
        raise failure


async def _as_async(parts: Iterable[P] | AsyncIterable[P]) -> AsyncGenerator[P, None]:
    if isinstance(parts, AsyncIterable):
        iterator = aiter(parts)
        try:
            async for part in iterator:
                yield part
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
    else:
        for part in parts:
            yield part


class OpensEpochs(AsyncIterableDataset[T_co]):
    """A stream whose epochs run tasks of their own (readers of many parts at once).

    The loader enters :meth:`open_epoch` in the task that consumes the epoch, so the readers'
    task group is entered and left there. Iterating the dataset directly (``async for``) runs the
    epoch in a task the iterator owns and hands its items over one by one; ``aclose()`` on the
    iterator (or dropping it) cancels that task, which closes every open part.
    """

    @abstractmethod
    def open_epoch(self) -> contextlib.AbstractAsyncContextManager[AsyncIterator[T_co]]:
        """Start the next epoch: an async context manager giving its iterator."""

    def __aiter__(self) -> AsyncIterator[T_co]:
        """Start the next epoch: an iterator over it (see the class on closing it)."""
        return EpochIterator(self.open_epoch())


class _Failed:
    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


class EpochIterator(AsyncIterator[T]):
    """Iterates an epoch opened with ``open_epoch()`` from any task, in any way (``break``,
    dropping it): the epoch runs in a task of its own, started at the first ``__anext__``;
    items come over a rendezvous stream, so nothing is read beyond the epoch's own buffers.

    Raises (from ``__anext__``): the epoch's error, as itself.

    Cancellation: cancelling a ``__anext__`` leaves the epoch running (the next call goes on);
    :meth:`aclose`, or the iterator being garbage-collected, cancels the epoch's task, whose
    ``async with`` closes every part.
    """

    def __init__(self, epoch: contextlib.AbstractAsyncContextManager[AsyncIterator[T]]) -> None:
        self._epoch: contextlib.AbstractAsyncContextManager[AsyncIterator[T]] | None = epoch
        self._task: asyncio.Task[None] | None = None
        self._items: MemoryObjectReceiveStream[T | _Failed] | None = None

    def __aiter__(self) -> EpochIterator[T]:
        return self

    async def __anext__(self) -> T:
        if self._items is None:
            if self._epoch is None:
                raise StopAsyncIteration
            send, self._items = anyio.create_memory_object_stream[T | _Failed](0)
            self._task = asyncio.get_running_loop().create_task(self._run(self._epoch, send))
            self._epoch = None
        try:
            item = await self._items.receive()
        except anyio.EndOfStream:
            await self.aclose()
            raise StopAsyncIteration from None
        if isinstance(item, _Failed):
            await self.aclose()
            raise item.error
        return item

    @staticmethod
    async def _run(
        epoch: contextlib.AbstractAsyncContextManager[AsyncIterator[T]],
        send: MemoryObjectSendStream[T | _Failed],
    ) -> None:
        async with send:
            try:
                async with epoch as items:
                    async for item in items:
                        await send.send(item)
            except anyio.BrokenResourceError:
                pass  # the iterator was closed
            except Exception as exc:
                with contextlib.suppress(anyio.BrokenResourceError):
                    await send.send(_Failed(exc))

    async def aclose(self) -> None:
        """Stop the epoch: cancel its task and wait until every part is closed."""
        self._epoch = None
        task, self._task = self._task, None
        if self._items is not None:
            self._items.close()
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])  # its parts are closed when it ends

    def __del__(self) -> None:
        if self._items is not None:
            self._items.close()
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the loop runs its cleanup (closing the parts) on its own
