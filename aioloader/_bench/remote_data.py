"""The remote workload's datasets (module level, so torch's workers can import them), and the
settings, results and checks of a run."""

from __future__ import annotations

import math
import threading
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import torch
import torch.utils.data

from aioloader._bench.harness import delivery_error
from aioloader._bench.remote_server import (
    BUCKET,
    CEILING_CONCURRENCY,
    OBJECT_SIZE,
    REGION,
    S3_KEYS,
    payload,
    s3_client,
)

# -- the datasets (module level, so torch's workers can import them) ---------------------------


def fetch_blocking(url: str) -> bytes:
    with urllib.request.urlopen(url) as response:
        data: bytes = response.read()
    return data


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
