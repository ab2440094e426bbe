"""How a fork server held in reserve catches up with the main module when it is woken.

Owns: :func:`catch_up` (becoming what a fresh interpreter prepared by ``multiprocessing.spawn``
would be: the parent's path, arguments and directory, and the main module run again here, or
nowhere, or in each worker), :class:`Refused` (why it then does not serve),
:func:`running_main_again` and :func:`modules_being_imported`.
Never: waits, forks or serves (``standby.py``).
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import sys
import types
from dataclasses import dataclass
from multiprocessing import spawn
from typing import Any, Literal

from . import standin

__all__ = ["MainRun", "Refused", "catch_up", "modules_being_imported", "running_main_again"]

#: Where the main module runs again once a standby is woken: ``"here"`` (in the standby,
#: before it serves: its workers have what it bound), ``"nowhere"`` (a script that builds its
#: loader at its top level: the workers are sent its classes by value) or ``"in workers"``
#: (each worker runs it after its fork, as the stdlib's server's workers do: where running it
#: here started a thread or initialised CUDA).
MainRun = Literal["here", "nowhere", "in workers"]

_catching_up = False  # in the standby, while the main module runs again


@dataclass(frozen=True, slots=True)
class Refused:
    """Why a standby does not serve (it answers this, or None, once woken).

    Attributes:
        why: In words, for ``server_why``.
        main_left_unsafe: Running the main module's top level again in it started a thread or
            initialised CUDA there (a thread or CUDA started outside the script's ``__main__``
            guard): what the script can move, where the other reasons are not.
    """

    why: str
    main_left_unsafe: bool = False


def running_main_again() -> bool:
    """Whether this process is a fork server (the standby, or the stdlib's) or a spawned worker
    running the main module again: a loader started from there (a script's unguarded top
    level) must not start workers. The stdlib marks its own with ``_inheriting``."""
    return _catching_up or bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def modules_being_imported() -> frozenset[str]:
    """The modules whose top level is running now (the chain of imports that reached here),
    aioloader's own left out: in the standby they stay half-imported for good."""
    names = set()
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>":
            name = frame.f_globals.get("__name__", "")
            if name != "__main__" and name.partition(".")[0] != "aioloader":
                names.add(name)
        frame = frame.f_back
    return frozenset(names)


def catch_up(
    preparation: dict[str, Any], partial: frozenset[str], main: MainRun, preload: list[str]
) -> None:
    """Become what a fresh interpreter prepared by ``multiprocessing.spawn`` would be: the
    parent's path, arguments and directory; the modules ``partial`` (half-imported when this
    process was forked) imported again, whole, when next imported; and the main module run
    again as ``__mp_main__`` where ``main`` says (see :data:`MainRun`). Where it runs in the
    workers, the modules of the application's ``set_forkserver_preload`` list (``preload``)
    are imported here first, as the stdlib's server imports them (one that fails is left out,
    as there): its workers do not import them again (found by review)."""
    global _catching_up
    for name in [*sys.modules]:
        # A half-imported module goes, and so do its submodules: those imported before the
        # fork hold the half-built package (``from . import x`` inside its __init__).
        if name in partial or any(name.startswith(f"{package}.") for package in partial):
            del sys.modules[name]
    if main == "nowhere":  # a worker runs the script unless __main__ is it (its file, or module)
        standin.stand_in(standin.encode(preparation))
    by_name = preparation.get("init_main_from_name")
    if main != "nowhere" and (
        preparation.get("init_main_from_path")
        or (by_name and by_name != "__main__" and not by_name.endswith(".__main__"))
    ):
        # spawn.prepare runs the main module only where ``__main__`` is not it already: the
        # half-run original must not count as it (here, nor in the workers).
        sys.modules["__main__"] = types.ModuleType("__main__")
    if main != "here":
        preparation.pop("init_main_from_path", None)
        preparation.pop("init_main_from_name", None)
        spawn.prepare(preparation)
        for name in preload if main == "in workers" else ():
            if name != "__main__":
                with contextlib.suppress(ImportError):
                    importlib.import_module(name)
        return
    _catching_up = True
    try:
        spawn.prepare(preparation)
    finally:
        _catching_up = False
