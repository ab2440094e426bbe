"""What a loader's scope and its epochs are given: a frozen plan.

Owns: :class:`LoaderPlan`, the settings one scope runs with (read from the loader when the
scope opens, as torch reads its loader's attributes when an iterator starts). Never: validates
arguments (``_arguments.py``), or refers to the ``DataLoader``: a scope holding the plan does
not keep a dropped loader alive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._device import DevicePlan
    from ._pipeline import PipelineConfig
    from ._source import InWorkers, Kind, MapSource, StreamSource

__all__ = ["LoaderPlan"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LoaderPlan:
    """The settings of one scope, fixed when it opens.

    Attributes:
        dataset: The user's dataset.
        kind: What kind of dataset it is.
        source: The dataset wrapped for the pipeline (or for the workers).
        sampler, batch_sampler: The map-style order (None for a stream).
        config: The epoch's sizes and functions.
        device: The device stage's plan, or None.
        num_workers, worker_mode, start_method, worker_init_fn: The worker pool.
        worker_seed: The workers' base seed for this scope (``seed=``, or drawn anew per scope
            as each torch iterator draws one).
        io_threads: Threads that call a blocking dataset read in this process.
        prefetch: Ready batches held for the consumer.
        timeout: Seconds the consumer waits for a batch (0: for ever).
    """

    dataset: Any
    kind: Kind
    source: MapSource | StreamSource | InWorkers
    sampler: Iterable[int] | None
    batch_sampler: Iterable[Sequence[int]] | None
    config: PipelineConfig
    device: DevicePlan | None
    num_workers: int
    worker_mode: str
    start_method: Any
    worker_init_fn: Callable[[int], object] | None
    worker_seed: int
    io_threads: int
    prefetch: int
    timeout: float
