"""The statistics' verdict names the stage that limited a run, on runs built to be limited by
each: the fetches, the workers, the consumer."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

import aioloader
from aioloader import DataLoader
from aioloader._base.verdict import verdict


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
    assert "fetches ran at their cap of 4 samples at once" in stats.verdict, stats
    assert "raise max_inflight" in stats.verdict
    assert stats.verdict in repr(stats)


async def test_a_worker_bound_run_says_add_workers() -> None:
    stats = await run(DataLoader(Instant(), batch_size=8, transform=heavy, max_inflight=64))
    assert "the workers were busy" in stats.verdict, stats
    assert "add workers" in stats.verdict


def test_a_consumer_bound_run_says_the_loader_is_not_the_problem() -> None:
    """A plain ``for`` whose step takes 20 ms (on its own thread, as a training step does).

    Batches are made ahead (``prefetch=8``), as the stages make them for a training loop:
    a stall of the loop thread on a loaded box is then absorbed by the batches ready, as it is
    in training. Made in the consumer's own calls instead (no ``prefetch``), every stall was
    the consumer's wait: 15-17% in two full CI runs, where 10% is the verdict's bound.
    """

    class Many(Instant):
        def __len__(self) -> int:
            return 800

    loader = DataLoader(Many(), batch_size=8, prefetch=8)
    for _ in loader:
        time.sleep(0.02)
    stats = loader.statistics()
    assert stats.verdict.startswith("the consumer was the bottleneck"), stats
    assert "not slowing training" in stats.verdict


def test_before_any_batch_it_says_so() -> None:
    assert DataLoader(Instant(), batch_size=8).statistics().verdict == "no batch handed out yet"


class Remote(aioloader.AsyncDataset[int]):
    def __len__(self) -> int:
        return 256

    async def get(self, index: int) -> int:
        # Long beside the transform (0.5 ms): with 64 in flight its thread is 8% busy, 9x
        # under the 75% called busy (a loaded box stretches each call several times), while
        # the waits once timed as busy (64 calls queued each round) add up to 2.5x the run.
        await asyncio.sleep(0.4)
        return index


def light(x: int) -> int:
    deadline = time.perf_counter() + 0.0005
    while time.perf_counter() < deadline:
        pass
    return x


async def test_fetches_waiting_for_a_thread_are_not_called_worker_bound() -> None:
    """Found by review: a transform waiting for the one worker thread was timed as busy, so
    a fetch-bound run (raising max_inflight doubles it) was called worker-bound."""
    loader = DataLoader(Remote(), batch_size=16, max_inflight=64, transform=light)
    stats = await run(loader)
    assert "raise max_inflight" in stats.verdict, stats
    assert (stats.stage("transform").utilisation(stats.elapsed_s) or 0) < 0.75


async def trickle() -> AsyncIterator[int]:
    for i in range(120):
        await asyncio.sleep(0.004)  # each sample takes its producer 4 ms
        yield i


async def test_a_stream_read_one_sample_at_a_time_is_said_so() -> None:
    stats = await run(DataLoader(trickle, batch_size=8))
    assert "the stream gave its samples one at a time" in stats.verdict, stats
    assert "max_inflight" not in stats.verdict


def device_bound(busy_s: float) -> aioloader.LoaderStatistics:
    """A snapshot of a run whose device stage was busy ``busy_s`` of its 1 s."""
    from aioloader._base.stats import ConsumerStatistics, LatencySummary, StageStatistics

    latency = LatencySummary(100, 0.003, 0.004, 0.01, 0.02)
    device = StageStatistics(
        "device", 0, 1, 1, 0, 1, 4, 100, 0, 0, 0, 0.0, 0.0, latency, busy_s=busy_s
    )
    consumer = ConsumerStatistics(100, 6400, wait_s=0.5, max_wait_s=0.01, busy_s=0.5)
    return aioloader.LoaderStatistics(1, 1.0, (device,), consumer)


def test_a_device_bound_run_asks_for_pinning_only_when_batches_are_not_pinned() -> None:
    """Found on an H200: the demo, pinned already, was told to set pin_memory=True."""
    from aioloader._base.verdict import verdict

    unpinned, pinned = verdict(device_bound(0.9)), verdict(device_bound(0.9), pinned=True)
    assert "copying batches to the device took 90%" in unpinned and "pin_memory=True" in unpinned
    assert "copying batches to the device took 90%" in pinned, pinned
    assert "pin_memory" not in pinned and "move less" in pinned
    assert "no stage was saturated" in verdict(device_bound(0.5), pinned=True)


def test_reads_in_worker_processes_are_never_told_to_raise_max_inflight() -> None:
    in_this_process = verdict(device_bound(0.5), pinned=True)
    in_workers = verdict(device_bound(0.5), pinned=True, reads_in_workers=True)
    assert "more max_inflight" in in_this_process
    assert "max_inflight" not in in_workers and "more num_workers" in in_workers, in_workers


def test_a_run_limited_by_pinning_on_the_host_is_said_so() -> None:
    """Found by review: ``pin_memory=True`` without ``device`` pins on the stage's thread; a
    run it limited was told to set pin_memory=True."""
    from aioloader._base.verdict import verdict

    said = verdict(device_bound(0.9), pinned=True, to_device=False)
    assert "pinning batches (pin_memory=True) took 90%" in said and "pass device=" in said
    assert "copying batches to the device" not in said


async def test_a_slow_worker_start_is_named_with_why_and_what_to_do() -> None:
    stats = await run(DataLoader(Slow(), batch_size=8, max_inflight=4))
    elapsed = stats.elapsed_s
    slow = aioloader.WorkerStatistics(
        2, elapsed * 0.5 + 0.5, 20, 0, 0, 0, 0, "interpreter", "this process had 3 Python threads"
    )
    said = verdict(dataclasses.replace(stats, workers=slow))
    assert f"starting the 2 worker processes took {slow.startup_s:.1f} s" in said, said
    assert "(this process had 3 Python threads)" in said
    assert "import aioloader before CUDA is initialised" in said
    # The standby refused because the main module's top level, run again in it, started a
    # thread: importing earlier would not help; the guard does.
    unguarded = dataclasses.replace(slow, main_left_unsafe=True)
    said = verdict(dataclasses.replace(stats, workers=unguarded))
    assert "starts a thread or initialises CUDA; do that under `if __name__ ==" in said, said
    assert "import aioloader before" not in said and "persistent_workers=True" in said
    reserve = dataclasses.replace(unguarded, server="standby")  # its workers ran the module
    said = verdict(dataclasses.replace(stats, workers=reserve))
    assert "each ran the main module's top level after its fork" in said, said
    assert "starts a thread or initialises CUDA; do that under `if __name__ ==" in said
    forked = dataclasses.replace(slow, server="forked", server_why="")
    said = verdict(dataclasses.replace(stats, workers=forked))
    assert "took" in said and "persistent_workers=True" in said and "CUDA" not in said
    assert "MiB" not in said  # nothing said of a small dataset's pickle
    heavy = dataclasses.replace(forked, start_bytes=57 << 20)  # ImageNet's list of paths
    said = verdict(dataclasses.replace(stats, workers=heavy))
    assert (
        "lighten worker_init_fn and the dataset each worker receives (they pickle to 57 MiB)"
        in said
    ), said
    quick = dataclasses.replace(slow, startup_s=0.02)
    assert "starting" not in verdict(dataclasses.replace(stats, workers=quick))
    # A standby that took long to catch up (imports after aioloader's): said, with the cure;
    # its seconds were paid as the loader was built, outside the run's elapsed time.
    caught_up = dataclasses.replace(quick, server="standby", server_s=elapsed * 0.5 + 0.5)
    said = verdict(dataclasses.replace(stats, workers=caught_up))
    assert f"{caught_up.server_s:.1f} s of it readying the fork server" in said, said
    assert "Import aioloader after the heavy imports" in said
    assert "starting" not in verdict(
        dataclasses.replace(stats, workers=dataclasses.replace(caught_up, server_s=0.01))
    )
    # A fresh standby the loader was built before it was ready: its wait, why, and the cure a
    # notebook has (its threads were there before any cell: importing earlier is the cure).
    why = "this process had 3 Python threads; when aioloader was imported, ..."
    waited = dataclasses.replace(caught_up, server="fresh standby", server_why=why)
    said = verdict(dataclasses.replace(stats, workers=waited))
    assert f"{waited.server_s:.1f} s of it waiting for the fork server started in" in said, said
    assert f"a fresh interpreter ({why}), to be ready" in said
    assert "in a cell before the loader's), or build the loader later" in said


async def test_ray_workers_busy_or_slow_to_start_are_named_as_the_clusters() -> None:
    stats = await run(DataLoader(Instant(), batch_size=8, transform=heavy, max_inflight=64))
    ray = aioloader.WorkerStatistics(2, 0.01, 20, 0, 0, 0, 0, "ray", "2 node(s): a, b")
    said = verdict(dataclasses.replace(stats, workers=ray))
    assert "the cluster's Ray workers were busy" in said, said
    assert "(2 actors on 2 node(s): a, b)" in said and "not the loader" in said
    slow = dataclasses.replace(ray, startup_s=stats.elapsed_s + 1)
    said = verdict(dataclasses.replace(stats, workers=slow))
    assert f"starting the 2 Ray actors took {slow.startup_s:.1f} s" in said, said
    assert "persistent_workers=True" in said and "fork server" not in said
    # Kept across epochs already: not told to keep them.
    said = verdict(dataclasses.replace(stats, workers=slow, epochs=3))
    assert "paid once for the 3 epochs so far" in said and "persistent_workers" not in said
