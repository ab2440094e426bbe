"""How long something that repeats has been taking.

Owns: :class:`Recent`, the moving average that the adaptive decisions read (run a call inline
or on a thread, read a batch's samples in one task or a task each). Never: decides anything
itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["Placement", "Recent"]

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
        """``fn(*args)``, here and now, its duration added (a failed call's too)."""
        started = time.perf_counter()
        try:
            return fn(*args)
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
        probe_every: int = 16,
        slow_probe_every: int = 256,
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
