"""Stream-per-slot batching: position ``i`` of every batch continues stream ``i``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import aioloader
from aioloader.sources import SlotSample, SlotStreams, slot_streams, tar_shards
from tests.sources.test_tar import make_shard, payload

# A part is (name, length): reading it yields (name, 0), (name, 1), ... (name, length - 1).
Part = tuple[str, int]


async def read(part: Part) -> AsyncIterator[tuple[str, int]]:
    name, length = part
    for j in range(length):
        await anyio.lowlevel.checkpoint()
        yield name, j


def parts(*lengths: int) -> list[Part]:
    return [(f"p{i}", n) for i, n in enumerate(lengths)]


async def rounds(ds: SlotStreams[tuple[str, int]]) -> list[list[SlotSample[tuple[str, int]]]]:
    flat = [s async for s in ds]
    assert len(flat) % ds.slots == 0
    return [flat[i : i + ds.slots] for i in range(0, len(flat), ds.slots)]


async def test_each_position_continues_its_own_stream() -> None:
    ds = slot_streams(parts(3, 2, 4, 1, 2, 5), read, slots=3, shuffle=False)
    assert ds.shares(0) == [[("p0", 3), ("p3", 1)], [("p1", 2), ("p4", 2)], [("p2", 4), ("p5", 5)]]
    got = await rounds(ds)
    for r in got:
        assert [s.slot for s in r] == [0, 1, 2]
        assert all(s.valid for s in r)
    streams = [[s.sample for s in (r[i] for r in got)] for i in range(3)]
    # Slot 0 holds 4 samples in all, the fewest: the epoch is four rounds long.
    assert len(got) == 4
    assert streams[0] == [("p0", 0), ("p0", 1), ("p0", 2), ("p3", 0)]
    assert streams[1] == [("p1", 0), ("p1", 1), ("p4", 0), ("p4", 1)]
    assert streams[2] == [("p2", 0), ("p2", 1), ("p2", 2), ("p2", 3)]
    firsts = [[r[i].first for r in got] for i in range(3)]
    assert firsts == [[True, False, False, True], [True, False, True, False], [True] + [False] * 3]


async def test_pad_policy_runs_until_every_stream_is_dry() -> None:
    ds = slot_streams(parts(1, 3), read, slots=2, shuffle=False, policy="pad", fill=("pad", -1))
    got = await rounds(ds)
    assert [[(s.valid, s.sample) for s in r] for r in got] == [
        [(True, ("p0", 0)), (True, ("p1", 0))],
        [(False, ("pad", -1)), (True, ("p1", 1))],
        [(False, ("pad", -1)), (True, ("p1", 2))],
    ]


@given(
    lengths=st.lists(st.integers(0, 6), min_size=1, max_size=9),
    slots=st.integers(1, 4),
    seed=st.integers(0, 3),
)
def test_no_two_positions_share_data_and_shortest_is_full(
    lengths: list[int], slots: int, seed: int
) -> None:
    if len(lengths) < slots:
        return
    ds = slot_streams(parts(*lengths), read, slots=slots, seed=seed)

    async def run() -> list[list[SlotSample[tuple[str, int]]]]:
        return await rounds(ds)

    got = anyio.run(run)
    shares = ds.shares(0)
    shortest = min(sum(n for _, n in share) for share in shares)
    assert len(got) == shortest
    names_per_slot = [{s.sample[0] for s in (r[i] for r in got)} for i in range(slots)]
    for i in range(slots):
        for j in range(i + 1, slots):
            assert not names_per_slot[i] & names_per_slot[j]
    for i, share in enumerate(shares):
        expected = [(name, j) for name, n in share for j in range(n)][: len(got)]
        assert [r[i].sample for r in got] == expected


async def test_epochs_reshuffle_and_split_by_rank() -> None:
    all_parts = parts(*([2] * 8))
    ds0 = slot_streams(all_parts, read, slots=2, seed=5, rank=0, world_size=2)
    ds1 = slot_streams(all_parts, read, slots=2, seed=5, rank=1, world_size=2)
    mine = [p for share in ds0.shares(0) for p in share]
    theirs = [p for share in ds1.shares(0) for p in share]
    assert len(mine) == len(theirs) == 4 and not set(mine) & set(theirs)
    assert ds0.shares(0) != ds0.shares(1)
    first = [s.sample async for s in ds0]
    second = [s.sample async for s in ds0]
    assert first != second  # the next __aiter__ is the next epoch


async def test_too_few_parts_for_the_slots_is_an_error() -> None:
    ds = slot_streams(parts(2, 2), read, slots=3)
    with pytest.raises(ValueError, match="2 parts for this rank but there are 3 slots"):
        _ = [s async for s in ds]


async def test_a_failing_stream_is_named_and_the_others_closed() -> None:
    closed: list[str] = []

    async def fragile(part: Part) -> AsyncIterator[tuple[str, int]]:
        try:
            async for item in read(part):
                if part[0] == "p1" and item[1] == 1:
                    raise OSError("disk gone")
                yield item
        finally:
            closed.append(part[0])

    ds = slot_streams(parts(5, 5, 5), fragile, slots=3, shuffle=False)
    with pytest.raises(OSError, match="disk gone") as info:
        _ = [s async for s in ds]
    assert "aioloader: slot stream 1 of 3" in info.value.__notes__
    assert sorted(closed) == ["p0", "p1", "p2"]


async def test_batches_from_the_loader_keep_positions(tmp_path: Path) -> None:
    ds = slot_streams(parts(4, 5, 6, 4), read, slots=2, shuffle=False)

    def encode(s: SlotSample[tuple[str, int]]) -> SlotSample[torch.Tensor]:
        name, j = s.sample
        return s._replace(sample=torch.tensor([int(name[1:]), j]))

    loader = aioloader.DataLoader(
        ds, batch_size=2, transform=encode, num_workers=2, worker_mode="thread"
    )
    async with loader:
        batches = [b async for b in loader]
    assert len(batches) == 9  # slot 0 holds p0 + p2 = 10 samples, slot 1 p1 + p3 = 9
    for b in batches:
        assert isinstance(b, SlotSample)
        assert b.slot.tolist() == [0, 1]
    slot0 = [tuple(b.sample[0].tolist()) for b in batches]
    assert slot0 == [(0, j) for j in range(4)] + [(2, j) for j in range(5)]
    slot1 = [tuple(b.sample[1].tolist()) for b in batches]
    assert slot1 == [(1, j) for j in range(5)] + [(3, j) for j in range(4)]


async def test_tar_shards_per_slot(tmp_path: Path) -> None:
    paths = [
        make_shard(
            tmp_path / f"s{s}.tar", [(f"s{s}/{j:04d}.bin", payload(s, j, "bin")) for j in range(3)]
        )
        for s in range(4)
    ]
    ds = tar_shards(paths, shuffle_shards=True, seed=1).per_slot(2)
    loader = aioloader.DataLoader(ds, batch_size=2, collate_fn=list)
    async with loader:
        batches = [b async for b in loader]
    assert len(batches) == 6  # two shards of three samples per slot
    by_slot = [[b[i].sample["__shard__"] for b in batches] for i in range(2)]
    assert not set(by_slot[0]) & set(by_slot[1])
    keys = [b[i].sample["__key__"] for b in batches for i in range(2)]
    assert sorted(keys) == sorted(f"s{s}/{j:04d}" for s in range(4) for j in range(3))


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="slots"):
        slot_streams(parts(1), read, slots=0)
    with pytest.raises(TypeError, match="slots"):
        slot_streams(parts(1), read, slots=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="policy"):
        slot_streams(parts(1), read, slots=1, policy="longest")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="read"):
        slot_streams(parts(1), "read", slots=1)  # type: ignore[arg-type]


def test_the_loader_refuses_settings_that_break_positions() -> None:
    ds = slot_streams(parts(1, 1), read, slots=2)
    with pytest.raises(ValueError, match=r"batch_size must equal the dataset's slots \(2\)"):
        aioloader.DataLoader(ds, batch_size=3)
    with pytest.raises(ValueError, match="in_order=False"):
        aioloader.DataLoader(ds, batch_size=2, in_order=False)
    with pytest.raises(ValueError, match="distributed=True"):
        aioloader.DataLoader(ds, batch_size=2, distributed=True, rank=0, world_size=2)


async def test_streams_read_ahead_of_the_rounds_and_open_their_next_part_early() -> None:
    progress: dict[str, int] = {}

    async def counted(part: Part) -> AsyncIterator[tuple[str, int]]:
        async for item in read(part):
            progress[part[0]] = item[1] + 1
            yield item

    ds = SlotStreams(
        lambda epoch: parts(3, 3, 3, 3),
        _reader(counted),
        slots=2,
        buffer=2,
    )
    async with ds.open_epoch(0) as it:
        first = await anext(it)
        for _ in range(50):
            await anyio.lowlevel.checkpoint()
        assert first == SlotSample(0, True, True, ("p0", 0))
        # Stream 0 (p0, then p2) and stream 1 (p1, then p3) read while no round was taken:
        # each part to its buffer (2) plus the sample in hand, the next part opened already.
        assert progress["p0"] == 3 and progress["p1"] >= 2
        assert set(progress) == {"p0", "p1", "p2", "p3"}


def _reader(fn: Any) -> Any:
    @contextlib.asynccontextmanager
    async def open_reader() -> AsyncIterator[Any]:
        yield fn

    return open_reader
