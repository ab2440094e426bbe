"""Items fetched over HTTP(S): ``urls([...])`` is an :class:`~aioloader.AsyncDataset` of bodies.

Owns: one ``aiohttp.ClientSession`` per open dataset (a connection pool of ``connections``,
opened by ``async with`` — the loader's scope does it — and closed when that scope exits),
and the request of one item or one byte range. What goes wrong becomes an exception of
``_httperrors.py`` that says which item, which (redacted) URL and what happened; the transient
ones are retried by the loader's :class:`~aioloader.RetryPolicy`.

Never: retries anything itself, not even aiohttp's silent resend of a GET whose connection
broke (every attempt is the loader's, counted in its statistics and bounded by its policy);
logs; or shows credentials (a URL in a ``repr`` is redacted as ``_httperrors.py`` says).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, Self, overload
from urllib.parse import urlsplit

import aiohttp
import anyio
from multidict import CIMultiDictProxy

from .._base.checks import check_int, check_seconds
from .._base.exceptions import LoaderStateError
from .._data.dataset import AsyncDataset
from ._gate import ByteGate, holding
from ._httperrors import (
    HTTPConnectionError,
    HTTPStatusError,
    _shows_secrets,
    client_error,
    redact_url,
    status_error,
)
from ._keyed import Keyed, keyed

__all__ = ["UrlDataset", "urls"]

#: An error response's body is read (so its connection can be reused) when at most this long.
_DRAIN_LIMIT = 64 * 1024

_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$", re.IGNORECASE)


# -- the dataset --------------------------------------------------------------------------------


@overload
def urls(
    urls: Sequence[str],
    *,
    connections: int = 64,
    timeout: float = 30.0,
    headers: Mapping[str, str] | None = None,
    max_bytes_in_flight: int | None = None,
    with_keys: Literal[False] = False,
) -> UrlDataset: ...
@overload
def urls(
    urls: Sequence[str],
    *,
    connections: int = 64,
    timeout: float = 30.0,
    headers: Mapping[str, str] | None = None,
    max_bytes_in_flight: int | None = None,
    with_keys: Literal[True],
) -> Keyed[bytes]: ...
def urls(
    urls: Sequence[str],
    *,
    connections: int = 64,
    timeout: float = 30.0,
    headers: Mapping[str, str] | None = None,
    max_bytes_in_flight: int | None = None,
    with_keys: bool = False,
) -> UrlDataset | Keyed[bytes]:
    """A dataset whose item ``i`` is the body of ``urls[i]``, fetched with HTTP GET.

    Example::

        ds = aioloader.sources.urls([f"https://host/shard/{i}.bin" for i in range(n)])
        loader = aioloader.DataLoader(ds, batch_size=32, retry=aioloader.RetryPolicy())
        async with loader:
            async for batch in loader: ...   # batch: a list of bytes

    Args:
        urls: ``http://`` or ``https://`` URLs; the dataset keeps a copy.
        connections: Most connections open at once (the pool's size). Requests beyond it wait
            for a free connection; that wait does not count toward ``timeout``.
        timeout: Seconds one request may take, from when it has a connection slot until its
            whole body has arrived (redirects included).
        headers: Sent with every request (e.g. ``Authorization``); never shown in a ``repr`` or
            an error.
        max_bytes_in_flight: Bound on the bytes of bodies being received at once (each body
            counted by its ``Content-Length`` once the headers arrive; a body without one is
            read alone). A body larger than the bound is read alone too. None:
            only ``connections`` bounds the transfer; the loader's ``max_inflight_bytes`` bounds
            what is held after it.
        with_keys: Items are ``(key, bytes)``, the key being the URL without its query string
            or credentials (a signed URL's signature stays out of the samples).

    Returns:
        The dataset; the loader opens and closes its client session.

    Raises:
        TypeError: ``urls`` is a single string, or holds something that is not a string;
            ``connections`` is not an int.
        ValueError: A URL is not http(s); ``connections`` or ``max_bytes_in_flight`` is below
            1; ``timeout`` is not a positive number.
    """
    dataset = UrlDataset(
        urls,
        connections=connections,
        timeout=timeout,
        headers=headers,
        max_bytes_in_flight=max_bytes_in_flight,
    )
    return keyed(dataset, dataset.key) if with_keys else dataset


class UrlDataset(AsyncDataset[bytes]):
    """Bodies of HTTP(S) URLs, by index; see :func:`urls`.

    It holds a client session while open: ``async with dataset:`` (a
    :class:`~aioloader.DataLoader` does that for its scope). It may be opened again after it
    was closed, and entered more than once at a time in one event loop (the session is shared
    and closed when the last user leaves).
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        connections: int = 64,
        timeout: float = 30.0,
        headers: Mapping[str, str] | None = None,
        max_bytes_in_flight: int | None = None,
    ) -> None:
        """See :func:`urls`."""
        if isinstance(urls, str | bytes):
            raise TypeError("urls must be a sequence of URLs, not a single string")
        self._urls: tuple[str, ...] = tuple(urls)
        for i, url in enumerate(self._urls):
            if not isinstance(url, str):
                raise TypeError(f"urls[{i}] must be a str, got {type(url).__qualname__}")
            if not url[:8].lower().startswith(("http://", "https://")):
                raise ValueError(f"urls[{i}] is not an http(s) URL: {redact_url(url)!r}")
        self.connections = check_int("connections", connections, minimum=1)
        self.timeout = check_seconds("timeout", timeout)
        self._headers = dict(headers or {})
        self.max_bytes_in_flight = max_bytes_in_flight
        if max_bytes_in_flight is not None:
            ByteGate(max_bytes_in_flight)  # validate now, not when first opened
        self._gate: ByteGate | None = None
        self._session: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._users = 0

    def __len__(self) -> int:
        """The number of URLs."""
        return len(self._urls)

    def key(self, index: int) -> str:
        """``urls[index]`` without its query string or credentials.

        Raises:
            IndexError: ``index`` is out of range.
        """
        parts = urlsplit(self._urls[index])
        host = parts.netloc.rpartition("@")[2]  # user info (credentials) left out
        return f"{parts.scheme}://{host}{parts.path}"

    @property
    def peak_bytes_in_flight(self) -> int:
        """The most body bytes held against ``max_bytes_in_flight`` at once, while open (0
        without the bound)."""
        return 0 if self._gate is None else self._gate.peak

    def __repr__(self) -> str:
        first = f", first={redact_url(self._urls[0])!r}" if self._urls else ""
        state = "open" if self._session is not None else "closed"
        return (
            f"aioloader.sources.UrlDataset({len(self._urls)} URLs{first}, "
            f"connections={self.connections}, timeout={self.timeout}, {state})"
        )

    # -- the session ---------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        """Open the client session (a pool of ``connections`` connections) in this event loop.

        Raises:
            LoaderStateError: It is already open in another event loop.

        Cancellation: nothing is left open.
        """
        loop = asyncio.get_running_loop()
        if self._session is not None:
            if loop is not self._loop:
                raise LoaderStateError(
                    "this UrlDataset is open in another event loop; a session serves one loop"
                )
            self._users += 1
            return self
        session = new_session(
            connector=aiohttp.TCPConnector(limit=self.connections),
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            headers=self._headers,
        )
        self._session, self._loop, self._users = session, loop, 1
        self._slots = asyncio.Semaphore(self.connections)
        if self.max_bytes_in_flight is not None:
            self._gate = ByteGate(self.max_bytes_in_flight)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the session when the last user leaves (its connections with it).

        Cancellation: the session is closed all the same (the close is shielded).
        """
        if self._session is None:
            return
        self._users -= 1
        if self._users > 0:
            return
        session, self._session, self._slots, self._loop = self._session, None, None, None
        self._gate = None
        with anyio.CancelScope(shield=True):
            await session.close()

    def _open(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        session, slots = self._session, self._slots
        if session is None or slots is None:
            raise LoaderStateError(
                "this UrlDataset is not open: use `async with dataset:` around its use (a "
                "DataLoader opens it for its `async with loader:` scope)"
            )
        if asyncio.get_running_loop() is not self._loop:
            raise LoaderStateError("this UrlDataset is open in another event loop")
        return session, slots

    # -- items ---------------------------------------------------------------------------------

    def concurrency(self) -> int:
        """``connections``: a fetch beyond them would wait for one (its timeouts running)."""
        return self.connections

    async def get(self, index: int) -> bytes:
        """The body of ``urls[index]``, read whole; redirects are followed.

        Raises:
            IndexError: ``index`` is out of range.
            LoaderStateError: The dataset is not open.
            TransientHTTPError: The server answered 408, 425, 429, 500, 502, 503 or 504.
            HTTPStatusError: It answered another status that is not 2xx (404, 403, ...), or
                redirected too often (``status``: the last redirect's).
            HTTPConnectionError: No connection, or it broke, or the body was cut short.
            HTTPTimeoutError: No whole response within ``timeout``.
            ValueError: aiohttp found the URL malformed.

        Cancellation: the request is abandoned and its connection closed; nothing is left
        running.
        """
        _, _, data = await self._fetch(index, None)
        return data

    async def get_range(self, index: int, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the body of ``urls[index]`` (fewer when the body ends
        sooner), asked for with ``Range: bytes=start-(end-1)``.

        A 206 answer must carry a ``Content-Range`` beginning at ``start``. A server that
        ignores ``Range`` and answers 200 with the whole body is handled too: the body is sliced
        (correct, but the whole body was transferred).

        Raises:
            ValueError: ``start < 0`` or ``end < start``; or aiohttp found the URL malformed.
            IndexError: ``index`` is out of range.
            LoaderStateError: The dataset is not open.
            HTTPStatusError: As :meth:`get`; also 416 when ``start`` is at or past the end of
                the body (whether the server said so or sent the whole body), and 206 when the
                server sent a different range than the one asked for.
            TransientHTTPError: As :meth:`get`.
            HTTPConnectionError: As :meth:`get`.
            HTTPTimeoutError: As :meth:`get`.

        Cancellation: as :meth:`get`.
        """
        if start < 0 or end < start:
            raise ValueError(f"need 0 <= start <= end, got start={start}, end={end}")
        if start == end:
            _ = self._urls[index]  # an out-of-range index raises all the same
            return b""
        headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
        status, resp_headers, data = await self._fetch(index, headers)
        url = redact_url(self._urls[index])
        if status != 206:  # the server ignored Range: slice the whole body
            if start >= len(data):
                raise HTTPStatusError(
                    f"HTTP {status} from {url} (item {index}) ignored Range and sent the whole "
                    f"{len(data)}-byte body; bytes {start}-{end - 1} are past its end",
                    status=416,
                    url=url,
                )
            return data[start:end]
        match = _CONTENT_RANGE.match(resp_headers.get("Content-Range", ""))
        first, last = (int(match[1]), int(match[2])) if match else (-1, -1)
        if first != start or last < first or last - first + 1 != len(data):
            got = resp_headers.get("Content-Range", "no Content-Range")
            raise HTTPStatusError(
                f"HTTP 206 from {url} (item {index}) answered {got!r} with {len(data)} bytes, "
                f"not bytes {start}-{end - 1}",
                status=206,
                url=url,
            )
        return data[: end - start]

    async def _fetch(
        self, index: int, headers: dict[str, str] | None
    ) -> tuple[int, CIMultiDictProxy[str], bytes]:
        """One GET: the status, headers and whole body of a 2xx answer; else the error.

        Raises:
            As :meth:`get`.

        Cancellation: as :meth:`get`.
        """
        raw = self._urls[index]
        session, slots = self._open()
        url = redact_url(raw)
        where = f"{url} (item {index})"
        async with slots:
            try:
                async with session.get(raw, headers=headers) as resp:
                    status, reason, resp_headers = resp.status, resp.reason, resp.headers
                    expected = resp.content_length
                    if 200 <= status < 300:
                        data = await self._read_body(resp)
                    else:
                        data = b""
                        await _drain(resp)
            except (aiohttp.ClientError, OSError) as exc:  # TimeoutError is an OSError
                error, cause = client_error(exc, raw, where, self.timeout), exc
            else:
                if not 200 <= status < 300:
                    raise status_error(status, reason, raw, where, resp_headers.get("Retry-After"))
                encoding = resp_headers.get("Content-Encoding", "identity").lower()
                if expected is not None and encoding == "identity" and len(data) != expected:
                    raise HTTPConnectionError(
                        f"body of {where} cut short: {len(data)} of {expected} bytes", url=url
                    )
                return status, resp_headers, data
        # Raised outside the except block, so a cause that shows secrets is not even kept as
        # the implicit __context__.
        raise error from (None if _shows_secrets(cause, raw) else cause)

    async def _read_body(self, resp: aiohttp.ClientResponse) -> bytes:
        """The whole body, holding its bytes against ``max_bytes_in_flight`` while it arrives:
        its ``Content-Length``, or the whole bound when the server sends none (such a body is
        read alone: counting it chunk by chunk could leave two bodies each waiting for the
        other's bytes, or one waiting for its own)."""
        gate, length = self._gate, resp.content_length
        size = gate.limit if gate is not None and length is None else (length or 0)
        async with holding(gate, size):
            return await resp.read()


def new_session(**options: Any) -> aiohttp.ClientSession:
    """An ``aiohttp.ClientSession`` that never resends a request by itself.

    aiohttp silently resends a GET once when its connection breaks before the response; retries
    belong to the caller's :class:`~aioloader.RetryPolicy` (counted, bounded, backed off), so
    that resend is turned off.
    """
    session = aiohttp.ClientSession(**options)
    if hasattr(session, "_retry_connection"):
        session._retry_connection = False
    return session


async def _drain(resp: aiohttp.ClientResponse) -> None:
    """Read a short error body so its connection can serve the next request (a server that
    throttles answers many of them); a long or broken one just closes the connection.

    Cancellation: the read stops; the response's context closes the connection.
    """
    length = resp.content_length
    if length is not None and length <= _DRAIN_LIMIT:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            await resp.read()
