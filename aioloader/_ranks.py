"""One rank's share of a stream that every rank reads whole (``distributed=True`` over an
iterable dataset), padded so that every rank gets the same number of samples.

Owns: which positions are this rank's, and the padding at the end. Never: reads the stream or
batches anything.

The rule is ``DistributedSampler``'s without shuffling: rank ``r`` takes positions ``r, r + W,
...`` of the ``N`` samples; the order is padded to a multiple of ``W`` by repeating it from its
start (padded position ``p >= N`` is sample ``(p - N) % N``). Every rank gets ``ceil(N / W)``
samples, so with the same ``batch_size`` and ``drop_last`` every rank yields the same number of
batches: a rank with one batch more would hang the next collective.
"""

from __future__ import annotations

from typing import Generic, TypeVar

__all__ = ["StreamShare"]

T = TypeVar("T")


class StreamShare(Generic[T]):
    """Rank ``rank`` of ``world_size``'s share of a stream, fed every sample in order.

    Keeps the first ``world_size`` samples of the stream (what the padding may repeat).

    Raises:
        ValueError: ``rank`` is not in ``[0, world_size)``.
    """

    __slots__ = ("_count", "_head", "rank", "world_size")

    def __init__(self, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.rank = rank
        self.world_size = world_size
        self._count = 0
        self._head: list[T] = []

    def mine(self, sample: T) -> bool:
        """Note the stream's next sample; whether it is this rank's."""
        position = self._count
        self._count += 1
        if position < self.world_size:
            self._head.append(sample)
        return position % self.world_size == self.rank

    def padding(self) -> list[tuple[int, T]]:
        """At the end of the stream: ``(position, sample)`` of the samples this rank repeats so
        that every rank has ``ceil(N / world_size)`` (none when the stream was empty)."""
        n, w = self._count, self.world_size
        if n == 0:
            return []
        total = -(-n // w) * w
        repeated = [(p - n) % n for p in range(n, total) if p % w == self.rank]
        return [(q, self._head[q]) for q in repeated]
