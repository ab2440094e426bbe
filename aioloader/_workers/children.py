"""The main process's side of a worker process at the operating system's level: the signals held
across a fork, a pipe hung up so that every copy of it sees EOF, a pipe put back in blocking
mode, waiting for a process to exit until it can be reaped, and the shared-memory names a
reaped one left.

Never: starts or stops a process by itself (``processes.py`` decides when).
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import signal
import socket
import threading
from multiprocessing.connection import Connection

import anyio
import torch.multiprocessing

__all__ = ["EXITING", "blocking", "exits", "hang_up", "hold_signals", "remove_left_segments"]

_SHM = "/dev/shm"
#: Set as the interpreter exits: no worker is reused, so a cancelled job's is stopped at once
#: (its reply would be read by no one, and the exit waited 5 s for it: found by review).
EXITING = threading.Event()


def hold_signals() -> frozenset[int]:
    """Block, on this thread, the signals this process handles in Python and had not blocked:
    the signals a worker forked now receives wait until it has dropped this process's handlers
    (``worker.py``). Delivered before, a SIGTERM meant to stop it would run this process's
    handler there, and write to the event loop's wake-up descriptor, a socket it shares with
    this process. The caller unblocks them again once the worker is forked."""
    handled = {s for s in signal.valid_signals() if callable(signal.getsignal(s))}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, handled)
    return frozenset(handled - before)


async def exits(process: multiprocessing.process.BaseProcess, *, within: float) -> bool:
    """Whether ``process`` has exited, or does within ``within`` seconds (and can be reaped).

    Its sentinel is readable as its descriptors close while it exits, a moment before it can
    be reaped (a forked worker's sentinel is a pipe): the blocking join is that moment."""
    if process.exitcode is not None:
        return True
    with anyio.move_on_after(within):
        await anyio.wait_readable(process.sentinel)
        process.join(1.0)
        if process.exitcode is None and signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN:
            return True  # the kernel reaped it (its status is gone): no signal to a freed pid
    return process.exitcode is not None


def hang_up(conn: Connection) -> None:
    """Close this end of a worker's pipe so that the worker sees EOF even where a process
    forked from this one since holds a copy of it (torch's fork workers, a user's fork): the
    socket is shut down first, which reaches every copy (a pipe that is no socket: closed)."""
    with contextlib.suppress(OSError), socket.socket(fileno=os.dup(conn.fileno())) as end:
        end.shutdown(socket.SHUT_RDWR)
    conn.close()


def blocking(conn: Connection) -> None:
    """Blocking mode again: uvloop makes a socket it polls non-blocking, and ``Connection``'s
    whole-message reads and writes then fail part-way on a message over the socket's buffer."""
    os.set_blocking(conn.fileno(), True)


def remove_left_segments(pid: int | None) -> int:
    """Unlink the shared-memory names that torch's ``file_descriptor`` strategy left behind
    for worker ``pid``, which has exited; return how many. That strategy unlinks each segment
    as it makes it (the descriptor is what is sent), so a name of a reaped process's is one it
    was stopped between making and unlinking: nothing refers to it, and it would stay until
    the machine restarts (seen once in a CI run, under load). The ``file_system`` strategy's
    names stay while another process maps them: left alone."""
    if pid is None or torch.multiprocessing.get_sharing_strategy() != "file_descriptor":  # type: ignore[no-untyped-call]
        return 0
    prefix, removed = f"torch_{pid}_", 0
    with contextlib.suppress(OSError):  # no /dev/shm here
        for name in os.listdir(_SHM):
            if name.startswith(prefix):
                with contextlib.suppress(OSError):  # gone meanwhile
                    os.unlink(os.path.join(_SHM, name))
                    removed += 1
    return removed
