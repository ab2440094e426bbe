"""The dynamic batcher: its pure policy driven by a fake clock (with Hypothesis), and the async
layer driven by gates (a model that blocks until the test releases it), never by sleeps."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import namedtuple
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import aioloader
from aioloader._device.plan import DevicePlan
from aioloader._serving.pending import PendingQueue
from aioloader._serving.policy import BatchPolicy, Decision, default_split
from tests.device.test_device import FakeAccelerator

FAST = settings(max_examples=200, deadline=None)
_LOCK = threading.Lock()  # a lambda goes to the workers by value, but nothing sends a lock


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Gated:
    """An async model_fn over lists: records each batch, then blocks until released."""

    def __init__(self, *, open_: bool = False) -> None:
        self.batches: list[list[Any]] = []
        self.running = 0
        self.max_running = 0
        self.entered = anyio.Event()
        self.gate = anyio.Event()
        if open_:
            self.gate.set()

    async def __call__(self, batch: list[Any]) -> list[Any]:
        self.batches.append(list(batch))
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        self.entered.set()
        try:
            await self.gate.wait()
        finally:
            self.running -= 1
        return [x * 10 for x in batch]


def lists(model: Callable[[Any], Any], **kwargs: Any) -> aioloader.DynamicBatcher:
    """A batcher whose batches are plain lists (no tensors), one result per item."""
    kwargs.setdefault("max_delay", 0.0)
    return aioloader.DynamicBatcher(model, collate_fn=list, **kwargs)


async def settle() -> None:
    """Let every task run until it blocks (so a submit has queued, a batch has started)."""
    await anyio.wait_all_tasks_blocked()


async def outcome(fn: Callable[[], Any]) -> Any:
    try:
        return await fn()
    except Exception as exc:
        return exc


def check_accounts(batcher: aioloader.DynamicBatcher) -> None:
    s = batcher.statistics()
    assert s.submitted == s.completed + s.failed + s.expired + s.cancelled + s.pending
    assert s.pending == 0 and s.queued == 0 and s.running == 0


# --------------------------------------------------------------------------------------------
# the policy (pure, fake clock)
# --------------------------------------------------------------------------------------------


def test_policy_cuts_a_full_batch_at_once_and_otherwise_waits_for_the_oldest() -> None:
    policy = BatchPolicy(max_batch_size=4, max_delay=0.5)
    assert policy.decide(0, None, 10.0) == Decision(0)
    assert policy.decide(3, 10.0, 10.2) == Decision(0, 10.5)
    assert policy.decide(3, 10.0, 10.5) == Decision(3)
    assert policy.decide(9, 10.0, 10.0) == Decision(4)
    assert policy.decide(1, 10.0, 10.0, flush=True) == Decision(1)


def test_preferred_sizes_take_the_largest_that_fits_else_everything() -> None:
    policy = BatchPolicy(max_batch_size=16, max_delay=1.0, preferred_sizes=(8, 4, 4))
    assert policy.preferred_sizes == (4, 8)
    assert policy.decide(7, 0.0, 1.0) == Decision(4)
    assert policy.decide(12, 0.0, 1.0) == Decision(8)
    assert policy.decide(3, 0.0, 1.0) == Decision(3)  # none fits: take all
    assert policy.decide(20, 0.0, 0.0) == Decision(8)  # full: still a preferred size


@FAST
@given(
    max_batch_size=st.integers(1, 64),
    preferred=st.lists(st.integers(1, 64), max_size=4),
    queued=st.integers(0, 200),
    waited=st.floats(0, 2),
    max_delay=st.floats(0, 1),
    flush=st.booleans(),
)
def test_policy_decisions_are_bounded_and_prefer_the_preferred(
    max_batch_size: int,
    preferred: list[int],
    queued: int,
    waited: float,
    max_delay: float,
    flush: bool,
) -> None:
    preferred = [p for p in preferred if p <= max_batch_size]
    policy = BatchPolicy(max_batch_size, max_delay, tuple(preferred))
    now = 100.0
    oldest = now - waited
    d = policy.decide(queued, oldest if queued else None, now, flush=flush)
    due = queued >= max_batch_size or flush or now >= oldest + max_delay
    if queued and due:
        assert 1 <= d.size <= min(queued, max_batch_size)
        fitting = [p for p in preferred if p <= min(queued, max_batch_size)]
        assert d.size == (max(fitting) if fitting else min(queued, max_batch_size))
    else:
        assert d.size == 0
        assert d.wake_at is None if not queued else d.wake_at == oldest + max_delay


@FAST
@given(
    gaps=st.lists(st.floats(0, 0.02), min_size=1, max_size=120),
    max_batch_size=st.integers(1, 16),
    max_delay=st.sampled_from([0.0, 0.001, 0.005, 0.05]),
    preferred=st.lists(st.integers(1, 16), max_size=3),
)
def test_simulated_arrivals_each_request_in_one_batch_in_order_within_the_delay(
    gaps: list[float], max_batch_size: int, max_delay: float, preferred: list[int]
) -> None:
    """Drive the policy and the queue as the batcher does, on a fake clock, with a model that
    takes no time: every request lands in exactly one batch, in arrival order, no batch is too
    big, and nobody waits longer than ``max_delay``."""
    policy = BatchPolicy(
        max_batch_size, max_delay, tuple(p for p in preferred if p <= 16 and p <= max_batch_size)
    )
    queue: PendingQueue[Req] = PendingQueue(10_000)
    arrivals = [sum(gaps[: i + 1]) for i in range(len(gaps))]
    batches: list[list[Req]] = []
    i, now = 0, 0.0
    while i < len(arrivals) or len(queue):
        d = policy.decide(len(queue), queue.oldest_at(), now, flush=i == len(arrivals))
        if d.size:
            taken, expired = queue.take(d.size, now)
            assert not expired
            batches.append(taken)
            for r in taken:
                assert now - r.enqueued_at <= max_delay + 1e-9
            continue
        next_arrival = arrivals[i] if i < len(arrivals) else math.inf
        now = min(next_arrival, d.wake_at if d.wake_at is not None else math.inf)
        if now == next_arrival:
            queue.push(Req(i, now))
            i += 1
    flat = [r.id for b in batches for r in b]
    assert flat == list(range(len(arrivals)))
    assert all(1 <= len(b) <= max_batch_size for b in batches)


@dataclass(eq=False)
class Req:
    id: int
    enqueued_at: float
    deadline: float = math.inf
    cost: float = 0.0
    bucket: Hashable = None


def test_queue_admits_up_to_capacity_withdraws_and_skips_the_expired() -> None:
    queue: PendingQueue[Req] = PendingQueue(3)
    a, b, c = Req(0, 0.0, deadline=5.0), Req(1, 1.0), Req(2, 2.0)
    for r in (a, b, c):
        queue.push(r)
    with pytest.raises(aioloader.Overloaded, match="max_queue=3"):
        queue.push(Req(3, 3.0))
    assert queue.withdraw(b) and not queue.withdraw(b)
    assert queue.oldest_at() == 0.0
    taken, expired = queue.take(5, now=6.0)
    assert taken == [c] and expired == [a]
    assert len(queue) == 0 and queue.max_len == 3 and queue.oldest_at() is None


# --------------------------------------------------------------------------------------------
# splitting outputs
# --------------------------------------------------------------------------------------------

Pair = namedtuple("Pair", "a b")


def test_default_split_of_tensors_lists_mappings_and_tuples() -> None:
    out = default_split(torch.arange(6).reshape(3, 2), 3)
    assert [t.tolist() for t in out] == [[0, 1], [2, 3], [4, 5]]
    assert default_split(["x", "y"], 2) == ["x", "y"]
    rows = default_split({"p": torch.tensor([1, 2]), "q": ["u", "v"]}, 2)
    assert [(r["p"].item(), r["q"]) for r in rows] == [(1, "u"), (2, "v")]
    pairs = default_split(Pair(torch.tensor([1, 2]), torch.tensor([3, 4])), 2)
    assert all(isinstance(p, Pair) for p in pairs)
    assert [(p.a.item(), p.b.item()) for p in pairs] == [(1, 3), (2, 4)]
    plain = default_split((torch.tensor([1, 2]), ["a", "b"]), 2)
    assert plain[1][0].item() == 2 and plain[1][1] == "b" and type(plain[1]) is tuple


def test_default_split_names_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match=r"output\['p'\]: a tensor of shape \(3,\)"):
        default_split({"p": torch.zeros(3)}, 2)
    with pytest.raises(ValueError, match="a list of 1 outputs for 2"):
        default_split(["x"], 2)
    with pytest.raises(ValueError, match="shape"):
        default_split(torch.tensor(1.0), 1)
    with pytest.raises(TypeError, match="pass split_fn"):
        default_split(object(), 1)


# --------------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"max_batch_size": 0}, ValueError, "max_batch_size"),
        ({"max_batch_size": True}, TypeError, "max_batch_size"),
        ({"max_delay": -1}, ValueError, "max_delay"),
        ({"max_delay": math.inf}, ValueError, "max_delay"),
        ({"max_queue": 4, "max_batch_size": 8}, ValueError, "max_queue"),
        ({"max_queue": 0}, ValueError, "max_queue"),
        ({"preferred_batch_sizes": (4, 64)}, ValueError, "preferred_batch_sizes"),
        ({"preferred_batch_sizes": (0,)}, ValueError, "preferred_batch_sizes"),
        ({"max_concurrent_batches": 0}, ValueError, "max_concurrent_batches"),
        ({"timeout": 0}, ValueError, "timeout"),
        ({"timeout": "1"}, TypeError, "timeout"),
        ({"collate_fn": 3}, TypeError, "collate_fn"),
        ({"split_fn": "x"}, TypeError, "split_fn"),
        ({"num_workers": -1}, ValueError, "num_workers"),
        ({"num_workers": 1, "collate_in_thread": True}, ValueError, "collate_in_thread"),
        ({"num_workers": 1, "collate_fn": lambda b: (_LOCK, b)}, TypeError, "collate_fn"),
        ({"multiprocessing_context": "fork"}, ValueError, "multiprocessing_context"),
        ({"on_exit": "wait"}, ValueError, "on_exit"),
        ({"clock": 1.0}, TypeError, "clock"),
        # found by review: unnamed, or accepted
        ({"preferred_batch_sizes": 5}, TypeError, "preferred_batch_sizes"),
        ({"max_delay": "0.1"}, TypeError, "max_delay"),
        ({"timeout": math.inf}, ValueError, "timeout must be a positive, finite"),
        ({"collate_in_thread": "yes"}, TypeError, "collate_in_thread"),
        ({"pin_memory": "yes"}, TypeError, "pin_memory"),
    ],
)
def test_bad_arguments_name_the_argument(
    kwargs: dict[str, Any], error: type[Exception], name: str
) -> None:
    with pytest.raises(error, match=name):
        aioloader.DynamicBatcher(lambda b: b, **kwargs)


def test_model_fn_must_be_callable() -> None:
    with pytest.raises(TypeError, match="model_fn"):
        aioloader.DynamicBatcher(42)  # type: ignore[arg-type]  # the point of the test


def test_public_names() -> None:
    assert issubclass(aioloader.Overloaded, aioloader.AioLoaderError)
    assert issubclass(aioloader.Overloaded, RuntimeError)


# --------------------------------------------------------------------------------------------
# the async layer
# --------------------------------------------------------------------------------------------


def double_sync(batch: torch.Tensor) -> torch.Tensor:
    return batch * 2


async def double_async(batch: torch.Tensor) -> torch.Tensor:
    await anyio.lowlevel.checkpoint()
    return batch * 2


@pytest.mark.parametrize("model", [double_sync, double_async], ids=["sync", "async"])
async def test_each_of_1000_concurrent_callers_gets_its_own_result(model: Any) -> None:
    results: dict[int, Any] = {}

    async def call(i: int) -> None:
        results[i] = await batcher.submit(torch.tensor([i, -i]))

    batcher = aioloader.DynamicBatcher(model, max_batch_size=32, max_delay=0.001, max_queue=1000)
    async with batcher, anyio.create_task_group() as tg:
        for i in range(1000):
            tg.start_soon(call, i)
    assert {i: r.tolist() for i, r in results.items()} == {i: [2 * i, -2 * i] for i in range(1000)}
    s = batcher.statistics()
    assert s.completed == s.submitted == 1000
    assert sum(size * count for size, count in s.batch_sizes) == 1000
    assert max(size for size, _ in s.batch_sizes) == 32  # a crowd fills whole batches
    assert s.max_running == 1
    check_accounts(batcher)


async def gather(
    batcher: aioloader.DynamicBatcher, items: list[Any], **kwargs: Any
) -> dict[Any, Any]:
    """Submit every item concurrently (in this order); map each item to its outcome."""
    got: dict[Any, Any] = {}

    async def call(item: Any) -> None:
        got[item] = await outcome(lambda: batcher.submit(item, **kwargs))

    async with anyio.create_task_group() as tg:
        for item in items:
            tg.start_soon(call, item)
    return got


async def test_a_model_exception_goes_to_every_caller_of_its_batch_only() -> None:
    def model(batch: list[int]) -> list[int]:
        if 13 in batch:
            raise KeyError("bad batch")
        return batch

    batcher = lists(model, max_batch_size=4, max_delay=60.0)
    async with batcher:
        got = await gather(batcher, [10, 11, 12, 13, 20, 21, 22, 23])
    errors = [got[i] for i in (10, 11, 12, 13)]
    assert all(isinstance(e, KeyError) for e in errors)
    assert all(e is errors[0] for e in errors)  # the original object, its type kept
    assert any("stage 'model', batch 0" in n for n in errors[0].__notes__)
    assert [got[i] for i in (20, 21, 22, 23)] == [20, 21, 22, 23]
    s = batcher.statistics()
    assert (s.failed, s.completed, s.batches) == (4, 4, 2)
    check_accounts(batcher)


async def test_an_exception_returned_for_one_request_goes_to_its_caller_only() -> None:
    def model(batch: list[int]) -> list[Any]:
        return [ValueError(f"no answer for {x}") if x == 2 else x + 100 for x in batch]

    batcher = lists(model, max_batch_size=4, max_delay=60.0)
    async with batcher:
        got = await gather(batcher, [0, 1, 2, 3])
    assert [got[i] for i in (0, 1, 3)] == [100, 101, 103]
    assert isinstance(got[2], ValueError) and "no answer for 2" in str(got[2])
    assert any("request 2 of 4 only" in n for n in got[2].__notes__)
    assert batcher.statistics().failed == 1


async def test_a_split_with_the_wrong_count_fails_every_caller_of_the_batch() -> None:
    batcher = lists(lambda b: b, split_fn=lambda out, n: out[:-1], max_batch_size=3)
    async with batcher:
        got = await gather(batcher, [1, 2, 3])
    assert all(isinstance(e, ValueError) for e in got.values())
    assert "split_fn gave 2 outputs for a batch of 3 requests" in str(got[1])
    assert any("stage 'split'" in n for n in got[1].__notes__)


async def test_collate_failure_names_the_stage() -> None:
    batcher = aioloader.DynamicBatcher(lambda b: b, max_batch_size=1, max_delay=60.0)
    async with batcher:
        got = await gather(batcher, [object()])
    error = next(iter(got.values()))
    assert isinstance(error, TypeError)
    assert any("stage 'collate'" in n for n in error.__notes__)


async def test_a_batch_that_will_not_collate_is_split_and_only_the_bad_request_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by review: one client's malformed input (a shape that does not stack, an object
    that cannot be collated) failed every caller batched with it. The batch is split in
    halves down to single requests: the rest are served, in parts that collate."""
    calls: list[int] = []

    def model(batch: torch.Tensor) -> torch.Tensor:
        calls.append(len(batch))
        return batch.sum(dim=1)

    items = [torch.ones(3), torch.ones(3), torch.ones(4), object(), torch.ones(3)]
    batcher = aioloader.DynamicBatcher(model, max_batch_size=5, max_delay=60.0)
    async with batcher:
        got = await gather(batcher, items)
    outcomes = [got[item] for item in items]
    assert [float(x) for x in outcomes[:3]] == [3.0, 3.0, 4.0] and float(outcomes[4]) == 3.0
    error = outcomes[3]
    assert isinstance(error, TypeError)
    (note,) = [n for n in error.__notes__ if n.startswith("aioloader: failed")]
    assert "stage 'collate'" in note and "this request only" in note and "batch of 5" in note
    assert sum(calls) == 4 and len(calls) >= 2  # each served once, in parts
    stats = batcher.statistics()
    assert (stats.completed, stats.failed, stats.batches) == (4, 1, 1)
    # parts: one more than splits; each part a model call, but the bad request's alone
    assert stats.split == len(calls) >= 2
    (warning,) = [r for r in caplog.records if "would not collate" in r.getMessage()]
    assert "bucket_fn" in warning.getMessage() and warning.levelname == "WARNING"
    assert f"split {stats.split} times" in repr(stats)


async def test_a_caller_cancelled_before_its_batch_starts_is_withdrawn() -> None:
    model = Gated()
    batcher = lists(model, max_batch_size=1)
    async with batcher, anyio.create_task_group() as tg:
        tg.start_soon(batcher.submit, 1)
        await model.entered.wait()  # batch [1] runs and blocks
        tg.start_soon(batcher.submit, 2)
        leaving = anyio.CancelScope()

        async def leaves() -> None:
            with leaving:
                await batcher.submit(3)

        tg.start_soon(leaves)
        await settle()
        assert batcher.statistics().queued == 2
        leaving.cancel()
        await settle()
        assert batcher.statistics().queued == 1  # withdrawn at once, not at cut time
        model.gate.set()
    assert model.batches == [[1], [2]]  # 3 never reached the model
    s = batcher.statistics()
    assert (s.completed, s.cancelled) == (2, 1)
    check_accounts(batcher)


async def test_a_caller_cancelled_while_its_batch_runs_loses_only_its_result() -> None:
    model = Gated()
    batcher = lists(model, max_batch_size=2)
    results: list[int] = []
    async with batcher, anyio.create_task_group() as tg:
        leaving = anyio.CancelScope()

        async def leaves() -> None:
            with leaving:
                await batcher.submit(1)

        async def stays() -> None:
            results.append(await batcher.submit(2))

        tg.start_soon(leaves)
        tg.start_soon(stays)
        await model.entered.wait()
        assert model.batches == [[1, 2]]
        leaving.cancel()
        await settle()
        model.gate.set()
    assert results == [20]
    s = batcher.statistics()
    assert (s.completed, s.cancelled, s.batches) == (1, 1, 1)
    check_accounts(batcher)


async def test_a_deadline_in_the_queue_withdraws_the_request() -> None:
    model = Gated()
    batcher = lists(model, max_batch_size=1, timeout=30.0)
    async with batcher, anyio.create_task_group() as tg:
        tg.start_soon(batcher.submit, 1)
        await model.entered.wait()
        with pytest.raises(TimeoutError, match=r"within 0.01 s \(queued\)"):
            await batcher.submit(2, timeout=0.01)
        assert batcher.statistics().queued == 0
        model.gate.set()
    assert model.batches == [[1]]
    assert batcher.statistics().expired == 1
    check_accounts(batcher)


async def test_no_request_gives_up_before_its_deadline() -> None:
    """uvloop's timers count whole milliseconds and fired up to 1.5 ms early."""
    model = Gated()
    batcher = lists(model, max_batch_size=1)
    early: list[float] = []

    async def wait_out(limit: float) -> None:
        start = time.monotonic()  # the batcher's clock
        with pytest.raises(TimeoutError):
            await batcher.submit(2, timeout=limit)
        if time.monotonic() - start < limit:
            early.append(limit)

    async with batcher, anyio.create_task_group() as tg:
        tg.start_soon(batcher.submit, 1)  # the model holds it: the others wait in the queue
        await model.entered.wait()
        async with anyio.create_task_group() as waiting:
            for k in range(40):
                waiting.start_soon(wait_out, 0.0005 + k * 0.00037)
        model.gate.set()
    assert early == []
    assert batcher.statistics().expired == 40


async def test_a_deadline_fires_even_if_the_clock_disagrees() -> None:
    """A clock that never moves (a test's): the timer is the judge, as for the delay."""
    model = Gated()
    batcher = lists(model, max_batch_size=1, clock=FakeClock())
    async with batcher:
        with pytest.raises(TimeoutError, match="its batch was running"):
            await batcher.submit(1, timeout=0.02)
        model.gate.set()
    assert batcher.statistics().expired == 1


async def test_a_deadline_while_running_drops_the_result() -> None:
    model = Gated()
    batcher = lists(model, max_batch_size=1, timeout=0.01)  # the batcher-wide default
    async with batcher:
        with pytest.raises(TimeoutError, match="its batch was running"):
            await batcher.submit(1)
        assert model.batches == [[1]]
        model.gate.set()
    s = batcher.statistics()
    assert (s.expired, s.completed) == (1, 0)
    check_accounts(batcher)


async def test_a_request_found_expired_at_cut_time_is_skipped() -> None:
    clock = FakeClock()
    model = Gated(open_=True)
    batcher = lists(model, max_batch_size=2, max_delay=600.0, clock=clock)
    async with batcher, anyio.create_task_group() as tg:
        got: dict[int, Any] = {}

        async def call(item: int) -> None:
            got[item] = await outcome(lambda: batcher.submit(item, timeout=300.0))

        tg.start_soon(call, 1)
        await settle()
        clock.now = 400.0  # past request 1's deadline on the batcher's clock
        tg.start_soon(call, 2)  # the queue is full: a batch is cut now
    assert isinstance(got[1], TimeoutError) and got[2] == 20
    assert model.batches == [[2]]
    assert batcher.statistics().expired == 1


async def test_the_delay_timer_cuts_the_batch_even_if_the_clock_disagrees() -> None:
    clock = FakeClock()  # never moves: only the timer can say the delay is over
    batcher = lists(lambda b: b, max_batch_size=8, max_delay=0.01, clock=clock)
    async with batcher:
        got = await gather(batcher, [1, 2, 3])
    assert got == {1: 1, 2: 2, 3: 3}
    assert batcher.statistics().batch_sizes == ((3, 1),)


async def test_a_full_queue_refuses_at_once() -> None:
    model = Gated()
    batcher = lists(model, max_batch_size=1, max_queue=2)
    async with batcher, anyio.create_task_group() as tg:
        tg.start_soon(batcher.submit, 1)
        await model.entered.wait()
        tg.start_soon(batcher.submit, 2)
        tg.start_soon(batcher.submit, 3)
        await settle()
        with pytest.raises(aioloader.AioLoaderError, match="queue is full") as info:
            await batcher.submit(4)
        assert isinstance(info.value, aioloader.Overloaded)
        model.gate.set()
    s = batcher.statistics()
    assert (s.submitted, s.completed, s.rejected, s.max_queued) == (3, 3, 1, 2)


async def test_leaving_drains_the_queue_without_waiting_for_the_delay() -> None:
    batcher = lists(lambda b: [x + 1 for x in b], max_batch_size=8, max_delay=3600.0)
    async with anyio.create_task_group() as tg:
        got: dict[int, Any] = {}

        async def call(i: int) -> None:
            got[i] = await outcome(lambda: batcher.submit(i))

        async with batcher:
            for i in range(3):
                tg.start_soon(call, i)
            await settle()
            assert batcher.statistics().queued == 3
        assert got == {0: 1, 1: 2, 2: 3}  # served before the exit returned
    with pytest.raises(aioloader.LoaderStateError, match="not open"):
        await batcher.submit(9)
    check_accounts(batcher)


async def test_leaving_with_cancel_fails_waiting_and_running_requests() -> None:
    model = Gated()
    batcher = lists(model, max_batch_size=1, on_exit="cancel")
    got: dict[int, Any] = {}
    async with anyio.create_task_group() as tg:

        async def call(i: int) -> None:
            got[i] = await outcome(lambda: batcher.submit(i))

        async with batcher:
            for i in range(3):
                tg.start_soon(call, i)
            await model.entered.wait()
            await settle()
    assert all(isinstance(e, aioloader.LoaderStateError) for e in got.values()), got
    assert "was running" in str(got[0]) and "started" in str(got[1])
    s = batcher.statistics()
    assert (s.cancelled, s.completed) == (2, 0) and s.failed == 1
    check_accounts(batcher)


async def test_a_body_that_raises_cancels_rather_than_drains() -> None:
    model = Gated()
    batcher = lists(model, max_batch_size=1)
    got: dict[int, Any] = {}
    async with anyio.create_task_group() as tg:

        async def call(i: int) -> None:
            got[i] = await outcome(lambda: batcher.submit(i))

        with pytest.raises(OSError, match="body"):
            async with batcher:
                tg.start_soon(call, 1)
                await model.entered.wait()
                raise OSError("body")
    assert isinstance(got[1], aioloader.LoaderStateError)


async def test_submit_outside_the_scope_and_reentry() -> None:
    batcher = lists(lambda b: b)
    with pytest.raises(aioloader.LoaderStateError, match="async with batcher"):
        await batcher.submit(1)
    async with batcher:
        with pytest.raises(aioloader.LoaderStateError, match="already open"):
            await batcher.__aenter__()
        assert await batcher.submit(1) == 1
    async with batcher:  # a closed batcher opens again, with fresh statistics
        assert await batcher.submit(2) == 2
        assert batcher.statistics().submitted == 1


async def test_another_loop_is_refused_at_once_and_run_coroutine_threadsafe_serves() -> None:
    """Found by review: a submit from another thread's loop hung (its future was resolved from
    the batcher's thread, which never woke the caller's loop)."""
    batcher = lists(lambda b: [x * 10 for x in b])
    loop = asyncio.get_running_loop()

    def from_another_loop() -> tuple[str, int]:
        async def refused() -> str:
            try:
                await batcher.submit(1)
            except aioloader.LoaderStateError as exc:
                return str(exc)
            return "served"

        said = asyncio.run(refused())
        handed_over = asyncio.run_coroutine_threadsafe(batcher.submit(2), loop)
        return said, handed_over.result(timeout=10)

    with anyio.fail_after(20):
        async with batcher:
            said, served = await anyio.to_thread.run_sync(from_another_loop)
    assert "another event loop" in said and "run_coroutine_threadsafe" in said
    assert served == 20
    assert batcher.statistics().submitted == 1  # the refused one was never admitted


async def test_the_scope_is_closed_by_the_task_that_opened_it() -> None:
    """Another task's close is refused with the remedy (anyio's own message named no batcher);
    the scope stays open, serving, and its own task closes it."""
    batcher = lists(lambda b: b)
    opened, close = anyio.Event(), anyio.Event()

    async def owner() -> None:
        async with batcher:
            opened.set()
            await close.wait()

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(owner)
            await opened.wait()
            with pytest.raises(aioloader.LoaderStateError, match="closed by the task that opened"):
                await batcher.__aexit__(None, None, None)
            assert await batcher.submit(3) == 3  # still open, and serving
            close.set()
    with pytest.raises(aioloader.LoaderStateError, match="is not open"):
        await batcher.submit(4)


async def test_preferred_sizes_shape_the_batches_cut_from_a_backlog() -> None:
    model = Gated()
    batcher = lists(model, max_batch_size=8, preferred_batch_sizes=(2, 4))
    async with batcher, anyio.create_task_group() as tg:
        tg.start_soon(batcher.submit, 0)
        await model.entered.wait()
        for i in range(1, 8):
            tg.start_soon(batcher.submit, i)
        await settle()
        model.gate.set()
    assert [len(b) for b in model.batches] == [1, 4, 2, 1]
    assert [x for b in model.batches for x in b] == list(range(8))
    assert batcher.statistics().batch_sizes == ((1, 2), (2, 1), (4, 1))


async def test_max_concurrent_batches_bounds_the_batches_in_flight() -> None:
    model = Gated()
    batcher = lists(model, max_batch_size=1, max_concurrent_batches=2)
    async with batcher, anyio.create_task_group() as tg:
        for i in range(6):
            tg.start_soon(batcher.submit, i)
        await settle()
        s = batcher.statistics()
        assert (s.running, s.queued, model.running) == (2, 4, 2)
        model.gate.set()
    s = batcher.statistics()
    assert model.max_running == 2 and s.max_running == 2 and s.completed == 6


async def test_statistics_on_a_fake_clock() -> None:
    clock = FakeClock()
    batcher = lists(lambda b: b, max_batch_size=2, max_delay=600.0, clock=clock)
    async with batcher, anyio.create_task_group() as tg:
        tg.start_soon(batcher.submit, 1)
        await settle()
        clock.now = 0.25
        tg.start_soon(batcher.submit, 2)
    s = batcher.statistics()
    assert s.batch_sizes == ((2, 1),) and s.mean_batch_size == 2.0
    assert s.queue_wait.max == 0.25 and s.queue_wait.count == 2
    assert s.latency.count == 2 and s.latency.max == 0.25
    assert s.elapsed_s == 0.25
    text = repr(s)
    assert text.startswith("BatcherStatistics: 2 submitted")
    assert "2 completed" in text and "sizes (size:batches) 2:1" in text
    assert "queue wait" in text and "end to end" in text


async def test_collation_in_a_thread() -> None:
    batcher = aioloader.DynamicBatcher(double_async, max_batch_size=4, collate_in_thread=True)
    async with batcher:
        got = await gather(batcher, [1.0, 2.0, 3.0, 4.0])
    assert {k: v.item() for k, v in got.items()} == {1.0: 2.0, 2.0: 4.0, 3.0: 6.0, 4.0: 8.0}


async def test_collation_in_a_worker_process() -> None:
    batcher = aioloader.DynamicBatcher(double_sync, max_batch_size=4, max_delay=60.0, num_workers=1)
    async with batcher:
        got = await gather(batcher, [torch.full((3,), float(i)) for i in range(4)])
        s = batcher.statistics()
    assert sorted(v.tolist()[0] for v in got.values()) == [0.0, 2.0, 4.0, 6.0]
    assert s.workers is not None and s.workers.processes == 1 and s.workers.jobs == 1


# -- the device stage ---------------------------------------------------------------------------


async def test_batches_go_through_the_device_stage_before_the_model() -> None:
    fake = FakeAccelerator()
    seen: list[tuple[str, bool]] = []

    def model(batch: torch.Tensor) -> torch.Tensor:
        # The stage made the batch ready on this (the model's) thread before the call.
        seen.append((threading.current_thread().name, bool(fake.handed)))
        assert fake.handed[-1][0] == threading.get_ident()
        return batch * 2

    batcher = aioloader.DynamicBatcher(model, max_batch_size=4, max_delay=0.001)
    batcher._work.device = DevicePlan(lambda: fake, True, lambda b: b + 1)
    batcher._work._finish = None
    async with batcher:
        results = await asyncio.gather(*(batcher.submit(torch.tensor([i])) for i in range(8)))
    assert [r.item() for r in results] == [(i + 1) * 2 for i in range(8)]
    assert seen and all(name.startswith("aioloader-batcher") and handed for name, handed in seen)
    assert fake.pinned_sizes and fake.closed
    assert any(
        thread.startswith("aioloader-device") for what, thread in fake.calls if what == "record"
    )


async def test_device_cpu_runs_device_transform_on_the_host() -> None:
    batcher = aioloader.DynamicBatcher(
        lambda b: b, max_batch_size=2, max_delay=0.001, device="cpu", device_transform=torch.neg
    )
    async with batcher:
        assert (await batcher.submit(torch.tensor([3]))).item() == -3


def test_device_arguments_are_checked() -> None:
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda' needs CUDA"):
            aioloader.DynamicBatcher(lambda b: b, device="cuda")
        with pytest.warns(UserWarning, match="'pin_memory' argument is set as true but no accel"):
            aioloader.DynamicBatcher(lambda b: b, pin_memory=True)
    with pytest.raises(TypeError, match="device_transform"):
        aioloader.DynamicBatcher(lambda b: b, device_transform=3)  # type: ignore[arg-type]


async def test_host_device_transform_runs_where_collation_runs() -> None:
    threads: list[str] = []

    def transform(batch: torch.Tensor) -> torch.Tensor:
        threads.append(threading.current_thread().name)
        return batch + 1

    batcher = aioloader.DynamicBatcher(
        lambda b: b,
        max_batch_size=2,
        max_delay=0.001,
        collate_in_thread=True,
        device_transform=transform,
    )
    async with batcher:
        assert (await batcher.submit(torch.tensor([1]))).item() == 2
    assert threads and all(name.startswith("aioloader-batcher") for name in threads)


async def test_an_exception_raised_again_names_the_batch_it_failed_this_time() -> None:
    """Found by review: a model that keeps its load error and raises it at every call: the
    note still named batch 0 and its one caller at batch 2 with two."""
    kept = RuntimeError("the model did not load")

    def model(batch: list[int]) -> list[int]:
        raise kept

    async with lists(model, max_batch_size=2) as batcher:
        for expected in (
            "batch 0 (every caller of this batch of 1 gets it)",
            "batch 1 (every caller of this batch of 1 gets it)",
        ):
            with pytest.raises(RuntimeError) as caught:
                await batcher.submit(1)
            (note,) = [n for n in caught.value.__notes__ if n.startswith("aioloader: failed")]
            assert note.endswith(expected), note
