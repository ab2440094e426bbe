"""How objects cross into and out of worker processes: by name where the other side can find
them, by value where it cannot.

torch's loader on Linux forks its workers, so a dataset holding a lambda, a ``collate_fn``
defined inside a function, or a class defined in a notebook cell reaches them as it is. Ours
are forked from a fork server (or spawned) and get pickled copies, and the standard pickle sends
a function or a class by name: the worker must be able to import it. Where it cannot, the
function or class goes by value instead (cloudpickle, as Ray and Dask send them):

* a lambda, a closure, a function or class defined inside a function (the standard pickle
  refuses them);
* anything defined in ``__main__`` when the workers do not run the main module again (a
  notebook, ``python -c``, a REPL: the main module has no file to run). A script's main module
  runs again in the workers (as ``__mp_main__``), so its classes go by name and keep their
  identity.

Everything else goes as before: by name, with torch's reductions (tensors through shared
memory). A class sent by value keeps its identity on the way back: cloudpickle tags it, and an
instance a worker returns is rebuilt as an instance of the main process's own class.

Owns: :func:`dumps` (a job or a reply), :class:`Sent` (a worker's start arguments) and
:class:`Unsent` (one that did not unpickle in the worker, to be reported, not crashed on).
Never: sends by value what the standard pickle sends by name, or hides why an object cannot be
sent at all (a lock, a socket, an open generator: the error is cloudpickle's, with the name).
"""

from __future__ import annotations

import io
import pickle
import sys
import types
from collections import ChainMap
from multiprocessing.reduction import ForkingPickler
from typing import Any, ClassVar

import cloudpickle  # type: ignore[import-untyped]  # no stubs, no py.typed

__all__ = ["Sent", "Unsent", "dumps", "main_runs_again"]


def main_runs_again() -> bool:
    """Whether a worker process runs this process's main module again (as multiprocessing's
    spawn and forkserver prepare it: from its module name, or from its file), so that what it
    defines can be found by name there."""
    main = sys.modules.get("__main__")
    return getattr(main, "__spec__", None) is not None or bool(getattr(main, "__file__", None))


class _ByName(ForkingPickler):
    """multiprocessing's pickler (torch's reductions included) that refuses a function or
    class of ``__main__`` when the workers will not have it (see :func:`main_runs_again`)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)) and obj.__module__ == "__main__":
            raise pickle.PicklingError(
                f"{obj.__qualname__} is defined in __main__, which the workers do not run"
            )
        return NotImplemented


class _ByValue(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle has no annotations
    """cloudpickle's pickler (functions and classes the other side cannot import go by value)
    with multiprocessing's reductions too: torch's tensors still cross through shared memory."""

    dispatch_table: ClassVar[ChainMap[Any, Any]] = ChainMap(
        ForkingPickler._extra_reducers,  # type: ignore[attr-defined]  # torch registers here
        cloudpickle.Pickler.dispatch_table,
    )


def _dumps(pickler: type[pickle.Pickler], obj: object) -> memoryview:
    buffer = io.BytesIO()
    pickler(buffer, pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getbuffer()


def _refused(exc: BaseException) -> bool:
    """An error of the standard pickle that sending by value may get past."""
    return isinstance(exc, (pickle.PicklingError, TypeError, AttributeError))


def dumps(obj: object, *, to_main: bool = False) -> memoryview:
    """``obj`` pickled for the other side of a worker's pipe: by name, else by value.

    Args:
        obj: A job (to a worker) or a reply (to the main process).
        to_main: From a worker to the main process, which has every ``__main__`` name.

    Raises:
        Exception: ``obj`` cannot be pickled even by value (cloudpickle's error: a lock, a
            socket, an open generator, named in it); the standard pickle's error is its
            ``__context__``.
    """
    by_name = ForkingPickler if to_main or main_runs_again() else _ByName
    try:
        return _dumps(by_name, obj)
    except Exception as exc:
        if not _refused(exc):
            raise
    return _dumps(_ByValue, obj)


class Sent:
    """A worker's start argument (its dataset, ``worker_init_fn``) as :func:`dumps` sends it:
    unpickled in the worker, it is a copy of the object itself, or an :class:`Unsent` that
    says why not. multiprocessing pickles a new process's arguments itself, by name; this puts
    :func:`dumps` in its place, and keeps a failure to unpickle from killing the worker before
    it can say so."""

    __slots__ = ("obj", "what")

    def __init__(self, obj: object, what: str) -> None:
        self.obj, self.what = obj, what

    def __reduce__(self) -> tuple[Any, tuple[bytes, str]]:
        # Pickled as the process starts (torch's reductions see the process being started).
        return _load, (bytes(dumps(self.obj)), f"{self.what} ({type(self.obj).__qualname__})")


class Unsent:
    """In a worker: a start argument that did not unpickle (:meth:`error` says why)."""

    __slots__ = ("cause", "what")

    def __init__(self, what: str, cause: Exception) -> None:
        self.what, self.cause = what, cause

    def error(self) -> Exception:
        """The unpickling error, with a note that names the argument and, where the workers
        run the main module again, what they do not run of it."""
        self.cause.add_note(
            f"aioloader: the {self.what} was pickled in the main process but did not unpickle "
            "in the worker: something it refers to by name is not there"
            + (
                ". Each worker runs the main module again without its `if __name__ == "
                "'__main__':` block: a class or function defined in that block must move to the "
                "top level or to a module"
                if main_runs_again()
                else ""
            )
        )
        return self.cause


def _load(data: bytes, what: str) -> Any:
    try:
        return pickle.loads(data)
    except Exception as exc:
        return Unsent(what, exc)
