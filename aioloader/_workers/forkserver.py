"""Starting multiprocessing's fork server as a fork of this process, when that is safe.

Owns: the decision to fork the server (this process has one thread, no CUDA context, and the
server is not running yet) and handing the running server to ``multiprocessing.forkserver``, so
that ``multiprocessing.get_context("forkserver")`` uses it for every later worker. Never: forks
a process with other threads, or changes how an already running server works.

Why: the stdlib starts its fork server as a fresh interpreter, which imports torch again (about
1.3 s here, and a second private copy of torch's pages in memory). Forked from this process, the
server has torch already; workers forked from it start in milliseconds and share this process's
pages copy-on-write, as torch's fork workers do. Forking is safe here for the reason fork is
refused elsewhere: it happens only before this process has another Python thread, a tokio
runtime or a CUDA context (so no lock is held by anyone else), and the server never touches the
event loop, an I/O client or CUDA. Anything we cannot check (another Python's
server protocol, more threads, CUDA initialised) falls back to the stdlib's own start, with
torch and the worker module preloaded in it.

The server inherits this process's memory and open regular files, as torch's fork workers do: a
file a module opened at import is readable in a worker (pipes and sockets it lets go of). It
keeps the memory it shares with this process for the life of the process: memory this process
frees after the server was forked (when the first loader with process workers was built) stays
mapped in the server.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import multiprocessing.context
import multiprocessing.forkserver as stdlib_forkserver
import os
import socket
import stat
import sys
import threading
from multiprocessing import connection, resource_tracker, util
from typing import Any

import torch

from .worker import name_this_process

__all__ = ["prepare_forkserver"]

_PRELOAD = ("aioloader._workers.worker",)  # imports torch and NumPy: what every worker needs
_SERVER_STATE = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_lock")


def _safe_to_fork() -> bool:
    """No other Python thread (ours, the application's, an executor's), no CUDA context, and no
    native thread that named itself (tokio's runtime behind obstore does): the native threads
    left are the unnamed pools of BLAS and OpenMP, which NumPy and torch start at import and
    which register their own fork handlers (torch's fork workers rely on the same)."""
    if sys.platform != "linux" or threading.active_count() != 1:
        return False
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return False
    try:
        with open("/proc/self/comm") as f:
            process_name = f.read().strip()
        names = set()
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/comm") as f:
                names.add(f.read().strip())
    except OSError:  # no /proc: we cannot tell, so we do not fork
        return False
    return names <= {process_name}


def _server_protocol_known(server: object) -> bool:
    """This Python's fork server is the one we know how to hand a forked server to (3.11 to 3.13:
    no authentication key; its ``main`` takes the listener and the alive pipe first)."""
    if not all(hasattr(server, name) for name in _SERVER_STATE):
        return False
    if hasattr(server, "_forkserver_authkey"):
        return False
    params = list(inspect.signature(stdlib_forkserver.main).parameters)
    return params[:3] == ["listener_fd", "alive_r", "preload"]


def _serve_in_child(listener_fd: int, alive_r: int, alive_w: int) -> None:
    """In the forked child: let go of the application's pipes and sockets, then serve.

    Regular files stay open, as with torch's fork workers: a module that opened a file at import
    reads it in a worker. Pipes and sockets must not: the server lives as long as this process,
    and a pipe's write end held here would keep its reader from ever seeing EOF (a subprocess's
    stdin, this server's own alive pipe). They are pointed at /dev/null rather than closed:
    Python objects inherited with the memory still think they own their descriptors, and one
    collected later would close whatever reused the number (a worker's pipe).
    """
    try:
        # Every object inherited from the application goes to the collector's permanent
        # generation: a collection here or in a worker forked from here would otherwise write
        # to each object's header and copy every page of the inherited heap.
        gc.freeze()
        os.close(alive_w)  # the parent's end: its close (or death) is our EOF
        name_this_process("aioloader-fs")
        server = getattr(stdlib_forkserver, "_forkserver", None)
        if server is not None:  # forked while held: a fresh one, as the stdlib's fork handlers do
            server._lock = threading.Lock()
        devnull = os.open(os.devnull, os.O_RDWR)
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd in (listener_fd, alive_r, devnull):
                continue
            with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
                mode = os.fstat(fd).st_mode
                if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
                    os.dup2(devnull, fd)
        os.close(devnull)
        stdlib_forkserver.main(listener_fd, alive_r, [])
    finally:
        os._exit(0)


def _running(server: Any) -> bool:
    return server._forkserver_pid is not None


def _fork_server() -> bool:
    """Fork the server now, if it is safe and not running; True when this process has one."""
    server = getattr(stdlib_forkserver, "_forkserver", None)
    if server is None or not _server_protocol_known(server):
        return False
    if _running(server):
        return True  # the usual case, checked before reading /proc for every worker
    if not _safe_to_fork():
        return False
    with server._lock:
        if _running(server):  # another thread started it meanwhile (by us, or the stdlib)
            return True
        resource_tracker.ensure_running()  # before the fork: the server's children share it
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            for stream in (sys.stdout, sys.stderr):  # else the children print it again
                with contextlib.suppress(Exception):
                    stream.flush()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child never returns
                _serve_in_child(listener.fileno(), alive_r, alive_w)
            os.close(alive_r)
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
    return True


def prepare_forkserver(context: str | multiprocessing.context.BaseContext) -> None:
    """Before starting workers with ``context`` (no-op unless it is forkserver): fork the server
    from this process when that is safe, else ask the stdlib's server (if it has not started
    yet) to preload torch and the worker module besides what the application asked for.

    Called where the process may still have one thread (a plain ``for`` calls it before starting
    its event loop's thread) and again as the workers start."""
    ctx = multiprocessing.get_context(context) if isinstance(context, str) else context
    if ctx.get_start_method() != "forkserver" or _fork_server():
        return
    server = getattr(stdlib_forkserver, "_forkserver", None)
    current = list(getattr(server, "_preload_modules", ["__main__"]))
    wanted = current + [m for m in _PRELOAD if m not in current]
    if wanted != current:
        ctx.set_forkserver_preload(wanted)
