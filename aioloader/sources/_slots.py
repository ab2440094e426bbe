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
import functools
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from typing import Any, Generic, Literal, NamedTuple, TypeVar

from .._base.checks import check_int
from .._data.epochs import OpensEpochs
from .._data.sharding import epoch_parts
from .._fanin.lanes import close_iterator, interleaved

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
    :func:`aioloader._data.sharding.epoch_parts` says, then dealt out: stream ``i`` reads parts ``i,
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


class SlotStreams(OpensEpochs[SlotSample[T]], Generic[T]):
    """Rounds of one sample from each of ``slots`` streams, stream ``0`` first.

    Use it with ``DataLoader(dataset, batch_size=slots)`` (the loader refuses another batch size,
    or ``in_order=False``, which would break the positions). The loader owns its epochs
    (``loader.set_epoch``); iterated directly, each :meth:`__aiter__` call starts the next
    epoch (see :class:`~aioloader.OpensEpochs`). Every stream reads its share of that epoch's
    parts, so no two positions read the same data.

    Streams run dry at different times (parts hold different numbers of samples). ``policy``
    says what happens then:

    * ``"shortest"`` (the default): the epoch ends at the first round in which a stream has
      nothing left; that round is not yielded, and what the other streams had left is not read.
      Every batch is full and every position continues its stream.
    * ``"pad"``: the epoch goes on until every stream is dry; a dry stream's positions are
      ``SlotSample(slot, first=False, valid=False, sample=fill)``. ``fill`` must collate with
      the real samples (e.g. a zero tensor of the same shape).

    Streams read concurrently and ahead of the rounds: each holds up to ``buffer`` of its
    samples (counted by ``size``, default 1 each) and opens its next part before the current
    one ends.

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
        buffer: int = 64,
        size: Callable[[T], int] | None = None,
    ) -> None:
        check_int("slots", slots, minimum=1)
        if policy not in _POLICIES:
            raise ValueError(f"policy must be one of {_POLICIES}, got {policy!r}")
        self.slots = slots
        self.policy: SlotPolicy = policy
        self.fill = fill
        self._parts_of = parts_of
        self._open_reader = open_reader
        self._buffer = buffer
        self._size = size

    def __repr__(self) -> str:
        return f"{type(self).__name__}(slots={self.slots}, policy={self.policy!r})"

    def check_loader_options(
        self, *, batch_size: int | None, in_order: bool, distributed: bool
    ) -> None:
        """The loader options this dataset needs (the loader calls this when it is built):
        batches of ``slots``, in order, unsplit (anything else would put one stream's samples
        at another's position).

        Raises:
            ValueError: An option it cannot work with, named.
        """
        if batch_size != self.slots:
            raise ValueError(
                f"batch_size must equal the dataset's slots ({self.slots}) so position i of "
                f"every batch continues stream i; got batch_size={batch_size}"
            )
        if not in_order:
            raise ValueError(
                "in_order=False would reorder the batches of a stream-per-slot dataset"
            )
        if distributed:
            raise ValueError(
                "distributed=True would split a stream-per-slot dataset's rounds; its parts are "
                "already split by rank (pass rank/world_size to it)"
            )

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

    def epoch_items(
        self, epoch: int, state: None
    ) -> contextlib.AbstractAsyncContextManager[AsyncIterator[SlotSample[T]]]:
        """Epoch ``epoch`` (see :meth:`~aioloader.OpensEpochs.open_epoch`; it does not resume,
        so ``state`` is None): an async context manager giving its rounds, flattened. Every
        stream reads ahead of the rounds into a buffer of its own (its next part opened before
        the current one ends), so a round does not wait for a stream to start a read.

        Raises:
            ValueError: As :meth:`shares`, at once.

        Cancellation: leaving the block closes every stream's open parts before it is left.
        """
        return self._rounds(self.shares(epoch))

    @contextlib.asynccontextmanager
    async def _rounds(self, shares: list[list[Any]]) -> AsyncIterator[AsyncIterator[SlotSample[T]]]:
        size = self._size

        def measure(item: tuple[bool, T]) -> int:
            return 1 if size is None else size(item[1])

        async with self._open_reader() as read, contextlib.AsyncExitStack() as stack:
            streams = [
                await stack.enter_async_context(
                    interleaved(
                        share,
                        functools.partial(_marked, read),
                        width=1,
                        ahead=1,
                        part_limit=self._buffer,
                        size=measure,
                    )
                )
                for share in shares
            ]
            async with aclosing(self._flatten(streams)) as rounds:
                yield rounds

    async def _flatten(
        self, streams: list[AsyncIterator[tuple[bool, T]]]
    ) -> AsyncGenerator[SlotSample[T], None]:
        alive = [True] * len(streams)
        while True:
            got: list[tuple[bool, T] | None] = []
            for slot, stream in enumerate(streams):
                item = None
                if alive[slot]:
                    try:
                        item = await anext(stream, None)
                    except Exception as exc:
                        exc.add_note(f"aioloader: slot stream {slot} of {len(streams)}")
                        raise
                    alive[slot] = item is not None
                got.append(item)
            if not any(alive) or (self.policy == "shortest" and not all(alive)):
                return
            for slot, item in enumerate(got):
                if item is None:
                    yield SlotSample(slot, False, False, self.fill)
                else:
                    yield SlotSample(slot, item[0], True, item[1])


async def _marked(
    read: Callable[[Any], AsyncIterator[T]], part: Any
) -> AsyncGenerator[tuple[bool, T], None]:
    """A part's samples, each with whether it is the part's first."""
    first = True
    samples = read(part)
    try:
        async for sample in samples:
            yield first, sample
            first = False
    finally:
        await close_iterator(samples)
