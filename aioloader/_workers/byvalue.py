"""Sending to worker processes what pickle cannot send by name, by value: a lambda, a local
function or class, and the main module's own functions and classes where the workers do not
have them (a notebook's; a script's defined under its ``if __name__ == "__main__":`` guard).

torch's workers on Linux are forked by default, so a torch user's ``collate_fn=lambda b: b``
works there. Ours are not forked from the main process by default (``processes.py``), and
pickle sends a function by its module and name: a lambda fails. Such a value is pickled by
value here, with cloudpickle; everything in it that a worker finds by name still goes by name
(a torch class, the script's dataset class: the worker's is the class itself, not a copy).

Owns: deciding what must go by value (with ``byname.py``'s scan, which pickles into nothing;
which of the main module's own a worker has is ``mainmodule.py``'s), a job's functions sent
to each worker once (:func:`dumps_job`), the start arguments pickled once for a start's
workers (:func:`start_pickler`) or by value inside each worker's start (:class:`StartArgs`:
tensors through shared memory, as pickle by name sends them), and a
worker's replies (:func:`dumps_reply`: an instance of a class that came by value arrives as the
caller's own class). Never: sends by value what a worker finds by name.

Costs: a by-value function is pickled for each worker as its first job is sent (so each
epoch's workers get its state then, as torch's forked ones do) and once at construction, to
fail there.
The start arguments are pickled once for the workers a pool starts together
(:func:`start_pickler`, ``startonce.py``: 0.65 s for a dataset that holds ImageNet's 1.28
million paths, on a 2-core box); only where they do not pickle are they scanned and pickled
for each worker's start, which says why.
"""

from __future__ import annotations

import copy
import copyreg
import io
import itertools
import pickle
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import cloudpickle

from . import fdpass
from .byname import (
    ACTING,
    MainRule,
    as_a_process_starts,
    forking_reducers,
    found_by_name,
    sent_by_name,
)
from .fdpass import Passing

__all__ = [
    "ByValue",
    "MainRule",
    "StartArgs",
    "check_worker_init_fn",
    "dumps_job",
    "dumps_reply",
    "forget_received",
    "inherited",
    "inherited_tokens",
    "portable",
    "received_start",
    "sendable",
    "sent_by_name",
    "start_args",
    "start_pickler",
]

_tokens = itertools.count()
# In a worker: the values sent to it by value, by token, and whether it was sent any.
_received: dict[int, Any] = {}
_by_value_here = False
# In this process: every live ByValue, by token. A worker forked from this process inherits
# it, and so has, unpickled, every value made before its fork (``inherited_tokens``).
_made: weakref.WeakValueDictionary[int, ByValue] = weakref.WeakValueDictionary()


class ByValue:
    """A function argument (``collate_fn``, say) that goes to the workers by value: pickled
    for each worker as its first job is sent, with what the worker has of the main module,
    and sent to it once (:func:`dumps_job`). Calling it calls ``value``: the loader may run it
    in this process too. In a worker it is ``value`` itself."""

    __slots__ = ("__weakref__", "token", "value")

    def __init__(self, value: Any) -> None:
        self.value = value
        self.token = next(_tokens)
        _made[self.token] = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.value(*args, **kwargs)

    def __repr__(self) -> str:
        return repr(self.value)

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        # Outside a pool's jobs: nothing of the main module is taken to be there
        return _receive, (self.token, _dumps(self.value, _nothing))

    def __copy__(self) -> ByValue:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> ByValue:
        # Not through __reduce__: a copy in this process, its functions its own (a copy of a
        # partial of a main-module function would hold a function no longer found by name)
        return ByValue(copy.deepcopy(self.value, memo))


def _nothing(obj: types.FunctionType | type) -> bool:
    return False


class StartArgs:
    """A worker's start arguments by value: pickled as the worker starts (inside its
    process's start), with torch's reductions (a tensor is shared, not copied)."""

    __slots__ = ("main_has", "value")

    def __init__(self, value: Any, main_has: MainRule) -> None:
        self.value = value
        self.main_has = main_has

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return _receive_start, (_dumps(self.value, self.main_has, sharing=True),)


def _receive(token: int, blob: bytes) -> Any:
    global _by_value_here
    _by_value_here = True
    if token in _received:  # sent again (a job sent before the one that carried it was run):
        return _received[token]  # the worker keeps its own, with whatever state it has built
    value = _received[token] = pickle.loads(blob)
    return value


def _received_before(token: int) -> Any:
    if token in _received:
        return _received[token]
    return _made[token].value  # a forked worker: made before its fork, inherited


def forget_received() -> None:
    """In a worker forked from a process that had itself been sent values by value: those are
    not this worker's. Its replies go by value only once it is sent some (:func:`dumps_reply`);
    a class it inherited would come back a copy, so it goes by name or fails, as in torch's
    forked workers."""
    global _by_value_here
    _by_value_here = False
    _received.clear()


def inherited_tokens() -> set[int]:
    """The tokens of the values a worker forked from this process now inherits: jobs refer to
    them by token, unpickled (as torch's forked workers inherit ``collate_fn``)."""
    return set(_made.keys())


def _receive_start(blob: bytes) -> Any:
    return received_start(blob, by_value=True)


def received_start(blob: bytes | memoryview, buffers: Iterable[Any] = (), *, by_value: bool) -> Any:
    """In a worker: its start arguments, from their pickle and its out-of-band ``buffers``
    (``by_value``: something in it came by value, so the worker's replies go by value too:
    :func:`dumps_reply`)."""
    global _by_value_here
    _by_value_here = _by_value_here or by_value
    return pickle.loads(blob, buffers=buffers)


def portable(value: Any, main_has: MainRule) -> Any:
    """``value`` (a function argument) as a job sends it: itself when it is a function or
    class pickle sends by name (checked by a scan that copies nothing), else a
    :class:`ByValue` of it (pickled once now, to fail here), sent to each worker once. A
    bound method, a ``functools.partial`` or a callable object holds state (a bound
    method's dataset) that would otherwise be pickled again with every job.

    Raises:
        Exception: It does not pickle, by name or by value (the reason pickle gives).
    """
    if value is None or (_plain(value) and sent_by_name(value, main_has)):
        return value
    _dumps(value, main_has, trial=True)
    return ByValue(value)


def _plain(value: object) -> bool:
    """A function or class, which pickle sends as its name alone."""
    return isinstance(value, types.FunctionType | types.BuiltinFunctionType | type)


def inherited(name: str, value: Any) -> Any:
    """``value`` (the argument ``name``) as a job sends it to workers forked from this process:
    a :class:`ByValue` they inherit and jobs name by its token, never pickled (a bound method
    of the dataset is the forked worker's own dataset's)."""
    return None if value is None else ByValue(value)


def sendable(name: str, value: Any, main_has: MainRule, *, remedy: str) -> Any:
    """:func:`portable` of the argument ``name``.

    Raises:
        TypeError: It cannot be sent to a worker process, even by value; the message names
            the argument and what to do.
    """
    try:
        return portable(value, main_has)
    except Exception as exc:
        raise TypeError(
            f"{name}={value!r} cannot be sent to worker processes ({type(exc).__name__}: "
            f"{exc}): make its object picklable, or {remedy}"
        ) from exc


def start_args(
    worker_init_fn: Callable[[int], object] | None, dataset: object, main_has: MainRule
) -> object:
    """``(worker_init_fn, dataset)`` as the workers are sent them: one pickle, so that a bound
    method of the dataset as ``worker_init_fn`` stays bound to the worker's copy; a
    :class:`StartArgs` where pickle cannot send them by name.

    Raises:
        TypeError: They cannot be pickled; the message names which and why.
    """
    start = (worker_init_fn, dataset)
    try:
        return start if sent_by_name(start, main_has, starting=True) else StartArgs(start, main_has)
    except Exception as exc:
        what = f"worker_init_fn={worker_init_fn!r}"
        if dataset is not None and not _scans(dataset, main_has):
            what = f"the dataset ({type(dataset).__qualname__})"
        raise TypeError(
            f"{what} cannot be sent to the worker processes ({type(exc).__name__}: {exc}): "
            "each worker gets a copy, as with torch's spawn and forkserver start methods. Make "
            "it picklable, pass multiprocessing_context='fork' (the workers then inherit it, "
            "as torch's forked workers do), or worker_mode='thread' to keep it in this process"
        ) from exc


def start_pickler(
    file: io.BytesIO,
    main_has: MainRule,
    *,
    acting: Callable[[Any], Any],
    out_of_band: Callable[[pickle.PickleBuffer], object],
) -> Any:
    """A pickler of start arguments for several workers at once: by name where a worker
    finds them so, by value where not (its ``by_value`` says whether it sent any), what acts
    as it reduces (a tensor, a socket, a connection: :data:`byname.ACTING`) reduced by
    ``acting`` instead, and buffers given to ``out_of_band``; its ``kinds``, the types of the
    objects it reduced (not the builtins' types it saves itself)."""
    return _StartPickler(file, main_has, sharing=False, acting=acting, out_of_band=out_of_band)


def check_worker_init_fn(worker_init_fn: object, main_has: MainRule) -> None:
    """Fail now, not as the workers start, where ``worker_init_fn`` cannot be sent to them: it
    goes with the dataset as each worker starts, so it is tried as a process's start pickles
    it (a bound method of a dataset holding a multiprocessing ``Value``).

    Raises:
        TypeError: It cannot be pickled, by name or by value; the message names it.
    """
    with as_a_process_starts():
        remedy = (
            "pass multiprocessing_context='fork' (the workers inherit it), or worker_mode='thread'"
        )
        sendable("worker_init_fn", worker_init_fn, main_has, remedy=remedy)


def _scans(value: object, main_has: MainRule) -> bool:
    try:
        sent_by_name(value, main_has, starting=True)
    except Exception:
        return False
    return True


def dumps_job(
    job: object, has: set[int], sending: set[int], main_has: MainRule
) -> tuple[memoryview, Passing]:
    """``job`` pickled as ``ForkingPickler`` does (tensors through shared memory, their
    descriptors passed with the message: ``fdpass.py``), its :class:`ByValue` values whole
    unless their token is in ``has`` (the worker has it): each pickled for this worker, with
    torch's and multiprocessing's reductions (a tensor it holds stays shared, a connection it
    holds is the worker's own descriptor), and with what the worker has of the main module
    (``main_has``). The tokens sent whole are added to ``sending`` (to join ``has`` once the
    job is sent). Returns the message (:func:`fdpass.send` sends both).

    Raises:
        Exception: The job does not pickle (nothing is kept of what was shared for it).
    """
    passing = Passing()

    def reduce(value: ByValue) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        if value.token in has:
            return _received_before, (value.token,)
        sending.add(value.token)
        blob = _dumps(value.value, main_has, sharing=True, passing=passing)
        return _receive, (value.token, blob)

    return passing.dumps(job, {ByValue: reduce}), passing


def dumps_reply(reply: object) -> tuple[memoryview, Passing]:
    """In a worker: ``reply`` pickled as ``ForkingPickler`` does (tensors through shared
    memory, their descriptors passed with the message: ``fdpass.py``). Once the worker was
    sent values by value, a class that came so goes back by value (cloudpickle gives the main
    process its own class back: it tracks the classes it sent).

    Raises:
        Exception: ``reply`` does not pickle (nothing is kept of what was shared for it).
    """
    passing = Passing()
    if not _by_value_here:
        return passing.dumps(reply), passing
    buffer = fdpass.buffer()
    pickler = _Pickler(buffer, None, sharing=True, passing=passing)
    return passing.dump(pickler, buffer, reply), passing


def _dumps(
    value: object,
    main_has: MainRule,
    *,
    sharing: bool = False,
    trial: bool = False,
    passing: Passing | None = None,
) -> bytes:
    """``value`` by value: with torch's reductions where ``sharing`` (a storage's descriptor
    passed by ``passing``, if given); with multiprocessing's but not torch's where ``trial``
    (as a process's start would pickle it, moving nothing)."""
    buffer = io.BytesIO()
    _Pickler(buffer, main_has, sharing=sharing, trial=trial, passing=passing).dump(value)
    return buffer.getvalue()


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]
    """cloudpickle, but what a worker finds by name goes by name (cloudpickle sends every
    function and class of the main module by value: a worker's would be copies); with
    ``sharing``, torch's reductions too (valid in one process's start, or in a worker's reply).
    ``main_has`` None: in a worker, whose main module is the one its replies are read against
    (what it found by name there, the main process has)."""

    def __init__(
        self,
        file: io.BytesIO,
        main_has: MainRule | None,
        *,
        sharing: bool,
        trial: bool = False,
        acting: Callable[[Any], Any] | None = None,
        out_of_band: Callable[[pickle.PickleBuffer], object] | None = None,
        passing: Passing | None = None,
    ) -> None:
        self.main_has = main_has
        self.by_value = False  # whether it sent a function or class by value
        table = {**copyreg.dispatch_table, **cloudpickle.Pickler._dispatch_table}
        # An open text file is refused, as pickle by name refuses it (cloudpickle would read
        # it whole into a copy for every worker)
        table.pop(io.TextIOWrapper, None)
        if sharing or trial:  # a trial runs as a process's start would, but moves nothing
            table.update(forking_reducers(skipping=ACTING if trial else ()))
            if passing is not None:
                table.update(passing.reducers())
        elif acting is not None:  # what acts as it reduces: reduced by ``acting`` instead
            table.update(forking_reducers(skipping=ACTING, instead=acting))
        # Before the pickler's own start, which reads it (cloudpickle's class attribute, a
        # ChainMap, would hide a later one; and a ChainMap's lookups run in Python, per object)
        self.dispatch_table = table
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=out_of_band)

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, types.FunctionType | type) or found_by_name(obj, self.main_has):
            return NotImplemented
        self.by_value = True
        return super().reducer_override(obj)


class _StartPickler(_Pickler):
    """A pickler of start arguments, noting the types of the objects it reduces (a template
    declines a class that runs code of its own as it is unpickled: ``template.py``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kinds: set[type] = set()

    def reducer_override(self, obj: Any) -> Any:
        self.kinds.add(type(obj))
        return super().reducer_override(obj)
