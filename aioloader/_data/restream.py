"""What the ranks of a stream read in parts (tar shards) have left of an epoch, re-divided among
another number of ranks: the pure decision behind resuming a stream on a new world size.

Owns: :class:`Piece` (a run of a part's items: from a byte offset, or from the part's start
passing over some items; to the part's end or for a count), :class:`RankLeft` (where one rank
stood: its pieces in reading order, the interleave's next piece, how far each open piece was
taken, the samples its shuffle buffer held) with :meth:`RankLeft.from_state` (read from a
``tar_shards`` state), :func:`pieces_left` and :func:`redivide`; and the part of a stream's
state that says what its rank reads (:func:`split_pieces`, :func:`state_pieces`, the
``SPLIT_KEYS``), with :func:`redivide_states` (every old rank's state to each new rank's).
Never: reads a part, knows a format or a transport, or keeps a clock; no event loop, no I/O.

A re-dividable state (``tar_shards``' since issue 26) names, besides where its epoch stands,
what its rank reads: ``"split": [rank, world_size]`` (the dataset's own split), ``"pieces"``
(the rank's pieces, ``[[part, start, skip, count], ...]``, or null: its parts of the split,
whole, in the epoch's order, which ``"shards"``, ``"seed"`` and ``"shuffle_shards"`` decide)
and ``"dataset"`` (a digest of every part's name and the split's seed and shuffle: the same on
every rank of one run). A fresh epoch and a re-divided one are the same thing, a rank's list of
pieces; null only keeps a state small when nothing was re-divided.

Exact by construction: what a rank has left is its unopened pieces, the rest of each open piece
(from the byte after its last item taken, or, where offsets are unknown, passing over the
items taken) and each sample its shuffle buffer held (a piece of one item). Every item of the
epoch not yet taken is in exactly one piece of exactly one new rank, and nothing taken is in
any. What it cannot keep is the order: the new ranks read their pieces in a new interleave.
Nothing is padded: ranks get as many pieces as the dealing gives them (one more for the first
``len % world`` ranks), and, as with ``tar_shards``' own split, not as many samples.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._base.checks import check_int
from .sharding import epoch_parts

__all__ = [
    "SPLIT_KEYS",
    "Piece",
    "RankLeft",
    "pieces_left",
    "redivide",
    "redivide_states",
    "split_pieces",
    "state_pieces",
]

#: What a re-dividable stream state says its rank reads (see the module).
SPLIT_KEYS = ("epoch", "shards", "dataset", "seed", "shuffle_shards", "split", "pieces")


@dataclass(frozen=True, slots=True)
class Piece:
    """A run of part ``part``'s items: read from byte ``start`` (None: from the part's start),
    pass over ``skip`` items, then take ``count`` items (None: to the part's end)."""

    part: int
    start: int | None = None
    skip: int = 0
    count: int | None = None

    def after(self, taken: int, end: int | None) -> Piece | None:
        """The rest of this piece once ``taken`` of its items were taken, the last ending
        before byte ``end`` (None: unknown, as in a compressed shard); None if nothing is left.
        """
        count = None if self.count is None else self.count - taken
        if count is not None and count <= 0:
            return None
        if end is not None:
            return Piece(self.part, end, 0, count)
        return Piece(self.part, self.start, self.skip + taken, count)

    def item(self, place: int, at: int | None) -> Piece:
        """Its item ``place`` (counted from the piece's first), which starts at byte ``at``
        (None: unknown), as a piece of one item."""
        if at is not None:
            return Piece(self.part, at, 0, 1)
        return Piece(self.part, self.start, self.skip + place, 1)

    def to_json(self) -> list[int | None]:
        return [self.part, self.start, self.skip, self.count]

    @classmethod
    def from_json(cls, value: object) -> Piece:
        """Raises: ValueError: ``value`` is not ``[part, start, skip, count]``."""
        if not (isinstance(value, list | tuple) and len(value) == 4):
            raise ValueError(f"a piece must be [part, start, skip, count], got {value!r}")
        part, start, skip, count = value
        fields = (part, skip, *(v for v in (start, count) if v is not None))
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in fields):
            raise ValueError(f"a piece must be [part, start, skip, count], got {value!r}")
        return cls(part, start, skip, count)


@dataclass(frozen=True, slots=True)
class RankLeft:
    """Where one rank of a parts stream stood in its epoch.

    Attributes:
        plan: Its pieces, in the order its interleave takes them.
        next_part: The interleave's next piece: ``plan[next_part:]`` were not opened.
        open: Open piece -> ``(items taken, byte after the last one or None)``. A piece below
            ``next_part`` and not here is finished.
        held: The samples its shuffle buffer held: ``(piece, place in it, byte offset or None)``.
    """

    plan: Sequence[Piece]
    next_part: int
    open: dict[int, tuple[int, int | None]] = field(default_factory=dict)
    held: Sequence[tuple[int, int, int | None]] = ()

    @classmethod
    def fresh(cls, plan: Sequence[Piece]) -> RankLeft:
        """A rank that has read nothing of ``plan``."""
        return cls(list(plan), 0)

    @classmethod
    def from_state(cls, plan: Sequence[Piece], state: Mapping[str, Any]) -> RankLeft:
        """Where a ``tar_shards`` state (``TarShards.state_dict()`` during an epoch) stood,
        over ``plan`` (the pieces that rank read, in its reading order).

        Raises:
            ValueError: ``state`` is malformed or names a piece ``plan`` does not have.
        """
        try:
            cursor = state["cursor"]
            if cursor is None:
                return cls.fresh(plan)
            next_part = int(cursor["interleave"]["next_part"])
            ends = state.get("ends", {})
            opened = {
                int(p): (int(n), None if ends.get(str(p)) is None else int(ends[str(p)]))
                for p, n in cursor["taken"]
            }
            buffer = state.get("buffer") or {"origins": []}
            held = [
                (int(p), int(i), None if at is None else int(at)) for p, i, at in buffer["origins"]
            ]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a tar state is malformed: {exc!r}") from None
        named = [next_part - 1, *opened, *(p for p, _, _ in held)]
        if next_part > len(plan) or any(not 0 <= p < len(plan) for p in named if p >= 0):
            raise ValueError(f"a tar state names pieces its plan of {len(plan)} does not have")
        return cls(list(plan), next_part, opened, held)


def pieces_left(rank: RankLeft) -> list[Piece]:
    """What ``rank`` has left: the rest of each open piece, its shuffle buffer's samples (a
    piece each), then its unopened pieces."""
    left = []
    for index, (taken, end) in sorted(rank.open.items()):
        rest = rank.plan[index].after(taken, end)
        if rest is not None:
            left.append(rest)
    left += [rank.plan[index].item(place, at) for index, place, at in rank.held]
    left += rank.plan[rank.next_part :]
    return left


def redivide(ranks: Sequence[RankLeft], world_size: int) -> list[list[Piece]]:
    """What each of ``world_size`` new ranks reads: every piece left by ``ranks`` (in rank
    order, as :func:`pieces_left` lists them), piece ``j`` dealt to new rank ``j % world_size``.

    Raises:
        TypeError, ValueError: ``world_size`` is not an int >= 1, or ``ranks`` is empty.
    """
    world = check_int("world_size", world_size, minimum=1)
    if not ranks:
        raise ValueError("ranks is empty: give what every old rank left")
    every = [piece for rank in ranks for piece in pieces_left(rank)]
    return [every[r::world] for r in range(world)]


def split_pieces(
    parts: int, epoch: int, *, seed: int, shuffle: bool, rank: int, world_size: int
) -> list[Piece]:
    """Rank ``rank``'s parts of a fresh epoch, whole, in reading order: the split of
    :func:`~aioloader._data.sharding.epoch_parts` over ``parts`` parts (by index)."""
    order = epoch_parts(
        range(parts), epoch, seed=seed, shuffle=shuffle, rank=rank, world_size=world_size
    )
    return [Piece(p) for p in order]


def state_pieces(state: Mapping[str, Any]) -> list[Piece]:
    """The pieces a re-dividable state's rank reads in its epoch, in reading order: those it
    names, or (``"pieces": null``) its parts of the epoch's split.

    Raises:
        ValueError: ``state`` is malformed, or names no split (it cannot be re-divided: a
            stream other than ``tar_shards``, or a state saved before issue 26).
    """
    if not all(key in state for key in SPLIT_KEYS):
        missing = [key for key in SPLIT_KEYS if key not in state]
        raise ValueError(f"the stream's state names no split and pieces (it lacks {missing})")
    try:
        parts, epoch, seed = (int(state[key]) for key in ("shards", "epoch", "seed"))
        rank, world = (int(v) for v in state["split"])
        shuffle, pieces = bool(state["shuffle_shards"]), state["pieces"]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the stream's split is malformed: {exc!r}") from None
    if not (0 <= rank < world and parts >= 0):
        raise ValueError(f"the stream's split {state['split']!r} is malformed")
    if pieces is None:
        return split_pieces(parts, epoch, seed=seed, shuffle=shuffle, rank=rank, world_size=world)
    if not isinstance(pieces, list | tuple):
        raise ValueError(f"the stream's pieces must be a list, got {pieces!r}")  # noqa: TRY004
    named = [Piece.from_json(p) for p in pieces]
    if any(p.part >= parts for p in named):
        raise ValueError(f"the stream's pieces name parts beyond its {parts}")
    return named


def redivide_states(
    states: Sequence[tuple[Mapping[str, Any], bool]], world_size: int, epoch: int
) -> list[dict[str, Any]]:
    """Each of ``world_size`` new ranks' state of ``epoch``, from every old rank's: ``(state,
    done)``, ``done`` for a rank that took all it had of the epoch (its state may be the next
    epoch's start; it still names its rank). Every old rank of the split must be there once.
    The new states name their split (``[k, world_size]``) and their pieces (:func:`redivide`)
    and stand at their start; when every old rank was done, ``epoch`` is the next one and
    each new rank reads its own split of it (``"pieces": null``).

    Raises:
        ValueError: A state names no split or is malformed (``states[i]`` named), the states
            are of different datasets or seeds, a rank's is not of ``epoch``, or a rank of the
            split is missing or given twice.
    """
    world = check_int("world_size", world_size, minimum=1)
    if not states:
        raise ValueError("states is empty: give what every old rank left")
    plans: list[list[Piece]] = []
    for i, (state, _) in enumerate(states):
        try:
            plans.append(state_pieces(state))
        except ValueError as exc:
            raise ValueError(
                f"states[{i}]: {exc}; only a stream whose state names them (tar_shards') can "
                "be re-divided among another number of ranks: resume it with the world size "
                "it ran with (each rank its own state)"
            ) from None
    first = states[0][0]
    for i, (state, _) in enumerate(states):
        for key in ("dataset", "shards", "seed", "shuffle_shards"):
            if state[key] != first[key]:
                raise ValueError(
                    f"states[{i}]'s stream {key!r} is {state[key]!r}, states[0]'s "
                    f"{first[key]!r}: the states are not of one run's ranks of one dataset"
                )
    splits = [[int(v) for v in state["split"]] for state, _ in states]
    old_world = splits[0][1]
    if sorted(splits) != [[r, old_world] for r in range(old_world)]:
        raise ValueError(
            f"the states' streams are ranks {splits} ([rank, world_size]): a stream is "
            "re-divided from every rank of one split, each once"
        )
    left = []
    for i, ((state, done), plan) in enumerate(zip(states, plans, strict=True)):
        if done:
            continue
        if int(state["epoch"]) != epoch:
            raise ValueError(f"states[{i}]'s stream is at epoch {state['epoch']}, not {epoch}")
        try:
            left.append(RankLeft.from_state(plan, state))
        except ValueError as exc:
            raise ValueError(f"states[{i}]: {exc}") from None
    if not left:  # every rank took all it had: the new ranks read their own split of `epoch`
        return [_start(first, epoch, k, world, None) for k in range(world)]
    dealt = redivide(left, world)
    return [_start(first, epoch, k, world, dealt[k]) for k in range(world)]


def _start(
    like: Mapping[str, Any], epoch: int, rank: int, world: int, pieces: list[Piece] | None
) -> dict[str, Any]:
    """A state at the start of a rank's epoch: ``like``'s dataset, this split and pieces."""
    state = {key: like[key] for key in ("shards", "dataset", "seed", "shuffle_shards")}
    return {
        "epoch": epoch,
        **state,
        "split": [rank, world],
        "pieces": None if pieces is None else [p.to_json() for p in pieces],
        "cursor": None,
    }
