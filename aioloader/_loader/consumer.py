"""The consumer's end of one epoch: what ``async for`` and a plain ``for`` take batches from.

Owns: :class:`EpochIterator`: it begins an epoch on its first call (ending an unfinished one
first), makes its batches in the consumer's calls (``_pipeline/demand.py``) or receives them
from its stages, hands them out (a staged batch made ready on the consumer's thread and stream),
times the consumer's waits, and turns the epoch's end into ``StopAsyncIteration`` or its error.
Never: refers to the loader, builds samplers, runs stages or owns pools (``scope.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import warnings
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

import anyio
import anyio.abc

from .._base.exceptions import LoaderStateError, LoaderTimeout, forget_locals, not_an_end
from .._base.inline import ROUND_EVERY_S
from .._data.datapipes import epoch_pipe_seed
from .._data.order import epoch_takers, owner_epoch
from .._data.resume import Mark
from .._data.source import InWorkers, MapSource
from .._data.streams import begin_here
from .._device.stage import Staged, hand_out
from .._pipeline.demand import HANDED_OVER, OnDemand
from .._pipeline.epoch import Epoch
from .._pipeline.handoff import HandoffReceive, handoff
from .._pipeline.items import Raised, Received
from .._workers.offload import ThreadOffload
from .checkpoint import EpochState, Progress, fresh_state
from .progress import EpochProgress, epoch_samples, past_length
from .resuming import resumed_batches
from .scope import LoaderState, Running, Scope

__all__ = ["EpochIterator"]


T_Batch = TypeVar("T_Batch")


class EpochIterator(Generic[T_Batch]):
    """The consumer's end of one epoch. Created by ``DataLoader.__aiter__``; the epoch's tasks
    start at the first ``__anext__`` (ending an unfinished earlier epoch first)."""

    def __init__(
        self, state: LoaderState, scope: Scope, number: int, resume: EpochState | None, given: bool
    ) -> None:
        self._state = state
        self._plan = scope.plan
        self._scope = scope
        self._epoch_given = given  # by set_epoch: any sampler is told (epoch_takers)
        self._resume = resume  # a loaded state of this epoch: it goes on from there
        a, drawn, state.pipe_seed = self._plan.arguments, state.pipe_seed, None  # a plain for's
        self._pipe_seed = epoch_pipe_seed(self._plan.dataset, a.seed, a.generator, number, drawn)
        self._number, self.progress, self.shown = self._numbered(number)
        self._running: Running | None = None
        self._went_round = 0.0  # when a batch made here last let the loop go round first
        self._demand: OnDemand | None = None  # the epoch's batches made in the calls for them
        self._batches: Iterator[tuple[int, list[int]]] | None = None
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
        """Let the consumer's side (a plain ``for``'s pump) hold up to ``most`` ready batches,
        half of ``prefetch`` at most, taken out of the epoch stream's ``prefetch`` (no more
        than ``prefetch`` wait in all). Call before the stages start. Returns how many."""
        self._held_elsewhere = min(most, self._plan.config.prefetch // 2)
        return self._held_elsewhere

    @property
    def stages_on_device(self) -> bool:
        """Whether batches come staged for a device (:func:`hand_out` finishes them)."""
        return self._scope.device is not None

    async def prepare(self, *, own_thread: bool = False) -> None:
        """Begin the epoch (ending an unfinished earlier one first): its batches are made on
        demand where that suits (see :meth:`_on_demand`), else its stages start with the first
        :meth:`receive`. Idempotent. ``own_thread``: a plain ``for`` on a thread of its own,
        which makes a blocking dataset's batches however slow, as torch's loop does.

        Raises:
            LoaderStateError: The scope this iteration began in has closed.
        """
        if self._running is not None:
            return
        scope, plan, state = self._scope, self._plan, self._state
        if scope is not state.scope or scope.task_group is None:
            raise LoaderStateError("the loader's scope this iteration began in has closed")
        if scope.current is not None:
            await scope.current.aclose()
        resume = self._resume
        batches: Iterator[tuple[int, list[int]]] | None = None
        if plan.kind.is_map:
            owned = owner_epoch(plan.sampler, plan.batch_sampler)
            if owned is not None and owned != self._number and not self._epoch_given:
                self._renumber(owned)  # set after iter(): torch's loader draws the order now
            for taker in epoch_takers(plan.sampler, plan.batch_sampler, given=self._epoch_given):
                taker(self._number)
            self.progress.begin_order(plan, resume)  # a user's sampler's generator: saved
            batches = resumed_batches(
                plan.sampler, plan.batch_sampler, resume, rank=plan.rank, world_size=plan.world_size
            )
        elif not isinstance(plan.source, InWorkers):  # a stream read here
            begin_here(plan.dataset, self._number, self._pipe_seed)
        self._batches = batches
        state.progress = self.progress
        self._running = scope.current = Running(self.shown)
        state.stats.epochs += 1
        taken = resume.taken if resume is not None else None
        if batches is not None and self._on_demand(own_thread):
            source, work = plan.source, scope.work
            if not isinstance(source, MapSource) or not isinstance(work, ThreadOffload):
                raise TypeError("an epoch made on demand reads a map source")
            self._demand = OnDemand(
                self._number,
                plan.config,
                source,
                batches,
                work,
                state.stats,
                scope.pace,
                taken,
                patient=own_thread,
            )

    def _numbered(self, number: int) -> tuple[int, Progress, EpochProgress]:
        """The epoch's number, its record (from the loaded state, if any) and its progress."""
        plan, resume, draw = self._plan, self._resume, self._plan.arguments.progress
        progress = Progress(resume if resume is not None else fresh_state(plan, number))
        consumer = self._state.stats.consumer
        shown = EpochProgress(number, epoch_samples(plan), consumer, progress, draw=draw)
        return number, progress, shown

    def _renumber(self, epoch: int) -> None:
        """Run epoch ``epoch``, its sampler's owner's choice made after this iterator was (it
        raises ``LoaderStateError`` where a loaded state of another epoch was to go on)."""
        if self._resume is not None:
            raise LoaderStateError(
                f"the state loaded with load_state_dict() goes on with epoch "
                f"{self._resume.epoch}; sampler.set_epoch({epoch}), called after iter(loader), "
                "dropped it (call it before, with the state's epoch, to resume)"
            )
        self.shown.close()
        self._number, self.progress, self.shown = self._numbered(epoch)
        self._state.shown = self.shown

    def _on_demand(self, own_thread: bool) -> bool:
        """Whether this epoch's batches are made in the consumer's calls for them: the plan
        allows it; the dataset is map-style, read in this process (no worker processes or
        threads), blocking with reads fast enough to run inline (or not timed yet; for a plain
        ``for`` on its own thread, ``own_thread``, however slow), or async with reads that
        returned at once (a sample: an earlier epoch timed them; or a ``get_many`` slice within
        a millisecond, or not timed yet); and the transforms run inline too."""
        plan, scope = self._plan, self._scope
        source, work = plan.source, scope.work
        if not plan.on_demand_allowed:
            return False
        if not isinstance(source, MapSource) or not isinstance(work, ThreadOffload):
            return False
        reads = source.reads_now()
        if reads is None:
            quick = scope.pace.slices_quick if source.batched else scope.pace.sequential
            return quick and work.may_call_now
        patient = own_thread and reads[0].can_inline and work.can_inline
        return patient or (reads[0].may_call_now and work.may_call_now)

    async def _start_stages(self) -> HandoffReceive[Any]:
        """Start the epoch's stages (on the batches left, when some were made on demand)."""
        scope, plan, state, running = self._scope, self._plan, self._state, self._running
        if scope is not state.scope or scope.task_group is None:
            raise LoaderStateError("the loader's scope this iteration began in has closed")
        if running is None:
            raise LoaderStateError("the epoch was not prepared")
        resume, demand = self._resume, self._demand
        batches = self._batches
        taken = resume.taken if resume is not None else None
        empty: list[Mark] = []
        skips_left: int | None = None
        if demand is not None:  # handed over: the stages go on where it stopped
            batches, taken, empty, skips_left = demand.rest()
            self._demand = None
        config = plan.config
        buffer = config.prefetch - self._held_elsewhere  # the rest waits beyond the stream
        if scope.device is not None:
            await scope.device.let_go()  # the last epoch's blocks go back with the first jobs
        send, recv = handoff(buffer)
        epoch = Epoch(
            self._number,
            config,
            plan.source,
            batches,
            scope.work,
            state.stats,
            scope.device,
            taken=taken,
            stream_from=resume.stream if resume is not None else None,
            on_stream_start=self.progress.started,
            pace=scope.pace,
            empty=empty,
            skips_left=skips_left,
            pipe_seed=self._pipe_seed,
        )
        name = f"aioloader-epoch-{self._number}"
        running.run_stages(scope.task_group, epoch, send, recv, name)
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
        if self._running is None:
            await self.prepare()
        self._check_open()
        demand = self._demand
        if demand is not None and not demand.handed_over:
            # Made here, on the loop's thread; first a trip round the loop once a millisecond,
            # so that its other tasks run (batches made here are fast: slow ones hand over),
            # and a cancelled caller gets none. A trip each batch cost 5% of a batch of rows.
            now = self._asked()
            if now - self._went_round >= ROUND_EVERY_S:
                await asyncio.sleep(0)
                self._went_round = now
            got = self._after(await demand.anext(), now)
            if got is not None:
                return got
        if (running := self._running) is None or running.closed:
            raise StopAsyncIteration  # stopped meanwhile (by a newer epoch, or the scope)
        recv = running.recv if running.recv is not None else await self._start_stages()
        stats = self._state.stats.consumer
        now = time.perf_counter()
        if self._last_yield is not None:
            stats.busy_s += now - self._last_yield
        timeout = self._plan.arguments.timeout
        item: Any = None
        try:
            # A cancellation point still, but a ready batch costs no trip round the loop.
            await anyio.lowlevel.checkpoint_if_cancelled()
            try:
                item = recv.receive_nowait()
            except anyio.WouldBlock:  # (without a timeout, no cancel scope made per batch)
                with anyio.fail_after(timeout) if timeout > 0 else contextlib.nullcontext():
                    item = await recv.receive()  # cancelled, it loses nothing (handoff.py)
        except anyio.EndOfStream:
            pass
        except anyio.ClosedResourceError:  # closed by a newer epoch (another thread's iter())
            raise StopAsyncIteration from None
        except TimeoutError:
            raise LoaderTimeout(f"DataLoader timed out after {timeout} seconds") from None
        finally:
            waited = time.perf_counter() - now
            stats.waited(waited)
        self._state.stats.output.set_queued(recv.statistics().current_buffer_used)
        if item is None:
            self._closed = True
            recv.close()
            error = running.epoch.error if running.epoch is not None else None
            if error is not None:
                raise error
            self.ended = True  # every batch was handed out: finished once the consumer sees it
            raise StopAsyncIteration
        return self._received(item)

    def receive_now(self) -> Received | None:
        """The next batch of an epoch made on demand, made now on the calling thread (the
        consumer's: the loop's for ``async for``, its own for a plain ``for``); None when the
        epoch's stages make it (they run on the loop: :meth:`receive` waits for it there).
        Call after :meth:`prepare`.

        Raises: as :meth:`receive`.
        Cancellation: not a waiting point.
        """
        demand = self._demand
        if demand is None or not demand.blocking or demand.handed_over:
            return None
        self._check_open()
        now = self._asked()
        return self._after(demand.next(), now)

    def _check_open(self) -> None:
        running = self._running
        if self._closed or (running is not None and running.closed):
            raise StopAsyncIteration  # ended (or stopped by a newer epoch, or the scope)
        if self._scope is not self._state.scope:
            raise LoaderStateError("the loader's scope this iteration began in has closed")

    def _asked(self) -> float:
        """The consumer asks for a batch now: the time since the last one was busy."""
        now = time.perf_counter()
        if self._last_yield is not None:
            self._state.stats.consumer.busy_s += now - self._last_yield
        return now

    def _after(self, item: Any, asked: float) -> Received | None:
        """A batch made on demand (see :meth:`receive_now`), asked for at ``asked``."""
        self._state.stats.consumer.waited(time.perf_counter() - asked)  # waited while it was made
        if self._running is not None and self._running.closed:  # a newer epoch began meanwhile
            self._closed = True  # (another thread's): this one's batch is dropped
            raise StopAsyncIteration
        if item is HANDED_OVER:
            self._last_yield = None  # its wait for the stages counts from the next call
            return None
        if item is None:
            self._closed = True
            self.ended = True
            raise StopAsyncIteration
        return self._received(item)

    def _received(self, item: Any) -> Received:
        """An output item (see ``Epoch``) as the consumer's side receives it."""
        stats = self._state.stats.consumer
        if isinstance(item, Raised):
            # Its traceback keeps the frames it passed: those of ours that finished keep no
            # locals, so no cycle holds this iterator until the garbage collector runs.
            forget_locals(item.error)
            return Received(None, None, item.marks, not_an_end(item.error))
        batch, size, marks = item
        if isinstance(batch, Staged):
            batch.release()  # taken: no longer ahead of the consumer
        stats.batches += 1
        stats.samples += size
        self._yielded += 1
        reported, warning = self._state.iterable_len, None
        if reported is not None and self._yielded > reported and not self._plan.kind.is_map:
            warning = past_length(self._plan, reported, self._yielded)
        self._last_yield = time.perf_counter()
        return Received(batch, warning, marks, None)

    def close_stream(self) -> None:
        self._closed = True
        if self._running is not None:
            self._running.close_stream()

    async def aclose(self) -> None:
        """Stop the epoch early and wait until its tasks are gone (the wait is shielded)."""
        self._closed = True
        if self._running is not None:
            await self._running.aclose()
