"""The CPU workloads' data, transforms and checks (``cpu.py`` measures them): the sizes, the
transforms and torch datasets (module level: spawned workers import them by name), the data
made at start-up, and the checks every batch goes through. Never: runs a loader.

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
"""

from __future__ import annotations

import importlib
import io
import math
import random
import statistics
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.utils.data

from aioloader._bench.harness import delivery_error, describe

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
        return jpeg_crop(self.payloads[index % len(self.payloads)]), index


def jpeg_crop(payload: bytes) -> torch.Tensor:
    """dropin-jpeg's sample: ``payload`` decoded, cropped, flipped (see the dataset)."""
    with Image.open(io.BytesIO(payload)) as image:
        rgb = image.convert("RGB")
    box = random_resized_crop_box(*rgb.size)
    crop = rgb.resize((JPEG_CROP, JPEG_CROP), Image.Resampling.BILINEAR, box=box)
    if random.random() < 0.5:
        crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return torch.from_numpy(np.array(crop)).permute(2, 0, 1).contiguous()


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
