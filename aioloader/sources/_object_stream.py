"""A stream of the objects under a prefix of an object store, listed anew each epoch.

Owns: :func:`object_stream` and :class:`ObjectStream`: the listing (filtered as :func:`objects`
filters), reads ahead of the consumer in listing order, and the listing position a resumed epoch
goes on from. Never: retries (a stream is not retried by the loader; the map-style
:func:`~aioloader.sources.objects` is) or shards by rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import Any

from .._base.checks import check_int
from .._data.epochs import OpensEpochs
from .._fanin.lanes import interleaved
from ._objects import redact_store_url, store_error, store_from_url, wanted
from ._patterns import check_key_filters

__all__ = ["ObjectStream", "object_stream"]


def object_stream(
    url: str,
    *,
    suffix: str | Sequence[str] | None = None,
    glob: str | None = None,
    concurrency: int = 16,
    config: Mapping[str, Any] | None = None,
    client_options: Mapping[str, Any] | None = None,
    store: Any = None,
) -> ObjectStream:
    """A streaming dataset of the objects under ``url``: each epoch lists the prefix again (so
    objects added since the last epoch are read too) and yields ``(key, bytes)`` in listing
    order, reading up to ``concurrency`` objects at once. For prefixes too large or too
    changeable to list once; :func:`objects` is the map-style form (random access, shuffling,
    the loader's retries and sharding by index).

    Args:
        url, suffix, glob, config, client_options, store: As for :func:`objects`.
        concurrency: Objects read (or read and waiting) ahead of the one the consumer has: a
            read starts as soon as the consumer asks for the next object, so up to
            ``concurrency`` reads are in flight while the consumer works on one.

    Raises:
        TypeError, ValueError: ``concurrency`` is not an int >= 1.

    Iterating raises:
        FileNotFoundError: An object listed this epoch was deleted before it was read.
        TransientStoreError, Exception: As :meth:`ObjectDataset.get`; a stream is not retried
            by the loader, so wrap flaky stores with a map-style :func:`objects` instead.
    """
    check_int("concurrency", concurrency, minimum=1)
    suffixes, glob = check_key_filters(suffix, glob)
    if store is None:
        store = store_from_url(url, config, client_options)
    return ObjectStream(store, url, suffixes, glob, concurrency)


class ObjectStream(OpensEpochs[tuple[str, bytes]]):
    """``(key, bytes)`` of every object under a prefix, listed anew each epoch; see
    :func:`object_stream`.

    Resuming: :meth:`state_dict` is the last key the open epoch's iterator gave (its listing
    position); after :meth:`load_state_dict` the next epoch lists the keys after it. That needs
    the store to list keys in order, as S3, GCS and Azure do: a listing found out of order
    makes :meth:`state_dict` raise rather than resume wrongly.
    """

    #: :meth:`state_dict` builds a new object each call: the loader need not copy it.
    state_dict_is_a_copy = True

    def __init__(
        self, store: Any, url: str, suffixes: tuple[str, ...], glob: str | None, concurrency: int
    ) -> None:
        self._store = store
        self._url = redact_store_url(url)
        self._suffixes = suffixes
        self._glob = glob
        self.concurrency = concurrency
        self._running: _Listed | None = None

    def state_dict(self) -> dict[str, Any]:
        """``{"after": key}``: the last key the open epoch's iterator gave (None before the
        first, or with no epoch open and nothing loaded).

        Raises:
            ValueError: The store listed keys out of order this epoch (a listing position
                would not resume it).
        """
        run = self._running
        if run is None:
            return self.next_state({"after": None})
        if not run.in_order:
            raise ValueError(
                f"{self!r} cannot resume: the store listed {run.out_of_order!r} after a later "
                "key, so a listing position does not say what is left"
            )
        return {"after": run.last}

    def check_state(self, state: dict[str, Any]) -> None:
        """A state goes on with whichever epoch opens (each lists anew): it has no epoch.

        Raises:
            TypeError: ``state`` is not ``{"after": key or None}``.
        """
        after = state.get("after")
        if not (after is None or isinstance(after, str)):
            raise TypeError(f"state must be {{'after': key or None}}, got {state!r}")

    def __repr__(self) -> str:
        return f"ObjectStream({self._url!r}, concurrency={self.concurrency})"

    def epoch_items(
        self, epoch: int, state: dict[str, Any] | None
    ) -> contextlib.AbstractAsyncContextManager[AsyncIterator[tuple[str, bytes]]]:
        """One epoch (its number does not matter: each lists anew), from ``state["after"]`` on
        if given: list, and read ``concurrency`` objects ahead of the one the consumer has,
        in listing order (a read starts as soon as the consumer asks for the next object: no
        pause between windows).

        Cancellation: leaving the block cancels the reads in flight; nothing is left running.
        """
        return self._epoch(None if state is None else state.get("after"))

    @contextlib.asynccontextmanager
    async def _epoch(self, after: str | None) -> AsyncIterator[AsyncIterator[tuple[str, bytes]]]:
        run = _Listed(after)

        async def taken(
            items: AsyncIterator[tuple[str, bytes]],
        ) -> AsyncGenerator[tuple[str, bytes], None]:
            async for key, data in items:
                run.took(key)
                yield key, data

        async with (
            interleaved(
                self._listing(after),
                self._read,
                width=1,
                ahead=self.concurrency,
                part_limit=1,
                name=self._name,
            ) as items,
            contextlib.aclosing(taken(items)) as objects,
        ):
            self._running = run
            try:
                yield objects
            finally:
                self._running = None

    def _name(self, entry: tuple[str, int]) -> str:
        return f"{self._url.rstrip('/')}/{entry[0]}"

    async def _listing(self, after: str | None = None) -> AsyncGenerator[tuple[str, int], None]:
        """The epoch's ``(key, size)`` that pass the filters, but the prefix's own folder
        marker (``""``; ``_markers.py``)."""
        import obstore

        try:
            async for chunk in obstore.list(self._store, offset=after, chunk_size=1000):
                for meta in chunk:
                    path = meta["path"]
                    if path and wanted(path, self._suffixes, self._glob):
                        yield path, meta["size"]
        except Exception as exc:
            error = store_error(exc, self._url)
            raise error from error.__cause__

    async def _read(self, entry: tuple[str, int]) -> AsyncGenerator[tuple[str, bytes], None]:
        """``(key, bytes)`` of a listed entry; nothing for a folder marker (a zero-byte entry
        that is not there: its key had a ``/`` the listing dropped, ``_markers.py``)."""
        import obstore
        import obstore.exceptions as obs_exc

        key, size = entry
        try:
            result = await obstore.get_async(self._store, key)
            data = bytes(await result.bytes_async())
        except Exception as exc:
            if size == 0 and isinstance(exc, FileNotFoundError | obs_exc.NotFoundError):
                return
            error = store_error(exc, self._name(entry))
            raise error from error.__cause__
        yield key, data


class _Listed:
    """The keys an epoch of an :class:`ObjectStream` gave: the last one, and whether they came
    in key order."""

    __slots__ = ("last", "out_of_order")

    def __init__(self, after: str | None) -> None:
        self.last = after
        self.out_of_order: str | None = None

    @property
    def in_order(self) -> bool:
        return self.out_of_order is None

    def took(self, key: str) -> None:
        if self.last is not None and key <= self.last and self.out_of_order is None:
            self.out_of_order = key
        self.last = key
