"""Turning lists of samples into batches.

Owns: :func:`default_collate` (torch-compatible, plus dataclasses) and the rebuilding of
containers it shares with :func:`~aioloader._data.convert.default_convert`. Padding of
variable-length sequences lives in :mod:`aioloader._data.padding`, built on the helpers here. Never:
touches an event loop, does I/O or keeps global state. Everything here is a pure function of its
arguments, so it runs unchanged in the loop thread, an offload thread or a worker process.

Errors say *where* in the sample they happened, as a path such as ``sample['image'][1]``:
the root is ``sample``, ``[key]`` indexes a mapping, ``[i]`` a position in a sequence and
``.name`` a field of a named tuple or dataclass. Errors raised by torch itself while building a
tensor keep their type and message and get the path attached as a note (PEP 678).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import (
    Callable,
    Iterable,
    Mapping,
    MutableMapping,
    MutableSequence,
    Sequence,
)
from typing import Any

import numpy as np
import torch

from .._workers.pack import shared_storage
from .._workers.worker import get_worker_info
from . import collatemap

__all__ = ["default_collate"]

# NumPy dtype kinds torch cannot hold: byte strings (S, a), unicode strings (U), objects (O).
# Same pattern as torch's, matched against ``dtype.str`` (e.g. "<U5", "|S3", "|O").
_NP_STR_OBJ_DTYPE = re.compile(r"[SaUO]")

# NumPy scalar types that default_collate turns into tensors (string scalars are str/bytes
# subclasses and are left alone, like torch does).
_NP_SCALAR_TYPES = (np.bool_, np.number, np.object_)

_SPARSE_LAYOUTS = frozenset(
    {torch.sparse_coo, torch.sparse_csr, torch.sparse_bsr, torch.sparse_csc, torch.sparse_bsc}
)

_ROOT = "sample"


# --------------------------------------------------------------------------------------------
# default_collate
# --------------------------------------------------------------------------------------------


def default_collate(batch: Sequence[Any]) -> Any:
    """Collate a list of samples into a batch, exactly like ``torch.utils.data.default_collate``.

    The type of the first sample decides how the batch is collated; the rules (checked in this
    order) are torch's:

    * :class:`torch.Tensor` -> ``torch.stack`` along a new first dimension (same dtype).
    * NumPy array -> converted with ``torch.as_tensor``, then stacked. Arrays of strings or
      objects raise :class:`TypeError`.
    * NumPy scalar (``np.bool_``, numbers) -> ``torch.as_tensor(batch)``.
    * ``float`` -> float64 tensor.
    * ``int`` (``bool`` included) -> ``torch.tensor(batch)``: int64 for ints, ``torch.bool``
      for bools. As in torch, the *first* element picks the rule, so ``[1, 2.5]`` gives a
      tensor of the default float dtype (float32) while ``[2.5, 1]`` gives float64.
    * ``str`` / ``bytes`` -> the batch itself, unchanged. Note that strings nested in a tuple,
      list or named tuple come back as a *tuple* of strings, and strings in a mapping as a
      *list* — that is what torch does.
    * mapping -> collated per key (the first sample's keys), returned as the same mapping
      type: mutable mappings are copied and updated (so ``defaultdict`` keeps its factory,
      ``OrderedDict`` its type), immutable ones are rebuilt from a dict; a type that supports
      neither gives a plain ``dict``.
    * named tuple -> the same named tuple type, field by field.
    * other sequence -> transposed, each position collated. Samples of unequal length raise
      :class:`RuntimeError`. A ``tuple`` gives a ``list``; a ``list`` (or other mutable
      sequence) gives a copy of the same type; another sequence type is rebuilt from a list if
      it can be, else a ``list`` is returned.

    Extension beyond torch: a dataclass instance (frozen or not) is collated field by field
    into an instance of the same dataclass. The instance is built without calling ``__init__``
    or ``__post_init__`` (each field, ``init=False`` ones included, holds the collated values
    of that field), so validation written for a single sample does not run on the batch.
    Torch raises :class:`TypeError` for dataclasses.

    Args:
        batch: The samples, all of the same structure.

    Returns:
        The batch: a tensor, or the samples' container structure with collated leaves.

    Raises:
        ValueError: If ``batch`` is empty.
        TypeError: If an element of the samples has a type that cannot be collated (the message
            names the type and the path to it), or samples disagree in type where that matters.
        RuntimeError: If sequences in the samples have unequal lengths, or tensors at the same
            position have different shapes (the message names the path and both shapes).
        KeyError: If a mapping in a later sample lacks a key of the first sample's mapping.
    """
    collatemap.refresh()  # the user's functions in torch's map, if any
    return _collate(_as_batch(batch), _ROOT)


def _as_batch(batch: Any) -> Sequence[Any]:
    """Check that ``batch`` is a non-empty sequence of samples (any iterable is listed)."""
    if isinstance(batch, str | bytes | Mapping):
        raise TypeError(f"batch must be a sequence of samples, not {type(batch)!r}")
    samples: Sequence[Any]
    if isinstance(batch, Sequence):
        samples = batch
    elif isinstance(batch, Iterable):
        samples = list(batch)
    else:
        raise TypeError(f"batch must be a sequence of samples, not {type(batch)!r}")
    if len(samples) == 0:
        raise ValueError("cannot collate an empty batch")
    return samples


def _collate(batch: Sequence[Any], path: str) -> Any:
    """Collate ``batch`` (non-empty), whose elements all sit at ``path`` in their samples."""
    elem = batch[0]
    if collatemap.registered and (fn := collatemap.function_for(elem)) is not None:
        return fn(batch, collate_fn_map=collatemap.collate_fn_map)
    if isinstance(elem, torch.Tensor):
        return _collate_tensors(batch, path)
    if isinstance(elem, np.ndarray):
        return _collate_tensors(_arrays_to_tensors(batch, path), path)
    if isinstance(elem, _NP_SCALAR_TYPES):
        return _build_tensor(torch.as_tensor, batch, path)
    if isinstance(elem, float):
        return _build_tensor(lambda b: torch.tensor(b, dtype=torch.float64), batch, path)
    if isinstance(elem, int):
        return _build_tensor(torch.tensor, batch, path)
    if isinstance(elem, str | bytes):
        return batch
    if isinstance(elem, Mapping):
        return _collate_mapping(batch, path)
    if isinstance(elem, tuple) and hasattr(elem, "_fields"):
        return _collate_namedtuple(batch, path)
    if isinstance(elem, Sequence):
        return _collate_sequence(batch, path)
    if dataclasses.is_dataclass(elem) and not isinstance(elem, type):
        return _collate_dataclass(batch, path)
    raise TypeError(f"{path}: cannot collate {type(elem)!r}")


def _collate_tensors(batch: Sequence[Any], path: str) -> torch.Tensor:
    """Stack same-shaped tensors along a new first dimension."""
    elem = batch[0]
    if elem.is_nested:
        raise RuntimeError(
            "Batches of nested tensors are not currently supported by the default collate_fn "
            f"(at {path}); pass a custom collate_fn that handles them"
        )
    if elem.layout in _SPARSE_LAYOUTS:
        raise RuntimeError(
            f"{path}: batches of sparse tensors are not supported by default_collate; "
            "pass a custom collate function"
        )
    tensors = batch if isinstance(batch, list | tuple) else list(batch)
    in_worker = get_worker_info() is not None  # there: into shared memory (see _alloc_like)
    try:
        out = _alloc_like(elem, len(tensors)) if in_worker and _can_preallocate(tensors) else None
        return torch.stack(tensors, 0, out=out)
    except (RuntimeError, TypeError, ValueError, AttributeError) as exc:
        _explain_unstackable(tensors, path)  # a sample that differs: say which
        exc.add_note(f"while collating {path}")
        raise


def _explain_unstackable(batch: Sequence[Any], path: str) -> None:
    """After a failed stack (checking first would cost every batch): raise ``TypeError`` for
    a sample that is no tensor, ``RuntimeError`` for one shaped unlike sample 0, naming it."""
    shape = batch[0].shape
    for i, item in enumerate(batch):
        if not isinstance(item, torch.Tensor):
            raise TypeError(
                f"{path}: expected a tensor in every sample (as in sample 0), "
                f"but sample {i} has {type(item)!r}"
            )
        if item.shape != shape:
            raise RuntimeError(
                f"{path}: cannot stack tensors of different shapes: sample 0 has shape "
                f"{tuple(shape)} but sample {i} has shape {tuple(item.shape)}"
            )


def _can_preallocate(batch: Sequence[torch.Tensor]) -> bool:
    """Whether ``torch.stack(batch, out=_alloc_like(...))`` gives what a plain stack would.

    Not when dtypes differ (a plain stack promotes them), for tensor subclasses (a plain stack
    keeps the subclass), for quantized tensors, or when autograd would need to record the stack
    (``out=`` does not support autograd).
    """
    elem = batch[0]
    if elem.is_quantized:
        return False
    grad = torch.is_grad_enabled()
    for item in batch:
        if type(item) is not torch.Tensor or item.dtype != elem.dtype:
            return False
        if grad and item.requires_grad:
            return False
    return True


def _alloc_like(elem: torch.Tensor, n: int) -> torch.Tensor:
    """Allocate the (uninitialised) output of stacking ``n`` tensors shaped like ``elem``.

    Called in a worker: the batch is allocated in shared memory, so it reaches the main process
    without another copy (only a handle crosses the pipe).
    """
    shape = (n, *elem.shape)
    nbytes = n * elem.numel() * elem.element_size()
    if elem.device.type != "cpu" or nbytes == 0:
        return torch.empty(shape, dtype=elem.dtype, device=elem.device)
    # Made in shared memory, as torch's collate makes it: not made, then copied there
    return elem.new_empty(0).set_(shared_storage(nbytes)).view(shape)


def _arrays_to_tensors(batch: Sequence[Any], path: str) -> list[torch.Tensor]:
    """Convert the NumPy arrays of a batch to tensors (no copy where NumPy allows)."""
    dtype = batch[0].dtype
    if _NP_STR_OBJ_DTYPE.search(dtype.str) is not None:
        raise TypeError(f"{path}: cannot collate NumPy arrays of dtype {dtype}")
    return [_build_tensor(torch.as_tensor, item, path) for item in batch]


def _build_tensor(make: Callable[[Any], torch.Tensor], data: Any, path: str) -> torch.Tensor:
    """``make(data)``, with ``path`` noted on torch's error if it fails."""
    try:
        result: torch.Tensor = make(data)
    except (RuntimeError, TypeError, ValueError, OverflowError) as exc:
        exc.add_note(f"while collating {path}")
        raise
    return result


def _collate_mapping(batch: Sequence[Any], path: str) -> Mapping[Any, Any]:
    elem = batch[0]
    alike = _alike(batch)
    values: dict[Any, Any] = {}
    for key in elem:
        column = _column(batch, key, path, alike=alike)
        values[key] = _collate(column, f"{path}[{key!r}]")
    return _rebuild_mapping(elem, values)


def _alike(batch: Sequence[Any]) -> bool:
    """Whether every sample is of sample 0's type (one pass in C, once per batch)."""
    return len(set(map(type, batch))) == 1


def _column(batch: Sequence[Any], key: Any, path: str, *, alike: bool) -> list[Any]:
    """``[sample[key] for sample in batch]`` for mapping samples (``alike``: all of sample 0's
    mapping type, so none needs a check of its own), with errors naming the path."""
    if alike:
        try:
            return [item[key] for item in batch]
        except KeyError:
            pass  # a sample without the key: found and named below
    column = []
    for i, item in enumerate(batch):
        if not isinstance(item, Mapping):
            raise TypeError(
                f"{path}: expected a mapping in every sample (as in sample 0), "
                f"but sample {i} has {type(item)!r}"
            )
        try:
            column.append(item[key])
        except KeyError:
            raise KeyError(f"{path}: sample {i} has no key {key!r} (sample 0 has)") from None
    return column


def _rebuild_mapping(elem: Mapping[Any, Any], values: dict[Any, Any]) -> Mapping[Any, Any]:
    """Return ``values`` in a mapping of ``elem``'s type where possible, else as a dict.

    Mirrors torch: a mutable mapping is shallow-copied and updated (its type may carry extra
    state, such as a ``defaultdict``'s factory), an immutable one is built from a dict, and a
    type that supports neither (raises :class:`TypeError`) gives a plain ``dict``.
    """
    try:
        if isinstance(elem, MutableMapping):
            clone = copy.copy(elem)
            clone.update(values)
            return clone
        rebuilt: Mapping[Any, Any] = type(elem)(values)  # type: ignore[call-arg]
    except TypeError:
        return values
    return rebuilt


def _collate_namedtuple(batch: Sequence[Any], path: str) -> Any:
    elem = batch[0]
    fields: tuple[str, ...] = elem._fields
    # Like torch: fields are zipped, so each position is collated from a tuple.
    return type(elem)(
        *(
            _collate(column, f"{path}.{name}")
            for name, column in zip(fields, zip(*batch, strict=False), strict=False)
        )
    )


def _collate_sequence(batch: Sequence[Any], path: str) -> Any:
    elem = batch[0]
    size = len(elem)
    try:
        equal = set(map(len, batch)) == {size}  # one pass in C; a sample without one: below
    except Exception:  # found and named, in sample order, below
        equal = False
    for i, item in enumerate(() if equal else batch):
        try:
            item_size = len(item)
        except TypeError as exc:
            exc.add_note(f"while collating {path} (sample {i})")
            raise
        if item_size != size:
            raise RuntimeError(
                f"{path}: each element in list of batch should be of equal size "
                f"(sample 0 has length {size}, sample {i} has length {item_size})"
            )
    # Like torch: positions are zipped, so each position is collated from a tuple.
    collated = [
        _collate(column, f"{path}[{i}]") for i, column in enumerate(zip(*batch, strict=False))
    ]
    if isinstance(elem, tuple):
        return collated  # a list, as torch returns for tuples (backwards compatibility)
    return _rebuild_sequence(elem, collated)


def _rebuild_sequence(elem: Sequence[Any], values: list[Any]) -> Any:
    """``values`` in a sequence of ``elem``'s type where possible, else as the list: mirrors
    torch, a mutable sequence is shallow-copied and assigned position by position, another
    type is built from the list, and one that supports neither (``range``) gives the list."""
    try:
        if isinstance(elem, MutableSequence):
            clone = copy.copy(elem)
            for i, value in enumerate(values):
                clone[i] = value
            return clone
        return type(elem)(values)  # type: ignore[call-arg]
    except TypeError:
        return values


def _collate_dataclass(batch: Sequence[Any], path: str) -> Any:
    elem = batch[0]
    cls = type(elem)
    for i, item in enumerate(batch):
        if type(item) is not cls:
            raise TypeError(
                f"{path}: expected {cls!r} in every sample (as in sample 0), "
                f"but sample {i} has {type(item)!r}"
            )
    values = {
        field.name: _collate([getattr(item, field.name) for item in batch], f"{path}.{field.name}")
        for field in dataclasses.fields(elem)
    }
    # Bypass __init__/__post_init__ (and frozen=True's __setattr__): every field is set to
    # the collated values of that field, nothing is recomputed or validated.
    out = object.__new__(cls)
    for name, value in values.items():
        object.__setattr__(out, name, value)
    return out
