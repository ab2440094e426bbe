"""The device stage: finished batches pinned, then copied to a CUDA device on a side stream.

Owns: :class:`DeviceStage` (owned by the loader's scope, called by the epoch's emitter a batch
at a time, in order), the hand-over of a staged batch to the consumer (:class:`Staged`). What a
stage does: ``plan.py``; the device calls and the pinned pool: ``accelerator.py``.

Every blocking call (copying into pinned memory, registering a worker block, issuing the
copies and ``device_transform``, waiting on an event before a pinned buffer is reused) runs on
the stage's one thread, never on the event loop. The only CUDA calls made elsewhere are
:meth:`Staged.ready`'s, in the consumer's thread (the current stream is per thread): no waits.

Never: decides order or how far the stage runs ahead (the epoch does), or synchronises the
consumer's stream with the host.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import torch

from .._base.tree import map_pinnable, map_tensors, plain_cpu_tensor, tensors_in
from .._workers.ledger import Registrations, find_block
from .._workers.offload import ThreadOffload
from .accelerator import Accelerator, Event, PinnedPool
from .hostcopy import HostCopy, as_bytes, page_locked
from .plan import DevicePlan

__all__ = ["DeviceStage", "Staged", "hand_out"]

_ALIGN = 256  # bytes: each tensor's offset in a pinned buffer (whole cache lines, any dtype)
# A contiguous tensor larger than _CHUNKED_OVER chunks of _CHUNK_BYTES goes through its pinned
# buffer chunk by chunk (see DeviceStage); _CHUNK_BYTES = 0 copies every tensor whole. Both are
# read at each copy, so a test or a benchmark can change them.
_CHUNK_BYTES = 0  # whole: see docs/design.md ("Chunked copies") for why, as measured
_CHUNKED_OVER = 2
# Threads per host copy into pinned memory, the stage's own included (see hostcopy.py): a
# quarter of the cores, at most 4 (the workers have the rest); read as the stage is made.
_COPY_THREADS = max(1, min(4, (os.cpu_count() or 1) // 4))


class Staged:
    """A batch the device stage has issued to the device (or pinned on the host).

    The event loop thread calls :meth:`release` when the consumer takes it (it no longer counts
    as ahead of the consumer); the consumer's thread calls :meth:`ready` to get the batch.
    """

    __slots__ = ("_accelerator", "_event", "_release", "_tensors", "batch")

    def __init__(
        self,
        batch: Any,
        *,
        release: Callable[[], None] | None = None,
        accelerator: Accelerator | None = None,
        event: Event | None = None,
        tensors: Sequence[torch.Tensor] = (),
    ) -> None:
        self.batch = batch
        self._release = release
        self._accelerator = accelerator
        self._event = event
        self._tensors = tensors

    def release(self) -> None:
        """Give the batch's place on the device back to the stage (idempotent; call on the event
        loop's thread)."""
        release, self._release = self._release, None
        if release is not None:
            release()

    def ready(self) -> Any:
        """The batch, safe to use on the calling thread's current stream: that stream waits
        (on the device, the host does not) until the copies and ``device_transform`` are done,
        and the allocator will not reuse the batch's memory before that stream is done with it.
        Call it once, in the thread that uses the batch: this object lets go of the batch, so
        the batch's memory goes back as soon as the consumer drops it.

        Raises:
            RuntimeError: A CUDA error (possibly from earlier asynchronous work).
        """
        batch, self.batch = self.batch, None
        tensors, self._tensors = self._tensors, ()
        if self._event is not None and self._accelerator is not None:
            self._accelerator.hand_over(self._event, tensors)
        return batch


def hand_out(value: Any) -> Any:
    """What the consumer gets for a value of the output stream: a staged batch made ready on the
    calling thread's stream, anything else as it is."""
    return value.ready() if isinstance(value, Staged) else value


def _copy_in_chunks(
    host: HostCopy, tensor: torch.Tensor, staging: torch.Tensor, target: torch.Tensor
) -> bool:
    """Copy ``tensor`` to ``target`` through ``staging`` (its bytes in a pinned buffer) chunk by
    chunk: each chunk's copy to the device is issued (``non_blocking``) as soon as the chunk is
    in the buffer, so it runs while the host copies the next one. False, with nothing copied,
    when ``tensor`` is not larger than ``_CHUNKED_OVER`` chunks or either end has no byte view
    (:func:`.hostcopy.as_bytes`): then the caller copies it whole."""
    chunk = _CHUNK_BYTES
    nbytes = staging.numel()
    if chunk <= 0 or nbytes <= _CHUNKED_OVER * chunk:
        return False
    source, dest = as_bytes(tensor), as_bytes(target)
    if source is None or dest is None:
        return False
    for start in range(0, nbytes, chunk):
        end = min(start + chunk, nbytes)
        host.copy(staging[start:end], source[start:end])
        dest[start:end].copy_(staging[start:end], non_blocking=True)
    return True


def _dense_strides(tensor: torch.Tensor) -> tuple[int, ...]:
    """The strides ``tensor.to(device)`` would give: its own when it is dense (contiguous,
    channels-last, any permutation), else contiguous ones."""
    if tensor.is_contiguous():
        return tuple(tensor.stride())
    return tuple(torch.empty_like(tensor, device="meta").stride())


class DeviceStage:
    """Moves finished batches to the device, one at a time, on a thread of its own.

    Owned by the loader's scope: :meth:`open` when it opens, :meth:`aclose` when it closes. The
    epoch's emitter calls :meth:`stage` for each batch, in order, and bounds how many staged
    batches the consumer has not taken yet (``depth``).

    With a device, each tensor of a batch is copied into a buffer of the :class:`PinnedPool`
    (when pinning; straight from a worker's block registered with the device where it lies in
    one: ``_workers/blocks.py``), then copied to the device with ``non_blocking=True`` on the
    side stream; ``device_transform`` runs on the side stream after that; an event marks the
    end. A pinned buffer (a block) is reused only once the copies out of it have completed.
    Tensors that cannot go through a pinned buffer (subclasses, sparse, quantized, nested or
    empty tensors, tensors on a device) are moved with ``tensor.to(device)`` on the side stream.

    A contiguous tensor larger than ``_CHUNKED_OVER`` chunks of ``_CHUNK_BYTES`` goes through
    its buffer chunk by chunk: each chunk's device copy is issued as soon as that chunk is in
    the buffer, so it overlaps the host copy of the next chunk, where a whole tensor's device
    copy waits for all of its host copy (the figures are in docs/design.md). A permuted dense
    tensor, or one without a byte view, is copied whole.

    Args:
        plan: What to do (see :class:`DevicePlan`).
        depth: How many staged batches may wait for the consumer (the pool keeps one more
            buffer than that, and at least two).
    """

    def __init__(self, plan: DevicePlan, *, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.depth = depth
        self.accelerator = plan.accelerator() if plan.accelerator is not None else None
        self.pool = (
            PinnedPool(self.accelerator.pinned, capacity=max(2, depth + 1))
            if self.accelerator is not None and plan.pin
            else None
        )
        self._transform = plan.transform
        self._thread = ThreadOffload(1, "device")
        self._host = HostCopy(_COPY_THREADS)
        # Tensors copied straight out of a worker's block, until their copies' event completes.
        self._holding: deque[tuple[Event, list[torch.Tensor]]] = deque()
        self._held_to_close: list[torch.Tensor] = []
        acc = self.accelerator
        self.registrations = Registrations(acc.register) if acc is not None and plan.pin else None

    async def open(self) -> None:
        """Initialise the device on the stage's thread (the first CUDA call can take seconds).

        Raises:
            RuntimeError: CUDA failed to initialise.

        Cancellation: a call already running finishes first (shielded); then it goes on.
        """
        if self.accelerator is not None:
            await self._thread.run(self.accelerator.open)

    async def stage(self, batch: Any, release: Callable[[], None] | None = None) -> Staged:
        """Pin ``batch`` and issue its copy to the device (and ``device_transform``).

        Args:
            batch: A collated batch.
            release: Called (on the loop's thread) when the consumer takes the batch, or when
                staging fails.

        Returns:
            A :class:`Staged` batch; the copies may still be running on the device.

        Raises:
            Exception: Copying or ``device_transform`` failed (e.g.
                ``torch.OutOfMemoryError``), with its original type.

        Cancellation: a batch whose staging has started on the thread is finished there
        (shielded) and dropped; its pinned buffer is reused once its copy is done.
        """
        return await self._thread.run(self._stage, batch, release)

    async def let_go(self) -> None:
        """Drop the tensors of worker blocks whose copies are done, on the stage's thread (as
        an epoch starts: the last one's blocks go back with its first jobs). Cancellation: as
        :meth:`open`."""
        if self.registrations is not None:
            await self._thread.run(self._let_go)

    async def aclose(self) -> None:
        """Wait for the copies still running, drop the pinned buffers, join the threads.

        Cancellation: shielded; the wait is bounded by the work already issued to the device.
        """
        with anyio.CancelScope(shield=True):
            try:
                await self._thread.run(self._close)
            finally:
                self._thread.close()
                self._host.close()

    # -- on the stage's thread -----------------------------------------------------------------

    def _close(self) -> None:
        if self.accelerator is not None:
            self.accelerator.close()
        self._holding.clear()  # the side stream is done: nothing reads them any more
        self._held_to_close.clear()
        if self.registrations is not None:
            self.registrations.close()
        if self.pool is not None:
            self.pool.clear()

    def _let_go(self) -> None:
        """Drop the block tensors whose copies have completed (their blocks go back to the
        workers once nothing else holds them), and undo the registrations of blocks gone."""
        while self._holding and self._holding[0][0].query():
            self._holding.popleft()
        if self.registrations is not None:
            self.registrations.let_go()

    def _stage(self, batch: Any, release: Callable[[], None] | None) -> Staged:
        acc = self.accelerator
        if acc is None:
            return Staged(map_pinnable(self._pin_leaf, batch), release=release)
        with torch.no_grad(), acc.side():
            moved, event = self._copy(acc, tensors_in(batch))
            out = map_tensors(lambda t: moved[id(t)], batch)
            leaves = list(moved.values())  # the batch's tensors, now on the device
            if self._transform is not None:
                out = self._transform(out)
                event = acc.record()
                leaves = tensors_in(out)  # what the transform returned, walked once more
        on_device = tuple(t for t in leaves if t.device == acc.device)
        return Staged(out, release=release, accelerator=acc, event=event, tensors=on_device)

    def _pin_leaf(self, leaf: Any) -> Any:
        """A tensor pinned (:meth:`_pinned`); another object with a ``pin_memory`` method (a
        custom batch type) pinned by that method, as torch's pin thread does."""
        return self._pinned(leaf) if isinstance(leaf, torch.Tensor) else leaf.pin_memory()

    def _pinned(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` copied into page-locked memory (torch's caching host allocator), with
        its layout where it is dense; one on a device, or pinned already, as it is."""
        if tensor.device.type != "cpu" or tensor.is_pinned():
            return tensor
        if not plain_cpu_tensor(tensor):  # sparse, a subclass, empty: torch's own pinning
            return tensor.pin_memory()
        out = page_locked(tensor.shape, _dense_strides(tensor), tensor.dtype)
        self._host.copy(out, tensor)
        return out

    def _copy(
        self, acc: Accelerator, leaves: list[torch.Tensor]
    ) -> tuple[dict[int, torch.Tensor], Event]:
        moved: dict[int, torch.Tensor] = {}
        packed: list[tuple[torch.Tensor, tuple[int, ...], int, int]] = []
        direct: list[torch.Tensor] = []  # in a worker's block registered with the device
        total = 0
        buffer = None
        self._let_go()
        try:
            for tensor in leaves:
                if not plain_cpu_tensor(tensor):
                    moved[id(tensor)] = tensor.to(acc.device)
                    continue
                if self._registered_block(tensor):
                    target = torch.empty_strided(
                        tensor.shape, _dense_strides(tensor), dtype=tensor.dtype, device=acc.device
                    )
                    direct.append(tensor)  # held from before its copy is issued
                    target.copy_(tensor, non_blocking=True)
                    moved[id(tensor)] = target
                    continue
                nbytes = tensor.numel() * tensor.element_size()
                packed.append((tensor, _dense_strides(tensor), total, nbytes))
                total += -(-nbytes // _ALIGN) * _ALIGN
            buffer = self.pool.take(total) if self.pool is not None and total else None
            for tensor, strides, offset, nbytes in packed:
                target = torch.empty_strided(
                    tensor.shape, strides, dtype=tensor.dtype, device=acc.device
                )
                if buffer is None:  # pin_memory=False: from pageable memory
                    target.copy_(tensor, non_blocking=True)
                elif not _copy_in_chunks(
                    self._host, tensor, buffer[offset : offset + nbytes], target
                ):
                    staging = buffer[offset : offset + nbytes].view(tensor.dtype)
                    staging = staging.as_strided(tensor.shape, strides)
                    self._host.copy(staging, tensor)
                    target.copy_(staging, non_blocking=True)
                moved[id(tensor)] = target
        except BaseException:
            self._hold(direct, self._give_back(acc, buffer, direct))
            raise
        event = self._give_back(acc, buffer, direct)
        self._hold(direct, event)
        return moved, event

    def _registered_block(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lies in a worker block registered with the device (now, if new)."""
        if self.registrations is None:
            return False
        block = find_block(tensor)
        return block is not None and self.registrations.ready(block)

    def _hold(self, direct: list[torch.Tensor], event: Event) -> None:
        if direct:
            self._holding.append((event, direct))

    def _give_back(
        self, acc: Accelerator, buffer: torch.Tensor | None, direct: list[torch.Tensor]
    ) -> Event:
        """An event after the copies issued so far; ``buffer`` is reused once it completes.
        Without one (recording failed), neither ``buffer`` nor the blocks of ``direct`` are
        known to be idle: the buffer is never reused, and ``direct`` is held until the stage
        closes, after the side stream is done."""
        try:
            event = acc.record()
        except BaseException:
            if buffer is not None and self.pool is not None:
                self.pool.discard(buffer)
            self._held_to_close.extend(direct)
            raise
        if buffer is not None and self.pool is not None:
            self.pool.give_back(buffer, event)
        return event
