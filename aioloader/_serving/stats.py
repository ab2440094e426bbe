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
from .pending import PendingQueue

__all__ = ["BatchCostStatistics", "BatcherRecorder", "BatcherStatistics"]

_RESERVOIR = 4096  # latencies kept for percentiles: the most recent ones


@dataclass(frozen=True, slots=True)
class BatchCostStatistics:
    """What the batches cost, by ``cost_fn`` (kept when the batcher has one).

    Attributes:
        batches: Batches counted.
        requests: Requests in them.
        cost: The sum of their requests' costs (what a model that does not pad pays).
        padded_cost: The sum over batches of size x largest request's cost (what a model that
            pads every request of a batch to its longest pays).
        max_batch_cost: The largest batch cost seen, by the batcher's own measure (padded with
            ``padded_cost=True``, else summed).
        over_limit: Batches of one request whose own cost was over ``max_batch_cost`` (each ran
            alone).
    """

    batches: int
    requests: int
    cost: float
    padded_cost: float
    max_batch_cost: float
    over_limit: int

    @property
    def mean_batch_cost(self) -> float:
        """Summed cost per batch (0 before the first batch)."""
        return self.cost / self.batches if self.batches else 0.0

    @property
    def padded_per_request(self) -> float:
        """Padded cost per request served: what a padding model spends on each."""
        return self.padded_cost / self.requests if self.requests else 0.0

    @property
    def padded_fraction(self) -> float:
        """Padding cost over padded cost: the share of a padding model's work spent on padding
        (0 before the first batch). Bucketing by length lowers it."""
        return (self.padded_cost - self.cost) / self.padded_cost if self.padded_cost else 0.0


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
        cost: What the batches cost (None without ``cost_fn``).
        buckets: Buckets with a request waiting now (1 or 0 without ``bucket_fn``).
        split: Times a batch (or a part of one) that would not collate was split in two, each
            a model call more (``batches`` and ``batch_sizes`` count the batch as cut).
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
    cost: BatchCostStatistics | None = None
    buckets: int = 0
    split: int = 0

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
            f" sizes (size:batches) {sizes}"
            + (f"; split {self.split:,} times (would not collate)" if self.split else ""),
            f"  {'ms':<12}{'p50':>9}{'p90':>9}{'p99':>9}{'max':>9}{'count':>9}",
        ]
        for name, s in (
            ("queue wait", self.queue_wait),
            ("end to end", self.latency),
            ("batch", self.batch_time),
        ):
            cells = "".join(f"{format_ms(v):>9}" for v in (s.p50, s.p90, s.p99, s.max))
            lines.append(f"  {name:<12}{cells}{s.count:>9,}")
        if self.cost is not None:
            c = self.cost
            lines.append(
                f"  cost: {c.mean_batch_cost:,.1f} a batch summed"
                f" (largest {c.max_batch_cost:,.1f}), padded {c.padded_per_request:,.1f}"
                f" a request, {c.padded_fraction:.0%} of it padding;"
                f" {c.over_limit} over the limit (ran alone)"
            )
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
        "cost",
        "expired",
        "failed",
        "max_running",
        "rejected",
        "running",
        "sizes",
        "split",
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
        self.batches = self.running = self.max_running = self.split = 0
        self.sizes: Counter[int] = Counter()
        self._queue_waits: deque[float] = deque(maxlen=_RESERVOIR)
        self._latencies: deque[float] = deque(maxlen=_RESERVOIR)
        self._batch_times: deque[float] = deque(maxlen=_RESERVOIR)
        self.workers = WorkerRecorder()  # stays empty without collation processes
        self.cost: _CostRecorder | None = None  # set by a batcher with a cost_fn

    def track_cost(self) -> None:
        """Keep cost counters (the batcher has a ``cost_fn``)."""
        self.cost = _CostRecorder()

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
            split=self.split,
            queue_wait=LatencySummary.of(self._queue_waits, len(self._queue_waits)),
            latency=LatencySummary.of(self._latencies, self.completed + self.failed),
            batch_time=LatencySummary.of(self._batch_times, self.batches - self.running),
            elapsed_s=(self.stopped if self.stopped is not None else now) - self.started,
            workers=self.workers.snapshot() if self.workers.processes else None,
            cost=None if self.cost is None else self.cost.snapshot(),
            buckets=queue.buckets,
        )


class _CostRecorder:
    """The cost counters, from the event loop thread only."""

    __slots__ = ("batches", "cost", "max_batch_cost", "over_limit", "padded_cost", "requests")

    def __init__(self) -> None:
        self.batches = self.requests = self.over_limit = 0
        self.cost = self.padded_cost = self.max_batch_cost = 0.0

    def batch(self, costs: list[float], limit: float | None, padded: bool) -> None:
        """Count a batch of requests costing ``costs``."""
        n, total, largest = len(costs), sum(costs), max(costs, default=0.0)
        self.batches += 1
        self.requests += n
        self.cost += total
        self.padded_cost += n * largest
        own = n * largest if padded else total
        self.max_batch_cost = max(self.max_batch_cost, own)
        if limit is not None and n == 1 and own > limit:
            self.over_limit += 1

    def snapshot(self) -> BatchCostStatistics:
        return BatchCostStatistics(
            self.batches, self.requests, self.cost, self.padded_cost, self.max_batch_cost,
            self.over_limit,
        )  # fmt: skip
