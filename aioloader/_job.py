"""The work done for one batch on a worker: transform each sample, then collate (and pin).

Owns: the function a worker runs, and its result type. It is module-level and takes only
picklable arguments, so a thread runs it today and a worker process can run it unchanged. Never:
touches the event loop, the loader or any shared state; decisions about failures (skip or raise)
are made by the caller on the event loop, where the failure budget lives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["JobResult", "collate_only", "pin_tree", "run_batch"]


@dataclass(slots=True)
class JobResult:
    """The outcome of :func:`run_batch`.

    Attributes:
        batch: The collated batch, when every sample transformed; else None.
        transformed: The samples that did transform, when some did not (so the caller can
            collate the survivors after deciding to skip the failures).
        failures: ``(position in the batch, exception)`` for each sample whose transform raised.
    """

    batch: Any = None
    transformed: list[Any] = field(default_factory=list)
    failures: list[tuple[int, Exception]] = field(default_factory=list)


def run_batch(
    transform: Callable[[Any], Any] | None,
    collate: Callable[[Any], Any],
    samples: Sequence[Any],
    unbatched: bool,
    pin: bool,
) -> JobResult:
    """Transform every sample, then collate them into one batch.

    Args:
        transform: Applied to each sample, or None.
        collate: Applied to the list of transformed samples (to the single sample when
            ``unbatched``).
        samples: The raw samples of one batch, in batch order.
        unbatched: ``batch_size=None``: ``samples`` holds one sample, collated on its own.
        pin: Copy the batch's tensors into page-locked memory.

    Returns:
        A :class:`JobResult`. A transform failure does not raise: it is reported in ``failures``
        and the batch is left uncollated.

    Raises:
        Exception: Whatever ``collate`` raises.
    """
    if transform is None:
        transformed = list(samples)
    else:
        transformed = []
        failures: list[tuple[int, Exception]] = []
        for position, sample in enumerate(samples):
            try:
                transformed.append(transform(sample))
            except Exception as exc:
                failures.append((position, exc))
        if failures:
            return JobResult(transformed=transformed, failures=failures)
    return JobResult(batch=collate_only(collate, transformed, unbatched, pin))


def collate_only(
    collate: Callable[[Any], Any], transformed: list[Any], unbatched: bool, pin: bool
) -> Any:
    """Collate already transformed samples (and pin the result when asked)."""
    batch = collate(transformed[0] if unbatched else transformed)
    return pin_tree(batch) if pin else batch


def pin_tree(data: Any) -> Any:
    """Return ``data`` with every CPU tensor inside it (mappings, named tuples, sequences)
    copied into page-locked memory; other objects are returned unchanged."""
    if isinstance(data, torch.Tensor):
        return data if data.is_pinned() else data.pin_memory()
    if isinstance(data, Mapping):
        return type(data)({k: pin_tree(v) for k, v in data.items()})  # type: ignore[call-arg]
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(pin_tree(v) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(pin_tree(v) for v in data)
    return data
