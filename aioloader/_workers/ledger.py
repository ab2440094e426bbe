"""The main process's side of worker blocks (``blocks.py`` has the protocol): each worker
block mapped once (:class:`BlockLedger`, one per process), the views of a result counted so
that the block goes back to its worker once they are all garbage, and the registrations of
blocks with a device (:class:`Registrations`), made and undone on the device stage's thread.

Owns: the mapped blocks, their views' lifetimes, the keys freed for each worker, the
registrations. Never: writes into a block, or sends anything.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import deque
from collections.abc import Callable

import numpy as np
import torch

__all__ = ["LEDGER", "Block", "BlockLedger", "Key", "Registrations", "find_block"]

Key = tuple[int, int]  # (the worker's pid, the block's number in that worker)

_tokens = itertools.count()


class Block:
    """The main process's mapping of one worker block, and how many views of its current
    result are alive."""

    def __init__(self, key: Key, tensor: torch.Tensor, ledger: BlockLedger) -> None:
        self.key = key
        self.token = next(_tokens)  # unique in this process, unlike id() or the key
        self.tensor = tensor
        self.address = tensor.data_ptr()
        self.nbytes = tensor.numel()
        self._array = tensor.numpy()
        self._ledger = ledger
        self._live = 0  # views of the current result still alive

    def view(
        self,
        offset: int,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        order: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """The tensor a :class:`BlockView` stands for, over this block's memory."""
        stored = shape if order is None else tuple(shape[d] for d in order)
        nbytes = int(np.prod(stored, dtype=np.int64)) * dtype.itemsize
        region = self._array[offset : offset + nbytes]
        with self._ledger.lock:
            self._live += 1
        weakref.finalize(region, self._gone).atexit = False
        tensor = torch.from_numpy(region).view(dtype).view(stored)
        if order is not None:
            tensor = tensor.permute(tuple(order.index(d) for d in range(len(order))))
        return tensor

    def _gone(self) -> None:
        with self._ledger.lock:
            self._live -= 1
            if self._live == 0:
                self._ledger.freed_now(self)


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
        order: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """A view of block ``key``, mapped from ``block`` when it comes (its first trip, or a
        larger block that replaced a free one under the same key).

        Raises:
            RuntimeError: ``key`` is unknown and no block came with it.
        """
        with self.lock:
            known = self._blocks.get(key)
            if block is not None and (known is None or known.tensor is not block):
                known = self._blocks[key] = Block(key, block, self)
            elif known is None:
                raise RuntimeError(
                    f"aioloader: worker {key[0]}'s block {key[1]} came without its "
                    "memory and was never mapped here"
                )
        return known.view(offset, dtype, shape, order)

    def freed_now(self, block: Block) -> None:
        """``block``'s result is gone (called under :attr:`lock`): its worker is told with
        its next job, unless the worker is gone or the block was replaced."""
        if self._blocks.get(block.key) is block:
            self._freed.setdefault(block.key[0], []).append(block.key)

    def freed(self, pid: int) -> list[Key]:
        """The blocks of worker ``pid`` freed since the last call (for its next job)."""
        with self.lock:
            return self._freed.pop(pid, [])

    def requeue(self, pid: int, keys: list[Key]) -> None:
        """``keys`` from :meth:`freed` did not reach worker ``pid`` (its job did not pickle):
        they go with the next one."""
        if keys:
            with self.lock:
                self._freed.setdefault(pid, [])[:0] = keys

    def forget(self, pid: int) -> None:
        """Worker ``pid`` is gone: drop its blocks (views still alive keep their memory)."""
        with self.lock:
            dropped = [self._blocks.pop(k) for k in [k for k in self._blocks if k[0] == pid]]
            self._freed.pop(pid, None)
        del dropped  # outside the lock

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


class Registrations:
    """Blocks registered with one device by the device stage, all on the stage's thread:
    each block at most once (a refusal is not retried); each undone on that thread, in
    :meth:`let_go`, once the block is gone, or in :meth:`close`, after the device is done with
    every copy. A registered block's memory stays mapped until it is undone.

    Args:
        register: ``register(address, nbytes)``: the call that undoes it, or None where the
            device refuses (``Accelerator.register``).
    """

    def __init__(self, register: Callable[[int, int], Callable[[], object] | None]) -> None:
        self._register = register
        self._done: dict[int, tuple[weakref.ref[Block], torch.Tensor, Callable[[], object]]] = {}
        self._refused: set[int] = set()
        self._gone: deque[int] = deque()  # tokens of registered blocks now garbage
        self.undone = 0  # registrations undone so far

    def ready(self, block: Block) -> bool:
        """Whether ``block`` is registered, registering it now if it is new."""
        token = block.token
        if token in self._done:
            return True
        if token in self._refused:
            return False
        undo = self._register(block.address, block.nbytes)
        if undo is None:
            self._refused.add(token)
            return False
        self._done[token] = (
            weakref.ref(block, lambda _: self._gone.append(token)),
            block.tensor,
            undo,
        )
        return True

    def let_go(self) -> None:
        """Undo the registrations of blocks that are gone."""
        while self._gone:
            entry = self._done.pop(self._gone.popleft(), None)
            if entry is not None:
                self._undo(entry[2])

    def close(self) -> None:
        """Undo every registration (call once the device has finished every copy)."""
        self._gone.clear()
        done, self._done = self._done, {}
        for _, _, undo in done.values():
            self._undo(undo)

    def _undo(self, undo: Callable[[], object]) -> None:
        undo()
        self.undone += 1
