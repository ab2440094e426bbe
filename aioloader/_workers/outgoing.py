"""A job on its way to a worker process: pickled for that worker, then sent or dropped.

Owns: :class:`Outgoing` (the job's pickle, the descriptors it passes, the blocks and the
values sent by value it carries) and :func:`pickle_job`. Never: decides when a job is sent
(``processes.py``), or reads a reply.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import fdpass
from .byvalue import MainRule, dumps_job
from .children import blocking
from .ledger import LEDGER
from .pack import pack_tensors
from .starting import Worker

__all__ = ["Job", "Outgoing", "pickle_job"]

Job = tuple[Callable[..., Any], tuple[Any, ...], Any]  # (fn, args, seed)


@dataclass(eq=False, slots=True)
class Outgoing:
    """``worker``'s job, pickled: ``freed`` the blocks it tells the worker it may reuse (None:
    no blocks), ``sending`` the tokens of the values it carries whole (the worker has them
    once it has run the job: a job sent before that carries them too)."""

    worker: Worker
    message: memoryview
    passing: fdpass.Passing
    freed: list[Any] | None
    sending: set[int]

    def send(self) -> int:
        """Send it (then, whatever happens, the message is released, the descriptors closed);
        returns its size in bytes.

        Raises:
            OSError: The worker is gone (it died while idle): the job never reached it.
            fdpass.Unsent: The job went, not all of its tensors' descriptors.
        """
        worker = self.worker
        blocking(worker.conn)
        # The message is a view of a BytesIO, released as it is sent (or not): not when a
        # traceback is collected (a frame that views it, left in a cycle, crashed 3.12.1's
        # gc: gh-111049). The refusal's own frames (send_bytes') view it too: it is dropped as
        # its handler ends, not kept as the context of what is raised. The tensors' descriptors
        # go with it; refused, they are closed here (the worker never had them).
        size = len(self.message)
        fdpass.send(worker.conn, self.message, self.passing)
        return size

    def drop(self) -> None:
        """Not sent: its blocks go with the worker's next job (where it lives)."""
        self.message.release()
        self.passing.close()
        if self.worker.alive:
            LEDGER.requeue(self.worker.pid, self.freed or [])


def pickle_job(worker: Worker, job: Job, *, blocks: bool, main_has: MainRule) -> Outgoing:
    """``job`` pickled for ``worker``: its tensors in shared memory, the blocks it may reuse
    (``blocks``), the values sent by value that it has not yet.

    Raises:
        Exception: Pickling the job failed (with a note naming the worker).
    """
    fn, args, seed = job
    # Its tensors in one block of its own (pack.py): not each moved to shared memory where
    # it is, which a dataset's cached sample (or the whole tensor a row of it is a view
    # of) would then stay, with a descriptor open
    args = pack_tensors(args, at_least=1, most=None, aliased=True)
    freed = LEDGER.freed(worker.pid) if blocks else None  # None: no blocks
    sending: set[int] = set()
    try:
        message, passing = dumps_job((fn, args, seed, freed), worker.has, sending, main_has)
    except BaseException as exc:
        LEDGER.requeue(worker.pid, freed or [])  # they go with the next job
        if isinstance(exc, Exception):  # pickle's own words vary by version (3.13's)
            exc.add_note(
                f"aioloader: raised as the job was pickled for worker {worker.id} "
                f"(pid {worker.pid}): what it carries must pickle (a lambda, a lock or an "
                "open file in a sample does not)"
            )
        raise
    return Outgoing(worker, message, passing, freed, sending)
