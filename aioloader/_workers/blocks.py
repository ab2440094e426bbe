"""Shared-memory blocks that worker processes write their results into, reused batch after
batch, so that the device stage can register each block with CUDA once and copy batches to the
device straight out of it, with no host copy into a pinned buffer (issue 25).

Why: a worker's result otherwise crosses in a new shared-memory segment each batch, which the
device stage copies into page-locked memory before its H2D copy. That host copy bounded the
stage at 14.3 GB/s on an H100 box (26% of a pinned ``copy_``), and it is CPU in the training
process. Registering each new segment in place (``cudaHostRegister``) cost 2.1-2.3 ms and
0.8-1.3 ms to undo: no better. A block is registered once and used for many batches.

The protocol, where the loader turns it on (``ProcessWorkers(blocks=True)``: worker processes
and a device stage that pins, with a CUDA device, or on the host only where each worker makes
:data:`REUSED_FROM` batches or more in its life):

* Each job carries the keys of the worker's blocks that the main process is done with since
  its last job (a list; None turns blocks off for the job).
* The worker (:class:`OutputBlocks`) copies its batch's plain dense CPU tensors into one free
  block of its own, at most :data:`PER_WORKER` blocks, and pickles each as a
  :class:`BlockView`: the block's key, an offset, a dtype, a shape (and the order of a
  permuted layout), and on the block's first trip the block itself (torch shares its
  storage: one descriptor, once).
* Unpickled in the main process, a view is a tensor over the main process's mapping of the
  block (``ledger.py``). The block is free again once every tensor of that result is gone
  (garbage: whoever dropped it, the device stage, a cancelled epoch, the user); its key rides
  with the next job to that worker.
* With a device, the stage asks ``ledger.find_block`` for a tensor's block, registers it once
  (``ledger.Registrations``, on the stage's thread, undone there once the block is gone or the
  stage closes) and copies from it directly (``_device/stage.py``). Pinning on the host only
  (``pin_memory=True`` without ``device``, workers that make many batches), it copies the batch
  out of the block into torch's pinned memory and drops the views: the training process maps
  each block once, where a new segment a batch cost it a mapping, its page faults and an
  unmapping (on an H200 box, the training process's CPU per 37 MiB batch beside a resnet18
  step, 42.0 ms that way, 29-31 out of blocks; torch's 34: docs/design.md, "Worker blocks").
* An object that pinning hands to its own ``pin_memory`` method is not walked into: it
  reaches that method as the worker made it.

Only a job's batch (``JobResult.batch``) goes into a block, not what else a result carries (a
stream's checkpoint mark, samples left uncollated after a failure), which may be kept long
after the batch. A batch under :data:`MIN_BYTES`, or one that finds no free block that fits
once the worker has :data:`PER_WORKER`, goes the usual way (``pack.py`` and torch's sharing);
a free block too small for the batch is replaced by a larger one under the same key (its
next trip carries the new block).

Owns: the protocol, the worker's blocks and the placeholders (the main process's side is
``ledger.py``). Never: sends anything (the pipe is ``processes.py``'s), or decides whether
blocks are used (the loader's scope does).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._base.tree import map_pinnable, tensors_in
from .ledger import LEDGER, Key
from .pack import alone_in_storage, memory_order, plain_values, shared_storage

__all__ = ["MIN_BYTES", "PER_WORKER", "REUSED_FROM", "BlockView", "OutputBlocks"]

MIN_BYTES = 1 << 20  # a result's tensors under this go the usual way: registering pays off above
PER_WORKER = 4  # blocks a worker may own: two jobs queued to it, one being staged, one spare
# Batches a worker makes in its life from which blocks pay for pinning on the host only: its
# first few each pay a block's first trip and a copy; workers of a plain `for` that make fewer
# (one short epoch) keep torch's segments (measured: docs/design.md, "Worker blocks").
REUSED_FROM = 2 * PER_WORKER
_ALIGN = 64  # bytes: each tensor's offset in a block (a cache line, aligned for any dtype)
_ROUND = 1 << 20  # bytes: block sizes are whole MiB, so batches a little larger still fit


# -- in the worker ------------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class _Own:
    tensor: torch.Tensor  # uint8, its storage in shared memory
    busy: bool = False  # holds a result the main process has not let go of
    sent: bool = False  # the main process has a mapping of it


class BlockView:
    """A tensor of a worker's result, written into one of its blocks: pickled in the worker,
    unpickled in the main process as a tensor over that process's mapping of the block. A
    dense tensor that is not contiguous (channels-last, any permutation) is written in its
    memory's order, ``order`` the permutation that makes it contiguous (None: contiguous)."""

    __slots__ = ("block", "dtype", "key", "offset", "order", "shape")

    def __init__(
        self,
        key: Key,
        block: torch.Tensor | None,
        offset: int,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        order: tuple[int, ...] | None = None,
    ) -> None:
        self.key, self.block, self.offset = key, block, offset
        self.dtype, self.shape, self.order = dtype, shape, order

    def __reduce__(self) -> tuple[Callable[..., torch.Tensor], tuple[Any, ...]]:
        return _rebuild, (self.key, self.block, self.offset, self.dtype, self.shape, self.order)


def _rebuild(
    key: Key,
    block: torch.Tensor | None,
    offset: int,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    order: tuple[int, ...] | None,
) -> torch.Tensor:
    return LEDGER.view(key, block, offset, dtype, shape, order)


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
        """``data`` with its eligible tensors (plain, dense, CPU, no autograd; not two sharing
        a storage) copied into one free block and replaced by :class:`BlockView`s (one per
        tensor: a tensor that appears twice arrives as one); as it is when they are under
        :data:`MIN_BYTES` or no block fits. Call :meth:`sent` or :meth:`unsent` once the reply
        is pickled (or failed to)."""
        chosen: dict[int, tuple[torch.Tensor, tuple[int, ...]]] = {}  # id -> (tensor, order)
        # Not inside an object with a pin_memory method: pinning hands that object to its own
        # method, which must get it as it was (not a container rebuilt around block views).
        reached = {id(t) for t in tensors_in(data, as_pinned=True)}
        for t in alone_in_storage(tensors_in(data)):
            if id(t) in reached and plain_values(t) and (order := memory_order(t)) is not None:
                chosen[id(t)] = (t, order)
        offsets: dict[int, int] = {}
        size = 0
        for key, (t, _) in chosen.items():
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
        made: dict[int, BlockView] = {}

        def place(t: Any) -> Any:  # a tensor, or an object pinned by its own method
            if id(t) in made:
                return made[id(t)]
            entry = chosen.get(id(t))
            if entry is None or entry[0] is not t:
                return t
            order, start = entry[1], offsets[id(t)]
            flat = t.permute(order).reshape(-1).view(torch.uint8)
            np.copyto(into[start : start + t.nbytes], flat.numpy())
            identity = order == tuple(range(t.dim()))
            made[id(t)] = BlockView(
                block_key, first, start, t.dtype, tuple(t.shape), None if identity else order
            )
            return made[id(t)]

        try:
            written = map_pinnable(place, data)
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
        """A free block of at least ``nbytes``, made busy: the smallest that fits; else a new
        one while there is room; else a free one too small, replaced by a larger one under the
        same number (unsent: its next trip carries it). None when every block is busy."""
        free = [i for i, b in enumerate(self._blocks) if not b.busy]
        fits = [i for i in free if self._blocks[i].tensor.numel() >= nbytes]
        if fits:
            number = min(fits, key=lambda i: self._blocks[i].tensor.numel())
        elif len(self._blocks) < self.limit or free:
            try:
                storage = shared_storage(-(-nbytes // _ROUND) * _ROUND)
                tensor = torch.empty(0, dtype=torch.uint8).set_(storage)
            except (RuntimeError, OSError):  # no room in /dev/shm: torch's sharing will say so
                return None
            if len(self._blocks) < self.limit:
                self._blocks.append(_Own(tensor))
                number = len(self._blocks) - 1
            else:
                number = min(free, key=lambda i: self._blocks[i].tensor.numel())
                self._blocks[number] = _Own(tensor)
        else:
            return None
        self._blocks[number].busy = True
        return number
