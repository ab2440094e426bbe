"""``aioloader._data.restream``: what the ranks of a parts stream left of an epoch, re-divided
among another number of ranks (issue 26, part 2: the pure part).

The property runs a model of ``tar_shards``' reading: the real :class:`Interleave` over a rank's
pieces and the shuffle buffer's rule, over parts whose items lie at known byte offsets (or, as
in a compressed shard, at unknown ones)."""

from __future__ import annotations

import gzip
import random
from collections import Counter
from collections.abc import Iterator
from contextlib import aclosing
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from aioloader._data.restream import Piece, RankLeft, pieces_left, redivide
from aioloader._data.sharding import epoch_parts
from aioloader._fanin.interleave import Interleave
from aioloader.sources import tar_shards
from tests.sources.test_tar import make_shards

ITEM = 100  # item k of a part lies at bytes [100 k, 100 (k + 1))

Item = tuple[int, int]  # (part, index in it)


def read(piece: Piece, sizes: list[int], offsets: bool) -> Iterator[tuple[Item, int | None]]:
    """A piece's items with where each starts, as ``located(shard, start)`` and the piece's
    skip and count give them."""
    first = 0 if piece.start is None else piece.start // ITEM
    items = range(first + piece.skip, sizes[piece.part])
    if piece.count is not None:
        items = items[: piece.count]
    for k in items:
        yield (piece.part, k), (k * ITEM if offsets else None)


class Rank:
    """One rank reading its pieces as ``tar_shards`` does (interleave, then shuffle buffer),
    until it has given ``stop`` items; then :meth:`left` is where it stood."""

    def __init__(
        self, plan: list[Piece], sizes: list[int], offsets: bool, width: int, buffer: int, seed: int
    ) -> None:
        self.plan, self.sizes, self.offsets = plan, sizes, offsets
        self.order = Interleave(width, random.Random(seed))
        self.taken: dict[int, int] = {}
        self.ends: dict[int, int | None] = {}
        self.buffer = buffer
        self.rng = random.Random(seed + 1)
        self.held: list[tuple[Item, tuple[int, int, int | None]]] = []
        self.out = self._shuffled()

    def _interleaved(self) -> Iterator[tuple[Item, tuple[int, int, int | None]]]:
        readers: dict[int, Iterator[tuple[Item, int | None]]] = {}
        while not self.order.done:
            p = self.order.turn()
            if p >= len(self.plan):
                self.order.missing()
                continue
            reader = readers.setdefault(p, read(self.plan[p], self.sizes, self.offsets))
            got = next(reader, None)
            if got is None:
                self.order.ended()
                self.taken.pop(p, None)
                self.ends.pop(p, None)
                continue
            item, at = got
            place = self.taken.get(p, 0)
            self.order.drew()
            self.taken[p] = place + 1
            self.ends[p] = None if at is None else at + ITEM
            yield item, (p, place, at)

    def _shuffled(self) -> Iterator[Item]:
        if self.buffer <= 1:
            for item, _ in self._interleaved():
                yield item
            return
        for item, origin in self._interleaved():
            if len(self.held) < self.buffer:
                self.held.append((item, origin))
                continue
            slot = self.rng.randrange(self.buffer)
            evicted, self.held[slot] = self.held[slot], (item, origin)
            yield evicted[0]
        self.rng.shuffle(self.held)
        while self.held:
            yield self.held.pop()[0]

    def take(self, stop: int | None) -> list[Item]:
        got = []
        while stop is None or len(got) < stop:
            item = next(self.out, None)
            if item is None:
                break
            got.append(item)
        return got

    def left(self) -> RankLeft:
        opened = {p: (n, self.ends[p]) for p, n in self.taken.items()}
        return RankLeft(self.plan, self.order.next_part, opened, [o for _, o in self.held])


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 6), min_size=1, max_size=9),
    worlds=st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4)),
    width=st.integers(1, 4),
    buffer=st.integers(0, 5),
    offsets=st.booleans(),
    stops=st.lists(st.integers(0, 12), min_size=8, max_size=8),
    shuffle=st.booleans(),
)
def test_stop_anywhere_resume_on_other_worlds_twice_and_the_epoch_is_read_once(
    sizes: list[int],
    worlds: tuple[int, int, int],
    width: int,
    buffer: int,
    offsets: bool,
    stops: list[int],
    shuffle: bool,
) -> None:
    """W ranks stop at random points and save; W' ranks go on from what they left and stop
    again; W'' ranks finish. Every item of the epoch is taken once, none twice, none lost."""
    first = worlds[0]
    assume(len(sizes) >= first)  # fewer parts than ranks: an error, each rank needs one
    plans = [
        [
            Piece(p)
            for p in epoch_parts(
                range(len(sizes)), 3, seed=7, shuffle=shuffle, rank=r, world_size=first
            )
        ]
        for r in range(first)
    ]
    epoch = Counter(
        (piece.part, k) for plan in plans for piece in plan for k in range(sizes[piece.part])
    )
    taken: Counter[Item] = Counter()
    for phase in range(len(worlds)):
        ranks = [
            Rank(plan, sizes, offsets, width, buffer, seed=phase * 10 + r)
            for r, plan in enumerate(plans)
        ]
        last = phase == len(worlds) - 1
        for r, rank in enumerate(ranks):
            taken.update(rank.take(None if last else stops[(phase * 4 + r) % len(stops)]))
        if not last:
            plans = redivide([rank.left() for rank in ranks], worlds[phase + 1])
            assert len(plans) == worlds[phase + 1]
        else:
            assert all(not rank.left().open and not rank.left().held for rank in ranks)
    assert taken == epoch


def test_pieces_left_and_the_dealing() -> None:
    plan = [Piece(0), Piece(1), Piece(2, start=500, count=4), Piece(3)]
    rank = RankLeft(
        plan, next_part=3, open={0: (2, 200), 2: (4, 900)}, held=[(1, 5, 500), (1, 6, None)]
    )
    assert pieces_left(rank) == [
        Piece(0, start=200),  # the rest of part 0, from the byte after its 2nd item
        # piece 2 had 4 of its 4 taken: nothing left
        Piece(1, start=500, count=1),  # a held sample, read from its own offset
        Piece(1, skip=6, count=1),  # one whose offset is unknown: 6 passed over
        Piece(3),  # not opened
    ]
    assert redivide([rank, RankLeft.fresh([Piece(9)])], 2) == [
        [Piece(0, start=200), Piece(1, skip=6, count=1), Piece(9)],
        [Piece(1, start=500, count=1), Piece(3)],
    ]
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        redivide([rank], 0)
    with pytest.raises(TypeError, match="world_size"):
        redivide([rank], "2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ranks is empty"):
        redivide([], 2)
    assert Piece.from_json(Piece(1, None, 3, 2).to_json()) == Piece(1, None, 3, 2)
    with pytest.raises(ValueError, match=r"\[part, start, skip, count\]"):
        Piece.from_json([1, -1, 0, None])


@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("stop", [0, 7, 19, 40])
async def test_a_real_tar_state_says_what_is_left(
    tmp_path: Path, compressed: bool, stop: int
) -> None:
    """What a ``tar_shards`` state says is left (read back with its own reader, piece by
    piece) and what was taken are the epoch, once each: offsets, places and the buffer's
    samples mean what :mod:`restream` takes them to mean."""
    paths = make_shards(tmp_path, n_shards=4, n_samples=9)
    if compressed:
        for p in paths:
            p.write_bytes(gzip.compress(p.read_bytes()))
    ds = tar_shards(paths, shuffle_shards=True, shuffle_buffer=6, shards_in_flight=2, seed=3)
    shards = ds.epoch_shards(0)
    async with ds.open_epoch(0) as samples:
        taken = []
        for _ in range(stop):  # the epoch stays open: its state is where the consumer stands
            sample = await anext(samples, None)
            if sample is None:
                break
            taken.append(sample["__key__"])
        state = ds.state_dict()
    left = pieces_left(RankLeft.from_state([Piece(i) for i in range(len(shards))], state))
    rest = []
    async with ds._reading.open_located() as located:
        for piece in left:
            got = 0
            async with aclosing(located(shards[piece.part], piece.start or 0)) as items:
                async for sample, _, _ in items:
                    got += 1
                    if got <= piece.skip:
                        continue
                    rest.append(sample["__key__"])
                    if piece.count is not None and got - piece.skip == piece.count:
                        break
    everything = sorted(f"s{s}/{j:04d}" for s in range(4) for j in range(9))
    assert len(taken) == min(stop, 36)
    assert sorted(taken + rest) == everything
