"""A benchmark's server in a subprocess of its own (:class:`ServerProcess`), and how the server's
side waits to be stopped (:func:`wait_for_stop`).

Owns: spawning the server, its port or the traceback of its failure, stopping it when the
``with`` block ends or this process dies. Never: knows what it serves (the workload passes its
``target``); imports torch or aioloader itself.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import traceback
from collections.abc import Callable

SERVER_START_S = 120.0  # a ServerProcess's start, imports and set-up, up to its port


def wait_for_stop(conn: multiprocessing.connection.Connection) -> None:
    """Return when anything arrives on ``conn`` or it closes (the parent stopped or died)."""
    with contextlib.suppress(EOFError, OSError):
        conn.recv()


def _serve(
    target: Callable[..., None],
    args: tuple[object, ...],
    conn: multiprocessing.connection.Connection,
) -> None:
    """A :class:`ServerProcess`'s child: the server, or the traceback of its failure."""
    try:
        target(*args, conn)
    except Exception:
        with contextlib.suppress(OSError):
            conn.send(traceback.format_exc())


class ServerProcess:
    """``target(*args, conn)`` in a subprocess: it sends its port through ``conn``, then serves
    until :func:`wait_for_stop` returns; a traceback comes back instead when it raises. A
    context manager that stops it on exit; it also stops when this process dies (its end of the
    pipe closes).

    The subprocess is spawned, not forked from :func:`run_in_child`'s fork server: a fork would
    share the server's pages, and a row's child would then hold a smaller share of them than a
    process of its own would (:class:`MemorySampler`'s ``lent`` assumes the child is the
    server's only one)."""

    def __init__(
        self,
        name: str,
        target: Callable[..., None],
        *args: object,
        start_timeout: float = SERVER_START_S,
    ) -> None:
        self.name = name
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(
            target=_serve, args=(target, args, child), name=name, daemon=True
        )
        self.process.start()
        child.close()
        try:
            if not self._conn.poll(start_timeout):
                raise RuntimeError(f"{name} did not start within {start_timeout:g} s")
            message = self._conn.recv()
        except BaseException:
            self.kill()
            raise
        if not isinstance(message, int):
            self.kill()
            raise RuntimeError(f"{name} failed to start:\n{message}")
        self.port = message

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            self._conn.send(None)
        self._conn.close()
        self.process.join(10)
        if self.process.is_alive():
            self.kill()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
