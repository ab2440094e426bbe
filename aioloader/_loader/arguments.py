"""Checking a DataLoader's arguments: each one's type and range, and torch's rules about which
arguments go together.

Owns: every construction-time error, each naming its argument. Never: builds samplers or
anything else the loader keeps.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
import pickle
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch

from ._accelerator import resolve_device
from ._processes import DEFAULT_START_METHOD, START_METHODS
from ._retry import RetryPolicy
from ._source import Kind, classify

__all__ = ["Checked", "check_arguments", "non_negative_int", "positive_int"]

_DEFAULT_PREFETCH = 2


def positive_int(name: str, value: object) -> int:
    """torch's check of its own integer arguments: ``ValueError`` for a wrong type too, as
    torch raises it (ours follow ``_checks.py``'s rule)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def non_negative_int(name: str, value: object) -> int:
    """As :func:`positive_int`, 0 allowed (torch's ``num_workers``, ``epoch``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def callable_or_none(name: str, value: object) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be callable or None, got {type(value).__qualname__}")


class Checked(NamedTuple):
    """What the checks resolved."""

    kind: Kind
    batch_size: int | None  # None also when a batch_sampler decides the batches (torch's rule)
    prefetch: int
    start_method: str | multiprocessing.context.BaseContext
    device: torch.device | None  # None also for None; a CUDA device has its index


def start_method_of(context: object) -> str | multiprocessing.context.BaseContext:
    """The worker processes' start method: ``context`` (a name or a multiprocessing context)
    when given, else forkserver.

    Raises:
        ValueError: The method is fork, or unknown.
        TypeError: ``context`` is neither a string nor a multiprocessing context.
    """
    if context is None:
        return DEFAULT_START_METHOD
    if isinstance(context, str):
        method = context
    elif isinstance(context, multiprocessing.context.BaseContext):
        method = context.get_start_method()
    else:
        raise TypeError(
            "multiprocessing_context option should be a valid context object or a string "
            f"specifying the start method, but got multiprocessing_context={context!r} "
            f"(a {type(context).__qualname__})"
        )
    if method == "fork":
        raise ValueError(
            "multiprocessing_context='fork' is not supported: forking a process that runs an "
            "event loop, threads, obstore/tokio or CUDA can hang or corrupt it; use "
            "'forkserver' (the default: workers start as fast as forked ones) or 'spawn'"
        )
    if method not in START_METHODS:
        raise ValueError(
            f"multiprocessing_context option should specify a valid start method in "
            f"{START_METHODS!r}, but got multiprocessing_context={method!r}"
        )
    return context if isinstance(context, multiprocessing.context.BaseContext) else method


def check_picklable(name: str, value: object, *, remedy: str = "pass worker_mode='thread'") -> None:
    """Fail now, not mid-epoch, when ``value`` cannot be sent to a worker process.

    Raises:
        TypeError: ``value`` does not pickle; the message names the argument and what to do.
    """
    if value is None:
        return
    try:
        pickle.dumps(value)
    except Exception as exc:
        raise TypeError(
            f"{name}={value!r} cannot be sent to worker processes ({type(exc).__name__}: "
            f"{exc}). Define it at module level (a lambda, a closure or a local function "
            f"cannot be pickled), make its object picklable, or {remedy}"
        ) from exc


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
            ("shuffle", shuffle, shuffle in (None, False)),
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


def check_arguments(
    *,
    dataset: object,
    batch_size: int | None,
    shuffle: bool | None,
    sampler: Iterable[int] | None,
    batch_sampler: Iterable[Sequence[int]] | None,
    num_workers: int,
    collate_fn: Callable[[Any], Any] | None,
    drop_last: bool,
    timeout: float,
    worker_init_fn: Callable[[int], object] | None,
    multiprocessing_context: object,
    generator: torch.Generator | None,
    prefetch_factor: int | None,
    persistent_workers: bool,
    in_order: bool,
    transform: Callable[[Any], Any] | None,
    max_inflight: int,
    prefetch: int | None,
    max_inflight_bytes: int | None,
    seed: int | None,
    retry: RetryPolicy | None,
    sample_timeout: float | None,
    max_failures: int,
    distributed: bool,
    io_threads: int | None,
    worker_mode: str,
    device: object = None,
    device_transform: Callable[[Any], Any] | None = None,
) -> Checked:
    """Check the arguments of :class:`~aioloader.DataLoader` (see it for their meanings).

    Raises:
        TypeError: An argument has the wrong type; the message names it.
        ValueError: An argument is out of range or conflicts with another; the message names it.
    """
    kind = classify(dataset)
    if batch_size is not None:
        positive_int("batch_size", batch_size)
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(  # torch's words (its tests match them), and the value given
            "num_workers option should be non-negative; use num_workers=0 to disable "
            f"multiprocessing (got num_workers={num_workers!r})"
        )
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout < 0:
        raise ValueError(f"timeout option should be non-negative, got timeout={timeout!r}")
    for name, fn in (
        ("collate_fn", collate_fn),
        ("worker_init_fn", worker_init_fn),
        ("transform", transform),
        ("device_transform", device_transform),
    ):
        callable_or_none(name, fn)
    _check_combinations(kind, dataset, batch_size, shuffle, sampler, batch_sampler, drop_last)
    if shuffle not in (None, True, False):
        raise TypeError(f"shuffle must be a bool or None, got {shuffle!r}")
    if not isinstance(drop_last, bool):
        raise TypeError(f"drop_last must be a bool, got {drop_last!r}")
    if not isinstance(in_order, bool):
        raise TypeError(f"in_order must be a bool, got {in_order!r}")
    if num_workers == 0:
        if prefetch_factor is not None:
            raise ValueError(
                "prefetch_factor needs num_workers > 0 (torch's rule); use prefetch= to "
                "bound ready batches with num_workers=0"
            )
        if persistent_workers:
            raise ValueError("persistent_workers option needs num_workers > 0")
        if multiprocessing_context is not None:
            raise ValueError(
                "multiprocessing_context can only be used with multi-process loading "
                f"(num_workers > 0), but got num_workers={num_workers}"
            )
    if prefetch_factor is not None:
        positive_int("prefetch_factor", prefetch_factor)
    positive_int("max_inflight", max_inflight)
    if prefetch is None:
        prefetch = _DEFAULT_PREFETCH if prefetch_factor is None else prefetch_factor * num_workers
    non_negative_int("prefetch", prefetch)
    if max_inflight_bytes is not None:
        positive_int("max_inflight_bytes", max_inflight_bytes)
    non_negative_int("max_failures", max_failures)
    if io_threads is not None:
        positive_int("io_threads", io_threads)
    if sample_timeout is not None and (
        not isinstance(sample_timeout, (int, float)) or isinstance(sample_timeout, bool)
    ):
        raise TypeError(f"sample_timeout must be a number or None, got {sample_timeout!r}")
    if sample_timeout is not None and not sample_timeout > 0:
        raise ValueError(
            f"sample_timeout must be a positive number or None, got {sample_timeout!r}"
        )
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise TypeError(f"retry must be an aioloader.RetryPolicy or None, got {retry!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int or None, got {seed!r}")
    if seed is not None and generator is not None:
        raise ValueError("pass seed or generator, not both: both set the shuffle order")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__qualname__}")

    if batch_sampler is not None:
        batch_size = None  # torch's convention: batching is the batch_sampler's
    _let_the_dataset_check(dataset, batch_size, in_order, distributed)
    if sampler is not None and distributed:
        raise ValueError("sampler is mutually exclusive with distributed")

    if worker_mode not in ("process", "thread"):
        raise ValueError(f"worker_mode must be 'process' or 'thread', got {worker_mode!r}")
    start_method = start_method_of(multiprocessing_context)
    target = resolve_device(device)
    on_host = target is None or target.type != "cuda"
    if worker_mode == "process" and num_workers > 0:
        for name, fn in (
            ("transform", transform),
            ("collate_fn", collate_fn),
            ("worker_init_fn", worker_init_fn),
            # Without a CUDA device it runs where collation runs: in the workers.
            ("device_transform", device_transform if on_host else None),
        ):
            check_picklable(name, fn)
    _warn_if_more_workers_than_cpus(num_workers)
    return Checked(kind, batch_size, prefetch, start_method, target)


def _warn_if_more_workers_than_cpus(num_workers: int) -> None:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        cpus = os.cpu_count() or 0
    if cpus and num_workers > cpus:
        warnings.warn(
            f"This DataLoader will create {num_workers} worker processes in total, more than "
            f"the {cpus} CPUs this process may run on: excessive worker creation might get "
            "DataLoader running slow or even freeze; lower num_workers if it does",
            UserWarning,
            stacklevel=4,  # the caller of DataLoader(...)
        )
