"""The requests waiting for a batch, grouped by bucket, and what the next batch of each may hold.

Owns: :class:`BatchLimits` (the most requests and the most cost in one batch, the cost summed or
padded, and the rule for a request over the limit), :class:`PendingQueue` (waiting requests
oldest first, bounded, withdrawn in O(1), grouped into buckets that each know the first batch
they would give and whether it can still grow), and the checks of what ``cost_fn`` and
``bucket_fn`` return. Never: touches an event loop, awaits or reads a clock (times are passed
in), or decides *when* to cut (:mod:`aioloader._serving.policy`).

A batch is always a prefix of one bucket, oldest first: it takes requests while they fit, so a
request that would pass the cost limit ends the batch (it heads the next one) rather than being
skipped. A single request whose own cost is over the limit makes a batch of one.
"""

from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from .._base.checks import check_int
from .._base.exceptions import Overloaded, annotate

__all__ = ["BatchLimits", "PendingQueue", "Waiting", "bucket_of", "cost_of"]


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """What one batch may hold.

    Args:
        max_batch_size: The most requests in one batch.
        max_batch_cost: The most cost in one batch (None: no cost limit). A batch is cut before
            its cost would pass it; a single request whose cost is over it runs alone.
        padded: A batch's cost is its size times its largest request's cost (what a model that
            pads its batch pays), rather than the sum of its requests' costs.

    Raises:
        TypeError: ``max_batch_cost`` is not a number, ``padded`` not a bool.
        ValueError: ``max_batch_size`` is not positive, ``max_batch_cost`` not positive and
            finite.
    """

    max_batch_size: int
    max_batch_cost: float | None = None
    padded: bool = False

    def __post_init__(self) -> None:
        check_int("max_batch_size", self.max_batch_size, minimum=1)
        _check_limit(self.max_batch_cost)
        _check_bool("padded_cost", self.padded)

    def cost(self, n: int, total: float, largest: float) -> float:
        """The cost of a batch of ``n`` requests whose costs sum to ``total``, the largest
        ``largest``."""
        return n * largest if self.padded else total

    def fits(self, n: int, total: float, largest: float) -> bool:
        """Whether such a batch is within the limits (one request always is)."""
        if n > self.max_batch_size:
            return False
        limit = self.max_batch_cost
        return limit is None or n <= 1 or self.cost(n, total, largest) <= limit


def _check_limit(limit: object) -> None:
    if limit is None:
        return
    if isinstance(limit, bool) or not isinstance(limit, numbers.Real):
        raise TypeError(f"max_batch_cost must be a number or None, got {limit!r}")
    if not math.isfinite(limit) or limit <= 0:
        raise ValueError(f"max_batch_cost must be a finite number > 0, got {limit!r}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


class Waiting(Protocol):
    """What the queue reads of a request: when it arrived and expires, its cost and bucket."""

    @property
    def enqueued_at(self) -> float: ...

    @property
    def deadline(self) -> float: ...

    @property
    def cost(self) -> float: ...

    @property
    def bucket(self) -> Hashable: ...


E = TypeVar("E", bound=Waiting)


class _Bucket(Generic[E]):
    """One bucket's requests, oldest first, and the first batch they would give: its first
    ``fit`` requests (costs summing to ``total``, the largest ``largest``), ``full`` when no
    request could join it (``max_batch_size`` reached, a request waiting behind it that did
    not fit, or one request alone over the cost limit)."""

    __slots__ = ("entries", "fit", "full", "largest", "total")

    def __init__(self) -> None:
        self.entries: OrderedDict[E, None] = OrderedDict()
        self.fit = 0
        self.total = self.largest = 0.0
        self.full = False

    def grow(self, limits: BatchLimits, entry: E) -> None:
        """``entry`` was appended: extend the first batch with it if it fits."""
        if self.full:
            return
        n, total, largest = self.fit + 1, self.total + entry.cost, max(self.largest, entry.cost)
        if limits.fits(n, total, largest):
            self.fit, self.total, self.largest = n, total, largest
            self.full = n >= limits.max_batch_size or _alone_over(limits, n, total, largest)
        else:
            self.full = True

    def refresh(self, limits: BatchLimits) -> None:
        """Work the first batch out again (after requests left the bucket)."""
        self.fit, self.total, self.largest, self.full = 0, 0.0, 0.0, False
        for entry in self.entries:
            self.grow(limits, entry)
            if self.full:
                return


def _alone_over(limits: BatchLimits, n: int, total: float, largest: float) -> bool:
    limit = limits.max_batch_cost
    return limit is not None and limits.cost(n, total, largest) > limit


class PendingQueue(Generic[E]):
    """Requests waiting for a batch, oldest first, at most ``capacity`` of them, grouped by
    their ``bucket`` key (all in one bucket when the batcher has no ``bucket_fn``).

    Withdrawing a request (its caller was cancelled or gave up) is O(1) plus re-working its
    bucket's first batch (at most ``max_batch_size`` steps), so a crowd of departing clients
    never leaves stale entries holding capacity.

    Args:
        capacity: The most requests that may wait (``max_queue``).
        limits: What one batch may hold (default: at most ``capacity`` requests, no cost).

    Raises:
        ValueError: ``capacity`` is not positive.
    """

    def __init__(self, capacity: int, limits: BatchLimits | None = None) -> None:
        self.capacity = check_int("max_queue", capacity, minimum=1)
        self.limits = limits if limits is not None else BatchLimits(capacity)
        self._entries: OrderedDict[E, None] = OrderedDict()  # every bucket's, oldest first
        self._buckets: dict[Hashable, _Bucket[E]] = {}
        self._full: dict[Hashable, None] = {}  # the buckets whose first batch is full
        self.max_len = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def buckets(self) -> int:
        """Buckets with a request waiting."""
        return len(self._buckets)

    def push(self, entry: E) -> bool:
        """Append ``entry`` to its bucket.

        Returns:
            Whether the batcher's decision may have changed: ``entry`` is the only request
            waiting, or its bucket's first batch just became full.

        Raises:
            Overloaded: ``capacity`` requests already wait.
        """
        if len(self._entries) >= self.capacity:
            raise Overloaded(
                f"the batcher's queue is full ({self.capacity} requests waiting, max_queue="
                f"{self.capacity}); try again later"
            )
        self._entries[entry] = None
        self.max_len = max(self.max_len, len(self._entries))
        key = entry.bucket
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket()
        bucket.entries[entry] = None
        was_full = bucket.full
        bucket.grow(self.limits, entry)
        if bucket.full and not was_full:
            self._full[key] = None
            return True
        return len(self._entries) == 1

    def withdraw(self, entry: E) -> bool:
        """Remove ``entry`` if it still waits; return whether it did."""
        if self._entries.pop(entry, False) is not None:
            return False
        key = entry.bucket
        bucket = self._buckets[key]
        del bucket.entries[entry]
        self._settle(key, bucket)
        return True

    def oldest(self) -> E | None:
        """The request that has waited longest (None when none waits)."""
        for entry in self._entries:
            return entry
        return None

    def oldest_at(self) -> float | None:
        """When the oldest waiting request arrived (None when none waits)."""
        entry = self.oldest()
        return None if entry is None else entry.enqueued_at

    def next_batch(self, key: Hashable) -> tuple[int, bool]:
        """``(fit, full)`` for bucket ``key``: how many of its requests its next batch would
        take, and whether no request could join them (``(0, False)`` for an empty bucket)."""
        bucket = self._buckets.get(key)
        return (0, False) if bucket is None else (bucket.fit, bucket.full)

    def oldest_full(self) -> E | None:
        """The oldest request heading a bucket whose next batch is full (None: no such
        bucket)."""
        best: E | None = None
        for key in self._full:
            head = next(iter(self._buckets[key].entries))
            if best is None or head.enqueued_at < best.enqueued_at:
                best = head
        return best

    def take(self, n: int, now: float, key: Hashable = None) -> tuple[list[E], list[E]]:
        """Remove up to ``n`` live requests from the head of bucket ``key`` while they fit in
        one batch (:meth:`BatchLimits.fits`; at least one, even over the cost limit).

        Returns:
            ``(batch, expired)``: the requests taken, and those met on the way whose deadline
            had passed by ``now`` (removed too, not counted in ``n``).
        """
        batch: list[E] = []
        expired: list[E] = []
        bucket = self._buckets.get(key)
        if bucket is None:
            return batch, expired
        entries, limits = bucket.entries, self.limits
        total = largest = 0.0
        while entries and len(batch) < n:
            entry = next(iter(entries))
            if entry.deadline <= now:
                expired.append(entry)
            else:
                cost = entry.cost
                if not limits.fits(len(batch) + 1, total + cost, max(largest, cost)):
                    break
                total, largest = total + cost, max(largest, cost)
                batch.append(entry)
            del entries[entry]
            del self._entries[entry]
        self._settle(key, bucket)
        return batch, expired

    def take_all(self) -> list[E]:
        """Remove and return every waiting request, oldest first."""
        everything = list(self._entries)
        self._entries.clear()
        self._buckets.clear()
        self._full.clear()
        return everything

    def _settle(self, key: Hashable, bucket: _Bucket[E]) -> None:
        """Requests left ``bucket``: drop it if empty, else work its first batch out again."""
        if not bucket.entries:
            del self._buckets[key]
            self._full.pop(key, None)
            return
        bucket.refresh(self.limits)
        if bucket.full:
            self._full[key] = None
        else:
            self._full.pop(key, None)


# --------------------------------------------------------------------------------------------
# What cost_fn and bucket_fn return
# --------------------------------------------------------------------------------------------


def cost_of(cost_fn: Callable[[Any], Any], item: Any) -> float:
    """``cost_fn(item)`` as a float, checked.

    Raises:
        TypeError: It is not a real number (a bool is not one).
        ValueError: It is negative, infinite or NaN.
        Exception: Whatever ``cost_fn`` raised, with a note naming it.
    """
    try:
        cost = cost_fn(item)
    except Exception as exc:
        annotate(exc, "cost_fn", detail="the request was not admitted")
        raise
    if isinstance(cost, bool) or not isinstance(cost, numbers.Real):
        raise TypeError(f"cost_fn must return a number, got {type(cost).__qualname__}")
    value = float(cost)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"cost_fn must return a finite number >= 0, got {cost!r}")
    return value


def bucket_of(bucket_fn: Callable[[Any], Any], item: Any) -> Hashable:
    """``bucket_fn(item)``, checked to be hashable.

    Raises:
        TypeError: The key is not hashable.
        Exception: Whatever ``bucket_fn`` raised, with a note naming it.
    """
    try:
        key = bucket_fn(item)
    except Exception as exc:
        annotate(exc, "bucket_fn", detail="the request was not admitted")
        raise
    try:
        hash(key)
    except TypeError:
        raise TypeError(
            f"bucket_fn must return a hashable key, got {type(key).__qualname__}"
        ) from None
    return key  # type: ignore[no-any-return]  # hash() succeeded: it is Hashable
