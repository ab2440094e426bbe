"""Statistics: the frozen snapshots users read (the recorders that count are in ``recorders.py``).

Owns: the public statistics' dataclasses and a readable summary of them. Never: counts anything
itself.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

__all__ = [
    "ConsumerStatistics",
    "LatencySummary",
    "LoaderStatistics",
    "StageStatistics",
    "WorkerStatistics",
]


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
        bytes_sent: Bytes written to their pipes (jobs: raw samples and the functions' names;
            for Ray workers, the jobs as pickled for Ray).
        bytes_received: Bytes read back (results: tensors travel as shared-memory handles; for
            Ray workers, the tensors' bytes read from the object store).
        crashes: Workers that died mid-job.
        restarts: Workers started again after a crash or a cancelled job that did not finish.
        server: Where the workers were forked from (start method forkserver): ``"forked"`` (a
            server forked from this process), ``"standby"`` (the server forked as aioloader
            was imported), ``"fresh standby"`` (a fresh interpreter started as aioloader was
            imported, where forking was not safe then: it imported torch meanwhile),
            ``"interpreter"`` (the stdlib's fresh interpreter, started as the loader was
            built, which imports torch and the main module: the slow start), ``"other"``;
            ``""`` with spawn;
            ``"ray"`` for Ray workers (actors, which Ray starts).
        server_why: Why the faster ways to start it were not taken (``""`` when forked); for
            Ray workers, the nodes their actors were placed on.
        server_s: Seconds getting that server ready cost before the workers could start, in
            the first loader that needed it (once per process): a few milliseconds to fork
            one; for the standby, the time it took to run the main module again, that is to
            import what the main module imports after aioloader (for a fresh standby, also
            what was left of its own imports). Not part of ``startup_s``.
        main_left_unsafe: With ``"interpreter"``: the server forked in reserve as aioloader
            was imported did not serve because the main module's top level, which it runs
            again (as torch's spawn and forkserver workers do), started a thread or
            initialised CUDA there; under the script's ``if __name__ == "__main__":`` guard,
            they would not run again.
        start_bytes: The start arguments (the dataset, ``worker_init_fn``) as pickled once
            for the workers that last started together (its out-of-band NumPy buffers and
            the copies of its tensors included; not the tensors torch shares, the sockets and
            the descriptors each worker's start pickles for itself); 0 where the workers were
            forked from this process, and for Ray workers.
        template_pid: The template those workers were forked from: a process that unpickled
            the start arguments once, whose pages they share copy-on-write (0: none; each
            unpickled its own copy).
        template_why: Why there was none: ``"one worker starting"`` (a replacement), ``"they
            pickle to under 1 MiB"``, ``"AIOLOADER_TEMPLATE=0"``, ``"start method spawn"``,
            or what unpickling them did that forked workers must not share (``"unpickling
            them opened /data/train.h5"``, a thread, an error); ``""`` with a template, with
            workers forked from this process and for Ray workers.
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
    server_s: float = 0.0
    main_left_unsafe: bool = False
    start_bytes: int = 0
    template_pid: int = 0
    template_why: str = ""


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
        max_bytes_held: The most ever held. ``max_inflight_bytes`` is a soft bound: new
            fetches wait while it is exceeded, so this may pass it by what the fetches then
            running bring.
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
            ray = w.server == "ray"
            kind, via = ("Ray actors", "bytes") if ray else ("processes", "pipe bytes")
            lines.append(
                f"  workers: {w.processes} {kind} started in {w.startup_s:.2f}s, {w.jobs} jobs,"
                f" {via} out {w.bytes_sent:,} / back {w.bytes_received:,},"
                f" {w.crashes} crashed, {w.restarts} restarted"
            )
            if ray:
                lines.append(f"  Ray cluster: {w.server_why}")
            elif w.server:
                why = f" ({w.server_why})" if w.server_why else ""
                ready = f", ready in {w.server_s:.2f}s" if w.server_s else ""
                lines.append(f"  fork server: {w.server}{ready}{why}")
            if w.start_bytes >= 2**20:
                size = f"  start arguments: {w.start_bytes / 2**20:.0f} MiB pickled once, "
                if w.template_pid:
                    lines.append(size + f"unpickled once, by a template (pid {w.template_pid})")
                else:
                    lines.append(size + f"unpickled by each worker ({w.template_why})")
        two = ""
        if self.workers is not None and self.workers.processes:
            two = (
                "; transform with workers that read the dataset: two jobs a worker at once, "
                "the second sent behind the first, its latency counting that wait"
            )
        lines.append(
            "  (busy: the share of the stage's slots' time its work took; in flight and queued: "
            "the most at once / the limit, - for none; no room: time it waited for the next "
            "stage; no work: time it waited for the stage before; fetched bytes held at most "
            f"{self.max_bytes_held:,}{two})"
        )
        return "\n".join(lines)


#: How the stages are named for a person (``stage()`` takes the names in ``StageStatistics``).
_SHOWN = {"window": "in progress", "output": "ready"}


def format_ms(seconds: float) -> str:
    """Seconds as milliseconds with two decimals, or ``-`` for NaN (no data)."""
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.2f}"
