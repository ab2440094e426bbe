"""A pool of worker processes, driven from the event loop without threads or polling.

Owns: starting workers, handing a job to an idle worker (or, for a worker's own stream or a
batch dealt to it, to that worker: there, two at once, the second waiting in its pipe while the
first runs: ``queued.py``) over its pipe, awaiting the replies in turn by the pipe's
readability, noticing a dead worker through its pipe's EOF and its process sentinel (so a crash
surfaces in milliseconds, named), and stopping them.

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
import multiprocessing
import multiprocessing.context
import multiprocessing.util
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import anyio

from .._base.exceptions import WorkerCrashed, first_leaf, worker_error
from .._base.recorders import WorkerRecorder
from . import fdpass
from .children import EXITING, exits, hang_up, remove_left_segments
from .descriptors import JobNotTaken
from .incoming import crashed, mark_dead, read_reply, ready
from .ledger import LEDGER
from .outgoing import Job, Outgoing, pickle_job
from .procview import WorkerProcess
from .queued import Turn, Unstarted, may_queue
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
_POSTS = 3  # times a job is sent: again where its worker died before it reached or began it


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
        start_timeout: Seconds the started workers may take to run ``worker_init_fn`` (the
            loader's ``timeout``, as torch's first batch waits for its workers' start); 0: no
            limit.
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
        start_timeout: float = 0.0,
    ) -> None:
        self.concurrency, self.start_timeout = workers, start_timeout
        self.hurried = False  # stopping for good (a KeyboardInterrupt): cancelled jobs get no grace
        self.blocks = blocks
        self.per_worker = True  # each worker a process with its own copy (``_pool.WorkerPool``)
        # A lane's next job waits in its worker's pipe (queued.py): two jobs at once, as torch's
        # prefetch_factor=2 has two indices sent to each worker
        self.inlines, self.depth = False, 2
        self._ctx = multiprocessing.get_context(context) if isinstance(context, str) else context
        self._stats = stats
        self._starts = Starts(
            self._ctx, workers, seed, derive, worker_init_fn, dataset, stats,
            lambda worker: self._stop(worker, grace=0.0),
        )  # fmt: skip
        self._main_has = self._starts.main_has
        self._slots: Slots[Worker] = Slots(workers)  # the worker in each slot, the idle ones
        self._order: list[anyio.Lock] = []  # a slot's jobs, sent in turn (made as it starts)

    # -- life ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every worker and wait until each has run ``worker_init_fn``.

        Raises:
            WorkerCrashed: A worker died while starting.
            LoaderTimeout: Not every worker had run ``worker_init_fn`` within
                ``start_timeout`` (a hanging one held the first batch for ever: found by
                review; torch's times out).
            Exception: ``worker_init_fn`` raised (original type, worker traceback in a note).
        """
        started = time.perf_counter()
        self._order = [anyio.Lock() for _ in range(self.concurrency)]
        self._slots.now = await self._starts.together(range(self.concurrency))
        try:
            await ready(self._slots.now, self._stats, self.start_timeout)
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
            await ready([fresh], self._stats)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._stop(fresh, grace=0.0)
            raise
        self._slots.now[worker.id] = fresh
        self._stats.restarts += 1
        return fresh

    async def _stop(self, worker: Worker, *, grace: float) -> None:
        while not worker.stopped:
            if worker.stopping is not None:  # under way: wait, then stop it if that call did not
                with anyio.CancelScope(shield=True):
                    await worker.stopping.wait()
                continue
            worker.stopping = anyio.Event()
            try:
                await self._stop_now(worker, grace)
            finally:
                stopping, worker.stopping = worker.stopping, None
                stopping.set()

    async def _stop_now(self, worker: Worker, grace: float) -> None:
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
                    if not worker.stopped:  # (one not yet ready, its pid unsaid, has no job)
                        grace = _STOP_GRACE if worker.pid else 0.0
                        tg.start_soon(lambda w, g: self._stop(w, grace=g), worker, grace)
        self._slots.close()

    def processes(self) -> list[WorkerProcess]:
        """A view of each slot's worker process now, by worker id (torch's ``_workers``); from
        any thread."""
        return [WorkerProcess(worker) for worker in self._slots.now]

    # -- jobs ------------------------------------------------------------------------------------

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
        job = (fn, args, seed)
        self._stats.jobs += 1
        for _ in range(_POSTS):
            worker, out, turn = await self._post(worker, job, replace=replace)
            try:
                ok, value = await self._answer(worker, turn)
            except Unstarted:  # queued behind a job its worker died in: never started
                continue
            if ok:  # it has the values sent whole (not where it refused or failed the job)
                worker.has |= out.sending
            elif isinstance(value, JobNotTaken):  # its blocks go with the next job
                LEDGER.requeue(worker.pid, out.freed or [])
            if not ok:
                try:
                    raise worker_error(value)
                finally:  # no reference cycle through this frame
                    del value
            return value  # type: ignore[no-any-return]
        raise crashed(worker, self._stats)

    async def _post(
        self, worker: Worker, job: Job, *, replace: bool
    ) -> tuple[Worker, Outgoing, Turn]:
        """Send ``job`` to ``worker`` behind the jobs it has (queued.py), or to its replacement
        where it is dead; returns the worker it went to, the job as sent and its turn. A slot's
        jobs are sent in the order they are posted (a lane's batches in the epoch's order).

        Raises:
            WorkerCrashed: The worker is dead and ``replace`` is False; or see :meth:`_send`.
            Exception: Pickling the job failed.

        Cancellation: the job is not sent (or, sent, is the caller's to answer).
        """
        order = self._order[worker.id]
        try:  # free: no trip round the event loop (anyio's acquire always makes one)
            order.acquire_nowait()
        except anyio.WouldBlock:
            await order.acquire()
        try:
            for _ in range(_POSTS):
                if not worker.alive:
                    if not replace:
                        raise crashed(worker, self._stats)
                    now = self._slots.now[worker.id]  # replaced for a job posted before
                    if now.last is not None and now.last.waiting:
                        # It died in a job sent before: that job's reader (on the pipe, not
                        # closed under it) names the crash before it is replaced
                        await now.last.read.wait()
                    worker = now if now is not worker and now.alive else await self._replace(now)
                sent = await self._send(worker, job)
                if sent is not None:
                    return worker, *sent
            raise crashed(worker, self._stats)
        finally:
            order.release()

    async def _answer(self, worker: Worker, turn: Turn) -> tuple[bool, Any]:
        """The worker's reply to the job of ``turn``, read after the replies to the jobs sent
        to it before.

        Raises:
            Unstarted: The worker died before it answered a job sent before this one.
            WorkerCrashed: The worker died during the job.

        Cancellation: see the module's policy.
        """
        answered = False
        try:
            await turn.come()
            if not worker.alive:  # since its last reply: this job may have run
                raise crashed(worker, self._stats)
            try:
                return await read_reply(worker, self._stats)
            finally:
                answered = worker.alive  # read (a crash marks it dead)
        except anyio.get_cancelled_exc_class():
            answered = await self._drain_cancelled(worker, turn)
            raise
        finally:
            turn.done(answered=answered)

    async def _send(self, worker: Worker, job: Job) -> tuple[Outgoing, Turn] | None:
        """Pickle ``job`` for ``worker`` and send it: at once, or where it may not wait in a
        busy worker's pipe (queued.py), once the worker has answered. Returns the job as sent
        and its turn; None where the worker was found dead (the job never reached it).

        Raises:
            WorkerCrashed: The job went, not all of its tensors' descriptors (the kernel
                refused more in flight, or the worker died): the worker is killed, to be
                replaced; the cause is :class:`fdpass.Unsent`.
            Exception: Pickling the job failed (the worker is left as it is).

        Cancellation: while it waits for a busy worker; the job is not sent.
        """
        out = pickle_job(worker, job, blocks=self.blocks, main_has=self._main_has)
        last = worker.last if worker.last is not None and worker.last.waiting else None
        if last is not None and not may_queue(len(out.message), len(out.passing.fds)):
            out.drop()
            await last.read.wait()
            if not worker.alive:
                return None
            # Anew: what the worker has now goes by token (a value the job before carried whole)
            out = pickle_job(worker, job, blocks=self.blocks, main_has=self._main_has)
            last = None
        try:
            self._stats.bytes_sent += out.send()
        except fdpass.Unsent as exc:
            # It has the job, not all of its tensors, and waits for them (or died): it cannot
            # go on. Stopped, it is replaced on its next use.
            worker.process.kill()
            worker.process.join(1.0)
            worker.alive = False
            lost = crashed(worker, self._stats)
            lost.add_note(
                f"aioloader: stopped by the loader: the job's tensors could not all be sent to "
                f"it ({exc})"
            )
            raise lost from exc
        except OSError:  # it died while idle: the job never reached it
            await mark_dead(worker)
            return None
        worker.last = turn = Turn(last)
        return out, turn

    async def _drain_cancelled(self, worker: Worker, turn: Turn) -> bool:
        """A cancelled job's reply, read (shielded) and dropped; returns whether it was read.
        A worker still busy after ``CANCEL_GRACE`` is stopped: it would run on unseen."""
        read = False
        with anyio.CancelScope(shield=True):
            # The jobs before it are their readers' (each with its own grace): its grace
            # starts with its turn, and the pipe is only closed by the job whose turn it is
            try:
                await turn.come()
            except Unstarted:
                return False
            if not worker.alive:
                return False
            hurry = self.hurried or EXITING.is_set()  # (Ctrl-C or an exit waited 5 s: review)
            with anyio.move_on_after(0.0 if hurry else CANCEL_GRACE) as grace:
                read = await self._dropped(worker)
            if grace.cancelled_caught:  # still busy: don't let it run on unseen
                await self._stop(worker, grace=0.0)
        return read

    async def _dropped(self, worker: Worker) -> bool:
        """Read the worker's next reply and drop it; returns whether there was one."""
        try:
            await read_reply(worker, self._stats)
        except WorkerCrashed:
            return False
        except Exception:  # the reply, dropped with its job
            pass
        return True
