"""How long something that repeats has been taking.

Owns: :class:`Recent`, the moving average that the adaptive decisions read (run a call inline
or on a thread, read a batch's samples in one task or a task each). Never: decides anything
itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["Recent"]

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

    def call(self, fn: Callable[..., R], *args: object) -> R:
        """``fn(*args)``, here and now, its duration added (a failed call's too)."""
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.add(time.perf_counter() - started)


class InlineChoice:
    """Whether the next call of something that repeats runs inline (on the event loop's thread)
    or on a thread, from how long recent calls took.

    Inline while the recent ones took under ``limit`` seconds, and for the first call (nothing
    measured yet: timed alone, it says what a call costs). On threads, a call's time includes
    its waits for the GIL while the loop and the other threads run: fast calls made at once on
    several threads (a folder's files read in slices) look slow to each other, and would stay
    there, each several times slower than inline. So while the average is under ``probe_below``
    seconds, a call made when no call is on the threads runs inline once every ``probe_every``
    calls, and its time alone replaces the average: it brings the calls back inline if they are
    in fact fast.

    Pure bookkeeping (no clock of its own): :attr:`recent` holds the durations, which the
    caller adds (:meth:`Recent.call` does for an inline call).
    """

    __slots__ = ("_every", "_limit", "_probe_below", "_since_probe", "on_threads", "recent")

    def __init__(self, limit: float, *, probe_below: float, probe_every: int = 8) -> None:
        self._limit = limit
        self._probe_below = probe_below
        self._every = probe_every
        self._since_probe = 0
        self.on_threads = 0  # calls on the threads now (see :meth:`away`)
        self.recent = Recent()

    def inline(self) -> bool:
        """Whether the next call runs inline."""
        seconds = self.recent.seconds
        if seconds is None or seconds < self._limit:
            return True
        self._since_probe += 1
        if self.on_threads or seconds >= self._probe_below or self._since_probe < self._every:
            return False
        self._since_probe = 0
        self.recent.seconds = None  # the probe's time alone is the estimate, as the first's
        return True

    def away(self) -> _Away:
        """``with choice.away():`` around a call on the threads, counted in :attr:`on_threads`
        until it returns (or fails, or is cancelled)."""
        return _Away(self)


class _Away:
    __slots__ = ("_choice",)

    def __init__(self, choice: InlineChoice) -> None:
        self._choice = choice

    def __enter__(self) -> None:
        self._choice.on_threads += 1

    def __exit__(self, *exc_info: object) -> None:
        self._choice.on_threads -= 1
