"""Fresh interpreters started as fork servers where forking this process is not safe, each a
process group of its own.

Owns: :func:`spawn_server` (a fork and an exec, as the stdlib starts its own server, of an
interpreter that runs a given entry with a listening socket and an alive pipe, and then serves
the stdlib's fork-server protocol: ``standby.serve_fresh``). Never: decides when one is started
(``standby.py``), or forks this process (``forkserver.py``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from multiprocessing import spawn, util

from .forkserver import ForkedServer, listening

__all__ = ["spawn_server"]


def spawn_server(
    entry: str, keep: tuple[int, ...] = (), extra: tuple[int, ...] = ()
) -> ForkedServer:
    """Start a fresh interpreter that becomes a fork server speaking the stdlib's protocol,
    where forking this process is not safe (a fork and an exec, as the stdlib starts its own):
    it runs ``entry(listener_fd, alive_r, *keep, *extra)`` (a function named
    ``"module:function"``), with this process's ``sys.path`` (its text entries) and
    interpreter flags, ``AIOLOADER_STANDBY=0`` in its environment (it makes no standby of its
    own as it imports aioloader), and only those descriptors and its standard streams.

    It is a process group of its own: a Jupyter kernel signals the processes of its group as
    it shuts down (SIGTERM, then waits for them to be gone: a child killed and not reaped held
    its shutdown 2.5 s, until it was killed, its exit hooks unrun; found by review), and sends
    its interrupt (SIGINT) to the whole group. Until it has left this one (its first
    statement, after the interpreter's start), both are blocked in it (blocked in this thread
    as it is spawned, so from its first instruction) and then dropped; SIGINT stays ignored
    (the entry decides how it takes it later). A background group at a terminal, it ignores
    SIGTTOU, so that a warning it prints under ``stty tostop`` does not stop it. (The
    processes it forks go back to this process's group: ``standby.serve_fresh``.)

    Raises:
        OSError: The listening socket, the pipe or the process could not be made. Nothing is
            left open or running, whatever is raised (a Ctrl-C this thread held while it was
            spawned too: the child is killed and reaped). A Ctrl-C another thread takes
            meanwhile is raised once the spawn has ended, its child killed and reaped
            (:func:`_spawned`; a search by the child's command line, which stood in for a lost
            pid, read that line empty as the child exec'd on a busy machine).
    """
    module, _, function = entry.partition(":")
    path = [os.fsdecode(p) for p in sys.path if isinstance(p, str | bytes | os.PathLike)]
    address, listener = listening()
    code = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); os.setpgid(0, 0); "
        "signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT, signal.SIGTERM]); "
        "signal.signal(signal.SIGTERM, signal.SIG_DFL); "
        "signal.signal(signal.SIGTTOU, signal.SIG_IGN); "
        f"sys.path[:] = {path!r}; os.environ['AIOLOADER_STANDBY'] = '0'; "
        f"from {module} import {function}; {function}(*map(int, sys.argv[1:]))"
    )
    with listener:
        alive_r, alive_w = os.pipe()
        pid: int | None = None
        held = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT, signal.SIGTERM])
        try:
            try:
                fds = (listener.fileno(), alive_r, *keep)
                executable = spawn.get_executable()
                args = [
                    executable, *util._args_from_interpreter_flags(),  # type: ignore[attr-defined]
                    "-c", code, *map(str, (*fds, *extra)),
                ]  # fmt: skip
                pid = _spawned(executable, args, fds)
            finally:
                os.close(alive_r)
                signal.pthread_sigmask(signal.SIG_SETMASK, held)  # a Ctrl-C held raises here
        except BaseException:
            os.close(alive_w)
            if pid is not None:
                _kill_and_reap(pid)
            raise
    return ForkedServer(address, alive_w, pid)


def _spawned(executable: str, args: list[str], fds: tuple[int, ...]) -> int:
    """``util.spawnv_passfds``, from a thread of its own where this is the main thread: the
    child's pid, which a signal handler raising here cannot lose. Handlers run on the main
    thread only, at its next instruction, wherever that is: between the child's start and the
    return of its pid, the child was lost (found by review: a zombie for the rest of the
    session). The thread inherits this thread's signal mask, and the child the thread's.

    Raises:
        BaseException: What the spawn raised; or what interrupted the wait (a Ctrl-C), once
            the spawn has ended and its child, if any, is killed and reaped.
    """
    if threading.current_thread() is not threading.main_thread():
        return util.spawnv_passfds(executable, args, fds)  # type: ignore[arg-type]
    ended: list[int | BaseException] = []

    def spawn() -> None:
        try:
            ended.append(util.spawnv_passfds(executable, args, fds))  # type: ignore[arg-type]
        except BaseException as exc:
            ended.append(exc)

    thread = threading.Thread(target=spawn, name="aioloader-spawn", daemon=True)
    try:  # everything up to the pid's return: a handler may raise at any call in it
        thread.start()
        thread.join()
        if isinstance(ended[0], BaseException):
            raise ended[0]
        return ended[0]
    except BaseException:
        # (interrupted before the thread started, it has nothing to wait for)
        with contextlib.suppress(RuntimeError):
            thread.join()  # the spawn is a fork and an exec: milliseconds
        if ended and isinstance(ended[0], int):
            _kill_and_reap(ended[0])
        raise


def _kill_and_reap(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
