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

Owns: :class:`StartCopies`, the reduction of a start's tensors to copies of their storages,
each storage once (views of one storage stay views of one in the worker). Never: moves or
changes a tensor here; decides where the bytes go (the pickle's buffer callback does:
``startonce.py``).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["MOVED_FROM", "StartCopies"]

# Bytes: a storage this large or larger is moved to shared memory as torch shares it, once
# (a 4 GiB tensor would otherwise be copied again at every epoch's start without persistent
# workers, and held twice while they run).
MOVED_FROM = 64 << 20


class StartCopies:
    """The copies a start's pickle makes of its tensors' storages, one per storage."""

    __slots__ = ("_storages",)

    def __init__(self) -> None:
        self._storages: dict[int, _Storage] = {}

    def reduce(self, tensor: object) -> tuple[Callable[..., Any], tuple[Any, ...]] | None:
        """``tensor`` as a view of its storage's copy (the storage pickled once however many
        views of it are pickled), or None where it goes torch's way."""
        if not _copied(tensor):
            return None
        assert isinstance(tensor, torch.Tensor)
        storage = tensor.untyped_storage()
        held = self._storages.get(storage._cdata)
        if held is None:
            held = self._storages[storage._cdata] = _Storage(storage)
        size, stride = tuple(tensor.shape), tensor.stride()
        return _view, (held, tensor.dtype, tensor.storage_offset(), size, stride)


def _copied(value: object) -> bool:
    if type(value) is not torch.Tensor:  # a Parameter, a subclass, a storage: torch's way
        return False
    if value.device.type != "cpu" or value.layout != torch.strided or value.requires_grad:
        return False
    if value.is_quantized or value.is_nested or value.is_conj() or value.is_neg():
        return False
    storage = value.untyped_storage()
    return storage.nbytes() < MOVED_FROM and not storage.is_shared()


class _Storage:
    """A storage in a start's pickle: its bytes, given to the pickle's buffer callback (in
    the pickle where small, else in the start's file of buffers)."""

    __slots__ = ("_storage",)

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self._storage = storage

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        whole = torch.empty(0, dtype=torch.uint8).set_(self._storage)
        return _storage, (pickle.PickleBuffer(whole.numpy().data),)


def _storage(data: Any) -> torch.UntypedStorage:
    """In a worker: a storage over ``data`` (a bytearray, or a writable view of the start's
    file of buffers, mapped copy-on-write), which it keeps alive."""
    if not len(data):
        return torch.empty(0, dtype=torch.uint8).untyped_storage()
    return torch.frombuffer(data, dtype=torch.uint8).untyped_storage()


def _view(
    storage: torch.UntypedStorage,
    dtype: torch.dtype,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
) -> torch.Tensor:
    return torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)
