"""Datasets whose epochs run tasks of their own, who chooses their epoch, and the iterator that
owns such an epoch.

Owns: :class:`OpensEpochs` (the contract: ``open_epoch(epoch, state)`` gives an async context
manager whose ``async with`` owns the epoch's tasks; the one place a stream's epoch and resume
state are checked, and the epoch of a dataset iterated directly), :func:`claim_epochs` (a
loader taking the epochs over) and :class:`OwnedEpochIterator` (iterating such a dataset
directly, from any task). Never: starts readers itself (``_fanin/lanes.py`` does), or keeps
the epoch of a dataset a loader reads (the loader passes it to :meth:`OpensEpochs.open_epoch`).
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import abstractmethod
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from .._base.checks import check_int
from .._base.exceptions import LoaderStateError
from .dataset import AsyncIterableDataset, T_co

__all__ = ["OpensEpochs", "OwnedEpochIterator", "claim_epochs", "open_owned"]

T = TypeVar("T")


class OpensEpochs(AsyncIterableDataset[T_co]):
    """A stream whose epochs run tasks of their own (readers of many parts at once).

    Epochs have one owner. A :class:`~aioloader.DataLoader` reading the dataset owns them: it
    passes its epoch (and, resuming, the dataset's state) to :meth:`open_epoch` each time it
    opens one, and the dataset keeps no count of its own. From the moment such a loader is
    built, :meth:`set_epoch` and :meth:`load_state_dict` on the dataset raise
    :class:`~aioloader.LoaderStateError` naming ``loader.set_epoch`` / ``loader.load_state_dict``
    (the loader would otherwise overwrite them without a word); an epoch chosen with
    :meth:`set_epoch` before the loader was built is where the loader starts. Iterated directly
    (``async for``, no loader), each :meth:`__aiter__` opens the next epoch (the first is 0, or
    the one :meth:`set_epoch` / :meth:`load_state_dict` chose).

    The loader enters :meth:`open_epoch` in the task that consumes the epoch, so the readers'
    task group is entered and left there. Iterating the dataset directly runs the epoch in a
    task the iterator owns and hands its items over one by one; ``aclose()`` on the iterator
    (or dropping it) cancels that task, which closes every open part.

    A subclass implements :meth:`epoch_items` and, to resume, ``state_dict()`` and
    :meth:`check_state`.
    """

    # Class defaults, so that a subclass need not call __init__: the epoch (and state) the
    # next direct iteration opens, whether set_epoch chose it, and whether a loader owns them.
    _direct_epoch = 0
    _direct_chosen = False
    _direct_state: Any = None
    _loader_owned = False

    @abstractmethod
    def epoch_items(
        self, epoch: int, state: Any
    ) -> contextlib.AbstractAsyncContextManager[AsyncIterator[T_co]]:
        """Epoch ``epoch`` (checked by :meth:`open_epoch`): an async context manager giving its
        iterator, going on from ``state`` (checked by :meth:`check_state`) unless it is None."""

    def check_state(self, state: dict[str, Any]) -> int | None:
        """Check a state from ``state_dict()`` (a dict: :meth:`open_epoch` checked that) and
        return the epoch it is of, or None for a state of no particular epoch.

        Raises:
            TypeError: The dataset cannot resume (this default), or ``state`` is malformed.
            ValueError: ``state`` is malformed or of other data.
        """
        raise TypeError(f"{type(self).__qualname__} cannot resume (it has no state_dict())")

    def epoch_start_state(self, epoch: int) -> dict[str, Any] | None:
        """The state at the start of ``epoch``, nothing read, for a loader's state before its
        first batch of the epoch; None (this default) when it would say nothing
        ``state_dict()`` during the epoch would not. A stream that splits itself by rank
        names its split here, so that ``merge_states`` can re-divide a rank that took
        nothing yet (``tar_shards`` does)."""
        return None

    def open_epoch(
        self, epoch: int, state: Any = None
    ) -> contextlib.AbstractAsyncContextManager[AsyncIterator[T_co]]:
        """Open epoch ``epoch``: an async context manager giving its iterator, going on from
        ``state`` (what ``state_dict()`` gave during that epoch) when it is not None.

        Raises:
            TypeError: ``epoch`` is not an int, or ``state`` is not a dict from
                ``state_dict()`` (or the dataset cannot resume).
            ValueError: ``epoch`` is negative, or ``state`` is malformed or of another epoch.
        """
        epoch = check_int("epoch", epoch, minimum=0)
        if state is not None:
            of = self._checked(state)
            if of is not None and of != epoch:
                raise ValueError(f"state is of epoch {of}; it cannot go on with epoch {epoch}")
        return self.epoch_items(epoch, state)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch the next direct iteration opens (``async for`` over the dataset),
        or, before a loader is built over the dataset, the loader's first epoch.

        Raises:
            TypeError, ValueError: ``epoch`` is not an int >= 0.
            LoaderStateError: A loader reads this dataset: call ``loader.set_epoch(epoch)``
                instead; or a state loaded with :meth:`load_state_dict` is of another epoch.
        """
        epoch = check_int("epoch", epoch, minimum=0)
        self._not_owned(f"set_epoch({epoch})")
        loaded = self._direct_state
        of = self.check_state(loaded) if loaded is not None else None
        if of is not None and of != epoch:
            raise LoaderStateError(
                f"the state loaded with load_state_dict() goes on with epoch {of}; "
                f"set_epoch({epoch}) would drop it"
            )
        self._direct_epoch, self._direct_chosen = epoch, True

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next direct iteration go on where ``state`` (from ``state_dict()``) stood.

        Raises:
            TypeError, ValueError: ``state`` is malformed or of other data.
            LoaderStateError: A loader reads this dataset: load the loader's state
                (``loader.load_state_dict``), which carries this one.
        """
        self._not_owned("load_state_dict()")
        of = self._checked(state)
        if of is not None:
            self._direct_epoch = of
        self._direct_chosen = False
        self._direct_state = state

    def next_state(self, fresh: dict[str, Any]) -> dict[str, Any]:
        """For ``state_dict()`` with no epoch open: the state loaded for the next direct
        iteration, else ``fresh`` (the start of an epoch; its ``"epoch"`` key, if any, is set
        to the next direct iteration's)."""
        if self._direct_state is not None:
            return dict(self._direct_state)
        if "epoch" in fresh:
            fresh["epoch"] = self._direct_epoch
        return fresh

    def __aiter__(self) -> AsyncIterator[T_co]:
        """Open the next epoch: an iterator over it (see the class on closing it and on which
        epoch it is)."""
        epoch, state = self._direct_epoch, self._direct_state
        self._direct_epoch, self._direct_state, self._direct_chosen = epoch + 1, None, False
        return OwnedEpochIterator(self.open_epoch(epoch, state))

    def _checked(self, state: Any) -> int | None:
        if not isinstance(state, dict):
            raise TypeError(
                f"state must be a dict from {type(self).__qualname__}.state_dict(), got {state!r}"
            )
        return self.check_state(state)

    def _not_owned(self, call: str) -> None:
        if self._loader_owned:
            raise LoaderStateError(
                f"{call} on a dataset a DataLoader reads: the loader chooses its epochs and "
                f"where they go on (it would overwrite this); call loader.{call} instead"
            )


def claim_epochs(dataset: object) -> int | None:
    """A loader takes over the epochs of ``dataset`` (an :class:`OpensEpochs`; others are left
    alone): from now on the dataset's ``set_epoch`` and ``load_state_dict`` raise, naming the
    loader's. Returns the epoch ``set_epoch`` chose before (where the loader starts), or None.

    Raises:
        LoaderStateError: A state loaded into the dataset (``load_state_dict``) would be lost:
            the loader resumes only from its own state.
    """
    if not isinstance(dataset, OpensEpochs):
        return None
    if dataset._direct_state is not None:
        raise LoaderStateError(
            f"a state was loaded into the {type(dataset).__qualname__} with its "
            "load_state_dict(); a loader resumes from its own state: load the loader's "
            "(loader.load_state_dict) instead"
        )
    dataset._loader_owned = True
    return dataset._direct_epoch if dataset._direct_chosen else None


def open_owned(dataset: OpensEpochs[T], epoch: int, state: Any) -> AsyncIterator[T]:
    """An iterator over ``dataset``'s epoch ``epoch`` through its own ``__aiter__`` (a subclass
    that iterates its own way), for the loader that owns its epochs."""
    dataset._direct_epoch, dataset._direct_state = epoch, state
    return aiter(dataset)


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
