"""The iterator a plain ``for`` gets: torch's iterator protocol over one epoch, its batches
received on a session's background loop (``session.py``).

Owns: :class:`PlainIterator` (``next()`` after a failed batch goes on with the following batch,
as torch's iterator does) and the pump task that receives its batches ahead of the requests,
over a plain queue. Never: opens or closes a scope (the session does), or runs stages.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import queue
import threading
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .._base.exceptions import LoaderStateError, StopInWorker
from .._device.stage import hand_out
from .session import Session, SessionLoader, close_from_anywhere

if TYPE_CHECKING:
    from .._workers.procview import WorkerProcess
    from .consumer import EpochIterator

__all__ = ["PlainIterator"]

T_Batch = TypeVar("T_Batch")

_AHEAD = 4  # at most this many host batches a plain `for` reads ahead (half of `prefetch` at most)


def _give(credits: asyncio.Semaphore, n: int) -> None:
    for _ in range(n):
        credits.release()


async def _loop_and_credits(ahead: int) -> tuple[asyncio.AbstractEventLoop, asyncio.Semaphore]:
    return asyncio.get_running_loop(), asyncio.Semaphore(ahead)


async def _pump(
    epoch: EpochIterator[Any],
    credits: asyncio.Semaphore,
    replies: queue.SimpleQueue[tuple[bool, Any]],
) -> None:
    """Receive a batch of ``epoch`` for each credit (one per request, plus the ``ahead`` it
    started with) into ``replies``: ``(True, received)`` (a batch, or a failed batch's error:
    see :meth:`EpochIterator.receive`) or ``(False, error)``. Ends after the epoch's end
    (``StopAsyncIteration``).

    Cancellation: a waiting consumer gets ``concurrent.futures.CancelledError`` (what a portal
    call gets when its loop stops).
    """
    try:
        while True:
            await credits.acquire()
            try:
                batch = await epoch.receive()
            except StopAsyncIteration as end:
                replies.put((False, end))
                return
            except Exception as exc:  # a timeout: raised in the consumer, which goes on
                replies.put((False, exc))
                del exc
            else:
                replies.put((True, batch))
                del batch
    except BaseException:
        replies.put((False, concurrent.futures.CancelledError()))
        raise


class PlainIterator(Generic[T_Batch]):
    """One epoch for a plain ``for``: torch's iterator protocol over the background loop.

    A batch that failed raises from ``next()``; the next ``next()`` goes on with the following
    batch, as torch's iterator does. The epoch (and a session owned by this iterator) is closed
    when the epoch ends, when :meth:`close` is called, or when the iterator is dropped.
    """

    def __init__(self, loader: SessionLoader[T_Batch], session: Session, *, owned: bool) -> None:
        self._session = session
        self._owned = owned
        self._loader = loader  # as torch's iterator: the loader lives as long as it
        self._done = False
        self._closing = threading.Lock()  # close() here and from a later iter()'s thread
        # Batches come from a pump task on the loop over a plain queue, up to `ahead` of the
        # requests (see _receive): far cheaper than a portal call per batch.
        self._replies: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
        self._ask: Callable[[int], object] | None = None
        self._owed = 0  # batches asked for whose credits the pump has not had yet
        self._every = 1
        self._pump: concurrent.futures.Future[None] | None = None
        self._prepared = False  # the epoch began (on the loop): its batches may come from here
        self._superseded = False  # ended by a later iter(loader): see supersede()
        self._processes: list[WorkerProcess] | None = None
        try:
            self._epoch: EpochIterator[T_Batch] = session.portal.call(self._loader.__aiter__)
            self._scope = loader._scope  # the epoch's: its workers (`_workers`)
        except BaseException:
            self._done = True
            if owned:
                session.close()
            raise

    def __iter__(self) -> PlainIterator[T_Batch]:
        return self

    @property
    def _workers(self) -> list[WorkerProcess]:
        """The worker processes of this iterator's epoch, by worker id, as torch's
        multiprocessing iterator lists them (code that wants its workers' pids reads it):
        each answers ``pid``, ``is_alive()``, ``join()``, ``exitcode``, ``terminate()`` and
        ``kill()`` (:class:`~aioloader._workers.procview.WorkerProcess`), also after the
        epoch has ended. The processes as they were when first asked: a worker replaced
        after a crash is not in the list.

        Raises:
            AttributeError: The loader has no worker processes (``num_workers=0``, thread or
                Ray workers), as torch's single-process iterator has no ``_workers``.
        """
        if self._processes is None:
            pool = self._scope.process_pool() if self._scope is not None else None
            if pool is None:
                raise AttributeError(
                    "'PlainIterator' object has no attribute '_workers': this loader has no "
                    "worker processes"
                )
            self._processes = pool.processes()
        return self._processes

    def __len__(self) -> int:
        return len(self._loader)

    @property
    def _pin_memory_thread(self) -> threading.Thread:
        """The thread that pins batches, as torch's multiprocessing iterator keeps it (torch's
        tests join it once the iterator is dropped): the session's event-loop thread, which
        runs the device stage; it ends as the epoch's session closes.

        Raises:
            AttributeError: No batch is pinned here, or no worker process makes them (torch's
                iterator has no pin thread then: ``pin_memory`` off or no accelerator, or
                ``num_workers=0``).
        """
        scope = self._scope
        if scope is None or scope.device is None or scope.process_pool() is None:
            raise AttributeError(
                "'PlainIterator' object has no attribute '_pin_memory_thread': this loader "
                "pins no batches made by worker processes"
            )
        return self._session.thread

    def __next__(self) -> T_Batch:
        """The next batch, on the host or (with a device stage) safe on this thread's stream.

        Raises:
            StopIteration: The epoch is over.
            Exception: This batch failed (see :meth:`EpochIterator.__anext__`); the next call
                goes on.
        """
        if self._done:
            raise self._stopped()
        got: Any = None
        try:
            if self._ask is None:  # no pump yet: the epoch's batches may be made here
                if not self._prepared:
                    self._session.portal.call(
                        functools.partial(self._epoch.prepare, own_thread=True)
                    )
                    self._prepared = True
                # Made here, in this thread's call, as torch's are; an error raised within
                # keeps this frame (its traceback's frames keep their callers), which holds no
                # `self` when it raises: see below.
                got = self._epoch.receive_now()
            if got is None:
                ok, got = self._receive()
                if not ok:
                    raise got
            self._epoch.took(got)  # this thread is the consumer: it has it now
            if got.error is not None:  # (a dataset's StopIteration ends the loop, as torch's)
                raise StopIteration if isinstance(got.error, StopInWorker) else got.error
        except StopAsyncIteration:
            # `got` is the end raised above, whose traceback holds this frame: a cycle that
            # would keep the iterator, and a dropped loader's persistent workers, until the
            # collector's next pass (torch's stop as the loader is dropped).
            got = None
            if self._epoch.ended:  # set on the loop's thread before the end was sent here
                self._epoch.progress.finished = True
            self._epoch.shown.close()
            self.close()
            raise self._stopped() from None  # (ended by a later iter() on another thread?)
        except BaseException as exc:
            closed = self._session.closed  # the loader's scope ended: this epoch with it
            if not isinstance(exc, Exception) or closed:
                self._close_now(hurry=not isinstance(exc, Exception))
            # Stopped meanwhile, by a later iter() on another thread or by the scope's end:
            # said as on this one, whatever the closing left this call with (a cancelled call,
            # a closed portal or loop: "Event loop is closed" came out, found by review).
            ended = self._superseded or (closed and isinstance(exc, Exception))
            error = self._stopped() if ended else exc
        else:
            if got.warning is not None:  # given here, where torch gives it: in the consumer
                warnings.warn(got.warning, UserWarning, stacklevel=2)
            # This thread is the consumer: its current stream must wait for the copy.
            return hand_out(got.batch)  # type: ignore[no-any-return]
        # The error's traceback holds this frame: without `self` in it, a caller that keeps the
        # error (a log, a test) does not keep the epoch running; dropping the iterator stops it.
        # Without `error` in it there is no reference cycle: refcounting frees it all at once.
        del self, got
        try:
            raise error
        finally:
            del error

    def _receive(self) -> tuple[bool, Any]:
        """``(True, batch)``, the next batch as the loop holds it, or ``(False, error)``: what
        :meth:`EpochIterator.receive` raised (``concurrent.futures.CancelledError`` when the
        session closed meanwhile). Returned, not raised: the error's traceback must not hold
        this frame, which holds the iterator (see :meth:`__next__`)."""
        if self._ask is None:
            epoch = self._epoch
            # Host batches are read ahead while this thread works on the one before (a request
            # answered at once costs no wait for the loop's thread), out of `prefetch`: the
            # epoch's stream holds that many fewer. Staged ones are not, so the device holds no
            # more than the stage's depth. Credits go back two at a time (enough while at least
            # one batch is read ahead): half the wake-ups of the loop's thread.
            ahead = 0 if epoch.stages_on_device else epoch.hold_ahead(_AHEAD)
            self._every = 2 if ahead else 1
            portal = self._session.portal
            loop, credits = portal.call(_loop_and_credits, ahead)
            self._pump = portal.start_task_soon(_pump, self._epoch, credits, self._replies)

            def ask(n: int) -> None:
                loop.call_soon_threadsafe(_give, credits, n)

            self._ask = ask
        self._owed += 1
        if self._owed >= self._every:
            self._ask(self._owed)
            self._owed = 0
        return self._replies.get()

    def supersede(self) -> None:
        """A later ``iter(loader)`` begins another epoch: this one ends (a loader runs one plain
        ``for`` epoch at a time), and a later ``next()`` here raises :class:`LoaderStateError`
        if the epoch had batches left (torch's loader would have given them: each of its
        iterators has an epoch of its own), where it used to stop silently."""
        if not self._done:
            self._superseded = True
            self.close()

    def _stopped(self) -> BaseException:
        """What ``next()`` raises once the epoch is over for this iterator: StopIteration, or
        :class:`LoaderStateError` where a later ``iter(loader)`` ended it with batches left."""
        if self._superseded and self._batches_left():
            return LoaderStateError(self._superseded_message())
        return StopIteration()

    def _batches_left(self) -> bool:
        """Whether the superseded epoch certainly had batches left: a map-style dataset's epoch
        (its batches known: ``len(loader)``) with fewer taken, not re-divided among another
        number of ranks and skipping no samples (an empty batch leaves no mark). A stream's
        may have had more or none: it stops quietly, as it did."""
        plan: Any = getattr(self._loader, "_plan", None)
        progress = self._epoch.progress
        if plan is None or not plan.kind.is_map or plan.arguments.max_failures:
            return False
        if progress.base.layers:  # an elastic resume's remainder: not len(loader) batches
            return False
        try:
            return len(progress.taken) < len(self._loader)
        except TypeError:  # a batch sampler without a length
            return False

    def _superseded_message(self) -> str:
        epoch = self._epoch.progress.base.epoch
        return (
            f"this iterator's epoch ({epoch}) ended when a later iter(loader) began another, "
            f"after {len(self._epoch.progress.taken)} of its batches: a loader runs one plain "
            "`for` epoch at a time (torch's gives each iterator an epoch of its own). To read "
            "the data twice at once (an evaluation inside the training loop, zip(loader, "
            "loader)), iterate a second loader: copy.copy(loader) makes one"
        )

    def close(self) -> None:
        """Stop the epoch (and the session, when this iterator owns it). Idempotent, and safe
        from two threads at once (this iterator's, and a later ``iter(loader)``'s)."""
        with self._closing:
            if self._done:
                return
            self._done = True
        session = self._session
        try:
            if self._pump is not None:
                self._pump.cancel()
            if not session.closed:
                session.portal.call(self._epoch.aclose)
        finally:
            if self._owned:
                session.close()

    def _close_now(self, *, hurry: bool) -> None:
        """:meth:`close`; with ``hurry`` (a KeyboardInterrupt: Ctrl-C waited 5 s, and a second
        was lost, found by review), the worker processes' cancelled jobs are given no grace
        where the workers end with this iterator (persistent ones are kept: a caught Ctrl-C
        must not restart them, nor run ``worker_init_fn`` again)."""
        hurry = hurry and self._owned and self._scope is not None
        pool = self._scope.process_pool() if hurry and self._scope is not None else None
        if pool is not None:
            pool.hurried = True
        try:
            self.close()
        finally:
            if pool is not None:
                pool.hurried = False

    def __del__(self) -> None:
        if getattr(self, "_done", True):
            return
        close_from_anywhere(self.close)
