"""The dynamic batcher's decisions: when to cut a batch, from which bucket and how big, and how
a model's output is split back per request.

Owns: :class:`BatchPolicy` (cut now, from which bucket, or wait until when), the split of a
batch's output (:func:`default_split`, :func:`split_outputs`), and the checks of the batcher's
arguments. The waiting requests, their buckets and what each bucket's next batch may hold are
:mod:`aioloader._serving.pending`'s. Never: touches an event loop, awaits, sleeps or reads a
clock; every time is passed in, so tests drive it with a fake clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from .._base.checks import check_bool, check_int, check_seconds
from .pending import PendingQueue

__all__ = [
    "BatchPolicy",
    "check_arguments",
    "check_timeout",
    "Decision",
    "default_split",
    "rearm_after_timer",
    "sizes_of",
    "split_outputs",
]


class Decision(NamedTuple):
    """What the batcher does now: cut a batch of ``size`` requests (``size > 0``) from bucket
    ``bucket``, or wait until ``wake_at`` (clock time) or, when ``wake_at`` is None, until a
    request arrives."""

    size: int
    wake_at: float | None = None
    bucket: Hashable = None


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    """When to cut a batch, from which bucket, and how big.

    A batch is cut as soon as no waiting request could join it (``max_batch_size`` requests
    wait, or the next would pass the cost limit), or once the oldest waiting request has waited
    ``max_delay`` (or at once when flushing at shutdown). Its size is the largest preferred size
    that fits (at most the requests its bucket's next batch would take), or, when none fits,
    all of those.

    Args:
        max_batch_size: The most requests in one batch.
        max_delay: Seconds the oldest request may wait for others to join its batch.
        preferred_sizes: Batch sizes to prefer (e.g. those a compiled model or a CUDA graph was
            captured for), each at most ``max_batch_size``; sorted and deduplicated.

    Raises:
        ValueError: An argument is out of range (the message names it).
    """

    max_batch_size: int
    max_delay: float
    preferred_sizes: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        check_int("max_batch_size", self.max_batch_size, minimum=1)
        if isinstance(self.max_delay, bool) or not isinstance(self.max_delay, int | float):
            raise TypeError(f"max_delay must be a number of seconds, got {self.max_delay!r}")
        if not math.isfinite(self.max_delay) or self.max_delay < 0:
            raise ValueError(
                f"max_delay must be a finite number of seconds >= 0, got {self.max_delay!r}"
            )
        sizes = sorted(
            {check_int("preferred_batch_sizes", s, minimum=1) for s in self.preferred_sizes}
        )
        if sizes and sizes[-1] > self.max_batch_size:
            raise ValueError(
                f"preferred_batch_sizes must be <= max_batch_size={self.max_batch_size}, "
                f"got {sizes[-1]}"
            )
        object.__setattr__(self, "preferred_sizes", tuple(sizes))

    def size_for(self, available: int) -> int:
        """The batch to cut from ``available`` waiting requests: the largest preferred size
        that fits, else all of them (never more than ``max_batch_size``)."""
        available = min(available, self.max_batch_size)
        best = 0
        for size in self.preferred_sizes:
            if size > available:
                break
            best = size
        return best or available

    def decide(
        self,
        ready: int,
        oldest_at: float | None,
        now: float,
        *,
        full: bool | None = None,
        flush: bool = False,
    ) -> Decision:
        """Cut one bucket's next batch now, or say until when to wait.

        Args:
            ready: Requests its next batch would take (at most ``max_batch_size`` are used).
            oldest_at: When the oldest of them arrived (None when none waits).
            now: The current clock time.
            full: No waiting request could join them (default: ``ready >= max_batch_size``;
                a cost limit makes a batch full sooner).
            flush: Shutting down: cut whatever waits without waiting for ``max_delay``.

        Returns:
            ``Decision(size)`` to cut ``size`` requests now; ``Decision(0, wake_at)`` to wait
            until ``wake_at`` or a change; ``Decision(0)`` (nothing waits) to wait for a request.
        """
        if ready <= 0 or oldest_at is None:
            return Decision(0)
        if full is None:
            full = ready >= self.max_batch_size
        due = oldest_at + self.max_delay
        if full or flush or now >= due:
            return Decision(self.size_for(ready))
        return Decision(0, due)

    def choose(self, queue: PendingQueue[Any], now: float, *, flush: bool = False) -> Decision:
        """The next batch across buckets: the oldest request's bucket when its batch is full or
        that request has waited ``max_delay`` (or when flushing); else the full bucket whose
        head is oldest; else wait until the oldest request's ``max_delay``. A batch never mixes
        buckets, and the oldest request is never passed over once due.

        Returns:
            As :meth:`decide`, with the bucket to cut from.
        """
        head = queue.oldest()
        if head is None:
            return Decision(0)
        ready, full = queue.next_batch(head.bucket)
        decision = self.decide(ready, head.enqueued_at, now, full=full, flush=flush)
        if decision.size:
            return decision._replace(bucket=head.bucket)
        other = queue.oldest_full()
        if other is None:
            return decision
        ready, _ = queue.next_batch(other.bucket)
        return Decision(self.size_for(ready), bucket=other.bucket)


# --------------------------------------------------------------------------------------------
# A delay timer that fires early
# --------------------------------------------------------------------------------------------

TIMER_GRAIN_S = 0.001
"""The shortest wait a runner re-arms after an early timer. uvloop's timers are whole
milliseconds, counted from a loop time truncated to the millisecond: one fires up to 1.5 ms
before its delay is up, and a wait under 0.5 ms is run at once there (re-arming that would spin)."""

NEAR_MISS_S = 0.002
"""A timer this early, or less, is a coarse timer's near miss; earlier, the batcher's clock and
the loop's disagree (a test's clock that does not move): the timer is trusted."""

MAX_REARMS = 3
"""Re-arms per batch, at most: a timer on a millisecond grain that fired at most 1.5 ms early,
re-armed for at least a millisecond, lands after the delay within two; the third is margin for
a tick the loop reads a hair early (floating point)."""


def rearm_after_timer(left: float, rearms: int) -> float | None:
    """A runner's delay timer fired with ``left`` seconds still to go by the batcher's clock
    (``rearms`` times already re-armed for this batch): the seconds to wait again, or None to
    take the delay as over and cut.

    A batch is never cut before its oldest request's ``max_delay`` because the loop's timer was
    coarse (measured on uvloop at 200 requests/s: one batch in twenty cut 0.3 ms or more early):
    a near miss waits again for what is left, at least :data:`TIMER_GRAIN_S`, so it lands
    within about a millisecond after the delay, never spinning. Pure: the caller reads the
    clock.
    """
    if left <= 0 or left > NEAR_MISS_S or rearms >= MAX_REARMS:
        return None
    return max(left, TIMER_GRAIN_S)


# --------------------------------------------------------------------------------------------
# Splitting a batch's output back per request
# --------------------------------------------------------------------------------------------


def default_split(output: Any, n: int) -> list[Any]:
    """Split a model's output for a batch of ``n`` requests into ``n`` per-request outputs.

    * a tensor (or NumPy array) -> its rows along dimension 0 (views, no copies);
    * a list -> itself: its ``n`` elements are the per-request outputs;
    * a mapping -> one ``dict`` per request, each value split by these rules;
    * a tuple (named tuples included) -> one tuple of the same type per request, each element
      split by these rules.

    Raises:
        ValueError: A tensor's first dimension or a list's length is not ``n``.
        TypeError: The output (or a part of it) has another type; pass ``split_fn``.
    """
    return _split(output, n, "output")


def _split(value: Any, n: int, path: str) -> list[Any]:
    if isinstance(value, torch.Tensor | np.ndarray):
        rows = value.shape[0] if value.ndim else None
        if rows != n:
            raise ValueError(
                f"{path}: a tensor of shape {tuple(value.shape)} cannot be split into {n} "
                "requests along dimension 0"
            )
        return list(value.unbind(0)) if isinstance(value, torch.Tensor) else list(value)
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{path}: a list of {len(value)} outputs for {n} requests")
        return value
    if isinstance(value, Mapping):
        columns = {k: _split(v, n, f"{path}[{k!r}]") for k, v in value.items()}
        return [{k: col[i] for k, col in columns.items()} for i in range(n)]
    if isinstance(value, tuple):
        parts = [_split(v, n, f"{path}[{j}]") for j, v in enumerate(value)]
        rebuild: Callable[[Iterable[Any]], Any] = (
            (lambda xs: type(value)(*xs)) if hasattr(value, "_fields") else type(value)
        )
        return [rebuild(p[i] for p in parts) for i in range(n)]
    raise TypeError(
        f"{path}: cannot split a {type(value).__qualname__} into per-request outputs; "
        "return a tensor, a list, a mapping or a tuple, or pass split_fn"
    )


def split_outputs(
    split_fn: Callable[[Any, int], Sequence[Any]], output: Any, n: int
) -> Sequence[Any]:
    """``split_fn(output, n)``, checked to give exactly ``n`` outputs.

    Raises:
        ValueError: ``split_fn`` gave a different number of outputs.
        Exception: Whatever ``split_fn`` raised.
    """
    outputs = split_fn(output, n)
    if len(outputs) != n:
        raise ValueError(f"split_fn gave {len(outputs)} outputs for a batch of {n} requests")
    return outputs


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------


def check_arguments(
    *,
    model_fn: object,
    max_batch_size: int,
    max_queue: object,
    max_concurrent_batches: object,
    collate_fn: object,
    split_fn: object,
    collate_in_thread: object,
    num_workers: object,
    on_exit: object,
    pin_memory: object = False,
    clock: object,
    cost_fn: object = None,
    bucket_fn: object = None,
    max_batch_cost: object = None,
    padded_cost: object = False,
) -> None:
    """Check a :class:`DynamicBatcher`'s arguments (the policy's are checked by
    :class:`BatchPolicy`).

    Raises:
        TypeError: An argument has the wrong type (a count that is not an int, a function that
            is not callable), or ``collate_fn`` does not pickle while ``num_workers > 0``.
        ValueError: An argument is out of range or unknown (the message names it), or
            ``max_batch_cost`` or ``padded_cost=True`` is given without ``cost_fn``.
    """
    for name, fn in (("model_fn", model_fn), ("clock", clock)):
        if not callable(fn):
            raise TypeError(f"{name} must be callable, got {type(fn).__qualname__}")
    optional = (
        ("collate_fn", collate_fn), ("split_fn", split_fn), ("cost_fn", cost_fn),
        ("bucket_fn", bucket_fn),
    )  # fmt: skip
    for name, opt in optional:
        if opt is not None and not callable(opt):
            raise TypeError(f"{name} must be callable or None, got {type(opt).__qualname__}")
    if check_int("max_queue", max_queue, minimum=1) < max_batch_size:
        raise ValueError(f"max_queue must be >= max_batch_size ({max_batch_size}), got {max_queue}")
    if cost_fn is None:
        given = (("max_batch_cost", max_batch_cost is not None), ("padded_cost", padded_cost))
        for name, set_ in given:
            if set_:
                raise ValueError(f"{name} needs cost_fn (the cost of one request)")
    check_int("max_concurrent_batches", max_concurrent_batches, minimum=1)
    check_int("num_workers", num_workers, minimum=0)
    check_bool("collate_in_thread", collate_in_thread)
    check_bool("pin_memory", pin_memory)
    if num_workers and collate_in_thread:
        raise ValueError("collate_in_thread=True and num_workers > 0 exclude each other")
    if on_exit not in ("drain", "cancel"):
        raise ValueError(f"on_exit must be 'drain' or 'cancel', got {on_exit!r}")


def sizes_of(preferred: object) -> tuple[int, ...]:
    """``preferred_batch_sizes`` as a tuple (:class:`BatchPolicy` checks each size).

    Raises:
        TypeError: Not an iterable of sizes (one int, a string); the message names it.
    """
    if isinstance(preferred, str | bytes) or not isinstance(preferred, Iterable):
        raise TypeError(f"preferred_batch_sizes must be a sequence of ints, got {preferred!r}")
    return tuple(preferred)


def check_timeout(name: str, value: object) -> float | None:
    """``value`` as seconds: a positive number, or None for no limit.

    Raises:
        TypeError: Not a number. ValueError: Not positive and finite (the message names
        ``name``).
    """
    return None if value is None else check_seconds(name, value)
