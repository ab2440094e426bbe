"""A worker process as torch's iterator lists it in ``_workers``: its pid, whether it is alive,
a join, its exit code, a signal; from any thread.

Owns: :class:`WorkerProcess`. Never: reaps the process or stops it on the pool's behalf (the
pool does, on the loop's thread); a signal sent here is a crash the pool then sees as any other.

torch's multiprocessing iterator keeps its workers' ``multiprocessing.Process`` objects in
``_workers``, and code that wants its workers' pids reads it (torch's own tests too). Ours are
the pool's: a ``Process`` is not safe to poll from a second thread (two readers of a fork
server's sentinel take one exit status between them), and the pool closes it once it is
joined. So the view waits on a pidfd of its own, opened while the worker is known alive: it
turns readable as the process ends, whoever reaps it, and no later process can take its place.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .starting import Worker

__all__ = ["WorkerProcess"]


class WorkerProcess:
    """One worker process, read-only, as a ``multiprocessing.Process`` answers for it.

    ``pid``, ``is_alive()``, ``join(timeout)``, ``exitcode``, ``terminate()`` and ``kill()``
    keep their ``multiprocessing.Process`` meanings, with one difference: ``exitcode`` is known
    once the loader has reaped the process (as it stops its workers, or finds one dead), and
    None until then. Where the loader is stopping it, ``join`` waits for that too.
    """

    __slots__ = ("__weakref__", "_gone", "_pidfd", "_worker")

    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        self._pidfd: int | None = None
        self._gone = worker.stopped or not worker.pid
        if not self._gone:
            try:
                self._pidfd = os.pidfd_open(worker.pid)
            except ProcessLookupError:
                # Dead unnoticed (between epochs, say) and reaped: a fork server reaps its
                # own children, and its pid may be another process's by now.
                self._gone = True
            except (OSError, AttributeError):  # no pidfds here: the pid, as a last resort
                pass
        if self._pidfd is not None:
            weakref.finalize(self, os.close, self._pidfd)

    @property
    def pid(self) -> int:
        return self._worker.pid

    @property
    def worker_id(self) -> int:
        return self._worker.id

    @property
    def exitcode(self) -> int | None:
        """The exit code (``-N``: ended by signal ``N``) once the loader has reaped the
        process; None before."""
        return self._worker.exitcode

    def _ended_within(self, seconds: float | None) -> bool:
        if self._gone or self._worker.stopped:
            return True
        if self._pidfd is None:  # no pidfd: the pool's word, or the pid's absence
            if not self._worker.alive:
                return True
            try:
                os.kill(self._worker.pid, 0)
            except ProcessLookupError:
                return True
            except OSError:
                pass
            if seconds is None or seconds > 0:
                self._worker.reaped.wait(seconds)
            return self._worker.stopped
        poller = select.poll()
        poller.register(self._pidfd, select.POLLIN)  # readable once the process has ended
        return bool(poller.poll(None if seconds is None else max(0.0, seconds) * 1000))

    def is_alive(self) -> bool:
        """Whether the process is still running (a process that ended is not, reaped or not)."""
        return not self._ended_within(0)

    def join(self, timeout: float | None = None) -> None:
        """Wait until the process ends, ``timeout`` seconds at most (None: as long as it takes);
        where the loader is stopping it, also until the loader has reaped it (``exitcode``).

        Cancellation: none; a blocking call, as ``multiprocessing.Process.join`` is.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._ended_within(timeout):
            return
        if not self._worker.alive:  # the pool is stopping it or found it dead: it reaps it
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._worker.reaped.wait(left)

    def terminate(self) -> None:
        """SIGTERM, unless the process has ended. The loader sees a worker ended by a signal,
        as it sees a crash."""
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL, unless the process has ended (see :meth:`terminate`)."""
        self._signal(signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        if self._ended_within(0):
            return
        with contextlib.suppress(ProcessLookupError):
            if self._pidfd is not None:  # to this process, never a later one of its pid
                signal.pidfd_send_signal(self._pidfd, signum)
            else:
                os.kill(self._worker.pid, signum)

    def __repr__(self) -> str:
        state = "alive" if self.is_alive() else f"exitcode={self.exitcode}"
        return f"<aioloader worker {self._worker.id} pid={self.pid} {state}>"
