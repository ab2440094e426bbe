"""The machinery the benchmark scripts share: how a configuration is run, timed and measured, and
how its row is printed beside its peers'.

Owns: the result row (:class:`Result`: samples over wall time, memory peaks, failed or skipped);
timing one configuration under a watchdog (:func:`timed`, :func:`watchdog`); the memory of a
process tree or process group sampled from outside (:class:`MemorySampler`, :func:`process_tree`,
:func:`process_group`); waiting for and killing the processes a configuration left
(:func:`wait_for_children`, :func:`kill_tree`, :func:`kill_group`); a configuration in a fresh
child measured from this process (:func:`run_in_child`, :func:`preloaded_forkserver`); the rows
handed to ``aioloader bench`` (:func:`report`); a server in a subprocess
(:class:`ServerProcess`); the exactly-once check of an epoch (:func:`delivery_error`); the table
with ratios against peers measured in the same run (:func:`format_table`, :func:`ratio_to`); the
header line (:func:`versions`, :func:`cpus_and_load`); the common flags (:func:`add_quick`,
:func:`add_only`, :func:`add_timeout`, :func:`add_batch_size`, :func:`quick_defaults`); and the
exit status (:func:`exit_status`). Never: knows a workload, a loader or a peer (a script passes
in what to run, check and print); imports torch or aioloader itself (``bench_startup.py``
measures fresh interpreters and keeps its own process light); prints (a script prints what this
formats), :func:`exit_status`'s ``FAILED:`` line aside.

The workloads (``aioloader/_bench/*.py``) import it as ``aioloader._bench.harness``, which imports
aioloader's facade and so torch; ``benchmarks/bench_startup.py``, which must stay light, loads
this file by its path. Linux only: memory and CPU come from ``/proc``.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import functools
import gc
import importlib.metadata
import json
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.forkserver
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any, Generic, Literal, Protocol, TypeVar


class Named(Protocol):
    """A table's row: its first column is ``name``."""

    @property
    def name(self) -> str: ...


T = TypeVar("T")
J = TypeVar("J")
Row = TypeVar("Row", bound=Named)
R = TypeVar("R", bound="Result")

POLL_S = 0.05  # MemorySampler's default: RSS every 50 ms
PSS_EVERY = 4  # ... and PSS (smaps_rollup, ~1 ms a process) every 4th poll: every 0.2 s
EXIT_WAIT_S = 15.0  # how long a configuration's processes may take to exit once it is over
SERVER_START_S = 120.0  # a ServerProcess's start, imports and set-up, up to its port
CHILD_START_S = 120.0  # a run_in_child child's start and set-up, up to its "ready"
CHILD_EXIT_S = EXIT_WAIT_S + 10.0  # its wait for its processes, then its own exit
STACK_DUMP_S = 1.0  # a timed-out child's time to write its stacks before it is killed


# -- the result row -------------------------------------------------------------------------------


@dataclass
class Result:
    """One configuration's row: ``samples`` delivered in ``wall_s`` seconds; the memory peaks of
    its processes (MiB, see :meth:`record_memory`); ``error``: why it failed; ``skipped``: why it
    was not measured (a peer that is not installed: reported, not failed)."""

    name: str
    samples: int = 0
    wall_s: float = 0.0
    _: KW_ONLY
    error: str | None = None
    skipped: str | None = None
    start_rss_mib: float = 0.0
    peak_rss_mib: float = 0.0
    start_pss_mib: float = 0.0
    peak_pss_mib: float = 0.0
    cpu_s: float | None = None  # CPU time of the measured processes, when they were sampled

    @property
    def ok(self) -> bool:
        """Not failed (a skipped row is not a failure)."""
        return self.error is None

    @property
    def measured(self) -> bool:
        """Ran and passed its checks: a row whose figures a ratio may use."""
        return self.ok and self.skipped is None

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def rate(self) -> float:
        """The samples/s that ``aioloader bench`` reports for the row (a workload whose rows
        time more than one figure says which)."""
        return self.samples_per_s

    @property
    def status(self) -> str:
        """The check column: ``ok``, ``FAIL: why`` or ``skipped: why``."""
        if self.skipped is not None:
            return f"skipped: {self.skipped}"
        return "ok" if self.error is None else f"FAIL: {self.error}"

    def record_memory(self, sampler: MemorySampler) -> None:
        """Take the sums on entry and the peaks of a finished :class:`MemorySampler`."""
        self.start_rss_mib, self.peak_rss_mib = sampler.start_mib, sampler.peak_mib
        self.start_pss_mib, self.peak_pss_mib = sampler.start_pss_mib, sampler.peak_pss_mib
        self.cpu_s = sampler.cpu_s


def error_text(exc: BaseException) -> str:
    """How a row reports an exception: ``Type: message``."""
    return f"{type(exc).__qualname__}: {exc}"


def describe(value: Any) -> str:
    """A batch (or part of one) in a few words, for an error message."""
    if _is_tensor(value):
        return f"tensor {tuple(value.shape)} {value.dtype}"
    if isinstance(value, list | tuple):
        return f"{type(value).__name__} of [{', '.join(describe(v) for v in value[:4])}]"
    return type(value).__name__


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")  # a script that has a tensor has imported torch
    return torch is not None and isinstance(value, torch.Tensor)


def delivery_error(
    indices: Sequence[int], items: int, batches: int, expected_batches: int
) -> str | None:
    """What is wrong with an epoch that delivered ``indices`` in ``batches`` batches, or None
    when each of ``range(items)`` came exactly once in ``expected_batches`` batches."""
    if sorted(indices) != list(range(items)):
        seen = set(indices)
        missing = items - len(seen & set(range(items)))
        duplicates = len(indices) - len(seen)
        return (
            f"got {len(indices)} samples for {items} items: "
            f"{missing} missing, {duplicates} duplicated"
        )
    if batches != expected_batches:
        return f"got {batches} batches, expected {expected_batches}"
    return None


# -- timing ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def watchdog(seconds: float) -> Iterator[None]:
    """Dump every thread's stack and exit the process if the block is still running after
    ``seconds`` (a hung configuration must not hang the whole run silently)."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@dataclass
class Timed(Generic[T]):
    """What :func:`timed` saw: ``value`` (None when it raised), ``wall_s``, ``error``."""

    value: T | None
    wall_s: float
    error: str | None


def timed(run: Callable[[], T], watchdog_s: float) -> Timed[T]:
    """Call ``run`` once, timed by ``time.perf_counter``, under a :func:`watchdog` of
    ``watchdog_s``; an exception it raises is reported (as :func:`error_text`), not raised, so
    that the other configurations still run."""
    with watchdog(watchdog_s):
        start = time.perf_counter()
        try:
            value = run()
        except Exception as exc:
            return Timed(None, time.perf_counter() - start, error_text(exc))
    return Timed(value, time.perf_counter() - start, None)


# -- the rows a workload reports to ``aioloader bench`` --------------------------------------------

ROWS_ENV = "AIOLOADER_BENCH_ROWS"  # the file ``aioloader bench`` reads the rows from


def report(table: str, result: Result, **extra: Any) -> None:
    """Hand a finished row of ``table`` to ``aioloader bench``, which runs each workload in a
    process of its own and names the file in ``$AIOLOADER_BENCH_ROWS``: one JSON line a row.
    Without the variable (a script run by hand), nothing. ``extra``: figures the command's chart
    uses (``in_flight``: the requests the row keeps in flight)."""
    path = os.environ.get(ROWS_ENV)
    if not path:
        return
    row: dict[str, Any] = {
        "table": table,
        "config": result.name,
        "samples_per_s": result.rate if result.measured else None,
        "cpu_s": result.cpu_s if result.measured else None,
        "peak_pss_mib": result.peak_pss_mib if result.measured and result.peak_pss_mib else None,
        "status": result.status,
        "ok": result.ok,
        "skipped": result.skipped,
        **extra,
    }
    for key, value in row.items():  # JSON has no NaN or infinity: a figure not measured
        if isinstance(value, float) and not math.isfinite(value):
            row[key] = None
    with open(path, "a", encoding="utf-8") as rows:
        rows.write(json.dumps(row, allow_nan=False) + "\n")


# -- processes: trees, groups, RSS and PSS --------------------------------------------------------


@functools.cache
def _children_files_work() -> bool:
    """Whether ``/proc/<pid>/task/<tid>/children`` exists (CONFIG_PROC_CHILDREN)."""
    pid = os.getpid()
    return Path(f"/proc/{pid}/task/{pid}/children").exists()


def process_tree(root: int, exclude: int | None = None) -> list[int]:
    """``root`` and every process below it, leaving out ``exclude`` and everything below it."""
    if _children_files_work():
        found, todo = [root], [root]
        while todo:
            pid = todo.pop()
            with contextlib.suppress(OSError):
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with contextlib.suppress(OSError):
                        text = Path(f"/proc/{pid}/task/{tid}/children").read_text()
                        for child in map(int, text.split()):
                            if child != exclude:
                                found.append(child)
                                todo.append(child)
        return found
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            # "pid (comm) state ppid ...": comm may hold spaces or parentheses.
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            parents.setdefault(ppid, []).append(int(entry))
    found, todo = [root], [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child != exclude:
                found.append(child)
                todo.append(child)
    return found


def process_group(pgid: int) -> list[int]:
    """Live (not zombie) processes whose process group is ``pgid``."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] != "Z" and int(fields[2]) == pgid:
                members.append(int(entry))
    return members


def rss_kib(pid: int) -> int:
    """Resident set size (``VmRSS``); 0 for a process that is gone or a zombie."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


CLOCK_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid: int) -> tuple[int, int] | None:
    """``(start, ticks)``: when ``pid`` started (clock ticks after boot: with the pid, a
    process's identity, as pids are reused) and the user plus system clock ticks it has used
    (its threads', not its children's); None for a process that is gone."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()  # from field 3, "state"
        # utime and stime are fields 14 and 15, starttime field 22.
        return int(fields[19]), int(fields[11]) + int(fields[12])
    return None


def pss_kib(pid: int) -> int:
    """Proportional set size: each resident page divided by the number of processes mapping it
    (what ``psutil.Process(pid).memory_full_info().pss`` reports, read from the same file)."""
    for name in ("smaps_rollup", "smaps"):  # smaps_rollup: Linux 4.14+
        with contextlib.suppress(OSError, ValueError):
            text = Path(f"/proc/{pid}/{name}").read_text()
            return sum(int(line.split()[1]) for line in text.splitlines() if line[:4] == "Pss:")
    return 0  # gone


class MemorySampler:
    """While the ``with`` block runs, a background thread polls the summed RSS of
    ``processes()`` (default: this process's tree) every ``poll_s`` seconds and their summed PSS
    every ``pss_every`` polls (0: never); ``peak_mib`` / ``peak_pss_mib`` are the highest sums
    seen (on entry and on exit included), ``start_mib`` / ``start_pss_mib`` the sums on entry.
    Shared pages count once per process in RSS, divided among them in PSS.

    ``lent``: ``(pid, idle_kib)`` of a fork server the processes were forked from, and its PSS
    when it had no child: each PSS sum adds what the server's PSS has fallen by since, the share
    of its pages its children now hold. So a child's sum is what a process of its own would
    hold: the pages it still shares with the server count whole, and those it has written to (a
    garbage collection, reference counts) count once, in the child, not also in the server. It
    holds while the child is the server's only child.

    ``cpu_s``: the CPU time the processes used while the block ran, summed from each one's ticks
    as last seen (a process seen on entry counts from then): a lower bound. A process that exits
    between two polls loses what it used since the last one (at most ``poll_s`` for each of its
    threads); one that lives less than a poll is not seen.

    The thread is this process's: sampling another process's tree from here (``run_in_child``)
    keeps the measured process free of it. Sampling this process's own tree, its CPU and its
    hold on the GIL count in what it measures."""

    def __init__(
        self,
        processes: Callable[[], Iterable[int]] | None = None,
        *,
        poll_s: float = POLL_S,
        pss_every: int = PSS_EVERY,
        lent: tuple[int, int] | None = None,
    ) -> None:
        self.processes = processes or functools.partial(process_tree, os.getpid())
        self.lent = lent
        self.poll_s = poll_s
        self.pss_every = pss_every
        self.peak_kib = self.start_kib = 0
        self.peak_pss_kib = self.start_pss_kib = 0
        self._first_ticks: dict[tuple[int, int], int] = {}  # by (pid, start)
        self._last_ticks: dict[tuple[int, int], int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def _sample(self, pss: bool, first: bool = False) -> tuple[int, int]:
        pids = list(self.processes())
        for pid in pids:
            if (seen := cpu_ticks(pid)) is not None:
                start, ticks = seen
                self._last_ticks[pid, start] = ticks
                if first:
                    self._first_ticks[pid, start] = ticks
        rss = sum(rss_kib(pid) for pid in pids)
        self.peak_kib = max(self.peak_kib, rss)
        total_pss = 0
        if pss and self.pss_every:
            total_pss = sum(pss_kib(pid) for pid in pids)
            if self.lent is not None:
                server, idle_kib = self.lent
                total_pss += max(0, idle_kib - pss_kib(server))
        self.peak_pss_kib = max(self.peak_pss_kib, total_pss)
        return rss, total_pss

    def _run(self) -> None:
        polls = 0
        while not self._stop.wait(self.poll_s):
            polls += 1
            self._sample(pss=bool(self.pss_every) and polls % self.pss_every == 0)

    def __enter__(self) -> MemorySampler:
        self.start_kib, self.start_pss_kib = self._sample(pss=True, first=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample(pss=True)

    @property
    def peak_mib(self) -> float:
        return self.peak_kib / 1024

    @property
    def cpu_s(self) -> float:
        ticks = sum(t - self._first_ticks.get(key, 0) for key, t in self._last_ticks.items())
        return ticks * CLOCK_TICK_S

    @property
    def start_mib(self) -> float:
        return self.start_kib / 1024

    @property
    def peak_pss_mib(self) -> float:
        return self.peak_pss_kib / 1024

    @property
    def start_pss_mib(self) -> float:
        return self.start_pss_kib / 1024


def wait_until_gone(processes: Callable[[], Collection[int]], seconds: float) -> Collection[int]:
    """Poll ``processes()`` (collecting garbage first: a dropped loader's finalizer stops its
    workers) until it is empty or ``seconds`` have passed; return what it last listed."""
    deadline = time.monotonic() + seconds
    while True:
        gc.collect()
        left = processes()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def wait_for_children(before: Collection[int], seconds: float = EXIT_WAIT_S) -> set[int]:
    """Wait (up to ``seconds``) for the processes below this one that are not in ``before`` to
    exit; return those still there (zombies count as gone)."""

    def started() -> set[int]:
        tree = process_tree(os.getpid())
        return {pid for pid in tree if pid not in before and rss_kib(pid) > 0}

    return set(wait_until_gone(started, seconds))


def kill_tree(root: int) -> None:
    """SIGSTOP ``root`` and everything below it until no new process turns up (a stopped
    process starts none), then SIGKILL them all."""
    stopped: set[int] = set()
    while fresh := set(process_tree(root)) - stopped:
        for pid in fresh:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGSTOP)
        stopped |= fresh
    for pid in stopped:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of every CPU since boot (busy: all but idle and iowait; steal
    included). Over an interval, busy minus this benchmark's own CPU is what other processes
    used: on a shared machine, the rows measured meanwhile are slowed by it."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    total = sum(ticks)
    return total - ticks[3] - ticks[4], total


# -- a server in a subprocess -------------------------------------------------------------------


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


# -- a configuration in a fresh child ------------------------------------------------------------


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


def _fork_server_pid() -> int | None:
    """The pid of multiprocessing's fork server in this process, if one runs (aioloader's forked
    one or the stdlib's)."""
    server: Any = getattr(multiprocessing.forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    return pid if isinstance(pid, int) else None


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
    if (server := _fork_server_pid()) is not None:
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
    if _fork_server_pid() is None:
        # Start the server, and let it import its modules, before the first row: its PSS is
        # read while it has no child.
        first = start.Process(target=_nothing, name="bench-fork-server-start")
        first.start()
        first.join()
    server = _fork_server_pid()
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


# -- the table ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Column(Generic[Row]):
    """A column of :func:`format_table`: ``cell(row)`` in ``width`` characters, right-aligned
    (``align=">"``) or left-aligned (``"<"``), under ``header``."""

    header: str
    width: int
    cell: Callable[[Row], str]
    align: Literal["<", ">"] = ">"


def format_table(
    rows: Iterable[Row],
    name_width: int,
    columns: Sequence[Column[Row]],
    check: Callable[[Row], str],
    *,
    blank: Callable[[Row], bool] | None = None,
    check_header: str = "check",
    note: str | None = None,
) -> str:
    """A header, a rule, then a line a row: its name under ``config`` in ``name_width``
    characters, its ``columns`` ("-" in each for a ``blank`` row), two spaces and
    ``check(row)`` under ``check_header``; then ``note``."""
    header = (
        f"{'config':<{name_width}}"
        + "".join(f"{c.header:{c.align}{c.width}}" for c in columns)
        + f"  {check_header}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        empty = blank is not None and blank(row)
        cells = "".join(f"{'-' if empty else c.cell(row):{c.align}{c.width}}" for c in columns)
        lines.append(f"{row.name:<{name_width}}{cells}  {check(row)}")
    if note is not None:
        lines.append(note)
    return "\n".join(lines)


def ratio_to(rows: Iterable[R], peer: str, *values: Callable[[R], float]) -> Callable[[R], str]:
    """A cell: each of ``values`` of the row over the same of the row named ``peer``, as
    ``1.23x`` (several: ``1.23x/0.98x``); "-" where either row was not :attr:`Result.measured`,
    the peer did not run, or a value of the peer's is 0."""
    by_name = {r.name: r for r in rows}

    def cell(row: R) -> str:
        base = by_name.get(peer)
        if base is None or not base.measured or not row.measured:
            return "-"
        if any(value(base) == 0 for value in values):
            return "-"
        return "/".join(f"{value(row) / value(base):.2f}x" for value in values)

    return cell


# -- the header line ------------------------------------------------------------------------------


def versions(*packages: str | tuple[str, str], where: bool = False) -> str:
    """``aioloader 0.1.0, torch 2.5.1, ..., python 3.11.9``: the aioloader this process imports
    (``where``: and its folder), then each installed distribution of ``packages`` (a name, or
    ``(label, distribution)``; one not installed is left out), then Python's version."""
    import aioloader  # here, not at import: the harness imports nothing heavy

    first = f"aioloader {aioloader.__version__}"
    if where:
        first += f" ({Path(aioloader.__file__).parent})"
    found = [first]
    for package in packages:
        label, distribution = package if isinstance(package, tuple) else (package, package)
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found.append(f"{label} {importlib.metadata.version(distribution)}")
    return f"{', '.join(found)}, python {sys.version.split()[0]}"


def load_average(fields: int = 2) -> str:
    """The first ``fields`` load averages (1, 5, 15 minutes), as ``/proc/loadavg`` writes them."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:fields])


def machine() -> str:
    """``2 cores (2 usable), <CPU model>, load average 0.50 0.93 0.99``."""
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    usable = len(os.sched_getaffinity(0))
    return f"{os.cpu_count()} cores ({usable} usable), {model}, load average {load_average(3)}"


def cpus_and_load() -> str:
    return f"{os.cpu_count()} CPUs (load average {load_average()})"


# -- the common flags, the exit status ------------------------------------------------------------


def add_quick(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("--quick", action="store_true", help=help)


def add_only(
    parser: argparse.ArgumentParser,
    choices: Sequence[str] | None = None,
    *,
    metavar: str | None = "NAME",
    help: str = "configurations to run",
) -> None:
    parser.add_argument("--only", nargs="+", choices=choices, metavar=metavar, help=help)


def add_timeout(parser: argparse.ArgumentParser, help: str, default: float | None = None) -> None:
    parser.add_argument("--timeout", type=float, default=default, help=help)


def add_batch_size(parser: argparse.ArgumentParser, default: int = 32) -> None:
    parser.add_argument("--batch-size", type=int, default=default, help="samples per batch")


def quick_defaults(args: argparse.Namespace, **defaults: tuple[object, object]) -> None:
    """For each ``name=(quick, full)`` whose flag was not given (None): ``quick`` under
    ``--quick``, else ``full``."""
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)


def exit_status(failed: Sequence[str]) -> int:
    """1 after a ``FAILED:`` line on stderr naming what failed; 0 when nothing did."""
    if failed:
        print(f"\nFAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
