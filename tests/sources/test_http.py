"""The HTTP source against a real server on 127.0.0.1 that injects faults
(tests/support/http_server.py), through the real loader: whole epochs under transient failures,
retries counted, errors that name the item and a redacted URL, timeouts, ranges, redirects, and the
session's lifetime."""

from __future__ import annotations

import asyncio
import datetime
import gc
import logging
import pickle
import random
import time
import traceback
import warnings
from typing import Any

import aiohttp
import anyio
import pytest

import aioloader
import aioloader.sources
from aioloader.sources import tar_shards
from aioloader.sources._httperrors import (
    HTTPConnectionError,
    HTTPStatusError,
    HTTPTimeoutError,
    TransientHTTPError,
    redact_url,
)
from tests.sources.test_tar import collect
from tests.support import http_server
from tests.support.http_server import Fault, FaultServer, body

fault_server = http_server.fault_server  # the fixture: a started server, stopped at teardown

FAST_RETRY = aioloader.RetryPolicy(attempts=6, initial_backoff=0.001, max_backoff=0.01)


def notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


def everything_shown(exc: BaseException) -> str:
    """What a traceback, a log line or a report could show of ``exc`` and its chain."""
    parts: list[str] = []
    e: BaseException | None = exc
    while e is not None:
        parts += [str(e), repr(e), notes(e)]
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    parts.append("".join(traceback.format_exception_only(exc)))
    return "\n".join(parts)


def load(ds: aioloader.sources.UrlDataset, **kwargs: Any) -> aioloader.DataLoader[list[bytes]]:
    """A loader whose batches are lists of bodies (what default_collate makes of bytes)."""
    return aioloader.DataLoader(ds, **kwargs)


def is_closed(session: aiohttp.ClientSession) -> bool:
    return session.closed


async def epoch(loader: aioloader.DataLoader[list[bytes]]) -> list[bytes]:
    out: list[bytes] = []
    async for batch in loader:
        out.extend(batch)
    return out


async def test_whole_epoch_through_transient_faults_and_retries_match(
    fault_server: FaultServer,
) -> None:
    n = 300
    fault_server.plan.random(0.1, seed=1234)  # 503, 500, connection reset, truncated body
    ds = aioloader.sources.urls([fault_server.url(i) for i in range(n)], connections=16)
    loader = load(ds, batch_size=16, retry=FAST_RETRY, max_inflight=32)
    async with loader:
        got = await epoch(loader)
    assert got == [body(i) for i in range(n)]  # every sample once, in order, intact
    faults = fault_server.faults
    assert fault_server.total_faults >= 10, faults  # ~30 expected: the plan really ran
    assert set(faults) <= {Fault.S503, Fault.S500, Fault.RESET, Fault.TRUNCATE}
    assert len(faults) == 4, faults  # every kind was hit
    assert loader.statistics().stage("fetch").retries == fault_server.total_faults
    assert sum(fault_server.requests.values()) == n + fault_server.total_faults


async def test_fetches_wait_for_no_connection_so_sample_timeout_times_the_request(
    fault_server: FaultServer,
) -> None:
    # 64 fetches on 4 connections: those queued in the pool timed out on a healthy server,
    # were retried, and the epoch failed after 3 attempts.
    fault_server.plan.latency = 0.2
    ds = aioloader.sources.urls([fault_server.url(i) for i in range(24)], connections=4)
    loader = aioloader.DataLoader(
        ds, batch_size=8, collate_fn=len, sample_timeout=0.6, retry=aioloader.RetryPolicy(3)
    )
    async with loader:
        assert [n async for n in loader] == [8, 8, 8]
    assert sum(fault_server.requests.values()) == 24 and fault_server.max_active <= 4
    assert loader.statistics().stage("fetch").limit == 4


async def test_a_throttling_server_s_retry_after_is_waited(fault_server: FaultServer) -> None:
    # Its 429s used up every attempt within its Retry-After (0.05, 0.08, 0.17 s).
    fault_server.plan.retry_after = "1"
    fault_server.plan.once(fault_server.path(0), Fault.S429)
    ds = aioloader.sources.urls([fault_server.url(0)])
    loader = aioloader.DataLoader(ds, batch_size=None, retry=aioloader.RetryPolicy(attempts=2))
    began = time.monotonic()
    async with loader:
        assert [len(item) async for item in loader] == [len(body(0))]
    assert time.monotonic() - began >= 1.0 and fault_server.requests[fault_server.path(0)] == 2


def test_retry_after_is_read_as_seconds_or_a_date() -> None:
    from email.utils import format_datetime

    from aioloader.sources._httperrors import status_error

    later = format_datetime(datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=30))
    asked = [
        status_error(429, None, "http://h/x", "x", header).retry_after
        for header in ("7", later, "soon", None, "\u00b2")  # ("²".isdigit() is True)
    ]
    assert asked[0] == 7.0 and asked[1] is not None and 25 < asked[1] <= 30
    assert asked[2:] == [None, None, None]
    policy = aioloader.RetryPolicy(max_backoff=0.1)
    rng = random.Random(0)
    error = status_error(503, None, "http://h/x", "x", "600")
    assert policy.delay(error, 1, rng) == 60.0  # asked for, up to a minute
    assert policy.delay(ValueError(), 1, rng) <= 0.1


async def test_retries_run_out_on_a_path_that_always_503s(fault_server: FaultServer) -> None:
    fault_server.plan.always(fault_server.path(7), Fault.S503)
    ds = aioloader.sources.urls([fault_server.url(i) for i in range(12)])
    retry = aioloader.RetryPolicy(attempts=3, initial_backoff=0.001, max_backoff=0.002)
    async with load(ds, batch_size=4, retry=retry) as loader:
        with pytest.raises(TransientHTTPError) as info:
            await epoch(loader)
    err = info.value
    assert err.status == 503 and err.url == fault_server.url(7)
    assert isinstance(err, HTTPStatusError) and isinstance(err, aioloader.TransientError)
    assert str(err) == f"HTTP 503 Service Unavailable from {fault_server.url(7)} (item 7)"
    assert "gave up after 3 attempts" in notes(err) and "sample 7" in notes(err)
    assert err.__cause__ is None  # a status is not an aiohttp exception: nothing to chain
    assert fault_server.requests[fault_server.path(7)] == 3


async def test_404_fails_at_once_without_retry(fault_server: FaultServer) -> None:
    missing = fault_server.n + 5
    ds = aioloader.sources.urls([fault_server.url(0), fault_server.url(missing)])
    async with load(ds, batch_size=2, retry=FAST_RETRY) as loader:
        with pytest.raises(HTTPStatusError) as info:
            await epoch(loader)
    err = info.value
    assert type(err) is HTTPStatusError and not isinstance(err, aioloader.TransientError)
    assert err.status == 404 and f"HTTP 404 Not Found from {fault_server.url(missing)}" in str(err)
    assert "gave up" not in notes(err) and "sample 1" in notes(err)
    assert fault_server.requests[fault_server.path(missing)] == 1
    assert loader.statistics().stage("fetch").retries == 0


@pytest.mark.parametrize("status", [Fault.S429, Fault.S500])
async def test_other_transient_statuses(fault_server: FaultServer, status: Fault) -> None:
    fault_server.plan.always(fault_server.path(1), status)
    async with aioloader.sources.urls([fault_server.url(1)]) as ds:
        with pytest.raises(TransientHTTPError) as info:
            await ds.get(0)
    assert info.value.status == int(status)


async def test_connection_reset_and_truncated_body_are_transient(
    fault_server: FaultServer,
) -> None:
    fault_server.plan.once(fault_server.path(3), Fault.RESET, Fault.TRUNCATE)
    async with aioloader.sources.urls([fault_server.url(3)]) as ds:
        with pytest.raises(HTTPConnectionError, match="disconnected") as reset:
            await ds.get(0)
        with pytest.raises(HTTPConnectionError, match="cut short") as cut:
            await ds.get(0)
        assert await ds.get(0) == body(3)
    for info in (reset, cut):
        err = info.value
        assert isinstance(err, aioloader.TransientError) and isinstance(err, ConnectionError)
        assert err.url == fault_server.url(3) and f"{fault_server.url(3)} (item 0)" in str(err)
        assert isinstance(err.__cause__, aiohttp.ClientError)
        assert FAST_RETRY.should_retry(err, 1)
    assert isinstance(reset.value.__cause__, aiohttp.ServerDisconnectedError)
    assert isinstance(cut.value.__cause__, aiohttp.ClientPayloadError)
    assert fault_server.requests[fault_server.path(3)] == 3  # aiohttp resent nothing itself


async def test_unreachable_server_is_a_transient_connection_error() -> None:
    with anyio.fail_after(10):
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        await listener.aclose()  # nothing listens there now
        async with aioloader.sources.urls([f"http://127.0.0.1:{port}/x?sig=s3cr3t"]) as ds:
            with pytest.raises(HTTPConnectionError, match="cannot connect") as info:
                await ds.get(0)
    assert "s3cr3t" not in everything_shown(info.value)


async def test_stall_beyond_timeout_raises_timeout_error_then_a_retry_succeeds(
    fault_server: FaultServer,
) -> None:
    fault_server.plan.always(fault_server.path(2), Fault.STALL)
    async with aioloader.sources.urls([fault_server.url(2)], timeout=0.2) as ds:
        with pytest.raises(TimeoutError) as info:
            await ds.get(0)
    err = info.value
    assert isinstance(err, HTTPTimeoutError) and err.timeout == 0.2
    assert str(err) == f"no whole response from {fault_server.url(2)} (item 0) within timeout=0.2s"

    # One stall in an epoch: the fetch times out, is retried, and the epoch is whole.
    fault_server.plan = type(fault_server.plan)()
    fault_server.plan.once(fault_server.path(5), Fault.STALL)
    # (A timeout with room to spare: asyncio's debug mode makes each request ~5 ms slower.)
    ds = aioloader.sources.urls([fault_server.url(i) for i in range(8)], timeout=1.0)
    loader = load(ds, batch_size=4, retry=FAST_RETRY)
    async with loader:
        assert await epoch(loader) == [body(i) for i in range(8)]
    assert loader.statistics().stage("fetch").retries == 1
    assert fault_server.requests[fault_server.path(5)] == 2


async def test_signed_urls_never_show_their_secrets(
    fault_server: FaultServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="aioloader")
    caplog.set_level(logging.DEBUG, logger="aiohttp")
    secret = "?X-Amz-Signature=secret&token=abc"
    signed = fault_server.url(4).replace("http://", "http://user:pass@") + secret
    fault_server.plan.always(fault_server.path(4), Fault.S503)
    ds = aioloader.sources.urls([signed, fault_server.url(0) + secret])
    assert "secret" not in repr(ds) and "abc" not in repr(ds) and "pass" not in repr(ds)
    assert f"first='{fault_server.url(4)}?<redacted>'" in repr(ds)
    retry = aioloader.RetryPolicy(attempts=2, initial_backoff=0.0, max_backoff=0.0)
    async with load(ds, batch_size=2, retry=retry) as loader:
        with pytest.raises(TransientHTTPError) as info:
            await epoch(loader)
    err = info.value
    assert err.url == fault_server.url(4) + "?<redacted>" and err.url in str(err)
    assert "gave up after 2 attempts" in notes(err)
    # The credentials did reach the server (they are only kept out of what we show).
    assert fault_server.headers[fault_server.path(4)]["Authorization"].startswith("Basic ")

    # Other failures: a cut body (aiohttp's exception chained), a redirect loop (aiohttp's
    # exception names the full URL, so it is not chained).
    fault_server.plan.always(fault_server.path(4), Fault.TRUNCATE)
    loop_url = f"http://user:pass@127.0.0.1:{fault_server.port}/loop{secret}"
    async with aioloader.sources.urls([signed, loop_url]) as ds:
        with pytest.raises(HTTPConnectionError) as cut:
            await ds.get(0)
        with pytest.raises(HTTPStatusError, match="too many redirects") as loop:
            await ds.get(1)
    assert isinstance(cut.value.__cause__, aiohttp.ClientPayloadError)
    assert loop.value.__cause__ is None and loop.value.__context__ is None
    assert not isinstance(loop.value, aioloader.TransientError) and loop.value.status == 302
    shown = "\n".join(everything_shown(e) for e in (err, cut.value, loop.value))
    # What aioloader and aiohttp logged (the retries among it); not asyncio's debug-mode
    # slow-callback warnings, whose task reprs hold file paths.
    shown += repr(ds) + "\n".join(
        r.getMessage() for r in caplog.records if r.name.startswith(("aioloader", "aiohttp"))
    )
    assert any("retrying" in r.getMessage() for r in caplog.records)
    for word in ("secret", "abc", "pass"):
        assert word not in shown


@pytest.mark.parametrize(
    "fault", [Fault.RESET, Fault.TRUNCATE, Fault.S503, Fault.S500, "refused", "ftp"]
)
async def test_a_signed_url_reached_by_a_redirect_never_shows(
    fault_server: FaultServer, fault: Fault | str
) -> None:
    """The first URL has no secret; the 302 leads to a signed one, which then fails (or whose
    host refuses the connection)."""
    if isinstance(fault, Fault):
        fault_server.plan.always(fault_server.path(3), fault)
        url = f"{fault_server.base}/signed-redirect/3"
    elif fault == "refused":
        url = f"{fault_server.base}/signed-elsewhere/3"
    else:  # a Location that is not HTTP: aiohttp's error text is that URL
        url = f"{fault_server.base}/signed-ftp/3"
    async with aioloader.sources.urls([url]) as ds:
        with pytest.raises(Exception) as info:  # the type depends on the fault
            await ds.get(0)
    shown = everything_shown(info.value) + "".join(traceback.format_exception(info.value))
    assert "SECRET" not in shown, shown
    assert url in shown  # the URL asked for is named
    # tar_shards reads through the same client: its error is as clean.
    with pytest.raises(Exception) as tar:
        await collect(tar_shards([url], retry=None))
    shown = everything_shown(tar.value) + "".join(traceback.format_exception(tar.value))
    assert "SECRET" not in shown, shown


def test_redact_url() -> None:
    assert redact_url("https://u:p@h.example:8443/a/b?x=1#frag") == (
        "https://h.example:8443/a/b?<redacted>#<redacted>"
    )
    assert redact_url("http://h/a") == "http://h/a"
    assert redact_url("http://[::1/x") == "<unparseable URL>"


async def test_range_reads_and_a_server_that_ignores_range(fault_server: FaultServer) -> None:
    whole = body(9)
    async with aioloader.sources.urls([fault_server.url(9)]) as ds:
        assert await ds.get_range(0, 10, 100) == whole[10:100]
        assert fault_server.headers[fault_server.path(9)]["Range"] == "bytes=10-99"
        assert await ds.get_range(0, 1000, 5000) == whole[1000:]  # clipped at the end
        assert await ds.get_range(0, 7, 7) == b""
        with pytest.raises(HTTPStatusError) as past:
            await ds.get_range(0, 2048, 4096)
        assert past.value.status == 416
        fault_server.plan.ignore_range = True  # 200 and the whole body: sliced here
        assert await ds.get_range(0, 10, 100) == whole[10:100]
        assert await ds.get_range(0, 1000, 5000) == whole[1000:]
        with pytest.raises(HTTPStatusError) as past_ignored:
            await ds.get_range(0, 2048, 4096)
        assert past_ignored.value.status == 416
        with pytest.raises(ValueError, match="start"):
            await ds.get_range(0, 5, 4)
        with pytest.raises(IndexError):
            await ds.get_range(1, 0, 4)


async def test_redirects_are_followed(fault_server: FaultServer) -> None:
    ds = aioloader.sources.urls([fault_server.url(i, redirect=True) for i in range(10)])
    async with load(ds, batch_size=5) as loader:
        assert await epoch(loader) == [body(i) for i in range(10)]
    assert fault_server.requests["/redirect/3"] == 1 and fault_server.requests["/obj/3"] == 1


async def test_connections_bound_the_requests_in_flight(fault_server: FaultServer) -> None:
    fault_server.plan.latency = 0.01
    ds = aioloader.sources.urls([fault_server.url(i) for i in range(40)], connections=4)
    async with load(ds, batch_size=8, max_inflight=32) as loader:
        assert len(await epoch(loader)) == 40
    assert 2 <= fault_server.max_active <= 4


async def test_headers_are_sent_and_not_shown(fault_server: FaultServer) -> None:
    ds = aioloader.sources.urls([fault_server.url(1)], headers={"Authorization": "Bearer tok42"})
    async with ds:
        await ds.get(0)
    assert fault_server.headers[fault_server.path(1)]["Authorization"] == "Bearer tok42"
    assert "tok42" not in repr(ds)


async def test_session_lives_exactly_as_long_as_the_loaders_scope(
    fault_server: FaultServer,
) -> None:
    ds = aioloader.sources.urls([fault_server.url(i) for i in range(6)])
    with pytest.raises(aioloader.LoaderStateError, match="async with dataset"):
        await ds.get(0)
    loader = load(ds, batch_size=3)
    sessions: list[aiohttp.ClientSession] = []
    for _ in range(2):  # the scope can be opened again, with a new session
        async with loader:
            assert ds._session is not None and ds._session not in sessions
            sessions.append(ds._session)
            assert not is_closed(sessions[-1]) and "open" in repr(ds)
            assert len(await epoch(loader)) == 6
        assert is_closed(sessions[-1]) and "closed" in repr(ds)
        with pytest.raises(RuntimeError, match="not open"):
            await ds.get(0)
    # Opened by the user around the loader: the loader's scope shares the session.
    async with ds:
        async with loader:
            assert len(await epoch(loader)) == 6
        assert await ds.get(1) == body(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del sessions, loader
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []


async def cancel_when_set(event: asyncio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def test_a_cancelled_fetch_leaves_the_dataset_usable(fault_server: FaultServer) -> None:
    fault_server.plan.once(fault_server.path(1), Fault.STALL)
    async with aioloader.sources.urls([fault_server.url(1)]) as ds:
        # Cancelled once the server holds the request (a fixed delay could end before the
        # request arrived on a loaded machine, leaving the stall to the second get).
        with anyio.fail_after(10), anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(cancel_when_set, fault_server.stalled, scope)
                await ds.get(0)
        assert scope.cancelled_caught and fault_server.faults[Fault.STALL] == 1
        assert await ds.get(0) == body(1)


async def test_plain_for_loop_opens_the_session_in_its_own_loop(
    fault_server: FaultServer,
) -> None:
    ds = aioloader.sources.urls([fault_server.url(i) for i in range(6)])

    def run() -> list[bytes]:
        return [b for batch in load(ds, batch_size=4) for b in batch]

    # The server runs on this loop, so the blocking loop runs in a thread of its own.
    assert await anyio.to_thread.run_sync(run) == [body(i) for i in range(6)]
    assert ds._session is None


def test_arguments_are_checked() -> None:
    with pytest.raises(TypeError, match="single string"):
        aioloader.sources.urls("http://h/x")
    with pytest.raises(ValueError, match=r"urls\[1\] is not an http\(s\) URL"):
        aioloader.sources.urls(["http://h/x", "ftp://u:pw@h/y?k=v"])
    with pytest.raises(ValueError, match="connections must be a positive int"):
        aioloader.sources.urls(["http://h/x"], connections=0)
    with pytest.raises(ValueError, match="timeout"):
        aioloader.sources.urls(["http://h/x"], timeout=0)
    assert len(aioloader.sources.urls([])) == 0


def test_errors_pickle_with_their_attributes() -> None:
    err = TransientHTTPError("HTTP 503 from http://h/x (item 0)", status=503, url="http://h/x")
    err.add_note("aioloader: gave up after 3 attempts")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is TransientHTTPError and back.status == 503 and back.url == "http://h/x"
    assert str(back) == str(err) and notes(back) == notes(err)
    timeout = pickle.loads(pickle.dumps(HTTPTimeoutError("t", url="u", timeout=1.0)))
    assert timeout.timeout == 1.0 and isinstance(timeout, TimeoutError)
