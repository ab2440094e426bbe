"""What runs in a start's template process (``template.py``) and in the workers forked from
it: the template unpickles the start arguments, checks that doing so left it safe to fork, and
serves the stdlib's fork-server protocol; a worker finds its start arguments in what it
inherited.

Owns: :func:`serve` (the template process's target), :class:`Held` (a worker's start
arguments, by reference). Never: runs in the main process (but to make a :class:`Held`).
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing.forkserver as stdlib_forkserver
import os
import signal
from multiprocessing.connection import Connection
from typing import Any

import torch.multiprocessing

from .environ import ParentEnviron
from .forkserver import flush_stdio, listening, unsafe_to_fork
from .startonce import Unreceived
from .worker import name_this_process

__all__ = ["Held", "serve"]

_held: dict[str, object] = {}  # token: the start arguments, unpickled in the template


class Held:
    """A worker's start arguments, as its template holds them: a name, pickled in its start."""

    __slots__ = ("token",)

    def __init__(self, token: str) -> None:
        self.token = token

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return _held_start, (self.token,)


def _held_start(token: str) -> object:
    """In a worker forked from a template: the start arguments it inherited."""
    try:
        return _held[token]
    except KeyError:
        raise RuntimeError(
            "aioloader: this worker was not forked from the template that holds its start arguments"
        ) from None


def serve(
    reply: Connection,
    alive: Any,
    environ: ParentEnviron | None,
    start: Unreceived,
    token: str,
    sharing_strategy: str,
) -> None:
    """The template process: unpickle the start arguments, then, where that left it safe to
    fork, tell the main process where it listens and serve its workers' starts until its alive
    pipe's EOF (the main process's end closed, and every worker forked from it gone).
    ``environ`` is in place by now (applied as it was unpickled)."""
    del environ
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process's Ctrl-C is its own
    name_this_process("aioloader-tpl")
    torch.multiprocessing.set_sharing_strategy(sharing_strategy)  # type: ignore[no-untyped-call]
    alive_r = alive.detach()
    before, tasks = _descriptors(), _tasks()
    try:
        held = start.receive()
    except BaseException as exc:  # each worker's own start raises it, named
        reply.send((False, f"unpickling them raised {type(exc).__name__}"))
        return
    finally:
        flush_stdio()  # what unpickling printed, before the workers are forked from here
    del start
    why = _unsafe(before, tasks)
    if why:
        reply.send((False, why))
        return
    _held[token] = held
    del held
    # What it holds goes to the collector's permanent generation: a collection in a worker
    # would otherwise write to each object's header and copy every page of it
    gc.freeze()
    address, listener = listening()
    reply.send((True, address))
    reply.close()
    stdlib_forkserver.main(listener.detach(), alive_r, [])


def _descriptors() -> dict[int, str]:
    """This process's open descriptors and what each is."""
    found = {}
    for entry in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own, gone by now
            found[int(entry)] = os.readlink(f"/proc/self/fd/{entry}")
    return found


def _tasks() -> int:
    """This process's threads, as the kernel counts them (a thread started without
    ``threading`` too)."""
    return len(os.listdir("/proc/self/task"))


def _unsafe(before: dict[int, str], tasks: int) -> str:
    """Why forking workers from this template could share what each worker must have its own
    of, or lose: a descriptor opened since ``before`` (but the start's own files in memory), a
    thread started since there were ``tasks`` (a fork has only the thread that forks);
    ``""`` where nothing was."""
    opened = sorted(
        path
        for fd, path in _descriptors().items()
        if before.get(fd) != path and not path.startswith("/memfd:aioloader-start")
    )
    if opened:
        return f"unpickling them opened {', '.join(opened[:3])}"
    if why := unsafe_to_fork():
        return f"after unpickling them, {why}"
    if (now := _tasks()) != tasks:
        return f"unpickling them started {now - tasks} native thread(s)"
    return ""
