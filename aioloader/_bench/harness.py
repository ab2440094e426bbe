"""The machinery the benchmark scripts share, and its first part: a configuration's row, how it is
timed and checked, and how it reaches ``aioloader bench``.

Owns: the result row (:class:`Result`: samples over wall time, memory peaks, failed or skipped);
timing one configuration under a watchdog (:func:`timed`, :func:`watchdog`); the exactly-once
check of an epoch (:func:`delivery_error`) and a batch described for an error message
(:func:`describe`); the rows handed to ``aioloader bench`` (:func:`report`). Never: knows a
workload, a loader or a peer (a script passes in what to run, check and print); imports torch or
aioloader itself; prints (a script prints what the harness formats).

The rest of the harness, a module a concept: the processes a configuration runs in, their memory
and CPU sampled from outside, waiting for and killing what it left (``harness_processes``); a
configuration in a fresh child measured from this process (``harness_child``); a server in a
subprocess (``harness_server``); the table with ratios against peers measured in the same run
(``harness_table``); the header line, the common flags and the exit status (``harness_script``).

The workloads (``aioloader/_bench/*.py``) import them as ``aioloader._bench.harness*``, which
imports aioloader's facade and so torch; ``benchmarks/bench_startup.py``, which measures fresh
interpreters and must keep its own process light, loads ``harness_processes``, ``harness_table``
and ``harness_script`` by their paths (none of the three imports another module of the package
when it runs). Linux only: memory and CPU come from ``/proc``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from aioloader._bench.harness_processes import MemorySampler

T = TypeVar("T")


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
