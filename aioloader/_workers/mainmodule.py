"""Which of the main module's functions and classes a worker process has under their names: it
depends on how the worker starts (``byvalue.py`` sends the others by value).

A worker forked from this process (torch's fork) has what the main module has; a fork server
forked from this process has what the main module had then (its workers do not run it again);
a spawned worker, or one from a server that runs the main script again (the standby, the
stdlib's), has what the script binds outside its ``if __name__ == "__main__":`` guard; from
``python -c``, standard input or a notebook, none.

Owns: :func:`workers_main` and the reading of the script it needs
(:func:`names_bound_on_import`). Never: imports or runs the script.
"""

from __future__ import annotations

import ast
import functools
import multiprocessing.context
import multiprocessing.process
import os
import sys
import types
from collections.abc import Iterable, Iterator

from .byvalue import MainRule
from .serverstart import server_start, start_method_name

__all__ = ["main_runs_again", "names_bound_on_import", "workers_main"]


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
    main = sys.modules.get("__main__")
    if start is not None and start.main is not None and not _forked_runs_main_again(main):
        forked = start.main

        def in_forked(obj: types.FunctionType | type) -> bool:
            top = obj.__qualname__.split(".")[0]
            return top in forked and forked[top] is getattr(main, top, None)

        return in_forked
    if not main_runs_again():
        return _nothing
    defined = _main_defines()
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


def main_runs_again() -> bool:
    """Whether a spawned worker runs this process's main module again, as multiprocessing
    prepares one: a script (``python train.py``) or a module run with ``-m`` (not a package's
    ``__main__``) does; a notebook, standard input and ``python -c`` do not."""
    main = sys.modules.get("__main__")
    if main is None:
        return False
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", None)
    if name is not None:
        return name != "__main__" and not name.endswith(".__main__")
    path = getattr(main, "__file__", None)
    return path is not None and not path.endswith(("<stdin>", "ipython"))


@functools.cache
def _main_defines() -> frozenset[str] | _Everything:
    """What a worker that runs the main script again has (:func:`names_bound_on_import`)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    try:
        with open(path or "", "rb") as file:
            return names_bound_on_import(file.read())
    except (OSError, SyntaxError, ValueError):
        return _Everything()


def names_bound_on_import(source: str | bytes) -> frozenset[str] | _Everything:
    """The names a module's ``source`` binds at its top level when it is imported, not run as
    the main module: outside its ``if __name__ == "__main__":`` blocks. Everything, where that
    cannot be told (``from m import *``).

    Raises:
        SyntaxError: ``source`` is not Python.
    """
    body = ast.parse(source).body
    outside = _bound(_outside_the_guard(body))
    if isinstance(outside, _Everything):
        return outside
    # A name the guard binds again is not, as the main module runs, the one a worker has
    inside = _bound(node for guard in _guards(body) for node in _outside_the_guard(guard.body))
    return outside if isinstance(inside, _Everything) else outside - inside


def _bound(nodes: Iterable[ast.AST]) -> frozenset[str] | _Everything:
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            return _Everything()
        if isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return frozenset(names)


def _guards(body: list[ast.stmt]) -> Iterator[ast.If]:
    """The ``if __name__ == "__main__":`` blocks at a module's top level (and in its ``else``
    branches)."""
    for statement in body:
        if isinstance(statement, ast.If) and _is_main_guard(statement.test):
            yield statement
            yield from _guards(statement.orelse)


class _Everything:
    def __contains__(self, name: object) -> bool:
        return True


def _outside_the_guard(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """The nodes of a module's top level that run on import, into compound statements (``if``,
    ``try``, ``with``, ``for``), not into functions, classes or ``if __name__ == "__main__"``."""
    for statement in body:
        if isinstance(statement, ast.If) and _is_main_guard(statement.test):
            yield from _outside_the_guard(statement.orelse)
            continue
        yield statement
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        for child in ast.iter_child_nodes(statement):
            if isinstance(child, ast.ExceptHandler):
                yield from _outside_the_guard(child.body)
            elif not isinstance(child, ast.stmt):  # a target, a test, a with's item
                yield from ast.walk(child)
        for field in ("body", "orelse", "finalbody"):
            block = getattr(statement, field, None)
            if isinstance(block, list):
                yield from _outside_the_guard(block)


def _is_main_guard(test: ast.expr) -> bool:
    """``__name__ == "__main__"``, either way round, alone or in an ``and``."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_is_main_guard(value) for value in test.values)
    if not (isinstance(test, ast.Compare) and len(test.comparators) == 1):
        return False
    sides = [test.left, test.comparators[0]]
    return (
        isinstance(test.ops[0], ast.Eq)
        and any(isinstance(a, ast.Name) and a.id == "__name__" for a in sides)
        and any(isinstance(a, ast.Constant) and a.value == "__main__" for a in sides)
    )
