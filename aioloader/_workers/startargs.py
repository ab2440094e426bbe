"""A worker's start arguments (its dataset and ``worker_init_fn``): sent in one pickle, and
unpickled by the worker itself, so that one that does not unpickle there is reported, not
crashed on.

multiprocessing pickles a new process's arguments and unpickles them before the process runs
any code of ours. A dataset whose class the worker cannot find by name (defined under the
script's ``if __name__ == '__main__':`` block, which a worker started by spawn or by a fork
server that runs the main module again does not run; or in a notebook) killed each worker as
it started, and the main process saw only ``WorkerCrashed``. Here the arguments are pickled
into bytes as the process starts, by the same pickler and in one pickle (so
``worker_init_fn=dataset.method`` is a method of the worker's own copy, as before), and the
worker unpickles them as it begins: an error is sent back, named.

Owns: :class:`StartArgs`, :class:`Unsent`, :func:`main_runs_again`. Never: changes how
anything is pickled.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

__all__ = ["StartArgs", "Unsent", "main_runs_again"]

Start = tuple[Callable[[int], object] | None, Any]  # (worker_init_fn, dataset)


def main_runs_again() -> bool:
    """Whether a worker started by spawn, or by a fork server that is not a fork of this
    process, runs this process's main module again (as multiprocessing prepares it): from the
    module's name unless it is a ``__main__`` (``python -m pkg``), else from its file where
    there is one (a script; not ``python -c``, stdin, a notebook)."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return name != "__main__" and not name.endswith(".__main__")
    path = getattr(main, "__file__", None)
    return (
        isinstance(path, str)
        and os.path.splitext(os.path.basename(path))[0] != "ipython"
        and os.path.isfile(path)
    )


class StartArgs:
    """``(worker_init_fn, dataset)`` as a worker's start argument: unpickled in the worker, it
    is the pair itself, or an :class:`Unsent` that says why not."""

    __slots__ = ("start",)

    def __init__(self, worker_init_fn: Callable[[int], object] | None, dataset: object) -> None:
        self.start: Start = (worker_init_fn, dataset)

    def __reduce__(self) -> tuple[Any, tuple[bytes, str]]:
        # Pickled as the process starts: torch's reductions see the process being started.
        init_fn, dataset = self.start
        what = (
            f"dataset ({type(dataset).__qualname__})"
            if dataset is not None
            else f"worker_init_fn ({init_fn!r})"
        )
        return _load, (bytes(ForkingPickler.dumps(self.start)), what)


class Unsent:
    """In a worker: start arguments that did not unpickle (:meth:`error` says why)."""

    __slots__ = ("cause", "what")

    def __init__(self, what: str, cause: Exception) -> None:
        self.what, self.cause = what, cause

    def error(self) -> Exception:
        """The unpickling error, with a note that names what did not unpickle and where it
        must be defined for the worker to find it."""
        where = (
            "Each worker runs the main module again without its `if __name__ == '__main__':` "
            "block: a class or function defined in that block must move to the top level or "
            "to a module"
            if main_runs_again()
            else "The workers do not run the main module (python -c, a notebook, `python -m` "
            "of a package's __main__): a class or function defined there must move to a "
            "module they can import"
        )
        self.cause.add_note(
            f"aioloader: the {self.what} was pickled in the main process but did not unpickle "
            f"in the worker: something it refers to by name is not there. {where}"
        )
        return self.cause


def _load(data: bytes, what: str) -> Start | Unsent:
    try:
        start: Start = pickle.loads(data)
    except Exception as exc:
        return Unsent(what, exc)
    return start
