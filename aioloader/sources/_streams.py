"""One object read start to end as a stream of chunks, from a local file, an HTTP(S) URL or an
object store, resuming after a transient failure at the byte where it broke.

Owns: opening an object at a byte offset (a seek, an HTTP ``Range`` request, an object-store
range read), a stall timeout between chunks, and the resume loop, with the caller's
:class:`~aioloader.RetryPolicy` deciding whether and when to try again. Never: parses the bytes,
or shows credentials (a reader's ``name`` is redacted).

An HTTP resume asks for ``Range: bytes=<offset>-`` with ``If-Range`` set to the first answer's
``ETag``, so an object replaced mid-read is noticed instead of spliced (without an ETag, a
resumed answer whose total length or ``Last-Modified`` differs from the first is refused); a
server that ignores ranges answers the whole body again and the bytes already delivered are
skipped.
"""

from __future__ import annotations

import random
import re
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any, Protocol

import aiofiles
import aiohttp
import anyio

from .._base.retry import RetryPolicy
from ._httperrors import (
    HTTPConnectionError,
    HTTPStatusError,
    _shows_secrets,
    client_error,
    redact_url,
    status_error,
)
from ._objects import store_error

__all__ = ["ChunkReader", "FileReader", "HTTPReader", "StoreReader", "StallError", "resumable"]

_CONTENT_RANGE_START = re.compile(r"^\s*bytes\s+(\d+)-", re.IGNORECASE)
_CONTENT_RANGE_TOTAL = re.compile(r"^\s*bytes\s+\d+-\d+/(\d+)\s*$", re.IGNORECASE)
_UNSATISFIED = re.compile(r"^\s*bytes\s+\*/(\d+)\s*$", re.IGNORECASE)


class StallError(TimeoutError):
    """No byte of an object arrived within the reader's stall timeout. A ``TimeoutError``, so
    the default :class:`~aioloader.RetryPolicy` resumes the read."""


class ChunkReader(Protocol):
    """Reads one object from a byte offset to its end."""

    @property
    def name(self) -> str:
        """The object's path or URL, safe to show (no credentials)."""
        ...

    def chunks(self, offset: int) -> AsyncGenerator[bytes, None]:
        """The object's bytes from ``offset`` to its end, in chunks; closing the generator
        closes whatever it opened."""
        ...


class FileReader:
    """A local file, read with aiofiles."""

    def __init__(self, path: str, chunk_size: int) -> None:
        self.name = path
        self._chunk = chunk_size

    async def chunks(self, offset: int) -> AsyncGenerator[bytes, None]:
        # Opening and closing are shielded: a cancellation while the thread opens the file
        # would leave it open, and one while it closes would skip the close.
        with anyio.CancelScope(shield=True):
            f = await aiofiles.open(self.name, "rb")
        try:
            if offset:
                await f.seek(offset)
            while chunk := await f.read(self._chunk):
                yield chunk
        finally:
            with anyio.CancelScope(shield=True):
                await f.close()


class HTTPReader:
    """An HTTP(S) URL, read through a session the caller owns."""

    def __init__(
        self, session: aiohttp.ClientSession, url: str, chunk_size: int, timeout: float
    ) -> None:
        self._session = session
        self._raw = url
        self.name = redact_url(url)
        self._chunk = chunk_size
        self._timeout = timeout
        self._etag: str | None = None
        self._total: int | None = None  # the object's length, from the first answer
        self._modified: str | None = None  # its Last-Modified, from the first answer

    async def chunks(self, offset: int) -> AsyncGenerator[bytes, None]:
        headers = {"Accept-Encoding": "identity"}
        if offset:
            headers["Range"] = f"bytes={offset}-"
            if self._etag is not None:
                headers["If-Range"] = self._etag
        try:
            async with self._session.get(self._raw, headers=headers) as resp:
                if _ends_at(resp, offset):
                    return  # the break came after the last byte: nothing is left to read
                skip = self._check(resp, offset)
                async for chunk in resp.content.iter_chunked(self._chunk):
                    if skip >= len(chunk):
                        skip -= len(chunk)
                        continue
                    yield chunk[skip:] if skip else chunk
                    skip = 0
                if skip:
                    raise HTTPConnectionError(
                        f"{self.name} ended before byte {offset} on a resumed read", url=self.name
                    )
        except (aiohttp.ClientError, OSError) as exc:
            if isinstance(exc, HTTPConnectionError | StallError):
                raise
            error = client_error(exc, self._raw, self.name, self._timeout)
            cause = None if _shows_secrets(exc, self._raw) else exc
        else:
            return
        raise error from cause

    def _check(self, resp: aiohttp.ClientResponse, offset: int) -> int:
        """How many leading bytes of this answer to skip; raise for an answer that is no use."""
        if not 200 <= resp.status < 300:
            raise status_error(
                resp.status, resp.reason, self._raw, self.name, resp.headers.get("Retry-After")
            )
        etag = resp.headers.get("ETag")
        if offset == 0:
            self._etag = etag
            self._total = resp.content_length
            self._modified = resp.headers.get("Last-Modified")
            return 0
        if self._etag is None:  # no strong validator: the length and date must not change
            self._same_object(resp, offset)
        if self._etag is not None and etag is not None and etag != self._etag:
            raise HTTPStatusError(
                f"{self.name} changed while it was read (ETag {self._etag} became {etag}); "
                f"refusing to splice it at byte {offset}",
                status=resp.status,
                url=self.name,
            )
        if resp.status == 206:
            match = _CONTENT_RANGE_START.match(resp.headers.get("Content-Range", ""))
            if match is None or int(match[1]) != offset:
                got = resp.headers.get("Content-Range", "no Content-Range")
                raise HTTPStatusError(
                    f"HTTP 206 from {self.name} answered {got!r} to a resume at byte {offset}",
                    status=206,
                    url=self.name,
                )
            return 0
        if self._etag is not None and etag is None:
            raise HTTPStatusError(
                f"{self.name} answered a resume at byte {offset} with the whole body and no "
                "ETag: it cannot be told from a replaced object; refusing to splice it",
                status=resp.status,
                url=self.name,
            )
        return offset  # the server ignored Range: skip what was already delivered

    def _same_object(self, resp: aiohttp.ClientResponse, offset: int) -> None:
        """Without an ETag, refuse a resumed answer whose total length or ``Last-Modified``
        differs from the first answer's (RFC 9110: a weak check, but a splice of two objects of
        different lengths is certain)."""
        total: int | None = None
        match = _CONTENT_RANGE_TOTAL.match(resp.headers.get("Content-Range", ""))
        if resp.status == 206 and match is not None:
            total = int(match[1])
        elif resp.status == 200:
            total = resp.content_length
        modified = resp.headers.get("Last-Modified")
        problem = ""
        if self._total is not None and total is not None and total != self._total:
            problem = f"length {self._total} became {total}"
        elif self._modified is not None and modified is not None and modified != self._modified:
            problem = f"Last-Modified {self._modified} became {modified}"
        if problem:
            raise HTTPStatusError(
                f"{self.name} changed while it was read ({problem}, and it has no ETag); "
                f"refusing to splice it at byte {offset}",
                status=resp.status,
                url=self.name,
            )


def _ends_at(resp: aiohttp.ClientResponse, offset: int) -> bool:
    """Whether ``resp`` is a 416 saying the object is ``offset`` bytes long (a resume asked for
    the bytes after its last one: the read was complete when the connection broke)."""
    if resp.status != 416 or not offset:
        return False
    match = _UNSATISFIED.match(resp.headers.get("Content-Range", ""))
    return match is not None and int(match[1]) == offset


class StoreReader:
    """An object in an obstore store."""

    def __init__(self, store: Any, key: str, name: str, chunk_size: int) -> None:
        self._store = store
        self._key = key
        self.name = name
        self._chunk = chunk_size
        self._etag: str | None = None

    async def chunks(self, offset: int) -> AsyncGenerator[bytes, None]:
        import obstore

        options: dict[str, Any] = {}
        if offset:
            options["range"] = {"offset": offset}
            if self._etag is not None:
                options["if_match"] = self._etag  # a replaced object fails, is not spliced
        try:
            result = await obstore.get_async(self._store, self._key, options=options)  # type: ignore[arg-type]
            if offset == 0:
                self._etag = result.meta.get("e_tag")
            async for chunk in result.stream(min_chunk_size=self._chunk):
                yield bytes(chunk)
        except Exception as exc:
            error = store_error(exc, self.name)
            raise error from error.__cause__


async def resumable(
    reader: ChunkReader,
    retry: RetryPolicy | None,
    *,
    stall_timeout: float | None,
    on_retry: Any = None,
    start: int = 0,
) -> AsyncGenerator[bytes, None]:
    """The bytes of ``reader``'s object from byte ``start`` on, resuming from the next byte
    after a failure that ``retry`` calls worth another attempt.

    Attempts are counted per stall: an attempt that delivered bytes before failing starts the
    count afresh, so a long object on a flaky link is not failed by breaks spread over hours.
    ``on_retry()`` is called before each new attempt.

    Raises:
        StallError: No chunk arrived within ``stall_timeout`` seconds, and retries ran out.
        Exception: The reader's error when it is not worth retrying or retries ran out, with a
            note naming the object, the byte offset and the attempt.

    Cancellation: the open request or file is closed before the cancellation propagates.
    """
    rng = random.Random()
    offset = start
    failures = 0
    while True:
        try:
            async with aclosing(reader.chunks(offset)) as chunks:
                while (chunk := await _next(chunks, stall_timeout, reader, offset)) is not None:
                    offset += len(chunk)
                    failures = 0
                    yield chunk
        except Exception as exc:
            failures += 1
            if retry is None or not retry.should_retry(exc, failures):
                exc.add_note(
                    f"aioloader: reading {reader.name} at byte {offset} (attempt {failures})"
                )
                raise
            if on_retry is not None:
                on_retry()
            await anyio.sleep(retry.delay(exc, failures, rng))
        else:
            return


async def _next(
    chunks: AsyncIterator[bytes], stall: float | None, reader: ChunkReader, at: int
) -> bytes | None:
    """The next chunk, None at the end; :class:`StallError` when it takes over ``stall`` s."""
    with anyio.move_on_after(stall):
        return await anext(chunks, None)
    raise StallError(f"no bytes from {reader.name} for {stall}s (stalled at byte {at})")
