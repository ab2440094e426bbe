"""Backpressure and lifetime: bounds are never exceeded, a slow consumer stops the fetching, and
leaving the scope in any way leaves no task, thread or file descriptor behind and loses nothing."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import anyio
import pytest
import torch

import aioloader
from tests.conftest import aioloader_threads
from tests.support.helpers import Counting, Gated, Stream, flat, open_fds, other_tasks


async def until(predicate: Any, seconds: float = 10.0) -> None:
    """Yield to the loop until ``predicate()`` holds (bounded); the pipeline's own progress,
    not wall-clock time, decides when it does."""
    with anyio.fail_after(seconds):
        while not predicate():
            await anyio.lowlevel.checkpoint()


class Watched(Counting):
    """Checks, at every fetch, that the loader has not run ahead of the consumer further than
    its bounds allow."""

    def __init__(self, n: int, allowed_ahead: int) -> None:
        super().__init__(n)
        self.consumed = 0
        self.allowed_ahead = allowed_ahead
        self.violations: list[tuple[int, int]] = []

    async def get(self, index: int) -> int:
        if self.calls - self.consumed > self.allowed_ahead:
            self.violations.append((self.calls, self.consumed))
        return await super().get(index)


@pytest.mark.parametrize(("max_inflight", "prefetch"), [(1, 0), (8, 2), (64, 4)])
async def test_slow_consumer_stops_fetching_and_bounds_hold(
    max_inflight: int, prefetch: int
) -> None:
    bs = 4
    dl = aioloader.DataLoader(
        Counting(1), batch_size=bs, max_inflight=max_inflight, prefetch=prefetch
    )
    async with dl:  # learn the window the loader chose for these settings
        await anext(aiter(dl))
        window = dl.statistics().stage("window").limit
    assert window is not None
    ahead = (
        window + prefetch + 1
    ) * bs  # batches in the window, ready, and in the consumer's hands
    ds = Watched(2000, ahead)
    dl = aioloader.DataLoader(ds, batch_size=bs, max_inflight=max_inflight, prefetch=prefetch)
    async with dl:
        it = aiter(dl)
        got = [await anext(it)]
        ds.consumed = bs
        stats = dl.statistics

        # The consumer now stops. The pipeline fills exactly to its bounds (a full window of
        # batches, a full output stream) and stalls there.
        await until(lambda: ds.calls == ahead and stats().stage("output").queued == prefetch)
        for _ in range(200):
            await anyio.lowlevel.checkpoint()
        assert ds.calls == ahead, "fetching went on while the consumer was stopped"
        assert stats().stage("window").in_flight == window

        async for batch in it:
            got.append(batch)
            ds.consumed += bs
            for _ in range(3):  # a slow consumer: the loader runs ahead, within bounds
                await anyio.lowlevel.checkpoint()
    assert flat(got) == list(range(2000))
    assert ds.violations == []
    s = dl.statistics()
    assert s.stage("fetch").max_in_flight <= max_inflight
    assert ds.max_running <= max_inflight
    assert s.stage("window").max_in_flight <= window
    assert s.stage("output").max_queued <= prefetch
    assert s.stage("window").blocked_put_s > 0  # the scheduler did wait for room
    assert s.stage("fetch").in_flight == 0 and s.stage("transform").in_flight == 0


async def test_in_flight_bytes_stay_bounded() -> None:
    class Blobs(Counting):
        async def get(self, index: int) -> Any:
            await super().get(index)
            return bytes(1000)

    def run(limit: int | None) -> aioloader.DataLoader[Any]:
        return aioloader.DataLoader(
            Blobs(480),
            batch_size=16,
            max_inflight=16,
            prefetch=1,
            max_inflight_bytes=limit,
            collate_fn=len,
        )

    peaks = []
    for limit in (None, 8_000):
        dl = run(limit)
        async with dl:
            total = 0
            async for n in dl:
                total += n
                for _ in range(20):  # a slow consumer, so the pipeline fills up
                    await anyio.lowlevel.checkpoint()
        assert total == 480
        peaks.append(dl.statistics().max_bytes_held)
    unbounded, bounded = peaks
    # The limit, plus what fetches already running when it was reached bring in.
    assert bounded <= 8_000 + 16 * 1000
    assert unbounded > bounded


async def test_break_then_leave_leaves_nothing_behind() -> None:
    fds = open_fds()
    ds = Counting(3000)
    async with aioloader.DataLoader(ds, batch_size=8, num_workers=2, worker_mode="thread") as dl:
        async for _ in dl:
            break
        assert ds.calls < 3000
    assert other_tasks() == set()
    assert aioloader_threads() == []
    assert open_fds() == fds
    async with dl:  # a new scope, a whole epoch
        assert flat([b async for b in dl]) == list(range(3000))


async def test_cancelling_the_consumer_cancels_the_pipeline() -> None:
    ds = Gated(64)
    dl = aioloader.DataLoader(ds, batch_size=4, max_inflight=16)
    async with anyio.create_task_group() as tg:

        async def consume() -> None:
            async with dl:
                async for _ in dl:
                    pass

        tg.start_soon(consume)
        ds.gates[0].set()
        await ds.entered[15].wait()  # the pipeline is running: 16 fetches started
        tg.cancel_scope.cancel()
    assert other_tasks() == set()
    assert aioloader_threads() == []
    assert dl.statistics().stage("fetch").in_flight == 0
    ds.open_all()
    async with dl:
        assert flat([b async for b in dl]) == list(range(64))


async def test_cancel_with_transforms_running_on_threads() -> None:
    entered = threading.Event()
    release = threading.Event()

    def slow(x: int) -> int:
        entered.set()
        release.wait(10)
        return x

    dl = aioloader.DataLoader(
        Counting(40), batch_size=4, num_workers=2, transform=slow, worker_mode="thread"
    )
    with anyio.CancelScope() as scope:
        async with dl:
            it = aiter(dl)
            async with anyio.create_task_group() as tg:
                tg.start_soon(anext, it)
                await anyio.to_thread.run_sync(entered.wait, 10)
                release.set()  # the running transform finishes during the scope's exit
                scope.cancel()
    assert scope.cancelled_caught
    assert aioloader_threads() == []
    assert other_tasks() == set()


async def test_cancelled_anext_loses_no_batch() -> None:
    ds = Gated(12)
    async with aioloader.DataLoader(ds, batch_size=4) as dl:
        it = aiter(dl)
        ds.open_all()
        first = await anext(it)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await anext(it)
        assert scope.cancelled_caught
        rest = [b async for b in it]
    assert flat([first, *rest]) == list(range(12))


async def test_stream_source_is_closed_on_cancellation() -> None:
    ds = Stream(10_000)
    with anyio.CancelScope() as scope:
        async with aioloader.DataLoader(ds, batch_size=4) as dl:
            async for _ in dl:
                scope.cancel()
    assert ds.opened == 1 and ds.closed == 1


def test_plain_for_exception_propagates_unwrapped_and_cleans_up() -> None:
    ds = Counting(100, fail={50})
    dl = aioloader.DataLoader(ds, batch_size=4)
    with pytest.raises(KeyError, match="bad sample 50"):
        for _ in dl:
            pass
    assert aioloader_threads() == []
    ds.fail.clear()
    with dl:
        assert flat(dl) == list(range(100))
        assert flat(dl) == list(range(100))


def test_a_plain_for_holds_no_more_ready_batches_than_prefetch() -> None:
    """The plain-for pump's read-ahead is taken out of ``prefetch``: while the consumer holds
    its first batch, what is read ahead is the window (batches in progress) plus ``prefetch``
    finished ones, no more."""

    class Counted(torch.utils.data.Dataset[int]):
        reads = 0

        def __len__(self) -> int:
            return 64

        def __getitem__(self, index: int) -> int:
            Counted.reads += 1
            return index

    dl = aioloader.DataLoader(Counted(), batch_size=1, max_inflight=1, prefetch=2)
    window = 2 * 1 + 1 + 1  # 2 x the batches max_inflight fetches, + 1 worker, + 1
    with dl:
        it = iter(dl)
        first = next(it)
        time.sleep(0.3)  # the pipeline fills everything it may
        assert Counted.reads <= 1 + window + 2
        assert [first.item(), *(b.item() for b in it)] == list(range(64))


@pytest.mark.parametrize(
    "ending",
    ["with-block", "close", "lightning"],
    ids=["scope-left", "loader.close", "_shutdown_workers"],
)
def test_next_on_an_iterator_whose_scope_ended_stops_as_torchs(ending: str) -> None:
    # It raised the loop thread's "Event loop is closed" (or "This portal is not running")
    # once, then StopIteration; torch's persistent iterator stops after _shutdown_workers().
    loader = aioloader.DataLoader(
        list(range(64)), batch_size=8, num_workers=1, persistent_workers=ending != "with-block"
    )
    if ending == "with-block":
        with loader:
            it = iter(loader)
            next(it)
    else:
        it = iter(loader)
        next(it)
        if ending == "close":
            loader.close()
        else:
            loader._iterator._shutdown_workers()  # Lightning's teardown
            loader._iterator = None
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(it)


async def test_an_iteration_begun_as_the_scope_closes_ends_and_closes() -> None:
    # Its stages' start came a loop turn after the group went inactive: the consumer got
    # anyio's "task group is not active", and its aclose() never returned.
    loader = aioloader.DataLoader(Counting(32), batch_size=4)
    held: dict[str, Any] = {}

    async def consume() -> int:
        it = held["it"] = aiter(loader)
        return len([b async for b in it])

    async with loader:
        task = asyncio.ensure_future(consume())
    assert await task == 0
    with anyio.fail_after(5):
        await held["it"].aclose()
    async with loader:  # the loader is whole
        assert flat([b async for b in loader]) == list(range(32))
