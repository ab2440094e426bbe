"""The dynamic batcher's runner tasks: collect a batch when the policy cuts one, run it, hand each
caller its outcome.

Owns: :class:`Dispatcher`, one scope's loop of ``max_concurrent_batches`` runner tasks: waiting
(on an event, with the policy's deadline) for a batch to be cut, taking it from the queue,
running it through :class:`~aioloader._serving.runner.BatchRunner` and settling each of its
requests (``RUNNING`` → ``DONE``, or dropped when its caller left), and failing what is still
queued when the scope closes without serving it. Never: decides when to cut
or how big (:mod:`aioloader._serving.policy`), runs collate/model/split itself
(:mod:`aioloader._serving.runner`), admits requests or opens the scope
(:mod:`aioloader._serving.batcher`), or polls.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import Any

import anyio

from .._base.exceptions import LoaderStateError, annotate
from .pending import BatchLimits, PendingQueue
from .policy import BatchPolicy, rearm_after_timer
from .request import DONE, GONE, RUNNING, Request
from .runner import BatchRunner
from .stats import BatcherRecorder

__all__ = ["CUT_TURNS", "Dispatcher"]

logger = logging.getLogger("aioloader")

CUT_TURNS = 2
"""Loop turns a batch cut by ``max_delay`` waits, so that the requests which the turn the delay
ends in sets going are in it. Two: a caller woken in that turn (by a socket read, a timer), or
started as a task by that turn's callback, submits on the next turn; a task woken in that turn
that starts the task which submits (a connection's task spawning a handler task per request;
the benchmark's load, a sleeping driver creating a task per request) submits on the turn after.
Measured in process on uvloop against Ray Serve's ``@serve.batch`` with the same arrivals
(issue 29): one turn left 2-3% fewer requests in a batch than Ray's; two, as many or up to 4%
more, at a median latency within 0.3 ms."""


class Dispatcher:
    """The runner tasks of one scope of a batcher: its queue and recorder, the event a runner
    waiting for requests waits on (:meth:`wake` sets it), and ``is_open``: whether the scope is
    still open (not closing)."""

    def __init__(
        self,
        queue: PendingQueue[Request],
        rec: BatcherRecorder,
        *,
        policy: BatchPolicy,
        limits: BatchLimits,
        work: BatchRunner,
        clock: Callable[[], float],
        is_open: Callable[[], bool],
    ) -> None:
        self._queue = queue
        self._rec = rec
        self._policy = policy
        self._limits = limits
        self._work = work
        self._clock = clock
        self._is_open = is_open
        self._waiter: asyncio.Future[bool] | None = None  # the collecting runner's wait
        self._runners: set[anyio.CancelScope] = set()  # each runner task's own scope
        self._stopped = False

    def wake(self) -> None:
        """Tell the runner collecting a batch to look again (a request arrived, a batch became
        full, or the scope is closing)."""
        _resolve(self._waiter, False)

    def cancel_waiting(self) -> None:
        """Fail every request still queued: the scope is closing without serving them."""
        waiting = self._queue.take_all()
        if not waiting:
            return
        error = LoaderStateError(
            "the batcher closed (on_exit='cancel', or its scope failed or was cancelled) "
            "before this request's batch started"
        )
        for request in waiting:
            request.state = GONE
            self._rec.cancelled += 1
            request.resolve(None, error)

    def stop(self) -> None:
        """Cancel the runner tasks (the scope closing with ``on_exit="cancel"``, or failing):
        each in a cancel scope of its own, not through their task group's, whose host is the
        task that closes the batcher. A task already being cancelled (aiohttp runs its
        ``cleanup_ctx`` in the ``finally`` of its cancelled main task) closing it would see the
        task group's cancellation taken for its own, and raised: found by review."""
        self._stopped = True
        for scope in self._runners:
            scope.cancel()

    async def runner(self, cutting: anyio.Lock) -> None:
        """Collect a batch (one runner at a time, under ``cutting``), run it, repeat; return once
        closing with nothing left, or stopped (:meth:`stop`). ``max_concurrent_batches``
        runners bound the batches in flight structurally, and a runner only collects while it
        is free, so requests that arrive while every runner is busy join the next batch."""
        with anyio.CancelScope() as scope:
            if self._stopped:  # stopped before this task began
                scope.cancel()
            self._runners.add(scope)
            try:
                while True:
                    async with cutting:
                        requests = await self._next_batch()
                    if requests is None:
                        return
                    await self._run(requests)
            finally:
                self._runners.discard(scope)

    async def _next_batch(self) -> list[Request] | None:
        """Wait until the policy cuts a batch and take it; None once closing with none left.

        A batch cut because its oldest request's ``max_delay`` is up (not because it is full)
        is cut :data:`CUT_TURNS` loop turns later: requests that the turn the delay ends in
        sets going (woken by the same poll as the timer) join it instead of starting the next,
        smaller batch; those turns are taken once per batch. A timer that fired before the
        delay was up on the batcher's clock is re-armed (:func:`policy.rearm_after_timer`)."""
        queue, policy = self._queue, self._policy
        fired = -math.inf  # the last deadline whose timer fired: it is due, whatever the clock
        turned = False  # this batch's extra loop turns are taken
        rearms, again = 0, 0.0  # an early timer's waits again (policy.rearm_after_timer)
        armed_for: float | None = None  # the deadline they are for
        while True:
            now = max(self._clock(), fired)
            closing = not self._is_open()
            decision = policy.choose(queue, now, flush=closing)
            if decision.size:
                if not (turned or closing or queue.next_batch(decision.bucket)[1]):
                    turned = True
                    for _ in range(CUT_TURNS):  # what this turn set going runs before the cut
                        await asyncio.sleep(0)
                    continue
                requests, expired = queue.take(decision.size, now, decision.bucket)
                for request in expired:  # its caller's own deadline is about to fire too
                    request.state = GONE
                    self._rec.expired += 1
                    request.resolve(None, TimeoutError("request expired in the queue"))
                if requests := self._callers_left(requests):
                    return requests
                continue
            if closing:
                return None
            # The delay timer is a deadline on this wait, not a poll: submit() wakes it when
            # the queue's first request arrives or a batch becomes full.
            if decision.wake_at != armed_for:  # another oldest request: its own timer
                rearms, again, armed_for = 0, 0.0, decision.wake_at
            delay = None if decision.wake_at is None else max(decision.wake_at - now, again)
            if await self._wait(delay) and decision.wake_at is not None:
                # The loop's timer and the batcher's clock need not agree to the microsecond:
                # uvloop's fires up to 1.5 ms early, and a test's clock may not move at all. A
                # near miss waits again (never less than a millisecond: no spin); further
                # off, or re-armed MAX_REARMS times, the timer is trusted.
                rearm = rearm_after_timer(decision.wake_at - self._clock(), rearms)
                if rearm is None:
                    fired = decision.wake_at
                else:
                    rearms, again = rearms + 1, rearm

    def _callers_left(self, requests: list[Request]) -> list[Request]:
        """``requests`` but those whose caller was cancelled since it last ran (its future is
        cancelled as the task is; ``submit`` withdraws it only once the task runs again, which
        may be after this turn's cut): withdrawn here, counted once, never run."""
        if not any(request.future.cancelled() for request in requests):
            return requests
        left = []
        for request in requests:
            if request.future.cancelled():
                request.state = GONE
                self._rec.cancelled += 1
                if request.timer is not None:
                    request.timer.cancel()
            else:
                left.append(request)
        return left

    async def _wait(self, delay: float | None) -> bool:
        """Wait for :meth:`wake`, or ``delay`` seconds (None: no limit); True if the delay ran
        out. A bare future and one ``call_later``, as each request's deadline is: an anyio
        cancel scope's timeout re-checks the loop's clock when it fires and, with under half a
        millisecond left on uvloop, re-arms itself with ``call_soon`` until the next tick (a
        spin: measured, 230-440 callbacks a wait).

        Cancellation: the timer is cancelled and the cancellation goes on."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        self._waiter = waiter
        timer = None if delay is None else loop.call_later(delay, _resolve, waiter, True)
        try:
            return await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    async def _run(self, requests: list[Request]) -> None:
        """Collate, run and split one batch, and give each caller its outcome.

        Cancellation (the scope closing with ``on_exit="cancel"``): the batch's callers get
        :class:`LoaderStateError`; a running thread or worker job is waited for first (see
        ``_workers/offload.py`` and ``_workers/processes.py``).
        """
        rec, n = self._rec, len(requests)
        started = self._clock()
        seq = rec.batch_started(n)
        if rec.cost is not None:
            limits = self._limits
            rec.cost.batch([r.cost for r in requests], limits.max_batch_cost, limits.padded)
        for request in requests:
            request.state = RUNNING
            rec.waited(started - request.enqueued_at)
        try:
            items = [r.item for r in requests]
            outcomes = await self._work.run_each(items, seq, None, self._split)
        except BaseException:
            error = LoaderStateError(
                f"the batcher closed (on_exit='cancel', or its scope failed or was cancelled) "
                f"while this request's batch {seq} was running"
            )
            for request in requests:
                self._settle(request, None, error)
            raise
        else:
            for position, (request, (ok, out)) in enumerate(zip(requests, outcomes, strict=True)):
                if not ok:  # noted with the stage and batch (or part) it failed in
                    self._settle(request, None, out)
                elif isinstance(out, Exception):
                    annotate(out, "model", batch=seq, detail=f"request {position} of {n} only")
                    self._settle(request, None, out)
                else:
                    self._settle(request, out, None)
        finally:
            rec.batch_finished(self._clock() - started)

    def _split(self, size: int, error: BaseException) -> None:
        """A part of ``size`` requests would not collate and was split: counted, and said once
        a scope (a batcher that splits every batch serves at a fraction of its rate)."""
        self._rec.split += 1
        if self._rec.split == 1:
            logger.warning(
                "aioloader: DynamicBatcher: a batch of %d requests would not collate (%s: %s); "
                "it is split in halves down to the requests that collate together, a model "
                "call each part. If inputs differ in shape, pad them in collate_fn or batch "
                "by shape with bucket_fn=lambda x: tuple(x.shape) (in dtype: convert them as "
                "they are submitted, or bucket by dtype too); statistics().split counts the "
                "splits",
                size, type(error).__name__, error,
            )  # fmt: skip

    def _settle(self, request: Request, value: Any, error: BaseException | None) -> None:
        if request.state != RUNNING or request.future.cancelled():
            return  # its caller left (or, cancelled, is leaving: it counts that): dropped
        request.state = DONE
        self._rec.served(self._clock() - request.enqueued_at, ok=error is None)
        request.resolve(value, error)


def _resolve(waiter: asyncio.Future[bool] | None, timed_out: bool) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(timed_out)
