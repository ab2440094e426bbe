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
from collections.abc import Callable, Iterable, Sequence, Sized
from typing import Any

import torch

from .._base.checks import check_int
from .sampler import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler

__all__ = [
    "GENERATOR_SAMPLERS",
    "PLAIN_BATCHERS",
    "epoch_takers",
    "map_order",
    "order_generator",
    "owned_epoch",
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
        elif isinstance(dataset, Sized):
            sampler = SequentialSampler(dataset)
        else:  # torch's: its length asked for as it is used (a sampler given would not ask)
            sampler = torch.utils.data.SequentialSampler(dataset)
    if batch_size is None:
        return sampler, None
    return sampler, torch.utils.data.BatchSampler(sampler, batch_size, drop_last)


def epoch_takers(
    sampler: object, batch_sampler: object, *, given: bool
) -> list[Callable[[int], object]]:
    """What an epoch tells its number: aioloader's own samplers (given, or inside a batch
    sampler), whose order is the loader's epoch's unless their owner has called their
    ``set_epoch`` (:func:`owned_epoch`: then the epoch is the owner's, as a torch sampler's
    is); and, when the epoch was given (``loader.set_epoch``), any sampler. torch's loader
    calls none: a torch sampler's epoch is its owner's to set (the ``DistributedSampler``
    idiom; Lightning sets the one it injects), and the loader's own count would undo theirs
    (Lightning, rebuilding loaders each epoch, would see epoch 1's order again and again).
    Our ``BatchSampler`` only forwards to its sampler: not called."""
    inner = _inner(batch_sampler)
    takers: dict[int, Callable[[int], object]] = {}  # one call each (a sampler may be both)
    for obj in (sampler, inner, batch_sampler):
        set_epoch = getattr(obj, "set_epoch", None)
        if isinstance(obj, (SequentialSampler, RandomSampler, DistributedSampler)):
            if given or owned_epoch(obj) is None:  # not as its owner: it stays the loader's
                takers[id(obj)] = functools.partial(_begin_epoch, obj)
        elif callable(set_epoch) and given and not isinstance(obj, BatchSampler):
            takers[id(obj)] = set_epoch
    return list(takers.values())


def owner_epoch(sampler: object, batch_sampler: object) -> int | None:
    """The epoch of the loader's sampler (aioloader's; given, or inside a batch
    sampler) where its owner has called its ``set_epoch``, or None. A loader runs it, read
    as each epoch draws its order, as torch's loader draws it from its sampler then: torch's
    idiom, ``sampler.set_epoch(epoch)`` before each epoch, gives torch's epochs."""
    for obj in (sampler, _inner(batch_sampler)):
        epoch = owned_epoch(obj)
        if epoch is not None:
            return epoch
    return None


def owned_epoch(sampler: object) -> int | None:
    """The epoch of one of aioloader's shuffling samplers whose owner has called its
    ``set_epoch``, or None (not called yet, or another sampler). (The samplers' own module
    keeps the flag; this module decides what it means for a loader.)"""
    if isinstance(sampler, (RandomSampler, DistributedSampler)) and sampler._owned:
        return sampler._epoch
    return None


def _begin_epoch(
    sampler: RandomSampler | DistributedSampler | SequentialSampler, epoch: int
) -> None:
    """A loader's epoch ``epoch`` draws its order from ``sampler``: that epoch's (and from now
    on a random sampler's epochs are the loader's to set: it takes no next one itself)."""
    if isinstance(sampler, (RandomSampler, DistributedSampler)):
        sampler._epoch = check_int("epoch", epoch, minimum=0)
    if isinstance(sampler, RandomSampler):
        sampler._driven = True


def _inner(batch_sampler: object) -> object:
    """A batch sampler's sampler (torch's ``BatchSampler``, ours, or a subclass: the sampler a
    resume replays, ``_loader/resuming.py``), or None. Its epoch is the loader's to set, so
    that an epoch resumed replays the order it began (found by review: inside a subclass, ours
    was never set, took a new order at each iteration, and a resume read samples twice)."""
    inner: Any = batch_sampler if isinstance(batch_sampler, torch.utils.data.BatchSampler) else None
    return None if inner is None else getattr(inner, "sampler", None)


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
