"""The batch sampler: a sampler's indices grouped into lists of ``batch_size``, as torch's
``BatchSampler`` groups them (its checks, words and attributes).

Owns: :class:`BatchSampler` and :func:`batches_of`, the C-level slicing both it and a resumed
epoch's fast path use. Never: orders indices (``sampler.py``) or numbers batches for resume
(``resume.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sized

import torch.utils.data as torch_data

__all__ = ["BatchSampler", "batches_of"]


def batches_of(sampler: Iterable[int], batch_size: int, drop_last: bool) -> Iterator[list[int]]:
    """``sampler``'s indices in lists of ``batch_size``, the last short one dropped when
    ``drop_last``: what torch's ``BatchSampler`` yields, a batch per C-level slice."""
    indices = iter(sampler)
    while batch := list(itertools.islice(indices, batch_size)):
        if len(batch) < batch_size and drop_last:
            return
        yield batch


class BatchSampler(torch_data.BatchSampler):
    """Groups the indices of another sampler into lists of ``batch_size``.

    Behaves like torch's ``BatchSampler``: every batch has ``batch_size``
    indices except possibly the last, which is dropped when ``drop_last``.

    Args:
        sampler: Any iterable of indices; ``len()`` needs it to be sized.
        batch_size: The number of indices per batch.
        drop_last: Drop the last batch if it is short.

    Raises:
        TypeError: If ``sampler`` is not iterable.
        ValueError: If ``batch_size`` is not a positive int or ``drop_last`` is not a bool
            (torch's type and words).
    """

    def __init__(self, sampler: Iterable[int], batch_size: int, drop_last: bool) -> None:
        if not isinstance(sampler, Iterable):
            raise TypeError(f"sampler must be an iterable of indices, got {sampler!r}")
        self._sampler = sampler
        self._batch_size = _positive_batch_size(batch_size)
        self._drop_last = _bool_drop_last(drop_last)

    @property
    def sampler(self) -> Iterable[int]:  # type: ignore[override]  # fixed at construction
        """The wrapped sampler."""
        return self._sampler

    @property
    def batch_size(self) -> int:
        """The number of indices per full batch; setting it (checked) takes effect at the next
        iteration, as with torch's."""
        return self._batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        self._batch_size = _positive_batch_size(value)

    @property
    def drop_last(self) -> bool:
        """Whether a short last batch is dropped (settable, as ``batch_size``)."""
        return self._drop_last

    @drop_last.setter
    def drop_last(self, value: bool) -> None:
        self._drop_last = _bool_drop_last(value)

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the wrapped sampler if it has ``set_epoch``.

        Args:
            epoch: The epoch number.
        """
        set_epoch = getattr(self._sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        return batches_of(self._sampler, self._batch_size, self._drop_last)

    def __len__(self) -> int:
        if not isinstance(self._sampler, Sized):
            raise TypeError(f"sampler has no len(): {type(self._sampler).__name__}")
        n = len(self._sampler)
        return n // self._batch_size if self._drop_last else -(-n // self._batch_size)


def _positive_batch_size(batch_size: object) -> int:
    """``batch_size``, checked as torch's ``BatchSampler`` checks it (a ``ValueError``)."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
        raise ValueError(
            f"batch_size should be a positive integer value, but got batch_size={batch_size}"
        )
    return batch_size


def _bool_drop_last(drop_last: object) -> bool:
    """``drop_last``, checked as torch's ``BatchSampler`` checks it (a ``ValueError``)."""
    if not isinstance(drop_last, bool):
        msg = f"drop_last should be a boolean value, but got drop_last={drop_last}"
        raise ValueError(msg)  # noqa: TRY004  # torch's type
    return drop_last
