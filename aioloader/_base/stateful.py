"""torchdata's ``Stateful`` protocol for a blocking iterable dataset: which of the dataset and
its iterator keep state, and one pass over it started from, and saved to, such a state.

Owns: :func:`is_stateful`, :func:`snapshot` (a state as it is now, copied) and
:class:`StatefulPass` (``iter(dataset)`` with the state put back, and its state between
items). Never: decides when a state is taken or where it goes (the stream sources and the
worker's pass do), or checks that it is JSON.

Where the state lives, as torchdata's ``StatefulDataLoader`` looks for it:

- the dataset defines ``state_dict()``/``load_state_dict()`` (or is its own iterator): the
  pass's state is the dataset's, as it always was here;
- ``iter(dataset)`` gives an iterator of its own that defines them: the pass's state is
  ``{ITERATOR_STATE: the iterator's, "dataset": the dataset's (or None)}``. A pass started
  from it loads the dataset's state, calls ``iter()``, then loads the iterator's: the order
  torchdata restores them in.

A pass where neither keeps state is not :attr:`~StatefulPass.resumable`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["ITERATOR_STATE", "StatefulPass", "is_stateful", "snapshot"]

#: The key of an iterator's state in a pass's state (a dataset's own state never holds it).
ITERATOR_STATE = "aioloader.iterator_state"


def is_stateful(obj: object) -> bool:
    """Whether ``obj`` defines both ``state_dict()`` and ``load_state_dict(state)``."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def snapshot(obj: Any) -> Any:
    """``obj.state_dict()`` as it is now: copied, unless ``obj`` says it gives a new object
    each call (``state_dict_is_a_copy = True``), for a state kept by reference would move on
    with the reading ahead."""
    state = obj.state_dict()
    return state if getattr(obj, "state_dict_is_a_copy", False) else copy.deepcopy(state)


def _split(state: Any) -> tuple[Any, Any]:
    """A pass's state as (the dataset's, the iterator's)."""
    if isinstance(state, dict) and ITERATOR_STATE in state:
        return state.get("dataset"), state[ITERATOR_STATE]
    return state, None


class StatefulPass:
    """One pass over a blocking iterable ``dataset`` (``iter(dataset)``), started from ``state``
    (:meth:`state` of an earlier pass over a copy of the same dataset) when it is not None.

    Raises:
        TypeError: ``state`` holds a state for the dataset or for its iterator, and the one it
            is for defines no ``load_state_dict`` (the state is of another dataset), named.
        Exception: What the dataset's ``load_state_dict``, ``__iter__`` or its iterator's
            ``load_state_dict`` raised.
    """

    __slots__ = ("_dataset", "_own", "iterator", "resumable")

    def __init__(self, dataset: Iterable[Any], state: Any = None) -> None:
        name = type(dataset).__qualname__
        of_dataset, of_iterator = _split(state)
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
        #: The iterator keeps a state of its own (torchdata's other place for it).
        self._own = iterator is not dataset and is_stateful(iterator)
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

    def state(self) -> Any:
        """The pass's state after the items its iterator has given (see the module's
        docstring), or None if it keeps none.

        Raises:
            Exception: What ``state_dict()`` raised.
        """
        dataset = snapshot(self._dataset) if is_stateful(self._dataset) else None
        if not self._own:
            return dataset
        return {ITERATOR_STATE: snapshot(self.iterator), "dataset": dataset}
