"""A pool of worker processes, driven from the event loop without threads or polling.

Owns: starting workers, handing one job at a time to an idle worker (or, for a worker's own
stream, to that worker) over its pipe, awaiting the reply by the pipe's readability, noticing a
dead worker through its pipe's EOF and its process sentinel (so a crash surfaces in
milliseconds, named), and stopping them.

Start-up: by default (forkserver) every worker is a fork of the fork server (tens of
milliseconds), started once per process the fastest safe way (``serverstart.py``); spawn imports
torch in every worker. ``"fork"`` forks this process itself as the workers start, as torch's
fork does: the workers inherit the dataset and the job's functions unpickled, and so much else:
the descriptors open then (a socket closed here later stays open in them), and a lock another
thread held then (torch's fork workers share that risk). What a forked worker must not keep it
drops: the pipes, the signal handlers, the loop's wake-up descriptor (``worker.py``).

Cancellation policy: a job already sent to a worker is awaited, shielded, for up to
``CANCEL_GRACE`` seconds and its reply dropped; a worker still busy after that is terminated and
replaced on next use. Never: runs user code in the main process, or leaves a child behind once
:meth:`ProcessWorkers.aclose` returns.
"""

from __future__ import annotations

import contextlib
import errno
import multiprocessing
import multiprocessing.context
import multiprocessing.util
import signal
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import anyio

from .._base.exceptions import WorkerCrashed, first_leaf
from .._base.recorders import WorkerRecorder
from . import fdpass
from .byvalue import dumps_job
from .children import blocking, exits, hang_up, remove_left_segments
from .descriptors import JobNotTaken, out_of_descriptors, too_many_open_files
from .ledger import LEDGER
from .pack import pack_tensors
from .procview import WorkerProcess
from .serverstart import died_starting_note, note_server
from .slots import Slots
from .starting import Starts, Worker

__all__ = [
    "CANCEL_GRACE",
    "ProcessWorkers",
]

R = TypeVar("R")

CANCEL_GRACE = 5.0  # seconds a cancelled job may still run before its worker is terminated
_STOP_GRACE = 5.0  # seconds a worker may take to exit after its pipe closes


class ProcessWorkers:
    """``concurrency`` worker processes, each running one job at a time.

    Args:
        workers: Number of processes.
        context: A start method name (``"forkserver"``, ``"spawn"`` or ``"fork"``) or a
            multiprocessing context using one.
        seed: Base seed; worker ``i`` is seeded with ``derive(seed, i)`` at start.
        derive: Derives a worker's seed from ``(seed, worker_id)``.
        worker_init_fn: Called once in each worker as it starts, with its id.
        stats: Where start-up time, restarts and pipe bytes are counted.
        dataset: A blocking dataset each worker keeps its own copy of (sent once, as each
            worker starts), or None.
        blocks: Results come back in blocks each worker reuses (``blocks.py``: for a device
            stage that copies out of them), not in a new shared-memory segment each.
    """

    def __init__(
        self,
        workers: int,
        *,
        context: str | multiprocessing.context.BaseContext,
        seed: int,
        derive: Callable[..., int],
        worker_init_fn: Callable[[int], object] | None,
        stats: WorkerRecorder,
        dataset: object = None,
        blocks: bool = False,
    ) -> None:
        self.concurrency = workers
        self.blocks = blocks
        self.per_worker = True  # each worker a process with its own copy (``_pool.WorkerPool``)
        self.inlines, self.depth = False, 1  # a round trip to a worker process, one at a time
        self._ctx = multiprocessing.get_context(context) if isinstance(context, str) else context
        self._stats = stats
        self._starts = Starts(
            self._ctx, workers, seed, derive, worker_init_fn, dataset, stats,
            lambda worker: self._stop(worker, grace=0.0),
        )  # fmt: skip
        self._main_has = self._starts.main_has
        self._slots: Slots[Worker] = Slots(workers)  # the worker in each slot, the idle ones

    # -- life ------------------------------------------------------------------------------------

    async def _ready(self, worker: Worker) -> None:
        ok, value = await self._reply(worker)
        if not ok:
            raise value  # worker_init_fn failed, with the worker's traceback in a note
        worker.pid = value

    async def start(self) -> None:
        """Start every worker and wait until each has run ``worker_init_fn``.

        Raises:
            WorkerCrashed: A worker died while starting.
            Exception: ``worker_init_fn`` raised (original type, worker traceback in a note).
        """
        started = time.perf_counter()
        self._slots.now = await self._starts.together(range(self.concurrency))
        try:
            async with anyio.create_task_group() as tg:
                for worker in self._slots.now:
                    tg.start_soon(self._ready, worker)
        except Exception as group:
            error = first_leaf(group)
            if isinstance(error, WorkerCrashed):
                error.add_note(died_starting_note(self._ctx.get_start_method()))
            raise error from None
        self._slots.all_idle()
        self._stats.startup_s = time.perf_counter() - started
        self._stats.processes = self.concurrency
        if self._ctx.get_start_method() == "forkserver":
            note_server(self._stats)

    async def _replace(self, worker: Worker) -> Worker:
        """A fresh process for a dead (or abandoned) worker's slot.

        Cancellation: a half-started replacement is stopped again; the slot keeps the old,
        stopped worker, to be replaced on next use.
        """
        await self._stop(worker, grace=0.0)
        [fresh] = await self._starts.together([worker.id])
        try:
            await self._ready(fresh)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._stop(fresh, grace=0.0)
            raise
        self._slots.now[worker.id] = fresh
        self._stats.restarts += 1
        return fresh

    async def _stop(self, worker: Worker, *, grace: float) -> None:
        if worker.stopped:
            return
        worker.alive = False
        hang_up(worker.conn)  # EOF: the worker's loop ends
        process = worker.process
        if not await exits(process, within=grace):
            process.terminate()
            if not await exits(process, within=_STOP_GRACE):
                process.kill()
        with anyio.CancelScope(shield=True):
            await anyio.wait_readable(process.sentinel)
        process.join()
        worker.reap()
        # Exited, yet never reaped where the application ignores SIGCHLD (the kernel reaps it):
        # its sentinel is closed once the process object is dropped.
        with contextlib.suppress(ValueError):
            process.close()
        worker.stopped = True
        worker.reaped.set()  # (its exit code unknown where SIGCHLD is ignored)
        LEDGER.forget(worker.pid)  # its blocks: mappings here live on only in their views
        remove_left_segments(worker.pid)
        if worker.template is not None:
            template, worker.template = worker.template, None
            await template.release()

    async def aclose(self) -> None:
        """Stop every worker: close its pipe, wait for it to exit, terminate it if it does not.

        Cancellation: shielded; a cancelled caller still leaves no child behind.
        """
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for worker in self._slots.now:
                    if not worker.stopped:
                        tg.start_soon(lambda w: self._stop(w, grace=_STOP_GRACE), worker)
        self._slots.close()

    def processes(self) -> list[WorkerProcess]:
        """A view of each slot's worker process now, by worker id (torch's ``_workers``); from
        any thread."""
        return [WorkerProcess(worker) for worker in self._slots.now]

    # -- jobs ------------------------------------------------------------------------------------

    async def _reply(self, worker: Worker) -> tuple[bool, Any]:
        """Await the worker's next message; a dead worker raises :class:`WorkerCrashed`."""
        await anyio.wait_readable(worker.conn.fileno())
        blocking(worker.conn)
        try:
            data = worker.conn.recv_bytes()
        except (EOFError, OSError):
            await self._mark_dead(worker)
            raise self._crashed(worker) from None
        self._stats.bytes_received += len(data)
        try:  # the tensors' descriptors follow the message (fdpass.py)
            fds = fdpass.descriptors(worker.conn, fdpass.count(data))
        except (EOFError, OSError) as exc:
            if isinstance(exc, OSError) and exc.errno == errno.EMFILE:
                raise too_many_open_files() from exc
            await self._mark_dead(worker)
            raise self._crashed(worker) from None
        try:
            reply: tuple[bool, Any] = fdpass.loads(data, fds)
        except Exception as exc:
            if out_of_descriptors():
                raise too_many_open_files() from exc
            # What a reply hands over through the worker's resource sharer (a connection or a
            # socket in it; not a tensor: fdpass.py) is taken as the reply is unpickled: a
            # worker killed since it sent the reply refuses (or hangs up) there. (Another
            # error, such as a missing file a value's reduction opens, is raised at once: a
            # live worker would hold it up a second.)
            if isinstance(exc, (ConnectionError, EOFError)) and await self._died(worker):
                raise self._crashed(worker) from exc
            raise
        return reply

    async def _died(self, worker: Worker) -> bool:
        """Whether the worker has exited, or does within a second (then it is marked dead)."""
        with anyio.CancelScope(shield=True):
            if not await exits(worker.process, within=1.0):
                return False
        worker.alive = False
        worker.reap()
        return True

    async def _mark_dead(self, worker: Worker) -> None:
        """Its pipe broke: the process is dead or dying. Wait (briefly) until it can be reaped."""
        worker.alive = False
        if worker.stopped:
            return
        with anyio.CancelScope(shield=True):
            if await exits(worker.process, within=1.0):
                worker.reap()

    def _crashed(self, worker: Worker) -> WorkerCrashed:
        try:
            code = worker.process.exitcode
            pid = worker.pid or worker.process.pid or 0
        except ValueError:  # stopped and closed already
            code, pid = None, worker.pid
        self._stats.crashes += 1
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            return WorkerCrashed(worker.id, pid, exitcode=code, signal=name)
        return WorkerCrashed(worker.id, pid, exitcode=code, signal=None)

    async def run(self, fn: Callable[..., R], *args: Any, seed: int | None = None) -> R:
        """Run ``fn(*args)`` in an idle worker (seeded with ``seed`` first) and return its result.

        Raises:
            WorkerCrashed: The worker died during the job (the worker is replaced on next use).
            Exception: Whatever ``fn`` raised, with its original type when it pickles (else
                ``RemoteError``), and the worker's traceback in a note.

        Cancellation: see the module's policy; the worker goes back to the pool either way.
        """
        return await self._slots.run(self._exchange, fn, args, seed)

    @contextlib.asynccontextmanager
    async def reserved(self) -> AsyncIterator[Callable[..., Any]]:
        """Take every worker out of the pool for one owner, which sends each job to a worker of
        its choice (a worker's own iterator lives there): yields ``run_on(worker_id, fn, *args,
        seed=None, replace=True)``, awaited like :meth:`run`; with ``replace=False`` a dead
        worker raises :class:`WorkerCrashed` instead of being replaced (what lived in it, an
        iterator, is gone with it). The workers go back to the pool on exit.

        Cancellation: waiting for the workers can be cancelled; the ones taken go back.
        """
        async with self._slots.reserved(self._exchange) as run_on:
            yield run_on

    async def _exchange(
        self,
        worker: Worker,
        fn: Callable[..., R],
        args: tuple[Any, ...],
        seed: int | None,
        *,
        replace: bool = True,
    ) -> R:
        if not worker.alive:
            if not replace:
                raise self._crashed(worker)
            worker = await self._replace(worker)
        try:
            freed = self._send(worker, (fn, args, seed))
        except _Gone:  # it died while idle: the job never reached it
            await self._mark_dead(worker)
            if not replace:
                raise self._crashed(worker) from None
            worker = await self._replace(worker)
            freed = self._send(worker, (fn, args, seed))  # anew: it has no value sent before
        self._stats.jobs += 1
        try:
            ok, value = await self._reply(worker)
        except anyio.get_cancelled_exc_class():
            await self._drain_cancelled(worker)
            raise
        if not ok and isinstance(value, JobNotTaken):  # its blocks go with the next job
            LEDGER.requeue(worker.pid, freed or [])
        if not ok:
            try:
                raise value
            finally:  # no reference cycle through this frame
                del value
        return value  # type: ignore[no-any-return]

    def _send(
        self, worker: Worker, job: tuple[Callable[..., Any], tuple[Any, ...], Any]
    ) -> list[Any] | None:
        """Pickle ``job`` for ``worker`` (the blocks it may reuse, the values sent by value that
        it has already) and send it; returns the blocks it carried (None: no blocks).

        Raises:
            _Gone: The worker is gone (it died while idle): the job never reached it.
            WorkerCrashed: The job went, not all of its tensors' descriptors (the kernel
                refused more in flight, or the worker died): the worker is killed, to be
                replaced; the cause is :class:`fdpass.Unsent`.
            Exception: Pickling the job failed (the worker is left as it is).
        """
        fn, args, seed = job
        # Its tensors in one block of its own (pack.py): not each moved to shared memory where
        # it is, which a dataset's cached sample (or the whole tensor a row of it is a view
        # of) would then stay, with a descriptor open
        args = pack_tensors(args, at_least=1, most=None, aliased=True)
        freed = LEDGER.freed(worker.pid) if self.blocks else None  # None: no blocks
        sending: set[int] = set()
        try:
            whole = (fn, args, seed, freed)
            message, passing = dumps_job(whole, worker.has, sending, self._main_has)
        except BaseException as exc:
            LEDGER.requeue(worker.pid, freed or [])  # they go with the next job
            if isinstance(exc, Exception):  # pickle's own words vary by version (3.13's)
                exc.add_note(
                    f"aioloader: raised as the job was pickled for worker {worker.id} "
                    f"(pid {worker.pid}): what it carries must pickle (a lambda, a lock or an "
                    "open file in a sample does not)"
                )
            raise
        blocking(worker.conn)
        # The message is a view of a BytesIO, released as it is sent (or not): not when a
        # traceback is collected (a frame that views it, left in a cycle, crashed 3.12.1's
        # gc: gh-111049). The refusal's own frames (send_bytes') view it too: it is dropped as
        # its handler ends, not kept as the context of what is raised. The tensors' descriptors
        # go with it; refused, they are closed here (the worker never had them).
        size = len(message)
        try:
            fdpass.send(worker.conn, message, passing)
        except fdpass.Unsent as exc:
            # It has the job, not all of its tensors, and waits for them (or died): it cannot
            # go on. Stopped, it is replaced on its next use.
            worker.process.kill()
            worker.process.join(1.0)
            worker.alive = False
            crashed = self._crashed(worker)
            crashed.add_note(
                f"aioloader: stopped by the loader: the job's tensors could not all be sent to "
                f"it ({exc})"
            )
            raise crashed from exc
        except OSError:
            refused = True
        else:
            refused = False
            self._stats.bytes_sent += size
        if refused:
            raise _Gone
        worker.has |= sending
        return freed

    async def _drain_cancelled(self, worker: Worker) -> None:
        if not worker.alive:
            return
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(CANCEL_GRACE), contextlib.suppress(WorkerCrashed):
                await self._reply(worker)
                return
            await self._stop(worker, grace=0.0)  # still busy: don't let it run on unseen


class _Gone(Exception):
    """A worker's pipe refused a job: the worker died while idle."""
