"""The transform + collate stage of an epoch: a batch's samples made into the batch.

Owns: :class:`TransformStage`, the part of :class:`~aioloader._pipeline.epoch.Epoch` that runs
a fetched batch's ``transform`` and ``collate_fn`` on the work pool (each job on whichever
worker is free, or batch ``k`` on worker ``k % n`` as torch deals a dataset in workers), a batch
of indices read by the workers themselves, and the skip budget spent on the failed samples of a
job before the survivors are collated. A failed batch becomes a :class:`Done` carrying its
error, annotated with its stage, batch and epoch. Never: schedules, fetches or orders batches,
or holds the window's slots (``epoch.py`` and ``output.py`` do).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._base.exceptions import LoaderTimeout, WorkerCrashed, annotate
from .._base.recorders import Recorders
from .._data.seeds import derive_seed
from .._data.source import InWorkers, MapSource
from .._data.streams import StreamSource
from .._workers.job import JobResult, collate_only, run_batch, run_indices
from .._workers.pool import WorkerPool
from .config import PipelineConfig
from .fetch import FailureBudget
from .flow import get, put
from .items import Batch, Done, one_item_lanes

__all__ = ["TransformStage"]


class TransformStage:
    """The transform + collate stage of an :class:`~aioloader._pipeline.epoch.Epoch` (its base
    class): the epoch sets the attributes below."""

    number: int
    config: PipelineConfig
    source: MapSource | StreamSource | InWorkers
    work: WorkerPool
    stats: Recorders
    budget: FailureBudget

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
        rely on which worker read which batch). ``work.depth`` batches sent to each worker at
        once (a process runs one while the next waits in its pipe) and one queued in its lane:
        a lane's tasks take its batches in turn and send each as they take it, so a worker
        gets them in the epoch's order."""
        n = work.concurrency
        with one_item_lanes(Batch, n) as lanes:
            async with ready, done, work.reserved() as run_on, anyio.create_task_group() as tg:
                for worker_id, (_, recv) in enumerate(lanes):
                    run = functools.partial(run_on, worker_id)
                    for _ in range(work.depth):
                        tg.start_soon(self._lane, run, recv.clone(), done.clone())
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
            # A worker lost (or a Ray worker's replacement not placed) is not collation's.
            lost = isinstance(exc, WorkerCrashed | LoaderTimeout)
            stage = "transform" if lost else "collate"
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
                cfg.retry if cfg.worker_retry is None else cfg.worker_retry,
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
