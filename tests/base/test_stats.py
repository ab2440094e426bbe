"""A stage's operations counted by context manager: start, finish, failure, retry, cancel."""

from __future__ import annotations

import asyncio

import pytest

import aioloader
from aioloader._base.recorders import StageRecorder


def recorder() -> StageRecorder:
    return StageRecorder("fetch", limit=None, queue_capacity=None)


def counts(rec: StageRecorder) -> tuple[int, int, int, int]:
    s = rec.snapshot()
    return s.in_flight, s.max_in_flight, s.completed, s.failed


def test_a_finished_operation_and_one_that_failed() -> None:
    rec = recorder()
    with rec.operation(3):
        assert counts(rec) == (3, 3, 0, 0)
    assert counts(rec) == (0, 3, 3, 0)
    with pytest.raises(KeyError), rec.operation():
        raise KeyError("x")
    assert counts(rec) == (0, 3, 3, 1)


def test_a_retried_or_elsewhere_counted_failure_is_not_a_failure() -> None:
    rec = recorder()
    with pytest.raises(OSError), rec.operation() as op:
        op.retrying()
        raise OSError("reset")
    with pytest.raises(OSError), rec.operation() as op:
        op.not_a_failure()
        raise OSError("worker died")
    assert counts(rec) == (0, 1, 0, 0)


def test_cancelled_and_abandoned_operations_count_nothing() -> None:
    rec = recorder()
    with pytest.raises(asyncio.CancelledError), rec.operation(2):
        raise asyncio.CancelledError
    with rec.operation() as op:
        op.abandon()  # the end of a stream: no operation
    assert counts(rec) == (0, 2, 0, 0)


def test_statistics_say_they_cover_the_last_of_several_scopes() -> None:
    dl = aioloader.DataLoader(list(range(8)), batch_size=4)
    for _ in range(2):  # a plain for without `with`: a scope per epoch
        assert sum(len(b) for b in dl) == 8
    stats = dl.statistics()
    assert (stats.scopes, stats.epochs, stats.consumer.samples) == (2, 1, 8)
    head = repr(stats).splitlines()[0]
    assert head.endswith(
        "1 epoch(s) (the counters of the last of 2 scopes: a plain for without `with loader:` "
        "or persistent_workers=True opens one per epoch)"
    ), head
    with dl:
        for _ in range(2):
            assert sum(len(b) for b in dl) == 8
    stats = dl.statistics()
    assert (stats.scopes, stats.epochs, stats.consumer.samples) == (3, 2, 16)
    assert repr(stats).splitlines()[0].endswith("2 epoch(s) (the counters of the last of 3 scopes)")
    fresh = aioloader.DataLoader(list(range(8)), batch_size=4)
    with fresh:
        assert sum(len(b) for b in fresh) == 8
    assert repr(fresh.statistics()).splitlines()[0].endswith("1 epoch(s)")
