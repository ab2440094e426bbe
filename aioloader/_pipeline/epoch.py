"""One epoch of the data path: schedule → fetch → transform+collate → reorder → device → output.

Owns: the stages of one epoch as tasks in one task group, joined by bounded memory object
streams (the schedulers and the fetch stage here; the transform + collate stage in
``transform.py`` and the reorder + device + output stage in ``output.py``, the epoch's base
classes), and the bounds that make backpressure work:

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

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._base.exceptions import annotate, first_leaf, stray_cancellation
from .._base.recorders import Recorders
from .._data.resume import Mark, Taken
from .._data.sharding import StreamShare
from .._data.source import InWorkers, MapSource
from .._data.streams import StreamSource
from .._device.stage import DeviceStage
from .._workers.pool import WorkerPool
from .config import PipelineConfig
from .fetch import Attempts, FailureBudget, Pace
from .flow import ByteBudget, blocked, get, put
from .handoff import HandoffSend
from .items import Batch, Done
from .output import OutputStage
from .reads import Reads
from .reorder import BatchAssembler
from .transform import TransformStage
from .worker_streams import WorkerStreams

__all__ = ["Epoch"]

logger = logging.getLogger("aioloader")


class Epoch(TransformStage, OutputStage):
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
        on_stream_start: Called (on the loop) once a stream's pass is open and keeps a state
            (for worker processes, once every worker's is): with its mark before its first
            batch, where it stands before anything was read, or None for the stream's start.
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
        on_stream_start: Callable[[tuple[int, int, Any] | None], None] | None = None,
        pace: Pace | None = None,
        empty: Sequence[Mark] = (),
        skips_left: int | None = None,
        pipe_seed: int | None = None,
    ) -> None:
        self.number = number
        self.pipe_seed = pipe_seed  # a DataPipe's epoch seed, for its readers in the workers
        self.config = config
        self.source = source
        self.batches = batches
        self.work = work
        self.stats = stats
        self.device = device
        self.taken = taken
        self.stream_from = stream_from
        self.on_stream_start = on_stream_start
        # Staged batches the consumer has not taken: on the device, ahead of it.
        self._on_device = anyio.Semaphore(device.depth if device is not None else 1)
        self.error: BaseException | None = None
        self.finished = anyio.Event()
        self.began = False  # its task has run (a task cancelled before it runs never does)
        self.cancel_scope = anyio.CancelScope()
        batched = isinstance(source, MapSource) and source.batched
        self._chunk = config.chunk(batched)
        # A plain source's reads: a task per sample, or a batch per task.
        self._pace = pace if pace is not None else Pace()
        self._fetch_workers = config.fetch_workers(batched)
        in_workers = isinstance(source, InWorkers)
        dealt = isinstance(source, InWorkers) and source.dealt
        self._lanes = dealt and work.per_worker and config.in_order  # see _round_robin
        depth = work.depth if self._lanes else 1
        self.window = config.window(work.concurrency, in_workers=in_workers, depth=depth)
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
        out: HandoffSend[Any],
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run the epoch's stages until the data ends, a stage fails, or it is cancelled.

        A failure is stored in :attr:`error`; ``out`` is closed afterwards in every case, so the
        consumer sees the end of the stream only once the outcome is known.

        Cancellation: every stage is cancelled and waited for; running transform calls finish
        first (see ``_workers/offload.py``); nothing is left running.
        """
        self.began = True
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

    async def _stages(self, out: HandoffSend[Any]) -> None:
        window = self.window
        ready_send, ready_recv = anyio.create_memory_object_stream[Batch](window)
        done_send, done_recv = anyio.create_memory_object_stream[Done](window)
        async with anyio.create_task_group() as tg:
            if isinstance(self.source, InWorkers) and not self.source.is_map:
                # Each worker iterates its own copy: batches come ready-made from the workers.
                ready_send.close()
                ready_recv.close()
                tg.start_soon(WorkerStreams(self).run, done_send)
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
            if self._lanes:
                # torch's rule for a dataset in workers: batch i goes to worker i % n (with
                # in_order=False, as torch, to whichever worker is free; an async dataset's
                # reader, which keeps no state, too).
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

    async def _schedule_stream(
        self, source: StreamSource, ready: MemoryObjectSendStream[Batch]
    ) -> None:
        cfg = self.config
        per_batch = cfg.per_batch
        assembler: BatchAssembler[tuple[int, Any]] = BatchAssembler(per_batch)
        taken = self.taken
        seq, start, state = self.stream_from if self.stream_from is not None else (0, 0, None)
        marked = False

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
            # A resumable stream's state after each batch travels with it to the consumer
            # (whether the pass keeps one is known once it is open).
            marked = source.resumable
            if marked and self.on_stream_start is not None:
                opening = source.state()
                self.on_stream_start(None if opening is None else (seq, start, opening))
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
                        except asyncio.CancelledError as cancel:
                            stray = stray_cancellation(cancel, "the stream")
                            if stray is None:
                                raise
                            raise stray from cancel
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
