"""What one ``async with loader:`` owns, and the consumer's end of an epoch.

Owns: the scope's task group, worker and I/O threads, device stage and current epoch
(:class:`Scope`), and :class:`EpochIterator`, which starts an epoch's tasks on its first
``__anext__`` (ending an unfinished earlier epoch first), hands out batches (a staged batch is
made ready on the consumer's own thread and stream), times the consumer's waits and turns the
end of the output stream into ``StopAsyncIteration`` or the epoch's original exception. Both are
given the loader's frozen plan (``_loader/plan.py``) and :class:`LoaderState`, never the loader.
Never: validates arguments or builds samplers (``_loader/loader.py``), or runs stages
(``_pipeline/epoch.py``).
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream

from .._base.exceptions import LoaderStateError, LoaderTimeout
from .._data.seeds import derive_seed
from .._data.source import InWorkers
from .._device.stage import DeviceStage, Staged, hand_out
from .._pipeline.epoch import Epoch
from .._pipeline.items import Raised, Received
from .._workers.offload import ThreadOffload
from .._workers.pool import WorkerPool
from .._workers.processes import ProcessWorkers
from .checkpoint import EpochState, Progress, fresh_state
from .progress import EpochProgress, epoch_samples
from .resuming import resumed_batches

if TYPE_CHECKING:
    from .._base.stats import Recorders
    from .plan import LoaderPlan

__all__ = ["EpochIterator", "LoaderState", "Received", "Running", "Scope"]

T_Batch = TypeVar("T_Batch")


class LoaderState:
    """What a loader and its scopes both change.

    Attributes:
        stats: The recorders of the current (or last) scope.
        scope: The open scope, or None.
        iterable_len: The length an iterable dataset reported to ``len(loader)`` (batches past
            it warn, as torch's do), or None.
        progress: The consumer's record of the current (or last) epoch, or None before any.
        shown: The current (or last) epoch's progress line (and bar), or None before any.
    """

    __slots__ = ("iterable_len", "progress", "scope", "shown", "stats")

    def __init__(self, stats: Recorders) -> None:
        self.stats = stats
        self.scope: Scope | None = None
        self.iterable_len: int | None = None
        self.progress: Progress | None = None
        self.shown: EpochProgress | None = None


class Scope:
    """What one ``async with loader:`` owns: the task group, the threads, the device stage, the
    running epoch."""

    def __init__(
        self, plan: LoaderPlan, state: LoaderState, stack: contextlib.AsyncExitStack
    ) -> None:
        # Nothing here keeps the loader: a loop thread holding the scope must not keep a
        # dropped loader (and its persistent workers) alive.
        self.plan = plan
        self.stack = stack
        self.thread = threading.get_ident()
        self.task_group: anyio.abc.TaskGroup | None = None
        self.work: WorkerPool
        worker_init_fn = plan.arguments.worker_init_fn
        # Without `seed=`, each scope draws anew, as each torch iterator does (a plain `for`
        # without `with` is a scope per epoch: new augmentations each), whatever the workers.
        worker_seed = plan.scope_seed()
        if plan.in_processes:
            self.work = ProcessWorkers(
                plan.num_workers,
                context=plan.start_method,
                seed=worker_seed,
                derive=derive_seed,
                worker_init_fn=worker_init_fn,
                stats=state.stats.workers,
                dataset=plan.dataset if isinstance(plan.source, InWorkers) else None,
            )
        else:
            self.work = ThreadOffload(
                plan.worker_threads,
                "worker",
                worker_init_fn=worker_init_fn,
                inline_below=plan.work_inline_below,
            )
        self.io: ThreadOffload | None = None
        device = plan.device_plan
        self.device = DeviceStage(device, depth=plan.device_depth) if device else None
        self.current: Running | None = None

    def offload(self) -> ThreadOffload:
        if self.io is None:
            self.io = ThreadOffload(
                self.plan.io_threads, "io", inline_below=self.plan.io_inline_below
            )
        return self.io

    def close_iteration(self) -> None:
        if self.current is not None:
            self.current.close_stream()

    async def start_workers(self) -> None:
        """Start the worker processes, then initialise the device (off the loop)."""
        await self.work.start()
        if self.device is not None:
            await self.device.open()

    async def close_workers(self) -> None:
        """Stop the workers and threads, and close the device stage (its copies finish)."""
        try:
            await self.work.aclose()
            if self.io is not None:
                self.io.close()
        finally:
            if self.device is not None:
                await self.device.aclose()


class Running:
    """An epoch in progress and the consumer's end of its output. It refers to no loader, so the
    scope can stop it (a new epoch starting, the scope closing) whoever holds the iterator."""

    def __init__(
        self, epoch: Epoch, recv: MemoryObjectReceiveStream[Any], shown: EpochProgress
    ) -> None:
        self.epoch = epoch
        self.recv = recv
        self.shown = shown
        self.closed = False

    def close_stream(self) -> None:
        self.closed = True
        self.shown.close()  # a bar left by a break ends its line here
        # Ready batches (perhaps on the device) are dropped now, not when the iterator is.
        with contextlib.suppress(anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
            while True:
                self.recv.receive_nowait()
        self.recv.close()

    async def aclose(self) -> None:
        """Stop the epoch and wait until its tasks are gone. Cancellation: the wait is shielded."""
        self.close_stream()
        epoch = self.epoch
        if not epoch.finished.is_set():
            epoch.cancel_scope.cancel()
            with anyio.CancelScope(shield=True):
                await epoch.finished.wait()


class EpochIterator(Generic[T_Batch]):
    """The consumer's end of one epoch. Created by ``DataLoader.__aiter__``; the epoch's tasks
    start at the first ``__anext__`` (ending an unfinished earlier epoch first)."""

    def __init__(
        self, state: LoaderState, scope: Scope, number: int, resume: EpochState | None = None
    ) -> None:
        self._state = state
        self._plan = scope.plan
        self._scope = scope
        self._number = number
        self._resume = resume  # a loaded state of this epoch: it goes on from there
        self.progress = Progress(resume if resume is not None else fresh_state(scope.plan, number))
        self.shown = EpochProgress(
            number,
            epoch_samples(scope.plan),
            state.stats.consumer,
            self.progress,
            draw=scope.plan.arguments.progress,
        )
        self._running: Running | None = None
        self._last_yield: float | None = None
        self._closed = False
        self._yielded = 0
        self._held_elsewhere = 0  # ready batches the consumer's side holds (see hold_ahead)
        #: The epoch's last batch was received (with no error after it): the consumer that
        #: sees the end marks :attr:`progress` finished (a plain ``for``'s pump sees it first).
        self.ended = False

    def __aiter__(self) -> EpochIterator[T_Batch]:
        return self

    def hold_ahead(self, most: int) -> int:
        """Let the consumer's side hold ready batches of its own (a plain ``for`` reads ahead
        across threads): up to ``most``, and half of ``prefetch`` at most, taken out of
        ``prefetch`` so that no more than ``prefetch`` finished batches wait in all (the other
        half stays in the epoch's stream, so its emitter does not wait on every hand-over).
        Call before the first batch. Returns how many it may hold."""
        self._held_elsewhere = min(most, self._plan.config.prefetch // 2)
        return self._held_elsewhere

    @property
    def stages_on_device(self) -> bool:
        """Whether batches come staged for a device (:func:`hand_out` finishes them)."""
        return self._scope.device is not None

    async def _start(self) -> MemoryObjectReceiveStream[Any]:
        scope, plan, state = self._scope, self._plan, self._state
        if scope is not state.scope or scope.task_group is None:
            raise LoaderStateError("the loader's scope this iteration began in has closed")
        if scope.current is not None:
            await scope.current.aclose()
        resume = self._resume
        batches: Iterable[tuple[int, list[int]]] | None = None
        if plan.kind.is_map:
            for obj in (plan.sampler, plan.batch_sampler):
                set_epoch = getattr(obj, "set_epoch", None)
                if callable(set_epoch):
                    set_epoch(self._number)
            batches = resumed_batches(
                plan.sampler,
                plan.batch_sampler,
                resume,
                rank=plan.rank,
                world_size=plan.world_size,
            )
        elif not isinstance(plan.source, InWorkers):
            # A stream read here (tar shards, an interleave) shuffles by the loader's epoch.
            set_epoch = getattr(plan.dataset, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self._number)
        config = plan.config
        buffer = config.prefetch - self._held_elsewhere  # the rest waits beyond the stream
        send, recv = anyio.create_memory_object_stream[Any](buffer)
        epoch = Epoch(
            self._number,
            config,
            plan.source,
            batches,
            scope.work,
            state.stats,
            scope.device,
            taken=resume.taken if resume is not None else None,
            stream_from=resume.stream if resume is not None else None,
        )
        state.progress = self.progress
        self._running = scope.current = Running(epoch, recv, self.shown)
        state.stats.epochs += 1
        await scope.task_group.start(epoch.run, send, name=f"aioloader-epoch-{self._number}")
        return recv

    async def __anext__(self) -> T_Batch:
        """The next batch of the epoch. With a device stage it is on the device, safe to use on
        the current stream of the calling thread.

        Raises:
            StopAsyncIteration: The epoch ended.
            LoaderTimeout: No batch within the loader's ``timeout``.
            Exception: This batch failed: the original exception, with notes naming the stage,
                the sample and the batch. The next call goes on with the following batch (as
                torch's iterator does), except after a failed stream source, which is over.

        Cancellation: safe; no batch is lost (the next call returns the batch this one would
        have returned).
        """
        try:
            got = await self.receive()
        except StopAsyncIteration:
            if self.ended:
                self.progress.finished = True
            self.shown.close()
            raise
        self.took(got)  # this task is the consumer: it has the batch (or error)
        if got.error is not None:
            error = got.error
            del got
            try:
                raise error
            finally:  # no cycle through this frame: the traceback will hold the caller's
                del error
        if got.warning is not None:
            warnings.warn(got.warning, UserWarning, stacklevel=2)
        return hand_out(got.batch)  # type: ignore[no-any-return]

    def took(self, got: Received) -> None:
        """The consumer has ``got`` (call on the consumer's thread)."""
        marks = got.marks
        self.progress.took(marks)
        if self.shown.drawing:
            self.shown.draw()

    async def receive(self) -> Received:
        """The next batch as the event loop holds it: a :class:`Staged` batch with a device
        stage, to be finished with :func:`hand_out` in the thread that uses it (a plain ``for``
        runs this on the loop's thread, then ``hand_out`` on its own); torch's warning for an
        iterable past its reported length, or None, for the consumer to give; the batch's mark,
        for the consumer to give :attr:`progress` when it takes the batch; or, for a failed
        batch, its error for the consumer to raise (the next call goes on).

        Raises: as :meth:`__anext__`, except a failed batch's error (returned).
        Cancellation: as :meth:`__anext__`.
        """
        running = self._running
        if self._closed or (running is not None and running.closed):
            raise StopAsyncIteration  # ended (or stopped by a newer epoch, or the scope)
        recv = running.recv if running is not None else await self._start()
        stats = self._state.stats.consumer
        now = time.perf_counter()
        if self._last_yield is not None:
            stats.busy_s += now - self._last_yield
        timeout = self._plan.arguments.timeout
        item: Any = None
        try:
            # A cancellation point still (a cancelled caller gets no batch), but a batch that is
            # ready is taken without a trip round the event loop.
            await anyio.lowlevel.checkpoint_if_cancelled()
            try:
                item = recv.receive_nowait()
            except anyio.WouldBlock:
                if timeout > 0:
                    with anyio.fail_after(timeout):
                        item = await recv.receive()
                else:  # no cancel scope to make and leave per batch
                    item = await recv.receive()
        except anyio.EndOfStream:
            pass
        except TimeoutError:
            raise LoaderTimeout(f"DataLoader timed out after {timeout} seconds") from None
        finally:
            waited = time.perf_counter() - now
            stats.waited(waited)
        self._state.stats.output.set_queued(recv.statistics().current_buffer_used)
        if item is None:
            self._closed = True
            recv.close()
            if self._running is not None and self._running.epoch.error is None:
                self.ended = True  # every batch was handed out: finished once the consumer sees it
            error = self._running.epoch.error if self._running is not None else None
            if error is not None:
                raise error
            raise StopAsyncIteration
        if isinstance(item, Raised):
            return Received(None, None, item.marks, item.error)
        batch, size, marks = item
        if isinstance(batch, Staged):
            batch.release()  # taken: no longer ahead of the consumer
        stats.batches += 1
        stats.samples += size
        self._yielded += 1
        reported, warning = self._state.iterable_len, None
        if reported is not None and self._yielded > reported and not self._plan.kind.is_map:
            warning = self._past_length(reported)
        self._last_yield = time.perf_counter()
        return Received(batch, warning, marks, None)

    def _past_length(self, reported: int) -> str:
        """torch's warning, for the consumer to give where it takes the batch: an iterable
        yielded more than ``len(loader)`` said it would (as torch does, the dataset's length
        is compared with the batches yielded)."""
        plan = self._plan
        text = (
            f"Length of IterableDataset {plan.dataset!r} was reported to be {reported} (when "
            f"accessing len(dataloader)), but {self._yielded} samples have been fetched."
        )
        if plan.num_workers > 0:
            text += (
                " For multiprocessing data-loading, this could be caused by not properly "
                "configuring the IterableDataset replica at each worker (each worker iterates "
                "its own copy: shard it with get_worker_info())."
            )
        return text

    def close_stream(self) -> None:
        self._closed = True
        if self._running is not None:
            self._running.close_stream()

    async def aclose(self) -> None:
        """Stop the epoch early and wait until its tasks are gone.

        Cancellation: the wait is shielded.
        """
        self._closed = True
        if self._running is not None:
            await self._running.aclose()
