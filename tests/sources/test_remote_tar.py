"""Tar shards streamed over HTTP (a real aiohttp server on 127.0.0.1 that breaks transfers on
request) and from an S3-compatible server (moto), resumed where a transfer broke; brace
patterns; the resume loop on its own."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import anyio
import obstore
import pytest
from hypothesis import given
from hypothesis import strategies as st
from obstore.store import from_url

import aioloader
from aioloader.sources import StallError, TarShards, TransientHTTPError, tar_shards
from aioloader.sources._braces import expand_braces
from aioloader.sources._http import new_session
from aioloader.sources._streams import HTTPReader, StoreReader, resumable
from tests.sources.test_objects import CREDS
from tests.sources.test_tar import ALL_KEYS, collect, keys, make_shard, make_shards
from tests.support import http_server
from tests.support.http_server import Fault, FaultServer, body

fault_server = http_server.fault_server

FAST = aioloader.RetryPolicy(attempts=4, initial_backoff=0.0)


SHARD_FIELDS = ("__shard__", "__url__", "__local_path__")


def serve_shards(server: FaultServer, paths: list[Path]) -> list[str]:
    for i, path in enumerate(paths):
        server.objects[i] = path.read_bytes()
    return [server.url(i) for i in range(len(paths))]


async def local_samples(paths: list[Path]) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in s.items() if k not in SHARD_FIELDS}
        for s in await collect(tar_shards(paths))
    ]


def without_shard(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in s.items() if k not in SHARD_FIELDS} for s in samples]


# -- HTTP -----------------------------------------------------------------------------------------


async def test_http_shards_stream_the_same_samples(
    tmp_path: Path, fault_server: FaultServer
) -> None:
    paths = make_shards(tmp_path)
    urls = serve_shards(fault_server, paths)
    got = await collect(tar_shards(urls, chunk_size=700))
    assert without_shard(got) == await local_samples(paths)
    assert {s["__shard__"] for s in got} == set(urls)


async def test_a_sample_s_url_is_its_shard_s_without_the_query_string(
    tmp_path: Path, fault_server: FaultServer
) -> None:
    # It kept "?<redacted>", so a basename of it ended that way.
    url = serve_shards(fault_server, make_shards(tmp_path, n_shards=1, n_samples=3))[0]
    got = await collect(tar_shards([url + "?X-Amz-Signature=secret#part"]))
    assert len(got) == 3 and {s["__url__"] for s in got} == {s["__shard__"] for s in got} == {url}


async def test_broken_transfers_resume_at_the_byte_they_stopped(
    tmp_path: Path, fault_server: FaultServer
) -> None:
    paths = make_shards(tmp_path)
    urls = serve_shards(fault_server, paths)
    fault_server.plan.once(fault_server.path(0), Fault.TRUNCATE)
    fault_server.plan.once(fault_server.path(1), Fault.RESET)
    fault_server.plan.once(fault_server.path(2), Fault.S503)
    ds = tar_shards(urls, chunk_size=256, retry=FAST)
    got = await collect(ds)
    assert without_shard(got) == await local_samples(paths)
    assert ds.retries == 3 == fault_server.total_faults
    # The truncated shard came back with a range request from where the first answer broke.
    resumed = fault_server.headers[fault_server.path(0)]
    assert resumed["Range"].startswith("bytes=") and resumed["Range"] != "bytes=0-"
    assert int(resumed["Range"][6:-1]) > 0
    assert resumed["If-Range"].startswith('"')


async def test_a_server_that_ignores_ranges_is_skipped_forward(
    tmp_path: Path, fault_server: FaultServer
) -> None:
    paths = make_shards(tmp_path, n_shards=1, n_samples=20)
    urls = serve_shards(fault_server, paths)
    fault_server.plan.ignore_range = True
    fault_server.plan.once(fault_server.path(0), Fault.TRUNCATE, Fault.TRUNCATE)
    ds = tar_shards(urls, chunk_size=256, retry=FAST)
    assert without_shard(await collect(ds)) == await local_samples(paths)
    assert ds.retries == 2


async def test_without_an_etag_a_resume_of_another_length_is_not_spliced(
    tmp_path: Path, fault_server: FaultServer
) -> None:
    """No strong validator: the resumed answer's total length must be the first answer's
    (RFC 9110); an object replaced by one of another length mid-read is refused."""
    paths = make_shards(tmp_path, n_shards=1, n_samples=20)
    urls = serve_shards(fault_server, paths)
    fault_server.plan.no_etag = True
    fault_server.plan.once(fault_server.path(0), Fault.TRUNCATE)

    class ReplaceThenRetry(aioloader.RetryPolicy):
        def should_retry(self, exc: BaseException, failures: int) -> bool:
            fault_server.objects[0] = fault_server.objects[0] + bytes(1024)
            return super().should_retry(exc, failures)

    policy = ReplaceThenRetry(attempts=3, initial_backoff=0.0)
    with pytest.raises(aioloader.sources.HTTPStatusError, match=r"length \d+ became \d+"):
        await collect(tar_shards(urls, retry=policy))
    # Unchanged, the same resume goes through.
    fault_server.objects[0] = paths[0].read_bytes()
    fault_server.plan.once(fault_server.path(0), Fault.TRUNCATE)
    ds = tar_shards(urls, retry=FAST)
    assert without_shard(await collect(ds)) == await local_samples(paths)
    assert ds.retries == 1


@pytest.mark.parametrize(
    "honours_if_range",
    [True, False],  # False: it answers the resume with 206 from the new object
)
async def test_an_object_replaced_mid_read_is_not_spliced(
    tmp_path: Path, fault_server: FaultServer, honours_if_range: bool
) -> None:
    paths = make_shards(tmp_path, n_shards=1, n_samples=20)
    urls = serve_shards(fault_server, paths)
    fault_server.plan.ignore_if_range = not honours_if_range
    fault_server.plan.once(fault_server.path(0), Fault.TRUNCATE)

    class ReplaceThenRetry(aioloader.RetryPolicy):
        def should_retry(self, exc: BaseException, failures: int) -> bool:
            fault_server.objects[0] = fault_server.objects[0][::-1]
            return super().should_retry(exc, failures)

    policy = ReplaceThenRetry(attempts=3, initial_backoff=0.0)
    with pytest.raises(aioloader.sources.HTTPStatusError, match="changed while it was read"):
        await collect(tar_shards(urls, chunk_size=256, retry=policy))


async def test_a_resume_past_the_last_byte_ends_the_read(fault_server: FaultServer) -> None:
    session = new_session()
    try:
        reader = HTTPReader(session, fault_server.url(3), 256, 5.0)
        whole = b"".join([c async for c in reader.chunks(0)])
        assert whole == body(3)
        # A break after the last byte resumes at len(body): the server answers 416 */len.
        assert [c async for c in reader.chunks(len(whole))] == []
    finally:
        await session.close()


async def test_more_slot_streams_than_aiohttp_default_pool(
    tmp_path: Path, fault_server: FaultServer
) -> None:
    n = 105
    for i in range(n):
        shard = make_shard(tmp_path / f"{i}.tar", [(f"k{i}.bin", bytes([i % 256]) * 10)])
        fault_server.objects[i] = shard.read_bytes()
    ds = tar_shards([fault_server.url(i) for i in range(n)], timeout=5.0).per_slot(n)
    with anyio.fail_after(20):
        got = [s async for s in ds]
    assert [s.slot for s in got] == list(range(n))
    assert [s.sample["bin"] for s in got] == [bytes([i % 256]) * 10 for i in range(n)]


async def test_when_retries_run_out_the_error_names_the_shard_and_byte(
    tmp_path: Path, fault_server: FaultServer
) -> None:
    paths = make_shards(tmp_path)
    urls = serve_shards(fault_server, paths)
    fault_server.plan.always(fault_server.path(1), Fault.S503)
    ds = tar_shards(urls, retry=aioloader.RetryPolicy(attempts=2, initial_backoff=0.0))
    seen: list[str] = []
    with pytest.raises(TransientHTTPError) as info:
        async for sample in ds:
            seen.append(sample["__key__"])
    # Shards are read at once: the failed shard's error comes at its first turn, and the
    # samples drawn before it were delivered.
    assert seen == ["s0/0000"]
    assert info.value.status == 503
    assert f"reading {urls[1]} at byte 0 (attempt 2)" in "\n".join(info.value.__notes__)
    assert ds.retries == 1


async def test_a_stalled_transfer_is_resumed(tmp_path: Path, fault_server: FaultServer) -> None:
    paths = make_shards(tmp_path, n_shards=2)
    urls = serve_shards(fault_server, paths)
    fault_server.plan.once(fault_server.path(1), Fault.STALL)
    ds = tar_shards(urls, timeout=0.2, retry=FAST)
    assert without_shard(await collect(ds)) == await local_samples(paths)
    assert ds.retries == 1


async def test_without_retries_a_stall_fails_naming_the_shard(
    tmp_path: Path, fault_server: FaultServer
) -> None:
    urls = serve_shards(fault_server, make_shards(tmp_path, n_shards=1))
    fault_server.plan.once(fault_server.path(0), Fault.STALL)
    with pytest.raises(StallError, match=rf"no bytes from {urls[0]} for 0.2s"):
        await collect(tar_shards(urls, timeout=0.2, retry=None))


async def test_the_loader_reads_http_shards_exactly_once(
    tmp_path: Path, fault_server: FaultServer
) -> None:
    urls = serve_shards(fault_server, make_shards(tmp_path))
    fault_server.plan.random(
        0.3, (Fault.TRUNCATE, Fault.S500, Fault.RESET, Fault.RESET_BODY), seed=3
    )
    ds = tar_shards(
        urls, chunk_size=512, retry=aioloader.RetryPolicy(attempts=10, initial_backoff=0)
    )
    loader = aioloader.DataLoader(ds, batch_size=4, collate_fn=list)
    got: list[str] = []
    async with loader:
        async for batch in loader:
            got += keys(batch)
    assert sorted(got) == ALL_KEYS
    assert ds.retries == fault_server.total_faults > 0


async def test_a_brace_pattern_names_the_shards(tmp_path: Path, fault_server: FaultServer) -> None:
    urls = serve_shards(fault_server, make_shards(tmp_path))
    ds = tar_shards(f"{fault_server.base}/obj/{{0..2}}")
    assert ds.shards == urls
    assert sorted(keys(await collect(ds))) == ALL_KEYS


def test_urls_in_repr_and_samples_lose_their_secrets() -> None:
    ds = tar_shards(["https://user:pw@host/a.tar?X-Amz-Signature=s3cr3t"])
    assert "s3cr3t" not in repr(ds) and "pw" not in repr(ds)


# -- S3 (moto) ------------------------------------------------------------------------------------


@pytest.fixture
def shard_bucket(s3_endpoint: str, tmp_path: Path) -> dict[str, Any]:
    name = f"aioloader-{uuid.uuid4().hex[:12]}"
    options: dict[str, Any] = {
        "config": {"endpoint": s3_endpoint, **CREDS},
        "client_options": {"allow_http": True},
    }
    import boto3

    boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        aws_access_key_id=CREDS["access_key_id"],
        aws_secret_access_key=CREDS["secret_access_key"],
        region_name=CREDS["region"],
    ).create_bucket(Bucket=name)
    store = from_url(f"s3://{name}/", **options)
    paths = make_shards(tmp_path)
    for i, path in enumerate(paths):
        obstore.put(store, f"shards/shard-{i}.tar", path.read_bytes())
    return {"name": name, "store": store, "paths": paths, **options}


async def test_s3_shards_stream_from_a_brace_pattern(shard_bucket: dict[str, Any]) -> None:
    pattern = f"s3://{shard_bucket['name']}/shards/shard-{{0..2}}.tar"
    ds = tar_shards(
        pattern,
        config=shard_bucket["config"],
        client_options=shard_bucket["client_options"],
        chunk_size=512,
    )
    got = await collect(ds)
    assert without_shard(got) == await local_samples(shard_bucket["paths"])
    assert got[0]["__shard__"] == f"s3://{shard_bucket['name']}/shards/shard-0.tar"


async def test_s3_shards_by_key_in_a_given_store(shard_bucket: dict[str, Any]) -> None:
    ds = tar_shards([f"shards/shard-{i}.tar" for i in range(3)], store=shard_bucket["store"])
    loader = aioloader.DataLoader(ds, batch_size=5, collate_fn=list)
    async with loader:
        got = [k async for batch in loader for k in keys(batch)]
    assert sorted(got) == ALL_KEYS


async def test_a_missing_s3_shard_is_named(shard_bucket: dict[str, Any]) -> None:
    ds = tar_shards(["shards/nope.tar"], store=shard_bucket["store"])
    with pytest.raises(FileNotFoundError) as info:
        await collect(ds)
    assert "shards/nope.tar" in "\n".join(info.value.__notes__)


async def test_a_store_read_resumes_from_an_offset(shard_bucket: dict[str, Any]) -> None:
    data = shard_bucket["paths"][0].read_bytes()
    reader = StoreReader(shard_bucket["store"], "shards/shard-0.tar", "shard-0", 1000)
    whole = b"".join([c async for c in reader.chunks(0)])
    tail = b"".join([c async for c in reader.chunks(1234)])
    assert whole == data and tail == data[1234:]


# -- the resume loop -----------------------------------------------------------------------------


class Flaky:
    """A reader of ``data`` in 10-byte chunks that fails (transiently) at the given offsets,
    once each."""

    name = "flaky://object"

    def __init__(self, data: bytes, fail_at: list[int], error: type[Exception]) -> None:
        self.data, self.fail_at, self.error = data, list(fail_at), error
        self.opened: list[int] = []

    async def chunks(self, offset: int) -> AsyncGenerator[bytes, None]:
        self.opened.append(offset)
        for at in range(offset, len(self.data), 10):
            if self.fail_at and at >= self.fail_at[0]:
                self.fail_at.pop(0)
                raise self.error("broken")
            yield self.data[at : at + 10]


async def test_resumable_counts_attempts_per_stall() -> None:
    data = bytes(range(200))
    # Four breaks in all, but never two without progress between them: three attempts suffice.
    reader = Flaky(data, [30, 60, 90, 150], ConnectionResetError)
    retries: list[int] = []
    policy = aioloader.RetryPolicy(attempts=2, initial_backoff=0.0)
    got = b"".join(
        [
            c
            async for c in resumable(
                reader, policy, stall_timeout=None, on_retry=lambda: retries.append(1)
            )
        ]
    )
    assert got == data
    assert reader.opened == [0, 30, 60, 90, 150]
    assert len(retries) == 4


async def test_resumable_does_not_retry_a_permanent_error() -> None:
    reader = Flaky(bytes(100), [50], PermissionError)
    with pytest.raises(PermissionError) as info:
        _ = [c async for c in resumable(reader, aioloader.RetryPolicy(), stall_timeout=None)]
    assert "reading flaky://object at byte 50 (attempt 1)" in info.value.__notes__[0]


# -- brace patterns -------------------------------------------------------------------------------


def test_brace_patterns() -> None:
    assert expand_braces("a.tar") == ["a.tar"]
    assert expand_braces("s-{000..003}.tar") == [f"s-{i:03d}.tar" for i in range(4)]
    assert expand_braces("s-{8..11}") == ["s-8", "s-9", "s-10", "s-11"]
    assert expand_braces("{2..0}") == ["2", "1", "0"]
    assert expand_braces("{a,b}/{0..1}") == ["a/0", "a/1", "b/0", "b/1"]
    for bad in ("s-{0..3", "s-0..3}", "{x}", "{}", "{a{b}}"):
        with pytest.raises(ValueError, match="shard pattern"):
            expand_braces(bad)


@given(
    st.lists(
        st.tuples(st.integers(0, 30), st.integers(0, 30), st.booleans()), min_size=1, max_size=3
    )
)
def test_brace_ranges_expand_to_the_product(groups: list[tuple[int, int, bool]]) -> None:
    pattern = "/".join(f"{{{a:03d}..{b:03d}}}" if pad else f"{{{a}..{b}}}" for a, b, pad in groups)
    names = expand_braces(pattern)
    expected = 1
    for a, b, _ in groups:
        expected *= abs(b - a) + 1
    assert len(names) == expected == len(set(names))
    first = names[0].split("/")
    for (a, _, pad), part in zip(groups, first, strict=True):
        assert part == (f"{a:03d}" if pad else str(a))


def test_tar_shards_arguments_are_checked() -> None:
    with pytest.raises(TypeError, match="retry"):
        tar_shards(["a.tar"], retry=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        tar_shards(["a.tar"], timeout=0)
    with pytest.raises(ValueError, match="shard pattern"):
        tar_shards("a-{0..2.tar")
    assert isinstance(tar_shards("a-{0..1}.tar"), TarShards)


async def test_shards_in_flight_over_http_give_the_local_order(
    tmp_path: Path, fault_server: FaultServer
) -> None:
    """Several shards are requested at once (``shards_in_flight`` and one opened ahead), and
    the samples come in the same order as from local files, whatever the network's timing."""
    paths = make_shards(tmp_path, n_shards=8, n_samples=4)
    urls = serve_shards(fault_server, paths)
    fault_server.plan.latency = 0.05
    local = keys(await collect(tar_shards(paths, shards_in_flight=3, shuffle_shards=True)))
    remote = tar_shards(urls, shards_in_flight=3, shuffle_shards=True)
    assert keys(await collect(remote)) == local
    assert fault_server.max_active == 4  # 3 open shards and the next one


async def test_a_failing_shard_among_several_in_flight_is_named(
    tmp_path: Path, fault_server: FaultServer
) -> None:
    paths = make_shards(tmp_path, n_shards=4, n_samples=400)
    urls = serve_shards(fault_server, paths)
    fault_server.plan.always(fault_server.path(2), Fault.S500)
    ds = tar_shards(urls, shards_in_flight=4, retry=None, chunk_size=1024, buffer_bytes=4096)
    with pytest.raises(TransientHTTPError) as info:
        await collect(ds)
    assert f"reading part 2 ({urls[2]})" in "\n".join(info.value.__notes__)
    assert info.value.status == 500


async def test_a_compressed_shard_resumes_mid_stream(
    tmp_path: Path, fault_server: FaultServer
) -> None:
    """A .tar.gz over HTTP cut in the middle: the read resumes at the compressed byte where it
    broke, and decompression goes on from there."""
    import webdataset as wds

    path = tmp_path / "shard.tar.gz"
    with wds.TarWriter(str(path), compress=True) as sink:
        for i in range(50):
            sink.write({"__key__": f"k{i:03d}", "bin": bytes([i]) * 3000})
    urls = serve_shards(fault_server, [path])
    fault_server.plan.once(fault_server.path(0), Fault.TRUNCATE)
    ds = tar_shards(urls, retry=FAST, chunk_size=1024)
    got = await collect(ds)
    assert [(s["__key__"], s["bin"]) for s in got] == [
        (f"k{i:03d}", bytes([i]) * 3000) for i in range(50)
    ]
    assert ds.retries == 1
