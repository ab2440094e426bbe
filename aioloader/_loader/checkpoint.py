"""A loader's state between batches: what ``state_dict()`` gives, ``load_state_dict()`` takes
and :func:`merge_states` combines, and the epoch that goes on from it.

Owns: :class:`EpochState` (the document: JSON-serialisable, checked field by field when loaded)
and :class:`Progress` (the consumer's record of the running epoch: what it took, and for a stream
the dataset's state after the last batch taken in order). Never: runs an epoch, combines ranks'
states (``merging.py``), checks a state against a loader or builds its batches
(``resuming.py``), or decides an order itself (``_data/resume.py`` and the samplers do).

The document::

    {"format": "aioloader.state/1", "epoch": 3, "seed": 7, "order_seed": 7,
     "map": true, "length": 10000000, "batch_size": 32, "drop_last": false,
     "world_size": 2, "rank": 0,
     "taken": {"through": 120, "beyond": [122]}, "samples": 3840,
     "layers": [], "stream": null}

``taken`` names the batches of epoch ``epoch`` this rank's consumer had, by place; ``layers``
the earlier world sizes of this epoch (an elastic resume), each with every rank's ``taken``;
``stream`` where a stream goes on: the place of the next batch formed after the last one taken
in order that had a state, the stream position and the dataset's own state there. A merged
state has ``rank: null`` and every old rank in its last layer.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .._base.stateful import decode, encode
from .._data.epochs import OpensEpochs
from .._data.order import order_generator
from .._data.resume import Layer, Mark, Taken
from .._data.source import dataset_length

if TYPE_CHECKING:
    from .plan import LoaderPlan

__all__ = [
    "FORMAT",
    "EpochState",
    "Progress",
    "dumps_checked",
    "fresh_state",
    "restore_sampler",
    "sampler_start",
]

FORMAT = "aioloader.state/1"


@dataclass(slots=True, kw_only=True)
class EpochState:
    """One rank's place in an epoch (or, with ``rank=None``, every old rank's: merged)."""

    epoch: int
    seed: int
    order_seed: int | None
    map: bool
    length: int | None
    batch_size: int | None
    drop_last: bool
    world_size: int
    rank: int | None
    taken: Taken = field(default_factory=Taken)
    samples: int = 0
    layers: list[Layer] = field(default_factory=list)
    stream: tuple[int, int, Any] | None = None
    sampler: dict[str, Any] | None = None

    @property
    def merged(self) -> bool:
        return self.rank is None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "epoch": self.epoch,
            "seed": self.seed,
            "order_seed": self.order_seed,
            "map": self.map,
            "length": self.length,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "world_size": self.world_size,
            "rank": self.rank,
            "taken": self.taken.to_json(),
            "samples": self.samples,
            "layers": [layer.to_json() for layer in self.layers],
            "stream": None
            if self.stream is None
            else {"batch": self.stream[0], "position": self.stream[1], "dataset": self.stream[2]},
            "sampler": self.sampler,
        }

    @classmethod
    def from_json(cls, state: object) -> EpochState:
        """Read a document, checking every field.

        Raises:
            TypeError: ``state`` is not a mapping.
            ValueError: A field is missing or malformed (the message names it), or the format
                is not this version's.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a dict from DataLoader.state_dict(), got {state!r}")
        if state.get("format") != FORMAT:
            raise ValueError(
                f"state['format'] must be {FORMAT!r} (a dict from DataLoader.state_dict()), "
                f"got {state.get('format')!r}"
            )

        def get(key: str, kind: type | tuple[type, ...], *, none: bool = False) -> Any:
            if key not in state:
                raise ValueError(f"state[{key!r}] is missing")
            value = state[key]
            if value is None and none:
                return None
            wrong_bool = isinstance(value, bool) and kind is not bool
            if wrong_bool or not isinstance(value, kind):
                raise TypeError(f"state[{key!r}] must be {_kind(kind)}, got {value!r}")
            signed = key in ("seed", "order_seed")
            if isinstance(value, int) and not isinstance(value, bool) and value < 0 and not signed:
                raise ValueError(f"state[{key!r}] must be >= 0, got {value!r}")
            return value

        world = get("world_size", int)
        rank = get("rank", int, none=True)
        if world < 1 or (rank is not None and rank >= world):
            raise ValueError(f"state['rank'] {rank} is outside world_size {world}")
        layers_json = get("layers", list)
        layers = [Layer.from_json(x, f"state['layers'][{i}]") for i, x in enumerate(layers_json)]
        stream_json = get("stream", dict, none=True)
        stream: tuple[int, int, Any] | None = None
        if stream_json is not None:
            where = []
            for key in ("batch", "position"):
                value = stream_json.get(key)
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise ValueError(f"state['stream'][{key!r}] must be an int >= 0")
                where.append(value)
            stream = (where[0], where[1], stream_json.get("dataset"))
        sampler = state.get("sampler")  # absent from a state saved before it was kept
        if sampler is not None and not isinstance(sampler, dict):
            raise TypeError(f"state['sampler'] must be dict or None, got {sampler!r}")
        return cls(
            epoch=get("epoch", int),
            seed=get("seed", int),
            order_seed=get("order_seed", int, none=True),
            map=get("map", bool),
            length=get("length", int, none=True),
            batch_size=get("batch_size", int, none=True),
            drop_last=get("drop_last", bool),
            world_size=world,
            rank=rank,
            taken=Taken.from_json(get("taken", dict), "state['taken']"),
            samples=get("samples", int),
            layers=layers,
            stream=stream,
            sampler=sampler,
        )


def _kind(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


class Progress:
    """The consumer's record of one epoch: which batches it took (:class:`Taken`), how many
    samples, and, for a stream, the last mark (next seq, position, dataset state) of the batches
    up to ``taken.through - 1``: where a resumed epoch starts reading.

    Only the consumer's thread calls :meth:`took` (a plain ``for``'s thread, or the event loop's
    for ``async for``); :meth:`state` may be called from any thread (a lock keeps the two
    apart, so a state is never half of one batch's change).
    """

    __slots__ = ("_lock", "base", "finished", "marks", "resumable", "samples", "stream", "taken")

    def __init__(self, base: EpochState) -> None:
        self.base = base  # what the epoch started from (a loaded state, or a fresh one)
        self.taken = base.taken.copy()
        self.samples = base.samples
        self.stream = base.stream
        self.marks: dict[int, tuple[int, int, Any]] = {}  # marks of batches past `through`
        self.finished = False
        #: The stream's passes keep a state (known once they are open).
        self.resumable = False
        self._lock = threading.Lock()  # state() may be asked from a thread of the user's

    def took(self, marks: tuple[Mark, ...]) -> None:
        """The consumer has what these marks name (a batch, or its error, and the places of
        empty batches before it)."""
        with self._lock:
            for mark in marks:
                self._took(mark)

    def _took(self, mark: Mark) -> None:
        seq, size, stream = mark
        taken = self.taken
        self.samples += size
        if seq != taken.through:
            if stream is not None:
                self.marks[seq] = stream
            taken.add(seq)
            return
        taken.add(seq)
        if stream is not None:
            self.stream = stream
        for s in range(seq + 1, taken.through):  # taken before, now in order
            passed = self.marks.pop(s, None)
            if passed is not None:
                self.stream = passed

    def begin_order(self, plan: LoaderPlan, resume: EpochState | None) -> None:
        """A map-style epoch is about to draw its order: a user's sampler's generator is set
        back to where the saved epoch's began (``resume``, a loaded state), and where it
        stands is kept (:func:`sampler_start`).

        Raises:
            ValueError: The saved generator state is malformed.
        """
        if resume is not None:
            restore_sampler(plan, resume.sampler, loading=False)
        start = sampler_start(plan, drawn=True)
        with self._lock:
            self.base = dataclasses.replace(self.base, sampler=start)

    def started(self, mark: tuple[int, int, Any] | None) -> None:
        """A stream's pass is open and keeps a state: ``mark`` is where it stands before its
        first batch (None: its start), the place a state goes on from until a batch taken in
        order has a mark of its own."""
        with self._lock:
            self.resumable = True
            if self.stream is None:
                self.stream = mark

    def state(self) -> EpochState:
        with self._lock:
            return self._state()

    def _state(self) -> EpochState:
        base = self.base
        if self.finished:  # the next epoch's start: nothing taken, no earlier world sizes
            return dataclasses.replace(
                base, epoch=base.epoch + 1, taken=Taken(), samples=0, layers=[], stream=None
            )
        return dataclasses.replace(
            base,
            taken=self.taken.copy(),
            samples=self.samples,
            layers=list(base.layers),
            stream=self.stream,
        )


def dumps_checked(state: dict[str, Any], dataset: object) -> None:
    """Check that ``state`` is JSON-serialisable.

    Raises:
        TypeError: It is not (a dataset's ``state_dict()`` gave something else), naming the
            dataset.
    """
    try:
        json.dumps(state)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"the state of {type(dataset).__qualname__}.state_dict() is not JSON-serialisable "
            f"({exc}); a dataset's state must be made of dicts, lists, tuples, str, int, "
            "float, bool, None, bytes, tensors and NumPy arrays and scalars"
        ) from None


def fresh_state(plan: LoaderPlan, epoch: int) -> EpochState:
    """The state at the start of ``epoch``, nothing taken (a stream that names its start,
    :meth:`~aioloader.OpensEpochs.epoch_start_state`, has it as its mark: what ``merge_states``
    needs of a rank that took nothing yet)."""
    length = dataset_length(plan.dataset) if plan.kind.is_map else None
    batch_size, drop_last = plan.batching
    stream = None
    if isinstance(plan.dataset, OpensEpochs) and not plan.kind.is_map:
        start = plan.dataset.epoch_start_state(epoch)
        stream = None if start is None else (0, 0, start)
    return EpochState(
        epoch=epoch,
        seed=plan.base_seed,
        order_seed=plan.order_seed,
        map=plan.kind.is_map,
        length=length,
        batch_size=batch_size,
        drop_last=drop_last,
        world_size=plan.world_size,
        rank=plan.rank,
        stream=stream,
        sampler=sampler_start(plan, drawn=False),
    )


def sampler_start(plan: LoaderPlan, *, drawn: bool) -> dict[str, Any] | None:
    """Where a user's sampler's ``generator`` stands now, or None when its order needs none
    (``order_generator``). ``drawn``: the epoch draws its order from here now (kept as the
    epoch begins); else this is a state between epochs, and what the next epoch does first
    (a new scope's draw from the loader's ``generator``, which may be the same) is still to
    come, so a resumed loader sets the generator back as the state is loaded."""
    generator = order_generator(plan.order) if plan.kind.is_map else None
    if generator is None:
        return None
    return {"generator": encode(generator.get_state()), "drawn": drawn}


def restore_sampler(
    plan: LoaderPlan, saved: dict[str, Any] | None, *, loading: bool, check: bool = False
) -> None:
    """Set a user's sampler's ``generator`` back to ``saved`` (:func:`sampler_start`): as the
    state is loaded (``loading``) for a state kept between epochs, as the epoch draws its
    order for one kept as it drew it. At the other time, or with ``check``, a copy of the
    generator takes it: checked only.

    Raises:
        ValueError: ``saved`` is not such a state, or this loader's sampler has no generator.
    """
    if saved is None:
        return
    generator = order_generator(plan.order) if plan.kind.is_map else None
    if generator is None:
        raise ValueError(
            "the state holds a sampler's generator state (state['sampler']); this loader's "
            "sampler was given no generator"
        )
    now = bool(saved.get("drawn", True)) != loading and not check
    target = generator if now else torch.Generator(device=generator.device)
    try:
        target.set_state(decode(saved["generator"]))
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"state['sampler'] is not a generator's state: {exc}") from None
