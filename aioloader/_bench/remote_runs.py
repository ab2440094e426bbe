"""The remote workload's configurations: aioloader's loader, torch's ``DataLoader`` (and the
import swapped), torchdata.nodes, SPDL, a thread pool and the asyncio ceiling, each reading
every object once, by name."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import torch
import torch.utils.data

import aioloader
import aioloader.sources
from aioloader._bench.remote_data import (
    BlockingDataset,
    Settings,
    fetch_async,
    get_async,
)
from aioloader._bench.remote_server import (
    BUCKET,
    CEILING_CONCURRENCY,
    JOIN_TIMEOUT_S,
    THREADS,
)

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
