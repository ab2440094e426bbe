"""Whether pickle sends a value by name, and whether a worker finds it by that name: the scan
that decides what must go by value (``byvalue.py``), pickling into nothing (no tensor moved to
shared memory, no descriptor handed out, a NumPy array's bytes not copied), and the reductions
``ForkingPickler`` adds, with those that act as they reduce made to do nothing.

Owns: :func:`sent_by_name`, :func:`found_by_name`, :func:`as_a_process_starts`,
:func:`forking_reducers` and ``MainRule``, the question which of the main module's functions
and classes a worker has (answered by ``mainmodule.py``). Never: pickles a value into bytes.
"""

from __future__ import annotations

import contextlib
import copyreg
import multiprocessing
import multiprocessing.context
import pickle
import sys
import types
from collections.abc import Callable, Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any

__all__ = [
    "ACTING",
    "MainRule",
    "as_a_process_starts",
    "forking_reducers",
    "found_by_name",
    "sent_by_name",
]

# Which of the main module's functions and classes a worker has under their names
MainRule = Callable[[types.FunctionType | type], bool]


# -- the scan -------------------------------------------------------------------------------------


def sent_by_name(value: object, main_has: MainRule, *, starting: bool = False) -> bool:
    """Whether every function and class in ``value`` is one pickle sends by name and a worker
    finds by that name (``main_has`` says which of the main module's own). Pickles into
    nothing: tensors and buffers are not copied, torch's reductions do not run, no descriptor
    is handed out. ``starting``: as a process's start pickles it (a multiprocessing lock or
    shared ``Value`` pickles only then).

    Raises:
        Exception: ``value`` does not pickle at all (the reason pickle gives).
    """
    with as_a_process_starts() if starting else contextlib.nullcontext():
        try:
            _Scan(main_has).dump(value)
        except _NotByName:
            return False
    return True


@contextlib.contextmanager
def as_a_process_starts(stand_in: object = None) -> Iterator[None]:
    """Pickling as a process's start pickles: what hands a descriptor to it (a shared
    ``Value``'s memory) is handed nothing (or to ``stand_in``'s ``DupFd``), and what pickles
    only then (a multiprocessing lock) pickles."""
    previous = multiprocessing.context.get_spawning_popen()
    multiprocessing.context.set_spawning_popen(stand_in or _NoProcess())  # type: ignore[arg-type]
    try:
        yield
    finally:
        multiprocessing.context.set_spawning_popen(previous)


class _NotByName(Exception):
    pass


class _Nowhere:
    def write(self, data: bytes | memoryview) -> None:
        pass


class _NoProcess:
    """Stands for the process whose start pickles what the scan walks: what hands a
    descriptor to it (a shared ``Value``'s memory) is handed nothing."""

    def duplicate_for_child(self, fd: int) -> int:
        return fd

    def DupFd(self, fd: int) -> int:  # multiprocessing's name
        return fd


def _skip(_: object) -> tuple[type, tuple[()]]:
    return object, ()


class _Scan(pickle.Pickler):
    """Walks what pickle would send and raises at the first function or class a worker would
    not find by name."""

    def __init__(self, main_has: MainRule) -> None:
        super().__init__(_Nowhere(), pickle.HIGHEST_PROTOCOL, buffer_callback=_out_of_band)
        self.main_has = main_has
        # multiprocessing's own too: the scan needs no descriptor (a shared Value's memory)
        scanned = forking_reducers(skipping=(*ACTING, "multiprocessing"))
        self.dispatch_table = {**copyreg.dispatch_table, **scanned}

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.FunctionType | type) and not found_by_name(obj, self.main_has):
            raise _NotByName(obj)
        return NotImplemented


# What acts as it reduces: torch's reductions move a tensor to shared memory, a socket's and a
# connection's hand a descriptor to the resource sharer's thread (outside a process's start)
ACTING = ("torch", "socket", "multiprocessing.connection")


def forking_reducers(
    *, skipping: tuple[str, ...] = (), instead: Callable[[Any], Any] = _skip
) -> dict[type, Any]:
    """``ForkingPickler``'s reductions, those of types from the modules ``skipping`` names
    replaced by ``instead`` (by default, reducing to nothing)."""
    extra: dict[type, Any] = dict(ForkingPickler._extra_reducers)  # type: ignore[attr-defined]
    for kind in extra:
        if kind.__module__.startswith(skipping):
            extra[kind] = instead
    return extra


def _out_of_band(_: pickle.PickleBuffer) -> bool:
    return True  # a NumPy array's bytes are not copied into the scan


# -- what a worker finds by name ------------------------------------------------------------------


def found_by_name(obj: types.FunctionType | type, main_has: MainRule | None) -> bool:
    """Whether a worker finds ``obj`` by its module and qualified name (``main_has`` says
    which of the main module's own it has; None: those it is found under here)."""
    module_name = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module_name, str) or not isinstance(qualname, str):
        return False
    module = sys.modules.get(module_name)
    if module is None:
        return False
    found: object = module
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if found is not obj:
        return False
    return module_name != "__main__" or main_has is None or main_has(obj)
