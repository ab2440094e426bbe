"""Which fork server this process's workers are forked from, and why that one.

Owns: :func:`prepare_forkserver`, the one decision, made once per process, of how the fork
server starts, fastest first: forked from this process now, when that is safe (workers then
share everything the application has imported); else the standby started as aioloader was
imported (forked then, or a fresh interpreter where that was not safe), caught up with the main
module (``standby.py``); else the stdlib's own, a fresh
interpreter asked to preload torch and the worker module besides the main module, started as
the decision is made (a loader with workers is built), so that its imports run while the
application goes on to its first epoch (a notebook's next cell, a script's model). And
:func:`server_start`, what was decided and why, for the statistics and the verdict, and
:func:`start_method_of`, the workers' start method. Never:
forks anything itself (``forkserver.py`` does), or starts a second server once one runs.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.context
import multiprocessing.spawn
import os
import sys
import time
import types
from dataclasses import dataclass

from .._base.recorders import WorkerRecorder
from . import standby, standin
from .catchup import running_main_again
from .forkserver import (
    PRELOAD,
    ForkedServer,
    fork_server,
    install,
    may_have_exited,
    running_server_pid,
    server_lock,
    server_preload,
    server_protocol_known,
    start_stdlib_server,
    uninstall,
    unsafe_to_fork,
)
from .mainscript import running_unguarded

__all__ = [
    "DEFAULT_START_METHOD",
    "ServerStart",
    "died_starting_note",
    "note_server",
    "prepare_forkserver",
    "server_start",
    "start_method_name",
    "start_method_of",
]

DEFAULT_START_METHOD = "forkserver"


@dataclass(frozen=True, slots=True)
class ServerStart:
    """How this process's fork server started.

    Attributes:
        how: ``"forked"`` (from this process, when the first loader needed it), ``"standby"``
            (forked as aioloader was imported, caught up with the main module when first
            needed), ``"fresh standby"`` (a fresh interpreter started as aioloader was
            imported, where forking was not safe then: it imported torch meanwhile, and
            caught up likewise), ``"interpreter"`` (the stdlib's: a fresh interpreter that
            imports torch and the main module, started as the first loader with workers is
            built; the first worker start waits for what is left of its imports), or
            ``"other"`` (something else had started the stdlib's server).
        why: Why the faster ways were not taken ("" for ``"forked"``).
        seconds: What getting it ready cost the process here (for ``"interpreter"``, the
            imports are paid by the first worker start instead, in its ``startup_s``).
        pid: The server's process, where it is one of ours (if the stdlib's server slot later
            holds another, ours died and the stdlib replaced it: the decision is made again).
        main: For ``"forked"``: the main module's functions and classes as the server was
            forked, which its workers have under those names (they do not run it again).
        main_again: Whether the server (or its workers) runs the main script again: not
            where the loader was built at the script's top level, outside its ``__main__``
            guard (running it again would come back there); its workers are then sent the
            script's functions and classes by value, as a notebook's.
        main_left_unsafe: For ``"interpreter"``: the standby did not serve because the main
            module's top level, run again there, started a thread or initialised CUDA.
    """

    how: str
    why: str = ""
    seconds: float = 0.0
    pid: int | None = None
    main: dict[str, object] | None = None
    main_again: bool = True
    main_left_unsafe: bool = False

    @property
    def slow(self) -> bool:
        """Whether workers pay for a fresh interpreter's imports (or for a server we did not
        start, whose preload we cannot know)."""
        return self.how in ("interpreter", "other")


_started: ServerStart | None = None
_unclaimed_s = 0.0  # what getting the server ready cost, not yet in a pool's statistics
_ours: ForkedServer | None = None  # the server we forked (or woke) and installed, if any
_stood_in: int | None = None  # the stdlib's server we started standing for the script, if any


EXIT_WAIT_S = 1.0  # how long the exit hook waits for each server it stops


def _stop_servers_at_exit() -> None:
    """At the interpreter's exit (after the loaders' own hook closed their workers): stop and
    reap the servers forked from this process, the standby too, before the interpreter tears
    its modules down. They share this process's heap copy-on-write, and the teardown writes
    to most of it: with a server still alive, every page it touches is copied (measured on 2
    cores: the process tree's PSS rose from 273 to 361 MiB as a script ended).

    A server that still has a process it forked alive (a worker of a loader left running, one
    of the application's own forkserver processes or pools) is left as it was: it would not
    stop until they have exited (each holds its alive pipe), and killing it would lose their
    exit codes. Each wait is bounded (:data:`EXIT_WAIT_S`): the exit never hangs here. A
    forkserver context used after a server was stopped starts the stdlib's own."""
    global _ours
    standby.retire(wait=EXIT_WAIT_S)
    ours = _ours
    if ours is None or ours.forked_alive():
        return
    _ours = None
    if uninstall(ours, timeout=EXIT_WAIT_S):  # else another holds the slot, or its lock
        ours.retire(wait=EXIT_WAIT_S)


def _forget_in_child() -> None:
    """In a child forked from this process (the application's fork, a fork-method process):
    the server is its parent's to stop, and the child's copy of its alive pipe must not keep
    it from stopping (found by review: a fork child alive at exit held the exit 1 s)."""
    global _ours
    ours, _ours = _ours, None
    if ours is not None:
        ours.let_go_in_child()


atexit.register(_stop_servers_at_exit)  # before the application's own: it runs after theirs
os.register_at_fork(after_in_child=_forget_in_child)


def server_start() -> ServerStart | None:
    """How this process's fork server started; None before a loader needed one."""
    return _started


def note_server(stats: WorkerRecorder) -> None:
    """Put into a pool's statistics how the fork server started and why, and what getting it
    ready cost this process (a standby catching up with the main module: its imports after
    aioloader's): that cost once, in the first pool that starts workers after it."""
    global _unclaimed_s
    if _started is not None:
        stats.server, stats.server_why = _started.how, _started.why
        stats.main_left_unsafe = _started.main_left_unsafe
        stats.server_s += _unclaimed_s
        _unclaimed_s = 0.0


def _install(forked: ForkedServer) -> None:
    global _ours
    install(forked)
    _ours = forked


def _start() -> ServerStart:
    """Start the fork server the fastest safe way, once (see the module's docstring)."""
    if not server_protocol_known():
        standby.retire()
        return ServerStart("interpreter", standby.UNKNOWN_PROTOCOL)
    with server_lock() as running:  # the stdlib's own, held while it starts its server
        if running is not None:
            if _started is not None and _started.pid in (None, running):
                return _started
            standby.retire()  # the workers come from a server we did not start
            return ServerStart("other", "the stdlib's server was started by another caller")
        began = time.perf_counter()
        why = unsafe_to_fork()
        if why is None:
            standby.retire()  # forked now, the server has everything the application imported
            main = _functions_and_classes(sys.modules.get("__main__"))
            forked = fork_server()
            _install(forked)
            return ServerStart("forked", "", time.perf_counter() - began, forked.pid, main)
        again = not running_unguarded()
        fresh = standby.fresh()
        woken = standby.wake(run_main=again)
        if isinstance(woken, standby.Refused):
            unsafe = woken.main_left_unsafe
            return ServerStart(
                "interpreter", f"{why}; {woken.why}", main_again=again, main_left_unsafe=unsafe
            )
        _install(woken.server)
        how, why = ("fresh standby", f"{why}; {fresh}") if fresh else ("standby", why)
        if woken.instead is not None:  # its reserve serves: each worker runs the main module
            reserve = "its reserve serves, each worker running the main module"
            why = f"{why}; {woken.instead.why}; {reserve}"
        return ServerStart(
            how,
            why,
            time.perf_counter() - began,
            woken.server.pid,
            main_again=again,
            main_left_unsafe=woken.instead is not None,
        )


def _functions_and_classes(module: object) -> dict[str, object]:
    return {
        name: value
        for name, value in list(vars(module).items() if module is not None else ())
        if isinstance(value, types.FunctionType | type)
    }


def prepare_forkserver(context: str | multiprocessing.context.BaseContext) -> None:
    """Before starting workers with ``context`` (no-op unless it is forkserver): start the fork
    server (see the module's docstring) unless one runs.

    Called where the process may still have one thread (a loader's construction; a plain
    ``for`` before it starts its event loop's thread) and again as the workers start. The
    stdlib's server, once started here, stays this process's: a process that becomes safe to
    fork later (its other threads ended) keeps it.

    Raises:
        RuntimeError: Called while a fork server runs the main module again (a script that
            starts a loader with worker processes at its top level, unguarded).
    """
    global _started, _unclaimed_s, _stood_in
    ctx = multiprocessing.get_context(context) if isinstance(context, str) else context
    if ctx.get_start_method() != "forkserver":
        return
    if running_main_again():
        raise RuntimeError(
            "aioloader: a loader with worker processes was started while a fork server ran "
            "the main module again to find its classes (as spawn and forkserver do): put the "
            "script's loading and training under `if __name__ == '__main__':`"
        )
    running = running_server_pid()
    replaced = _started is not None and _started.pid not in (None, running)  # ours died
    if _started is None or _started.slow or replaced:  # until ours runs: it may be safe now
        fresh = _start()
        if _started is None or replaced or not fresh.slow:
            if fresh is not _started:
                _unclaimed_s += fresh.seconds
            _started = fresh
    if not _started.slow:
        return
    current = server_preload()
    wanted = current + [m for m in PRELOAD if m not in current]
    if not _started.main_again:  # the script's top level would build this loader again
        wanted = [m for m in wanted if m != "__main__"]
        wanted += [standin.MODULE] if standin.MODULE not in wanted else []
    if wanted != current:
        ctx.set_forkserver_preload(wanted)
    running = running_server_pid()
    # (one standing in for the script that died: the stdlib would start one that does not;
    # where alive after all, starting it does nothing)
    if _started.how == "interpreter" and (
        running is None or (running == _stood_in and may_have_exited(running))
    ):
        environ = {} if _started.main_again else _standing_in()
        start_stdlib_server(environ)  # its imports (seconds) run while the application goes on
        _stood_in = running_server_pid() if environ else None


def _standing_in() -> dict[str, str]:
    """What the stdlib's server is started with to stand in for the main script
    (``standin.py``): nothing where there is no script (``python -c``, a notebook)."""
    script = standin.encode(multiprocessing.spawn.get_preparation_data("aioloader"))
    return {} if script is None else {standin.ENV: script}


def died_starting_note(method: str) -> str:
    """What a worker that died while starting (with start ``method``) most likely met: the
    main script, run again in it, built a loader at its top level; unless the workers do not
    run it (a script that builds its loader at its top level, unguarded: they are sent its
    functions and classes instead)."""
    if method == "forkserver" and _started is not None and not _started.main_again:
        if _started.how.endswith("standby") or running_server_pid() in (_stood_in, None):
            return (
                "aioloader: the worker died while starting (not in the main script: this "
                "script builds its loader at its top level, so its workers do not run it "
                "again; they are sent its functions and classes instead)"
            )
        return (  # a server started without the stand-in (by another, or after ours died)
            "aioloader: the worker died while starting. This script builds its loader at "
            "its top level, outside `if __name__ == '__main__':`, and its workers came from "
            "a fork server that runs the script again in each. Guard the script's top level, "
            "or pass multiprocessing_context='fork' (torch's default on Linux)"
        )
    return (
        "aioloader: the worker died while starting. With the spawn and forkserver start "
        "methods each worker imports your main module: a script that starts the loader at "
        "import time must guard it with `if __name__ == '__main__':`"
    )


def start_method_name(context: str | multiprocessing.context.BaseContext) -> str:
    """The start method's name: ``context`` itself, or the method of the context given."""
    return context if isinstance(context, str) else context.get_start_method()


def start_method_of(
    context: object, *, serving: bool = False
) -> str | multiprocessing.context.BaseContext:
    """The worker processes' start method: ``context`` (a name or a multiprocessing context)
    when given, else forkserver. ``"fork"`` is taken with torch's meaning: each worker is a
    fork of this process as its workers start (``processes.py`` says what that costs), except
    for a serving process's workers (``serving``: a ``DynamicBatcher``'s).

    Raises:
        ValueError: The method is unknown, not available on this platform, or fork refused.
        TypeError: ``context`` is neither a string nor a multiprocessing context.
    """
    if context is None:
        return DEFAULT_START_METHOD
    if isinstance(context, str):
        method = context
    elif isinstance(context, multiprocessing.context.BaseContext):
        method = context.get_start_method()
    else:
        raise TypeError(
            "multiprocessing_context option should be a valid context object or a string "
            f"specifying the start method, but got multiprocessing_context={context!r} "
            f"(a {type(context).__qualname__})"
        )
    available = multiprocessing.get_all_start_methods()  # torch's words, and its list
    if serving:
        available = [m for m in available if m != "fork"]
        if method == "fork":
            raise ValueError(
                "multiprocessing_context='fork' is not supported by DynamicBatcher: a fork of "
                "a serving process holds copies of its client connections, which then stay "
                "open after the server closes them; use 'forkserver' (the default) or 'spawn'"
            )
    if method not in available:
        raise ValueError(
            f"multiprocessing_context option should specify a valid start method in "
            f"{available!r}, but got multiprocessing_context={method!r}"
        )
    return context if isinstance(context, multiprocessing.context.BaseContext) else method
