"""A real HTTP proxy on 127.0.0.1 in front of an S3 server (moto), injecting faults into the
object reads that pass through it, for testing object-store sources.

``S3FaultProxy`` forwards every request to the upstream server unchanged and answers with the
upstream's answer, except for a GET whose path has a fault in the proxy's
:class:`~tests.support.http_server.FaultPlan` (the same plans and faults as the HTTP
``FaultServer``): a status fault answers with S3's XML error body (``SlowDown`` for 503,
``AccessDenied`` for 403, ...) and never reaches the upstream; ``RESET`` resets the connection
(TCP RST) before any byte of the answer; ``RESET_BODY``, ``TRUNCATE`` and ``STALL`` send the
upstream's status, headers (with the full ``Content-Length``) and the first :attr:`cut` of its
body, then reset the connection, close it, or send nothing more until teardown.

Use it through :func:`s3_proxy` (a context manager). It serves from its own thread and event
loop, as moto's threaded server does: ``sources.objects`` lists a prefix with a blocking call,
which would stall a proxy sharing the caller's loop. It binds port 0 on 127.0.0.1 only, and at
teardown it wakes every stalled handler and stops, so no handler outlives the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter, defaultdict
from collections.abc import Iterator

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from tests.support.http_server import Fault, FaultPlan, reset, serve_on_loopback

__all__ = ["S3_ERROR_CODES", "S3FaultProxy", "s3_proxy"]

# The code S3 puts in the XML body of each status the proxy can answer with.
S3_ERROR_CODES = {
    400: "InvalidArgument",
    403: "AccessDenied",
    404: "NoSuchKey",
    412: "PreconditionFailed",
    429: "SlowDown",
    500: "InternalError",
    503: "SlowDown",
}
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade"}
)


def s3_error(status: int, path: str) -> web.Response:
    """S3's answer for ``status``: its XML error document naming the resource."""
    code = S3_ERROR_CODES[status]
    xml = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>injected {status}</Message>"
        f"<Resource>{path}</Resource><RequestId>aioloader-test</RequestId></Error>"
    )
    return web.Response(status=status, text=xml, content_type="application/xml")


class S3FaultProxy:
    """An aiohttp server on 127.0.0.1 forwarding to ``upstream`` through a :class:`FaultPlan`.

    Attributes:
        upstream: The S3 server's URL (``http://127.0.0.1:{port}``).
        plan: The faults to inject into GETs, by request path (``/bucket/key``).
        cut: The fraction of a body sent before ``RESET_BODY``, ``TRUNCATE`` or ``STALL``.
        requests: GET requests received, per path (faulted ones included).
        ranges: The ``Range`` header of each GET of a path, in order (None: no range).
        faults: Faults injected, per kind.
        injected: Every injected fault as ``(path, fault)``, in order.
    """

    def __init__(self, upstream: str, *, cut: float = 0.25) -> None:
        self.upstream = upstream.rstrip("/")
        self.plan = FaultPlan()
        self.cut = cut
        self.requests: Counter[str] = Counter()
        self.ranges: defaultdict[str, list[str | None]] = defaultdict(list)
        self.faults: Counter[Fault] = Counter()
        self.injected: list[tuple[str, Fault]] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="s3-fault-proxy")
        self._stop = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._client: aiohttp.ClientSession | None = None

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:{port}``, the endpoint to give a store."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def total_faults(self) -> int:
        """Faults injected so far."""
        return sum(self.faults.values())

    def start(self) -> None:
        """Start the proxy's thread, bind 127.0.0.1 on a free port and start forwarding."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout=30)

    def stop(self) -> None:
        """Wake every stalled handler, stop the server and its upstream client, then the
        thread."""
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
        self._loop.close()

    async def _serve(self) -> None:
        # No decompression: the proxy hands the upstream's bytes on as they are.
        self._client = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner, self.port = await serve_on_loopback(app)

    async def _close(self) -> None:
        self._stop.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        fault = None
        if request.method == "GET":
            self.requests[request.path] += 1
            self.ranges[request.path].append(request.headers.get("Range"))
            fault = self.plan.pick(request.path)
        if fault is not None:
            self.faults[fault] += 1
            self.injected.append((request.path, fault))
            if fault.value.isdigit():
                return s3_error(int(fault), request.path)
            if fault is Fault.RESET:
                assert request.transport is not None
                reset(request.transport)
                raise web.HTTPServiceUnavailable  # never written: the connection is gone
        status, headers, body = await self._upstream(request)
        if fault is None:
            return web.Response(status=status, body=body, headers=headers)
        resp = web.StreamResponse(status=status, headers=headers)
        resp.content_length = len(body)
        await resp.prepare(request)
        await resp.write(body[: int(len(body) * self.cut)])
        transport = request.transport
        assert transport is not None
        if fault is Fault.RESET_BODY:
            reset(transport)
        elif fault is Fault.TRUNCATE:
            transport.close()
        else:
            assert fault is Fault.STALL, fault
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.plan.stall_s)
            transport.close()
        return resp

    async def _upstream(self, request: web.Request) -> tuple[int, CIMultiDict[str], bytes]:
        """The upstream's status, end-to-end headers and body for ``request``."""
        assert self._client is not None
        headers = _end_to_end(request.headers)
        async with self._client.request(
            request.method,
            f"{self.upstream}{request.rel_url}",
            headers=headers,
            data=await request.read(),
            allow_redirects=False,
        ) as answer:
            return answer.status, _end_to_end(answer.headers), await answer.read()


def _end_to_end(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    """``headers`` without the hop-by-hop ones (and the length, which each hop sets)."""
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _HOP_BY_HOP)


@contextlib.contextmanager
def s3_proxy(upstream: str, *, cut: float = 0.25) -> Iterator[S3FaultProxy]:
    """A started :class:`S3FaultProxy` in front of ``upstream``, with no faults planned;
    stopped on exit."""
    proxy = S3FaultProxy(upstream, cut=cut)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()
