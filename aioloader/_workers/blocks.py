"""Shared-memory blocks that worker processes write their results into, reused batch after
batch, so that the device stage can register each block with CUDA once and copy batches to the
device straight out of it, with no host copy into a pinned buffer (issue 25).

Why: a worker's result otherwise crosses in a new shared-memory segment each batch, which the
device stage copies into page-locked memory before its H2D copy. That host copy bounded the
stage at 14.3 GB/s on an H100 box (26% of a pinned ``copy_``), and it is CPU in the training
process. Registering each new segment in place (``cudaHostRegister``) cost 2.1-2.3 ms and
0.8-1.3 ms to undo: no better. A block is registered once and used for many batches.

The protocol, where the loader turns it on (``ProcessWorkers(blocks=True)``: worker processes
and a CUDA device stage that pins):

* Each job carries the keys of the worker's blocks that the main process is done with since
  its last job (a list; None turns blocks off for the job).
* The worker (:class:`OutputBlocks`) copies its result's plain contiguous CPU tensors into one
  free block of its own, at most :data:`PER_WORKER` blocks, and pickles each as a
  :class:`BlockView`: the block's key, an offset, a dtype and a shape, and on the block's first
  trip the block itself (torch shares its storage: one descriptor, once).
* Unpickled in the main process, a view is a tensor over the main process's mapping of the
  block (:class:`BlockLedger`). The block is free again once every tensor of that result is
  gone (garbage: whoever dropped it, the device stage, a cancelled epoch, the user); its key
  rides with the next job to that worker.
* The device stage asks :func:`find_block` for a tensor's block, registers it once
  (``Accelerator.register``) and copies from it directly (``_device/stage.py``).

A result under :data:`MIN_BYTES`, or one that finds no free block that fits once the worker
has :data:`PER_WORKER`, goes the usual way (``pack.py`` and torch's sharing). A block is never
resized: a larger batch later takes a new one while there is room, or goes the usual way.

Owns: the worker's blocks, the placeholders, the main process's ledger of mapped blocks and
their registrations. Never: sends anything (the pipe is ``processes.py``'s), or decides whether
blocks are used (the loader's scope does).
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._base.tree import map_tensors, plain_cpu_tensor, tensors_in

__all__ = [
    "LEDGER",
    "MIN_BYTES",
    "PER_WORKER",
    "Block",
    "BlockLedger",
    "BlockView",
    "Key",
    "OutputBlocks",
    "find_block",
]

MIN_BYTES = 1 << 20  # a result's tensors under this go the usual way: registering pays off above
PER_WORKER = 4  # blocks a worker may own: two jobs queued to it, one being staged, one spare
_ALIGN = 64  # bytes: each tensor's offset in a block (a cache line, aligned for any dtype)
_ROUND = 1 << 20  # bytes: block sizes are whole MiB, so batches a little larger still fit

Key = tuple[int, int]  # (the worker's pid, the block's number in that worker)


# -- in the worker ------------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class _Own:
    tensor: torch.Tensor  # uint8, its storage in shared memory
    busy: bool = False  # holds a result the main process has not let go of
    sent: bool = False  # the main process has a mapping of it


class BlockView:
    """A tensor of a worker's result, written into one of its blocks: pickled in the worker,
    unpickled in the main process as a tensor over that process's mapping of the block."""

    __slots__ = ("block", "dtype", "key", "offset", "shape")

    def __init__(
        self,
        key: Key,
        block: torch.Tensor | None,
        offset: int,
        dtype: torch.dtype,
        shape: tuple[int, ...],
    ) -> None:
        self.key, self.block, self.offset, self.dtype, self.shape = key, block, offset, dtype, shape

    def __reduce__(self) -> tuple[Callable[..., torch.Tensor], tuple[Any, ...]]:
        return _rebuild, (self.key, self.block, self.offset, self.dtype, self.shape)


def _rebuild(
    key: Key, block: torch.Tensor | None, offset: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    return LEDGER.view(key, block, offset, dtype, shape)


def _eligible(tensor: torch.Tensor) -> bool:
    return (
        plain_cpu_tensor(tensor)
        and not tensor.requires_grad
        and not tensor.is_conj()
        and not tensor.is_neg()
        and tensor.is_contiguous()
    )


class OutputBlocks:
    """A worker's blocks (one per worker process; see the module).

    Args:
        limit: The most blocks this worker may own.
    """

    def __init__(self, limit: int = PER_WORKER) -> None:
        self.limit = limit
        self._blocks: list[_Own] = []
        self._pending: int | None = None  # the block of the result being sent

    def free(self, keys: Iterable[Key]) -> None:
        """The main process is done with these blocks (keys of another process are ignored:
        a job meant for a worker that died before it)."""
        pid = os.getpid()
        for owner, number in keys:
            if owner == pid and 0 <= number < len(self._blocks):
                self._blocks[number].busy = False

    def write(self, data: Any) -> Any:
        """``data`` with its eligible tensors (plain, contiguous, CPU, no autograd; not two
        sharing a storage) copied into one free block and replaced by :class:`BlockView`s; as
        it is when they are under :data:`MIN_BYTES` or no block fits. Call :meth:`sent` or
        :meth:`unsent` once the reply is pickled (or failed to)."""
        found = tensors_in(data)
        owners: dict[int, int] = {}
        for t in found:
            key = t.untyped_storage().data_ptr()
            owners[key] = owners.get(key, 0) + 1
        chosen = {
            id(t): t for t in found if _eligible(t) and owners[t.untyped_storage().data_ptr()] == 1
        }
        offsets: dict[int, int] = {}
        size = 0
        for key, t in chosen.items():
            offsets[key] = size
            size += -(-t.nbytes // _ALIGN) * _ALIGN
        if size < MIN_BYTES:
            return data
        number = self._take(size)
        if number is None:
            return data
        own = self._blocks[number]
        into = own.tensor.numpy()
        block_key = (os.getpid(), number)
        first = None if own.sent else own.tensor

        def place(t: torch.Tensor) -> Any:
            start = offsets.get(id(t))
            if start is None or chosen.get(id(t)) is not t:
                return t
            np.copyto(into[start : start + t.nbytes], t.view(-1).view(torch.uint8).numpy())
            return BlockView(block_key, first, start, t.dtype, tuple(t.shape))

        try:
            written = map_tensors(place, data)
        except BaseException:
            own.busy = False
            raise
        self._pending = number
        return written

    def sent(self) -> None:
        """The reply with the last :meth:`write`'s block is pickled: it carries the block."""
        if self._pending is not None:
            self._blocks[self._pending].sent = True
            self._pending = None

    def unsent(self) -> None:
        """The reply could not be pickled: the last :meth:`write`'s block is free again."""
        if self._pending is not None:
            self._blocks[self._pending].busy = False
            self._pending = None

    def _take(self, nbytes: int) -> int | None:
        fits = [i for i, b in enumerate(self._blocks) if not b.busy and b.tensor.numel() >= nbytes]
        if fits:
            number = min(fits, key=lambda i: self._blocks[i].tensor.numel())
        elif len(self._blocks) < self.limit:
            size = -(-nbytes // _ROUND) * _ROUND
            try:
                tensor = torch.empty(size, dtype=torch.uint8)
                tensor.untyped_storage().share_memory_()
            except (RuntimeError, OSError):  # no room in /dev/shm: torch's sharing will say so
                return None
            self._blocks.append(_Own(tensor))
            number = len(self._blocks) - 1
        else:
            return None
        self._blocks[number].busy = True
        return number


# -- in the main process ------------------------------------------------------------------------


class Block:
    """The main process's mapping of one worker block: views of it, how many are alive, and its
    registration with the device (undone when the block is dropped)."""

    def __init__(self, key: Key, tensor: torch.Tensor, ledger: BlockLedger) -> None:
        self.key = key
        self.tensor = tensor
        self.address = tensor.data_ptr()
        self.nbytes = tensor.numel()
        self._array = tensor.numpy()
        self._ledger = ledger
        self._live = 0  # views of the current result still alive
        self._unregister: Callable[[], object] | None = None
        self._refused = False  # registering failed once: not tried again

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        region = self._array[offset : offset + nbytes]
        with self._ledger.lock:
            self._live += 1
        weakref.finalize(region, self._gone).atexit = False
        return torch.from_numpy(region).view(dtype).view(shape)

    def _gone(self) -> None:
        with self._ledger.lock:
            self._live -= 1
            if self._live == 0:
                self._ledger.freed_now(self.key)

    def registered(self, register: Callable[[int, int], Callable[[], object] | None]) -> bool:
        """Whether the block is registered with the device, registering it on the first call
        (``register(address, nbytes)`` returns the call that undoes it, or None when the device
        refuses); a refusal is not retried."""
        if self._unregister is None and not self._refused:
            self._unregister = register(self.address, self.nbytes)
            self._refused = self._unregister is None
        return self._unregister is not None

    def __del__(self) -> None:
        unregister, self._unregister = self._unregister, None
        if unregister is not None:
            with contextlib.suppress(Exception):  # the interpreter is exiting, say
                unregister()


class BlockLedger:
    """The main process's worker blocks, by key (one ledger per process: unpickling a
    :class:`BlockView` has no other way to reach it). Thread-safe: views are built on the
    loop's thread and die on any."""

    def __init__(self) -> None:
        # Reentrant: a collection inside a locked section may run a view's finalizer (_gone).
        self.lock = threading.RLock()
        self._blocks: dict[Key, Block] = {}
        self._freed: dict[int, list[Key]] = {}

    def view(
        self,
        key: Key,
        block: torch.Tensor | None,
        offset: int,
        dtype: torch.dtype,
        shape: tuple[int, ...],
    ) -> torch.Tensor:
        """A view of block ``key`` (mapped from ``block`` on its first trip).

        Raises:
            RuntimeError: ``key`` is unknown and no block came with it.
        """
        with self.lock:
            known = self._blocks.get(key)
            if known is None:
                if block is None:
                    raise RuntimeError(
                        f"aioloader: worker {key[0]}'s block {key[1]} came without its "
                        "memory and was never mapped here"
                    )
                known = self._blocks[key] = Block(key, block, self)
        return known.view(offset, dtype, shape)

    def freed_now(self, key: Key) -> None:
        """Block ``key``'s result is gone (called under :attr:`lock`): its worker is told
        with its next job, unless the worker is gone."""
        if key in self._blocks:
            self._freed.setdefault(key[0], []).append(key)

    def freed(self, pid: int) -> list[Key]:
        """The blocks of worker ``pid`` freed since the last call (for its next job)."""
        with self.lock:
            return self._freed.pop(pid, [])

    def forget(self, pid: int) -> None:
        """Worker ``pid`` is gone: drop its blocks (views still alive keep their memory, and a
        block's registration is undone when its last reference goes)."""
        with self.lock:
            for key in [k for k in self._blocks if k[0] == pid]:
                del self._blocks[key]
            self._freed.pop(pid, None)

    def find(self, tensor: torch.Tensor) -> Block | None:
        """The block ``tensor``'s memory lies in, or None."""
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        with self.lock:
            for block in self._blocks.values():
                if block.address <= start and end <= block.address + block.nbytes:
                    return block
        return None


LEDGER = BlockLedger()


def find_block(tensor: torch.Tensor) -> Block | None:
    """The worker block ``tensor``'s memory lies in (see :meth:`BlockLedger.find`), or None."""
    return LEDGER.find(tensor)
