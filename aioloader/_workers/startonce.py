"""The start arguments (``worker_init_fn`` and the dataset) pickled once for every worker a
pool starts together, and handed to each through files in memory, not down a pipe each; a
NumPy array's memory shared by the workers, copy-on-write, as a forked worker shares it.

Why: a worker not forked from this process is sent its copy of the dataset as it starts. A
dataset holding ImageNet's list of 1.28 million (path, class) pairs pickles to 57 MiB in
0.65 s on a 2-core box; pickled for each worker and written down each one's start pipe (about
0.1 s more each), that was seconds before the first batch of every epoch with many workers,
where torch's forked workers inherit the list. A dataset holding a 256 MiB array (features,
labels, CIFAR's images) put a private copy of it in each worker: the process tree's PSS with
2 workers was 1,034 MiB, against torch's 513 (538 now).

A dataset's tensors go as a NumPy array's bytes do, as one table of copies unpickled before
the rest (``startcopy.py``). What one pickle cannot serve (:func:`dumps_once`): what acts as it
reduces, a tensor torch moves to shared memory (one in shared memory already, one of
``startcopy.MOVED_FROM`` bytes or more, a ``Parameter``), a socket or a connection, a
descriptor a value hands to one process's start (a multiprocessing ``Value``'s memory). Those
go in the
pickle as references by index, and each worker's start pickles them for itself, with torch's
and multiprocessing's reductions, as the whole start was pickled before. A start that does not
pickle at all is pickled per worker (``byvalue.start_args``), which names what fails.

Owns: :func:`dumps_once`, :class:`StartArguments`, :class:`OnceStart`: the pickle's file (the
table of copies, then the pickle) and its out-of-band buffers' file (``memfile.py``), each
handed to each worker's start as a descriptor; parts under :data:`IN_FILE_FROM` go with the
start itself.
Never: keeps a file here past the start (the pool closes them once its workers have theirs);
a worker lets go of the pickle's once it has unpickled it, and keeps the buffers' mapped (and
the descriptor Python's ``mmap`` keeps) for as long as it holds an array from it (a write to
one makes that page its own). Arrays under :data:`OUT_OF_BAND_FROM` go in the pickle.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import multiprocessing.forkserver as stdlib_forkserver
import os
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

from . import fdpass
from .byname import as_a_process_starts
from .byvalue import MainRule, received_start, start_args, start_pickler
from .memfile import IN_FILE_FROM, OUT_OF_BAND_FROM, in_memory, mapped
from .nogc import collections_paused
from .startcopy import StartCopies, rebuilt, referred

__all__ = [
    "IN_FILE_FROM",
    "MOST_HANDED",
    "OUT_OF_BAND_FROM",
    "Descriptor",
    "OnceStart",
    "StartArguments",
    "Unreceived",
]

# Values handed over by descriptor (a tensor, a socket) that a start through a fork server
# takes: the stdlib's client hands over at most MAXFDS_TO_SEND less 4, a few of them the
# start's own files. More go down the worker's pipe (fdpass.starting), or refuse a template.
MOST_HANDED = stdlib_forkserver.MAXFDS_TO_SEND - 16


class StartArguments:
    """What a pool's workers are sent as they start: ``(worker_init_fn, dataset)``.

    Args:
        worker_init_fn: Called in each worker as it starts.
        dataset: Each worker's copy, or None.
        main_has: Which of the main module's functions and classes the workers have.
        forked: The workers are forks of this process: they have them as they are then.
    """

    def __init__(
        self,
        worker_init_fn: Callable[[int], object] | None,
        dataset: object,
        main_has: MainRule,
        forked: bool,
    ) -> None:
        self._given = (worker_init_fn, dataset)
        self._main_has = main_has
        self._forked = forked
        self._each: object = None  # as each worker's start pickles them: start_args
        self.once_bytes = 0  # the last start's one pickle; 0 where each worker had its own

    @contextlib.contextmanager
    def now(self) -> Iterator[object]:
        """The start arguments, as they are now, for the workers starting in the block:
        pickled once for them all where that serves (:class:`OnceStart`), else as each
        worker's start pickles them.

        Raises:
            TypeError: They cannot be pickled; the message names which and why.
        """
        if self._forked:
            yield self._given
            return
        once = OnceStart.of(self._given, self._main_has)
        self.once_bytes = 0 if once is None else once.size
        if once is None:  # it does not pickle: each worker's start says why
            if self._each is None:
                self._each = start_args(*self._given, self._main_has)
            yield self._each
            return
        try:
            yield once
        finally:
            once.close()  # each worker started has the file now


@dataclass(eq=False, slots=True)
class _Pickled:
    blob: memoryview  # the pickle
    copies: bytes  # the table of its tensors' copies, unpickled first (b"" for none)
    buffers: list[pickle.PickleBuffer]  # their out-of-band buffers, the table's first
    acting: list[object]  # what each worker's start pickles for itself, by index in the pickle
    by_value: bool  # something in it went by value
    kinds: frozenset[type]  # the types of the objects in it (not builtins': reduced by them)


def dumps_once(start: object, main_has: MainRule) -> _Pickled | None:
    """The start arguments ``start`` pickled once for any number of workers (by name where a
    worker finds them so, by value where not), its plain tensors as one table of copies after
    it (``startcopy.py``), but for what acts as it reduces: a tensor ``startcopy`` leaves to
    torch (which moves it to shared memory and counts it once per pickle), a socket, a
    connection, a descriptor a value hands to a process's start (a multiprocessing ``Value``'s
    memory). Those are referred to by index, each worker's start pickling them for itself.
    None where it does not pickle (each worker's own start pickles it then, and says why)."""
    acting: list[object] = []
    indices: dict[int, int] = {}  # by id(): a value met twice is one value in each worker
    copies = StartCopies()

    def act(value: object) -> int:
        index = indices.get(id(value))
        if index is None:
            index = indices[id(value)] = len(acting)
            acting.append(value)
        return index

    def refer(value: object) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        if (copied := copies.reduce(value)) is not None:  # a tensor, as a NumPy array goes
            return copied
        return _acting_ref, (act(value),)

    buffer = io.BytesIO()
    buffers: list[pickle.PickleBuffer] = []
    table_buffers: list[pickle.PickleBuffer] = []

    def out_of_band(into: list[pickle.PickleBuffer]) -> Callable[[pickle.PickleBuffer], bool]:
        def in_band(buffer: pickle.PickleBuffer) -> bool:
            with memoryview(buffer) as view:
                if view.nbytes < OUT_OF_BAND_FROM or not view.contiguous:
                    return True
            into.append(buffer)
            return False

        return in_band

    pickler = start_pickler(buffer, main_has, acting=refer, out_of_band=out_of_band(buffers))
    try:
        with as_a_process_starts(_EachProcessStart(refer)):
            pickler.dump(start)
        with collections_paused():  # our own objects only: none is garbage yet
            table = copies.dumps(out_of_band(table_buffers), act)
    except Exception:  # each worker's own pickle says why, as it did without this
        return None
    kinds = frozenset(pickler.kinds)
    return _Pickled(
        buffer.getbuffer(), table, table_buffers + buffers, acting, pickler.by_value, kinds
    )


class _EachProcessStart:
    """Stands for the start of each process the pickle goes to: a descriptor a value hands to
    it becomes a reference, each worker's start handing the descriptor to it."""

    def __init__(self, refer: Callable[[object], tuple[Callable[..., Any], tuple[Any, ...]]]):
        self._refer = refer

    def duplicate_for_child(self, fd: int) -> int:
        return fd

    def DupFd(self, fd: int) -> _Referred:  # multiprocessing's name
        return _Referred(self._refer(Descriptor(fd)))


class _Referred:
    """A value pickled as a reference (:func:`_acting_ref`) to one of the acting values."""

    __slots__ = ("reduced",)

    def __init__(self, reduced: tuple[Callable[[int], Any], tuple[int]]) -> None:
        self.reduced = reduced

    def __reduce__(self) -> tuple[Callable[[int], Any], tuple[int]]:
        return self.reduced


class Descriptor:
    """A descriptor that a value's pickle hands to a process's start: pickled in that start as
    multiprocessing hands one (``DupFd``: the process detaches its own)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Callable[[Any], Any], tuple[Any]]:
        return _same, (reduction.DupFd(self.fd),)


def _same(value: Any) -> Any:
    return value


# In a worker, while its start arguments are unpickled: its own pickle of the acting values
_acting_here: list[Any] = []


def _acting_ref(index: int) -> Any:
    return _acting_here[index]


class OnceStart:
    """``(worker_init_fn, dataset)`` pickled once, for the workers starting now: the pickle
    and its out-of-band buffers (a NumPy array's memory), each in a file in memory where
    large, and the acting values (:func:`dumps_once`). Pickled in a process's start, it hands
    that process the files' descriptors and its own pickle of the acting values; the process
    unpickles the start arguments as its start is unpickled, the pickle's file read and let go
    of, the buffers' file mapped copy-on-write: the arrays' pages are shared by every worker
    until one writes to them, as a forked worker shares its parent's.
    """

    __slots__ = ("_acting", "_buffers", "_pickle", "by_value", "handed", "kinds", "size")

    def __init__(self, pickled: _Pickled) -> None:
        blob, raws = pickled.blob, [buffer.raw() for buffer in pickled.buffers]
        self.size = len(pickled.copies) + len(blob) + sum(len(raw) for raw in raws)
        self.by_value = pickled.by_value
        self.kinds = pickled.kinds  # the types of the objects in it (not builtins')
        self._acting = pickled.acting
        # Descriptors each start hands over for the values it pickles for itself
        self.handed = sum(fdpass.descriptors_of(value) for value in pickled.acting)
        # The table of copies, then the pickle: a list of the two, or their file and spans
        self._pickle: Any = in_memory([memoryview(pickled.copies), blob]) or [
            pickled.copies,
            bytes(blob),
        ]
        # Read-only where the array was (an in-band pickle gives it bytes, not a bytearray)
        self._buffers: Any = in_memory(raws) or [
            bytes(raw) if raw.readonly else bytearray(raw) for raw in raws
        ]

    @classmethod
    def of(cls, start: object, main_has: MainRule) -> OnceStart | None:
        """``start`` pickled once, or None where it does not pickle (:func:`dumps_once`)."""
        pickled = dumps_once(start, main_has)
        if pickled is None:
            return None
        with pickled.blob:  # a view of a BytesIO: let go here, even by an error (gh-111049)
            return cls(pickled)

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        # A file goes as its descriptor, which DupFd hands to the process whose start pickles
        # this (outside a process's start, to the resource sharer for one process to claim: a
        # pool pickles it only in its workers' starts); the acting values with torch's and
        # multiprocessing's reductions, as that start pickles them
        pickled, buffers = self._pickle, self._buffers
        if isinstance(pickled, tuple):
            pickled = (reduction.DupFd(pickled[0]), pickled[1])
        if isinstance(buffers, tuple):
            buffers = (reduction.DupFd(buffers[0]), buffers[1])
        return _receive, (pickled, buffers, self._acting, self.by_value)

    def unreceived(self) -> object:
        """This, to be pickled in a process's start that unpickles the start arguments later
        (:meth:`Unreceived.receive`), not as its start is unpickled."""
        return _Later(self)

    def close(self) -> None:
        """Let go of the files here (each worker that has them keeps its own descriptors)."""
        for part in (self._pickle, self._buffers):
            if isinstance(part, tuple) and part[0] >= 0:
                os.close(part[0])
        self._pickle = self._buffers = None


class _Later:
    __slots__ = ("once",)

    def __init__(self, once: OnceStart) -> None:
        self.once = once

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        pickled, buffers, acting, by_value = self.once.__reduce__()[1]
        passing = fdpass.for_the_pipe()
        if passing is not None and self.once.handed > MOST_HANDED:
            # A worker's start from a fork server, which hands over at most 252 descriptors:
            # the storages' go down its pipe, taken once it runs; the rest (a socket, a shared
            # Value) with the start, as before
            with passing.dumps(acting) as message:
                acting = fdpass.Piped(bytes(message))
        return Unreceived, (pickled, buffers, acting, by_value)


class Unreceived:
    """In a process: start arguments whose files and acting values it has, not unpickled yet
    (a template watches what unpickling them opens)."""

    __slots__ = ("_parts",)

    def __init__(self, *parts: Any) -> None:
        self._parts = parts

    def receive(self, conn: Connection | None = None) -> Any:
        """The start arguments, unpickled now (:func:`_receive`); acting values sent down the
        pipe are taken from ``conn`` first.

        Raises:
            EOFError: The main process closed the pipe before the descriptors came.
            Exception: What unpickling raises.
        """
        pickled, buffers, acting, by_value = self._parts
        if isinstance(acting, fdpass.Piped):
            if conn is None:  # pragma: no cover - only a worker's start is piped
                raise RuntimeError("start arguments sent down a pipe, received without one")
            acting = acting.received(conn)
        return _receive(pickled, buffers, acting, by_value)


def _receive(pickled: Any, buffers: Any, acting: list[Any], by_value: bool) -> Any:
    """In a worker: its start arguments, from the table of copies and the pickle (a list of
    the two, or their file's descriptor and where each is), the buffers (a list, or their
    file's descriptor and where each is) and this worker's own pickle of the acting values
    (unpickled by now)."""
    global _acting_here
    if isinstance(buffers, tuple):
        buffers = mapped(*buffers)
    _acting_here = acting
    try:
        if isinstance(pickled, list):
            copies, start = pickled
            return _unpickled(copies, start, iter(buffers), by_value)
        handle, spans = pickled
        fd = handle.detach()  # this process's own descriptor of the file
        try:
            end = max(offset + length for offset, length, _ in spans)
            with mmap.mmap(fd, end, prot=mmap.PROT_READ) as region, memoryview(region) as view:
                (at, length, _), (start_at, start_length, _) = spans
                with (
                    view[at : at + length] as copies,
                    view[start_at : start_at + start_length] as start,
                ):
                    return _unpickled(copies, start, iter(buffers), by_value)
        finally:
            os.close(fd)
    finally:
        _acting_here = []


def _unpickled(copies: Any, start: Any, buffers: Iterator[Any], by_value: bool) -> Any:
    with collections_paused():  # our own objects only: none is garbage yet
        tensors = rebuilt(copies, buffers, _acting_here)
    with referred(tensors):  # the tensors' table first: the pickle refers to them
        return received_start(start, buffers, by_value=by_value)
