"""The stdlib's fork server standing for a script it must not run: preloaded by that server (a
fresh interpreter) where the application's script built its loader at its top level, outside
its ``if __name__ == "__main__":`` guard, and no server could be forked from it.

multiprocessing runs the main script again in each worker it starts (as ``__mp_main__``)
unless the worker's ``__main__`` is that script already: the same file (``python train.py``)
or the same module (``python -m jobs.train``). Run again, such a script comes back to its
loader, inside a worker, and the worker dies. Imported as the server preloads, this module
marks the server's ``__main__`` as the script (:func:`stand_in`), so its workers leave the
script alone; the script's functions and classes reach them by value, as a notebook's do.

Owns: :data:`ENV`, by which the parent says which script (:func:`encode`), and the marking.
Never: imports or runs the script. Without :data:`ENV` (a server someone else started) it
does nothing: the workers run the script, as the stdlib's do.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
from typing import Any

__all__ = ["ENV", "MODULE", "encode", "stand_in"]

ENV = "AIOLOADER_SERVER_MAIN"  # "path:<file>" or "name:<module>", read once, as the server starts
MODULE = __name__  # what the server's preload list names


def encode(preparation: dict[str, Any]) -> str | None:
    """What :data:`ENV` says for the script named in ``preparation`` (multiprocessing's
    ``spawn.get_preparation_data``: the main module each worker would run); None if it names
    none (``python -c``, standard input, a notebook)."""
    if name := preparation.get("init_main_from_name"):
        return f"name:{name}"
    if path := preparation.get("init_main_from_path"):
        return f"path:{path}"
    return None


def stand_in(value: str | None) -> None:
    """Make this process's ``__main__`` the script ``value`` names (see :func:`encode`), as
    multiprocessing's ``spawn.prepare`` checks it: its ``__file__`` is that path, or its
    ``__spec__`` names that module. Nothing for None or a value of another form."""
    main = sys.modules["__main__"]
    kind, _, what = (value or "").partition(":")
    if kind == "path" and what:
        main.__file__ = what
    elif kind == "name" and what:
        main.__spec__ = importlib.machinery.ModuleSpec(what, None)


stand_in(os.environ.pop(ENV, None))  # popped: the server's workers inherit its environment
