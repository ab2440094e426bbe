"""A torch ``IterableDataset`` in the worker processes: every worker iterates its own copy.

Owns: :class:`WorkerStreams` (pulling each worker's batches, in turn or as they come, with the
pass closed in the worker when the epoch ends early) and :class:`RankBatches` (those batches
split over ranks and padded, ``distributed=True``). A resumable dataset (``state_dict`` /
``load_state_dict``) sends each worker's state back with each batch; a batch's mark holds every
worker's state as of that batch and the worker whose turn is next, and a resumed epoch starts
each worker's pass from its own state and the round-robin at that worker. Never: schedules,
fetches or emits (the epoch does; batches go to it through ``Epoch.pass_on``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from .._base.exceptions import WorkerCrashed
from .._base.recorders import Operation, Recorders
from .._data.datapipes import seed_pipe
from .._data.resume import Taken
from .._data.seeds import derive_seed
from .._data.sharding import StreamShare
from .._workers.job import JobResult, close_stream, next_stream_batch, open_stream
from .._workers.pool import WorkerPool
from .._workers.processes import CANCEL_GRACE
from .config import PipelineConfig
from .fetch import FailureBudget
from .items import Batch, Done, one_item_lanes

__all__ = ["RankBatches", "WorkerStreams"]


class Epoch(Protocol):
    """What the worker streams need of their epoch (``epoch.Epoch`` is one)."""

    number: int
    config: PipelineConfig
    stats: Recorders
    work: WorkerPool
    budget: FailureBudget
    stream_from: tuple[int, int, Any] | None
    pipe_seed: int | None
    taken: Taken | None
    on_stream_start: Callable[[tuple[int, int, Any] | None], None] | None

    async def pass_on(self, item: Done, seq: int, done: MemoryObjectSendStream[Done]) -> None:
        """Hand a batch to the emitter as the epoch's batch ``seq``."""

    async def skip_then_collate(
        self,
        batch: Batch,
        result: JobResult,
        keys: Sequence[object],
        run: Callable[..., Awaitable[Any]],
        *,
        seed: int | None = None,
    ) -> JobResult:
        """Skip a job's failed samples within the budget, then collate the rest."""


class RankBatches:
    """The batches of per-worker streams, numbered in their order, split over ranks
    (``distributed=True``): every rank's workers read the whole dataset, rank ``r`` keeps
    batches ``r, r + W, ...`` and repeats batches from the start so that every rank yields as
    many (``StreamShare``'s rule, over batches)."""

    def __init__(
        self,
        epoch: Epoch,
        done: MemoryObjectSendStream[Done],
        *,
        start: int = 0,
        mark: Callable[[Done, int], None] | None = None,
    ) -> None:
        cfg = epoch.config
        self._epoch = epoch
        self._done = done
        self._seq = start
        self._mark = mark
        self._share: StreamShare[Done] | None = None
        if cfg.world_size > 1:
            self._share = StreamShare(cfg.rank, cfg.world_size)

    async def offer(self, item: Done) -> None:
        empty = not item.size and item.error is None  # its samples skipped: no rank's batch
        if self._share is None or (not empty and self._share.mine(item)):
            await self._send(item)

    async def finish(self) -> None:
        for _, item in self._share.padding() if self._share is not None else ():
            batch = dataclasses.replace(item.batch)  # its own place in the epoch
            await self._send(dataclasses.replace(item, batch=batch))

    async def _send(self, item: Done) -> None:
        seq = self._seq
        self._seq += 1
        if self._mark is not None:
            self._mark(item, seq)
        taken = self._epoch.taken
        if taken is not None and seq in taken and self._epoch.config.in_order:
            return  # taken before the stop (a failed batch, re-formed in its turn): left out
        await self._epoch.pass_on(item, seq, self._done)


class WorkerStreams:
    """The batches of an epoch whose iterable dataset lives in the workers, handed to
    ``epoch`` one by one (:meth:`run`)."""

    def __init__(self, epoch: Epoch) -> None:
        self.epoch = epoch
        self.config = epoch.config
        self.stats = epoch.stats
        self.number = epoch.number
        self.work = epoch.work
        start, _, saved = epoch.stream_from or (0, 0, None)
        self.start = start
        self._saved: dict[str, Any] = dict(saved["workers"]) if saved else {}
        self._next: int = saved["next"] if saved else 0
        self._latest: dict[str, Any] = dict(self._saved)  # each worker's state, in output order
        self._opening: dict[str, Any] = dict(self._saved)  # each worker's place at its start
        self._keeps_state = False  # a worker's pass keeps a state (they all do, or none)
        self._opens = 0  # workers whose pass is open
        # No batch is pulled before every pass is open: the first batch's mark holds every
        # worker's place at its start, however late one opened.
        self._all_open = anyio.Event()

    def _opened(self, worker: int, resumable: bool, opening: Any) -> None:
        """``worker``'s pass is open; if it keeps a state, ``opening`` is where it stands
        before its first batch (None: its start). That is the worker's place until a batch of
        its own goes out (no batch is pulled before every pass is open, so every mark holds
        it). Once every worker's pass is open and keeps a state, the epoch's place before its
        first batch is told (``on_stream_start``): the states the epoch was resumed from and
        those openings."""
        start = self.epoch.on_stream_start
        if resumable and not self._keeps_state:  # known from the first worker to open
            self._keeps_state = True
            if start is not None:
                start(None)
        if opening is not None:
            self._latest.setdefault(str(worker), opening)
            self._opening.setdefault(str(worker), opening)
        self._opens += 1
        if self._opens < self.work.concurrency:
            return
        self._all_open.set()
        if self._keeps_state and start is not None:
            start((self.start, 0, {"workers": dict(self._opening), "next": self._next}))

    def _marked(self, item: Done, seq: int) -> None:
        """Give ``item`` (a batch going out as the epoch's ``seq``) the mark a resumed epoch
        starts from: every worker's state as of it, and the worker whose turn is next."""
        worker, state = item.batch.ids[0], item.batch.mark
        if state is None:  # a failed batch (its worker's place is not known), or no state kept
            item.batch.mark = None
            return
        self._latest[str(worker)] = state
        turn = (worker + 1) % self.work.concurrency
        item.batch.mark = (seq + 1, 0, {"workers": dict(self._latest), "next": turn})

    async def run(self, done: MemoryObjectSendStream[Done]) -> None:
        """Every worker iterates its own copy of an iterable dataset (torch's semantics: it
        shards itself with ``get_worker_info()``). Batches go out round-robin over the workers
        still going (``in_order``) or as they come; a worker whose pass ends stops contributing.
        A failed batch is raised in its turn and its worker goes on, as in torch."""
        work = self.work
        if not work.per_worker:
            raise TypeError("an iterable dataset in workers needs process workers")
        n, in_order = work.concurrency, self.config.in_order
        out = RankBatches(self.epoch, done, start=self.start, mark=self._marked)
        # The lanes outlive the task group: no pull task ever sends into a closed lane.
        with one_item_lanes(Done, n if in_order else 0) as lanes:
            async with done, work.reserved() as run_on, anyio.create_task_group() as tg:
                if in_order:  # one lane per worker, taken in turn
                    for worker_id, (send, _) in enumerate(lanes):
                        tg.start_soon(self._pull_worker_stream, run_on, worker_id, send)
                    receivers = [recv for _, recv in lanes]
                    turn = self._next % n  # a resumed epoch: the worker whose turn was next
                    receivers = receivers[turn:] + receivers[:turn]  # the same cycle
                    while receivers:
                        for recv in list(receivers):
                            try:
                                item = await recv.receive()
                            except anyio.EndOfStream:  # that worker's pass is over
                                receivers.remove(recv)
                                continue
                            await out.offer(item)
                    await out.finish()
                    return
                merged_send, merged_recv = anyio.create_memory_object_stream[Done](n)
                async with merged_send:
                    for worker_id in range(n):
                        send = merged_send.clone()
                        tg.start_soon(self._pull_worker_stream, run_on, worker_id, send)
                async with merged_recv:
                    async for item in merged_recv:
                        await out.offer(item)
                await out.finish()

    async def _pull_worker_stream(
        self,
        run_on: Callable[..., Awaitable[Any]],
        worker_id: int,
        results: MemoryObjectSendStream[Done],
    ) -> None:
        cfg = self.config
        async with results:
            seed = derive_seed(cfg.seed, self.number, worker_id) if cfg.seeded else None
            saved = self._saved.get(str(worker_id))
            # A dead worker is replaced here.
            pipe_seed = self.epoch.pipe_seed
            prepare = None if pipe_seed is None else functools.partial(seed_pipe, seed=pipe_seed)
            resumable, opening = await run_on(worker_id, open_stream, saved, prepare, seed=seed)
            self._opened(worker_id, resumable, opening)
            try:
                await self._all_open.wait()
                await self._pull_batches(run_on, worker_id, results)
            finally:  # ended early (a break, a failure): the pass's `finally` blocks run now
                with (
                    anyio.CancelScope(shield=True),
                    anyio.move_on_after(CANCEL_GRACE),
                    contextlib.suppress(Exception),
                ):
                    await run_on(worker_id, close_stream, replace=False)

    async def _pull_batches(
        self,
        run_on: Callable[..., Awaitable[Any]],
        worker_id: int,
        results: MemoryObjectSendStream[Done],
    ) -> None:
        """A worker's batches, in its order, until its pass is over. A failed batch goes on
        with its error and, where the worker read its samples, its place after them: a resumed
        epoch starts past it (as past a batch that went out), not at it. So does a batch whose
        samples were all skipped, empty."""
        rec = self.stats.transform
        seq = 0  # this worker's batches; the epoch's order is given when they go out
        while True:
            place = None  # the worker's state after this batch's samples, once it has read them
            try:
                with rec.operation() as op:
                    result = await self._next_worker_batch(run_on, worker_id, op)
                    if result is not None:
                        place = result.state
                        result = await self._settled(run_on, worker_id, seq, result)
            except WorkerCrashed:  # its copy of the stream is gone with it
                raise
            except Exception as exc:
                exc.add_note(
                    f"aioloader: in worker {worker_id}'s pass over its copy of the dataset, "
                    f"its batch {seq}, epoch {self.number}"
                )
                await results.send(Done(Batch(seq, [worker_id], [], mark=place), None, 0, exc))
                seq += 1
                continue
            if result is None:
                return
            # One whose samples were all skipped goes on empty: its place is taken with the
            # next item (a resumed epoch does not read and skip them again).
            batch = Batch(seq, [worker_id], [], mark=place)
            await results.send(Done(batch, result.batch, result.size))
            seq += 1

    async def _next_worker_batch(
        self, run_on: Callable[..., Awaitable[Any]], worker_id: int, op: Operation
    ) -> JobResult | None:
        """A worker's next batch as it made it (None at its pass's end): its failures
        reported, not raised, unless its pass's iterator failed."""
        cfg = self.config
        try:
            result: JobResult | None = await run_on(
                worker_id,
                next_stream_batch,
                None if cfg.unbatched else cfg.batch_size,
                cfg.drop_last,
                cfg.transform,
                cfg.collate_fn,
                cfg.finish,
                self.epoch.budget.left > 0,
                replace=False,  # a fresh worker would have no pass: it would end silently
            )
        except WorkerCrashed:
            op.not_a_failure()  # counted with the worker's crash
            raise
        return result

    async def _settled(
        self, run_on: Callable[..., Awaitable[Any]], worker_id: int, seq: int, result: JobResult
    ) -> JobResult:
        """``result`` with its failed samples skipped as the failure budget allows.

        Raises:
            Exception: The batch failed as a whole, or a failure past the budget.
        """
        if result.error is not None:
            error, result.error = result.error, None
            raise error
        if not result.failures:
            return result
        keys = [
            f"worker {worker_id}, its batch {seq}, position {position}"
            for position, _, _ in result.failures
        ]
        run = functools.partial(run_on, worker_id, replace=False)
        return await self.epoch.skip_then_collate(Batch(seq, [worker_id], []), result, keys, run)
