"""What travels between an epoch's stages.

Owns: :class:`Batch` (a batch on its way: ids, samples, what failed, its bytes), :class:`Done`
(a batch transformed and collated, or its error), :class:`Raised` (an output item the consumer
raises), and :func:`one_item_lanes`. Never: does anything with them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._data.resume import Mark

__all__ = ["Batch", "Done", "Raised", "Received", "one_item_lanes"]


@dataclass(slots=True, eq=False)
class Batch:
    seq: int  # position in the epoch
    ids: list[Any]  # dataset indices (map-style) or stream positions (iterable)
    samples: list[Any]
    pending: int = 0  # fetches not yet finished
    failed: set[int] = field(default_factory=set)  # positions skipped under max_failures
    nbytes: int = 0
    error: Exception | None = None  # ends the epoch when the batch's turn to be yielded comes
    mark: Any = None  # a resumable stream's (next seq, position, dataset state) after it
    counted: bool = True  # taken when handed over (a stream source's failure is not)


@dataclass(frozen=True, slots=True)
class Raised:
    """An output item: the batch in this turn failed; the consumer raises ``error``.
    ``marks`` are taken with it (see ``Epoch``): a failed batch counts as taken, a stream
    source's failure does not."""

    error: BaseException
    marks: tuple[Any, ...] = ()


@dataclass(slots=True, eq=False)
class Done:
    batch: Batch
    value: Any
    size: int  # samples in the collated batch; 0: nothing left, the batch is skipped
    error: Exception | None = None


T = TypeVar("T")


@contextlib.contextmanager
def one_item_lanes(
    item: type[T], n: int
) -> Iterator[list[tuple[MemoryObjectSendStream[T], MemoryObjectReceiveStream[T]]]]:
    """``n`` one-item streams, one per worker, every end closed on exit (a task that never
    started would otherwise leave its end open)."""
    lanes = [anyio.create_memory_object_stream[T](1) for _ in range(n)]
    with contextlib.ExitStack() as streams:
        for send, recv in lanes:
            streams.callback(send.close)
            streams.callback(recv.close)
        yield lanes


class Received(NamedTuple):
    """An output item as the consumer's side receives it (``EpochIterator.receive``)."""

    batch: Any  # None when `error` is set
    warning: str | None  # torch's warning for an iterable past its reported length
    marks: tuple[Mark, ...]  # what the consumer takes with it (see ``Epoch``)
    error: BaseException | None  # the batch failed: the consumer raises this
