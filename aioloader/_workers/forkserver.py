"""Forking a fork server from this process, when that is safe, for the stdlib to use.

Owns: the safety check (:func:`unsafe_to_fork`: one Python thread, no CUDA context, no named
native thread), forking a server that speaks the stdlib's fork-server protocol
(:func:`fork_server`) and handing it to ``multiprocessing.forkserver`` (:func:`install`), so
that ``multiprocessing.get_context("forkserver")`` uses it for every later worker. Never: forks
a process with other threads, or changes how an already running server works. When to fork,
and what to do when it is not safe, is ``serverstart.py``'s decision.

Why: the stdlib starts its fork server as a fresh interpreter, which imports torch again (a
second private copy of torch's pages in memory, and seconds of start-up where CUDA torch is
installed). Forked from this process, the server has torch already; workers forked from it
start in milliseconds and share this process's pages copy-on-write, as torch's fork workers do.
Forking is safe where fork as a start method is not: it happens only while this process has no
other thread and no CUDA context (so no lock is held by anyone else), and the server never
touches the event loop, an I/O client or CUDA.

The server inherits this process's memory and open regular files, as torch's fork workers do: a
file a module opened at import is readable in a worker (pipes and sockets it lets go of). It
keeps the memory it shares with this process for the life of the process: memory this process
frees after the server was forked stays mapped in the server.

The one seam into another package's private names, for the whole package: :func:`install` sets
three attributes of ``multiprocessing.forkserver._forkserver`` (3.11 to 3.13;
:func:`server_protocol_known` says whether this Python's server is that one), and
:func:`running_server_pid`, :func:`server_preload` and :func:`server_lock` read its pid and
its preload list and hold its lock.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import multiprocessing.forkserver as stdlib_forkserver
import os
import socket
import stat
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from multiprocessing import connection, util
from typing import Any

import torch

from .pidfd import exited_within
from .tracker import ensure_resource_tracker
from .worker import name_this_process

__all__ = [
    "FORK_SAFE_THREADS",
    "PRELOAD",
    "ForkedServer",
    "children_of",
    "may_have_exited",
    "ServerClient",
    "fork_server",
    "flush_stdio",
    "install",
    "let_go_of",
    "listening",
    "running_server_pid",
    "server_lock",
    "server_preload",
    "server_protocol_known",
    "start_stdlib_server",
    "uninstall",
    "unsafe_to_fork",
]

PRELOAD = ("aioloader._workers.worker",)  # imports torch and NumPy: what every worker needs
_SERVER_STATE = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_lock")


# Named native threads of libraries that hold every lock they share around a fork
# (pthread_atfork) and leave the child sound without them: jemalloc's background purge thread,
# started as pyarrow loads (pandas and Hugging Face datasets import it), whose allocator locks
# all its mutexes before a fork and resets its background threads in the child.
FORK_SAFE_THREADS = frozenset({"jemalloc_bg_thd"})


def unsafe_to_fork() -> str | None:
    """Why forking this process now could hang or corrupt the child, or None when it is safe.

    Safe: no other Python thread (ours, the application's, an executor's), no CUDA context, and
    no native thread that named itself (tokio's runtime behind obstore does) but those of
    :data:`FORK_SAFE_THREADS`. The native threads left are the unnamed pools of BLAS and
    OpenMP, which NumPy and torch start at import and which register their own fork handlers
    (torch's fork workers rely on the same)."""
    if sys.platform != "linux":
        return f"fork servers are forked on Linux only (this is {sys.platform})"
    if (threads := threading.active_count()) != 1:
        return f"this process had {threads} Python threads"
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return "CUDA was initialised in this process"
    try:
        with open("/proc/self/comm") as f:
            process_name = f.read().strip()
        names = set()
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/comm") as f:
                names.add(f.read().strip())
    except OSError:  # no /proc: we cannot tell, so we do not fork
        return "/proc could not be read to count this process's threads"
    if named := sorted(names - {process_name} - FORK_SAFE_THREADS):
        return f"this process had native threads ({', '.join(named)})"
    return None


def server_protocol_known() -> bool:
    """This Python's fork server is the one we know how to hand a forked server to (3.11 to 3.13:
    no authentication key; its ``main`` takes the listener and the alive pipe first)."""
    server = getattr(stdlib_forkserver, "_forkserver", None)
    if server is None or not all(hasattr(server, name) for name in _SERVER_STATE):
        return False
    if hasattr(server, "_forkserver_authkey"):
        return False
    params = list(inspect.signature(stdlib_forkserver.main).parameters)
    return params[:3] == ["listener_fd", "alive_r", "preload"]


@dataclass(frozen=True, slots=True)
class ForkedServer:
    """A forked fork server, as the stdlib's client finds it: where it listens, the write end of
    the pipe whose EOF stops it, and its pid."""

    address: str
    alive_w: int
    pid: int

    def retire(self, wait: float | None = None) -> bool:
        """Stop it (its alive pipe's EOF, or its wake line's) and reap it: once it has exited
        (``wait=None``), or if it exits within ``wait`` seconds. Whether it was reaped.

        Every process it forked holds the alive pipe's write end too (the stdlib's server
        hands it to each), so it sees EOF only once they have all exited."""
        with contextlib.suppress(OSError):
            os.close(self.alive_w)
        if wait is not None and not exited_within(self.pid, wait):
            return False
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        return True

    def let_go_in_child(self) -> None:
        """In a child forked from this process: point its copy of the alive pipe's write end
        at /dev/null (not closed: the stdlib's client, which may still send the number, finds
        a descriptor there), so that the child does not keep the server from its EOF."""
        let_go_of(self.alive_w)

    def forked_alive(self) -> bool:
        """Whether a process it forked (a worker, the application's own) is alive."""
        return _has_live_children(self.pid)


def let_go_of(fd: int) -> None:
    """Point ``fd`` (a pipe's write end this process inherited) at /dev/null, not closed: a
    Python object that still owns the number finds a descriptor there, and the pipe's reader
    no longer waits for this process to let go of it."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)


def flush_stdio() -> None:
    """Flush ``sys.stdout`` and ``sys.stderr`` before a fork: else each child writes what was
    in their buffers again."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def children_of(pid: int) -> Iterator[tuple[int, str]]:
    """``(pid, state)`` of each process whose parent is ``pid`` (state ``"Z"``: a zombie),
    from ``/proc``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            yield int(entry), fields[0]


def _has_live_children(pid: int) -> bool:
    """Whether a process whose parent is ``pid`` is alive (not a zombie)."""
    return any(state != "Z" for _, state in children_of(pid))


_STDOUT, _STDERR = 1, 2


def _serve_in_child(
    listener_fd: int, alive_r: int, alive_w: int, name: str, keep: tuple[int, ...],
    before_serving: Callable[[], None] | None,
) -> None:  # fmt: skip
    """In the forked child: let go of the application's pipes and sockets, then serve.

    Regular files stay open, as with torch's fork workers: a module that opened a file at import
    reads it in a worker. Pipes and sockets must not (``keep`` excepted): the server lives as
    long as this process, and a pipe's write end held here would keep its reader from ever
    seeing EOF (a subprocess's stdin, this server's own alive pipe). They are pointed at
    /dev/null rather than closed: Python objects inherited with the memory still think they own
    their descriptors, and one collected later would close whatever reused the number (a
    worker's pipe). But standard output and error: a worker prints and a dying worker's
    traceback goes there, as from torch's workers and the stdlib's server's (they went to
    /dev/null where this process's were pipes: a container's log, ``| tee``, a captured
    subprocess; found as the template's print was tested). The server exits as this process
    does, so their reader sees EOF then.
    """
    try:
        # Every object inherited from the application goes to the collector's permanent
        # generation: a collection here or in a worker forked from here would otherwise write
        # to each object's header and copy every page of the inherited heap.
        gc.freeze()
        os.close(alive_w)  # the parent's end: its close (or death) is our EOF
        name_this_process(name)
        server = getattr(stdlib_forkserver, "_forkserver", None)
        if server is not None:  # forked while held: a fresh one, as the stdlib's fork handlers do
            server._lock = threading.Lock()
        devnull = os.open(os.devnull, os.O_RDWR)
        for entry in os.listdir("/proc/self/fd"):
            fd = int(entry)
            if fd in (listener_fd, alive_r, devnull, *keep, _STDOUT, _STDERR):
                continue
            with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
                mode = os.fstat(fd).st_mode
                if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
                    os.dup2(devnull, fd)
        os.close(devnull)
        if before_serving is not None:
            before_serving()
        stdlib_forkserver.main(listener_fd, alive_r, [])
    finally:
        os._exit(0)


def fork_server(
    name: str = "aioloader-fs",
    keep: tuple[int, ...] = (),
    before_serving: Callable[[], None] | None = None,
) -> ForkedServer:
    """Fork this process into a fork server speaking the stdlib's protocol (the caller has
    checked :func:`unsafe_to_fork`). The child keeps ``keep`` (descriptors of its own) and runs
    ``before_serving`` before it serves; if that raises, it exits.

    Raises:
        OSError: The fork (or the listening socket) failed; nothing is left open.
    """
    address, listener = listening()
    with listener:
        alive_r, alive_w = os.pipe()
        flush_stdio()
        try:
            pid = os.fork()
        except BaseException:
            os.close(alive_r)
            os.close(alive_w)
            raise
        if pid == 0:  # pragma: no cover - the child never returns
            _serve_in_child(listener.fileno(), alive_r, alive_w, name, keep, before_serving)
        os.close(alive_r)
    return ForkedServer(address, alive_w, pid)


def listening() -> tuple[str, socket.socket]:
    """A socket listening where a fork server's clients connect (as the stdlib's server's)."""
    address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
    listener = socket.socket(socket.AF_UNIX)
    try:
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
    except BaseException:
        listener.close()
        raise
    return address, listener


class ServerClient(stdlib_forkserver.ForkServer):
    """The stdlib's fork-server client, pointed at a server of ours that runs already (a
    start's template, ``template.py``): where it listens, and the alive pipe's write end
    each process it forks is handed. Its ``connect_to_new_process`` asks that server."""

    def __init__(self, address: str, alive_w: int) -> None:
        super().__init__()
        self._forkserver_address = address
        self._forkserver_alive_fd = alive_w

    def ensure_running(self) -> None:  # it runs: it answered; the tracker may not yet
        ensure_resource_tracker()


def running_server_pid() -> int | None:
    """The pid of multiprocessing's fork server in this process, if one runs (one of ours, or
    the stdlib's fresh interpreter)."""
    server: Any = getattr(stdlib_forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    return pid if isinstance(pid, int) else None


def server_preload() -> list[str]:
    """The modules the stdlib's server will import as it starts (``set_forkserver_preload``'s
    list; ``["__main__"]`` by default)."""
    server: Any = getattr(stdlib_forkserver, "_forkserver", None)
    return list(getattr(server, "_preload_modules", ["__main__"]))


@contextlib.contextmanager
def server_lock() -> Iterator[int | None]:
    """Hold the stdlib's own lock, which it holds while it starts its server: nothing starts
    one meanwhile. Yields :func:`running_server_pid`."""
    server: Any = stdlib_forkserver._forkserver
    with server._lock:
        yield running_server_pid()


def start_stdlib_server(environ: Mapping[str, str] | None = None) -> None:
    """Start the stdlib's fork server (a fresh interpreter) now if none runs, without waiting
    for its imports: they run beside the application, and the first worker start waits only
    for what is left of them. ``environ``: variables the server starts with besides this
    process's environment (set in it while the server starts, then put back). Where it cannot
    be started (no room for a process), nothing happens here: the first worker start tries
    again and raises."""
    ensure_resource_tracker()  # first: it would keep ``environ`` for its life
    before = {name: os.environ.get(name) for name in environ or {}}
    os.environ.update(environ or {})
    try:
        with contextlib.suppress(OSError):
            stdlib_forkserver.ensure_running()
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def may_have_exited(pid: int) -> bool:
    """Whether this process's child ``pid`` may have exited: False only where it certainly
    runs. It is not reaped here, so the stdlib's own wait for its server still sees it.
    Without ``os.waitid`` (macOS before Python 3.13) it cannot be told: True."""
    if not hasattr(os, "waitid"):
        return True
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def install(forked: ForkedServer) -> None:
    """Make ``forked`` the stdlib's fork server, which every forkserver context then uses."""
    ensure_resource_tracker()  # its descriptor goes to the server with each request
    server: Any = stdlib_forkserver._forkserver
    server._forkserver_address = forked.address
    server._forkserver_alive_fd = forked.alive_w
    server._forkserver_pid = forked.pid


def uninstall(forked: ForkedServer, timeout: float = -1) -> bool:
    """Empty the stdlib's fork-server slot if ``forked`` holds it (a later forkserver context
    would start the stdlib's own), under the stdlib's lock (waited for at most ``timeout``
    seconds; no limit when negative); whether it did."""
    server: Any = stdlib_forkserver._forkserver
    if not server._lock.acquire(timeout=timeout):
        return False
    try:
        if running_server_pid() != forked.pid:
            return False
        server._forkserver_address = None
        server._forkserver_alive_fd = None
        server._forkserver_pid = None
        return True
    finally:
        server._lock.release()
