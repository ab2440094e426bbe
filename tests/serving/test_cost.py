"""Batching by cost and by bucket: the pure queue and policy driven by a fake clock (with
Hypothesis), then the batcher, driven by gates and the loop's own order, never by sleeps."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aioloader
from aioloader._serving.pending import BatchLimits, PendingQueue, bucket_of, cost_of
from aioloader._serving.policy import BatchPolicy, Decision
from tests.serving.test_batcher import FakeClock, Gated, check_accounts, gather, lists, settle

FAST = settings(max_examples=300, deadline=None)


@dataclass(eq=False)
class Req:
    id: int
    enqueued_at: float
    cost: float = 0.0
    bucket: Hashable = None
    deadline: float = math.inf


def queue_of(limits: BatchLimits, *reqs: Req) -> PendingQueue[Req]:
    queue: PendingQueue[Req] = PendingQueue(1000, limits)
    for r in reqs:
        queue.push(r)
    return queue


# --------------------------------------------------------------------------------------------
# the pure part
# --------------------------------------------------------------------------------------------


def test_limits_sum_or_pad_and_one_request_always_fits() -> None:
    summed, padded = BatchLimits(8, 100), BatchLimits(8, 100, padded=True)
    assert summed.cost(3, 60, 40) == 60 and padded.cost(3, 60, 40) == 120
    assert summed.fits(3, 60, 40) and not padded.fits(3, 60, 40)
    assert summed.fits(1, 500, 500) and padded.fits(1, 500, 500)  # alone over the limit
    assert not BatchLimits(2).fits(3, 0, 0)


def test_a_batch_is_cut_before_its_cost_would_pass_the_limit() -> None:
    queue = queue_of(BatchLimits(8, 100), Req(0, 0, 40), Req(1, 0, 50), Req(2, 0, 20))
    assert queue.next_batch(None) == (2, True)  # 40 + 50; 20 more would make 110
    batch, _ = queue.take(8, now=0.0)
    assert [r.id for r in batch] == [0, 1]
    assert queue.next_batch(None) == (1, False)  # 20: others may still join


def test_a_request_over_the_limit_runs_alone_at_once() -> None:
    policy = BatchPolicy(8, max_delay=10.0)
    queue = queue_of(BatchLimits(8, 100), Req(0, 0.0, 30), Req(1, 0.0, 500), Req(2, 0.0, 30))
    # [0] is full: the 500 behind it cannot join; it is cut without waiting for max_delay.
    assert policy.choose(queue, now=0.0) == Decision(1, bucket=None)
    assert [r.id for r in queue.take(1, 0.0)[0]] == [0]
    assert queue.next_batch(None) == (1, True)  # 500 alone: nothing can join it
    assert [r.id for r in queue.take(8, 0.0)[0]] == [1]
    assert policy.choose(queue, now=0.0) == Decision(0, 10.0)  # 30: waits for others
    alone = queue_of(BatchLimits(8, 100), Req(9, 0.0, 500))
    assert alone.next_batch(None) == (1, True)


def test_padded_cost_keeps_a_long_request_out_of_a_batch_of_short_ones() -> None:
    reqs = [Req(i, 0.0, 10) for i in range(4)] + [Req(4, 0.0, 60)]
    summed = queue_of(BatchLimits(8, 100), *reqs)
    padded = queue_of(BatchLimits(8, 100, padded=True), *reqs)
    assert summed.next_batch(None) == (5, False)  # 100: fits
    assert padded.next_batch(None) == (4, True)  # 5 x 60 = 300 would not


def test_withdrawing_from_a_full_batch_lets_the_next_join() -> None:
    a, b, c = Req(0, 0.0, 60), Req(1, 0.0, 60), Req(2, 0.0, 30)
    queue = queue_of(BatchLimits(8, 100), a, b, c)
    assert queue.next_batch(None) == (1, True) and queue.oldest_full() is a
    assert queue.withdraw(a) and not queue.withdraw(a)
    assert queue.next_batch(None) == (2, False) and queue.oldest_full() is None


def test_the_oldest_bucket_goes_first_once_due_else_a_full_one() -> None:
    policy = BatchPolicy(2, max_delay=1.0)
    queue = queue_of(BatchLimits(2), Req(0, 0.0, bucket="s"), Req(1, 0.5, bucket="l"))
    assert policy.choose(queue, now=0.6) == Decision(0, 1.0)
    queue.push(Req(2, 0.7, bucket="l"))  # "l" is full: cut before "s" is due
    assert policy.choose(queue, now=0.7) == Decision(2, bucket="l")
    queue.push(Req(3, 0.8, bucket="s"))  # now both are full: the older head goes first
    assert policy.choose(queue, now=0.8) == Decision(2, bucket="s")
    queue.take(2, 0.8, "s")
    queue.push(Req(4, 0.9, bucket="s"))
    assert policy.choose(queue, now=1.6) == Decision(2, bucket="l")  # due before "s" (0.9)
    assert queue.buckets == 2


def test_cost_and_bucket_functions_are_checked() -> None:
    assert cost_of(len, "abc") == 3.0 and bucket_of(len, "abc") == 3
    with pytest.raises(TypeError, match="cost_fn must return a number, got str"):
        cost_of(str, 1)
    with pytest.raises(TypeError, match="cost_fn must return a number, got bool"):
        cost_of(bool, 1)
    for bad in (-1, math.nan, math.inf):
        with pytest.raises(ValueError, match="cost_fn must return a finite number >= 0"):
            cost_of(lambda _, bad=bad: bad, 1)
    with pytest.raises(TypeError, match="bucket_fn must return a hashable key, got list"):
        bucket_of(list, "ab")
    with pytest.raises(KeyError) as info:
        cost_of({}.__getitem__, 1)
    assert any("cost_fn" in note for note in info.value.__notes__)


@FAST
@given(
    arrivals=st.lists(
        st.tuples(
            st.floats(0, 0.02),  # gap before it
            st.floats(0, 120),  # cost
            st.integers(0, 3),  # bucket
        ),
        min_size=1,
        max_size=80,
    ),
    max_batch_size=st.integers(1, 12),
    max_batch_cost=st.one_of(st.none(), st.floats(1, 300)),
    padded=st.booleans(),
    buckets=st.booleans(),
    max_delay=st.sampled_from([0.0, 0.001, 0.005, 0.05]),
)
def test_simulated_arrivals_with_costs_and_buckets(
    arrivals: list[tuple[float, float, int]],
    max_batch_size: int,
    max_batch_cost: float | None,
    padded: bool,
    buckets: bool,
    max_delay: float,
) -> None:
    """Drive the policy and the queue as the batcher does, on a fake clock, with a model that
    takes no time: every request lands in exactly one batch; a batch holds one bucket, in
    arrival order; it stays within the cost limit unless it is one request; it stops only
    where the next request of its bucket would not fit; once the oldest request is due its
    bucket goes first; nobody waits past ``max_delay``."""
    limits = BatchLimits(max_batch_size, max_batch_cost, padded)
    policy = BatchPolicy(max_batch_size, max_delay)
    queue: PendingQueue[Req] = PendingQueue(10_000, limits)
    reqs, at = [], 0.0
    for i, (gap, cost, key) in enumerate(arrivals):
        at += gap
        reqs.append(Req(i, at, cost, key if buckets else None))
    batches: list[list[Req]] = []
    i, now = 0, 0.0
    while i < len(reqs) or len(queue):
        flush = i == len(reqs)
        d = policy.choose(queue, now, flush=flush)
        if d.size:
            oldest = queue.oldest()
            assert oldest is not None
            if now >= oldest.enqueued_at + max_delay:  # the oldest is due: its bucket first
                assert d.bucket == oldest.bucket
            taken, expired = queue.take(d.size, now, d.bucket)
            assert taken and not expired
            if oldest.bucket == d.bucket:
                assert taken[0] is oldest
            rest = [r for r in queue._entries if r.bucket == d.bucket]
            if rest and len(taken) < max_batch_size:  # maximal: the next one does not fit
                costs = [r.cost for r in (*taken, rest[0])]
                assert not limits.fits(len(costs), sum(costs), max(costs))
            for r in taken:
                assert now - r.enqueued_at <= max_delay + 1e-9 or flush
            batches.append(taken)
            continue
        assert d.wake_at is None or d.wake_at > now
        next_arrival = reqs[i].enqueued_at if i < len(reqs) else math.inf
        now = min(next_arrival, d.wake_at if d.wake_at is not None else math.inf)
        if now == next_arrival:
            queue.push(reqs[i])
            i += 1
    assert sorted(r.id for b in batches for r in b) == list(range(len(reqs)))
    for batch in batches:
        assert 1 <= len(batch) <= max_batch_size
        assert len({r.bucket for r in batch}) == 1  # buckets never mixed
        assert [r.id for r in batch] == sorted(r.id for r in batch)
        costs = [r.cost for r in batch]
        if max_batch_cost is not None and len(batch) > 1:
            spent = len(costs) * max(costs) if padded else sum(costs)
            assert spent <= max_batch_cost
    for key in {r.bucket for r in reqs}:  # each bucket in arrival order across batches
        order = [r.id for b in batches for r in b if r.bucket == key]
        assert order == sorted(order)


# --------------------------------------------------------------------------------------------
# the batcher
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"max_batch_cost": 10}, ValueError, "max_batch_cost needs cost_fn"),
        ({"padded_cost": True}, ValueError, "padded_cost needs cost_fn"),
        ({"cost_fn": len, "max_batch_cost": 0}, ValueError, "max_batch_cost"),
        ({"cost_fn": len, "max_batch_cost": math.inf}, ValueError, "max_batch_cost"),
        ({"cost_fn": len, "max_batch_cost": "8"}, TypeError, "max_batch_cost"),
        ({"cost_fn": len, "padded_cost": 1}, TypeError, "padded_cost"),
        ({"cost_fn": 3}, TypeError, "cost_fn"),
        ({"bucket_fn": "len"}, TypeError, "bucket_fn"),
    ],
)
def test_bad_cost_arguments_name_the_argument(
    kwargs: dict[str, Any], error: type[Exception], name: str
) -> None:
    with pytest.raises(error, match=name):
        aioloader.DynamicBatcher(lambda b: b, **kwargs)


async def test_a_backlog_is_cut_by_cost_and_one_over_the_limit_runs_alone() -> None:
    model = Gated()
    batcher = lists(model, max_batch_size=8, cost_fn=len, max_batch_cost=10)
    async with batcher, anyio.create_task_group() as tg:
        tg.start_soon(batcher.submit, "x")
        await model.entered.wait()  # a batch runs: the rest accumulates
        for word in ("aaaa", "bbbb", "cc", "d" * 30, "ee", "ff"):
            tg.start_soon(batcher.submit, word)
        await settle()
        model.gate.set()
    assert model.batches == [["x"], ["aaaa", "bbbb", "cc"], ["d" * 30], ["ee", "ff"]]
    cost = batcher.statistics().cost
    assert cost is not None
    assert (cost.batches, cost.requests, cost.over_limit) == (4, 7, 1)
    assert cost.cost == 1 + 10 + 30 + 4 and cost.max_batch_cost == 30
    check_accounts(batcher)


async def test_bad_costs_and_keys_fail_only_their_own_submit() -> None:
    batcher = lists(lambda b: b, cost_fn=lambda x: x, bucket_fn=lambda x: [] if x == 7 else 0)
    async with batcher:
        with pytest.raises(ValueError, match="cost_fn must return a finite number >= 0"):
            await batcher.submit(-1)
        with pytest.raises(TypeError, match="bucket_fn must return a hashable key"):
            await batcher.submit(7)
        assert await batcher.submit(3) == 3
    s = batcher.statistics()
    assert (s.submitted, s.completed, s.rejected) == (1, 1, 0)


async def test_buckets_are_never_mixed_and_padding_is_counted() -> None:
    model = Gated()
    batcher = lists(
        model,
        max_batch_size=4,
        cost_fn=len,
        max_batch_cost=64,
        padded_cost=True,
        bucket_fn=lambda x: (len(x) - 1).bit_length(),
    )
    words = ["a", "b" * 10, "c", "d" * 12, "e", "f" * 17, "g"]
    async with batcher, anyio.create_task_group() as tg:
        tg.start_soon(batcher.submit, "z")
        await model.entered.wait()
        for word in words:
            tg.start_soon(batcher.submit, word)
        await settle()
        assert batcher.statistics().buckets == 3
        model.gate.set()
    # The oldest request's bucket first; lengths 10 and 12 share the bucket of 9..16.
    assert model.batches == [["z"], ["a", "c", "e", "g"], [words[1], words[3]], [words[5]]]
    cost = batcher.statistics().cost
    assert cost is not None and cost.padded_cost == 1 + 4 + 2 * 12 + 17
    assert cost.padded_fraction == pytest.approx(2 / 46)
    assert "4% of it padding" in repr(batcher.statistics())


async def test_max_delay_cuts_every_bucket_not_only_the_oldest() -> None:
    clock = FakeClock()  # never moves: only the delay timer cuts these batches
    batcher = lists(
        lambda b: b, max_batch_size=8, max_delay=0.01, clock=clock, bucket_fn=lambda x: x % 3
    )
    async with batcher:  # served inside the scope: by the delay, not by the exit's flush
        got = await gather(batcher, list(range(7)))
    assert got == {i: i for i in range(7)}
    s = batcher.statistics()
    assert s.batch_sizes == ((2, 2), (3, 1)) and s.queue_wait.max == 0.0
    check_accounts(batcher)


async def test_requests_ready_in_the_turn_the_delay_ends_join_the_batch() -> None:
    """With ``max_delay=0`` every batch is cut by the delay. Request 1 wakes the runner; 2
    becomes ready in the same loop turn, after the runner's wake-up; 3 one turn later (a task
    that turn's callback starts); 4 two turns later. 2 and 3 join 1's batch, 4 does not: the
    cut waits ``CUT_TURNS`` turns, no more."""
    model = Gated(open_=True)
    batcher = lists(model, max_batch_size=8)
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[Any]] = []

    def later(item: int, turns: int) -> None:
        if turns:
            loop.call_soon(later, item, turns - 1)
        else:
            tasks.append(loop.create_task(batcher.submit(item)))

    async with batcher:
        await settle()
        tasks.append(loop.create_task(batcher.submit(1)))
        loop.call_soon(later, 2, 0)
        loop.call_soon(later, 3, 1)
        loop.call_soon(later, 4, 2)
        await asyncio.gather(*tasks[:1])
        await settle()
        await asyncio.gather(*tasks)
    assert model.batches == [[1, 2, 3], [4]]


async def test_a_full_batch_is_cut_at_once_without_the_extra_turn() -> None:
    model = Gated(open_=True)
    batcher = lists(model, max_batch_size=1)
    loop = asyncio.get_running_loop()
    async with batcher:
        await settle()
        first = loop.create_task(batcher.submit(1))
        second: list[asyncio.Task[Any]] = []
        loop.call_soon(lambda: second.append(loop.create_task(batcher.submit(2))))
        await first
        await second[0]
    assert model.batches == [[1], [2]]
