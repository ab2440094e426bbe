"""Where an epoch stands, and how it goes on: the pure decisions behind ``state_dict()``.

Owns: :class:`Taken` (the batches of an epoch the consumer has had, by their place in the
epoch: a watermark and the few taken past it), :func:`numbered` (an epoch's batches with their
places, those taken left out), and the elastic rule: :class:`Layer` (one world size's pass over
an order, and what each of its ranks took), :func:`remainder` (the samples no rank of any
layer took, in the order's order) and :func:`rank_batches` (a rank's batches of such a
remainder, by ``DistributedSampler``'s rule). Never: reads a dataset, keeps a clock, or knows
the loader; no event loop, no I/O, no threads.

Why a watermark and not a position: with ``in_order=False`` batches are taken out of order, so
"batches ``0..k``" does not describe what the consumer had; ``through`` (every batch before it
taken) and ``beyond`` (those taken after it) does, in a size bounded by the batches in flight.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np

__all__ = ["Layer", "Mark", "Taken", "numbered", "rank_batches", "remainder", "share_positions"]

#: ``(seq, samples, stream mark)``: a batch a consumer takes, by place; the stream mark is
#: ``(next seq, position, dataset state)`` after the batch, for a resumable stream, else None.
Mark = tuple[int, int, "tuple[int, int, Any] | None"]


class Taken:
    """The batches of one epoch the consumer has taken, by their place (``seq``) in the epoch:
    every place below :attr:`through`, and those in :attr:`beyond`.

    Raises (``from_json``): TypeError or ValueError, naming ``where``, for a malformed record.
    """

    __slots__ = ("beyond", "through")

    def __init__(self, through: int = 0, beyond: Iterable[int] = ()) -> None:
        self.through = through
        self.beyond = set(beyond)

    def add(self, seq: int) -> None:
        """The batch at ``seq`` was taken."""
        if seq != self.through:
            self.beyond.add(seq)
            return
        through = seq + 1
        beyond = self.beyond
        while through in beyond:
            beyond.discard(through)
            through += 1
        self.through = through

    def __contains__(self, seq: int) -> bool:
        return seq < self.through or seq in self.beyond

    def __len__(self) -> int:
        """How many batches were taken."""
        return self.through + len(self.beyond)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Taken):
            return NotImplemented
        return self.through == other.through and self.beyond == other.beyond

    def __repr__(self) -> str:
        return f"Taken(through={self.through}, beyond={sorted(self.beyond)})"

    def copy(self) -> Taken:
        return Taken(self.through, self.beyond)

    def to_json(self) -> dict[str, Any]:
        return {"through": self.through, "beyond": sorted(self.beyond)}

    @classmethod
    def from_json(cls, record: object, where: str) -> Taken:
        if not isinstance(record, Mapping):
            raise TypeError(f"{where} must be a mapping with 'through' and 'beyond'")
        through, beyond = record.get("through"), record.get("beyond")
        if not _is_count(through) or not isinstance(beyond, list):
            raise ValueError(f"{where} must have an int 'through' >= 0 and a list 'beyond'")
        if not all(_is_count(s) and s > through for s in beyond):
            raise ValueError(f"{where}['beyond'] must list ints above 'through' ({through})")
        return cls(through, beyond)


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def numbered(
    batches: Iterable[Sequence[int]], taken: Taken | None = None
) -> Iterator[tuple[int, list[int]]]:
    """``(seq, indices)`` for each non-empty batch of ``batches`` (an empty one has no place:
    a bucketing batch sampler may give them), leaving out those ``taken`` holds."""
    seq = 0
    for indices in batches:
        ids = list(indices)
        if not ids:
            continue
        if taken is None or seq not in taken:
            yield seq, ids
        seq += 1


def share_positions(n: int, rank: int, world_size: int) -> np.ndarray:
    """The positions in an order of ``n`` samples that ``rank`` takes by ``DistributedSampler``'s
    rule: ``rank, rank + W, ...``, ``ceil(n / W)`` of them, the order padded by repeating it
    from its start (a padded position wraps round: ``p % n``). Empty when ``n`` is 0."""
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    count = -(-n // world_size)
    return (rank + world_size * np.arange(count, dtype=np.int64)) % n


def _batch_bounds(share: int, batch_size: int, drop_last: bool) -> int:
    """How many of a share's samples its batches hold (a short last batch dropped or not)."""
    return share - share % batch_size if drop_last else share


@dataclass(frozen=True, slots=True)
class Layer:
    """One world size's pass over an order: ``world_size`` ranks, each taking its share by
    ``DistributedSampler``'s rule and batching it by ``batch_size`` (``drop_last``: a short last
    batch dropped); ``taken`` holds what each rank's consumer took. A layer is complete when it
    holds every rank (``merge_states`` builds one from the ranks' states)."""

    world_size: int
    batch_size: int
    drop_last: bool
    taken: Mapping[int, Taken]

    @property
    def complete(self) -> bool:
        return set(self.taken) == set(range(self.world_size))

    def consumed(self, n: int) -> np.ndarray:
        """A mask over an order of ``n``: the samples some rank of this layer took."""
        mask = np.zeros(n, dtype=bool)
        if n == 0:
            return mask
        b = self.batch_size
        for rank, taken in self.taken.items():
            share = share_positions(n, rank, self.world_size)
            held = _batch_bounds(len(share), b, self.drop_last)
            mask[share[: min(taken.through * b, held)]] = True
            for seq in taken.beyond:
                mask[share[seq * b : min((seq + 1) * b, held)]] = True
        return mask

    def to_json(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "taken": {str(r): t.to_json() for r, t in sorted(self.taken.items())},
        }

    @classmethod
    def from_json(cls, record: object, where: str) -> Layer:
        if not isinstance(record, Mapping):
            raise TypeError(f"{where} must be a mapping")
        world, size, drop = (record.get(k) for k in ("world_size", "batch_size", "drop_last"))
        if not (_is_count(world) and world >= 1 and _is_count(size) and size >= 1):
            raise ValueError(f"{where} needs ints 'world_size' >= 1 and 'batch_size' >= 1")
        if not isinstance(drop, bool):
            raise TypeError(f"{where}['drop_last'] must be a bool")
        taken = record.get("taken")
        if not isinstance(taken, Mapping):
            raise TypeError(f"{where}['taken'] must map ranks to taken batches")
        ranks: dict[int, Taken] = {}
        for key, value in taken.items():
            if not (isinstance(key, str) and key.isdigit() and int(key) < world):
                raise ValueError(f"{where}['taken'] has a rank {key!r} outside [0, {world})")
            ranks[int(key)] = Taken.from_json(value, f"{where}['taken'][{key!r}]")
        return cls(world, size, drop, ranks)


def remainder(order: np.ndarray, layers: Sequence[Layer]) -> np.ndarray:
    """The samples of ``order`` that no rank of ``layers`` took, in ``order``'s order: each
    layer passed over what the layers before it left.

    Raises:
        ValueError: A layer is not complete (a rank's record is missing).
    """
    for i, layer in enumerate(layers):
        if not layer.complete:
            missing = sorted(set(range(layer.world_size)) - set(layer.taken))
            raise ValueError(f"layer {i} of the state lacks ranks {missing}")
        order = order[~layer.consumed(len(order))]
    return order


def rank_batches(
    order: np.ndarray, rank: int, world_size: int, batch_size: int | None, drop_last: bool
) -> Iterator[list[int]]:
    """``rank``'s batches of ``order`` (a remainder): its share by ``DistributedSampler``'s rule,
    in batches of ``batch_size`` (None: each sample alone), a short last one dropped when
    ``drop_last``. Every rank gets as many batches as the others."""
    share = order[share_positions(len(order), rank, world_size)].tolist()
    size = batch_size or 1
    it = iter(share)
    while batch := list(itertools.islice(it, size)):
        if len(batch) < size and drop_last:
            return
        yield batch
