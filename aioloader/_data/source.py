"""Adapters that give every kind of dataset one of two shapes the pipeline understands.

Owns: classifying a user's dataset (async map-style, async iterable, torch map-style, torch
iterable, plain sequence or iterable) and wrapping it as a :class:`MapSource` (indexable, with a
length) or a :class:`StreamSource` (iterated once per epoch). Blocking calls of torch datasets go
through a :class:`~aioloader._workers.offload.ThreadOffload`, a whole batch per thread call, so
the event loop never blocks and the per-item thread hop is paid once per batch. Never:
schedules, retries or batches; that is ``_pipeline``.
"""

from __future__ import annotations

import enum
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch.utils.data

from .._base.exceptions import annotate, worker_error
from .._workers.offload import ThreadOffload
from .dataset import AsyncDataset, AsyncIterableDataset
from .streams import AsyncStream, BlockingStream, StreamSource

__all__ = [
    "InWorkers",
    "Kind",
    "MapSource",
    "classify",
    "open_source",
    "reads_at_once",
]


class Kind(enum.Enum):
    ASYNC_MAP = "async map-style"
    ASYNC_STREAM = "async iterable"
    BLOCKING_MAP = "map-style"
    BLOCKING_STREAM = "iterable"

    @property
    def is_map(self) -> bool:
        return self in (Kind.ASYNC_MAP, Kind.BLOCKING_MAP)

    @property
    def is_blocking(self) -> bool:
        return self in (Kind.BLOCKING_MAP, Kind.BLOCKING_STREAM)


def classify(dataset: object) -> Kind:
    """Decide how the loader reads ``dataset``.

    Raises:
        TypeError: ``dataset`` is none of the accepted kinds; the message lists them.
    """
    if isinstance(dataset, AsyncDataset):
        return Kind.ASYNC_MAP
    if isinstance(dataset, AsyncIterableDataset) or hasattr(dataset, "__aiter__"):
        return Kind.ASYNC_STREAM
    if inspect.isasyncgenfunction(dataset):
        return Kind.ASYNC_STREAM
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return Kind.BLOCKING_STREAM
    if isinstance(dataset, (str, bytes, bytearray)):
        pass  # a sequence, but never meant as a dataset
    elif hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        return Kind.BLOCKING_MAP
    elif isinstance(dataset, torch.utils.data.Dataset):
        # Without __len__, as torch's loader takes one: a sampler (or batch sampler) gives
        # its indices, keys of any kind (found by review: it was refused)
        return Kind.BLOCKING_MAP
    elif isinstance(dataset, Iterable):
        return Kind.BLOCKING_STREAM
    raise TypeError(
        "dataset must be an aioloader.AsyncDataset, an async iterable (an "
        "aioloader.AsyncIterableDataset, an object with __aiter__ or an async generator "
        "function), a torch.utils.data.Dataset, a torch IterableDataset, or a "
        f"sequence; got {type(dataset).__qualname__}"
    )


def dataset_length(dataset: object) -> int | None:
    """``len(dataset)`` when the dataset defines it, else None."""
    try:
        return len(dataset)  # type: ignore[arg-type]  # probing: any object may define __len__
    except TypeError:
        return None


class MapSource(ABC):
    """Items by index. ``batched`` sources prefer :meth:`get_many` for a whole batch."""

    batched: bool

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    async def get(self, index: int) -> Any: ...

    @abstractmethod
    async def get_many(self, indices: Sequence[int]) -> list[Any]: ...

    @property
    def reads_inline(self) -> bool:
        """Whether a read would run at once on the caller's thread, not suspending (fast
        blocking reads: see ``_workers/offload.py``)."""
        return False

    def will_need(self, indices: Sequence[int]) -> None:
        """A batch's ``indices`` are scheduled: a hint that they will be read soon (see
        :meth:`AsyncDataset.will_need`). Returns at once."""
        del indices  # a source that takes hints overrides this

    def reads_now(self) -> tuple[ThreadOffload, Callable[[Sequence[int]], list[Any]]] | None:
        """For a batch made on the caller's own thread (``_pipeline/demand.py``): the pool
        whose placement these reads share, and the blocking read of a slice of indices (its
        samples in order; it raises the dataset's own error, noted with the sample); None for
        a source read only from the event loop."""
        return None


class InWorkers:
    """A blocking (torch) dataset whose copies live in the worker processes, as in torch: the
    epoch sends each worker a batch's indices (map-style) or asks it for the next batch of its
    own iterator (iterable), and gets collated batches back. Nothing of it runs in this process.

    Attributes:
        dataset: The dataset (each worker was sent a copy when it started).
        is_map: Map-style (indices) rather than iterable.
        dealt: Batch ``k`` goes to worker ``k % n`` (with ``in_order``), as torch deals a
            user's dataset (whose copies may keep state); else to whichever worker is free
            (an async dataset's reader for the workers: ``AsyncDataset.for_workers``).
    """

    def __init__(self, dataset: object, kind: Kind, *, dealt: bool = True) -> None:
        self.dataset = dataset
        self.is_map = kind.is_map
        self.dealt = dealt

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]  # map-style: it has a length


class _AsyncMap(MapSource):
    def __init__(self, dataset: AsyncDataset[Any]) -> None:
        self._dataset = dataset
        self.batched = type(dataset).get_many is not AsyncDataset.get_many
        self.get = dataset.get  # type: ignore[method-assign]  # no wrapper coroutine per read
        if type(dataset).will_need is not AsyncDataset.will_need:  # no call per batch otherwise
            self.will_need = dataset.will_need  # type: ignore[method-assign]

    def __len__(self) -> int:
        return len(self._dataset)

    async def get(self, index: int) -> Any:
        return await self._dataset.get(index)

    async def get_many(self, indices: Sequence[int]) -> list[Any]:
        items = await self._dataset.get_many(indices)
        if len(items) != len(indices):
            raise ValueError(
                f"{type(self._dataset).__qualname__}.get_many returned {len(items)} items "
                f"for {len(indices)} indices"
            )
        return items


class _BlockingMap(MapSource):
    """A torch map-style dataset (or a sequence): ``__getitem__`` runs on the I/O threads."""

    batched = True

    def __init__(
        self, dataset: Any, offload: Callable[[], ThreadOffload], *, unbatched: bool = False
    ) -> None:
        self._dataset = dataset
        self._offload = offload
        # torch's batched protocol is for a batch: without batching, torch calls __getitem__
        self._getitems = None if unbatched else getattr(dataset, "__getitems__", None)

    def __len__(self) -> int:
        return len(self._dataset)

    def _read(self, index: int) -> Any:
        try:
            return self._dataset[index]
        except StopIteration as stop:  # (a coroutine would make it PEP 479's RuntimeError)
            raise annotate(worker_error(stop), "fetch", index=index) from stop
        except Exception as exc:
            annotate(exc, "fetch", index=index)
            raise

    def _read_many(self, indices: Sequence[int]) -> list[Any]:
        getitems = self._getitems
        if getitems is None:
            dataset, index = self._dataset, None
            try:  # one try for the slice: a sample costs what its read costs
                return [dataset[(index := i)] for i in indices]
            except StopIteration as stop:  # ends a plain `for`, as torch's (see _read)
                raise annotate(worker_error(stop), "fetch", index=index) from stop
            except Exception as exc:
                annotate(exc, "fetch", index=index)
                raise
        items = list(getitems(list(indices)))  # torch's batched protocol (torch >= 2.1)
        if len(items) != len(indices):
            raise ValueError(
                f"{type(self._dataset).__qualname__}.__getitems__ returned {len(items)} items "
                f"for {len(indices)} indices {list(indices)}"
            )
        return items

    @property
    def reads_inline(self) -> bool:
        return self._offload().inline_now

    def reads_now(self) -> tuple[ThreadOffload, Callable[[Sequence[int]], list[Any]]] | None:
        return self._offload(), self._read_many

    async def get(self, index: int) -> Any:
        return await self._offload().run(self._read, index)

    async def get_many(self, indices: Sequence[int]) -> list[Any]:
        return await self._offload().run(self._read_many, indices)


def open_source(
    dataset: object,
    kind: Kind,
    offload: Callable[[], ThreadOffload],
    *,
    in_workers: bool,
    reads_in_workers: bool = False,
    per_batch: int = 1,
    unbatched: bool = False,
) -> MapSource | StreamSource | InWorkers:
    """Wrap ``dataset`` (already classified as ``kind``) once, for the loader's whole life.

    Args:
        dataset: The user's dataset.
        kind: What :func:`classify` said of it.
        offload: Gives the thread pool of the loader's current scope, for blocking datasets
            read in this process (called at each blocking call, never at construction).
        in_workers: A blocking dataset lives in the worker processes (``num_workers > 0``
            with process workers); ignored for async datasets, which run in the event loop.
        reads_in_workers: An async map-style dataset with a reader for the workers
            (``AsyncDataset.for_workers``) is read by them: the workers are local processes
            and this process's fetch options are at their defaults.
        per_batch: Samples per batch (a resumable blocking stream is pulled a batch at a time).
        unbatched: ``batch_size=None``: a torch dataset's ``__getitems__`` is not called (in
            the workers, ``_workers/job.py`` does the same), as torch calls it for batches only.
    """
    if kind.is_blocking and in_workers:
        return InWorkers(dataset, kind)
    if kind is Kind.ASYNC_MAP:
        reader = dataset.for_workers() if reads_in_workers else None  # type: ignore[attr-defined]
        if reader is not None:
            return InWorkers(reader, Kind.BLOCKING_MAP, dealt=False)
        return _AsyncMap(dataset)  # type: ignore[arg-type]  # classify() checked the type
    if kind is Kind.BLOCKING_MAP:
        return _BlockingMap(dataset, offload, unbatched=unbatched)
    if kind is Kind.ASYNC_STREAM:
        return AsyncStream(dataset)
    return BlockingStream(dataset, offload, per_batch)  # type: ignore[arg-type]  # an Iterable


def reads_at_once(dataset: object) -> int | None:
    """An async dataset's own bound on the items it reads at once (see
    :meth:`~aioloader.AsyncDataset.concurrency`), at least 1; None for another dataset or none."""
    bound = dataset.concurrency() if isinstance(dataset, AsyncDataset) else None
    return None if bound is None else max(1, bound)
