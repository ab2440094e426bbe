"""A user's stream split into parts (one per shard, file or key range), read several at once.

Owns: the public :func:`interleave` dataset: the epoch's part order (shuffled and split by rank
as :func:`~aioloader._data.sharding.epoch_parts` says) and how a part is opened. Never: reads or
orders items itself (``_fanin/lanes.py`` and ``_fanin/interleave.py`` do).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from .._base.checks import check_bool, check_int, check_seed
from .._data.epochs import OpensEpochs
from .._data.seeds import derive_seed
from .._data.sharding import SplitsByRank, epoch_parts, resolve_rank
from .lanes import Cursor, ahead_for, interleaved, plan_digest

__all__ = ["Interleaved", "interleave"]

T = TypeVar("T")

Part = AsyncIterable[T] | Callable[[], AsyncIterator[T]]


def interleave(
    parts: Sequence[Part[T]],
    *,
    in_flight: int = 8,
    buffer: int = 16,
    shuffle: bool = False,
    seed: int = 0,
    rank: int | None = None,
    world_size: int | None = None,
) -> Interleaved[T]:
    """One stream read as several parts at once: ``in_flight`` parts are read concurrently, each
    into a buffer of its own, and their items are interleaved in an order that depends only on
    the seed and the parts' lengths (never on which part is faster).

    A part is an async iterable that can be iterated again each epoch (an
    :class:`~aioloader.AsyncIterableDataset`, an object with ``__aiter__``) or a callable giving
    a fresh async iterator (an async generator function, or ``functools.partial`` of one).
    Example: one part per key range of a table::

        async def rows(start, stop):
            async for row in db.scan(start, stop):
                yield row

        ds = aioloader.interleave([functools.partial(rows, k, k + 10_000)
                                   for k in range(0, 1_000_000, 10_000)], in_flight=16)
        loader = aioloader.DataLoader(ds, batch_size=256)

    Epochs: a loader reading it owns them (``loader.set_epoch``); iterated directly, each
    ``async for`` opens the next (see :class:`~aioloader.OpensEpochs`).

    Order: each epoch, the parts are shuffled (with ``shuffle``: ``random.Random(derive_seed(seed,
    epoch))``) and split by rank (part ``j`` goes to rank ``j % world_size``; the last
    ``len(parts) % world_size`` are dropped so every rank reads as many parts); then
    ``in_flight`` of them are open at a time and each round takes one item from every open part
    (in part order, or, with ``shuffle``, in an order drawn each round); a part that ends gives
    its place to the next. ``in_flight=1`` reads the parts one after the other.

    Args:
        parts: The parts.
        in_flight: Parts read at once (a quarter more, at least one, are opened ahead so the next
            part is flowing when one ends).
        buffer: Items each open part reads ahead of the consumer.
        shuffle: Shuffle the part order and the rounds each epoch.
        seed: The seed of both shuffles.
        rank, world_size: This rank and the number of ranks, or None to detect them (from
            ``torch.distributed``, else 0 of 1). A loader given ``distributed=True`` refuses
            it (a second split), unless ``world_size=1`` is given here.

    Raises:
        TypeError: ``parts`` is not a sequence, a part is neither an async iterable nor
            callable, or a number is not an int.
        ValueError: ``parts`` is empty, ``in_flight < 1``, ``buffer < 1``, or a bad rank.

    Iterating raises: a part's error where its items would have come (after the items before
    it), with a note naming the part; the other parts are closed.

    Cancellation: ending an epoch early cancels the readers of the open parts. A part stopped at
    a ``yield`` is closed (``aclose``, shielded); one stopped inside its own ``await`` gets the
    cancellation there, so an ``await`` in its ``finally`` (closing a connection) must shield
    itself (``with anyio.CancelScope(shield=True):``) to be sure to run.
    """
    return Interleaved(
        parts,
        in_flight=in_flight,
        buffer=buffer,
        shuffle=shuffle,
        seed=seed,
        rank=rank,
        world_size=world_size,
    )


class Interleaved(SplitsByRank, OpensEpochs[T]):
    """Parts of one stream read several at once; see :func:`interleave`."""

    #: :meth:`state_dict` builds a new object each call: the loader need not copy it.
    state_dict_is_a_copy = True

    def __init__(
        self,
        parts: Sequence[Part[T]],
        *,
        in_flight: int,
        buffer: int,
        shuffle: bool,
        seed: int,
        rank: int | None,
        world_size: int | None,
    ) -> None:
        given: object = parts
        if not isinstance(given, Sequence) or isinstance(given, str | bytes):
            raise TypeError(f"parts must be a sequence of async iterables, got {parts!r}")
        if not parts:
            raise ValueError("parts must hold at least one part")
        for i, part in enumerate(parts):
            if not (hasattr(part, "__aiter__") or callable(part)):
                raise TypeError(
                    f"parts[{i}] must be an async iterable or a callable giving an async "
                    f"iterator, got {part!r}"
                )
            if hasattr(part, "__anext__"):  # an iterator: empty from its second epoch on
                raise TypeError(
                    f"parts[{i}] is a one-shot async iterator ({type(part).__name__}); pass "
                    "the async generator function (or a re-iterable dataset) instead"
                )
        self._parts = list(parts)
        self.in_flight = check_int("in_flight", in_flight, minimum=1)
        self.buffer = check_int("buffer", buffer, minimum=1)
        self._shuffle = check_bool("shuffle", shuffle)
        self._seed = check_seed(seed)
        if rank is not None and world_size is not None:
            resolve_rank(rank, world_size)  # validate early
        self._rank = rank
        self._world_size = world_size
        self._running: tuple[int, str, Cursor] | None = None  # the open epoch: plan, cursor

    def __repr__(self) -> str:
        return f"Interleaved(parts={len(self._parts)}, in_flight={self.in_flight})"

    def state_dict(self) -> dict[str, Any]:
        """Where the open epoch's iterator stands (the interleave's order and how many items
        it took from each open part), or, with none open, the start of the next epoch.
        Resuming reopens the open parts and passes over the items they gave before, so a part
        must give the same items each time it is opened."""
        if self._running is None:
            return self.next_state({"epoch": 0, "parts": len(self._parts), "cursor": None})
        epoch, digest, cursor = self._running
        return {
            "epoch": epoch,
            "parts": len(self._parts),
            "plan": digest,
            "cursor": cursor.to_json(),
        }

    def check_state(self, state: dict[str, Any]) -> int:
        """The epoch of ``state`` (from :meth:`state_dict`); the rest is checked as the epoch
        opens.

        Raises:
            TypeError, ValueError: ``state`` is malformed, or of another number of parts.
        """
        epoch = check_int("state['epoch']", state.get("epoch"), minimum=0)
        if state.get("parts") != len(self._parts):
            raise ValueError(
                f"state['parts'] is {state.get('parts')!r}; this interleave has "
                f"{len(self._parts)} parts"
            )
        return epoch

    def epoch_parts(self, epoch: int) -> list[int]:
        """The indices of the parts this rank reads in ``epoch``, in plan order."""
        return epoch_parts(
            list(range(len(self._parts))),
            epoch,
            seed=self._seed,
            shuffle=self._shuffle,
            rank=self._rank,
            world_size=self._world_size,
        )

    def epoch_items(
        self, epoch: int, state: dict[str, Any] | None
    ) -> contextlib.AbstractAsyncContextManager[AsyncIterator[T]]:
        """Epoch ``epoch`` (see :meth:`~aioloader.OpensEpochs.open_epoch`), from ``state`` on
        if given: an async context manager giving its iterator; the parts' readers run until
        the block is left.

        Cancellation: leaving the block early closes every open part before it is left.
        """
        resume = state if state is not None and state.get("cursor") is not None else None
        return self._epoch(epoch, resume)

    @contextlib.asynccontextmanager
    async def _epoch(
        self, epoch: int, resume: dict[str, Any] | None
    ) -> AsyncIterator[AsyncIterator[T]]:
        plan = self.epoch_parts(epoch)
        width = min(self.in_flight, len(plan)) or 1
        rng = random.Random(derive_seed(self._seed, epoch, 2)) if self._shuffle else None
        digest = plan_digest(plan, self._seed, self._shuffle)
        cursor = Cursor.for_epoch(
            width,
            rng,
            digest,
            resume,
            differs="seed, shuffle, rank or world_size",
            width_name="in_flight",
        )
        async with interleaved(
            plan,
            self._open,
            width=width,
            ahead=ahead_for(width, len(plan)),
            part_limit=self.buffer,
            rng=rng,
            name=self._name,
            cursor=cursor,
        ) as items:
            self._running = (epoch, digest, cursor)
            try:
                yield items
            finally:
                self._running = None

    def _open(self, index: int) -> AsyncIterator[T]:
        part = self._parts[index]
        if hasattr(part, "__aiter__"):
            return aiter(part)
        iterator = part()
        if not hasattr(iterator, "__anext__"):
            raise TypeError(
                f"parts[{index}]() must return an async iterator, got {type(iterator).__name__}"
            )
        return iterator

    def _name(self, index: int) -> str:
        text = repr(self._parts[index])
        return f"parts[{index}]: {text if len(text) <= 80 else text[:77] + '...'}"
