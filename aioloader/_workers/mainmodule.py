"""Which of the main module's functions and classes a worker process has under their names: it
depends on how the worker starts (``byvalue.py`` sends the others by value).

A worker forked from this process (torch's fork) has what the main module has; a fork server
forked from this process has what the main module had then (its workers do not run it again);
a spawned worker, or one from a server that runs the main script again (the standby, the
stdlib's), has what the script binds outside its ``if __name__ == "__main__":`` guard; from
``python -c``, standard input or a notebook, none.

Owns: :func:`workers_main`. Never: reads the script (``mainscript.py`` does), imports or runs
it.
"""

from __future__ import annotations

import multiprocessing.context
import multiprocessing.process
import os
import sys
import types

from .byvalue import MainRule
from .mainscript import main_defines, main_runs_again
from .serverstart import server_start, start_method_name

__all__ = ["workers_main"]


def workers_main(context: str | multiprocessing.context.BaseContext) -> MainRule:
    """Which of the main module's functions and classes a worker started with ``context``
    has under their names: a fork server forked from this process has those the main module
    had then (its workers do not run it again); a spawned worker, or one from a server that
    ran the main script again, those the script binds outside its ``__main__`` guard; from
    ``python -c`` or a notebook, none. A worker forked from this process (``"fork"``) has
    those the main module has as the workers start, taken to be those it has now."""
    method = start_method_name(context)
    if method == "fork":
        return _bound_in_main
    start = server_start() if method == "forkserver" else None
    if start is not None and not start.main_again:  # an unguarded script, not run again
        return _nothing
    main = sys.modules.get("__main__")
    if start is not None and start.main is not None and not _forked_runs_main_again(main):
        forked = start.main

        def in_forked(obj: types.FunctionType | type) -> bool:
            top = obj.__qualname__.split(".")[0]
            return top in forked and forked[top] is getattr(main, top, None)

        return in_forked
    if not main_runs_again():
        return _nothing
    defined = main_defines()
    return lambda obj: obj.__qualname__.split(".")[0] in defined


def _nothing(obj: types.FunctionType | type) -> bool:
    return False


def _bound_in_main(obj: types.FunctionType | type) -> bool:
    main = sys.modules.get("__main__")
    return main is not None and obj.__qualname__.split(".")[0] in vars(main)


def _forked_runs_main_again(main: types.ModuleType | None) -> bool:
    """Whether a worker of a server forked from this process runs the main script again all
    the same: multiprocessing compares the script's path as given (``python ./train.py``) with
    its normalised absolute form, and runs it again where they differ."""
    path = getattr(main, "__file__", None)
    if (
        not isinstance(path, str)
        or getattr(getattr(main, "__spec__", None), "name", None) is not None
    ):
        return False
    original = getattr(multiprocessing.process, "ORIGINAL_DIR", None)  # as spawn reads it
    if not os.path.isabs(path) and isinstance(original, str):
        return os.path.normpath(os.path.join(original, path)) != path
    return os.path.normpath(path) != path
