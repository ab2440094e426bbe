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
imported this module (``harness_child.run_in_child``), after the same set-up in each (this script's
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
import contextlib
import cProfile
import io
import math
import pstats
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import FrameType

from aioloader._bench.harness import Result, report, watchdog
from aioloader._bench.harness_child import run_in_child
from aioloader._bench.harness_script import (
    add_only,
    add_quick,
    add_timeout,
    cpus_and_load,
    exit_status,
    quick_defaults,
    versions,
)
from aioloader._bench.harness_table import Column, format_table, ratio_to
from aioloader._bench.overhead_data import (
    BASELINE,
    BATCH_SIZES,
    FILE_BATCH,
    FILE_BYTES,
    FILES,
    PLAIN,
    PROFILE_TOP,
    QUICK_FILES,
    QUICK_ROWS,
    REPEATS,
    ROWS,
    TIMEOUT_S,
    WIDTH,
    WORKLOADS,
    Outcome,
    write_files,
)
from aioloader._bench.overhead_runs import (
    ALL_NAMES,
    CONFIGS,
    Job,
    prepare,
    prepare_child,
)

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
    """Run ``job`` in a fresh child (``harness_child.run_in_child``), its memory sampled from
    here."""
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
