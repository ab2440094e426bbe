"""A fork server held in reserve: forked as aioloader is imported, while that is still safe (else
a fresh interpreter started then), for a loader built once forking is not safe.

Owns: starting the standby (:func:`fork_standby`, called at the end of ``aioloader/__init__``),
waking it when a loader needs a server and this process can no longer fork one (:func:`wake`),
and retiring it when a fresh fork is made instead (:func:`retire`). Never: runs the
application's code in the standby before it is woken.

Why: a training script initialises CUDA and starts threads (a logger, a metrics exporter, an
earlier loader's loop) before it builds its loader. Forking then could hang, so the only server
left was a fresh interpreter importing torch and the main module: seconds, in every process,
and a second private copy of torch. Imported before any of that, aioloader forks the standby
then (a few milliseconds), and the standby waits, doing nothing, on its wake line.

Woken, it catches up with the main module as ``multiprocessing.spawn`` does for a fresh
interpreter (the same semantics as the stdlib's server): it takes this process's ``sys.path``,
``sys.argv`` and working directory, and runs the main script once more as ``__mp_main__`` (its
``if __name__ == "__main__":`` block does not run), so that the classes and functions a worker
unpickles are there (``catchup.py``). The imports the standby already has (torch, NumPy,
aioloader) are not paid again. If the main script's top level fails, the standby says why and
exits, and the stdlib's server is started instead; if it leaves a thread or a CUDA context
behind, a second standby forked beside it (the reserve) serves instead, each of its workers
running the main module after its fork, as the stdlib's server's do. A top level that starts a
loader is not run again (``mainscript.running_unguarded``).

Where forking is not safe as aioloader is imported in an interactive session (a notebook
kernel's threads, which it always has; CUDA already initialised), the standby is a fresh
interpreter instead (:func:`~.spawned.spawn_server`), started then: it imports torch and
aioloader while the user goes on to the next cells, and, woken, does the same. Not in a script
(``_interactive``): there, a library's threads or CUDA before the import are the exception, and
the import can move (the verdict says so).
Either waits on its wake line, and takes this process's environment variables as it is woken.
The fresh one costs a process with torch imported (about 150 MiB of private memory on 2 cores
with CPU torch) for the life of the application, used or not: the stdlib's server, which a
loader with workers would start otherwise, costs the same.

``AIOLOADER_STANDBY=0`` in the environment turns it off.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver as stdlib_forkserver
import os
import signal
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import spawn
from typing import Any

from .catchup import MainRun, Refused, catch_up, modules_being_imported, running_main_again
from .environ import adopt_environ, environ_now
from .forkserver import (
    ForkedServer,
    fork_server,
    server_preload,
    server_protocol_known,
    unsafe_to_fork,
)
from .spawned import spawn_server
from .worker import name_this_process

__all__ = [
    "ENV",
    "Refused",
    "UNKNOWN_PROTOCOL",
    "Woken",
    "fork_standby",
    "fresh",
    "retire",
    "serve_fresh",
    "wake",
]

ENV = "AIOLOADER_STANDBY"


@dataclass(eq=False, slots=True)
class _Standby:
    server: ForkedServer
    line: multiprocessing.connection.Connection  # this process's end of the wake line
    fresh: str = ""  # a fresh interpreter: why it was not forked ("" where forked)


_standby: _Standby | None = None
#: A second forked standby, beside the first: where running the main module again left the
#: first with a thread or a CUDA context, it serves instead, each worker running the main
#: module after its fork (as the stdlib's server's workers do) but with torch imported already.
#: Forked from the same image, it shares its pages with the first.
_reserve: _Standby | None = None
_missing = "no standby: aioloader has not been imported"  # why there is none, once it was
UNKNOWN_PROTOCOL = (
    f"Python {sys.version.split()[0]}'s fork server is not one a forked server can be handed "
    "to (3.11 to 3.13 only)"
)


def _forget_in_child() -> None:
    """In a child forked from this process (a server of ours, or the application's own fork):
    the standby is its parent's, and its copies of the standby's descriptors go."""
    global _standby, _reserve
    for standby in (_standby, _reserve):
        if standby is not None:
            standby.line.close()
            with contextlib.suppress(OSError):
                os.close(standby.server.alive_w)
    _standby = _reserve = None


os.register_at_fork(after_in_child=_forget_in_child)


def _a_multiprocessing_child() -> bool:
    """This process is a worker or a server of multiprocessing's, still importing its main
    module (spawn) or its preload (a fork server), or already running: no standby of its own."""
    if running_main_again() or spawn.is_forking(sys.argv):
        return True
    if multiprocessing.parent_process() is not None:
        return True
    serving = stdlib_forkserver.main.__code__
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is serving:
            return True
        frame = frame.f_back
    return False


def fork_standby() -> None:
    """Fork the standby, if forking is safe now and nothing turned it off; else, in an
    interactive session, start a fresh one; else do nothing (a loader then forks a server when
    it is built, if that is safe, or the stdlib starts one). Never raises: where the fork or
    its socket fails (a sandbox without fork), the reason is kept for ``server_why`` and
    importing aioloader goes on."""
    global _standby, _missing
    if _standby is not None or _a_multiprocessing_child():
        return
    if os.environ.get(ENV, "1") == "0":
        _missing = f"no standby: {ENV}=0"
        return
    if not server_protocol_known():
        _missing = UNKNOWN_PROTOCOL
        return
    why = unsafe_to_fork()
    if why is not None and (sys.platform != "linux" or not _interactive()):
        _missing = f"no standby: when aioloader was imported, {why}"
        return
    partial = modules_being_imported()
    try:
        ours, theirs = multiprocessing.Pipe()
    except OSError as exc:
        _missing = f"no standby: its socket pair failed ({exc!r})"
        return
    fresh = "" if why is None else f"when aioloader was imported, {why}"
    try:
        if why is None:
            server = _fork(theirs, partial)
        else:
            ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # (a background job)
            server = spawn_server(
                f"{__name__}:serve_fresh",
                keep=(theirs.fileno(),),
                extra=(int(ignored), os.getpgrp()),
            )
        _standby = _Standby(server, ours, fresh)
    except Exception as exc:  # a sandbox without fork, no room for its socket: import goes on
        ours.close()
        _missing = f"no standby: {'forking' if why is None else 'starting'} it failed ({exc!r})"
        return
    except BaseException:  # interrupted: (spawn_server or fork_server left nothing running)
        ours.close()
        raise
    finally:
        theirs.close()
    _missing = "the standby was used or retired"
    if why is None:
        _fork_reserve(partial)


def _fork(line: multiprocessing.connection.Connection, partial: frozenset[str]) -> ForkedServer:
    """Fork a standby that waits on its end of ``line`` (the standby and the reserve alike)."""
    return fork_server(
        "aioloader-sb", keep=(line.fileno(),), before_serving=lambda: _wait(line, partial)
    )


def _fork_reserve(partial: frozenset[str]) -> None:
    """Fork :data:`_reserve` (after the first standby: its descriptors are not the reserve's),
    where that can be done; a failure leaves the first alone."""
    global _reserve
    try:
        ours, theirs = multiprocessing.Pipe()
    except OSError:
        return
    try:
        _reserve = _Standby(_fork(theirs, partial), ours)
    except Exception:  # (the first standby serves alone)
        ours.close()
    except BaseException:  # interrupted: the first goes too, and the interruption goes on
        ours.close()
        retire()
        raise
    finally:
        theirs.close()


def _interactive() -> bool:
    """Whether this is an interactive session (a Jupyter or IPython kernel, IPython's shell,
    Python's own prompt), where a fresh standby is worth its process: a kernel always has
    threads before any cell imports aioloader, and its user goes on to the next cells while
    the standby imports. Not elsewhere: a process that imports aioloader among other threads
    without building a loader with workers (a Ray actor running our jobs, a server) would pay
    a process with torch imported for nothing."""
    if hasattr(sys, "ps1") or sys.flags.interactive:
        return True
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    return callable(get_ipython) and get_ipython() is not None


def serve_fresh(listener_fd: int, alive_r: int, line_fd: int, int_ignored: int, group: int) -> None:
    """In a fresh standby (its entry, from :func:`fork_standby`, with torch and aioloader
    imported by now): wait to be woken, then serve, as a forked standby does, taking Ctrl-C
    as the application took it as the standby was started (Python's handler, or ignored:
    ``int_ignored``). Never returns.

    It stays a process group of its own (``spawned.py``), but every process it forks (the
    workers, the application's own forkserver processes) goes back to the application's,
    ``group``, as the stdlib's server's children are in it: they get a kernel's interrupt and
    its SIGTERM as it shuts down (then this server reaps them), and at a terminal they are in
    the foreground (found by review: with them in the server's group, a worker's print under
    ``stty tostop`` stopped them all, and the application's own processes outlived the
    kernel)."""
    try:
        woken = signal.SIG_IGN if int_ignored else signal.default_int_handler
        _wait(multiprocessing.connection.Connection(line_fd), frozenset(), woken)
        os.register_at_fork(after_in_child=lambda: _rejoin(group))
        # Named only now: the native threads its imports started (unnamed pools, which take
        # the process's name) must read as such to the check that it is safe to fork.
        name_this_process("aioloader-sb")
        gc.freeze()  # what it imported and ran, kept off the workers' collections' pages
        stdlib_forkserver.main(listener_fd, alive_r, [])
    finally:
        os._exit(0)


def _rejoin(group: int) -> None:
    """In a process a fresh standby forked: the application's process group, and SIGTTOU as
    it was (the standby ignores it)."""
    signal.signal(signal.SIGTTOU, signal.SIG_DFL)
    with contextlib.suppress(OSError):  # the application's group is gone: it exited
        os.setpgid(0, group)


def _wait(
    line: multiprocessing.connection.Connection,
    partial: frozenset[str],
    woken: Callable[[int, types.FrameType | None], Any] | int | None = None,
) -> None:
    """In the standby: wait to be woken (EOF: retired, or this process's parent exited), catch
    up with the main module, and answer None (serving) or why not (then exit): where the main
    module's top level failed, or left a thread or a CUDA context here (workers forked from it
    could inherit a lock held; the stdlib's server, started instead, never runs the main
    module: each of its workers runs it after its fork).

    While it only waits, Ctrl-C is the application's (the standby ignores it). Woken, it takes
    Ctrl-C as the parent does: the stdlib's server hands the handler it found to every process
    it forks (the application's own forkserver children too), and a main module that blocks
    while it runs again must not outlive its parent. ``woken``: that handler, where it is not
    the one this process has now (a fresh standby)."""
    waiting = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        preparation, main, environ, preload = line.recv()
    except EOFError:
        os._exit(0)
    signal.signal(signal.SIGINT, waiting if woken is None else woken)
    refused: Refused | None = None
    try:
        adopt_environ(environ)
        catch_up(preparation, partial, main, preload)
        why = unsafe_to_fork()
        if why is not None:
            why = f"the standby server could not serve: running the main module again, {why}"
            refused = Refused(why, main_left_unsafe=True)
    except BaseException as exc:  # the main module's top level failed here: say how
        refused = Refused(f"the standby server could not run the main module again: {exc!r}")
    line.send(refused)
    line.close()
    if refused is not None:
        os._exit(0)


@dataclass(frozen=True, slots=True)
class Woken:
    """A standby that serves.

    Attributes:
        server: The server.
        instead: Where it is the reserve: why the first standby did not serve (running the
            main module again started a thread or initialised CUDA there); the reserve's
            workers each run the main module after their fork.
    """

    server: ForkedServer
    instead: Refused | None = None


def wake(*, run_main: bool = True) -> Woken | Refused:
    """Wake the standby: the server, once it has caught up with the main module; else why there
    is none to use (no standby, or it could not catch up: then it has exited). With
    ``run_main=False`` (a script that builds its loader at its top level, outside its
    ``__main__`` guard) it takes this process's path, arguments and directory but does not run
    the main script again, and neither do its workers: they have the main module as it was
    when aioloader was imported. Where running the main module again left the standby with a
    thread or a CUDA context, the reserve serves instead (see :data:`_reserve`).

    Blocks while the standby runs the main module's imports again (those it did not have);
    interrupted meanwhile (Ctrl-C), the standby (and the reserve) is killed and reaped, and
    the interruption goes on."""
    global _standby, _reserve
    standby, _standby = _standby, None
    if standby is None:
        retire()
        return Refused(_missing)
    try:
        woken = _rouse(standby, "here" if run_main else "nowhere")
    except BaseException:
        retire()
        raise
    reserve, _reserve = _reserve, None
    if reserve is None:
        return woken
    if isinstance(woken, Refused) and woken.main_left_unsafe:
        served = _rouse(reserve, "in workers")
        if isinstance(served, Refused):  # the first's reason is kept: what the script can move
            return Refused(f"{woken.why}; its reserve could not serve: {served.why}", True)
        return Woken(served.server, woken)
    _retire(reserve, None)
    return woken


def _rouse(standby: _Standby, main: MainRun) -> Woken | Refused:
    """Wake ``standby`` (see :func:`wake`), the main module run again where ``main`` says."""
    global _missing
    preparation = spawn.get_preparation_data("aioloader-fs")
    preparation["authkey"] = bytes(preparation["authkey"])  # pickles only into a new process
    refused: Refused | None
    try:
        standby.line.send((preparation, main, environ_now(), server_preload()))
        refused = standby.line.recv()
    except (EOFError, OSError) as exc:
        refused = Refused(f"the standby server exited ({exc!r})")
    except BaseException:  # interrupted (Ctrl-C) while it ran the main module: it goes too
        _missing = "the standby was stopped: waking it was interrupted"
        standby.line.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(standby.server.pid, signal.SIGKILL)
        standby.server.retire()
        raise
    standby.line.close()
    if refused is None:
        return Woken(standby.server)
    standby.server.retire()
    return refused


def fresh() -> str:
    """Why the standby, not yet woken, is a fresh interpreter; "" where it was forked (or
    there is none)."""
    return "" if _standby is None else _standby.fresh


def retire(wait: float | None = None) -> None:
    """Let the standby (and the reserve) go (a server forked from this process now replaces
    it, or the process exits), and reap it: once it has exited, or if it does within ``wait``
    seconds. A fresh one, which has nothing of this process's, is killed (it may still be
    importing torch)."""
    global _standby, _reserve
    standby, reserve, _standby, _reserve = _standby, _reserve, None, None
    for each in (standby, reserve):
        if each is not None:
            _retire(each, wait)


def _retire(standby: _Standby, wait: float | None) -> None:
    with contextlib.suppress(OSError):
        standby.line.close()  # EOF on its line: it exits
    if standby.fresh:
        with contextlib.suppress(ProcessLookupError):
            os.kill(standby.server.pid, signal.SIGKILL)
    standby.server.retire(wait)
