"""Many parts of a stream (shards, files, key ranges) read at once, their items handed out in
the order :class:`~aioloader._fanin.interleave.Interleave` gives.

Owns: one reader task per open part, each filling a bounded buffer of its own, parts opened in
plan order up to ``width + ahead`` at once (so the part after one that ends is already being
read), and the consumer's side that takes items in the interleave's order. Never: decides the
order (``_fanin/interleave.py``), or knows what a part is (``read(part)`` opens it).

Memory: a part's buffer holds at most ``part_limit`` units (``size(item)``, e.g. bytes; an
item larger than that is still admitted alone), so what is held read ahead is bounded by
``(width + ahead) * part_limit`` plus what each open ``read(part)`` holds itself (a chunk being
parsed). A slow consumer stops the readers: a full buffer waits for the consumer.

Errors: a part's error is raised when the consumer reaches it in the order (after the items
before it), with a note naming the part; leaving the ``async with`` then closes every other
part. An error while listing the parts is raised where the consumer needs the part that could
not be listed.

Resuming: a :class:`Cursor` says where the consumer stands (the interleave's state, and how many
items it took from each open part); an interleave given a saved cursor reopens the open parts,
passes over the items already taken, and goes on with the plan where it stood.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
from collections import deque
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Callable,
    Iterable,
    Sequence,
)
from contextlib import aclosing
from typing import Any, Generic, TypeVar

import anyio

from .interleave import Interleave

__all__ = ["Cursor", "ahead_for", "close_iterator", "interleaved", "plan_digest"]

T = TypeVar("T")
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


class Cursor:
    """Where the consumer of an interleave stands: the :class:`Interleave`, the items it took
    from each open part (``taken``), and the ``(part, item)`` of the last item it took."""

    __slots__ = ("last", "order", "taken")

    def __init__(self, order: Interleave, taken: dict[int, int] | None = None) -> None:
        self.order = order
        self.taken = dict(taken or {})
        self.last: tuple[int, int] = (-1, -1)

    @property
    def started(self) -> bool:
        return self.order.next_part > 0

    def to_json(self) -> dict[str, Any]:
        return {
            "interleave": self.order.to_json(),
            "taken": [[p, n] for p, n in self.taken.items()],
        }

    @classmethod
    def for_epoch(
        cls,
        width: int,
        rng: random.Random | None,
        plan: str,
        saved: dict[str, Any] | None,
        *,
        differs: str,
        width_name: str,
    ) -> Cursor:
        """A new epoch's cursor, or the one ``saved`` (a state holding the ``plan_digest`` it
        was saved for and its ``cursor``) stood at.

        Raises:
            ValueError: ``saved`` is of another plan (``differs`` says what may differ), or
                read another number of parts at once (``width_name`` is the setting).
            TypeError: ``saved``'s cursor is malformed.
        """
        if saved is None:
            return cls(Interleave(width, rng))
        if saved.get("plan") != plan:
            raise ValueError(
                f"the state was saved for another plan of the epoch ({differs}): it cannot "
                "resume here"
            )
        cursor = cls.from_json(saved["cursor"], rng)
        if cursor.order.width != width:
            raise ValueError(
                f"the state was saved reading {cursor.order.width} parts at once; this epoch "
                f"reads {width} ({width_name} must be the same to resume)"
            )
        return cursor

    @classmethod
    def from_json(cls, state: object, rng: random.Random | None) -> Cursor:
        """Raises: TypeError, ValueError: ``state`` is malformed."""
        if not isinstance(state, dict):
            raise TypeError(f"an interleave cursor must be a mapping, got {state!r}")
        order = Interleave.from_json(state.get("interleave"), rng)
        pairs = state.get("taken")
        if not (isinstance(pairs, list) and all(_count_pair(x) for x in pairs)):
            raise ValueError(f"an interleave cursor's 'taken' is malformed: {pairs!r}")
        taken = {p: n for p, n in pairs}
        if set(taken) != set(order.open_parts) or any(n < 1 for n in taken.values()):
            raise ValueError(
                f"an interleave cursor's taken parts {sorted(taken)} are not its open parts "
                f"{order.open_parts}"
            )
        return cls(order, taken)


def plan_digest(*plan: object) -> str:
    """A short digest of what decides an epoch's order (its parts in plan order, the seeds and
    settings), saved beside a cursor: a cursor means nothing for another plan."""
    text = json.dumps(plan, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _count_pair(pair: object) -> bool:
    return (
        isinstance(pair, (list, tuple))
        and len(pair) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in pair)
    )


class _Parts(Generic[P, T]):
    """The parts opened so far, in plan order, and the room for more."""

    def __init__(self, room: int) -> None:
        self.lanes: dict[int, _Lane[T]] = {}  # the parts opened and not yet finished
        self.opened = 0
        self.done = False
        self.error: BaseException | None = None
        self.room = anyio.Semaphore(room)
        self._changed = anyio.Event()

    def add(self, lane: _Lane[T]) -> None:
        self.lanes[self.opened] = lane
        self.opened += 1
        self._changed.set()
        self._changed = anyio.Event()

    def reopened(self, index: int, lane: _Lane[T]) -> None:
        """A part a resumed interleave had open: its lane, before the plan goes on."""
        self.lanes[index] = lane

    def go_on_from(self, index: int) -> None:
        """The plan goes on from part ``index`` (every part before it opened, or done)."""
        self.opened = index
        self._changed.set()
        self._changed = anyio.Event()

    def close(self, error: BaseException | None = None) -> None:
        self.done = True
        self.error = error
        self._changed.set()

    async def lane(self, index: int) -> _Lane[T] | None:
        """Part ``index``'s lane once it is open; None when the plan has no such part."""
        while index >= self.opened:
            if self.done:
                if self.error is not None:
                    raise self.error
                return None
            await self._changed.wait()
        return self.lanes[index]


async def close_iterator(iterator: object) -> None:
    """``aclose()`` an async iterator that has it (an async generator), shielded: its files and
    connections close even when the caller is being cancelled."""
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            await aclose()


def ahead_for(width: int, parts: int) -> int:
    """The parts opened ahead of ``width`` open ones in a plan of ``parts``: a quarter of the
    width (at least one) so the next part flows when one ends; none when all are open."""
    return 0 if width >= parts else max(1, width // 4)


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
    cursor: Cursor | None = None,
    reopen: Callable[[int, P, int], AsyncIterator[T] | None] | None = None,
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
        cursor: Filled in as the consumer takes items (see :class:`Cursor`); one that has
            ``started`` (restored from a saved state, with ``rng`` restored in it) resumes
            there, ``parts`` then being a sequence.
        reopen: For a resumed part: ``reopen(index, part, taken)`` gives an iterator that
            starts after the ``taken`` items already taken (a seek), or None to read the part
            from its start and pass over them.

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
    if cursor is None:
        cursor = Cursor(Interleave(width, rng))
    resumed = cursor.started
    if resumed and not isinstance(parts, Sequence):
        raise TypeError("resuming an interleave needs its parts as a sequence")
    # Read now: the consumer's first turn may take the next part before the plan task runs.
    next_part, reopened = cursor.order.next_part, dict(cursor.taken)

    async def fill(part: P, lane: _Lane[T], skip: int = 0, index: int = -1) -> None:
        try:
            items = None
            if skip and reopen is not None:
                items = reopen(index, part, skip)
            if items is None:
                items = read(part)
            else:
                skip = 0
            try:
                async for item in items:
                    if skip:  # taken before the stop
                        skip -= 1
                        continue
                    await lane.put(item, measure(item))
            finally:
                await close_iterator(items)
        except Exception as exc:
            lane.close(exc)
        else:
            lane.close()

    async def plan(tg: anyio.abc.TaskGroup) -> None:
        plan = parts
        try:
            if resumed and isinstance(parts, Sequence):
                for index in sorted(reopened):
                    await shelf.room.acquire()
                    again: _Lane[T] = _Lane(name(parts[index]), part_limit)
                    shelf.reopened(index, again)
                    tg.start_soon(fill, parts[index], again, reopened[index], index)
                shelf.go_on_from(next_part)
                plan = parts[next_part:]
            async with aclosing(_as_async(plan)) as listing:
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
        order, taken = cursor.order, cursor.taken
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
                del shelf.lanes[index]  # its reader is done: let it go
                taken.pop(index, None)
                shelf.room.release()
                continue
            order.drew()
            n = taken.get(index, 0)
            taken[index] = n + 1
            cursor.last = (index, n)
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
            await close_iterator(iterator)
    else:
        for part in parts:
            yield part
