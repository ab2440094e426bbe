"""Where an epoch of ``tar_shards`` stands, and how it goes on from a saved state.

Owns: :func:`check_saved_state` (a saved state is of this dataset's shards, seed and rank),
:class:`EpochRun` (the open epoch as ``TarShards.state_dict`` describes it: what the
rank reads, its pieces, named as ``_data/restream.py`` says; the interleave's cursor over them,
the byte offset after the last sample taken from each open piece, the shuffle buffer),
:func:`piece_items` (a piece's samples) and :class:`ShuffleBuffer` (the sample shuffle buffer,
which knows where each sample it holds lies, so a saved state can read them again). A resumed
piece is read from the byte after its last sample taken (a range request, a seek); a piece of a
compressed shard, whose offsets are the uncompressed stream's, from its own start with the
samples taken passed over. Never: reads bytes or parses tar itself (``_tarread.py`` and
``_tarfmt.py`` do), or decides a re-division (``_data/restream.py`` does).
"""

from __future__ import annotations

import random
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from typing import Any

import anyio

from .._base.checks import check_int
from .._data.restream import Piece, state_pieces
from .._data.sharding import resolve_rank
from .._fanin.interleave import rng_from_json, rng_to_json
from .._fanin.lanes import Cursor

__all__ = [
    "EpochRun",
    "Located",
    "ShuffleBuffer",
    "Spanned",
    "check_saved_state",
    "piece_items",
    "without_spans",
]

#: A sample with where it lies in its shard: ``(sample, start, end)``, offsets None for a
#: compressed shard.
Spanned = tuple[dict[str, Any], int | None, int | None]
#: ``located(shard, start=0)``: a shard's samples from byte ``start`` on, with their spans.
Located = Callable[..., AsyncGenerator[Spanned, None]]
#: ``read(piece)``: a piece's samples, with their spans.
ReadPiece = Callable[[Piece], AsyncGenerator[Spanned, None]]


async def piece_items(located: Located, shard: str, piece: Piece) -> AsyncGenerator[Spanned, None]:
    """The samples of ``piece`` of ``shard``: read from its byte offset (or the shard's start),
    its ``skip`` first passed over, then ``count`` of them (or to the shard's end)."""
    skip, left = piece.skip, piece.count
    if left == 0:
        return
    async with aclosing(located(shard, piece.start or 0)) as items:
        async for item in items:
            if skip:
                skip -= 1
                continue
            yield item
            if left is not None:
                left -= 1
                if not left:
                    return


async def _nothing() -> AsyncGenerator[Spanned, None]:
    return
    yield  # an async generator that gives nothing


async def without_spans(
    items: AsyncGenerator[Spanned, None],
) -> AsyncGenerator[dict[str, Any], None]:
    """The samples alone."""
    async with aclosing(items):
        async for sample, _, _ in items:
            yield sample


def check_saved_state(
    state: dict[str, Any], *, count: int, dataset: str, rank: int | None, world_size: int | None
) -> int:
    """The epoch of a saved state of a ``tar_shards`` of ``count`` shards whose split is
    ``dataset`` (its digest) and whose ``rank`` and ``world_size`` are as given (None: detected);
    the rest is checked as the epoch opens (:class:`EpochRun`).

    Raises:
        TypeError, ValueError: ``state`` is malformed, of a different list of shards or seed,
            or of another rank or world size.
    """
    epoch, shards = state.get("epoch"), state.get("shards")
    checked = check_int("state['epoch']", epoch, minimum=0)
    if shards != count:
        raise ValueError(
            f"state['shards'] is {shards!r}: the state is of a dataset of other shards "
            f"(this one has {count})"
        )
    if state.get("dataset", dataset) != dataset:
        raise ValueError(
            "the state is of another tar_shards (other shards, seed or shuffle_shards): it "
            "cannot resume here"
        )
    split = state.get("split")
    if split is not None:  # a state saved before issue 26 names none: its plan is checked
        mine = list(resolve_rank(rank, world_size))
        if list(split) != mine:
            raise ValueError(
                f"the state is rank {split[0]}'s of {split[1]}; this tar_shards is rank "
                f"{mine[0]} of {mine[1]} (give each rank its own state: states[k] of "
                "merge_states(..., world_size=W) to rank k)"
            )
        state_pieces(state)  # well-formed
    return checked


class EpochRun:
    """An open epoch of ``tar_shards`` (see the module).

    ``split`` is what the state names of what the rank reads (``_data/restream.py``'s
    ``SPLIT_KEYS``, the epoch among them), given whole to every state.

    Raises (``__init__``, with a saved state): ValueError, TypeError: the state is malformed,
    of another plan of shards (other shards, seed, shuffles, rank), or read another number of
    shards at once.
    """

    def __init__(
        self,
        split: dict[str, Any],
        plan: str,
        width: int,
        order: random.Random | None,
        resume: dict[str, Any] | None,
    ) -> None:
        self.split = split
        self.plan = plan
        self.buffer: ShuffleBuffer | None = None
        self.ends: dict[int, int | None] = {}  # open part -> the byte after its last sample taken
        self.last_start: int | None = None  # where the last sample taken starts
        self._resumed_ends: dict[int, int | None] = {}
        self.cursor = Cursor.for_epoch(
            width,
            order,
            plan,
            resume,
            differs="other shards, seed, shuffle_shards, shuffle_buffer, rank or world_size",
            width_name="shards_in_flight",
        )
        if resume is None:
            return
        ends = resume.get("ends", {})
        if not isinstance(ends, dict):
            raise TypeError(f"a tar state's 'ends' must be a mapping, got {ends!r}")
        for key, end in ends.items():
            if not (str(key).isdigit() and (end is None or isinstance(end, int))):
                raise ValueError(f"a tar state's 'ends' is malformed: {ends!r}")
            self._resumed_ends[int(key)] = end
        self.ends = dict(self._resumed_ends)

    def state(self) -> dict[str, Any]:
        cursor = self.cursor
        state: dict[str, Any] = {
            **self.split,  # its pieces a tuple, shared; its split a new list (a state is new)
            "split": list(self.split["split"]),
            "plan": self.plan,
            "cursor": cursor.to_json(),
            "ends": {str(p): self.ends.get(p) for p in cursor.taken},
        }
        if self.buffer is not None:
            state["buffer"] = self.buffer.to_json()
        return state

    def reopener(
        self, read: ReadPiece
    ) -> Callable[[int, Piece, int], AsyncIterator[Spanned] | None]:
        """For the interleave: a resumed open piece read from the byte after its last sample
        taken, or None (compressed: read from its start, the samples taken passed over)."""

        def reopen(index: int, piece: Piece, taken: int) -> AsyncIterator[Spanned] | None:
            end = self._resumed_ends.get(index)
            if end is None:
                return None
            rest = piece.after(taken, end)
            return _nothing() if rest is None else read(rest)

        return reopen

    async def samples(
        self, spanned: AsyncIterator[Spanned]
    ) -> AsyncGenerator[dict[str, Any], None]:
        """The interleave's samples, each one's place noted as it is taken."""
        cursor, ends = self.cursor, self.ends
        async for sample, start, end in spanned:
            ends[cursor.last[0]] = end
            self.last_start = start
            yield sample


class ShuffleBuffer:
    """The sample shuffle buffer: filled first, then each new sample takes a random slot and the
    evicted one is yielded; the rest in random order at the end. It knows where each sample it
    holds came from (shard, place, byte offset), so a saved state can fill it again."""

    __slots__ = ("draining", "epoch", "items", "origins", "rng", "size")

    def __init__(self, size: int, rng: random.Random, run: EpochRun) -> None:
        self.size = size
        self.rng = rng
        self.epoch = run
        self.items: list[dict[str, Any]] = []
        # (part in the epoch's order, sample in it, its byte offset or None)
        self.origins: list[tuple[int, int, int | None]] = []
        self.draining = False

    def to_json(self) -> dict[str, Any]:
        return {
            "origins": list(self.origins),
            "rng": rng_to_json(self.rng),
            "draining": self.draining,
        }

    def restore(self, state: object) -> None:
        """Where a saved buffer stood (its samples are read again by :meth:`read_again`).

        Raises:
            TypeError, ValueError: ``state`` is malformed.
        """
        if not isinstance(state, dict):
            raise TypeError(f"a shuffle buffer's state must be a mapping, got {state!r}")
        try:
            origins = [
                (int(p), int(i), None if at is None else int(at)) for p, i, at in state["origins"]
            ]
            draining = bool(state["draining"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a shuffle buffer's state is malformed: {exc!r}") from None
        if len(origins) > self.size:
            raise ValueError(
                f"the saved shuffle buffer holds {len(origins)} samples; shuffle_buffer is "
                f"{self.size} (it must be the same to resume)"
            )
        rng_from_json(self.rng, state.get("rng"))
        self.origins, self.draining = origins, draining

    async def read_again(
        self, read: ReadPiece, pieces: Sequence[Piece], name: Callable[[Piece], str], width: int
    ) -> None:
        """Read the samples a restored buffer held, one sequential read per piece (``width``
        at once): from the first buffered sample's byte offset to the last one's, or (a
        compressed shard) from the piece's start, by place."""
        found: dict[tuple[int, int], dict[str, Any]] = {}
        limit = anyio.Semaphore(width)
        wanted: dict[int, dict[int, int | None]] = {}  # part -> place -> byte offset
        for part, place, at in self.origins:
            wanted.setdefault(part, {})[place] = at

        async def fill(part: int, places: dict[int, int | None]) -> None:
            offsets = {at: place for place, at in places.items() if at is not None}
            by_offset = len(offsets) == len(places)
            start = min(offsets) if by_offset else 0
            left = set(places)
            piece = pieces[part] if not by_offset else Piece(pieces[part].part, start)
            async with limit, aclosing(read(piece)) as samples:
                place = -1
                async for sample, begin, _ in samples:
                    place += 1
                    key = offsets.get(begin) if by_offset else place  # type: ignore[arg-type]
                    if key is not None and key in left:
                        found[part, key] = sample
                        left.discard(key)
                        if not left:
                            return
            raise ValueError(
                f"shard {name(pieces[part])!r} does not hold the samples the saved shuffle "
                f"buffer held ({sorted(left)}): the shard changed since the state was saved"
            )

        async with anyio.create_task_group() as tg:
            for part, places in sorted(wanted.items()):
                tg.start_soon(fill, part, places)
        self.items = [found[part, place] for part, place, _ in self.origins]

    async def run(
        self, samples: AsyncIterator[dict[str, Any]]
    ) -> AsyncGenerator[dict[str, Any], None]:
        """``samples`` through the buffer (the run's cursor names each one's origin)."""
        size, rng, run = self.size, self.rng, self.epoch
        cursor = run.cursor
        if not self.draining:
            items, origins = self.items, self.origins
            async for sample in samples:
                origin = (*cursor.last, run.last_start)
                if len(items) < size:
                    items.append(sample)
                    origins.append(origin)
                    continue
                slot = rng.randrange(size)
                evicted, items[slot] = items[slot], sample
                origins[slot] = origin
                yield evicted
            order = list(range(len(items)))
            rng.shuffle(order)  # the same draws as shuffling the samples themselves
            self.items = [items[k] for k in order]
            self.origins = [origins[k] for k in order]
            self.draining = True
        while self.items:
            self.origins.pop()
            yield self.items.pop()
