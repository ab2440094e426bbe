"""Recorders: the mutable counters the pipeline updates, and the snapshots they give.

Owns: counting (in flight, queue fill, blocked time, latency percentiles, retries, failures).
Never: awaits, locks or touches the event loop; every update is a few attribute writes done on
the loop thread, so recording costs nothing measurable per item.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from types import TracebackType

from .stats import (
    ConsumerStatistics,
    LatencySummary,
    StageStatistics,
    WorkerStatistics,
)

__all__ = ["ConsumerRecorder", "Operation", "Recorders", "StageRecorder", "WorkerRecorder"]


_RESERVOIR = 4096  # latencies kept per stage for percentiles: the most recent ones


class WorkerRecorder:
    """Mutable counters of a process pool, updated from the event loop thread only."""

    __slots__ = (
        "bytes_received",
        "bytes_sent",
        "crashes",
        "jobs",
        "main_left_unsafe",
        "processes",
        "restarts",
        "server",
        "server_s",
        "server_why",
        "start_bytes",
        "startup_s",
        "template_pid",
        "template_why",
    )

    def __init__(self) -> None:
        self.processes = 0
        self.startup_s = 0.0
        self.jobs = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.crashes = 0
        self.restarts = 0
        self.server = ""
        self.server_why = ""
        self.server_s = 0.0
        self.main_left_unsafe = False
        self.start_bytes = 0
        self.template_pid = 0
        self.template_why = ""

    def snapshot(self) -> WorkerStatistics:
        return WorkerStatistics(
            self.processes,
            self.startup_s,
            self.jobs,
            self.bytes_sent,
            self.bytes_received,
            self.crashes,
            self.restarts,
            self.server,
            self.server_why,
            self.server_s,
            self.main_left_unsafe,
            self.start_bytes,
            self.template_pid,
            self.template_why,
        )


class Operation:
    """One or more operations of a stage in progress; see :meth:`StageRecorder.operation`."""

    __slots__ = ("_count", "_counted", "_done", "_rec", "_started")

    def __init__(self, rec: StageRecorder, count: int) -> None:
        self._rec = rec
        self._count = count
        self._counted = True
        self._done = False
        self._started = 0.0

    def __enter__(self) -> Operation:
        self._rec.start(self._count)
        self._started = time.perf_counter()
        return self

    def retrying(self) -> None:
        """A failure now is followed by another attempt: not counted in ``failed``."""
        self._counted = False

    def not_a_failure(self) -> None:
        """A failure now is counted elsewhere (a worker's crash): not in ``failed``."""
        self._counted = False

    def abandon(self) -> None:
        """End without counting: no longer in flight, no latency, no completion."""
        if not self._done:
            self._done = True
            self._rec.leave(self._count)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._done:
            return
        self._done = True
        rec, count = self._rec, self._count
        if exc_type is not None and not issubclass(exc_type, Exception):
            rec.leave(count)  # cancelled: nothing else is counted
            return
        rec.finish(time.perf_counter() - self._started, ok=exc_type is None, count=count)
        if exc_type is not None and self._counted:
            rec.failed += count


class StageRecorder:
    """Mutable counters of one stage, updated from the event loop thread only."""

    __slots__ = (
        "_busy",
        "_latencies",
        "_since",
        "blocked_get_s",
        "blocked_put_s",
        "busy_s",
        "completed",
        "failed",
        "in_flight",
        "limit",
        "max_in_flight",
        "max_queued",
        "name",
        "queue_capacity",
        "queued",
        "retries",
        "skipped",
    )

    def __init__(
        self, name: str, *, limit: int | None, queue_capacity: int | None, busy: bool = True
    ) -> None:
        self.name = name
        self.limit = limit
        self.queue_capacity = queue_capacity
        self.in_flight = 0
        self.max_in_flight = 0
        self.queued = 0
        self.max_queued = 0
        self.completed = 0
        self.failed = 0
        self.skipped = 0
        self.retries = 0
        self.blocked_put_s = 0.0
        self.blocked_get_s = 0.0
        self.busy_s = 0.0
        self._busy = busy  # keeps busy_s (a stage whose work has a duration)
        self._since = time.perf_counter()
        self._latencies: deque[float] = deque(maxlen=_RESERVOIR)

    def _tick(self) -> None:
        """Count the slots taken since the last change of ``in_flight``."""
        if not self._busy:
            return
        now = time.perf_counter()
        if self.limit is not None and self.in_flight:
            self.busy_s += min(self.in_flight, self.limit) * (now - self._since)
        self._since = now

    def _busy_now(self) -> float:
        """``busy_s`` with the slots taken since the last change (read, not recorded: a
        snapshot may be taken from another thread)."""
        if self.limit is None or not self.in_flight or not self._busy:
            return self.busy_s
        return self.busy_s + min(self.in_flight, self.limit) * (time.perf_counter() - self._since)

    def leave(self, count: int = 1) -> None:
        """End ``count`` operations uncounted (cancelled, abandoned)."""
        self._tick()
        self.in_flight -= count

    def start(self, count: int = 1) -> None:
        """Begin ``count`` operations."""
        self._tick()
        self.in_flight += count
        if self.in_flight > self.max_in_flight:
            self.max_in_flight = self.in_flight

    def finish(self, latency: float | None, *, ok: bool = True, count: int = 1) -> None:
        """End ``count`` operations that took ``latency`` seconds each (None: no duration)."""
        self._tick()
        self.in_flight -= count
        if latency is not None:
            if count == 1:
                self._latencies.append(latency)
            else:
                self._latencies.extend(itertools.repeat(latency, min(count, _RESERVOIR)))
        if ok:
            self.completed += count

    def finish_in_turn(self, count: int, seconds: float) -> None:
        """End one operation in flight that completed ``count`` operations one after another
        in ``seconds`` (a slice read in turn): counted as ``count`` of ``seconds / count``."""
        self._tick()
        self.in_flight -= 1
        if count:
            self._latencies.extend(itertools.repeat(seconds / count, min(count, _RESERVOIR)))
            self.completed += count

    def record(self, seconds: float, count: int = 1, *, ok: bool = True) -> None:
        """``count`` operations done one after another in ``seconds``, none of them counted in
        flight (a batch made on the consumer's thread): completed (or failed), each with a
        latency of ``seconds / count``, the time counted busy."""
        if self._busy:
            self.busy_s += seconds
        self._latencies.extend(itertools.repeat(seconds / count, min(count, _RESERVOIR)))
        if ok:
            self.completed += count
        else:
            self.failed += count

    def operation(self, count: int = 1) -> Operation:
        """Count ``count`` operations of this stage around a ``with`` block: started on entry;
        on a normal exit finished (with their latency); on an ``Exception`` finished as
        failed (and counted in ``failed``, unless :meth:`Operation.retrying` said another
        attempt follows, or :meth:`Operation.not_a_failure` said the error is counted
        elsewhere); on cancellation (any other ``BaseException``) no longer in flight, nothing
        else counted. :meth:`Operation.abandon` ends them uncounted (the end of a stream is no
        operation)."""
        return Operation(self, count)

    def set_queued(self, n: int) -> None:
        self.queued = n
        if n > self.max_queued:
            self.max_queued = n

    def snapshot(self) -> StageStatistics:
        return StageStatistics(
            name=self.name,
            in_flight=self.in_flight,
            max_in_flight=self.max_in_flight,
            limit=self.limit,
            queued=self.queued,
            max_queued=self.max_queued,
            queue_capacity=self.queue_capacity,
            completed=self.completed,
            failed=self.failed,
            skipped=self.skipped,
            retries=self.retries,
            blocked_put_s=self.blocked_put_s,
            blocked_get_s=self.blocked_get_s,
            latency=LatencySummary.of(self._latencies, self.completed + self.failed),
            busy_s=self._busy_now(),
        )


class ConsumerRecorder:
    """Mutable counters of the consumer side, updated from the event loop thread only."""

    __slots__ = ("batches", "busy_s", "max_wait_s", "samples", "wait_s")

    def __init__(self) -> None:
        self.batches = 0
        self.samples = 0
        self.wait_s = 0.0
        self.max_wait_s = 0.0
        self.busy_s = 0.0

    def waited(self, seconds: float) -> None:
        self.wait_s += seconds
        if seconds > self.max_wait_s:
            self.max_wait_s = seconds

    def snapshot(self) -> ConsumerStatistics:
        return ConsumerStatistics(
            self.batches, self.samples, self.wait_s, self.max_wait_s, self.busy_s
        )


class Recorders:
    """The loader's statistics recorders, shared by its epochs (cumulative over its scope)."""

    def __init__(
        self, *, max_inflight: int, workers: int, prefetch: int, device: int | None = None
    ) -> None:
        self.started = time.perf_counter()
        self.epochs = 0
        # Batches in progress and ready ones have no duration of their own: no busy time.
        self.window = StageRecorder("window", limit=None, queue_capacity=None, busy=False)
        self.fetch = StageRecorder("fetch", limit=max_inflight, queue_capacity=None)
        self.transform = StageRecorder("transform", limit=workers, queue_capacity=None)
        # One batch staged at a time; `device` of them may wait for the consumer.
        self.device = StageRecorder("device", limit=1, queue_capacity=device)
        self.has_device = device is not None
        self.output = StageRecorder("output", limit=None, queue_capacity=prefetch, busy=False)
        self.consumer = ConsumerRecorder()
        self.workers = WorkerRecorder()
        self.skipped: list[object] = []
        self.bytes_held = 0
        self.max_bytes_held = 0
        self.made_on_demand = 0

    @property
    def stages(self) -> tuple[StageRecorder, ...]:
        if self.has_device:
            return (self.window, self.fetch, self.transform, self.device, self.output)
        return (self.window, self.fetch, self.transform, self.output)
