"""Datasets whose epochs run tasks of their own, and the iterator that owns such an epoch.

Owns: :class:`OpensEpochs` (the contract: ``open_epoch()`` gives an async context manager whose
``async with`` owns the epoch's tasks) and :class:`OwnedEpochIterator` (iterating such a
dataset directly, from any task). Never: starts readers itself (``_fanin/lanes.py`` does).
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import abstractmethod
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from .dataset import AsyncIterableDataset, T_co

__all__ = ["OpensEpochs", "OwnedEpochIterator"]

T = TypeVar("T")


class OpensEpochs(AsyncIterableDataset[T_co]):
    """A stream whose epochs run tasks of their own (readers of many parts at once).

    The loader enters :meth:`open_epoch` in the task that consumes the epoch, so the readers'
    task group is entered and left there. Iterating the dataset directly (``async for``) runs the
    epoch in a task the iterator owns and hands its items over one by one; ``aclose()`` on the
    iterator (or dropping it) cancels that task, which closes every open part.
    """

    @abstractmethod
    def open_epoch(self) -> contextlib.AbstractAsyncContextManager[AsyncIterator[T_co]]:
        """Start the next epoch: an async context manager giving its iterator."""

    def __aiter__(self) -> AsyncIterator[T_co]:
        """Start the next epoch: an iterator over it (see the class on closing it)."""
        return OwnedEpochIterator(self.open_epoch())


class _Failed:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


_DONE: Any = object()


class OwnedEpochIterator(AsyncIterator[T]):
    """Iterates an epoch opened with ``open_epoch()`` from any task, in any way (``break``,
    dropping it): the epoch runs in a task of its own, started at the first ``__anext__``;
    items come over a one-item queue, so at most one item is read beyond the epoch's own
    buffers.

    Raises (from ``__anext__``): the epoch's error, as itself (once; then the iterator is over).

    Cancellation: cancelling a ``__anext__`` loses nothing and leaves the epoch running (the
    next call gets the item it would have had: an ``asyncio.Queue`` takes an item out only when
    the getter resumes); :meth:`aclose`, or the iterator being garbage-collected, cancels the
    epoch's task, whose ``async with`` closes every part. After either, ``__anext__`` raises
    ``StopAsyncIteration``.
    """

    def __init__(self, epoch: contextlib.AbstractAsyncContextManager[AsyncIterator[T]]) -> None:
        self._epoch: contextlib.AbstractAsyncContextManager[AsyncIterator[T]] | None = epoch
        self._task: asyncio.Task[None] | None = None
        self._queue: asyncio.Queue[Any] | None = None
        self._over = False

    def __aiter__(self) -> OwnedEpochIterator[T]:
        return self

    async def __anext__(self) -> T:
        if self._over:
            raise StopAsyncIteration
        if self._queue is None:  # the first call starts the epoch (aclose before it: _over)
            epoch, self._epoch = self._epoch, None
            if epoch is None:
                raise StopAsyncIteration
            self._queue = asyncio.Queue(1)
            self._task = asyncio.get_running_loop().create_task(self._run(epoch, self._queue))
        item = await self._queue.get()
        if item is _DONE:
            await self.aclose()
            raise StopAsyncIteration
        if isinstance(item, _Failed):
            await self.aclose()
            raise item.error
        return item  # type: ignore[no-any-return]

    @staticmethod
    async def _run(
        epoch: contextlib.AbstractAsyncContextManager[AsyncIterator[T]], queue: asyncio.Queue[Any]
    ) -> None:
        try:
            async with epoch as items:
                async for item in items:
                    await queue.put(item)
        except asyncio.CancelledError:
            raise  # closed by aclose() or collection
        except BaseException as exc:  # the consumer raises it, whatever it is
            await queue.put(_Failed(exc))
        else:
            await queue.put(_DONE)

    async def aclose(self) -> None:
        """Stop the epoch: cancel its task and wait until every part is closed. A ``__anext__``
        waiting in another task then ends with ``StopAsyncIteration``."""
        self._over = True
        self._epoch = None
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])  # its parts are closed when it ends
        queue = self._queue
        if queue is not None:
            while not queue.empty():
                queue.get_nowait()
            queue.put_nowait(_DONE)  # for a __anext__ still waiting

    def __del__(self) -> None:
        task = self._task
        if task is not None and not task.done():
            # Collection may run on any thread; the loop runs the cleanup (closing the parts).
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing runs any more
                task.get_loop().call_soon_threadsafe(task.cancel)
