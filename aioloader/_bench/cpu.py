"""CPU-bound benchmark: aioloader's worker processes vs torch's DataLoader on compute-heavy work.

Two transform workloads, each a map-style dataset whose samples are cheap to fetch and expensive
to turn into tensors, batched ``--batch-size`` (default 32) at a time:

* ``gil``: 4,000 samples, each an ``int``; the transform runs ~2 ms of pure-Python arithmetic
  (a loop calibrated at start-up so one call takes about 2 ms on this machine) and returns a
  small int64 tensor ``[index, result]``. The GIL is held throughout, so only processes scale.
* ``decode``: 2,000 samples, each ``(index, encoded image)`` made once at start-up: PNG through
  PIL when PIL imports, else a NumPy stand-in (a zlib-compressed 224x224x3 uint8 array, about
  64 KB). The transform decodes it (``PIL.Image.open`` / ``zlib.decompress`` +
  ``numpy.frombuffer``), takes a 192x192 crop at an offset derived from the index, flips odd
  indices, and returns ``(3x192x192 uint8 CHW tensor, index)``.

Two drop-in workloads, each a ``torch.utils.data.Dataset`` doing all its work in
``__getitem__`` (no aioloader ``transform=``), as a torch user's dataset does:

* ``dropin-py``: 4,000 samples; ``__getitem__(i)`` runs the gil spin (the same calibration)
  and returns ``tensor([i, spin(i, loops)])``.
* ``dropin-jpeg``: 4,000 samples over 128 distinct 256x256 JPEGs (quality 90, about 18 KiB
  each) encoded once at start-up with Pillow and held in memory, sample ``i`` referencing image
  ``i % 128``; ``__getitem__`` decodes with Pillow, takes a random resized crop to 160x160
  (torchvision's ``RandomResizedCrop`` parameters, scale (0.08, 1), ratio (3/4, 4/3), drawn
  with Python's ``random``; bilinear), flips half the samples at random, and returns
  ``(3x160x160 uint8 CHW tensor, i)``. Needs Pillow (the ``bench`` extra).

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

Each transform configuration runs two epochs in one loader scope (aioloader: one ``async
with``; torch: ``persistent_workers=True`` when ``num_workers > 0``). Every configuration
reports:

* ``cold/s``: samples/s of epoch 1 timed from constructing the loader, so worker start-up is
  included;
* ``steady/s``: samples/s of epoch 2 (workers already up);
* ``1st batch s``: seconds from constructing the loader to the first batch;
* ``peak MiB``: the highest sum of VmRSS over this process and all its descendants, sampled
  every 50 ms from ``/proc`` by a background thread while the configuration runs (worker
  shutdown included; ``harness.MemorySampler``). Shared pages (shared-memory batches, fork's
  copy-on-write pages) count once per process that maps them, so this over-states what the
  machine actually spent; ``+MiB`` is that peak minus the same sum just before the
  configuration started;
* ``peak PSS`` / ``+PSS``: the same for the proportional set size (``Pss`` of
  ``/proc/<pid>/smaps_rollup``, what psutil's ``memory_full_info().pss`` reports: a shared page
  divided among the processes mapping it), sampled every 0.2 s;
* ``main CPU s`` / ``workers CPU s``: CPU-seconds of this process (the transform itself with
  ``num_workers=0``; otherwise the loader's own overhead plus the checks) and of its worker
  processes, over both epochs (reaped children only: aioloader's workers are children of its
  fork server, so they read 0 here and their CPU shows as ``other CPU``);
* ``other CPU``: the share of the machine's CPU used meanwhile by processes outside this
  benchmark (steal included): on a shared machine, rows with a high figure are slowed by it;
* before the configurations, one small aioloader loader with a worker starts the process-wide
  fork server (as the resource tracker is started), as a training script's first loader would:
  its start is in ``bench_startup.py``'s figures, not in a row here;
* ``speed``: the single-core speed just before and after the configuration (a fixed ``spin``)
  relative to start-up: a VM's vCPU can run at very different speeds from minute to minute.

The main process runs torch with ``--main-threads`` (default 1) intra-op threads, as both
loaders' workers do: on two loaded cores torch's OpenMP threads in the consumer stall.

Ratios are against ``aio-nw1`` and ``torch-nw2-spawn`` (drop-in: ``aio-nw0`` and
``torch-nw2-fork``), as cold/steady pairs. The statistics of ``aio-nw2`` are printed for each
workload (drop-in: of its last scope, after the second epoch), with the bytes per job that
crossed the worker pipes. Each drop-in workload then prints its goals beside the figures:
``aio-nw2`` over ``torch-nw2-fork`` samples/s >= 1.0x, over ``aio-nw0`` >= 1.8x (steady and
cold, each marked met or MISSED), over ``torch-nw2-spawn`` for reference, and peak PSS of
``aio-nw2`` over ``torch-nw2-fork`` <= 1.2x. A missed goal is reported, not a failure.

A last check (``pipe``) sends one 64x3x224x224 uint8 batch (9,633,792 bytes of pixels) through
one aioloader worker and prints ``statistics().workers.bytes_received / jobs``: what crossed the
pipe for that batch, which should be a few shared-memory handles, not the pixels.

Every epoch is checked: each index delivered exactly once, the right number of batches, well
formed batches, and the output right (every pixel sum for ``decode``, a spread of recomputed
results for ``gil`` and ``dropin-py``, for ``dropin-jpeg`` every crop's channel means within 12
levels of its image's base colour: the crop is random); worker processes must be gone once a
loader is closed (or dropped). The script exits non-zero when a check fails or a configuration
raises or times out.

Run it from the repository root::

    python benchmarks/bench_cpu.py            # the full run (~5.5 min on 2 cores)
    python benchmarks/bench_cpu.py --quick    # a smoke test (gil 640 samples, decode 320,
                                              # each drop-in 640: those rows ~45 s)
    python benchmarks/bench_cpu.py --only gil
    python benchmarks/bench_cpu.py --quick --only dropin-py dropin-jpeg
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import io
import math
import multiprocessing.resource_tracker
import os
import random
import statistics
import sys
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.utils.data

import aioloader
from aioloader._bench.harness import (
    EXIT_WAIT_S,
    Column,
    MemorySampler,
    Result,
    add_batch_size,
    add_only,
    add_quick,
    add_timeout,
    cpus_and_load,
    delivery_error,
    describe,
    error_text,
    exit_status,
    format_table,
    machine_ticks,
    process_tree,
    quick_defaults,
    ratio_to,
    report,
    versions,
    wait_for_children,
    watchdog,
)

Image: Any  # PIL.Image when PIL is installed (PNG), else None (the NumPy/zlib stand-in)
try:
    Image = importlib.import_module("PIL.Image")
except ImportError:  # pragma: no cover - depends on the environment
    Image = None

GIL_ITEMS = 4000
DECODE_ITEMS = 2000
DROPIN_PY_ITEMS = 4000
DROPIN_JPEG_ITEMS = 4000
QUICK_GIL_ITEMS = 640
QUICK_DECODE_ITEMS = 320
QUICK_DROPIN_ITEMS = 640  # each drop-in workload under --quick
SPIN_TARGET_S = 0.002  # pure-Python work per gil sample
GIL_SPOT_EVERY = 37  # recompute the gil result of every 37th index to check it
IMAGE_SIDE = 224
CROP_SIDE = 192
DISTINCT_IMAGES = 128  # images encoded at start-up; every sample holds its own copy
JPEG_SIDE = 256  # dropin-jpeg: the encoded images
JPEG_CROP = 160  # dropin-jpeg: the output of the random resized crop
JPEG_QUALITY = 90
JPEG_TOLERANCE = 12  # most a crop's channel mean may differ from its image's base colour
EPOCHS = 2
SPEED_PROBE_LOOPS = 4000
PIPE_BATCH = 64
PIPE_DATA_BYTES = PIPE_BATCH * 3 * IMAGE_SIDE * IMAGE_SIDE  # 9,633,792
PIPE_MAX_FRACTION = 0.01  # more than 1% of the pixels through the pipe: they were pickled
WORKLOADS = ("gil", "decode", "dropin-py", "dropin-jpeg", "pipe")


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


class Samples(Protocol):
    """A workload's samples: a sequence, or a drop-in workload's torch ``Dataset``."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> Any: ...


class TransformedDataset(torch.utils.data.Dataset[Any]):
    """torch's side: ``__getitem__`` applies the transform to the stored sample."""

    def __init__(self, samples: Samples, transform: Callable[[Any], Any]) -> None:
        self.samples = samples
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Any:
        return self.transform(self.samples[index])


class DropinSpinDataset(torch.utils.data.Dataset[torch.Tensor]):
    """dropin-py: a torch ``Dataset`` doing the gil work in ``__getitem__``: ``i`` ->
    ``tensor([i, spin(i, loops)])``."""

    def __init__(self, items: int, loops: int) -> None:
        self.items = items
        self.loops = loops

    def __len__(self) -> int:
        return self.items

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, spin(index, self.loops)], dtype=torch.int64)


def random_resized_crop_box(
    width: int,
    height: int,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> tuple[int, int, int, int]:
    """torchvision's ``RandomResizedCrop.get_params`` drawn with Python's ``random``: the crop as
    a Pillow box ``(left, top, right, bottom)``."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * random.uniform(*scale)
        aspect = math.exp(random.uniform(*log_ratio))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = random.randint(0, height - h)
            left = random.randint(0, width - w)
            return left, top, left + w, top + h
    in_ratio = width / height  # fallback: the centre crop
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        w, h = round(height * max(ratio)), height
    else:
        w, h = width, height
    top, left = (height - h) // 2, (width - w) // 2
    return left, top, left + w, top + h


class DropinJpegDataset(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """dropin-jpeg: a torch ``Dataset`` over JPEG bytes held in memory (sample ``i`` references
    ``payloads[i % len(payloads)]``); ``__getitem__`` decodes with Pillow, takes a random resized
    crop to 160x160 (bilinear), flips half the samples, and returns ``(3x160x160 uint8 CHW
    tensor, i)``: torchvision's ``RandomResizedCrop(160)`` + ``RandomHorizontalFlip()`` +
    ``PILToTensor()`` written with Pillow and NumPy."""

    def __init__(self, payloads: Sequence[bytes], items: int) -> None:
        self.payloads = list(payloads)
        self.items = items

    def __len__(self) -> int:
        return self.items

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        payload = self.payloads[index % len(self.payloads)]
        with Image.open(io.BytesIO(payload)) as image:
            rgb = image.convert("RGB")
        box = random_resized_crop_box(*rgb.size)
        crop = rgb.resize((JPEG_CROP, JPEG_CROP), Image.Resampling.BILINEAR, box=box)
        if random.random() < 0.5:
            crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        chw = torch.from_numpy(np.array(crop)).permute(2, 0, 1).contiguous()
        return chw, index


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


def make_jpeg(k: int) -> tuple[bytes, np.ndarray]:
    """A 256x256 JPEG (quality 90, about 18 KiB) and its base colour: the colour plus a smooth
    pattern (a random 32x32 grid upscaled bicubic, +-40) plus +-8 of pixel noise, so that any
    crop's channel means stay within a few levels of the base colour."""
    rng = np.random.default_rng(1000 + k)
    base = rng.integers(64, 193, 3)
    grid = rng.integers(88, 169, (JPEG_SIDE // 8, JPEG_SIDE // 8, 3), dtype=np.uint8)
    smooth = Image.fromarray(grid).resize((JPEG_SIDE, JPEG_SIDE), Image.Resampling.BICUBIC)
    noise = rng.integers(-8, 9, (JPEG_SIDE, JPEG_SIDE, 3))
    pixels = np.clip(base + (np.asarray(smooth, dtype=np.int16) - 128) + noise, 0, 255)
    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(out, format="JPEG", quality=JPEG_QUALITY)
    return out.getvalue(), base


# -- checks ------------------------------------------------------------------------------------


def unpack_gil(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(batch, torch.Tensor) or batch.ndim != 2 or batch.shape[1] != 2:
        raise ValueError(f"malformed gil batch: {describe(batch)}")
    return batch[:, 0], batch[:, 1]


def unpack_decode(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(batch, list | tuple) or len(batch) != 2:
        raise ValueError(f"malformed decode batch: {describe(batch)}")
    images, indices = batch
    if (
        not isinstance(images, torch.Tensor)
        or not isinstance(indices, torch.Tensor)
        or images.dtype != torch.uint8
        or tuple(images.shape[1:]) != (3, CROP_SIDE, CROP_SIDE)
        or indices.shape != images.shape[:1]
    ):
        raise ValueError(f"malformed decode batch: {describe(batch)}")
    return indices, torch.from_numpy(pixel_sums(images))


def unpack_jpeg(bases: np.ndarray, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """dropin-jpeg: value 1 where every channel mean of the crop is within ``JPEG_TOLERANCE`` of
    its image's base colour (``bases[index % len(bases)]``), else 0 (the crop is random, so the
    pixels cannot be checked exactly)."""
    if not isinstance(batch, list | tuple) or len(batch) != 2:
        raise ValueError(f"malformed dropin-jpeg batch: {describe(batch)}")
    images, indices = batch
    if (
        not isinstance(images, torch.Tensor)
        or not isinstance(indices, torch.Tensor)
        or images.dtype != torch.uint8
        or tuple(images.shape[1:]) != (3, JPEG_CROP, JPEG_CROP)
        or indices.shape != images.shape[:1]
    ):
        raise ValueError(f"malformed dropin-jpeg batch: {describe(batch)}")
    means = images.numpy().reshape(images.shape[0], 3, -1).mean(axis=2)
    expected = bases[indices.numpy() % len(bases)]
    close = (np.abs(means - expected) <= JPEG_TOLERANCE).all(axis=1)
    return indices, torch.from_numpy(close.astype(np.int64))


def pixel_sums(images: torch.Tensor) -> np.ndarray:
    """Per-image sums of a uint8 batch, by NumPy (single-threaded, whatever ``--main-threads``)."""
    sums: np.ndarray = images.numpy().reshape(images.shape[0], -1).sum(axis=1, dtype=np.int64)
    return sums


@dataclass(frozen=True)
class Workload:
    """What a configuration loads: ``samples`` (aioloader's dataset as-is) and ``transform``
    (None for a drop-in workload, whose ``samples`` is a torch ``Dataset`` doing all the work);
    ``unpack`` turns a batch into (indices, per-sample values), checked against ``expected``
    (index -> value, for every index or a spread of them)."""

    name: str
    samples: Samples
    transform: Callable[[Any], Any] | None
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
        expected_batches = math.ceil(items / self.workload.batch_size)
        error = delivery_error(self.indices, items, self.batches, expected_batches)
        if error is not None:
            return error
        if self.wrong:
            return f"{len(self.wrong)} samples transformed wrongly (first: index {self.wrong[0]})"
        return None


# -- CPU used meanwhile ------------------------------------------------------------------------


def _machine_busy_s() -> float:
    """CPU-seconds the whole machine has spent busy (all CPUs; steal included) since boot."""
    return machine_ticks()[0] / os.sysconf("SC_CLK_TCK")


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
}
DROPIN_BASELINES = ("aio-nw0", "torch-nw2-fork")
# The drop-in goals: (row, over row, "samples/s" or "PSS", goal, higher is better)
DROPIN_GOALS = (
    ("aio-nw2", "torch-nw2-fork", "samples/s", 1.0, True),
    ("aio-nw2", "torch-nw2-spawn", "samples/s", None, True),
    ("aio-nw2", "aio-nw0", "samples/s", 1.8, True),
    ("aio-nw2", "torch-nw2-fork", "peak PSS", 1.2, False),
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
    result = CpuResult(
        name,
        workload.items,
        timing=timing,
        main_cpu_s=cpu.main_s,
        worker_cpu_s=cpu.children_s,
        other_load=cpu.other,
        speed=reference_probe_s / statistics.mean((probe_before, speed_probe())),
        error="; ".join(errors) or None,
        statistics=stats,
    )
    result.record_memory(memory)
    # Two lower bounds of the tree's CPU time: this process's and its reaped children's (torch's
    # workers, to their exit; not aioloader's, which its fork server reaps) and the one sampled
    # over the whole tree (every worker, less each one's last poll before it exits).
    result.cpu_s = max(cpu.main_s + cpu.children_s, memory.cpu_s)
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


# -- output ------------------------------------------------------------------------------------


def format_results(results: Iterable[CpuResult], baselines: Sequence[str] = BASELINES) -> str:
    results = list(results)
    columns: list[Column[CpuResult]] = [
        Column("cold/s", 9, lambda r: f"{r.cold_per_s:,.0f}"),
        Column("steady/s", 10, lambda r: f"{r.steady_per_s:,.0f}"),
        Column("1st batch s", 13, lambda r: f"{r.first_batch_s:.2f}"),
        Column("peak MiB", 10, lambda r: f"{r.peak_rss_mib:,.0f}"),
        Column("+MiB", 7, lambda r: f"{r.peak_rss_mib - r.start_rss_mib:,.0f}"),
        Column("peak PSS", 10, lambda r: f"{r.peak_pss_mib:,.0f}"),
        Column("+PSS", 7, lambda r: f"{r.peak_pss_mib - r.start_pss_mib:,.0f}"),
        Column("main CPU s", 12, lambda r: f"{r.main_cpu_s:.1f}"),
        Column("workers CPU s", 15, lambda r: f"{r.worker_cpu_s:.1f}"),
        Column("other CPU", 11, lambda r: f"{r.other_load:.0%}"),
        Column("speed", 7, lambda r: f"{r.speed:.2f}"),
    ]
    for peer in baselines:
        cold_steady = ratio_to(results, peer, lambda r: r.cold_per_s, lambda r: r.steady_per_s)
        columns.append(Column(f"vs {peer}", max(14, len(peer) + 5), cold_steady))
    note = (
        "(ratios: cold/steady samples/s of the row over the column's; MiB: summed RSS, PSS: "
        "summed proportional set size,\n both in MiB over this process and its workers, "
        "+: peak minus the sum before the row;\n CPU s: both epochs, start-up and shutdown "
        "included; other CPU: share of the machine's CPU used by other\n processes "
        "meanwhile; speed: single-core speed around the run over that at start-up (1.00 = the "
        "same))"
    )
    return format_table(results, 17, columns, lambda r: r.status, note=note)


def _verdict(value: float, goal: float | None, higher_is_better: bool) -> str:
    if goal is None:
        return "(no goal)"
    if math.isnan(value):
        return "n/a"
    met = value >= goal if higher_is_better else value <= goal
    return "met" if met else "MISSED"


def format_goals(results: Iterable[CpuResult]) -> str:
    """The drop-in goals, each ratio beside its goal: samples/s as steady and cold (cold
    includes constructing the loader and starting its workers), peak PSS as is."""
    by_name = {r.name: r for r in results}
    lines = []
    for row, over, what, goal, higher in DROPIN_GOALS:
        a, b = by_name.get(row), by_name.get(over)
        label = f"  {what:<10} {row} / {over}"
        sign = ">=" if higher else "<="
        goal_text = f"goal {sign} {goal:.1f}x" if goal is not None else "(for reference)"
        if a is None or b is None or not a.ok or not b.ok:
            lines.append(f"{label:<44} n/a (a row is missing or failed)")
            continue
        if what == "peak PSS":
            value = a.peak_pss_mib / b.peak_pss_mib if b.peak_pss_mib else math.nan
            figures = f"{value:.2f}x ({a.peak_pss_mib:,.0f} / {b.peak_pss_mib:,.0f} MiB)"
            verdict = _verdict(value, goal, higher)
        else:
            steady = a.steady_per_s / b.steady_per_s if b.steady_per_s else math.nan
            cold = a.cold_per_s / b.cold_per_s if b.cold_per_s else math.nan
            figures = f"steady {steady:.2f}x, cold {cold:.2f}x"
            verdict = (
                f"steady {_verdict(steady, goal, higher)}, cold {_verdict(cold, goal, higher)}"
                if goal is not None
                else ""
            )
        lines.append(f"{label:<44} {figures:<30} {goal_text:<16} {verdict}".rstrip())
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
    parser.add_argument(
        "--dropin-py-items",
        type=int,
        default=None,
        help=f"dropin-py samples (default {DROPIN_PY_ITEMS})",
    )
    parser.add_argument(
        "--dropin-jpeg-items",
        type=int,
        default=None,
        help=f"dropin-jpeg samples (default {DROPIN_JPEG_ITEMS})",
    )
    add_batch_size(parser)
    parser.add_argument(
        "--main-threads",
        type=int,
        default=1,
        help="torch intra-op threads in this (the consumer's) process; workers of both loaders "
        "use 1 (default 1: on 2 cores, torch's OpenMP threads in the consumer stall on loaded "
        "cores, e.g. a 110 KB uint8 sum taking 15 ms instead of 0.1 ms)",
    )
    add_quick(
        parser,
        f"smoke test: gil {QUICK_GIL_ITEMS} samples, decode {QUICK_DECODE_ITEMS}, each "
        f"drop-in workload {QUICK_DROPIN_ITEMS}",
    )
    add_only(
        parser,
        WORKLOADS,
        metavar="WORKLOAD",
        help=f"workloads to run: {', '.join(WORKLOADS)} (default: all)",
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        metavar="CONFIG",
        choices=sorted({*CONFIGS, *DROPIN_CONFIGS}),
        help="run only these configurations (default: all of each workload's)",
    )
    add_timeout(
        parser, "seconds one configuration may take (default: max(120, 4x its serial time))"
    )
    args = parser.parse_args(argv)
    quick_defaults(
        args,
        gil_items=(QUICK_GIL_ITEMS, GIL_ITEMS),
        decode_items=(QUICK_DECODE_ITEMS, DECODE_ITEMS),
        dropin_py_items=(QUICK_DROPIN_ITEMS, DROPIN_PY_ITEMS),
        dropin_jpeg_items=(QUICK_DROPIN_ITEMS, DROPIN_JPEG_ITEMS),
    )
    sizes = (args.gil_items, args.decode_items, args.dropin_py_items, args.dropin_jpeg_items)
    if min(*sizes, args.batch_size, args.main_threads) <= 0:
        parser.error("the --*-items, --batch-size and --main-threads must be positive")
    return args


def _timeout(args: argparse.Namespace, serial_s: float) -> float:
    return float(args.timeout or max(120.0, 4 * EPOCHS * serial_s))


@functools.cache
def spin_calibration() -> tuple[int, float]:
    """``calibrate_spin(SPIN_TARGET_S)``, once for gil and dropin-py."""
    return calibrate_spin(SPIN_TARGET_S)


def gil_workload(args: argparse.Namespace) -> Workload:
    loops, per_call = spin_calibration()
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


def dropin_py_workload(args: argparse.Namespace) -> Workload:
    loops, per_call = spin_calibration()
    items = args.dropin_py_items
    expected = {i: spin(i, loops) for i in range(0, items, GIL_SPOT_EVERY)}
    serial = items * per_call
    print(
        f"dropin-py: a torch Dataset whose __getitem__ runs the gil spin ({loops:,} loop rounds "
        f"= {per_call * 1e3:.2f} ms); {items} samples, ~{serial:.1f} s serial per epoch; "
        f"{len(expected)} results recomputed to check",
        flush=True,
    )
    return Workload(
        name="dropin-py",
        samples=DropinSpinDataset(items, loops),
        transform=None,
        batch_size=args.batch_size,
        unpack=unpack_gil,
        expected=expected,
        timeout=_timeout(args, serial),
    )


def dropin_jpeg_workload(args: argparse.Namespace) -> Workload:
    items = args.dropin_jpeg_items
    start = time.perf_counter()
    made = [make_jpeg(k) for k in range(min(items, DISTINCT_IMAGES))]
    payloads = [payload for payload, _ in made]
    bases = np.stack([base for _, base in made])
    encode_s = time.perf_counter() - start
    dataset = DropinJpegDataset(payloads, items)
    state = random.getstate()
    random.seed(0)
    start = time.perf_counter()
    probe = min(items, 256)
    for i in range(probe):
        dataset[i]
    per_sample = (time.perf_counter() - start) / probe
    random.setstate(state)
    kib = sum(len(p) for p in payloads) / len(payloads) / 1024
    print(
        f"dropin-jpeg: a torch Dataset over {len(payloads)} distinct {JPEG_SIDE}x{JPEG_SIDE} "
        f"JPEGs in memory (quality {JPEG_QUALITY}, {kib:,.1f} KiB each, encoded in "
        f"{encode_s:.1f} s); __getitem__: Pillow decode, random resized crop to "
        f"{JPEG_CROP}x{JPEG_CROP}, random flip, CHW uint8 tensor: {per_sample * 1e3:.2f} ms per "
        f"sample serial; {items} samples, ~{items * per_sample:.1f} s per epoch; every crop's "
        f"channel means checked against its image's colour (+-{JPEG_TOLERANCE})",
        flush=True,
    )
    return Workload(
        name="dropin-jpeg",
        samples=dataset,
        transform=None,
        batch_size=args.batch_size,
        unpack=functools.partial(unpack_jpeg, bases),
        expected=dict.fromkeys(range(items), 1),
        timeout=_timeout(args, items * per_sample),
    )


def run_workload(
    workload: Workload,
    configs: dict[str, Runner],
    baselines: Sequence[str],
    reference_probe_s: float,
) -> list[CpuResult]:
    dropin = workload.transform is None
    print(
        f"\n== {workload.name}: {workload.items} samples, batch {workload.batch_size}, "
        f"{EPOCHS} epochs per configuration"
        + (" (drop-in: plain `for` over the loader, persistent_workers=True)" if dropin else "")
        + " ==",
        flush=True,
    )
    results: list[CpuResult] = []
    for name, runner in configs.items():
        result = measure(name, runner, workload, reference_probe_s)
        results.append(result)
        report(workload.name, result)
        startup = ""
        if result.statistics is not None and result.statistics.workers is not None:
            startup = f"  workers up in {result.statistics.workers.startup_s:.2f} s"
        print(
            f"  done {name:<16} cold {result.cold_per_s:>7,.0f}/s  steady "
            f"{result.steady_per_s:>7,.0f}/s  1st batch {result.first_batch_s:5.2f} s  "
            f"peak {result.peak_rss_mib:,.0f} MiB RSS, {result.peak_pss_mib:,.0f} MiB PSS"
            f"{startup}  {result.status}",
            flush=True,
        )
    print()
    print(f"{workload.name} ({workload.items} samples, batch {workload.batch_size}):")
    print(format_results(results, baselines))
    if dropin:
        print()
        print(f"{workload.name} goals (aio-nw2: aioloader.DataLoader, num_workers=2):")
        print(format_goals(results))
    stats = next((r.statistics for r in results if r.name == STATS_CONFIG), None)
    if stats is not None:
        print()
        which = "after the second epoch" if dropin else "both epochs"
        print(f"{workload.name} {STATS_CONFIG} statistics ({which}):")
        print(repr(stats))
        print(f"pipe: {_job_bytes(stats)}")
    return results


def _chosen(configs: dict[str, Runner], names: Sequence[str] | None) -> dict[str, Runner]:
    """``configs`` less those ``--configs`` did not name (all of them without the flag)."""
    return {n: r for n, r in configs.items() if names is None or n in names}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    only: list[str] = args.only or list(WORKLOADS)
    torch.set_num_threads(args.main_threads)
    print(
        f"{versions('torch', 'numpy', where=True)}, {cpus_and_load()}, "
        f"{torch.get_num_threads()} torch thread(s) in the main process",
        flush=True,
    )
    # Start multiprocessing's resource tracker now, so every configuration's RSS includes it.
    multiprocessing.resource_tracker.ensure_running()
    # Likewise aioloader's process-wide fork server: a first loader with workers starts it (a
    # fork of this process, as no other thread runs yet), as a training script's first loader
    # would. Its start is in bench_startup.py's figures, not in a configuration's here.
    warm_up: aioloader.DataLoader[Any]
    with aioloader.DataLoader(list(range(4)), batch_size=2, num_workers=1) as warm_up:
        list(warm_up)
    reference_probe_s = speed_probe()
    failed: list[str] = []
    builders = {"gil": gil_workload, "decode": decode_workload}
    for name in ("gil", "decode"):
        if name in only:
            configs = _chosen(CONFIGS, args.configs)
            results = run_workload(builders[name](args), configs, BASELINES, reference_probe_s)
            failed.extend(f"{name}/{r.name}" for r in results if not r.ok)
    dropins = {"dropin-py": dropin_py_workload, "dropin-jpeg": dropin_jpeg_workload}
    for name, build in dropins.items():
        if name not in only:
            continue
        if name == "dropin-jpeg" and Image is None:
            print("\ndropin-jpeg: needs Pillow (pip install -e '.[bench]'); not run", flush=True)
            failed.append(name)
            continue
        configs = _chosen(DROPIN_CONFIGS, args.configs)
        results = run_workload(build(args), configs, DROPIN_BASELINES, reference_probe_s)
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
    return exit_status(failed)


if __name__ == "__main__":
    sys.exit(main())
