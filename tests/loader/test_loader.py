"""The loader's data path end to end: every sample exactly once, order, batching, datasets."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import torch

import aioloader
from tests.support.helpers import Batched, Counting, Stream, TorchMap, TorchStream, flat


async def epoch(loader: aioloader.DataLoader[Any]) -> list[Any]:
    return [b async for b in loader]


@pytest.mark.parametrize("max_inflight", [1, 3, 64])
@pytest.mark.parametrize("batch_size", [1, 5, 32])
async def test_sequential_epoch_is_in_order(max_inflight: int, batch_size: int) -> None:
    ds = Counting(103, jitter=0.002)
    async with aioloader.DataLoader(ds, batch_size=batch_size, max_inflight=max_inflight) as dl:
        batches = await epoch(dl)
    assert flat(batches) == list(range(103))
    assert [len(b) for b in batches[:-1]] == [batch_size] * (len(batches) - 1)
    assert len(batches) == len(dl)
    assert ds.max_running <= max_inflight


async def test_drop_last_and_unbatched() -> None:
    async with aioloader.DataLoader(Counting(10), batch_size=4, drop_last=True) as dl:
        assert flat(await epoch(dl)) == list(range(8))
    async with aioloader.DataLoader(Counting(4), batch_size=None) as dl:
        items = await epoch(dl)
    assert items == [0, 1, 2, 3]  # default_convert leaves ints alone, like torch


@pytest.mark.parametrize("in_order", [True, False])
async def test_shuffle_is_seeded_whatever_the_concurrency(in_order: bool) -> None:
    orders = []
    for max_inflight, jitter in ((1, 0.0), (64, 0.003)):
        dl = aioloader.DataLoader(
            Counting(200, jitter=jitter, seed=max_inflight),
            batch_size=8,
            shuffle=True,
            seed=7,
            max_inflight=max_inflight,
            in_order=in_order,
        )
        async with dl:
            e0, e1 = await epoch(dl), await epoch(dl)
            dl.set_epoch(0)
            again = await epoch(dl)
        orders.append((e0, e1, again))
    for e0, e1, again in orders:
        assert sorted(flat(e0)) == list(range(200))
        assert sorted(flat(e1)) == list(range(200))
        assert flat(e0) != flat(e1), "a new epoch must give a new order"
        if in_order:
            assert flat(again) == flat(e0), "set_epoch(0) must replay epoch 0"
    if in_order:  # the same order whatever max_inflight and completion order
        assert flat(orders[0][0]) == flat(orders[1][0])
        assert flat(orders[0][1]) == flat(orders[1][1])
    else:  # batch contents are fixed by the sampler; only their order may change
        key = lambda bs: sorted(tuple(b.tolist()) for b in bs)  # noqa: E731
        assert key(orders[0][0]) == key(orders[1][0])


async def test_out_of_order_yields_a_finished_batch_first() -> None:
    from tests.support.helpers import Gated

    ds = Gated(4)
    async with aioloader.DataLoader(ds, batch_size=2, in_order=False, max_inflight=4) as dl:
        it = aiter(dl)
        for i in (2, 3):  # batch 1 completes while batch 0 is still held at its gate
            ds.gates[i].set()
        first = await anext(it)
        ds.open_all()
        second = await anext(it)
        with pytest.raises(StopAsyncIteration):
            await anext(it)
    assert first.tolist() == [2, 3]
    assert second.tolist() == [0, 1]


async def test_batched_getter_is_used_once_per_batch() -> None:
    ds = Batched(50)
    async with aioloader.DataLoader(ds, batch_size=10) as dl:
        assert flat(await epoch(dl)) == list(range(50))
    assert ds.many_calls == 5


async def async_gen() -> AsyncIterator[int]:
    for i in range(23):
        yield i


@pytest.mark.parametrize(
    "make",
    [
        lambda: Stream(23),
        lambda: async_gen,
        lambda: TorchStream(23),
        lambda: TorchMap(23),
        lambda: list(range(23)),
        lambda: range(23),
    ],
    ids=[
        "AsyncIterableDataset",
        "asyncgen-function",
        "torch-iterable",
        "torch-map",
        "list",
        "range",
    ],
)
async def test_every_kind_of_dataset_gives_every_sample_once(make: Any) -> None:
    async with aioloader.DataLoader(make(), batch_size=4) as dl:
        for _ in range(2):
            assert flat(await epoch(dl)) == list(range(23))


async def test_one_shot_async_iterator_says_so_on_second_epoch() -> None:
    async with aioloader.DataLoader(async_gen(), batch_size=5) as dl:
        assert flat(await epoch(dl)) == list(range(23))
        with pytest.raises(aioloader.LoaderStateError, match="one-shot"):
            await epoch(dl)


async def test_stream_is_closed_when_epoch_is_abandoned() -> None:
    ds = Stream(1000)
    async with aioloader.DataLoader(ds, batch_size=4, prefetch=1) as dl:
        async for _ in dl:
            break
        assert flat(await epoch(dl)) == list(range(1000))
    assert ds.opened == 2
    assert ds.closed == 2


async def test_slow_transform_and_collate_run_off_the_event_loop() -> None:
    loop_thread = threading.get_ident()
    seen: set[int] = set()

    def double(x: int) -> int:
        seen.add(threading.get_ident())
        time.sleep(0.001)  # slower than a thread hop: worth moving off the loop
        return 2 * x

    def collate(samples: list[int]) -> tuple[str, list[int]]:
        seen.add(threading.get_ident())
        return ("batch", samples)

    dl = aioloader.DataLoader(Counting(9), batch_size=3, transform=double, collate_fn=collate)
    async with dl:
        batches = await epoch(dl)
    assert batches == [("batch", [0, 2, 4]), ("batch", [6, 8, 10]), ("batch", [12, 14, 16])]
    assert seen and loop_thread not in seen


async def test_fast_transform_and_collate_run_inline_once_known_fast() -> None:
    """A call that costs less than a thread hop runs on the loop's thread (with num_workers=0,
    as torch runs them in the calling thread); the first, not yet timed, runs on a thread."""
    loop_thread = threading.get_ident()
    where: list[int] = []

    def collate(samples: list[int]) -> list[int]:
        where.append(threading.get_ident())
        return samples

    dl = aioloader.DataLoader(Counting(60), batch_size=3, collate_fn=collate)
    async with dl:
        batches = await epoch(dl)
    assert [x for b in batches for x in b] == list(range(60))
    assert where[0] != loop_thread and loop_thread in where


async def test_worker_threads_are_initialised_with_their_ids() -> None:
    ids: list[int] = []
    dl = aioloader.DataLoader(
        Counting(64, jitter=0.001),
        batch_size=2,
        num_workers=2,
        worker_init_fn=ids.append,
        worker_mode="thread",
    )
    async with dl:
        assert flat(await epoch(dl)) == list(range(64))
    assert sorted(ids) in ([0], [0, 1])  # threads start lazily


@pytest.mark.parametrize("world_size", [1, 2, 3])
async def test_distributed_ranks_partition_the_data(world_size: int) -> None:
    seen: list[int] = []
    counts = set()
    for rank in range(world_size):
        dl = aioloader.DataLoader(
            Counting(50),
            batch_size=4,
            shuffle=True,
            seed=3,
            distributed=True,
            rank=rank,
            world_size=world_size,
        )
        async with dl:
            mine = flat(await epoch(dl))
        counts.add(len(mine))
        seen += mine
    assert len(counts) == 1, "every rank must yield the same number of samples"
    assert set(seen) == set(range(50))
    assert len(seen) == world_size * -(-50 // world_size)  # padded, like torch


async def test_distributed_stream_is_sharded_round_robin() -> None:
    shards = []
    for rank in range(3):
        dl = aioloader.DataLoader(
            Stream(30), batch_size=4, distributed=True, rank=rank, world_size=3
        )
        async with dl:
            shards.append(flat(await epoch(dl)))
    assert shards == [list(range(r, 30, 3)) for r in range(3)]


def test_plain_for_loop_runs_on_a_background_loop() -> None:
    dl = aioloader.DataLoader(Counting(20), batch_size=6)
    assert flat(dl) == list(range(20))
    assert flat(dl) == list(range(20))  # a second epoch, a fresh scope


def test_plain_for_break_stops_everything_and_next_epoch_is_whole() -> None:
    ds = Counting(1000)
    dl = aioloader.DataLoader(ds, batch_size=4, prefetch=1, max_inflight=4)
    for _ in dl:
        break
    calls_after_break = ds.calls
    assert calls_after_break < 1000  # it stopped, it did not run the epoch to the end
    assert flat(dl) == list(range(1000))


def test_with_scope_keeps_workers_across_epochs() -> None:
    ids: list[int] = []
    with aioloader.DataLoader(
        Counting(12), batch_size=4, num_workers=1, worker_init_fn=ids.append, worker_mode="thread"
    ) as dl:
        for _ in range(3):
            assert flat(dl) == list(range(12))
    assert ids == [0]  # one worker, started once for three epochs


async def test_plain_for_inside_async_scope_is_refused() -> None:
    async with aioloader.DataLoader(Counting(4)) as dl:
        with pytest.raises(aioloader.LoaderStateError, match="async for"):
            iter(dl)


async def test_async_for_needs_the_scope() -> None:
    dl = aioloader.DataLoader(Counting(4))
    with pytest.raises(aioloader.LoaderStateError, match="async with"):
        aiter(dl)


async def test_scope_cannot_be_entered_twice() -> None:
    dl = aioloader.DataLoader(Counting(4))
    async with dl:
        with pytest.raises(aioloader.LoaderStateError, match="already open"):
            await dl.__aenter__()


async def test_dict_samples_are_collated_like_torch() -> None:
    class Records(aioloader.AsyncDataset[dict[str, Any]]):
        def __len__(self) -> int:
            return 6

        async def get(self, index: int) -> dict[str, Any]:
            return {"x": torch.full((2,), index), "label": index, "name": f"s{index}"}

    async with aioloader.DataLoader(Records(), batch_size=3) as dl:
        first = (await epoch(dl))[0]
    assert torch.equal(first["x"], torch.tensor([[0, 0], [1, 1], [2, 2]]))
    assert torch.equal(first["label"], torch.tensor([0, 1, 2]))
    assert first["name"] == ["s0", "s1", "s2"]


async def test_statistics_snapshot_is_frozen_and_readable() -> None:
    async with aioloader.DataLoader(Counting(40), batch_size=8) as dl:
        await epoch(dl)
        stats = dl.statistics()
    assert stats.consumer.batches == 5
    assert stats.consumer.samples == 40
    assert stats.stage("fetch").completed == 40
    assert stats.stage("output").completed == 5
    assert stats.epochs == 1
    with pytest.raises(AttributeError):
        stats.epochs = 3  # type: ignore[misc]
    text = repr(stats)
    assert "40 samples" in text and "fetch" in text and "transform" in text
    with pytest.raises(KeyError, match="nope"):
        stats.stage("nope")


async def test_reads_that_wait_overlap_up_to_max_inflight_and_fast_ones_run_in_turn() -> None:
    """An AsyncDataset's reads that wait run side by side, max_inflight at once and never
    more; reads that return at once are read a batch per task (Pace), still within the bound."""

    class Tracked(aioloader.AsyncDataset[int]):
        def __init__(self, n: int, wait: float) -> None:
            self.n, self.wait, self.now, self.most = n, wait, 0, 0

        def __len__(self) -> int:
            return self.n

        async def get(self, index: int) -> int:
            self.now += 1
            self.most = max(self.most, self.now)
            if self.wait:
                await anyio.sleep(self.wait)
            self.now -= 1
            return index

    slow = Tracked(96, 0.02)
    async with aioloader.DataLoader(slow, batch_size=8, max_inflight=16) as dl:
        assert [x for b in await epoch(dl) for x in b.tolist()] == list(range(96))
    assert slow.most == 16
    fast = Tracked(960, 0.0)
    async with aioloader.DataLoader(fast, batch_size=8, max_inflight=16) as dl:
        assert [x for b in await epoch(dl) for x in b.tolist()] == list(range(960))
    assert fast.most == 1  # none waits: each read is over before the next starts
