"""Streaming benchmark: WebDataset-style tar shards read from remote storage by webdataset's own
pipeline, by a plain asyncio loop and by ``aioloader.sources.tar_shards``, each configuration in
a fresh process of its own.

Workload: ``--shards`` (default 16) shards of ``--samples-per-shard`` (default 1,000) samples:
16,000 samples, about 256 MiB of JPEGs in about 310 MiB of tar, written with
``webdataset.TarWriter`` into a temporary folder (removed at the end). Sample ``i`` of shard
``k`` has ``__key__`` ``f"{k:04d}/{i:06d}"``, a ``jpg`` member (a real JPEG made with Pillow: a
smooth random 112x112 RGB image plus +-64 of pixel noise, 4:4:4, the quality chosen at start-up
so that it is about ``--sample-kib`` KiB, default 16) and a ``cls`` member (the sample's global
index ``k * samples_per_shard + i`` in ASCII). Batches of ``--batch-size`` (default 32);
``--epochs`` (default 1) epochs.

Servers, each in a subprocess of its own on ``127.0.0.1`` (port 0, reported through a pipe, up for
the whole run, stopped at its end, or when this process dies):

* an aiohttp server of the shard files at ``/shard-{k:04d}.tar``: ``--latency`` (default 20 ms)
  of ``await asyncio.sleep`` before each response starts, then the body streamed in 64 KiB
  chunks, each response paced to at most ``--bandwidth`` (default 50 MB/s; 0: no cap). It sends
  ``Content-Length``, an ``ETag`` and ``Accept-Ranges``, and answers ``Range: bytes=N-`` with
  206 and ``Content-Range`` (``If-Range`` honoured), as aioloader's resumption needs;
* moto's S3 server (``ThreadedMotoServer``), the shards uploaded with boto3 to bucket ``bench``
  with ``ACL="public-read"``: moto refuses an anonymous GET of a private object (403, empty
  body), and webdataset's curl sends no credentials. No latency or bandwidth cap there. Needs
  ``moto[server]`` (the ``dev`` extra); without it the S3 rows are skipped.

Configurations, each reading every sample once per epoch, for each decode:

* ``wds-nw2``, ``wds-nw8``: what the webdataset documentation recommends: ``wds.WebDataset(urls,
  shardshuffle=False, workersplitter=wds.split_by_worker, empty_check=False).map(decode)
  .batched(batch_size, collation_fn=collate)`` (batching inside each worker), iterated through
  ``torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=N)`` (what
  ``wds.WebLoader`` wraps; fork context, torch's default), the same loader for every epoch,
  with ``persistent_workers=True`` when ``--epochs`` > 1. Each worker reads its shards
  (``urls[w::N]``) one after another through a ``curl`` subprocess; with 2 workers 2 shards are
  open at a time, with 8 workers 8. Each worker ends with a partial batch, so there are more
  batches than ``ceil(samples / batch_size)``: the check expects that exact number.
  ``empty_check=False`` because a worker without a shard (``--quick``: 4 shards, 8 workers)
  otherwise raises ``ValueError: No samples found``.
* ``asyncio-ref``: the plain asyncio code a competent engineer writes: one
  ``aiohttp.ClientSession`` for all epochs; each epoch fetches every shard at once
  (``asyncio.gather``), each read whole into ``bytes``, then, shard by shard, parses it with the
  standard library's ``tarfile`` (from ``io.BytesIO``), groups members into samples by key,
  decodes them on the event loop's thread and batches them.
* ``aio-nw0``: ``aioloader.DataLoader(aioloader.sources.tar_shards(urls), batch_size=32,
  transform=decode, collate_fn=collate, num_workers=0)``; ``async with loader:`` around one
  ``async for`` per epoch, under ``asyncio.run``: transform and collation on a thread of the
  loader's own. ``shards_in_flight`` is not passed (the source's default).
* ``aio-nw2``: the same with ``num_workers=2`` and ``persistent_workers=True`` (transform and
  collation in aioloader's worker processes, batches back through shared memory).
* ``aio-nw0-k{K}``: ``aio-nw0`` with ``tar_shards(urls, shards_in_flight=K)``, one row for each
  ``--in-flight K`` given (skipped where ``TarShards`` has no such parameter).
* ``aio-s3-nw0``: ``aio-nw0`` over ``s3://bench/shard-{k:04d}.tar`` on the moto server
  (``config``: endpoint, region ``us-east-1``, access keys ``testing``; ``client_options=
  {"allow_http": True}``), read through obstore.
* ``wds-s3-nw8``: ``wds-nw8`` over moto's plain path-style URLs
  ``http://127.0.0.1:PORT/bench/shard-{k:04d}.tar``.

Decodes (``--decode light|heavy|both``; default both, ``--quick``: light), module-level functions
of the sample dict returning ``(key, label, tensor)``:

* ``light``: ``int(cls)`` and the JPEG bytes as a 1-D uint8 tensor (``torch.frombuffer`` of a
  copy); collated to ``(keys, list of tensors, labels tensor)`` (the tensors differ in length);
* ``heavy``: Pillow decodes the JPEG, then a float32 CHW tensor normalised with ImageNet's
  mean and std; collated to ``(keys, stacked Nx3x112x112 tensor, labels tensor)``.

Each decode's serial cost per sample (over shard 0, on one thread) is printed at start-up.

How a configuration runs: each row of each decode runs in a child process of its own, forked
from a server that has only imported this module (``harness.run_in_child``), one after another,
the servers staying up. No row
inherits the heap an earlier one grew. Every child has the same baseline: it imports this
script's modules (torch, NumPy, Pillow, aiohttp, webdataset, aioloader and its sources) and
obstore where installed, sets torch to one intra-op thread (as both loaders' workers run), and
collects garbage; then it tells this process it is ready and waits. This process reads the
child's PSS (``base PSS``), starts sampling the memory of the child's process tree, and tells it
to go: the child's clock starts, it builds the loader, runs the epochs, stops the loader, and
sends back its timings and its check. It then waits up to 15 s for every process it started to
exit (aioloader's fork server aside: it lives as long as the child), kills those left, reports
them, and exits. This process only writes the shards, runs the servers, starts the children,
enforces the timeout and prints the tables.

Measured per configuration:

* ``samples/s``: the samples of all epochs / the wall time from building the loader to its end
  (start-up and shutdown of workers, fork server, sessions and connections included);
* ``first batch s``: from building the loader to the first batch;
* ``steady samples/s``: the samples after the first batch / the time from the first batch to the
  end (the loader's shutdown included);
* ``base PSS MiB``: the child's PSS after its imports, before its clock starts;
* ``peak RSS MiB``, ``peak PSS MiB``: the highest summed RSS and summed PSS of the child and all
  its descendants: the loader's workers, the curl processes under webdataset's workers,
  aioloader's fork server (forked from the child when its first loader with workers starts, as
  in a training script, so in ``aio-nw2``'s time and memory). Sampled by this process from
  outside (``harness.run_in_child``: its ``MemorySampler`` rooted at the child, RSS every
  50 ms, PSS every 0.2 s), so that the child runs no thread of the benchmark's: one would
  compete for its GIL, and aioloader forks its fork server only from a process with a single
  thread. The servers and multiprocessing's resource tracker (this process's, which the child
  is handed) are not in a child's tree; the share of the fork server's pages the child holds is
  (``MemorySampler``'s ``lent``).

Ratios, to the same decode's row: ``vs asyncio-ref`` and ``vs wds-nw8`` of ``samples/s``,
``steady vs wds-nw8`` of ``steady samples/s``, ``PSS vs wds-nw8`` of ``peak PSS``.

Checks, for each epoch: every key arrives exactly once with its own label, the payload is the
right size (light) or shape (heavy), no batch is larger than the batch size, and the number of
batches is as expected; and no process a child started is left 15 s after its epochs ended.
Each configuration gets ``--timeout`` (default 120 s) per epoch from its go; past that this
process has the child dump its threads' stacks (``faulthandler`` on SIGUSR1), kills its whole
tree (SIGSTOP to every process in it, then SIGKILL), reports it as timed out and goes on. The
script exits non-zero when a configuration fails or times out.

``--profile NAME`` runs configuration NAME once more per decode, after the tables, in a fresh
child with cProfile enabled on the child's main thread around its epochs, and prints the 25
functions with the most own time. For an async configuration that is the whole
``asyncio.run`` (aioloader's event loop), not aioloader's transform thread or any worker
process; for webdataset, only the consuming loop.

Run it from the repository root::

    python benchmarks/bench_streams.py                   # the full run
    python benchmarks/bench_streams.py --quick           # 4 shards x 100 samples, light decode
    python benchmarks/bench_streams.py --epochs 3 --in-flight 4 --in-flight 8
    python benchmarks/bench_streams.py --quick --profile aio-nw0
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import cProfile
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import io
import logging
import math
import multiprocessing
import multiprocessing.connection
import pstats
import re
import signal
import sys
import tarfile
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp
import numpy as np
import torch
import torch.utils.data
import webdataset as wds
from aiohttp import web
from PIL import Image

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
    describe,
    error_text,
    exit_status,
    format_table,
    machine,
    quick_defaults,
    ratio_to,
    report,
    run_in_child,
    versions,
    wait_for_stop,
)

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


# -- the servers (subprocesses) ----------------------------------------------------------------


def _start_range(header: str | None, size: int) -> int | None:
    """The first byte asked for by ``Range: bytes=N-`` (or ``bytes=N-M``, answered to the end),
    or None for no usable range."""
    match = re.fullmatch(r"bytes=(\d+)-(\d*)", (header or "").strip())
    return int(match[1]) if match else None


async def _send_paced(
    response: web.StreamResponse, path: Path, start: int, bandwidth: float
) -> None:
    """Write ``path`` from byte ``start`` in ``CHUNK``s, at most ``bandwidth`` bytes/s (0: no
    cap): each chunk waits until the bytes up to its end are due since the headers went out."""
    loop = asyncio.get_running_loop()
    began, sent = loop.time(), 0
    with path.open("rb") as stream:
        stream.seek(start)
        while chunk := stream.read(CHUNK):
            sent += len(chunk)
            if bandwidth > 0 and (ahead := began + sent / bandwidth - loop.time()) > 0:
                await asyncio.sleep(ahead)
            await response.write(chunk)


def serve_shards(
    directory: str, latency: float, bandwidth: float, conn: multiprocessing.connection.Connection
) -> None:
    """Serve ``directory``'s shards at ``/shard-NNNN.tar`` on 127.0.0.1 (port 0), send the port
    through ``conn``, and run until anything arrives on it (or it closes)."""
    root = Path(directory)

    async def handle(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        path = root / name
        if not SHARD_NAME.fullmatch(name) or not path.is_file():
            raise web.HTTPNotFound()
        stat = path.stat()
        size, etag = stat.st_size, f'"{stat.st_mtime_ns:x}-{stat.st_size:x}"'
        start = _start_range(request.headers.get("Range"), size)
        if_range = request.headers.get("If-Range")
        if start is not None and if_range is not None and if_range != etag:
            start = None  # the object changed: send all of it
        if start is not None and start >= size:
            raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{size}"})
        await asyncio.sleep(latency)
        headers = {"ETag": etag, "Accept-Ranges": "bytes"}
        if start:
            headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
        response = web.StreamResponse(status=206 if start else 200, headers=headers)
        response.content_type = "application/x-tar"
        response.content_length = size - (start or 0)
        # A client that goes away (a timed-out configuration) is no error of the server's.
        with contextlib.suppress(ConnectionError):
            await response.prepare(request)
            await _send_paced(response, path, start or 0, bandwidth)
            await response.write_eof()
        return response

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/{name}", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
            await site.start()
            conn.send(runner.addresses[0][1])
            await asyncio.get_running_loop().run_in_executor(None, wait_for_stop, conn)
        finally:
            await runner.cleanup()

    asyncio.run(main())


def serve_moto(directory: str, conn: multiprocessing.connection.Connection) -> None:
    """Run moto's S3 server on 127.0.0.1 (port 0), upload ``directory``'s shards to ``BUCKET``
    (public-read) with boto3, send the port through ``conn``, run until told to stop."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    port = server.get_host_and_port()[1]
    client = boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{port}",
        region_name=REGION,
        aws_access_key_id=S3_KEYS,
        aws_secret_access_key=S3_KEYS,
    )
    client.create_bucket(Bucket=BUCKET)
    for path in sorted(Path(directory).glob("shard-*.tar")):
        client.put_object(Bucket=BUCKET, Key=path.name, Body=path.read_bytes(), ACL="public-read")
    conn.send(port)
    wait_for_stop(conn)
    server.stop()


# -- settings, checks, results ------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    data: ShardSet
    batch_size: int
    http_port: int
    moto_port: int | None

    @property
    def http_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.http_port}/{name}" for name in self.data.names]

    @property
    def s3_urls(self) -> list[str]:
        return [f"s3://{BUCKET}/{name}" for name in self.data.names]

    @property
    def moto_http_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.moto_port}/{BUCKET}/{name}" for name in self.data.names]

    @property
    def s3_options(self) -> dict[str, Any]:
        config = {
            "endpoint": f"http://127.0.0.1:{self.moto_port}",
            "region": REGION,
            "access_key_id": S3_KEYS,
            "secret_access_key": S3_KEYS,
        }
        return {"config": config, "client_options": {"allow_http": True}}


@dataclass
class EpochCheck:
    """Checks one epoch's batches as they come (none is kept): every label once, with its key,
    payloads right, batches no larger than ``batch_size``, ``expected_batches`` of them."""

    data: ShardSet
    decoder: Decoder
    batch_size: int
    expected_batches: int
    counts: collections.Counter[int] = field(default_factory=collections.Counter)
    batches: int = 0
    error: str | None = None

    @property
    def samples(self) -> int:
        return sum(self.counts.values())

    def add(self, batch: Any) -> None:
        self.batches += 1
        if self.error is None:
            self.error = self._check(batch)

    def _check(self, batch: Any) -> str | None:
        if not isinstance(batch, list | tuple) or len(batch) != 3:
            return f"a batch is a {type(batch).__name__}, not (keys, images, labels)"
        keys, images, labels = batch
        if not isinstance(labels, torch.Tensor) or labels.ndim != 1:
            return f"labels are {describe(labels)}, not a 1-D tensor"
        values: list[int] = labels.tolist()
        if not 0 < len(values) <= self.batch_size or len(keys) != len(values):
            return f"a batch of {len(values)} labels and {len(keys)} keys"
        for key, label in zip(keys, values, strict=True):
            if not 0 <= label < self.data.total or key != self.data.key(label):
                return f"key {key!r} came with label {label}"
        self.counts.update(values)
        return self.decoder.check_images(images, values, self.data)

    def finish(self) -> str | None:
        if self.error is not None:
            return self.error
        labels = list(self.counts.elements())
        return delivery_error(labels, self.data.total, self.batches, self.expected_batches)


class Recorder:
    """Where a configuration's loop hands its batches: ``begin_epoch`` opens a fresh
    ``EpochCheck`` that the next batches go to; ``first`` is when the first batch came (the
    ``time.perf_counter()`` before it was checked), ``first_samples`` how many samples it had."""

    def __init__(self, data: ShardSet, decoder: Decoder, batch_size: int, expected: int) -> None:
        self._new_check = functools.partial(EpochCheck, data, decoder, batch_size, expected)
        self.checks: list[EpochCheck] = []
        self.first: float | None = None
        self.first_samples = 0

    def begin_epoch(self) -> None:
        self.checks.append(self._new_check())

    def add(self, batch: Any) -> None:
        now = time.perf_counter()
        check = self.checks[-1]
        check.add(batch)
        if self.first is None:
            self.first, self.first_samples = now, check.samples

    @property
    def samples(self) -> int:
        return sum(check.samples for check in self.checks)

    def finish(self, epochs: int) -> str | None:
        """The first error of any epoch, or None when all ``epochs`` epochs are right."""
        if len(self.checks) != epochs:
            return f"{len(self.checks)} epochs, expected {epochs}"
        for number, check in enumerate(self.checks, 1):
            if (error := check.finish()) is not None:
                return error if epochs == 1 else f"epoch {number}: {error}"
        return None


@dataclass
class Outcome:
    """What a child sends back when its epochs end (as a dict: in the child this class lives in
    ``__mp_main__``, which this process cannot unpickle). ``first_s``: from building the loader
    to the first batch; ``steady_*``: from the first batch to the end."""

    samples: int = 0
    wall_s: float = 0.0
    first_s: float | None = None
    steady_samples: int = 0
    steady_s: float = 0.0
    error: str | None = None
    profile: str | None = None


@dataclass
class StreamResult(Result):
    """One row: ``samples`` and ``wall_s`` are the outcome's; ``outcome`` is None when the child
    sent none (timed out, died, skipped); ``start_pss_mib`` is the base PSS."""

    outcome: Outcome | None = None
    timed_out: bool = False

    @property
    def steady_per_s(self) -> float:
        o = self.outcome
        return o.steady_samples / o.steady_s if o is not None and o.steady_s > 0 else 0.0

    @property
    def status(self) -> str:
        return f"TIMED OUT: {self.error}" if self.timed_out else super().status


# -- the configurations -------------------------------------------------------------------------


def run_wds(
    settings: Settings, decoder: Decoder, epochs: int, rec: Recorder, *, workers: int, moto: bool
) -> None:
    urls = settings.moto_http_urls if moto else settings.http_urls
    dataset = (
        wds.WebDataset(
            urls, shardshuffle=False, workersplitter=wds.split_by_worker, empty_check=False
        )
        .map(decoder.transform)
        .batched(settings.batch_size, collation_fn=decoder.collate)
    )
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=None, num_workers=workers, persistent_workers=epochs > 1
    )
    for _ in range(epochs):
        rec.begin_epoch()
        for batch in loader:
            rec.add(batch)
    # Without persistent workers, the iterator stopped its workers at the end of the epoch; with
    # them, the loader's iterator stops them when the loader goes, as this returns.


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


async def _asyncio_epoch(
    session: aiohttp.ClientSession, settings: Settings, decoder: Decoder, rec: Recorder
) -> None:
    """One epoch: every shard fetched whole at once, then parsed, decoded and batched (the
    shards are let go of as this returns)."""

    async def fetch(url: str) -> bytes:
        async with session.get(url) as response:
            response.raise_for_status()
            return await response.read()

    shards = await asyncio.gather(*(fetch(url) for url in settings.http_urls))
    pending: list[Decoded] = []
    for shard in shards:
        for sample in tar_samples(shard):
            pending.append(decoder.transform(sample))
            if len(pending) == settings.batch_size:
                rec.add(decoder.collate(pending))
                pending = []
    if pending:
        rec.add(decoder.collate(pending))


async def _asyncio_ref(settings: Settings, decoder: Decoder, epochs: int, rec: Recorder) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(epochs):
            rec.begin_epoch()
            await _asyncio_epoch(session, settings, decoder, rec)


def run_asyncio_ref(settings: Settings, decoder: Decoder, epochs: int, rec: Recorder) -> None:
    asyncio.run(_asyncio_ref(settings, decoder, epochs, rec))


async def _aio(
    urls: list[str],
    options: dict[str, Any],
    settings: Settings,
    decoder: Decoder,
    epochs: int,
    rec: Recorder,
    workers: int,
) -> None:
    dataset = aioloader.sources.tar_shards(urls, **options)
    loader: aioloader.DataLoader[Batch] = aioloader.DataLoader(
        dataset,
        batch_size=settings.batch_size,
        num_workers=workers,
        transform=decoder.transform,
        collate_fn=decoder.collate,
        persistent_workers=workers > 0,
    )
    async with loader:
        for _ in range(epochs):
            rec.begin_epoch()
            async for batch in loader:
                rec.add(batch)


def run_aio(
    settings: Settings,
    decoder: Decoder,
    epochs: int,
    rec: Recorder,
    *,
    workers: int,
    s3: bool = False,
    in_flight: int | None = None,
) -> None:
    options: dict[str, Any] = settings.s3_options if s3 else {}
    if in_flight is not None:
        options["shards_in_flight"] = in_flight
    urls = settings.s3_urls if s3 else settings.http_urls
    asyncio.run(_aio(urls, options, settings, decoder, epochs, rec, workers))


Runner = Callable[[Settings, Decoder, int, Recorder], None]  # (settings, decoder, epochs, rec)


@dataclass(frozen=True)
class Config:
    """``split``: the number of webdataset workers each batching its own shards (0: one stream
    batched as a whole); ``skip``: why it cannot run here."""

    name: str
    run: Runner
    split: int = 0
    moto: bool = False
    skip: str | None = None

    def expected_batches(self, data: ShardSet, batch_size: int) -> int:
        """Batches per epoch."""
        if not self.split:
            return math.ceil(data.total / batch_size)
        per_worker = (len(range(w, data.shards, self.split)) for w in range(self.split))
        return sum(math.ceil(n * data.per_shard / batch_size) for n in per_worker)


def in_flight_support() -> tuple[bool, object]:
    """Whether ``TarShards`` takes ``shards_in_flight``, and its default."""
    parameter = inspect.signature(aioloader.sources.TarShards).parameters.get("shards_in_flight")
    return parameter is not None, None if parameter is None else parameter.default


def build_configs(in_flight: Sequence[int]) -> list[Config]:
    supported, _ = in_flight_support()
    configs = [
        Config("wds-nw2", functools.partial(run_wds, workers=2, moto=False), split=2),
        Config("wds-nw8", functools.partial(run_wds, workers=8, moto=False), split=8),
        Config("asyncio-ref", run_asyncio_ref),
        Config("aio-nw0", functools.partial(run_aio, workers=0)),
        Config("aio-nw2", functools.partial(run_aio, workers=2)),
    ]
    for kk in dict.fromkeys(in_flight):
        configs.append(
            Config(
                f"aio-nw0-k{kk}",
                functools.partial(run_aio, workers=0, in_flight=kk),
                skip=None if supported else "TarShards() has no shards_in_flight parameter",
            )
        )
    moto_missing = None
    if importlib.util.find_spec("moto") is None or importlib.util.find_spec("boto3") is None:
        moto_missing = "moto[server] and boto3 not installed (pip install -e '.[dev]')"
    configs += [
        Config(
            "aio-s3-nw0",
            functools.partial(run_aio, workers=0, s3=True),
            moto=True,
            skip=moto_missing,
        ),
        Config(
            "wds-s3-nw8",
            functools.partial(run_wds, workers=8, moto=True),
            split=8,
            moto=True,
            skip=moto_missing,
        ),
    ]
    return configs


BASELINES = ("asyncio-ref", "wds-nw8")


# -- the child: one configuration in a process of its own ---------------------------------------


@dataclass(frozen=True)
class Job:
    """One configuration for one decode, as this process hands it to a child (by name: the
    child builds the configuration itself)."""

    config: str
    decode: str
    settings: Settings
    epochs: int
    in_flight: tuple[int, ...]
    profile: bool = False


def _format_profile(profiler: cProfile.Profile) -> str:
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats(pstats.SortKey.TIME).print_stats(PROFILE_TOP)
    return out.getvalue()


def run_epochs(job: Job, config: Config, decoder: Decoder, rec: Recorder) -> Outcome:
    """Run ``config``'s epochs (under cProfile when ``job.profile``), timed from building the
    loader to its end, then check them."""
    profiler = cProfile.Profile()
    error = None
    start = time.perf_counter()
    try:
        with profiler if job.profile else contextlib.nullcontext():
            config.run(job.settings, decoder, job.epochs, rec)
    except Exception as exc:  # report it: this process sends it to the parent
        error = error_text(exc)
    end = time.perf_counter()
    first = rec.first
    return Outcome(
        samples=rec.samples,
        wall_s=end - start,
        first_s=None if first is None else first - start,
        steady_samples=rec.samples - rec.first_samples,
        steady_s=0.0 if first is None else end - first,
        error=error or rec.finish(job.epochs),
        profile=_format_profile(profiler) if job.profile else None,
    )


def prepare_child(job: Job) -> Callable[[], dict[str, Any]]:
    """A child's set-up, the same for every row (its fork server has imported this module's
    imports by now), before ``harness.run_in_child`` has it say ready; returns its work: run the
    epochs, and the outcome as a dict."""
    with contextlib.suppress(ImportError):
        importlib.import_module("obstore")  # aio-s3-nw0's; imported by every row alike
    torch.set_num_threads(1)
    # torch warns that 8 workers exceed this machine's cores: measuring that is the point.
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    config = next(c for c in build_configs(job.in_flight) if c.name == job.config)
    decoder = DECODERS[job.decode]
    settings = job.settings
    rec = Recorder(
        settings.data,
        decoder,
        settings.batch_size,
        config.expected_batches(settings.data, settings.batch_size),
    )
    return lambda: dataclasses.asdict(run_epochs(job, config, decoder, rec))


# -- measuring (this process) -------------------------------------------------------------------


def measure(job: Job, timeout: float) -> StreamResult:
    """Run ``job`` in a fresh child (``harness.run_in_child``); sample its tree's memory
    from here between go and the child's last message; past ``timeout`` per epoch, dump its
    stacks and kill its tree."""
    run = run_in_child(prepare_child, job, timeout * job.epochs, name=f"bench-{job.config}")
    result = StreamResult(job.config, error=run.error, timed_out=run.timed_out)
    if run.payload is not None:
        result.outcome = outcome = Outcome(**run.payload)
        result.samples, result.wall_s = outcome.samples, outcome.wall_s
    result.record_memory(run.memory)
    return result


@dataclass(frozen=True)
class Bench:
    settings: Settings
    timeout: float
    epochs: int
    in_flight: tuple[int, ...]

    def job(self, config: Config, decode: str, *, profile: bool = False) -> Job:
        return Job(config.name, decode, self.settings, self.epochs, self.in_flight, profile)


def profile(config: Config, decode: str, bench: Bench) -> None:
    """Run ``config`` once more in a child, under cProfile there (its main thread only), and
    print the top functions it sends back."""
    result = measure(bench.job(config, decode, profile=True), bench.timeout)
    status = "check ok" if result.ok else result.status
    print(f"\nprofile of {config.name}, {decode} decode ({status}):")
    text = result.outcome.profile if result.outcome is not None else None
    print(text or "(no profile: the child sent none)", flush=True)


# -- output -------------------------------------------------------------------------------------


def format_results(results: Sequence[StreamResult]) -> str:
    """The table of one decode; a skipped row shows "-" in every column, a row whose child sent
    no outcome "-" in the epoch columns."""

    def epoch(cell: Callable[[StreamResult, Outcome], str]) -> Callable[[StreamResult], str]:
        return lambda r: "-" if r.outcome is None else cell(r, r.outcome)

    def first_batch(r: StreamResult, o: Outcome) -> str:
        return "-" if o.first_s is None else f"{o.first_s:.2f}"

    columns: list[Column[StreamResult]] = [
        Column("samples/s", 11, epoch(lambda r, o: f"{r.samples_per_s:,.0f}")),
        Column("first batch s", 15, epoch(first_batch)),
        Column("steady samples/s", 18, epoch(lambda r, o: f"{r.steady_per_s:,.0f}")),
        Column("wall s", 9, epoch(lambda r, o: f"{o.wall_s:.2f}")),
        Column("base PSS MiB", 14, lambda r: f"{r.start_pss_mib:,.0f}"),
        Column("peak RSS MiB", 14, lambda r: f"{r.peak_rss_mib:,.0f}"),
        Column("peak PSS MiB", 14, lambda r: f"{r.peak_pss_mib:,.0f}"),
        Column("vs asyncio-ref", 16, ratio_to(results, "asyncio-ref", lambda r: r.samples_per_s)),
        Column("vs wds-nw8", 12, ratio_to(results, "wds-nw8", lambda r: r.samples_per_s)),
        Column("steady vs wds-nw8", 19, ratio_to(results, "wds-nw8", lambda r: r.steady_per_s)),
        Column("PSS vs wds-nw8", 16, ratio_to(results, "wds-nw8", lambda r: r.peak_pss_mib)),
    ]
    return format_table(
        results, 16, columns, lambda r: r.status, blank=lambda r: r.skipped is not None
    )


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="webdataset vs asyncio vs aioloader, streaming tar shards from HTTP and S3, "
        "each configuration in a fresh process."
    )
    parser.add_argument("--shards", type=int, default=None, help=f"shards (default {SHARDS})")
    parser.add_argument(
        "--samples-per-shard",
        type=int,
        default=None,
        help=f"samples in each shard (default {SAMPLES_PER_SHARD})",
    )
    parser.add_argument(
        "--sample-kib", type=float, default=SAMPLE_KIB, help="JPEG size to aim for, in KiB"
    )
    add_batch_size(parser, BATCH_SIZE)
    parser.add_argument(
        "--epochs", type=int, default=1, help="epochs per configuration, one loader (default 1)"
    )
    parser.add_argument(
        "--latency", type=float, default=LATENCY_S, help="HTTP server's seconds to first byte"
    )
    parser.add_argument(
        "--bandwidth",
        type=float,
        default=BANDWIDTH_MB_S,
        help="HTTP server's cap per response, MB/s (0: none)",
    )
    parser.add_argument(
        "--decode", choices=("light", "heavy", "both"), default=None, help="default: both"
    )
    add_timeout(
        parser, f"seconds one configuration may take per epoch (default {TIMEOUT_S:g})", TIMEOUT_S
    )
    parser.add_argument(
        "--in-flight",
        type=int,
        action="append",
        default=[],
        metavar="K",
        help="add a row aio-nw0-kK with tar_shards(..., shards_in_flight=K) (repeatable)",
    )
    add_only(parser)
    parser.add_argument(
        "--profile", metavar="NAME", help="run NAME once more under cProfile, print the top 25"
    )
    add_quick(
        parser,
        f"smoke test: {QUICK_SHARDS} shards x {QUICK_SAMPLES_PER_SHARD} samples, light decode "
        "(unless given)",
    )
    args = parser.parse_args(argv)
    quick_defaults(
        args,
        shards=(QUICK_SHARDS, SHARDS),
        samples_per_shard=(QUICK_SAMPLES_PER_SHARD, SAMPLES_PER_SHARD),
        decode=("light", "both"),
    )
    if not 0 < args.shards < 10_000 or min(args.samples_per_shard, args.batch_size) <= 0:
        parser.error("--shards must be 1..9999, --samples-per-shard and --batch-size positive")
    if args.sample_kib <= 0 or args.latency < 0 or args.bandwidth < 0 or args.timeout <= 0:
        parser.error("--sample-kib and --timeout must be positive, --latency, --bandwidth >= 0")
    if args.epochs <= 0 or any(k <= 0 for k in args.in_flight):
        parser.error("--epochs and --in-flight must be positive")
    names = [c.name for c in build_configs(args.in_flight)]
    for name in [*(args.only or []), *([args.profile] if args.profile else [])]:
        if name not in names:
            parser.error(f"unknown configuration {name!r}; choose from {', '.join(names)}")
    return args


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _progress(r: StreamResult) -> str:
    if r.outcome is None:
        return f"  done {r.name:<14} {r.status}"
    return (
        f"  done {r.name:<14} {r.samples_per_s:>8,.0f} samples/s {r.outcome.wall_s:>7.2f} s "
        f"{r.peak_rss_mib:>6,.0f} MiB RSS {r.peak_pss_mib:>6,.0f} MiB PSS "
        f"(base {r.start_pss_mib:,.0f})  {r.status}"
    )


def run_all(args: argparse.Namespace, bench: Bench, configs: list[Config]) -> list[str]:
    """Every configuration for every decode, each in a child; print each decode's table; return
    what failed."""
    settings = bench.settings
    failed: list[str] = []
    decoders = ["light", "heavy"] if args.decode == "both" else [args.decode]
    tables: list[tuple[str, list[StreamResult]]] = []
    for decode in decoders:
        print(f"\n== {decode} decode ==", flush=True)
        results: list[StreamResult] = []
        for config in configs:
            if config.skip is not None or (config.moto and settings.moto_port is None):
                skipped = config.skip or "no moto server"
                results.append(StreamResult(config.name, skipped=skipped))
            else:
                results.append(measure(bench.job(config, decode), bench.timeout))
            r = results[-1]
            print(_progress(r), flush=True)
            report(f"shards-{decode}", r)
            if not r.ok and not r.skipped:
                failed.append(f"{decode}/{r.name}")
        tables.append((decode, results))
    data = settings.data
    for decode, results in tables:
        print(
            f"\n{decode} decode ({data.total:,} samples in {data.shards} shards, batch "
            f"{settings.batch_size}, {bench.epochs} epoch{'s' if bench.epochs > 1 else ''}):"
        )
        print(format_results(results))
    if args.profile:
        config = next(c for c in configs if c.name == args.profile)
        for decode in decoders:
            profile(config, decode, bench)
    return failed


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.perf_counter()
    signal.signal(signal.SIGTERM, _interrupt)  # clean up as for Ctrl-C
    torch.set_num_threads(1)  # for the decode costs measured here
    configs = build_configs(args.in_flight)
    if args.only:
        configs = [c for c in configs if c.name in args.only]
    supported, default = in_flight_support()
    names = ("torch", "webdataset", "aiohttp", "obstore", "moto", "pillow")
    print(versions(*names), flush=True)
    print(f"machine: {machine()}", flush=True)
    print(
        "TarShards(shards_in_flight=...): "
        + (
            f"supported, default {default!r}"
            if supported
            else "not supported (one shard at a time)"
        ),
        flush=True,
    )
    with contextlib.ExitStack() as stack:
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-streams-")))
        start = time.perf_counter()
        data = write_shards(directory, args.shards, args.samples_per_shard, args.sample_kib)
        shard_mib = sum(p.stat().st_size for p in directory.iterdir()) / 2**20 / data.shards
        print(
            f"data: {data.shards} shards x {data.per_shard} samples, {data.side}x{data.side} JPEG "
            f"quality {data.quality} (mean {sum(data.sizes) / len(data.sizes) / 1024:.1f} KiB), "
            f"{shard_mib:.2f} MiB per shard, written in {time.perf_counter() - start:.1f} s",
            flush=True,
        )
        decoders = ["light", "heavy"] if args.decode == "both" else [args.decode]
        print(decode_costs(data, [DECODERS[d] for d in decoders]), flush=True)
        http = stack.enter_context(
            ServerProcess(
                "bench-streams-http",
                serve_shards,
                str(directory),
                args.latency,
                args.bandwidth * 1e6,
            )
        )
        moto_port = None
        if any(c.moto and c.skip is None for c in configs):
            start = time.perf_counter()
            moto = stack.enter_context(
                ServerProcess("bench-streams-moto", serve_moto, str(directory))
            )
            moto_port = moto.port
            print(
                f"moto S3 on 127.0.0.1:{moto.port}, shards uploaded in "
                f"{time.perf_counter() - start:.1f} s",
                flush=True,
            )
        cap = f"{args.bandwidth:g} MB/s per response" if args.bandwidth else "no bandwidth cap"
        print(
            f"HTTP on 127.0.0.1:{http.port}: {args.latency * 1e3:g} ms to first byte, {cap}; "
            f"{args.epochs} epoch(s), each configuration in a fresh child process, timeout "
            f"{args.timeout:g} s per epoch",
            flush=True,
        )
        settings = Settings(data, args.batch_size, http.port, moto_port)
        bench = Bench(settings, args.timeout, args.epochs, tuple(args.in_flight))
        failed = run_all(args, bench, configs)
    print(f"\ntotal {time.perf_counter() - began:.0f} s")
    return exit_status(failed)


if __name__ == "__main__":
    sys.exit(main())
