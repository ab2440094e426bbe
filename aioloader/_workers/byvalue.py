"""Sending to worker processes what pickle cannot find by name, by value: a lambda, a local
function or class, and, where the workers do not run the main module again (a notebook, standard
input, ``python -c``), the main module's own functions and classes.

torch's workers on Linux are forked by default, so a torch user's ``collate_fn=lambda b: b``
works there. Ours are never forked (``processes.py``), and pickle sends a function by its
module and name: a lambda fails. Here such a value is pickled by value, with cloudpickle, once;
everything in it that pickle finds by name still goes by name (a torch class, the script's
module-level dataset class: the worker's is the class itself, not a copy).

Owns: deciding what must go by value (:func:`portable`, from a scan that pickles nothing),
:class:`ByValue`, sending one to each worker once (:func:`dumps_job`), and a worker's replies
(:func:`dumps_reply`: what a value sent by value made comes back as the caller's own class).
Never: sends by value what pickle sends by name, or runs torch's shared-memory reductions to
decide.

Costs: the scan of a dataset pickles it into nothing (about 0.3 s for a list of a million
paths on a 2-core box); it runs only where the main module has functions or classes a worker
would not find by name (a notebook's, say). Elsewhere the dataset is pickled as it always was,
and only if pickle refuses it (a lambda in it) does it go by value.
"""

from __future__ import annotations

import ast
import copyreg
import functools
import io
import itertools
import pickle
import sys
import types
from collections import ChainMap
from collections.abc import Callable, Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any, ClassVar

import cloudpickle

__all__ = [
    "ByValue",
    "dumps_job",
    "dumps_reply",
    "main_has_what_workers_lack",
    "main_runs_again",
    "names_bound_on_import",
    "portable",
    "sendable",
    "start_args",
    "sent_by_name",
]

_tokens = itertools.count()
_received: dict[int, Any] = {}  # in a worker: the values sent to it by value, by token


class ByValue:
    """``value`` as it is sent to the workers: by value (its pickle made once, on first use),
    and to each worker once. Calling it calls ``value``: the loader may run it in this process
    too. In a worker it is ``value`` itself."""

    __slots__ = ("_blob", "token", "value")

    def __init__(self, value: Any) -> None:
        self.value = value
        self.token = next(_tokens)
        self._blob: bytes | None = None

    @property
    def blob(self) -> bytes:
        """``value`` pickled by value (made once).

        Raises:
            Exception: It does not pickle even so (a lock, an open file in it).
        """
        if self._blob is None:
            buffer = io.BytesIO()
            _ByValuePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(self.value)
            self._blob = buffer.getvalue()
        return self._blob

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.value(*args, **kwargs)

    def __repr__(self) -> str:
        return repr(self.value)

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return _receive, (self.token, self.blob)


def _receive(token: int, blob: bytes) -> Any:
    value = _received[token] = pickle.loads(blob)
    return value


def _received_before(token: int) -> Any:
    return _received[token]


def portable(value: Any) -> Any:
    """``value`` as the workers are sent it: itself when pickle sends it by name and whole
    (checked by a scan that copies nothing), else a :class:`ByValue` of it.

    Raises:
        Exception: It does not pickle, by name or by value (the reason pickle gives).
    """
    if value is None or sent_by_name(value):
        return value
    wrapped = ByValue(value)
    wrapped.blob  # noqa: B018  # fail here, at construction, not in an epoch
    return wrapped


def sendable(name: str, value: Any, *, remedy: str) -> Any:
    """:func:`portable` of the argument ``name``.

    Raises:
        TypeError: It cannot be sent to a worker process, even by value; the message names
            the argument and what to do.
    """
    try:
        return portable(value)
    except Exception as exc:
        raise TypeError(
            f"{name}={value!r} cannot be sent to worker processes ({type(exc).__name__}: "
            f"{exc}): make its object picklable, or {remedy}"
        ) from exc


def start_args(worker_init_fn: Callable[[int], object] | None, dataset: object) -> object:
    """``(worker_init_fn, dataset)`` as the workers are sent them: one pickle, so that a
    bound method of the dataset as ``worker_init_fn`` stays bound to the worker's copy; by value
    where pickle cannot send it by name.

    Raises:
        TypeError: It cannot be sent even so; the message names which and why.
    """
    try:
        return portable((worker_init_fn, dataset))
    except Exception as exc:
        what = f"worker_init_fn={worker_init_fn!r}"
        if dataset is not None and not _sends(dataset):
            what = f"the dataset ({type(dataset).__qualname__})"
        raise TypeError(
            f"{what} cannot be sent to the worker processes ({type(exc).__name__}: {exc}): "
            "each worker gets a copy, as with torch's spawn and forkserver start methods. Make "
            "it picklable, or pass worker_mode='thread' to keep it in this process"
        ) from exc


def _sends(value: object) -> bool:
    try:
        portable(value)
    except Exception:
        return False
    return True


def dumps_job(job: object, has: set[int], sending: set[int]) -> memoryview:
    """``job`` pickled as ``ForkingPickler`` does (tensors through shared memory), the
    :class:`ByValue` values in it whole unless their token is in ``has`` (the worker has it);
    the tokens sent whole are added to ``sending`` (to join ``has`` once the job is sent)."""

    def reduce(value: ByValue) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        if value.token in has:
            return _received_before, (value.token,)
        sending.add(value.token)
        return value.__reduce__()

    buffer = io.BytesIO()
    pickler = ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table[ByValue] = reduce
    pickler.dump(job)
    return buffer.getbuffer()


def dumps_reply(reply: object) -> memoryview:
    """In a worker: ``reply`` pickled as ``ForkingPickler`` does (tensors through shared
    memory). Once the worker was sent values by value, what they made goes by value where it
    must too (an instance of a class that came by value: the main process gets its own class
    back, which cloudpickle tracks by the id it sent it with).

    Raises:
        Exception: ``reply`` does not pickle.
    """
    if not _received:
        return ForkingPickler.dumps(reply)
    buffer = io.BytesIO()
    _ReplyPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(reply)
    return buffer.getbuffer()


# -- what goes by name ----------------------------------------------------------------------------


def main_runs_again() -> bool:
    """Whether a spawned or fork-server worker runs this process's main module again, as
    multiprocessing prepares one: a script (``python train.py``) or a module run with ``-m``
    (not a package's ``__main__``) does; a notebook, standard input and ``python -c`` do not."""
    main = sys.modules.get("__main__")
    if main is None:
        return False
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", None)
    if name is not None:
        return name != "__main__" and not name.endswith(".__main__")
    path = getattr(main, "__file__", None)
    return path is not None and not path.endswith(("<stdin>", "ipython"))


def main_has_what_workers_lack() -> bool:
    """Whether the main module has a function or class of its own that a worker would not
    find by name: any, in a notebook; one defined under ``if __name__ == "__main__":`` in a
    script. Pickle sends such a value by name without a complaint; the worker fails."""
    main = sys.modules.get("__main__")
    return any(
        isinstance(value, types.FunctionType | type)
        and getattr(value, "__module__", None) == "__main__"
        and not _found_by_name(value)
        for value in list(vars(main).values() if main is not None else ())
    )


def sent_by_name(value: object) -> bool:
    """Whether every function and class in ``value`` is one pickle sends by name and a worker
    finds by that name. Pickles into nothing: tensors and buffers are not copied, and torch's
    shared-memory reductions do not run.

    Raises:
        Exception: ``value`` does not pickle at all (the reason pickle gives).
    """
    try:
        _Scan().dump(value)
    except _NotByName:
        return False
    return True


class _NotByName(Exception):
    pass


class _Nowhere:
    def write(self, data: bytes | memoryview) -> None:
        pass


def _skip(_: object) -> tuple[type, tuple[()]]:
    return object, ()


class _Scan(pickle.Pickler):
    """Walks what pickle would send and raises at the first function or class a worker would
    not find by name."""

    def __init__(self) -> None:
        super().__init__(_Nowhere(), pickle.HIGHEST_PROTOCOL, buffer_callback=_out_of_band)
        extra: dict[type, Any] = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
        # ForkingPickler's, but not those that act as they reduce: torch's move a tensor to
        # shared memory, a socket's hands its descriptor to the resource sharer's thread
        acting = [t for t in extra if t.__module__.startswith(("torch", "socket", "multipro"))]
        self.dispatch_table = {
            **copyreg.dispatch_table,
            **extra,
            **dict.fromkeys(acting, _skip),
        }

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.FunctionType | type) and not _found_by_name(obj):
            raise _NotByName(obj)
        return NotImplemented


def _out_of_band(_: pickle.PickleBuffer) -> bool:
    return True  # a NumPy array's bytes are not copied into the scan


class _ByValuePickler(cloudpickle.Pickler):  # type: ignore[misc]
    """cloudpickle, but what a worker finds by name goes by name (cloudpickle sends every
    function and class of the main module by value: the worker's would be copies)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.FunctionType | type) and _found_by_name(obj):
            return NotImplemented
        return super().reducer_override(obj)


class _ReplyPickler(_ByValuePickler):
    """:class:`_ByValuePickler` with torch's shared-memory reductions."""

    dispatch_table: ClassVar[ChainMap[type, Any]] = ChainMap(
        cloudpickle.Pickler._dispatch_table,
        ForkingPickler._extra_reducers,  # type: ignore[attr-defined]
        copyreg.dispatch_table,
    )


def _found_by_name(obj: types.FunctionType | type) -> bool:
    """Whether a worker finds ``obj`` by its module and qualified name."""
    module_name = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module_name, str) or not isinstance(qualname, str):
        return False
    module = sys.modules.get(module_name)
    if module is None:
        return False
    if module_name == "__main__" and not (
        main_runs_again() and qualname.split(".")[0] in _main_defines()
    ):
        return False
    found: object = module
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found is obj


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
    names: set[str] = set()
    for node in _outside_the_guard(ast.parse(source).body):
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            return _Everything()
        if isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return frozenset(names)


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
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and len(test.comparators) == 1
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value == "__main__"
    )
