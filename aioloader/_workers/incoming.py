"""A worker process's reply, read from its pipe: the message, then its tensors' descriptors
(``fdpass.py``), unpickled; a dead worker told apart by its pipe's EOF and its process's exit,
and named (:class:`WorkerCrashed`).

Owns: :func:`read_reply`, :func:`mark_dead`, :func:`died`, :func:`crashed`. Never: sends to a
worker, or stops one (``processes.py`` does).
"""

from __future__ import annotations

import errno
import math
import signal
from collections.abc import Sequence
from typing import Any

import anyio

from .._base.exceptions import LoaderTimeout, WorkerCrashed, first_leaf
from .._base.recorders import WorkerRecorder
from . import fdpass
from .children import blocking, exits
from .descriptors import out_of_descriptors, too_many_open_files
from .starting import Worker

__all__ = ["crashed", "died", "mark_dead", "read_reply", "ready"]


async def ready(
    workers: Sequence[Worker],
    stats: WorkerRecorder,
    timeout: float = 0.0,  # noqa: ASYNC109 (the error of its timeout names those not ready)
) -> None:
    """Wait until each of ``workers``, just started, has said it is ready (its pid, once
    ``worker_init_fn`` ran), each within ``timeout`` seconds (0: no limit) of the start or of
    the one before it, as torch's ``timeout`` gives each batch its own wait.

    Raises:
        LoaderTimeout: None said so for ``timeout`` seconds: those not ready are named (a
            hanging ``worker_init_fn`` held the first batch for ever, where torch's ``timeout``
            fires: found by review).
        WorkerCrashed: One died first.
        Exception: ``worker_init_fn`` raised (original type, worker traceback in a note).
    """
    waiting = {worker.id for worker in workers}
    deadline = anyio.CancelScope(deadline=anyio.current_time() + (timeout or math.inf))

    async def one(worker: Worker) -> None:
        ok, value = await read_reply(worker, stats)
        if not ok:
            raise value
        worker.pid = value
        waiting.discard(worker.id)
        deadline.deadline = anyio.current_time() + (timeout or math.inf)  # progress: a new wait

    try:
        with deadline:
            async with anyio.create_task_group() as tg:
                for worker in workers:
                    tg.start_soon(one, worker)
        if deadline.cancelled_caught:
            raise TimeoutError
    except TimeoutError:
        raise LoaderTimeout(
            f"DataLoader timed out after {timeout} seconds: worker(s) {sorted(waiting)} had not "
            "finished starting (worker_init_fn)"
        ) from None
    except Exception as group:
        raise first_leaf(group) from None


async def read_reply(worker: Worker, stats: WorkerRecorder) -> tuple[bool, Any]:
    """Await the worker's next message (its descriptors taken, unpickled).

    Raises:
        WorkerCrashed: The worker is dead (it is marked so, and reaped).
        OSError: Out of descriptors (:func:`too_many_open_files`).
        Exception: The reply did not unpickle.

    Cancellation: while it awaits the message; nothing is read then.
    """
    try:
        fd = worker.conn.fileno()
    except OSError:  # closed: stopped by the pool
        raise crashed(worker, stats) from None
    await anyio.wait_readable(fd)
    blocking(worker.conn)
    try:
        data = worker.conn.recv_bytes()
    except (EOFError, OSError):
        await mark_dead(worker)
        raise crashed(worker, stats) from None
    stats.bytes_received += len(data)
    try:  # the tensors' descriptors follow the message (fdpass.py)
        fds = fdpass.descriptors(worker.conn, fdpass.count(data))
    except (EOFError, OSError) as exc:
        if isinstance(exc, OSError) and exc.errno == errno.EMFILE:
            raise too_many_open_files() from exc
        await mark_dead(worker)
        raise crashed(worker, stats) from None
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
        if isinstance(exc, (ConnectionError, EOFError)) and await died(worker):
            raise crashed(worker, stats) from exc
        raise
    return reply


async def died(worker: Worker) -> bool:
    """Whether the worker has exited, or does within a second (then it is marked dead)."""
    with anyio.CancelScope(shield=True):
        if not await exits(worker.process, within=1.0):
            return False
    worker.alive = False
    worker.reap()
    return True


async def mark_dead(worker: Worker) -> None:
    """Its pipe broke: the process is dead or dying. Wait (briefly) until it can be reaped."""
    worker.alive = False
    if worker.stopped:
        return
    with anyio.CancelScope(shield=True):
        if await exits(worker.process, within=1.0):
            worker.reap()


def crashed(worker: Worker, stats: WorkerRecorder) -> WorkerCrashed:
    """The error of ``worker``'s death, naming its pid, exit code and signal; the death is
    counted once, however many calls find it (a worker stream's job, then its close)."""
    try:
        code = worker.process.exitcode
        pid = worker.pid or worker.process.pid or 0
    except ValueError:  # stopped and closed already
        code, pid = None, worker.pid
    if not worker.crash_counted:
        worker.crash_counted = True
        stats.crashes += 1
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        return WorkerCrashed(worker.id, pid, exitcode=code, signal=name)
    return WorkerCrashed(worker.id, pid, exitcode=code, signal=None)
