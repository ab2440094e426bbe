"""Every rank's state of a run combined for the next run's ranks: :func:`merge_states`.

Owns: the checks that the states are one run's ranks, the map-style merge (every rank's record
as the epoch's last layer, re-divided by each new rank as it resumes) and the stream merge
(what each old rank left of its stream, dealt to the new ranks now, one state each). Never:
decides what is left or how it is dealt (``_data/resume.py``, ``_data/restream.py``), or reads
a dataset.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, overload

from .._base.checks import check_int
from .._data.restream import redivide_states
from .._data.resume import Layer, Taken
from .checkpoint import EpochState

__all__ = ["merge_states"]


@overload
def merge_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]: ...


@overload
def merge_states(
    states: Sequence[Mapping[str, Any]], *, world_size: int
) -> list[dict[str, Any]]: ...


def merge_states(
    states: Sequence[Mapping[str, Any]], *, world_size: int | None = None
) -> dict[str, Any] | list[dict[str, Any]]:
    """Combine the states of every rank of a run for the ranks of the next run (the same
    number of ranks or another).

    Gather the ranks' ``state_dict()`` however suits you: saved one file per rank, or
    ``torch.distributed.all_gather_object`` before saving one file.

    Map-style: ``merge_states(states)`` is one state that each new rank loads with its own
    ``rank`` and ``world_size``; the remaining samples are re-divided by ``DistributedSampler``'s
    rule (padding included), every rank yielding as many batches. With ``world_size=W``, a
    list of ``W`` copies of it.

    A stream (``tar_shards``, split across ranks by its own ``rank``/``world_size`` or by
    ``torch.distributed``): ``merge_states(states, world_size=W)`` deals what every old rank
    left (the rest of each open shard from its byte offset, each sample its shuffle buffer
    held, its unopened shards) to ``W`` new ranks, and returns their states: rank ``k`` loads
    ``states[k]`` (its ``tar_shards`` must be rank ``k`` of ``W``). Together the new ranks take
    every sample the old ones had not taken, once; not in the old order, and not as many each
    (whole pieces are dealt, nothing is padded, as with ``tar_shards``' own split). It may be
    done again, within the same epoch, from the new ranks' states. With ``drop_last=True``
    each rank's short last batch is dropped, so the samples lost are the new ranks' tails.

    Raises:
        TypeError, ValueError: A state is malformed; the states are not of one run's ranks
            (different epochs, datasets, seeds or batch sizes, map-style and stream mixed), a
            rank is missing or given twice; or, for a stream: no ``world_size``, a stream that
            cannot be re-divided (its state names no split and pieces: ``interleave()``,
            ``object_stream``, a user's stream), one split by ``distributed=True``, or batches
            taken out of order (``in_order=False``) past the last one taken in order.
    """
    if isinstance(states, (Mapping, str, bytes)) or not isinstance(states, Sequence):
        raise TypeError("states must be a list of DataLoader.state_dict() results, one per rank")
    world = None if world_size is None else check_int("world_size", world_size, minimum=1)
    if not states:
        raise ValueError("states is empty: give the state of every rank")
    given: list[EpochState] = []
    for i, document in enumerate(states):
        try:
            given.append(EpochState.from_json(document))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"states[{i}]: {exc}") from None
    streams = [i for i, s in enumerate(given) if not s.map]
    if streams:
        i = streams[0]
        if len(streams) != len(given):
            j = next(j for j, s in enumerate(given) if s.map)
            raise ValueError(f"states[{i}] is of a stream, states[{j}] of a map-style dataset")
        if world is None:
            raise ValueError(
                f"states[{i}] is of a stream: what its ranks left is dealt to the new ranks "
                "now, so merge_states needs their number: merge_states(states, world_size=W) "
                "gives one state per new rank"
            )
        return _merge_streams(given, world)
    merged = _merge_map(given)
    return merged if world is None else [copy.deepcopy(merged) for _ in range(world)]


def _merge_map(given: list[EpochState]) -> dict[str, Any]:
    read = _as_one_epoch(given)
    first = read[0]
    for i, s in enumerate(read):
        if s.merged:
            raise ValueError(f"states[{i}] is already merged")
        for key in ("epoch", "seed", "order_seed", "length", "batch_size", "drop_last"):
            if getattr(s, key) != getattr(first, key):
                raise ValueError(
                    f"states[{i}][{key!r}] is {getattr(s, key)!r}, states[0]'s is "
                    f"{getattr(first, key)!r}: the states are not of one run's ranks"
                )
        if s.world_size != first.world_size or s.layers != first.layers:
            raise ValueError(
                f"states[{i}] ran with world_size {s.world_size}, states[0] with "
                f"{first.world_size} (or after other elastic resumes): not one run's ranks"
            )
    ranks = sorted(s.rank for s in read if s.rank is not None)
    if ranks != list(range(first.world_size)):
        raise ValueError(
            f"states hold ranks {ranks}; a run of world_size {first.world_size} needs each of "
            f"0..{first.world_size - 1} once"
        )
    batch = first.batch_size or 1
    layer = Layer(
        first.world_size,
        batch,
        first.drop_last,
        {s.rank: s.taken for s in read if s.rank is not None},
    )
    merged = dataclasses.replace(  # every rank's record, as the epoch's last layer
        first,
        rank=None,
        taken=Taken(),
        samples=sum(s.samples for s in read),
        layers=[*first.layers, layer],
        stream=None,
    )
    return merged.to_json()


def _merge_streams(given: list[EpochState], world: int) -> list[dict[str, Any]]:
    """Each new rank's state: what every old rank's stream left, dealt (``redivide_states``).

    A rank's stream goes on from the mark of its last batch taken in order; a rank whose last
    batches came after its stream's end (the short tail) took all it had, as did one whose
    state is the next epoch's start."""
    first = given[0]
    epochs = sorted({s.epoch for s in given})
    if len(epochs) > 2 or epochs[-1] > epochs[0] + 1:
        raise ValueError(f"states are at different epochs: {epochs}")
    left: list[tuple[Mapping[str, Any], bool]] = []
    for i, s in enumerate(given):
        if s.world_size != 1:
            raise ValueError(
                f"states[{i}] is rank {s.rank} of {s.world_size} of a stream split by "
                "distributed=True, which cannot be resumed (split it in the dataset: "
                "tar_shards(rank=, world_size=), or torch.distributed's, by default)"
            )
        # Not the loader's seed: a stream's order is its dataset's (whose seed is checked with
        # its state); the loader's decides per-batch seeds only, drawn per rank unless given.
        for key in ("batch_size", "drop_last"):
            if getattr(s, key) != getattr(first, key):
                raise ValueError(
                    f"states[{i}][{key!r}] is {getattr(s, key)!r}, states[0]'s is "
                    f"{getattr(first, key)!r}: the states are not of one run's ranks"
                )
        if s.stream is None or not isinstance(s.stream[2], Mapping):
            raise ValueError(
                f"states[{i}] is of a stream that names no place it could be re-divided from "
                "(its dataset has no state of its own before its first batch): only "
                "tar_shards' states can be re-divided; resume it with the world size it ran "
                "with (each rank its own state)"
            )
        seq, _, dataset = s.stream
        if s.epoch > epochs[0]:  # the next epoch's start: it took all it had
            if len(s.taken) or seq:
                raise ValueError(
                    f"states[{i}] is into epoch {s.epoch} while others are in {epochs[0]}: "
                    "save every rank's state at the same step"
                )
            left.append((dataset, True))
            continue
        if s.taken.beyond:
            raise ValueError(
                f"states[{i}] took batches {sorted(s.taken.beyond)} out of order "
                f"(in_order=False), past batch {s.taken.through - 1}: which samples they held "
                "cannot be told from its stream's state, so it cannot be re-divided (resume "
                "it with the world size it ran with, or save with in_order=True)"
            )
        left.append((dataset, seq < s.taken.through))  # batches past the end: all taken
    epoch = epochs[0] if not all(done for _, done in left) else epochs[0] + 1
    new = redivide_states(left, world, epoch)
    return [
        dataclasses.replace(
            first,
            epoch=epoch,
            world_size=1,
            rank=0,
            taken=Taken(),
            samples=0,
            layers=[],
            stream=(0, 0, dataset),
        ).to_json()
        for dataset in new
    ]


def _as_one_epoch(states: list[EpochState]) -> list[EpochState]:
    """The states of one epoch: a rank that saw its epoch end saved the start of the next one
    (nothing taken); beside ranks still in that epoch it is a rank that took every batch.

    Raises:
        ValueError: The states are more than an epoch apart, or a rank is into the next epoch.
    """
    epochs = sorted({s.epoch for s in states})
    if len(epochs) == 1:
        return states
    if len(epochs) > 2 or epochs[1] != epochs[0] + 1:
        raise ValueError(f"states are at different epochs: {epochs}")
    during = next(s for s in states if s.epoch == epochs[0])
    every = Taken((during.length or 0) + 1)  # more batches than any share has
    merged = []
    for s in states:
        if s.epoch == epochs[0]:
            merged.append(s)
        elif len(s.taken) or s.stream is not None:
            raise ValueError(
                f"rank {s.rank}'s state is into epoch {s.epoch} while others are in "
                f"{epochs[0]}: save every rank's state at the same step"
            )
        else:
            merged.append(dataclasses.replace(during, rank=s.rank, taken=every.copy()))
    return merged
