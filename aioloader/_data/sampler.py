"""Index samplers: which dataset indices an epoch visits, in what order, in which batches.

Owns: the sequential, random and distributed samplers, the batch sampler that groups their
indices, :func:`map_order` (the sampler and batch sampler a loader iterates, built as torch
builds them) and :func:`order_generator` (the generator a user's sampler draws from). Never:
derives seeds (``seeds``) or decides a rank's share (``sharding``); no event loop, no I/O, no
threads.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import Any, TypeVar

import torch
from torch.utils.data import Sampler

from .._base.checks import check_bool, check_int, check_seed
from .seeds import draw_seed, epoch_permutation
from .sharding import resolve_rank, shard, shard_length

__all__ = [
    "GENERATOR_SAMPLERS",
    "map_order",
    "order_generator",
    "BatchSampler",
    "DistributedSampler",
    "RandomSampler",
    "SequentialSampler",
]

T_Part = TypeVar("T_Part")


def _length_source(length: object) -> int | Sized:
    """An int, checked; or a data source (anything with ``__len__``), whose length is read at
    each use, as torch's samplers read ``len(data_source)``: a dataset that grows is followed."""
    if isinstance(length, int) and not isinstance(length, bool):
        return check_int("length", length, minimum=0)
    if isinstance(length, Sized):
        return length
    raise TypeError(f"length must be an int or a sized data source, got {length!r}")


def _current_length(length: int | Sized) -> int:
    return length if isinstance(length, int) else len(length)


class SequentialSampler(Sampler[int]):
    """Yields ``0, 1, ..., length - 1`` every epoch.

    Args:
        length: The dataset length, or the dataset itself (its length is read each epoch).

    Raises:
        TypeError: If ``length`` is neither an int nor sized.
        ValueError: If ``length`` is negative.
    """

    def __init__(self, length: int | Sized) -> None:
        self._length = _length_source(length)

    def __iter__(self) -> Iterator[int]:
        return iter(range(_current_length(self._length)))

    def __len__(self) -> int:
        return _current_length(self._length)

    def set_epoch(self, epoch: int) -> None:
        """Accept an epoch for interface compatibility; the order never changes.

        Raises:
            TypeError: If ``epoch`` is not an int.
            ValueError: If ``epoch`` is negative.
        """
        check_int("epoch", epoch, minimum=0)


class RandomSampler(Sampler[int]):
    """Yields a seeded random permutation of ``range(length)`` per epoch.

    The order for epoch ``e`` is ``torch.randperm(length, generator=g)`` with
    ``g`` seeded by ``derive_seed(seed, e)``: the same seed and epoch always give
    the same order, in any process.

    Args:
        length: The dataset length, or the dataset itself (its length is read each epoch).
        seed: The base seed. If given, ``generator`` is ignored.
        generator: Used once, at construction, to draw the base seed when
            ``seed`` is None. If both are None, the base seed is drawn from torch's
            default generator, so ``torch.manual_seed`` makes runs repeatable.

    Raises:
        TypeError: If ``length`` or ``seed`` is not an int, or ``generator`` is
            not a ``torch.Generator``.
        ValueError: If ``length`` is negative.
    """

    def __init__(
        self,
        length: int | Sized,
        *,
        seed: int | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        self._length = _length_source(length)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {generator!r}")
        if seed is None:
            seed = draw_seed(generator)
        self._seed = check_seed(seed)
        self._epoch = 0

    @property
    def seed(self) -> int:
        """The base seed that, with the epoch, determines the order."""
        return self._seed

    @property
    def epoch(self) -> int:
        """The epoch whose order ``__iter__`` yields."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration yields.

        Args:
            epoch: The epoch number.

        Raises:
            TypeError: If ``epoch`` is not an int.
            ValueError: If ``epoch`` is negative.
        """
        self._epoch = check_int("epoch", epoch, minimum=0)

    def __iter__(self) -> Iterator[int]:
        n = _current_length(self._length)
        return iter(epoch_permutation(n, self._seed, self._epoch))

    def __len__(self) -> int:
        return _current_length(self._length)


class DistributedSampler(Sampler[int]):
    """Yields this rank's share of a (seeded, shuffled) global order.

    Follows torch's ``DistributedSampler``: the global order is
    ``RandomSampler(length, seed=seed)``'s order for the epoch when ``shuffle``,
    else ``range(length)``; it is padded by repeating indices from its start
    (or truncated when ``drop_last``) to a multiple of ``world_size``, and rank
    ``r`` takes ``order[r::world_size]``. Every rank gets ``len(self)`` indices.
    With ``shuffle=False`` the output equals torch's exactly.

    Args:
        length: The dataset length.
        rank: This process's rank; None to detect it (see :func:`resolve_rank`).
        world_size: The number of processes; None to detect it.
        shuffle: Shuffle the global order each epoch.
        seed: The base seed; it must be the same on every rank.
        drop_last: Truncate the global order instead of padding it.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If ``length < 0``, ``world_size < 1`` or ``rank`` is outside
            ``[0, world_size)``.
    """

    def __init__(
        self,
        length: int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        self._length = check_int("length", length, minimum=0)
        self._rank, self._world_size = resolve_rank(rank, world_size)
        self._shuffle = check_bool("shuffle", shuffle)
        self._seed = check_seed(seed)
        self._drop_last = check_bool("drop_last", drop_last)
        self._epoch = 0

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of processes sharing the dataset."""
        return self._world_size

    @property
    def seed(self) -> int:
        """The base seed of the shuffled global order."""
        return self._seed

    @property
    def shuffle(self) -> bool:
        """Whether the global order is shuffled."""
        return self._shuffle

    @property
    def drop_last(self) -> bool:
        """Whether the global order is truncated rather than padded."""
        return self._drop_last

    @property
    def epoch(self) -> int:
        """The epoch whose order ``__iter__`` yields."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; call it with the same value on every rank.

        Args:
            epoch: The epoch number.

        Raises:
            TypeError: If ``epoch`` is not an int.
            ValueError: If ``epoch`` is negative.
        """
        self._epoch = check_int("epoch", epoch, minimum=0)

    def __iter__(self) -> Iterator[int]:
        if self._shuffle:
            order = epoch_permutation(self._length, self._seed, self._epoch)
        else:
            order = list(range(self._length))
        positions = shard(self._length, self._rank, self._world_size, self._drop_last)
        return iter([order[p] for p in positions])

    def __len__(self) -> int:
        return shard_length(self._length, self._world_size, self._drop_last)


class BatchSampler(Sampler[list[int]]):
    """Groups the indices of another sampler into lists of ``batch_size``.

    Behaves like torch's ``BatchSampler``: every batch has ``batch_size``
    indices except possibly the last, which is dropped when ``drop_last``.

    Args:
        sampler: Any iterable of indices; ``len()`` needs it to be sized.
        batch_size: The number of indices per batch.
        drop_last: Drop the last batch if it is short.

    Raises:
        TypeError: If ``sampler`` is not iterable, ``batch_size`` is not an int
            or ``drop_last`` is not a bool.
        ValueError: If ``batch_size`` is not positive.
    """

    def __init__(self, sampler: Iterable[int], batch_size: int, drop_last: bool) -> None:
        if not isinstance(sampler, Iterable):
            raise TypeError(f"sampler must be an iterable of indices, got {sampler!r}")
        self._sampler = sampler
        self._batch_size = check_int("batch_size", batch_size, minimum=1)
        self._drop_last = check_bool("drop_last", drop_last)

    @property
    def sampler(self) -> Iterable[int]:
        """The wrapped sampler."""
        return self._sampler

    @property
    def batch_size(self) -> int:
        """The number of indices per full batch."""
        return self._batch_size

    @property
    def drop_last(self) -> bool:
        """Whether a short last batch is dropped."""
        return self._drop_last

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the wrapped sampler if it has ``set_epoch``.

        Args:
            epoch: The epoch number.
        """
        set_epoch = getattr(self._sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        indices, size = iter(self._sampler), self._batch_size
        while batch := list(itertools.islice(indices, size)):  # a batch per C-level slice
            if len(batch) < size and self._drop_last:
                return
            yield batch

    def __len__(self) -> int:
        if not isinstance(self._sampler, Sized):
            raise TypeError(f"sampler has no len(): {type(self._sampler).__name__}")
        n = len(self._sampler)
        return n // self._batch_size if self._drop_last else -(-n // self._batch_size)


def map_order(
    dataset: Any,
    is_map: bool,
    *,
    batch_size: int | None,
    shuffle: object,
    sampler: Iterable[int] | None,
    batch_sampler: Iterable[Sequence[int]] | None,
    drop_last: bool,
    rank: int | None,
    world_size: int | None,
    seed: int | None,
    generator: torch.Generator | None,
) -> tuple[Iterable[int] | None, Iterable[Sequence[int]] | None]:
    """The ``(sampler, batch_sampler)`` a loader iterates, as torch's ``DataLoader`` builds
    them (the arguments already checked): for a map-style dataset, the user's sampler, or a
    ``DistributedSampler`` (``rank``/``world_size`` given: ``distributed=True``), a
    ``RandomSampler`` (``shuffle``) or a ``SequentialSampler``, batched by a ``BatchSampler``
    when ``batch_size`` is set; a stream has neither (only the user's ``batch_sampler``, if
    any, which the checks refused for a stream)."""
    if not is_map or batch_sampler is not None:
        return None, batch_sampler
    if sampler is None:
        if rank is not None and world_size is not None:
            sampler = DistributedSampler(
                len(dataset),
                rank=rank,
                world_size=world_size,
                shuffle=bool(shuffle),
                seed=0 if seed is None else seed,
            )
        elif shuffle:  # the dataset itself: its length is read each epoch, as torch's
            sampler = RandomSampler(dataset, seed=seed, generator=generator)
        else:
            sampler = SequentialSampler(dataset)
    if batch_size is None:
        return sampler, None
    return sampler, BatchSampler(sampler, batch_size, drop_last)


def order_generator(order: object) -> torch.Generator | None:
    """The ``torch.Generator`` a user's sampler (or a batch sampler's sampler) was given to
    draw its order from (torch's ``RandomSampler``, ``SubsetRandomSampler``,
    ``WeightedRandomSampler``: ``generator=``), or None. Its state when an epoch begins
    replays the epoch's order: the loader saves it, and sets it back on resuming."""
    if isinstance(order, (BatchSampler, torch.utils.data.BatchSampler)):
        order = order.sampler
    if type(order) not in GENERATOR_SAMPLERS:  # another may draw from elsewhere too
        return None
    generator = getattr(order, "generator", None)
    return generator if isinstance(generator, torch.Generator) else None


#: torch's samplers whose order is drawn from their ``generator`` alone (by type: a subclass,
#: or another sampler with a ``generator`` attribute, may draw from elsewhere too).
GENERATOR_SAMPLERS = (
    torch.utils.data.RandomSampler,
    torch.utils.data.SubsetRandomSampler,
    torch.utils.data.WeightedRandomSampler,
)
