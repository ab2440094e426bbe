"""The CPU workloads' configurations (``cpu.py`` runs them): the CPU meter, the runners of
aioloader's and torch's loaders over a workload, the measurement of one configuration with its
goals, and the pipe check (tensors back through shared memory, not the pipe).

Configurations of the transform workloads, measured one after another in one run:

* ``aio-nw0``: ``aioloader.DataLoader(..., transform=fn, num_workers=0)``: transform + collate
  on one thread off the event loop.
* ``aio-nw1``, ``aio-nw2``: the same with 1 and 2 spawned worker processes (``worker_mode=
  "process"``), a whole batch per job, tensors back through shared memory.
* ``torch-nw0``: ``torch.utils.data.DataLoader`` over a ``Dataset`` whose ``__getitem__``
  applies the same transform, default collate.
* ``torch-nw2-spawn``: the same, ``num_workers=2``, ``multiprocessing_context="spawn"`` (the
  start-up aioloader's workers pay: a fresh interpreter importing torch, and here the dataset
  pickled to each worker).
* ``torch-nw2-fork``: the same with torch's default (fork) context.

Configurations of the drop-in workloads: the code a torch user has, with only the loader class
swapped: ``DataLoader(dataset, batch_size=32, num_workers=N)``, plus ``persistent_workers=True``
when ``N > 0``, the same dataset object for every row, and two epochs of a plain ``for batch in
loader:`` (no ``with``, no ``async``, no ``transform=``); the loader is then dropped (``del``,
no shutdown call) and its workers must be gone within 15 s:

* ``torch-nw0``, ``torch-nw2-fork`` (torch's default context on Linux), ``torch-nw2-spawn``
  (``multiprocessing_context="spawn"``): ``torch.utils.data.DataLoader``;
* ``aio-nw0``, ``aio-nw2``: ``aioloader.DataLoader`` with its default context.
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.data

import aioloader
from aioloader._bench.cpu_data import (
    EPOCHS,
    IMAGE_SIDE,
    PIPE_BATCH,
    PIPE_DATA_BYTES,
    PIPE_MAX_FRACTION,
    EpochCheck,
    TransformedDataset,
    Workload,
    full_image,
    speed_probe,
)
from aioloader._bench.harness import Result, describe, error_text, watchdog
from aioloader._bench.harness_processes import (
    EXIT_WAIT_S,
    MemorySampler,
    machine_ticks,
    process_tree,
    wait_for_children,
)

# -- CPU used meanwhile ------------------------------------------------------------------------


def _machine_busy_s() -> float:
    """CPU-seconds the whole machine has spent busy (all CPUs; steal included) since boot."""
    return machine_ticks()[0] / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU used while the ``with`` block runs: ``main_s`` by this process (all its threads),
    ``children_s`` by its child processes (counted once they have exited and been reaped), and
    ``other`` the share of the machine's capacity used by every *other* process (other work on a
    shared machine makes every figure noisier); :meth:`other_than` the same beside a better
    count of this process tree's CPU."""

    def __enter__(self) -> CpuMeter:
        self.main_s = self.children_s = self.other = math.nan
        self.busy_s = self.capacity_s = math.nan
        self._wall = time.perf_counter()
        self._busy = _machine_busy_s()
        self._times = os.times()
        return self

    def __exit__(self, *exc_info: object) -> None:
        wall = time.perf_counter() - self._wall
        busy = _machine_busy_s() - self._busy
        before, after = self._times, os.times()
        self.main_s = (after.user - before.user) + (after.system - before.system)
        self.children_s = (after.children_user - before.children_user) + (
            after.children_system - before.children_system
        )
        self.busy_s, self.capacity_s = busy, wall * (os.cpu_count() or 1)
        self.other = self.other_than(self.main_s + self.children_s)

    def other_than(self, tree_s: float) -> float:
        """The share of the machine's capacity used by processes outside a tree that used
        ``tree_s`` CPU-seconds while the block ran."""
        if not self.capacity_s > 0:
            return math.nan
        return max(0.0, (self.busy_s - tree_s) / self.capacity_s)


# -- the configurations ------------------------------------------------------------------------


@dataclass
class Timing:
    """``start``: before the loader is built; ``first``: first batch; ``ends``: epoch ends."""

    start: float = field(default_factory=time.perf_counter)
    first: float | None = None
    ends: list[float] = field(default_factory=list)


@dataclass
class CpuResult(Result):
    """A row; ``samples`` is the samples of one epoch, ``wall_s`` unused (see ``timing``)."""

    timing: Timing = field(default_factory=Timing)
    main_cpu_s: float = math.nan
    worker_cpu_s: float = math.nan
    other_load: float = math.nan
    speed: float = math.nan
    statistics: aioloader.LoaderStatistics | None = None

    @property
    def cold_per_s(self) -> float:
        t = self.timing
        return self.samples / (t.ends[0] - t.start) if t.ends else 0.0

    @property
    def steady_per_s(self) -> float:
        t = self.timing
        return self.samples / (t.ends[1] - t.ends[0]) if len(t.ends) > 1 else 0.0

    @property
    def rate(self) -> float:
        """Over both epochs, from building the loader (worker start-up included) to the end."""
        t = self.timing
        return len(t.ends) * self.samples / (t.ends[-1] - t.start) if t.ends else 0.0

    @property
    def first_batch_s(self) -> float:
        t = self.timing
        return t.first - t.start if t.first is not None else math.nan


def _consume(batches: Iterable[Any], workload: Workload, timing: Timing, errors: list[str]) -> None:
    check = EpochCheck(workload)
    for batch in batches:
        if timing.first is None:
            timing.first = time.perf_counter()
        check.add(batch)
    timing.ends.append(time.perf_counter())
    error = check.finish()
    if error is not None:
        errors.append(f"epoch {len(timing.ends)}: {error}")


async def _aio_epochs(
    workload: Workload, num_workers: int, timing: Timing, errors: list[str]
) -> aioloader.LoaderStatistics:
    loader: aioloader.DataLoader[Any] = aioloader.DataLoader(
        workload.samples,
        batch_size=workload.batch_size,
        num_workers=num_workers,
        transform=workload.transform,
        seed=0,
        worker_mode="process",
    )
    async with asyncio.timeout(workload.timeout), loader:
        for _ in range(EPOCHS):
            check = EpochCheck(workload)  # batches are checked and dropped as they come
            async for batch in loader:
                if timing.first is None:
                    timing.first = time.perf_counter()
                check.add(batch)
            timing.ends.append(time.perf_counter())
            error = check.finish()
            if error is not None:
                errors.append(f"epoch {len(timing.ends)}: {error}")
    return loader.statistics()


def run_aio(
    workload: Workload, num_workers: int, timing: Timing, errors: list[str]
) -> aioloader.LoaderStatistics:
    stats = asyncio.run(_aio_epochs(workload, num_workers, timing, errors))
    if stats.consumer.samples != EPOCHS * workload.items:
        errors.append(
            f"statistics().consumer.samples is {stats.consumer.samples}, "
            f"not {EPOCHS * workload.items}"
        )
    if num_workers and (stats.workers is None or stats.workers.processes != num_workers):
        errors.append(f"statistics().workers is {stats.workers}, expected {num_workers} processes")
    return stats


def run_torch(
    workload: Workload, num_workers: int, context: str | None, timing: Timing, errors: list[str]
) -> None:
    if workload.transform is None:
        raise ValueError(f"workload {workload.name!r} has no transform for torch's rows")
    dataset = TransformedDataset(workload.samples, workload.transform)
    extra: dict[str, Any] = {}
    if num_workers:
        extra = {"persistent_workers": True, "timeout": workload.timeout}
        if context is not None:
            extra["multiprocessing_context"] = context
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=workload.batch_size, num_workers=num_workers, **extra
    )
    for _ in range(EPOCHS):
        _consume(loader, workload, timing, errors)
    if num_workers:  # stop the persistent workers now, not whenever the loader is collected
        iterator = loader._iterator
        if iterator is not None:
            iterator._shutdown_workers()  # type: ignore[attr-defined]
    del loader


def run_dropin(
    loader_class: Any,
    workload: Workload,
    num_workers: int,
    timing: Timing,
    errors: list[str],
    **context: Any,
) -> aioloader.LoaderStatistics | None:
    """A drop-in row: a torch user's code as written, ``loader_class`` (torch's or aioloader's
    DataLoader) the only difference: the dataset as-is, ``batch_size``, ``num_workers``,
    ``persistent_workers=True`` with workers, two epochs of a plain ``for`` over the loader
    object (no ``with``). ``context`` only names torch's ``multiprocessing_context``."""
    options: dict[str, Any] = {"batch_size": workload.batch_size, "num_workers": num_workers}
    if num_workers:
        options["persistent_workers"] = True
    loader = loader_class(workload.samples, **options, **context)
    for _ in range(EPOCHS):
        _consume(loader, workload, timing, errors)
    stats = loader.statistics() if isinstance(loader, aioloader.DataLoader) else None
    # Dropped like a user's loader going out of scope (no private shutdown call): measure()
    # then gives the workers EXIT_WAIT_S to be gone.
    del loader
    return stats


Runner = Callable[[Workload, Timing, list[str]], aioloader.LoaderStatistics | None]

CONFIGS: dict[str, Runner] = {
    "aio-nw0": lambda w, t, e: run_aio(w, 0, t, e),
    "aio-nw1": lambda w, t, e: run_aio(w, 1, t, e),
    "aio-nw2": lambda w, t, e: run_aio(w, 2, t, e),
    "torch-nw0": lambda w, t, e: run_torch(w, 0, None, t, e),
    "torch-nw2-spawn": lambda w, t, e: run_torch(w, 2, "spawn", t, e),
    "torch-nw2-fork": lambda w, t, e: run_torch(w, 2, None, t, e),
}
BASELINES = ("aio-nw1", "torch-nw2-spawn")
STATS_CONFIG = "aio-nw2"

TorchLoader = torch.utils.data.DataLoader
DROPIN_CONFIGS: dict[str, Runner] = {
    "torch-nw0": lambda w, t, e: run_dropin(TorchLoader, w, 0, t, e),
    "torch-nw2-fork": lambda w, t, e: run_dropin(TorchLoader, w, 2, t, e),
    "torch-nw2-spawn": lambda w, t, e: run_dropin(
        TorchLoader, w, 2, t, e, multiprocessing_context="spawn"
    ),
    "aio-nw0": lambda w, t, e: run_dropin(aioloader.DataLoader, w, 0, t, e),
    "aio-nw2": lambda w, t, e: run_dropin(aioloader.DataLoader, w, 2, t, e),
    # dropin-jpeg only, where Ray is installed (cpu_ray.py): the same code on two Ray actors.
    "aio-ray-nw2": lambda w, t, e: run_dropin(aioloader.DataLoader, w, 2, t, e, worker_mode="ray"),
}
DROPIN_BASELINES = ("aio-nw0", "torch-nw2-fork")
# The drop-in goals: (row, over row, "samples/s" or "PSS", goal, higher is better)
DROPIN_GOALS = (
    ("aio-nw2", "torch-nw2-fork", "samples/s", 1.0, True),
    ("aio-nw2", "torch-nw2-spawn", "samples/s", None, True),
    ("aio-nw2", "aio-nw0", "samples/s", 1.8, True),
    ("aio-nw2", "torch-nw2-fork", "peak PSS", 1.2, False),
    ("aio-ray-nw2", "aio-nw2", "samples/s", 0.9, True),  # the cost of the cluster path
)


def measure(name: str, runner: Runner, workload: Workload, reference_probe_s: float) -> CpuResult:
    """Run one configuration (two epochs) under a watchdog that dumps every thread's stack and
    exits the process if it hangs well past ``workload.timeout``; sample RSS and PSS
    throughout."""
    errors: list[str] = []
    stats: aioloader.LoaderStatistics | None = None
    probe_before = speed_probe()
    before = set(process_tree(os.getpid()))
    with CpuMeter() as cpu, MemorySampler() as memory:
        timing = Timing()
        try:
            with watchdog(workload.timeout + 30):
                stats = runner(workload, timing, errors)
        except Exception as exc:  # report it, go on with the other configurations
            errors.append(error_text(exc))
        left = wait_for_children(before)
    if left:
        errors.append(f"{len(left)} child processes still alive {EXIT_WAIT_S:g} s after closing")
    if not errors and len(timing.ends) != EPOCHS:
        errors.append(f"ran {len(timing.ends)} epochs, not {EPOCHS}")
    # Two lower bounds of the tree's CPU time: this process's and its reaped children's (torch's
    # workers, to their exit; not aioloader's, which its fork server reaps) and the one sampled
    # over the whole tree (every worker, less each one's last poll before it exits).
    tree_cpu_s = max(cpu.main_s + cpu.children_s, memory.cpu_s)
    result = CpuResult(
        name,
        workload.items,
        timing=timing,
        main_cpu_s=cpu.main_s,
        worker_cpu_s=tree_cpu_s - cpu.main_s,
        other_load=cpu.other_than(tree_cpu_s),
        speed=reference_probe_s / statistics.mean((probe_before, speed_probe())),
        error="; ".join(errors) or None,
        statistics=stats,
    )
    result.record_memory(memory)
    result.cpu_s = tree_cpu_s
    return result


# -- the pipe check ----------------------------------------------------------------------------


@dataclass
class PipeResult:
    per_job: float
    jobs: int
    error: str | None


def measure_pipe(timeout: float) -> PipeResult:
    """One 64x3x224x224 uint8 batch through one worker process: bytes back per job."""
    try:
        with watchdog(timeout + 30):
            loader: aioloader.DataLoader[torch.Tensor] = aioloader.DataLoader(
                list(range(PIPE_BATCH)),
                batch_size=PIPE_BATCH,
                num_workers=1,
                transform=full_image,
                seed=0,
            )
            with loader:
                batches = list(loader)
            stats = loader.statistics()
    except Exception as exc:
        return PipeResult(0.0, 0, error_text(exc))
    expected = torch.arange(PIPE_BATCH, dtype=torch.uint8).view(-1, 1, 1, 1)
    if (
        len(batches) != 1
        or tuple(batches[0].shape) != (PIPE_BATCH, 3, IMAGE_SIDE, IMAGE_SIDE)
        or not bool((batches[0] == expected).all())
    ):
        got = ", ".join(describe(b) for b in batches)
        return PipeResult(0.0, 0, f"wrong batches: {got}")
    workers = stats.workers
    if workers is None or workers.jobs == 0:
        return PipeResult(0.0, 0, f"no worker statistics: {workers}")
    per_job = workers.bytes_received / workers.jobs
    error = None
    if per_job > PIPE_MAX_FRACTION * PIPE_DATA_BYTES:
        error = f"{per_job:,.0f} bytes per job crossed the pipe: the pixels were pickled"
    return PipeResult(per_job, workers.jobs, error)
