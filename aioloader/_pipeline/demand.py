"""A map-style epoch made batch by batch when the consumer asks: torch's ``num_workers=0`` path.

Owns: :class:`OnDemand`, which reads, transforms and collates the epoch's next batch on the
consumer's own thread, inside its call for it (``next()`` of a plain ``for``, ``__anext__`` of
``async for``), while that costs less than a hand-off would; and when it no longer does, the
hand-over of the rest of the epoch to :class:`~aioloader._pipeline.epoch.Epoch`'s stages.

Why: where a batch takes microseconds to make (rows in memory, pre-tokenised text), the stages'
tasks, stream hand-offs and thread hops cost more than the batch. torch's ``num_workers=0``
loop makes each batch in the caller's ``next()``; so does this, with the same statistics, marks
and failure rules as the stages:

* A blocking (torch) dataset's batch is made in the consumer's call on the consumer's thread
  (:meth:`OnDemand.next`: a plain ``for`` makes it on its own thread, no loop involved); an
  ``AsyncDataset``'s reads are awaited on the loop, one after another or a ``get_many`` a batch
  (:meth:`OnDemand.anext`, which makes a blocking dataset's batches too).
* It runs while the reads and the transforms are fast: a blocking read and the transform under
  their pools' ``inline_limit`` (a millisecond: ``_workers/offload.py``; their times count in
  those pools' placements as inline calls do), an awaited read under ``SEQUENTIAL_BELOW_S`` a
  sample, an awaited ``get_many`` under a millisecond a batch (``fetch.Pace``, which it tells:
  reads that fast do not wait for long, so awaiting them in turn loses little overlap;
  ``sources.files`` reads cached files inline). After :data:`SLOW_IN_A_ROW` batches in a row
  that were slower, the rest of the epoch goes to the stages, where slow reads overlap ahead of
  the consumer. One slow batch (the machine busy a moment, a page fault, a collection) is not
  enough: there is no way back to this path within the epoch. A plain ``for`` reading a blocking
  dataset is the exception: it makes every batch in its own thread's calls, however slow, as
  torch's ``num_workers=0`` loop does (nothing of the event loop's waits on it; handed to the
  stages, the reading thread and the consumer wait for the GIL at each other's system calls:
  the figures are in docs/design.md). ``prefetch=`` asks for the stages.
* A read that fails with ``max_failures`` left is handed over too (the stages read it again
  sample by sample, so that only the bad samples go); with none left its batch fails in its
  turn. A transform's failure spends the budget here, as the stages spend it.
* The statistics are the stages': reads and transforms counted with their times, the
  consumer's waits; the bytes held are a batch's collated bytes (nothing else is held: its
  samples are gone once it is collated).
* Nothing runs ahead of the consumer, and nothing runs between its calls: handing over is
  starting the stages on the batches not yet made (those made count as taken). A call
  cancelled while it awaits a read leaves its batch to the next call, which reads it again.

Never: runs anything on the event loop, or decides whether an epoch may be made on demand (the
consumer's end does: ``_loader/consumer.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

from .._base.exceptions import annotate, as_failure, raised_of_its_own
from .._base.inline import INLINE_BELOW_S, SEQUENTIAL_BELOW_S, SLOW_IN_A_ROW
from .._base.recorders import Recorders
from .._data.resume import Mark, Taken
from .._data.source import MapSource
from .._workers.job import collate_only, run_batch
from .._workers.offload import ThreadOffload
from .config import PipelineConfig
from .fetch import READ, Attempts, FailureBudget, Pace
from .flow import nbytes_of
from .items import Raised

__all__ = ["HANDED_OVER", "OnDemand"]

#: What :meth:`OnDemand.next` returns when the rest of the epoch goes to the stages.
HANDED_OVER: Any = object()


_AGAIN: Any = object()  # a batch with nothing left: on with the next one


class OnDemand:
    """The consumer's side of a map-style epoch whose batches are made in its calls.

    Args:
        number: The epoch number (for notes).
        config: The pipeline settings.
        source: The dataset: blocking (``source.reads_now()`` gives its pool and read), or
            async (its ``get_many`` awaited a batch at a time, or its ``get`` sample by sample).
        batches: The epoch's numbered batches of indices, in order (a resumed epoch's taken ones
            left out).
        work: The transform pool; it runs fast calls inline (an ``inline_limit``).
        stats: The loader's recorders.
        pace: The scope's record of how long an awaited read takes (observed here too).
        taken: A resumed epoch's batches taken before, or None.
        patient: The consumer is a plain ``for`` on its own thread: a blocking dataset's slow
            batches are made here too, as torch's ``num_workers=0`` loop makes them.

    Raises:
        ValueError: A pool that never runs calls inline.

    After :meth:`next` or :meth:`anext` returned :data:`HANDED_OVER`, :meth:`rest` gives what
    the stages go on with.
    """

    def __init__(
        self,
        number: int,
        config: PipelineConfig,
        source: MapSource,
        batches: Iterator[tuple[int, list[int]]],
        work: ThreadOffload,
        stats: Recorders,
        pace: Pace,
        taken: Taken | None,
        *,
        patient: bool = False,
    ) -> None:
        reads = source.reads_now()
        self.io: ThreadOffload | None = None
        self._read: Callable[[Sequence[int]], list[Any]] | None = None
        self._get: Callable[[int], Awaitable[Any]] = source.get
        self._get_many = source.get_many if source.batched else None
        io_limit: float | None = SEQUENTIAL_BELOW_S  # an awaited read's, per sample
        if reads is not None:
            self.io, self._read = reads
            io_limit = self.io.inline_limit
        elif source.batched:
            io_limit = INLINE_BELOW_S  # an awaited slice's, as a blocking one's
        if io_limit is None or work.inline_limit is None:
            raise ValueError("an epoch made on demand needs pools that run calls inline")
        self.number = number
        self.config = config
        self.io_limit = io_limit  # a batch's read (a blocking one, or get_many), or per sample
        self.work, self.work_limit = work, work.inline_limit
        self.pace = pace
        self._batches = batches
        self.stats = stats
        self.taken = Taken(taken.through, taken.beyond) if taken is not None else Taken()
        self.budget = FailureBudget(config.max_failures, stats, number)
        self._attempts = Attempts(stats.fetch, None, None, number)  # notes only
        self._next: tuple[int, list[int]] | None = None  # the batch the next call makes first
        self._empty: list[Mark] = []  # places of batches with nothing left: taken with the next
        self._slow = 0  # batches in a row whose read or transform was slow
        self._patient = patient and self._read is not None
        self.handed_over = False
        self.ended = False

    @property
    def blocking(self) -> bool:
        """Whether the reads are blocking calls (:meth:`next` may make a batch), not awaited."""
        return self._read is not None

    @property
    def ready(self) -> bool:
        """Whether the next batch may be made here: nothing of the pools' runs on their threads,
        and fewer than :data:`SLOW_IN_A_ROW` batches in a row were slow (unless patient)."""
        io = self.io
        quick = self._patient or self._slow < SLOW_IN_A_ROW
        return quick and (io is None or io.idle) and self.work.idle

    def next(self) -> Any:
        """The next output item, made now on the calling thread: as the stages' output stream
        carries them (``(batch, samples, marks)`` or :class:`Raised`), None at the end of the
        epoch, or :data:`HANDED_OVER`: the rest of the epoch goes to the stages (see
        :meth:`rest`). Blocking reads only (see :attr:`blocking`).

        Raises: nothing of a batch's (a failed batch is a :class:`Raised` item).
        Cancellation: not a waiting point; a call runs to its end.
        """
        read = self._read
        if read is None:
            raise TypeError("an async dataset's batches are made by anext()")
        while True:
            job = self._take()
            if not isinstance(job, tuple):
                return job
            seq, ids = job
            began = time.perf_counter()
            try:
                samples = read(ids)
            except (Exception, asyncio.CancelledError) as exc:  # its note names the sample
                failure = exc if isinstance(exc, Exception) else raised_of_its_own(exc, READ)
                item = self._read_failed(failure, seq, ids, began, ids)
            else:
                item = self._made(seq, ids, samples, began)
            item = self._settle(seq, ids, item)
            if item is not _AGAIN:
                return item

    async def anext(self) -> Any:
        """As :meth:`next`, on the event loop: an async dataset's reads are awaited one after
        another (a blocking one's made at once, as :meth:`next` makes them).

        Raises: nothing of a batch's (a failed batch is a :class:`Raised` item).
        Cancellation: the batch being read is left to the next call, which reads it again.
        """
        if self._read is not None:
            return self.next()
        get, get_many = self._get, self._get_many
        while True:
            job = self._take()
            if not isinstance(job, tuple):
                return job
            seq, ids = job
            began, index = time.perf_counter(), None
            try:
                if get_many is not None:
                    samples = await get_many(ids)
                else:
                    samples = [await get(index := i) for i in ids]
            except BaseException as exc:
                failure = as_failure(exc, READ)
                if failure is None:  # cancelled: this batch is the next call's
                    self._next = (seq, ids)
                    raise
                key = ids if get_many is not None else index
                item = self._read_failed(failure, seq, ids, began, key)
            else:
                item = self._made(seq, ids, samples, began)
            item = self._settle(seq, ids, item)
            if item is not _AGAIN:
                try:
                    return item
                finally:  # a failed batch's error keeps this (coroutine) frame: no cycle
                    del item

    def rest(self) -> tuple[Iterator[tuple[int, list[int]]], Taken, list[Mark], int]:
        """What the stages go on with once handed over: the batches not yet made, those taken
        (made here, or before a resume), the places of empty batches to go with the next
        item, and the failures the epoch may still skip."""
        batches = self._batches
        if self._next is not None:
            batches = _first_then(self._next, batches)
            self._next = None
        return batches, self.taken, self._empty, self.budget.left

    def _take(self) -> Any:
        """The next ``(seq, ids)`` to make here, None at the end, or :data:`HANDED_OVER`."""
        if self.ended:
            return None
        if self.handed_over:
            return HANDED_OVER
        if not self.ready:
            self.handed_over = True
            return HANDED_OVER
        if self._next is not None:
            job, self._next = self._next, None
            return job
        try:
            return next(self._batches)
        except StopIteration:
            self.ended = True
            return None

    def _settle(self, seq: int, ids: list[int], item: Any) -> Any:
        """What a call returns for batch ``seq``'s ``item``: the item, :data:`HANDED_OVER`
        (the batch unmade, the stages' first), or :data:`_AGAIN` (nothing left of it)."""
        if item is HANDED_OVER:
            self.handed_over = True
            self._next = (seq, ids)
            return HANDED_OVER
        self.taken.add(seq)
        return _AGAIN if item is None else item

    def _read_failed(
        self, exc: Exception, seq: int, ids: list[int], began: float, key: object
    ) -> Any:
        """A batch whose read of ``key`` raised ``exc``: handed over while the budget may skip
        some of it (the stages read it sample by sample), else its failed item."""
        took = time.perf_counter() - began
        if self.io is not None:
            self.io.took_inline(took)
        if self.budget.left:
            return HANDED_OVER
        # A slice read in one call fails whole, as the stages count it; a sample read alone, one.
        self.stats.fetch.record(took, len(ids) if key is ids else 1, ok=False)
        error = self._attempts.failed(exc, key, seq)
        self.budget.exhausted_note(error)
        return Raised(error, (*self._taken_empty(), (seq, 0, None)))

    def _made(self, seq: int, ids: list[int], samples: list[Any], began: float) -> Any:
        """A read batch transformed and collated: its output item, or None when nothing is left
        of it (its place goes with the next item); the times counted, the slow ones too."""
        read = time.perf_counter()
        took = read - began
        if self.io is not None:
            self.io.took_inline(took)
            slow = took >= self.io_limit
        elif self._get_many is not None:
            self.pace.observe_slice(took)
            slow = took >= self.io_limit
        else:
            self.pace.observe(took, len(ids))
            slow = took >= self.io_limit * len(ids)
        self.stats.fetch.record(took, len(ids))
        item = self._finish(seq, ids, samples)
        done = time.perf_counter() - read
        self.work.took_inline(done)
        self.stats.transform.record(done, 1, ok=not isinstance(item, Raised))
        self._slow = self._slow + 1 if slow or done >= self.work_limit else 0
        return item

    def _finish(self, seq: int, ids: list[int], samples: list[Any]) -> Any:
        """Transform and collate a read batch into its output item (see :meth:`_made`)."""
        cfg, stats = self.config, self.stats
        try:
            result = run_batch(cfg.transform, cfg.collate_fn, samples, cfg.unbatched, cfg.finish)
            if result.failures:
                keys = [ids[position] for position, _, _ in result.failures]
                self.budget.skip_each(result.failures, keys, seq)
                if not result.transformed:
                    self._empty.append((seq, 0, None))
                    return None
                value = collate_only(cfg.collate_fn, result.transformed, cfg.unbatched, cfg.finish)
                size = len(result.transformed)
            else:
                value, size = result.batch, result.size
        except (Exception, asyncio.CancelledError) as exc:
            failure = exc if isinstance(exc, Exception) else raised_of_its_own(exc, "collate_fn")
            annotate(failure, "collate", epoch=self.number, batch=seq, index=ids)  # or completes
            return Raised(failure, (*self._taken_empty(), (seq, 0, None)))
        nbytes = nbytes_of(value)
        if nbytes > stats.max_bytes_held:
            stats.max_bytes_held = nbytes
        stats.output.completed += 1
        stats.made_on_demand += 1
        return value, size, (*self._taken_empty(), (seq, size, None))

    def _taken_empty(self) -> tuple[Mark, ...]:
        empty, self._empty = self._empty, []
        return tuple(empty)


def _first_then(
    first: tuple[int, list[int]], rest: Iterator[tuple[int, list[int]]]
) -> Iterator[tuple[int, list[int]]]:
    yield first
    yield from rest
