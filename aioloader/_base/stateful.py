"""torchdata's ``Stateful`` protocol for a blocking iterable dataset: which of the dataset and
its iterator keep state, and one pass over it started from, and saved to, such a state.

Owns: :func:`is_stateful`, :func:`snapshot` (a state as it is now, copied) and
:class:`StatefulPass` (``iter(dataset)`` with the state put back, and its state between
items). Never: decides when a state is taken or where it goes (the stream sources and the
worker's pass do), or checks that it is JSON.

Where the state lives, as torchdata's ``StatefulDataLoader`` looks for it:

- the iterator ``iter(dataset)`` gives defines ``state_dict()``/``load_state_dict()`` (the
  dataset itself, when it is its own iterator): the pass's state is ``{ITERATOR_STATE: the
  iterator's, "dataset": the dataset's, or None when the dataset keeps none or is the
  iterator}``;
- else the dataset defines them: the pass's state is the dataset's (a generator function's
  ``__iter__`` reads where to start from the dataset).

A pass started from a state loads the dataset's state, calls ``iter()``, then loads the
iterator's: the order torchdata restores them in (a dataset that is its own iterator is
loaded after its ``__iter__``, which may reset it). A pass where neither keeps a state is not
:attr:`~StatefulPass.resumable`.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

__all__ = [
    "ITERATOR_STATE",
    "TAG",
    "StatefulPass",
    "decode",
    "encode",
    "is_stateful",
    "snapshot",
]

#: The key of an iterator's state in a pass's state (a dataset's own state never holds it).
ITERATOR_STATE = "aioloader.iterator_state"


def is_stateful(obj: object) -> bool:
    """Whether ``obj`` defines both ``state_dict()`` and ``load_state_dict(state)``."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def snapshot(obj: Any) -> Any:
    r"""``obj.state_dict()`` as it is now, :func:`encode`\ d: a copy (a state kept by reference
    would move on with the reading ahead), unless ``obj`` says it gives a new object each
    call (``state_dict_is_a_copy = True``) of plain JSON values."""
    state = obj.state_dict()
    return state if getattr(obj, "state_dict_is_a_copy", False) else encode(state)


# -- a dataset's state as JSON, exactly --------------------------------------------------------
#
# JSON keeps dicts with str keys, lists, str, int, float, bool and None. A dataset's state
# often holds more: torch's and NumPy's RNG states (a tensor; a tuple holding an array),
# ``random.getstate()`` (tuples), dicts keyed by int. Those are written as a dict with one
# reserved key, TAG, naming what it holds, and read back as they were; so is a dict that has
# the reserved key itself. Anything else is copied as it is, and the loader's JSON check
# names it.

TAG = "aioloader.type"


def _tagged(kind: str, **fields: Any) -> dict[str, Any]:
    return {TAG: kind, **fields}


def _raw(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def encode(value: Any) -> Any:
    """A copy of ``value`` made of JSON values only, where it holds the kinds above (see
    :func:`decode`); other values are deep-copied as they are. A dict or tuple of a subclass
    (a ``Counter``, a named tuple, ``torch.Size``) comes back as a plain dict or tuple, its
    keys and items as they were."""
    kind = type(value)
    if value is None or kind in (str, int, float, bool):
        return value
    if kind is list:
        return [encode(v) for v in value]
    if isinstance(value, dict):
        if kind is dict and TAG not in value and all(type(k) is str for k in value):
            return {k: encode(v) for k, v in value.items()}
        return _tagged("dict", items=[[encode(k), encode(v)] for k, v in value.items()])
    if isinstance(value, tuple):
        return _tagged("tuple", items=[encode(v) for v in value])
    if kind is bytes:
        return _tagged("bytes", data=_raw(value))
    if isinstance(value, torch.Tensor) and value.layout == torch.strided:
        plain = value.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
        data = plain.view(torch.uint8).numpy().tobytes() if plain.numel() else b""
        dtype = str(value.dtype).removeprefix("torch.")
        return _tagged("tensor", dtype=dtype, shape=list(value.shape), data=_raw(data))
    if isinstance(value, (np.ndarray, np.generic)):
        array = np.asarray(value)
        if not array.dtype.hasobject and array.dtype.fields is None:  # else: not as JSON
            raw = _raw(np.ascontiguousarray(array).tobytes())
            if isinstance(value, np.generic):
                return _tagged("numpy", dtype=array.dtype.str, data=raw)
            return _tagged("ndarray", dtype=array.dtype.str, shape=list(array.shape), data=raw)
    return copy.deepcopy(value)


def decode(value: Any) -> Any:
    """``value`` (from :func:`encode`, perhaps through ``json.dumps``/``json.loads``) as the
    dataset gave it: tuples, dicts with other keys, bytes, tensors, NumPy arrays and scalars
    back.

    Raises:
        ValueError: A tagged value is malformed (the state was edited), naming its kind.
    """
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    kind = value.get(TAG)
    if kind is None:
        return {k: decode(v) for k, v in value.items()}
    try:
        if kind == "dict":
            return {decode(k): decode(v) for k, v in value["items"]}
        if kind == "tuple":
            return tuple(decode(v) for v in value["items"])
        if kind == "bytes":
            return base64.b64decode(value["data"])
        if kind == "tensor":
            dtype = getattr(torch, value["dtype"])
            raw = bytearray(base64.b64decode(value["data"]))
            if not raw:
                return torch.empty(value["shape"], dtype=dtype)
            flat = torch.frombuffer(raw, dtype=torch.uint8)
            return flat.view(dtype).reshape(value["shape"])
        if kind == "ndarray":
            array = np.frombuffer(base64.b64decode(value["data"]), dtype=np.dtype(value["dtype"]))
            return array.reshape(value["shape"]).copy()
        if kind == "numpy":
            scalar = np.frombuffer(base64.b64decode(value["data"]), dtype=np.dtype(value["dtype"]))
            return scalar.reshape(())[()]
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise ValueError(f"a saved state's {kind!r} value is malformed: {exc}") from None
    raise ValueError(f"a saved state holds a value of unknown kind {kind!r}")


def _split(state: Any) -> tuple[Any, Any]:
    """A pass's state as (the dataset's, the iterator's)."""
    if isinstance(state, dict) and ITERATOR_STATE in state:
        return state.get("dataset"), state[ITERATOR_STATE]
    return state, None


def _next_only(iterator: Iterator[Any]) -> Iterator[Any]:
    """``iterator``'s items by its ``__next__`` alone. (Not ``iter(__next__, sentinel)``,
    which compares every item with the sentinel: a NumPy array cannot be.)"""
    step = iterator.__next__
    while True:
        try:
            item = step()
        except StopIteration:
            return
        yield item


class StatefulPass:
    """One pass over a blocking iterable ``dataset`` (``iter(dataset)``), started from ``state``
    (:meth:`state` of an earlier pass over a copy of the same dataset) when it is not None.

    Raises:
        TypeError: ``state`` holds a state for the dataset or for its iterator, and the one it
            is for defines no ``load_state_dict`` (the state is of another dataset), named.
        Exception: What the dataset's ``load_state_dict``, ``__iter__`` or its iterator's
            ``load_state_dict`` raised.
    """

    __slots__ = ("_apart", "_dataset", "_own", "items", "iterator", "opening", "resumable")

    def __init__(self, dataset: Iterable[Any], state: Any = None) -> None:
        name = type(dataset).__qualname__
        of_dataset, of_iterator = _split(state)
        of_dataset, of_iterator = decode(of_dataset), decode(of_iterator)
        if of_dataset is not None:
            if not is_stateful(dataset):
                raise TypeError(
                    f"the saved state holds a state of the dataset, but {name} defines no "
                    "state_dict()/load_state_dict(): it is another dataset's state"
                )
            dataset.load_state_dict(of_dataset)  # type: ignore[attr-defined]
        iterator = iter(dataset)
        self._dataset = dataset
        self.iterator: Iterator[Any] = iterator
        #: The pass's items: the iterator's ``__next__``, never its ``__iter__`` again (a
        #: dataset that is its own iterator may start over there, as ``for`` would make it).
        self.items: Iterator[Any] = _next_only(iterator)
        #: The iterator keeps a state (torchdata's first place for it).
        self._own = is_stateful(iterator)
        #: The dataset keeps one of its own, beside its iterator.
        self._apart = iterator is not dataset and is_stateful(dataset)
        if of_iterator is not None:
            if not self._own:
                raise TypeError(
                    f"the saved state holds a state of the iterator {name}.__iter__() gave, but "
                    f"this one ({type(iterator).__qualname__}) defines no "
                    "state_dict()/load_state_dict()"
                )
            iterator.load_state_dict(of_iterator)  # type: ignore[attr-defined]
        #: Whether :meth:`state` gives where this pass stands.
        self.resumable = self._own or is_stateful(dataset)
        #: Where the pass stands before its first item, as :meth:`state` would give it: the
        #: iterator's state now, when it keeps one; else the state it was started from (None
        #: for a pass from the start). A dataset's own state is not read now: a generator
        #: function's ``__iter__`` has not run yet, and that state still says where the
        #: last pass stood.
        self.opening: Any = self.state() if self._own else state

    def state(self) -> Any:
        """The pass's state after the items its iterator has given (see the module's
        docstring), or None if it keeps none.

        Raises:
            Exception: What ``state_dict()`` raised.
        """
        dataset = snapshot(self._dataset) if self._apart else None
        if not self._own:
            return dataset
        return {ITERATOR_STATE: snapshot(self.iterator), "dataset": dataset}
