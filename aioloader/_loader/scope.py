"""What one ``async with loader:`` owns.

Owns: the scope's task group, worker and I/O threads, device stage, the pace of its dataset's
awaited reads and its current epoch (:class:`Scope`); :class:`Running`, an epoch in progress as
the scope can stop it; and :class:`LoaderState`, what a loader and its scopes both change. Given
the loader's frozen plan (``_loader/plan.py``), never the loader. Never: validates arguments or
builds samplers (``_loader/loader.py``), hands out batches (``consumer.py``), or runs stages
(``_pipeline/epoch.py``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.abc

from .._data.datapipes import is_datapipe, shard_in_worker
from .._data.seeds import derive_seed
from .._data.sharding import resolve_rank
from .._data.source import InWorkers
from .._device.stage import DeviceStage
from .._pipeline.epoch import Epoch
from .._pipeline.fetch import Pace
from .._pipeline.handoff import HandoffReceive, HandoffSend
from .._workers.blocks import REUSED_FROM
from .._workers.offload import ThreadOffload
from .._workers.pool import WorkerPool
from .._workers.processes import ProcessWorkers
from .._workers.raypool import RayPool
from .checkpoint import Progress
from .progress import EpochProgress

if TYPE_CHECKING:
    from .._base.recorders import Recorders
    from .plan import LoaderPlan

__all__ = ["LoaderState", "Running", "Scope"]

T_Batch = TypeVar("T_Batch")


class LoaderState:
    """What a loader and its scopes both change.

    Attributes:
        stats: The recorders of the current (or last) scope.
        scope: The open scope, or None.
        iterable_len: The length an iterable dataset reported to ``len(loader)`` (batches past
            it warn, as torch's do), or None.
        progress: The consumer's record of the current (or last) epoch, or None before any.
        shown: The current (or last) epoch's progress line (and bar), or None before any.
        scopes: Scopes opened over the loader's life (``stats`` covers the last one).
        pipe_seed: A DataPipe's seed for the next epoch, drawn by a plain ``for`` before the
            scope it opens draws its own (torch's order), or None.
    """

    __slots__ = ("iterable_len", "pipe_seed", "progress", "scope", "scopes", "shown", "stats")

    def __init__(self, stats: Recorders) -> None:
        self.stats = stats
        self.scopes = 0
        self.scope: Scope | None = None
        self.iterable_len: int | None = None
        self.pipe_seed: int | None = None
        self.progress: Progress | None = None
        self.shown: EpochProgress | None = None


class Scope:
    """What one ``async with loader:`` owns: the task group, the threads, the device stage, the
    running epoch."""

    def __init__(
        self,
        plan: LoaderPlan,
        state: LoaderState,
        stack: contextlib.AsyncExitStack,
        *,
        one_epoch: bool = False,
    ) -> None:
        # Nothing here keeps the loader: a loop thread holding the scope must not keep a
        # dropped loader (and its persistent workers) alive.
        self.plan = plan
        self.stack = stack
        self.thread = threading.get_ident()
        self.task_group: anyio.abc.TaskGroup | None = None
        self.work: WorkerPool
        worker_init_fn = plan.arguments.worker_init_fn
        # Without `seed=`, each scope draws anew, as each torch iterator does (a plain `for`
        # without `with` is a scope per epoch: new augmentations each), whatever the workers.
        worker_seed = plan.scope_seed()
        dataset = plan.source.dataset if isinstance(plan.source, InWorkers) else None
        if is_datapipe(dataset):  # each worker keeps its share of the pipe, as torch's do
            rank, world_size = resolve_rank(None, None)
            worker_init_fn = functools.partial(shard_in_worker, worker_init_fn, rank, world_size)
        device = plan.device_plan
        # A stage that pins reads batches out of blocks the workers reuse: with a device, it
        # copies them to the device straight out of the (registered) block. Pinning only, it
        # copies them into pinned memory from a block mapped once, not a new segment a batch:
        # less of the training process's CPU, where the workers live long enough to reuse
        # their blocks; workers that make few batches each (one short epoch) would pay a
        # block's first trip and a copy for each (docs/design.md, "Worker blocks").
        blocks = (
            device is not None
            and device.pin
            and (device.accelerator is not None or not (one_epoch and _few_batches_each(plan)))
        )
        if plan.ray is not None and plan.num_workers > 0:
            self.work = RayPool(
                plan.ray,
                plan.num_workers,
                seed=worker_seed,
                derive=derive_seed,
                worker_init_fn=worker_init_fn,
                stats=state.stats.workers,
                dataset=dataset,
            )
        elif plan.in_processes:
            self.work = ProcessWorkers(
                plan.num_workers,
                context=plan.start_method,
                seed=worker_seed,
                derive=derive_seed,
                worker_init_fn=worker_init_fn,
                stats=state.stats.workers,
                dataset=dataset,
                blocks=blocks,
                start_timeout=plan.arguments.timeout,
            )
        else:
            self.work = ThreadOffload(
                plan.worker_threads,
                "worker",
                # torch never calls it without worker processes (its own example reads
                # get_worker_info(), None there); thread workers (worker_mode="thread") do
                worker_init_fn=worker_init_fn if plan.num_workers else None,
                inline_below=plan.work_inline_below,
            )
        self.io: ThreadOffload | None = None
        self.device = DeviceStage(device, depth=plan.device_depth) if device else None
        self.current: Running | None = None
        self.pace = Pace()  # how long the dataset's awaited reads take, epoch after epoch

    def process_pool(self) -> ProcessWorkers | None:
        """The scope's worker processes (torch's ``_workers`` are views of them), or None where
        its workers are none, threads or Ray actors."""
        return self.work if isinstance(self.work, ProcessWorkers) else None

    def offload(self) -> ThreadOffload:
        if self.io is None:
            self.io = ThreadOffload(
                self.plan.io_threads, "io", inline_below=self.plan.io_inline_below
            )
        return self.io

    def close_iteration(self) -> None:
        if self.current is not None:
            self.current.close_stream()

    async def start_workers(self) -> None:
        """Start the worker processes, then initialise the device (off the loop)."""
        await self.work.start()
        if self.device is not None:
            await self.device.open()

    async def close_workers(self) -> None:
        """Stop the workers and threads, and close the device stage (its copies finish)."""
        try:
            await self.work.aclose()
            if self.io is not None:
                self.io.close()
        finally:
            if self.device is not None:
                await self.device.aclose()


class Running:
    """An epoch in progress and the consumer's end of its output. It refers to no loader, so the
    scope can stop it (a new epoch starting, the scope closing) whoever holds the iterator.

    An epoch made on demand (``_pipeline/demand.py``) has no stages (``epoch`` and ``recv``
    None) until it hands the rest of its batches over to them (:meth:`run_stages`).
    """

    def __init__(self, shown: EpochProgress) -> None:
        self.epoch: Epoch | None = None
        self.recv: HandoffReceive[Any] | None = None
        self.shown = shown
        self.closed = False

    def run_stages(
        self,
        group: anyio.abc.TaskGroup,
        epoch: Epoch,
        out: HandoffSend[Any],
        recv: HandoffReceive[Any],
        name: str,
    ) -> None:
        """Run ``epoch``'s stages in ``group``, their output read from ``recv``: started with
        nothing to await, so that nothing befalling the caller meanwhile cancels them (a caller
        cancelled in anyio's ``start()`` had them cancelled before they ran, and its next call
        read their closed output as the epoch's end: found by review; asyncio's own
        cancellation, as ``asyncio.timeout`` around ``anext()`` sends it, reaches through an
        anyio shield). A scope closing meanwhile runs none: the stream is closed, so the next
        receive ends the epoch.
        """
        self.epoch, self.recv = epoch, recv
        try:
            group.start_soon(epoch.run, out, name=name)
        except RuntimeError:  # the group is no longer active: the scope is closing
            epoch.finished.set()
            self.close_stream()

    def close_stream(self) -> None:
        self.closed = True
        self.shown.close()  # a bar left by a break ends its line here
        recv = self.recv
        if recv is None:
            return
        # Ready batches (perhaps on the device) are dropped now, not when the iterator is.
        with contextlib.suppress(anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
            while True:
                recv.receive_nowait()
        recv.close()

    async def aclose(self) -> None:
        """Stop the epoch and wait until its tasks are gone. Cancellation: the wait is shielded."""
        self.close_stream()
        epoch = self.epoch
        if epoch is not None and not epoch.finished.is_set():
            epoch.cancel_scope.cancel()  # one not yet begun ends as it begins
            if epoch.began:  # (one whose group was cancelled first never will)
                with anyio.CancelScope(shield=True):
                    await epoch.finished.wait()


def _few_batches_each(plan: LoaderPlan) -> bool:
    """Whether one epoch gives each worker fewer than ``REUSED_FROM`` batches to make (too few
    to reuse worker blocks), from its sampler's length; False where that is unknown (an
    iterable dataset: its ``len`` is not asked, which torch's warnings would count)."""
    sampler = plan.batch_sampler if plan.batch_sampler is not None else plan.sampler
    try:
        return len(sampler) < REUSED_FROM * max(1, plan.num_workers)  # type: ignore[arg-type]
    except TypeError:  # None (an iterable dataset), or a sampler without a length
        return False
