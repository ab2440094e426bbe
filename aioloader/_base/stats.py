"""Statistics: mutable recorders the pipeline updates, and the frozen snapshots users read.

Owns: counting (in flight, queue fill, blocked time, latency percentiles, retries, failures) and
rendering a readable summary. Never: awaits, locks or touches the event loop; every update is a
few attribute writes done on the loop thread, so recording costs nothing measurable per item.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field
from types import TracebackType

__all__ = [
    "ConsumerStatistics",
    "LatencySummary",
    "LoaderStatistics",
    "Recorders",
    "StageStatistics",
    "WorkerRecorder",
    "WorkerStatistics",
]

_RESERVOIR = 4096  # latencies kept per stage for percentiles: the most recent ones


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """Latency percentiles of the most recent operations of a stage, in seconds."""

    count: int
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, samples: deque[float] | list[float], count: int) -> LatencySummary:
        if not samples:
            return cls(count, math.nan, math.nan, math.nan, math.nan)
        ordered = sorted(samples)

        def pick(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

        return cls(count, pick(0.50), pick(0.90), pick(0.99), ordered[-1])


@dataclass(frozen=True, slots=True)
class StageStatistics:
    """One stage's counters.

    Attributes:
        name: ``"window"``, ``"fetch"``, ``"transform"``, ``"device"`` or ``"output"``.
        in_flight: Operations running now.
        max_in_flight: The most that ever ran at once.
        limit: The configured bound on ``in_flight`` (None when unbounded).
        queued: Items waiting in the stage's outgoing queue now.
        max_queued: The most that ever waited there at once.
        queue_capacity: The bound on ``queued``.
        completed: Operations that finished successfully.
        failed: Operations that failed for good (after retries).
        skipped: Failed samples dropped under the ``max_failures`` budget.
        retries: Attempts repeated after a transient error.
        blocked_put_s: Total time spent waiting for room downstream (backpressure).
        blocked_get_s: Total time spent waiting for work from upstream (starvation).
        latency: Percentiles of the operation's duration.
        busy_s: Slot-seconds its ``limit`` slots were taken: the time integral of
            ``min(in_flight, limit)`` (operations waiting beyond the limit, say for a thread,
            are not counted twice), so ``busy_s / (elapsed_s * limit)`` is how busy they were.
    """

    name: str
    in_flight: int
    max_in_flight: int
    limit: int | None
    queued: int
    max_queued: int
    queue_capacity: int | None
    completed: int
    failed: int
    skipped: int
    retries: int
    blocked_put_s: float
    blocked_get_s: float
    latency: LatencySummary
    busy_s: float = 0.0

    def utilisation(self, elapsed_s: float) -> float | None:
        """The share of its ``limit`` slots' time its operations took over ``elapsed_s``
        seconds (None for a stage without a limit)."""
        if self.limit is None or elapsed_s <= 0 or math.isnan(self.latency.p50):
            return None  # unbounded, or its operations have no duration (batches in progress)
        return min(1.0, self.busy_s / (elapsed_s * self.limit))


@dataclass(frozen=True, slots=True)
class WorkerStatistics:
    """The worker processes of a scope (absent with thread workers).

    Attributes:
        processes: Worker processes.
        startup_s: Seconds from starting them to every one having run ``worker_init_fn``.
        jobs: Jobs (batches) sent to them.
        bytes_sent: Bytes written to their pipes (jobs: raw samples and the functions' names).
        bytes_received: Bytes read back (results: tensors travel as shared-memory handles).
        crashes: Workers that died mid-job.
        restarts: Workers started again after a crash or a cancelled job that did not finish.
        server: Where the workers were forked from (start method forkserver): ``"forked"`` (a
            server forked from this process), ``"standby"`` (the server forked as aioloader
            was imported), ``"interpreter"`` (the stdlib's fresh interpreter, which imports
            torch and the main module: the slow start), ``"other"``; ``""`` with spawn.
        server_why: Why the faster ways to start it were not taken (``""`` when forked).
    """

    processes: int
    startup_s: float
    jobs: int
    bytes_sent: int
    bytes_received: int
    crashes: int
    restarts: int
    server: str = ""
    server_why: str = ""


class WorkerRecorder:
    """Mutable counters of a process pool, updated from the event loop thread only."""

    __slots__ = (
        "bytes_received",
        "bytes_sent",
        "crashes",
        "jobs",
        "processes",
        "restarts",
        "server",
        "server_why",
        "startup_s",
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
        )


@dataclass(frozen=True, slots=True)
class ConsumerStatistics:
    """What the code iterating the loader saw.

    Attributes:
        batches: Batches handed out.
        samples: Samples in those batches.
        wait_s: Total time ``__anext__`` waited for a batch (the GPU starving shows up here).
        max_wait_s: The longest single wait.
        busy_s: Total time between handing out a batch and being asked for the next one.
    """

    batches: int
    samples: int
    wait_s: float
    max_wait_s: float
    busy_s: float

    @property
    def wait_fraction(self) -> float:
        """Share of the consumer's time spent waiting for data (0 when it never waited)."""
        total = self.wait_s + self.busy_s
        return self.wait_s / total if total > 0 else 0.0


@dataclass(frozen=True, slots=True)
class LoaderStatistics:
    """A frozen snapshot of :meth:`DataLoader.statistics`, cumulative over the loader's scope.

    Attributes:
        epochs: Epochs started.
        elapsed_s: Seconds since the scope opened (until it closed, once it has).
        stages: Per-stage counters: ``window`` (batches between scheduling and hand-off),
            ``fetch``, ``transform`` (transform + collate), ``device`` (only with a device
            stage: pinning and issuing the copies; ``queued`` counts the batches on the device
            that the consumer has not taken, at most ``queue_capacity``) and ``output`` (ready
            batches).
        consumer: What the iterating code saw.
        skipped_samples: Ids of samples skipped under ``max_failures`` (the first 1,000).
        bytes_held: Bytes of fetched samples in unfinished batches now.
        max_bytes_held: The most ever held (bounded by ``max_inflight_bytes`` when set).
        made_on_demand: Batches made in the consumer's own calls for them (``num_workers=0``,
            a fast dataset: see ``_pipeline/demand.py``), none of them ahead of it.
        workers: The worker processes' counters (None with thread workers).
        verdict: Which stage limited throughput, and what to change, in one sentence (see
            ``_base/verdict.py``).
        scopes: Scopes the loader has opened (``async with`` / ``with``, or one per epoch of a
            plain ``for`` without either): these counters are the last one's.
    """

    epochs: int
    elapsed_s: float
    stages: tuple[StageStatistics, ...]
    consumer: ConsumerStatistics
    skipped_samples: tuple[object, ...] = field(default=())
    bytes_held: int = 0
    max_bytes_held: int = 0
    made_on_demand: int = 0
    workers: WorkerStatistics | None = None
    verdict: str = ""
    scopes: int = 1

    def stage(self, name: str) -> StageStatistics:
        """Return the stage called ``name``.

        Raises:
            KeyError: No stage has that name.
        """
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"no stage named {name!r}; stages: {[s.name for s in self.stages]}")

    @property
    def samples_per_s(self) -> float:
        """Samples handed to the consumer per second of the loader's life."""
        return self.consumer.samples / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def _of_scopes(self) -> str:
        if self.scopes <= 1:
            return ""
        said = f" (the counters of the last of {self.scopes} scopes"
        if self.epochs <= 1:
            said += (
                ": a plain for without `with loader:` or persistent_workers=True opens one "
                "per epoch"
            )
        return said + ")"

    def __repr__(self) -> str:
        c = self.consumer
        lines = [
            f"LoaderStatistics: {c.batches:,} batches, {c.samples:,} samples in "
            f"{self.elapsed_s:.2f}s ({self.samples_per_s:,.0f} samples/s), {self.epochs} epoch(s)"
            + self._of_scopes(),
            f"  verdict: {self.verdict}",
            f"  consumer: waited for data {c.wait_s:.3f}s ({c.wait_fraction:.0%} of its time), "
            f"longest wait {c.max_wait_s:.3f}s",
            f"  {'stage':<12}{'busy':>6}{'in flight':>11}{'queued':>9}{'done':>9}{'retried':>9}"
            f"{'failed':>8}{'skipped':>9}{'no room':>9}{'no work':>9}{'p50 ms':>9}{'p99 ms':>9}",
        ]
        for s in self.stages:
            use = s.utilisation(self.elapsed_s)
            busy = "-" if use is None else f"{min(use, 1):.0%}"
            limit = "-" if s.limit is None else str(s.limit)
            cap = "-" if s.queue_capacity is None else str(s.queue_capacity)
            lines.append(
                f"  {_SHOWN.get(s.name, s.name):<12}{busy:>6}{f'{s.max_in_flight}/{limit}':>11}"
                f"{f'{s.max_queued}/{cap}':>9}{s.completed:>9}{s.retries:>9}{s.failed:>8}"
                f"{s.skipped:>9}{s.blocked_put_s:>8.3f}s{s.blocked_get_s:>8.3f}s"
                f"{format_ms(s.latency.p50):>9}{format_ms(s.latency.p99):>9}"
            )
        if self.skipped_samples:
            shown = ", ".join(repr(k) for k in self.skipped_samples[:10])
            more = len(self.skipped_samples) - 10
            lines.append(f"  skipped samples: {shown}" + (f" (+{more} more)" if more > 0 else ""))
        if self.workers is not None and self.workers.processes:
            w = self.workers
            lines.append(
                f"  workers: {w.processes} processes started in {w.startup_s:.2f}s, {w.jobs} jobs,"
                f" pipe bytes out {w.bytes_sent:,} / back {w.bytes_received:,},"
                f" {w.crashes} crashed, {w.restarts} restarted"
            )
            if w.server:
                why = f" ({w.server_why})" if w.server_why else ""
                lines.append(f"  fork server: {w.server}{why}")
        lines.append(
            "  (busy: the share of the stage's slots' time its work took; in flight and queued: "
            "the most at once / the limit, - for none; no room: time it waited for the next "
            "stage; no work: time it waited for the stage before; fetched bytes held at most "
            f"{self.max_bytes_held:,})"
        )
        return "\n".join(lines)


#: How the stages are named for a person (``stage()`` takes the names in ``StageStatistics``).
_SHOWN = {"window": "in progress", "output": "ready"}


def format_ms(seconds: float) -> str:
    """Seconds as milliseconds with two decimals, or ``-`` for NaN (no data)."""
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.2f}"


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
