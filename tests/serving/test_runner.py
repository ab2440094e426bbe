"""Where a blocking model runs: on the batcher's thread or, while its calls are fast, on the
event loop's own thread. Durations come from the batcher's clock, which the model itself
advances (a fake clock): no sleeps, no wall-clock assertions."""

from __future__ import annotations

import threading

import aioloader
from tests.serving.test_batcher import FakeClock, check_accounts


class Model:
    """Records the thread of each call; a call 'takes' ``cost`` seconds of the fake clock."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.cost = 0.0
        self.threads: list[str] = []

    def __call__(self, batch: list[int]) -> list[int]:
        self.threads.append("loop" if threading.current_thread() is MAIN else "thread")
        self.clock.now += self.cost
        return batch


MAIN = threading.main_thread()


async def test_a_fast_model_runs_on_the_loop_a_slow_one_on_the_thread_and_back() -> None:
    clock = FakeClock()
    model = Model(clock)
    batcher = aioloader.DynamicBatcher(
        model, collate_fn=list, max_batch_size=1, max_delay=0.0, clock=clock
    )
    async with batcher:
        for i in range(3):
            assert await batcher.submit(i) == i
        assert model.threads == ["thread", "loop", "loop"]  # the first is timed on the thread
        model.cost = 0.005  # slower than the 1 ms a hop is worth
        for i in range(6):
            await batcher.submit(i)
        # One slow call inline moves the estimate past the limit; from then on the calls go
        # to the thread, one tried inline after 1, then 2 calls there (each try slow again).
        assert model.threads[3:] == ["loop", "loop", "thread", "loop", "thread", "thread"]
        model.cost = 0.0
        for i in range(5):
            await batcher.submit(i)
        # The next try (the 4th call after the last, tries spaced 1, 2, 4, ...) is fast: back
        # on the loop for good.
        assert model.threads[9:] == ["thread", "loop", "loop", "loop", "loop"]
    check_accounts(batcher)


async def test_the_model_stays_on_threads_with_several_batches_at_once() -> None:
    clock = FakeClock()
    model = Model(clock)
    batcher = aioloader.DynamicBatcher(
        model, collate_fn=list, max_batch_size=1, max_concurrent_batches=2, clock=clock
    )
    async with batcher:
        for i in range(4):
            await batcher.submit(i)
    assert model.threads == ["thread"] * 4


async def test_a_slow_model_is_never_tried_on_the_loop() -> None:
    """From review: a model of 10 ms or more is re-timed on its thread, never inline, where a
    try would hold every request the loop serves (a 100 ms GPU model, once in 256 batches)."""
    clock = FakeClock()
    model = Model(clock)
    model.cost = 0.1
    batcher = aioloader.DynamicBatcher(
        model, collate_fn=list, max_batch_size=1, max_delay=0.0, clock=clock
    )
    async with batcher:
        for i in range(40):
            assert await batcher.submit(i) == i
        assert model.threads == ["thread"] * 40
        model.cost = 0.0  # fast again (warmed up): the next re-timing on the thread finds it
        for i in range(40):
            await batcher.submit(i)
        assert model.threads[-1] == "loop"
    check_accounts(batcher)
