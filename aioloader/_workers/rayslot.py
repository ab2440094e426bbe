"""One Ray worker's slot as the pool sees it: its actor, and its calls not answered yet.

Owns: :class:`Actor` (the handle, what ``ready()`` told of it, whether it is alive) and the
bookkeeping of the calls in flight to it (two at once: ``RayPool.depth``): which one it was
running when it died, and when the last of them has been answered. Never: calls Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import anyio

from .._base.exceptions import WorkerCrashed
from .._base.recorders import WorkerRecorder

__all__ = ["Actor"]


@dataclass(eq=False, slots=True)
class Actor:
    """Worker ``id``'s actor.

    Attributes:
        handle: Ray's handle of it.
        pid, node: Its process and node (address and id), once it was ready.
        name: Its actor id (hex).
        alive: False once a call learnt of its death, or it was killed.
        killed: The pool killed it.
        calls: Its calls not answered yet, oldest first: the oldest runs, the others wait
            behind it (Ray runs an actor's calls in the order they were sent).
    """

    id: int
    handle: Any  # ray.actor.ActorHandle
    pid: int = 0
    name: str = "?"
    node: str = ""
    alive: bool = True
    killed: bool = False
    calls: list[object] = field(default_factory=list)
    _dead_seen: bool = False  # a call learnt of its death (and counted it)
    _ran: object = None  # then: the call it was running
    _settled: anyio.Event | None = None  # set as its last unanswered call is answered

    def dead(self) -> WorkerCrashed:
        """The error that names it, dead."""
        node = self.node or "not known (it was not ready yet)"
        return WorkerCrashed(self.id, self.pid, actor=self.name, node=node)

    def died(self, stats: WorkerRecorder) -> object:
        """The call it was running when it died (its oldest unanswered one, as the first of its
        calls learns of the death), the death counted once in ``stats``."""
        if not self._dead_seen:
            self._dead_seen = True
            self._ran = self.calls[0] if self.calls else None
            stats.crashes += 1
        return self._ran

    def let_go(self, ticket: object) -> None:
        """``ticket``'s call was answered (or given up)."""
        self.calls.remove(ticket)
        if not self.calls and self._settled is not None:
            self._settled.set()

    async def settle(self, most: float) -> None:
        """Until the calls it still had are answered (failed, or sent on to its replacement),
        so that its replacement gets its lane's batches in the epoch's order; at most ``most``
        seconds (an actor Ray called unreachable may still be running one: the replacement
        kills it then)."""
        if not self.calls:
            return
        if self._settled is None:
            self._settled = anyio.Event()
        with anyio.move_on_after(most):
            await self._settled.wait()
