"""Object-store reads through faults: moto's S3 server behind a real proxy on 127.0.0.1 that
resets, cuts, stalls or refuses chosen GETs (``tests/support/s3_proxy.py``), for
``sources.objects`` and ``sources.tar_shards("s3://...")``; and the classification of
obstore's errors on the messages it gave for those faults (``obstore_errors.json``, captured
from the proxy and from a port where nothing listens)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import boto3
import obstore
import pytest
from obstore.exceptions import GenericError, PermissionDeniedError, PreconditionError
from obstore.store import from_url

import aioloader
from aioloader.sources import TransientStoreError, tar_shards
from aioloader.sources._objects import store_error, transient_cause
from tests.sources.test_objects import CREDS
from tests.sources.test_remote_tar import local_samples, without_shard
from tests.sources.test_tar import collect, make_shards
from tests.support.http_server import Fault
from tests.support.s3_proxy import S3FaultProxy, s3_proxy

N_OBJECTS = 12
FAULTED = (2, 7)  # the objects whose first GET is faulted
RETRY = aioloader.RetryPolicy(attempts=3, initial_backoff=0.0)
STALL_TIMEOUT = 0.5  # a stall is detected by the read's timeout, never waited out
LIMIT = 60.0  # no load loop runs longer

TRANSIENT = (Fault.RESET, Fault.RESET_BODY, Fault.TRUNCATE, Fault.STALL, Fault.S503)
PERMANENT = (
    (Fault.S403, PermissionDeniedError),
    (Fault.S400, GenericError),
    (Fault.S412, PreconditionError),
    (Fault.S404, FileNotFoundError),
)
MID_BODY = (Fault.RESET_BODY, Fault.TRUNCATE, Fault.STALL)


@pytest.fixture(scope="module")
def s3_bucket(s3_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A bucket on moto holding ``objs/0000.bin``... (object ``i`` is ``i`` as 2 bytes, to
    1 KiB) and ``shards/shard-{0..2}.tar``, written directly, not through the proxy."""
    name = f"aioloader-{uuid.uuid4().hex[:12]}"
    boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        aws_access_key_id=CREDS["access_key_id"],
        aws_secret_access_key=CREDS["secret_access_key"],
        region_name=CREDS["region"],
    ).create_bucket(Bucket=name)
    options: dict[str, Any] = {
        "config": {"endpoint": s3_endpoint, **CREDS},
        "client_options": {"allow_http": True},
    }
    store = from_url(f"s3://{name}/", **options)
    for i in range(N_OBJECTS):
        obstore.put(store, f"objs/{i:04d}.bin", i.to_bytes(2, "little") * 512)
    paths = make_shards(tmp_path_factory.mktemp("shards"))
    for i, path in enumerate(paths):
        obstore.put(store, f"shards/shard-{i}.tar", path.read_bytes())
    return {"name": name, "paths": paths}


@pytest.fixture
def proxy(s3_endpoint: str) -> Iterator[S3FaultProxy]:
    with s3_proxy(s3_endpoint) as started:
        yield started


def through(proxy: S3FaultProxy) -> dict[str, Any]:
    """Store options that reach moto through ``proxy``."""
    return {"config": {"endpoint": proxy.endpoint, **CREDS}, "client_options": {"allow_http": True}}


def object_path(bucket: dict[str, Any], i: int) -> str:
    return f"/{bucket['name']}/objs/{i:04d}.bin"


def shard_path(bucket: dict[str, Any], i: int) -> str:
    return f"/{bucket['name']}/shards/shard-{i}.tar"


def assert_retries(counted: int, proxy: S3FaultProxy, fault: Fault) -> None:
    """Each injected fault was retried once; a stall's timeout may also cut a slow answer on a
    loaded machine, which is one more retry, never one fewer."""
    assert proxy.total_faults > 0
    if fault is Fault.STALL:
        assert counted >= proxy.total_faults
    else:
        assert counted == proxy.total_faults


# -- sources.objects ------------------------------------------------------------------------------


async def read_objects(
    bucket: dict[str, Any], proxy: S3FaultProxy, fault: Fault | None = None
) -> tuple[list[bytes], aioloader.DataLoader[Any]]:
    ds = aioloader.sources.objects(f"s3://{bucket['name']}/objs/", **through(proxy))
    # A stall is cut by the loader's timeout of an attempt. (obstore's own client timeout would
    # do as well, its error is classified below, but it would also bound the listing, which is
    # not retried.)
    timeout = STALL_TIMEOUT if fault is Fault.STALL else None
    loader: aioloader.DataLoader[Any] = aioloader.DataLoader(
        ds, batch_size=4, collate_fn=list, retry=RETRY, sample_timeout=timeout
    )
    bodies: list[bytes] = []
    with anyio.fail_after(LIMIT):
        async with loader:
            async for batch in loader:
                bodies += batch
    return bodies, loader


@pytest.mark.parametrize("fault", TRANSIENT)
async def test_objects_retry_a_transient_fault_and_read_each_object_once(
    s3_bucket: dict[str, Any], proxy: S3FaultProxy, fault: Fault
) -> None:
    for i in FAULTED:
        proxy.plan.once(object_path(s3_bucket, i), fault)
    bodies, loader = await read_objects(s3_bucket, proxy, fault)
    assert sorted(bodies) == [i.to_bytes(2, "little") * 512 for i in range(N_OBJECTS)]
    assert sorted(proxy.injected) == [(object_path(s3_bucket, i), fault) for i in FAULTED]
    assert all(proxy.requests[object_path(s3_bucket, i)] >= 2 for i in FAULTED)
    assert_retries(loader.statistics().stage("fetch").retries, proxy, fault)


@pytest.mark.parametrize(("fault", "kind"), PERMANENT)
async def test_objects_raise_a_refusal_once_naming_the_key(
    s3_bucket: dict[str, Any], proxy: S3FaultProxy, fault: Fault, kind: type[Exception]
) -> None:
    path = object_path(s3_bucket, 2)
    proxy.plan.always(path, fault)
    with pytest.raises(kind) as info:
        await read_objects(s3_bucket, proxy)
    assert not isinstance(info.value, TransientStoreError)
    where = f"s3://{s3_bucket['name']}/objs/0002.bin"
    assert any(where in note for note in info.value.__notes__)
    assert proxy.requests[path] == 1


# -- sources.tar_shards("s3://...") ---------------------------------------------------------------


def s3_shards(bucket: dict[str, Any], proxy: S3FaultProxy, fault: Fault | None) -> Any:
    timeout = STALL_TIMEOUT if fault is Fault.STALL else LIMIT
    return tar_shards(
        f"s3://{bucket['name']}/shards/shard-{{0..2}}.tar",
        **through(proxy),
        chunk_size=512,
        timeout=timeout,
        retry=RETRY,
    )


@pytest.mark.parametrize("fault", TRANSIENT)
async def test_s3_shards_resume_where_a_transient_fault_broke_them(
    s3_bucket: dict[str, Any], proxy: S3FaultProxy, fault: Fault
) -> None:
    path = shard_path(s3_bucket, 1)
    proxy.plan.once(path, fault)
    ds = s3_shards(s3_bucket, proxy, fault)
    with anyio.fail_after(LIMIT):
        got = await collect(ds)
    assert without_shard(got) == await local_samples(s3_bucket["paths"])
    assert_retries(ds.retries, proxy, fault)
    first, resumed, *_ = proxy.ranges[path]
    assert first is None
    if fault in MID_BODY:
        # Resumed from the byte after the last one delivered: a quarter of the shard was sent.
        cut = int(s3_bucket["paths"][1].stat().st_size * proxy.cut)
        assert resumed is not None and resumed.startswith("bytes=") and resumed.endswith("-")
        assert 0 < int(resumed[6:-1]) <= cut
    else:
        assert resumed is None  # nothing came: the shard is read again from its start


@pytest.mark.parametrize(("fault", "kind"), PERMANENT)
async def test_s3_shards_raise_a_refusal_once_naming_the_shard(
    s3_bucket: dict[str, Any], proxy: S3FaultProxy, fault: Fault, kind: type[Exception]
) -> None:
    path = shard_path(s3_bucket, 1)
    proxy.plan.always(path, fault)
    ds = s3_shards(s3_bucket, proxy, None)
    with pytest.raises(kind) as info, anyio.fail_after(LIMIT):
        await collect(ds)
    assert not isinstance(info.value, TransientStoreError)
    assert f"s3://{s3_bucket['name']}/shards/shard-1.tar" in "\n".join(info.value.__notes__)
    assert proxy.requests[path] == 1
    assert ds.retries == 0


# -- classification of obstore's messages ---------------------------------------------------------

CAPTURED: list[dict[str, str]] = json.loads(
    (Path(__file__).parent / "obstore_errors.json").read_text()
)
CAUSES = {
    "reset": "Interrupted: ConnectionReset",  # before the first byte of the answer
    "reset-body": "Interrupted: ConnectionReset",
    "truncate": "Interrupted: UnexpectedEof",
    "stall": "Timeout",  # obstore's client timeout (client_options={"timeout": "1s"})
    "503": "HTTP 503",
    "refused": "Connect: ConnectionRefused",  # nothing listens on the port
    "403": None,
    "400": None,
    "412": None,
    "404": None,
}


@pytest.mark.parametrize("captured", CAPTURED, ids=[c["fault"] for c in CAPTURED])
def test_the_source_chain_says_what_is_transient(captured: dict[str, str]) -> None:
    assert transient_cause(captured["message"]) == CAUSES[captured["fault"]]
    head, debug, chain = captured["message"].partition("\n\nDebug source:")
    # Words in the head count for nothing: only the chain does.
    misleading = "Generic S3 error: connection reset; timed out; SlowDown; status code: 503"
    assert transient_cause(misleading + debug + chain) == CAUSES[captured["fault"]]
    assert transient_cause(head) is None


def test_a_generic_error_broken_mid_body_becomes_transient() -> None:
    (captured,) = [c for c in CAPTURED if c["fault"] == "reset-body"]
    assert captured["type"] == "GenericError"
    error = store_error(GenericError(captured["message"]), "s3://bucket/key")
    assert isinstance(error, TransientStoreError)
    assert str(error) == (
        "reading s3://bucket/key failed: GenericError (Interrupted: ConnectionReset)"
    )
    assert isinstance(error.__cause__, GenericError)
