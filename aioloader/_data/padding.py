"""Padding variable-length sequences into batches.

Owns: :class:`PadCollate` (and its default instance :data:`pad_collate`) and the
:class:`PaddedBatch` it returns. Never: touches an event loop, does I/O or keeps global state.
Everything here is a pure function of its arguments (or a picklable, immutable callable), so it
runs unchanged in the loop thread, an offload thread or a worker process. Keys that are not
padded are collated by :func:`~aioloader._data.collate.default_collate`'s machinery, whose error
paths (such as ``sample['label']``) it shares.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, NamedTuple, overload

import numpy as np
import numpy.typing as npt
import torch

from .collate import (
    _NP_STR_OBJ_DTYPE,
    _ROOT,
    _alike,
    _as_batch,
    _build_tensor,
    _collate,
    _column,
    _rebuild_mapping,
)

__all__ = ["PadCollate", "PaddedBatch", "pad_collate"]


class PaddedBatch(NamedTuple):
    """A batch of variable-length sequences, padded to the longest one.

    Attributes:
        values: ``(B, L_max, *rest)``, the samples' dtype; positions past a sample's length
            hold the padding value.
        lengths: ``(B,)`` int64, each sample's length ``L_i``.
        mask: ``(B, L_max)`` bool, True where ``values`` holds real data; None if the
            collate function was asked not to build it.
    """

    values: torch.Tensor
    lengths: torch.Tensor
    mask: torch.Tensor | None


class PadCollate:
    """Collate variable-length sequences by padding them to the longest in the batch.

    A plain, immutable class (not a closure), so instances pickle and can be sent to worker
    processes. Call it on a list of samples:

    * If the samples are sequences — tensors or NumPy arrays of shape ``(L_i, *rest)`` with
      ``*rest`` equal across the batch, or lists of Python ints (token ids, converted to int64)
      — the result is a :class:`PaddedBatch`.
    * If the samples are mappings, the keys to pad (``keys``, or by default every key whose
      value in the first sample is a numeric tensor or NumPy array with at least one
      dimension) become :class:`PaddedBatch` values, and every other key is collated with
      :func:`default_collate`. The result is a mapping built like :func:`default_collate`
      builds one. Lists of token ids are only padded when their key is named in ``keys``.

    All tensors of the result are on the samples' device.

    Args:
        padding_value: The value past each sample's end. For an integer or bool dtype it must
            be a whole number.
        keys: For mapping samples, the keys to pad; None (the default) picks them as above.
        mask: Whether to build :attr:`PaddedBatch.mask`.

    Raises:
        TypeError: If ``padding_value`` is not a number, ``keys`` is a single string or holds
            anything but strings, or ``mask`` is not a bool.

    Example:
        >>> collate = PadCollate(padding_value=-1)
        >>> batch = collate([torch.tensor([1, 2, 3]), torch.tensor([4])])
        >>> batch.values
        tensor([[ 1,  2,  3],
                [ 4, -1, -1]])
        >>> batch.lengths
        tensor([3, 1])
    """

    __slots__ = ("_keys", "_mask", "_padding_value")

    def __init__(
        self,
        *,
        padding_value: float | int = 0,
        keys: Collection[str] | None = None,
        mask: bool = True,
    ) -> None:
        if isinstance(padding_value, bool) or not isinstance(padding_value, int | float):
            raise TypeError(f"padding_value must be an int or float, not {padding_value!r}")
        if not isinstance(mask, bool):
            raise TypeError(f"mask must be a bool, not {mask!r}")
        frozen_keys: frozenset[str] | None = None
        if keys is not None:
            if isinstance(keys, str | bytes) or not isinstance(keys, Collection):
                raise TypeError(
                    f"keys must be a collection of key names (e.g. [{keys!r}]), not {keys!r}"
                )
            for key in keys:
                if not isinstance(key, str):
                    raise TypeError(f"keys must hold strings, but holds {key!r}")
            frozen_keys = frozenset(keys)
        self._padding_value = padding_value
        self._keys = frozen_keys
        self._mask = mask

    @property
    def padding_value(self) -> float | int:
        """The value past each sample's end."""
        return self._padding_value

    @property
    def keys(self) -> frozenset[str] | None:
        """The keys padded in mapping samples; None to pick them from the first sample."""
        return self._keys

    @property
    def mask(self) -> bool:
        """Whether :attr:`PaddedBatch.mask` is built."""
        return self._mask

    def __repr__(self) -> str:
        keys = None if self._keys is None else sorted(self._keys)
        return (
            f"{type(self).__name__}(padding_value={self._padding_value!r}, keys={keys!r}, "
            f"mask={self._mask!r})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PadCollate):
            return NotImplemented
        return self._state() == other._state()

    def __hash__(self) -> int:
        return hash(self._state())

    def _state(self) -> tuple[float | int, frozenset[str] | None, bool]:
        return (self._padding_value, self._keys, self._mask)

    def __getstate__(self) -> tuple[float | int, frozenset[str] | None, bool]:
        return self._state()

    def __setstate__(self, state: tuple[float | int, frozenset[str] | None, bool]) -> None:
        self._padding_value, self._keys, self._mask = state

    @overload
    def __call__(
        self, batch: Sequence[torch.Tensor | npt.NDArray[Any] | Sequence[int]]
    ) -> PaddedBatch: ...

    @overload
    def __call__(self, batch: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]: ...

    @overload
    def __call__(self, batch: Sequence[Any]) -> Any: ...

    def __call__(self, batch: Sequence[Any]) -> Any:
        """Collate ``batch``, padding its sequences.

        Args:
            batch: The samples: all sequences (tensors, arrays, lists of ints) or all mappings.

        Returns:
            A :class:`PaddedBatch` for sequence samples; for mapping samples, a mapping of the
            first sample's keys to a :class:`PaddedBatch` (padded keys) or the
            :func:`default_collate` result (other keys).

        Raises:
            ValueError: If ``batch`` is empty, a padded sample is 0-d, or padded samples
                disagree in their trailing shape (the message names the sample positions).
            TypeError: If padded samples disagree in dtype, a padded value is not a tensor,
                array or list of ints, samples mix mappings and sequences, or ``keys`` is set
                but the samples are not mappings.
            KeyError: If a key named in ``keys`` is missing from a sample.
        """
        batch = _as_batch(batch)
        elem = batch[0]
        if not isinstance(elem, Mapping):
            if self._keys is not None:
                raise TypeError(
                    f"{self!r}: keys are given, but sample 0 is {type(elem)!r}, not a mapping"
                )
            return self._pad(batch, _ROOT)
        pad_keys = self._keys if self._keys is not None else _auto_pad_keys(elem)
        for i, item in enumerate(batch):
            if not isinstance(item, Mapping):
                raise TypeError(
                    f"expected a mapping in every sample (as in sample 0), "
                    f"but sample {i} has {type(item)!r}"
                )
            for key in pad_keys:
                if key not in item:
                    raise KeyError(f"sample {i} has no key {key!r} (named in keys)")
        values: dict[Any, Any] = {}
        alike = _alike(batch)
        for key in elem:
            path = f"{_ROOT}[{key!r}]"
            column = _column(batch, key, _ROOT, alike=alike)
            values[key] = self._pad(column, path) if key in pad_keys else _collate(column, path)
        return _rebuild_mapping(elem, values)

    def _pad(self, batch: Sequence[Any], path: str) -> PaddedBatch:
        """Pad the sequences of ``batch`` (all at ``path`` in their samples)."""
        tensors = [_to_padable(item, i, path) for i, item in enumerate(batch)]
        elem = tensors[0]
        rest = elem.shape[1:]
        for i, tensor in enumerate(tensors):
            if tensor.dtype != elem.dtype:
                raise TypeError(
                    f"{path}: padded samples must share a dtype, but sample 0 has "
                    f"{elem.dtype} and sample {i} has {tensor.dtype}"
                )
            if tensor.shape[1:] != rest:
                raise ValueError(
                    f"{path}: padded samples must agree in all but their first dimension, "
                    f"but sample 0 has shape {tuple(elem.shape)} and sample {i} has shape "
                    f"{tuple(tensor.shape)}"
                )
        dtype = elem.dtype
        if (
            not (dtype.is_floating_point or dtype.is_complex)
            and isinstance(self._padding_value, float)
            and not self._padding_value.is_integer()
        ):
            raise ValueError(
                f"{path}: padding_value={self._padding_value!r} cannot be stored in {dtype}"
            )
        device = elem.device
        sizes = [t.shape[0] for t in tensors]
        max_len = max(sizes)
        lengths = torch.tensor(sizes, dtype=torch.int64, device=device)
        values = torch.full(
            (len(tensors), max_len, *rest), self._padding_value, dtype=dtype, device=device
        )
        for i, tensor in enumerate(tensors):
            values[i, : tensor.shape[0]] = tensor
        mask = None
        if self._mask:
            mask = torch.arange(max_len, device=device) < lengths.unsqueeze(1)
        return PaddedBatch(values=values, lengths=lengths, mask=mask)


def _auto_pad_keys(elem: Mapping[Any, Any]) -> frozenset[Any]:
    """The keys of ``elem`` whose values are numeric tensors or arrays with ``ndim >= 1``."""
    return frozenset(key for key, value in elem.items() if _is_padable_array(value))


def _is_padable_array(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.ndim >= 1
    if isinstance(value, np.ndarray):
        return value.ndim >= 1 and _NP_STR_OBJ_DTYPE.search(value.dtype.str) is None
    return False


def _to_padable(item: Any, index: int, path: str) -> torch.Tensor:
    """Convert one sample's sequence to a tensor of at least one dimension."""
    if isinstance(item, torch.Tensor):
        tensor = item
    elif isinstance(item, np.ndarray):
        if _NP_STR_OBJ_DTYPE.search(item.dtype.str) is not None:
            raise TypeError(
                f"{path}: cannot pad NumPy arrays of dtype {item.dtype} (sample {index})"
            )
        tensor = _build_tensor(torch.as_tensor, item, path)
    elif (
        isinstance(item, Sequence)
        and not isinstance(item, str | bytes)
        and all(isinstance(token, int) for token in item)
    ):
        tensor = torch.tensor(list(item), dtype=torch.int64)
    else:
        raise TypeError(
            f"{path}: cannot pad {type(item)!r} (sample {index}); expected a tensor, a NumPy "
            "array or a sequence of ints"
        )
    if tensor.ndim == 0:
        raise ValueError(f"{path}: cannot pad a 0-d tensor (sample {index})")
    return tensor


pad_collate = PadCollate()
"""A :class:`PadCollate` with the defaults: pad with 0, pick the keys to pad, build the mask."""
