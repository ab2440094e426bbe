"""A method of the loader's dataset passed as a function argument (``collate_fn=
dataset.collater``, fairseq's way), run on the dataset of the process it runs in.

torch pickles a worker's dataset and its ``collate_fn`` together, so a worker's
``dataset.collater`` is bound to that worker's own dataset: the one ``worker_init_fn``
configured. Sent apart, the method would carry a second copy of the dataset, configured by no
one. Here it travels as its name and is looked up on the worker's dataset as it runs.

Owns: :class:`DatasetMethod` and :func:`on_worker_dataset`, which makes one. Never: pickles the
dataset.
"""

from __future__ import annotations

import types
from typing import Any

from .worker import get_worker_info

__all__ = ["DatasetMethod", "on_worker_dataset"]


class DatasetMethod:
    """The method ``name`` of the dataset where it runs: a worker's own copy (the one
    :func:`~aioloader.get_worker_info` names), else ``method``, bound to the dataset in this
    process. Pickles as its name alone."""

    __slots__ = ("method", "name")

    def __init__(self, name: str, method: types.MethodType | None = None) -> None:
        self.name = name
        self.method = method

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        info = get_worker_info()
        if info is not None and info.dataset is not None:
            return getattr(info.dataset, self.name)(*args, **kwargs)
        if self.method is None:
            raise RuntimeError(f"no dataset here to call {self.name}() on")
        return self.method(*args, **kwargs)

    def __repr__(self) -> str:
        return repr(self.method) if self.method is not None else f"<dataset's {self.name}>"

    def __reduce__(self) -> tuple[type[DatasetMethod], tuple[str]]:
        return DatasetMethod, (self.name,)


def on_worker_dataset(dataset: object, fn: Any) -> Any:
    """``fn`` as it runs in the workers that hold a copy of ``dataset``: a
    :class:`DatasetMethod` where it is a method of ``dataset`` found under its own name, else
    ``fn`` itself."""
    if not isinstance(fn, types.MethodType) or fn.__self__ is not dataset:
        return fn
    if getattr(dataset, fn.__name__, None) != fn:  # not found under its name (renamed, wrapped)
        return fn
    return DatasetMethod(fn.__name__, fn)
