"""``aioloader.DynamicBatcher``: single requests in, batches through a model, one result out each.

Owns: the batcher's scope (its task group and runner tasks), admission, each request's life
(queued, deadline, cancellation) and handing every caller its own outcome. Never: decides when
to cut a batch or how big (:mod:`aioloader._serving.policy`), runs collate/model/split itself
(:mod:`aioloader._serving.runner`), or polls (a runner waits on an event with the policy's
deadline).

A request's life: ``WAITING`` in the queue → ``RUNNING`` in a batch → ``DONE`` (outcome set), or
``GONE`` (withdrawn, expired, cancelled or abandoned: counted once, by whoever moved it there).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import math
import multiprocessing.context
import time
from collections.abc import Callable, Hashable, Sequence
from types import TracebackType
from typing import Any, Final, Literal

import anyio
import anyio.abc
import torch

from .._base.exceptions import LoaderStateError, Overloaded, annotate
from .._data.collate import default_collate
from .._workers.processes import start_method_of
from .pending import BatchLimits, PendingQueue, bucket_of, cost_of
from .policy import BatchPolicy, check_arguments, check_timeout, default_split
from .runner import BatchRunner, device_plan_of
from .stats import BatcherRecorder, BatcherStatistics

__all__ = ["DynamicBatcher"]

_WAITING, _RUNNING, _DONE, _GONE = "waiting", "running", "done", "gone"


class _Default(enum.Enum):
    """The type of ``submit``'s default ``timeout``: the batcher's own."""

    TIMEOUT = "the batcher's timeout"


_USE_DEFAULT: Final = _Default.TIMEOUT


class _Request:
    """One caller's request; its outcome arrives through ``future``.

    A bare asyncio future and timer handle rather than an anyio event and cancel scope: they
    are what every request pays for, and cost a few microseconds instead of tens. Each raise of
    a future's exception starts from the traceback it was set with, so when every caller of a
    batch gets the same exception object, one caller's frames don't pile onto another's.
    """

    __slots__ = ("bucket", "cost", "deadline", "enqueued_at", "future", "item", "state", "timer")

    def __init__(
        self,
        item: Any,
        enqueued_at: float,
        deadline: float,
        future: asyncio.Future[Any],
        cost: float,
        bucket: Hashable,
    ) -> None:
        self.item = item
        self.enqueued_at = enqueued_at
        self.deadline = deadline
        self.future = future
        self.cost = cost
        self.bucket = bucket
        self.state = _WAITING
        self.timer: asyncio.TimerHandle | None = None

    def resolve(self, value: Any, error: BaseException | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if not self.future.done():
            if error is None:
                self.future.set_result(value)
            else:
                self.future.set_exception(error)


class DynamicBatcher:
    """Coalesce concurrent single requests into batches for a model (serving-side batching).

    ::

        async with DynamicBatcher(model, max_batch_size=32, max_delay=0.005) as batcher:
            result = await batcher.submit(sample)   # from many concurrent request handlers

    A batch is cut as soon as ``max_batch_size`` requests wait (or the next would pass
    ``max_batch_cost``), or once the oldest has waited ``max_delay``; then its size is the
    largest of ``preferred_batch_sizes`` that fits, else everything that fits. Requests ready
    in the loop turn the delay ends in still join (the cut waits one turn, no more). While
    ``max_concurrent_batches`` batches run, requests accumulate, so under load batches grow by
    themselves. A batch is collated (``collate_fn``), passed to ``model_fn``, and the output
    split back per request (``split_fn``).

    Batching by cost (text, embeddings: a batch's price is its tokens, not its count)::

        DynamicBatcher(model, max_batch_size=64, max_batch_cost=8192, cost_fn=len,
                       padded_cost=True, bucket_fn=lambda x: (len(x) - 1).bit_length())

    A batch takes waiting requests oldest first while its cost stays within ``max_batch_cost``
    (the sum of ``cost_fn`` over its requests, or with ``padded_cost=True`` its size times its
    largest request's cost). A request whose own cost is over ``max_batch_cost`` is not
    refused: it runs in a batch of its own (counted in ``statistics().cost.over_limit``). With
    ``bucket_fn`` a batch takes requests of one bucket only (e.g. lengths within a power of two,
    so a padded batch pads little); the oldest request's bucket goes first, and ``max_delay``
    still bounds every request's wait for its batch to be cut.

    Failures: an exception from ``collate_fn``, ``model_fn`` or ``split_fn`` (or a split
    giving the wrong number of outputs) goes to every caller of that batch, with a note naming
    the stage and the batch. A failure of one request only: make ``model_fn``'s output split to
    an ``Exception`` instance at that request's position (e.g. return a list); only that caller
    gets it raised.

    Leaving ``async with``: with ``on_exit="drain"`` (the default) no new request is admitted
    and everything already admitted is batched without waiting for ``max_delay`` and served
    before the exit returns; with ``on_exit="cancel"``, or when the body raises or is cancelled,
    waiting requests fail at once and running batches are cancelled (a blocking ``model_fn``
    can't be interrupted: its thread is waited for and its result dropped), their callers
    getting :class:`~aioloader.LoaderStateError`. Either way every admitted caller has its
    outcome, and no task, thread or process of the batcher is left, when the exit returns.

    Args:
        model_fn: Called with a collated batch; returns the batch's output. A plain function
            runs in one of the batcher's threads (off the event loop), except that with one
            batch at a time and no ``device``, while its calls have been taking under 1 ms
            (by ``clock``), it is called on the loop: a thread hop costs more than that. An
            ``async def`` function (or an object with an ``async def __call__``) is awaited
            on the loop.
        max_batch_size: The most requests in one batch.
        max_delay: Seconds the oldest waiting request may wait for others to join its batch.
        max_queue: The most requests that may wait for a batch; a submission beyond it is
            refused at once with :class:`~aioloader.Overloaded`. At least ``max_batch_size``.
        preferred_batch_sizes: Batch sizes to prefer (those a compiled model or a CUDA graph
            was captured for), each at most ``max_batch_size``.
        max_concurrent_batches: The most batches running at once.
        timeout: Default seconds a request may take from submission to its outcome (None: no
            limit); ``submit(..., timeout=...)`` overrides it.
        collate_fn: Turns the list of submitted items into the model's input (default
            :func:`~aioloader.default_collate`).
        split_fn: ``split_fn(output, n)`` returns the ``n`` per-request outputs (default: rows
            of a tensor along dimension 0; a list as is; mappings and tuples of those, split
            element-wise).
        collate_in_thread: Collate in the batcher's threads rather than on the event loop
            (for heavy collation; light collation is faster inline).
        num_workers: Collate in this many worker processes instead (``collate_fn`` must
            pickle; items travel pickled, batch tensors come back through shared memory).
        multiprocessing_context: The workers' start method, as the loader takes it: a name
            (``"forkserver"``, the default, or ``"spawn"``) or a multiprocessing context.
        on_exit: ``"drain"`` or ``"cancel"``: what leaving ``async with`` does to requests
            not yet served (see above).
        device: Move each collated batch to this device before ``model_fn`` sees it (the
            loader's device stage: ``"cuda"``, ``"cuda:N"``, a ``torch.device``; ``"cpu"`` or
            None: no stage). The copy runs on a dedicated CUDA stream and the stream
            ``model_fn`` runs on waits for it; outputs are split as they come (on the device).
        pin_memory: Copy through the stage's pool of pinned buffers (with a CUDA ``device``).
        device_transform: Applied to the batch on the device, on the side stream, after the
            copy (e.g. uint8 to normalised float).
        clock: The clock for queue times, deadlines and statistics (seconds, monotonic).
        cost_fn: ``cost_fn(item)`` is one request's cost (tokens, pixels): a number >= 0,
            called once in ``submit``. Alone it only fills ``statistics().cost``.
        max_batch_cost: The most cost in one batch (needs ``cost_fn``; None: no limit).
        padded_cost: A batch costs its size times its largest request's cost (what a model
            that pads pays), not the sum (needs ``cost_fn``).
        bucket_fn: ``bucket_fn(item)`` is a hashable key, called once in ``submit``; a batch
            holds requests of one key only.

    Raises:
        ValueError: An argument is out of range or unknown (the message names it),
            ``max_batch_cost`` or ``padded_cost`` is given without ``cost_fn``, or ``device``
            names CUDA while CUDA is not available.
        TypeError: A function argument is not callable, ``max_batch_cost`` is not a number,
            or ``collate_fn`` does not pickle while ``num_workers > 0``.
    """

    def __init__(
        self,
        model_fn: Callable[[Any], Any],
        *,
        max_batch_size: int = 32,
        max_delay: float = 0.005,
        max_queue: int = 1024,
        preferred_batch_sizes: Sequence[int] = (),
        max_concurrent_batches: int = 1,
        timeout: float | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        split_fn: Callable[[Any, int], Sequence[Any]] | None = None,
        collate_in_thread: bool = False,
        num_workers: int = 0,
        multiprocessing_context: str | multiprocessing.context.BaseContext | None = None,
        on_exit: Literal["drain", "cancel"] = "drain",
        device: str | torch.device | None = None,
        pin_memory: bool = False,
        device_transform: Callable[[Any], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        cost_fn: Callable[[Any], float] | None = None,
        max_batch_cost: float | None = None,
        padded_cost: bool = False,
        bucket_fn: Callable[[Any], Hashable] | None = None,
    ) -> None:
        self.policy = BatchPolicy(max_batch_size, max_delay, tuple(preferred_batch_sizes))
        start_method = start_method_of(multiprocessing_context)  # the loader's rule: never fork
        check_arguments(
            model_fn=model_fn,
            max_batch_size=max_batch_size,
            max_queue=max_queue,
            max_concurrent_batches=max_concurrent_batches,
            collate_fn=collate_fn,
            split_fn=split_fn,
            collate_in_thread=collate_in_thread,
            num_workers=num_workers,
            on_exit=on_exit,
            clock=clock,
            cost_fn=cost_fn,
            bucket_fn=bucket_fn,
            max_batch_cost=max_batch_cost,
            padded_cost=padded_cost,
        )
        self.limits = BatchLimits(max_batch_size, max_batch_cost, padded_cost)
        self.cost_fn = cost_fn
        self.bucket_fn = bucket_fn
        self.max_queue = max_queue
        self.max_concurrent_batches = max_concurrent_batches
        self.timeout = check_timeout("timeout", timeout)
        self.on_exit = on_exit
        self._work = BatchRunner(
            model_fn,
            collate_fn or default_collate,
            split_fn or default_split,
            collate_in_thread=collate_in_thread,
            num_workers=num_workers,
            start_method=start_method,
            concurrency=max_concurrent_batches,
            device=device_plan_of(device, pin_memory=pin_memory, transform=device_transform),
            host_transform=device_transform,
            clock=clock,
        )
        self._clock = clock
        self._state = "new"  # new -> open -> closing -> closed (-> open again)
        self._queue: PendingQueue[_Request] = PendingQueue(max_queue, self.limits)
        self._rec = self._recorder()
        self._stack: contextlib.AsyncExitStack | None = None
        self._cancel_scope: anyio.CancelScope | None = None
        self._arrived: anyio.Event | None = None  # set when the runner collecting should look

    # -- scope -----------------------------------------------------------------------------------

    async def __aenter__(self) -> DynamicBatcher:
        """Open the batcher's scope: start its runner tasks (and collation processes, which have
        started when this returns).

        Raises:
            LoaderStateError: The scope is already open.
            WorkerCrashed: A collation process died while starting.

        Cancellation: whatever was started is stopped again before the cancellation goes on.
        """
        if self._state in ("open", "closing"):
            raise LoaderStateError("this batcher's scope is already open; it cannot be re-entered")
        self._queue = PendingQueue(self.max_queue, self.limits)
        self._rec = self._recorder()
        self._arrived = anyio.Event()
        stack = contextlib.AsyncExitStack()
        try:
            await self._work.open(stack, self._rec.workers)
            # Runs after the task group is gone: no admitted caller is left without an outcome.
            stack.callback(self._cancel_waiting)
            tg = await stack.enter_async_context(anyio.create_task_group())
            cutting = anyio.Lock()
            for i in range(self.max_concurrent_batches):
                tg.start_soon(self._runner, cutting, name=f"aioloader-batcher-runner-{i}")
        except BaseException:
            with anyio.CancelScope(shield=True):
                await stack.aclose()
            raise
        self._stack, self._cancel_scope = stack, tg.cancel_scope
        self._state = "open"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the scope: drain or cancel the requests not yet served (see the class), then
        wait for every task, thread and process of the batcher.

        Cancellation: a drain that is cancelled turns into a cancel; the tasks, threads and
        processes are still waited for, and every admitted caller still gets an outcome.
        """
        stack, scope = self._stack, self._cancel_scope
        if self._state != "open" or stack is None or scope is None:
            return
        self._state = "closing"
        if self.on_exit == "cancel" or exc_type is not None:
            self._cancel_waiting()
            scope.cancel()
        self._wake()  # a runner waiting for requests must see the closing
        try:
            await stack.aclose()  # the body's exception stays the caller's: not passed in
        finally:
            self._state = "closed"
            self._rec.stopped = self._clock()
            self._stack = self._cancel_scope = None

    def _recorder(self) -> BatcherRecorder:
        rec = BatcherRecorder(self._clock())
        if self.cost_fn is not None:
            rec.track_cost()
        return rec

    def statistics(self) -> BatcherStatistics:
        """A frozen snapshot of the batcher's counters, cumulative over its current (or last)
        scope."""
        return self._rec.snapshot(self._clock(), self._queue)

    # -- callers ---------------------------------------------------------------------------------

    async def submit(
        self,
        item: Any,
        *,
        timeout: float | _Default | None = _USE_DEFAULT,  # noqa: ASYNC109  # see below
    ) -> Any:
        """Queue ``item`` for the next batch and return its own output.

        Args:
            item: One request's input (one sample, as ``collate_fn`` expects).
            timeout: Seconds until the request gives up (default: the batcher's ``timeout``;
                None: no limit). A parameter rather than an outer ``anyio.fail_after``: the
                batcher then knows the deadline, skips the request at cut time once it has
                passed, and counts it as expired rather than cancelled.

        Returns:
            This request's element of the split model output.

        Raises:
            Overloaded: ``max_queue`` requests already wait; raised at once.
            TimeoutError: The deadline passed before the outcome (a queued request is withdrawn;
                a running one's result is dropped).
            LoaderStateError: The batcher's scope is not open (or is closing), or it closed
                with ``on_exit="cancel"`` (or was cancelled) before this request was served.
            ValueError: ``timeout`` is not a positive number or None, or ``cost_fn`` returned
                a negative or non-finite cost.
            TypeError: ``cost_fn`` returned something other than a number, or ``bucket_fn``
                an unhashable key.
            Exception: What ``cost_fn`` or ``bucket_fn`` raised (the request is not admitted),
                or what ``collate_fn``, ``model_fn`` or ``split_fn`` raised for this
                request's batch, or the exception instance the model returned for this request.

        Cancellation: a queued request is withdrawn (it never reaches the model); in a batch
        already running, its result is dropped. Other callers are unaffected.
        """
        if self._state != "open":
            where = "is closing" if self._state == "closing" else "is not open"
            raise LoaderStateError(
                f"DynamicBatcher.submit(): the batcher's scope {where}; submit inside "
                "`async with batcher:`"
            )
        limit = self.timeout if timeout is _USE_DEFAULT else check_timeout("timeout", timeout)
        cost = 0.0 if self.cost_fn is None else cost_of(self.cost_fn, item)
        bucket = None if self.bucket_fn is None else bucket_of(self.bucket_fn, item)
        now = self._clock()
        loop = asyncio.get_running_loop()
        deadline = math.inf if limit is None else now + limit
        request = _Request(item, now, deadline, loop.create_future(), cost, bucket)
        try:
            changed = self._queue.push(request)  # the first to wait, or its batch is now full
        except Overloaded:
            self._rec.rejected += 1
            raise
        self._rec.submitted += 1
        if limit is not None:
            request.timer = loop.call_later(limit, self._expire, request, limit)
        if changed:  # only these change the decision
            self._wake()
        try:
            return await request.future
        except asyncio.CancelledError:  # the caller went away
            self._leave(request, expired=False)
            future = request.future
            if future.done() and not future.cancelled():
                future.exception()  # an outcome that came too late: mark it seen, not leaked
            raise

    def _expire(self, request: _Request, limit: float) -> None:
        """The request's deadline passed (a timer callback on the loop)."""
        was = request.state
        if was in (_DONE, _GONE):
            return
        self._leave(request, expired=True)
        where = "its batch was running: the result is dropped" if was == _RUNNING else "queued"
        request.resolve(None, TimeoutError(f"request not served within {limit} s ({where})"))

    def _leave(self, request: _Request, *, expired: bool) -> None:
        """The caller gives up on ``request``: withdraw it if queued; drop its result if not."""
        if request.state in (_DONE, _GONE):
            return
        if request.state == _WAITING:
            self._queue.withdraw(request)
        request.state = _GONE
        if request.timer is not None:
            request.timer.cancel()
        if expired:
            self._rec.expired += 1
        else:
            self._rec.cancelled += 1

    def _wake(self) -> None:
        if self._arrived is not None:
            self._arrived.set()

    def _cancel_waiting(self) -> None:
        waiting = self._queue.take_all()
        if not waiting:
            return
        error = LoaderStateError(
            "the batcher closed (on_exit='cancel', or its scope failed or was cancelled) "
            "before this request's batch started"
        )
        for request in waiting:
            request.state = _GONE
            self._rec.cancelled += 1
            request.resolve(None, error)

    # -- runners ---------------------------------------------------------------------------------

    async def _runner(self, cutting: anyio.Lock) -> None:
        """Collect a batch (one runner at a time, under ``cutting``), run it, repeat; return once
        closing with nothing left. ``max_concurrent_batches`` runners bound the batches in
        flight structurally, and a runner only collects while it is free, so requests that
        arrive while every runner is busy join the next batch."""
        while True:
            async with cutting:
                requests = await self._next_batch()
            if requests is None:
                return
            await self._run(requests)

    async def _next_batch(self) -> list[_Request] | None:
        """Wait until the policy cuts a batch and take it; None once closing with none left.

        A batch cut because its oldest request's ``max_delay`` is up (not because it is full)
        is cut one loop turn later: requests whose ``submit`` is ready in the turn the delay
        ends in (woken by the same poll as the timer) join it instead of starting the next,
        smaller batch. One turn, once per batch: the wait is not extended further."""
        queue, policy = self._queue, self.policy
        fired = -math.inf  # the last deadline whose timer fired: it is due, whatever the clock
        turned = False  # this batch's one extra loop turn is taken
        while True:
            now = max(self._clock(), fired)
            closing = self._state != "open"
            decision = policy.choose(queue, now, flush=closing)
            if decision.size:
                if not (turned or closing or queue.next_batch(decision.bucket)[1]):
                    turned = True
                    await asyncio.sleep(0)  # what is ready this turn runs before the cut
                    continue
                requests, expired = queue.take(decision.size, now, decision.bucket)
                for request in expired:  # its caller's own deadline is about to fire too
                    request.state = _GONE
                    self._rec.expired += 1
                    request.resolve(None, TimeoutError("request expired in the queue"))
                if requests:
                    return requests
                continue
            if closing:
                return None
            # The delay timer is a deadline on this wait, not a poll: submit() sets the event
            # when the queue's first request arrives or it reaches max_batch_size.
            self._arrived = arrived = anyio.Event()
            delay = None if decision.wake_at is None else decision.wake_at - now
            with anyio.move_on_after(delay) as timer:
                await arrived.wait()
            if timer.cancelled_caught and decision.wake_at is not None:
                # The loop's timer and the batcher's clock need not agree to the microsecond
                # (uvloop's is millisecond-grained; a test's clock may not move at all):
                # trusting the timer keeps a near miss from turning into a spin.
                fired = decision.wake_at

    async def _run(self, requests: list[_Request]) -> None:
        """Collate, run and split one batch, and give each caller its outcome.

        Cancellation (the scope closing with ``on_exit="cancel"``): the batch's callers get
        :class:`LoaderStateError`; a running thread or worker job is waited for first (see
        ``_workers/offload.py`` and ``_workers/processes.py``).
        """
        rec, n = self._rec, len(requests)
        started = self._clock()
        seq = rec.batch_started(n)
        if rec.cost is not None:
            limits = self.limits
            rec.cost.batch([r.cost for r in requests], limits.max_batch_cost, limits.padded)
        for request in requests:
            request.state = _RUNNING
            rec.waited(started - request.enqueued_at)
        try:
            outputs = await self._work.run([r.item for r in requests], seq)
        except Exception as exc:  # noted with the stage and batch: every caller gets it
            for request in requests:
                self._settle(request, None, exc)
        except BaseException:
            error = LoaderStateError(
                f"the batcher closed (on_exit='cancel', or its scope failed or was cancelled) "
                f"while this request's batch {seq} was running"
            )
            for request in requests:
                self._settle(request, None, error)
            raise
        else:
            for position, (request, out) in enumerate(zip(requests, outputs, strict=True)):
                if isinstance(out, Exception):
                    annotate(out, "model", batch=seq, detail=f"request {position} of {n} only")
                    self._settle(request, None, out)
                else:
                    self._settle(request, out, None)
        finally:
            rec.batch_finished(self._clock() - started)

    def _settle(self, request: _Request, value: Any, error: BaseException | None) -> None:
        if request.state != _RUNNING:  # its caller left: the result is dropped
            return
        request.state = _DONE
        self._rec.served(self._clock() - request.enqueued_at, ok=error is None)
        request.resolve(value, error)
