"""What torch's ``DataLoader`` keeps in private attributes that code written for it reads:
Composer's trainer asks ``loader._dataset_kind`` of any ``torch.utils.data.DataLoader`` (ours
is one) before its epoch, hand-written iterators copy ``_IterableDataset_len_called``. Views of
the loader's plan and state, under torch's names and with torch's values.

Owns: :class:`TorchNames` (a base class of ``DataLoader``) and :func:`torch_order`, the
sampler and batch sampler torch shows where the plan has none. Never: changes the loader.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.utils.data
from torch.utils.data.dataloader import _DatasetKind, _InfiniteConstantSampler

if TYPE_CHECKING:
    from .plan import LoaderPlan
    from .scope import LoaderState

__all__ = ["TorchNames", "torch_batches", "torch_order", "torch_sampler"]


class TorchNames:
    """torch's private attributes of a loader, read-only (a base class of ``DataLoader``)."""

    _plan: LoaderPlan
    _state: LoaderState

    @property
    def _dataset_kind(self) -> Any:
        """``_DatasetKind.Map`` (0) for a map-style dataset, ``_DatasetKind.Iterable`` (1)
        for a stream, as torch sets it."""
        return _DatasetKind.Map if self._plan.kind.is_map else _DatasetKind.Iterable

    @_dataset_kind.setter
    def _dataset_kind(self, value: Any) -> None:
        """Raises: AttributeError: the kind is the dataset's (torch sets it once, from it)."""
        raise AttributeError(f"_dataset_kind follows the loader's dataset; cannot set {value!r}")

    @property
    def _auto_collation(self) -> bool:
        """Whether samples are collated into batches: torch reads it off its batch sampler,
        which it makes for a stream too (over an endless sampler), where ours has none."""
        return self._plan.batch_size is not None or self._plan.batch_sampler is not None

    @property
    def _IterableDataset_len_called(self) -> Any:
        """The length an iterable dataset reported to ``len(loader)`` (batches past it warn,
        as torch's do), or None."""
        return self._state.iterable_len

    @_IterableDataset_len_called.setter
    def _IterableDataset_len_called(self, value: Any) -> None:
        self._state.iterable_len = value  # as torch's __len__ sets it: warnings count from it

    @property
    def iterable_len_called(self) -> int | None:
        """``_IterableDataset_len_called``, under a name of our own."""
        return self._state.iterable_len


def torch_order(loader: Any) -> tuple[Any, Any]:
    """The ``(sampler, batch_sampler)`` torch's loader has where ours has none: for a stream,
    torch's endless ``_InfiniteConstantSampler`` (batched by a ``BatchSampler`` when
    ``batch_size`` is set); for a map-style dataset given a ``batch_sampler``, a
    ``SequentialSampler`` over it (found by review: ``len(loader.sampler)`` failed). Made once
    per plan, so that they are the same objects each time they are read."""
    plan = loader._plan
    cached = loader.__dict__.get("_torch_order")
    if cached is not None and cached[0] is plan:
        return cached[1], cached[2]
    sampler: Any = plan.sampler
    batch_sampler: Any = plan.batch_sampler
    if sampler is None:
        if plan.kind.is_map:
            sampler = torch.utils.data.SequentialSampler(plan.arguments.dataset)
        else:
            sampler = _InfiniteConstantSampler()
            if batch_sampler is None and plan.batch_size is not None:
                drop_last = plan.arguments.drop_last
                batch_sampler = torch.utils.data.BatchSampler(sampler, plan.batch_size, drop_last)
    loader.__dict__["_torch_order"] = (plan, sampler, batch_sampler)
    return sampler, batch_sampler


def torch_sampler(loader: Any) -> Any:
    """``loader.sampler`` where the plan has none (:func:`torch_order`)."""
    return torch_order(loader)[0]


def torch_batches(loader: Any) -> Any:
    """``loader.batch_sampler`` where the plan has none (:func:`torch_order`)."""
    return torch_order(loader)[1]
