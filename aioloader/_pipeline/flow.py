"""Hand-offs between pipeline stages, with the accounting the statistics need.

Owns: sending into and receiving from bounded memory object streams while counting the time a
stage spent blocked (backpressure on put, starvation on get), the fetched-bytes budget, and the
byte size of a sample. Never: decides what is sent, or holds data itself.
"""

from __future__ import annotations

import itertools
import operator
import time
from typing import Any

import anyio
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._base.recorders import StageRecorder
from .handoff import HandoffSend

__all__ = ["ByteBudget", "blocked", "get", "nbytes_of", "nbytes_of_all", "put"]


def nbytes_of(sample: Any, seen: set[int] | None = None) -> int:
    """Bytes held by a fetched sample, for the ``max_inflight_bytes`` bound: buffers, arrays and
    tensors count their data; strings their length; containers their members, each container
    once (``seen``: the ids of those counted: a sample that holds itself recursed without end,
    found by review); anything else counts 0."""
    if isinstance(sample, (bytes, bytearray)):
        return len(sample)
    nbytes = _nbytes_attr(sample)  # memoryviews, numpy arrays, torch tensors
    if isinstance(nbytes, int):
        return nbytes
    if isinstance(sample, str):
        return len(sample)
    if isinstance(sample, dict | list | tuple):  # (subclasses too)
        seen = set() if seen is None else seen
        if id(sample) in seen:
            return 0
        seen.add(id(sample))
        members = list(sample.values()) if isinstance(sample, dict) else list(sample)
        return nbytes_of_all(members, seen)
    return 0


def nbytes_of_all(samples: list[Any], seen: set[int] | None = None) -> int:
    """``sum(map(nbytes_of, samples))``, with no Python call per sample when the samples are
    all of one kind: numbers (0 each), ``bytes`` or ``str`` (their lengths), arrays or tensors
    (an ``nbytes`` each), or dicts, lists and tuples, whose members are counted together (each
    container once: ``seen``)."""
    if not samples:
        return 0
    kinds = set(map(type, samples))
    if len(kinds) != 1:
        return sum(map(nbytes_of, samples, itertools.repeat(set() if seen is None else seen)))
    (kind,) = kinds
    if kind in _NO_BYTES:
        return 0
    if kind in _LENGTH:
        return sum(map(len, samples))
    if kind is dict or kind is list or kind is tuple:
        if seen is None:  # the top: each sample counts, the same object twice too
            seen, fresh = set(map(id, samples)), samples
        else:  # a container met again (a sample that holds itself) counts once
            fresh = [s for s in samples if id(s) not in seen]
            seen.update(map(id, fresh))
        if kind is dict:
            return nbytes_of_all([v for s in fresh for v in s.values()], seen)
        return nbytes_of_all([v for s in fresh for v in s], seen)
    if isinstance(_nbytes_attr(samples[0]), int):
        try:
            total = sum(map(_NBYTES, samples))
        except (AttributeError, TypeError, RuntimeError):  # not an int after all; sparse
            pass
        else:
            if isinstance(total, int):
                return total
    return sum(map(nbytes_of, samples, itertools.repeat(set() if seen is None else seen)))


def _nbytes_attr(sample: Any) -> object:
    """``sample.nbytes``, None without one; a sparse COO tensor's (torch defines none for it:
    the attribute raises) is its indices' and values' (found by review: a sparse sample failed
    its batch as it was counted; the compressed layouts have their own)."""
    try:
        return getattr(sample, "nbytes", None)
    except RuntimeError:
        if not isinstance(sample, torch.Tensor) or sample.layout != torch.sparse_coo:
            raise
    return int(sample._indices().nbytes + sample._values().nbytes)


_NBYTES = operator.attrgetter("nbytes")
_NO_BYTES = frozenset({int, float, bool, complex, type(None)})
_LENGTH = frozenset({bytes, bytearray, str})


class ByteBudget:
    """Holds new fetches while the bytes of unfinished batches exceed the limit. The oldest
    unfinished batch may always fetch: it is what frees bytes, so waiting on it would deadlock."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.held = 0
        self.active: set[int] = set()
        self._room = anyio.Event()

    async def wait_room(self, seq: int) -> None:
        while self.limit is not None and self.held >= self.limit and seq != min(self.active):
            await self._room.wait()

    def charge(self, n: int) -> None:
        self.held += n

    def release(self, seq: int, n: int) -> None:
        self.active.discard(seq)
        self.held -= n
        if self.limit is not None:  # no bound: nobody waits for room
            self._room.set()
            self._room = anyio.Event()


class blocked:  # used like a function: `with blocked(rec, "put"):`
    """Adds the time spent inside the block to a recorder's blocked-put or blocked-get total."""

    __slots__ = ("_kind", "_rec", "_t0")

    def __init__(self, rec: StageRecorder, kind: str) -> None:
        self._rec, self._kind = rec, kind

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        dt = time.perf_counter() - self._t0
        if self._kind == "put":
            self._rec.blocked_put_s += dt
        else:
            self._rec.blocked_get_s += dt


async def put(
    stream: MemoryObjectSendStream[Any] | HandoffSend[Any], item: Any, rec: StageRecorder
) -> None:
    """Send, counting time spent blocked by a full stream (backpressure) against ``rec``."""
    try:
        stream.send_nowait(item)
    except anyio.WouldBlock:
        with blocked(rec, "put"):
            await stream.send(item)


async def get(stream: MemoryObjectReceiveStream[Any], rec: StageRecorder) -> Any:
    """Receive the next item, or None at the end of the stream, counting time spent waiting
    for upstream (starvation) against ``rec``. Items are never None: they are batches or jobs."""
    try:
        return stream.receive_nowait()
    except anyio.WouldBlock:
        with blocked(rec, "get"):
            try:
                return await stream.receive()
            except anyio.EndOfStream:
                return None
    except anyio.EndOfStream:
        return None
