"""The loader's own cost per sample, measured interleaved in one process.

``bench_overhead.py`` runs each configuration in a fresh child (to measure its memory), one
after another; on a shared 2-core machine the speed of the whole machine drifts between them
(torch's ``num_workers=0`` loop has measured anywhere from 294k to 562k rows/s from one minute to
the next). Here the configurations take turns, epoch by epoch, in one process, and each keeps
its best epoch, so a drift slows them all alike and the ratios hold; each round's ratio to the
torch epoch measured just before it is reported too (their median), which a burst of load
that favours one configuration's best epoch moves less:

    python benchmarks/bench_overhead_interleaved.py [--batch-sizes 32 256] [--rounds 7]

Configurations, on rows of 16 float32 in memory, default collation, ``num_workers=0``:
``torch`` (torch's ``DataLoader``, the baseline), ``for`` (a torch ``Dataset`` through
``aioloader.DataLoader``, a plain ``for`` inside ``with loader:``), ``async`` (the same,
``async for``) and ``async-asyncds`` (an ``AsyncDataset`` whose ``get`` never suspends).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Iterable
from typing import Any

import torch

import aioloader
from aioloader._bench.harness_script import cpus_and_load, versions
from aioloader._bench.overhead import AsyncRows, Rows


def rate(samples: Iterable[Any]) -> float:
    started = time.perf_counter()
    n = sum(len(batch) for batch in samples)
    return n / (time.perf_counter() - started)


async def async_rate(loader: aioloader.DataLoader[Any]) -> float:
    started, n = time.perf_counter(), 0
    async for batch in loader:
        n += len(batch)
    return n / (time.perf_counter() - started)


def measure(rows: int, batch_size: int, rounds: int) -> dict[str, list[float]]:
    """Each configuration's rate in each round (torch's measured in every round, beside them)."""
    data, async_data = Rows(rows), AsyncRows(rows)
    theirs = torch.utils.data.DataLoader(data, batch_size=batch_size)
    seen: dict[str, list[float]] = {}

    def keep(name: str, value: float) -> None:
        seen.setdefault(name, []).append(value)

    with aioloader.DataLoader(data, batch_size=batch_size) as ours:
        rate(ours)  # warm-up
        for _ in range(rounds):
            keep("torch", rate(theirs))
            keep("for", rate(ours))

    async def in_loop() -> None:
        plain = aioloader.DataLoader(data, batch_size=batch_size)
        native = aioloader.DataLoader(async_data, batch_size=batch_size)
        async with plain, native:
            await async_rate(plain)
            await async_rate(native)
            for _ in range(rounds):
                keep("torch", rate(theirs))
                keep("async", await async_rate(plain))
                keep("async-asyncds", await async_rate(native))

    asyncio.run(in_loop())
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(f"{versions('torch')}, {cpus_and_load()}: {args.rows:,} rows x 16 float32")
    for batch_size in args.batch_sizes:
        seen = measure(args.rows, batch_size, args.rounds)
        torch_rates = seen["torch"]  # 2 per round: beside the plain loop, then in the event loop
        print(
            f"batch {batch_size}, {args.rounds} interleaved rounds: the best epoch's rate and "
            "ratio, and the median of each round's ratio to the torch epoch beside it"
        )
        for name, rates in seen.items():
            value = max(rates)
            ratio = value / max(torch_rates)
            if name == "torch":
                print(f"  {name:<14} {value:>10,.0f}/s {1e6 / value:>6.2f} µs  {ratio:.2f}x torch")
                continue
            beside = torch_rates[: len(rates)] if name == "for" else torch_rates[len(rates) :]
            paired = statistics.median(r / t for r, t in zip(rates, beside, strict=True))
            print(
                f"  {name:<14} {value:>10,.0f}/s {1e6 / value:>6.2f} µs  {ratio:.2f}x torch"
                f"  (median of rounds {paired:.2f}x)"
            )


if __name__ == "__main__":
    main()
