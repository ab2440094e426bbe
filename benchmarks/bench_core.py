"""Core throughput benchmark: aioloader vs torch's DataLoader on an I/O-bound dataset.

Workload: a map-style dataset of ``--items`` (default 2,000) items, each a small tensor
(``torch.full((16,), i)``) that takes ``--delay`` (default 10 ms) of I/O to fetch, collated in
batches of ``--batch-size`` (default 32). The I/O is simulated by ``await asyncio.sleep(delay)``
in an :class:`aioloader.AsyncDataset` and by ``time.sleep(delay)`` in a
``torch.utils.data.Dataset``. All configurations are measured in one run, one after another, so
the ratios between them are what matter:

* ``torch-nw0``: ``torch.utils.data.DataLoader``, ``num_workers=0`` (the serial baseline:
  about ``items * delay`` seconds, ~20 s at the defaults).
* ``torch-nw2``: ``torch.utils.data.DataLoader``, ``num_workers=2`` (default multiprocessing
  context).
* ``aio-inflight{16,64,256}``: ``aioloader.DataLoader`` over the async dataset, ``async for``,
  ``max_inflight`` 16, 64 and 256.
* ``aio-for-inflight64``: the same through a plain ``for`` loop (the pipeline runs on a
  background event-loop thread), ``max_inflight=64``.
* ``aio-torch-dataset``: ``aioloader.DataLoader`` given the *torch* (blocking) dataset as-is,
  ``async for``, default settings (it reads a whole batch per call on its I/O threads).
* ``asyncio-ceiling``: no loader at all: ``asyncio.Semaphore(64)`` + ``asyncio.gather`` of every
  fetch, then ``torch.stack`` in batches: the best any asyncio loader can do at that concurrency.

Wall time covers one full epoch end to end, including starting and stopping the loader (worker
processes, threads, event loop). Every configuration also checks that each index is delivered
exactly once, and the script exits non-zero when one is not (or when one raises or times out).

Run it from the repository root::

    python benchmarks/bench_core.py            # the full run (~30 s)
    python benchmarks/bench_core.py --quick    # a smoke test (320 items)
    python benchmarks/bench_core.py --only torch-nw2 aio-inflight64
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.utils.data

import aioloader
from aioloader._bench.harness import Result, delivery_error, timed
from aioloader._bench.harness_script import (
    add_batch_size,
    add_only,
    add_quick,
    add_timeout,
    exit_status,
    quick_defaults,
    versions,
)
from aioloader._bench.harness_table import Column, format_table, ratio_to

QUICK_ITEMS = 320
CEILING_CONCURRENCY = 64


class AsyncSleepyDataset(aioloader.AsyncDataset[torch.Tensor]):
    """Item ``i`` is ``torch.full((16,), i)``, after ``delay`` seconds of simulated async I/O."""

    def __init__(self, items: int, delay: float) -> None:
        self.items = items
        self.delay = delay

    def __len__(self) -> int:
        return self.items

    async def get(self, index: int) -> torch.Tensor:
        await asyncio.sleep(self.delay)
        return torch.full((16,), index)


class BlockingSleepyDataset(torch.utils.data.Dataset[torch.Tensor]):
    """The same items, after ``delay`` seconds of simulated blocking I/O (``time.sleep``)."""

    def __init__(self, items: int, delay: float) -> None:
        self.items = items
        self.delay = delay

    def __len__(self) -> int:
        return self.items

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.delay)
        return torch.full((16,), index)


@dataclass(frozen=True)
class Settings:
    items: int
    batch_size: int
    delay: float
    timeout: float


@dataclass
class CoreResult(Result):
    """A row, with the loader's statistics (aioloader's configurations)."""

    statistics: aioloader.LoaderStatistics | None = None


def check(batches: Sequence[torch.Tensor], settings: Settings) -> tuple[int, str | None]:
    """Return (samples delivered, None) or (samples, what is wrong): every index exactly once,
    every row one constant value, the right number of batches."""
    values: list[int] = []
    for batch in batches:
        if batch.ndim != 2 or batch.shape[1] != 16 or not bool((batch == batch[:, :1]).all()):
            return len(values), f"malformed batch of shape {tuple(batch.shape)}"
        values.extend(int(v) for v in batch[:, 0].tolist())
    expected_batches = math.ceil(settings.items / settings.batch_size)
    return len(values), delivery_error(values, settings.items, len(batches), expected_batches)


# -- the configurations --------------------------------------------------------------------------


def run_torch(settings: Settings, num_workers: int) -> tuple[list[torch.Tensor], None]:
    dataset = BlockingSleepyDataset(settings.items, settings.delay)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=settings.batch_size, num_workers=num_workers
    )
    return list(loader), None


async def _aio_async_for(
    dataset: object, settings: Settings, max_inflight: int | None = None
) -> tuple[list[torch.Tensor], aioloader.LoaderStatistics]:
    """One epoch by ``async for``; ``max_inflight`` None keeps the loader's default."""
    loader: aioloader.DataLoader[torch.Tensor] = (
        aioloader.DataLoader(dataset, batch_size=settings.batch_size)
        if max_inflight is None
        else aioloader.DataLoader(
            dataset, batch_size=settings.batch_size, max_inflight=max_inflight
        )
    )
    batches: list[torch.Tensor] = []
    async with asyncio.timeout(settings.timeout):
        async with loader:
            async for batch in loader:
                batches.append(batch)
    return batches, loader.statistics()


def run_aio(
    settings: Settings, max_inflight: int
) -> tuple[list[torch.Tensor], aioloader.LoaderStatistics]:
    dataset = AsyncSleepyDataset(settings.items, settings.delay)
    return asyncio.run(_aio_async_for(dataset, settings, max_inflight=max_inflight))


def run_aio_plain_for(
    settings: Settings, max_inflight: int
) -> tuple[list[torch.Tensor], aioloader.LoaderStatistics]:
    dataset = AsyncSleepyDataset(settings.items, settings.delay)
    loader: aioloader.DataLoader[torch.Tensor] = aioloader.DataLoader(
        dataset, batch_size=settings.batch_size, max_inflight=max_inflight
    )
    batches = list(loader)
    return batches, loader.statistics()


def run_aio_torch_dataset(
    settings: Settings,
) -> tuple[list[torch.Tensor], aioloader.LoaderStatistics]:
    dataset = BlockingSleepyDataset(settings.items, settings.delay)
    return asyncio.run(_aio_async_for(dataset, settings))


async def _ceiling(settings: Settings) -> list[torch.Tensor]:
    dataset = AsyncSleepyDataset(settings.items, settings.delay)
    semaphore = asyncio.Semaphore(CEILING_CONCURRENCY)

    async def fetch(index: int) -> torch.Tensor:
        async with semaphore:
            return await dataset.get(index)

    async with asyncio.timeout(settings.timeout):
        samples = await asyncio.gather(*(fetch(i) for i in range(settings.items)))
    size = settings.batch_size
    return [torch.stack(samples[i : i + size]) for i in range(0, len(samples), size)]


def run_ceiling(settings: Settings) -> tuple[list[torch.Tensor], None]:
    return asyncio.run(_ceiling(settings)), None


Runner = Callable[[Settings], tuple[list[torch.Tensor], aioloader.LoaderStatistics | None]]

CONFIGS: dict[str, Runner] = {
    "torch-nw0": lambda s: run_torch(s, 0),
    "torch-nw2": lambda s: run_torch(s, 2),
    "aio-inflight16": lambda s: run_aio(s, 16),
    "aio-inflight64": lambda s: run_aio(s, 64),
    "aio-inflight256": lambda s: run_aio(s, 256),
    "aio-for-inflight64": lambda s: run_aio_plain_for(s, 64),
    "aio-torch-dataset": run_aio_torch_dataset,
    "asyncio-ceiling": run_ceiling,
}
BASELINES = ("torch-nw0", "torch-nw2", "asyncio-ceiling")
STATS_CONFIG = "aio-inflight64"


def measure(name: str, settings: Settings) -> CoreResult:
    """Run one configuration, timed, under a watchdog that dumps every thread's stack and exits
    the process if it hangs well past ``settings.timeout``."""
    run = timed(lambda: CONFIGS[name](settings), settings.timeout + 30)
    if run.value is None:  # it raised: report it, go on with the other configurations
        return CoreResult(name, 0, run.wall_s, error=run.error)
    batches, stats = run.value
    samples, error = check(batches, settings)
    if error is None and stats is not None and stats.consumer.samples != settings.items:
        error = f"statistics().consumer.samples is {stats.consumer.samples}, not {settings.items}"
    return CoreResult(name, samples, run.wall_s, error=error, statistics=stats)


def format_results(results: Iterable[CoreResult]) -> str:
    results = list(results)
    columns: list[Column[CoreResult]] = [
        Column("samples/s", 12, lambda r: f"{r.samples_per_s:,.0f}"),
        Column("wall s", 9, lambda r: f"{r.wall_s:.2f}"),
    ]
    for label, peer, width in zip(("nw0", "nw2", "ceiling"), BASELINES, (9, 9, 12), strict=True):
        per_s = ratio_to(results, peer, lambda r: r.samples_per_s)
        columns.append(Column(f"vs {label}", width, per_s))
    return format_table(results, 20, columns, lambda r: r.status)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="aioloader vs torch DataLoader on an I/O-bound map-style dataset."
    )
    parser.add_argument("--items", type=int, default=None, help="dataset size (default 2000)")
    add_batch_size(parser)
    parser.add_argument("--delay", type=float, default=0.01, help="seconds of I/O per item")
    add_quick(parser, f"smoke test: {QUICK_ITEMS} items (unless --items)")
    add_only(parser, list(CONFIGS))
    add_timeout(parser, "seconds one configuration may take (default: max(120, 3 * items * delay))")
    args = parser.parse_args(argv)
    quick_defaults(args, items=(QUICK_ITEMS, 2000))
    if args.items <= 0 or args.batch_size <= 0 or args.delay < 0:
        parser.error("--items and --batch-size must be positive, --delay non-negative")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    timeout = args.timeout or max(120.0, 3 * args.items * args.delay)
    settings = Settings(args.items, args.batch_size, args.delay, timeout)
    names: list[str] = args.only or list(CONFIGS)
    print(
        f"{versions('torch')}: {settings.items} items x {settings.delay * 1e3:g} ms I/O, "
        f"batch {settings.batch_size}",
        flush=True,
    )
    results: list[CoreResult] = []
    for name in names:
        result = measure(name, settings)
        results.append(result)
        print(
            f"  done {name:<20} {result.samples_per_s:>10,.0f} samples/s "
            f"{result.wall_s:>7.2f} s  {result.status}",
            flush=True,
        )
    print()
    print(format_results(results))
    stats = next((r.statistics for r in results if r.name == STATS_CONFIG), None)
    if stats is not None:
        print()
        print(f"{STATS_CONFIG} statistics:")
        print(repr(stats))
    return exit_status([r.name for r in results if not r.ok])


if __name__ == "__main__":
    sys.exit(main())
