"""Epochs made on demand (``_pipeline/demand.py``): a fast torch ``Dataset`` with
``num_workers=0`` is read, transformed and collated in the consumer's own call, as torch's
``num_workers=0`` loop does, and a slow one is handed to the stages, with every batch once, in
order, and the failure rules, marks and statistics of the stages."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

import aioloader
from aioloader._base.inline import SLOW_IN_A_ROW
from tests.conftest import aioloader_threads
from tests.support.helpers import flat


class Recorded(torch.utils.data.Dataset[int]):
    """Rows ``0..n-1``; records the thread of each read; the ``slow_from``-th read and those
    after it sleep."""

    def __init__(
        self, n: int, *, slow_from: int | None = None, fail: set[int] | None = None
    ) -> None:
        self.n = n
        self.slow_from = slow_from
        self.fail = fail or set()
        self.threads: list[int] = []
        self.reads: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        self.threads.append(threading.get_ident())
        self.reads.append(index)
        if index in self.fail:
            raise KeyError(f"bad row {index}")
        if self.slow_from is not None and len(self.reads) > self.slow_from:
            time.sleep(0.0015 / 4)  # a batch of 4 takes 1.5 ms: over the inline limit
        return index


def test_a_fast_dataset_is_read_in_the_callers_thread_as_torchs_is() -> None:
    ds = Recorded(40)
    with aioloader.DataLoader(ds, batch_size=4, shuffle=True, seed=3) as dl:
        ours = [b.tolist() for b in dl]
    assert sorted(flat(torch.tensor(ours))) == list(range(40))
    assert set(ds.threads) == {threading.get_ident()}  # no hop to the loop's or a thread
    stats = dl.statistics()
    assert stats.stage("fetch").completed == 40
    assert stats.stage("transform").completed == 10
    assert stats.stage("output").completed == 10
    assert stats.consumer.batches == 10 and stats.consumer.samples == 40
    assert stats.max_bytes_held == 4 * 8  # one collated batch of int64 at a time


async def test_async_for_makes_batches_on_the_loop_and_lets_other_tasks_run() -> None:
    ds = Recorded(4000)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.lowlevel.checkpoint()

    async with aioloader.DataLoader(ds, batch_size=4) as dl, anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        got = [b async for b in dl]
        tg.cancel_scope.cancel()
    assert flat(got) == list(range(4000))
    assert set(ds.threads) == {threading.get_ident()}
    # The loop went round between batches, once a millisecond at most (1,000 batches of 4
    # take several milliseconds); not once a batch.
    assert 3 <= ticks < 900, ticks


@pytest.mark.parametrize("plain_for", [True, False])
async def test_a_slow_dataset_is_handed_to_the_stages_by_async_for(plain_for: bool) -> None:
    ds = Recorded(80, slow_from=20)
    if plain_for:
        with aioloader.DataLoader(ds, batch_size=4) as dl:
            got = list(dl)
    else:
        async with aioloader.DataLoader(ds, batch_size=4) as dl:
            got = [b async for b in dl]
    assert flat(got) == list(range(80))
    assert sorted(ds.reads) == list(range(80))  # each row read once
    here = threading.get_ident()
    made_here = sum(1 for t in ds.threads if t == here)
    if plain_for:  # on its own thread, as torch's num_workers=0 loop, however slow
        assert made_here == 80
    else:
        # 5 fast batches and SLOW_IN_A_ROW slow ones were made in the caller's call; the rest
        # on the stages' thread (the reads are slow: never inline there), off the loop.
        # (A fast batch timed slow on a loaded machine may end it sooner, never later.)
        assert 4 * SLOW_IN_A_ROW <= made_here <= 4 * (5 + SLOW_IN_A_ROW)
        assert here not in ds.threads[made_here:]  # made here first, then on the stages
    assert dl.statistics().stage("fetch").completed == 80


async def test_the_next_epoch_of_a_slow_dataset_starts_on_the_stages() -> None:
    ds = Recorded(40, slow_from=0)
    async with aioloader.DataLoader(ds, batch_size=4) as dl:
        assert flat([b async for b in dl]) == list(range(40))
        ds.threads.clear()
        assert flat([b async for b in dl]) == list(range(40))
    assert threading.get_ident() not in ds.threads


def test_a_failed_read_fails_its_batch_and_the_epoch_goes_on_as_torchs() -> None:
    ds = Recorded(20, fail={9})
    with aioloader.DataLoader(ds, batch_size=4) as dl:
        it = iter(dl)
        got = [next(it), next(it)]
        with pytest.raises(KeyError, match="bad row 9") as info:
            next(it)
        got += list(it)
    assert flat(got) == [i for i in range(20) if not 8 <= i < 12]
    notes = "\n".join(info.value.__notes__)
    assert "stage 'fetch'" in notes and "sample 9" in notes and "batch 2" in notes
    assert dl.statistics().stage("fetch").failed == 4


async def test_a_failed_read_under_max_failures_skips_only_the_bad_sample() -> None:
    ds = Recorded(20, fail={9})
    async with aioloader.DataLoader(ds, batch_size=4, max_failures=1) as dl:
        got = [b async for b in dl]
    assert flat(got) == [i for i in range(20) if i != 9]
    stats = dl.statistics()
    assert stats.stage("fetch").skipped == 1 and stats.skipped_samples == (9,)


def test_transform_failures_spend_the_budget_and_an_empty_batch_is_taken() -> None:
    def transform(x: int) -> int:
        if 4 <= x < 8:
            raise ValueError(f"no {x}")
        return x

    ds = Recorded(12)
    with aioloader.DataLoader(ds, batch_size=4, transform=transform, max_failures=4) as dl:
        it = iter(dl)
        first = next(it)
        second = next(it)  # batch 1 had nothing left: its place goes with batch 2
        state = dl.state_dict()
        assert list(it) == []
    assert flat([first, second]) == [0, 1, 2, 3, 8, 9, 10, 11]
    assert dl.statistics().stage("transform").skipped == 4
    resumed = aioloader.DataLoader(Recorded(12), batch_size=4, transform=transform, max_failures=4)
    resumed.load_state_dict(state)
    with resumed:
        assert list(resumed) == []  # batches 0, 1 and 2 were all taken


def test_a_transform_failure_past_the_budget_names_the_sample() -> None:
    def transform(x: int) -> int:
        if x == 6:
            raise ValueError("cannot decode")
        return x

    with aioloader.DataLoader(Recorded(12), batch_size=4, transform=transform) as dl:
        it = iter(dl)
        next(it)
        with pytest.raises(ValueError, match="cannot decode") as info:
            next(it)
        assert flat(list(it)) == [8, 9, 10, 11]
    notes = "\n".join(info.value.__notes__)
    assert "stage 'transform'" in notes and "sample 6" in notes


def test_a_collate_failure_names_the_batch() -> None:
    def collate(samples: list[int]) -> Any:
        if 8 in samples:
            raise RuntimeError("ragged")
        return samples

    with aioloader.DataLoader(Recorded(12), batch_size=4, collate_fn=collate) as dl:
        it = iter(dl)
        assert next(it) == [0, 1, 2, 3]
        assert next(it) == [4, 5, 6, 7]
        with pytest.raises(RuntimeError, match="ragged") as info:
            next(it)
    notes = "\n".join(info.value.__notes__)
    assert "stage 'collate'" in notes and "batch 2" in notes


async def test_a_resumed_epoch_goes_on_made_on_demand_and_then_on_the_stages() -> None:
    with aioloader.DataLoader(Recorded(80), batch_size=4, shuffle=True, seed=7) as dl:
        whole = [b.tolist() for b in dl]
    with aioloader.DataLoader(Recorded(80), batch_size=4, shuffle=True, seed=7) as dl:
        it = iter(dl)
        before = [next(it).tolist() for _ in range(3)]
        state = dl.state_dict()
    again = Recorded(80, slow_from=24)
    resumed = aioloader.DataLoader(again, batch_size=4, shuffle=True, seed=7)
    resumed.load_state_dict(state)
    async with resumed:
        after = [b.tolist() async for b in resumed]
    assert before + after == whole
    here = threading.get_ident()
    # 6 fast batches, then SLOW_IN_A_ROW slow ones made in the calls (a fast one timed slow on
    # a loaded machine may end it sooner, never later), the rest on the stages.
    made_here = again.threads.count(here)
    assert 4 * SLOW_IN_A_ROW <= made_here <= 4 * (6 + SLOW_IN_A_ROW)
    assert again.threads[:made_here] == [here] * made_here


def test_a_break_and_a_new_epoch_leave_nothing_running() -> None:
    ds = Recorded(400)
    with aioloader.DataLoader(ds, batch_size=4) as dl:
        for i, _ in enumerate(dl):
            if i == 3:
                break
        ds.reads.clear()
        assert flat(list(dl)) == list(range(400))
        assert ds.reads == list(range(400))  # the new epoch read each row once, in order


def test_epochs_that_are_not_made_on_demand() -> None:
    """Batches asked for ahead (``prefetch``), a ``timeout``, retries, an ``io_threads`` pool
    or worker threads: the stages make every batch, off the caller's thread."""
    here = threading.get_ident()
    for kwargs in (
        {"prefetch": 2},
        {"timeout": 5.0},
        {"retry": aioloader.RetryPolicy(attempts=2)},
        {"io_threads": 1},
        {"num_workers": 1, "worker_mode": "thread", "worker_init_fn": lambda _: None},
    ):
        ds = Recorded(16)
        with aioloader.DataLoader(ds, batch_size=4, **kwargs) as dl:
            assert flat(list(dl)) == list(range(16)), kwargs
        assert here not in ds.threads, kwargs


class AsyncRecorded(aioloader.AsyncDataset[int]):
    """Rows ``0..n-1`` read by ``await get``; records the task of each read. While ``wait`` is
    set a read waits for it (sleeps when ``sleep``)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tasks: list[object] = []
        self.sleep = 0.0
        self.gate: anyio.Event | None = None

    def __len__(self) -> int:
        return self.n

    async def get(self, index: int) -> int:
        self.tasks.append(asyncio.current_task())
        if self.gate is not None:
            await self.gate.wait()
        if self.sleep:
            await anyio.sleep(self.sleep)
        return index


async def consumer_reads(loader: aioloader.DataLoader[Any], ds: AsyncRecorded) -> list[Any]:
    """An epoch of ``loader``: its batches, and how many of ``ds``'s reads ran in this task."""
    ds.tasks.clear()
    got = [b async for b in loader]
    here = asyncio.current_task()
    return [flat(got), sum(1 for t in ds.tasks if t is here)]


async def made_in_the_calls(loader: aioloader.DataLoader[Any], ds: AsyncRecorded) -> None:
    """Epochs of ``loader`` until one is made in the consumer's calls (a loaded machine may
    time a first batch read a task per sample slow), each whole."""
    for _ in range(10):
        got, here = await consumer_reads(loader, ds)
        assert got == list(range(ds.n))
        if here == ds.n:
            return
    raise AssertionError("no epoch was made in the consumer's calls")


async def test_an_async_dataset_that_never_waits_is_awaited_in_the_consumers_call() -> None:
    ds = AsyncRecorded(64)
    async with aioloader.DataLoader(ds, batch_size=4) as dl:
        # The first epoch times the reads on the stages; the next is made in the calls.
        assert await consumer_reads(dl, ds) == [list(range(64)), 0]
        await made_in_the_calls(dl, ds)
        ds.sleep = 0.001  # the reads wait now: the stages take over, nothing lost
        got, here = await consumer_reads(dl, ds)
        # At most SLOW_IN_A_ROW batches are read here first (none, where a loaded machine timed
        # the last fast epoch slow and gave this one to the stages from its start)
        assert got == list(range(64)) and here in range(0, 4 * SLOW_IN_A_ROW + 1, 4), here
        assert await consumer_reads(dl, ds) == [list(range(64)), 0]  # and keep it


async def test_a_call_cancelled_while_its_batch_is_read_leaves_the_batch_to_the_next() -> None:
    ds = AsyncRecorded(32)
    async with aioloader.DataLoader(ds, batch_size=4) as dl:
        await made_in_the_calls(dl, ds)
        for _ in range(10):  # an epoch whose first batch is made in this call (a loaded
            ds.tasks.clear()  # machine may time a read slow and hand an epoch to the stages)
            it = aiter(dl)
            first = await anext(it)
            if ds.tasks == [asyncio.current_task()] * 4:
                break  # nothing runs ahead of this task: batch 1 is read in the next call
            assert flat([first, *[b async for b in it]]) == list(range(32))
        else:
            raise AssertionError("no epoch's first batch was made in the consumer's call")
        ds.gate = anyio.Event()
        with anyio.move_on_after(0.05) as scope:
            await anext(it)  # waits at the gate: cancelled there
        assert scope.cancelled_caught
        ds.gate.set()
        rest = [b async for b in it]
    assert flat([first, *rest]) == list(range(32))  # batch 1 came with the next call


class AsyncBatched(AsyncRecorded):
    """As :class:`AsyncRecorded`, read a batch per ``get_many`` call."""

    async def get_many(self, indices: Sequence[int]) -> list[int]:
        return [await self.get(i) for i in indices]


async def test_a_get_many_that_returns_at_once_is_awaited_in_the_consumers_call() -> None:
    for _ in range(5):  # a loaded machine may time a first epoch's slice slow (CI, once): anew
        ds = AsyncBatched(64)
        async with aioloader.DataLoader(ds, batch_size=8) as dl:
            await made_in_the_calls(dl, ds)  # from the first epoch: its slices are not timed yet
            ds.sleep = 0.0005  # 4 ms a batch: the stages take over after three, and keep it
            got, here = await consumer_reads(dl, ds)
            assert got == list(range(64))
            if here == 0:  # that epoch's slices were timed slow: it went to the stages at once
                continue
            assert here == 8 * SLOW_IN_A_ROW
            assert await consumer_reads(dl, ds) == [list(range(64)), 0]
            return
    raise AssertionError("no epoch's batches were made in the consumer's calls")


async def test_sources_files_warm_is_read_in_the_consumers_call(tmp_path: Any) -> None:
    """Cached files (their slices read inline) are read in ``__anext__``, not by the stages."""
    for i in range(64):
        (tmp_path / f"{i:02d}.bin").write_bytes(bytes([i]) * 100)
    tasks: list[object] = []

    class Spy(aioloader.sources.FileDataset):
        def _read_many(self, items: Sequence[tuple[str, str]]) -> list[bytes]:
            try:
                tasks.append(asyncio.current_task())
            except RuntimeError:  # on one of its threads
                tasks.append(None)
            return super()._read_many(items)

    async with aioloader.DataLoader(Spy(tmp_path), batch_size=8, collate_fn=list) as dl:
        for _ in range(10):  # the first epoch times the slices; a loaded machine may need more
            tasks.clear()
            got = [b async for b in dl]
            assert [x[0] for b in got for x in b] == list(range(64))
            if tasks == [asyncio.current_task()] * 8:  # every slice read in this task's calls
                return
    raise AssertionError("no epoch of cached files was made in the consumer's calls")


@pytest.mark.parametrize("stage", ["fetch", "transform"])
def test_a_failed_batch_made_on_demand_frees_its_iterator_at_once(stage: str) -> None:
    """Found by review: the error's traceback keeps the frames that made the batch, and they
    held the error: a cycle that kept a dropped iterator (and its loop thread) until the
    garbage collector ran. With it off, dropping the iterator stops the thread."""

    def transform(x: int) -> int:
        if x == 5 and stage == "transform":
            raise ValueError("no 5")
        return x

    def consume() -> str:
        """Take two batches, catch the third's error, return: the iterator is dropped with
        this frame, unless something still refers to the frame."""
        ds = Recorded(8, fail={5} if stage == "fetch" else set())
        it = iter(aioloader.DataLoader(ds, batch_size=2, transform=transform))
        next(it), next(it)
        try:
            next(it)
        except (KeyError, ValueError) as exc:
            return str(exc)
        return "no error"

    gc.disable()
    try:
        assert "5" in consume()
        deadline = time.monotonic() + 10
        while aioloader_threads():
            assert time.monotonic() < deadline, "the loop thread outlived its iterator"
            time.sleep(0.01)
    finally:
        gc.enable()


def test_the_verdict_of_an_epoch_made_on_demand_names_prefetch() -> None:
    ds = Recorded(40, slow_from=0)
    with aioloader.DataLoader(ds, batch_size=4) as dl:
        assert flat(list(dl)) == list(range(40))
    stats = dl.statistics()
    assert stats.made_on_demand == 10
    assert "made in its own calls" in stats.verdict and "prefetch=N" in stats.verdict
