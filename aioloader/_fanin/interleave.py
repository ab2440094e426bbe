"""Which open part (shard, file, key range) an interleaved stream takes its next item from.

Owns: the order of an interleave over ``width`` slots, each holding one part at a time, parts
taken in plan order as slots free up, visited round by round (in slot order, or in a seeded
permutation each round). The order depends only on the parts' lengths and the seed, never on
which part's bytes arrive first, so the same seed gives the same epoch however fast the network
is, and a position in it can be written down. Never: reads anything or waits (``_fanin/lanes.py``
carries the order out).

The consumer asks :meth:`Interleave.turn` for the part to draw from, then says what happened:
:meth:`~Interleave.drew` (an item came), :meth:`~Interleave.ended` (that part has no more) or
:meth:`~Interleave.missing` (the part index it asked for does not exist: the plan ran out).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from .._base.checks import check_int

__all__ = ["Interleave", "rng_from_json", "rng_to_json"]

_EMPTY = -1  # a slot that will take the next part of the plan when its turn comes
_CLOSED = -2  # a slot the plan ran out for


class Interleave:
    """The draw order of an interleave of parts over ``width`` slots.

    Slots are visited round by round; in each round every open slot gets one turn, in slot
    order, or, with ``rng``, in an order drawn with ``rng.shuffle`` at the start of the round.
    A slot that is empty when its turn comes takes the next part of the plan (parts are numbered
    0, 1, ... in the order they are taken); a slot whose part ends takes the next part in the same
    turn. So at most ``width`` parts are open at once, and they open in plan order (a reader can
    open parts ahead of the turns that need them).

    With ``width=1`` the parts are read one after the other; with ``width >= parts`` and no
    ``rng`` it is a round-robin over all of them.

    Raises:
        TypeError, ValueError: ``width`` is not an int >= 1.
    """

    __slots__ = ("_closed", "_order", "_pos", "_rng", "_rng_state", "_slots", "next_part")

    def __init__(self, width: int, rng: random.Random | None = None) -> None:
        self._slots = [_EMPTY] * check_int("width", width, minimum=1)
        self._rng = rng
        self._rng_state: list[Any] | None = None
        self._order = list(range(width))
        self._pos = 0
        self._closed = 0
        #: The index of the part the next empty slot takes (= how many parts were taken).
        self.next_part = 0
        self._new_round()

    @property
    def width(self) -> int:
        """The number of slots."""
        return len(self._slots)

    @property
    def done(self) -> bool:
        """True once every slot is closed: the plan ran out and every part ended."""
        return self._closed == len(self._slots)

    @property
    def open_parts(self) -> list[int]:
        """The parts in the slots now, in slot order (empty and closed slots left out)."""
        return [p for p in self._slots if p >= 0]

    def turn(self) -> int:
        """The part to draw the next item from. A part index equal to :attr:`next_part` - 1 that
        was just taken may not exist yet: the caller says :meth:`missing` if the plan has no
        such part.

        Raises:
            RuntimeError: :attr:`done` is true.
        """
        if self.done:
            raise RuntimeError("the interleave is done: every part ended")
        slot = self._order[self._pos]
        part = self._slots[slot]
        if part == _EMPTY:
            part = self._slots[slot] = self.next_part
            self.next_part += 1
        return part

    def drew(self) -> None:
        """An item came from :meth:`turn`'s part: the next slot's turn."""
        self._advance()

    def ended(self) -> None:
        """:meth:`turn`'s part has no more items: its slot takes the next part, in this turn."""
        self._slots[self._order[self._pos]] = _EMPTY

    def missing(self) -> None:
        """The part :meth:`turn` named does not exist (the plan ran out): its slot closes, and no
        slot takes a part again."""
        slot = self._order[self._pos]
        if self._slots[slot] != self.next_part - 1:
            raise RuntimeError("missing() is only for the part just taken")
        self.next_part -= 1  # it was never a part
        self._slots[slot] = _CLOSED
        self._closed += 1
        self._advance()

    def _advance(self) -> None:
        if self.done:
            return
        while True:
            self._pos += 1
            if self._pos == len(self._order):
                self._new_round()
            if self._slots[self._order[self._pos]] != _CLOSED:
                return

    def to_json(self) -> dict[str, Any]:
        """Where the order stands, as JSON-ready values: restored by :meth:`from_json`, it goes
        on exactly as this one would (its generator's state included)."""
        return {
            "slots": list(self._slots),
            "order": list(self._order),
            "pos": self._pos,
            "closed": self._closed,
            "next_part": self.next_part,
            "rng": self._rng_json(),
        }

    @classmethod
    def from_json(cls, state: object, rng: random.Random | None) -> Interleave:
        """An interleave where ``state`` (from :meth:`to_json`) stood; ``rng`` is set to the
        saved generator state.

        Raises:
            TypeError, ValueError: ``state`` is malformed, or has a generator state where
                ``rng`` is None (or none where it is not).
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"an interleave's state must be a mapping, got {state!r}")
        raw: list[Any] = [state.get(k) for k in ("slots", "order")]
        numbers = [state.get(k) for k in ("pos", "closed", "next_part")]
        if not (_ints(raw[0]) and raw[0] and _ints(raw[1]) and _ints(numbers)):
            raise ValueError(f"an interleave's state is malformed: {dict(state)!r}")
        slots: list[int] = list(raw[0])
        order: list[int] = list(raw[1])
        pos, closed, next_part = (int(n) for n in numbers if isinstance(n, int))
        if (state.get("rng") is None) != (rng is None):
            raise ValueError("the interleave's state and its shuffle setting disagree")
        width = len(slots)
        shut = {i for i, p in enumerate(slots) if p == _CLOSED}
        consistent = (
            all(_CLOSED <= p < next_part for p in slots)
            and closed == len(shut)
            and len(set(order)) == len(order)
            and set(range(width)) - shut <= set(order) <= set(range(width))
            and (closed == width or (0 <= pos < len(order) and order[pos] not in shut))
        )
        if not consistent:
            raise ValueError(f"an interleave's state is inconsistent: {dict(state)!r}")
        self = cls(width)
        self._slots, self._order, self._pos, self._closed = slots, order, pos, closed
        self.next_part = next_part
        if rng is not None:
            rng_from_json(rng, state["rng"])
        self._rng = rng
        return self

    def _rng_json(self) -> list[Any] | None:
        """The generator's state, taken again only after it drew (once a round: a state is
        asked for at every batch, and reading the generator's 625 words costs ~13 µs)."""
        if self._rng is None:
            return None
        if self._rng_state is None:
            self._rng_state = rng_to_json(self._rng)
        return self._rng_state

    def _new_round(self) -> None:
        self._rng_state = None  # the shuffle below draws
        self._pos = 0
        if self._closed:
            self._order = [s for s in range(len(self._slots)) if self._slots[s] != _CLOSED]
        if self._rng is not None:
            self._rng.shuffle(self._order)


def _ints(values: object) -> bool:
    return isinstance(values, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in values
    )


def rng_to_json(rng: random.Random) -> list[Any]:
    """A ``random.Random``'s state as JSON-ready values (its 625-word Mersenne Twister state, as
    the tuple ``getstate`` gives: ``json`` writes it as a list, and it is taken at every batch,
    so it is not copied into one)."""
    version, words, gauss = rng.getstate()
    return [version, words, gauss]


def rng_from_json(rng: random.Random, state: Any) -> None:
    """Set ``rng`` to a state from :func:`rng_to_json`.

    Raises:
        ValueError: ``state`` is not such a state.
    """
    try:
        version, words, gauss = state
        rng.setstate((int(version), tuple(int(w) for w in words), gauss))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"a random generator's state is malformed: {exc}") from None
