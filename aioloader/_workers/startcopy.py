"""A dataset's tensors in its workers' start, copied with it as a NumPy array's bytes are, and
mapped copy-on-write in each worker, as a forked worker has its parent's; not moved into a
shared-memory segment each.

Why: torch's sharing, which a start through a fork server or spawn used, moves each storage
it meets into a shared-memory segment of its own where it is, that segment's descriptor held
open in this process for as long as the storage lives, handed to every worker and mapped there
on its own. A dataset of 15,000 cached 3x64x64 images held 15,011 descriptors, failed to start
under the usual open-file limit of 1,024 (torch's forked workers inherit the list), and took
2.45 s to the end of its first epoch with 2 workers on a 2-core box, against torch's 0.36 s
(each epoch after, without persistent workers, 1.6 s against 0.29 s). A worker that changed a
sample in place changed the main process's too (a forked worker's write is its own).

A storage of :data:`MOVED_FROM` bytes or more still goes torch's way: there are few of them,
and moved once they are not copied again by each epoch's start; so does one already in
shared memory (``share_memory_()``: meant to be shared), a subclass, a tensor that requires
grad, and any other that is not a plain dense CPU tensor.

Owns: :class:`StartCopies`, a start's tensors as one table of copies of their storages, each
storage once (views of one storage stay views of one in the worker), and :func:`received`,
which rebuilds them. Never: moves or changes a tensor here; decides where the bytes go (the
pickle's buffer callback does: ``startonce.py``).
"""

from __future__ import annotations

import contextlib
import io
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["MOVED_FROM", "StartCopies", "received"]

# Bytes: a storage this large or larger is moved to shared memory as torch shares it, once
# (a 4 GiB tensor would otherwise be copied again at every epoch's start without persistent
# workers, and held twice while they run).
MOVED_FROM = 64 << 20


class StartCopies:
    """A start's tensors met as its arguments are pickled (:meth:`reduce`), pickled after them
    as one table (:meth:`dumps`) that a worker unpickles first (:func:`received`): each
    storage's bytes once, however many of its views there are, and each tensor's place in its
    storage. One table, not a reduction per tensor: 15,000 tensors took 0.16-0.17 s to pickle
    each its own way, 0.11-0.12 s as a table (unpickled in 0.05 s either way)."""

    __slots__ = ("_tensors",)

    def __init__(self) -> None:
        self._tensors: list[torch.Tensor] = []

    def reduce(self, tensor: object) -> tuple[Callable[[int], Any], tuple[int]] | None:
        """``tensor`` as a reference to its place in the table (pickle's memo sends a tensor met
        twice once), or None where it goes torch's way."""
        if not _copied(tensor):
            return None
        assert isinstance(tensor, torch.Tensor)
        self._tensors.append(tensor)
        return _copy_ref, (len(self._tensors) - 1,)

    def dumps(self, out_of_band: Callable[[pickle.PickleBuffer], bool]) -> bytes:
        """The table pickled (``b""`` where no tensor was met), each storage's bytes given to
        ``out_of_band`` (pickle's buffer callback); to be unpickled before the arguments."""
        if not self._tensors:
            return b""
        index: dict[int, int] = {}  # a storage's place in ``data``, by its address
        data: list[pickle.PickleBuffer] = []
        places = []
        for tensor in self._tensors:
            storage = tensor.untyped_storage()
            at = index.get(storage._cdata)
            if at is None:
                at = index[storage._cdata] = len(data)
                whole = torch.empty(0, dtype=torch.uint8).set_(storage)
                data.append(pickle.PickleBuffer(whole.numpy().data))
            places.append(
                (at, tensor.dtype, tensor.storage_offset(), *tensor.shape, *tensor.stride())
            )
        buffer = io.BytesIO()
        pickle.Pickler(buffer, pickle.HIGHEST_PROTOCOL, buffer_callback=out_of_band).dump(
            (data, places)
        )
        return buffer.getvalue()


def _copied(value: object) -> bool:
    if type(value) is not torch.Tensor:  # a Parameter, a subclass, a storage: torch's way
        return False
    if not value.is_cpu or value.layout != torch.strided or value.requires_grad:
        return False
    if value.is_quantized or value.is_nested or value.is_conj() or value.is_neg():
        return False
    storage = value.untyped_storage()
    return storage.nbytes() < MOVED_FROM and not storage.is_shared()


# In a worker, while its start arguments are unpickled: the tensors of the start's table
_copies_here: list[torch.Tensor] = []


def _copy_ref(index: int) -> torch.Tensor:
    return _copies_here[index]


@contextlib.contextmanager
def received(table: bytes | memoryview, buffers: Iterator[Any]) -> Iterator[None]:
    """In a worker: the start's tensors rebuilt from ``table`` and its out-of-band ``buffers``
    (taken from the iterator, in order), each storage over its bytes (a bytearray, or a
    writable view of the start's file of buffers, mapped copy-on-write, which the storage
    keeps alive); the start's arguments find them while the block runs."""
    global _copies_here
    if not len(table):
        yield
        return
    data, places = pickle.loads(table, buffers=buffers)
    storages = [_storage(bytes_) for bytes_ in data]
    tensors = []
    for at, dtype, offset, *layout in places:
        ndim = len(layout) // 2
        size, stride = layout[:ndim], layout[ndim:]
        tensors.append(torch.empty(0, dtype=dtype).set_(storages[at], offset, size, stride))
    _copies_here = tensors
    try:
        yield
    finally:
        _copies_here = []


def _storage(data: Any) -> torch.UntypedStorage:
    if not len(data):
        return torch.empty(0, dtype=torch.uint8).untyped_storage()
    return torch.frombuffer(data, dtype=torch.uint8).untyped_storage()
