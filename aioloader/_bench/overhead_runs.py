"""The overhead workload's configurations: aioloader's loaders and their peers (torch's
``DataLoader``, plain loops) over each dataset, by name."""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.data

import aioloader
from aioloader._bench.overhead_data import (
    HAS_UVLOOP,
    PLAIN,
    AsyncRows,
    Files,
    Rows,
    Run,
    drop_cache,
    file_indices,
    file_path,
    row_indices,
)

# -- the configurations -------------------------------------------------------------------------


def options(batch_size: int, collate: Callable[[Any], Any] | None) -> dict[str, Any]:
    """The loader's arguments: ``batch_size``, and ``collate_fn`` when not the default."""
    return {"batch_size": batch_size} | ({} if collate is None else {"collate_fn": collate})


def run_torch(
    dataset: Any, run: Run, *, workers: int, collate: Callable[[Any], Any] | None
) -> None:
    loader = torch.utils.data.DataLoader(
        dataset, num_workers=workers, **options(run.batch_size, collate)
    )
    for epoch in run.epochs():
        with epoch:
            add = epoch.add
            for batch in loader:
                add(batch)


def run_plain(dataset: Any, run: Run, *, stack: bool) -> None:
    """The hand-written loop: ``torch.stack`` of each slice's items (``stack``), or the list."""
    n, size = len(dataset), run.batch_size
    for epoch in run.epochs():
        with epoch:
            add = epoch.add
            for s in range(0, n, size):
                samples = [dataset[i] for i in range(s, min(n, s + size))]
                add(torch.stack(samples) if stack else samples)


def run_aio_for(
    dataset: Any, run: Run, *, scope: bool, collate: Callable[[Any], Any] | None
) -> None:
    """A plain ``for`` per epoch, inside one ``with loader:`` (``scope``) or without."""
    loader: aioloader.DataLoader[Any] = aioloader.DataLoader(
        dataset, **options(run.batch_size, collate)
    )
    with loader if scope else contextlib.nullcontext():
        for epoch in run.epochs():
            with epoch:
                add = epoch.add
                for batch in loader:
                    add(batch)


async def _aio_async_epochs(dataset: Any, run: Run, collate: Callable[[Any], Any] | None) -> None:
    loader: aioloader.DataLoader[Any] = aioloader.DataLoader(
        dataset, **options(run.batch_size, collate)
    )
    async with loader:
        for epoch in run.epochs():
            with epoch:
                add = epoch.add
                async for batch in loader:
                    add(batch)


def run_aio_async(
    dataset: Any, run: Run, *, uvloop: bool, collate: Callable[[Any], Any] | None
) -> None:
    """``async with loader:`` around one ``async for`` per epoch, under ``asyncio.run`` or
    ``asyncio.Runner(loop_factory=uvloop.new_event_loop)``."""
    if not uvloop:
        asyncio.run(_aio_async_epochs(dataset, run, collate))
        return
    import uvloop as _uvloop

    with asyncio.Runner(loop_factory=_uvloop.new_event_loop) as runner:
        runner.run(_aio_async_epochs(dataset, run, collate))


@dataclass(frozen=True)
class Job:
    """One configuration of one workload, as handed to a child (which builds it by name)."""

    workload: str  # "rows" or "files"
    config: str
    items: int
    batch_size: int
    repeats: int
    cold: bool = False
    directory: str = ""  # files: the folder


def file_paths(job: Job) -> list[str]:
    return [file_path(job.directory, i) for i in range(job.items)]


def files_source(job: Job) -> Any:
    import aioloader.sources  # here: the rows workload's children need not import it

    return aioloader.sources.files(job.directory, "*.bin")


Body = Callable[[Any, Run], None]  # (dataset, run)


@dataclass(frozen=True)
class Config:
    """``make(job)``: the dataset (built before the child's clock starts); ``body``: its epochs;
    ``skip``: why it cannot run here."""

    name: str
    make: Callable[[Job], Any]
    body: Body
    skip: str | None = None


def _rows(job: Job) -> Rows:
    return Rows(job.items)


def _async_rows(job: Job) -> AsyncRows:
    return AsyncRows(job.items)


def _files(job: Job) -> Files:
    return Files(file_paths(job))


def build_configs() -> dict[str, dict[str, Config]]:
    """Each workload's configurations, in the order they run."""
    no_uvloop = None if HAS_UVLOOP else "uvloop is not installed"
    p = functools.partial
    rows = [
        Config("torch-nw0", _rows, p(run_torch, workers=0, collate=None)),
        Config("torch-nw2", _rows, p(run_torch, workers=2, collate=None)),
        Config("torch-nw8", _rows, p(run_torch, workers=8, collate=None)),
        Config(PLAIN, _rows, p(run_plain, stack=True)),
        Config("aio-torchds-for", _rows, p(run_aio_for, scope=True, collate=None)),
        Config("aio-torchds-for-nowith", _rows, p(run_aio_for, scope=False, collate=None)),
        Config("aio-torchds-async", _rows, p(run_aio_async, uvloop=False, collate=None)),
        Config(
            "aio-torchds-async-uvloop",
            _rows,
            p(run_aio_async, uvloop=True, collate=None),
            skip=no_uvloop,
        ),
        Config("aio-asyncds-async", _async_rows, p(run_aio_async, uvloop=False, collate=None)),
        Config(
            "aio-asyncds-async-uvloop",
            _async_rows,
            p(run_aio_async, uvloop=True, collate=None),
            skip=no_uvloop,
        ),
    ]
    files = [
        Config(PLAIN, _files, p(run_plain, stack=False)),
        Config("torch-nw0", _files, p(run_torch, workers=0, collate=list)),
        Config("torch-nw2", _files, p(run_torch, workers=2, collate=list)),
        Config("torch-nw8", _files, p(run_torch, workers=8, collate=list)),
        Config("aio-files", files_source, p(run_aio_async, uvloop=False, collate=list)),
        Config("aio-torchds-for", _files, p(run_aio_for, scope=True, collate=list)),
    ]
    return {"rows": {c.name: c for c in rows}, "files": {c.name: c for c in files}}


CONFIGS = build_configs()
ALL_NAMES = list(dict.fromkeys(name for configs in CONFIGS.values() for name in configs))


def prepare(job: Job, profiler: cProfile.Profile | None = None) -> Callable[[], dict[str, Any]]:
    """The set-up of a configuration, the same for every row (in a child: before
    ``harness_child.run_in_child`` has it say ready): the dataset built; returns its work, whose
    outcome is a dict."""
    # torch warns that 8 workers exceed a small machine's cores: measuring that is the point.
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    config = CONFIGS[job.workload][job.config]
    dataset = config.make(job)
    if job.workload == "rows":
        run = Run(job.items, job.batch_size, job.repeats, row_indices, profiler=profiler)
    else:
        before = functools.partial(drop_cache, file_paths(job)) if job.cold else None
        run = Run(job.items, job.batch_size, job.repeats, file_indices, before, profiler)
    return functools.partial(run.execute, functools.partial(config.body, dataset))


def prepare_child(job: Job) -> Callable[[], dict[str, Any]]:
    return prepare(job)
