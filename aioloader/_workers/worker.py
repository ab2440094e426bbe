"""The worker process side: who a worker is, how it is seeded, and its job loop.

Owns: :class:`WorkerInfo` and :func:`get_worker_info` (also answered by torch's own
``torch.utils.data.get_worker_info()`` inside a worker, so a torch user's dataset finds out who
it runs in without changing a line), the worker's copy of a blocking dataset (sent once, when the
worker starts, as torch does), the per-worker and per-batch seeding of ``random``, NumPy and
torch, and :func:`worker_main`, the loop a worker runs: receive a job (a function and its
arguments, pickled), run it, send the result back. Tensors in results travel through shared
memory (torch's reductions in ``ForkingPickler``), packed into one block first
(``_workers/pack.py``): only a handle crosses the pipe, its descriptor beside the message
(``fdpass.py``), as a job's tensors come. Never: touches
an event loop, opens network clients or imports user code it was not sent.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import multiprocessing.util
import os
import random
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch
import torch.multiprocessing  # registers torch's shared-memory reductions
import torch.utils.data

from . import failnote, fdpass
from .blocks import OutputBlocks
from .byvalue import dumps_reply, forget_received
from .descriptors import job_out_of_files
from .environ import ParentEnviron
from .fdpass import Passing
from .hangup import quiet_once_main_is_gone
from .pack import pack_tensors
from .rankinfo import stand_in
from .result import JobResult
from .startonce import Unreceived

__all__ = [
    "WorkerInfo",
    "become_worker",
    "call_job",
    "get_worker_info",
    "name_this_process",
    "seed_everything",
    "with_worker_note",
    "worker_dataset",
    "worker_main",
]


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """Who the current worker is.

    Attributes:
        id: The worker's index, ``0 <= id < num_workers``.
        num_workers: Workers in the pool.
        seed: This worker's seed (``random``, NumPy and torch were seeded with it at start;
            each batch's work is then seeded from the loader's seed, epoch and batch index).
        dataset: The worker's own copy of the loader's dataset when it is a blocking (torch)
            dataset that runs in the workers, or of an async dataset's reader for the workers
            (``AsyncDataset.for_workers``: a ``FileReader`` for ``sources.files``), else None
            (as torch's ``WorkerInfo.dataset``: ``worker_init_fn`` may configure it, e.g. give
            each worker its share of a stream).
    """

    id: int
    num_workers: int
    seed: int
    dataset: Any = None


_info: WorkerInfo | None = None
_where: str | None = None  # this worker, as the notes of its exceptions name it
_blocks = OutputBlocks()  # the blocks this worker writes results into, when the loader asks


def get_worker_info() -> WorkerInfo | None:
    """The :class:`WorkerInfo` of the worker process this runs in, or None in the main process
    (and in the loader's threads)."""
    return _info


def worker_dataset() -> Any:
    """The worker's copy of the loader's dataset.

    Raises:
        RuntimeError: Called outside a worker, or in a worker that was given no dataset.
    """
    if _info is None or _info.dataset is None:
        raise RuntimeError("no dataset lives in this process: it is not a loader's worker")
    return _info.dataset


def _tell_torch(info: WorkerInfo) -> None:
    """Make ``torch.utils.data.get_worker_info()`` answer inside this worker, as it does in
    torch's own: a torch user's dataset calls torch's function, not ours. torch keeps the
    answer in a module global with no public setter; a torch without it only loses this."""
    module = getattr(torch.utils.data, "_utils", None)
    worker = getattr(module, "worker", None)
    torch_info = getattr(worker, "WorkerInfo", None)
    if worker is None or torch_info is None:  # pragma: no cover - every torch we support has it
        return
    worker._worker_info = torch_info(
        id=info.id, num_workers=info.num_workers, seed=info.seed, dataset=info.dataset
    )


def seed_everything(seed: int) -> None:
    """Seed ``random``, NumPy's global generator and torch's default generator."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def with_worker_note(exc: BaseException) -> Exception:
    """``exc`` (or a stand-in, for a non-Exception or one that does not pickle) with a note
    naming this worker and carrying its traceback (``failnote.py``)."""
    return failnote.noted(exc, _where or f"pid {os.getpid()}")


def _prepare_failures(result: Any) -> Any:
    return failnote.prepare_failures(result, _where or f"pid {os.getpid()}")


def name_this_process(name: str) -> None:
    """Set this process's name as ``ps -o comm``, top and /proc show it (Linux, 15 bytes; best
    effort): a worker or the fork server should not look like a second copy of the app."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # PR_SET_NAME


_M_MMAP_THRESHOLD = -3  # mallopt's parameter (glibc's malloc.h)
# Bytes: blocks this large or larger get a mapping of their own. Not glibc's 128 KiB default:
# a decoded image's buffers (a few hundred KiB, every sample) then cost a mapping and its page
# faults each time (the CHANGELOG has the figures); the job messages and batches are MiBs.
MMAP_THRESHOLD = 1 << 20


def fix_mmap_threshold() -> None:
    """Keep glibc's malloc giving blocks of ``MMAP_THRESHOLD`` bytes or more their own mapping,
    returned to the system when freed (Linux with glibc; best effort; left alone where the
    user set ``MALLOC_MMAP_THRESHOLD_``): a job's raw samples, a pickled batch.

    By default glibc raises the threshold to the size of each mapped block freed, up to 32 MiB:
    once a worker has freed one job's raw samples or one pickled batch, the next ones come from
    the heap, which keeps its high-water mark (the CHANGELOG has the figures)."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    with contextlib.suppress(Exception):  # not glibc (musl has a mallopt that does nothing)
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def _exit_now() -> None:
    """Leave at once once the main process has hung up: an interpreter shutdown with torch
    loaded costs most of a second per worker. What the stdlib's own process would still do at
    its end is done: multiprocessing's finalizers, which remove the socket that handed batches'
    descriptors to the main process (and a temporary folder made here, if any)."""
    with contextlib.suppress(Exception):
        multiprocessing.util._run_finalizers()  # type: ignore[attr-defined]  # as Process does
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _send(conn: Connection, reply: tuple[memoryview, Passing]) -> None:
    try:
        fdpass.send(conn, *reply)  # the message, then its tensors' descriptors
    except OSError:  # the main process is gone (or stopped us): nobody is left to tell
        _exit_now()


def worker_main(
    conn: Connection,
    worker_id: int,
    num_workers: int,
    seed: int,
    environ: ParentEnviron | None,
    start: tuple[Callable[[int], object] | None, Any] | Unreceived,
    sharing_strategy: str | None = None,
    forked: frozenset[int] | None = None,
    ranked: tuple[int, int] | None = None,
) -> None:
    """Run in a worker process: set up, then serve jobs until the main process closes the pipe.

    Each job is ``(fn, args, batch_seed)``; the reply is ``(ok, value)``: the function's result,
    or the exception it raised (with the worker's traceback in a note). The loop ends at EOF:
    closing the pipe is the shutdown signal, so no control value shares the data path.

    ``environ``: the main process's environment variables, already this worker's (set as it
    was unpickled: :class:`ParentEnviron`), for a worker from a fork server; None otherwise.
    ``start`` is ``(worker_init_fn, dataset)``, or their pickle (:class:`Unreceived`), unpickled
    here (what that raises is sent back, as ``worker_init_fn``'s error is): ``dataset`` is this
    worker's copy of a blocking dataset (None when the dataset runs in the main process);
    ``worker_init_fn`` sees it in :func:`get_worker_info` and may change it.
    ``sharing_strategy`` is the main process's ``torch.multiprocessing`` sharing strategy as the
    worker started: the worker shares its tensors that way (a fork server started before the
    script set it would not know it).
    Ctrl-C is the main process's to handle: the worker ignores SIGINT (the main process stops
    it by closing the pipe), so an interrupted script prints one traceback, not one per worker.
    ``forked``: the worker is a fork of the main process, which blocked these signals as it
    forked; the worker drops the main process's handlers, then unblocks them.
    ``ranked``: the main process's ``(rank, world_size)`` where it has a process group, which
    ``torch.distributed`` answers with here (``rankinfo.py``).
    """
    if forked is not None:
        _drop_inherited_signal_handlers()
        forget_received()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if forked:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, forked)
    name_this_process(f"aioloader-w{worker_id}")
    quiet_once_main_is_gone()
    if sharing_strategy is not None:
        torch.multiprocessing.set_sharing_strategy(sharing_strategy)  # type: ignore[no-untyped-call]
    if ranked is not None:
        stand_in(*ranked)
    try:
        # A pickle of them for every worker starting now, or this worker's own (unpickled)
        given = _received(start, worker_id, conn) if isinstance(start, Unreceived) else start
        worker_init_fn, dataset = given
        become_worker(worker_id, num_workers, seed, dataset)
        if worker_init_fn is not None:
            worker_init_fn(worker_id)
    except BaseException as exc:
        _send(conn, dumps_reply((False, with_worker_note(exc))))
        return
    _send(conn, dumps_reply((True, os.getpid())))
    while True:
        try:
            job = conn.recv_bytes()
            fds = fdpass.descriptors(conn, fdpass.count(job))  # its tensors' (fdpass.py)
        except OSError as exc:
            if exc.errno != errno.EMFILE:
                _exit_now()
            # Out of descriptors: the job's were all read (and let go of), the pipe is in step
            _send(conn, dumps_reply((False, with_worker_note(job_out_of_files(fdpass.count(job))))))
            continue
        except EOFError:
            _exit_now()
        reply = _run_job(job, fds)
        del job  # nothing of a job (its raw samples) is kept while the next one is awaited
        _send(conn, reply)


def _received(start: Unreceived, worker_id: int, conn: Connection) -> Any:
    """The start arguments unpickled; what that raises (a ``__setstate__``'s error, a module
    this process cannot import) names the dataset and this worker."""
    try:
        return start.receive(conn)
    except BaseException as exc:
        exc.add_note(
            f"aioloader: raised in worker {worker_id} (pid {os.getpid()}) as it unpickled the "
            "dataset and worker_init_fn it was sent"
        )
        raise


def _drop_inherited_signal_handlers() -> None:
    """In a worker forked from the main process: its Python signal handlers back to the
    default, and its event loop's wake-up descriptor let go. Inherited, a SIGTERM sent to stop
    this worker would run the application's handler here and, through the wake-up descriptor
    (a socket shared with the main process), wake the main process's loop as if it had been
    signalled itself."""
    signal.set_wakeup_fd(-1)
    for signum in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):  # SIGKILL, SIGSTOP; 32 and 33 (glibc)
            if callable(signal.getsignal(signum)):
                signal.signal(signum, signal.SIG_DFL)


def become_worker(
    worker_id: int,
    num_workers: int,
    seed: int,
    dataset: Any,
    where: str | None = None,
    threads: int = 1,
) -> None:
    """Make this process worker ``worker_id`` of ``num_workers``: what
    :func:`get_worker_info` (and torch's) answer, ``threads`` intra-op threads, the mmap
    threshold, the worker's seed. ``where`` names the worker in the notes of the exceptions it
    sends back (default: its id and pid)."""
    global _info, _where
    _info = WorkerInfo(worker_id, num_workers, seed, dataset)
    _where = where or f"worker {worker_id} (pid {os.getpid()})"
    _tell_torch(_info)
    torch.set_num_threads(threads)  # N workers on N cores: more would oversubscribe
    fix_mmap_threshold()
    seed_everything(seed)


def call_job(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    batch_seed: int | None,
    finish: Callable[[Any], Any],
) -> tuple[bool, Any]:
    """``(True, finish(result))`` of ``fn(*args)``, seeded with ``batch_seed`` first, or
    ``(False, exception)`` with the worker's traceback in a note (picklable). ``finish``
    prepares the result for the way back (packing tensors for shared memory, say)."""
    if batch_seed is not None:
        seed_everything(batch_seed)
    try:
        return True, finish(_prepare_failures(fn(*args)))
    except BaseException as exc:
        return False, with_worker_note(exc)


def _into_blocks(result: Any) -> Any:
    """A job's batch written into one of this worker's blocks (``blocks.py``; nothing else of
    the result: a checkpoint mark or uncollated samples may be kept long after the batch),
    then what is left packed as usual."""
    if isinstance(result, JobResult) and result.batch is not None:
        result.batch = _blocks.write(result.batch)
    try:
        return pack_tensors(result)
    except BaseException:
        _blocks.unsent()  # the reply will say what failed: the block holds nothing sent
        raise


def _run_job(job: bytes, fds: list[int]) -> tuple[memoryview, Passing]:
    """One job, ``(fn, args, batch_seed, freed)`` pickled (``fds``: the descriptors that came
    with it): the reply, ``(ok, value)`` pickled. ``freed`` is None, or the keys of this
    worker's blocks the main process is done with: the result then goes into a block where it
    can (``blocks.py``)."""
    fn, args, batch_seed, freed = fdpass.loads(job, fds)
    if freed is not None:
        _blocks.free(freed)
    reply = call_job(fn, args, batch_seed, pack_tensors if freed is None else _into_blocks)
    del fn, args
    try:
        sent = dumps_reply(reply)
    except BaseException as exc:  # the result does not pickle
        _blocks.unsent()
        return dumps_reply((False, with_worker_note(exc)))
    _blocks.sent()
    return sent
