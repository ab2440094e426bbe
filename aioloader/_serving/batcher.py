"""``aioloader.DynamicBatcher``: single requests in, batches through a model, one result out each.

Owns: the batcher's public surface and its docstrings; its scope (its task group, the runner
tasks started in it), admission, and a request's life on its caller's side (queued, deadline,
cancellation). Never: decides when to cut a batch or how big (:mod:`aioloader._serving.policy`),
collects and runs batches (the runner tasks, :mod:`aioloader._serving.dispatch`), runs
collate/model/split itself (:mod:`aioloader._serving.runner`), or polls.

A request's life (``request.py``): ``WAITING`` in the queue → ``RUNNING`` in a batch → ``DONE``,
or ``GONE`` (withdrawn, expired, cancelled or abandoned: counted once, by whoever moved it there).
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

from .._base.exceptions import LoaderStateError, Overloaded
from .._workers.serverstart import start_method_of
from .alike import collate_alike
from .dispatch import Dispatcher
from .owner import Owner
from .pending import BatchLimits, PendingQueue, bucket_of, cost_of
from .policy import (
    BatchPolicy,
    check_arguments,
    check_timeout,
    default_split,
    rearm_after_timer,
    sizes_of,
)
from .request import DONE, GONE, RUNNING, WAITING, Request
from .runner import BatchRunner, device_plan_of
from .stats import BatcherRecorder, BatcherStatistics

__all__ = ["DynamicBatcher"]


class _Default(enum.Enum):
    """The type of ``submit``'s default ``timeout``: the batcher's own."""

    TIMEOUT = "the batcher's timeout"


_USE_DEFAULT: Final = _Default.TIMEOUT


class DynamicBatcher:
    """Coalesce concurrent single requests into batches for a model (serving-side batching).

    ::

        async with DynamicBatcher(model, max_batch_size=32, max_delay=0.005) as batcher:
            result = await batcher.submit(sample)   # from many concurrent request handlers

    A batch is cut as soon as ``max_batch_size`` requests wait (or the next would pass
    ``max_batch_cost``), or once the oldest has waited ``max_delay``; then its size is the
    largest of ``preferred_batch_sizes`` that fits, else everything that fits. A batch cut by
    the delay is never cut before it on ``clock`` (a loop whose timers count whole
    milliseconds, uvloop's, may cut up to a millisecond after it), and requests that the loop
    turn the delay ends in sets going still join (the cut waits two turns, no more). While
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
    still bounds every request's wait for its batch to be cut (to within a millisecond on
    uvloop, as above).

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
        max_delay: Seconds the oldest waiting request waits for others to join its batch
            (unless the batch fills first).
        max_queue: The most requests that may wait for a batch; a submission beyond it is
            refused at once with :class:`~aioloader.Overloaded`. At least ``max_batch_size``.
        preferred_batch_sizes: Batch sizes to prefer (those a compiled model or a CUDA graph
            was captured for), each at most ``max_batch_size``.
        max_concurrent_batches: The most batches running at once.
        timeout: Default seconds a request may take from submission to its outcome (None: no
            limit); ``submit(..., timeout=...)`` overrides it.
        collate_fn: Turns the list of submitted items into the model's input (default
            :func:`~aioloader.default_collate`, for requests whose tensors, arrays and numbers
            agree in dtype: a batch whose requests differ is split into parts that agree, as
            one whose shapes do not stack, so that no request's dtype changes another's).
        split_fn: ``split_fn(output, n)`` returns the ``n`` per-request outputs (default: rows
            of a tensor along dimension 0; a list as is; mappings and tuples of those, split
            element-wise).
        collate_in_thread: Collate in the batcher's threads rather than on the event loop
            (for heavy collation; light collation is faster inline).
        num_workers: Collate in this many worker processes instead (``collate_fn`` must
            pickle; items travel pickled, batch tensors come back through shared memory).
        multiprocessing_context: The workers' start method, as the loader takes it: a name
            (``"forkserver"``, the default, or ``"spawn"``) or a multiprocessing context (no fork).
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
            ``max_batch_cost`` or ``padded_cost`` is given without ``cost_fn``, ``device``
            names CUDA while CUDA is not available, or ``multiprocessing_context`` is fork.
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
        self.policy = BatchPolicy(max_batch_size, max_delay, sizes_of(preferred_batch_sizes))
        start_method = start_method_of(multiprocessing_context, serving=True)
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
            pin_memory=pin_memory,
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
            collate_fn or collate_alike,
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
        self._queue: PendingQueue[Request] = PendingQueue(max_queue, self.limits)
        self._rec = self._recorder()
        self._stack: contextlib.AsyncExitStack | None = None
        self._dispatch: Dispatcher | None = None  # the runner tasks of the current (or last) scope
        self._owner: Owner | None = None  # the loop and task that opened the current scope

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
        owner = Owner()
        self._queue = PendingQueue(self.max_queue, self.limits)
        self._rec = self._recorder()
        self._dispatch = dispatch = Dispatcher(
            self._queue,
            self._rec,
            policy=self.policy,
            limits=self.limits,
            work=self._work,
            clock=self._clock,
            is_open=lambda: self._state == "open",
        )
        stack = contextlib.AsyncExitStack()
        try:
            await self._work.open(stack, self._rec.workers)
            # Runs after the task group is gone: no admitted caller is left without an outcome.
            stack.callback(dispatch.cancel_waiting)
            tg = await stack.enter_async_context(anyio.create_task_group())
            cutting = anyio.Lock()
            for i in range(self.max_concurrent_batches):
                tg.start_soon(dispatch.runner, cutting, name=f"aioloader-batcher-runner-{i}")
        except BaseException:
            with anyio.CancelScope(shield=True):
                await stack.aclose()
            raise
        self._stack, self._owner = stack, owner
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

        Raises:
            LoaderStateError: Another task than the one that opened the scope closes it (the
                scope stays open).

        Cancellation: a drain that is cancelled turns into a cancel; the tasks, threads and
        processes are still waited for, and every admitted caller still gets an outcome.
        """
        stack, dispatch = self._stack, self._dispatch
        if self._state != "open" or stack is None or dispatch is None:
            return
        if self._owner is not None:
            self._owner.check_exit()
        self._state = "closing"
        if self.on_exit == "cancel" or exc_type is not None:
            dispatch.cancel_waiting()
            dispatch.stop()
        self._wake()  # a runner waiting for requests must see the closing
        try:
            await stack.aclose()  # the body's exception stays the caller's: not passed in
        finally:
            self._state = "closed"
            self._rec.stopped = self._clock()
            self._stack = None

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
                with ``on_exit="cancel"`` (or was cancelled) before this request was served, or
                this is another event loop than the scope's (see ``_serving/owner.py``).
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
        owner = self._owner
        if self._state != "open" or owner is None:
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
        owner.check_loop(loop)
        deadline = math.inf if limit is None else now + limit
        request = Request(item, now, deadline, loop.create_future(), cost, bucket)
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

    def _expire(self, request: Request, limit: float, rearms: int = 0) -> None:
        """The request's deadline passed (a timer callback on the loop); a near miss by the
        batcher's clock waits again, as the delay timer does (``policy.rearm_after_timer``)."""
        was = request.state
        if was in (DONE, GONE):
            return
        if (again := rearm_after_timer(request.deadline - self._clock(), rearms)) is not None:
            args = (request, limit, rearms + 1)
            request.timer = asyncio.get_running_loop().call_later(again, self._expire, *args)
            return
        self._leave(request, expired=True)
        where = "its batch was running: the result is dropped" if was == RUNNING else "queued"
        request.resolve(None, TimeoutError(f"request not served within {limit} s ({where})"))

    def _leave(self, request: Request, *, expired: bool) -> None:
        """The caller gives up on ``request``: withdraw it if queued; drop its result if not."""
        if request.state in (DONE, GONE):
            return
        if request.state == WAITING:
            self._queue.withdraw(request)
        request.state = GONE
        if request.timer is not None:
            request.timer.cancel()
        if expired:
            self._rec.expired += 1
        else:
            self._rec.cancelled += 1

    def _wake(self) -> None:
        if self._dispatch is not None:
            self._dispatch.wake()
