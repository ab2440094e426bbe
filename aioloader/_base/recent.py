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
