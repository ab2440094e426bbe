"""The interleave of many parts: its order (pure, property-tested) and the reader that carries it
out (bounded buffers, errors named, parts closed)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aioloader
from aioloader._fanin.interleave import Interleave
from aioloader._fanin.lanes import interleaved


def simulate(lengths: list[int], width: int, seed: int | None) -> tuple[list[tuple[int, int]], int]:
    """Run the order over parts of ``lengths``: (part, item) pairs, and the most parts open."""
    order = Interleave(width, None if seed is None else random.Random(seed))
    got: list[tuple[int, int]] = []
    drawn = [0] * len(lengths)
    most_open = 0
    while not order.done:
        part = order.turn()
        if part >= len(lengths):
            order.missing()
            continue
        most_open = max(most_open, len(order.open_parts))
        if drawn[part] == lengths[part]:
            order.ended()
            continue
        got.append((part, drawn[part]))
        drawn[part] += 1
        order.drew()
    return got, most_open


lengths_st = st.lists(st.integers(min_value=0, max_value=12), max_size=12)


@settings(max_examples=300, deadline=None)
@given(lengths_st, st.integers(min_value=1, max_value=6), st.none() | st.integers(0, 2**32))
def test_every_item_once_in_part_order_and_width_bounded(
    lengths: list[int], width: int, seed: int | None
) -> None:
    got, most_open = simulate(lengths, width, seed)
    assert sorted(got) == [(p, i) for p, n in enumerate(lengths) for i in range(n)]
    for part in range(len(lengths)):
        assert [i for p, i in got if p == part] == list(range(lengths[part]))
    assert most_open <= width
    assert simulate(lengths, width, seed) == (got, most_open)  # nothing but seed and lengths


@settings(max_examples=100, deadline=None)
@given(lengths_st, st.none() | st.integers(0, 2**32))
def test_width_one_reads_parts_one_after_the_other(lengths: list[int], seed: int | None) -> None:
    got, _ = simulate(lengths, 1, seed)
    assert got == [(p, i) for p, n in enumerate(lengths) for i in range(n)]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=5), min_size=1, max_size=8))
def test_parts_open_in_plan_order(lengths: list[int]) -> None:
    """A part starts only after every earlier part started: readers may open them in order."""
    got, _ = simulate(lengths, 3, 7)
    firsts = [p for k, (p, i) in enumerate(got) if i == 0]
    assert firsts == sorted(firsts)


def test_round_robin_without_rng_and_a_seeded_round_order() -> None:
    got, _ = simulate([2, 2, 2], 3, None)
    assert got == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    seeded, _ = simulate([4, 4, 4], 3, 1)
    rounds = [sorted(p for p, _ in seeded[k : k + 3]) for k in range(0, 12, 3)]
    assert rounds == [[0, 1, 2]] * 4  # each round draws once from every part
    assert seeded != simulate([4, 4, 4], 3, None)[0]
    assert seeded != simulate([4, 4, 4], 3, 2)[0]


def test_a_part_that_ends_gives_its_slot_to_the_next_part() -> None:
    got, _ = simulate([1, 3, 2], 2, None)
    assert got == [(0, 0), (1, 0), (2, 0), (1, 1), (2, 1), (1, 2)]


def test_bad_width_and_misuse() -> None:
    with pytest.raises(TypeError, match="width"):
        Interleave(True)
    with pytest.raises(ValueError, match="width must be a positive int"):
        Interleave(0)
    order = Interleave(1)
    assert order.turn() == 0
    order.missing()
    assert order.done
    with pytest.raises(RuntimeError, match="done"):
        order.turn()


# -- the reader --------------------------------------------------------------------------------


class Part:
    """A part of ``n`` items that records how far its reader got and whether it was closed."""

    def __init__(self, name: str, n: int, fail_at: int | None = None) -> None:
        self.name, self.n, self.fail_at = name, n, fail_at
        self.read = 0
        self.closed = False
        self.opened = False

    async def items(self) -> AsyncIterator[tuple[str, int]]:
        self.opened = True
        try:
            for i in range(self.n):
                if i == self.fail_at:
                    raise OSError(f"{self.name} broke at item {i}")
                await anyio.lowlevel.checkpoint()
                self.read += 1
                yield self.name, i
        finally:
            self.closed = True


async def collect(parts: list[Part], **kw: object) -> list[tuple[str, int]]:
    options: dict[str, object] = {"width": 2, "ahead": 1, "part_limit": 4} | kw
    async with interleaved(parts, Part.items, name=lambda p: p.name, **options) as it:  # type: ignore[arg-type]
        return [x async for x in it]


async def test_reader_gives_the_orders_items_whatever_the_timing() -> None:
    parts = [Part(f"p{k}", n) for k, n in enumerate([3, 1, 4, 0, 2])]
    got = await collect(parts, rng=random.Random(5))
    want, _ = simulate([3, 1, 4, 0, 2], 2, 5)
    assert [(int(name[1:]), i) for name, i in got] == want
    assert all(p.closed for p in parts)


async def test_slow_consumer_stops_the_readers() -> None:
    parts = [Part(f"p{k}", 100) for k in range(6)]
    async with interleaved(parts, Part.items, width=2, ahead=1, part_limit=4) as it:
        first = await anext(it)
        for _ in range(20):
            await anyio.lowlevel.checkpoint()
        assert first == ("p0", 0)
        assert [p.opened for p in parts] == [True, True, True, False, False, False]
        # each open part read at most its buffer (4), one item in hand and the one drawn
        assert max(p.read for p in parts) <= 6
    assert all(p.closed for p in parts[:3])


async def test_a_failing_part_is_named_in_turn_and_the_others_are_closed() -> None:
    parts = [Part("p0", 50), Part("bad", 50, fail_at=2), Part("p2", 50)]
    got: list[tuple[str, int]] = []
    with pytest.raises(OSError, match="bad broke at item 2") as info:
        async with interleaved(
            parts, Part.items, width=3, ahead=0, part_limit=8, name=lambda p: p.name
        ) as it:
            async for item in it:
                got.append(item)
    assert "aioloader: reading part 1 (bad)" in info.value.__notes__
    assert ("bad", 1) in got and ("bad", 2) not in got
    assert all(p.closed for p in parts)


async def test_a_listing_error_is_raised_where_its_part_is_needed() -> None:
    async def listing() -> AsyncIterator[Part]:
        yield Part("p0", 2)
        raise PermissionError("listing denied")

    got: list[tuple[str, int]] = []
    with pytest.raises(PermissionError, match="listing denied") as info:
        async with interleaved(listing(), Part.items, width=1, ahead=0, part_limit=4) as it:
            async for item in it:
                got.append(item)
    assert got == [("p0", 0), ("p0", 1)]
    assert any("listing part 1" in n for n in info.value.__notes__)


async def test_break_closes_every_open_part() -> None:
    parts = [Part(f"p{k}", 1000) for k in range(4)]
    async with interleaved(parts, Part.items, width=2, ahead=2, part_limit=16) as it:
        async for _ in it:
            break
    assert all(p.closed for p in parts if p.opened)


async def test_sizes_bound_the_buffer_but_a_large_item_goes_alone() -> None:
    class Big(Part):
        async def items(self) -> AsyncIterator[tuple[str, int]]:
            async for x in super().items():
                yield x

    parts = [Big("p0", 5)]
    async with interleaved(
        parts, Big.items, width=1, ahead=0, part_limit=10, size=lambda _: 100
    ) as it:
        got = [x async for x in it]
    assert got == [("p0", i) for i in range(5)]


# -- aioloader.interleave: a user's stream in parts ---------------------------------------------


def counting_part(name: str, n: int) -> Callable[[], AsyncIterator[str]]:
    async def items() -> AsyncIterator[str]:
        for i in range(n):
            await anyio.lowlevel.checkpoint()
            yield f"{name}{i}"

    return items


class Rows(aioloader.AsyncIterableDataset[str]):
    def __init__(self, name: str, n: int) -> None:
        self.name, self.n = name, n

    async def __aiter__(self) -> AsyncIterator[str]:
        for i in range(self.n):
            yield f"{self.name}{i}"


async def test_interleave_through_the_loader_in_a_seeded_order() -> None:
    parts: list[Any] = [counting_part("a", 3), Rows("b", 2), counting_part("c", 4)]
    ds = aioloader.interleave(parts, in_flight=2)
    loader: aioloader.DataLoader[list[str]] = aioloader.DataLoader(
        ds, batch_size=4, collate_fn=list
    )
    async with loader:
        epoch = [x async for batch in loader for x in batch]
    assert epoch == ["a0", "b0", "a1", "b1", "a2", "c0", "c1", "c2", "c3"]
    shuffled = aioloader.interleave(parts, in_flight=2, shuffle=True, seed=3)
    first = [x async for x in shuffled]
    second = [x async for x in shuffled]  # the next epoch
    assert sorted(first) == sorted(second) == sorted(epoch)
    again = aioloader.interleave(parts, in_flight=2, shuffle=True, seed=3)
    assert [x async for x in again] == first


async def test_interleave_splits_parts_by_rank() -> None:
    parts = [counting_part(name, 2) for name in "abcde"]
    per_rank = [
        [x async for x in aioloader.interleave(parts, rank=r, world_size=2)] for r in range(2)
    ]
    assert per_rank == [["a0", "c0", "a1", "c1"], ["b0", "d0", "b1", "d1"]]  # e is dropped


async def test_interleave_refuses_fewer_parts_than_ranks_and_a_second_split() -> None:
    parts = [counting_part(name, 2) for name in "abc"]
    with pytest.raises(ValueError, match=r"3 parts .* among 4 ranks"):
        [x async for x in aioloader.interleave(parts, rank=3, world_size=4)]
    with pytest.raises(ValueError, match="would split Interleaved a second time"):
        aioloader.DataLoader(aioloader.interleave(parts), distributed=True)


async def test_interleave_names_the_failing_part() -> None:
    async def broken() -> AsyncIterator[str]:
        yield "x0"
        raise KeyError("row 7")

    ds = aioloader.interleave([counting_part("a", 5), broken], in_flight=2)
    got: list[str] = []
    with pytest.raises(KeyError, match="row 7") as info:
        async for item in ds:
            got.append(item)
    assert got == ["a0", "x0", "a1"]
    assert any("parts[1]" in note for note in info.value.__notes__)


def test_interleave_arguments() -> None:
    with pytest.raises(ValueError, match="at least one part"):
        aioloader.interleave([])
    with pytest.raises(TypeError, match=r"parts\[1\] must be an async iterable"):
        aioloader.interleave([counting_part("a", 1), 3])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="in_flight"):
        aioloader.interleave([counting_part("a", 1)], in_flight=0)
    with pytest.raises(ValueError, match="buffer"):
        aioloader.interleave([counting_part("a", 1)], buffer=0)
    with pytest.raises(TypeError, match="parts must be a sequence"):
        aioloader.interleave(counting_part("a", 1))  # type: ignore[arg-type]


async def test_interleave_refuses_a_part_that_gives_no_async_iterator() -> None:
    def not_async() -> Any:
        return [1, 2]

    ds: aioloader.Interleaved[int] = aioloader.interleave([not_async])
    with pytest.raises(TypeError, match=r"parts\[0\]\(\) must return an async iterator"):
        [x async for x in ds]


# -- OwnedEpochIterator: direct iteration from any task -----------------------------------


def numbers(n: int, pause: float = 0.0) -> Callable[[], AsyncIterator[int]]:
    async def items() -> AsyncIterator[int]:
        for i in range(n):
            yield i
            await anyio.sleep(pause)

    return items


async def test_a_finished_closed_or_failed_iterator_stops() -> None:
    it = aiter(aioloader.interleave([numbers(2)]))
    assert [x async for x in it] == [0, 1]
    with pytest.raises(StopAsyncIteration):
        await anext(it)
    closed = aiter(aioloader.interleave([numbers(5)]))
    assert await anext(closed) == 0
    await closed.aclose()  # type: ignore[attr-defined]
    with pytest.raises(StopAsyncIteration):
        await anext(closed)

    async def broken() -> AsyncIterator[int]:
        yield 0
        raise anyio.BrokenResourceError("a client's stream broke")  # not "the consumer left"

    failing = aiter(aioloader.interleave([broken]))
    assert await anext(failing) == 0
    with pytest.raises(anyio.BrokenResourceError, match="client's stream"):
        await anext(failing)
    with pytest.raises(StopAsyncIteration):
        await anext(failing)


async def test_closing_ends_a_next_waiting_in_another_task() -> None:
    it = aiter(aioloader.interleave([numbers(3, pause=30)]))
    assert await anext(it) == 0
    async with anyio.create_task_group() as tg:
        got: list[object] = []

        async def wait() -> None:
            try:
                got.append(await anext(it))
            except StopAsyncIteration:
                got.append("stopped")

        tg.start_soon(wait)
        await anyio.sleep(0.05)
        with anyio.fail_after(5):
            await it.aclose()  # type: ignore[attr-defined]
    assert got == ["stopped"]


async def test_cancelled_nexts_lose_no_item() -> None:
    """Time-outs racing the items as they arrive: every item still comes, once, in order."""
    it = aiter(aioloader.interleave([numbers(200, pause=0.0005)]))
    got: list[int] = []
    with anyio.fail_after(20):
        while True:
            try:
                got.append(await asyncio.wait_for(anext(it), 0.0003))
            except TimeoutError:
                continue
            except StopAsyncIteration:
                break
    assert got == list(range(200))


async def test_the_loader_uses_a_subclass_own_aiter(tmp_path: Path) -> None:
    class Numbers(aioloader.Interleaved[int]):
        async def __aiter__(self) -> AsyncIterator[int]:  # type: ignore[override]
            async for x in super().__aiter__():
                yield 10 * x

    ds = Numbers([numbers(3)], in_flight=1, buffer=4, shuffle=False, seed=0, rank=0, world_size=1)
    loader: aioloader.DataLoader[list[int]] = aioloader.DataLoader(
        ds, batch_size=3, collate_fn=list
    )
    async with loader:
        assert [b async for b in loader] == [[0, 10, 20]]


def test_interleave_refuses_a_one_shot_iterator_as_a_part() -> None:
    with pytest.raises(TypeError, match=r"parts\[0\] is a one-shot async iterator"):
        aioloader.interleave([numbers(3)()])
