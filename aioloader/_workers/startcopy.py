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

Each storage goes one way, whichever tensors view it, so that views of one storage stay views
of one in the worker: torch's way (moved to shared memory once, where it is, and shared; its
descriptor sent down each worker's pipe) where any value on it goes that way (a ``Parameter``,
a tensor that requires grad, a subclass, a sparse or nested tensor, a storage itself), where
it is in shared memory already (``share_memory_()``, a batch an earlier loader made, or moved
by an earlier start: shared as it was), where it is :data:`MOVED_FROM` bytes or more (few
such, and moved once they are not copied again by each epoch's start), and, largest first,
where the start's copies would come to more than
:data:`COPIED_AT_MOST` and it is :data:`MOVABLE_FROM` or more (a dataset of 20 GiB in chunks
of 32 MiB would hold a second copy while the workers run, and copy it at every start).
Smaller storages are always copied: moved, each would hold a descriptor here. Nothing is
copied where this process cannot make a file in memory (:func:`memfile.available`): the bytes
would go down each worker's pipe.

Owns: :class:`StartCopies`, a start's tensors as one table of copies of their storages, each
storage once (views of one storage stay views of one in the worker), and :func:`rebuilt`,
which rebuilds them. Never: moves or changes a tensor here (torch's reductions move what goes
their way); decides where the bytes go (the pickle's buffer callback does: ``startonce.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import pickle
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._base.tree import dense_parts, plain_cpu_tensor
from . import memfile

__all__ = [
    "COPIED_AT_MOST",
    "MOVABLE_FROM",
    "MOVED_FROM",
    "StartCopies",
    "rebuilt",
    "referred",
]

# Bytes: a storage this large or larger is moved to shared memory as torch shares it, once
# (a 4 GiB tensor would otherwise be copied again at every epoch's start without persistent
# workers, and held twice while they run).
MOVED_FROM = 64 << 20
# Bytes: the most a start copies of storages of MOVABLE_FROM bytes or more; beyond it, the
# largest of those are moved instead
COPIED_AT_MOST = 256 << 20
MOVABLE_FROM = 1 << 20


class StartCopies:
    """A start's tensors met as its arguments are pickled (:meth:`reduce`), pickled after them
    as one table (:meth:`dumps`) that a worker unpickles first (:func:`rebuilt`): each
    storage's bytes once, however many of its views there are, and each tensor's place in its
    storage (where the storage goes torch's way, it is one of the start's acting values, once
    however many views of it there are: 100,000 rows of one 100 MB tensor, ``list(tensor)``,
    took 4.4 s an epoch as 100,000 tensors torch shared, 1.2 s so; torch's forked workers
    0.5 s). One table, not a reduction per tensor: 15,000 tensors took 0.16-0.17 s to pickle
    each its own way, 0.11-0.12 s as a table (unpickled in 0.05 s either way)."""

    __slots__ = ("_enabled", "_keys", "_storages", "_tensors", "_torch_way")

    def __init__(self) -> None:
        self._enabled = memfile.available()
        self._tensors: list[torch.Tensor] = []
        self._keys: list[int] = []  # each tensor's storage, by its address
        self._storages: dict[int, torch.UntypedStorage] = {}  # by address
        self._torch_way: set[int] = set()  # storages (by address) a value goes torch's way on

    def reduce(self, value: object) -> tuple[Callable[[int], Any], tuple[int]] | None:
        """``value`` as a reference to its place in the table (pickle's memo sends a tensor met
        twice once), or None where it goes torch's way (its storage is noted: every tensor on
        it goes that way too)."""
        if isinstance(value, torch.Tensor) and _plain(value):
            storage = value.untyped_storage()
            key = storage._cdata
            if key not in self._storages:
                self._storages[key] = storage
                if not self._enabled or storage.is_shared() or storage.nbytes() >= MOVED_FROM:
                    self._torch_way.add(key)
            self._keys.append(key)
            self._tensors.append(value)
            return _copy_ref, (len(self._tensors) - 1,)
        self._torch_way.update(_storage_keys(value))
        return None

    def dumps(
        self, out_of_band: Callable[[pickle.PickleBuffer], bool], act: Callable[[object], int]
    ) -> bytes:
        """The table pickled (``b""`` where no tensor was met), each copied storage's bytes
        given to ``out_of_band`` (pickle's buffer callback), each tensor on a storage that
        goes torch's way given to ``act`` (which returns its index among the acting values);
        to be unpickled before the arguments."""
        if not self._tensors:
            return b""
        moved = self._moved()
        index: dict[int, int] = {}  # a copied storage's place in ``data``, by its address
        data: list[pickle.PickleBuffer | bytearray] = []
        places: list[Any] = []
        for tensor, key in zip(self._tensors, self._keys, strict=True):
            at = index.get(key)
            if at is None and key in moved:  # the storage as torch shares it: negative
                at = index[key] = -1 - act(self._storages[key])
            elif at is None:
                at = index[key] = len(data)
                data.append(_bytes_of(self._storages[key]))
            offset, dtype = tensor.storage_offset(), tensor.dtype
            bits = tensor.is_conj() | tensor.is_neg() << 1  # lazy views torch's sharing drops
            places.append((at, dtype, offset, bits, *tensor.shape, *tensor.stride()))
        buffer = io.BytesIO()
        pickle.Pickler(buffer, pickle.HIGHEST_PROTOCOL, buffer_callback=out_of_band).dump(
            (data, places)
        )
        return buffer.getvalue()

    def _moved(self) -> set[int]:
        """The storages that go torch's way: those a value went on, and the largest movable
        ones while the copies would come to more than :data:`COPIED_AT_MOST`."""
        sizes = {key: storage.nbytes() for key, storage in self._storages.items()}
        moved = self._torch_way & sizes.keys()
        movable = sorted(
            (size, key) for key, size in sizes.items() if key not in moved and size >= MOVABLE_FROM
        )
        total = sum(size for key, size in sizes.items() if key not in moved)
        while total > COPIED_AT_MOST and movable:
            size, key = movable.pop()
            moved.add(key)
            total -= size
        return moved


def _bytes_of(storage: torch.UntypedStorage) -> pickle.PickleBuffer | bytearray:
    """``storage``'s bytes for the table: a view of them (the buffer callback may send it out
    of band), or, under ``memfile.OUT_OF_BAND_FROM``, a copy, which the pickle holds anyway
    (300,000 storages of 16 bytes: 0.21 s, against 1.79 s for the views)."""
    nbytes = storage.nbytes()
    if nbytes < memfile.OUT_OF_BAND_FROM:
        return bytearray(ctypes.string_at(storage.data_ptr(), nbytes) if nbytes else b"")
    whole = torch.empty(0, dtype=torch.uint8).set_(storage)
    return pickle.PickleBuffer(whole.numpy().data)


def _plain(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` goes in the table (its storage copied or shared): a plain dense CPU
    tensor, empty or not, without autograd; not a ``Parameter``, a subclass, a sparse or
    nested tensor (torch's reductions handle those whole)."""
    return plain_cpu_tensor(tensor, empty=True) and not tensor.requires_grad


def _storage_keys(value: object) -> list[int]:
    """The addresses of the CPU storages ``value`` (a tensor, a sparse one's indices and
    values, or a storage) is on; none where it is not a torch value on the CPU, or has no
    storage of its own (a nested tensor)."""
    storages: list[torch.UntypedStorage]
    if isinstance(value, torch.Tensor):
        try:
            storages = [part.untyped_storage() for part in dense_parts(value)]
        except (RuntimeError, NotImplementedError):
            return []
    elif isinstance(value, torch.TypedStorage):
        storages = [value._untyped_storage]
    elif isinstance(value, torch.UntypedStorage):
        storages = [value]
    else:
        return []
    return [storage._cdata for storage in storages if storage.device.type == "cpu"]


# In a worker, while its start arguments are unpickled: the tensors of the start's table
_copies_here: list[torch.Tensor] = []


def _copy_ref(index: int) -> torch.Tensor:
    return _copies_here[index]


def rebuilt(table: bytes | memoryview, buffers: Iterator[Any], acting: list[Any]) -> list[Any]:
    """In a worker: the start's tensors rebuilt from ``table`` and its out-of-band ``buffers``
    (taken from the iterator, in order), each storage over its bytes (a bytearray, or a
    writable view of the start's file of buffers, mapped copy-on-write, which the storage
    keeps alive), or taken from the start's ``acting`` values."""
    if not len(table):
        return []
    data, places = pickle.loads(table, buffers=buffers)
    views = Counter(place[0] for place in places)
    storages: dict[int, torch.UntypedStorage] = {}
    tensors = []
    for at, dtype, offset, bits, *layout in places:
        ndim = len(layout) // 2
        size, stride = layout[:ndim], layout[ndim:]
        if at >= 0 and views[at] == 1 and not offset and not bits:  # a storage of its own
            whole = _whole(data[at], dtype, size, stride)
            if whole is not None:
                tensors.append(whole)
                continue
        if at < 0:
            storage = acting[-1 - at]  # shared: the start's own
        elif (storage := storages.get(at)) is None:
            storage = storages[at] = _storage(data[at])
        tensor = torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)
        if bits & 1:
            tensor = tensor.conj()
        if bits & 2:
            tensor = torch._neg_view(tensor)
        tensors.append(tensor)
    return tensors


def _whole(
    data: Any, dtype: torch.dtype, size: list[int], stride: list[int]
) -> torch.Tensor | None:
    """The tensor of ``size`` and ``stride`` over all of ``data``, where those are the
    contiguous ones and it fills ``data`` (one call, not a storage and a view of it: 300,000
    tensors of 16 bytes, 0.3 s against 1.3 s); else None."""
    expected = 1
    for extent, step in zip(reversed(size), reversed(stride), strict=True):
        if step != expected:
            return None
        expected *= extent
    if not expected or expected * dtype.itemsize != len(data):
        return None
    try:
        flat = torch.frombuffer(data, dtype=dtype)
    except (TypeError, ValueError, RuntimeError):  # a dtype it does not take: the long way
        return None
    return flat if len(size) == 1 else flat.view(size)


@contextlib.contextmanager
def referred(tensors: list[Any]) -> Iterator[None]:
    """The start's pickle, unpickled in the block, finds ``tensors`` (:func:`rebuilt`)."""
    global _copies_here
    _copies_here = tensors
    try:
        yield
    finally:
        _copies_here = []


def _storage(data: Any) -> torch.UntypedStorage:
    if not len(data):
        return torch.empty(0, dtype=torch.uint8).untyped_storage()
    return torch.frombuffer(data, dtype=torch.uint8).untyped_storage()
