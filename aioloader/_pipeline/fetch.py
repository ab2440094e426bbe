"""The fetch path's rules, each testable without a loader: one read under the per-sample
timeout and the retry policy (:class:`Attempts`), the epoch's budget of samples it may skip
(:class:`FailureBudget`), and whether a source's reads wait (:class:`Pace`).

Owns: counting attempts and failures in the fetch stage's recorder, the backoff between
attempts, the notes a failure gets ("gave up after N attempts", "max_failures=N exhausted"),
and which skipped keys the statistics keep. Never: decides what a sample is or where it goes
(``_pipeline/epoch.py``).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio

from .._base.exceptions import annotate, stray_cancellation
from .._base.inline import INLINE_BELOW_S, SEQUENTIAL_BELOW_S, Recent
from .._base.recorders import Recorders, StageRecorder
from .._base.retry import RetryPolicy

__all__ = ["READ", "Attempts", "FailureBudget", "Pace"]

logger = logging.getLogger("aioloader")

_MAX_SKIPPED_KEPT = 1000  # skipped sample ids remembered for the statistics

READ = "the dataset's read"
"""What a :class:`~aioloader.StrayCancellation` from a read says raised it."""


class Pace:
    """How long a source's reads take, and so how a batch's reads are dealt out: one job per
    sample (reads that wait overlap, up to ``max_inflight``) or one job per batch (reads that
    return at once run back to back in one task).

    The first batch is read a sample per job; after that the moving average of the time a read
    took (per sample) decides, batch by batch. A batched source's calls (``get_many``, a slice
    each) are timed apart: whether a slice returns within ``slice_below`` (the epochs made on
    demand read them, ``demand.py``).
    """

    __slots__ = ("_below", "_recent", "_slice_below", "_slices")

    def __init__(
        self, below: float = SEQUENTIAL_BELOW_S, slice_below: float = INLINE_BELOW_S
    ) -> None:
        self._below = below
        self._recent = Recent()  # a read's time, per sample
        self._slice_below = slice_below
        self._slices = Recent()  # a batched source's call's time, per slice

    def observe(self, seconds: float, count: int = 1) -> None:
        """``count`` reads took ``seconds`` together."""
        self._recent.add(seconds / count)

    def observe_slice(self, seconds: float) -> None:
        """A batched source's call (one slice) took ``seconds``."""
        self._slices.add(seconds)

    @property
    def slices_quick(self) -> bool:
        """Whether a batched source's calls have been returning within ``slice_below``, or
        none was timed yet (a slow source costs a few calls made in turn before the stages
        take over: ``demand.SLOW_IN_A_ROW``)."""
        return self._slices.not_over(self._slice_below)

    @property
    def sequential(self) -> bool:
        """Whether reads have been returning at once (under the limit, on average), so that
        reading them one after another loses nothing."""
        return self._recent.under(self._below)

    def samples_per_job(self, per_batch: int) -> int:
        """1 while reads wait (or nothing is known yet), else the whole batch."""
        return per_batch if self.sequential else 1


class Attempts:
    """Reads under ``sample_timeout`` (seconds per attempt, None: no limit) and ``retry``
    (None: one attempt), counted in ``rec``; ``epoch`` names the epoch in notes."""

    def __init__(
        self,
        rec: StageRecorder,
        retry: RetryPolicy | None,
        sample_timeout: float | None,
        epoch: int,
    ) -> None:
        self._rec = rec
        self._retry = retry
        self._timeout = sample_timeout
        self._epoch = epoch
        self._rng = random.Random()  # retry jitter only: never affects which data is produced

    @property
    def plain(self) -> bool:
        """No retries and no per-sample timeout: an attempt is just the call."""
        return self._retry is None and self._timeout is None

    def failed(self, error: Exception, key: object, seq: int) -> Exception:
        """``error``, the last attempt's, with the note naming the stage, the sample ``key``
        and the batch ``seq`` (a blocking dataset's own note already names the sample within
        its slice: then it is kept)."""
        annotate(error, "fetch", epoch=self._epoch, batch=seq, index=key)
        return error

    async def run(
        self, call: Callable[[], Awaitable[Any]], key: object, seq: int, *, count: int = 1
    ) -> Any:
        """``call()``'s result, attempted as the retry policy allows (``count``: the samples
        one call reads, for the statistics).

        Raises:
            Exception: The last attempt's error, with a note naming the stage, the sample and
                the batch ``seq`` (and "gave up after N attempts" when it was retried).
            TimeoutError: An attempt took over ``sample_timeout`` and was not retried.

        Cancellation: the attempt in progress is cancelled; nothing stays counted in flight.
        """
        retry, failures = self._retry, 0
        while True:
            again = False  # the policy is asked once per failure
            try:
                with self._rec.operation(count) as op:
                    try:
                        result = await self._call(call)
                    except Exception as exc:
                        again = retry is not None and retry.should_retry(exc, failures + 1)
                        if again:
                            op.retrying()  # another attempt follows: not a failure yet
                        raise
            except Exception as exc:
                error = exc
            else:
                return result
            failures += 1
            if not again or retry is None:
                if failures > 1:
                    error.add_note(f"aioloader: gave up after {failures} attempts")
                raise self.failed(error, key, seq)
            self._rec.retries += 1
            logger.debug("aioloader: retrying %r after %r", key, error)
            await anyio.sleep(retry.delay(error, failures, self._rng))

    async def _call(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """One attempt under the per-sample timeout (no cancel scope when there is none).

        Raises:
            StrayCancellation: The read raised ``CancelledError`` of its own (see
                :func:`~aioloader._base.exceptions.stray_cancellation`).
        """
        try:
            if self._timeout is None:
                return await call()
            with anyio.move_on_after(self._timeout) as deadline:
                result = await call()
        except asyncio.CancelledError as exc:
            stray = stray_cancellation(exc, READ)
            if stray is None:
                raise
            raise stray from exc
        if deadline.cancelled_caught:  # ours, not a timeout of the dataset's own
            raise TimeoutError(f"aioloader: sample_timeout={self._timeout}s exceeded")
        return result


class FailureBudget:
    """The samples an epoch may skip (``max_failures``); skipped ones are counted in the
    stage's recorder and remembered (up to 1,000 keys) in ``stats.skipped``."""

    def __init__(self, max_failures: int, stats: Recorders, epoch: int) -> None:
        self.max_failures = max_failures
        self.left = max_failures
        self._stats = stats
        self._epoch = epoch

    def exhausted_note(self, exc: BaseException) -> None:
        """Say on ``exc`` that the budget ran out (when there was one)."""
        if self.max_failures:
            exc.add_note(f"aioloader: max_failures={self.max_failures} exhausted")

    def skip_each(
        self, failures: Sequence[tuple[int, str, Exception]], keys: Sequence[object], seq: int
    ) -> None:
        """Spend the budget on each of a job's failed samples (``keys`` name them, in order).

        Raises:
            Exception: The first failure past the budget, as :meth:`skip_or_raise` raises it.
        """
        for (_, stage, exc), key in zip(failures, keys, strict=True):
            self.skip_or_raise(exc, stage, seq, key)

    def skip_or_raise(self, exc: Exception, stage: str, seq: int, key: object) -> None:
        """Spend one unit of the budget on ``exc`` (a warning is logged), or raise it.

        Raises:
            Exception: ``exc``, with notes naming the stage, the sample and the batch ``seq``
                (and that the budget is exhausted), when nothing is left.
        """
        if self.left == 0:
            annotate(exc, stage, epoch=self._epoch, batch=seq, index=key)
            self.exhausted_note(exc)
            raise exc
        self.left -= 1
        stats = self._stats
        rec = stats.fetch if stage == "fetch" else stats.transform
        rec.skipped += 1
        if len(stats.skipped) < _MAX_SKIPPED_KEPT:
            stats.skipped.append(key)
        logger.warning(
            "aioloader: skipped sample %r (stage %r, epoch %d): %s: %s",
            key,
            stage,
            self._epoch,
            type(exc).__name__,
            exc,
        )
