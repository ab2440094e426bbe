"""Reading a map-style source's samples into their batch.

Owns: :class:`Reads`: a slice of a batch read the way its source and pace call for (one
``get_many`` call; samples one after another in this task; a sample alone through the whole
fetch path), each failure skipped within the budget or failing its batch, the bytes held
charged, and the pace observed. Never: schedules (``epoch.py`` deals the slices out) or decides
the pace (``fetch.Pace``).
"""

from __future__ import annotations

import time

from .._base.exceptions import as_failure
from .._base.recorders import Recorders
from .._data.source import MapSource
from .fetch import READ, Attempts, FailureBudget, Pace
from .flow import ByteBudget, nbytes_of, nbytes_of_all
from .items import Batch

__all__ = ["Reads"]


class Reads:
    """The fetch stage's reads of one epoch (see the module)."""

    def __init__(
        self,
        attempts: Attempts,
        budget: FailureBudget,
        pace: Pace,
        held: ByteBudget,
        stats: Recorders,
    ) -> None:
        self._attempts = attempts
        self._budget = budget
        self._pace = pace
        self._bytes = held
        self._stats = stats

    async def slice(self, source: MapSource, batch: Batch, start: int, stop: int) -> None:
        """Read positions ``start`` to ``stop`` of ``batch`` into it.

        Raises: nothing of a sample's: a failure is skipped (the budget allows) or stored on
        the batch, which fails in its turn.

        Cancellation: the read in progress is cancelled; nothing stays counted in flight.
        """
        if source.batched:
            await self.many(source, batch, start, stop)
        elif stop - start == 1:
            began = time.perf_counter()
            await self.one(source, batch, start)
            self._pace.observe(time.perf_counter() - began)
        else:
            await self.in_turn(source, batch, start, stop)

    async def one(self, source: MapSource, batch: Batch, position: int) -> None:
        """Read one sample through the whole fetch path (timeout, retries)."""
        index = batch.ids[position]
        try:
            sample = await self._attempts.run(lambda: source.get(index), index, batch.seq)
        except Exception as exc:
            self._skip_or_end(batch, position, exc)
        else:
            batch.samples[position] = sample
            self._charge(batch, nbytes_of(sample))
        batch.pending -= 1

    async def in_turn(self, source: MapSource, batch: Batch, start: int, stop: int) -> None:
        """Read positions ``start`` to ``stop`` one after another in this task (reads that do
        not wait: see :class:`~aioloader._pipeline.fetch.Pace`), each failure handled alone
        as :meth:`one` handles it. One read in flight; each counted when the slice
        ends, with the slice's mean time."""
        attempts, rec = self._attempts, self._stats.fetch
        if not attempts.plain:  # retries or timeouts: each read through the whole machinery
            began = time.perf_counter()
            for position in range(start, stop):
                await self.one(source, batch, position)
            self._pace.observe(time.perf_counter() - began, stop - start)
            return
        ids, samples, get, ok = batch.ids, batch.samples, source.get, 0
        rec.start()  # one read in flight at a time
        began = time.perf_counter()
        try:
            for position in range(start, stop):
                try:
                    samples[position] = await get(ids[position])
                except BaseException as exc:
                    failure = as_failure(exc, READ)
                    if failure is None:
                        raise  # cancelled
                    rec.failed += 1
                    error = attempts.failed(failure, ids[position], batch.seq)
                    self._skip_or_end(batch, position, error)
                else:
                    ok += 1
                batch.pending -= 1
        except BaseException:  # cancelled: no longer in flight, nothing else counted
            rec.leave(1)
            raise
        took = time.perf_counter() - began
        rec.finish_in_turn(ok, took)
        self._charge(batch, nbytes_of_all(samples[start:stop]))
        self._pace.observe(took, stop - start)

    def _skip_or_end(self, batch: Batch, position: int, exc: Exception) -> None:
        """A sample failed: skip it within the budget, or fail its batch."""
        try:
            self._budget.skip_or_raise(exc, "fetch", batch.seq, batch.ids[position])
        except Exception as fatal:
            batch.error = batch.error or fatal
        batch.failed.add(position)

    async def many(self, source: MapSource, batch: Batch, start: int, stop: int) -> None:
        """Read a slice with one ``get_many`` call; if it fails and the budget allows, read it
        sample by sample so only the bad samples go."""
        ids = batch.ids[start:stop]
        began = time.perf_counter()
        try:
            samples = await self._attempts.run(
                lambda: source.get_many(ids), ids, batch.seq, count=len(ids)
            )
        except Exception as exc:
            if self._budget.left == 0:
                self._budget.exhausted_note(exc)
                batch.error = batch.error or exc
                batch.pending -= len(ids)
                return
            # Some of the slice may be fine: fetch it item by item so only bad samples go (and
            # only they count as failed).
            self._stats.fetch.failed -= len(ids)
            for position in range(start, stop):
                await self.one(source, batch, position)
            return
        self._pace.observe_slice(time.perf_counter() - began)
        batch.samples[start:stop] = samples
        batch.pending -= len(ids)
        self._charge(batch, nbytes_of_all(samples))

    def _charge(self, batch: Batch, n: int) -> None:
        """Count ``n`` fetched bytes held by ``batch``."""
        batch.nbytes += n
        self._bytes.charge(n)
        stats = self._stats
        stats.bytes_held = self._bytes.held
        if stats.bytes_held > stats.max_bytes_held:
            stats.max_bytes_held = stats.bytes_held
