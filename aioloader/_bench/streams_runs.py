"""The shards workload's configurations (``streams.py`` runs each in a process of its own): the
settings and checks of a run, webdataset's loader, a plain asyncio reference, aioloader's
``tar_shards`` over HTTP and S3, and the list of configurations.

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
"""

from __future__ import annotations

import asyncio
import collections
import functools
import importlib
import importlib.util
import inspect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import torch
import torch.utils.data
import webdataset as wds

import aioloader
import aioloader.sources
from aioloader._bench.harness import Result, delivery_error, describe
from aioloader._bench.streams_data import (
    BUCKET,
    REGION,
    S3_KEYS,
    Batch,
    Decoded,
    Decoder,
    ShardSet,
    tar_samples,
)

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
