"""CPU-bound benchmark: aioloader's worker processes vs torch's DataLoader on compute-heavy work.

Two workloads, each a map-style dataset whose samples are cheap to fetch and expensive to turn
into tensors, batched ``--batch-size`` (default 32) at a time:

* ``gil``: 4,000 samples, each an ``int``; the transform runs ~2 ms of pure-Python arithmetic
  (a loop calibrated at start-up so one call takes about 2 ms on this machine) and returns a
  small int64 tensor ``[index, result]``. The GIL is held throughout, so only processes scale.
* ``decode``: 2,000 samples, each ``(index, encoded image)`` made once at start-up: PNG through
  PIL when PIL imports, else a NumPy stand-in (a zlib-compressed 224x224x3 uint8 array, about
  64 KB). The transform decodes it (``PIL.Image.open`` / ``zlib.decompress`` +
  ``numpy.frombuffer``), takes a 192x192 crop at an offset derived from the index, flips odd
  indices, and returns ``(3x192x192 uint8 CHW tensor, index)``.

Configurations, measured one after another in one run:

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

Each configuration runs two epochs in one loader scope (aioloader: one ``async with``; torch:
``persistent_workers=True`` when ``num_workers > 0``) and reports:

* ``cold/s``: samples/s of epoch 1 timed from constructing the loader, so worker start-up is
  included;
* ``steady/s``: samples/s of epoch 2 (workers already up);
* ``1st batch s``: seconds from constructing the loader to the first batch;
* ``peak MiB``: the highest sum of VmRSS over this process and all its descendants, sampled
  every 50 ms from ``/proc`` by a background thread while the configuration runs (worker
  shutdown included). Shared pages (shared-memory batches, fork's copy-on-write pages) count
  once per process that maps them, so this over-states what the machine actually spent;
  ``+MiB`` is that peak minus the same sum just before the configuration started;
* ``main CPU s`` / ``workers CPU s``: CPU-seconds of this process (the transform itself with
  ``num_workers=0``; otherwise the loader's own overhead plus the checks) and of its worker
  processes, over both epochs;
* ``other CPU``: the share of the machine's CPU used meanwhile by processes outside this
  benchmark (steal included): on a shared machine, rows with a high figure are slowed by it;
* ``speed``: the single-core speed just before and after the configuration (a fixed ``spin``)
  relative to start-up: a VM's vCPU can run at very different speeds from minute to minute.

The main process runs torch with ``--main-threads`` (default 1) intra-op threads, as both
loaders' workers do: on two loaded cores torch's OpenMP threads in the consumer stall.

Ratios are against ``aio-nw1`` and ``torch-nw2-spawn``, as cold/steady pairs. The statistics of
``aio-nw2`` are printed for each workload, with the bytes per job that crossed the worker pipes.

A last check (``pipe``) sends one 64x3x224x224 uint8 batch (9,633,792 bytes of pixels) through
one aioloader worker and prints ``statistics().workers.bytes_received / jobs``: what crossed the
pipe for that batch, which should be a few shared-memory handles, not the pixels.

Every epoch is checked: each index delivered exactly once, the right number of batches, well
formed batches, and the transform's output right (every pixel sum for ``decode``, a spread of
recomputed results for ``gil``); worker processes must be gone once a loader is closed. The
script exits non-zero when a check fails or a configuration raises or times out.

Run it from the repository root::

    python benchmarks/bench_cpu.py            # the full run (~2 min on 2 cores)
    python benchmarks/bench_cpu.py --quick    # a smoke test (gil 640 samples, decode 320)
    python benchmarks/bench_cpu.py --only gil
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import gc
import importlib
import io
import math
import multiprocessing.resource_tracker
import os
import statistics
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.data

import aioloader

Image: Any  # PIL.Image when PIL is installed (PNG), else None (the NumPy/zlib stand-in)
try:
    Image = importlib.import_module("PIL.Image")
except ImportError:  # pragma: no cover - depends on the environment
    Image = None

GIL_ITEMS = 4000
DECODE_ITEMS = 2000
QUICK_GIL_ITEMS = 640
QUICK_DECODE_ITEMS = 320
SPIN_TARGET_S = 0.002  # pure-Python work per gil sample
GIL_SPOT_EVERY = 37  # recompute the gil result of every 37th index to check it
IMAGE_SIDE = 224
CROP_SIDE = 192
DISTINCT_IMAGES = 128  # images encoded at start-up; every sample holds its own copy
EPOCHS = 2
SPEED_PROBE_LOOPS = 4000
POLL_S = 0.05
PIPE_BATCH = 64
PIPE_DATA_BYTES = PIPE_BATCH * 3 * IMAGE_SIDE * IMAGE_SIDE  # 9,633,792
PIPE_MAX_FRACTION = 0.01  # more than 1% of the pixels through the pipe: they were pickled
EXIT_WAIT_S = 15.0  # how long closed loaders' worker processes may take to exit


# -- the transforms and the torch dataset (module level: spawned workers import them by name) -----


def spin(seed: int, loops: int) -> int:
    """``loops`` rounds of pure-Python integer arithmetic: holds the GIL the whole time."""
    acc = seed
    for k in range(loops):
        acc = (acc * 1103515245 + 12345 + k) & 0xFFFFFFFF
    return acc


class SpinTransform:
    """The gil transform: sample ``i`` (an int) -> ``tensor([i, spin(i, loops)])``."""

    def __init__(self, loops: int) -> None:
        self.loops = loops

    def __call__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, spin(index, self.loops)], dtype=torch.int64)


def _decode_pixels(payload: bytes) -> np.ndarray:
    """Encoded image -> HWC uint8 array."""
    if Image is not None:
        with Image.open(io.BytesIO(payload)) as image:
            return np.asarray(image.convert("RGB"))
    raw = zlib.decompress(payload)
    return np.frombuffer(raw, dtype=np.uint8).reshape(IMAGE_SIDE, IMAGE_SIDE, 3)


def decode_sample(sample: tuple[int, bytes]) -> tuple[torch.Tensor, int]:
    """The decode transform: decode, crop 192x192 at an index-derived offset, flip odd indices,
    HWC -> CHW uint8 tensor."""
    index, payload = sample
    pixels = _decode_pixels(payload)
    room = IMAGE_SIDE - CROP_SIDE
    top, left = (index * 7) % (room + 1), (index * 13) % (room + 1)
    crop = pixels[top : top + CROP_SIDE, left : left + CROP_SIDE]
    if index % 2:
        crop = crop[:, ::-1]
    chw = np.ascontiguousarray(crop.transpose(2, 0, 1))
    return torch.from_numpy(chw), index


def full_image(index: int) -> torch.Tensor:
    """The pipe check's transform: a 3x224x224 uint8 image filled with ``index % 256``."""
    return torch.full((3, IMAGE_SIDE, IMAGE_SIDE), index % 256, dtype=torch.uint8)


class TransformedDataset(torch.utils.data.Dataset[Any]):
    """torch's side: ``__getitem__`` applies the transform to the stored sample."""

    def __init__(self, samples: Sequence[Any], transform: Callable[[Any], Any]) -> None:
        self.samples = samples
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Any:
        return self.transform(self.samples[index])


# -- the data, made at start-up ----------------------------------------------------------------


def _spin_median(loops: int, calls: int) -> float:
    timings = []
    for i in range(calls):
        start = time.perf_counter()
        spin(i, loops)
        timings.append(time.perf_counter() - start)
    return statistics.median(timings)


def speed_probe() -> float:
    """Median seconds of a fixed ``spin``: compared with the value at start-up, it shows the
    machine's single-core speed drifting (a VM's host, CPU frequency) between configurations."""
    return _spin_median(SPEED_PROBE_LOOPS, 7)


def calibrate_spin(target_s: float) -> tuple[int, float]:
    """Loops per call so that one ``spin`` takes about ``target_s``, and the median time of a
    call at that count: rescaled from the median of 15 calls until within 5% (at most 5 times;
    the first calls run before the interpreter has specialised the loop)."""
    loops = 1000
    per_call = _spin_median(loops, 15)
    for _ in range(5):
        loops = max(1, round(loops * target_s / per_call))
        per_call = _spin_median(loops, 15)
        if abs(per_call - target_s) <= 0.05 * target_s:
            break
    return loops, per_call


def make_image(k: int) -> np.ndarray:
    """A 224x224x3 uint8 image that compresses about 2.3:1 with zlib: 8x8 flat blocks of random
    colour plus one bit of noise."""
    rng = np.random.default_rng(k)
    low = rng.integers(0, 254, (IMAGE_SIDE // 8, IMAGE_SIDE // 8, 3), dtype=np.uint8)
    blocks = np.repeat(np.repeat(low, 8, axis=0), 8, axis=1)
    return blocks + rng.integers(0, 2, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8)


def encode_image(pixels: np.ndarray) -> bytes:
    if Image is not None:
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, format="PNG")
        return out.getvalue()
    return zlib.compress(pixels.tobytes(), 6)


def make_decode_samples(items: int) -> list[tuple[int, bytes]]:
    """``(index, payload)`` pairs; every sample holds its own bytes object (no pickle sharing)."""
    encoded = [encode_image(make_image(k)) for k in range(min(items, DISTINCT_IMAGES))]
    return [(i, bytes(bytearray(encoded[i % len(encoded)]))) for i in range(items)]


# -- checks ------------------------------------------------------------------------------------


def unpack_gil(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(batch, torch.Tensor) or batch.ndim != 2 or batch.shape[1] != 2:
        raise ValueError(f"malformed gil batch: {_describe(batch)}")
    return batch[:, 0], batch[:, 1]


def unpack_decode(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(batch, list | tuple) or len(batch) != 2:
        raise ValueError(f"malformed decode batch: {_describe(batch)}")
    images, indices = batch
    if (
        not isinstance(images, torch.Tensor)
        or not isinstance(indices, torch.Tensor)
        or images.dtype != torch.uint8
        or tuple(images.shape[1:]) != (3, CROP_SIDE, CROP_SIDE)
        or indices.shape != images.shape[:1]
    ):
        raise ValueError(f"malformed decode batch: {_describe(batch)}")
    return indices, torch.from_numpy(pixel_sums(images))


def pixel_sums(images: torch.Tensor) -> np.ndarray:
    """Per-image sums of a uint8 batch, by NumPy (single-threaded, whatever ``--main-threads``)."""
    sums: np.ndarray = images.numpy().reshape(images.shape[0], -1).sum(axis=1, dtype=np.int64)
    return sums


def _describe(batch: Any) -> str:
    if isinstance(batch, torch.Tensor):
        return f"tensor {tuple(batch.shape)} {batch.dtype}"
    if isinstance(batch, list | tuple):
        return f"{type(batch).__name__} of [{', '.join(_describe(b) for b in batch[:4])}]"
    return type(batch).__name__


@dataclass(frozen=True)
class Workload:
    """What a configuration loads: ``samples`` (aioloader's dataset as-is) and ``transform``;
    ``unpack`` turns a batch into (indices, per-sample values), checked against ``expected``
    (index -> value, for every index or a spread of them)."""

    name: str
    samples: Sequence[Any]
    transform: Callable[[Any], Any]
    batch_size: int
    unpack: Callable[[Any], tuple[torch.Tensor, torch.Tensor]]
    expected: dict[int, int]
    timeout: float

    @property
    def items(self) -> int:
        return len(self.samples)


@dataclass
class EpochCheck:
    """Collects one epoch's indices and values, batch by batch (batches are not kept)."""

    workload: Workload
    batches: int = 0
    indices: list[int] = field(default_factory=list)
    wrong: list[int] = field(default_factory=list)
    error: str | None = None

    def add(self, batch: Any) -> None:
        self.batches += 1
        if self.error is not None:
            return
        try:
            indices, values = self.workload.unpack(batch)
        except ValueError as exc:
            self.error = str(exc)
            return
        expected = self.workload.expected
        for index, value in zip(indices.tolist(), values.tolist(), strict=True):
            self.indices.append(index)
            if index in expected and expected[index] != value:
                self.wrong.append(index)

    def finish(self) -> str | None:
        if self.error is not None:
            return self.error
        items = self.workload.items
        if sorted(self.indices) != list(range(items)):
            seen = set(self.indices)
            missing = items - len(seen & set(range(items)))
            duplicates = len(self.indices) - len(seen)
            return (
                f"got {len(self.indices)} samples for {items} items: "
                f"{missing} missing, {duplicates} duplicated"
            )
        expected_batches = math.ceil(items / self.workload.batch_size)
        if self.batches != expected_batches:
            return f"got {self.batches} batches, expected {expected_batches}"
        if self.wrong:
            return f"{len(self.wrong)} samples transformed wrongly (first: index {self.wrong[0]})"
        return None


# -- peak RSS of this process and its descendants ----------------------------------------------


def _children_files_work() -> bool:
    pid = os.getpid()
    return Path(f"/proc/{pid}/task/{pid}/children").exists()


def descendants(root: int, by_children_file: bool) -> list[int]:
    """``root`` and every process below it."""
    if by_children_file:
        found, todo = [root], [root]
        while todo:
            pid = todo.pop()
            with contextlib.suppress(OSError):
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with contextlib.suppress(OSError):
                        text = Path(f"/proc/{pid}/task/{tid}/children").read_text()
                        for word in text.split():
                            found.append(int(word))
                            todo.append(int(word))
        return found
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            parents.setdefault(ppid, []).append(int(entry))
    found, todo = [root], [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def rss_kib(pid: int) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0  # gone, or a zombie


def _machine_busy_s() -> float:
    """CPU-seconds the whole machine has spent busy (all CPUs; steal included) since boot."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU used while the ``with`` block runs: ``main_s`` by this process (all its threads),
    ``children_s`` by its child processes (counted once they have exited and been reaped), and
    ``other`` the share of the machine's capacity used by every *other* process (other work on a
    shared machine makes every figure noisier)."""

    def __enter__(self) -> CpuMeter:
        self.main_s = self.children_s = self.other = math.nan
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
        capacity = wall * (os.cpu_count() or 1)
        other = busy - self.main_s - self.children_s
        self.other = max(0.0, other / capacity) if capacity > 0 else math.nan


class RssSampler:
    """Polls the summed VmRSS of this process and its descendants every ``POLL_S`` seconds in a
    background thread while the ``with`` block runs; ``peak_mib`` is the highest sum seen."""

    def __init__(self) -> None:
        self.root = os.getpid()
        self.by_children_file = _children_files_work()
        self.peak_kib = 0
        self.start_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def total_kib(self) -> int:
        return sum(rss_kib(pid) for pid in descendants(self.root, self.by_children_file))

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.peak_kib = max(self.peak_kib, self.total_kib())

    def __enter__(self) -> RssSampler:
        self.start_kib = self.peak_kib = self.total_kib()
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_kib = max(self.peak_kib, self.total_kib())

    @property
    def peak_mib(self) -> float:
        return self.peak_kib / 1024

    @property
    def start_mib(self) -> float:
        return self.start_kib / 1024


# -- the configurations ------------------------------------------------------------------------


@dataclass
class Timing:
    """``start``: before the loader is built; ``first``: first batch; ``ends``: epoch ends."""

    start: float = field(default_factory=time.perf_counter)
    first: float | None = None
    ends: list[float] = field(default_factory=list)


@dataclass
class Result:
    name: str
    items: int
    timing: Timing
    peak_mib: float = 0.0
    start_mib: float = 0.0
    main_cpu_s: float = math.nan
    worker_cpu_s: float = math.nan
    other_load: float = math.nan
    speed: float = math.nan
    error: str | None = None
    statistics: aioloader.LoaderStatistics | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def cold_per_s(self) -> float:
        t = self.timing
        return self.items / (t.ends[0] - t.start) if t.ends else 0.0

    @property
    def steady_per_s(self) -> float:
        t = self.timing
        return self.items / (t.ends[1] - t.ends[0]) if len(t.ends) > 1 else 0.0

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


def _wait_for_children(baseline: set[int], by_children_file: bool) -> set[int]:
    """Wait (up to ``EXIT_WAIT_S``) for processes started since ``baseline`` to exit; return
    those still there."""
    deadline = time.monotonic() + EXIT_WAIT_S
    while True:
        gc.collect()
        extra = {
            pid
            for pid in descendants(os.getpid(), by_children_file)
            if pid not in baseline and rss_kib(pid) > 0
        }
        if not extra or time.monotonic() > deadline:
            return extra
        time.sleep(0.05)


def measure(name: str, workload: Workload, reference_probe_s: float) -> Result:
    """Run one configuration (two epochs) under a watchdog that dumps every thread's stack and
    exits the process if it hangs well past ``workload.timeout``; sample RSS throughout."""
    errors: list[str] = []
    stats: aioloader.LoaderStatistics | None = None
    probe_before = speed_probe()
    by_children_file = _children_files_work()
    before = set(descendants(os.getpid(), by_children_file))
    faulthandler.dump_traceback_later(workload.timeout + 30, exit=True)
    with CpuMeter() as cpu, RssSampler() as rss:
        timing = Timing()
        try:
            stats = CONFIGS[name](workload, timing, errors)
        except Exception as exc:  # report it, go on with the other configurations
            errors.append(f"{type(exc).__qualname__}: {exc}")
        finally:
            faulthandler.cancel_dump_traceback_later()
        left = _wait_for_children(before, by_children_file)
    if left:
        errors.append(f"{len(left)} child processes still alive {EXIT_WAIT_S:g} s after closing")
    if not errors and len(timing.ends) != EPOCHS:
        errors.append(f"ran {len(timing.ends)} epochs, not {EPOCHS}")
    return Result(
        name,
        workload.items,
        timing,
        peak_mib=rss.peak_mib,
        start_mib=rss.start_mib,
        main_cpu_s=cpu.main_s,
        worker_cpu_s=cpu.children_s,
        other_load=cpu.other,
        speed=reference_probe_s / statistics.mean((probe_before, speed_probe())),
        error="; ".join(errors) or None,
        statistics=stats,
    )


# -- the pipe check ----------------------------------------------------------------------------


@dataclass
class PipeResult:
    per_job: float
    jobs: int
    error: str | None


def measure_pipe(timeout: float) -> PipeResult:
    """One 64x3x224x224 uint8 batch through one worker process: bytes back per job."""
    faulthandler.dump_traceback_later(timeout + 30, exit=True)
    try:
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
        return PipeResult(0.0, 0, f"{type(exc).__qualname__}: {exc}")
    finally:
        faulthandler.cancel_dump_traceback_later()
    expected = torch.arange(PIPE_BATCH, dtype=torch.uint8).view(-1, 1, 1, 1)
    if (
        len(batches) != 1
        or tuple(batches[0].shape) != (PIPE_BATCH, 3, IMAGE_SIDE, IMAGE_SIDE)
        or not bool((batches[0] == expected).all())
    ):
        got = ", ".join(_describe(b) for b in batches)
        return PipeResult(0.0, 0, f"wrong batches: {got}")
    workers = stats.workers
    if workers is None or workers.jobs == 0:
        return PipeResult(0.0, 0, f"no worker statistics: {workers}")
    per_job = workers.bytes_received / workers.jobs
    error = None
    if per_job > PIPE_MAX_FRACTION * PIPE_DATA_BYTES:
        error = f"{per_job:,.0f} bytes per job crossed the pipe: the pixels were pickled"
    return PipeResult(per_job, workers.jobs, error)


# -- output ------------------------------------------------------------------------------------


def _ratio(result: Result, baseline: Result | None) -> str:
    if baseline is None or not baseline.ok or not result.ok:
        return "-"
    if baseline.cold_per_s == 0 or baseline.steady_per_s == 0:
        return "-"
    return (
        f"{result.cold_per_s / baseline.cold_per_s:.2f}x/"
        f"{result.steady_per_s / baseline.steady_per_s:.2f}x"
    )


def format_table(results: Iterable[Result]) -> str:
    results = list(results)
    by_name = {r.name: r for r in results}
    header = (
        f"{'config':<17}{'cold/s':>9}{'steady/s':>10}{'1st batch s':>13}{'peak MiB':>10}"
        f"{'+MiB':>7}{'main CPU s':>12}{'workers CPU s':>15}{'other CPU':>11}{'speed':>7}"
        f"{'vs aio-nw1':>14}{'vs torch-nw2-spawn':>20}  check"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r.name:<17}{r.cold_per_s:>9,.0f}{r.steady_per_s:>10,.0f}{r.first_batch_s:>13.2f}"
            f"{r.peak_mib:>10,.0f}{r.peak_mib - r.start_mib:>7,.0f}{r.main_cpu_s:>12.1f}"
            f"{r.worker_cpu_s:>15.1f}{r.other_load:>11.0%}{r.speed:>7.2f}"
            + "".join(
                f"{_ratio(r, by_name.get(b)):>{w}}"
                for b, w in zip(BASELINES, (14, 20), strict=True)
            )
            + f"  {'ok' if r.ok else 'FAIL: ' + str(r.error)}"
        )
    lines.append(
        "(ratios: cold/steady samples/s of the row over the column's; CPU s: both epochs, "
        "start-up and shutdown included;\n other CPU: share of the machine's CPU used by other "
        "processes meanwhile; speed: single-core speed\n around the run over that at "
        "start-up (1.00 = the same))"
    )
    return "\n".join(lines)


def _job_bytes(stats: aioloader.LoaderStatistics) -> str:
    workers = stats.workers
    if workers is None or workers.jobs == 0:
        return "no worker jobs recorded"
    return (
        f"{workers.jobs} jobs: {workers.bytes_sent / workers.jobs:,.0f} bytes sent and "
        f"{workers.bytes_received / workers.jobs:,.0f} bytes received per job (batch)"
    )


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="aioloader vs torch DataLoader on CPU-heavy transforms (GIL-bound, decode)."
    )
    parser.add_argument(
        "--gil-items", type=int, default=None, help=f"gil samples (default {GIL_ITEMS})"
    )
    parser.add_argument(
        "--decode-items", type=int, default=None, help=f"decode samples (default {DECODE_ITEMS})"
    )
    parser.add_argument("--batch-size", type=int, default=32, help="samples per batch")
    parser.add_argument(
        "--main-threads",
        type=int,
        default=1,
        help="torch intra-op threads in this (the consumer's) process; workers of both loaders "
        "use 1 (default 1: on 2 cores, torch's OpenMP threads in the consumer stall on loaded "
        "cores, e.g. a 110 KB uint8 sum taking 15 ms instead of 0.1 ms)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke test: gil {QUICK_GIL_ITEMS} samples, decode {QUICK_DECODE_ITEMS}",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=["gil", "decode", "pipe"],
        metavar="WORKLOAD",
        help="workloads to run: gil, decode, pipe (default: all)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds one configuration may take (default: max(120, 4x its serial time))",
    )
    args = parser.parse_args(argv)
    if args.gil_items is None:
        args.gil_items = QUICK_GIL_ITEMS if args.quick else GIL_ITEMS
    if args.decode_items is None:
        args.decode_items = QUICK_DECODE_ITEMS if args.quick else DECODE_ITEMS
    if min(args.gil_items, args.decode_items, args.batch_size, args.main_threads) <= 0:
        parser.error(
            "--gil-items, --decode-items, --batch-size and --main-threads must be positive"
        )
    return args


def _timeout(args: argparse.Namespace, serial_s: float) -> float:
    return float(args.timeout or max(120.0, 4 * EPOCHS * serial_s))


def gil_workload(args: argparse.Namespace) -> Workload:
    loops, per_call = calibrate_spin(SPIN_TARGET_S)
    transform = SpinTransform(loops)
    items = args.gil_items
    expected = {i: spin(i, loops) for i in range(0, items, GIL_SPOT_EVERY)}
    serial = items * per_call
    print(
        f"gil: spin calibrated to {loops:,} loop rounds = {per_call * 1e3:.2f} ms per sample "
        f"(target {SPIN_TARGET_S * 1e3:g} ms); {items} samples, ~{serial:.1f} s serial per "
        f"epoch; {len(expected)} results recomputed to check",
        flush=True,
    )
    return Workload(
        name="gil",
        samples=list(range(items)),
        transform=transform,
        batch_size=args.batch_size,
        unpack=unpack_gil,
        expected=expected,
        timeout=_timeout(args, serial),
    )


def decode_workload(args: argparse.Namespace) -> Workload:
    items = args.decode_items
    start = time.perf_counter()
    samples = make_decode_samples(items)
    made = time.perf_counter() - start
    start = time.perf_counter()
    expected: dict[int, int] = {}
    for sample in samples:
        image, index = decode_sample(sample)
        expected[index] = int(pixel_sums(image[None])[0])
    per_sample = (time.perf_counter() - start) / items
    payload = sum(len(p) for _, p in samples)
    codec = "PNG via PIL" if Image is not None else "zlib + numpy.frombuffer (no PIL)"
    print(
        f"decode: {items} samples, {codec}, {payload / items / 1024:,.1f} KiB per encoded "
        f"{IMAGE_SIDE}x{IMAGE_SIDE}x3 image ({payload / 2**20:,.1f} MiB in all, made in "
        f"{made:.1f} s); transform {per_sample * 1e3:.2f} ms per sample serial "
        f"(~{items * per_sample:.1f} s per epoch); output 3x{CROP_SIDE}x{CROP_SIDE} uint8",
        flush=True,
    )
    return Workload(
        name="decode",
        samples=samples,
        transform=decode_sample,
        batch_size=args.batch_size,
        unpack=unpack_decode,
        expected=expected,
        timeout=_timeout(args, items * per_sample),
    )


def run_workload(workload: Workload, reference_probe_s: float) -> list[Result]:
    print(
        f"\n== {workload.name}: {workload.items} samples, batch {workload.batch_size}, "
        f"{EPOCHS} epochs per configuration ==",
        flush=True,
    )
    results: list[Result] = []
    for name in CONFIGS:
        result = measure(name, workload, reference_probe_s)
        results.append(result)
        status = "ok" if result.ok else f"FAIL: {result.error}"
        startup = ""
        if result.statistics is not None and result.statistics.workers is not None:
            startup = f"  workers up in {result.statistics.workers.startup_s:.2f} s"
        print(
            f"  done {name:<16} cold {result.cold_per_s:>7,.0f}/s  steady "
            f"{result.steady_per_s:>7,.0f}/s  1st batch {result.first_batch_s:5.2f} s  "
            f"peak {result.peak_mib:,.0f} MiB{startup}  {status}",
            flush=True,
        )
    print()
    print(f"{workload.name} ({workload.items} samples, batch {workload.batch_size}):")
    print(format_table(results))
    stats = next((r.statistics for r in results if r.name == STATS_CONFIG), None)
    if stats is not None:
        print()
        print(f"{workload.name} {STATS_CONFIG} statistics (both epochs):")
        print(repr(stats))
        print(f"pipe: {_job_bytes(stats)}")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    only: list[str] = args.only or ["gil", "decode", "pipe"]
    torch.set_num_threads(args.main_threads)
    load1, load5 = Path("/proc/loadavg").read_text().split()[:2]
    print(
        f"aioloader {aioloader.__version__}, torch {torch.__version__}, numpy {np.__version__}, "
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs (load average {load1} {load5}), "
        f"{torch.get_num_threads()} torch thread(s) in the main process",
        flush=True,
    )
    # Start multiprocessing's resource tracker now, so every configuration's RSS includes it.
    multiprocessing.resource_tracker.ensure_running()
    reference_probe_s = speed_probe()
    failed: list[str] = []
    builders = {"gil": gil_workload, "decode": decode_workload}
    for name in ("gil", "decode"):
        if name in only:
            results = run_workload(builders[name](args), reference_probe_s)
            failed.extend(f"{name}/{r.name}" for r in results if not r.ok)
    if "pipe" in only:
        pipe = measure_pipe(_timeout(args, 1.0))
        print()
        print(
            f"pipe: one {PIPE_BATCH}x3x{IMAGE_SIDE}x{IMAGE_SIDE} uint8 batch through 1 worker: "
            f"statistics().workers.bytes_received / jobs = {pipe.per_job:,.0f} bytes "
            f"({pipe.jobs} job); the batch's data is {PIPE_DATA_BYTES:,} bytes "
            f"({pipe.per_job / PIPE_DATA_BYTES:.5%} of it crossed the pipe)  "
            f"{'ok' if pipe.error is None else 'FAIL: ' + pipe.error}"
        )
        if pipe.error is not None:
            failed.append("pipe")
    if failed:
        print(f"\nFAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
