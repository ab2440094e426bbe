"""Serving benchmark: aioloader's DynamicBatcher behind an HTTP server, against one model call per
request and a naive batcher, under open-loop load.

The server (an aiohttp app on 127.0.0.1, port 0, uvloop, in a subprocess so the load generator
does not share its event loop or GIL) answers ``POST /predict``: a body of 512 float32 values
(2 KiB) in, the model's 512 float32 outputs for it out. Three servers, one after another:

* ``(a) batcher``: ``DynamicBatcher(model, max_batch_size=32, max_delay=0.005, max_queue=1024)``;
  the model runs in the batcher's thread, one batch at a time.
* ``(b) per-request``: one model call per request on a batch of one, serialized on one thread
  (what a naive server with one model instance does).
* ``(c) naive batch``: a loop that sleeps ``max_delay`` (5 ms), then runs the model once on
  everything that arrived meanwhile (no size bound, no deadline), on one thread.
* ``(d) ray batch``, where Ray is installed: Ray Serve's ``@serve.batch`` with the same
  ``max_batch_size`` and ``max_delay`` as its ``batch_wait_timeout_s``, the model on one
  thread (``_bench/serving_ray.py``). ``--modes`` picks servers.

The model (``--model``):

* ``gpu`` (default) simulates an accelerator: a call sleeps 4 ms + 0.1 ms per row in the model's
  thread — a GPU's fixed launch/transfer/sync cost plus a small per-row cost, during which the
  host CPU is free — and returns ``tanh(batch)`` (a few microseconds on the host, standing for
  what the device computes). Batch time: about 4.1 ms for 1 row, 7.2 ms for 32. (Running even
  a small torch MLP on the host here costs sporadic multi-millisecond CPU spikes on this VM
  that swamp every server's tail latency alike.)
* ``cpu``: a real torch MLP 512→2048→2048→512 on the CPU (one intra-op thread). Its weights are
  read on every call, so batch time is sub-linear (here about 3 ms for 1 row, 12 ms for 32), but
  it burns a core that the HTTP stack needs on a 2-core machine, so the comparison then mostly
  measures CPU contention.

The server measures its model's batch time for 1, 8 and 32 rows at start-up. All three servers
set ``sys.setswitchinterval(0.0005)``: the model's thread needs the GIL back after each call
while the loop thread is busy with HTTP, and at the default 5 ms every hand-off may cost 5 ms.

Load: for each offered rate (requests/s), a seeded Poisson arrival process issues
``rate x window`` requests (open loop: each is sent at its arrival time whether or not earlier
ones are answered) over up to 512 keep-alive connections; a request gives up after
``--request-timeout`` seconds (closing its connection, which cancels its server handler).
The client is a minimal HTTP/1.1 client on asyncio protocols: aiohttp's client costs about
0.6 ms of CPU per request on this VM, CPU the server under test would lose. Latency runs from
the scheduled arrival to the answer, so client-side queueing counts. Between rates the client
waits until the server has no handler running.

Columns: ``done/s`` (successful answers per second, from the first arrival to the last request's
end), ``x(b)`` (that over the per-request server's at the same rate), ``p50``/``p99`` ms (over
every request; a failed one counts as infinitely slow, shown ``>timeout``), ``srv p99`` (p99 of
the time inside the server's handler, for the answered requests: the part HTTP, the client and
the machine's scheduling don't add), ``fail`` (timed out,
or 503 from the batcher's admission control), ``batch`` (mean model batch size), ``other CPU``
(share of the machine's CPU used meanwhile by processes outside this benchmark: rows with a high
figure were slowed by them).

The goal checked at the end: at each rate where (b) saturates (answers < 90% of offered), (a)
serves what is offered (>= 95%: several times (b) once the rate is) with p99 <= max_delay +
the model's 32-row batch time + 5 ms.

Run:
    python benchmarks/bench_serving.py            # 4 rates x 3 s each, about a minute
    python benchmarks/bench_serving.py --quick    # a smoke test: 2 rates, short windows
    python benchmarks/bench_serving.py --model cpu --rates 100 400 800
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import uvloop
from aiohttp import web

from aioloader import DynamicBatcher
from aioloader._bench.harness import (
    MemorySampler,
    Result,
    add_quick,
    machine_ticks,
    quick_defaults,
    report,
)
from aioloader._bench.serving_ray import available, ray_batched

FEATURES = 512
MAX_BATCH, MAX_DELAY = 32, 0.005
GPU_FIXED_S, GPU_PER_ROW_S = 0.004, 0.0001
SWITCH_INTERVAL_S = 0.0005
MODES = {"batcher": "(a) batcher", "serial": "(b) per-request", "naive": "(c) naive batch"}
if available():
    MODES["ray"] = "(d) ray batch"


# --------------------------------------------------------------------------------------------
# server (subprocess)
# --------------------------------------------------------------------------------------------


def build_model(kind: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model a server runs (see the module docstring): ``gpu`` or ``cpu``."""
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


# --------------------------------------------------------------------------------------------
# load generator
# --------------------------------------------------------------------------------------------


def _jiffies(pid: int | str) -> int:
    """CPU time (user + system, in clock ticks) of a process, children it waited for included."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()  # noqa: SIM115
    return sum(int(f) for f in fields[11:15])


class CpuShare:
    """The share of the machine's CPU that processes other than ours used meanwhile."""

    def __init__(self, server_pid: int) -> None:
        self.pids: tuple[int | str, ...] = ("self", server_pid)
        self.start = (sum(_jiffies(p) for p in self.pids), *machine_ticks())

    def other(self) -> float:
        ours0, busy0, total0 = self.start
        ours = sum(_jiffies(p) for p in self.pids) - ours0
        busy, total = machine_ticks()
        return max(0.0, (busy - busy0 - ours) / max(1, total - total0))


@dataclass
class Level:
    mode: str
    rate: float
    sent: int
    ok: int
    failed: int
    span_s: float
    latencies: list[float]  # successful ones, seconds
    sizes: dict[int, int]  # the model's batches over the level, by size
    other_cpu: float
    server_p99: float  # inside the server's handler: no HTTP, no client
    server_cpu_s: float | None = None  # the server process's, over the level
    server_pss_mib: float | None = None  # its peak

    @property
    def done_per_s(self) -> float:
        return self.ok / self.span_s if self.span_s > 0 else 0.0

    def percentile(self, q: float) -> float:
        """Over every request; failures count as infinitely slow."""
        ordered = sorted(self.latencies) + [math.inf] * self.failed
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else math.nan

    @property
    def batches(self) -> int:
        return sum(self.sizes.values())

    @property
    def mean_batch(self) -> float:
        rows = sum(size * n for size, n in self.sizes.items())
        return rows / self.batches if self.batches else 0.0

    def size_shares(self) -> list[float]:
        """The share of batches in each of ``SIZE_BINS``."""
        total = self.batches or 1
        return [
            sum(n for size, n in self.sizes.items() if lo <= size <= hi) / total
            for lo, hi in SIZE_BINS
        ]


SIZE_BINS = ((1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 32))


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection, one request at a time, answers parsed by hand."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.head_end = self.end = -1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's: not a subclass

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.end < 0:
            i = self.buffer.find(b"\r\n\r\n")
            if i < 0:
                return
            head = bytes(self.buffer[:i]).lower()
            j = head.index(b"content-length:") + len(b"content-length:")
            k = head.find(b"\r\n", j)
            self.status = int(head[9:12])
            self.head_end, self.end = i + 4, i + 4 + int(head[j : k if k >= 0 else None])
        if len(self.buffer) >= self.end:
            body = bytes(self.buffer[self.head_end : self.end])
            del self.buffer[: self.end]
            self.end = -1
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_result((self.status, body))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection lost"))

    async def post(self, request: bytes) -> tuple[int, bytes]:
        if self.transport is None:
            raise ConnectionError("post() before the connection was made")
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return await self.waiter


class Client:
    """A pool of keep-alive connections to the server: an idle one per request, or a new one
    (up to ``limit`` at once). A request that times out closes its connection, which cancels
    its handler on the server. Built on asyncio protocols because aiohttp's client costs about
    0.6 ms of CPU per request on this 2-core VM (this one about 0.15 ms): CPU the server under
    test would lose."""

    def __init__(self, port: int, limit: int = 512) -> None:
        self.port = port
        self.idle: list[_Connection] = []
        self.slots = asyncio.Semaphore(limit)

    async def post(self, path: str, body: bytes, deadline_s: float) -> tuple[int, bytes]:
        request = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        loop = asyncio.get_running_loop()
        conn: _Connection | None = None
        try:
            async with asyncio.timeout(deadline_s), self.slots:
                conn = self.idle.pop() if self.idle else None
                if conn is None:
                    _, conn = await loop.create_connection(_Connection, "127.0.0.1", self.port)
                answer = await conn.post(request)
        except BaseException:
            if conn is not None and conn.transport is not None:
                conn.transport.close()
            raise
        self.idle.append(conn)
        return answer

    def close(self) -> None:
        for conn in self.idle:
            if conn.transport is not None:
                conn.transport.close()
        self.idle.clear()


async def drive(
    client: Client, rate: float, n: int, request_timeout: float, seed: int
) -> tuple[int, int, float, list[float]]:
    """Send ``n`` requests at Poisson arrivals of ``rate``/s; return (ok, failed, span, lats)."""
    rng = random.Random(seed)
    bodies = [torch.randn(FEATURES, generator=torch.Generator().manual_seed(i)) for i in range(32)]
    payloads = [b.numpy().tobytes() for b in bodies]
    latencies: list[float] = []
    failed = 0

    async def one(at: float, body: bytes) -> None:
        nonlocal failed
        try:
            status, answer = await client.post("/predict", body, request_timeout)
        except (TimeoutError, OSError):
            failed += 1
            return
        if status != 200 or len(answer) != FEATURES * 4:
            failed += 1
        else:
            latencies.append(time.perf_counter() - at)

    start = time.perf_counter()
    at = start
    async with asyncio.TaskGroup() as tg:
        for i in range(n):
            at += rng.expovariate(rate)
            delay = at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tg.create_task(one(at, payloads[i % len(payloads)]))
    return len(latencies), failed, time.perf_counter() - start, latencies


class Remote:
    """A server subprocess and a client for it."""

    def __init__(self, mode: str, proc: asyncio.subprocess.Process, hello: dict[str, Any]) -> None:
        self.mode = mode
        self.proc = proc
        self.client = Client(hello["port"])
        self.times = {int(k): v for k, v in hello["times"].items()}

    @classmethod
    async def start(cls, mode: str, model: str) -> Remote:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "aioloader._bench.serving", "--serve", mode, "--model", model,
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            if proc.stdout is None:
                raise RuntimeError("the server process has no stdout pipe")
            hello = json.loads(await asyncio.wait_for(proc.stdout.readline(), 120))
        except BaseException:
            proc.kill()
            await proc.wait()
            raise
        return cls(mode, proc, hello)

    async def counters(self) -> tuple[Counter[int], float]:
        """The model's batches so far by size, once no handler runs, and the p99 of the
        handlers' times since the last call."""
        _, body = await self.client.post("/idle", b"", 60)
        c = json.loads(body)
        return Counter({int(k): v for k, v in c["sizes"].items()}), c["p99"]

    async def level(self, rate: float, args: argparse.Namespace) -> Level:
        sizes0, _ = await self.counters()
        n = max(20, round(rate * args.window))
        cpu = CpuShare(self.proc.pid)
        pid = self.proc.pid
        with MemorySampler(lambda: [pid]) as server:  # its CPU and memory, from here
            ok, failed, span, lats = await drive(
                self.client, rate, n, args.request_timeout, seed=int(rate)
            )
        other = cpu.other()
        sizes1, p99 = await self.counters()
        print(f"  {MODES[self.mode]:<16} {rate:>6.0f}/s: {ok}/{n} ok", flush=True)
        return Level(
            self.mode, rate, n, ok, failed, span, lats, dict(sizes1 - sizes0), other, p99,
            server.cpu_s, server.peak_pss_mib,
        )  # fmt: skip

    async def stop(self) -> None:
        self.client.close()
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(self.proc.wait(), 30)


async def measure(args: argparse.Namespace) -> tuple[dict[str, list[Level]], dict[int, float]]:
    """Start the servers, then measure each rate on each in turn (so a burst of CPU use by
    other processes is spread over the servers rather than spoiling one)."""
    remotes: list[Remote] = []
    try:
        for mode in args.modes:
            remotes.append(await Remote.start(mode, args.model))
        for remote in remotes:
            await drive(remote.client, 50, 25, args.request_timeout, seed=99)  # warm up
        results: dict[str, list[Level]] = {mode: [] for mode in args.modes}
        for rate in args.rates:
            for remote in remotes:
                results[remote.mode].append(await remote.level(rate, args))
    finally:
        for remote in remotes:
            await remote.stop()
    return results, remotes[0].times


def ms(seconds: float, timeout: float) -> str:
    return f">{timeout * 1e3:.0f}" if math.isinf(seconds) else f"{seconds * 1e3:.1f}"


def summarize(results: dict[str, list[Level]], times: dict[int, float], args: Any) -> bool:
    t = args.request_timeout
    print(
        f"\nmodel {args.model}: batch time 1 row {times[1] * 1e3:.2f} ms, 8 rows "
        f"{times[8] * 1e3:.2f} ms, 32 rows {times[32] * 1e3:.2f} ms; max_delay "
        f"{MAX_DELAY * 1e3:.0f} ms, max_batch_size {MAX_BATCH}\n"
    )
    head = f"{'offered/s':>9}  {'server':<16}{'done/s':>8}{'x(b)':>7}{'p50 ms':>9}{'p99 ms':>9}"
    print(head + f"{'srv p99':>9}{'fail':>6}{'batch':>7}{'other CPU':>11}")
    for i, rate in enumerate(args.rates):
        base = results["serial"][i].done_per_s if "serial" in results else 0.0
        for mode in results:
            lv = results[mode][i]
            relative = f"{lv.done_per_s / base:.2f}" if base else "-"
            print(
                f"{rate:>9.0f}  {MODES[mode]:<16}{lv.done_per_s:>8.0f}{relative:>7}"
                f"{ms(lv.percentile(0.5), t):>9}{ms(lv.percentile(0.99), t):>9}"
                f"{ms(lv.server_p99, t):>9}{lv.failed:>6}{lv.mean_batch:>7.1f}{lv.other_cpu:>11.0%}"
            )
    bins = "".join(f"{f'{lo}-{hi}' if lo < hi else lo:>7}" for lo, hi in SIZE_BINS)
    print(
        f"\nbatch sizes (share of model calls):\n{'offered/s':>9}  {'server':<16}{'calls':>7}{bins}"
    )
    for i, rate in enumerate(args.rates):
        for mode in results:
            lv = results[mode][i]
            shares = "".join(f"{share:>7.0%}" for share in lv.size_shares())
            print(f"{rate:>9.0f}  {MODES[mode]:<16}{lv.batches:>7}{shares}")
    bound = MAX_DELAY + times[32] + 0.005
    verdicts = []
    for i, rate in enumerate(args.rates if {"serial", "batcher"} <= results.keys() else ()):
        b, a = results["serial"][i], results["batcher"][i]
        if b.done_per_s >= 0.9 * rate:
            continue
        ratio = a.done_per_s / b.done_per_s if b.done_per_s else math.inf
        p99 = a.percentile(0.99)
        sustained = a.ok >= 0.95 * a.sent
        good = sustained and p99 <= bound
        verdicts.append(good)
        print(
            f"goal at {rate:.0f}/s ((b) saturated at {b.done_per_s:.0f}/s): (a) served"
            f" {a.ok / a.sent:.0%} of it, {ratio:.1f}x (b); p99 {ms(p99, t)} ms (want <="
            f" {bound * 1e3:.1f} = max_delay + 32-row batch + 5 ms): "
            + ("holds" if good else "DOES NOT HOLD")
        )
    if not verdicts:
        print("goal: (b) saturated at no offered rate; raise --rates")
    return all(verdicts)


async def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    print("starting the three servers", flush=True)
    results, times = await measure(args)
    summarize(results, times, args)
    for mode, levels in results.items():
        for level in levels:
            error = f"{level.failed} of {level.sent} requests failed" if level.failed else None
            row = Result(f"{mode}@{level.rate:g}", level.ok, level.span_s, error=error)
            row.cpu_s, row.peak_pss_mib = level.server_cpu_s, level.server_pss_mib or 0.0
            # (b) and (c) are baselines: at a rate past what they serve, they fail requests.
            if mode != "batcher":
                row.error = None
            report("serving", row, offered=level.rate, p99_ms=level.percentile(0.99) * 1e3)
    print(f"\n(total {time.perf_counter() - started:.0f} s)")
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_quick(parser, "smoke test: 2 rates, 0.5 s each")
    parser.add_argument("--model", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--rates", type=float, nargs="+", help="offered loads, requests/s")
    parser.add_argument("--window", type=float, help="seconds of arrivals per rate")
    parser.add_argument("--request-timeout", type=float, default=3.0)
    parser.add_argument("--serve", choices=tuple(MODES), help=argparse.SUPPRESS)
    parser.add_argument(
        "--modes", nargs="+", choices=tuple(MODES), default=list(MODES), help="servers to run"
    )
    args = parser.parse_args(argv)
    quick_defaults(args, rates=([150, 600], [100, 300, 600, 900]), window=(0.5, 3.0))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    if options.serve:
        uvloop.run(serve(options.serve, options.model))
        return 0
    return uvloop.run(run(options))


if __name__ == "__main__":
    sys.exit(main())
