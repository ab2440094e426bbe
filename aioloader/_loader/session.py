"""The background event loop behind a plain ``for`` (and ``with loader:``).

Owns: :class:`Session`, a daemon thread running an event loop (uvloop when installed) that holds
the loader's scope open; and the interpreter-exit hook that closes every session still open, so
a script that ends with a loader or an iterator open exits cleanly: workers stopped by us,
nothing printed (a child forked meanwhile has none of them to close). Never: validates
arguments, runs stages, or iterates an epoch (``plain.py`` does, for a plain ``for``).

Why a daemon thread of our own rather than anyio's ``start_blocking_portal``: at interpreter
exit Python joins non-daemon threads *before* ``atexit`` handlers run, so a loop left running in
one would hang the exit (or be torn down under the workers). A daemon loop is still alive when
our ``atexit`` hook runs; the hook is registered after ``multiprocessing``'s, so it runs first
and stops the workers before ``multiprocessing`` would terminate them.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio
from anyio.from_thread import BlockingPortal

from .._base.exceptions import LoaderStateError
from .._workers.children import EXITING
from .._workers.serverstart import prepare_forkserver

if TYPE_CHECKING:
    from .consumer import EpochIterator
    from .scope import Scope

__all__ = ["Session", "SessionLoader", "close_from_anywhere"]

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

    async def _open_scope(self, *, one_epoch: bool) -> None: ...

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
    EXITING.set()
    for session in list(_open):
        with contextlib.suppress(Exception):
            session.close()


# A child forked from this process has copies of the open sessions, not their loop threads:
# none is its exit hook's to close.
os.register_at_fork(after_in_child=_open.clear)


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

    def __init__(self, loader: SessionLoader[Any], *, one_epoch: bool) -> None:
        self._loader = weakref.ref(loader)
        self._one_epoch = one_epoch
        self._scope: Scope | None = None

    async def __aenter__(self) -> None:
        loader = self._loader()
        if loader is None:  # pragma: no cover - the caller holds it
            raise LoaderStateError("the loader was collected before its scope opened")
        await loader._open_scope(one_epoch=self._one_epoch)
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
        one_epoch: The scope serves one epoch only (a plain ``for``'s own, without ``with``
            or ``persistent_workers``).

    Raises:
        Exception: Whatever opening the scope raised (the loop is stopped again first).
    """

    def __init__(
        self, loader: SessionLoader[Any], *, persistent: bool, one_epoch: bool = False
    ) -> None:
        self.persistent = persistent
        self._pid = os.getpid()  # a forked child's copy has no loop to stop
        if loader.worker_mode == "process" and loader.num_workers > 0:
            prepare_forkserver(loader.start_method)  # while this may be the only thread
        self.portal, self._thread = _start_loop()
        self._stack = contextlib.ExitStack()
        self._stack.callback(self._stop_loop)
        try:
            scope = _LoaderScope(loader, one_epoch=one_epoch)
            self._stack.enter_context(self.portal.wrap_async_context_manager(scope))
        except BaseException:
            self._stack.close()
            raise
        self.closed = False
        _hook_exit()
        _open.add(self)

    @property
    def thread(self) -> threading.Thread:
        """The loop's thread (it ends as the session closes)."""
        return self._thread

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
        self.closed = True
        if os.getpid() != self._pid:  # a forked child's copy
            return
        _open.discard(self)
        self._stack.close()
