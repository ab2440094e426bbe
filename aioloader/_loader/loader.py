"""``aioloader.DataLoader``: torch's DataLoader arguments, an asyncio pipeline underneath.

Owns: the ``DataLoader`` class: torch's signature and its docstring, the attributes that read
the arguments back (views of the plan: ``settings.py``), ``len()``, ``set_epoch``, the consumer
side of iteration (``async for``, and a plain ``for`` through ``session.py``'s background
loop), progress and statistics. Its base classes open and close its scope (``async with`` /
``with``: ``lifecycle.py``) and save and load its state (``state_dict.py``). Never: checks
arguments itself (``arguments.py``, ``plan.py``), runs pipeline stages (``_pipeline/epoch.py``)
or decides order (``_data/sampler.py``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, TypeVar

import torch

from .._base.exceptions import LoaderStateError
from .._base.recorders import Recorders
from .._base.retry import RetryPolicy
from .._base.stats import LoaderStatistics
from .._base.verdict import verdict
from .._data.datapipes import draw_pipe_seed
from .._data.epochs import claim_epochs
from .._data.order import owner_epoch
from .._data.seeds import draw_seed
from .._data.source import InWorkers, dataset_length
from .._workers.rayspec import RayWorkers
from .arguments import Arguments, non_negative_int
from .checkpoint import EpochState
from .consumer import EpochIterator
from .lifecycle import ScopeLifecycle
from .plain import PlainIterator
from .plan import plan_loader
from .scope import LoaderState, Scope
from .session import Session
from .settings import Setting
from .state_dict import Resumable
from .torchnames import TorchNames, torch_batches, torch_sampler

__all__ = ["DataLoader"]

T_Batch = TypeVar("T_Batch")


class DataLoader(ScopeLifecycle, Resumable, TorchNames, torch.utils.data.DataLoader[T_Batch]):
    """Batches from an async or ordinary dataset, fetched concurrently, yielded by ``async for``.

    The positional arguments and their meanings are those of ``torch.utils.data.DataLoader``, so a
    torch user switches by changing the import; the keyword-only ones are aioloader's own. It is
    a subclass of torch's ``DataLoader``, so the tools that check for one (Lightning's sampler
    injection under DDP, among others) treat it as one; torch's ``__init__`` is not run (the
    plan below takes its place) and every method torch's iteration uses is this class's own.

    Args:
        dataset: An :class:`~aioloader.AsyncDataset`, an async iterable (an
            :class:`~aioloader.AsyncIterableDataset`, any object with ``__aiter__``, or an async
            generator function, called once per epoch), a torch ``Dataset`` or ``IterableDataset``,
            or a sequence. Async datasets run in the event loop. A blocking (torch) dataset runs
            where torch runs it: with ``num_workers > 0`` process workers, each worker gets its
            own copy when it starts and reads batches from it (``get_worker_info()`` works in
            ``__getitem__``/``__iter__``); otherwise it is read on the loader's I/O threads.
            A dataset that is an async context manager (one holding a client session) is
            entered when the loader's scope opens and exited when it closes.
        batch_size: Samples per batch; None disables batching (each sample is converted with
            :func:`default_convert` or ``collate_fn`` and yielded alone).
        shuffle: Reshuffle every epoch (map-style datasets only).
        sampler: Yields the indices of an epoch (mutually exclusive with ``shuffle``).
        batch_sampler: Yields lists of indices (mutually exclusive with ``batch_size``,
            ``shuffle``, ``sampler`` and ``drop_last``).
        num_workers: Worker processes, one batch per job, tensors returned through shared
            memory. They read a blocking dataset (its copy lives in each worker) and run
            ``transform`` and ``collate_fn``; an async dataset's samples are read in the event
            loop and sent to them, unless it gives the workers a reader of their own
            (``AsyncDataset.for_workers``: ``sources.files`` does) and ``max_inflight``,
            ``max_inflight_bytes`` and ``sample_timeout`` are at their defaults. 0 reads in
            this process and transforms on one thread off the event loop.
        collate_fn: Turns a list of samples into a batch (default: :func:`default_collate`).
        pin_memory: Copy batches into page-locked memory (only with an accelerator; warns once
            and goes on unpinned without one). With a CUDA ``device``, batches go through a
            pool of pinned buffers reused across batches; without one, each batch is pinned on
            the host (torch's behaviour). Pinning runs on a thread of the loader's own.
        drop_last: Drop the last incomplete batch.
        timeout: Seconds to wait for a batch before raising :class:`~aioloader.LoaderTimeout`
            (0: wait for ever).
        worker_init_fn: Called once in each worker as it starts, with the worker's id.
        multiprocessing_context: The workers' start method: ``"forkserver"`` (the default: the
            fork server preloads torch once, then each worker starts in tens of milliseconds)
            or ``"spawn"``, or ``"fork"`` with torch's meaning (each worker a fork of this
            process as the workers start: the dataset is not pickled; the workers inherit the
            process's descriptors and, from a thread's lock held then, a possible hang), or a
            context using one. Needs ``num_workers > 0``.
        generator: A ``torch.Generator`` the random sampler draws its base seed from.
        prefetch_factor: Torch's name for ready batches per worker; sets ``prefetch`` to
            ``prefetch_factor * num_workers`` when ``prefetch`` is not given.
        persistent_workers: Keep the workers (and, for a plain ``for``, the background event
            loop) from one epoch to the next until :meth:`close`, or the interpreter's exit, as
            torch does (needs ``num_workers > 0``). Without it a plain ``for`` outside ``with
            loader:`` starts its workers each epoch. Inside ``async with`` / ``with`` the
            workers always live as long as the scope.
        pin_memory_device: Accepted for torch compatibility (``device`` says where batches go).
        in_order: Yield batches in sampler order (through a reorder buffer); False yields each
            batch as soon as it is complete.
        transform: Applied to every sample before collation: off the event loop, except with
            ``num_workers=0`` while it (with ``collate_fn``) has been taking under a
            millisecond a batch, when it runs on the loop's thread as torch runs it in the
            caller's.
        max_inflight: Most sample fetches running at once (a batched source counts its whole
            batch). Like ``max_inflight_bytes`` and ``sample_timeout``, set to other than its
            default it keeps an async dataset's reads in this process (where worker processes
            would read it themselves: see ``num_workers``).
        prefetch: Most finished batches waiting for the consumer (default 2). With
            ``num_workers=0`` and a dataset whose reads and transforms are fast, a batch is
            made in the call that asks for it, as torch's ``num_workers=0`` loop makes it,
            and none waits; giving ``prefetch`` asks for batches made ahead instead.
        max_inflight_bytes: Soft bound on fetched bytes held in unfinished batches: new fetches
            wait while it is exceeded (the oldest batch may always finish).
        seed: Base seed: of the shuffle order, and of each batch's work in worker processes
            (``random``, NumPy and torch are seeded from seed, epoch and batch index before a
            batch is transformed, so augmentations are the same whatever ``num_workers`` is).
            None draws one from ``generator`` or torch's default generator.
        retry: Retry policy for fetches (None: no retries).
        sample_timeout: Seconds one fetch attempt may take (None: no limit); a timeout is
            retried when the policy retries ``TimeoutError``.
        max_failures: Failed samples an epoch may skip (counted, logged and reported in
            :meth:`statistics`); a failure past them is raised in its batch's turn, and the
            epoch goes on with the next batch, as without a budget. 0: none is skipped.
        distributed: Shard the data across ranks: a ``DistributedSampler`` for map-style
            datasets; for a stream, rank ``r`` takes samples ``r, r + W, ...`` (every rank
            reads the stream) and the last round is padded with samples from the stream's
            start, so every rank yields as many batches; for an ``IterableDataset`` in worker
            processes the same rule applies to its batches (the first ``W`` are kept for the
            padding). Shard in the dataset itself to read less.
        rank: This process's rank (default: ``torch.distributed`` when initialised, else 0;
            read again as each scope opens: a loader built before the group follows it).
        world_size: The number of ranks (default: ``torch.distributed``, else 1; likewise).
        io_threads: Threads that call a blocking (torch) dataset read in this process
            (``num_workers=0`` or ``worker_mode="thread"``). Default (None): as in torch, one
            call of ``__getitem__`` at a time, so a dataset that is not thread-safe (a shared
            file handle, an HDF5 file) reads correctly; on one thread of the loader's own, or,
            while reads have been taking under a millisecond, on the event loop's thread (a
            thread hop would cost more than the read). Given, every read runs on that many
            threads: 1 for a dataset that must always be called from the same thread (a
            sqlite connection); more overlap blocking reads (slow storage, network), only for a
            dataset that can be called from several threads at once.
        worker_mode: ``"process"`` (default): ``num_workers`` spawned processes;
            ``"thread"``: ``num_workers`` threads (for GIL-releasing code or free-threaded
            Python); ``"ray"`` or an :class:`aioloader.RayWorkers`: ``num_workers`` Ray actors
            on the cluster ``ray.init()`` joins (joined here, on this thread, unless the
            program did; needs ``aioloader[ray]``), which do what worker processes do.
            Processes and actors are sent ``transform``, ``collate_fn`` and ``worker_init_fn``
            pickled (a lambda or a closure by value); what cannot be is named here.
        device: Where batches go: ``"cuda"`` (the current CUDA device; under torchrun the
            local rank's, from ``LOCAL_RANK``), ``"cuda:N"`` or a ``torch.device``. Every
            tensor of a batch (in mappings, named tuples, dataclasses, lists, tuples) is copied
            with ``non_blocking=True`` on a dedicated CUDA stream, off the event loop; a batch
            handed out is safe to use on the consumer's current stream, and at most
            ``max(prefetch, 1)`` batches are on the device ahead of the consumer. Non-tensors
            are left as they are. ``"cpu"`` or None: batches stay on the host.
        device_transform: Applied to each batch on the device after the copy, on the same
            stream (e.g. ``uint8`` to normalised float), so the host never handles the larger
            data; it runs on the device stage's thread under ``torch.no_grad()``. Without a CUDA
            ``device`` it is applied after ``collate_fn``, where collation runs.
        progress: Show a bar per epoch on stderr (tqdm when installed), with samples/s and the
            share of the time the consumer waited for data; one line per epoch when stderr
            is not a terminal. :meth:`progress` gives the same line for a loop of your own.

    Raises:
        TypeError: ``dataset`` or a callable argument has the wrong type.
        ValueError: An argument is out of range or conflicts with another (``device="cuda"``
            without CUDA, among others); the message names it.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Iterable[int] | None = None,
        batch_sampler: Iterable[Sequence[int]] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], object] | None = None,
        multiprocessing_context: object = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        transform: Callable[[Any], Any] | None = None,
        max_inflight: int = 64,
        prefetch: int | None = None,
        max_inflight_bytes: int | None = None,
        seed: int | None = None,
        retry: RetryPolicy | None = None,
        sample_timeout: float | None = None,
        max_failures: int = 0,
        distributed: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        io_threads: int | None = None,
        worker_mode: Literal["process", "thread", "ray"] | RayWorkers = "process",
        device: str | torch.device | None = None,
        device_transform: Callable[[Any], Any] | None = None,
        progress: bool = False,
    ) -> None:
        # Every argument, as given (the signature above is torch's, for users and their tools).
        given = {name: value for name, value in locals().items() if name != "self"}
        self._plan = plan_loader(Arguments(**given), self._offload)
        # As given in __dict__ too, where torch keeps them and tools read them (Lightning rebuilds
        # a loader from vars(loader)); reads go to the settings, kept in step (`progress`, a
        # method, would be hidden). docs/design.md: "The class is torch's".
        vars(self).update((name, value) for name, value in given.items() if name != "progress")
        self._state = LoaderState(self._new_recorders())  # shared with the scopes
        self._session: Session | None = None  # the background loop of `with` / plain `for`
        # The loader owns a stream's epochs (it passes them as each opens); one chosen with
        # the dataset's set_epoch before now is where it starts.
        first = claim_epochs(self._plan.dataset)
        self._next_epoch = 0 if first is None else first
        self._epoch_given = first is not None  # by set_epoch: see __aiter__
        self._resume: EpochState | None = None  # loaded, for the next epoch to go on from
        self._stopped_at: float | None = 0.0
        self._plain: weakref.ref[PlainIterator[T_Batch]] | None = None  # owns a plain-for scope
        self._iterating = threading.Lock()  # iter() in two threads at once: one after the other

    # torch's guard runs after its own __init__, not run here; the settings guard (at the
    # caller's line: no frame of this one's own).
    __setattr__ = object.__setattr__  # type: ignore[assignment]

    # -- the settings: views of the plan -------------------------------------------------------
    # torch's attributes (and aioloader's arguments) read the plan. Those that define the
    # epochs cannot change (torch's ValueError); the others can between iterations, as in
    # torch: the new value is checked as at construction and the next scope runs with it.

    dataset: Setting[Any] = Setting()
    batch_size: Setting[int | None] = Setting(resolved=True)
    # (where the plan has none, torch's: a stream's is endless; see torchnames.py)
    sampler: Setting[Iterable[int]] = Setting(resolved=True, shown=torch_sampler)
    batch_sampler: Setting[Any] = Setting(resolved=True, shown=torch_batches)
    num_workers: Setting[int] = Setting()
    collate_fn: Setting[Callable[[Any], Any]] = Setting(resolved=True)
    pin_memory: Setting[bool] = Setting()
    drop_last: Setting[bool] = Setting()
    timeout: Setting[float] = Setting()
    worker_init_fn: Setting[Callable[[int], object] | None] = Setting()  # type: ignore[assignment]
    multiprocessing_context: Setting[object] = Setting()
    generator: Setting[torch.Generator | None] = Setting()
    prefetch_factor: Setting[int | None] = Setting()
    persistent_workers: Setting[bool] = Setting()
    pin_memory_device: Setting[str] = Setting()
    in_order: Setting[bool] = Setting()
    transform: Setting[Callable[[Any], Any] | None] = Setting()
    max_inflight: Setting[int] = Setting()
    prefetch: Setting[int] = Setting(resolved=True)
    max_inflight_bytes: Setting[int | None] = Setting()
    seed: Setting[int | None] = Setting()
    retry: Setting[RetryPolicy | None] = Setting()
    sample_timeout: Setting[float | None] = Setting()
    max_failures: Setting[int] = Setting()
    distributed: Setting[bool] = Setting()
    rank: Setting[int] = Setting(resolved=True)
    world_size: Setting[int] = Setting(resolved=True)
    io_threads: Setting[int] = Setting(resolved=True)
    worker_mode: Setting[str | RayWorkers] = Setting()
    device: Setting[torch.device | None] = Setting(resolved=True)
    device_transform: Setting[Callable[[Any], Any] | None] = Setting()

    @property
    def start_method(self) -> Any:
        """The worker processes' start method (a name, or the context given)."""
        return self._plan.start_method

    @property
    def base_seed(self) -> int:
        """``seed``, or a random one (from the OS: building the loader draws nothing from
        torch's generators, as building torch's does not)."""
        return self._plan.base_seed

    def _replan(self, name: str, value: object) -> None:
        # Past __setattr__: Lightning replays what a hook sets on the loader it rebuilds, and an
        # old plan would undo the sampler it injected (the setting itself is replayed).
        object.__setattr__(self, "_plan", self._plan.replaced(name, value, self._offload))
        vars(self)[name] = value  # the argument as given, for vars(loader): see __init__

    @property
    def _scope(self) -> Scope | None:
        """The open scope, or None."""
        return self._state.scope

    @property
    def _stats(self) -> Recorders:
        return self._state.stats

    # -- torch's surface -----------------------------------------------------------------------

    def __len__(self) -> int:
        """Batches per epoch (torch's rule: for an iterable, from ``len(dataset)``).

        Raises:
            TypeError: The dataset is iterable and has no length.
        """
        self._refresh_plan(raising=False)
        if (order := self._plan.order) is not None:  # (a stream's, torch's, has no length)
            return len(order)  # type: ignore[arg-type]  # torch's: may raise TypeError
        n = dataset_length(self.dataset)  # read now: a dataset whose length changes is followed
        if n is None:
            raise TypeError(f"object of type {type(self.dataset).__qualname__!r} has no len()")
        self._state.iterable_len = n  # batches past it warn, as torch's
        if self.world_size > 1:  # each rank's share, padded (``sharding.StreamShare``)
            n = -(-n // self.world_size)
        if self.batch_size is None:
            return n
        if self.drop_last:
            return n // self.batch_size
        return -(-n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch the next iteration runs (it seeds the shuffle order). Without it,
        each iteration runs the epoch after the previous one, starting at 0.

        An epoch left unfinished (a ``break``) is over for :meth:`state_dict` from here: the
        state becomes the start of ``epoch``.

        Raises:
            TypeError, ValueError: ``epoch`` is not an int >= 0.
            LoaderStateError: A state loaded with :meth:`load_state_dict` is of another epoch
                (setting this one would drop it silently).
        """
        self._choose_epoch(non_negative_int("epoch", epoch), "set_epoch")
        self._epoch_given = True

    # -- progress and statistics ---------------------------------------------------------------

    def progress(self) -> str:
        """The running (or last) epoch's progress in one line, for a loop of your own to log:
        ``epoch 1: 3,200/10,000 samples, 5,120 samples/s, consumer waited 12%``
        (``progress=True`` draws it as a bar)."""
        shown = self._state.shown
        return "no epoch started" if shown is None else shown.line()

    def statistics(self) -> LoaderStatistics:
        """A frozen snapshot of the counters of the current (or last) scope, with its verdict:
        which stage limited throughput, and what to change. A plain ``for`` without ``with
        loader:`` or ``persistent_workers=True`` opens a scope per epoch: then it covers the
        last epoch (``scopes`` counts them, and the summary says so)."""
        s = self._stats
        end = self._stopped_at if self._scope is None else None
        elapsed = (end if end else time.perf_counter()) - s.started
        stats = LoaderStatistics(
            epochs=s.epochs,
            elapsed_s=elapsed if s.epochs else 0.0,
            stages=tuple(r.snapshot() for r in s.stages),
            consumer=s.consumer.snapshot(),
            skipped_samples=tuple(s.skipped),
            bytes_held=s.bytes_held,
            max_bytes_held=s.max_bytes_held,
            made_on_demand=s.made_on_demand,
            workers=s.workers.snapshot() if s.workers.processes else None,
            scopes=self._state.scopes,
        )
        device = self._plan.device_plan
        pinned = device is not None and device.pin
        to_device = device is not None and device.accelerator is not None
        reads_in_workers = isinstance(self._plan.source, InWorkers)
        said = verdict(stats, pinned=pinned, to_device=to_device, reads_in_workers=reads_in_workers)
        return dataclasses.replace(stats, verdict=said)

    # -- iteration -------------------------------------------------------------------------------

    def __aiter__(self) -> EpochIterator[T_Batch]:
        """Start iterating one epoch (the next one, or the one given to :meth:`set_epoch`).

        Raises:
            LoaderStateError: The loader's scope is not open (use ``async with loader:``).
        """
        if self._scope is None:
            raise LoaderStateError(
                "iterate the loader inside its scope: `async with loader: async for batch in "
                "loader: ...` (or use a plain `for` loop, which runs its own scope)"
            )
        owned = owner_epoch(self._plan.sampler, self._plan.batch_sampler)
        if owned is not None and not self._epoch_given:  # torch's idiom: sampler.set_epoch
            self._choose_epoch(owned, "sampler.set_epoch")
        number, self._next_epoch = self._next_epoch, self._next_epoch + 1
        given, self._epoch_given = self._epoch_given, False
        resume, self._resume = self._resume, None
        if resume is not None and resume.epoch != number:  # pragma: no cover - set_epoch refuses
            resume = None
        iterator: EpochIterator[T_Batch] = EpochIterator(
            self._state, self._scope, number, resume, given
        )
        self._state.shown = iterator.shown
        self._state.progress = iterator.progress  # the epoch under way, even before its first batch
        return iterator

    def __iter__(self) -> PlainIterator[T_Batch]:  # type: ignore[override]  # not torch's iterator class
        """Iterate one epoch from synchronous code: the pipeline runs on an event loop in a
        background thread. Leaving the loop early (``break``, an exception, dropping the
        iterator) stops the epoch. Without ``with loader:``, the scope (and its workers) lives
        for this epoch only, unless ``persistent_workers=True`` keeps it for the next.

        Raises:
            LoaderStateError: The loader's ``async with`` scope is open on this thread (the
                loop would block the event loop that runs the pipeline).
        """
        with self._iterating:  # one thread ends the earlier iterator and begins this one
            owner = self._plain() if self._plain is not None else None
            if owner is not None and self._session is None:
                owner.supersede()  # torch starts a new epoch; ours ends the earlier one's first
            if self._scope is not None and self._session is None:
                if self._scope.thread == threading.get_ident():
                    raise LoaderStateError(
                        "a plain `for` inside `async with loader:` would block the event "
                        "loop; use `async for`"
                    )
                raise LoaderStateError("the loader's scope is open in another thread")
            if self._session is not None:
                return PlainIterator(self, self._session, owned=False)
            self._refresh_plan()  # here, not on the loop's thread (Ray's join_cluster)
            a = self._plan.arguments  # a DataPipe's epoch seed first, as torch's iterator has it
            self._state.pipe_seed = draw_pipe_seed(self._plan.dataset, a.seed, a.generator)
            persistent = self.persistent_workers
            session = Session(self, persistent=persistent, one_epoch=not persistent)
            if self._state.pipe_seed is not None and self.num_workers:
                draw_seed(a.generator)  # and the one torch's multiprocessing iterator never uses
            if session.persistent:
                self._session = session
                return PlainIterator(self, session, owned=False)
            iterator: PlainIterator[T_Batch] = PlainIterator(self, session, owned=True)
            self._plain = weakref.ref(iterator)
            return iterator

    def __repr__(self) -> str:
        return (
            f"aioloader.DataLoader({type(self.dataset).__qualname__}, "
            f"batch_size={self.batch_size}, num_workers={self.num_workers}, "
            f"max_inflight={self.max_inflight}, prefetch={self.prefetch}, "
            f"in_order={self.in_order}"
            + (f", device='{self.device}')" if self.device is not None else ")")
        )
