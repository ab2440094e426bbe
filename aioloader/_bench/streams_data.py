"""The shards workload's data (``streams.py`` measures it): its sizes, the JPEG samples written
into tar shards by webdataset's own writer, the decodes and collations (module level: worker
processes import them by name) and their checks. Never: runs a loader or a server.

Workload: ``--shards`` (default 16) shards of ``--samples-per-shard`` (default 1,000) samples:
16,000 samples, about 256 MiB of JPEGs in about 310 MiB of tar, written with
``webdataset.TarWriter`` into a temporary folder (removed at the end). Sample ``i`` of shard
``k`` has ``__key__`` ``f"{k:04d}/{i:06d}"``, a ``jpg`` member (a real JPEG made with Pillow: a
smooth random 112x112 RGB image plus +-64 of pixel noise, 4:4:4, the quality chosen at start-up
so that it is about ``--sample-kib`` KiB, default 16) and a ``cls`` member (the sample's global
index ``k * samples_per_shard + i`` in ASCII). Batches of ``--batch-size`` (default 32);
``--epochs`` (default 1) epochs.

Decodes (``--decode light|heavy|both``; default both, ``--quick``: light), module-level functions
of the sample dict returning ``(key, label, tensor)``:

* ``light``: ``int(cls)`` and the JPEG bytes as a 1-D uint8 tensor (``torch.frombuffer`` of a
  copy); collated to ``(keys, list of tensors, labels tensor)`` (the tensors differ in length);
* ``heavy``: Pillow decodes the JPEG, then a float32 CHW tensor normalised with ImageNet's
  mean and std; collated to ``(keys, stacked Nx3x112x112 tensor, labels tensor)``.

Each decode's serial cost per sample (over shard 0, on one thread) is printed at start-up.
"""

from __future__ import annotations

import io
import math
import re
import tarfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.data
import webdataset as wds
from PIL import Image

from aioloader._bench.harness import describe

SHARDS = 16
SAMPLES_PER_SHARD = 1000
QUICK_SHARDS = 4
QUICK_SAMPLES_PER_SHARD = 100
SAMPLE_KIB = 16
BATCH_SIZE = 32
LATENCY_S = 0.020
BANDWIDTH_MB_S = 50.0
TIMEOUT_S = 120.0  # per epoch
CHUNK = 64 * 1024  # the HTTP server's write size
IMAGE_SIDE = 112  # at SAMPLE_KIB; scaled with the square root of --sample-kib
NOISE = 64  # +- per pixel and channel
BUCKET = "bench"
REGION = "us-east-1"
S3_KEYS = "testing"
PROFILE_TOP = 25
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
SHARD_NAME = re.compile(r"shard-\d{4}\.tar")

Decoded = tuple[str, int, torch.Tensor]  # (key, label, image)
Batch = tuple[list[str], Any, torch.Tensor]  # (keys, list of tensors or one stacked, labels)


def shard_name(k: int) -> str:
    return f"shard-{k:04d}.tar"


def sample_key(shard: int, i: int) -> str:
    return f"{shard:04d}/{i:06d}"


# -- the data ----------------------------------------------------------------------------------


def make_jpeg(seed: int, side: int, quality: int) -> bytes:
    """A ``side`` x ``side`` RGB JPEG (4:4:4): a random 8x coarser image upscaled bicubic plus
    +-``NOISE`` of pixel noise, which is what makes it big."""
    rng = np.random.default_rng(seed)
    low = rng.integers(0, 256, (max(1, side // 8), max(1, side // 8), 3), dtype=np.uint8)
    smooth = Image.fromarray(low).resize((side, side), Image.Resampling.BICUBIC)
    noise = rng.integers(-NOISE, NOISE + 1, (side, side, 3))
    pixels = np.clip(np.asarray(smooth, dtype=np.int16) + noise, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=quality, subsampling=0)
    return out.getvalue()


def calibrate_jpeg(kib: float) -> tuple[int, int]:
    """(side, quality) whose JPEGs are closest to ``kib`` KiB: the side scaled from 112 px at
    16 KiB, the quality by bisection (size grows with quality)."""
    side = max(16, round(IMAGE_SIDE * math.sqrt(kib / SAMPLE_KIB) / 8) * 8)
    target = kib * 1024
    low, high = 5, 95
    while low < high:
        middle = (low + high) // 2
        if len(make_jpeg(0, side, middle)) < target:
            low = middle + 1
        else:
            high = middle
    below = max(5, low - 1)
    best = min((below, low), key=lambda q: abs(len(make_jpeg(0, side, q)) - target))
    return side, best


@dataclass(frozen=True)
class ShardSet:
    """The shards written to ``directory``; ``sizes[label]`` is sample ``label``'s JPEG size."""

    directory: Path
    shards: int
    per_shard: int
    side: int
    quality: int
    sizes: list[int]

    @property
    def total(self) -> int:
        return self.shards * self.per_shard

    @property
    def names(self) -> list[str]:
        return [shard_name(k) for k in range(self.shards)]

    def key(self, label: int) -> str:
        return sample_key(label // self.per_shard, label % self.per_shard)


def write_shards(directory: Path, shards: int, per_shard: int, kib: float) -> ShardSet:
    """Write the shards with ``webdataset.TarWriter``."""
    side, quality = calibrate_jpeg(kib)
    sizes: list[int] = []
    for k in range(shards):
        with (directory / shard_name(k)).open("wb") as stream:
            writer = wds.TarWriter(stream)
            try:
                for i in range(per_shard):
                    label = k * per_shard + i
                    jpg = make_jpeg(label, side, quality)
                    sizes.append(len(jpg))
                    writer.write({"__key__": sample_key(k, i), "jpg": jpg, "cls": label})
            finally:
                writer.close()
    return ShardSet(directory, shards, per_shard, side, quality, sizes)


# -- decodes and collation (module level: worker processes import them by name) ----------------


def decode_light(sample: Mapping[str, Any]) -> Decoded:
    """The label and the JPEG bytes as a 1-D uint8 tensor (a copy, so that it is writable)."""
    image = torch.frombuffer(bytearray(sample["jpg"]), dtype=torch.uint8)
    return sample["__key__"], int(sample["cls"]), image


def decode_heavy(sample: Mapping[str, Any]) -> Decoded:
    """Pillow decode, then a float32 CHW tensor normalised with ImageNet's mean and std."""
    with Image.open(io.BytesIO(sample["jpg"])) as image:
        pixels = np.array(image.convert("RGB"))
    chw = torch.from_numpy(pixels).permute(2, 0, 1).to(torch.float32).contiguous()
    return sample["__key__"], int(sample["cls"]), chw.div_(255).sub_(MEAN).div_(STD)


def collate_list(samples: Sequence[Decoded]) -> Batch:
    keys, labels, images = zip(*samples, strict=True)
    return list(keys), list(images), torch.tensor(labels, dtype=torch.int64)


def collate_stack(samples: Sequence[Decoded]) -> Batch:
    keys, labels, images = zip(*samples, strict=True)
    return list(keys), torch.stack(images), torch.tensor(labels, dtype=torch.int64)


def check_light(images: Any, labels: list[int], data: ShardSet) -> str | None:
    if not isinstance(images, list | tuple):
        return f"light images are a {type(images).__name__}, not a list"
    for image, label in zip(images, labels, strict=True):
        if not isinstance(image, torch.Tensor) or image.dtype != torch.uint8 or image.ndim != 1:
            return f"sample {label}: {describe(image)}, not a 1-D uint8 tensor"
        if image.numel() != data.sizes[label]:
            return f"sample {label}: {image.numel()} bytes, not {data.sizes[label]}"
    return None


def check_heavy(images: Any, labels: list[int], data: ShardSet) -> str | None:
    shape = (len(labels), 3, data.side, data.side)
    if not isinstance(images, torch.Tensor) or tuple(images.shape) != shape:
        return f"heavy images are {describe(images)}, not a {shape} tensor"
    if images.dtype != torch.float32 or not bool(torch.isfinite(images).all()):
        return f"heavy images are {images.dtype} or not finite"
    return None


@dataclass(frozen=True)
class Decoder:
    name: str
    transform: Callable[[Mapping[str, Any]], Decoded]
    collate: Callable[[Sequence[Decoded]], Batch]
    check_images: Callable[[Any, list[int], ShardSet], str | None]


DECODERS = {
    "light": Decoder("light", decode_light, collate_list, check_light),
    "heavy": Decoder("heavy", decode_heavy, collate_stack, check_heavy),
}


def decode_costs(data: ShardSet, decoders: Sequence[Decoder]) -> str:
    """Each decode's serial time per sample over shard 0, on this thread."""
    samples = list(tar_samples((data.directory / shard_name(0)).read_bytes()))
    costs = []
    for decoder in decoders:
        start = time.perf_counter()
        for sample in samples:
            decoder.transform(sample)
        per_sample = (time.perf_counter() - start) / len(samples)
        costs.append(f"{decoder.name} {per_sample * 1e3:.3f} ms")
    return f"decode per sample, serial: {', '.join(costs)}"


def _split_member(name: str) -> tuple[str, str]:
    """A member path -> (key, extension), split at the first dot of its last component."""
    folder, _, base = name.rpartition("/")
    stem, _, extension = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), extension


def tar_samples(data: bytes) -> Iterator[dict[str, Any]]:
    """The samples of a whole shard in memory, parsed with ``tarfile``."""
    sample: dict[str, Any] = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        for member in tar:
            if not member.isfile():
                continue
            key, extension = _split_member(member.name)
            if not extension:
                continue
            if sample and sample["__key__"] != key:
                yield sample
                sample = {}
            extracted = tar.extractfile(member)
            if extracted is None:  # not a regular file (a folder, a link): no sample data
                continue
            sample.setdefault("__key__", key)
            sample[extension] = extracted.read()
    if sample:
        yield sample
