"""``DataLoader(progress=True)``: a bar per epoch, and the line ``loader.progress()`` gives.

Owns: :class:`EpochProgress`, what one epoch has handed its consumer (samples, rate, the share
of the time the consumer waited for data), drawn with tqdm when it is installed, else with the
plain bar of ``_base/progress.py`` (redrawn on a terminal, one line per epoch elsewhere), on
stderr; and torch's warning for an iterable past the length it reported. Never: prints unless
asked (``progress=True``); reads the pipeline (the consumer's side tells it what it took).
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

from .._base.progress import Progress

if TYPE_CHECKING:
    from .._base.recorders import ConsumerRecorder
    from .checkpoint import Progress as Record
    from .plan import LoaderPlan

__all__ = ["EpochProgress", "epoch_samples", "past_length"]


class EpochProgress:
    """One epoch's progress, as its consumer took it.

    Args:
        epoch: The epoch's number.
        total: Samples the epoch should hand out, or None (a stream without a length).
        consumer: The scope's consumer recorder (its waits; cumulative, read as differences).
        taken: The epoch's record of what its consumer took (its ``samples`` are counted
            there, a resumed epoch's earlier ones included; this reads them).
        draw: Show a bar (``progress=True``); else only :meth:`line` reads it.
    """

    def __init__(
        self,
        epoch: int,
        total: int | None,
        consumer: ConsumerRecorder,
        taken: Record,
        *,
        draw: bool,
    ) -> None:
        self.epoch = epoch
        self.total = total
        self._taken = taken
        start = self._start = self._shown = taken.samples
        self._consumer = consumer
        self._waited0, self._busy0 = consumer.wait_s, consumer.busy_s
        self._started = time.perf_counter()
        self._bar: Any = None
        if draw:
            self._bar = _bar(epoch, total, start)

    def waited(self) -> float:
        """The share of this epoch's time the consumer waited for data."""
        waited = self._consumer.wait_s - self._waited0
        busy = self._consumer.busy_s - self._busy0
        return waited / (waited + busy) if waited + busy > 0 else 0.0

    @property
    def drawing(self) -> bool:
        """Whether a bar is drawn (else nothing needs :meth:`draw`)."""
        return self._bar is not None

    def draw(self) -> None:
        """Bring the bar up to what the consumer has taken."""
        bar, samples = self._bar, self._taken.samples
        if bar is not None:
            bar.update(samples - self._shown, f"waited {self.waited():.0%}")
            self._shown = samples

    def line(self) -> str:
        """``epoch 1: 3,200/10,000 samples, 5,120 samples/s, consumer waited 12%``."""
        samples = self._taken.samples
        rate = (samples - self._start) / max(1e-9, time.perf_counter() - self._started)
        of = f"/{self.total:,}" if self.total else ""
        return (
            f"epoch {self.epoch}: {samples:,}{of} samples, {rate:,.0f} samples/s, "
            f"consumer waited {self.waited():.0%}"
        )

    def close(self) -> None:
        """The epoch ended (or was left: a break, an error, the scope closing): the bar's
        last line stays. Idempotent."""
        bar, self._bar = self._bar, None
        if bar is not None:
            bar.close(f"waited {self.waited():.0%}")


def _bar(epoch: int, total: int | None, start: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return Progress(total or 0, f"epoch {epoch}", stream=sys.stderr, initial=start)
    return _Tqdm(
        tqdm(total=total, initial=start, desc=f"epoch {epoch}", unit="sample", unit_scale=True)
    )


class _Tqdm:
    """tqdm behind the plain bar's two calls."""

    def __init__(self, bar: Any) -> None:
        self._bar = bar

    def update(self, n: int, extra: str) -> None:
        self._bar.set_postfix_str(extra, refresh=False)
        self._bar.update(n)

    def close(self, extra: str) -> None:
        self._bar.set_postfix_str(extra)
        self._bar.close()


def epoch_samples(plan: LoaderPlan) -> int | None:
    """Samples a map-style epoch hands out (None when not known: a stream, a batch sampler
    without a length)."""
    if not plan.kind.is_map:
        return None
    try:
        n = len(plan.sampler)  # type: ignore[arg-type]
    except TypeError:
        return None
    size = plan.batch_size
    return n - n % size if size and plan.arguments.drop_last else n


def past_length(plan: LoaderPlan, reported: int, yielded: int) -> str:
    """torch's warning, for the consumer to give where it takes the batch: an iterable
    yielded more than ``len(loader)`` said it would (as torch does, the dataset's length
    is compared with the batches yielded)."""
    text = (
        f"Length of IterableDataset {plan.dataset!r} was reported to be {reported} (when "
        f"accessing len(dataloader)), but {yielded} samples have been fetched."
    )
    if plan.num_workers > 0:
        text += (
            " For multiprocessing data-loading, this could be caused by not properly "
            "configuring the IterableDataset replica at each worker (each worker iterates "
            "its own copy: shard it with get_worker_info())."
        )
    return text
