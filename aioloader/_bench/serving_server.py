"""The serving workload's server, a subprocess of its own (``serving.py``'s ``--serve MODE``):
the model, its batch times measured at start-up, and one of the ways to run it for concurrent
requests (``MODES``: the batcher, one call a request, a naive batcher, Ray Serve's
``@serve.batch`` where Ray is installed) behind an aiohttp app answering ``POST /predict`` (and
``POST /idle``: its counters once no handler runs). ``serving.py``'s docstring says what each
is and why.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from aiohttp import web

from aioloader import DynamicBatcher
from aioloader._bench.serving_ray import ray_batched

FEATURES = 512
MAX_BATCH, MAX_DELAY = 32, 0.005
GPU_FIXED_S, GPU_PER_ROW_S = 0.004, 0.0001
SWITCH_INTERVAL_S = 0.0005
MODES = {
    "batcher": "(a) batcher",
    "serial": "(b) per-request",
    "naive": "(c) naive batch",
    "ray": "(d) ray batch",  # where Ray Serve imports (``serving_ray.available``)
}


def build_model(kind: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model a server runs (see ``serving.py``'s docstring): ``gpu`` or ``cpu``."""
    torch.set_num_threads(1)
    if kind == "gpu":

        def accelerator(batch: torch.Tensor) -> torch.Tensor:
            out = torch.tanh(batch)  # stands for what the device computes
            time.sleep(GPU_FIXED_S + GPU_PER_ROW_S * batch.shape[0])  # the device's time
            return out

        return accelerator
    torch.manual_seed(0)
    dims = (FEATURES, 2048, 2048, FEATURES)
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(dims):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    mlp = torch.nn.Sequential(*layers[:-1]).eval()

    def run(batch: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            out: torch.Tensor = mlp(batch)
        return out

    return run


def batch_times(model: Callable[[torch.Tensor], torch.Tensor]) -> dict[int, float]:
    """Median seconds per model call for 1, 8 and 32 rows."""
    times = {}
    for rows in (1, 8, 32):
        x = torch.randn(rows, FEATURES)
        samples = []
        for _ in range(15):
            t = time.perf_counter()
            model(x)
            samples.append(time.perf_counter() - t)
        times[rows] = statistics.median(samples[3:])
    return times


class Server:
    """One of the three ways to run the model for concurrent requests, plus its counters."""

    def __init__(self, mode: str, model: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.mode = mode
        self.model = model
        self.sizes: Counter[int] = Counter()  # batches by size
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="model")
        self.lock = asyncio.Lock()
        self.pending: list[tuple[torch.Tensor, asyncio.Future[torch.Tensor]]] = []
        self.batcher = DynamicBatcher(
            model, max_batch_size=MAX_BATCH, max_delay=MAX_DELAY, max_queue=1024
        )
        self.ray: Callable[[torch.Tensor], Awaitable[torch.Tensor]] | None = None
        if mode == "ray":
            self.ray = ray_batched(
                model, self.thread, max_batch_size=MAX_BATCH, max_delay=MAX_DELAY, sizes=self.sizes
            )

    def counters(self) -> dict[int, int]:
        """Batches so far, by size."""
        if self.mode == "batcher":
            return dict(self.batcher.statistics().batch_sizes)
        return dict(self.sizes)

    async def predict(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "batcher":
            out: torch.Tensor = await self.batcher.submit(x)
            return out
        if self.ray is not None:
            return await self.ray(x)
        loop = asyncio.get_running_loop()
        if self.mode == "serial":
            async with self.lock:
                self.sizes[1] += 1
                return (await loop.run_in_executor(self.thread, self.model, x[None]))[0]
        future: asyncio.Future[torch.Tensor] = loop.create_future()
        self.pending.append((x, future))
        return await future

    async def naive_loop(self) -> None:
        """Sleep, take everything, run it: the batcher a first attempt usually is."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(MAX_DELAY)
            taken, self.pending = self.pending, []
            taken = [(x, f) for x, f in taken if not f.done()]
            if not taken:
                continue
            self.sizes[len(taken)] += 1
            out = await loop.run_in_executor(
                self.thread, self.model, torch.stack([x for x, _ in taken])
            )
            for (_, future), row in zip(taken, out, strict=True):
                if not future.done():
                    future.set_result(row)


async def serve(mode: str, model_kind: str) -> None:
    # The model's thread needs the GIL back after each call while the loop thread is busy
    # with HTTP: at the default 5 ms switch interval every hand-off can cost 5 ms.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    model = build_model(model_kind)
    times = batch_times(model)
    server = Server(mode, model)
    running = 0
    idle = asyncio.Event()
    idle.set()

    handled: list[float] = []  # seconds from handler start to answer, since the last /idle

    async def predict(request: web.Request) -> web.Response:
        nonlocal running
        running += 1
        idle.clear()
        started = time.perf_counter()
        try:
            x = torch.frombuffer(bytearray(await request.read()), dtype=torch.float32)
            y = await server.predict(x)
            handled.append(time.perf_counter() - started)
            return web.Response(body=y.numpy().tobytes())
        except Exception as exc:  # Overloaded -> 503; anything else is a bug worth seeing
            status = 503 if type(exc).__name__ == "Overloaded" else 500
            return web.Response(status=status, text=f"{type(exc).__name__}: {exc}")
        finally:
            running -= 1
            if running == 0:
                idle.set()

    async def wait_idle(request: web.Request) -> web.Response:
        await idle.wait()
        sizes = server.counters()
        ordered = sorted(handled)
        handled.clear()
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else math.nan
        return web.json_response({"sizes": sizes, "p99": p99})

    app = web.Application(client_max_size=1 << 20)
    app.add_routes([web.post("/predict", predict), web.post("/idle", wait_idle)])
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with server.batcher:
        naive = asyncio.create_task(server.naive_loop()) if mode == "naive" else None
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            line = {"port": runner.addresses[0][1], "times": times}
            print(json.dumps(line), flush=True)
            await stop.wait()
        finally:
            await runner.cleanup()
            if naive is not None:
                naive.cancel()
                await asyncio.gather(naive, return_exceptions=True)
    server.thread.shutdown(wait=True)
    if mode == "batcher":
        print(f"(a)'s statistics over every rate: {server.batcher.statistics()}", file=sys.stderr)
