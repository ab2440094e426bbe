"""The ``batch_size=None`` path: a single sample's NumPy arrays and scalars made tensors.

Owns: :func:`default_convert`, torch's ``default_convert``. Containers are rebuilt as
``collate.py`` rebuilds them. Never: batches, touches an event loop or keeps state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .collate import _NP_STR_OBJ_DTYPE, _rebuild_mapping, _rebuild_sequence

__all__ = ["default_convert"]


def default_convert(data: Any) -> Any:
    """Convert the NumPy arrays and scalars in ``data`` to tensors, like torch's default_convert.

    Used instead of collation when a loader yields single samples (``batch_size=None``).
    Tensors are returned as they are; NumPy arrays and scalars become tensors with
    ``torch.as_tensor`` (arrays of strings or objects, and NumPy string scalars, are left
    unchanged); mappings, named tuples and sequences are converted element by element and
    rebuilt the way :func:`default_collate` rebuilds them (so a ``tuple`` becomes a ``list``,
    as in torch); anything else is returned unchanged.

    As in torch, only objects whose type is one of NumPy's own (``type(x).__module__ ==
    "numpy"``) are converted, so masked arrays and record arrays pass through unchanged. One
    deliberate difference: torch (with NumPy 2) fails on ``np.bytes_`` scalars; here they are
    left unchanged, like ``np.str_``.

    Args:
        data: One sample.

    Returns:
        The sample with NumPy arrays and scalars replaced by tensors.

    Raises:
        TypeError: If a NumPy array or scalar has a dtype torch does not support (such as
            ``datetime64``), as torch does.
    """
    if isinstance(data, torch.Tensor):
        return data
    if type(data).__module__ == "numpy" and not isinstance(data, str | bytes):
        if isinstance(data, np.ndarray) and _NP_STR_OBJ_DTYPE.search(data.dtype.str) is not None:
            return data
        return torch.as_tensor(data)
    if isinstance(data, Mapping):
        return _rebuild_mapping(data, {key: default_convert(data[key]) for key in data})
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(default_convert(item) for item in data))
    if isinstance(data, tuple):
        return [default_convert(item) for item in data]
    if isinstance(data, Sequence) and not isinstance(data, str | bytes):
        return _rebuild_sequence(data, [default_convert(item) for item in data])
    return data
