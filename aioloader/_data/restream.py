"""What the ranks of a stream read in parts (tar shards) have left of an epoch, re-divided among
another number of ranks: the pure decision behind resuming a stream on a new world size.

Owns: :class:`Piece` (a run of a part's items: from a byte offset, or from the part's start
passing over some items; to the part's end or for a count), :class:`RankLeft` (where one rank
stood: its pieces in reading order, the interleave's next piece, how far each open piece was
taken, the samples its shuffle buffer held) with :meth:`RankLeft.from_state` (read from a
``tar_shards`` state), :func:`pieces_left` and :func:`redivide`. Never: reads a part, knows a
format or a transport, or keeps a clock; no event loop, no I/O.

Exact by construction: what a rank has left is its unopened pieces, the rest of each open piece
(from the byte after its last item taken, or, where offsets are unknown, passing over the
items taken) and each sample its shuffle buffer held (a piece of one item). Every item of the
epoch not yet taken is in exactly one piece of exactly one new rank, and nothing taken is in
any. What it cannot keep is the order: the new ranks read their pieces in a new interleave.
Nothing is padded: ranks get as many pieces as the dealing gives them (one more for the first
``len % world`` ranks), and, as with ``tar_shards``' own split, not as many samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .._base.checks import check_int

__all__ = ["Piece", "RankLeft", "pieces_left", "redivide"]


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
    def from_state(cls, plan: Sequence[Piece], state: dict[str, Any]) -> RankLeft:
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
