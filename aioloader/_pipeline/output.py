"""The output stage of an epoch: finished batches in order, to the device, to the consumer.

Owns: :class:`OutputStage`, the part of :class:`~aioloader._pipeline.epoch.Epoch` that takes
done batches, restores their order (``in_order``: a :class:`ReorderBuffer`, with the places a
resumed epoch's consumer took skipped), stages each on the device (at most ``depth`` staged
batches ahead of the consumer: a slot per batch, given back when the consumer takes it), and
puts it on the output stream with its marks; a failed batch goes out as :class:`Raised` in its
turn, and the places of batches with nothing left in them go with the next item. Each batch
going out gives back its window slot and its bytes. Never: schedules, fetches or transforms
(``epoch.py`` and ``transform.py`` do), or decides order itself (``reorder.py`` does).
"""

from __future__ import annotations

from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from .._base.exceptions import annotate
from .._base.recorders import Recorders
from .._data.resume import Mark, Taken
from .._device.stage import DeviceStage, Staged
from .config import PipelineConfig
from .flow import ByteBudget, blocked, get, put
from .handoff import HandoffSend
from .items import Done, Raised
from .reorder import ReorderBuffer

__all__ = ["OutputStage"]


class OutputStage:
    """The reorder + device + output stage of an :class:`~aioloader._pipeline.epoch.Epoch`
    (its base class): the epoch sets the attributes below, and admits the batches whose window
    slots this stage gives back."""

    number: int
    config: PipelineConfig
    stats: Recorders
    device: DeviceStage | None
    taken: Taken | None
    error: BaseException | None
    _on_device: anyio.Semaphore
    _slots: anyio.Semaphore
    _bytes: ByteBudget
    _open_batches: int
    _empty_ahead: list[Mark]

    async def _emit(self, done: MemoryObjectReceiveStream[Done], out: HandoffSend[Any]) -> None:
        taken = self.taken
        reorder: ReorderBuffer[Done] = ReorderBuffer(taken.through if taken else 0)
        for seq in sorted(taken.beyond) if taken else ():
            reorder.skip(seq)  # taken before the stop: never scheduled
        empty = self._empty_ahead  # places of batches with nothing left: taken with the next item
        async with done:
            while (item := await get(done, self.stats.output)) is not None:
                deliverable = reorder.push(item.batch.seq, item) if self.config.in_order else [item]
                self.stats.transform.set_queued(
                    len(reorder) + done.statistics().current_buffer_used
                )
                for d in deliverable:
                    if d.error is not None:  # its turn has come: every batch before it is out
                        # Handed over, not kept: raised in the consumer, the error's traceback
                        # holds the consumer's frames (and its iterator), which no task of ours
                        # may keep alive.
                        error, d.error, d.batch.error = d.error, None, None
                        own = ((d.batch.seq, 0, d.batch.mark),) if d.batch.counted else ()
                        marks, empty = (*empty, *own), []
                        await put(out, Raised(error, marks), self.stats.output)
                        del error
                    elif d.size:
                        value = d.value if self.device is None else await self._stage(d)
                        mark = (d.batch.seq, d.size, d.batch.mark)
                        if empty:  # the places of empty batches go with this one
                            marks, empty = (*empty, mark), []
                        else:
                            marks = (mark,)
                        await put(out, (value, d.size, marks), self.stats.output)
                        self.stats.output.completed += 1
                        self.stats.output.set_queued(out.statistics().current_buffer_used)
                    else:  # nothing left of it: its place goes with the next item
                        empty.append((d.batch.seq, 0, d.batch.mark))
                    self._bytes.release(d.batch.seq, d.batch.nbytes)
                    self.stats.bytes_held = self._bytes.held
                    self.stats.window.finish(None)
                    self._open_batches -= 1
                    self._slots.release()

    async def _stage(self, d: Done) -> Staged:
        """Pin a batch and issue its copy to the device, once fewer than ``depth`` staged
        batches wait for the consumer. A failure ends the epoch in the batch's turn."""
        device, rec = self.device, self.stats.device
        if device is None:
            raise RuntimeError("no device stage")
        try:
            self._on_device.acquire_nowait()
        except anyio.WouldBlock:
            with blocked(rec, "put"):  # the device is `depth` batches ahead of the consumer
                await self._on_device.acquire()
        try:
            with rec.operation():
                staged = await device.stage(d.value, self._taken)
        except Exception as exc:
            self._taken()
            annotate(exc, "device", epoch=self.number, batch=d.batch.seq)
            self.error = exc
            raise
        except BaseException:  # cancelled: the staging itself finished on its thread
            self._taken()
            raise
        rec.set_queued(device.depth - self._on_device.value)
        return staged

    def _taken(self) -> None:
        """A staged batch left the device's queue: the consumer took it, or staging failed."""
        self._on_device.release()
        if self.device is not None:
            self.stats.device.set_queued(self.device.depth - self._on_device.value)
