"""Remote-read benchmark: aioloader vs torch's DataLoader vs torchdata.nodes vs SPDL vs a thread
pool vs plain asyncio, fetching objects over HTTP from a local server with first-byte latency.

Workload: an aiohttp server on ``127.0.0.1`` (port 0, in a spawned subprocess, stopped at the end
of the run) serves ``--items`` (default 2,000) objects of 64 KiB at ``/obj/{i}``, each after
``--latency`` (default 20 ms) of ``await asyncio.sleep`` before the response. Every configuration
reads each object once, in batches of ``--batch-size`` (default 32, ``collate_fn=list``), and is
measured in the same run, one after another, so the ratios between them are what matter:

* ``aio-conn{16,64,256}``: ``aioloader.DataLoader`` over
  ``aioloader.sources.urls(urls, connections=N)``, ``max_inflight=N``, ``async for``.
* ``torch-nw{2,8}``: ``torch.utils.data.DataLoader`` over a map-style dataset whose
  ``__getitem__`` is a blocking ``urllib.request.urlopen(url).read()``, ``num_workers`` 2 and 8.
* ``tdnodes-thr{16,64}``: a ``torchdata.nodes`` graph, ``IterableWrapper(urls)`` ->
  ``ParallelMapper(map_fn=<the same blocking fetch>, num_workers=N, method="thread",
  in_order=True)`` (at most ``2 * N`` items in flight, its default) -> ``Batcher(batch_size,
  drop_last=False)``, iterated through a ``Loader``; wall time includes joining its threads.
* ``spdl-conc64``: an SPDL pipeline, ``PipelineBuilder().add_source(urls)`` ->
  ``.pipe(<aiohttp fetch>, concurrency=64)`` -> ``.aggregate(batch_size)`` -> ``.add_sink()`` ->
  ``.build(num_threads=1)`` (no stage is synchronous), iterated under ``auto_stop()``. SPDL runs
  async stages on its own event loop in a background thread, so the fetch stage's one
  ``aiohttp.ClientSession`` (connector limit 64) is opened and closed on that loop by a
  ``TaskHook.stage_hook`` (passed through ``build(task_hook_factory=...)`` beside SPDL's default
  ``TaskStatsHook``), when the stage starts and ends. SPDL drops a failed fetch (its default
  ``max_failures=-1``) and logs it; the exactly-once check then fails the configuration.
* ``threads32``: ``concurrent.futures.ThreadPoolExecutor(32).map`` of the same blocking fetch.
* ``asyncio-ceiling``: one ``aiohttp.ClientSession`` (connector limit 64),
  ``asyncio.Semaphore(64)``, ``asyncio.gather`` of every fetch, then grouped in batches.

torchdata and SPDL are the optional extra ``.[bench]``: where one is not installed, its row says so
and the rest still run. Both are imported before any configuration is timed (so neither pays its
import inside its wall time, and every configuration's RSS includes both modules).

Wall time covers one full epoch end to end, including starting and stopping the loader (worker
processes, threads, sessions). Peak RSS is the largest sum of resident memory over this process
and its descendants (the server's process excluded), sampled from ``/proc`` every 50 ms while the
configuration runs. Every configuration checks that each object arrives exactly once with the
right bytes, in the right number of batches; the script exits non-zero when one does not (or when
one raises or times out); a peer that is not installed is reported, not failed.

Run it from the repository root::

    python benchmarks/bench_remote.py            # the full run
    python benchmarks/bench_remote.py --quick    # a smoke test (400 items)
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import faulthandler
import gc
import importlib
import importlib.metadata
import importlib.util
import math
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import time
import urllib.request
import warnings
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass

import aiohttp
import torch
import torch.utils.data
from aiohttp import web

import aioloader
import aioloader.sources

QUICK_ITEMS = 400
OBJECT_SIZE = 64 * 1024
CEILING_CONCURRENCY = 64
THREADS = 32
JOIN_TIMEOUT_S = 10.0
SAMPLE_INTERVAL_S = 0.05
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")

# The optional peers (the ``.[bench]`` extra), by top-level package: the module their
# configurations import, and the distribution that installs it.
PEERS: dict[str, tuple[str, str]] = {
    "torchdata": ("torchdata.nodes", "torchdata"),
    "spdl": ("spdl.pipeline", "spdl-core"),
}
NOT_INSTALLED = "not installed (pip install -e '.[bench]')"


def payload(index: int) -> bytes:
    """The 64 KiB body of object ``index``: its index as 4 little-endian bytes, repeated."""
    return index.to_bytes(4, "little") * (OBJECT_SIZE // 4)


# -- the server (a spawned subprocess) ----------------------------------------------------------


def serve(items: int, latency: float, conn: multiprocessing.connection.Connection) -> None:
    """Serve ``/obj/{i}`` on 127.0.0.1 (port 0), send the port through ``conn``, and run until
    anything arrives on ``conn`` (or it closes)."""

    async def handle(request: web.Request) -> web.Response:
        index = int(request.match_info["index"])
        if not 0 <= index < items:
            raise web.HTTPNotFound()
        await asyncio.sleep(latency)
        return web.Response(body=payload(index), content_type="application/octet-stream")

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/obj/{index}", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        port: int = runner.addresses[0][1]
        conn.send(port)
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, _wait_for_stop, conn)
        finally:
            await runner.cleanup()

    asyncio.run(main())


def _wait_for_stop(conn: multiprocessing.connection.Connection) -> None:
    with contextlib.suppress(EOFError):
        conn.recv()


class Server:
    """The object server in a spawned subprocess; a context manager that stops it on exit."""

    def __init__(self, items: int, latency: float) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(
            target=serve, args=(items, latency, child), name="bench-remote-server", daemon=True
        )
        self.process.start()
        child.close()
        if not self._conn.poll(60):
            self.process.kill()
            raise RuntimeError("the server did not start within 60 s")
        self.port: int = self._conn.recv()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            self._conn.send(None)
        self._conn.close()
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


# -- peak RSS of the process tree ---------------------------------------------------------------


def _tree_rss(root: int, exclude: int | None) -> int:
    """Resident bytes of ``root`` and its descendants, leaving out ``exclude`` and its own."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces or parentheses.
        fields = stat[stat.rfind(b")") + 2 :].split()
        parents[int(entry)] = int(fields[1])
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    total = 0
    stack = [root]
    while stack:
        pid = stack.pop()
        if pid == exclude:
            continue
        try:
            with open(f"/proc/{pid}/statm", "rb") as f:
                total += int(f.read().split()[1]) * PAGE_SIZE
        except (OSError, IndexError, ValueError):
            pass
        stack.extend(children.get(pid, ()))
    return total


class PeakRSS:
    """Samples the process tree's RSS every 50 ms in a thread while the ``with`` block runs."""

    def __init__(self, exclude: int | None) -> None:
        self.exclude = exclude
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        root = os.getpid()
        while True:
            self.peak = max(self.peak, _tree_rss(root, self.exclude))
            if self._stop.wait(SAMPLE_INTERVAL_S):
                return

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# -- the datasets (module level, so torch's workers can import them) ---------------------------


def fetch_blocking(url: str) -> bytes:
    with urllib.request.urlopen(url) as response:
        data: bytes = response.read()
    return data


class BlockingUrlDataset(torch.utils.data.Dataset[bytes]):
    """Item ``i`` is the body of ``urls[i]``, read by a blocking ``urllib`` request."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = list(urls)

    def __len__(self) -> int:
        return len(self.urls)

    def __getitem__(self, index: int) -> bytes:
        return fetch_blocking(self.urls[index])


async def fetch_async(session: aiohttp.ClientSession, url: str) -> bytes:
    async with session.get(url) as response:
        response.raise_for_status()
        return await response.read()


def identity(batch: list[bytes]) -> list[bytes]:
    return batch


# -- settings, results, checks -------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    items: int
    batch_size: int
    latency: float
    timeout: float
    port: int

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.port}/obj/{i}" for i in range(self.items)]


@dataclass
class Result:
    name: str
    samples: int
    wall_s: float
    peak_rss: int = 0
    error: str | None = None
    skipped: str | None = None  # why it was not measured (its peer is not installed)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0


def check(batches: Sequence[Sequence[bytes]], settings: Settings) -> tuple[int, str | None]:
    """Return (samples delivered, None) or (samples, what is wrong): every object exactly once
    with the right bytes, the right number of batches."""
    indices: list[int] = []
    for batch in batches:
        if not isinstance(batch, list):
            return len(indices), f"a batch is a {type(batch).__name__}, not a list"
        for sample in batch:
            if not isinstance(sample, bytes) or len(sample) != OBJECT_SIZE:
                size = len(sample) if isinstance(sample, bytes | bytearray) else "?"
                return len(indices), f"a sample is {type(sample).__name__} of {size} bytes"
            index = int.from_bytes(sample[:4], "little")
            if sample != payload(index):
                return len(indices), f"object {index} has the wrong bytes"
            indices.append(index)
    if sorted(indices) != list(range(settings.items)):
        seen = set(indices)
        missing = settings.items - len(seen & set(range(settings.items)))
        duplicates = len(indices) - len(seen)
        return len(indices), (
            f"got {len(indices)} samples for {settings.items} items: "
            f"{missing} missing, {duplicates} duplicated"
        )
    expected_batches = math.ceil(settings.items / settings.batch_size)
    if len(batches) != expected_batches:
        return len(indices), f"got {len(batches)} batches, expected {expected_batches}"
    return len(indices), None


# -- the configurations --------------------------------------------------------------------------


async def _aio(settings: Settings, connections: int) -> list[list[bytes]]:
    dataset = aioloader.sources.urls(settings.urls, connections=connections)
    loader: aioloader.DataLoader[list[bytes]] = aioloader.DataLoader(
        dataset, batch_size=settings.batch_size, max_inflight=connections, collate_fn=list
    )
    batches: list[list[bytes]] = []
    async with asyncio.timeout(settings.timeout):
        async with loader:
            async for batch in loader:
                batches.append(batch)
    return batches


def run_aio(settings: Settings, connections: int) -> list[list[bytes]]:
    return asyncio.run(_aio(settings, connections))


def run_torch(settings: Settings, num_workers: int) -> list[list[bytes]]:
    loader = torch.utils.data.DataLoader(
        BlockingUrlDataset(settings.urls),
        batch_size=settings.batch_size,
        num_workers=num_workers,
        collate_fn=list,
        timeout=settings.timeout if num_workers > 0 else 0,
    )
    return list(loader)


def _join_threads_since(before: set[threading.Thread]) -> None:
    """Join every thread started since ``before`` was listed; raise if one outlives the wait."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    started = [t for t in threading.enumerate() if t not in before]
    for thread in started:
        thread.join(max(0.0, deadline - time.monotonic()))
    if alive := [t.name for t in started if t.is_alive()]:
        raise RuntimeError(f"threads still running after {JOIN_TIMEOUT_S:g} s: {alive}")


def run_torchdata(settings: Settings, threads: int) -> list[list[bytes]]:
    import torchdata.nodes as tn  # type: ignore[import-untyped]

    before = set(threading.enumerate())
    torch_threads = torch.get_num_threads()  # each mapper thread sets it to 1, process-wide
    mapper = tn.ParallelMapper(
        tn.IterableWrapper(settings.urls),
        map_fn=fetch_blocking,
        num_workers=threads,
        method="thread",
        in_order=True,
    )
    loader = tn.Loader(tn.Batcher(mapper, batch_size=settings.batch_size, drop_last=False))
    failure: str | None = None
    try:
        batches = list(loader)
    except Exception as exc:  # raised again below, once its traceback no longer holds the mapper
        failure = f"{type(exc).__qualname__}: {exc}"
    if failure is not None:
        # The mapper stops its threads itself at the end of its input; otherwise its finalizer
        # does, once the reference cycle between the Loader and its iterator is collected.
        del loader, mapper
        gc.collect()
    _join_threads_since(before)
    torch.set_num_threads(torch_threads)
    if failure is not None:
        raise RuntimeError(failure)
    return batches


def run_spdl(settings: Settings, concurrency: int) -> list[list[bytes]]:
    from spdl.pipeline import PipelineBuilder, StageInfo, TaskHook, TaskStatsHook

    class SessionHook(TaskHook):
        """The fetch stage's one aiohttp session, opened when the stage starts and closed when
        it ends, on the event loop that SPDL runs (in a background thread) for async stages."""

        session: aiohttp.ClientSession

        @contextlib.asynccontextmanager
        async def stage_hook(self) -> AsyncIterator[None]:
            connector = aiohttp.TCPConnector(limit=concurrency)
            async with aiohttp.ClientSession(connector=connector) as self.session:
                yield

        @contextlib.asynccontextmanager
        async def task_hook(self, input_item: object = None) -> AsyncIterator[None]:
            yield

    session = SessionHook()

    async def fetch(url: str) -> bytes:
        return await fetch_async(session.session, url)

    def hooks(info: StageInfo) -> list[TaskHook]:
        # SPDL's default hook (TaskStatsHook) on every stage, and the session on the fetch's.
        return [TaskStatsHook(info), *([session] if info.stage_name == "fetch" else [])]

    pipeline = (
        PipelineBuilder[str, list[bytes]]()
        .add_source(settings.urls)
        .pipe(fetch, concurrency=concurrency, name="fetch")
        .aggregate(settings.batch_size)
        .add_sink()
        .build(num_threads=1, task_hook_factory=hooks)
    )
    with pipeline.auto_stop(timeout=settings.timeout):
        batches: list[list[bytes]] = list(pipeline.get_iterator(timeout=settings.timeout))
    return batches


def run_threads(settings: Settings) -> list[list[bytes]]:
    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        samples = list(pool.map(fetch_blocking, settings.urls, timeout=settings.timeout))
    size = settings.batch_size
    return [samples[i : i + size] for i in range(0, len(samples), size)]


async def _ceiling(settings: Settings) -> list[list[bytes]]:
    semaphore = asyncio.Semaphore(CEILING_CONCURRENCY)
    connector = aiohttp.TCPConnector(limit=CEILING_CONCURRENCY)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def fetch(url: str) -> bytes:
            async with semaphore:
                return await fetch_async(session, url)

        async with asyncio.timeout(settings.timeout):
            samples = await asyncio.gather(*(fetch(url) for url in settings.urls))
    size = settings.batch_size
    return [samples[i : i + size] for i in range(0, len(samples), size)]


def run_ceiling(settings: Settings) -> list[list[bytes]]:
    return asyncio.run(_ceiling(settings))


Runner = Callable[[Settings], list[list[bytes]]]

CONFIGS: dict[str, Runner] = {
    "aio-conn16": lambda s: run_aio(s, 16),
    "aio-conn64": lambda s: run_aio(s, 64),
    "aio-conn256": lambda s: run_aio(s, 256),
    "torch-nw2": lambda s: run_torch(s, 2),
    "torch-nw8": lambda s: run_torch(s, 8),
    "tdnodes-thr16": lambda s: run_torchdata(s, 16),
    "tdnodes-thr64": lambda s: run_torchdata(s, 64),
    "spdl-conc64": lambda s: run_spdl(s, CEILING_CONCURRENCY),
    "threads32": run_threads,
    "asyncio-ceiling": run_ceiling,
}
BASELINES = ("asyncio-ceiling", "torch-nw8")
# The configurations that need an optional peer: the peer's key in PEERS.
PEER_OF = {"tdnodes-thr16": "torchdata", "tdnodes-thr64": "torchdata", "spdl-conc64": "spdl"}


def measure(name: str, settings: Settings, server_pid: int | None) -> Result:
    """Run one configuration, timed and RSS-sampled, under a watchdog that dumps every thread's
    stack and exits the process if it hangs well past ``settings.timeout``."""
    faulthandler.dump_traceback_later(settings.timeout + 30, exit=True)
    sampler = PeakRSS(exclude=server_pid)
    start = time.perf_counter()
    try:
        with sampler:
            batches = CONFIGS[name](settings)
    except Exception as exc:  # report it, go on with the other configurations
        wall = time.perf_counter() - start
        return Result(name, 0, wall, sampler.peak, error=f"{type(exc).__qualname__}: {exc}")
    finally:
        faulthandler.cancel_dump_traceback_later()
    wall = time.perf_counter() - start
    samples, error = check(batches, settings)
    return Result(name, samples, wall, sampler.peak, error=error)


def _ratio(result: Result, baseline: Result | None) -> str:
    if baseline is None or not baseline.ok or baseline.samples_per_s == 0 or not result.ok:
        return "-"
    if baseline.skipped or result.skipped:
        return "-"
    return f"{result.samples_per_s / baseline.samples_per_s:.2f}x"


def format_table(results: Iterable[Result]) -> str:
    results = list(results)
    by_name = {r.name: r for r in results}
    header = (
        f"{'config':<18}{'samples/s':>11}{'wall s':>9}{'peak RSS MiB':>14}"
        f"{'vs ceiling':>12}{'vs nw8':>9}  check"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        if r.skipped:
            lines.append(f"{r.name:<18}{'-':>11}{'-':>9}{'-':>14}{'-':>12}{'-':>9}  {r.skipped}")
            continue
        lines.append(
            f"{r.name:<18}{r.samples_per_s:>11,.0f}{r.wall_s:>9.2f}{r.peak_rss / 2**20:>14,.0f}"
            + "".join(
                f"{_ratio(r, by_name.get(b)):>{w}}" for b, w in zip(BASELINES, (12, 9), strict=True)
            )
            + f"  {'ok' if r.ok else 'FAIL: ' + str(r.error)}"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="aioloader vs torch DataLoader vs threads vs asyncio, reading over HTTP."
    )
    parser.add_argument("--items", type=int, default=None, help="objects (default 2000)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per batch")
    parser.add_argument(
        "--latency", type=float, default=0.02, help="server's seconds before each response"
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"smoke test: {QUICK_ITEMS} items (unless --items)"
    )
    parser.add_argument(
        "--only", nargs="+", choices=list(CONFIGS), metavar="NAME", help="configurations to run"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds one configuration may take (default: max(120, 3 * items * latency))",
    )
    args = parser.parse_args(argv)
    if args.items is None:
        args.items = QUICK_ITEMS if args.quick else 2000
    if args.items <= 0 or args.batch_size <= 0 or args.latency < 0:
        parser.error("--items and --batch-size must be positive, --latency non-negative")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # torch warns that 8 workers exceed this machine's cores: measuring that is the point.
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    timeout = args.timeout or max(120.0, 3 * args.items * args.latency)
    installed = {peer: importlib.util.find_spec(peer) is not None for peer in PEERS}
    versions = ""
    for peer, (module, distribution) in PEERS.items():
        if installed[peer]:
            # Imported here, not inside a timed configuration. One that fails to import fails
            # its configurations.
            with contextlib.suppress(ImportError):
                importlib.import_module(module)
            versions += f", {peer} {importlib.metadata.version(distribution)}"
    print(
        f"aioloader {aioloader.__version__}, torch {torch.__version__}{versions}, aiohttp "
        f"{aiohttp.__version__}, python {sys.version.split()[0]}: {args.items} objects x "
        f"{OBJECT_SIZE // 1024} KiB, {args.latency * 1e3:g} ms first-byte latency, "
        f"batch {args.batch_size}",
        flush=True,
    )
    results: list[Result] = []
    with Server(args.items, args.latency) as server:
        settings = Settings(args.items, args.batch_size, args.latency, timeout, server.port)
        print(f"server on 127.0.0.1:{server.port} (pid {server.process.pid})", flush=True)
        names: list[str] = args.only or list(CONFIGS)
        for name in names:
            needs = PEER_OF.get(name)
            if needs is not None and not installed[needs]:
                if all(r.name != needs for r in results):  # one row for the peer
                    results.append(Result(needs, 0, 0.0, skipped=NOT_INSTALLED))
                    print(f"  skip {needs:<18} {NOT_INSTALLED}", flush=True)
                continue
            result = measure(name, settings, server.process.pid)
            results.append(result)
            status = "ok" if result.ok else f"FAIL: {result.error}"
            print(
                f"  done {name:<18} {result.samples_per_s:>10,.0f} samples/s "
                f"{result.wall_s:>7.2f} s  {result.peak_rss / 2**20:>6,.0f} MiB  {status}",
                flush=True,
            )
    print()
    print(format_table(results))
    failed = [r.name for r in results if not r.ok]
    if failed:
        print(f"\nFAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
