"""Stream-per-slot batching for stateful sequence models.

A language or speech model that carries hidden state from one batch to the next needs position
``i`` of every batch to continue the sequence position ``i`` held in the batch before. A
:class:`SlotStreams` dataset gives that: with ``slots`` streams and a loader whose
``batch_size`` is ``slots``, it yields rounds of one sample per stream, stream ``i`` first.

Owns: dealing an epoch's parts (shards, files) to the streams, pulling one round at a time (the
streams of a round concurrently), and the policy for streams that run dry. Never: decides the
epoch's parts (``epoch_parts`` does, shuffled and split by rank) or reads bytes (``read`` does).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any, Generic, Literal, NamedTuple, TypeVar

import anyio

from .._dataset import AsyncIterableDataset
from .._sampler import epoch_parts

__all__ = ["SlotPolicy", "SlotSample", "SlotStreams", "slot_streams"]

T = TypeVar("T")
P = TypeVar("P")

SlotPolicy = Literal["shortest", "pad"]
_POLICIES = ("shortest", "pad")

Reader = Callable[[Any], AsyncIterator[T]]


class SlotSample(NamedTuple, Generic[T]):
    """One position of a round.

    ``default_collate`` turns a round into ``SlotSample(slot=tensor, first=tensor,
    valid=tensor, sample=<collated samples>)``.

    Attributes:
        slot: The stream (and batch position) it belongs to.
        first: The first sample of a new part (shard, file) of this stream: a model may reset
            this position's state.
        valid: False for padding after the stream ran dry (policy ``"pad"``); then ``sample`` is
            the ``fill`` value.
        sample: The sample.
    """

    slot: int
    first: bool
    valid: bool
    sample: T


def slot_streams(
    parts: Sequence[P],
    read: Callable[[P], AsyncIterator[T]],
    *,
    slots: int,
    shuffle: bool = True,
    seed: int = 0,
    rank: int | None = None,
    world_size: int | None = None,
    policy: SlotPolicy = "shortest",
    fill: Any = None,
) -> SlotStreams[T]:
    """``slots`` parallel streams over ``parts`` (file paths, URLs, keys), each part read into
    samples by ``read(part)`` (an async generator function, e.g. one that cuts a token file into
    sequences).

    Each epoch, the parts are shuffled (``seed``, epoch) and split by rank as
    :func:`aioloader._sampler.epoch_parts` says, then dealt out: stream ``i`` reads parts ``i,
    i + slots, ...`` of that order, one after the other. For tar shards, see
    :meth:`aioloader.sources.TarShards.per_slot`.

    Raises:
        TypeError, ValueError: ``slots`` is not an int >= 1, ``policy`` is unknown, or
            ``read`` is not callable.
    """
    if not callable(read):
        raise TypeError(f"read must be a callable giving an async iterator, got {read!r}")
    owned = list(parts)

    def parts_of(epoch: int) -> list[P]:
        return epoch_parts(
            owned, epoch, seed=seed, shuffle=shuffle, rank=rank, world_size=world_size
        )

    @contextlib.asynccontextmanager
    async def open_reader() -> AsyncIterator[Callable[[P], AsyncIterator[T]]]:
        yield read

    return SlotStreams(parts_of, open_reader, slots=slots, policy=policy, fill=fill)


class SlotStreams(AsyncIterableDataset[SlotSample[T]], Generic[T]):
    """Rounds of one sample from each of ``slots`` streams, stream ``0`` first.

    Use it with ``DataLoader(dataset, batch_size=slots)`` (the loader refuses another batch size,
    or ``in_order=False``, which would break the positions). Each :meth:`__aiter__` call starts the
    next epoch; every stream reads its share of that epoch's parts, so no two positions read the
    same data.

    Streams run dry at different times (parts hold different numbers of samples). ``policy``
    says what happens then:

    * ``"shortest"`` (the default): the epoch ends at the first round in which a stream has
      nothing left; that round is not yielded, and what the other streams had left is not read.
      Every batch is full and every position continues its stream.
    * ``"pad"``: the epoch goes on until every stream is dry; a dry stream's positions are
      ``SlotSample(slot, first=False, valid=False, sample=fill)``. ``fill`` must collate with
      the real samples (e.g. a zero tensor of the same shape).

    A round is read concurrently: stream ``i``'s next sample does not wait for stream ``j``'s.

    Iterating raises:
        ValueError: An epoch has fewer parts than ``slots`` (for this rank), so some stream
            would have nothing to read.
        Exception: A stream's error, with a note naming the slot; the other streams are closed.

    Cancellation: the round being read is abandoned and every stream is closed.
    """

    def __init__(
        self,
        parts_of: Callable[[int], Sequence[Any]],
        open_reader: Callable[
            [], contextlib.AbstractAsyncContextManager[Callable[[Any], AsyncIterator[T]]]
        ],
        *,
        slots: int,
        policy: SlotPolicy = "shortest",
        fill: Any = None,
        start_epoch: Callable[[], int] | None = None,
    ) -> None:
        if isinstance(slots, bool) or not isinstance(slots, int):
            raise TypeError(f"slots must be an int, got {slots!r}")
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if policy not in _POLICIES:
            raise ValueError(f"policy must be one of {_POLICIES}, got {policy!r}")
        self.slots = slots
        self.policy: SlotPolicy = policy
        self.fill = fill
        self._parts_of = parts_of
        self._open_reader = open_reader
        self._start_epoch = start_epoch
        self._next_epoch = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(slots={self.slots}, policy={self.policy!r})"

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch the next :meth:`__aiter__` call iterates (without a
        ``start_epoch`` callback; a dataset made by ``TarShards.per_slot`` follows the shards'
        own epochs: call their ``set_epoch``).

        Raises:
            TypeError, ValueError: ``epoch`` is not an int >= 0.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self._next_epoch = epoch

    def shares(self, epoch: int) -> list[list[Any]]:
        """What each stream reads in ``epoch``: ``shares(e)[i]`` are stream ``i``'s parts.

        Raises:
            ValueError: Fewer parts than slots.
        """
        parts = list(self._parts_of(epoch))
        if len(parts) < self.slots:
            raise ValueError(
                f"epoch {epoch} has {len(parts)} parts for this rank but there are {self.slots} "
                "slots: every slot needs at least one part to read"
            )
        return [parts[i :: self.slots] for i in range(self.slots)]

    def __aiter__(self) -> AsyncIterator[SlotSample[T]]:
        """Start the next epoch: an async generator of rounds, flattened.

        Raises:
            ValueError: As :meth:`shares`, at once.
        """
        if self._start_epoch is not None:
            epoch = self._start_epoch()
        else:
            epoch, self._next_epoch = self._next_epoch, self._next_epoch + 1
        return self._rounds(self.shares(epoch))

    async def _rounds(self, shares: list[list[Any]]) -> AsyncGenerator[SlotSample[T], None]:
        async with self._open_reader() as read:
            streams = [_stream(read, share) for share in shares]
            try:
                alive = [True] * len(streams)
                while True:
                    got = await _round(streams, alive)
                    if not any(alive) or (self.policy == "shortest" and not all(alive)):
                        return
                    for slot, item in enumerate(got):
                        if item is None:
                            yield SlotSample(slot, False, False, self.fill)
                        else:
                            yield SlotSample(slot, item[0], True, item[1])
            finally:
                # Every stream is closed, even when closing one of them raises.
                with anyio.CancelScope(shield=True):
                    async with contextlib.AsyncExitStack() as closing:
                        for stream in streams:
                            closing.push_async_callback(stream.aclose)


async def _stream(
    read: Callable[[Any], AsyncIterator[T]], share: list[Any]
) -> AsyncGenerator[tuple[bool, T], None]:
    """One stream: its parts one after the other, each sample with whether it starts a part."""
    for part in share:
        first = True
        samples = read(part)
        try:
            async for sample in samples:
                yield first, sample
                first = False
        finally:
            aclose = getattr(samples, "aclose", None)
            if aclose is not None:
                await aclose()


async def _round(
    streams: list[AsyncGenerator[tuple[bool, T], None]], alive: list[bool]
) -> list[tuple[bool, T] | None]:
    """The next sample of every live stream, read concurrently; a stream found dry is marked
    in ``alive``. The first failure (by slot) is raised, noting its slot."""
    got: list[tuple[bool, T] | None] = [None] * len(streams)
    errors: list[tuple[int, Exception]] = []

    async def pull(slot: int) -> None:
        try:
            got[slot] = await anext(streams[slot])
        except StopAsyncIteration:
            alive[slot] = False
        except Exception as exc:
            errors.append((slot, exc))

    live = [slot for slot, ok in enumerate(alive) if ok]
    if len(live) == 1:
        await pull(live[0])
    else:
        async with anyio.create_task_group() as tg:
            for slot in live:
                tg.start_soon(pull, slot)
    if errors:
        slot, exc = min(errors, key=lambda e: e[0])
        exc.add_note(f"aioloader: slot stream {slot} of {len(streams)}")
        raise exc
    return got
