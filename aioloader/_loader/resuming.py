"""How a loader goes on from a saved state, and a map-style epoch's batches when it does.

Owns: :func:`check_resumable` (whether a loader can resume at all, and :func:`not_replayable`:
what in a sampler may give another order when iterated again), :func:`resolve` (a state checked
against a loader's settings and made this rank's) and :func:`resumed_batches` (the same batches
with the same places when the world size is the same; the remainder re-divided among the new
ranks when it is not). Never: reads or writes a state document (``checkpoint.py``) or decides
the elastic rule (``_data/resume.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch.utils.data as tud

from .._data.datapipes import draws_seeds, has_random_pipes
from .._data.order import GENERATOR_SAMPLERS, PLAIN_BATCHERS, order_generator
from .._data.resume import Layer, Taken, numbered, rank_batches, remainder
from .._data.sampler import RandomSampler, batches_of
from .._data.seeds import epoch_permutation
from .._data.source import InWorkers, dataset_length
from .._data.streams import BlockingStream, StreamSource, is_resumable
from .checkpoint import EpochState
from .plan import LoaderPlan

__all__ = [
    "check_resumable",
    "check_place",
    "not_replayable",
    "resolve",
    "resumed_batches",
]


def not_replayable(order: object) -> object | None:
    """What in ``order`` (a sampler or batch sampler) may give other batches when iterated
    again after ``set_epoch`` with the same epoch, or None: ours, torch's sequential and
    distributed samplers, a sequence of indices, a sampler given a ``generator`` (its state is
    saved: :func:`order_generator`) and a batch sampler over one of those replay their
    order."""
    replays = (RandomSampler, tud.SequentialSampler, tud.DistributedSampler, range, list, tuple)
    if isinstance(order, replays) or order_generator(order) is not None:  # ours subclass torch's
        return None
    if isinstance(order, tud.BatchSampler):  # ours included
        return not_replayable(order.sampler)
    return order


def _fast_batches(
    sampler: Iterable[int], batch_size: int, drop_last: bool, taken: Taken
) -> Iterator[tuple[int, list[int]]]:
    """A plain batch sampler's batches from ``taken.through`` on, a C-level slice each: the
    samples before it skipped in one (a 10-million-sample order in well under a second)."""
    indices = iter(sampler)
    start = taken.through
    next(itertools.islice(indices, start * batch_size, start * batch_size), None)
    for seq, batch in enumerate(batches_of(indices, batch_size, drop_last), start):
        if seq not in taken.beyond:
            yield seq, batch


def resumed_batches(
    sampler: Iterable[int] | None,
    batch_sampler: Iterable[Sequence[int]] | None,
    state: EpochState | None,
    *,
    rank: int,
    world_size: int,
) -> Iterator[tuple[int, list[int]]]:
    """The ``(seq, indices)`` of a map-style epoch's batches (``set_epoch`` already called),
    those ``state`` says were taken left out. With ``state.layers``, the epoch is the
    remainder those layers left, re-divided among ``world_size`` ranks."""
    taken = state.taken if state is not None else None
    if state is not None and state.layers:
        if state.length is None:  # pragma: no cover - checked when the state was loaded
            raise ValueError("an elastic state needs the dataset's length")
        if state.order_seed is None:
            order = np.arange(state.length, dtype=np.int64)
        else:
            order = np.asarray(
                epoch_permutation(state.length, state.order_seed, state.epoch), dtype=np.int64
            )
        rest = remainder(order, state.layers)
        batches = rank_batches(rest, rank, world_size, state.batch_size, state.drop_last)
        return numbered(batches, taken)
    if batch_sampler is None:
        if sampler is None:  # pragma: no cover - a map-style plan has one of them
            raise ValueError("a map-style epoch needs a sampler")
        if taken is not None and taken.through:
            return _fast_batches(sampler, 1, False, taken)
        return numbered(([i] for i in sampler), taken)
    if type(batch_sampler) in PLAIN_BATCHERS:  # its attributes read now, as torch's are
        plain: Any = batch_sampler
        return _fast_batches(plain.sampler, plain.batch_size, plain.drop_last, taken or Taken())
    return numbered(batch_sampler, taken)


def resolve(plan: LoaderPlan, s: EpochState) -> EpochState:
    """``s`` as this rank resumes it: its own record, or a merged (or world-of-one) state
    made this rank's.

    Raises:
        ValueError: ``s`` does not fit the loader's settings (named), or is one rank's of
            several, loaded with another world size or rank.
    """
    if s.map != plan.kind.is_map:
        kind = "map-style" if s.map else "stream"
        raise ValueError(f"the state is of a {kind} dataset; this loader's is not")
    if s.map:
        length = dataset_length(plan.dataset)
        if s.length != length:
            raise ValueError(
                f"the state is of a dataset of {s.length} samples; this one has {length}"
            )
    for name, saved, mine in zip(
        ("batch_size", "drop_last"), (s.batch_size, s.drop_last), plan.batching, strict=True
    ):
        if saved != mine:
            raise ValueError(f"the state was saved with {name}={saved}; this loader has {mine}")
    if plan.ours and (s.order_seed is None) != (plan.order_seed is None):
        raise ValueError(
            f"the state was saved with shuffle={s.order_seed is not None}; this loader has "
            f"shuffle={plan.order_seed is not None}"
        )
    if s.sampler is not None and order_generator(plan.order) is None:
        raise ValueError(
            "the state holds a sampler's generator state (state['sampler']); this loader's "
            "sampler was given no generator"
        )
    world, rank = plan.world_size, plan.rank
    elastic = s.merged or (s.world_size == 1 and world > 1)  # re-divides the seed's order
    if s.sampler is None and order_generator(plan.order) is not None and not elastic:
        raise ValueError(
            "this loader's sampler draws its order from a generator; the state holds no "
            "generator state (state['sampler']) to replay that order from (it was saved by a "
            "loader whose sampler had none)"
        )
    if plan.arguments.seed is not None and s.seed != plan.arguments.seed:
        raise ValueError(
            f"the state was saved with seed={s.seed}; this loader has {plan.arguments.seed}"
        )
    if elastic:
        if not plan.ours:
            raise ValueError(
                "an elastic resume (another world size, or a merged state) re-divides the "
                "loader's own order; this loader was given a sampler or batch sampler"
            )
        if s.sampler is not None:
            raise ValueError(
                "an elastic resume (another world size, or a merged state) re-divides the "
                "loader's seeded order; this state's order was drawn from a generator assigned "
                "to its sampler"
            )
        layers = list(s.layers)
        if not s.merged:
            layers.append(Layer(1, s.batch_size or 1, s.drop_last, {0: s.taken}))
        last = layers[-1]
        if last.world_size == world:  # the same ranks again: each goes on with its own record
            s = dataclasses.replace(s, taken=last.taken[rank].copy(), layers=layers[:-1])
        else:
            s = dataclasses.replace(s, taken=Taken(), layers=layers)
        # `samples` counts this rank's from here (a merged state's are every rank's).
        return dataclasses.replace(s, world_size=world, rank=rank, stream=None, samples=0)
    if (s.world_size, s.rank) != (world, rank):
        raise ValueError(
            f"the state is rank {s.rank}'s of a world of {s.world_size}; this loader is rank "
            f"{rank} of {world}: combine every rank's state with aioloader.merge_states() "
            "and load that"
        )
    return s


def check_resumable(plan: LoaderPlan) -> None:
    """What makes a loader unable to resume whatever its place (an order or a stream whose
    place where batches were taken is checked by :func:`check_place`, once it is known).

    Raises:
        TypeError: The loader cannot resume, named (see ``DataLoader.state_dict``).
    """
    name = type(plan.dataset).__qualname__
    if not plan.kind.is_map:
        if plan.world_size > 1:
            raise TypeError(
                f"the loader cannot resume: its stream {name} is split across ranks by "
                "distributed=True; split it in the dataset instead (tar_shards(rank=, "
                "world_size=)), where each rank resumes its own part"
            )
        return


def check_place(plan: LoaderPlan, state: EpochState, *, resumable: bool | None = None) -> None:
    """``state`` can be gone on from: nothing of its epoch was taken yet (an epoch's start is
    a state for any dataset and order), or a map-style order replays, or a stream's place was
    saved with the batches taken. ``resumable``: whether the stream's passes were seen to keep
    a state (``Progress.resumable``); None for a state being loaded, whose stream was checked
    when it was saved.

    Raises:
        TypeError: Batches were taken from an order that may be another when iterated again
            (a user's sampler drawing from torch's global generator, say), or from a stream
            that keeps no state (neither the dataset nor, for a blocking one, the iterator its
            ``__iter__`` gives defines ``state_dict``/``load_state_dict``), named.
    """
    if not len(state.taken):
        return
    if plan.kind.is_map:
        culprit = None if plan.ours else not_replayable(plan.order)
        if culprit is None:
            return
        hint = ""
        if type(culprit) in GENERATOR_SAMPLERS:  # torch's random samplers, given no generator
            hint = "give it a torch.Generator (generator=: its state is saved), or "
        raise TypeError(
            f"the loader cannot resume: its {type(culprit).__qualname__} may give another "
            f"order when iterated again; {hint}use shuffle=True with seed=, or one of "
            "aioloader's samplers"
        )
    if draws_seeds(plan.dataset, plan.arguments.seed) and has_random_pipes(plan.dataset):
        raise TypeError(
            f"the loader cannot resume: its DataPipe {type(plan.dataset).__qualname__} is "
            "seeded at each epoch from torch's generator, and a resumed epoch would be shuffled "
            "anew; pass seed= (each epoch's pipe seed is then derived from it and the epoch)"
        )
    if state.stream is not None or resumable is None or resumable:
        return  # (resumable with no mark: its first batches failed; read again from its start)
    if is_resumable(plan.dataset):
        return
    name = type(plan.dataset).__qualname__
    if isinstance(plan.source, InWorkers):
        raise TypeError(
            f"the loader cannot resume: its iterable dataset {name} is read in worker "
            "processes, and neither it nor the iterator its __iter__() gives defines "
            "state_dict()/load_state_dict(); define both on one of them (each worker's copy "
            "gives its own place, see docs/design.md, 'Resuming')"
        )
    if isinstance(plan.source, StreamSource) and plan.source.resumable:
        return
    if isinstance(plan.source, BlockingStream):
        raise TypeError(
            f"the loader cannot resume: its dataset {name} is a stream, and neither it nor "
            "the iterator its __iter__() gives defines state_dict()/load_state_dict(); "
            "define both on one of them (see docs/design.md, 'Resuming')"
        )
    raise TypeError(
        f"the loader cannot resume: its dataset {name} is a stream without "
        "state_dict()/load_state_dict() (an async generator cannot be resumed); "
        "define both on the dataset (see docs/design.md, 'Resuming')"
    )
