"""Sharding: which share of an epoch each rank takes, as pure decisions.

Owns: rank resolution (:func:`resolve_rank`, explicit or from ``torch.distributed``), torch's
``DistributedSampler`` rule for map-style datasets (:func:`shard_length`, :func:`shard`), the
round-robin rule for a stream's items (:func:`shard_stream_position`, and
:class:`StreamShare`, which pads the tail) and a stream's parts per
rank and epoch (:func:`epoch_parts`). Never: no event loop, no I/O, no threads; it reads only
whether ``torch.distributed`` is initialised.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Generic, TypeVar

import torch.distributed as dist

from .._base.checks import check_bool, check_int
from .seeds import derive_seed

__all__ = [
    "SplitsByRank",
    "StreamShare",
    "epoch_parts",
    "refuse_second_split",
    "resolve_rank",
    "shard",
    "shard_length",
    "shard_stream_position",
]

T = TypeVar("T")
T_Part = TypeVar("T_Part")


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Resolve and validate this process's rank and the world size.

    Explicit values win. A missing value comes from ``torch.distributed`` when it
    is available and initialised, else defaults to rank 0 of a world of 1.

    Args:
        rank: This process's rank, or None to detect it.
        world_size: The number of processes, or None to detect it.

    Returns:
        ``(rank, world_size)`` with ``world_size >= 1`` and
        ``0 <= rank < world_size``.

    Raises:
        TypeError: If a given value is not an int.
        ValueError: If ``world_size < 1`` or ``rank`` is outside
            ``[0, world_size)``.
    """
    if rank is None or world_size is None:
        initialised = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank() if initialised else 0
        if world_size is None:
            world_size = dist.get_world_size() if initialised else 1
    world_size = check_int("world_size", world_size, minimum=1)
    rank = check_int("rank", rank, minimum=0)
    if rank >= world_size:
        raise ValueError(
            f"rank must be in [0, {world_size - 1}] for world_size {world_size}, got {rank}"
        )
    return rank, world_size


def shard_length(n_items: int, world_size: int, drop_last: bool) -> int:
    """Return how many items each rank gets when sharding ``n_items`` items.

    Args:
        n_items: The size of the global order.
        world_size: The number of ranks.
        drop_last: Truncate to a multiple of ``world_size`` instead of padding.

    Returns:
        The per-rank count, the same for every rank (as torch's
        ``DistributedSampler``).

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If ``n_items < 0`` or ``world_size < 1``.
    """
    n_items = check_int("n_items", n_items, minimum=0)
    world_size = check_int("world_size", world_size, minimum=1)
    check_bool("drop_last", drop_last)
    return n_items // world_size if drop_last else -(-n_items // world_size)


def shard(n_items: int, rank: int, world_size: int, drop_last: bool) -> list[int]:
    """Return the positions in a global order of ``n_items`` that ``rank`` takes.

    The global order is padded by repeating it cyclically from its start until
    its length divides by ``world_size`` (or truncated when ``drop_last``); rank
    ``r`` then takes every ``world_size``-th position starting at ``r``. This is
    exactly torch's ``DistributedSampler`` rule.

    Args:
        n_items: The size of the global order.
        rank: This rank, in ``[0, world_size)``.
        world_size: The number of ranks.
        drop_last: Truncate instead of padding.

    Returns:
        ``shard_length(n_items, world_size, drop_last)`` positions into the
        global order (padding positions wrap around to its start).

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If ``n_items < 0``, ``world_size < 1`` or ``rank`` is out of
            range.
    """
    count = shard_length(n_items, world_size, drop_last)
    rank, world_size = resolve_rank(rank, world_size)
    return [(rank + k * world_size) % n_items for k in range(count)]


def shard_stream_position(position: int, rank: int, world_size: int) -> bool:
    """Return whether the item at ``position`` of a stream belongs to ``rank``.

    Items of an iterable dataset are dealt round-robin: position ``p`` goes to
    rank ``p % world_size``.

    Args:
        position: The item's 0-based position in the stream.
        rank: This rank, in ``[0, world_size)`` (see :func:`resolve_rank`).
        world_size: The number of ranks, at least 1.

    Returns:
        True if this rank should take the item.

    Raises:
        ValueError: If ``position`` is negative.
    """
    if position < 0:
        raise ValueError(f"position must be a non-negative int, got {position!r}")
    return position % world_size == rank


def refuse_second_split(world_size: int | None, distributed: bool, name: str) -> None:
    """Refuse a loader's ``distributed=True`` for a stream that gives each rank its own parts
    (``world_size`` not 1; None: torch.distributed's, at each epoch): the loader would keep
    1/world_size of each rank's share, without a word (found by review).

    Raises:
        ValueError: ``distributed`` is set and the stream splits by rank itself.
    """
    if distributed and world_size != 1:
        raise ValueError(
            f"distributed=True would split {name} a second time: it already gives each rank "
            "its own parts (by the rank and world_size given to it, else torch.distributed's), "
            "and the loader would keep 1/world_size of that share; leave distributed unset (or "
            f"give {name} world_size=1, every rank reading every part, for the loader to split "
            "its samples)"
        )


class SplitsByRank:
    """A stream that gives each rank its own parts (``_world_size``: the one given to it, None
    for torch.distributed's): the loader asks it which of its options it cannot work with."""

    _world_size: int | None = None

    def check_loader_options(
        self, *, batch_size: int | None, in_order: bool, distributed: bool
    ) -> None:
        """Called by the loader as it is built.

        Raises:
            ValueError: ``distributed=True`` (see :func:`refuse_second_split`).
        """
        refuse_second_split(self._world_size, distributed, type(self).__name__)


def epoch_parts(
    parts: Sequence[T_Part],
    epoch: int,
    *,
    seed: int,
    shuffle: bool,
    rank: int | None,
    world_size: int | None,
) -> list[T_Part]:
    """This rank's parts (shards, files) of a stream dataset in ``epoch``, in reading order.

    With ``shuffle``, the order is a permutation drawn with
    ``random.Random(derive_seed(seed, epoch))``. Part ``j`` of that order goes to rank
    ``j % world_size``; the last ``len(parts) % world_size`` parts are left out so every rank
    gets as many parts as the others.

    Raises:
        TypeError, ValueError: ``epoch`` is not an int >= 0, or a bad rank or world size (see
            :func:`resolve_rank`).
        ValueError: Fewer parts than ranks (but some): no rank would get one.
    """
    epoch = check_int("epoch", epoch, minimum=0)
    rank, world = resolve_rank(rank, world_size)
    order = list(parts)
    if shuffle:
        random.Random(derive_seed(seed, epoch)).shuffle(order)
    if 0 < len(order) < world:  # every rank's epoch would be empty, and nothing would say
        raise ValueError(
            f"{len(order)} parts (shards, files) cannot be shared among {world} ranks: each "
            "rank reads whole parts, as many as every other rank, so each needs one at least "
            f"(give {world} parts or more, or run fewer ranks)"
        )
    usable = len(order) - len(order) % world
    return order[rank:usable:world]


class StreamShare(Generic[T]):
    """Rank ``rank`` of ``world_size``'s share of a stream that every rank reads whole
    (``distributed=True`` over an iterable dataset), fed every sample in order, and padded so
    that every rank gets the same number of samples.

    The rule is ``DistributedSampler``'s without shuffling: rank ``r`` takes positions ``r, r +
    W, ...`` of the ``N`` samples (:func:`shard_stream_position`); the order is padded to a
    multiple of ``W`` by repeating it from its start (padded position ``p >= N`` is sample ``(p
    - N) % N``). Every rank gets ``ceil(N / W)`` samples, so with the same ``batch_size`` and
    ``drop_last`` every rank yields the same number of batches: a rank with one batch more
    would hang the next collective.

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
        return shard_stream_position(position, self.rank, self.world_size)

    def padding(self) -> list[tuple[int, T]]:
        """At the end of the stream: ``(position, sample)`` of the samples this rank repeats so
        that every rank has ``ceil(N / world_size)`` (none when the stream was empty)."""
        n, w = self._count, self.world_size
        if n == 0:
            return []
        total = -(-n // w) * w
        repeated = [(p - n) % n for p in range(n, total) if p % w == self.rank]
        return [(q, self._head[q]) for q in repeated]
