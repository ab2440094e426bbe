"""The main script, read: whether a worker runs it again, what it binds outside its ``if
__name__ == "__main__":`` guard, and whether the main thread runs its top level outside that
guard now.

Owns: :func:`main_runs_again`, :func:`names_bound_on_import` (and :func:`main_defines`, the
main script's), :func:`guarded_at` and :func:`running_unguarded`. Never: imports or runs the
script, or decides how workers start (``serverstart.py``) or what they have by name
(``mainmodule.py``).

Why the guard matters: torch users on Linux write scripts without it (torch's fork workers
never run the script again); a server that ran such a script again would build a model,
initialise CUDA and come to the loader again, as spawn's workers do.
"""

from __future__ import annotations

import ast
import functools
import sys
import threading
from collections.abc import Iterable, Iterator

__all__ = [
    "guarded_at",
    "main_defines",
    "main_runs_again",
    "names_bound_on_import",
    "running_unguarded",
]


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


def running_unguarded() -> bool:
    """Whether the main thread runs the main script's top level outside its ``if __name__ ==
    "__main__":`` guard now: a server or worker that ran the script again (as spawn prepares
    one) would come here too, to the loader being built, after doing again whatever the script
    did before it (load data, build a model, initialise CUDA). False where the script is not
    run again (a notebook, ``python -c``), where its top level has ended, and where its source
    cannot be read (then it is run again, as multiprocessing would)."""
    main = sys.modules.get("__main__")
    if main is None or not main_runs_again():
        return False
    ident = threading.main_thread().ident
    frame = sys._current_frames().get(ident) if ident is not None else None
    while frame is not None and not (
        frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)
    ):
        frame = frame.f_back
    if frame is None or frame.f_lineno is None:
        return False
    body = _main_tree()
    return body is not None and not guarded_at(body, frame.f_lineno)


def guarded_at(body: list[ast.stmt], line: int) -> bool:
    """Whether ``line`` of a module whose top level is ``body`` lies inside an ``if __name__ ==
    "__main__":`` block, so that importing the module never runs it: at the top level, in an
    ``else`` of one (run as the main module), or inside a ``try``, ``with``, loop or other
    ``if`` of the top level (``try: main() ...`` around the guard: found by review)."""
    for statement in body:
        first = min([statement.lineno, *(d.lineno for d in _decorators(statement))])
        if not first <= line <= (statement.end_lineno or statement.lineno):
            continue
        if isinstance(statement, ast.If) and _is_main_guard(statement.test):
            inside = any(s.lineno <= line <= (s.end_lineno or s.lineno) for s in statement.body)
            return inside or guarded_at(statement.orelse, line)
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            return False  # its body runs when called: from where, the caller's line says
        return any(guarded_at(block, line) for block in _blocks(statement))
    return False


def _blocks(statement: ast.stmt) -> Iterator[list[ast.stmt]]:
    """The statement lists a compound statement holds (an ``except`` handler's included)."""
    for field in ("body", "orelse", "finalbody"):
        block = getattr(statement, field, None)
        if isinstance(block, list):
            yield block
    for handler in getattr(statement, "handlers", ()):
        yield handler.body
    for case in getattr(statement, "cases", ()):  # match
        yield case.body


def _decorators(statement: ast.stmt) -> list[ast.expr]:
    if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return statement.decorator_list
    return []


@functools.cache
def _main_tree() -> list[ast.stmt] | None:
    """The main script's top level, parsed once; None where it cannot be read or parsed."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    try:
        with open(path or "", "rb") as file:
            return ast.parse(file.read()).body
    except (OSError, SyntaxError, ValueError):
        return None


@functools.cache
def main_defines() -> frozenset[str] | _Everything:
    """What a worker that runs the main script again has (:func:`names_bound_on_import`):
    everything, where the script cannot be read."""
    body = _main_tree()
    return _Everything() if body is None else _names_bound(body)


def names_bound_on_import(source: str | bytes) -> frozenset[str] | _Everything:
    """The names a module's ``source`` binds at its top level when it is imported, not run as
    the main module: outside its ``if __name__ == "__main__":`` blocks. Everything, where that
    cannot be told (``from m import *``).

    Raises:
        SyntaxError: ``source`` is not Python.
    """
    return _names_bound(ast.parse(source).body)


def _names_bound(body: list[ast.stmt]) -> frozenset[str] | _Everything:
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
