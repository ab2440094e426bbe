"""A real HTTP server on 127.0.0.1 that injects faults on request, for testing HTTP sources.

``FaultServer`` serves deterministic 1 KiB objects (or the bytes a test puts in its
``objects``) at ``/obj/{i}`` (with ``Range``, ``ETag`` and ``If-Range`` support), a redirect
to each at ``/redirect/{i}`` and a redirect loop at ``/loop``, and before answering
consults its :class:`FaultPlan`: a fault queued for the path (once, or every time), else, with
probability ``p``, one drawn from a seeded ``random.Random``. Faults are real network behaviour:
an error status, a connection aborted before any response, a body shorter than its
Content-Length, a reset (TCP RST) part-way through the body, or a stall. Every request and
every injected fault is counted.

Use it through the ``fault_server`` fixture: ``fault_server = http_server.fault_server`` in a
test module makes it that module's fixture. The server binds port 0 on 127.0.0.1 only; at
teardown it wakes every stalled handler and stops, so no handler outlives the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import random
import socket
import struct
import zlib
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import pytest_asyncio
from aiohttp import web

__all__ = ["Fault", "FaultPlan", "FaultServer", "body", "fault_server", "reset"]

OBJECT_SIZE = 1024


def body(i: int) -> bytes:
    """The body of object ``i``: its index as 4 little-endian bytes, repeated to 1 KiB."""
    return i.to_bytes(4, "little") * (OBJECT_SIZE // 4)


SIGNATURE = "X-Amz-Signature=REDIRECTSECRET&X-Amz-Credential=AKIDSECRET"


async def serve_on_loopback(app: web.Application) -> tuple[web.AppRunner, int]:
    """Start ``app`` on 127.0.0.1, on a free port: its runner (to clean up) and the port."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    (host, port), *_ = runner.addresses  # the site's sockets, as the runner reports them
    assert host == "127.0.0.1", host
    return runner, int(port)


class Fault(enum.StrEnum):
    """What the server does instead of answering normally."""

    S400 = "400"  #: 400 Bad Request
    S403 = "403"  #: 403 Forbidden
    S404 = "404"  #: 404 Not Found
    S412 = "412"  #: 412 Precondition Failed
    S429 = "429"  #: 429 Too Many Requests (with ``Retry-After``: ``FaultPlan.retry_after``)
    S500 = "500"  #: 500 Internal Server Error
    S503 = "503"  #: 503 Service Unavailable
    RESET = "reset"  #: the connection is aborted before any byte of the response
    RESET_BODY = "reset-body"  #: headers, part of the body, then a TCP reset (RST)
    TRUNCATE = "truncate"  #: headers with the full Content-Length, half the body, then close
    STALL = "stall"  #: no answer for ``FaultPlan.stall_s`` (or until teardown)


TRANSIENT_MIX = (Fault.S503, Fault.S500, Fault.RESET, Fault.TRUNCATE)


@dataclass
class FaultPlan:
    """Which requests fail and how. Queued faults for a path come first, then a fault that path
    always gets, then the random draw.

    Attributes:
        p: Probability that a request with nothing queued gets a random fault.
        mix: The faults a random draw chooses from (uniformly).
        rng: The seeded generator of the random draws.
        latency: Seconds every request waits before it is answered (or faulted).
        stall_s: How long a stall lasts at most (teardown ends it sooner).
        ignore_range: Answer ``Range`` requests with 200 and the whole body.
        ignore_if_range: Honour ``Range`` even when ``If-Range`` names another ETag.
        no_etag: Send no ``ETag`` (and so no validator a client could send back).
        retry_after: The ``Retry-After`` of a 429 (seconds, or an HTTP-date).
    """

    p: float = 0.0
    mix: tuple[Fault, ...] = TRANSIENT_MIX
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    latency: float = 0.0
    stall_s: float = 30.0
    ignore_range: bool = False
    ignore_if_range: bool = False
    no_etag: bool = False
    retry_after: str = "0"
    _queued: dict[str, deque[Fault]] = field(default_factory=dict)
    _always: dict[str, Fault] = field(default_factory=dict)

    def once(self, path: str, *faults: Fault) -> None:
        """Queue ``faults`` for the next requests of ``path``, one each, in order."""
        self._queued.setdefault(path, deque()).extend(faults)

    def always(self, path: str, fault: Fault) -> None:
        """Give every request of ``path`` the fault ``fault``."""
        self._always[path] = fault

    def random(self, p: float, mix: Iterable[Fault] = TRANSIENT_MIX, *, seed: int = 0) -> None:
        """Fault each request with probability ``p``, drawing from ``mix`` with ``seed``."""
        self.p, self.mix, self.rng = p, tuple(mix), random.Random(seed)

    def pick(self, path: str) -> Fault | None:
        """The fault for this request of ``path``, if any (consumes a queued one)."""
        queued = self._queued.get(path)
        if queued:
            return queued.popleft()
        if path in self._always:
            return self._always[path]
        if self.p and self.rng.random() < self.p:
            return self.rng.choice(self.mix)
        return None


def reset(transport: asyncio.Transport) -> None:
    """Abort the connection with a TCP RST (a linger of 0 s), as a peer that crashed does: the
    client reads the bytes already sent, then ``ECONNRESET``. A plain abort sends a FIN."""
    sock = transport.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class FaultServer:
    """An aiohttp server on 127.0.0.1 serving ``n`` objects through a :class:`FaultPlan`.

    Attributes:
        n: Objects served (``/obj/{i}`` for ``0 <= i < n``; other indices answer 404).
        objects: Bodies that replace the default ``body(i)`` of their index.
        plan: The faults to inject; change it at any time.
        requests: Requests received, per path (faulted ones included).
        faults: Faults injected, per kind.
        injected: Every injected fault as ``(path, fault)``, in order.
        headers: The request headers of the last request of each path.
        ranges: Every ``Range`` header asked for, in order.
        active: Requests being handled now; ``max_active``: the most at once.
        stalled: Set when a stall begins (a test that cancels a stalled request waits on it).
    """

    def __init__(self, n: int = 1000) -> None:
        self.n = n
        self.plan = FaultPlan()
        self.requests: Counter[str] = Counter()
        self.faults: Counter[Fault] = Counter()
        self.injected: list[tuple[str, Fault]] = []
        self.headers: dict[str, dict[str, str]] = {}
        self.ranges: list[str] = []  # every Range header asked for, in order
        self.active = 0
        self.max_active = 0
        self.port = 0
        self.objects: dict[int, bytes] = {}
        self.stalled = asyncio.Event()
        self._stop = asyncio.Event()
        self._runner: web.AppRunner | None = None

    # -- addresses ----------------------------------------------------------------------------

    @property
    def base(self) -> str:
        """``http://127.0.0.1:{port}``."""
        return f"http://127.0.0.1:{self.port}"

    def url(self, i: int, *, redirect: bool = False) -> str:
        """The URL of object ``i`` (through a 302 when ``redirect``)."""
        return f"{self.base}/{'redirect' if redirect else 'obj'}/{i}"

    @staticmethod
    def path(i: int) -> str:
        """The path of object ``i``, as counted in :attr:`requests`."""
        return f"/obj/{i}"

    @property
    def total_faults(self) -> int:
        """Faults injected so far."""
        return sum(self.faults.values())

    # -- lifetime ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind 127.0.0.1 on a free port and start serving."""
        app = web.Application(middlewares=[self._middleware])
        app.router.add_get("/obj/{i:\\d+}", self._object)
        app.router.add_get("/redirect/{i:\\d+}", self._redirect)
        app.router.add_get("/signed-redirect/{i:\\d+}", self._signed_redirect)
        app.router.add_get("/signed-elsewhere/{i:\\d+}", self._signed_elsewhere)
        app.router.add_get("/signed-ftp/{i:\\d+}", self._signed_elsewhere)
        app.router.add_get("/loop", self._loop)
        self._runner, self.port = await serve_on_loopback(app)

    async def stop(self) -> None:
        """Wake every stalled handler, then stop the server and close its connections."""
        self._stop.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- handlers ------------------------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        self.requests[path] += 1
        self.headers[path] = dict(request.headers)
        if "Range" in request.headers:
            self.ranges.append(request.headers["Range"])
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if self.plan.latency:
                await asyncio.sleep(self.plan.latency)
            fault = self.plan.pick(path)
            if fault is None:
                return await handler(request)
            self.faults[fault] += 1
            self.injected.append((path, fault))
            return await self._inject(request, fault, handler)
        finally:
            self.active -= 1

    async def _inject(
        self, request: web.Request, fault: Fault, handler: Handler
    ) -> web.StreamResponse:
        if fault is Fault.S429:
            headers = {"Retry-After": self.plan.retry_after}
            return web.Response(status=429, text="slow down", headers=headers)
        if fault.value.isdigit():
            return web.Response(status=int(fault), text=f"injected {fault}")
        if fault is Fault.STALL:
            self.stalled.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.plan.stall_s)
            return await handler(request)  # the client is usually gone by now
        transport = request.transport
        if fault is Fault.RESET:
            assert transport is not None
            transport.abort()
            raise web.HTTPServiceUnavailable  # never written: the connection is gone
        # TRUNCATE, RESET_BODY: promise the whole answer, send half of it, end the connection.
        answer = self._answer(request)
        assert isinstance(answer.body, bytes)
        resp = web.StreamResponse(status=answer.status, headers=answer.headers)
        resp.content_length = len(answer.body)
        await resp.prepare(request)
        await resp.write(answer.body[: len(answer.body) // 2])
        assert transport is not None
        if fault is Fault.RESET_BODY:
            reset(transport)
        else:
            transport.close()
        return resp

    def _answer(self, request: web.Request) -> web.Response:
        i = int(request.match_info.get("i", "0"))
        if i >= self.n:
            raise web.HTTPNotFound(text=f"no object {i}")
        data = self.objects.get(i, body(i))
        etag = f'"{zlib.crc32(data):08x}-{len(data)}"'
        if_range = request.headers.get("If-Range")
        ranged = request.headers.get("Range") is not None and not self.plan.ignore_range
        stale = if_range is not None and if_range != etag and not self.plan.ignore_if_range
        validator = {} if self.plan.no_etag else {"ETag": etag}
        if not ranged or stale:
            return web.Response(
                body=data, content_type="application/octet-stream", headers=validator
            )
        try:
            rng = request.http_range
        except ValueError:
            raise web.HTTPRequestRangeNotSatisfiable from None
        start, stop, _ = rng.indices(len(data))
        if rng.start is not None and rng.start >= len(data):
            raise web.HTTPRequestRangeNotSatisfiable(
                headers={"Content-Range": f"bytes */{len(data)}"}
            )
        return web.Response(
            status=206,
            body=data[start:stop],
            content_type="application/octet-stream",
            headers={"Content-Range": f"bytes {start}-{stop - 1}/{len(data)}", **validator},
        )

    async def _object(self, request: web.Request) -> web.StreamResponse:
        return self._answer(request)

    async def _signed_redirect(self, request: web.Request) -> web.StreamResponse:
        """A 302 to the object through a signed URL (a secret in the new URL's query)."""
        raise web.HTTPFound(f"/obj/{request.match_info['i']}?{SIGNATURE}")

    async def _signed_elsewhere(self, request: web.Request) -> web.StreamResponse:
        """A 302 to a signed URL on a port where nothing listens (the connection is refused),
        or, from ``/signed-ftp/``, to a signed URL that is not HTTP at all."""
        scheme = "ftp" if request.path.startswith("/signed-ftp/") else "http"
        target = f"{scheme}://127.0.0.1:1/obj/{request.match_info['i']}?{SIGNATURE}"
        raise web.HTTPFound(target)

    async def _redirect(self, request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound(f"/obj/{request.match_info['i']}")

    async def _loop(self, request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound("/loop")


@pytest_asyncio.fixture
async def fault_server() -> AsyncIterator[FaultServer]:
    """A started :class:`FaultServer` with 1000 objects and no faults planned; stopped at
    teardown."""
    server = FaultServer()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
