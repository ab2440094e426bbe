"""Jobs queued on a worker process: the next job is sent while the worker runs the one before,
so the worker never waits for the main process between jobs.

A worker reads its pipe only between jobs, so a reply gets its next job at once where that job
already waits in the pipe; sent only once the reply is read, the job waits for the main
process's event loop thread, which shares the GIL with the training loop (on two loaded cores
the workers of a JPEG decode were idle 3-8% of the time so; torch's workers have their next
indices in their queue, ``prefetch_factor`` of them).

Owns: :class:`Turn` (a job sent: its reply is read after the reply to the job sent before it),
:func:`may_queue` (what may wait in a worker's pipe), :class:`Unstarted`. Never: sends or
reads (``processes.py`` does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio

__all__ = ["QUEUE_MOST", "Turn", "Unstarted", "may_queue"]

# Bytes of a job that may wait in a worker's pipe while it runs another. A larger job (or one
# that passes descriptors) waits until the worker has answered: it could fill the socket's
# buffer, and a blocking send would then hold the event loop until the worker reads it; worse,
# the worker, blocked sending a large reply to a main process blocked sending, never would.
QUEUE_MOST = 16 * 1024


def may_queue(size: int, descriptors: int) -> bool:
    """Whether a job of ``size`` bytes passing ``descriptors`` may wait in a busy worker's pipe."""
    return size <= QUEUE_MOST and descriptors == 0


class Unstarted(Exception):
    """The worker died before it answered a job sent before this one: it never started this
    one, which goes to its replacement."""


@dataclass(eq=False, slots=True)
class Turn:
    """A job sent to a worker. Its reply is read once the reply to ``before`` (the job sent
    just before it to that worker, None where none was waiting) has been."""

    before: Turn | None
    read: anyio.Event = field(default_factory=anyio.Event)  # its reply read, or never will be
    answered: bool = False  # a reply was read for it (not: the worker died first)

    @property
    def waiting(self) -> bool:
        """Its reply has not been read yet."""
        return not self.read.is_set()

    async def come(self) -> None:
        """Wait until the replies to the jobs sent before it have been read.

        Raises:
            Unstarted: The worker died before it answered the job before this one.

        Cancellation: the wait is withdrawn (the job is still in the worker's pipe).
        """
        before = self.before
        if before is None:
            return
        await before.read.wait()
        self.before = None
        if not before.answered:
            raise Unstarted

    def done(self, *, answered: bool) -> None:
        """Its reply has been read (``answered``), or never will be (its worker is dead)."""
        self.answered = answered
        self.read.set()
