"""The per-source bound on bytes in flight: the gate itself, then HTTP and S3 sources under it."""

from __future__ import annotations

import uuid
from typing import Any

import anyio
import obstore
import pytest
from obstore.store import from_url

import aioloader
from aioloader.sources import objects, urls
from aioloader.sources._gate import ByteGate
from tests.sources.test_objects import CREDS, _boto_creds
from tests.support import http_server
from tests.support.http_server import FaultServer, body, serve_on_loopback

fault_server = http_server.fault_server


async def test_the_gate_admits_in_order_and_a_large_request_alone() -> None:
    gate = ByteGate(100)
    order: list[str] = []
    await gate.acquire(60)

    async def take(name: str, n: int) -> None:
        await gate.acquire(n)
        order.append(name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(take, "big", 500)  # larger than the limit: waits until nothing is held
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(take, "small", 10)  # would fit now, but comes after "big"
        await anyio.wait_all_tasks_blocked()
        assert order == [] and gate.held == 60
        gate.release(60)
        await anyio.wait_all_tasks_blocked()
        assert order == ["big"] and gate.held == 500
        gate.release(500)
    assert order == ["big", "small"] and gate.held == 10 and gate.peak == 500


async def test_a_cancelled_waiter_holds_nothing_and_unblocks_the_queue() -> None:
    gate = ByteGate(100)
    await gate.acquire(90)
    admitted: list[int] = []

    async def take(n: int) -> None:
        await gate.acquire(n)
        admitted.append(n)

    async with anyio.create_task_group() as tg:
        tg.start_soon(take, 50)
        await anyio.wait_all_tasks_blocked()
        waiter_scope = anyio.CancelScope()

        async def cancellable() -> None:
            with waiter_scope:
                await take(40)

        tg.start_soon(cancellable)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(take, 5)  # queued behind the 50 and the 40
        await anyio.wait_all_tasks_blocked()
        waiter_scope.cancel()
        await anyio.wait_all_tasks_blocked()
        assert admitted == [] and gate.held == 90
        gate.release(90)
    assert admitted == [50, 5] and gate.held == 55  # the cancelled 40 never held anything


def test_the_bound_is_checked() -> None:
    with pytest.raises(ValueError, match="max_bytes_in_flight"):
        ByteGate(0)
    with pytest.raises(TypeError, match="max_bytes_in_flight"):
        urls(["http://127.0.0.1/a"], max_bytes_in_flight=1.5)  # type: ignore[arg-type]


async def test_http_bodies_in_flight_stay_under_the_bound(fault_server: FaultServer) -> None:
    fault_server.plan.latency = 0.01
    ds = urls([fault_server.url(i) for i in range(64)], max_bytes_in_flight=3 * 1024)
    loader = aioloader.DataLoader(ds, batch_size=8, max_inflight=32)
    got: list[bytes] = []
    async with loader:
        async for batch in loader:
            got += batch
        assert 1024 <= ds.peak_bytes_in_flight <= 3 * 1024
    assert got == [body(i) for i in range(64)]


async def test_s3_objects_in_flight_stay_under_the_bound(s3_endpoint: str) -> None:
    name = f"aioloader-{uuid.uuid4().hex[:12]}"
    import boto3

    boto3.client("s3", endpoint_url=s3_endpoint, **_boto_creds()).create_bucket(Bucket=name)
    options: dict[str, Any] = {
        "config": {"endpoint": s3_endpoint, **CREDS},
        "client_options": {"allow_http": True},
    }
    store = from_url(f"s3://{name}/", **options)
    for i in range(24):
        obstore.put(store, f"{i:03d}.bin", bytes([i]) * (1000 + i))
    ds = objects(f"s3://{name}/", max_bytes_in_flight=2500, **options)
    assert ds.sizes == [1000 + i for i in range(24)]
    loader = aioloader.DataLoader(ds, batch_size=6, max_inflight=16, collate_fn=list)
    async with loader:
        got = [x async for batch in loader for x in batch]
    assert got == [bytes([i]) * (1000 + i) for i in range(24)]
    assert 1000 <= ds.peak_bytes_in_flight <= 2500


async def test_bodies_without_content_length_are_read_alone() -> None:
    from aiohttp import web

    async def chunked(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for _ in range(16):
            await resp.write(b"x" * 1024)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/c/{i}", chunked)
    runner, port = await serve_on_loopback(app)
    try:
        ds = urls([f"http://127.0.0.1:{port}/c/{i}" for i in range(4)], max_bytes_in_flight=6000)
        async with ds:
            with anyio.fail_after(10):  # counted chunk by chunk, two bodies would deadlock
                async with anyio.create_task_group() as tg:
                    for i in range(4):
                        tg.start_soon(ds.get, i)
            assert ds.peak_bytes_in_flight == 6000  # each held the whole bound, alone
    finally:
        await runner.cleanup()
