"""A loader's order: the sampler and batch sampler a map-style loader iterates, and the
generator an epoch's order is drawn from.

Owns: :func:`map_order` (the sampler and batch sampler, built as torch builds them),
:func:`epoch_takers` (which samplers an epoch tells its number), :func:`owner_epoch` (the
epoch a sampler's owner chose) and :func:`order_generator` (the generator a sampler draws its
order from, whose state replays an epoch). Never: the samplers themselves (``sampler.py``); no
event loop, no I/O, no threads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from .sampler import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    begin_epoch,
    chosen_epoch,
)

__all__ = [
    "GENERATOR_SAMPLERS",
    "PLAIN_BATCHERS",
    "epoch_takers",
    "map_order",
    "order_generator",
    "owner_epoch",
]

#: The batch samplers whose batches are their sampler's indices in lists of ``batch_size``
#: (by exact type: a subclass may batch otherwise). The loader's own is torch's class itself:
#: Lightning and Fabric rebuild a loader around its ``DistributedSampler`` only when
#: ``type(loader.batch_sampler) is torch.utils.data.BatchSampler`` (else they rebuild the batch
#: sampler and pass ``sampler=None, batch_size=1``, and ``loader.sampler.set_epoch`` fails).
PLAIN_BATCHERS = (torch.utils.data.BatchSampler, BatchSampler)


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
    ``RandomSampler`` (``shuffle``) or a ``SequentialSampler``, batched by torch's
    ``BatchSampler`` when ``batch_size`` is set; a stream has neither (only the user's
    ``batch_sampler``, if any, which the checks refused for a stream)."""
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
    return sampler, torch.utils.data.BatchSampler(sampler, batch_size, drop_last)


def epoch_takers(
    sampler: object, batch_sampler: object, *, given: bool
) -> list[Callable[[int], object]]:
    """What an epoch tells its number: aioloader's own samplers (given, or inside a plain
    batch sampler), whose order is the loader's epoch's (:func:`begin_epoch`, called last: a
    user's ``set_epoch`` that forwards to ours is overruled, not taken as the owner's
    choice); and, when the epoch was given (``loader.set_epoch``), any other's ``set_epoch``.
    torch's loader calls none: a torch sampler's epoch is its owner's to set (the
    ``DistributedSampler`` idiom; Lightning sets the one it injects), and the loader's own
    count would undo theirs (Lightning, rebuilding loaders each epoch, would see epoch 1's
    order again and again). Our ``BatchSampler`` only forwards to its sampler: not called."""
    inner = _plain_inner(batch_sampler)
    theirs: dict[int, Callable[[int], object]] = {}  # one call each (a sampler may be both)
    ours: dict[int, Callable[[int], object]] = {}
    for obj in (sampler, inner, batch_sampler):
        set_epoch = getattr(obj, "set_epoch", None)
        if isinstance(obj, (SequentialSampler, RandomSampler, DistributedSampler)):
            ours[id(obj)] = functools.partial(begin_epoch, obj)
        elif callable(set_epoch) and given and not isinstance(obj, BatchSampler):
            theirs[id(obj)] = set_epoch
    return [*theirs.values(), *ours.values()]


def owner_epoch(sampler: object, batch_sampler: object) -> int | None:
    """The epoch the owner of the loader's sampler (aioloader's; given, or inside a plain batch
    sampler) chose with its ``set_epoch`` since the loader last began an epoch, or None: the
    loader runs it next (torch's idiom, ``sampler.set_epoch(epoch)`` before each epoch, then
    gives each epoch its owner's order, a loader rebuilt each epoch included)."""
    inner = _plain_inner(batch_sampler)
    for obj in (sampler, inner):
        chosen = chosen_epoch(obj)
        if chosen is not None:
            return chosen
    return None


def _plain_inner(batch_sampler: object) -> object:
    """A plain batch sampler's sampler, or None."""
    plain: Any = batch_sampler if type(batch_sampler) in PLAIN_BATCHERS else None
    return None if plain is None else plain.sampler


def order_generator(order: object) -> torch.Generator | None:
    """The ``torch.Generator`` a user's sampler (or a batch sampler's sampler) was given to
    draw its order from (torch's ``RandomSampler``, ``SubsetRandomSampler``,
    ``WeightedRandomSampler``: ``generator=``), or None. Its state when an epoch begins
    replays the epoch's order: the loader saves it, and sets it back on resuming."""
    if isinstance(order, torch.utils.data.BatchSampler):  # ours included
        order = order.sampler
    if isinstance(order, RandomSampler):  # ours: None unless one was assigned
        return order.generator
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
