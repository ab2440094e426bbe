"""The benchmarks' processes seen from outside: a process tree or group, its memory (RSS, PSS) and
CPU sampled from ``/proc``, and waiting for and killing the processes a configuration left.

Owns: :func:`process_tree`, :func:`process_group`, :func:`rss_kib`, :func:`pss_kib`,
:func:`cpu_ticks`, :class:`MemorySampler` (a tree's memory and CPU from a thread of this
process); :func:`wait_until_gone`, :func:`wait_for_children`, :func:`kill_tree`,
:func:`kill_group`; the machine's CPU ticks (:func:`machine_ticks`). Never: starts a process;
imports torch, aioloader or another module of the package (``benchmarks/bench_startup.py`` loads
this file by its path, to keep its own process light).

Linux only: memory and CPU come from ``/proc``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

POLL_S = 0.05  # MemorySampler's default: RSS every 50 ms
PSS_EVERY = 4  # ... and PSS (smaps_rollup, ~1 ms a process) every 4th poll: every 0.2 s
EXIT_WAIT_S = 15.0  # how long a configuration's processes may take to exit once it is over


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


def _wait_for_an_exit(pids: Iterable[int], seconds: float) -> bool:
    """Block until one of ``pids`` exits (its pidfd turns readable) or ``seconds`` pass; True
    when one did or was already gone. A zombie counts as exited."""
    fds: list[int] = []
    try:
        for pid in pids:
            try:
                fds.append(os.pidfd_open(pid))
            except ProcessLookupError:
                return True
        ready, _, _ = select.select(fds, [], [], max(0.0, seconds))
        return bool(ready)
    finally:
        for fd in fds:
            os.close(fd)


def wait_until_gone(processes: Callable[[], Collection[int]], seconds: float) -> Collection[int]:
    """Wait until ``processes()`` lists none (collecting garbage first: a dropped loader's
    finalizer stops its workers) or ``seconds`` have passed; return what it last listed. Each
    wait is on the listed processes' pidfds, so it wakes as one exits (no polling); the list is
    read again after each exit, and processes started meanwhile are waited for too."""
    deadline = time.monotonic() + seconds
    while True:
        gc.collect()
        left = processes()
        remaining = deadline - time.monotonic()
        if not left or remaining <= 0:
            return left
        if not _wait_for_an_exit(left, remaining):
            return processes()  # the deadline passed with every one of them running


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
