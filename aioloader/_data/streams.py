"""Stream sources: an iterable dataset read once per epoch, in the order it yields.

Owns: :class:`StreamSource` (the shape the pipeline reads a stream in), an async iterable's
(:class:`AsyncStream`: an async generator function, an :class:`~aioloader.AsyncIterableDataset`,
one that opens its own epochs) and a blocking one's (:class:`BlockingStream`: a torch
``IterableDataset`` advanced on one thread, in chunks), and what makes a stream resumable.
Never: classifies a dataset (``source.py`` does) or batches.
"""

from __future__ import annotations

import contextlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from typing import Any

import anyio

from .._base.exceptions import LoaderStateError
from .._base.stateful import StatefulPass, decode, is_stateful, snapshot
from .._workers.offload import ThreadOffload
from .datapipes import seed_pipe, shard_here
from .epochs import OpensEpochs, open_owned

__all__ = ["AsyncStream", "BlockingStream", "StreamSource", "begin_here", "is_resumable"]

_STREAM_CHUNK = 64  # items pulled from a blocking iterator per thread call


def is_resumable(dataset: object) -> bool:
    """Whether a stream dataset itself takes part in ``state_dict()``: it defines both
    ``state_dict()`` (its state after the items its current epoch's iterator has given) and
    ``load_state_dict(state)`` (the next epoch's iterator starts there), as torchdata's
    ``Stateful`` does. (A blocking one may keep its state in the iterator ``iter()`` gives
    instead: that is known once a pass starts, see ``_base/stateful.py``.)"""
    return is_stateful(dataset)


class StreamSource(ABC):
    """Samples in the order the dataset yields them, read once per epoch.

    A :attr:`resumable` source gives its :meth:`state` after the items its open iterator has
    given, and :meth:`open` takes such a state to start from.
    """

    resumable = False

    @abstractmethod
    def open(
        self, epoch: int, state: Any = None
    ) -> contextlib.AbstractAsyncContextManager[AsyncIterator[Any]]:
        """An iterator for epoch ``epoch``, closed (``aclose``) when the context exits; with
        ``state`` (from :meth:`state`), one that starts where that state stood. (A dataset
        that opens its own epochs is given ``epoch`` here; another stream's ``set_epoch`` is
        the consumer's to call.)"""

    def state(self) -> Any:
        """The dataset's state after the items the open iterator has given (resumable only)."""
        raise TypeError(f"{type(self).__qualname__} cannot resume")


class AsyncStream(StreamSource):
    """An async iterable dataset's stream (see the module's docstring)."""

    def __init__(self, dataset: Any) -> None:
        self._dataset = dataset
        self._consumed = False
        self.resumable = is_resumable(dataset)

    def state(self) -> Any:
        return snapshot(self._dataset)

    def _iterator(self) -> AsyncIterator[Any]:
        if inspect.isasyncgenfunction(self._dataset):
            return self._dataset()  # type: ignore[no-any-return]
        iterator: AsyncIterator[Any] = self._dataset.__aiter__()
        if iterator is self._dataset:  # a one-shot iterator, e.g. an async generator object
            if self._consumed:
                raise LoaderStateError(
                    f"the dataset is a one-shot async iterator ({type(self._dataset).__qualname__})"
                    " and was consumed by an earlier epoch; pass an async generator function or "
                    "an aioloader.AsyncIterableDataset to iterate it again"
                )
            self._consumed = True
        return iterator

    @contextlib.asynccontextmanager
    async def open(self, epoch: int, state: Any = None) -> AsyncIterator[AsyncIterator[Any]]:
        dataset = self._dataset
        state = decode(state)
        if isinstance(dataset, OpensEpochs):  # the loader owns its epochs: passed, not set
            if type(dataset).__aiter__ is OpensEpochs.__aiter__:  # its task group lives here
                async with dataset.open_epoch(epoch, state) as items:
                    yield items
                return
            iterator = open_owned(dataset, epoch, state)  # a subclass iterating its own way
        else:
            if state is not None:
                dataset.load_state_dict(state)
            iterator = self._iterator()
        try:
            yield iterator
        finally:
            aclose: Callable[[], Any] | None = getattr(iterator, "aclose", None)
            if aclose is not None:
                await aclose()


class BlockingStream(StreamSource):
    """A torch IterableDataset (or any iterable) advanced on one dedicated thread, in chunks.

    A resumable pass (the dataset's ``state_dict``/``load_state_dict``, or its iterator's:
    :class:`~aioloader._base.stateful.StatefulPass`) is pulled a batch (``per_batch`` items)
    per chunk, and its state taken after each chunk, on the same thread: the state after a
    batch's last item, whenever the loader asks between batches. Whether a pass is resumable
    is known once it is open (:attr:`resumable` is the dataset's own until then).
    """

    def __init__(
        self, dataset: Iterable[Any], offload: Callable[[], ThreadOffload], per_batch: int
    ) -> None:
        self._dataset = dataset
        self._offload = offload
        self._per_batch = per_batch
        self.resumable = is_resumable(dataset)
        self._state: Any = None

    def state(self) -> Any:
        return self._state

    def _pull(self, run: StatefulPass) -> tuple[list[Any], Exception | None]:
        """The next chunk, and the exception that cut it short (if one did): the items
        before a failure are the epoch's too, as torch delivers them."""
        chunk: list[Any] = []
        size = self._per_batch if run.resumable else _STREAM_CHUNK
        try:
            for item in run.items:
                chunk.append(item)
                if len(chunk) == size:
                    break
        except Exception as exc:
            return chunk, exc
        if run.resumable:
            self._state = run.state()
        return chunk, None

    def _begin(self, state: Any) -> StatefulPass:
        """A pass from ``state``, and its state before any item (on the stream's thread)."""
        run = StatefulPass(self._dataset, state)
        self._state = run.opening
        return run

    async def _chunks(self, run: StatefulPass) -> AsyncGenerator[Any, None]:
        while True:
            chunk, failed = await self._offload().run(self._pull, run)
            for item in chunk:
                yield item
            if failed is not None:
                raise failed
            if not chunk:
                return

    @contextlib.asynccontextmanager
    async def open(self, epoch: int, state: Any = None) -> AsyncIterator[AsyncIterator[Any]]:
        run = await self._offload().run(self._begin, state)
        self.resumable = run.resumable
        chunks = self._chunks(run)
        try:
            yield chunks
        finally:
            await chunks.aclose()
            close = getattr(run.iterator, "close", None)
            if close is not None:  # a generator: run its finally blocks on our thread, now
                with anyio.CancelScope(shield=True):
                    await self._offload().run(close, inline=False)


def begin_here(dataset: object, epoch: int, pipe_seed: int | None) -> None:
    """A stream read in this process (not in workers) begins epoch ``epoch``: a DataPipe keeps
    this rank's share and is seeded with ``pipe_seed`` (``datapipes.py``); a dataset with a
    ``set_epoch`` is told the epoch, as it shuffles by it (:class:`OpensEpochs`: given the
    epoch as it opens one)."""
    if pipe_seed is not None:
        shard_here(dataset)
        seed_pipe(dataset, pipe_seed)
    elif not isinstance(dataset, OpensEpochs):
        set_epoch = getattr(dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
