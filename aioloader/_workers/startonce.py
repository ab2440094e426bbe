"""The start arguments (``worker_init_fn`` and the dataset) pickled once for every worker a
pool starts together, and handed to each through one file in memory, not down a pipe each.

Why: a worker not forked from this process is sent its copy of the dataset as it starts. A
dataset holding ImageNet's list of 1.28 million (path, class) pairs pickles to 57 MiB in
0.65 s on a 2-core box; pickled for each worker and written down each one's start pipe (about
0.1 s more each), that was seconds before the first batch of every epoch with many workers,
where torch's forked workers inherit the list.

When one pickle serves every worker (:func:`byvalue.dumps_once`): when nothing in it acts as
it reduces: a tensor torch moves to shared memory (counted once per pickle), a socket or a
connection, a descriptor handed to one process's start. Otherwise each worker's start pickles
its own, as it did before.

Owns: :class:`OnceStart`: the file (``memfd_create``: anonymous, gone once the last process
lets go of it), handed to each worker's start as a descriptor; a pickle under
:data:`IN_FILE_FROM` goes with the start itself. Never: keeps the file past the start: the pool
closes it once its workers have theirs, each worker once it has unpickled its copy.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable, Iterator
from multiprocessing import reduction
from typing import Any

from .byvalue import MainRule, dumps_once, received_start, start_args

__all__ = ["IN_FILE_FROM", "OnceStart", "StartArguments"]

IN_FILE_FROM = 1 << 20  # bytes: a smaller pickle goes in each worker's start, copied


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
        if once is None:
            if self._each is None:
                self._each = start_args(*self._given, self._main_has)
            yield self._each
            return
        try:
            yield once
        finally:
            once.close()  # each worker started has the file now


class OnceStart:
    """``(worker_init_fn, dataset)`` pickled once, for the workers starting now. Pickled in
    a process's start, it hands that process the file's descriptor; the process unpickles
    the start arguments from the file as its start is unpickled.

    Args:
        blob: The pickle.
        by_value: Something in it went by value.
    """

    __slots__ = ("_blob", "_fd", "by_value", "size")

    def __init__(self, blob: memoryview, by_value: bool) -> None:
        self.size = len(blob)
        self.by_value = by_value
        self._fd = -1
        self._blob: bytes | None = None
        if self.size >= IN_FILE_FROM and hasattr(os, "memfd_create"):
            with contextlib.suppress(OSError):  # a sandbox that refuses it: in each start
                self._fd = _in_memory_file(blob)
        if self._fd < 0:
            self._blob = bytes(blob)

    @classmethod
    def of(cls, start: object, main_has: MainRule) -> OnceStart | None:
        """``start`` pickled once, or None where each worker must be pickled its own
        (:func:`byvalue.dumps_once`)."""
        pickled = dumps_once(start, main_has)
        return None if pickled is None else cls(*pickled)

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        if self._blob is not None:
            return _receive, (self._blob, self.by_value)
        # Outside a process's start this hands the descriptor to multiprocessing's resource
        # sharer for one process to claim; a pool pickles it only in its workers' starts.
        return _receive_file, (reduction.DupFd(self._fd), self.size, self.by_value)

    def close(self) -> None:
        """Let go of the file here (each worker that has it keeps its own descriptor)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _in_memory_file(blob: memoryview) -> int:
    fd = os.memfd_create("aioloader-start", os.MFD_CLOEXEC)
    try:
        view = blob.cast("B")
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        os.close(fd)
        raise
    return fd


def _receive(blob: bytes, by_value: bool) -> Any:
    return received_start(blob, by_value=by_value)


def _receive_file(handle: Any, size: int, by_value: bool) -> Any:
    fd = handle.detach()  # this process's own descriptor of the file
    try:
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mapped, memoryview(mapped) as view:
            return received_start(view, by_value=by_value)
    finally:
        os.close(fd)
