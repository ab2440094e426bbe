"""Remote-read benchmark: aioloader vs torch's DataLoader vs torchdata.nodes vs SPDL vs a thread
pool vs plain asyncio, fetching small objects over HTTP or S3 from a local server with
first-byte latency.

Workload: ``--items`` (default 2,000) objects of 64 KiB, each served after ``--latency``
(default 20 ms), by a server on ``127.0.0.1`` (port 0, in a subprocess, stopped at the
end of the run):

* ``--store http`` (default): an aiohttp server, ``GET /obj/{i}``, the latency an
  ``await asyncio.sleep`` before the response.
* ``--store s3``: moto's S3 server (threaded werkzeug), the objects ``obj/{i}`` in one bucket,
  the latency a sleep before each GET in the request's thread. The blocking peers read with
  boto3's ``get_object`` (a client a process), the async ones with obstore's ``get_async``,
  aioloader with ``aioloader.sources.objects("s3://bucket/obj/")`` (one listing, then a GET an
  object).

Every configuration reads each object once, in batches of ``--batch-size`` (default 32,
``collate_fn=list``), and is measured in the same run, one after another, so the ratios between
them are what matter:

* ``aio-conn{16,64,256}``: ``aioloader.DataLoader`` over
  ``aioloader.sources.urls(urls, connections=N)`` (or ``objects(...)``), ``max_inflight=N``,
  ``async for``.
* ``torch-nw{2,8}``: ``torch.utils.data.DataLoader`` over a map-style dataset whose
  ``__getitem__`` is a blocking ``urllib.request.urlopen(url).read()`` (or boto3 get),
  ``num_workers`` 2 and 8.
* ``aio-swapped-nw8``: the same code as ``torch-nw8`` with the import swapped
  (``aioloader.DataLoader``), nothing else changed.
* ``tdnodes-thr{16,64}``: a ``torchdata.nodes`` graph, ``IterableWrapper(urls)`` ->
  ``ParallelMapper(map_fn=<the same blocking fetch>, num_workers=N, method="thread",
  in_order=True)`` (at most ``2 * N`` items in flight, its default) -> ``Batcher(batch_size,
  drop_last=False)``, iterated through a ``Loader``; wall time includes joining its threads.
* ``spdl-conc64``: an SPDL pipeline, ``PipelineBuilder().add_source(urls)`` ->
  ``.pipe(<async fetch>, concurrency=64)`` -> ``.aggregate(batch_size)`` -> ``.add_sink()`` ->
  ``.build(num_threads=1)`` (no stage is synchronous), iterated under ``auto_stop()``. SPDL runs
  async stages on its own event loop in a background thread, so the fetch stage's one
  ``aiohttp.ClientSession`` (connector limit 64) is opened and closed on that loop by a
  ``TaskHook.stage_hook`` (passed through ``build(task_hook_factory=...)`` beside SPDL's default
  ``TaskStatsHook``), when the stage starts and ends. SPDL drops a failed fetch (its default
  ``max_failures=-1``) and logs it; the exactly-once check then fails the configuration.
* ``threads32``: ``concurrent.futures.ThreadPoolExecutor(32).map`` of the same blocking fetch.
* ``asyncio-ceiling``: one ``aiohttp.ClientSession`` (connector limit 64) or one obstore store,
  ``asyncio.Semaphore(64)``, ``asyncio.gather`` of every fetch, then grouped in batches.

torchdata and SPDL are the optional extra ``.[bench]``: where one is not installed, its row says so
and the rest still run.

Each configuration runs in a child of its own (``harness.run_in_child``), which imports the
peers before its clock starts (so none pays its import inside its wall time, and every row's
memory holds them all). Wall time covers one full epoch end to end, including starting and
stopping the loader (worker processes, threads, sessions). Peak PSS and CPU time are the
child's process tree's, sampled from ``/proc`` every 50 ms from this process. Every
configuration checks that each object arrives exactly once with the right bytes, in the right
number of batches; the script exits non-zero when one does not (or when one raises or times
out); a peer that is not installed is reported, not failed.

Run it from the repository root::

    .venv/bin/python benchmarks/bench_remote.py                # the full run
    .venv/bin/python benchmarks/bench_remote.py --quick        # a smoke test (400 items)
    .venv/bin/python benchmarks/bench_remote.py --store s3     # the same from moto's S3
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import functools
import gc
import importlib
import importlib.util
import logging
import math
import multiprocessing.connection
import sys
import threading
import time
import urllib.request
import warnings
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import torch
import torch.utils.data
from aiohttp import web

import aioloader
import aioloader.sources
from aioloader._bench.harness import (
    Column,
    Result,
    ServerProcess,
    add_batch_size,
    add_only,
    add_quick,
    add_timeout,
    delivery_error,
    exit_status,
    format_table,
    quick_defaults,
    ratio_to,
    report,
    run_in_child,
    timed,
    versions,
    wait_for_stop,
)

QUICK_ITEMS = 400
OBJECT_SIZE = 64 * 1024
CEILING_CONCURRENCY = 64
THREADS = 32
JOIN_TIMEOUT_S = 10.0
SERVER_START_S = 60.0

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


# -- the server (a subprocess) -----------------------------------------------------------------


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
            await loop.run_in_executor(None, wait_for_stop, conn)
        finally:
            await runner.cleanup()

    asyncio.run(main())


BUCKET, REGION, S3_KEYS = "bench", "us-east-1", "testing"
WARM_UP_GETS = 400


def serve_s3(items: int, latency: float, conn: multiprocessing.connection.Connection) -> None:
    """moto's S3 server on 127.0.0.1 (port 0), threaded, with ``latency`` before each GET's
    response (a WSGI wrapper: each request has its thread, so the waits overlap, as a store's
    first-byte latency does); ``items`` objects ``obj/{i}`` put into ``BUCKET``; then the port
    through ``conn``, and run until anything arrives on ``conn`` (or it closes)."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    app = DomainDispatcherApplication(create_backend_app)

    def delayed(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if environ.get("REQUEST_METHOD") == "GET":
            time.sleep(latency)
        return app(environ, start_response)

    server = make_server("127.0.0.1", 0, delayed, threaded=True)
    thread = threading.Thread(target=server.serve_forever, name="moto", daemon=True)
    thread.start()
    client = s3_client(server.port, connections=8)  # the uploads' threads
    client.create_bucket(Bucket=BUCKET)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        puts = [pool.submit(client.put_object, Bucket=BUCKET, Key=f"obj/{i}", Body=payload(i))
                for i in range(items)]  # fmt: skip
        for put in puts:
            put.result()
        # Warm moto's GET path up (its first requests are slower), so that the first row is
        # not measured against a colder server than the next ones.
        warm = [f"obj/{i}" for i in range(min(items, WARM_UP_GETS))]
        list(pool.map(lambda key: client.get_object(Bucket=BUCKET, Key=key)["Body"].read(), warm))
    conn.send(server.port)
    wait_for_stop(conn)
    server.shutdown()
    thread.join()


# -- the datasets (module level, so torch's workers can import them) ---------------------------


def fetch_blocking(url: str) -> bytes:
    with urllib.request.urlopen(url) as response:
        data: bytes = response.read()
    return data


def s3_client(port: int, connections: int) -> Any:
    """A boto3 S3 client of the moto server on ``port``, pooling ``connections`` connections
    (boto3 keeps 10; a client is shared by as many threads as use it)."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{port}",
        region_name=REGION,
        aws_access_key_id=S3_KEYS,
        aws_secret_access_key=S3_KEYS,
        config=Config(max_pool_connections=connections),
    )


class S3Get:
    """``S3Get(port)(key)``: the body of ``BUCKET``/``key`` from the moto server on ``port``,
    read by boto3's blocking ``get_object`` (one client a process, made on first use; a client
    is safe to share between threads, making one is not). Pickled, it is its port: a worker
    makes its own client."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._client: Any = None
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple[type[S3Get], tuple[int]]:
        return S3Get, (self.port,)

    def __call__(self, key: str) -> bytes:
        with self._lock:
            if self._client is None:
                self._client = s3_client(self.port, connections=CEILING_CONCURRENCY)
        body: bytes = self._client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        return body


class BlockingDataset(torch.utils.data.Dataset[bytes]):
    """Item ``i`` is ``fetch(locations[i])``: a blocking read (``urllib``, or boto3)."""

    def __init__(self, locations: Sequence[str], fetch: Callable[[str], bytes]) -> None:
        self.locations = list(locations)
        self.fetch = fetch

    def __len__(self) -> int:
        return len(self.locations)

    def __getitem__(self, index: int) -> bytes:
        return self.fetch(self.locations[index])


async def fetch_async(session: aiohttp.ClientSession, url: str) -> bytes:
    async with session.get(url) as response:
        response.raise_for_status()
        return await response.read()


async def get_async(store: Any, key: str) -> bytes:
    """An object's body through obstore's async ``get``."""
    import obstore

    result = await obstore.get_async(store, key)
    return bytes(await result.bytes_async())


def identity(batch: list[bytes]) -> list[bytes]:
    return batch


# -- settings, results, checks -------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """``store``: ``http`` (the aiohttp server) or ``s3`` (moto's, on ``port``)."""

    items: int
    batch_size: int
    latency: float
    timeout: float
    port: int
    store: str = "http"

    @property
    def locations(self) -> list[str]:
        """What a blocking or async fetch is given: URLs, or the objects' keys."""
        if self.store == "s3":
            return [f"obj/{i}" for i in range(self.items)]
        return [f"http://127.0.0.1:{self.port}/obj/{i}" for i in range(self.items)]

    def blocking_fetch(self) -> Callable[[str], bytes]:
        return S3Get(self.port) if self.store == "s3" else fetch_blocking

    @property
    def s3_config(self) -> dict[str, str]:
        return {
            "endpoint": f"http://127.0.0.1:{self.port}",
            "region": REGION,
            "access_key_id": S3_KEYS,
            "secret_access_key": S3_KEYS,
        }

    def s3_store(self) -> Any:
        """An obstore ``S3Store`` for ``BUCKET`` (the async peers' client)."""
        from obstore.store import S3Store

        config: Any = self.s3_config
        return S3Store(BUCKET, config=config, client_options={"allow_http": True})


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
    expected_batches = math.ceil(settings.items / settings.batch_size)
    return len(indices), delivery_error(indices, settings.items, len(batches), expected_batches)


# -- the configurations --------------------------------------------------------------------------


async def _aio(settings: Settings, connections: int) -> list[list[bytes]]:
    dataset: Any
    if settings.store == "s3":
        dataset = aioloader.sources.objects(
            f"s3://{BUCKET}/obj/",
            config=settings.s3_config,
            client_options={"allow_http": True},
        )
    else:
        dataset = aioloader.sources.urls(settings.locations, connections=connections)
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


def run_torch(
    settings: Settings, num_workers: int, loader_class: Any = torch.utils.data.DataLoader
) -> list[list[bytes]]:
    """A torch user's code: the blocking dataset, ``num_workers``, a plain ``for``;
    ``loader_class`` torch's DataLoader, or aioloader's (the import swapped, nothing else)."""
    loader = loader_class(
        BlockingDataset(settings.locations, settings.blocking_fetch()),
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
    import torchdata.nodes as tn

    before = set(threading.enumerate())
    torch_threads = torch.get_num_threads()  # each mapper thread sets it to 1, process-wide
    mapper = tn.ParallelMapper(
        tn.IterableWrapper(settings.locations),
        map_fn=settings.blocking_fetch(),
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
    store = settings.s3_store() if settings.store == "s3" else None

    async def fetch(location: str) -> bytes:
        if store is not None:
            return await get_async(store, location)
        return await fetch_async(session.session, location)

    def hooks(info: StageInfo) -> list[TaskHook]:
        # SPDL's default hook (TaskStatsHook) on every stage, and the session on the fetch's.
        return [TaskStatsHook(info), *([session] if info.stage_name == "fetch" else [])]

    pipeline = (
        PipelineBuilder[str, list[bytes]]()
        .add_source(settings.locations)
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
        fetch = settings.blocking_fetch()
        samples = list(pool.map(fetch, settings.locations, timeout=settings.timeout))
    size = settings.batch_size
    return [samples[i : i + size] for i in range(0, len(samples), size)]


async def _ceiling(settings: Settings) -> list[list[bytes]]:
    semaphore = asyncio.Semaphore(CEILING_CONCURRENCY)
    connector = aiohttp.TCPConnector(limit=CEILING_CONCURRENCY)
    store = settings.s3_store() if settings.store == "s3" else None
    async with aiohttp.ClientSession(connector=connector) as session:

        async def fetch(location: str) -> bytes:
            async with semaphore:
                if store is not None:
                    return await get_async(store, location)
                return await fetch_async(session, location)

        async with asyncio.timeout(settings.timeout):
            samples = await asyncio.gather(*(fetch(x) for x in settings.locations))
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
    "aio-swapped-nw8": lambda s: run_torch(s, 8, aioloader.DataLoader),
    "tdnodes-thr16": lambda s: run_torchdata(s, 16),
    "tdnodes-thr64": lambda s: run_torchdata(s, 64),
    "spdl-conc64": lambda s: run_spdl(s, CEILING_CONCURRENCY),
    "threads32": run_threads,
    "asyncio-ceiling": run_ceiling,
}
BASELINES = ("asyncio-ceiling", "torch-nw8")


def in_flight(name: str) -> dict[str, int]:
    """The requests a configuration keeps in flight at most, for ``aioloader bench``'s chart of
    throughput against it: the number its name ends with (connections, torch's workers, threads:
    ``ParallelMapper`` holds up to twice its threads' items, but runs at most one fetch a
    thread), the ceiling's semaphore."""
    if name == "asyncio-ceiling":
        return {"in_flight": CEILING_CONCURRENCY}
    digits = name[len(name.rstrip("0123456789")) :]
    return {"in_flight": int(digits)} if digits else {}


# The configurations that need an optional peer: the peer's key in PEERS.
PEER_OF = {"tdnodes-thr16": "torchdata", "tdnodes-thr64": "torchdata", "spdl-conc64": "spdl"}


@dataclass(frozen=True)
class Job:
    """One configuration, as handed to its child (which finds it by name)."""

    config: str
    settings: Settings


def prepare_child(job: Job) -> Callable[[], dict[str, Any]]:
    """A child's set-up, before its clock starts: the peers imported (so none pays its import in
    its wall time, and every row's memory holds them all), torch's worker warning silenced (8
    workers on 2 cores: measuring that is the point). Returns the work: the epoch, timed, then
    checked."""
    for module, _ in PEERS.values():
        with contextlib.suppress(ImportError):  # one that fails to import fails its rows
            importlib.import_module(module)
    if job.settings.store == "s3":
        import boto3
        import obstore

        del boto3, obstore  # imported for every row alike
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)

    def work() -> dict[str, Any]:
        outcome = timed(functools.partial(CONFIGS[job.config], job.settings), job.settings.timeout)
        if outcome.value is None:
            return {"samples": 0, "wall_s": outcome.wall_s, "error": outcome.error}
        samples, error = check(outcome.value, job.settings)
        return {"samples": samples, "wall_s": outcome.wall_s, "error": error}

    return work


def measure(name: str, settings: Settings) -> Result:
    """Run one configuration in a child of its own (``harness.run_in_child``), its process
    tree's memory and CPU sampled from here; past ``settings.timeout``, its stacks are dumped
    and its tree killed."""
    run = run_in_child(prepare_child, Job(name, settings), settings.timeout, f"bench-{name}")
    result = Result(name, error=run.error)
    if run.payload is not None:
        result.samples, result.wall_s = run.payload["samples"], run.payload["wall_s"]
    result.record_memory(run.memory)
    return result


def format_results(results: Iterable[Result]) -> str:
    results = list(results)
    columns: list[Column[Result]] = [
        Column("samples/s", 11, lambda r: f"{r.samples_per_s:,.0f}"),
        Column("wall s", 9, lambda r: f"{r.wall_s:.2f}"),
        Column("peak RSS MiB", 14, lambda r: f"{r.peak_rss_mib:,.0f}"),
        Column("peak PSS MiB", 14, lambda r: f"{r.peak_pss_mib:,.0f}"),
        Column("CPU s", 7, lambda r: f"{r.cpu_s or 0:.2f}"),
    ]
    for label, peer, width in zip(("ceiling", "nw8"), BASELINES, (12, 9), strict=True):
        per_s = ratio_to(results, peer, lambda r: r.samples_per_s)
        columns.append(Column(f"vs {label}", width, per_s))
    # A peer that is not installed: "-" in every column, and why in the check column.
    return format_table(
        results, 18, columns, lambda r: r.skipped or r.status, blank=lambda r: r.skipped is not None
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="aioloader vs torch DataLoader vs threads vs asyncio, reading over HTTP."
    )
    parser.add_argument("--items", type=int, default=None, help="objects (default 2000)")
    add_batch_size(parser)
    parser.add_argument(
        "--latency", type=float, default=0.02, help="server's seconds before each response"
    )
    parser.add_argument(
        "--store",
        choices=("http", "s3"),
        default="http",
        help="serve the objects from an aiohttp server or from moto's S3 server (default http)",
    )
    add_quick(parser, f"smoke test: {QUICK_ITEMS} items (unless --items)")
    add_only(parser, list(CONFIGS))
    add_timeout(
        parser, "seconds one configuration may take (default: max(120, 3 * items * latency))"
    )
    args = parser.parse_args(argv)
    quick_defaults(args, items=(QUICK_ITEMS, 2000))
    if args.items <= 0 or args.batch_size <= 0 or args.latency < 0:
        parser.error("--items and --batch-size must be positive, --latency non-negative")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # torch warns that 8 workers exceed this machine's cores: measuring that is the point.
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    timeout = args.timeout or max(120.0, 3 * args.items * args.latency)
    installed = {peer: importlib.util.find_spec(peer) is not None for peer in PEERS}
    peers: list[tuple[str, str]] = []
    for peer, (module, distribution) in PEERS.items():
        if installed[peer]:
            # Imported here, not inside a timed configuration. One that fails to import fails
            # its configurations.
            with contextlib.suppress(ImportError):
                importlib.import_module(module)
            peers.append((peer, distribution))
    print(
        f"{versions('torch', *peers, 'aiohttp')}: {args.items} objects x "
        f"{OBJECT_SIZE // 1024} KiB, {args.latency * 1e3:g} ms first-byte latency, "
        f"batch {args.batch_size}",
        flush=True,
    )
    results: list[Result] = []
    table = f"objects-{args.store}"
    server = ServerProcess(
        f"bench-remote-{args.store}",
        serve_s3 if args.store == "s3" else serve,
        args.items,
        args.latency,
        start_timeout=SERVER_START_S,
    )
    with server:
        settings = Settings(
            args.items, args.batch_size, args.latency, timeout, server.port, args.store
        )
        print(f"{args.store} server on 127.0.0.1:{server.port}", flush=True)
        names: list[str] = args.only or list(CONFIGS)
        for name in names:
            needs = PEER_OF.get(name)
            if needs is not None and not installed[needs]:
                if all(r.name != needs for r in results):  # one row for the peer
                    results.append(Result(needs, skipped=NOT_INSTALLED))
                    report(table, results[-1])
                    print(f"  skip {needs:<18} {NOT_INSTALLED}", flush=True)
                continue
            result = measure(name, settings)
            results.append(result)
            report(table, result, **in_flight(name))
            print(
                f"  done {name:<18} {result.samples_per_s:>10,.0f} samples/s "
                f"{result.wall_s:>7.2f} s  {result.peak_pss_mib:>6,.0f} MiB PSS  {result.status}",
                flush=True,
            )
    print()
    print(format_results(results))
    return exit_status([r.name for r in results if not r.ok])


if __name__ == "__main__":
    sys.exit(main())
