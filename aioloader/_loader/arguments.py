"""Checking a DataLoader's arguments: each one's type and range, and torch's rules about which
arguments go together.

Owns: every construction-time error, each naming its argument. Never: builds samplers or
anything else the loader keeps.
"""

from __future__ import annotations

import dataclasses
import inspect
import multiprocessing
import multiprocessing.context
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .._base.checks import (
    as_int,
    check_bool,
    check_int,
    check_picklable,
    check_seconds,
    check_seed,
)
from .._base.retry import RetryPolicy
from .._data.datapipes import is_datapipe
from .._data.source import Kind, classify
from .._device.accelerator import resolve_device
from .._workers.rayspec import RayWorkers, ray_spec_of
from .._workers.serverstart import start_method_of
from .noeffect import (
    STREAM_OPTIONS_WITHOUT_EFFECT,
    warn_for_stream,
    warn_if_more_workers_than_cpus,
    warn_in_workers,
)

__all__ = [
    "ASYNC_FETCH_OPTIONS",
    "Arguments",
    "Checked",
    "check_arguments",
    "fetch_options_given",
    "non_negative_int",
]

_DEFAULT_PREFETCH = 2


def non_negative_int(name: str, value: object) -> int:
    """torch's check of its own integer arguments (``epoch``): ``ValueError`` for a wrong type
    too, as torch raises it (ours follow ``_base/checks.py``'s rule)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def callable_or_none(name: str, value: object) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be callable or None, got {type(value).__qualname__}")
    call = getattr(value, "__call__", None)  # noqa: B004 (an instance's async __call__ too)
    if value is not None and any(map(inspect.iscoroutinefunction, (value, call))):
        raise TypeError(  # each sample would have been a coroutine never awaited (found by review)
            f"{name} is an async function: the loader calls it as a plain function (on a "
            "thread, in a worker process or inline), where nothing would await it; give a "
            "plain function, and do the awaiting in the dataset's async get() (an AsyncDataset)"
        )


class Checked(NamedTuple):
    """What the checks resolved."""

    kind: Kind
    batch_size: int | None  # None also when a batch_sampler decides the batches (torch's rule)
    prefetch: int
    start_method: str | multiprocessing.context.BaseContext
    device: torch.device | None  # None also for None; a CUDA device has its index
    ray: RayWorkers | None  # the workers are Ray actors (worker_mode="ray" or RayWorkers)


def _let_the_dataset_check(
    dataset: object, batch_size: int | None, in_order: bool, distributed: bool
) -> None:
    """A dataset that needs certain loader options says so: its ``check_loader_options(*,
    batch_size, in_order, distributed)`` raises ``ValueError`` naming the option it cannot
    work with (a stream-per-slot dataset needs ``batch_size == slots``, for one). The core
    names no dataset."""
    check = getattr(dataset, "check_loader_options", None)
    if callable(check):
        check(batch_size=batch_size, in_order=in_order, distributed=distributed)


def _check_workers_options(a: Arguments, num_workers: int) -> None:
    """torch's rules for the options of worker processes, in its order and words.

    Raises:
        ValueError: An option needs ``num_workers > 0``, or ``prefetch_factor`` is not
            positive.
        TypeError: ``prefetch_factor`` is not an int (torch's comparison fails so for a
            string; a float fails its iterator).
    """
    factor = a.prefetch_factor
    if num_workers == 0:
        if factor is not None:
            raise ValueError(
                # torch's words as they are (its missing space too): they are matched
                "prefetch_factor option could only be specified in multiprocessing.let "
                "num_workers > 0 to enable multiprocessing, otherwise set prefetch_factor to "
                f"None. (got prefetch_factor={factor!r}; prefetch= bounds the ready batches "
                "with num_workers=0)"
            )
        if a.persistent_workers:
            raise ValueError("persistent_workers option needs num_workers > 0")
        if a.multiprocessing_context is not None:
            raise ValueError(
                "multiprocessing_context can only be used with multi-process loading "
                f"(num_workers > 0), but got num_workers={num_workers}"
            )
    elif factor is not None:
        if isinstance(factor, bool) or not isinstance(factor, int):
            raise TypeError(f"prefetch_factor must be an int, got {factor!r}")
        if factor < 0:
            raise ValueError(f"prefetch_factor option should be non-negative, got {factor!r}")
        if factor == 0:  # torch's iterator fails an assert on it; refused here, up front
            raise ValueError("prefetch_factor must be greater than 0 with worker processes, got 0")


def _check_batching(a: Arguments, kind: Kind) -> None:
    """What torch's ``RandomSampler`` and ``BatchSampler`` check as torch's ``DataLoader``
    makes them, in its words: a shuffled dataset is not empty, ``batch_size`` is a positive
    int, ``drop_last`` a bool.

    Raises:
        ValueError: One of them is not (torch raises ``ValueError`` for a wrong type too).
        TypeError: ``drop_last`` is not a bool where torch does not look at it (ours: no
            batch size or a batch sampler given).
    """
    own_order = kind.is_map and a.sampler is None and a.batch_sampler is None
    if own_order and a.shuffle and not a.distributed and len(a.dataset) == 0:
        raise ValueError(
            "num_samples should be a positive integer value, but got num_samples=0 (the "
            f"dataset, {type(a.dataset).__qualname__}, is empty: nothing to shuffle)"
        )
    if a.batch_size is not None and a.batch_sampler is None:
        size = a.batch_size
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(
                f"batch_size should be a positive integer value, but got batch_size={size}"
            )
        if not isinstance(a.drop_last, bool):
            raise ValueError(
                f"drop_last should be a boolean value, but got drop_last={a.drop_last}"
            )
    check_bool("drop_last", a.drop_last)


def _check_combinations(
    kind: Kind,
    dataset: object,
    batch_size: int | None,
    shuffle: object,
    sampler: object,
    batch_sampler: object,
    drop_last: object,
) -> None:
    """torch's rules about which arguments go together, in torch's order and words (torch's own
    tests match them), each message ending with the value given.

    Raises:
        ValueError: Two arguments conflict.
    """
    if not kind.is_map:
        name = type(dataset).__qualname__
        for option, value, absent in (
            # a DataPipe's shufflers are switched by `shuffle`, as torch's (_data/datapipes.py)
            ("shuffle", shuffle, shuffle in (None, False) or is_datapipe(dataset)),
            ("sampler", sampler, sampler is None),
            ("batch_sampler", batch_sampler, batch_sampler is None),
        ):
            if not absent:
                raise ValueError(
                    f"DataLoader with IterableDataset: expected unspecified {option} option, "
                    f"but got {option}={value!r} ({name} is iterable: it decides its own "
                    "order; shuffle it in the source, e.g. with a shuffle buffer)"
                )
    if sampler is not None and shuffle:
        raise ValueError(
            f"sampler option is mutually exclusive with shuffle (got shuffle={shuffle!r})"
        )
    if batch_sampler is not None:
        if batch_size != 1 or shuffle or sampler is not None or drop_last:
            raise ValueError(
                "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, "
                f"and drop_last (got batch_size={batch_size!r}, shuffle={shuffle!r}, "
                f"sampler={sampler!r}, drop_last={drop_last!r})"
            )
    elif batch_size is None and drop_last:
        raise ValueError(
            "batch_size=None option disables auto-batching and is mutually exclusive with "
            f"drop_last (got drop_last={drop_last!r})"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Arguments:
    """The arguments of :class:`~aioloader.DataLoader`, as given (see it for their meanings).

    The signature of ``DataLoader.__init__`` is the declaration (for users and their tools);
    this record follows it, name for name and default for default, and so do the loader's
    attributes and the docstring's Args (``test_each_argument_is_declared_once...`` checks
    all three). The checks, the plan and the loader's attributes read the arguments from here.
    """

    dataset: Any
    batch_size: int | None = 1
    shuffle: bool | None = None
    sampler: Iterable[int] | None = None
    batch_sampler: Iterable[Sequence[int]] | None = None
    num_workers: int = 0
    collate_fn: Callable[[Any], Any] | None = None
    pin_memory: bool = False
    drop_last: bool = False
    timeout: float = 0
    worker_init_fn: Callable[[int], object] | None = None
    multiprocessing_context: object = None
    generator: torch.Generator | None = None
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    pin_memory_device: str = ""
    in_order: bool = True
    transform: Callable[[Any], Any] | None = None
    max_inflight: int = 64
    prefetch: int | None = None
    max_inflight_bytes: int | None = None
    seed: int | None = None
    retry: RetryPolicy | None = None
    sample_timeout: float | None = None
    max_failures: int = 0
    distributed: bool = False
    rank: int | None = None
    world_size: int | None = None
    io_threads: int | None = None
    worker_mode: str | RayWorkers = "process"
    device: object = None
    device_transform: Callable[[Any], Any] | None = None
    progress: bool = False

    def __post_init__(self) -> None:
        # torch takes any integral count, as it compares and ranges it (found by review:
        # a NumPy integer from a config array was refused): held as an int, for one type.
        object.__setattr__(self, "num_workers", as_int(self.num_workers, bools=True))
        object.__setattr__(self, "prefetch_factor", as_int(self.prefetch_factor, bools=False))


def check_arguments(a: Arguments, *, stacklevel: int = 3) -> Checked:
    """Check the arguments of :class:`~aioloader.DataLoader`.

    torch's own arguments fail as torch's do (its tests match the words, and torch raises
    ``ValueError`` for a wrong type of its integers); aioloader's follow ``_base/checks.py``'s
    rule: a wrong type raises ``TypeError``, a wrong value ``ValueError``.

    Warns (``UserWarning``, at ``stacklevel``): ``pin_memory_device`` (deprecated, as torch
    says); more worker processes than CPUs; an option of
    the fetches in this process given for a blocking dataset read in worker processes;
    ``sample_timeout`` or ``retry`` given for a stream.

    Raises:
        TypeError: An argument has the wrong type; the message names it.
        ValueError: An argument is out of range or conflicts with another; the message names it.
    """
    kind = classify(a.dataset)
    # -- torch's arguments, with torch's errors, in torch's order -----------------------------
    num_workers = a.num_workers
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(  # torch's words (its tests match them), and the value given
            "num_workers option should be non-negative; use num_workers=0 to disable "
            f"multiprocessing (got num_workers={num_workers!r})"
        )
    timeout = a.timeout
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout < 0:
        raise ValueError(f"timeout option should be non-negative, got timeout={timeout!r}")
    _check_workers_options(a, num_workers)
    start_method = start_method_of(a.multiprocessing_context)
    _check_combinations(
        kind, a.dataset, a.batch_size, a.shuffle, a.sampler, a.batch_sampler, a.drop_last
    )
    for name in ("collate_fn", "worker_init_fn", "transform", "device_transform"):
        callable_or_none(name, getattr(a, name))  # torch finds out as it calls them
    if a.shuffle not in (None, True, False):
        raise TypeError(f"shuffle must be a bool or None, got {a.shuffle!r}")
    _check_batching(a, kind)
    check_bool("in_order", a.in_order)
    check_bool("progress", a.progress)
    if a.generator is not None and not isinstance(a.generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator, got {type(a.generator).__qualname__}"
        )

    # -- aioloader's own: _base/checks.py's rule ---------------------------------------------
    check_int("max_inflight", a.max_inflight, minimum=1)
    prefetch = a.prefetch
    if prefetch is None:
        factor = a.prefetch_factor
        prefetch = _DEFAULT_PREFETCH if factor is None else factor * num_workers
    check_int("prefetch", prefetch, minimum=0)
    if a.max_inflight_bytes is not None:
        check_int("max_inflight_bytes", a.max_inflight_bytes, minimum=1)
    check_int("max_failures", a.max_failures, minimum=0)
    if a.io_threads is not None:
        check_int("io_threads", a.io_threads, minimum=1)
    if a.sample_timeout is not None:
        check_seconds("sample_timeout", a.sample_timeout)
    if a.retry is not None and not isinstance(a.retry, RetryPolicy):
        raise TypeError(f"retry must be an aioloader.RetryPolicy or None, got {a.retry!r}")
    if a.seed is not None:
        check_seed(a.seed)
        if a.generator is not None:
            raise ValueError("pass seed or generator, not both: both set the shuffle order")
    check_bool("distributed", a.distributed)
    ray = ray_spec_of(a.worker_mode)
    in_workers = num_workers > 0 and (a.worker_mode == "process" or ray is not None)
    if ray is not None and num_workers == 0:
        warnings.warn(
            f"worker_mode={a.worker_mode!r} has no effect with num_workers=0: batches are made "
            "in this process (as torch's num_workers=0); pass num_workers=N for N Ray actors",
            UserWarning,
            stacklevel=stacklevel,
        )
    if a.pin_memory and a.pin_memory_device:  # torch's warning, in its words
        warnings.warn(
            "pin_memory_device is deprecated, the current accelerator will be used as the "
            f"device,ignore pin_memory_device='{a.pin_memory_device}'.",
            UserWarning,
            stacklevel=stacklevel,
        )
    if ray is not None and a.multiprocessing_context is not None:
        warnings.warn(
            f"multiprocessing_context={a.multiprocessing_context!r} has no effect with Ray "
            "workers: Ray starts its actors' processes itself",
            UserWarning,
            stacklevel=stacklevel,
        )

    batch_size = None if a.batch_sampler is not None else a.batch_size  # torch's convention
    _let_the_dataset_check(a.dataset, batch_size, a.in_order, a.distributed)
    if a.sampler is not None and a.distributed:
        raise ValueError("sampler is mutually exclusive with distributed")
    if a.distributed and is_datapipe(a.dataset) and not kind.is_map:
        raise ValueError(  # it would keep 1/world_size of each rank's share
            f"distributed=True would split the stream of {type(a.dataset).__qualname__} again "
            "after its sharding_filter, which splits a DataPipe among torch.distributed's ranks "
            "as torch's DataLoader does (without torch.distributed, every rank reads the whole "
            "pipe, as with torch's): leave distributed unset"
        )
    target = resolve_device(a.device)
    on_host = target is None or target.type != "cuda"
    # Worker processes: the plan sends these by value where pickle cannot send them by name,
    # and names the one that cannot be sent at all (byvalue.py); worker_init_fn goes with the
    # dataset as each worker starts.
    if in_workers and ray is not None:
        from ray import cloudpickle  # Ray's jobs go by it: lambdas and the script's own too

        for name, fn in (
            ("transform", a.transform),
            ("collate_fn", a.collate_fn),
            ("worker_init_fn", a.worker_init_fn),
            # Without a CUDA device it runs where collation runs: in the workers.
            ("device_transform", a.device_transform if on_host else None),
        ):
            check_picklable(name, fn, dumps=cloudpickle.dumps, to="Ray workers")
    if ray is None:  # Ray's actors run on the cluster's CPUs, not this machine's
        warn_if_more_workers_than_cpus(num_workers, stacklevel + 1)
    in_own_workers = kind.is_blocking and in_workers
    if in_own_workers:
        warn_in_workers(fetch_options_given(a), kind, num_workers, stacklevel + 1, ray is not None)
    if not kind.is_map:  # (the warning above names sample_timeout for workers' streams)
        names = ("retry",) if in_own_workers else STREAM_OPTIONS_WITHOUT_EFFECT
        warn_for_stream(fetch_options_given(a, names), kind, stacklevel + 1)
    return Checked(kind, batch_size, prefetch, start_method, target, ray)


# aioloader's options for the fetches in this process: a blocking dataset read in worker
# processes has none (each worker reads its batch's samples itself). An async dataset's fetches
# follow the first three; io_threads is a blocking dataset's.
ASYNC_FETCH_OPTIONS = ("max_inflight", "max_inflight_bytes", "sample_timeout")
_FETCH_OPTIONS = (*ASYNC_FETCH_OPTIONS, "io_threads")


def fetch_options_given(a: Arguments, names: tuple[str, ...] = _FETCH_OPTIONS) -> dict[str, object]:
    """The fetch options among ``names`` given other than their defaults."""
    defaults = {f.name: f.default for f in dataclasses.fields(Arguments)}
    return {n: getattr(a, n) for n in names if getattr(a, n) != defaults[n]}
