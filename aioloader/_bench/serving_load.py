"""The serving workload's load generator: open-loop Poisson arrivals at each offered rate, sent by a
minimal HTTP/1.1 client on asyncio protocols (:class:`Client`) to a server subprocess driven from
here (:class:`Remote`), and what each rate measured (:class:`Level`: latencies, batch sizes, the
share of the machine's CPU other processes used meanwhile, the server's CPU and memory).
``serving.py``'s docstring says how the load is made and what is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from aioloader._bench.harness_processes import MemorySampler, machine_ticks
from aioloader._bench.serving_server import FEATURES, MODES


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
