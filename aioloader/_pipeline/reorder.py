"""Reordering of out-of-order results and grouping of items into batches.

This module owns two small pieces of bookkeeping used by the prefetch
scheduler: :class:`ReorderBuffer`, which holds results that completed out of
order and releases them in sequence order, and :class:`BatchAssembler`, which
groups a stream of items into lists of a fixed size.

It is pure: no event loop, no I/O, no threads. Neither class is thread-safe;
each is meant to be driven from a single task.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from .._base.checks import check_bool, check_int

__all__ = ["BatchAssembler", "ReorderBuffer"]

T = TypeVar("T")


class ReorderBuffer(Generic[T]):
    """Releases items in sequence order, whatever order they complete in.

    Every sequence number from ``start`` on must be pushed (with an item) or
    skipped (without one) exactly once. Items are delivered consecutively from
    :attr:`next_seq`; skipped sequence numbers are passed over.

    Args:
        start: The first sequence number to deliver.

    Raises:
        TypeError: If ``start`` is not an int.
        ValueError: If ``start`` is negative.
    """

    def __init__(self, start: int = 0) -> None:
        self._next_seq = check_int("start", start, minimum=0)
        self._items: dict[int, T] = {}
        self._skipped: set[int] = set()
        self._max_held = 0

    @property
    def next_seq(self) -> int:
        """The next sequence number to deliver."""
        return self._next_seq

    @property
    def max_held(self) -> int:
        """The largest number of items held at once (waiting for an earlier seq)."""
        return self._max_held

    def __len__(self) -> int:
        """The number of items held, waiting for an earlier sequence number."""
        return len(self._items)

    def push(self, seq: int, item: T) -> list[T]:
        """Store the item for ``seq`` and release what is now in order.

        Args:
            seq: The item's sequence number.
            item: The item.

        Returns:
            The items now deliverable, in sequence order (possibly empty).

        Raises:
            TypeError: If ``seq`` is not an int.
            ValueError: If ``seq`` was already delivered, pushed or skipped.
        """
        self._check_new(seq)
        self._items[seq] = item
        return self._release()

    def skip(self, seq: int) -> list[T]:
        """Mark ``seq`` as done without an item and release what is now in order.

        Args:
            seq: The sequence number to pass over (e.g. a dropped batch).

        Returns:
            The items now deliverable, in sequence order (possibly empty).

        Raises:
            TypeError: If ``seq`` is not an int.
            ValueError: If ``seq`` was already delivered, pushed or skipped.
        """
        self._check_new(seq)
        self._skipped.add(seq)
        return self._release()

    def _check_new(self, seq: int) -> None:
        """Raise if ``seq`` is not an int or is not new to the buffer."""
        if isinstance(seq, bool) or not isinstance(seq, int):
            raise TypeError(f"seq must be an int, got {seq!r}")
        if seq < self._next_seq:
            raise ValueError(f"seq {seq} was already delivered (next_seq is {self._next_seq})")
        if seq in self._items or seq in self._skipped:
            raise ValueError(f"seq {seq} was already pushed or skipped")

    def _release(self) -> list[T]:
        """Pop the consecutive run starting at ``next_seq`` and advance it."""
        ready: list[T] = []
        while True:
            seq = self._next_seq
            if seq in self._items:
                ready.append(self._items.pop(seq))
            elif seq in self._skipped:
                self._skipped.remove(seq)
            else:
                break
            self._next_seq = seq + 1
        self._max_held = max(self._max_held, len(self._items))
        return ready


class BatchAssembler(Generic[T]):
    """Groups a stream of items into lists of ``batch_size``.

    Args:
        batch_size: The number of items per batch.

    Raises:
        TypeError: If ``batch_size`` is not an int.
        ValueError: If ``batch_size`` is not positive.
    """

    def __init__(self, batch_size: int) -> None:
        self._batch_size = check_int("batch_size", batch_size, minimum=1)
        self._pending: list[T] = []

    @property
    def batch_size(self) -> int:
        """The number of items per full batch."""
        return self._batch_size

    def __len__(self) -> int:
        """The number of items waiting for their batch to fill."""
        return len(self._pending)

    def add(self, item: T) -> list[T] | None:
        """Add an item.

        Args:
            item: The next item of the stream.

        Returns:
            The completed batch if this item filled it, else None.
        """
        self._pending.append(item)
        if len(self._pending) < self._batch_size:
            return None
        batch, self._pending = self._pending, []
        return batch

    def flush(self, drop_last: bool) -> list[T] | None:
        """End the stream: return the partial last batch and empty the assembler.

        Args:
            drop_last: Discard a partial batch instead of returning it.

        Returns:
            The partial batch, or None if there is none or ``drop_last``.

        Raises:
            TypeError: If ``drop_last`` is not a bool.
        """
        check_bool("drop_last", drop_last)
        batch, self._pending = self._pending, []
        if not batch or drop_last:
            return None
        return batch
