"""The settings an epoch runs with, and the sizes derived from them.

Owns: :class:`PipelineConfig` (frozen; built by the loader's plan) and its derived sizes: the
samples per fetch call, the fetch workers, the window of batches in progress. Never: validates
arguments (the loader did) or runs anything.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._base.retry import RetryPolicy

__all__ = ["PipelineConfig"]


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    """The settings an epoch runs with (validated by the loader)."""

    batch_size: int  # samples per batch (a sizing hint when a batch_sampler decides)
    unbatched: bool  # batch_size=None without a batch_sampler: samples are yielded alone
    fetch_chunk: int | None  # samples per get_many call of a batched source; None: whole batch
    drop_last: bool
    max_inflight: int
    prefetch: int
    in_order: bool
    transform: Callable[[Any], Any] | None
    collate_fn: Callable[[Any], Any]
    retry: RetryPolicy | None
    sample_timeout: float | None
    max_failures: int
    max_inflight_bytes: int | None
    finish: Callable[[Any], Any] | None  # device_transform, run after collate (no device stage)
    rank: int
    world_size: int
    seed: int  # base seed: each batch's work is seeded from (seed, epoch, batch index)
    seeded: bool  # the user gave `seed=`: reseed per batch (else workers keep torch's streams)
    # `retry` as worker processes' jobs send it (by value where pickle cannot send it by name:
    # an exception class of a notebook's, or of a script its workers do not run); None: `retry`
    worker_retry: Any = None

    @property
    def per_batch(self) -> int:
        return self.batch_size

    def chunk(self, batched_source: bool) -> int:
        """Samples per fetch call: 1, or a slice of a batch for a batched source."""
        if not batched_source:
            return 1
        return min(self.per_batch, self.fetch_chunk or self.per_batch)

    def fetch_workers(self, batched_source: bool) -> int:
        """Concurrent fetch calls: as many as fit in ``max_inflight`` samples (at least one)."""
        return max(1, self.max_inflight // self.chunk(batched_source))

    def window(self, workers: int, *, in_workers: bool = False, depth: int = 1) -> int:
        """Batches in progress at once: twice what keeps every fetch busy (a batch waiting on
        its slowest sample must not idle the fetches, so the next ones start meanwhile), plus
        one per call the workers take at once (``depth`` each), plus one so the next batch
        starts while one is handed out. Where the workers read the dataset there is no fetch
        stage: per worker, two batches (torch's ``prefetch_factor=2``: one running, the next
        sent behind it, or queued in its lane where a worker takes one call at once) or
        ``depth``, plus one."""
        if in_workers:
            return max(depth, 2) * workers + 1
        fetching = math.ceil(self.max_inflight / self.per_batch)
        return 2 * fetching + workers * depth + 1
