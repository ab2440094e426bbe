"""Object-store source against a real S3-compatible server (moto's server mode on 127.0.0.1),
and against a real aiohttp server that throttles, for the retry path."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import boto3
import obstore
import pytest
from aiohttp import web
from obstore.store import from_url

import aioloader
from aioloader.sources import ObjectDataset, TransientStoreError
from tests.support.http_server import serve_on_loopback

CREDS = {"access_key_id": "testing", "secret_access_key": "testing", "region": "us-east-1"}


@pytest.fixture
def bucket(s3_endpoint: str) -> dict[str, Any]:
    name = f"aioloader-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=s3_endpoint, **_boto_creds())
    client.create_bucket(Bucket=name)
    options = {"config": {"endpoint": s3_endpoint, **CREDS}, "client_options": {"allow_http": True}}
    store = from_url(f"s3://{name}/train/", **options)  # type: ignore[arg-type]
    for i in range(40):
        obstore.put(store, f"{i:04d}.bin", i.to_bytes(2, "little") * 512)
    obstore.put(store, "notes.txt", b"not a sample")
    return {"url": f"s3://{name}/train/", "store": store, **options}


def _boto_creds() -> dict[str, str]:
    return {
        "aws_access_key_id": CREDS["access_key_id"],
        "aws_secret_access_key": CREDS["secret_access_key"],
        "region_name": CREDS["region"],
    }


def dataset(bucket: dict[str, Any], **kwargs: Any) -> ObjectDataset:
    return aioloader.sources.objects(
        bucket["url"], config=bucket["config"], client_options=bucket["client_options"], **kwargs
    )


def test_listing_is_sorted_filtered_and_free_of_secrets(bucket: dict[str, Any]) -> None:
    ds = dataset(bucket, suffix=".bin")
    assert ds.keys == [f"{i:04d}.bin" for i in range(40)]
    assert dataset(bucket, glob="003?.bin").keys == [f"003{i}.bin" for i in range(10)]
    assert "testing" not in repr(ds) and "40 objects" in repr(ds)
    with pytest.raises(ValueError, match="no objects"):
        dataset(bucket, suffix=".jpg")


async def test_an_epoch_reads_every_object_once(bucket: dict[str, Any]) -> None:
    ds = dataset(bucket, suffix=".bin")
    dl = aioloader.DataLoader(ds, batch_size=8, shuffle=True, seed=0, collate_fn=list)
    async with dl:
        for _ in range(2):
            bodies = [body async for batch in dl for body in batch]
            ids = sorted(int.from_bytes(b[:2], "little") for b in bodies)
            assert ids == list(range(40))
            assert all(len(b) == 1024 for b in bodies)


async def test_range_reads(bucket: dict[str, Any]) -> None:
    ds = dataset(bucket, suffix=".bin")
    assert await ds.get_range(7, 0, 4) == (7).to_bytes(2, "little") * 2
    with pytest.raises(ValueError, match="start < end"):
        await ds.get_range(7, 5, 5)


async def test_a_vanished_object_names_its_key_or_is_skipped(bucket: dict[str, Any]) -> None:
    ds = dataset(bucket, suffix=".bin")
    obstore.delete(bucket["store"], "0013.bin")
    async with aioloader.DataLoader(ds, batch_size=8, collate_fn=list) as dl:
        with pytest.raises(FileNotFoundError) as info:
            [b async for b in dl]
    assert any("0013.bin" in n for n in info.value.__notes__)
    dl = aioloader.DataLoader(ds, batch_size=8, collate_fn=list, max_failures=1)
    async with dl:
        assert sum([len(b) async for b in dl]) == 39
    assert dl.statistics().skipped_samples == (13,)


@contextlib.asynccontextmanager
async def s3_style_server(
    handler: Callable[[web.Request], Awaitable[web.Response]],
) -> AsyncIterator[Any]:
    """An aiohttp server on 127.0.0.1 answering GETs of ``/bucket/{key}`` with ``handler``,
    and an obstore S3 store pointed at it (obstore's own retries off)."""
    app = web.Application()
    app.router.add_get("/bucket/{key}", handler)
    runner, port = await serve_on_loopback(app)
    try:
        yield from_url(
            "s3://bucket/",
            config={"endpoint": f"http://127.0.0.1:{port}", **CREDS},  # type: ignore[typeddict-item]
            client_options={"allow_http": True},
            retry_config={"max_retries": 0},
        )
    finally:
        await runner.cleanup()


async def test_throttling_is_retried_by_the_loader_and_counted() -> None:
    attempts: dict[str, int] = {}

    async def handler(request: web.Request) -> web.Response:
        key = request.match_info["key"]
        attempts[key] = attempts.get(key, 0) + 1
        if key == "always" or (attempts[key] == 1 and int(key) % 3 == 0):
            return web.Response(status=503, text="<Error><Code>SlowDown</Code></Error>")
        return web.Response(body=int(key).to_bytes(2, "little") * 8)

    async with s3_style_server(handler) as store:
        ds = ObjectDataset(store, "s3://bucket/", [str(i) for i in range(30)])
        retry = aioloader.RetryPolicy(attempts=3, initial_backoff=0.001, max_backoff=0.005)
        dl = aioloader.DataLoader(ds, batch_size=10, collate_fn=list, retry=retry)
        async with dl:
            bodies = [body async for batch in dl for body in batch]
        assert sorted(int.from_bytes(b[:2], "little") for b in bodies) == list(range(30))
        assert dl.statistics().stage("fetch").retries == 10

        dl = aioloader.DataLoader(
            ObjectDataset(store, "s3://bucket/", ["always"]), collate_fn=list, retry=retry
        )
        async with dl:
            with pytest.raises(TransientStoreError, match="bucket/always") as info:
                [b async for b in dl]
        assert "gave up after 3 attempts" in "\n".join(info.value.__notes__)
        assert info.value.__cause__ is not None  # the store's own error, for its details
        assert attempts["always"] == 3


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (403, obstore.exceptions.PermissionDeniedError),
        (401, obstore.exceptions.UnauthenticatedError),
        (412, obstore.exceptions.PreconditionError),
        (400, obstore.exceptions.GenericError),
    ],
)
async def test_a_refusal_is_raised_once_with_its_type(status: int, kind: type) -> None:
    """A 4xx answer (S3's XML error body) is not retried: obstore's debug text, which holds
    ``retry_timeout`` and ``body: Some(...)``, no longer reads as transient."""
    attempts: dict[str, int] = {}

    async def handler(request: web.Request) -> web.Response:
        key = request.match_info["key"]
        attempts[key] = attempts.get(key, 0) + 1
        body = f"<Error><Code>E{status}</Code><Message>request timed out? no</Message></Error>"
        return web.Response(status=status, text=body)

    async with s3_style_server(handler) as store:
        retry = aioloader.RetryPolicy(attempts=3, initial_backoff=0.001, max_backoff=0.005)
        dl = aioloader.DataLoader(
            ObjectDataset(store, "s3://bucket/", ["denied"]), collate_fn=list, retry=retry
        )
        async with dl:
            with pytest.raises(kind) as info:
                [b async for b in dl]
        assert not isinstance(info.value, TransientStoreError)
        assert "aioloader: while reading s3://bucket/denied" in info.value.__notes__
        assert attempts["denied"] == 1


def test_demo_trains_from_an_s3_url(
    bucket: dict[str, Any],
    s3_endpoint: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Any,
) -> None:
    from aioloader._cli import demo as _demo
    from aioloader._cli.command import main

    url = bucket["url"].replace("/train/", "/demo/")
    store = from_url(url, config=bucket["config"], client_options={"allow_http": True})
    _demo.write_dataset(tmp_path, 256)
    for path in sorted(tmp_path.iterdir()):
        obstore.put(store, path.name, path.read_bytes())
    for name, value in {
        "AWS_ENDPOINT_URL": s3_endpoint,
        "AWS_ACCESS_KEY_ID": CREDS["access_key_id"],
        "AWS_SECRET_ACCESS_KEY": CREDS["secret_access_key"],
        "AWS_REGION": CREDS["region"],
        "AWS_ALLOW_HTTP": "true",
    }.items():
        monkeypatch.setenv(name, value)
    assert main(["demo", "--url", url, "--epochs", "2", "--batch-size", "32"]) == 0
    out = capsys.readouterr().out
    assert "256 objects under s3://" in out and "512 samples" in out


async def test_object_stream_lists_each_epoch_and_reads_in_listing_order(
    bucket: dict[str, Any],
) -> None:
    ds = aioloader.sources.object_stream(
        bucket["url"],
        suffix=".bin",
        concurrency=7,
        config=bucket["config"],
        client_options=bucket["client_options"],
    )
    loader = aioloader.DataLoader(ds, batch_size=8, collate_fn=list)
    async with loader:
        first = [item async for batch in loader for item in batch]
    assert first == [(f"{i:04d}.bin", i.to_bytes(2, "little") * 512) for i in range(40)]
    obstore.put(bucket["store"], "0040.bin", b"new")
    second = [key async for key, _ in ds]
    assert second == [f"{i:04d}.bin" for i in range(41)]  # listed again: the new object is read


async def test_object_stream_names_a_vanished_object(bucket: dict[str, Any]) -> None:
    ds = aioloader.sources.object_stream(
        bucket["url"], store=bucket["store"], glob="000*.bin", concurrency=2
    )
    seen: list[str] = []
    with pytest.raises(FileNotFoundError) as info:
        async for key, _ in ds:
            seen.append(key)
            if key == "0000.bin":
                obstore.delete(bucket["store"], "0005.bin")  # listed already, read later
    # Every object before the vanished one is delivered (reads slide: no window is lost).
    assert seen == [f"{i:04d}.bin" for i in range(5)]
    assert "0005.bin" in "\n".join(info.value.__notes__)


def test_object_stream_arguments() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        aioloader.sources.object_stream("memory:///", concurrency=0)
