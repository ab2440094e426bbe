"""Items fetched over HTTP(S): ``urls([...])`` is an :class:`~aioloader.AsyncDataset` of bodies.

Owns: one ``aiohttp.ClientSession`` per open dataset (a connection pool of ``connections``,
opened by ``async with`` — the loader's scope does it — and closed when that scope exits),
the request of one item or one byte range, and turning what goes wrong into exceptions that say
which item, which (redacted) URL and what happened: an error status, a connection that broke, a
body cut short, a timeout. Failures worth retrying are marked transient (``TransientError``,
``ConnectionError`` or ``TimeoutError``), so the loader's :class:`~aioloader.RetryPolicy`
retries them.

Never: retries anything itself, not even aiohttp's silent resend of a GET whose connection
broke (every attempt is the loader's, counted in its statistics and bounded by its policy);
logs; or shows credentials. A URL in a message or ``repr`` keeps its scheme, host, port and path
only: user info, query string (where signed URLs carry their signature and token) and fragment
are replaced. An aiohttp exception is kept as ``__cause__`` unless its own text would show them.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, Self, overload
from urllib.parse import unquote, urlsplit

import aiohttp
import anyio
from multidict import CIMultiDictProxy

from .._base.checks import check_int, check_seconds
from .._base.exceptions import AioLoaderError, LoaderStateError, TransientError
from .._data.dataset import AsyncDataset
from ._gate import ByteGate, holding
from ._keyed import Keyed, keyed

__all__ = [
    "HTTPConnectionError",
    "HTTPStatusError",
    "HTTPTimeoutError",
    "TransientHTTPError",
    "UrlDataset",
    "redact_url",
    "urls",
]

#: Statuses worth retrying: timeout, too early, throttled, and the server's passing troubles.
TRANSIENT_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})

#: An error response's body is read (so its connection can be reused) when at most this long.
_DRAIN_LIMIT = 64 * 1024

_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` without anything secret: scheme, host, port and path are kept; user info is
    dropped, and a query string or fragment is replaced by ``<redacted>``.

    Example: ``https://user:pw@host/a/b?X-Amz-Signature=...`` → ``https://host/a/b?<redacted>``.
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    host = parts.netloc.rpartition("@")[2]
    query = "?<redacted>" if parts.query else ""
    fragment = "#<redacted>" if parts.fragment else ""
    return f"{parts.scheme}://{host}{parts.path}{query}{fragment}"


def _secrets_of(url: str) -> list[str]:
    """The parts of ``url`` that :func:`redact_url` hides, raw and percent-decoded."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return [url]
    userinfo = parts.netloc.rpartition("@")[0]
    found = [userinfo, parts.query, parts.fragment]
    found += userinfo.split(":")
    for piece in re.split(r"[&;]", parts.query):  # each value (a bare piece: all of it)
        found.append(piece.partition("=")[2] or piece)
    found += [unquote(s) for s in found]
    return [s for s in found if s]


_URL_IN_TEXT = re.compile(r"[a-zA-Z][a-zA-Z0-9+.\-]*://[^\s'\"<>]+")


def _names_secret_url(text: str) -> bool:
    """Whether ``text`` shows any URL with user info, a query or a fragment (a redirect's
    target is signed where the URL asked for was not: its secrets are not ``url``'s)."""
    return any(redact_url(found) != found for found in _URL_IN_TEXT.findall(text))


def _shows_secrets(exc: BaseException, url: str) -> bool:
    """Whether the text of ``exc``, or of an exception chained to it, shows a secret of ``url``
    (aiohttp's ``TooManyRedirects`` and ``ConnectionTimeoutError`` name the full URL), or any
    URL that carries user info or a query (``NonHttpUrlRedirectClientError`` is the Location a
    redirect pointed at)."""
    secrets = [s for s in _secrets_of(url) if s]
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        try:
            text = f"{e}\n{e!r}\n" + "\n".join(map(str, getattr(e, "__notes__", ())))
        except Exception:  # a broken __str__: treat it as unsafe
            return True
        if any(s in text for s in secrets) or _names_secret_url(text):
            return True
        todo += [e.__cause__, e.__context__]
    return False


# -- exceptions ---------------------------------------------------------------------------------


class HTTPStatusError(AioLoaderError):
    """The server answered with a status other than 2xx (or a 206 with the wrong range).

    Attributes:
        status: The HTTP status.
        url: The URL asked for, redacted (no user info, query string or fragment).
    """

    def __init__(self, message: str, *, status: int, url: str) -> None:
        super().__init__(message)
        self.status = status
        self.url = url

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild,
            (type(self), str(self), {"status": self.status, "url": self.url}),
            self.__dict__,
        )


class TransientHTTPError(HTTPStatusError, TransientError):
    """An error status worth retrying: 408, 425, 429, 500, 502, 503 or 504. The default
    :class:`~aioloader.RetryPolicy` retries it (it is a :class:`~aioloader.TransientError`)."""


class HTTPConnectionError(AioLoaderError, TransientError, ConnectionError):
    """The exchange broke before a whole response arrived: the connection could not be made, was
    reset or closed by the server, or the body was shorter than its ``Content-Length``.

    It is a :class:`~aioloader.TransientError` and a ``ConnectionError``, so the default
    :class:`~aioloader.RetryPolicy` retries it.

    Attributes:
        url: The URL asked for, redacted.
    """

    def __init__(self, message: str, *, url: str) -> None:
        super().__init__(message)
        self.url = url

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), str(self), {"url": self.url}), self.__dict__)


class HTTPTimeoutError(AioLoaderError, TransientError, TimeoutError):
    """No complete response within the dataset's ``timeout``. A ``TimeoutError`` (and a
    :class:`~aioloader.TransientError`), so the default :class:`~aioloader.RetryPolicy` retries it.

    Attributes:
        url: The URL asked for, redacted.
        timeout: The limit that was exceeded, in seconds.
    """

    def __init__(self, message: str, *, url: str, timeout: float) -> None:
        super().__init__(message)
        self.url = url
        self.timeout = timeout

    def __reduce__(self) -> tuple[Any, ...]:
        state = {"url": self.url, "timeout": self.timeout}
        return (_rebuild, (type(self), str(self), state), self.__dict__)


def _rebuild(cls: type[Exception], message: str, kwargs: dict[str, Any]) -> Exception:
    return cls(message, **kwargs)


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
                    raise status_error(status, reason, raw, where)
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


def client_error(exc: BaseException, raw: str, where: str, timeout: float) -> Exception:
    """The error to raise for an aiohttp or socket exception while asking for ``raw``:
    transient (``HTTPTimeoutError``, ``HTTPConnectionError``) when a new attempt may work.
    Messages name ``where`` and never a secret of ``raw``; the caller chains ``exc`` unless
    :func:`_shows_secrets` says its text is unsafe."""
    url = redact_url(raw)
    if isinstance(exc, TimeoutError):  # aiohttp's ServerTimeoutError is one too
        return HTTPTimeoutError(
            f"no whole response from {where} within timeout={timeout}s", url=url, timeout=timeout
        )
    if isinstance(exc, aiohttp.TooManyRedirects):
        return HTTPStatusError(
            f"too many redirects from {where} ({len(exc.history)} followed)",
            status=exc.history[-1].status if exc.history else exc.status,
            url=url,
        )
    if isinstance(exc, aiohttp.InvalidURL):
        return ValueError(f"invalid URL {where}")
    if isinstance(exc, aiohttp.ClientPayloadError):
        return HTTPConnectionError(f"body of {where} cut short: {_describe(exc, raw)}", url=url)
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return HTTPConnectionError(f"server disconnected before answering {where}", url=url)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return HTTPConnectionError(f"cannot connect for {where}: {_describe(exc, raw)}", url=url)
    return HTTPConnectionError(f"connection failed for {where}: {_describe(exc, raw)}", url=url)


def status_error(status: int, reason: str | None, raw: str, where: str) -> HTTPStatusError:
    """The error for a non-2xx answer: :class:`TransientHTTPError` for the statuses worth
    retrying, :class:`HTTPStatusError` otherwise. A reason phrase that echoes a secret of ``raw``
    is left out."""
    kind = TransientHTTPError if status in TRANSIENT_STATUSES else HTTPStatusError
    if reason and (any(s in reason for s in _secrets_of(raw)) or _names_secret_url(reason)):
        reason = None  # a server that echoes the URL in its reason phrase
    text = f"HTTP {status} {reason or ''}".rstrip()
    return kind(f"{text} from {where}", status=status, url=redact_url(raw))


def _describe(exc: BaseException, raw_url: str) -> str:
    """The exception's type and message, or only its type when the message shows a secret."""
    if _shows_secrets(exc, raw_url) or not str(exc):
        return type(exc).__name__
    return f"{type(exc).__name__}: {exc}"


async def _drain(resp: aiohttp.ClientResponse) -> None:
    """Read a short error body so its connection can serve the next request (a server that
    throttles answers many of them); a long or broken one just closes the connection.

    Cancellation: the read stops; the response's context closes the connection.
    """
    length = resp.content_length
    if length is not None and length <= _DRAIN_LIMIT:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            await resp.read()
