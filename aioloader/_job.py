"""The work done for one batch on a worker: transform each sample, then collate.

Owns: the function a worker runs, and its result type. It is module-level and takes only
picklable arguments, so a thread runs it today and a worker process can run it unchanged. Never:
touches the event loop, the loader or any shared state; decisions about failures (skip or raise)
are made by the caller on the event loop, where the failure budget lives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["JobResult", "collate_only", "run_batch"]


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
    finish: Callable[[Any], Any] | None = None,
) -> JobResult:
    """Transform every sample, then collate them into one batch.

    Args:
        transform: Applied to each sample, or None.
        collate: Applied to the list of transformed samples (to the single sample when
            ``unbatched``).
        samples: The raw samples of one batch, in batch order.
        unbatched: ``batch_size=None``: ``samples`` holds one sample, collated on its own.
        finish: Applied to the collated batch (``device_transform`` when batches stay on the
            host), or None.

    Returns:
        A :class:`JobResult`. A transform failure does not raise: it is reported in ``failures``
        and the batch is left uncollated.

    Raises:
        Exception: Whatever ``collate`` or ``finish`` raises.
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
    return JobResult(batch=collate_only(collate, transformed, unbatched, finish=finish))


def collate_only(
    collate: Callable[[Any], Any],
    transformed: list[Any],
    unbatched: bool,
    finish: Callable[[Any], Any] | None = None,
) -> Any:
    """Collate already transformed samples and apply ``finish`` to the batch."""
    batch = collate(transformed[0] if unbatched else transformed)
    return batch if finish is None else finish(batch)
