"""The dataset types users subclass: async map-style and async iterable.

Owns: the two public abstract base classes and their contracts. Never: schedules, retries or
batches anything; that is the loader's job. Ordinary torch datasets need no subclassing: the loader
adapts them (see ``_data/source.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from typing import Generic, TypeVar

__all__ = ["AsyncDataset", "AsyncIterableDataset"]

T_Sample = TypeVar("T_Sample")
T_co = TypeVar("T_co", covariant=True)


class AsyncDataset(ABC, Generic[T_Sample]):
    """A map-style dataset whose items are fetched with ``await``.

    Subclasses implement ``__len__`` and :meth:`get`. A source that can fetch many items in one
    request (a batched API, a multi-range read, a whole batch of local files in one thread call)
    also overrides :meth:`get_many`; the loader then asks for a whole batch at once.

    Example::

        class Blobs(aioloader.AsyncDataset[bytes]):
            def __init__(self, keys): self.keys = keys
            def __len__(self): return len(self.keys)
            async def get(self, index): return await store.get(self.keys[index])
    """

    @abstractmethod
    def __len__(self) -> int:
        """The number of items."""

    @abstractmethod
    async def get(self, index: int) -> T_Sample:
        """Fetch item ``index``.

        Raises:
            Exception: Whatever the source raises; the loader adds a note naming the index and
                retries it if the retry policy marks it transient.

        Cancellation: the loader cancels a pending ``get`` when the epoch ends early or the
        loader's scope exits; the implementation must release what it holds (``async with``).
        """

    async def get_many(self, indices: Sequence[int]) -> list[T_Sample]:
        """Fetch several items in one call; the result is in the order of ``indices``.

        The default calls :meth:`get` for each index in turn; the loader only calls this method
        when a subclass overrides it (otherwise it fetches items concurrently with :meth:`get`).

        Raises:
            Exception: Whatever the source raises; all of ``indices`` count as failed.

        Cancellation: as for :meth:`get`.
        """
        return [await self.get(i) for i in indices]

    def will_need(self, indices: Sequence[int]) -> None:
        """A hint: ``indices`` will be read soon. The loader calls it, when a subclass overrides
        it, as it schedules each batch (up to its window of batches ahead of their reads), on
        the event loop's thread: it must return at once, and may start the reads somewhere
        they need no waiting for (``sources.files`` asks the kernel to read cold files ahead).
        The default does nothing.

        Raises: nothing (a hint that cannot be taken is dropped; the read reports the error).
        """

    def concurrency(self) -> int | None:
        """The most items this dataset reads at once (a connection pool's size), or None (the
        default): no bound of its own. The loader runs no more fetches at once than this (nor
        than ``max_inflight``), so that none waits inside the dataset for its turn, where the
        loader's ``sample_timeout`` would count the wait (found by review: ``urls(...,
        connections=4)`` read by 64 fetches timed out on a healthy server).
        """
        return None

    def for_workers(self) -> object | None:
        """A blocking map-style dataset with the same items, that a worker process can read on
        its own (picklable, ``__len__`` and ``__getitem__``, optionally ``__getitems__``), or
        None (the default): the items are then fetched in this process and sent to the workers.

        With local worker processes (``num_workers > 0``, ``worker_mode="process"``) and this
        process's fetch options at their defaults (``max_inflight``, ``max_inflight_bytes``,
        ``sample_timeout``), the loader sends each worker a copy of what this returns and
        then only indices: each worker reads its batch's items itself, as torch's
        workers read a torch dataset, and no item's bytes cross into this process. Worth it
        where reading is CPU work best kept off the training process (``sources.files``: local
        files); not for network reads, which the event loop overlaps best.

        The workers' ``get_worker_info().dataset`` is their copy of it. A batch goes to
        whichever worker is free (no state ties batch ``k`` to worker ``k % n``), and the
        statistics' ``fetch`` stage counts none of the reads: each is part of its batch's job
        in the ``transform`` stage.

        Raises: nothing; called when a loader is built, and again when one of its settings is
        changed.
        """
        return None


class AsyncIterableDataset(ABC, Generic[T_co]):
    """A stream of samples (records, keys, decoded shard members) iterated with ``async for``.

    Each epoch calls :meth:`__aiter__` once, in the loader's event loop, so every sample is read
    exactly once whatever ``num_workers`` is; only distributed ranks split the stream (the loader
    does that). An optional ``__len__`` gives ``len(loader)`` and equal per-rank counts.

    A dataset that needs certain loader options may define ``check_loader_options(*,
    batch_size, in_order, distributed)``: the loader calls it when it is built, and it raises
    ``ValueError`` naming an option it cannot work with (``SlotStreams`` needs batches of its
    ``slots``, in order, unsplit). Any dataset kind may define it.

    Resuming: a stream takes part in ``DataLoader.state_dict()`` by defining both
    ``state_dict()``, its state after the samples its current epoch's iterator has given
    (dicts, lists, tuples, str, numbers, bools, None, bytes, tensors, NumPy arrays: kept as
    JSON, given back as they were), and
    ``load_state_dict(state)``, after which the next :meth:`__aiter__` starts where that state
    stood (torchdata's ``Stateful`` protocol). The loader calls ``state_dict()`` between
    samples, after each batch's last one, and gives the state it saved to ``load_state_dict``
    before the resumed epoch's :meth:`__aiter__`. The loader keeps a deep copy of each state
    (a state kept by reference would move on with the read-ahead), unless the class sets
    ``state_dict_is_a_copy = True`` to say each call builds a new object of plain JSON
    values. A torch ``IterableDataset`` takes part the same way, or through the iterator its
    ``__iter__`` gives (see ``DataLoader.state_dict``).
    """

    @abstractmethod
    def __aiter__(self) -> AsyncIterator[T_co]:
        """Return a fresh iterator over the samples of one epoch.

        Cancellation: when an epoch ends early the loader closes the iterator (``aclose`` for an
        async generator), so ``finally`` blocks and ``async with`` in it run.
        """
