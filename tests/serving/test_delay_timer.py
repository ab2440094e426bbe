"""The batcher's delay timer: a batch cut by ``max_delay`` is never cut before its oldest
request has waited ``max_delay`` on the batcher's clock, on a loop whose timers are coarse
(uvloop counts whole milliseconds from a loop time truncated to the millisecond), without a
spin and without trusting a clock that disagrees with the loop for good."""

from __future__ import annotations

import math
import time
from collections.abc import Hashable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aioloader
from aioloader._serving import dispatch
from aioloader._serving.pending import PendingQueue
from aioloader._serving.policy import MAX_REARMS, NEAR_MISS_S, TIMER_GRAIN_S, rearm_after_timer

MS = 1e-3


def millisecond_timer(armed_at: float, wait: float, lateness: float) -> float:
    """When uvloop's timer armed at ``armed_at`` for ``wait`` seconds fires: its due tick is the
    loop's time (``armed_at`` truncated to the millisecond) plus ``wait`` rounded to whole
    milliseconds; it runs at the first loop turn at or past that tick, ``lateness`` after it. A
    wait that rounds to 0 runs on the next turn."""
    ticks = round(wait / MS)
    if ticks == 0:
        return armed_at + 1e-6
    return max((math.floor(armed_at / MS) + ticks) * MS + lateness, armed_at + 1e-6)


@settings(max_examples=2000, deadline=None)
@given(
    tick=st.integers(0, 1000),
    phase=st.floats(0, MS, exclude_max=True),  # where in its millisecond the timer is armed
    delay=st.floats(0.0002, 0.05),
    lateness=st.lists(st.floats(0, 0.9 * MS), min_size=MAX_REARMS + 1, max_size=MAX_REARMS + 1),
)
def test_on_a_millisecond_timer_the_cut_is_never_early_and_at_most_a_tick_late(
    tick: int, phase: float, delay: float, lateness: list[float]
) -> None:
    armed_at = tick * MS + phase
    due = armed_at + delay
    fired = millisecond_timer(armed_at, delay, lateness[0])
    rearms, waits = 0, []
    while (wait := rearm_after_timer(due - fired, rearms)) is not None:
        waits.append(wait)
        rearms += 1
        fired = millisecond_timer(fired, wait, lateness[rearms])
    assert fired >= due  # never cut before max_delay
    assert fired - due <= MS + max(lateness) + 1e-9  # within a tick (and the loop's lateness)
    assert rearms <= MAX_REARMS and all(w >= TIMER_GRAIN_S for w in waits)  # never a spin


@given(left=st.floats(-1, 1), rearms=st.integers(0, 5))
def test_a_timer_trusted_when_due_far_off_or_re_armed_enough(left: float, rearms: int) -> None:
    wait = rearm_after_timer(left, rearms)
    if left <= 0 or left > NEAR_MISS_S or rearms >= MAX_REARMS:
        assert wait is None  # due, the clocks disagree (a frozen clock), or re-armed enough
    else:
        assert wait == max(left, TIMER_GRAIN_S)


async def test_a_batch_cut_by_the_delay_is_never_cut_before_it_by_the_batchers_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The batcher's clock runs at 0.8 of the loop's, so the loop's timer fires with a fifth of
    the delay still to go on it (as uvloop's millisecond timer fires up to 1.5 ms early on the
    real clock). Single requests one after another, each batch cut by ``max_delay`` alone: at
    each cut (where the runner takes the batch from the queue) the oldest request has waited
    ``max_delay`` on the batcher's clock. Before the timer was re-armed, every one was cut
    early (3.8-3.9 ms of 4). Requests go on (at most 200) until a timer was re-armed: on a
    loaded machine one may fire late enough to need none (and a first wait may be short: the
    runner came late to arm it, which is no re-arm)."""
    max_delay = 0.004

    def clock() -> float:
        return 0.8 * time.monotonic()

    waited: list[float] = []  # at each cut: how long the batch's oldest request had waited
    take = PendingQueue.take

    def observed(queue: PendingQueue[Any], n: int, now: float, key: Hashable = None) -> Any:
        oldest = queue.oldest()
        assert oldest is not None
        waited.append(clock() - oldest.enqueued_at)
        return take(queue, n, now, key)

    monkeypatch.setattr(PendingQueue, "take", observed)
    rearmed: list[float] = []  # every wait again after a timer fired early

    def recorded(left: float, rearms: int) -> float | None:
        wait = rearm_after_timer(left, rearms)
        if wait is not None:
            rearmed.append(wait)
        return wait

    monkeypatch.setattr(dispatch, "rearm_after_timer", recorded)
    batcher = aioloader.DynamicBatcher(
        lambda b: b, collate_fn=list, max_delay=max_delay, clock=clock
    )
    sent = 0
    async with batcher:
        while sent < 20 or (not rearmed and sent < 200):
            assert await batcher.submit(sent) == sent
            sent += 1
    assert batcher.statistics().batch_sizes == ((1, sent),)
    assert len(waited) == sent and min(waited) >= max_delay, sorted(waited)[:3]
    assert rearmed and min(rearmed) >= TIMER_GRAIN_S  # a re-armed wait: never under the grain
