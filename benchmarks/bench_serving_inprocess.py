"""The DynamicBatcher in process (no HTTP) under seeded Poisson load, beside Ray Serve's
``@serve.batch`` where Ray is installed: model calls, the batch-size distribution and latency.

Two models:

* ``gpu``: the serving workload's simulated accelerator (4 ms + 0.1 ms a row, slept on one
  thread) over 512 features: the batch-size distribution at mid load (issue 29, part 2).
* ``mlp``: a small torch MLP (64 -> 256 -> 64, tens of microseconds a batch) at a high rate:
  the tail latency where the per-batch overhead (thread hand-off, collation, split) shows.

Each server first takes ``--warmup`` seconds of the same load in the same scope (its model's
first calls, a fresh thread's first torch calls: 6-8 ms of CPU each for the MLP, measured):
what a long-running server's tail is made of is measured after it. ``start p99`` is the
warm-up's own p99, where a fresh scope pays for that.

Servers: ``batcher`` (a plain ``model_fn``), ``ray-thread`` (``@serve.batch``, the model on one
thread, as the batcher's thread runs it), ``ray-inline`` (``@serve.batch`` calling the model in
its async function, as Ray Serve deployments usually do). Ray is never a dependency: install
``ray[serve]`` in a virtual environment of its own, put aioloader and torch on its path, and run
this with that interpreter. Every server gets the same arrivals (seeded by the rate).

Run:
    python benchmarks/bench_serving_inprocess.py --model gpu --rates 200 500 1000
    python benchmarks/bench_serving_inprocess.py --model mlp --rates 6000 --seconds 3
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import uvloop

import aioloader

BINS = ((1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 32))
Model = Callable[[torch.Tensor], torch.Tensor]


def build(kind: str) -> tuple[Model, int]:
    """The model and its number of features."""
    torch.set_num_threads(1)
    if kind == "gpu":

        def accelerator(x: torch.Tensor) -> torch.Tensor:
            out = torch.tanh(x)
            time.sleep(0.004 + 0.0001 * x.shape[0])
            return out

        return accelerator, 512
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))

    def run(x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            out: torch.Tensor = mlp.eval()(x)
        return out

    return run, 64


def ray_server(model: Model, inline: bool) -> Callable[[Any], Awaitable[Any]]:
    from ray.serve import batch, batching

    # Outside a deployment the queue asks for the replica's context only to warn.
    batching._BatchQueue._warn_if_max_batch_size_exceeds_max_ongoing_requests = lambda self: None
    pool = ThreadPoolExecutor(1)

    async def run(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        if inline:
            return list(model(torch.stack(xs)).unbind(0))
        out = await asyncio.get_running_loop().run_in_executor(pool, model, torch.stack(xs))
        return list(out.unbind(0))

    submit: Callable[[Any], Awaitable[Any]] = batch(max_batch_size=32, batch_wait_timeout_s=0.005)(
        run
    )
    return submit


async def level(
    server: str, model: Model, features: int, rate: float, seconds: float, warmup: float
) -> None:
    sizes: Counter[int] = Counter()
    measuring = False

    def counted(x: torch.Tensor) -> torch.Tensor:
        if measuring:
            sizes[x.shape[0]] += 1
        return model(x)

    batcher = None
    if server == "batcher":
        batcher = aioloader.DynamicBatcher(
            counted, max_batch_size=32, max_delay=0.005, max_queue=1 << 16
        )
        submit: Callable[[Any], Awaitable[Any]] = batcher.submit
    else:
        submit = ray_server(counted, server == "ray-inline")
    rng = random.Random(int(rate))
    x = torch.randn(features)
    start: list[float] = []  # the warm-up's latencies
    latencies: list[float] = []

    async def one(at: float, into: list[float]) -> None:
        await submit(x)
        into.append(time.perf_counter() - at)

    async def drive(n: int, into: list[float]) -> None:
        async with asyncio.TaskGroup() as tg:
            at = time.perf_counter()
            for _ in range(n):
                at += rng.expovariate(rate)
                if (delay := at - time.perf_counter()) > 0:
                    await asyncio.sleep(delay)
                tg.create_task(one(at, into))

    async def load() -> float:
        nonlocal measuring
        await drive(int(rate * warmup), start)
        measuring = True
        cpu = time.process_time()
        await drive(int(rate * seconds), latencies)
        return time.process_time() - cpu

    if batcher is not None:
        async with batcher:
            cpu = await load()
    else:
        cpu = await load()
    latencies.sort()
    start.sort()
    calls = sum(sizes.values())
    mean = sum(k * v for k, v in sizes.items()) / calls
    shares = "".join(
        f"{sum(v for k, v in sizes.items() if lo <= k <= hi) / calls:>7.0%}" for lo, hi in BINS
    )
    n = len(latencies)
    print(
        f"{rate:>9.0f}  {server:<11}{calls:>7}{mean:>7.2f}{shares}"
        f"{latencies[n // 2] * 1e3:>8.1f}{latencies[int(0.99 * n)] * 1e3:>8.1f}"
        f"{cpu / n * 1e6:>8.0f}{start[int(0.99 * len(start))] * 1e3 if start else math.nan:>11.1f}",
        flush=True,
    )


async def main(args: argparse.Namespace) -> None:
    model, features = build(args.model)
    bins = "".join(f"{f'{lo}-{hi}' if lo < hi else lo:>7}" for lo, hi in BINS)
    print(f"model {args.model}; batch sizes as shares of model calls")
    print(
        f"{'offered/s':>9}  {'server':<11}{'calls':>7}{'mean':>7}{bins}{'p50 ms':>8}{'p99 ms':>8}"
        f"{'cpu us':>8}{'start p99':>11}"
    )
    for rate in args.rates:
        for server in args.servers:
            await level(server, model, features, rate, args.seconds, args.warmup)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", choices=("gpu", "mlp"), default="gpu")
    parser.add_argument("--rates", type=float, nargs="+", default=[200, 500, 1000])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of load first")
    ray = importlib.util.find_spec("ray") is not None
    parser.add_argument(
        "--servers",
        nargs="+",
        choices=("batcher", "ray-thread", "ray-inline"),
        default=["batcher", "ray-thread", "ray-inline"] if ray else ["batcher"],
    )
    sys.exit(uvloop.run(main(parser.parse_args())))
