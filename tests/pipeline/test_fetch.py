"""The fetch path's rules without a loader: attempts under a timeout and a retry policy, and
the epoch's failure budget."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

import aioloader
from aioloader._base.recorders import Recorders
from aioloader._pipeline.fetch import Attempts, FailureBudget, Pace


def recorders() -> Recorders:
    return Recorders(max_inflight=4, workers=1, prefetch=2, device=None)


class Counting(aioloader.RetryPolicy):
    asked = 0

    def should_retry(self, exc: BaseException, failures: int) -> bool:
        Counting.asked += 1
        return super().should_retry(exc, failures)


async def test_transient_failures_are_retried_then_the_read_succeeds() -> None:
    stats = recorders()
    Counting.asked = 0
    policy = Counting(attempts=3, initial_backoff=0.0)
    attempts = Attempts(stats.fetch, policy, None, epoch=0)
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise aioloader.TransientError("try again")
        return "data"

    assert await attempts.run(flaky, "key-1", seq=0) == "data"
    fetch = stats.fetch.snapshot()
    assert (fetch.retries, fetch.completed, fetch.failed, fetch.in_flight) == (2, 1, 0, 0)
    assert Counting.asked == 2  # once per failure


async def test_giving_up_names_the_sample_and_counts_one_failure() -> None:
    stats = recorders()
    attempts = Attempts(
        stats.fetch, aioloader.RetryPolicy(attempts=2, initial_backoff=0.0), 0.05, 3
    )

    async def slow() -> None:
        await anyio.sleep(5)

    with pytest.raises(TimeoutError, match=r"sample_timeout=0\.05s") as info:
        await attempts.run(slow, "key-9", seq=4)
    notes = "\n".join(info.value.__notes__)
    assert "gave up after 2 attempts" in notes and "key-9" in notes and "epoch 3" in notes
    assert stats.fetch.snapshot().failed == 1


def test_the_budget_skips_then_raises() -> None:
    stats = recorders()
    budget = FailureBudget(2, stats, epoch=1)
    for key in ("a", "b"):
        budget.skip_or_raise(ValueError(key), "transform", seq=0, key=key)
    assert stats.transform.snapshot().skipped == 2 and stats.skipped == ["a", "b"]
    with pytest.raises(ValueError, match="c") as info:
        budget.skip_or_raise(ValueError("c"), "fetch", seq=5, key="c")
    assert any("max_failures=2 exhausted" in n for n in info.value.__notes__)


def test_no_budget_raises_at_once_without_a_budget_note() -> None:
    budget = FailureBudget(0, recorders(), epoch=0)
    with pytest.raises(KeyError) as info:
        budget.skip_or_raise(KeyError("k"), "fetch", seq=0, key="k")
    notes: list[Any] = getattr(info.value, "__notes__", [])
    assert not any("exhausted" in n for n in notes)


def test_pace_reads_a_batch_per_task_only_while_reads_return_at_once() -> None:
    pace = Pace(below=50e-6)
    assert pace.samples_per_job(32) == 1  # nothing known: a task per sample
    pace.observe(32 * 2e-6, 32)  # 2 µs a read: they do not wait
    assert pace.samples_per_job(32) == 32
    pace.observe(0.02)  # one read waited 20 ms: overlap them again
    assert pace.samples_per_job(32) == 1
    for _ in range(20):
        pace.observe(32 * 2e-6, 32)
    assert pace.samples_per_job(32) == 32
