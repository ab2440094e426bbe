"""A configuration in a fresh child, measured from this process (:func:`run_in_child`), and the
fork server its children are forked from (:func:`preloaded_forkserver`).

Owns: a child's life (its set-up, ready, go, its work, the processes it left), its tree's memory
and CPU sampled from here (a :class:`~aioloader._bench.harness_processes.MemorySampler` rooted
at it, with the share of the server's pages it holds), the timeout that dumps its stacks and
kills its tree, and what it returns (:class:`ChildRun`). Never: knows a workload (``prepare``
and ``job`` are the workload's); imports torch or aioloader itself.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import gc
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.forkserver
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from aioloader._bench.harness_processes import (
    EXIT_WAIT_S,
    MemorySampler,
    kill_tree,
    process_tree,
    pss_kib,
    wait_for_children,
)
from aioloader._workers.forkserver import running_server_pid

J = TypeVar("J")

CHILD_START_S = 120.0  # a run_in_child child's start and set-up, up to its "ready"
CHILD_EXIT_S = EXIT_WAIT_S + 10.0  # its wait for its processes, then its own exit
STACK_DUMP_S = 1.0  # a timed-out child's time to write its stacks before it is killed


class _ChildTimeout(Exception):
    """A child sent nothing within its time."""


class _ChildGone(Exception):
    """A child closed its pipe before it sent what was due (it died)."""


@dataclass
class ChildRun:
    """What :func:`run_in_child` saw. ``payload``: what the child's work returned (None when
    none came); ``error``: the first of a timeout or the child's death, the payload's own
    ``"error"``, processes it left, a non-zero exit code; ``memory``: its tree's, from go to its
    last message (``start_pss_mib``: after its set-up, before its clock starts)."""

    payload: dict[str, Any] | None
    error: str | None
    timed_out: bool
    memory: MemorySampler


def _nothing() -> None:
    """A child that only starts: the fork server, once it has imported its modules."""


def _child_main(
    prepare: Callable[[J], Callable[[], dict[str, Any]]],
    job: J,
    conn: multiprocessing.connection.Connection,
) -> None:
    """A child's whole life: ``prepare(job)`` (the same set-up for every row, returning the
    work), ``ready``, wait for go, run the work, send what it returned, wait for the processes
    it started to exit (killing those left; a fork server lives as long as this process) and
    send how many were left."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent's ask on a timeout
    # The context that started this process made its start method this process's default; a
    # user's script has the platform's (fork on Linux up to Python 3.13), which a peer's workers
    # use (torch's DataLoader, without multiprocessing_context).
    multiprocessing.set_start_method(None, force=True)
    work = prepare(job)
    gc.collect()
    conn.send(("ready", None))
    conn.recv()  # go: the parent has read the base PSS and samples this tree from now on
    conn.send(("ended", work()))
    keep = {os.getpid()}
    if (server := running_server_pid()) is not None:
        keep.add(server)
    left = wait_for_children(keep)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    conn.send(("done", len(left)))
    conn.close()


def _receive(conn: multiprocessing.connection.Connection, seconds: float, kind: str) -> Any:
    """The payload of the child's next message, which must be ``kind``."""
    if not conn.poll(seconds):
        raise _ChildTimeout(f"no {kind!r} within {seconds:g} s")
    try:
        got, payload = conn.recv()
    except EOFError:
        raise _ChildGone(f"the child exited before {kind!r}") from None
    if got != kind:
        raise RuntimeError(f"the child sent {got!r}, expected {kind!r}")
    return payload


def run_in_child(
    prepare: Callable[[J], Callable[[], dict[str, Any]]],
    job: J,
    timeout: float,
    name: str,
    *,
    context: multiprocessing.context.ForkServerContext | None = None,
) -> ChildRun:
    """Run a configuration in a fresh child, a fork of a server that has imported ``prepare``'s
    module and done nothing else (:func:`preloaded_forkserver`), so that no row inherits the heap
    an earlier one grew: the child runs ``prepare(job)`` (a module-level
    function: the child imports it by name) and says it is ready; this process reads its PSS,
    starts sampling its tree's memory and says go; the child runs the work ``prepare`` returned
    and sends back its result, a plain ``dict`` (the script's own classes live in the child's
    ``__mp_main__``, which this process cannot unpickle). Past ``timeout`` from go, this process
    has the child dump its threads' stacks (``faulthandler`` on SIGUSR1) and kills its tree.

    The fork server starts children in milliseconds, not the seconds a spawned interpreter takes
    to import torch. A child's PSS counts the share of the server's pages it holds (see
    :class:`MemorySampler`'s ``lent``), so a row's PSS is what a process of its own would hold.
    ``context``: another fork server context of this process's."""
    start = context or preloaded_forkserver([getattr(prepare, "__module__", "__main__")])
    if running_server_pid() is None:
        # Start the server, and let it import its modules, before the first row: its PSS is
        # read while it has no child.
        first = start.Process(target=_nothing, name="bench-fork-server-start")
        first.start()
        first.join()
    server = running_server_pid()
    if server is None:
        raise RuntimeError("the fork server did not start: no process to fork the row from")
    idle_kib = pss_kib(server)
    conn, child_conn = start.Pipe()
    # Not a daemon: daemonic processes may not start any (a loader's workers); this process kills
    # the child's tree in any case.
    process = start.Process(target=_child_main, args=(prepare, job, child_conn), name=name)
    process.start()
    child_conn.close()
    if process.pid is None:
        raise RuntimeError(f"{name}: the row's process did not start")
    memory = MemorySampler(functools.partial(process_tree, process.pid), lent=(server, idle_kib))
    payload: dict[str, Any] | None = None
    error: str | None = None
    timed_out = done = False
    try:
        _receive(conn, CHILD_START_S, "ready")
        with memory:
            conn.send(("go", None))
            try:
                payload = _receive(conn, timeout, "ended")
            except _ChildTimeout:
                raise _ChildTimeout(f"past {timeout:g} s; its process tree was killed") from None
            left = _receive(conn, CHILD_EXIT_S, "done")
        done = True
        error = payload.get("error") if payload is not None else None
        if left and error is None:
            error = f"{left} processes still alive {EXIT_WAIT_S:g} s after the end"
    except _ChildTimeout as exc:
        timed_out, error = True, str(exc)
        with contextlib.suppress(OSError):
            os.kill(process.pid, signal.SIGUSR1)  # its stacks, on the inherited stderr
        time.sleep(STACK_DUMP_S)
    except _ChildGone as exc:
        error = f"{exc} (exit code {process.exitcode})"
    finally:
        process.join(CHILD_EXIT_S if done else 0)
        if process.is_alive():
            kill_tree(process.pid)
        process.join()
        conn.close()
    if error is None and process.exitcode != 0:
        error = f"the child exited with code {process.exitcode}"
    return ChildRun(payload, error, timed_out, memory)


def preloaded_forkserver(modules: Sequence[str]) -> multiprocessing.context.ForkServerContext:
    """multiprocessing's ``forkserver`` context with ``modules`` imported in its server (started
    on its first use), for :func:`run_in_child`: every child is a fork of a process that has
    imported them and done nothing else, so no row inherits the heap an earlier one grew."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*modules, "aioloader._bench.frozen"])  # frozen: last
    return context
