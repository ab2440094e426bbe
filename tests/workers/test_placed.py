"""``_workers/placed.py``: calls run inline, timed alone on a thread, or on the threads at once,
on a real thread pool; a call timed alone never has another call beside it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import anyio
import pytest

from aioloader._base.inline import Placement
from aioloader._workers.placed import PlacedCalls


class Tracked:
    """A blocking call that records where it ran and how many ran at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0
        self.beside_alone: list[int] = []  # calls running when a call timed alone began
        self.threads: list[bool] = []  # True: on a pool thread

    def __call__(self, seconds: float, tag: str = "") -> str:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
            if tag == "alone":
                self.beside_alone.append(self.running - 1)
            self.threads.append(threading.current_thread().name.startswith("placed-test"))
        try:
            time.sleep(seconds)
            return tag
        finally:
            with self.lock:
                self.running -= 1


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4, thread_name_prefix="placed-test") as executor:
        yield executor


async def test_slow_calls_overlap_on_the_threads_and_fast_ones_run_here(
    pool: ThreadPoolExecutor,
) -> None:
    calls, fn = PlacedCalls(Placement(0.001, slow_below=1.0, probe_every=1000)), Tracked()
    calls.placement.recent.add(0.01)  # known slow: timed alone after 1, 2, 4, 8, 16 calls
    for _ in range(8):
        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(calls.run, pool, fn, 0.02)
    assert fn.most == 4 and all(fn.threads)
    calls.placement.recent.seconds = 0.0001  # known fast
    assert await calls.run(pool, fn, 0.0, "x") == "x" and fn.threads[-1] is False


async def test_a_call_timed_alone_has_none_beside_it(pool: ThreadPoolExecutor) -> None:
    """Calls on the threads finish before it starts, and none starts while it runs; its time is
    then what the placement goes by."""
    place = Placement(0.001, slow_below=1.0, probe_every=3)
    calls, fn = PlacedCalls(place), Tracked()
    place.recent.add(0.01)
    async with anyio.create_task_group() as tg:
        for i in range(9):  # every third decision is a call timed alone
            tag = "alone" if i % 3 == 2 else ""
            tg.start_soon(calls.run, pool, fn, 0.03, tag)
            await anyio.sleep(0.005)  # staggered, as fetch workers come
    assert fn.beside_alone == [0, 0, 0], "another call ran beside one timed alone"
    assert fn.most >= 2  # the others did overlap
    assert place.recent.seconds is not None and place.recent.seconds >= 0.02


async def test_a_call_waiting_for_its_turn_or_running_alone_can_be_cancelled(
    pool: ThreadPoolExecutor,
) -> None:
    place = Placement(0.001, slow_below=1.0, probe_every=1)
    calls, fn = PlacedCalls(place), Tracked()
    place.recent.add(0.01)
    with anyio.move_on_after(0.05) as scope:  # timed alone (probe_every=1), running 0.2 s
        await calls.run(pool, fn, 0.2, "alone")
    assert scope.cancelled_caught and fn.running == 0, "the running call was waited for"
    async with anyio.create_task_group() as tg:  # the lock was let go: others still run
        tg.start_soon(calls.run, pool, fn, 0.01)
        tg.start_soon(calls.run, pool, fn, 0.01)
    assert fn.running == 0 and len(fn.threads) == 3


async def test_the_first_wave_is_timed_alone_once_then_overlaps(pool: ThreadPoolExecutor) -> None:
    """Found by review: every call made before the first returned waited to be timed alone,
    one after another. Only the first is; the others, found slow, overlap."""
    calls, fn = PlacedCalls(Placement(0.001, slow_below=1.0)), Tracked()
    async with anyio.create_task_group() as tg:
        for _ in range(6):
            tg.start_soon(calls.run, pool, fn, 0.03)
    assert fn.most >= 3 and all(fn.threads), fn.most


def test_two_loops_sharing_the_calls_both_finish(pool: ThreadPoolExecutor) -> None:
    """Found by review: the lock and the event were shared by two event loops (two loaders on
    loops of their own sharing a dataset), and both hung. One loop owns them; the other's calls
    go straight to the threads."""
    calls, fn = PlacedCalls(Placement(0.001, slow_below=1.0, probe_every=2)), Tracked()
    done: list[int] = []

    async def many() -> None:
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(some)
        done.append(1)

    async def some() -> None:
        for _ in range(20):
            await calls.run(pool, fn, 0.002)

    threads = [threading.Thread(target=anyio.run, args=(many,), daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    assert done == [1, 1] and fn.running == 0
    assert not any(thread.is_alive() for thread in threads)
