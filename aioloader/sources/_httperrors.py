"""What goes wrong over HTTP(S), said without secrets: the exceptions of ``urls`` and of an HTTP
shard read, and URLs safe to show.

Owns: :class:`HTTPStatusError` and its kin, turning an aiohttp or socket exception or a non-2xx
status into one of them (saying which item or shard, which redacted URL and what happened),
marking the failures worth retrying as transient (``TransientError``, ``ConnectionError`` or
``TimeoutError``, so the caller's :class:`~aioloader.RetryPolicy` retries them), and
:func:`redact_url` with the checks that a text shows no secret of a URL.

Never: retries, logs, or shows credentials. A URL in a message or ``repr`` keeps its scheme, host,
port and path only: user info, query string (where signed URLs carry their signature and token)
and fragment are replaced. An aiohttp exception is kept as ``__cause__`` unless its own text would
show them.
"""

from __future__ import annotations

import datetime
import email.utils
import re
from typing import Any
from urllib.parse import unquote, urlsplit

import aiohttp

from .._base.exceptions import AioLoaderError, TransientError

__all__ = [
    "HTTPConnectionError",
    "HTTPStatusError",
    "HTTPTimeoutError",
    "TransientHTTPError",
    "redact_url",
]

#: Statuses worth retrying: timeout, too early, throttled, and the server's passing troubles.
TRANSIENT_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})


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
        retry_after: Seconds the server asked to wait before asking again (its
            ``Retry-After``, as seconds or a date), or None; a :class:`~aioloader.RetryPolicy`
            waits at least that long.
    """

    def __init__(
        self, message: str, *, status: int, url: str, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.url = url
        self.retry_after = retry_after

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


# -- classifying failures -----------------------------------------------------------------------


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


def status_error(
    status: int, reason: str | None, raw: str, where: str, retry_after: str | None = None
) -> HTTPStatusError:
    """The error for a non-2xx answer: :class:`TransientHTTPError` for the statuses worth
    retrying, :class:`HTTPStatusError` otherwise, with the seconds its ``Retry-After`` header
    asks for. A reason phrase that echoes a secret of ``raw`` is left out."""
    kind = TransientHTTPError if status in TRANSIENT_STATUSES else HTTPStatusError
    if reason and (any(s in reason for s in _secrets_of(raw)) or _names_secret_url(reason)):
        reason = None  # a server that echoes the URL in its reason phrase
    text = f"HTTP {status} {reason or ''}".rstrip()
    error = kind(f"{text} from {where}", status=status, url=redact_url(raw))
    error.retry_after = _seconds_after(retry_after)
    return error


def _seconds_after(header: str | None) -> float | None:
    """A ``Retry-After`` value in seconds from now: delta-seconds or an HTTP-date (RFC 9110);
    None for none or one that does not parse."""
    if not header:
        return None
    header = header.strip()
    if header.isascii() and header.isdigit():  # ("²".isdigit(): found by review)
        return float(header)
    try:
        when = email.utils.parsedate_to_datetime(header)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, (when - datetime.datetime.now(datetime.UTC)).total_seconds())


def _describe(exc: BaseException, raw_url: str) -> str:
    """The exception's type and message, or only its type when the message shows a secret."""
    if _shows_secrets(exc, raw_url) or not str(exc):
        return type(exc).__name__
    return f"{type(exc).__name__}: {exc}"
