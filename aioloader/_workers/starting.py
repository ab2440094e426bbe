"""Starting a pool's worker processes: each one's process, its pipe and its start arguments,
the workers that start together sharing one pickle of those (``startonce.py``) and, where it
serves, one template that unpickled them, from which each is forked (``template.py``).

Owns: :class:`Worker` (a started worker, as the pool keeps it) and :class:`Starts`. Never:
waits for a worker to be ready or stops one it did not start (``processes.py`` does).
"""

from __future__ import annotations

import contextlib
import errno
import multiprocessing.context
import multiprocessing.process
import multiprocessing.util
import os
import pickle
import resource
import signal
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import anyio
import torch.multiprocessing  # registers torch's shared-memory reductions

from .._base.recorders import WorkerRecorder
from . import fdpass
from .byvalue import inherited_tokens
from .children import hold_signals
from .descriptors import out_of_descriptors
from .environ import ParentEnviron, environ_now
from .mainmodule import workers_main
from .queued import Turn
from .rankinfo import main_rank
from .serverstart import prepare_forkserver
from .startonce import OnceStart, StartArguments
from .template import Template, TemplateWorker, remember_refusal, template_why_not
from .worker import worker_main

__all__ = ["Starts", "Worker"]


@dataclass(eq=False, slots=True)
class Worker:
    """A started worker process: its slot's id, its process and the pool's end of its pipe."""

    id: int
    process: multiprocessing.process.BaseProcess
    conn: Connection
    pid: int = 0
    alive: bool = True
    stopped: bool = False  # its process is joined and closed
    has: set[int] = field(default_factory=set)  # the ``ByValue`` tokens sent to it
    template: Template | None = None  # it was forked from its start's template
    unsent: fdpass.Passing | None = None  # its start's descriptors for its pipe (hand_over)
    exitcode: int | None = None  # once reaped (:meth:`reap`), for ``WorkerProcess`` views
    reaped: threading.Event = field(default_factory=threading.Event)
    last: Turn | None = None  # the last job sent to it (queued.py)
    stopping: anyio.Event | None = None  # set once it is stopped
    crash_counted: bool = False  # its death is in the statistics' crashes (incoming.py)

    def reap(self) -> None:
        """Record the exit code of its process, which has ended and been joined."""
        if self.exitcode is None:
            with contextlib.suppress(ValueError):  # closed: recorded before
                self.exitcode = self.process.exitcode
        if self.exitcode is not None:
            self.reaped.set()


class Starts:
    """How a pool's workers start.

    Args:
        ctx: The multiprocessing context they start with.
        concurrency: The pool's size (each worker's ``num_workers``).
        seed, derive: Worker ``i`` is seeded with ``derive(seed, i)``.
        worker_init_fn, dataset: The start arguments each worker is sent.
        stats: Where the start arguments' size and the template are recorded.
        stop: Stops a started worker (the pool's own stop, which releases its template).
    """

    def __init__(
        self,
        ctx: multiprocessing.context.BaseContext,
        concurrency: int,
        seed: int,
        derive: Callable[..., int],
        worker_init_fn: Callable[[int], object] | None,
        dataset: object,
        stats: WorkerRecorder,
        stop: Callable[[Worker], Awaitable[None]],
    ) -> None:
        self._ctx, self._concurrency = ctx, concurrency
        self._dataset = dataset
        prepare_forkserver(ctx)  # how they start: which of __main__'s own they have
        self.main_has = workers_main(ctx)
        self._forked = ctx.get_start_method() == "fork"
        self._served = ctx.get_start_method() == "forkserver"  # environ: see ParentEnviron
        self._start = StartArguments(worker_init_fn, dataset, self.main_has, self._forked)
        self._seed, self._derive = seed, derive
        self._stats = stats
        self._stop = stop

    async def together(self, ids: Sequence[int]) -> list[Worker]:
        """The workers ``ids`` started, sent the start arguments as they are now: forked from
        one template that unpickled them, where that serves.

        Raises:
            TypeError: The start arguments do not pickle (a note names the dataset).
            OSError: A process could not be started.

        Cancellation: the workers already started are stopped (shielded) before it propagates.
        """
        prepare_forkserver(self._ctx)  # forked before the start's files open: it keeps files
        with self._start.now() as start:
            self._stats.start_bytes = self._start.once_bytes
            template = await self._template(start, len(ids), whole=len(ids) == self._concurrency)
            workers: list[Worker] = []
            try:
                for i in ids:
                    workers.append(self._spawn(i, start, template))
                    await _hand_over(workers[-1], workers[:-1])
            except BaseException:
                with anyio.CancelScope(shield=True):
                    for worker in workers:
                        await self._stop(worker)
                raise
            finally:
                if template is not None:
                    await template.seal()  # it stops once these have
            return workers

    async def _template(self, start: object, workers: int, *, whole: bool) -> Template | None:
        """A template holding ``start`` for ``workers`` workers, or None; for a start of the
        ``whole`` pool (not a replacement), which and why, in the statistics."""
        why = template_why_not(self._ctx, start, workers, self._dataset)
        template = None
        if not why and isinstance(start, OnceStart):
            started = await Template.start(self._ctx, start, ParentEnviron(environ_now()))
            if isinstance(started, str):
                why = started
                remember_refusal(self._dataset, why)
            else:
                template = started
        if whole:
            self._stats.template_pid = 0 if template is None else template.pid or 0
            self._stats.template_why = why
        return template

    def _spawn(self, worker_id: int, start: object, template: Template | None) -> Worker:
        # The worker shares this process's temporary folder (a ``Process`` takes it from here
        # as it is made): the sockets torch's reductions listen on to hand over a batch's
        # descriptor go there, and this process removes it at exit, a killed worker's too.
        multiprocessing.util.get_temp_dir()
        try:
            return self._start_process(worker_id, start, template)
        except Exception as exc:
            if self._dataset is not None and out_of_descriptors():
                limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
                exc.add_note(
                    f"aioloader: this process ran out of open files ({limit}) as the dataset "
                    f"({type(self._dataset).__qualname__}) was sent to a worker: each tensor "
                    "it holds goes as a shared-memory segment of its own, its descriptor kept "
                    "open here (torch's file_descriptor sharing strategy). Raise the limit "
                    "(`ulimit -n`), call torch.multiprocessing.set_sharing_strategy("
                    "'file_system') first, or pass multiprocessing_context='fork' (the workers "
                    "then inherit them, as torch's forked workers do)"
                )
            elif self._dataset is not None and _is_pickling_error(exc):
                exc.add_note(
                    f"aioloader: the dataset ({type(self._dataset).__qualname__}) is sent to "
                    "each worker process and must pickle, as with torch's spawn and forkserver "
                    "start methods; or pass multiprocessing_context='fork' (the workers then "
                    "inherit it, as torch's forked workers do), or worker_mode='thread' to "
                    "read it in this process"
                )
            raise

    def _start_process(self, worker_id: int, start: object, template: Template | None) -> Worker:
        ours, theirs = self._ctx.Pipe(duplex=True)
        # A process forked from this one (this worker, with "fork"; a later worker of any pool)
        # must not hold our end: this worker would never see EOF should this process die.
        multiprocessing.util.register_after_fork(ours, Connection.close)
        has = inherited_tokens() if self._forked else set()  # what it will have, unpickled
        held: frozenset[int] | None = None
        passing = fdpass.Passing()
        try:
            held = hold_signals() if self._forked else None
            process = (self._ctx.Process if template is None else TemplateWorker)(  # type: ignore[attr-defined]
                target=worker_main,
                args=(
                    theirs,
                    worker_id,
                    self._concurrency,
                    self._derive(self._seed, worker_id),
                    ParentEnviron(environ_now()) if self._served else None,
                    template.start_args if template else _unreceived(start),
                    torch.multiprocessing.get_sharing_strategy(),  # type: ignore[no-untyped-call]
                    held,
                    main_rank(),
                ),
                name=f"aioloader-worker-{worker_id}",
                daemon=True,  # a last resort only: the pool stops every worker deterministically
            )
            routing = contextlib.nullcontext() if template is None else template.routing()
            # Through a fork server, a start's tensors past what it hands over go down the pipe
            piping = fdpass.starting(passing) if self._served else contextlib.nullcontext()
            with routing, piping:
                process.start()
        except BaseException:
            passing.close()
            ours.close()
            raise
        finally:
            if held:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, held)
            theirs.close()  # only the child holds its end: its death is EOF on ours
        if template is not None:
            template.adopt()
        return Worker(worker_id, process, ours, has=has, template=template, unsent=passing)


async def _hand_over(worker: Worker, before: list[Worker]) -> None:
    """Send ``worker`` its start's descriptors, if any went to its pipe (``fdpass.starting``).
    Where the kernel refuses more in flight (``ETOOMANYREFS``: a user without
    ``CAP_SYS_RESOURCE`` may have, over all its processes, no more in flight than its
    open-file limit), the rest go once the workers started ``before`` it have taken theirs
    (each then tells it is ready, or has ended), then as other processes take theirs (waited
    for, 10 ms doubling, for about :data:`_IN_FLIGHT_PATIENCE` seconds in all).

    Raises:
        OSError: The worker is gone; or the kernel still refuses (a note says what to do).

    Cancellation: the descriptors not sent are let go of (the pool stops the worker).
    """
    passing, worker.unsent = worker.unsent, None
    if passing is None:
        return
    try:
        if _sent_now(worker, passing):
            return
        for earlier in before:
            await anyio.wait_readable(earlier.conn.fileno())
        delay, waited = 0.01, 0.0
        while not _sent_now(worker, passing):
            if waited >= _IN_FLIGHT_PATIENCE:
                refused = OSError(errno.ETOOMANYREFS, os.strerror(errno.ETOOMANYREFS))
                refused.add_note(_in_flight_note(len(passing.fds)))
                raise refused
            await anyio.sleep(delay)
            waited, delay = waited + delay, min(delay * 2, 1.0)
    finally:
        passing.close()


def _sent_now(worker: Worker, passing: fdpass.Passing) -> bool:
    """Whether all of ``passing``'s descriptors went to ``worker`` now; False where the kernel
    refused more in flight (those that went are out of ``passing``).

    Raises:
        OSError: The worker is gone.
    """
    try:
        fdpass.send_descriptors(worker.conn, passing, patience=0.0)
    except OSError as exc:
        if exc.errno != errno.ETOOMANYREFS:
            raise
        return False
    return True


_IN_FLIGHT_PATIENCE = 10.0  # seconds a start waits for the kernel to take more in flight


def _in_flight_note(unsent: int) -> str:
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return (
        f"aioloader: {unsent} of the dataset's tensors could not be sent to a starting worker: "
        f"this user has more descriptors in flight, over all its processes (other loaders, "
        f"other ranks), than its open-file limit ({limit}) lets a process without "
        "CAP_SYS_RESOURCE. Raise the limit (`ulimit -n`), call "
        "torch.multiprocessing.set_sharing_strategy('file_system') first, or pass "
        "multiprocessing_context='fork'"
    )


def _unreceived(start: object) -> object:
    """What a worker's start holds of ``start``: one pickle, unpickled as the worker starts
    (where that raises, the worker says so: ``worker.py``), or each worker's own."""
    return start.unreceived() if isinstance(start, OnceStart) else start


def _is_pickling_error(exc: BaseException) -> bool:
    return isinstance(exc, (pickle.PicklingError, TypeError, AttributeError))
