"""The dynamic batcher's counters, and the frozen snapshot users read.

Owns: :class:`BatcherRecorder` (updated by the batcher on the event loop thread: a few attribute
writes per request) and :class:`BatcherStatistics` with its readable ``repr``. Never: awaits,
locks or reads a clock (times are passed in).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

from .._base.recorders import WorkerRecorder
from .._base.stats import LatencySummary, WorkerStatistics, format_ms
from .policy import PendingQueue

__all__ = ["BatcherRecorder", "BatcherStatistics"]

_RESERVOIR = 4096  # latencies kept for percentiles: the most recent ones


@dataclass(frozen=True, slots=True)
class BatcherStatistics:
    """A frozen snapshot of :meth:`DynamicBatcher.statistics`, cumulative over the batcher's
    scope (reset at each ``async with``). Times are in seconds, measured with its ``clock``.

    Every admitted request ends exactly one way, so ``submitted == completed + failed +
    expired + cancelled + pending``.

    Attributes:
        submitted: Requests admitted to the queue.
        completed: Requests whose caller got a result.
        failed: Requests whose caller got an exception from collate, the model or the split
            (the whole batch's, or its own per-request one).
        rejected: Submissions refused with :class:`~aioloader.Overloaded` (not admitted).
        expired: Requests whose deadline passed first (queued: withdrawn; running: result
            dropped).
        cancelled: Requests whose caller was cancelled first (queued: withdrawn; running:
            result dropped), or that the batcher's exit cancelled.
        queued: Requests waiting for a batch now.
        max_queued: The most that ever waited at once.
        max_queue: The bound on ``queued`` (admission control).
        running: Batches running now.
        max_running: The most batches that ever ran at once (``<= max_concurrent_batches``).
        batches: Batches started.
        batch_sizes: ``(size, batches of that size)`` pairs, smallest size first.
        queue_wait: From submission to the start of the request's batch.
        latency: End to end, from submission to the caller's outcome (served requests).
        batch_time: Collate + model + split of one batch.
        elapsed_s: Seconds since the scope opened (until it closed, once it has).
        workers: The collation processes' counters (None without ``num_workers``).
    """

    submitted: int
    completed: int
    failed: int
    rejected: int
    expired: int
    cancelled: int
    queued: int
    max_queued: int
    max_queue: int
    running: int
    max_running: int
    batches: int
    batch_sizes: tuple[tuple[int, int], ...]
    queue_wait: LatencySummary
    latency: LatencySummary
    batch_time: LatencySummary
    elapsed_s: float
    workers: WorkerStatistics | None = None

    @property
    def pending(self) -> int:
        """Admitted requests without an outcome yet (queued, or in a running batch)."""
        return self.submitted - self.completed - self.failed - self.expired - self.cancelled

    @property
    def mean_batch_size(self) -> float:
        """Requests per batch on average (0 before the first batch)."""
        total = sum(size * count for size, count in self.batch_sizes)
        return total / self.batches if self.batches else 0.0

    def __repr__(self) -> str:
        sizes = ", ".join(f"{size}:{count}" for size, count in self.batch_sizes) or "-"
        lines = [
            f"BatcherStatistics: {self.submitted:,} submitted in {self.elapsed_s:.2f}s:"
            f" {self.completed:,} completed, {self.failed:,} failed, {self.expired:,} expired,"
            f" {self.cancelled:,} cancelled, {self.pending:,} pending;"
            f" {self.rejected:,} rejected (queue full)",
            f"  queue: {self.queued} waiting now, peak {self.max_queued}/{self.max_queue};"
            f" batches running: {self.running}, peak {self.max_running}",
            f"  {self.batches:,} batches, mean size {self.mean_batch_size:.1f};"
            f" sizes (size:batches) {sizes}",
            f"  {'ms':<12}{'p50':>9}{'p90':>9}{'p99':>9}{'max':>9}{'count':>9}",
        ]
        for name, s in (
            ("queue wait", self.queue_wait),
            ("end to end", self.latency),
            ("batch", self.batch_time),
        ):
            cells = "".join(f"{format_ms(v):>9}" for v in (s.p50, s.p90, s.p99, s.max))
            lines.append(f"  {name:<12}{cells}{s.count:>9,}")
        if self.workers is not None:
            w = self.workers
            lines.append(
                f"  collate workers: {w.processes} processes started in {w.startup_s:.2f}s,"
                f" {w.jobs} jobs, {w.crashes} crashed, {w.restarts} restarted"
            )
        return "\n".join(lines)


class BatcherRecorder:
    """Mutable counters of a batcher, updated from the event loop thread only."""

    __slots__ = (
        "_batch_times",
        "_latencies",
        "_queue_waits",
        "batches",
        "cancelled",
        "completed",
        "expired",
        "failed",
        "max_running",
        "rejected",
        "running",
        "sizes",
        "started",
        "stopped",
        "submitted",
        "workers",
    )

    def __init__(self, started: float) -> None:
        self.started = started
        self.stopped: float | None = None
        self.submitted = self.completed = self.failed = 0
        self.rejected = self.expired = self.cancelled = 0
        self.batches = self.running = self.max_running = 0
        self.sizes: Counter[int] = Counter()
        self._queue_waits: deque[float] = deque(maxlen=_RESERVOIR)
        self._latencies: deque[float] = deque(maxlen=_RESERVOIR)
        self._batch_times: deque[float] = deque(maxlen=_RESERVOIR)
        self.workers = WorkerRecorder()  # stays empty without collation processes

    def batch_started(self, size: int) -> int:
        """Count a batch of ``size`` starting; return its sequence number."""
        seq = self.batches
        self.batches += 1
        self.sizes[size] += 1
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        return seq

    def batch_finished(self, seconds: float) -> None:
        self.running -= 1
        self._batch_times.append(seconds)

    def waited(self, seconds: float) -> None:
        """A request left the queue for its batch after ``seconds``."""
        self._queue_waits.append(seconds)

    def served(self, seconds: float, *, ok: bool) -> None:
        """A request's caller got its outcome ``seconds`` after submitting."""
        self._latencies.append(seconds)
        if ok:
            self.completed += 1
        else:
            self.failed += 1

    def snapshot(self, now: float, queue: PendingQueue[Any]) -> BatcherStatistics:
        return BatcherStatistics(
            submitted=self.submitted,
            completed=self.completed,
            failed=self.failed,
            rejected=self.rejected,
            expired=self.expired,
            cancelled=self.cancelled,
            queued=len(queue),
            max_queued=queue.max_len,
            max_queue=queue.capacity,
            running=self.running,
            max_running=self.max_running,
            batches=self.batches,
            batch_sizes=tuple(sorted(self.sizes.items())),
            queue_wait=LatencySummary.of(self._queue_waits, len(self._queue_waits)),
            latency=LatencySummary.of(self._latencies, self.completed + self.failed),
            batch_time=LatencySummary.of(self._batch_times, self.batches - self.running),
            elapsed_s=(self.stopped if self.stopped is not None else now) - self.started,
            workers=self.workers.snapshot() if self.workers.processes else None,
        )
