"""The background event loop behind a plain ``for`` (and ``with loader:``), and the iterator a
plain ``for`` gets.

Owns: :class:`Session`, a daemon thread running an event loop (uvloop when installed) that holds
the loader's scope open; :class:`PlainIterator`, torch's iterator protocol over one epoch
(``next()`` after a failed batch goes on with the following batch); and the interpreter-exit
hook that closes every session still open, so a script that ends with a loader or an iterator
open exits cleanly: workers stopped by us, nothing printed. Never: validates arguments or runs
stages.

Why a daemon thread of our own rather than anyio's ``start_blocking_portal``: at interpreter
exit Python joins non-daemon threads *before* ``atexit`` handlers run, so a loop left running in
one would hang the exit (or be torn down under the workers). A daemon loop is still alive when
our ``atexit`` hook runs; the hook is registered after ``multiprocessing``'s, so it runs first
and stops the workers before ``multiprocessing`` would terminate them.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import os
import queue
import threading
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import anyio
from anyio.from_thread import BlockingPortal

from .._base.exceptions import LoaderStateError
from .._device.stage import hand_out
from .._workers.serverstart import prepare_forkserver

if TYPE_CHECKING:
    from .consumer import EpochIterator
    from .scope import Scope

__all__ = ["PlainIterator", "Session", "close_from_anywhere"]

T_Batch = TypeVar("T_Batch")


class SessionLoader(Protocol[T_Batch]):
    """What a session needs of a loader (``_loader/loader.DataLoader`` is one): its scope to open
    and close on the loop, its epochs, its length and its worker settings."""

    @property
    def worker_mode(self) -> object: ...

    @property
    def num_workers(self) -> int: ...

    @property
    def start_method(self) -> Any: ...

    @property
    def _scope(self) -> Scope | None: ...

    async def __aenter__(self) -> Any: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None: ...

    def __aiter__(self) -> EpochIterator[T_Batch]: ...

    def __len__(self) -> int: ...


_open: weakref.WeakSet[Session] = weakref.WeakSet()
_hook_lock = threading.Lock()
_hooked = False


def _close_all_at_exit() -> None:
    for session in list(_open):
        with contextlib.suppress(Exception):
            session.close()


def _forget_in_child() -> None:
    """In a child forked from this process: its copies of the open sessions are the parent's
    (their loop threads are not in the child), none for its exit hook to close."""
    _open.clear()


os.register_at_fork(after_in_child=_forget_in_child)


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


def _hook_exit() -> None:
    global _hooked
    with _hook_lock:
        if not _hooked:
            atexit.register(_close_all_at_exit)
            _hooked = True


def close_from_anywhere(close: Callable[[], object]) -> None:
    """Run ``close`` (which waits on a loader's loop) now, or, when called on a thread of ours
    (the garbage collector can run a ``__del__`` on the loop's thread, where waiting on the loop
    deadlocks, or on an I/O thread the loop is waiting for), on a short-lived thread of its own.
    """
    if not threading.current_thread().name.startswith("aioloader-"):
        with contextlib.suppress(Exception):
            close()
        return

    def run() -> None:
        with contextlib.suppress(Exception):
            close()

    threading.Thread(target=run, name="aioloader-closer", daemon=True).start()


def _loop_options() -> dict[str, Any]:
    """uvloop when installed, as that loop's factory only (never the application's policy)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where it builds
        return {}
    return {"loop_factory": uvloop.new_event_loop}


def _start_loop() -> tuple[BlockingPortal, threading.Thread]:
    ready: Future[BlockingPortal] = Future()

    async def serve() -> None:
        async with BlockingPortal() as portal:
            ready.set_result(portal)
            await portal.sleep_until_stopped()

    def run() -> None:
        try:
            anyio.run(serve, backend="asyncio", backend_options=_loop_options())
        except BaseException as exc:  # the loop failed to start: tell the caller
            if not ready.done():
                ready.set_exception(exc)
            else:
                raise

    thread = threading.Thread(target=run, name="aioloader-loop", daemon=True)
    thread.start()
    return ready.result(), thread


class _LoaderScope:
    """The loader's ``async with``, as the loop's task holds it: by a weak reference, so a
    loader dropped by its user (with persistent workers open) can be collected; its
    ``__del__`` closes the session. A scope whose loader is gone closes through its own stack.
    """

    def __init__(self, loader: SessionLoader[Any]) -> None:
        self._loader = weakref.ref(loader)
        self._scope: Scope | None = None

    async def __aenter__(self) -> None:
        loader = self._loader()
        if loader is None:  # pragma: no cover - the caller holds it
            raise LoaderStateError("the loader was collected before its scope opened")
        await loader.__aenter__()
        self._scope = loader._scope

    async def __aexit__(self, *exc_info: object) -> None:
        loader = self._loader()
        if loader is not None:
            await loader.__aexit__(None, None, None)
        elif self._scope is not None:  # collected: close what it owned
            await self._scope.stack.aclose()


class Session:
    """A background event loop holding a loader's scope open.

    Args:
        loader: The loader whose scope (``async with``) opens on the loop, now.
        persistent: Kept open across epochs by ``persistent_workers`` (not by ``with``).

    Raises:
        Exception: Whatever opening the scope raised (the loop is stopped again first).
    """

    def __init__(self, loader: SessionLoader[Any], *, persistent: bool) -> None:
        self.persistent = persistent
        self._pid = os.getpid()  # a forked child's copy has no loop to stop
        if loader.worker_mode == "process" and loader.num_workers > 0:
            prepare_forkserver(loader.start_method)  # while this may be the only thread
        self.portal, self._thread = _start_loop()
        self._stack = contextlib.ExitStack()
        self._stack.callback(self._stop_loop)
        try:
            self._stack.enter_context(self.portal.wrap_async_context_manager(_LoaderScope(loader)))
        except BaseException:
            self._stack.close()
            raise
        self.closed = False
        _hook_exit()
        _open.add(self)

    def _stop_loop(self) -> None:
        self.portal.call(self.portal.stop, True)  # cancel what is left (an iterator's pump)
        self._thread.join()

    def close(self) -> None:
        """Close the loader's scope (workers stopped, tasks gone), then stop the loop.

        Cancellation: not cancellable; it returns once everything is stopped. Called from the
        loop's own thread it does nothing (see :func:`close_from_anywhere`), nor in a child
        forked from the process that opened it (its loop thread is not there: waiting for it
        hung the child's exit; the parent closes the scope).
        """
        if self.closed or threading.current_thread() is self._thread:
            return
        if os.getpid() != self._pid:
            self.closed = True
            return
        self.closed = True
        _open.discard(self)
        self._stack.close()


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
        # Batches come from a pump task on the loop over a plain queue, up to `ahead` of the
        # requests (see _receive): far cheaper than a portal call per batch.
        self._replies: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
        self._ask: Callable[[int], object] | None = None
        self._owed = 0  # batches asked for whose credits the pump has not had yet
        self._every = 1
        self._pump: concurrent.futures.Future[None] | None = None
        self._prepared = False  # the epoch began (on the loop): its batches may come from here
        try:
            self._epoch: EpochIterator[T_Batch] = session.portal.call(self._loader.__aiter__)
        except BaseException:
            self._done = True
            if owned:
                session.close()
            raise

    def __iter__(self) -> PlainIterator[T_Batch]:
        return self

    def __len__(self) -> int:
        return len(self._loader)

    def __next__(self) -> T_Batch:
        """The next batch, on the host or (with a device stage) safe on this thread's stream.

        Raises:
            StopIteration: The epoch is over.
            Exception: This batch failed (see :meth:`EpochIterator.__anext__`); the next call
                goes on.
        """
        if self._done:
            raise StopIteration
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
            if got.error is not None:
                raise got.error
        except StopAsyncIteration:
            if self._epoch.ended:  # set on the loop's thread before the end was sent here
                self._epoch.progress.finished = True
            self._epoch.shown.close()
            self.close()
            raise StopIteration from None
        except BaseException as exc:
            if not isinstance(exc, Exception) or self._session.closed:
                self.close()  # KeyboardInterrupt and the like: the epoch stops here
            error = exc
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

    def close(self) -> None:
        """Stop the epoch (and the session, when this iterator owns it). Idempotent."""
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

    def __del__(self) -> None:
        if getattr(self, "_done", True):
            return
        close_from_anywhere(self.close)
