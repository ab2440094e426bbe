"""One epoch of the data path: schedule → fetch → transform+collate → reorder → device → output.

Owns: the stages of one epoch as tasks in one task group, joined by bounded memory object
streams, and the bounds that make backpressure work:

* at most ``window`` batches exist between being scheduled and being handed to the output
  stream (a semaphore slot per batch, released when the batch enters the output stream);
* at most ``max_inflight`` sample fetches run at once (that many fetch workers pull jobs from
  a stream; a batched source fetches slices of ``fetch_chunk`` samples, or whole batches, and
  counts every sample of a slice against the bound);
* at most ``prefetch`` finished batches wait for the consumer (the output stream's buffer);
  with a device stage, at most ``max(prefetch, 1)`` staged batches (on the device) do: a slot
  per batch, taken before staging, given back when the consumer takes the batch;
* optionally, fetched bytes held in unfinished batches stay near ``max_inflight_bytes``.

A slow consumer fills the output stream, the emitter blocks, slots stop coming back, the
scheduler stops, and fetching stops. End of data is the closing of a stream, never a value in
it. A batch that failed (its fetch, transform or collate) is a :class:`Raised` item in its turn:
the consumer raises it, and its next call goes on with the following batch, as torch's does. A
failed stream (a source that raised) cannot go on, so its failure is the last item before the
end. A failure of the pipeline itself is recorded on the :class:`Epoch` and the output stream
is closed after it.

Where a blocking (torch) dataset lives in the worker processes
(:class:`~aioloader._data.source.InWorkers`) there is no fetch stage: a map-style batch's
indices go to a worker, which reads, transforms and collates them; an iterable dataset is
iterated by every worker on its own copy (``worker_streams.py``), and the batches come
round-robin across the workers (``in_order``) or as they are ready.

Never: decides order or sharding itself (``_data/sampler.py``, ``_data/sharding.py``,
``reorder.py`` do), or lets a task outlive the epoch's task group.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._base.exceptions import WorkerCrashed, annotate, first_leaf
from .._base.recorders import Recorders
from .._data.resume import Mark, Taken
from .._data.seeds import derive_seed
from .._data.sharding import StreamShare
from .._data.source import InWorkers, MapSource, StreamSource, is_resumable
from .._device.stage import DeviceStage, Staged
from .._workers.job import (
    JobResult,
    collate_only,
    run_batch,
    run_indices,
)
from .._workers.pool import WorkerPool
from .config import PipelineConfig
from .fetch import Attempts, FailureBudget, Pace
from .flow import ByteBudget, blocked, get, put
from .items import Batch, Done, Raised, one_item_lanes
from .reads import Reads
from .reorder import BatchAssembler, ReorderBuffer
from .worker_streams import WorkerStreams

__all__ = ["Epoch"]

logger = logging.getLogger("aioloader")


class Epoch:
    """One pass over the data. Create it, run :meth:`run` in a task group, read the output.

    Args:
        number: The epoch number (for notes and seeds).
        config: The pipeline settings.
        source: Where samples come from.
        batches: For a map-style source, the epoch's batches of indices (each index alone when
            ``batch_size`` is None), numbered with their places in the epoch (those a resumed
            epoch's consumer already took are left out); None for a stream.
        work: Runs transform + collate jobs.
        stats: The loader's recorders.
        device: The scope's device stage, or None (batches are yielded as collated).
        taken: A resumed epoch, or one whose first batches were made on demand
            (``demand.py``): the places of the batches its consumer took before (not yielded
            again; a stream's batches are re-formed and dropped).
        stream_from: A resumed stream: the place of its next batch, the position and the
            dataset's state to start from.
        pace: How long the source's awaited reads take: the scope's, which outlives the
            epoch (a new one when None).
        empty: Places of batches made on demand with nothing left in them: taken with the
            first item.
        skips_left: The failures the epoch may still skip (``max_failures`` when None).

    Output items: ``(batch, samples, marks)``, or :class:`Raised` in a failed batch's turn. The
    marks are what the consumer takes with the item: ``(seq, samples, stream mark)`` of the
    batch, after those of the batches emitted with nothing in them since the last item (every
    sample skipped under ``max_failures``), so that their places are taken too. The stream mark
    is ``(next seq, position, dataset state)`` after the batch (None unless the stream is
    resumable, and for the batches formed after its end). A stream source's failure has no
    mark of its own: a resumed epoch reads the stream again from before it.
    """

    def __init__(
        self,
        number: int,
        config: PipelineConfig,
        source: MapSource | StreamSource | InWorkers,
        batches: Iterable[tuple[int, list[int]]] | None,
        work: WorkerPool,
        stats: Recorders,
        device: DeviceStage | None = None,
        *,
        taken: Taken | None = None,
        stream_from: tuple[int, int, Any] | None = None,
        pace: Pace | None = None,
        empty: Sequence[Mark] = (),
        skips_left: int | None = None,
    ) -> None:
        self.number = number
        self.config = config
        self.source = source
        self.batches = batches
        self.work = work
        self.stats = stats
        self.device = device
        self.taken = taken
        self.stream_from = stream_from
        # Staged batches the consumer has not taken: on the device, ahead of it.
        self._on_device = anyio.Semaphore(device.depth if device is not None else 1)
        self.error: BaseException | None = None
        self.finished = anyio.Event()
        self.cancel_scope = anyio.CancelScope()
        batched = isinstance(source, MapSource) and source.batched
        self._chunk = config.chunk(batched)
        # A plain source's reads: a task per sample, or a batch per task.
        self._pace = pace if pace is not None else Pace()
        self._fetch_workers = config.fetch_workers(batched)
        in_workers = isinstance(source, InWorkers)
        self.window = config.window(work.concurrency, in_workers=in_workers)
        self._slots = anyio.Semaphore(self.window)
        self._bytes = ByteBudget(config.max_inflight_bytes)
        self.budget = FailureBudget(config.max_failures, stats, number)
        if skips_left is not None:
            self.budget.left = skips_left
        self._empty_ahead = list(empty)
        self._attempts = Attempts(stats.fetch, config.retry, config.sample_timeout, number)
        self._reads = Reads(self._attempts, self.budget, self._pace, self._bytes, stats)
        self._open_batches = 0
        stats.window.limit = self.window
        # A stream is read one sample at a time: its fetch stage has one slot.
        streamed = isinstance(source, StreamSource)
        stats.fetch.limit = 1 if streamed else max(config.max_inflight, self._chunk)
        stats.fetch.queue_capacity = self.window
        stats.transform.queue_capacity = self.window

    # -- the task ------------------------------------------------------------------------------

    async def run(
        self,
        out: MemoryObjectSendStream[Any],
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run the epoch's stages until the data ends, a stage fails, or it is cancelled.

        A failure is stored in :attr:`error`; ``out`` is closed afterwards in every case, so the
        consumer sees the end of the stream only once the outcome is known.

        Cancellation: every stage is cancelled and waited for; running transform calls finish
        first (see ``_workers/offload.py``); nothing is left running.
        """
        try:
            task_status.started()  # inside the try: from here on, `out` is closed whatever happens
            with self.cancel_scope:
                await self._stages(out)
        except Exception as exc:  # a stage failed: hand the original exception to the consumer
            if self.error is None:
                self.error = first_leaf(exc)
        finally:
            out.close()
            # Batches abandoned by an early end leave the window and give their bytes back.
            self.stats.window.leave(self._open_batches)
            self._open_batches = 0
            self.stats.bytes_held = 0
            self.finished.set()

    async def _stages(self, out: MemoryObjectSendStream[Any]) -> None:
        window = self.window
        ready_send, ready_recv = anyio.create_memory_object_stream[Batch](window)
        done_send, done_recv = anyio.create_memory_object_stream[Done](window)
        async with anyio.create_task_group() as tg:
            if isinstance(self.source, InWorkers) and not self.source.is_map:
                # Each worker iterates its own copy: batches come ready-made from the workers.
                ready_send.close()
                ready_recv.close()
                resumable = is_resumable(self.source.dataset)
                tg.start_soon(WorkerStreams(self, resumable=resumable).run, done_send)
                tg.start_soon(self._emit, done_recv, out)
                return
            if isinstance(self.source, InWorkers):
                if self.batches is None:
                    raise TypeError("a map-style epoch needs its batches of indices")
                tg.start_soon(self._schedule_indices, self.batches, ready_send.clone())
            elif isinstance(self.source, MapSource):
                if self.batches is None:
                    raise TypeError("a map-style epoch needs its batches of indices")
                # Jobs of admitted batches only (the window bounds them); buffered so that the
                # scheduler queues a whole batch without a task switch per sample.
                buffer = window * self.config.per_batch
                jobs_send, jobs_recv = anyio.create_memory_object_stream[tuple[Batch, int, int]](
                    buffer
                )
                # A pool whose fast calls run inline is called by the fetch workers themselves:
                # a batch goes on to be transformed without a hand-off to a stage of its own.
                then = done_send if self.work.inlines else ready_send
                direct = done_send.clone() if self.work.inlines else None
                tg.start_soon(self._schedule_map, self.source, self.batches, jobs_send, direct)
                for _ in range(self._fetch_workers):
                    tg.start_soon(self._fetch_worker, self.source, jobs_recv.clone(), then.clone())
                jobs_recv.close()
                if self.work.inlines:
                    ready_send.close()
                    ready_recv.close()
                    done_send.close()
                    tg.start_soon(self._emit, done_recv, out)
                    return
            else:
                tg.start_soon(self._schedule_stream, self.source, ready_send.clone())
            ready_send.close()
            work = self.work
            in_workers = isinstance(self.source, InWorkers)
            if in_workers and work.per_worker and self.config.in_order:
                # torch's rule for a dataset in workers: batch i goes to worker i % n (with
                # in_order=False, as torch, to whichever worker is free).
                tg.start_soon(self._round_robin, work, ready_recv, done_send)
            else:
                for _ in range(work.concurrency):
                    tg.start_soon(self._transform_worker, ready_recv.clone(), done_send.clone())
                ready_recv.close()
                done_send.close()
            tg.start_soon(self._emit, done_recv, out)

    # -- schedule -------------------------------------------------------------------------------

    async def admit(self, batch: Batch) -> None:
        try:  # a free slot costs no trip round the event loop (anyio's acquire always makes one)
            self._slots.acquire_nowait()
        except anyio.WouldBlock:
            with blocked(self.stats.window, "put"):
                await self._slots.acquire()
        self.stats.window.start()
        self._open_batches += 1
        self._bytes.active.add(batch.seq)

    async def _schedule_map(
        self,
        source: MapSource,
        batches: Iterable[tuple[int, list[int]]],
        jobs: MemoryObjectSendStream[tuple[Batch, int, int]],
        done: MemoryObjectSendStream[Done] | None,
    ) -> None:
        """Cut each batch into fetch jobs; or, with ``done`` (the pool inlines), make a batch
        whose reads are known to return at once here, start to finish: reads, transform and
        collate in this task, no hand-off to a fetch worker."""
        async with jobs, done or contextlib.nullcontext():
            for seq, ids in batches:
                batch = Batch(seq, ids, [None] * len(ids), pending=len(ids))
                await self.admit(batch)
                source.will_need(ids)  # up to a window of batches ahead of their reads
                step = self._chunk if source.batched else self._pace.samples_per_job(len(ids))
                quick = source.reads_inline if source.batched else step > 1
                if done is not None and quick and step >= len(ids):
                    await self._bytes.wait_room(batch.seq)
                    await self._reads.slice(source, batch, 0, len(ids))
                    done_batch = await self._transform(batch, self.work.run)
                    await put(done, done_batch, self.stats.transform)
                    continue
                for start in range(0, len(ids), step):
                    await put(jobs, (batch, start, min(len(ids), start + step)), self.stats.window)

    async def _schedule_indices(
        self, batches: Iterable[tuple[int, list[int]]], ready: MemoryObjectSendStream[Batch]
    ) -> None:
        """Batches of indices straight to the workers, which read them (no fetch stage)."""
        async with ready:
            for seq, ids in batches:
                batch = Batch(seq, ids, [])
                await self.admit(batch)
                await put(ready, batch, self.stats.fetch)

    async def pass_on(self, item: Done, seq: int, done: MemoryObjectSendStream[Done]) -> None:
        item.batch.seq = seq  # its place in the epoch, now that the order is decided
        await self.admit(item.batch)
        await put(done, item, self.stats.transform)

    async def skip_then_collate(
        self,
        batch: Batch,
        result: JobResult,
        keys: Sequence[object],
        run: Callable[..., Awaitable[Any]],
        *,
        seed: int | None = None,
    ) -> JobResult:
        """Spend the skip budget on a job's failed samples (``keys`` name them), or raise the
        first one past it; then collate the survivors where the job ran (``run``).

        Raises:
            Exception: A failure past the ``max_failures`` budget, or the collation's own.
        """
        self.budget.skip_each(result.failures, keys, batch.seq)
        if not result.transformed:
            return JobResult(size=0)
        cfg = self.config
        value = await run(
            collate_only,
            cfg.collate_fn,
            result.transformed,
            cfg.unbatched,
            cfg.finish,
            seed=seed,
        )
        return JobResult(batch=value, size=len(result.transformed))

    async def _schedule_stream(
        self, source: StreamSource, ready: MemoryObjectSendStream[Batch]
    ) -> None:
        cfg = self.config
        per_batch = cfg.per_batch
        assembler: BatchAssembler[tuple[int, Any]] = BatchAssembler(per_batch)
        taken = self.taken
        seq, start, state = self.stream_from if self.stream_from is not None else (0, 0, None)
        # A resumable stream's state after each batch travels with it to the consumer.
        marked = source.resumable

        async def ship(items: list[tuple[int, Any]]) -> None:
            nonlocal seq
            mark = (seq + 1, position + 1, source.state()) if marked else None
            batch = Batch(seq, [p for p, _ in items], [s for _, s in items], mark=mark)
            seq += 1
            if taken is not None and batch.seq in taken:
                return  # taken before the stop: formed again, the same, and left out
            await self.admit(batch)
            await put(ready, batch, self.stats.fetch)

        share: StreamShare[Any] | None = None
        if cfg.world_size > 1:
            share = StreamShare(cfg.rank, cfg.world_size)
        async with ready, source.open(self.number, state) as iterator:
            position = start - 1
            while True:
                position += 1
                try:
                    with self.stats.fetch.operation() as op:
                        try:
                            sample = await anext(iterator)
                        except StopAsyncIteration:
                            op.abandon()  # the end of the stream: no fetch
                            break
                except Exception as exc:
                    annotate(exc, "source", epoch=self.number, batch=seq, index=position)
                    # Raised in its turn, after the batches before it (the partial one is lost).
                    while taken is not None and seq in taken:  # its place is another's now
                        seq += 1
                    failed = Batch(seq, [position], [], error=exc, mark=None, counted=False)
                    await self.admit(failed)
                    await put(ready, failed, self.stats.fetch)
                    return
                if share is not None and not share.mine(sample):
                    continue
                full = assembler.add((position, sample))
                if full is not None:
                    await ship(full)
            marked = False  # past the end: the padding and the tail end the epoch, no mark
            for repeated in share.padding() if share is not None else ():
                full = assembler.add(repeated)  # every rank as many samples as the others
                if full is not None:
                    await ship(full)
            tail = assembler.flush(cfg.drop_last)
            if tail is not None:
                await ship(tail)

    # -- fetch ----------------------------------------------------------------------------------

    async def _fetch_worker(
        self,
        source: MapSource,
        jobs: MemoryObjectReceiveStream[tuple[Batch, int, int]],
        ready: MemoryObjectSendStream[Batch] | MemoryObjectSendStream[Done],
    ) -> None:
        """Fetch jobs' samples; a batch whose last sample arrives goes on: to the transform
        stage (``ready`` of batches), or transformed here (``ready`` of done batches, for a
        pool that ``inlines``)."""
        async with jobs, ready:
            while (job := await get(jobs, self.stats.fetch)) is not None:
                batch, start, stop = job
                await self._bytes.wait_room(batch.seq)
                await self._reads.slice(source, batch, start, stop)
                if batch.pending != 0:
                    continue
                if self.work.inlines:
                    await put(
                        ready, await self._transform(batch, self.work.run), self.stats.transform
                    )
                else:
                    await put(ready, batch, self.stats.fetch)

    # -- transform + collate ----------------------------------------------------------------------

    async def _transform_worker(
        self, ready: MemoryObjectReceiveStream[Batch], done: MemoryObjectSendStream[Done]
    ) -> None:
        async with ready, done:
            while (batch := await get(ready, self.stats.transform)) is not None:
                self.stats.fetch.set_queued(ready.statistics().current_buffer_used)
                await put(done, await self._transform(batch, self.work.run), self.stats.transform)

    async def _round_robin(
        self,
        work: WorkerPool,
        ready: MemoryObjectReceiveStream[Batch],
        done: MemoryObjectSendStream[Done],
    ) -> None:
        """Batch ``k`` of the epoch to worker ``k % n``, as torch deals a dataset's batches (a
        worker's copy may keep state, e.g. what ``worker_init_fn`` seeded, and torch's users
        rely on which worker read which batch). One batch queued and one running per worker."""
        n = work.concurrency
        with one_item_lanes(Batch, n) as lanes:
            async with ready, done, work.reserved() as run_on, anyio.create_task_group() as tg:
                for worker_id, (_, recv) in enumerate(lanes):
                    run = functools.partial(run_on, worker_id)
                    tg.start_soon(self._lane, run, recv, done.clone())
                k = 0
                while (batch := await get(ready, self.stats.transform)) is not None:
                    await lanes[k % n][0].send(batch)
                    k += 1
                for send, _ in lanes:
                    send.close()

    async def _lane(
        self,
        run: Callable[..., Awaitable[Any]],
        lane: MemoryObjectReceiveStream[Batch],
        done: MemoryObjectSendStream[Done],
    ) -> None:
        async with lane, done:
            async for batch in lane:
                await put(done, await self._transform(batch, run), self.stats.transform)

    async def _transform(self, batch: Batch, run: Callable[..., Awaitable[Any]]) -> Done:
        cfg, rec = self.config, self.stats.transform
        if batch.error is not None:
            return Done(batch, None, 0, batch.error)
        failed = batch.failed
        keep = (
            range(len(batch.ids))
            if not failed
            else [p for p in range(len(batch.ids)) if p not in failed]
        )
        if not keep:
            return Done(batch, None, 0)
        unbatched = cfg.unbatched
        seed = derive_seed(cfg.seed, self.number, batch.seq) if cfg.seeded else None
        try:
            with rec.operation():
                value, size = await self._run_batch(batch, keep, run, seed)
        except Exception as exc:
            # A worker's failure names its stage and sample already: this adds the batch and
            # the epoch to that note.
            ids = batch.ids[0] if unbatched else batch.ids
            stage = "transform" if isinstance(exc, WorkerCrashed) else "collate"
            annotate(exc, stage, epoch=self.number, batch=batch.seq, index=ids)
            return Done(batch, None, 0, exc)
        return Done(batch, value, size)

    async def _run_batch(
        self,
        batch: Batch,
        keep: Sequence[int],
        run: Callable[..., Awaitable[Any]],
        seed: int | None,
    ) -> tuple[Any, int]:
        """Transform and collate ``batch`` (or, in the workers, read it first); failed samples
        skipped as the failure budget allows. Returns the batch and its size."""
        cfg = self.config
        unbatched = cfg.unbatched
        result: JobResult
        if isinstance(self.source, InWorkers):  # the worker reads the indices itself
            result = await run(
                run_indices,
                batch.ids,
                cfg.transform,
                cfg.collate_fn,
                unbatched,
                cfg.finish,
                cfg.retry,
                self.budget.left > 0,
                seed=seed,
            )
            self.stats.fetch.retries += result.retries
        else:
            samples = [batch.samples[p] for p in keep] if batch.failed else batch.samples
            result = await run(
                run_batch,
                cfg.transform,
                cfg.collate_fn,
                samples,
                unbatched,
                cfg.finish,
                seed=seed,
            )
        if result.failures:
            keys = [batch.ids[keep[position]] for position, _, _ in result.failures]
            result = await self.skip_then_collate(batch, result, keys, run, seed=seed)
        return result.batch, result.size

    # -- reorder + output ---------------------------------------------------------------------

    async def _emit(
        self, done: MemoryObjectReceiveStream[Done], out: MemoryObjectSendStream[Any]
    ) -> None:
        taken = self.taken
        reorder: ReorderBuffer[Done] = ReorderBuffer(taken.through if taken else 0)
        for seq in sorted(taken.beyond) if taken else ():
            reorder.skip(seq)  # taken before the stop: never scheduled
        empty = self._empty_ahead  # places of batches with nothing left: taken with the next item
        async with done:
            while (item := await get(done, self.stats.output)) is not None:
                deliverable = reorder.push(item.batch.seq, item) if self.config.in_order else [item]
                self.stats.transform.set_queued(
                    len(reorder) + done.statistics().current_buffer_used
                )
                for d in deliverable:
                    if d.error is not None:  # its turn has come: every batch before it is out
                        # Handed over, not kept: raised in the consumer, the error's traceback
                        # holds the consumer's frames (and its iterator), which no task of ours
                        # may keep alive.
                        error, d.error, d.batch.error = d.error, None, None
                        own = ((d.batch.seq, 0, d.batch.mark),) if d.batch.counted else ()
                        marks, empty = (*empty, *own), []
                        await put(out, Raised(error, marks), self.stats.output)
                        del error
                    elif d.size:
                        value = d.value if self.device is None else await self._stage(d)
                        mark = (d.batch.seq, d.size, d.batch.mark)
                        if empty:  # the places of empty batches go with this one
                            marks, empty = (*empty, mark), []
                        else:
                            marks = (mark,)
                        await put(out, (value, d.size, marks), self.stats.output)
                        self.stats.output.completed += 1
                        self.stats.output.set_queued(out.statistics().current_buffer_used)
                    else:  # nothing left of it: its place goes with the next item
                        empty.append((d.batch.seq, 0, d.batch.mark))
                    self._bytes.release(d.batch.seq, d.batch.nbytes)
                    self.stats.bytes_held = self._bytes.held
                    self.stats.window.finish(None)
                    self._open_batches -= 1
                    self._slots.release()

    async def _stage(self, d: Done) -> Staged:
        """Pin a batch and issue its copy to the device, once fewer than ``depth`` staged
        batches wait for the consumer. A failure ends the epoch in the batch's turn."""
        device, rec = self.device, self.stats.device
        if device is None:
            raise RuntimeError("no device stage")
        try:
            self._on_device.acquire_nowait()
        except anyio.WouldBlock:
            with blocked(rec, "put"):  # the device is `depth` batches ahead of the consumer
                await self._on_device.acquire()
        try:
            with rec.operation():
                staged = await device.stage(d.value, self._taken)
        except Exception as exc:
            self._taken()
            annotate(exc, "device", epoch=self.number, batch=d.batch.seq)
            self.error = exc
            raise
        except BaseException:  # cancelled: the staging itself finished on its thread
            self._taken()
            raise
        rec.set_queued(device.depth - self._on_device.value)
        return staged

    def _taken(self) -> None:
        """A staged batch left the device's queue: the consumer took it, or staging failed."""
        self._on_device.release()
        if self.device is not None:
            self.stats.device.set_queued(self.device.depth - self._on_device.value)
