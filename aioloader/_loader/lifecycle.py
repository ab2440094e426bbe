"""The loader's scope opened and closed: ``async with loader:``, ``with loader:``, ``close()``.

Owns: :class:`ScopeLifecycle`, the part of ``DataLoader`` (one of its base classes) that opens
a scope (its recorders, workers, the dataset's own ``async with``, the task group) and closes
it, or a background session for a plain ``for`` (``session.py``), and ends persistent workers
with their loader. Never: says what a scope owns (``scope.py`` does), or begins an epoch.
"""

from __future__ import annotations

import contextlib
import threading
import time
from types import TracebackType
from typing import Any, Protocol, TypeVar

import anyio

from .._base.exceptions import LoaderStateError
from .._base.recorders import Recorders
from .._workers.offload import ThreadOffload
from .._workers.procview import WorkerProcess
from .plan import LoaderPlan
from .scope import LoaderState, Scope
from .session import Session, SessionLoader, close_from_anywhere

__all__ = ["PersistentIterator", "ScopeLifecycle", "ScopedLoader"]


class ScopedLoader(SessionLoader[Any], Protocol):
    """What opening and closing a scope need of a loader (``loader.DataLoader`` is one),
    besides what its session needs: its plan, shared state and dataset, its session, and when
    its last scope closed."""

    _plan: LoaderPlan
    _state: LoaderState
    _session: Session | None
    _stopped_at: float | None

    @property
    def dataset(self) -> Any: ...

    def _new_recorders(self) -> Recorders: ...

    def _offload(self) -> ThreadOffload: ...

    def _refresh_plan(self, *, raising: bool = True) -> None: ...

    def __exit__(self, *exc_info: object) -> None: ...

    def close(self) -> None: ...


L = TypeVar("L", bound=ScopedLoader)


def _is_async_context(obj: object) -> bool:
    return callable(getattr(obj, "__aenter__", None)) and callable(getattr(obj, "__aexit__", None))


class PersistentIterator:
    """What code written for torch reaches as ``loader._iterator`` while persistent workers
    run (torch keeps its persistent iterator there): ``_shutdown_workers()`` stops them, as
    Lightning's teardown and scripts that free their workers call it; ``_workers`` lists them
    (see ``PlainIterator._workers``)."""

    def __init__(self, loader: ScopedLoader, session: Session) -> None:
        self._loader, self._session = loader, session

    @property
    def _workers(self) -> list[WorkerProcess]:
        scope = self._loader._scope
        pool = scope.process_pool() if scope is not None and not self._session.closed else None
        return [] if pool is None else pool.processes()

    def _shutdown_workers(self) -> None:
        """Stop the persistent workers (no-op once they are stopped); the next epoch starts
        new ones, as torch's next iterator does."""
        if self._loader._session is self._session and self._session.persistent:
            self._loader.close()


# What runs, not what a loader is: a copy of the loader has its own (``__getstate__``).
_RUNNING = ("_state", "_session", "_plain", "_stopped_at", "_iterating", "_torch_order")


class ScopeLifecycle:
    """Opening and closing the loader's scope (a base class of ``DataLoader``, whose
    ``__init__`` sets the attributes below, which these methods set again)."""

    _session: Session | None
    _stopped_at: float | None

    def _new_recorders(self: ScopedLoader) -> Recorders:
        plan = self._plan
        return Recorders(
            max_inflight=plan.arguments.max_inflight,
            workers=plan.worker_threads,
            prefetch=plan.prefetch,
            device=plan.device_depth if plan.device_plan is not None else None,
        )

    def _offload(self: ScopedLoader) -> ThreadOffload:
        if self._scope is None:
            raise LoaderStateError("the loader's scope is closed")
        return self._scope.offload()

    async def __aenter__(self: L) -> L:
        """Open the loader's scope: its task group and its workers (threads, or processes that
        are started here and have run ``worker_init_fn`` when this returns), and the device
        stage (CUDA is initialised and its stream created on the stage's own thread).

        Raises:
            LoaderStateError: The scope is already open.
            WorkerCrashed: A worker process died while starting.
            RuntimeError: CUDA failed to initialise for ``device``.
            Exception: ``worker_init_fn`` raised in a worker (original type, worker traceback).

        Cancellation: whatever was started is stopped again before the cancellation goes on.
        """
        await self._open_scope(one_epoch=False)
        return self

    async def _open_scope(self: ScopedLoader, *, one_epoch: bool) -> None:
        """:meth:`__aenter__`'s work; ``one_epoch``: the scope serves one epoch only (a plain
        ``for``'s own, without ``with`` or ``persistent_workers``)."""
        if self._scope is not None:
            raise LoaderStateError("this loader's scope is already open; it cannot be re-entered")
        self._refresh_plan()
        self._state.stats = self._new_recorders()
        self._state.scopes += 1
        stack = contextlib.AsyncExitStack()
        scope = Scope(self._plan, self._state, stack, one_epoch=one_epoch)
        stack.push_async_callback(scope.close_workers)
        try:
            await scope.start_workers()
            if _is_async_context(self.dataset):
                # A dataset holding clients (an HTTP session, an object store) lives as long as
                # the scope: opened here, closed after every task that could use it is gone.
                await stack.enter_async_context(self.dataset)
            scope.task_group = await stack.enter_async_context(anyio.create_task_group())
        except BaseException:
            with anyio.CancelScope(shield=True):
                await stack.aclose()
            raise
        stack.callback(scope.task_group.cancel_scope.cancel)
        stack.callback(scope.close_iteration)
        self._state.scope = scope

    async def __aexit__(
        self: ScopedLoader,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        """Close the scope: cancel the running epoch, wait for every task and thread.

        Cancellation: the task group waits for its tasks even when the caller is cancelled, and
        the threads are joined after it, so a cancelled caller still leaves nothing behind.
        """
        scope = self._scope
        if scope is None:
            return None
        self._stopped_at = time.perf_counter()
        # The body's exception is the caller's, not the task group's: passing it in would wrap
        # it in an ExceptionGroup. The scope's cleanup is the same whatever ended the body.
        # The scope stays set while it closes: closing a blocking stream still needs its threads.
        try:
            await scope.stack.aclose()
        finally:
            self._state.scope = None
        return None

    def __enter__(self: L) -> L:
        """Open the scope for plain ``for`` loops: one background event loop (and one set of
        workers, one device stage) serves every epoch until ``__exit__``. A scope kept open by
        ``persistent_workers`` is taken over (``__exit__`` closes it).

        Raises:
            LoaderStateError: The scope is already open (``async with`` or ``with``).
            Exception: As :meth:`__aenter__`.
        """
        session = self._session
        if session is not None and session.persistent:
            session.persistent = False
            return self
        if session is not None or self._scope is not None:
            raise LoaderStateError("this loader's scope is already open; it cannot be re-entered")
        self._refresh_plan()  # here, not on the loop's thread (Ray's join_cluster)
        self._session = Session(self, persistent=False)
        return self

    def __exit__(self: ScopedLoader, *exc_info: object) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.close()

    @property
    def _iterator(self: ScopedLoader) -> Any:  # (torch's attribute is its iterator class)
        """torch's persistent iterator, as code written for torch reaches it: None unless
        persistent workers are running (see :class:`PersistentIterator`)."""
        session = self._session
        if session is None or not session.persistent:
            return None
        return PersistentIterator(self, session)

    @_iterator.setter
    def _iterator(self: ScopedLoader, value: Any) -> None:
        """``loader._iterator = None``, torch's way to drop its persistent iterator (Lightning
        does it as it tears its loops down), stops the persistent workers.

        Raises:
            TypeError: ``value`` is not None: the iterator is the loader's to make.
        """
        if value is not None:
            raise TypeError(
                f"only None can be assigned to a loader's _iterator (it stops persistent "
                f"workers), got {type(value).__qualname__}"
            )
        session = self._session
        if session is not None and session.persistent:
            self.close()

    def close(self: ScopedLoader) -> None:
        """Close the scope opened by ``with loader:`` or kept open by ``persistent_workers``:
        stop the workers and the background loop (no-op when none is open)."""
        self.__exit__(None, None, None)

    def __getstate__(self) -> dict[str, Any]:
        """What a copy takes (``copy.copy``, ``copy.deepcopy``, pickle, a loader sent to a
        spawned process): the settings, the epoch the loader runs next and a state loaded for
        it. Never what runs: a scope, its workers and threads, a plain ``for``'s iterator, the
        statistics. The copy opens its own, and an epoch of the original under way goes on
        undisturbed (torch's loader refuses to pickle while its persistent workers run)."""
        state = dict(vars(self))
        for name in _RUNNING:
            state.pop(name, None)
        return state

    def __setstate__(self: ScopedLoader, state: dict[str, Any]) -> None:
        """The copy's plan is made again from the same arguments, with the original's order,
        base seed and share of a ``distributed`` dataset, before its first use (``_refresh_plan``:
        not here, where a spawned process may be unpickling it as it starts). For its own
        scope: the original's reads in this process go through the original's, and a
        stream's pass keeps its place in it (found by review: a shallow copy's reads failed
        with the original's scope closed). For the process it is in: what its workers have
        of the main module by name (found by review: a retry policy sent by value for the
        original's workers failed to reach an unpickled copy's)."""
        vars(self).update(state)
        vars(self).update(_session=None, _plain=None, _stopped_at=0.0, _copied=True)
        vars(self).update(_iterating=threading.Lock())
        self._state = LoaderState(self._new_recorders())

    def __copy__(self) -> Any:
        """A shallow copy: the same dataset, samplers, settings and order, and a plan of its
        own once used (see ``__setstate__``)."""
        twin: Any = type(self).__new__(type(self))
        twin.__setstate__(self.__getstate__())
        return twin

    def __del__(self) -> None:
        # Persistent workers go with their loader, as torch's do. (A scope opened by `with`
        # or `async with` holds the loader itself: it closes when its block ends.)
        session = self.__dict__.get("_session")
        if session is not None:
            close_from_anywhere(session.close)
