"""How the dynamic batcher runs one batch: collate, device stage, model, split.

Owns: :class:`BatchRunner`, which knows where each step runs — collation inline on the loop, in
the batcher's threads or in worker processes (``_job.collate_only``, one round trip per batch);
the device stage (the loader's: pinned pool, side stream, event) when a CUDA device is given;
a blocking ``model_fn`` in a thread or inline (:class:`_ModelPlace`), an async one on the loop —
and the resources that takes
(opened and closed with the batcher's scope). A failure comes out with its original type and a
note naming the step and the batch. Never: touches requests, the queue or statistics
(``_serving/batcher.py``), or runs blocking user code on the event loop unless told (inline
collation).
"""

from __future__ import annotations

import contextlib
import inspect
import multiprocessing.context
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._base.exceptions import LoaderTimeout, WorkerCrashed, annotate, as_failure
from .._base.inline import (
    INLINE_BELOW_S,
    SERVING_PROBE_EVERY,
    SERVING_SLOW_BELOW_S,
    SLOW_PROBE_EVERY,
    TRY_INLINE_BELOW_S,
    Placement,
)
from .._base.recorders import WorkerRecorder
from .._data.seeds import derive_seed
from .._device.accelerator import resolve_device
from .._device.plan import DevicePlan, device_plan
from .._device.stage import DeviceStage, hand_out
from .._workers.byvalue import MainRule, sendable
from .._workers.job import collate_only
from .._workers.mainmodule import workers_main
from .._workers.offload import ThreadOffload
from .._workers.processes import ProcessWorkers
from .policy import split_outputs

__all__ = ["BatchRunner", "device_plan_of"]

STAGES = {
    "collate": "collate_fn", "device": "the device stage", "model": "model_fn", "split": "split_fn"
}  # fmt: skip
"""What each stage calls, as a :class:`~aioloader.StrayCancellation` names it."""

Outcome = tuple[bool, Any]
"""``(True, output)`` or ``(False, error)``: one request's."""


class _Uncollatable(Exception):  # a signal between two methods, never raised out
    """Collation refused a part of several requests: :meth:`BatchRunner.run_each` splits it."""


def device_plan_of(
    device: object, *, pin_memory: bool, transform: Callable[[Any], Any] | None
) -> DevicePlan | None:
    """The device stage a batcher needs (``_device.device_plan``: the loader's decision).

    Raises:
        TypeError: ``device`` is not a str, ``torch.device`` or None; ``transform`` is not
            callable.
        ValueError: ``device`` is not a device, or names CUDA without CUDA available.
    """
    if transform is not None and not callable(transform):
        raise TypeError(f"device_transform must be callable or None, got {transform!r}")
    return device_plan(
        resolve_device(device), pin_memory=pin_memory, transform=transform, stacklevel=3
    )


class BatchRunner:
    """Runs batches through ``collate_fn`` → ``model_fn`` → ``split_fn``.

    Args:
        model_fn: The model; a plain callable runs in a thread, an async one on the loop.
        collate_fn: List of items → model input.
        split_fn: ``(output, n)`` → ``n`` per-request outputs (checked to be ``n``).
        collate_in_thread: Collate in a thread rather than on the loop.
        num_workers: Collate in this many worker processes (0: not).
        start_method: The worker processes' start method.
        concurrency: The most batches run at once (threads to keep).
        device: The device stage's plan, or None.
        host_transform: Applied after collation when there is no device stage.
        clock: Times the model's calls, for where they run (the batcher's clock).
    """

    def __init__(
        self,
        model_fn: Callable[[Any], Any],
        collate_fn: Callable[[list[Any]], Any],
        split_fn: Callable[[Any, int], Sequence[Any]],
        *,
        collate_in_thread: bool,
        num_workers: int,
        start_method: str | multiprocessing.context.BaseContext,
        concurrency: int,
        device: DevicePlan | None = None,
        host_transform: Callable[[Any], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model_fn = model_fn
        self.collate_fn = collate_fn
        self.split_fn = split_fn
        self.collate_in_thread = collate_in_thread
        self.num_workers = num_workers
        self.start_method = start_method
        self.concurrency = concurrency
        self.async_model = _is_async_callable(model_fn)
        self.device = device
        self.clock = clock
        self._finish = host_transform if device is None else None
        if num_workers:  # what cannot be sent even by value is named now
            self._sent(workers_main("spawn"))
        self._job: tuple[Any, Any] = (collate_fn, self._finish)  # as the workers are sent them
        self._threads: ThreadOffload | None = None
        self._workers: ProcessWorkers | None = None
        self._stage: DeviceStage | None = None
        self._place: _ModelPlace | None = None

    def _sent(self, main_has: MainRule) -> tuple[Any, Any]:
        """``collate_fn`` and the host-side ``device_transform`` as the worker processes are
        sent them (``byvalue.py``).

        Raises:
            TypeError: One cannot be sent even by value; the message names it.
        """
        return (
            sendable("collate_fn", self.collate_fn, main_has, remedy="use num_workers=0"),
            sendable("device_transform", self._finish, main_has, remedy="use num_workers=0"),
        )

    async def open(self, stack: contextlib.AsyncExitStack, stats: WorkerRecorder) -> None:
        """Start the threads and worker processes this runner needs; ``stack`` closes them.

        Raises:
            WorkerCrashed: A worker process died while starting.

        Cancellation: what was started is closed by ``stack``, which the caller unwinds.
        """
        if self.num_workers:
            workers = ProcessWorkers(
                self.num_workers,
                context=self.start_method,
                seed=0,  # collation draws no random numbers; jobs are sent unseeded
                derive=derive_seed,
                worker_init_fn=None,
                stats=stats,
            )
            # By value where pickle cannot send them by name to these workers: their server
            # is chosen as they start (here), not as the batcher was built.
            self._job = self._sent(workers_main(self.start_method))
            stack.push_async_callback(workers.aclose)
            stack.callback(setattr, self, "_workers", None)
            self._workers = workers
            await workers.start()
        if self.device is not None:
            stage = DeviceStage(self.device, depth=self.concurrency)
            stack.push_async_callback(stage.aclose)
            stack.callback(setattr, self, "_stage", None)
            self._stage = stage
            await stage.open()
        if not self.async_model or self.collate_in_thread:
            threads = ThreadOffload(self.concurrency, "batcher")
            stack.callback(threads.close)
            stack.callback(setattr, self, "_threads", None)
            self._threads = threads
        # A fast blocking model runs inline (see _ModelPlace), a fresh estimate each scope: one
        # batch at a time only, never with a device stage (its batch is made ready on the
        # model's own thread).
        one = self.concurrency == 1 and self.device is None and not self.async_model
        self._place = _ModelPlace(self.clock) if one else None

    async def run_each(
        self,
        items: list[Any],
        seq: int,
        whole: int | None = None,
        on_split: Callable[[int, BaseException], object] | None = None,
    ) -> list[Outcome]:
        """One outcome per item of batch ``seq``, in order.

        A batch that collation refuses (requests whose shapes do not stack, one that cannot be
        pickled to a collation process) is split in halves, each run on its own (one model
        call each), down to single requests: only a request that cannot be collated alone
        fails, with collation's error, and the others are served, as a server that checks
        each request's input serves them (found by review: one bad input failed every caller
        of its batch). A later failure (device stage, model, split) is every caller's of the
        part it happened in. ``whole``: the batch's size, for the notes of its parts;
        ``on_split(size, error)``: told of each part split, with collation's error.

        Raises: nothing of a part's (its failure is each of its requests' outcome).

        Cancellation: as :meth:`run`.
        """
        try:
            outputs = await self.run(items, seq, whole=whole)
        except _Uncollatable as split:
            if on_split is not None:
                on_split(len(items), split.__cause__ or split)
            whole, half = whole or len(items), len(items) // 2
            groups = getattr(split.__cause__, "groups", None)  # alike.MixedDtypes: its parts
            if isinstance(groups, list) and len(groups) > 1:
                outcomes: list[Outcome] = [(False, None)] * len(items)
                for group in groups:
                    part = await self.run_each([items[i] for i in group], seq, whole, on_split)
                    for position, outcome in zip(group, part, strict=True):
                        outcomes[position] = outcome
                return outcomes
            first = await self.run_each(items[:half], seq, whole, on_split)
            return first + await self.run_each(items[half:], seq, whole, on_split)
        except Exception as exc:
            return [(False, exc)] * len(items)
        return [(True, out) for out in outputs]

    async def run(self, items: list[Any], seq: int, *, whole: int | None = None) -> Sequence[Any]:
        """Collate ``items``, run the model, split its output: one output per item.

        Raises:
            ValueError: ``split_fn`` gave a different number of outputs than items.
            Exception: What collation, the model or the split raised (original type), with a
                note naming the stage (``collate``, ``model``, ``split``) and batch ``seq``.
            StrayCancellation: The model (or collation) raised ``CancelledError`` of its own
                (it awaited something another task cancelled): this batch's failure, not the
                batcher's cancellation.

        Cancellation: a thread call already running is waited for and its result dropped
        (``_workers/offload.py``); a worker job likewise, up to its grace
        (``_workers/processes.py``).
        """
        n = len(items)
        stage = "collate"
        try:
            try:
                batch = await self._collate(items)
            except Exception as exc:  # a worker lost (or not placed) is no request's fault
                if n > 1 and not isinstance(exc, WorkerCrashed | LoaderTimeout):
                    raise _Uncollatable from exc
                raise
            if self._stage is not None:
                stage = "device"
                batch = await self._stage.stage(batch)
            stage = "model"
            output = await self._call_model(batch)
            stage = "split"
            outputs = split_outputs(self.split_fn, output, n)
        except BaseException as exc:
            failure = as_failure(exc, STAGES[stage])
            if failure is None or isinstance(failure, _Uncollatable):
                raise  # cancelled, or to be split
            annotate(failure, stage, batch=seq, detail=_who(n, whole))
            if failure is exc:
                raise
            raise failure from exc
        return outputs

    async def _collate(self, items: list[Any]) -> Any:
        """Collate (and apply the host-side ``device_transform``) where collation runs."""
        if self._workers is not None:
            collate_fn, finish = self._job
            return await self._workers.run(collate_only, collate_fn, items, False, finish)
        job = (collate_only, self.collate_fn, items, False, self._finish)
        if self.collate_in_thread and self._threads is not None:
            return await self._threads.run(*job)
        return collate_only(*job[1:])

    async def _call_model(self, batch: Any) -> Any:
        """Call the model; a staged batch is made ready on the thread the model runs on (its
        current stream waits for the copy)."""
        if self.async_model or self._threads is None:
            output = self.model_fn(hand_out(batch))
        elif self._place is not None:
            output = await self._place.call(self._threads, self.model_fn, batch, loop_modes())
        else:
            output = await self._threads.run(_call_ready, self.model_fn, batch, loop_modes())
        if inspect.isawaitable(output):  # an async model, or a plain function returning one
            output = await output
        return output


def _who(n: int, whole: int | None) -> str:
    """Who gets a failure of a part of ``n`` requests of a batch of ``whole`` (None: the
    batch itself)."""
    if whole is None:
        return f"every caller of this batch of {n} gets it"
    if n == 1:
        return f"this request only: the batch of {whole} was split, as it would not collate"
    return f"every caller of this part of {n} gets it (the batch of {whole} would not collate)"


Modes = tuple[bool, bool] | None
"""torch's grad and inference modes to call a model under: ``(grad, inference)``; None: a
thread's own (grad on, inference off)."""


def loop_modes() -> Modes:
    """The grad and inference modes of this thread (the event loop's), where a call on the
    batcher's thread must take them: torch keeps them per thread, and a server that turns
    grad off once at start-up (``torch.set_grad_enabled(False)``) got outputs that required
    grad from the calls that ran on the thread, not from those inline (found by review)."""
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    return None if grad and not inference else (grad, inference)


def _call_ready(model_fn: Callable[[Any], Any], batch: Any, modes: Modes = None) -> Any:
    if modes is None:
        return model_fn(hand_out(batch))
    grad, inference = modes
    with torch.inference_mode() if inference else torch.set_grad_enabled(grad):
        return model_fn(hand_out(batch))


class _ModelPlace:
    """Where a blocking model's next call runs, one batch at a time: on the loop thread while
    its calls have been taking under ``INLINE_BELOW_S``, else on the batcher's thread.

    Why inline: a hop costs more than a fast model. Measured with a 50 µs MLP at 3,000
    requests/s: 341 µs of CPU a request and p99 25 ms through the thread, 68 µs and 9.5 ms
    inline; the model's thread waits for the GIL at each of torch's re-acquisitions while the
    loop thread is busy (up to the switch interval, 5 ms by default).

    That wait is also why calls on the thread are not timed for this choice: under a busy loop
    a 50 µs call reads as milliseconds there, and would keep a fast model off the loop for
    good. So (:class:`~aioloader._base.inline.Placement`) the first call runs on the thread,
    timed (a warm-up never blocks the loop); calls inline are timed; and while calls go to
    the thread, one is tried inline after 1, 2, 4, ... calls, then every 64th (every 256th
    once it took 2 ms or more: a model that slow, a GPU's, blocks the loop for its time at
    each try), its time the estimate from then on. A model that took 10 ms or more is re-timed
    on its thread instead: a try inline would hold the loop's other requests that long.
    """

    __slots__ = ("clock", "placement")

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.placement = Placement(
            INLINE_BELOW_S,
            slow_below=SERVING_SLOW_BELOW_S,
            probe_every=SERVING_PROBE_EVERY,
            slow_probe_every=SLOW_PROBE_EVERY,
        )

    async def call(
        self,
        threads: ThreadOffload,
        model_fn: Callable[[Any], Any],
        batch: Any,
        modes: Modes = None,
    ) -> Any:
        """``model_fn`` on ``batch``, here or on ``threads`` (under ``modes``, this thread's).

        Raises:
            Exception: What ``model_fn`` raised.

        Cancellation: as :meth:`ThreadOffload.run` for a call on the thread; a call inline is
        not a waiting point.
        """
        placement, clock = self.placement, self.clock
        estimate = placement.recent.seconds
        where = placement.where()
        if where == "threads":
            return await threads.run(_call_ready, model_fn, batch, modes)
        if estimate is None or (where == "alone" and estimate >= TRY_INLINE_BELOW_S):
            output, took = await threads.run(_clocked, clock, model_fn, batch, modes)
            placement.alone_took(took)
            return output
        started = clock()
        try:
            return _call_ready(model_fn, batch)
        finally:
            took = clock() - started
            if where == "inline":
                placement.recent.add(took)
            else:  # a try after calls on the thread: the estimate from now on
                placement.alone_took(took)


def _clocked(
    clock: Callable[[], float], model_fn: Callable[[Any], Any], batch: Any, modes: Modes
) -> Any:
    started = clock()
    output = _call_ready(model_fn, batch, modes)
    return output, clock() - started


def _is_async_callable(fn: object) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004  # an object with an async __call__
    )
