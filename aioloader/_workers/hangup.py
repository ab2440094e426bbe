"""A worker's resource sharer told to keep quiet about a main process that died in a handshake.

What a worker's reply hands over through multiprocessing's resource sharer (a connection or a
socket in it; a tensor's descriptor crosses beside the message instead: ``fdpass.py``) the main
process takes from a thread of the worker's that serves a socket, where the main process
connects, answers a handshake and takes each descriptor. When the main process is killed
(SIGKILL: preempted, out of memory) in that exchange, the sharer's thread reports the hang-up
(``ConnectionResetError`` or ``EOFError`` in ``deliver_challenge``, a ``BrokenPipeError`` in
the hand-over) through ``sys.excepthook`` and serves on. The worker leaves by itself once it
sees its pipe's end, but the report reached the job's log as a traceback per worker, as if
something had failed besides the kill (torch's workers print it too).

Owns: that one report, from that one thread, once the main process is gone. Never: any other
thread's errors or any other error, or a hang-up while the main process lives (then the report
is printed as before).
"""

from __future__ import annotations

import multiprocessing
import sys
import threading
from multiprocessing import resource_sharer
from types import TracebackType

from .pidfd import exited_within

__all__ = ["quiet_once_main_is_gone"]

_HUNG_UP = (EOFError, ConnectionError)  # a peer's end closed, mid-read or mid-write
# Seconds: a killed process's descriptors are closed one by one, before it has exited; the
# socket's end closes first.
_GRACE = 1.0


def _main_hung_up(value: BaseException) -> bool:
    """Whether ``value``, raised in the current thread, is the resource sharer's report of a
    hang-up by a main process that is now gone (waits up to ``_GRACE`` seconds to know)."""
    if not isinstance(value, _HUNG_UP):
        return False
    serving = getattr(resource_sharer._resource_sharer, "_thread", None)  # type: ignore[attr-defined]
    if serving is None or threading.current_thread() is not serving:
        return False
    main = multiprocessing.parent_process()  # the process that started this one, whichever way
    if main is None or main.pid is None:
        return False
    # Not the stdlib's sentinel for it, but where no pidfd can be had: a fork-context worker
    # started later holds its write end too, and keeps it open while that sibling lives
    gone = exited_within(main.pid, _GRACE)
    if gone is None:
        main.join(_GRACE)
        return not main.is_alive()
    return gone


def quiet_once_main_is_gone() -> None:
    """In a worker: ``sys.excepthook`` keeps quiet about the resource sharer's hang-ups once
    the main process is gone, and hands everything else to the hook it replaces."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if not _main_hung_up(value):
            previous(kind, value, tb)

    sys.excepthook = hook
