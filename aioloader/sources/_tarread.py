"""Reading the shards of ``tar_shards``: what a shard's name says, and its samples from a byte
offset on.

Owns: the shard names (paths, URLs, brace patterns) checked and shown without credentials, the
reader each name calls for (a local file, a range request through the epoch's one HTTP session,
an object-store range read, a store built once per ``scheme://bucket``), resumed after a broken
transfer as the ``retry`` policy allows, and one epoch's pieces read through the interleave into
its :class:`~aioloader.sources._tarstate.EpochRun`. Never: decides which shards an epoch reads or
in what order (``_tar.py`` plans it), runs the resume loop (``_streams.py``'s ``resumable``
does) or parses bytes (``_tarfmt.py`` does).
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import anyio

from .._base.checks import check_seconds
from .._base.retry import RetryPolicy
from .._data.restream import Piece
from .._fanin.lanes import interleaved
from ._braces import expand_braces
from ._http import new_session
from ._httperrors import redact_url
from ._objects import redact_store_url, store_from_url
from ._streams import ChunkReader, FileReader, HTTPReader, StoreReader, resumable
from ._tarstate import EpochRun, Located, Spanned, piece_items, without_spans
from ._tarstream import read_located

__all__ = ["ShardReading", "shard_names"]

_HTTP = ("http", "https")
_LOCAL = ("", "file")


def shard_names(shards: str | Sequence[str | os.PathLike[str]], store: Any) -> list[str]:
    """The shards a ``tar_shards`` is given, as a list of names: a single string is a brace
    pattern; with ``store`` every name is a key in it, else a URL must name its host or bucket.

    Raises:
        TypeError: ``shards`` is not a sequence of paths or URLs.
        ValueError: ``shards`` is empty or a bad brace pattern, or a URL names no host or bucket.
    """
    if isinstance(shards, str):
        shards = expand_braces(shards)
    given: object = shards
    if not isinstance(given, Sequence) or isinstance(given, bytes | bytearray):
        raise TypeError(f"shards must be a sequence of paths or URLs, got {shards!r}")
    if not shards:
        raise ValueError("shards must name at least one tar file")
    names = [os.fspath(s) for s in shards]
    for i, s in enumerate(names):
        if not isinstance(s, str):
            raise TypeError(f"shards must be str paths or URLs, got {s!r}")
        if store is None and _scheme(s) not in _LOCAL and not urlsplit(s).netloc:
            what = "host" if _scheme(s) in _HTTP else "bucket"
            raise ValueError(f"shards[{i}] {_display(s)!r} names no {what}")
    return names


class ShardReading:
    """How a ``tar_shards`` reads its shards (its reading options, checked here; ``chunk_size``
    checked by the caller), and the object stores it built, one per ``scheme://bucket``, kept
    for its life. ``on_retry`` is called for each read resumed after a transient failure.

    Raises:
        TypeError: ``retry`` is not a :class:`~aioloader.RetryPolicy` or None.
        ValueError: ``timeout`` is not a positive number.
    """

    def __init__(
        self,
        *,
        chunk_size: int,
        retry: RetryPolicy | None,
        timeout: float,
        headers: Mapping[str, str] | None,
        config: Mapping[str, Any] | None,
        client_options: Mapping[str, Any] | None,
        store: Any,
        on_retry: Callable[[], None],
    ) -> None:
        self._chunk_size = chunk_size
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise TypeError(f"retry must be an aioloader.RetryPolicy or None, got {retry!r}")
        self._retry = retry
        self._timeout = check_seconds("timeout", timeout)
        self._headers = dict(headers or {})
        self._config = dict(config or {})
        self._client_options = dict(client_options or {})
        self._store = store
        self._stores: dict[str, Any] = {}  # one per scheme://bucket, built at first use
        self._on_retry = on_retry

    def remote(self, shard: str) -> bool:
        """Whether ``shard`` is read over the network (HTTP, an object store)."""
        return self._store is not None or _scheme(shard) not in _LOCAL

    @contextlib.asynccontextmanager
    async def open_reader(
        self,
    ) -> AsyncIterator[Callable[[str], AsyncGenerator[dict[str, Any], None]]]:
        """For one epoch: a function giving the samples of a shard (see :meth:`open_located`)."""
        async with self.open_located() as located:
            yield lambda shard: without_spans(located(shard))

    @contextlib.asynccontextmanager
    async def open_located(self) -> AsyncIterator[Located]:
        """For one epoch: a function giving the samples of a shard from a byte offset on, each
        with where it lies (``read_located``). It owns the epoch's HTTP session (opened at the
        first URL, closed on exit, shielded from cancellation)."""
        session: aiohttp.ClientSession | None = None

        def reader(shard: str) -> ChunkReader:
            nonlocal session
            scheme = "" if self._store is not None else _scheme(shard)
            if self._store is not None:
                return StoreReader(self._store, shard, shard, self._chunk_size)
            if scheme in _HTTP:
                if session is None:
                    session = new_session(
                        # One connection per stream being read (slot streams read many shards
                        # at once; aiohttp's default pool of 100 would starve the 101st).
                        connector=aiohttp.TCPConnector(limit=0),
                        headers=self._headers,
                        timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._timeout),
                    )
                return HTTPReader(session, shard, self._chunk_size, self._timeout)
            if scheme in _LOCAL:
                path = urlsplit(shard).path if scheme == "file" else shard
                return FileReader(path, self._chunk_size)
            parts = urlsplit(shard)
            root = f"{parts.scheme}://{parts.netloc}"
            if root not in self._stores:
                self._stores[root] = store_from_url(root, self._config, self._client_options)
            return StoreReader(
                self._stores[root], parts.path.lstrip("/"), _display(shard), self._chunk_size
            )

        def located(shard: str, start: int = 0) -> AsyncGenerator[Spanned, None]:
            named = _named(shard)  # a sample's: messages show a query was there (_display)
            fields: dict[str, Any] = {"__url__": named, "__shard__": named}
            if self._store is None and _scheme(shard) in _LOCAL:  # as webdataset names it
                fields["__local_path__"] = urlsplit(shard).path if _scheme(shard) else shard
            chunks = self._chunks(reader(shard), start)
            return read_located(_display(shard), chunks, fields, start=start)

        try:
            yield located
        finally:
            if session is not None:
                with anyio.CancelScope(shield=True):
                    await session.close()

    def _chunks(self, reader: ChunkReader, start: int = 0) -> AsyncGenerator[bytes, None]:
        return resumable(
            reader, self._retry, stall_timeout=self._timeout, on_retry=self._on_retry, start=start
        )

    @contextlib.asynccontextmanager
    async def epoch(
        self,
        shards: Sequence[str],
        pieces: list[Piece],
        run: EpochRun,
        *,
        width: int,
        ahead: int,
        part_limit: int,
        order: random.Random | None,
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """One epoch's samples: ``pieces`` (of ``shards``) read ``width`` at once, ``ahead``
        more opened early, each holding at most ``part_limit`` bytes read ahead, interleaved in
        the rounds ``order`` draws (slot order without it), through ``run``'s cursor and
        shuffle buffer (whose samples of a saved state are read again first).

        Cancellation: leaving the block early closes every open shard before it is left.
        """

        def name(piece: Piece) -> str:
            return _display(shards[piece.part])

        async with self.open_located() as located:

            def read(piece: Piece) -> AsyncGenerator[Spanned, None]:
                return piece_items(located, shards[piece.part], piece)

            async with (
                interleaved(
                    pieces,
                    read,
                    width=width,
                    ahead=ahead,
                    part_limit=part_limit,
                    size=_spanned_bytes,
                    rng=order,
                    name=name,
                    cursor=run.cursor,
                    reopen=run.reopener(read),
                ) as spanned,
                aclosing(run.samples(spanned)) as samples,
            ):
                if run.buffer is not None:
                    await run.buffer.read_again(read, pieces, name, width)
                    async with aclosing(run.buffer.run(samples)) as shuffled:
                        yield shuffled
                    return
                yield samples


_SAMPLE_OVERHEAD = 256  # bytes a sample holds besides its members: the dict, the key, headers


def _spanned_bytes(item: Spanned) -> int:
    return _sample_bytes(item[0])


def _sample_bytes(sample: dict[str, Any]) -> int:
    """What a sample holds, for the read-ahead bound: its members and a fixed overhead (so that
    a shard of tiny or empty samples is bounded too)."""
    return _SAMPLE_OVERHEAD + sum(len(v) for v in sample.values() if isinstance(v, bytes))


def _scheme(shard: str) -> str:
    """The URL scheme of ``shard``, lower case; "" for a plain path (a Windows drive letter is
    not a scheme)."""
    head, sep, _ = shard.partition("://")
    return head.lower() if sep and head.isalnum() and len(head) > 1 else ""


def _named(shard: str) -> str:
    """``shard`` as a sample's ``__url__`` names it: a URL without its query string, fragment
    or user info (as ``urls().key()`` names a URL: ``?<redacted>`` would end its basename)."""
    if _scheme(shard) in _LOCAL:
        return shard
    parts = urlsplit(_display(shard))
    return f"{parts.scheme}://{parts.netloc}{parts.path}"


def _display(shard: str) -> str:
    """``shard`` as shown in samples, messages and ``repr``: URLs without credentials."""
    scheme = _scheme(shard)
    if scheme in _HTTP:
        return redact_url(shard)
    return shard if scheme in _LOCAL else redact_store_url(shard)
