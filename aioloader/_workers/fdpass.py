"""Tensors' shared-memory descriptors passed along a worker's own pipe, with the message that
refers to them (``SCM_RIGHTS``), not through multiprocessing's resource sharer.

Why: torch's reductions (``ForkingPickler``'s) share a CPU tensor's storage as a descriptor,
handed to the resource sharer: a thread of the sending process that serves a Unix socket. The
receiver connects once per descriptor, both sides run an HMAC handshake, and the descriptor
crosses: 0.4 ms per storage, counted in both processes (64 tensors in a job took 26 ms to
pickle and unpickle). A descriptor nobody comes for stays open in the sharer, and the shared
memory with it, for as long as the process lives: each job sent to a worker that died before
it took the job left its tensors' memory behind in the main process. A receiver killed
mid-handshake made the sharer's thread print a traceback. A worker's pipe is a Unix socket
pair (``Pipe(duplex=True)``): a message's descriptors follow it on the same socket, all of
them in one ``sendmsg``; the kernel closes those nobody takes when the socket closes.

The wire: a message is ``send_bytes`` of a 4-byte count (little-endian) and the pickle, then,
when the count is not 0, that many descriptors in ``sendmsg`` calls of at most
:data:`PER_SENDMSG` each (one byte of data each). The pickle refers to a descriptor by its
index; the receiver takes them all before it unpickles, and closes those the pickle did not
take (torch's ``rebuild_storage_fd`` closes those it takes).

Owns: :class:`Passing` (the descriptors a pickle passes, and the reduction of a CPU storage
that collects them), :func:`buffer`, :func:`send`, :func:`loads` and :func:`descriptors`; a
worker's start's descriptors past what a fork server's start hands over (:func:`starting`,
:class:`Piped`, sent once the worker runs); waiting out the kernel's refusal of more in flight
(``ETOOMANYREFS``).
Never: decides what is pickled, or shares a storage another way than torch's ``file_descriptor``
strategy does (a storage torch would not share by descriptor goes torch's way: the
``file_system`` strategy, an empty storage, a CUDA storage's error).
"""

from __future__ import annotations

import array
import contextlib
import errno
import io
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing
from torch.multiprocessing import reductions

from .._base.tree import dense_parts

__all__ = [
    "HEADER",
    "PATIENCE",
    "PER_SENDMSG",
    "Passing",
    "Piped",
    "buffer",
    "count",
    "descriptors",
    "descriptors_of",
    "loads",
    "for_the_pipe",
    "send",
    "send_descriptors",
    "starting",
    "Unsent",
]

HEADER = 4  # bytes: the count of descriptors that follow the message
PER_SENDMSG = 250  # descriptors in one sendmsg (Linux takes at most 253: SCM_MAX_FD)
PATIENCE = 2.0  # seconds a send waits, in all, for the kernel to take more in flight


# torch's reduction of a storage: what a storage this module does not pass goes by
_torch_storage: Callable[[Any], Any] = reductions.reduce_storage


def buffer() -> io.BytesIO:
    """A buffer for a message's pickle, its header's place kept (:meth:`Passing.dump`)."""
    written = io.BytesIO()
    written.write(bytes(HEADER))
    return written


class Passing:
    """The descriptors a message passes, gathered as its pickle is written: a pickler given
    :meth:`reducers` shares each CPU storage as torch's ``file_descriptor`` strategy does and
    refers to its descriptor by index. The descriptors are the storages' own, valid while the
    storages live: this holds the storages until :meth:`close` (not duplicates: a dataset's
    thousand tensors would take two thousand descriptors as its workers start).

    Cancellation: none (nothing here awaits); :meth:`close` lets go of the storages.
    """

    __slots__ = ("_held", "fds")

    def __init__(self) -> None:
        self.fds: list[int] = []
        self._held: list[Any] = []  # the storages whose descriptors fds are

    def reducers(self) -> dict[type, Callable[[Any], Any]]:
        """For a pickler's ``dispatch_table``: each storage type torch shares, by this."""
        extra = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
        return {kind: self._storage for kind, how in extra.items() if how is _torch_storage}

    def _storage(self, storage: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        if (
            storage.device.type != "cpu"
            or storage.size() == 0
            or torch.multiprocessing.get_sharing_strategy() != "file_descriptor"  # type: ignore[no-untyped-call]
        ):
            return _torch_storage(storage)  # type: ignore[no-any-return]
        fd, size = storage._share_fd_cpu_()
        # As torch's reduction does: a storage this process gets back is this one
        held = reductions.StorageWeakRef(storage)  # type: ignore[no-untyped-call]
        reductions.shared_cache[reductions.fd_id(fd)] = held  # type: ignore[no-untyped-call]
        self.fds.append(fd)
        self._held.append(storage)
        return reductions.rebuild_storage_fd, (type(storage), _Passed(len(self.fds) - 1), size)

    def dumps(
        self, value: object, dispatch: dict[type, Callable[[Any], Any]] | None = None
    ) -> memoryview:
        """The message: ``value`` pickled as ``ForkingPickler`` does (with ``dispatch``'s
        reductions too), each CPU storage's descriptor passed by this.

        Raises:
            Exception: ``value`` does not pickle (the storages gathered are let go of).
        """
        written = buffer()
        pickler = ForkingPickler(written, pickle.HIGHEST_PROTOCOL)
        pickler.dispatch_table.update(dispatch or {})
        pickler.dispatch_table.update(self.reducers())
        return self.dump(pickler, written, value)

    def dump(self, pickler: pickle.Pickler, written: io.BytesIO, value: object) -> memoryview:
        """The message: ``value`` pickled by ``pickler`` (which writes to ``written``, from
        :func:`buffer`, and passes descriptors by this).

        Raises:
            Exception: ``value`` does not pickle (the storages gathered are let go of).
        """
        try:
            pickler.dump(value)
        except BaseException:
            self.close()
            raise
        message = written.getbuffer()
        message[:HEADER] = len(self.fds).to_bytes(HEADER, "little")  # the header: the count
        return message

    def handed(self) -> list[int]:
        """Duplicates of the descriptors, the caller's (to unpickle the message in this
        process, which closes them); the storages are let go of."""
        fds = [os.dup(fd) for fd in self.fds]
        self.close()
        return fds

    def close(self) -> None:
        """Let go of the storages (the descriptors sent are the receiver's own now)."""
        self.fds = []
        self._held = []


class _Passed:
    """In a pickle: the message's descriptor number ``index``."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[Callable[[int], Any], tuple[int]]:
        return _taken, (self.index,)


class _Taken:
    """What torch's ``rebuild_storage_fd`` detaches a descriptor from (it closes it)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def detach(self) -> int:
        return self.fd


_arrived = threading.local()  # .fds: the descriptors of the message this thread unpickles


def _taken(index: int) -> _Taken:
    fds: list[int] = _arrived.fds
    fd, fds[index] = fds[index], -1
    if fd < 0:
        raise pickle.UnpicklingError(f"descriptor {index} of the message was taken already")
    return _Taken(fd)


def loads(message: bytes | memoryview, fds: list[int]) -> Any:
    """Unpickle ``message`` (a header, then the pickle), given the descriptors that followed
    it; those it does not take are closed, whatever happens.

    Raises:
        Exception: What unpickling raises.
    """
    previous = getattr(_arrived, "fds", None)
    _arrived.fds = fds
    try:
        with memoryview(message) as whole, whole[HEADER:] as pickled:
            return pickle.loads(pickled)
    finally:
        _arrived.fds = previous
        for fd in fds:
            if fd >= 0:
                os.close(fd)


def count(message: bytes | memoryview) -> int:
    """How many descriptors follow ``message`` on its socket."""
    return int.from_bytes(message[:HEADER], "little")


def send(conn: Connection, message: memoryview, passing: Passing) -> None:
    """Send ``message`` down ``conn``, then ``passing``'s descriptors; ``message`` is
    released and ``passing`` closed, whatever happens.

    Raises:
        OSError: The other end is gone (nothing was sent).
        Unsent: The message was sent, its descriptors not all: the other end, waiting for
            them, cannot read on.
    """
    try:
        with message:
            conn.send_bytes(message)
        try:
            send_descriptors(conn, passing)
        except OSError as exc:
            raise Unsent(exc.errno, f"{len(passing.fds)} descriptors unsent: {exc}") from exc
    finally:
        passing.close()


class Unsent(OSError):
    """A message went, not all of its descriptors (:func:`send`)."""


def send_descriptors(conn: Connection, passing: Passing, *, patience: float = PATIENCE) -> None:
    """Send ``passing``'s descriptors down ``conn`` alone (for a message the other process
    has: a worker's start, :func:`starting`), each taken out of ``passing`` as it is sent: a
    call that raises can be made again for the rest. The kernel holds what was sent until
    the other end takes it, or closes. Where it refuses more in flight (``ETOOMANYREFS``: a
    user without ``CAP_SYS_RESOURCE`` may have, over all its processes, no more in flight than
    its open-file limit), the send waits (sleeps, 1 ms doubling) for up to ``patience``
    seconds in all for the other processes to take theirs.

    Raises:
        OSError: The other end is gone; or ``ETOOMANYREFS`` still, after ``patience``.
    """
    delay, waited = 0.001, 0.0
    with _socket_of(conn) as sock:
        while passing.fds:
            chunk = passing.fds[:PER_SENDMSG]
            try:
                socket.send_fds(sock, [b"\0"], chunk)
            except OSError as exc:
                if exc.errno != errno.ETOOMANYREFS or waited >= patience:
                    raise
                time.sleep(delay)
                waited, delay = waited + delay, min(delay * 2, 0.25)
                continue
            del passing.fds[: len(chunk)]


@contextlib.contextmanager
def starting(passing: Passing) -> Iterator[None]:
    """While a worker's process starts in this thread: what its start pickles for the
    worker's pipe gathers its storages' descriptors in ``passing`` (:func:`for_the_pipe`),
    to be sent down the pipe once the process has started (:func:`send_descriptors`). A
    process start hands over at most 252 descriptors through a fork server: a dataset that
    holds 1,000 tensors could not start its workers."""
    previous = getattr(_starting, "passing", None)
    _starting.passing = passing
    try:
        yield
    finally:
        _starting.passing = previous


_starting = threading.local()  # .passing: the start being pickled in this thread


def _forget_the_start() -> None:
    _starting.passing = None  # a fork made while a start was pickled: not this process's


os.register_at_fork(after_in_child=_forget_the_start)


class Piped:
    """A pickle sent to a process as it starts, its storages' descriptors down its pipe once
    it runs (:func:`starting`): unpickled there by :meth:`received`."""

    __slots__ = ("message",)

    def __init__(self, message: bytes) -> None:
        self.message = message

    def received(self, conn: Connection) -> Any:
        """Unpickled, with the descriptors taken from ``conn``.

        Raises:
            EOFError: The other end closed before they came.
            Exception: What unpickling raises.
        """
        return loads(self.message, descriptors(conn, count(self.message)))


def descriptors_of(value: object) -> int:
    """How many descriptors a process's start hands over for ``value``, at most: a sparse
    tensor's are its indices' and values' (a compressed one's, three), a nested tensor's its
    buffer's and its sizes', strides' and offsets' (four), a tensor's or a socket's one."""
    if not isinstance(value, torch.Tensor):
        return 1
    return 4 if value.is_nested else len(dense_parts(value))


def for_the_pipe() -> Passing | None:
    """The :class:`Passing` of the worker start being pickled in this thread, if any."""
    return getattr(_starting, "passing", None)


def descriptors(conn: Connection, expected: int) -> list[int]:
    """The ``expected`` descriptors that follow a message just read from ``conn``.

    Raises:
        EOFError: The other end closed before they came.
        OSError: ``EMFILE``: this process could not take them all (none is kept); or the
            socket's own error.
    """
    fds: list[int] = []
    if not expected:
        return fds
    truncated = False
    try:
        with _socket_of(conn) as sock:
            while len(fds) < expected:
                chunk = min(PER_SENDMSG, expected - len(fds))
                got = _received_fds(sock, chunk)
                if got is None:
                    raise EOFError("the other end closed before the message's descriptors came")
                fds += got
                if len(got) < chunk:  # the kernel dropped the rest: this process is out
                    truncated = True
                    fds += [-1] * (chunk - len(got))
        if truncated:
            raise OSError(errno.EMFILE, "the message's descriptors did not all fit")
    except BaseException:
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        raise
    return fds


def _received_fds(sock: socket.socket, most: int) -> list[int] | None:
    """One ``sendmsg``'s descriptors (up to ``most``), close-on-exec (``socket.recv_fds``
    drops the flag), or None at the end of the stream; fewer where the kernel truncated."""
    space = socket.CMSG_SPACE(most * _INT.itemsize)
    data, ancillary, _, _ = sock.recvmsg(1, space, socket.MSG_CMSG_CLOEXEC)
    if not data and not ancillary:
        return None
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return list(fds)


_INT = array.array("i")


@contextlib.contextmanager
def _socket_of(conn: Connection) -> Iterator[socket.socket]:
    """A socket object over ``conn``'s descriptor, blocking while it is used (one made where
    ``socket.setdefaulttimeout`` was called would be made non-blocking: a worker's next read
    of its pipe then failed), the descriptor's mode as it was afterwards."""
    fd = conn.fileno()
    was = os.get_blocking(fd)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0, fd)
    try:
        sock.settimeout(None)
        yield sock
    finally:
        sock.detach()  # the descriptor is conn's
        os.set_blocking(fd, was)
