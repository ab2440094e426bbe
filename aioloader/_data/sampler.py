"""Index samplers: which dataset indices an epoch visits, in what order, in which batches.

Owns: the sequential, random and distributed samplers (the batch sampler that groups their
indices is ``batching.py``'s, re-exported here). Each is a subclass of torch's sampler of the
same name, with torch's attributes, so code that asks ``isinstance(loader.sampler,
RandomSampler)`` (Lightning, deciding whether a loader shuffles and which
``DistributedSampler`` to inject under DDP) gets torch's answer; torch's ``__init__`` is not
run (each sampler here has its own arguments and order). Never: picks a loader's sampler
(``order.py``), derives seeds (``seeds``) or decides a rank's share (``sharding``); no event
loop, no I/O, no threads.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import TypeVar

import torch
import torch.utils.data as torch_data

from .._base.checks import check_bool, check_int, check_seed
from .batching import BatchSampler, batches_of
from .seeds import derive_seed, draw_seed, epoch_permutation
from .sharding import resolve_rank, shard, shard_length

__all__ = [
    "batches_of",
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


def _data_source(length: int | Sized) -> Sized:
    """torch's ``data_source`` attribute: the dataset given, or ``range(length)``."""
    return range(length) if isinstance(length, int) else length


class SequentialSampler(torch_data.SequentialSampler):
    """Yields ``0, 1, ..., length - 1`` every epoch.

    Args:
        length: The dataset length, or the dataset itself (its length is read each epoch).

    Raises:
        TypeError: If ``length`` is neither an int nor sized.
        ValueError: If ``length`` is negative.
    """

    def __init__(self, length: int | Sized) -> None:
        self._length = _length_source(length)
        self.data_source = _data_source(self._length)  # torch's attribute

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


class RandomSampler(torch_data.RandomSampler):
    """Yields a seeded random permutation of ``range(length)`` per epoch.

    The order for epoch ``e`` is ``torch.randperm(length, generator=g)`` with
    ``g`` seeded by ``derive_seed(seed, e)``: the same seed and epoch always give
    the same order, in any process. It takes torch's ``RandomSampler``'s arguments, with
    their meaning: ``replacement`` and ``num_samples`` draw from ``g`` as torch's draws
    from its generator (``num_samples`` indices, with replacement in draws of 32; without,
    whole permutations and part of one).

    Its epoch is a loader's, or its owner's once ``set_epoch`` is called. Iterated by other
    code (a batch sampler of the user's own, a torch ``DataLoader``, a plain ``list()``), each
    iteration takes the next epoch, so each gives a new order, as torch's sampler draws a new
    one at each iteration.

    Args:
        length: The dataset length, or the dataset itself (its length is read each epoch).
        replacement: Draw indices with replacement (torch's meaning).
        num_samples: Indices an epoch yields; None for the dataset's length.
        generator: Without ``seed``, each order is drawn from it, as torch's
            ``RandomSampler`` draws (the loader saves its state as an epoch begins, and a
            resume sets it back). If both are None, the base seed is drawn from torch's
            default generator at the first order, so ``torch.manual_seed`` called before the
            first epoch makes runs repeatable.
        seed: The base seed. If given, ``generator`` is ignored.

    The ``generator`` attribute keeps torch's meaning: the generator given (without a seed)
    or assigned, else None; once one is assigned (as accelerate does to a sampler without
    one, keeping every rank's in step), each later iteration draws its order from it, and the
    seed and epoch no longer decide it.

    Raises:
        TypeError: If ``length`` or ``seed`` is not an int, ``generator`` is not a
            ``torch.Generator``, or ``replacement`` is not a bool (torch's words).
        ValueError: If ``length`` is negative, or ``num_samples`` is not a positive int
            (torch's words).
    """

    def __init__(
        self,
        length: int | Sized,
        replacement: bool = False,
        num_samples: int | None = None,
        generator: torch.Generator | None = None,
        *,
        seed: int | None = None,
    ) -> None:
        self._length = _length_source(length)
        if not isinstance(replacement, bool):  # torch's checks, in its order and words
            raise TypeError(
                f"replacement should be a boolean value, but got replacement={replacement}"
            )
        if num_samples is not None and (
            not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples <= 0
        ):
            raise ValueError(
                f"num_samples should be a positive integer value, but got num_samples={num_samples}"
            )
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {generator!r}")
        self._seed = None if seed is None else check_seed(seed)
        self._seed_from = generator  # what the seed is drawn from, at its first use
        self._epoch = 0
        self._owned = False  # set_epoch was called: the epoch is its owner's, not a loader's
        self._driven = False  # a loader sets its epoch (order.py): it takes no next one itself
        # torch's attributes (``num_samples`` is its property, over ``_num_samples``)
        self.data_source = _data_source(self._length)
        self.replacement = replacement
        self._num_samples = num_samples
        # A generator given, without a seed, draws each order as torch's does (its state at
        # an epoch's start replays it), and reads back: accelerate, which gives a sampler that
        # has none a generator of its own, keeps the user's (found by review)
        self._drawn_from: torch.Generator | None = generator if seed is None else None

    @property
    def generator(self) -> torch.Generator | None:
        """The generator assigned to draw each order from (torch's attribute), or None: the
        order is the seed's and the epoch's."""
        return self._drawn_from

    @generator.setter
    def generator(self, generator: torch.Generator | None) -> None:
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {generator!r}")
        self._drawn_from = generator

    @property
    def seed(self) -> int:
        """The base seed that, with the epoch, determines the order (drawn at its first use
        when none was given)."""
        if self._seed is None:  # (none drawn from a generator its orders are drawn from)
            drawing = self._drawn_from is not None and self._drawn_from is self._seed_from
            self._seed = 0 if drawing else draw_seed(self._seed_from)
        return self._seed

    @property
    def epoch(self) -> int:
        """The epoch whose order ``__iter__`` yields."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration yields. From the first call on, the
        epoch is its caller's, as a torch sampler's is: a loader reading this sampler runs
        the epoch it has as each epoch draws its order, and no longer sets it (until then the
        loader gives it the loader's own count).

        Args:
            epoch: The epoch number.

        Raises:
            TypeError: If ``epoch`` is not an int.
            ValueError: If ``epoch`` is negative.
        """
        self._epoch, self._owned = check_int("epoch", epoch, minimum=0), True

    @property
    def num_samples(self) -> int:
        """Indices an epoch yields (torch's attribute): ``num_samples`` as given, else the
        dataset's length now."""
        given = self._num_samples
        return _current_length(self._length) if given is None else given

    def __iter__(self) -> Iterator[int]:
        n = _current_length(self._length)
        seed, epoch = self.seed, self._epoch
        if not (self._owned or self._driven):  # nobody sets its epoch: the next one follows
            self._epoch += 1
        if self._drawn_from is None and not self.replacement and self._num_samples is None:
            return iter(epoch_permutation(n, seed, epoch))
        generator = self._drawn_from
        if generator is None:
            generator = torch.Generator()
            generator.manual_seed(derive_seed(seed, epoch))
        return _drawn_as_torch(n, self.num_samples, self.replacement, generator)

    def __len__(self) -> int:
        return self.num_samples


def _drawn_as_torch(
    n: int, num_samples: int, replacement: bool, generator: torch.Generator
) -> Iterator[int]:
    """``num_samples`` indices of ``range(n)`` drawn from ``generator`` as torch's
    ``RandomSampler`` draws them, to the generator's state after them: with replacement in
    draws of 32 (and the remainder's); without, whole permutations and then part of one (a
    last permutation drawn even where none of it is taken, as torch's is)."""
    if replacement:
        for _ in range(num_samples // 32):
            yield from torch.randint(n, (32,), dtype=torch.int64, generator=generator).tolist()
        yield from torch.randint(
            n, (num_samples % 32,), dtype=torch.int64, generator=generator
        ).tolist()
        return
    for _ in range(num_samples // n):
        yield from torch.randperm(n, generator=generator).tolist()
    yield from torch.randperm(n, generator=generator).tolist()[: num_samples % n]


class DistributedSampler(torch_data.DistributedSampler):  # type: ignore[type-arg]
    """Yields this rank's share of a (seeded, shuffled) global order.

    Follows torch's ``DistributedSampler``: the global order is
    ``RandomSampler(length, seed=seed)``'s order for the epoch when ``shuffle``,
    else ``range(length)``; it is padded by repeating indices from its start
    (or truncated when ``drop_last``) to a multiple of ``world_size``, and rank
    ``r`` takes ``order[r::world_size]``. Every rank gets ``len(self)`` indices.
    With ``shuffle=False`` the output equals torch's exactly.

    It takes torch's ``DistributedSampler``'s arguments, in torch's order:
    ``DistributedSampler(dataset, num_replicas, rank, shuffle, seed, drop_last)``.

    Args:
        length: The dataset, or its length (read once, at construction, as torch's is).
        num_replicas: The number of processes (torch's name); None to detect it.
        rank: This process's rank; None to detect it (see :func:`resolve_rank`).
        shuffle: Shuffle the global order each epoch.
        seed: The base seed; it must be the same on every rank.
        drop_last: Truncate the global order instead of padding it.
        world_size: ``num_replicas``, by aioloader's name (keyword only; give one of them).

    Raises:
        TypeError: If an argument has the wrong type, or both ``num_replicas`` and
            ``world_size`` are given.
        ValueError: If ``length < 0``, ``world_size < 1`` or ``rank`` is outside
            ``[0, world_size)``.
    """

    def __init__(
        self,
        length: int | Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        world_size: int | None = None,
    ) -> None:
        if num_replicas is not None and world_size is not None:
            raise TypeError(
                "DistributedSampler takes num_replicas (torch's name) or world_size, not both: "
                f"got num_replicas={num_replicas!r}, world_size={world_size!r}"
            )
        source = _length_source(length)
        self._source = _data_source(source)
        self._length = _current_length(source)
        self._rank, self._world_size = resolve_rank(
            rank, world_size if num_replicas is None else num_replicas
        )
        self._shuffle = check_bool("shuffle", shuffle)
        self._seed = check_seed(seed)
        self._drop_last = check_bool("drop_last", drop_last)
        self._epoch = 0
        self._owned = False  # as RandomSampler's

    # torch's attributes, read-only here (fixed at construction; the epoch by set_epoch)

    @property
    def rank(self) -> int:  # type: ignore[override]
        """This process's rank."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of processes sharing the dataset."""
        return self._world_size

    @property
    def num_replicas(self) -> int:  # type: ignore[override]
        """``world_size``, by torch's name."""
        return self._world_size

    @property
    def num_samples(self) -> int:  # type: ignore[override]
        """Indices this rank yields an epoch (torch's name for ``len(self)``)."""
        return len(self)

    @property
    def total_size(self) -> int:  # type: ignore[override]
        """Indices all ranks yield together an epoch (torch's name)."""
        return len(self) * self._world_size

    @property
    def dataset(self) -> Sized:  # type: ignore[override]
        """The dataset given (torch's attribute), or ``range(length)`` for a length."""
        return self._source

    @property
    def seed(self) -> int:  # type: ignore[override]
        """The base seed of the shuffled global order."""
        return self._seed

    @property
    def shuffle(self) -> bool:  # type: ignore[override]
        """Whether the global order is shuffled."""
        return self._shuffle

    @property
    def drop_last(self) -> bool:  # type: ignore[override]
        """Whether the global order is truncated rather than padded."""
        return self._drop_last

    @property
    def epoch(self) -> int:  # type: ignore[override]
        """The epoch whose order ``__iter__`` yields."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; call it with the same value on every rank. From the first call on,
        the epoch is its caller's (as :meth:`RandomSampler.set_epoch`).

        Args:
            epoch: The epoch number.

        Raises:
            TypeError: If ``epoch`` is not an int.
            ValueError: If ``epoch`` is negative.
        """
        self._epoch, self._owned = check_int("epoch", epoch, minimum=0), True

    def __iter__(self) -> Iterator[int]:
        if self._shuffle:
            order = epoch_permutation(self._length, self._seed, self._epoch)
        else:
            order = list(range(self._length))
        positions = shard(self._length, self._rank, self._world_size, self._drop_last)
        return iter([order[p] for p in positions])

    def __len__(self) -> int:
        return shard_length(self._length, self._world_size, self._drop_last)
