"""A source's items with their names: ``(key, item)``, as ``object_stream`` gives them and as
webdataset's ``__key__`` names a sample.

Owns: :func:`keyed` (what ``files(..., with_keys=True)``, ``urls(...)`` and ``objects(...)``
return): the source's item ``i`` paired with its key (a file's path relative to the folder, an
object's key under the prefix, a URL without its query string or credentials), the source's
reading unchanged: a batched source is still read a slice per call, a per-item source one item
per fetch. Never: reads anything itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Generic, TypeVar

from .._data.dataset import AsyncDataset

__all__ = ["Keyed", "KeyedReader", "keyed"]

T = TypeVar("T")


class Keyed(AsyncDataset[tuple[str, T]], Generic[T]):
    """``(key, item)`` for each item of ``source``; an async context manager when the source is
    one (entering and leaving it). Create it with the sources' ``with_keys=True``.

    Attributes:
        source: The dataset whose items are named.
    """

    def __init__(self, source: AsyncDataset[T], key: Callable[[int], str]) -> None:
        self.source = source
        self._key = key

    def __len__(self) -> int:
        return len(self.source)

    def __repr__(self) -> str:
        return f"{self.source!r}.with_keys"

    def key(self, index: int) -> str:
        """The key of item ``index``.

        Raises:
            IndexError: ``index`` is out of range.
        """
        return self._key(index)

    def will_need(self, indices: Sequence[int]) -> None:
        self.source.will_need(indices)  # read ahead as the source reads ahead

    def for_workers(self) -> KeyedReader | None:
        """The source's own reader for worker processes, its items named by the reader's
        ``key`` (a :class:`KeyedReader`); None (read here) where the source has none, its
        reader cannot name its items, the keys are not the source's own ``key`` (another
        ``key`` function was given), or a subclass reads in its own way."""
        if type(self) not in (Keyed, _KeyedBatches):
            return None
        if self._key != getattr(self.source, "key", None):  # (bound: same function and self)
            return None
        reader = self.source.for_workers()
        if reader is None or not callable(getattr(reader, "key", None)):
            return None
        return KeyedReader(reader)

    def concurrency(self) -> int | None:
        return self.source.concurrency()

    async def get(self, index: int) -> tuple[str, T]:
        """``(key, item)`` of item ``index``.

        Raises:
            IndexError: ``index`` is out of range.
            Exception: As the source's ``get``.

        Cancellation: as the source's ``get``.
        """
        key = self._key(index)
        return key, await self.source.get(index)

    async def __aenter__(self) -> Keyed[T]:
        enter = getattr(self.source, "__aenter__", None)
        if enter is not None:
            await enter()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        leave = getattr(self.source, "__aexit__", None)
        if leave is not None:
            await leave(exc_type, exc, tb)


class _KeyedBatches(Keyed[T]):
    """:class:`Keyed` over a source that reads a slice per call (its ``get_many``)."""

    async def get_many(self, indices: Sequence[int]) -> list[tuple[str, T]]:
        keys = [self._key(i) for i in indices]
        return list(zip(keys, await self.source.get_many(indices), strict=True))


class KeyedReader:
    """``(key, item)`` for each item of a blocking ``reader`` that names its items
    (``reader.key(i)``): the worker processes' side of :class:`Keyed`. Reads as ``reader``
    reads (its ``__getitems__``, a batch in one call, where it has one)."""

    __slots__ = ("reader",)

    def __init__(self, reader: Any) -> None:
        self.reader = reader

    def __len__(self) -> int:
        return len(self.reader)

    def __repr__(self) -> str:
        return f"{self.reader!r}.with_keys"

    def __getitem__(self, index: int) -> tuple[str, Any]:
        return self.reader.key(index), self.reader[index]

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[str, Any]]:
        getitems = getattr(self.reader, "__getitems__", None)
        items = getitems(indices) if getitems is not None else [self.reader[i] for i in indices]
        return list(zip([self.reader.key(i) for i in indices], items, strict=True))


def keyed(source: AsyncDataset[T], key: Callable[[int], str]) -> Keyed[T]:
    """``source``'s items as ``(key(i), item)``, read as ``source`` is read (a batched source,
    one that overrides ``get_many``, stays batched)."""
    batched = type(source).get_many is not AsyncDataset.get_many
    return (_KeyedBatches if batched else Keyed)(source, key)
