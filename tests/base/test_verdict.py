"""The statistics' verdict names the stage that limited a run, on runs built to be limited by
each: the fetches, the workers, the consumer."""

from __future__ import annotations

import asyncio
import time

import aioloader
from aioloader import DataLoader


class Slow(aioloader.AsyncDataset[int]):
    """Each read waits 20 ms, as a remote object does."""

    def __len__(self) -> int:
        return 160

    async def get(self, index: int) -> int:
        await asyncio.sleep(0.02)
        return index


class Instant(aioloader.AsyncDataset[int]):
    def __len__(self) -> int:
        return 160

    async def get(self, index: int) -> int:
        return index


def heavy(x: int) -> int:
    """5 ms of CPU per sample."""
    deadline = time.perf_counter() + 0.005
    while time.perf_counter() < deadline:
        pass
    return x


async def run(loader: DataLoader[object]) -> aioloader.LoaderStatistics:
    async with loader:
        async for _ in loader:
            pass
    return loader.statistics()


async def test_a_fetch_bound_run_says_raise_max_inflight() -> None:
    stats = await run(DataLoader(Slow(), batch_size=8, max_inflight=4))
    assert "fetches ran at their max_inflight=4 cap" in stats.verdict, stats
    assert "raise max_inflight" in stats.verdict
    assert stats.verdict in repr(stats)


async def test_a_worker_bound_run_says_add_workers() -> None:
    stats = await run(DataLoader(Instant(), batch_size=8, transform=heavy, max_inflight=64))
    assert "the workers were busy" in stats.verdict, stats
    assert "add workers" in stats.verdict


def test_a_consumer_bound_run_says_the_loader_is_not_the_problem() -> None:
    """A plain ``for`` whose step takes 10 ms (on its own thread, as a training step does)."""

    class Many(Instant):
        def __len__(self) -> int:
            return 800

    loader = DataLoader(Many(), batch_size=8)
    for _ in loader:
        time.sleep(0.01)
    stats = loader.statistics()
    assert stats.verdict.startswith("the consumer was the bottleneck"), stats
    assert "not slowing training" in stats.verdict


def test_before_any_batch_it_says_so() -> None:
    assert DataLoader(Instant(), batch_size=8).statistics().verdict == "no batch handed out yet"
