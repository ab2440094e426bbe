"""What a loader runs with: one frozen plan, built from its arguments.

Owns: :class:`LoaderPlan` (the checked arguments, what is derived from them: the dataset's
kind and its wrapping for the pipeline, the sampler and batch sampler, the pipeline's sizes,
the device plan, the workers' start method, the base seed) and :func:`plan_loader`, which
builds it once. The loader's torch-visible attributes are views of the plan; scopes and epochs
are given the plan, never the ``DataLoader``. Never: runs anything, or refers to the loader (a
scope holding the plan does not keep a dropped loader alive).
"""

from __future__ import annotations

import dataclasses
import functools
import secrets
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from .._base.inline import INLINE_BELOW_S
from .._data.collate import default_collate
from .._data.convert import default_convert
from .._data.datapipes import set_shuffle
from .._data.order import PLAIN_BATCHERS, map_order
from .._data.sampler import DistributedSampler, RandomSampler
from .._data.seeds import draw_seed
from .._data.sharding import resolve_rank
from .._data.source import InWorkers, Kind, MapSource, open_source, reads_at_once
from .._data.streams import StreamSource
from .._device.plan import DevicePlan, device_plan
from .._pipeline.config import PipelineConfig
from .._workers.byvalue import check_worker_init_fn, inherited, sendable
from .._workers.datasetmethod import on_worker_dataset
from .._workers.mainmodule import workers_main
from .._workers.offload import ThreadOffload
from .._workers.raycluster import join_cluster
from .._workers.rayspec import RayWorkers
from .._workers.serverstart import prepare_forkserver, start_method_name
from .arguments import ASYNC_FETCH_OPTIONS, Arguments, check_arguments, fetch_options_given

__all__ = ["EPOCH_DEFINING", "LoaderPlan", "plan_loader"]

T = TypeVar("T")

# The arguments that define the epochs: fixed once the loader exists (torch's rule for its
# own, and ours for what decides the order and the ranks' shares).
EPOCH_DEFINING = frozenset(
    {
        "dataset",
        "batch_size",
        "shuffle",
        "sampler",
        "batch_sampler",
        "drop_last",
        "persistent_workers",
        "seed",
        "distributed",
        "rank",
        "world_size",
    }
)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoaderPlan:
    """A loader's settings, checked and resolved.

    Attributes:
        arguments: The arguments as given.
        kind: What kind of dataset it is.
        source: The dataset wrapped for the pipeline (or for the workers).
        sampler, batch_sampler: The map-style order (None for a stream), as torch builds them.
        batch_size: None when a batch sampler batches (torch's convention).
        collate_fn: The collate function (torch's default when none was given).
        prefetch: Ready batches held for the consumer (``prefetch_factor * num_workers`` when
            only torch's argument was given).
        io_threads: Threads that call a blocking dataset read in this process.
        device: Where batches go (a resolved ``torch.device``), or None.
        device_plan: The device stage's plan, or None.
        start_method: The worker processes' start method.
        ray: Where the workers run when they are Ray actors, else None.
        rank, world_size: This rank's share (0 of 1 unless ``distributed``).
        base_seed: ``seed``, or a random one (from the OS, not torch's generators).
        config: The epoch's sizes and functions.
    """

    arguments: Arguments
    kind: Kind
    source: MapSource | StreamSource | InWorkers
    sampler: Iterable[int] | None
    batch_sampler: Iterable[Sequence[int]] | None
    batch_size: int | None
    collate_fn: Callable[[Any], Any]
    prefetch: int
    io_threads: int
    device: torch.device | None
    device_plan: DevicePlan | None
    start_method: Any
    ray: RayWorkers | None
    rank: int
    world_size: int
    base_seed: int
    config: PipelineConfig

    # -- what scopes read, derived in one place -------------------------------------------------

    @property
    def dataset(self) -> Any:
        return self.arguments.dataset

    @property
    def num_workers(self) -> int:
        return self.arguments.num_workers

    @property
    def in_processes(self) -> bool:
        """Whether the workers are processes, local or Ray actors (else threads run the
        transforms)."""
        a = self.arguments
        return a.num_workers > 0 and (a.worker_mode == "process" or self.ray is not None)

    @property
    def worker_threads(self) -> int:
        """Threads that transform and collate when the workers are not processes."""
        return max(1, self.arguments.num_workers)

    @property
    def io_inline_below(self) -> float | None:
        """Fast blocking reads run inline, unless ``io_threads`` was given (reads then always
        run on that many threads: for a dataset that must be called from one thread)."""
        return INLINE_BELOW_S if self.arguments.io_threads is None else None

    @property
    def work_inline_below(self) -> float | None:
        """Fast transforms and collation run inline with ``num_workers=0`` (as torch runs them
        in the calling thread; ``worker_init_fn`` is not called there, as in torch)."""
        return INLINE_BELOW_S if self.arguments.num_workers == 0 else None

    @property
    def on_demand_allowed(self) -> bool:
        """Whether the arguments leave a map-style epoch's batches to be made in the consumer's
        calls (``_pipeline/demand.py``): nothing the stages are for was asked: no ``prefetch``
        (batches made ahead), no device stage, no ``timeout`` (a call that makes its batch
        cannot time out), no retries or per-sample timeouts."""
        a, cfg = self.arguments, self.config
        return (
            a.prefetch is None
            and self.device_plan is None
            and a.timeout == 0
            and cfg.retry is None
            and cfg.sample_timeout is None
        )

    @property
    def device_depth(self) -> int:
        """Batches on the device ahead of the consumer."""
        return max(1, self.prefetch)

    def scope_seed(self) -> int:
        """The workers' base seed for a scope opening now: ``seed=``, or drawn anew from
        ``generator`` (or torch's default generator) as each torch iterator draws one."""
        if self.arguments.seed is not None:
            return self.base_seed
        return draw_seed(self.arguments.generator)

    @property
    def order(self) -> object:
        """What a map-style epoch's order is drawn from: the batch sampler, else the sampler."""
        return self.batch_sampler if self.batch_sampler is not None else self.sampler

    @property
    def ours(self) -> bool:
        """Whether the map-style order is the loader's own (no sampler or batch sampler given):
        its shuffle seed can be restored and its remainder re-divided (elastic resume)."""
        a = self.arguments
        return self.kind.is_map and a.sampler is None and a.batch_sampler is None

    @property
    def batching(self) -> tuple[int | None, bool]:
        """``(batch_size, drop_last)`` as epochs batch now: the loader's own batch sampler's
        (torch's class, whose attributes a user may set between epochs), else the arguments'."""
        batcher: Any = self.batch_sampler
        if self.ours and type(batcher) in PLAIN_BATCHERS:
            return batcher.batch_size, batcher.drop_last
        return self.batch_size, self.arguments.drop_last

    @property
    def order_seed(self) -> int | None:
        """The seed of the loader's own shuffled order (None: not shuffled, or not ours)."""
        sampler = self.sampler
        if not self.ours:
            return None
        if isinstance(sampler, RandomSampler):
            return sampler.seed
        if isinstance(sampler, DistributedSampler) and sampler.shuffle:
            return sampler.seed
        return None

    def reseeded(self, base_seed: int, order_seed: int | None) -> LoaderPlan:
        """The plan with a saved run's seeds (``seed=None``: drawn then, to be restored now),
        its own order rebuilt with ``order_seed``."""
        sampler, batch_sampler = self.sampler, self.batch_sampler
        # (a generator assigned to our sampler draws its order: that generator's state is what
        # a resume restores, and the sampler is kept)
        ours = sampler if self.ours and isinstance(sampler, RandomSampler) else None
        if ours is not None and ours.generator is None and order_seed is not None:
            sampler = RandomSampler(self.dataset, seed=order_seed)
            batch_size, drop_last = self.batching  # as the batch sampler was set, if it was
            if batch_sampler is not None and batch_size is not None:
                batch_sampler = torch.utils.data.BatchSampler(sampler, batch_size, drop_last)
        config = dataclasses.replace(self.config, seed=base_seed)
        return dataclasses.replace(
            self, base_seed=base_seed, sampler=sampler, batch_sampler=batch_sampler, config=config
        )

    def replaced(
        self, name: str, value: object, offload: Callable[[], ThreadOffload]
    ) -> LoaderPlan:
        """The plan with argument ``name`` changed (torch lets a loader's settings change
        between iterations); the epochs' order, sampler and base seed are kept.

        Raises:
            ValueError: ``name`` defines the epochs (torch's words), or the new value is out
                of range. TypeError: The new value has the wrong type.
        """
        if name in EPOCH_DEFINING:
            raise ValueError(
                f"{name} attribute should not be set after DataLoader is initialized "
                "(build a new DataLoader instead)"
            )
        changed: dict[str, Any] = {name: value}
        arguments = dataclasses.replace(self.arguments, **changed)
        return plan_loader(arguments, offload, earlier=self, stacklevel=5)

    def made_again(
        self, offload: Callable[[], ThreadOffload], *, copied: bool = False
    ) -> LoaderPlan | None:
        """The plan made again (base seed kept, no warnings repeated), or None where nothing
        calls for it: a copy's (``copied``), in its own process; where ``distributed=True`` left
        rank and world size to ``torch.distributed`` and its share changed (a group started)."""
        a = self.arguments
        follow = a.distributed and a.rank is None and a.world_size is None  # (else: as given)
        group = torch.distributed.is_available() and torch.distributed.is_initialized()
        follow = follow and group and resolve_rank(None, None) != (self.rank, self.world_size)
        if not (follow or copied):
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return plan_loader(a, offload, earlier=self, follow=follow)


_REMEDY = "pass multiprocessing_context='fork' (the workers inherit it), or worker_mode='thread'"


def _on_worker_dataset(
    send: Callable[[str, Any], Any], dataset: object, name: str, value: Any
) -> Any:
    """``send`` of ``value``, a method of ``dataset`` (each worker's copy) made to run on the
    worker's own copy (``datasetmethod.py``)."""
    return send(name, on_worker_dataset(dataset, value))


def _as_it_is(name: str, value: T) -> T:
    return value


def _batch_size_hint(batch_size: int | None, batch_sampler: object) -> int:
    """Samples per batch, for sizing the pipeline's window: a batch sampler's own
    ``batch_size`` when it has one (torch's BatchSampler does), else 1."""
    if batch_size is not None:
        return batch_size
    hint = getattr(batch_sampler, "batch_size", None)
    return hint if isinstance(hint, int) and hint > 0 else 1


def plan_loader(
    a: Arguments,
    offload: Callable[[], ThreadOffload],
    *,
    earlier: LoaderPlan | None = None,
    follow: bool = False,
    stacklevel: int = 3,
) -> LoaderPlan:
    """Check ``a`` and build the plan (with ``earlier``: keep its base seed, its share of a
    ``distributed`` dataset and its order; with ``follow``, the share is read again, the order
    kept only where it did not change). ``stacklevel``: the warnings' (3: the caller of
    ``DataLoader(...)``). ``offload`` gives the open scope's I/O threads, for a blocking
    dataset read in this process. A loader whose workers are processes prepares the fork
    server now, while this process may still have one thread (``_workers/forkserver.py``).

    Raises:
        TypeError, ValueError: As :func:`~aioloader._loader.arguments.check_arguments`.
    """
    checked = check_arguments(a, stacklevel=stacklevel + 1)
    set_shuffle(a.dataset, a.shuffle)  # a DataPipe's shufflers on or off, as torch's loader's
    kind, batch_size, prefetch, start_method, target, ray = checked
    if a.distributed and earlier is not None and not follow:  # only following changes a share
        rank, world_size = earlier.rank, earlier.world_size
    else:
        rank, world_size = resolve_rank(a.rank, a.world_size) if a.distributed else (0, 1)
    base_seed = earlier.base_seed if earlier is not None else a.seed
    if base_seed is None:  # the OS's: building torch's loader draws from no generator either
        base_seed = secrets.randbits(63)
    if earlier is not None and (rank, world_size) == (earlier.rank, earlier.world_size):
        sampler, batch_sampler = earlier.sampler, earlier.batch_sampler
    else:
        sampler, batch_sampler = map_order(
            a.dataset,
            kind.is_map,
            batch_size=batch_size,
            shuffle=a.shuffle,
            sampler=a.sampler,
            batch_sampler=a.batch_sampler,
            drop_last=a.drop_last,
            rank=rank if a.distributed else None,
            world_size=world_size if a.distributed else None,
            seed=a.seed,
            generator=a.generator,
        )
    unbatched = batch_size is None and a.batch_sampler is None
    collate_fn = a.collate_fn or (default_convert if unbatched else default_collate)
    devices = device_plan(
        target, pin_memory=a.pin_memory, transform=a.device_transform, stacklevel=stacklevel
    )
    on_device = devices is not None and devices.accelerator is not None
    io_threads = 1 if a.io_threads is None else a.io_threads
    in_workers = a.num_workers > 0 and (a.worker_mode == "process" or ray is not None)
    send = _as_it_is
    if in_workers and ray is None:
        prepare_forkserver(start_method)  # now: which of the main module's the workers have
        # What the worker processes run goes by value where pickle cannot send it by name (a
        # lambda; byvalue.py); Ray's jobs go by cloudpickle anyway.
        main_has = workers_main(start_method)
        if start_method_name(start_method) == "fork":  # they inherit them all, unpickled
            send = inherited
        else:
            check_worker_init_fn(a.worker_init_fn, main_has)  # it goes as each worker starts
            send = functools.partial(sendable, main_has=main_has, remedy=_REMEDY)
            if kind.is_blocking:  # each worker holds a copy of the dataset: its method too
                send = functools.partial(_on_worker_dataset, send, a.dataset)
    elif in_workers and ray is not None:
        join_cluster(ray)  # on this thread: see join_cluster
    config = PipelineConfig(
        batch_size=_batch_size_hint(batch_size, a.batch_sampler),
        unbatched=unbatched,
        # A blocking dataset read here: in slices spread over the I/O threads (few thread
        # hops for fast local reads, yet every thread busy when items are slow).
        fetch_chunk=-(-a.max_inflight // io_threads) if kind.is_blocking else None,
        drop_last=a.drop_last,
        max_inflight=min(a.max_inflight, reads_at_once(a.dataset) or a.max_inflight),
        prefetch=prefetch,
        in_order=a.in_order,
        transform=send("transform", a.transform),
        collate_fn=send("collate_fn", collate_fn),
        retry=a.retry,
        sample_timeout=a.sample_timeout,
        max_failures=a.max_failures,
        max_inflight_bytes=a.max_inflight_bytes,
        # without a CUDA device it runs where collation runs
        finish=None if on_device else send("device_transform", a.device_transform),
        rank=rank,
        world_size=world_size,
        seed=base_seed,
        seeded=a.seed is not None,
        worker_retry=send("retry", a.retry) if in_workers else None,
    )
    return LoaderPlan(
        arguments=a,
        kind=kind,
        source=open_source(
            a.dataset,
            kind,
            offload,
            in_workers=in_workers,
            # Local processes read what they can themselves, unless a fetch option asks for
            # this process's fetches (Ray's actors may run where the files are not).
            reads_in_workers=in_workers
            and ray is None
            and not fetch_options_given(a, ASYNC_FETCH_OPTIONS),
            per_batch=config.per_batch,
            unbatched=unbatched,
        ),
        sampler=sampler,
        batch_sampler=batch_sampler,
        batch_size=batch_size,
        collate_fn=collate_fn,
        prefetch=prefetch,
        io_threads=io_threads,
        device=target,
        device_plan=devices,
        start_method=start_method,
        ray=ray,
        rank=rank,
        world_size=world_size,
        base_seed=base_seed,
        config=config,
    )
