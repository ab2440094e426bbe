"""Serving benchmark by cost: requests of long-tailed lengths through the DynamicBatcher, a model
whose time is its padded cost; batching by count against by cost and by cost within buckets.

Requests: a seeded draw of lengths (tokens): 90% short (8 to 32), 10% long (33 to 1,600: up to
50 times a short one). The model pads: a batch of ``n`` requests whose longest has ``L`` tokens
costs ``n x L`` tokens and takes ``FIXED_S + TOKEN_S x n x L`` seconds, slept on the batcher's
thread (an accelerator's time, during which the host is free). Load: open-loop Poisson arrivals
at each rate, ``submit()`` called in this process on a uvloop (no HTTP: that is
``serving.py``'s), every configuration with the same seeded arrivals and lengths.

Configurations (``max_batch_size=32``, ``max_delay=5 ms`` for all):

* ``count``: batches by count only (what ``@serve.batch`` without a cost function does);
  ``cost_fn`` given, without a limit, only for the statistics.
* ``cost``: ``cost_fn`` = the length, ``max_batch_cost=4096`` tokens, ``padded_cost=True``.
* ``bucket``: the same, with ``bucket_fn`` = the power of two at or above the length.

Columns: ``done/s``; ``model ms/req`` (the model's time over the requests served); ``padded
tok/req`` (padded cost per request served, from ``statistics().cost``); ``padding`` (padded
fraction: padding over padded cost); ``batch`` (mean size); ``p50``/``p99`` ms (arrival to
result; a failed request counts as infinitely slow).

The goal checked at the end: at each rate, ``bucket``'s padded cost per request is at least
30% below ``count``'s, at the same p99 bound: ``bucket``'s p99 within 25 ms (twice
``max_delay``, a batch of ``max_batch_cost`` tokens, and 10 ms for this shared 2-core VM), or no
higher than ``count``'s where ``count``'s is past it.

Run:
    python benchmarks/bench_serving_cost.py            # 3 rates x 3 configurations, ~40 s
    python benchmarks/bench_serving_cost.py --quick    # a smoke test: short windows
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import uvloop

from aioloader import DynamicBatcher
from aioloader._bench.harness import Result, report
from aioloader._bench.harness_script import add_quick, quick_defaults

MAX_BATCH, MAX_DELAY, MAX_COST = 32, 0.005, 4096
FIXED_S, TOKEN_S = 0.0005, 1e-6
SHORT, LONG, LONG_SHARE = (8, 32), (33, 1600), 0.1
CONFIGS = ("count", "cost", "bucket")
GOAL = 0.30  # padded cost per request saved by buckets, at least
P99_BOUND_S = 0.025  # the p99 every row is held to: 2 x max_delay + a full-cost batch + slack


def tokens(length: int) -> int:
    """A request's cost: its length."""
    return length


def pow2_bucket(length: int) -> int:
    """The exponent of the power of two at or above ``length``."""
    return (length - 1).bit_length()


def options(config: str) -> dict[str, Any]:
    """The batcher's arguments for ``config``."""
    if config == "count":
        return {"cost_fn": tokens}  # no limit: the cost only fills the statistics
    cost = {"cost_fn": tokens, "max_batch_cost": MAX_COST, "padded_cost": True}
    return cost if config == "cost" else {**cost, "bucket_fn": pow2_bucket}


def lengths(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(*(LONG if rng.random() < LONG_SHARE else SHORT)) for _ in range(n)]


@dataclass
class Level:
    config: str
    rate: float
    sent: int
    latencies: list[float]
    failed: int
    span_s: float
    model_s: float
    padded_per_request: float
    padded_fraction: float
    mean_batch: float

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies) + [math.inf] * self.failed
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else math.nan

    @property
    def served(self) -> int:
        return len(self.latencies)


async def level(config: str, rate: float, n: int, give_up_s: float, seed: int) -> Level:
    """``n`` requests at Poisson arrivals of ``rate``/s through a batcher made as ``config``."""
    model_s = 0.0

    def model(batch: list[int]) -> list[int]:
        nonlocal model_s
        took = FIXED_S + TOKEN_S * len(batch) * max(batch)  # what a padding model pays
        time.sleep(took)
        model_s += took
        return batch

    batcher = DynamicBatcher(
        model,
        collate_fn=list,
        max_batch_size=MAX_BATCH,
        max_delay=MAX_DELAY,
        max_queue=8192,
        timeout=give_up_s,
        **options(config),
    )
    sizes = lengths(n, seed)
    rng = random.Random(seed + 1)
    latencies: list[float] = []
    failed = 0

    async def one(at: float, length: int) -> None:
        nonlocal failed
        try:
            await batcher.submit(length)
        except Exception:  # timed out, or refused: counted as infinitely slow
            failed += 1
        else:
            latencies.append(time.perf_counter() - at)

    async with batcher, asyncio.TaskGroup() as tg:
        start = at = time.perf_counter()
        for length in sizes:
            at += rng.expovariate(rate)
            if (delay := at - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            tg.create_task(one(at, length))
    span = time.perf_counter() - start
    s = batcher.statistics()
    if s.cost is None:
        raise RuntimeError("a batcher with a cost_fn kept no cost statistics")
    return Level(
        config, rate, n, latencies, failed, span, model_s, s.cost.padded_per_request,
        s.cost.padded_fraction, s.mean_batch_size,
    )  # fmt: skip


async def run_levels(args: argparse.Namespace) -> dict[str, list[Level]]:
    results: dict[str, list[Level]] = {c: [] for c in args.configs}
    for rate in args.rates:
        n = max(50, round(rate * args.window))
        for config in args.configs:  # the same arrivals and lengths for each
            lv = await level(config, rate, n, args.request_timeout, seed=int(rate))
            results[config].append(lv)
            print(f"  {config:<7} {rate:>6.0f}/s: {lv.served}/{n} served", flush=True)
    return results


def summarize(results: dict[str, list[Level]], rates: Sequence[float]) -> bool:
    print(
        f"\nmodel: {FIXED_S * 1e3:.1f} ms + {TOKEN_S * 1e6:.2f} us a padded token; lengths"
        f" {SHORT[0]}-{SHORT[1]} ({1 - LONG_SHARE:.0%}) or {LONG[0]}-{LONG[1]}; max_batch_size"
        f" {MAX_BATCH}, max_delay {MAX_DELAY * 1e3:.0f} ms, max_batch_cost {MAX_COST}\n"
    )
    print(
        f"{'offered/s':>9}  {'config':<8}{'done/s':>8}{'model ms/req':>14}{'padded tok/req':>16}"
        f"{'padding':>9}{'batch':>7}{'p50 ms':>9}{'p99 ms':>9}{'fail':>6}"
    )
    for i, rate in enumerate(rates):
        for config, levels in results.items():
            lv = levels[i]
            per = lv.model_s / lv.served * 1e3 if lv.served else math.nan
            print(
                f"{rate:>9.0f}  {config:<8}{lv.served / lv.span_s:>8.0f}{per:>14.3f}"
                f"{lv.padded_per_request:>16.0f}{lv.padded_fraction:>9.0%}{lv.mean_batch:>7.1f}"
                f"{lv.percentile(0.5) * 1e3:>9.1f}{lv.percentile(0.99) * 1e3:>9.1f}{lv.failed:>6}"
            )
    if not {"count", "bucket"} <= results.keys():
        return True
    good = []
    for i, rate in enumerate(rates):
        count, bucket = results["count"][i], results["bucket"][i]
        saved = 1 - bucket.padded_per_request / count.padded_per_request
        tail = bucket.percentile(0.99) <= max(P99_BOUND_S, count.percentile(0.99))
        good.append(saved >= GOAL and tail)
        print(
            f"goal at {rate:.0f}/s: buckets pad {saved:.0%} less a request than count-only"
            f" (want >= {GOAL:.0%}); p99 {bucket.percentile(0.99) * 1e3:.1f} ms against"
            f" {count.percentile(0.99) * 1e3:.1f} (bound {P99_BOUND_S * 1e3:.0f} ms): "
            + ("holds" if good[-1] else "DOES NOT HOLD")
        )
    return all(good)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    results = uvloop.run(run_levels(args))
    summarize(results, args.rates)
    for config, levels in results.items():
        for lv in levels:
            error = f"{lv.failed} of {lv.sent} requests failed" if lv.failed else None
            row = Result(f"batcher-{config}@{lv.rate:g}", lv.served, lv.span_s, error=error)
            report(
                "serving-cost",
                row,
                offered=lv.rate,
                p99_ms=lv.percentile(0.99) * 1e3,
                padded_per_request=lv.padded_per_request,
            )
    print(f"\n(total {time.perf_counter() - started:.0f} s)")
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_quick(parser, "smoke test: short windows")
    parser.add_argument("--rates", type=float, nargs="+", help="offered loads, requests/s")
    parser.add_argument("--window", type=float, help="seconds of arrivals per rate")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--request-timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    quick_defaults(args, rates=([200, 600, 1200], [200, 600, 1200]), window=(0.5, 4.0))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
