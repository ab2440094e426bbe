"""Objects in an object store (S3 and S3-compatible endpoints, GCS, Azure, local, memory) as a
map-style dataset, through obstore.

Owns: configuring a store from a URL, listing a prefix once (sorted, filtered by suffix or
glob), whole-object and range reads, and turning store errors into errors that name the key and
say whether they are worth retrying. Never: retries by itself (obstore's own retries are turned
off so that the loader's :class:`~aioloader.RetryPolicy` retries, and counts, every attempt), or
shows credentials (they stay in the store's configuration, never in a message or ``repr``).

obstore runs its I/O on its own runtime threads and its async calls need an asyncio loop (uvloop
is one). It hangs in a forked child once the parent has used it: all reads happen in the parent's
event loop, and workers get bytes, never clients.
"""

from __future__ import annotations

import concurrent.futures
import fnmatch
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal, overload

from .._base.exceptions import TransientError
from .._data.dataset import AsyncDataset
from ._gate import ByteGate, holding
from ._keyed import Keyed, keyed
from ._markers import folder_markers
from ._patterns import check_key_filters

__all__ = ["ObjectDataset", "TransientStoreError", "objects"]

# obstore's message is a head, then this, then the debug form of object_store's error: its
# source chain, whose fields say what the head cannot ("HTTP error: request or response body
# error" is a reset mid-body, a body cut short and a stall alike; only the chain tells them).
_DEBUG = "\n\nDebug source:"
# The answer's status (object_store's RequestError::Status or ::Response).
_STATUS = re.compile(r"\b(?:Status|Response) \{\s*status: (\d{3})\b")
_TRANSIENT_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# No answer, or not all of it: object_store's own verdict (its HttpErrorKind, which it retries
# for an idempotent GET unless Unknown or Decode), then an I/O error further down the chain
# (std::io::Error's debug forms: Os { code, kind }, Custom { kind, error }, Kind(...)).
_HTTP_KIND = re.compile(r"\bHttpError \{\s*kind: (\w+)")
_TRANSIENT_HTTP_KINDS = frozenset({"Connect", "Request", "Timeout", "Interrupted"})
_IO_KIND = re.compile(r"\b(?:Os \{\s*code: -?\d+,\s*kind: |Custom \{\s*kind: |Kind\()(\w+)")
_TRANSIENT_IO_KINDS = frozenset(
    {
        "ConnectionReset",
        "ConnectionAborted",
        "ConnectionRefused",
        "NotConnected",
        "BrokenPipe",
        "UnexpectedEof",
        "TimedOut",
        "Interrupted",
    }
)


class TransientStoreError(TransientError):
    """A store request failed in a way worth retrying (throttled, 5xx, a timeout, a reset, a
    body cut short). The store's own exception is the ``__cause__``."""


def redact_store_url(url: str) -> str:
    """The URL without userinfo or query (signed URLs carry credentials there)."""
    url = re.sub(r"//[^/@]*@", "//", url)
    return url.split("?", 1)[0] + ("?<redacted>" if "?" in url else "")


class ObjectDataset(AsyncDataset[bytes]):
    """Item ``i`` is the content of the ``i``-th key under the prefix (sorted).

    Create it with :func:`objects`.

    Attributes:
        keys: The keys, relative to the URL's prefix, in item order.
        sizes: Their sizes in bytes, as listed (None when not known).
    """

    def __init__(
        self,
        store: Any,
        url: str,
        keys: Sequence[str],
        sizes: Sequence[int] | None = None,
        *,
        max_bytes_in_flight: int | None = None,
    ) -> None:
        self._store = store
        self._url = redact_store_url(url)
        self.keys = list(keys)
        self.sizes = None if sizes is None else list(sizes)
        if self.sizes is not None and len(self.sizes) != len(self.keys):
            raise ValueError(f"{len(self.sizes)} sizes for {len(self.keys)} keys")
        if max_bytes_in_flight is not None and self.sizes is None:
            raise ValueError("max_bytes_in_flight needs the objects' sizes")
        self._gate = None if max_bytes_in_flight is None else ByteGate(max_bytes_in_flight)

    def __len__(self) -> int:
        return len(self.keys)

    def __repr__(self) -> str:
        return f"ObjectDataset({self._url!r}, {len(self.keys)} objects)"

    @property
    def max_bytes_in_flight(self) -> int | None:
        """The bound on bytes being read at once, or None."""
        return None if self._gate is None else self._gate.limit

    @property
    def peak_bytes_in_flight(self) -> int:
        """The most object bytes held against ``max_bytes_in_flight`` at once (0 without it)."""
        return 0 if self._gate is None else self._gate.peak

    def _failed(self, exc: Exception, key: str) -> Exception:
        return store_error(exc, f"{self._url.rstrip('/')}/{key}")

    async def get(self, index: int) -> bytes:
        """The whole object ``keys[index]``.

        Raises:
            FileNotFoundError: The object is gone (obstore's ``NotFoundError``), naming the key.
            TransientStoreError: Throttling, a server error, a timeout or a broken connection.
            Exception: Any other store error, with a note naming the key.

        Cancellation: the request is dropped; nothing is left to close.
        """
        import obstore

        key = self.keys[index]
        try:
            async with holding(self._gate, self.sizes[index] if self.sizes else 0):
                result = await obstore.get_async(self._store, key)
                return bytes(await result.bytes_async())
        except Exception as exc:
            error = self._failed(exc, key)
            raise error from error.__cause__

    async def get_range(self, index: int, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of object ``keys[index]``.

        Raises:
            ValueError: ``start``/``end`` do not make a range.
            FileNotFoundError, TransientStoreError, Exception: as for :meth:`get`.

        Cancellation: as for :meth:`get`.
        """
        import obstore

        if not 0 <= start < end:
            raise ValueError(f"need 0 <= start < end, got start={start}, end={end}")
        key = self.keys[index]
        try:
            async with holding(self._gate, end - start):
                return bytes(await obstore.get_range_async(self._store, key, start=start, end=end))
        except Exception as exc:
            error = self._failed(exc, key)
            raise error from error.__cause__


def store_error(exc: Exception, where: str) -> Exception:
    """The error to raise for a store failure reading ``where`` (a redacted URL).

    Classified by the exception's type, then by what object_store's source chain in its text
    reports (see :func:`transient_cause`), never by words in the message's head: a missing
    object stays a ``FileNotFoundError`` (obstore's ``NotFoundError``) with a note naming it; a
    refusal (obstore's ``PermissionDeniedError``, ``UnauthenticatedError``,
    ``PreconditionError``, ... or a 4xx other than 408 and 429) keeps its type, with a note
    naming ``where``, and is not retried; throttling, 5xx and a request whose answer never came
    or broke off (a reset before or during the body, a body cut short, a timeout) become
    :class:`TransientStoreError` with the store's exception as ``__cause__``."""
    import obstore.exceptions as obs_exc

    if isinstance(exc, FileNotFoundError | obs_exc.NotFoundError):
        exc.add_note(f"aioloader: no object {where}")
        return exc
    if isinstance(exc, obs_exc.InvalidPathError):  # a listing met a key it cannot hold
        listing_failed(exc, where)
        return exc
    if type(exc) in (obs_exc.GenericError, obs_exc.BaseError):
        cause = transient_cause(str(exc))
        if cause is not None:
            error = TransientStoreError(f"reading {where} failed: {type(exc).__name__} ({cause})")
            error.__cause__ = exc
            return error
    exc.add_note(f"aioloader: while reading {where}")
    return exc


def listing_failed(exc: Exception, where: str) -> None:
    """Note on ``exc`` that listing ``where`` (a redacted URL) failed, and why where it is a
    key obstore cannot take (the whole listing fails with it)."""
    import obstore.exceptions as obs_exc

    if isinstance(exc, obs_exc.InvalidPathError):
        exc.add_note(
            f"aioloader: while listing {where}: a key under it is not a path obstore takes (an "
            "empty segment, as in 'logs//run.txt', or a '.' or '..' segment), and the whole "
            "listing fails with it: list a narrower prefix that leaves it out, or rename it"
        )
    else:
        exc.add_note(f"aioloader: while listing {where}")


def transient_cause(text: str) -> str | None:
    """What makes the store failure whose obstore message is ``text`` worth another attempt
    (``"HTTP 503"``, ``"Interrupted: ConnectionReset"``, ``"Timeout"``), or None when it is not.

    obstore's exceptions carry nothing structured (no ``__cause__``, no attributes): their text
    is the only record, and its debug section is object_store's source chain. Read from it, in
    order: the answer's status (transient when 408, 429 or 5xx); with no status, object_store's
    ``HttpError`` kind (Connect, Request, Timeout, Interrupted: a request that got no answer or
    lost it part-way); else an I/O error kind deeper in the chain (a reset, an unexpected end, a
    timeout). A text without the debug section is not transient."""
    _, found, chain = text.partition(_DEBUG)
    if not found:
        return None
    status = _STATUS.search(chain)
    if status is not None:
        return f"HTTP {status[1]}" if int(status[1]) in _TRANSIENT_STATUSES else None
    io_kinds = [kind for kind in _IO_KIND.findall(chain) if kind in _TRANSIENT_IO_KINDS]
    http_kind = _HTTP_KIND.search(chain)
    if http_kind is not None and http_kind[1] in _TRANSIENT_HTTP_KINDS:
        return ": ".join([http_kind[1], *io_kinds[:1]])
    return io_kinds[0] if io_kinds else None


def wanted(key: str, suffixes: tuple[str, ...], glob: str | None) -> bool:
    """Whether ``key`` passes the ``suffix`` (any of ``suffixes``; none: every key) and
    ``glob`` filters of :func:`objects` and :func:`~aioloader.sources.object_stream`."""
    return (not suffixes or key.endswith(suffixes)) and (
        glob is None or fnmatch.fnmatchcase(key, glob)
    )


def missing(store: Any, path: str, url: str) -> bool:
    """Whether no object is at ``path`` under ``url`` (a zero-byte listed entry: a folder
    marker, whose key had a ``/`` that the listing dropped, is not there; ``_markers.py``).

    Raises:
        Exception: The store's error asking for it, other than its absence.
    """
    import obstore
    import obstore.exceptions as obs_exc

    try:
        obstore.head(store, path)
    except (FileNotFoundError, obs_exc.NotFoundError):
        return True
    except Exception as exc:
        error = store_error(exc, f"{redact_store_url(url).rstrip('/')}/{path}")
        raise error from error.__cause__
    return False


def store_from_url(
    url: str,
    config: Mapping[str, Any] | None = None,
    client_options: Mapping[str, Any] | None = None,
) -> Any:
    """An obstore store for ``url`` with obstore's retries off (the caller's policy retries and
    counts each attempt) and ``allow_http`` on when ``AWS_ALLOW_HTTP=true``."""
    from obstore.store import from_url

    client = dict(client_options or {})
    if os.environ.get("AWS_ALLOW_HTTP", "").lower() == "true":
        client.setdefault("allow_http", True)  # the variable object_store's own builder reads
    options: dict[str, Any] = {
        "config": dict(config or {}),
        "client_options": client,
        "retry_config": {"max_retries": 0},
    }
    return from_url(url, **options)  # obstore's typed overloads are per store kind


@overload
def objects(
    url: str,
    *,
    suffix: str | Sequence[str] | None = None,
    glob: str | None = None,
    config: Mapping[str, Any] | None = None,
    client_options: Mapping[str, Any] | None = None,
    store: Any = None,
    max_bytes_in_flight: int | None = None,
    with_keys: Literal[False] = False,
) -> ObjectDataset: ...
@overload
def objects(
    url: str,
    *,
    suffix: str | Sequence[str] | None = None,
    glob: str | None = None,
    config: Mapping[str, Any] | None = None,
    client_options: Mapping[str, Any] | None = None,
    store: Any = None,
    max_bytes_in_flight: int | None = None,
    with_keys: Literal[True],
) -> Keyed[bytes]: ...
def objects(
    url: str,
    *,
    suffix: str | Sequence[str] | None = None,
    glob: str | None = None,
    config: Mapping[str, Any] | None = None,
    client_options: Mapping[str, Any] | None = None,
    store: Any = None,
    max_bytes_in_flight: int | None = None,
    with_keys: bool = False,
) -> ObjectDataset | Keyed[bytes]:
    """A map-style dataset of the objects under ``url`` (``s3://bucket/prefix/``, ``gs://``,
    ``az://``, ``file:///``, ``memory://``), listed once, now.

    Folder markers (zero-byte keys ending with ``/``, which the listing gives without it) are
    left out: the prefix's own, and one with keys under it. Without ``suffix`` or ``glob``, a
    zero-byte key with none under it is asked for (32 requests at once) and left out if it is
    not there; with a filter, one the filter keeps is a file.

    Args:
        url: The store and prefix. Credentials, region and endpoint come from ``config`` or the
            usual environment variables (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ...).
        suffix: Keep keys ending with this (or one of these) suffix.
        glob: Keep keys matching this shell pattern (``fnmatch``, on the key under the prefix).
        config: Store configuration (obstore's keys: ``endpoint``, ``region``,
            ``access_key_id``, ...).
        client_options: HTTP client options (``{"allow_http": True}`` for a local endpoint,
            ``timeout``, ...). ``AWS_ALLOW_HTTP=true`` in the environment sets ``allow_http``.
        store: An already configured obstore store to use instead of building one from ``url``.
        max_bytes_in_flight: Bound on the bytes of objects being read at once, each counted by
            its listed size from before its request until its bytes are returned (an object
            larger than the bound is read alone). None: no bound beyond the loader's
            ``max_inflight`` requests; its ``max_inflight_bytes`` bounds what is held after.
        with_keys: Items are ``(key, bytes)``, the key being the object's key under the
            prefix, as :func:`object_stream` gives them.

    Returns:
        The dataset; ``keys`` lists what it holds (``source.keys`` with ``with_keys``).

    Raises:
        ValueError: Nothing under the prefix matches the filters, or ``max_bytes_in_flight``
            is below 1.
        TypeError: ``max_bytes_in_flight`` is not an int.
        Exception: The store's error if listing fails (naming the URL, never credentials).
    """
    import obstore

    suffixes, glob = check_key_filters(suffix, glob)
    if max_bytes_in_flight is not None:
        ByteGate(max_bytes_in_flight)  # a bad bound fails before the listing
    if store is None:
        store = store_from_url(url, config, client_options)
    try:
        everything = sorted(
            (meta["path"], meta["size"])
            for chunk in obstore.list(store, chunk_size=1000)
            for meta in chunk
        )
    except Exception as exc:  # listed once, as the dataset is made: not retried
        listing_failed(exc, redact_store_url(url))
        raise
    markers, unsure = folder_markers(everything)
    # A filter picks files: a zero-byte one it keeps is a file (empty labels, _SUCCESS), not
    # asked for; without one, each is asked for, 32 at once (found by review: 2,000 empty
    # label files cost 2,000 requests one after another)
    if not suffixes and glob is None and unsure:
        with concurrent.futures.ThreadPoolExecutor(min(32, len(unsure))) as pool:
            gone = pool.map(lambda path: missing(store, path, url), unsure)
            markers.update(path for path, absent in zip(unsure, gone, strict=True) if absent)
    listed = [
        (path, size)
        for path, size in everything
        if path not in markers and wanted(path, suffixes, glob)
    ]
    if not listed:
        raise ValueError(
            f"no objects under {redact_store_url(url)!r} match suffix={suffix!r} glob={glob!r}"
        )
    keys, sizes = zip(*listed, strict=True)
    dataset = ObjectDataset(store, url, keys, sizes, max_bytes_in_flight=max_bytes_in_flight)
    return keyed(dataset, dataset.keys.__getitem__) if with_keys else dataset
