"""Where repeating work runs: on the calling thread while it is fast, else on threads. One
policy for the whole package: what is timed (:class:`Recent`), where the next call goes
(:class:`Placement`, and ``ThreadOffload``'s one-thread case of it), and every threshold those
decisions read, in the table below. docs/design.md ("Inline while fast") has the measurements
that chose each value.

=========================  ==========  ========================================================
threshold                  value       decides
=========================  ==========  ========================================================
``INLINE_BELOW_S``         1 ms        a call runs inline while its recent calls took less
                                       (``ThreadOffload``, a dataset's ``get_many`` slices, a
                                       serving model): a thread hop and the GIL's hand-overs
                                       cost more than such a call
``ROUND_EVERY_S``          1 ms        a plain ``for`` that makes batches in ``__anext__`` lets
                                       the event loop go round at least this often
``SEQUENTIAL_BELOW_S``     50 us       a batch's reads run one after another in one task while
                                       a read takes less (per sample), else a task each
``SLOW_IN_A_ROW``          3           batches in a row read or transformed slowly on demand,
                                       after which the epoch goes to the stages
``PROBE_EVERY``            16 (256)    calls sent to the threads between two timed alone, at
                                       most (once they take ``slow_below`` or more)
``FILES_SLOW_BELOW_S``     10 ms       a file slice this slow is re-timed every 256 calls
``SERVING_SLOW_BELOW_S``   2 ms        a model this slow is tried inline every 256 batches
                                       (else every 64: ``SERVING_PROBE_EVERY``)
``TRY_INLINE_BELOW_S``     10 ms       a model that took this long is re-timed on its thread,
                                       never tried inline (it would hold the loop that long)
=========================  ==========  ========================================================

Owns: those thresholds, :class:`Recent` (the moving average the decisions read) and
:class:`Placement` (inline, alone or on the threads). Never: runs anything on a thread (the
pools do: ``_workers/offload.py``, ``_workers/placed.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

from .exceptions import raised_of_its_own

__all__ = [
    "FILES_SLOW_BELOW_S",
    "INLINE_BELOW_S",
    "PROBE_EVERY",
    "ROUND_EVERY_S",
    "SEQUENTIAL_BELOW_S",
    "SERVING_PROBE_EVERY",
    "SERVING_SLOW_BELOW_S",
    "SLOW_IN_A_ROW",
    "SLOW_PROBE_EVERY",
    "TRY_INLINE_BELOW_S",
    "Placement",
    "Recent",
]

INLINE_BELOW_S = 1e-3
ROUND_EVERY_S = INLINE_BELOW_S
SEQUENTIAL_BELOW_S = 50e-6
SLOW_IN_A_ROW = 3
PROBE_EVERY, SLOW_PROBE_EVERY = 16, 256
FILES_SLOW_BELOW_S = 10 * INLINE_BELOW_S
SERVING_SLOW_BELOW_S, SERVING_PROBE_EVERY = 2 * INLINE_BELOW_S, 64
TRY_INLINE_BELOW_S = 0.01

R = TypeVar("R")


class Recent:
    """A moving average of durations, each new one weighing a quarter: one slow call moves it
    at once, a run of fast ones brings it back within a few calls."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds: float | None = None  # None: nothing measured yet

    def add(self, seconds: float) -> None:
        """One more measurement."""
        recent = self.seconds
        self.seconds = seconds if recent is None else recent + (seconds - recent) / 4

    def under(self, limit: float) -> bool:
        """Whether something was measured and the average is under ``limit``."""
        return self.seconds is not None and self.seconds < limit

    def not_over(self, limit: float) -> bool:
        """Whether nothing was measured yet or the average is under ``limit`` (the first call
        is tried where fast ones go)."""
        return self.seconds is None or self.seconds < limit

    def call(self, fn: Callable[..., R], *args: object) -> R:
        """``fn(*args)``, here and now, its duration added (a failed call's too).

        Raises:
            StrayCancellation: ``fn`` raised ``CancelledError`` (a plain call's own: see
                :func:`~aioloader._base.exceptions.raised_of_its_own`).
        """
        started = time.perf_counter()
        try:
            return fn(*args)
        except asyncio.CancelledError as exc:
            raise raised_of_its_own(exc, "a function run inline") from exc
        finally:
            self.add(time.perf_counter() - started)


class Placement:
    """Where the next call of something that repeats runs, from how long recent calls took
    when nothing else ran beside them: ``"inline"`` (on the calling, event loop, thread),
    ``"alone"`` (on a thread, once the calls on the threads are done, none starting meanwhile)
    or ``"threads"`` (on the threads, as many at once as there are).

    Inline while those calls took under ``limit`` seconds: a hop to a thread costs more. Over
    it, on the threads at once, so that their waits (a disk, a network) overlap. But the time
    of a call made beside others is not its own: calls on several threads wait for the GIL at
    each other's system calls, and fast ones (cached files) take several times as long as
    alone. So only calls timed alone count (:attr:`recent`: the caller adds inline calls and
    reports calls timed alone with :meth:`alone_took`, whose time replaces the average: it is
    the freshest clean one; never the others). The first call is timed alone; while calls go
    to the threads, one is timed alone after 1, 2, 4, ... calls, then every ``probe_every``
    (every ``slow_probe_every`` once they take ``slow_below`` seconds or more: a wait for the
    others to finish then costs the most), so one slow measure is soon corrected.

    Pure bookkeeping (no clock of its own): :meth:`Recent.call` times an inline call.
    """

    __slots__ = ("_every", "_interval", "_limit", "_since", "_slow_below", "_slow_every", "recent")

    def __init__(
        self,
        limit: float,
        *,
        slow_below: float,
        probe_every: int = PROBE_EVERY,
        slow_probe_every: int = SLOW_PROBE_EVERY,
    ) -> None:
        if not 0 < limit <= slow_below:
            raise ValueError(f"need 0 < limit <= slow_below, got {limit} and {slow_below}")
        self._limit = limit
        self._slow_below = slow_below
        self._every = probe_every
        self._slow_every = slow_probe_every
        self._since = 0
        self._interval = 1  # calls on the threads before the next one timed alone
        self.recent = Recent()

    def fast(self) -> bool:
        """Whether calls timed alone took under ``limit`` (they run inline)."""
        return self.recent.under(self._limit)

    def where(self) -> str:
        """``"inline"``, ``"alone"`` or ``"threads"``: where the next call runs."""
        seconds = self.recent.seconds
        if seconds is None:
            return "alone"
        if seconds < self._limit:
            self._interval = 1
            return "inline"
        self._since += 1
        if self._since < self._interval:
            return "threads"
        every = self._every if seconds < self._slow_below else self._slow_every
        self._since, self._interval = 0, min(2 * self._interval, every)
        return "alone"

    def alone_took(self, seconds: float) -> None:
        """A call timed alone took ``seconds``: the estimate from now on."""
        self.recent.seconds = seconds
