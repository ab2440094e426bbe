"""Options given where they have no effect, and a worker count past the CPUs: the warnings
a DataLoader gives as it is built (at the caller's ``stacklevel``).

Owns: which of aioloader's options act where. Never: refuses an argument (``arguments.py``
does).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping

from .._data.source import Kind

__all__ = [
    "STREAM_OPTIONS_WITHOUT_EFFECT",
    "warn_for_stream",
    "warn_if_more_workers_than_cpus",
    "warn_in_workers",
]


def warn_in_workers(
    given: Mapping[str, object], kind: Kind, num_workers: int, stacklevel: int, ray: bool
) -> None:
    """Warn of each fetch option ``given`` (name: value) for a blocking dataset read in
    worker processes, where none applies."""
    where = "Ray workers" if ray else "worker processes"
    for name, value in given.items():
        warnings.warn(
            f"{name}={value!r} has no effect here: a blocking {kind.value} dataset with "
            f"num_workers={num_workers} is read in the {where}, each reading its "
            f"batch itself (it applies to async datasets and sources, and to "
            "worker_mode='thread')",
            UserWarning,
            stacklevel=stacklevel,
        )


# A stream is read one item at a time from its iterator, which cannot be asked again for an
# item it failed to give (found by review: both were taken and silently did nothing).
STREAM_OPTIONS_WITHOUT_EFFECT = ("sample_timeout", "retry")


def warn_for_stream(given: Mapping[str, object], kind: Kind, stacklevel: int) -> None:
    """Warn of each of :data:`STREAM_OPTIONS_WITHOUT_EFFECT` ``given`` for a stream."""
    for name in given:
        warnings.warn(
            f"{name} has no effect here: an {kind.value} dataset is read one item at "
            "a time from its iterator, which cannot be asked again for an item it failed to "
            "give or stopped giving (timeout= bounds the wait for a batch; a stream source "
            "retries its own reads, as tar_shards(retry=...) does)",
            UserWarning,
            stacklevel=stacklevel,
        )


def warn_if_more_workers_than_cpus(num_workers: int, stacklevel: int) -> None:
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
            stacklevel=stacklevel,  # the caller of DataLoader(...)
        )
