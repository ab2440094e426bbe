"""Overhead benchmark: the loader's own cost per sample, where reading a sample costs next to
nothing, against torch's ``DataLoader`` and a hand-written loop, each configuration in a fresh
process of its own.

Workloads (``--workloads rows files``, default both):

* ``rows``: ``--rows`` (default 100,000; ``--quick``: 20,000) in-memory rows, a float32 tensor
  of shape (N, 16) whose row ``i`` is 16 times ``i``; default collation (a (B, 16) tensor per
  batch), for each batch size of ``--batch-sizes`` (default 32 and 256). ``Rows`` is a
  ``torch.utils.data.Dataset`` whose ``__getitem__`` returns ``self.data[i]``. Configurations:

  - ``torch-nw0`` (the baseline), ``torch-nw2``, ``torch-nw8``: ``torch.utils.data.DataLoader(
    Rows(N), batch_size=B, num_workers=k)``, a plain ``for`` per epoch, as a torch user writes
    it (so with workers, each epoch starts and stops its workers; fork, torch's default);
  - ``plain-loop``: ``for s in range(0, N, B): torch.stack([ds[i] for i in range(s, min(N, s +
    B))])``: what a hand-written loop costs;
  - ``aio-torchds-for``: ``aioloader.DataLoader(Rows(N), batch_size=B)``, the import swapped and
    nothing else, a plain ``for`` per epoch inside one ``with loader:`` (the pipeline on a
    background event loop, uvloop when installed);
  - ``aio-torchds-for-nowith``: the same without ``with``: what a torch user's ``for batch in
    loader`` per epoch costs (each epoch opens and closes the loader's scope);
  - ``aio-torchds-async``: the same dataset, ``async with loader:`` around one ``async for`` per
    epoch under ``asyncio.run``;
  - ``aio-asyncds-async``: an ``aioloader.AsyncDataset`` whose ``async def get(self, i): return
    self.data[i]`` never suspends, ``async for`` as above;
  - ``aio-torchds-async-uvloop``, ``aio-asyncds-async-uvloop``: the two under
    ``asyncio.Runner(loop_factory=uvloop.new_event_loop)`` (skipped without uvloop).

* ``files``: ``--files`` (default 20,000; ``--quick``: 2,000) files of 16 KiB (an 8-byte index,
  then random bytes) written once into a temporary folder (removed at the end), batch 32, each
  sample the file's bytes, batches kept as lists of bytes (``collate_fn=list``). Configurations:

  - ``plain-loop`` (the baseline of the warm table): open and read each file in a Python loop,
    32 to a list;
  - ``torch-nw0``, ``torch-nw2``, ``torch-nw8``: ``torch.utils.data.DataLoader`` over a torch
    ``Dataset`` whose ``__getitem__`` opens and reads path ``i``, ``collate_fn=list``;
  - ``aio-files``: ``aioloader.DataLoader(aioloader.sources.files(folder, "*.bin"),
    batch_size=32, collate_fn=list)``, ``async with`` + ``async for`` under ``asyncio.run`` (the
    source reads a batch's slice in one call on its own threads);
  - ``aio-torchds-for``: the torch ``Dataset`` through ``aioloader.DataLoader``, a plain ``for``
    inside ``with loader:``.

  Warm (the page cache holds the files: after a warm-up epoch) always; with ``--cold``, the
  same configurations again, each timed epoch preceded (untimed) by
  ``os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)`` on every file, so that its reads go to
  the disk (no root needed; the files are ``fdatasync``-ed when written, since dirty pages are
  not dropped), in a table of their own whose baseline is ``torch-nw8``.

How a configuration runs: in a child process of its own, forked from a server that has only
imported this module (``harness.run_in_child``), after the same set-up in each (this script's
imports, the data built, garbage collected), so no row inherits the heap an earlier one grew.
The child builds the
loader, runs one warm-up epoch (checked: every index exactly once, each sample's content
its index's, the expected number of batches), then ``--repeats`` (default 3) timed epochs
(counted: samples and batches; garbage collected before each, untimed). ``samples/s`` and
``µs/sample`` are of the best timed epoch; ``median µs`` of the median; ``+µs vs plain`` is the
row's ``µs/sample`` less ``plain-loop``'s (the loader's own cost over a hand-written loop);
``warm-up s`` is the warm-up epoch's wall time (loader start-up included where the scope opens
with the epoch). ``base PSS``, ``peak RSS``, ``peak PSS`` (MiB): the child's PSS after its
set-up, and the highest summed RSS and PSS of its process tree (workers included) from the
loader's construction to the end, sampled by this process from outside. Ratios are to the
table's baseline, measured in the same run: samples/s (higher is faster) and peak RSS / PSS.
A configuration has ``--timeout`` (default 300 s) for all its epochs, past which its stacks are
dumped and its tree killed. The script exits non-zero when a configuration fails.

``--profile NAME`` measures no table: it runs configuration NAME in this process (for each
selected workload that has it; for ``rows`` at each batch size) under cProfile, and prints the
top 30 functions by cumulative and by own time: of the main thread over the timed epochs, and
of the threads started during the run (the loader's event-loop and reading threads: over their
whole life, the warm-up epoch included).

Run it from the repository root::

    python benchmarks/bench_overhead.py                      # the full run
    python benchmarks/bench_overhead.py --quick              # 20,000 rows, 2,000 files
    python benchmarks/bench_overhead.py --quick --cold --workloads files
    python benchmarks/bench_overhead.py --only torch-nw0 aio-torchds-async --batch-sizes 32
    python benchmarks/bench_overhead.py --quick --profile aio-torchds-async --workloads rows
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import dataclasses
import functools
import gc
import importlib.util
import io
import math
import os
import pstats
import signal
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
import torch.utils.data

import aioloader
from aioloader._bench.harness import (
    Column,
    Result,
    add_only,
    add_quick,
    add_timeout,
    cpus_and_load,
    delivery_error,
    describe,
    error_text,
    exit_status,
    format_table,
    quick_defaults,
    ratio_to,
    report,
    run_in_child,
    versions,
    watchdog,
)

ROWS = 100_000
QUICK_ROWS = 20_000
WIDTH = 16  # floats in a row
BATCH_SIZES = (32, 256)
FILES = 20_000
QUICK_FILES = 2_000
FILE_BYTES = 16 * 1024
FILE_BATCH = 32
INDEX_BYTES = 8  # a file starts with its index, little-endian
REPEATS = 3
TIMEOUT_S = 300.0  # per configuration: its warm-up and timed epochs
PROFILE_TOP = 30
HAS_UVLOOP = importlib.util.find_spec("uvloop") is not None

WORKLOADS = ("rows", "files")
PLAIN = "plain-loop"
BASELINE = {"rows": "torch-nw0", "files": "plain-loop", "files-cold": "torch-nw8"}


# -- the datasets (module level: torch's workers and the forked children use them by name) ----


def make_rows(n: int) -> torch.Tensor:
    """(n, WIDTH) float32, row ``i`` all ``i`` (exact: n is far below 2**24)."""
    return torch.arange(n, dtype=torch.float32).unsqueeze(1).repeat(1, WIDTH)


class Rows(torch.utils.data.Dataset[torch.Tensor]):
    """A torch map-style dataset of in-memory rows: item ``i`` is ``self.data[i]``."""

    def __init__(self, n: int) -> None:
        self.data = make_rows(n)

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]


class AsyncRows(aioloader.AsyncDataset[torch.Tensor]):
    """The same rows as an ``AsyncDataset`` whose ``get`` never suspends."""

    def __init__(self, n: int) -> None:
        self.data = make_rows(n)

    def __len__(self) -> int:
        return self.data.shape[0]

    async def get(self, index: int) -> torch.Tensor:
        return self.data[index]


def file_path(directory: str, index: int) -> str:
    return os.path.join(directory, f"{index:06d}.bin")


class Files(torch.utils.data.Dataset[bytes]):
    """A torch map-style dataset of files: item ``i`` is the bytes of path ``i``."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = list(paths)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> bytes:
        with open(self.paths[index], "rb") as f:
            return f.read()


def write_files(directory: str, count: int, sync: bool) -> None:
    """``count`` files of ``FILE_BYTES``: the index, then the same random bytes; ``sync``:
    ``fdatasync`` each, so that the page cache can drop them (it keeps dirty pages)."""
    filler = os.urandom(FILE_BYTES - INDEX_BYTES)
    for i in range(count):
        with open(file_path(directory, i), "wb") as f:
            f.write(i.to_bytes(INDEX_BYTES, "little") + filler)
            if sync:
                f.flush()
                os.fdatasync(f.fileno())


def drop_cache(paths: Sequence[str]) -> None:
    """Ask the kernel to drop the files' pages from the page cache (clean pages are dropped)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- the checks ---------------------------------------------------------------------------------


class EpochError(Exception):
    """An epoch delivered something other than what it should have."""


def row_indices(batch: Any) -> list[int]:
    """The indices of a rows batch: a (b, WIDTH) float32 tensor, each row one value."""
    if (
        not isinstance(batch, torch.Tensor)
        or batch.dtype != torch.float32
        or batch.ndim != 2
        or batch.shape[1] != WIDTH
        or not bool((batch == batch[:, :1]).all())
    ):
        raise EpochError(f"a batch is {describe(batch)}, not (b, {WIDTH}) rows of one value each")
    return [int(v) for v in batch[:, 0].tolist()]


def file_indices(batch: Any) -> list[int]:
    """The indices of a files batch: a list of ``FILE_BYTES`` bytes each."""
    if not isinstance(batch, list):
        raise EpochError(f"a batch is {describe(batch)}, not a list of bytes")
    indices = []
    for sample in batch:
        if not isinstance(sample, bytes) or len(sample) != FILE_BYTES:
            size = len(sample) if isinstance(sample, bytes) else "-"
            raise EpochError(f"a sample is {describe(sample)} ({size} bytes), not file bytes")
        indices.append(int.from_bytes(sample[:INDEX_BYTES], "little"))
    return indices


# -- the epochs ---------------------------------------------------------------------------------


class Epoch:
    """One epoch, as a context manager around the loop over the loader: a timed one runs the
    run's ``before_timed`` (untimed), collects garbage (untimed) and times the block (under the
    run's profiler, if any); ``add(batch)`` counts each batch (and, in the warm-up, records its
    indices for the check). Leaving the block checks the epoch (:class:`EpochError`)."""

    def __init__(self, run: Run, number: int) -> None:
        self.run = run
        self.number = number  # 0: the warm-up
        self.timed = number > 0
        self.batches = self.samples = 0
        self.indices: list[int] = []
        self.start = self.seconds = 0.0
        self.add: Callable[[Any], None] = self._count if self.timed else self._record

    def _count(self, batch: Any) -> None:
        self.batches += 1
        self.samples += len(batch)

    def _record(self, batch: Any) -> None:
        self.batches += 1
        self.samples += len(batch)
        self.indices.extend(self.run.indices_of(batch))

    def __enter__(self) -> Epoch:
        run = self.run
        if self.timed and run.before_timed is not None:
            run.before_timed()
        gc.collect()
        if self.timed and run.profiler is not None:
            run.profiler.enable()
        self.start = time.perf_counter()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start
        if self.timed and self.run.profiler is not None:
            self.run.profiler.disable()
        if exc_type is None:
            self.run.finish(self)


@dataclass
class Outcome:
    """What a child sends back (as a dict: its classes live in its ``__mp_main__``)."""

    epoch_s: list[float] = field(default_factory=list)
    warmup_s: float | None = None
    error: str | None = None


class Run:
    """A configuration's epochs: :meth:`epochs` yields the warm-up, then ``repeats`` timed
    ones; :meth:`finish` checks each and keeps its time."""

    def __init__(
        self,
        items: int,
        batch_size: int,
        repeats: int,
        indices_of: Callable[[Any], list[int]],
        before_timed: Callable[[], None] | None = None,
        profiler: cProfile.Profile | None = None,
    ) -> None:
        self.items = items
        self.batch_size = batch_size
        self.repeats = repeats
        self.indices_of = indices_of
        self.before_timed = before_timed
        self.profiler = profiler
        self.outcome = Outcome()

    def epochs(self) -> Iterator[Epoch]:
        for number in range(self.repeats + 1):
            yield Epoch(self, number)

    def finish(self, epoch: Epoch) -> None:
        expected = math.ceil(self.items / self.batch_size)
        if not epoch.timed:
            error = delivery_error(epoch.indices, self.items, epoch.batches, expected)
            if error is not None:
                raise EpochError(f"warm-up epoch: {error}")
            self.outcome.warmup_s = epoch.seconds
            return
        if epoch.samples != self.items or epoch.batches != expected:
            raise EpochError(
                f"epoch {epoch.number}: {epoch.samples} samples in {epoch.batches} batches, "
                f"expected {self.items} in {expected}"
            )
        self.outcome.epoch_s.append(epoch.seconds)

    def execute(self, body: Callable[[Run], None]) -> dict[str, Any]:
        """Run ``body`` (the configuration's epochs); its outcome as a dict, an exception it
        raised reported as its error."""
        try:
            body(self)
        except Exception as exc:
            self.outcome.error = error_text(exc)
        timed = len(self.outcome.epoch_s)
        if self.outcome.error is None and timed != self.repeats:
            self.outcome.error = f"{timed} timed epochs ran, expected {self.repeats}"
        return dataclasses.asdict(self.outcome)


# -- the configurations -------------------------------------------------------------------------


def options(batch_size: int, collate: Callable[[Any], Any] | None) -> dict[str, Any]:
    """The loader's arguments: ``batch_size``, and ``collate_fn`` when not the default."""
    return {"batch_size": batch_size} | ({} if collate is None else {"collate_fn": collate})


def run_torch(
    dataset: Any, run: Run, *, workers: int, collate: Callable[[Any], Any] | None
) -> None:
    loader = torch.utils.data.DataLoader(
        dataset, num_workers=workers, **options(run.batch_size, collate)
    )
    for epoch in run.epochs():
        with epoch:
            add = epoch.add
            for batch in loader:
                add(batch)


def run_plain(dataset: Any, run: Run, *, stack: bool) -> None:
    """The hand-written loop: ``torch.stack`` of each slice's items (``stack``), or the list."""
    n, size = len(dataset), run.batch_size
    for epoch in run.epochs():
        with epoch:
            add = epoch.add
            for s in range(0, n, size):
                samples = [dataset[i] for i in range(s, min(n, s + size))]
                add(torch.stack(samples) if stack else samples)


def run_aio_for(
    dataset: Any, run: Run, *, scope: bool, collate: Callable[[Any], Any] | None
) -> None:
    """A plain ``for`` per epoch, inside one ``with loader:`` (``scope``) or without."""
    loader: aioloader.DataLoader[Any] = aioloader.DataLoader(
        dataset, **options(run.batch_size, collate)
    )
    with loader if scope else contextlib.nullcontext():
        for epoch in run.epochs():
            with epoch:
                add = epoch.add
                for batch in loader:
                    add(batch)


async def _aio_async_epochs(dataset: Any, run: Run, collate: Callable[[Any], Any] | None) -> None:
    loader: aioloader.DataLoader[Any] = aioloader.DataLoader(
        dataset, **options(run.batch_size, collate)
    )
    async with loader:
        for epoch in run.epochs():
            with epoch:
                add = epoch.add
                async for batch in loader:
                    add(batch)


def run_aio_async(
    dataset: Any, run: Run, *, uvloop: bool, collate: Callable[[Any], Any] | None
) -> None:
    """``async with loader:`` around one ``async for`` per epoch, under ``asyncio.run`` or
    ``asyncio.Runner(loop_factory=uvloop.new_event_loop)``."""
    if not uvloop:
        asyncio.run(_aio_async_epochs(dataset, run, collate))
        return
    import uvloop as _uvloop

    with asyncio.Runner(loop_factory=_uvloop.new_event_loop) as runner:
        runner.run(_aio_async_epochs(dataset, run, collate))


@dataclass(frozen=True)
class Job:
    """One configuration of one workload, as handed to a child (which builds it by name)."""

    workload: str  # "rows" or "files"
    config: str
    items: int
    batch_size: int
    repeats: int
    cold: bool = False
    directory: str = ""  # files: the folder


def file_paths(job: Job) -> list[str]:
    return [file_path(job.directory, i) for i in range(job.items)]


def files_source(job: Job) -> Any:
    import aioloader.sources  # here: the rows workload's children need not import it

    return aioloader.sources.files(job.directory, "*.bin")


Body = Callable[[Any, Run], None]  # (dataset, run)


@dataclass(frozen=True)
class Config:
    """``make(job)``: the dataset (built before the child's clock starts); ``body``: its epochs;
    ``skip``: why it cannot run here."""

    name: str
    make: Callable[[Job], Any]
    body: Body
    skip: str | None = None


def _rows(job: Job) -> Rows:
    return Rows(job.items)


def _async_rows(job: Job) -> AsyncRows:
    return AsyncRows(job.items)


def _files(job: Job) -> Files:
    return Files(file_paths(job))


def build_configs() -> dict[str, dict[str, Config]]:
    """Each workload's configurations, in the order they run."""
    no_uvloop = None if HAS_UVLOOP else "uvloop is not installed"
    p = functools.partial
    rows = [
        Config("torch-nw0", _rows, p(run_torch, workers=0, collate=None)),
        Config("torch-nw2", _rows, p(run_torch, workers=2, collate=None)),
        Config("torch-nw8", _rows, p(run_torch, workers=8, collate=None)),
        Config(PLAIN, _rows, p(run_plain, stack=True)),
        Config("aio-torchds-for", _rows, p(run_aio_for, scope=True, collate=None)),
        Config("aio-torchds-for-nowith", _rows, p(run_aio_for, scope=False, collate=None)),
        Config("aio-torchds-async", _rows, p(run_aio_async, uvloop=False, collate=None)),
        Config(
            "aio-torchds-async-uvloop",
            _rows,
            p(run_aio_async, uvloop=True, collate=None),
            skip=no_uvloop,
        ),
        Config("aio-asyncds-async", _async_rows, p(run_aio_async, uvloop=False, collate=None)),
        Config(
            "aio-asyncds-async-uvloop",
            _async_rows,
            p(run_aio_async, uvloop=True, collate=None),
            skip=no_uvloop,
        ),
    ]
    files = [
        Config(PLAIN, _files, p(run_plain, stack=False)),
        Config("torch-nw0", _files, p(run_torch, workers=0, collate=list)),
        Config("torch-nw2", _files, p(run_torch, workers=2, collate=list)),
        Config("torch-nw8", _files, p(run_torch, workers=8, collate=list)),
        Config("aio-files", files_source, p(run_aio_async, uvloop=False, collate=list)),
        Config("aio-torchds-for", _files, p(run_aio_for, scope=True, collate=list)),
    ]
    return {"rows": {c.name: c for c in rows}, "files": {c.name: c for c in files}}


CONFIGS = build_configs()
ALL_NAMES = list(dict.fromkeys(name for configs in CONFIGS.values() for name in configs))


def prepare(job: Job, profiler: cProfile.Profile | None = None) -> Callable[[], dict[str, Any]]:
    """The set-up of a configuration, the same for every row (in a child: before
    ``harness.run_in_child`` has it say ready): the dataset built; returns its work, whose
    outcome is a dict."""
    # torch warns that 8 workers exceed a small machine's cores: measuring that is the point.
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    config = CONFIGS[job.workload][job.config]
    dataset = config.make(job)
    if job.workload == "rows":
        run = Run(job.items, job.batch_size, job.repeats, row_indices, profiler=profiler)
    else:
        before = functools.partial(drop_cache, file_paths(job)) if job.cold else None
        run = Run(job.items, job.batch_size, job.repeats, file_indices, before, profiler)
    return functools.partial(run.execute, functools.partial(config.body, dataset))


def prepare_child(job: Job) -> Callable[[], dict[str, Any]]:
    return prepare(job)


# -- measuring (this process) -------------------------------------------------------------------


@dataclass
class OverheadResult(Result):
    """One row: ``samples`` (one epoch's) and ``wall_s`` (the best timed epoch); ``epoch_s``:
    every timed epoch's wall time; ``start_pss_mib``: the base PSS."""

    epoch_s: list[float] = field(default_factory=list)
    warmup_s: float | None = None
    timed_out: bool = False

    @property
    def us_per_sample(self) -> float:
        return self.wall_s / self.samples * 1e6 if self.samples else math.nan

    @property
    def median_us(self) -> float:
        return statistics.median(self.epoch_s) / self.samples * 1e6 if self.samples else math.nan

    @property
    def status(self) -> str:
        return f"TIMED OUT: {self.error}" if self.timed_out else super().status


def measure(job: Job, timeout: float) -> OverheadResult:
    """Run ``job`` in a fresh child (``harness.run_in_child``), its memory sampled from here."""
    config = CONFIGS[job.workload][job.config]
    if config.skip is not None:
        return OverheadResult(job.config, skipped=config.skip)
    run = run_in_child(prepare_child, job, timeout, name=f"bench-overhead-{job.config}")
    result = OverheadResult(job.config, error=run.error, timed_out=run.timed_out)
    if run.payload is not None:
        outcome = Outcome(**run.payload)
        result.epoch_s, result.warmup_s = outcome.epoch_s, outcome.warmup_s
        if outcome.epoch_s:
            result.samples, result.wall_s = job.items, min(outcome.epoch_s)
    result.record_memory(run.memory)
    return result


def _progress(r: OverheadResult) -> str:
    if not r.epoch_s:
        return f"  done {r.name:<26} {r.status}"
    return (
        f"  done {r.name:<26} {r.samples_per_s:>11,.0f} samples/s {r.us_per_sample:>8.2f} µs "
        f"{r.peak_pss_mib:>7,.0f} MiB PSS  {r.status}"
    )


def measure_all(jobs: Sequence[Job], timeout: float, tag: str) -> list[OverheadResult]:
    results = []
    for job in jobs:
        results.append(measure(job, timeout))
        print(_progress(results[-1]), flush=True)
        report(tag, results[-1])
    return results


def format_results(results: Sequence[OverheadResult], baseline: str) -> str:
    """One table: a row per configuration, ratios to ``baseline``'s row."""
    by_name = {r.name: r for r in results}

    def over_plain(r: OverheadResult) -> str:
        plain = by_name.get(PLAIN)
        if plain is None or not plain.measured or not r.measured:
            return "-"
        return f"{r.us_per_sample - plain.us_per_sample:+.2f}"

    def mib(value: Callable[[OverheadResult], float]) -> Callable[[OverheadResult], str]:
        return lambda r: f"{value(r):,.0f}"

    def per_s(r: OverheadResult) -> float:
        return r.samples_per_s

    columns: list[Column[OverheadResult]] = [
        Column("samples/s", 12, lambda r: f"{r.samples_per_s:,.0f}"),
        Column("µs/sample", 11, lambda r: f"{r.us_per_sample:.2f}"),
        Column("median µs", 11, lambda r: f"{r.median_us:.2f}"),
        Column("+µs vs plain", 14, over_plain),
        Column(f"vs {baseline}", len(baseline) + 5, ratio_to(results, baseline, per_s)),
        Column("warm-up s", 11, lambda r: "-" if r.warmup_s is None else f"{r.warmup_s:.2f}"),
        Column("base PSS", 10, mib(lambda r: r.start_pss_mib)),
        Column("peak RSS", 10, mib(lambda r: r.peak_rss_mib)),
        Column("peak PSS", 10, mib(lambda r: r.peak_pss_mib)),
        Column("RSS vs base", 13, ratio_to(results, baseline, lambda r: r.peak_rss_mib)),
        Column("PSS vs base", 13, ratio_to(results, baseline, lambda r: r.peak_pss_mib)),
    ]
    return format_table(
        results,
        26,
        columns,
        lambda r: r.status,
        blank=lambda r: not r.epoch_s,
        note=f"(memory in MiB; 'base' in the ratio headers is {baseline})",
    )


# -- profiling (in this process) ----------------------------------------------------------------


class _Snapshot:
    """A profiler's stats taken without ``disable()`` (which acts on the calling thread: the
    profiler of another thread must not be disabled from this one)."""

    def __init__(self, profiler: cProfile.Profile) -> None:
        profiler.snapshot_stats()
        self.stats = profiler.stats

    def create_stats(self) -> None:
        pass


@contextlib.contextmanager
def thread_profilers() -> Iterator[list[cProfile.Profile]]:
    """Every thread started (by ``threading``) inside the block runs under a cProfile of its
    own from its first call; the list holds them."""
    profilers: list[cProfile.Profile] = []

    def start(frame: FrameType, event: str, arg: object) -> None:
        profiler = cProfile.Profile()
        profilers.append(profiler)
        profiler.enable()  # replaces this hook, on this thread only

    threading.setprofile(start)
    try:
        yield profilers
    finally:
        threading.setprofile(None)


def _top(stats: pstats.Stats, out: io.StringIO) -> None:
    for key, what in (("cumulative", "cumulative time"), ("tottime", "own time")):
        print(f"-- top {PROFILE_TOP} by {what}:", file=out)
        stats.sort_stats(key).print_stats(PROFILE_TOP)


def profile(job: Job, timeout: float) -> str:
    """Run ``job`` here under cProfile; the report."""
    main = cProfile.Profile()
    with watchdog(timeout), thread_profilers() as others:
        outcome = prepare(job, main)()
    error = outcome["error"]
    out = io.StringIO()
    epochs = outcome["epoch_s"]
    us = f"{min(epochs) / job.items * 1e6:.2f} µs/sample (best, profiled)" if epochs else ""
    print(f"status: {'ok' if error is None else f'FAIL: {error}'}  {us}", file=out)
    print(f"\n== main thread, the {job.repeats} timed epochs ==", file=out)
    _top(pstats.Stats(main, stream=out), out)
    snapshots = [_Snapshot(p) for p in others]
    snapshots = [s for s in snapshots if s.stats]
    print(
        f"\n== the {len(snapshots)} threads started during the run, their whole life "
        "(warm-up included) ==",
        file=out,
    )
    if snapshots:
        _top(pstats.Stats(*snapshots, stream=out), out)  # type: ignore[arg-type]
    return out.getvalue()


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="The loader's own cost per sample: in-memory rows and small local files, "
        "aioloader vs torch's DataLoader vs a hand-written loop, each configuration in a fresh "
        "process."
    )
    parser.add_argument(
        "--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS), help="default: both"
    )
    parser.add_argument(
        "--batch-sizes",
        nargs="+",
        type=int,
        default=list(BATCH_SIZES),
        metavar="B",
        help="rows workload's batch sizes (default 32 256; files: always 32)",
    )
    parser.add_argument("--rows", type=int, default=None, help=f"rows (default {ROWS:,})")
    parser.add_argument(
        "--files", type=int, default=None, help=f"files of 16 KiB (default {FILES:,})"
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="files: also a table with the page cache dropped before each timed epoch",
    )
    parser.add_argument(
        "--repeats", type=int, default=REPEATS, help="timed epochs, after one warm-up (default 3)"
    )
    add_only(parser, ALL_NAMES)
    parser.add_argument(
        "--profile",
        metavar="NAME",
        choices=ALL_NAMES,
        help=f"no tables: run NAME in this process under cProfile, print the top {PROFILE_TOP}",
    )
    add_timeout(parser, f"seconds one configuration may take (default {TIMEOUT_S:g})", TIMEOUT_S)
    add_quick(parser, f"smoke test: {QUICK_ROWS:,} rows, {QUICK_FILES:,} files (unless given)")
    args = parser.parse_args(argv)
    quick_defaults(args, rows=(QUICK_ROWS, ROWS), files=(QUICK_FILES, FILES))
    if min(args.rows, args.files, args.repeats, *args.batch_sizes) <= 0 or args.timeout <= 0:
        parser.error("--rows, --files, --repeats, --batch-sizes and --timeout must be positive")
    if args.rows >= 2**24:
        parser.error("--rows must be below 2**24 (the rows' values are exact float32 indices)")
    args.batch_sizes = list(dict.fromkeys(args.batch_sizes))
    args.workloads = [w for w in WORKLOADS if w in args.workloads]
    return args


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def selected(workload: str, args: argparse.Namespace) -> list[str]:
    names = list(CONFIGS[workload])
    if args.profile:
        return [n for n in names if n == args.profile]
    return [n for n in names if args.only is None or n in args.only]


def rows_tables(args: argparse.Namespace) -> list[str]:
    """The rows workload at each batch size; return what failed."""
    names = selected("rows", args)
    failed = []
    for size in args.batch_sizes:
        title = f"rows: {args.rows:,} x {WIDTH} float32 in memory, batch {size}"
        jobs = [Job("rows", n, args.rows, size, args.repeats) for n in names]
        failed += run_table(jobs, title, BASELINE["rows"], f"rows-b{size}", args)
    return failed


def run_table(
    jobs: list[Job], title: str, baseline: str, tag: str, args: argparse.Namespace
) -> list[str]:
    """Profile ``jobs`` (``--profile``), or measure them and print their table; return the
    names of those that failed, under ``tag``."""
    if args.profile:
        for job in jobs:
            print(f"\n== profile of {job.config}, {title} ==", flush=True)
            print(profile(job, args.timeout), flush=True)
        return []
    print(f"\n== {title} ==", flush=True)
    results = measure_all(jobs, args.timeout, tag)
    print(f"\n{title}, best of {args.repeats} epochs after a warm-up:")
    print(format_results(results, baseline), flush=True)
    return [f"{tag}/{r.name}" for r in results if not r.ok]


def files_tables(args: argparse.Namespace) -> list[str]:
    """The files workload, warm and (``--cold``) cold; return what failed."""
    names = selected("files", args)
    failed = []
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as directory:
        start = time.perf_counter()
        write_files(directory, args.files, sync=args.cold)
        print(
            f"\nwrote {args.files:,} files of {FILE_BYTES // 1024} KiB into {directory} in "
            f"{time.perf_counter() - start:.1f} s{' (fdatasync-ed)' if args.cold else ''}",
            flush=True,
        )
        modes = [False, True] if args.cold else [False]
        for cold in modes:
            title = f"files: {args.files:,} x {FILE_BYTES // 1024} KiB, batch {FILE_BATCH}, " + (
                "cold (page cache dropped before each timed epoch)" if cold else "warm"
            )
            jobs = [
                Job("files", n, args.files, FILE_BATCH, args.repeats, cold, directory)
                for n in names
            ]
            tag = "files-cold" if cold else "files"
            failed += run_table(jobs, title, BASELINE[tag], tag, args)
    return failed


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.perf_counter()
    signal.signal(signal.SIGTERM, _interrupt)  # clean up (the temporary folder) as for Ctrl-C
    print(f"{versions('torch', 'uvloop', 'aiofiles')}, {cpus_and_load()}", flush=True)
    workloads = [w for w in args.workloads if selected(w, args)]
    if not workloads:
        print("no configuration selected in these workloads")
        return 0
    failed: list[str] = []
    if "rows" in workloads:
        failed += rows_tables(args)
    if "files" in workloads:
        failed += files_tables(args)
    print(f"\ntotal {time.perf_counter() - began:.0f} s, {cpus_and_load()}")
    return exit_status(failed)


if __name__ == "__main__":
    sys.exit(main())
