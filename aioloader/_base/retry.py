"""Retry policy: which failures are transient and how long to back off before the next attempt.

Owns: the pure decision (retry or not, and the delay). Never: sleeps or calls anything; the fetch
stage carries the decision out.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .exceptions import TransientError

__all__ = ["RetryPolicy"]

_MOST_ASKED = 60.0  # seconds: the longest a failure's own retry_after is waited


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retries with exponential backoff and full jitter, for errors marked transient.

    The delay before attempt ``k + 1`` (after the ``k``-th failure) is drawn uniformly from
    ``[0, min(max_backoff, initial_backoff * multiplier ** (k - 1))]`` when ``jitter`` is on (full
    jitter, so a burst of failures does not retry in lockstep), or is that bound exactly when off.
    A failure that says how long to wait (a ``retry_after`` attribute in seconds: an HTTP
    error's ``Retry-After``, on a 429 or a 503) waits at least that long, up to a minute.

    Args:
        attempts: Attempts in all, the first included (1 means no retry).
        initial_backoff: Upper bound of the first delay, in seconds.
        max_backoff: Cap on any delay, in seconds.
        multiplier: Growth of the bound from one attempt to the next.
        jitter: Draw each delay uniformly below its bound.
        retry_on: Exception types worth retrying; anything else fails at once.

    Raises:
        ValueError: An argument is out of range (the message names it).
        TypeError: ``retry_on`` holds something that is not an exception type.
    """

    attempts: int = 3
    initial_backoff: float = 0.05
    max_backoff: float = 2.0
    multiplier: float = 2.0
    jitter: bool = True
    retry_on: tuple[type[BaseException], ...] = (TransientError, TimeoutError, ConnectionError)

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int):
            raise TypeError(f"attempts must be an int, got {self.attempts!r}")
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")
        if not self.initial_backoff >= 0:
            raise ValueError(f"initial_backoff must be >= 0, got {self.initial_backoff}")
        if not self.max_backoff >= 0:
            raise ValueError(f"max_backoff must be >= 0, got {self.max_backoff}")
        if not self.multiplier >= 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier}")
        if not isinstance(self.retry_on, tuple) or not all(
            isinstance(t, type) and issubclass(t, BaseException) for t in self.retry_on
        ):
            raise TypeError(f"retry_on must be a tuple of exception types, got {self.retry_on!r}")

    def should_retry(self, exc: BaseException, failures: int) -> bool:
        """Whether to try again after the ``failures``-th failed attempt ended with ``exc``."""
        return failures < self.attempts and isinstance(exc, self.retry_on)

    def delay(self, exc: BaseException, failures: int, rng: random.Random) -> float:
        """Seconds to wait after the ``failures``-th failure, ``exc``: :meth:`backoff`, or
        what ``exc`` asks (its ``retry_after``) where longer, up to a minute (found by review:
        a throttling server's 429s used up every attempt within its ``Retry-After``)."""
        wait = self.backoff(failures, rng)
        asked = getattr(exc, "retry_after", None)
        if isinstance(asked, int | float) and not isinstance(asked, bool) and asked > wait:
            return float(min(asked, _MOST_ASKED))
        return wait

    def backoff(self, failures: int, rng: random.Random) -> float:
        """Seconds to wait after the ``failures``-th failure (``failures >= 1``)."""
        bound = min(self.max_backoff, self.initial_backoff * self.multiplier ** (failures - 1))
        return rng.uniform(0.0, bound) if self.jitter else bound
